"""What geot's PyG layers share: the per-layer graph slots, and PyG's own
forward for the calls geot does not run.

A geot layer subclasses the PyG layer and overrides ``forward`` only. Each
call first asks the layer's ``_call_reason`` whether geot runs it (from the
layer's options at call time, :meth:`GeotLayer._option_reason`, and the
call's inputs); where it does not, the call runs PyG's own forward on the
same module (same parameters),
with one :class:`GeotFallbackWarning` per layer and reason. So a geot layer
takes every input and option PyG's layer takes: geot's kernels where they
apply, PyG's result otherwise. ``torch.jit.script`` scripts PyG's layer with
the same parameters (geot's forward is not TorchScript).
"""
import inspect
import warnings
from typing import Optional

import torch
import torch_geometric.nn as pyg_nn
from torch_geometric.inspector import Inspector

from .common import flipped_pair_reason, has_module_hooks, nodes_reason, num_targets, sizes_reason
from .graph import sorted_graph, warn_at_trace_time
from .inputs import edges_of, input_kind


class GeotFallbackWarning(UserWarning):
    """A geot.nn layer ran PyG's own forward for a call: an option or input
    geot does not run on its kernels. The result is PyG's. Turn it into an
    error with ``warnings.simplefilter("error", GeotFallbackWarning)``."""


# Per-call hooks of MessagePassing: a layer that has any runs PyG's propagate, which calls them.
_HOOK_DICTS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks", "_message_forward_pre_hooks",
               "_message_forward_hooks", "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
               "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
               "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks")


def _in_onnx_export() -> bool:
    """torch.onnx.is_in_onnx_export(), asked only while exporting or tracing (where an ONNX export runs
    the model): the question itself costs 2 us a call."""
    return (torch.compiler.is_exporting() or torch.jit.is_tracing()) and torch.onnx.is_in_onnx_export()


def pyg_base(layer_class: type) -> type:
    """The PyG layer class a geot layer class derives from (for a generic
    one, the class it extends: PyG's or the user's)."""
    if getattr(layer_class, "_geot_base", None) is not None:
        return layer_class._geot_base
    for base in layer_class.__mro__:
        if base.__module__.startswith("torch_geometric."):
            return base
    raise TypeError(f"{layer_class.__name__} derives from no torch_geometric layer")


def _parameters(function) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


# The arguments of propagate / edge_updater that MessagePassing's templates
# leave out of their signature (MessagePassing._get_propagate_signature).
_CALL_EXCLUDED = [0, "edge_index", "size"]


def _pyg_call_arguments(base: type, method: str) -> Optional[dict]:
    """{argument: type} of what PyG's layer ``base`` passes to ``method``
    (its ``# <method>_type: (...)`` annotation, else the call in its
    forward's source), as ``torch_geometric.inspector.Inspector`` reads
    them for MessagePassing ({} where forward makes no such call); None
    where PyG's Inspector cannot read them either."""
    try:
        params = Inspector(base).get_params_from_method_call(method, exclude=_CALL_EXCLUDED)
    except (OSError, TypeError, ValueError):
        return None
    return {name: param.type_repr for name, param in params.items()}


def _mirror_pyg_introspection(cls: type) -> None:
    """Makes what introspection reads of geot's layer class ``cls`` PyG's:
    the docstring starts with PyG's (the paper, the options; geot's notes
    follow), ``forward``'s signature is PyG's annotated one where the
    parameters are the same, ``__init__`` unwraps to PyG's constructor
    (its signature and source), and the arguments PyG's forward passes to
    ``propagate`` and ``edge_updater`` are ``propagate_type`` /
    ``edge_updater_type`` class attributes (PyG's ``Inspector`` reads them
    from a source annotation or the call in forward, which geot's forward
    does not make). PyG's cheatsheet
    (``torch_geometric.nn.conv.utils``), its ``Inspector`` and users' code
    read these to tell what a layer supports."""
    try:
        base = pyg_base(cls)
    except TypeError:
        return  # a mixin of several layers
    own_doc = cls.__dict__.get("__doc__")
    if base.__doc__ and own_doc != base.__doc__:
        notes = "" if not own_doc else "\n\ngeot: " + inspect.cleandoc(own_doc)
        cls.__doc__ = inspect.cleandoc(base.__doc__) + notes
    forward = cls.__dict__.get("forward")
    if forward is not None and _parameters(forward) == _parameters(base.forward):
        forward.__signature__ = inspect.signature(base.forward)
    for method in ("propagate", "edge_updater"):
        arguments = _pyg_call_arguments(base, method)
        if arguments is not None and f"{method}_type" not in cls.__dict__:
            setattr(cls, f"{method}_type", arguments)
    if "__init__" not in cls.__dict__:
        def __init__(self, *args, **kwargs):
            GeotLayer.__init__(self, *args, **kwargs)

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__wrapped__ = base.__init__
        cls.__init__ = __init__


def _inspector(layer) -> Inspector:
    """PyG's Inspector of a layer's class, as MessagePassing.__init__ makes it."""
    inspector = Inspector(type(layer))
    inspector.inspect_signature(layer.message)
    inspector.inspect_signature(layer.aggregate, exclude=[0, "aggr"])
    inspector.inspect_signature(layer.message_and_aggregate, [0])
    inspector.inspect_signature(layer.update, exclude=[0])
    inspector.inspect_signature(layer.edge_update)
    return inspector


class _InstanceMethod:
    """A method that the class itself does not have: torch.package calls
    ``__reduce_package__`` on any object that has one, the layer classes
    (pickled by reference) included."""

    def __init__(self, function):
        self.function = function

    def __get__(self, instance, owner=None):
        if instance is None:
            raise AttributeError(self.function.__name__)
        return self.function.__get__(instance, owner)


# The float options PyG's layers read in their forward (by class; see compile_constant).
COMPILE_CONSTANTS = {
    "GATConv": ("negative_slope", "dropout"),
    "GATv2Conv": ("negative_slope", "dropout"),
    "RGATConv": ("negative_slope", "dropout"),
    "TransformerConv": ("dropout",),
    "APPNP": ("alpha", "dropout"),
    "ClusterGCNConv": ("diag_lambda",),
}


def compile_constant(name: str) -> property:
    """A float option of a layer, held as its repr. torch.compile(dynamic=True)
    makes a module's float a symbolic float, passed as a CPU scalar tensor:
    dynamo traces the model again where an op cannot take one, and inductor
    builds a C++ kernel for its casts (on a fresh H200 machine a 2-layer
    GATConv's first training step took 65 s so, 12.9 s with every float
    specialized by torch._dynamo.config.specialize_float). A string is a
    constant guarded on its value, and so is float() of it: the compiled
    graph holds the option as a number, and a new value recompiles. Values
    other than floats are kept as they are. Until _geot_init (a PyG layer
    being patched) the option is read from the layer's own attribute."""
    key = f"_geot_option_{name}"

    def get(self):
        held = self.__dict__
        if key in held:
            value = held[key]
            return float(value) if isinstance(value, str) else value
        if name in held:
            return held[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def set(self, value):
        self.__dict__.pop(name, None)
        self.__dict__[key] = repr(value) if type(value) is float else value

    return property(get, set, doc=f"PyG's ``{name}`` option (held for torch.compile: see compile_constant)")


def _compile_constants(cls: type) -> tuple:
    """The options of COMPILE_CONSTANTS that geot's layer class cls holds:
    those of the PyG class it extends (none for a user's subclass, whose
    attributes of those names may be anything)."""
    extended = getattr(cls, "_geot_base", None)  # a generic layer's
    if extended is None:
        try:
            extended = pyg_base(cls)
        except TypeError:  # a mixin (GeotPropagate)
            return ()
    return COMPILE_CONSTANTS.get(extended.__name__, ()) if extended.__module__.startswith("torch_geometric.") else ()


class GeotLayer:
    """Mixin of the geot layers (listed first among the bases)."""

    _geot_options: tuple = ()  # the options held by compile_constant

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("geot."):  # not users' subclasses
            _mirror_pyg_introspection(cls)
            cls._geot_options = _compile_constants(cls)
            for name in cls._geot_options:
                setattr(cls, name, compile_constant(name))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the PyG layer's constructor
        self._geot_init()

    def _geot_init(self) -> None:
        # The last graph of each variant the layer saw is kept in an attribute of its own (see
        # geot.nn.graph); _geot_graph: the last one stored, (edge tensor, edge_type, variant, SortedGraph,
        # version key).
        self._geot_graph = None
        self._geot_warned = set()
        for name in self._geot_options:  # a patched or unpickled PyG layer's own attribute
            if name in self.__dict__:
                setattr(self, name, self.__dict__.pop(name))

    def _plain_options(self) -> dict:
        """The options held by compile_constant, by name, as PyG's layer holds them."""
        return {name: getattr(self, name) for name in self._geot_options}

    def unsupported_options(self) -> Optional[str]:
        """Why the layer's options keep every call on PyG's forward, or None."""
        return self._option_reason()

    # What subclasses define -------------------------------------------------------------------

    _aggregations = ("add", "sum")  # the aggr strings geot runs

    def _option_reason(self) -> Optional[str]:
        """Why the layer's current options, hooks or the call's context (an ONNX export, torch.func
        transforms) run PyG's forward, or None (extended by layers)."""
        if not isinstance(self.aggr, str) or self.aggr not in self._aggregations:
            return f"aggr={self.aggr!r} (geot runs {', '.join(map(repr, self._aggregations))})"
        if self.explain:
            return "explain mode"
        if any(getattr(self, name) for name in _HOOK_DICTS):
            return "message-passing hooks"
        if has_module_hooks(getattr(self, "aggr_module", None)):
            return "hooks on aggr_module (geot's kernels do not call it)"
        if _in_onnx_export():
            return "ONNX export (geot's ops have no ONNX form)"
        if torch._C._are_functorch_transforms_active():
            return "torch.func transforms (geot's ops have no functorch rules)"
        return None

    # Calls --------------------------------------------------------------------------------------

    def _input_reason(self, edge_index) -> Optional[str]:
        """Why this graph input runs PyG's forward, or None."""
        kind = input_kind(edge_index)
        if kind is None:
            return f"edge_index of type {type(edge_index).__name__}"
        if kind != "edge_index" and self.flow != "source_to_target":
            return f"flow={self.flow!r} with a sparse adjacency"
        if kind == "torch.sparse" and edge_index.dim() != 2:
            return "a sparse adjacency that is not 2-D"
        return None

    def _pair_call_reason(self, nodes, edge_index, size) -> Optional[str]:
        """Why a call of a layer taking x or (x_src, x_dst) with size runs PyG's forward, or None."""
        reason = self._option_reason() or self._input_reason(edge_index) or nodes_reason(nodes, self.node_dim)
        if reason is not None:
            return reason
        edges = edges_of(edge_index)
        return sizes_reason(nodes, edges, size) or flipped_pair_reason(nodes, edges, size, self._flipped())

    def _aggregation_graph(self, nodes, edge_index, size, any_order: bool = False):
        """(sorted graph, output rows, per-edge weights in graph order or None)
        of a call: a torch.sparse adjacency's values weight the aggregation,
        as in PyG's spmm (a SparseTensor's are dropped, as PyG does)."""
        edges = edges_of(edge_index)
        graph = sorted_graph(self, edge_index, flipped=self._flipped(), any_order=any_order)
        weight = graph.edge_values(edges.weights) if edges.kind == "torch.sparse" else None
        return graph, num_targets(nodes, edges, size, graph), weight

    def _pyg_forward(self, reason: str, *args, **kwargs):
        """PyG's forward for this call, warning once per layer and reason."""
        self._warn_fallback(reason)
        return pyg_base(type(self)).forward(self, *args, **kwargs)

    def _warn_fallback(self, reason: str, what: str = "forward") -> None:
        message = f"geot.nn.{type(self).__name__} runs PyG's {what} for {reason}"
        if torch.compiler.is_compiling():
            warn_at_trace_time(message, GeotFallbackWarning)
        elif reason not in self._geot_warned:
            self._geot_warned.add(reason)
            warnings.warn(message, GeotFallbackWarning, stacklevel=3)

    def _flipped(self) -> bool:
        return self.flow == "target_to_source"

    def _set_jittable_templates(self, raise_on_error: bool = False) -> None:
        """PyG generates a ``propagate`` per layer class from the source of
        its forward; geot's forward calls none, so the layer inherits the one
        of its PyG class (generated here if no PyG instance was made yet)."""
        base = pyg_base(type(self))
        if "_jinja_propagate" in base.__dict__:
            return
        own_class, own_inspector = self.__class__, self.inspector
        self.__class__ = base
        self.inspector = _inspector(self)
        try:
            pyg_nn.MessagePassing._set_jittable_templates(self, raise_on_error)
        finally:
            self.__class__, self.inspector = own_class, own_inspector

    def __prepare_scriptable__(self):
        """torch.jit.script scripts PyG's layer, sharing this one's parameters."""
        return self._as_pyg_layer()

    def _as_pyg_layer(self):
        """PyG's layer with this one's parameters, submodules and options (shared, not copied)."""
        base = pyg_base(type(self))
        layer = base.__new__(base)
        layer.__dict__.update((name, value) for name, value in self.__dict__.items() if not name.startswith("_geot"))
        layer.__dict__.update(self._plain_options())
        layer.__dict__.update(self._pyg_attributes())
        layer.inspector = _inspector(layer)  # PyG's class's: this layer's Inspector describes geot's
        return layer

    def _pyg_attributes(self) -> dict:
        """Attributes PyG's layer keeps in its __dict__ that this one holds elsewhere."""
        return {}

    # Pickling -------------------------------------------------------------------------------------

    def __getstate__(self):
        """What torch.save, pickle and copy.deepcopy keep: the layer without
        what it keeps of the graphs it saw (sorted graphs and values derived
        from them, remade at its next call; some hold weak references, which
        do not pickle), except what PyG's layer pickles of them
        (:meth:`_kept_caches`)."""
        state = {name: value for name, value in super().__getstate__().items() if not name.startswith("_geot")}
        state.update(self._plain_options())
        state.update(self._kept_caches())
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._geot_init()

    def _kept_caches(self) -> dict:
        """Caches that are part of the PyG layer's state (GCNConv's cached normalization), by attribute."""
        return {}

    @_InstanceMethod
    def __reduce_package__(self, exporter):
        """torch.package exports the layer as PyG's (:meth:`_as_pyg_layer`):
        a package holds Python modules, not geot's compiled extension, so
        it needs PyG's modules alone (as for PyG's model), and the loaded
        model runs PyG's code; ``geot.nn.patch`` it to run on geot again."""
        from torch.package import PackageImporter

        package = f"geot_layers_as_pyg._{exporter.get_unique_id()}"
        exporter.save_pickle(package, "layer.pkl", self._as_pyg_layer())
        return PackageImporter.load_pickle, (package, "layer.pkl")
