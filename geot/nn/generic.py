"""Any PyG ``MessagePassing`` layer whose message geot understands, on geot.

A layer's ``forward`` calls ``self.propagate(edge_index, x=..., ...)``;
PyG's propagate gathers the per-edge messages ``message(x_j, ...)`` into an
[E, F] tensor and scatters them. Where ``message`` is ``x_j`` or a per-edge
weight times ``x_j`` (``w.view(-1, 1) * x_j``: APPNP, SGConv, TAGConv,
GraphConv, ChebConv, LGConv, SimpleConv, ClusterGCNConv, and many layers
people write), and the aggregation is sum, mean, max or min, the
propagation is one fused gather-reduce of geot instead, with no [E, F]
messages. The message is read with ``torch.fx`` (traced with and without
its per-edge argument), once per layer class. Everything else (other
messages, an ``update`` or ``aggregate`` of the layer's own, sparse
adjacencies, hooks, explain mode, decomposed layers) runs PyG's propagate.
Rows are [N, F], static graphs' [B, N, F] (PyG's default node_dim) or
[N, H, C] with a weight per edge and head (node_dim 0); the output is
laid out as PyG's (contiguous).
:func:`explain` says which a layer gets and why.
"""
import functools
import inspect
import operator
from typing import Dict, NamedTuple, Optional

import torch
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .common import REDUCE, gather_reduce, gather_reduce_nodes
from .graph import sorted_graph
from .inputs import input_kind
from .layer import GeotLayer, pyg_base

_MessagePassing = pyg_nn.MessagePassing


class MessagePlan(NamedTuple):
    """What a layer's message is, per call: read from ``message`` once per class."""
    source: Optional[str]   # the node input the message gathers (``x`` for ``x_j``); None: not understood
    weight: Optional[str]   # the per-edge argument that scales it, if any
    plain: Optional[str]    # why the message without that argument (None passed) is not understood, or None
    weighted: Optional[str]  # why the message with it is not understood, or None


class GeotPropagate(GeotLayer):
    """Mixin of the generic geot layers (made by :func:`geot_class`): ``propagate`` on geot where it can."""

    _aggregations = tuple(REDUCE)
    _geot_base: type  # the layer class it extends

    def __reduce_ex__(self, protocol):
        # A class geot_class made has no module attribute to be pickled by:
        # pickled by its PyG base instead, and made again when loaded.
        reduced = super().__reduce_ex__(protocol)
        if type(self) is not _classes.get(self._geot_base):
            return reduced
        return (_made_instance, (self._geot_base,)) + tuple(reduced[2:])

    def _geot_init(self) -> None:
        super()._geot_init()
        message_plan(self._geot_base)  # read now: torch.compile cannot trace the reading (a first call compiled)

    def propagate(self, edge_index, size=None, **kwargs) -> Tensor:
        reason = self._propagate_reason(edge_index, size, kwargs)
        if reason is not None:
            self._warn_fallback(reason, "propagate")
            return super().propagate(edge_index, size=size, **kwargs)
        plan = message_plan(self._geot_base)
        size = _call_size(edge_index, size, self._flipped())
        x_src, x_dst = _sources_and_targets(kwargs[plan.source])
        weight = None if plan.weight is None else kwargs.get(plan.weight)
        graph, weight = self._graph_and_weight(edge_index, weight)
        static = _static(x_src, self)
        reduce_rows = gather_reduce_nodes if static else gather_reduce
        return reduce_rows(graph, x_src, REDUCE[self.aggr], _num_targets(x_src, x_dst, size, static), weight)

    def _graph_and_weight(self, edge_index, weight: Optional[Tensor]):
        """The sorted graph and the edge weights in its order. Compiled, a later propagate of the same
        forward on the same tensors takes the first one's (compiled code keeps no graph made inside it,
        and inference graphs get no common-subexpression pass: K propagations would sort K times)."""
        any_order = REDUCE[self.aggr] in ("sum", "mean")
        traced = self.__dict__.get("_geot_traced") if torch.compiler.is_compiling() else None
        for seen_edges, seen_weight, flipped, seen_order, graph, ordered_weight in traced or ():
            if seen_edges is edge_index and seen_weight is weight and flipped == self._flipped() \
                    and seen_order == any_order:
                return graph, ordered_weight
        graph = sorted_graph(self, edge_index, flipped=self._flipped(), any_order=any_order)
        ordered_weight = None if weight is None else graph.edge_values(weight)
        if traced is not None:
            traced.append((edge_index, weight, self._flipped(), any_order, graph, ordered_weight))
        return graph, ordered_weight

    def _propagate_reason(self, edge_index, size, kwargs) -> Optional[str]:
        """Why this propagate call runs PyG's, or None."""
        reason = self._option_reason() or _class_reason(self._geot_base)
        if reason is not None:
            return reason
        if self.decomposed_layers != 1:  # (PyG's propagate is then the instance's own: not called)
            return "decomposed layers"
        if input_kind(edge_index) != "edge_index":
            return "a sparse adjacency (PyG's propagate multiplies it)"
        plan = message_plan(self._geot_base)
        weighted = plan.weight is not None and kwargs.get(plan.weight) is not None
        why = plan.weighted if weighted else plan.plain
        if why is not None:
            return why
        return _inputs_reason(kwargs.get(plan.source), kwargs.get(plan.weight) if weighted else None, edge_index,
                              _call_size(edge_index, size, self._flipped()), self)


def _inputs_reason(x, weight, edge_index, size, layer) -> Optional[str]:
    if isinstance(x, (tuple, list)) and len(x) != 2:
        return "x of this kind"
    if isinstance(x, (tuple, list)) and layer._flipped() and x[0] is not x[1]:
        # PyG's generated collect gathers x[0] there (its own _collect x[1]) and sizes the output by it.
        return "flow='target_to_source' with an (x_src, x_dst) pair"
    x_src, x_dst = _sources_and_targets(x)
    tensors = [x_src] + ([] if x_dst is None else [x_dst])
    if not all(isinstance(t, Tensor) and t.dim() in (2, 3) and t.is_floating_point() for t in tensors):
        return "x of this kind (geot takes [N, F], [N, H, C] or static [B, N, F] float rows)"
    static = _static(x_src, layer)
    if layer.node_dim not in (0, -x_src.dim()) and not static:
        return f"node_dim={layer.node_dim}"
    if any(t.dim() != x_src.dim() for t in tensors):
        return "x_src and x_dst of different ranks"
    if weight is not None and _weight_shape(x_src, edge_index.size(-1), static) != tuple(weight.shape):
        return "a per-edge argument of this shape"
    if size is not None and size[0] is not None and size[0] != x_src.size(-2 if static else 0):
        return "a size that disagrees with x"
    return None


def _static(x: Tensor, layer) -> bool:
    """Whether x is a static graph's [B, N, F] (node_dim -2 of 3-D rows: one graph for every batch entry)
    rather than [N, H, C] rows (node_dim 0)."""
    return x.dim() == 3 and layer.node_dim in (-2, 1)


def _weight_shape(x: Tensor, num_edges: int, static: bool) -> tuple:
    """The per-edge weight's shape geot takes with x: [E] for [N, F] and static [B, N, F] rows, [E, H] for
    [N, H, C] (a weight per head, as the message's ``alpha.unsqueeze(-1) * x_j`` reads it)."""
    return (num_edges,) if x.dim() == 2 or static else (num_edges, x.size(1))


def _sources_and_targets(x):
    """(x_src, x_dst or None) of a node input (a pair's first part is gathered)."""
    if not isinstance(x, (tuple, list)):
        return x, None
    return x[0], x[1]


def _call_size(edge_index, size, flipped: bool):
    """(sources, destinations): size as given, or an EdgeIndex's sparse size (PyG reads it there too),
    swapped with flow="target_to_source" (its rows are then the destinations)."""
    if size is None and hasattr(edge_index, "sparse_size"):
        size = edge_index.sparse_size()
    return None if size is None else (size[1], size[0]) if flipped else tuple(size)


def _num_targets(x_src: Tensor, x_dst: Optional[Tensor], size, static: bool) -> int:
    """Output rows, as PyG's propagate counts them."""
    if size is not None and size[1] is not None:
        return int(size[1])
    return (x_dst if x_dst is not None else x_src).size(-2 if static else 0)


def _class_reason(layer_class: type) -> Optional[str]:
    """Why no layer of this class propagates on geot, or None."""
    for name in ("aggregate", "update"):
        if getattr(layer_class, name) is not getattr(_MessagePassing, name):
            return f"an {name}() of its own"
    plan = message_plan(layer_class)
    return None if plan.source is not None else plan.plain


# Reading the message --------------------------------------------------------------------------------------

_plans: Dict[type, MessagePlan] = {}


def message_plan(layer_class: type) -> MessagePlan:
    """The layer class's message, read once."""
    plan = _plans.get(layer_class)
    if plan is None:
        plan = _plans[layer_class] = _read_message(layer_class)
    return plan


def _read_message(layer_class: type) -> MessagePlan:
    message = layer_class.message
    if message is _MessagePassing.message:
        return MessagePlan("x", None, None, None)
    names = [p for p in inspect.signature(message).parameters][1:]
    sources = [n for n in names if n.endswith("_j")]
    others = [n for n in names if not n.endswith("_j")]
    if len(sources) != 1 or len(others) > 1 or any(n.endswith("_i") for n in others):
        return MessagePlan(None, None, f"a message of ({', '.join(names)})", None)
    source, weight = sources[0], others[0] if others else None
    plain = _traced_kind(message, names, source, weight, weighted=False)
    weighted = None if weight is None else _traced_kind(message, names, source, weight, weighted=True)
    plain_reason = None if plain == "plain" else f"its message ({plain})"
    weighted_reason = None if weighted == "weighted" else f"its message ({weighted})"
    if plain_reason is not None and weighted_reason is not None:
        return MessagePlan(None, None, plain_reason, weighted_reason)
    return MessagePlan(source[:-2], weight, plain_reason, weighted_reason)


def _traced_kind(message, names, source: str, weight: Optional[str], weighted: bool) -> str:
    """'plain' (x_j), 'weighted' (w.view(-1, 1) * x_j) or what the traced message is instead."""
    # A function of the message's own arguments (fx names its placeholders after them); the patterns read no
    # attribute of the layer, so self is None.
    namespace = {"message": message}
    exec(f"def call({', '.join(names)}):\n    return message(None, {', '.join(names)})", namespace)
    concrete = {} if weighted or weight is None else {weight: None}
    try:
        graph = torch.fx.symbolic_trace(namespace["call"], concrete_args=concrete).graph
    except Exception as error:  # reads the layer, branches on values, ...: not a pattern of geot's
        return f"not traceable: {type(error).__name__}"
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    result = next(node for node in graph.nodes if node.op == "output").args[0]
    x_j = placeholders.get(source)
    if result is x_j:
        return "plain"
    if weighted and _is_scaled(result, x_j, placeholders.get(weight)):
        return "weighted"
    return "another computation"


def _is_scaled(node, x_j, weight) -> bool:
    """node is weight (one value per edge, as a column) times x_j."""
    if node is None or x_j is None or weight is None or node.op != "call_function":
        return False
    if node.target not in (operator.mul, torch.mul) or len(node.args) != 2 or node.kwargs:
        return False
    a, b = node.args
    column = b if a is x_j else a if b is x_j else None
    return column is not None and _is_column(column, weight)  # its shape is checked per call


def _is_column(node, weight) -> bool:
    """node is weight.view(-1, 1), .reshape(-1, 1), .unsqueeze(-1 or 1) or weight[:, None]."""
    if not hasattr(node, "op") or not node.args or node.args[0] is not weight:
        return False
    args = tuple(node.args[1:])
    if node.op == "call_method" and node.target in ("view", "reshape"):
        return args in (((-1, 1),), (-1, 1))
    if node.op == "call_method" and node.target == "unsqueeze":
        return args in ((-1,), (1,))
    if node.op == "call_function" and node.target is operator.getitem:
        return args == ((slice(None), None),)
    return False


# Layers ---------------------------------------------------------------------------------------------------

def propagates_on_geot(module: torch.nn.Module) -> bool:
    """Whether geot's propagate serves some calls of this module (a MessagePassing layer not yet geot's)."""
    return (isinstance(module, _MessagePassing) and not isinstance(module, GeotLayer)
            and _class_reason(type(module)) is None)


_classes: Dict[type, type] = {}


def with_trace_memo(base_forward):
    """A layer's forward (its signature kept); inside torch.compile with the memo of the graphs its
    propagate calls sort (GeotPropagate._graph_and_weight; e.g. a subclass of APPNP: one graph made inside
    forward by gcn_norm, propagated K times; geot's own APPNP, SGConv, ... keep it, geot.nn.propagations).
    No try/finally: dynamo runs a frame whose try block breaks the graph (gcn_norm's boolean masks, under
    fullgraph=False) eagerly, which would leave the frames after the break without the memo (a sort per
    propagation). A call that raises leaves the list until the next compiled call replaces it."""
    @functools.wraps(base_forward)
    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return base_forward(self, *args, **kwargs)
        self._geot_traced = []
        out = base_forward(self, *args, **kwargs)
        del self._geot_traced
        return out
    return forward


def _made_instance(layer_class: type):
    """An empty instance of geot_class(layer_class), for pickle to set the state of."""
    made = geot_class(layer_class)
    return made.__new__(made)


def geot_class(layer_class: type) -> type:
    """The geot version of a MessagePassing class: the class with geot's propagate."""
    made = _classes.get(layer_class)
    if made is None:
        made = type(layer_class.__name__, (GeotPropagate, layer_class),
                    {"__module__": __name__, "__doc__": layer_class.__doc__, "_geot_base": layer_class,
                     "forward": with_trace_memo(layer_class.forward)})
        _classes[layer_class] = made
    return made


def explain(module: torch.nn.Module) -> str:
    """Whether geot runs a layer's propagation (after :func:`geot.nn.patch`), and why not; for a model,
    one line per MessagePassing layer it holds, by name."""
    if isinstance(module, _MessagePassing):
        return _explain_layer(module)
    lines = [f"{name}: {_explain_layer(m)}" for name, m in module.named_modules() if isinstance(m, _MessagePassing)]
    return "\n".join(lines) if lines else f"{type(module).__name__} holds no MessagePassing layer"


def _explain_layer(layer) -> str:
    base = pyg_base(type(layer)) if isinstance(layer, GeotLayer) else type(layer)
    name = base.__name__
    if isinstance(layer, GeotLayer) and not isinstance(layer, GeotPropagate):
        reason = layer.unsupported_options()
        return f"{name}: geot's layer" + ("" if reason is None else f", which runs PyG's forward for {reason}")
    reason = _class_reason(base)
    if reason is None and isinstance(layer.aggr, str) and layer.aggr not in REDUCE:
        reason = f"aggr={layer.aggr!r}"
    if reason is not None:
        return f"{name}: PyG's propagate, for {reason}"
    plan = message_plan(base)
    kinds = [k for k, why in (("x_j", plan.plain), (f"{plan.weight} * x_j", plan.weighted)) if why is None]
    return f"{name}: geot's fused gather-reduce for a message of {' or '.join(kinds)} ({layer.aggr})"
