"""SGConv, TAGConv, APPNP, ChebConv, ClusterGCNConv and LGConv on geot: the
generic propagation over a graph normalized once; SGConv, TAGConv, ClusterGCNConv
and GraphConv with the projections first where they narrow the rows.

PyG's forward of these normalizes the graph on every call (APPNP: unless
cached), a new tensor that geot would sort on every call; these keep the
normalized graph with the input edge_index (:func:`kept_normalization`), so
it is sorted once.
SGConv, TAGConv, ClusterGCNConv and GraphConv apply Linears to propagated features, ``W Â^k x``. The
propagation is linear in the features, so ``W Â^k x = Â^k (x W^T)``: where
out_channels < in_channels, projecting first makes each propagation gather
out_channels features per edge rather than in_channels (8 instead of 128 for
a classifier on 128 features). Results then differ from PyG's by rounding
only. Anything else (a cached SGConv, sparse adjacencies, hooks) runs the
generic layer's forward, PyG's.
"""
import weakref

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor
from torch.nn.parameter import UninitializedParameter
from torch.utils.weak import WeakTensorKeyDictionary
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import add_self_loops as add_self_loops_to
from torch_geometric.utils import degree, remove_self_loops

from .common import linear_sum
from .generic import geot_class, with_trace_memo
from .graph import _version_key, call_at_trace_time, prepare_for_compiled

_kept_norms = WeakTensorKeyDictionary()  # edge_index -> (key, edge_weight ref, normalized graph)


def _gcn_normalization(layer, edge_index: Tensor, edge_weight, options: tuple):
    num_nodes, add_self_loops, flow, dtype = options
    return gcn_norm(edge_index, edge_weight, num_nodes, False, add_self_loops, flow, dtype)


def _cheb_normalization(layer, edge_index: Tensor, edge_weight, options: tuple):
    num_nodes, normalization, dtype = options
    return pyg_nn.ChebConv.__norm__(layer, edge_index, num_nodes, edge_weight, normalization, None, dtype=dtype)


def _cluster_gcn_normalization(layer, edge_index: Tensor, edge_weight, options: tuple):
    """ClusterGCNConv's weights of a plain edge_index: 1 / in-degree (of the self-looped graph), plus
    diag_lambda / in-degree on the self loops."""
    num_nodes, add_self_loops, diag_lambda = options
    if add_self_loops:
        edge_index = add_self_loops_to(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]
    source, target = edge_index[0], edge_index[1]
    inverse_degree = 1.0 / degree(target, num_nodes=num_nodes).clamp_(1.0)
    weight = inverse_degree[target]
    weight[source == target] += diag_lambda * inverse_degree
    return edge_index, weight


# kind -> the layer's normalization (edge_index, edge_weight, options) -> (edge index, per-edge weights); it
# reads nothing of the layer but what options hold (PyG's own methods take it as self).
NORMALIZATIONS = {"gcn": _gcn_normalization, "cheb": _cheb_normalization, "cluster_gcn": _cluster_gcn_normalization}


def kept_normalization(layer, kind: str, edge_index: Tensor, edge_weight, options: tuple):
    """NORMALIZATIONS[kind](layer, edge_index, edge_weight, options), kept
    with edge_index eagerly: the propagations then meet the same normalized
    graph tensor call after call, so geot sorts it once (PyG normalizes on
    every call; so does compiled code, and an edge_weight that requires
    grad). A new tensor, or an in-place change of edge_index or edge_weight,
    normalizes again."""
    normalize = NORMALIZATIONS[kind]
    if torch.compiler.is_compiling() or (edge_weight is not None and edge_weight.requires_grad):
        return normalize(layer, edge_index, edge_weight, options)
    key = (kind, options, _version_key(edge_index), None if edge_weight is None else _version_key(edge_weight))
    entry = _kept_norms.get(edge_index, {}).get(kind)
    if entry is not None and entry[0] == key and (entry[1] is None) == (edge_weight is None) and (
            edge_weight is None or entry[1]() is edge_weight):
        normalized_index, normalized_weight = entry[2]
        return (edge_index if normalized_index is None else normalized_index), normalized_weight
    normalized_index, normalized_weight = normalize(layer, edge_index, edge_weight, options)
    # The entry must not hold edge_index (its key) alive: edge_index itself is stored as None; a view of it
    # is not kept at all.
    if normalized_index.untyped_storage().data_ptr() == edge_index.untyped_storage().data_ptr():
        if normalized_index is not edge_index:
            return normalized_index, normalized_weight
        normalized_index = None
    _kept_norms.setdefault(edge_index, {})[kind] = (
        key, None if edge_weight is None else weakref.ref(edge_weight), (normalized_index, normalized_weight))
    return (edge_index if normalized_index is None else normalized_index), normalized_weight


def _normalized(layer, kind: str, edge_index: Tensor, edge_weight, options: tuple):
    """The call's normalized graph: kept_normalization's; inside
    torch.compile, the one kept while dynamo traced the layer's first graph
    (normalized and sorted then, eagerly: see
    geot.nn.graph.call_at_trace_time), else normalized in the compiled code
    on every call (a graph that changes)."""
    if not torch.compiler.is_compiling():
        return kept_normalization(layer, kind, edge_index, edge_weight, options)
    call_at_trace_time(_prepare_normalized, layer, kind, edge_index, edge_weight, options, torch.is_grad_enabled())
    kept = getattr(layer, "_geot_normalized", None)  # an attribute of its own, read after the trace-time call
    if kept is not None and kept[0] is edge_index and kept[1] is edge_weight and kept[2] == (kind, options):
        return kept[3]
    return NORMALIZATIONS[kind](layer, edge_index, edge_weight, options)


def _gcn_normalized(layer, x: Tensor, edge_index: Tensor, edge_weight, add_self_loops: bool):
    """_normalized by gcn_norm (SGConv, TAGConv, APPNP), for x's nodes and dtype."""
    return _normalized(layer, "gcn", edge_index, edge_weight,
                       (x.size(layer.node_dim), add_self_loops, layer.flow, x.dtype))


def _prepare_normalized(layer, kind: str, edge_index: Tensor, edge_weight, options: tuple, grad: bool) -> None:
    """Run while dynamo traces, on the real graph: the layer's first graph normalized, and the normalized
    graph sorted, kept for the compiled code to read (not an edge_weight that requires grad: its
    normalization must be recorded on every call)."""
    if edge_weight is not None and edge_weight.requires_grad:
        return
    normalized = kept_normalization(layer, kind, edge_index, edge_weight, options)
    if prepare_for_compiled(layer, normalized[0], layer._flipped(), grad):
        layer.__dict__["_geot_normalized"] = (edge_index, edge_weight, (kind, options), normalized)


def _runs_here(layer, x, edge_index) -> bool:
    """Whether this module's forward takes the call: a [N, F] x, a plain dense edge_index tensor (not a
    sparse adjacency, nor a subclass such as EdgeIndex, which keeps no storage of its own to key the kept
    normalization by), and nothing that reads the propagated features (hooks, explain). Else the generic
    layer's forward (PyG's, geot's propagate)."""
    return (isinstance(x, Tensor) and x.dim() == 2 and type(edge_index) is Tensor
            and edge_index.layout == torch.strided and layer._option_reason() is None)


def _narrows(weight) -> bool:
    """Whether a Linear's weight (materialized) has fewer output than input features."""
    return not isinstance(weight, UninitializedParameter) and weight.size(0) < weight.size(1)


class SGConv(geot_class(pyg_nn.SGConv)):
    """``torch_geometric.nn.SGConv`` on geot: ``lin(Â^K x)``, each of the K
    propagations one fused gather-reduce over the graph normalized once
    (:func:`kept_normalization`); ``Â^K (x W^T) + b`` where ``lin`` narrows the
    rows. With ``cached=True``, PyG's forward (Â^K x is what it keeps)."""

    def forward(self, x, edge_index, edge_weight=None) -> Tensor:
        if self.cached or self._cached_x is not None or not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index, edge_weight)
        return _sg_forward(self, x, edge_index, edge_weight)


@with_trace_memo
def _sg_forward(layer: SGConv, x: Tensor, edge_index: Tensor, edge_weight) -> Tensor:
    edge_index, edge_weight = _gcn_normalized(layer, x, edge_index, edge_weight, layer.add_self_loops)
    first = _narrows(layer.lin.weight)
    h = F.linear(x, layer.lin.weight) if first else x  # the bias after the propagation, as lin adds it
    for _ in range(layer.K):
        h = layer.propagate(edge_index, x=h, edge_weight=edge_weight)
    if not first:
        return layer.lin(h)
    return h if layer.lin.bias is None else h + layer.lin.bias


class TAGConv(geot_class(pyg_nn.TAGConv)):
    """``torch_geometric.nn.TAGConv`` on geot: ``sum_k lins[k](Â^k x)``, each
    propagation one fused gather-reduce over the graph normalized once
    (:func:`kept_normalization`); where the Linears narrow the rows, in Horner's
    form ``x W_0 + Â(x W_1 + Â(... + Â x W_K))``: the same K propagations,
    of out_channels features, after one product of x by every W_k."""

    def forward(self, x, edge_index, edge_weight=None) -> Tensor:
        if not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index, edge_weight)
        return _tag_forward(self, x, edge_index, edge_weight)


@with_trace_memo
def _tag_forward(layer: TAGConv, x: Tensor, edge_index: Tensor, edge_weight) -> Tensor:
    if layer.normalize:
        edge_index, edge_weight = _gcn_normalized(layer, x, edge_index, edge_weight, False)
    if layer.K > 0 and _narrows(layer.lins[0].weight):
        # Every x W_k from one product: x is read once, and its gradient is one
        # [N, in] product, where K + 1 of them summed would all be alive at once
        # in a compiled backward (inductor sums them in one kernel).
        weight = torch.cat([lin.weight for lin in layer.lins])
        hops = F.linear(x, weight).split(layer.out_channels, dim=-1)
        out = hops[-1]
        for hop in reversed(hops[:-1]):
            out = hop + layer.propagate(edge_index, x=out, edge_weight=edge_weight)
    else:  # PyG's order
        out = layer.lins[0](x)
        for lin in layer.lins[1:]:
            x = layer.propagate(edge_index, x=x, edge_weight=edge_weight)
            out = out + lin(x)
    return out if layer.bias is None else out + layer.bias


class APPNP(geot_class(pyg_nn.APPNP)):
    """``torch_geometric.nn.APPNP`` on geot: K steps of ``(1 - alpha) Â h +
    alpha x``, each propagation one fused gather-reduce over the graph
    normalized once (:func:`kept_normalization`; PyG normalizes on every call
    unless ``cached``). Edge dropout as PyG's (the weights of each step
    dropped from the last step's), on the same graph."""

    def forward(self, x, edge_index, edge_weight=None) -> Tensor:
        if not self.normalize or self.cached or not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index, edge_weight)
        return _appnp_forward(self, x, edge_index, edge_weight)


@with_trace_memo
def _appnp_forward(layer: APPNP, x: Tensor, edge_index: Tensor, edge_weight) -> Tensor:
    edge_index, edge_weight = _gcn_normalized(layer, x, edge_index, edge_weight, layer.add_self_loops)
    h = x
    for _ in range(layer.K):
        if layer.dropout > 0 and layer.training:  # as PyG's: each step drops from the last step's weights
            edge_weight = F.dropout(edge_weight, p=layer.dropout)
        x = layer.propagate(edge_index, x=x, edge_weight=edge_weight)
        x = x * (1 - layer.alpha)
        x = x + layer.alpha * h
    return x


class LGConv(geot_class(pyg_nn.LGConv)):
    """``torch_geometric.nn.LGConv`` (LightGCN) on geot: one propagation over
    the graph normalized once (:func:`kept_normalization`; PyG normalizes
    on every call, a new graph that geot would sort every call)."""

    def forward(self, x, edge_index, edge_weight=None) -> Tensor:
        if not self.normalize or not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index, edge_weight)
        return _lg_forward(self, x, edge_index, edge_weight)


@with_trace_memo
def _lg_forward(layer: LGConv, x: Tensor, edge_index: Tensor, edge_weight) -> Tensor:
    edge_index, edge_weight = _gcn_normalized(layer, x, edge_index, edge_weight, False)
    return layer.propagate(edge_index, x=x, edge_weight=edge_weight)


class ChebConv(geot_class(pyg_nn.ChebConv)):
    """``torch_geometric.nn.ChebConv`` on geot: the Chebyshev recursion
    ``T_k = 2 L T_{k-1} - T_{k-2}``, each propagation one fused
    gather-reduce over the scaled Laplacian computed once
    (:func:`kept_normalization`; PyG computes it on every call). With
    ``batch`` or ``lambda_max``, PyG's forward."""

    def forward(self, x, edge_index, edge_weight=None, batch=None, lambda_max=None) -> Tensor:
        if batch is not None or lambda_max is not None or not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index, edge_weight, batch, lambda_max)
        return _cheb_forward(self, x, edge_index, edge_weight)


@with_trace_memo
def _cheb_forward(layer: ChebConv, x: Tensor, edge_index: Tensor, edge_weight) -> Tensor:
    edge_index, norm = _normalized(layer, "cheb", edge_index, edge_weight,
                                   (x.size(layer.node_dim), layer.normalization, x.dtype))
    previous, out = x, layer.lins[0](x)
    if len(layer.lins) > 1:
        current = layer.propagate(edge_index, x=x, norm=norm)
        out = out + layer.lins[1](current)
        for lin in layer.lins[2:]:
            following = 2.0 * layer.propagate(edge_index, x=current, norm=norm) - previous
            out = out + lin(following)
            previous, current = current, following
    return out if layer.bias is None else out + layer.bias


class ClusterGCNConv(geot_class(pyg_nn.ClusterGCNConv)):
    """``torch_geometric.nn.ClusterGCNConv`` on geot: ``lin_out(Â x) +
    lin_root(x)``, the propagation one fused gather-reduce over the weights
    computed once (:func:`kept_normalization`; PyG computes them on every
    call); ``Â (x W_out^T) + b`` where ``lin_out`` narrows the rows."""

    def forward(self, x, edge_index) -> Tensor:
        if not _runs_here(self, x, edge_index):
            return super().forward(x, edge_index)
        return _cluster_gcn_forward(self, x, edge_index)


@with_trace_memo
def _cluster_gcn_forward(layer: ClusterGCNConv, x: Tensor, edge_index: Tensor) -> Tensor:
    edge_index, weight = _normalized(layer, "cluster_gcn", edge_index, None,
                                     (x.size(layer.node_dim), layer.add_self_loops, layer.diag_lambda))
    lin = layer.lin_out
    if _narrows(lin.weight):
        out = layer.propagate(edge_index, x=F.linear(x, lin.weight), edge_weight=weight)
        out = out if lin.bias is None else out + lin.bias
        return out + layer.lin_root(x)
    return linear_sum([(layer.propagate(edge_index, x=x, edge_weight=weight), lin), (x, layer.lin_root)])


class GraphConv(geot_class(pyg_nn.GraphConv)):
    """``torch_geometric.nn.GraphConv`` on geot: ``lin_rel(sum_j e_ji x_j) +
    lin_root(x_i)``, the aggregation one fused gather-reduce (geot's
    propagate); with sum or mean where ``lin_rel`` narrows the rows,
    ``sum_j e_ji (x_j W_rel^T) + b``: out_channels features gathered per
    edge (a classifier's last layer: 8 rather than 128). Otherwise PyG's
    forward on geot's propagate, its two Linears' outputs summed in one
    buffer (:func:`linear_sum`)."""

    def forward(self, x, edge_index, edge_weight=None, size=None) -> Tensor:
        x_src = x_dst = None
        if isinstance(x, Tensor):
            x_src = x_dst = x
        elif isinstance(x, (tuple, list)) and len(x) == 2:
            x_src, x_dst = x
        if not isinstance(x_src, Tensor) or self._option_reason() is not None:
            return super().forward(x, edge_index, edge_weight, size)
        if self._projects_first(x_src):
            return _graph_conv_forward(self, x_src, x_dst, edge_index, edge_weight, size)
        # PyG's forward, its two Linears' sum in one buffer
        out = self.propagate(edge_index, x=(x_src, x_dst), edge_weight=edge_weight, size=size)
        return linear_sum([(out, self.lin_rel)] + ([] if x_dst is None else [(x_dst, self.lin_root)]))

    def _projects_first(self, x_src) -> bool:
        """lin_rel commutes with a sum or mean of the sources' rows (PyG's
        flow: target_to_source gathers x[1] in some of PyG's paths), and
        narrows them; nothing observes lin_rel's input (hooks)."""
        lin = self.lin_rel
        return (x_src.dim() >= 2 and self.flow == "source_to_target"
                and isinstance(self.aggr, str) and self.aggr in ("add", "sum", "mean")
                and _narrows(lin.weight) and x_src.size(-1) == lin.weight.size(1)
                and not (lin._forward_hooks or lin._forward_pre_hooks))


@with_trace_memo
def _graph_conv_forward(layer: GraphConv, x_src: Tensor, x_dst, edge_index, edge_weight, size) -> Tensor:
    lin = layer.lin_rel
    projected = F.linear(x_src, lin.weight)
    out = layer.propagate(edge_index, x=(projected, x_dst), edge_weight=edge_weight, size=size)
    out = out if lin.bias is None else out + lin.bias
    return out if x_dst is None else out + layer.lin_root(x_dst)
