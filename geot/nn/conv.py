"""PyG's GCNConv, SAGEConv, GINConv, GATConv and RGCNConv with their
aggregation on geot ops.

Each subclasses the PyG layer and keeps its constructor, parameters and
``reset_parameters`` (so ``load_state_dict`` from a PyG layer works, and
:func:`geot.nn.patch` can convert a PyG layer in place); only ``forward``
changes. ``edge_index`` is a [2, E] integer tensor or an ``EdgeIndex`` in any
order (sorted once per graph, see :mod:`geot.nn.graph`). Options geot does not
implement raise ``NotImplementedError`` at construction (or in ``patch``).
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import _ops, hetero, index, validation
from .._ops import mean_counts
from ..config import explain, long_segment_level
from ..segment import segment_reduce
from .graph import SortedGraph, sorted_graph, static_addresses, transpose_index_as, with_transposed

_REDUCE = {"add": "sum", "sum": "sum", "mean": "mean", "max": "max"}


def _unsupported(layer, option: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"geot.nn.{type(layer).__name__.split('.')[-1]}: {option} is not supported ({why}); "
                               "use torch_geometric's layer for it")


def _check_common(layer, reduces=("add", "sum")) -> None:
    if layer.flow != "source_to_target":
        raise _unsupported(layer, f"flow={layer.flow!r}", "only 'source_to_target'")
    if not isinstance(layer.aggr, str) or layer.aggr not in reduces:
        raise _unsupported(layer, f"aggr={layer.aggr!r}", f"one of {reduces}")


def _pair(x):
    if isinstance(x, Tensor):
        return x, x
    if isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], Tensor):
        return x[0], x[1]
    raise TypeError(f"x must be a tensor or a pair (x_src, x_dst) of tensors, got {type(x).__name__}")


def _num_targets(x_src: Tensor, x_dst: Optional[Tensor], size) -> int:
    if size is not None:
        return int(size[1])
    return x_src.size(0) if x_dst is None else x_dst.size(0)


def _gather_reduce(graph: SortedGraph, x: Tensor, reduce: str, num_nodes: int, weight: Optional[Tensor] = None,
                   weight_t: Optional[Tensor] = None):
    """out[d] = reduce over the edges into d of weight[e] * x[src[e]].

    weight_t: weight in the graph's transposed order, when kept with the
    graph (the backward pass would gather it on every call). A mean's edge
    counts are kept with the graph, for the same reason."""
    counts = None
    if reduce == "mean" and x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        counts = graph.derived(("mean counts", num_nodes, x.dtype),
                               lambda: mean_counts(graph.dst, num_nodes).to(x.dtype))
    if weight is not None:
        weight, weight_t = weight.to(x.dtype), None if weight_t is None else weight_t.to(x.dtype)
    return index._fused(graph.src, graph.dst, weight, x, reduce, num_nodes, graph.transposed, None, counts, weight_t)


def _sum_plus_scaled(graph: SortedGraph, x: Tensor, scale: Tensor) -> Tensor:
    """scale * x[d] + the sum of x over the edges into d, one op without an
    autograd formula (GIN's inference; a row of x per node)."""
    return torch.ops.geot.index_sum_plus_scaled(graph.src, graph.dst, x, scale)


class _GCNNorm(NamedTuple):
    edge: Optional[Tensor]    # [E'] per-edge weight in graph order (None: unweighted, normalize=False)
    loop: Optional[Tensor]    # [N, 1] added self loops' weight (None without them)


def _matmul_dtype(x: Tensor):
    """The dtype of x @ W: autocast's where it casts x (it leaves float64 alone)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


def _cast_for_matmul(x_src: Tensor, x_dst: Optional[Tensor]):
    """(x_src, x_dst) in the dtype of x @ W, x cast once where both are one
    tensor: compiled code would otherwise make each cast copy up front."""
    cast = x_src.to(_matmul_dtype(x_src))
    return cast, cast if x_dst is x_src else x_dst


def _transposed_order(graph: SortedGraph, edge_values: Optional[Tensor]) -> Optional[Tensor]:
    """Per-edge values of the graph's order in its transposed order, for the
    backward pass; None where there is nothing to keep (no values, or values
    that require grad: those are gathered on every call, in their autograd graph)."""
    if edge_values is None or edge_values.requires_grad or graph.transposed is None:
        return None
    return edge_values.index_select(0, graph.transposed.perm)


class _RelationEdges(NamedTuple):
    """RGCN's edges over the projected table [N_src * R, C_out] (RGCNConv._project_then_reduce),
    in the graph's order. Index tensors only: kept once for every dtype."""
    rows: Tensor                # [E'] row an edge reads: src * R + its relation
    dst: Tensor                 # [E'] destination node, sorted (the graph's segment // R)


def _relation_edges(graph: SortedGraph, relations: int) -> _RelationEdges:
    relation = graph.dst.remainder(relations)
    return _RelationEdges(graph.src * relations + relation, graph.dst.div(relations, rounding_mode="floor"))


def _inverse_counts(graph: SortedGraph, num_segments: int, dtype) -> Tensor:
    """[S] 1 / the edge count of each segment (1 where empty), in dtype. The
    reciprocal is taken in float64, which autocast leaves alone (CUDA
    autocast runs a half-precision reciprocal in float32)."""
    return mean_counts(graph.dst, num_segments).to(torch.float64).reciprocal().to(dtype)


class _RelationBlock(NamedTuple):
    """The edges of relations [first, first + width) over their own projected table [N_src * width, C_out]."""
    rows: Tensor               # [E_b] src * width + relation - first
    dst: Tensor                # [E_b] destination node, sorted
    first: int
    width: int

    def segments(self, relations: int) -> Tensor:
        """[E_b] each edge's segment in the graph (dst * R + relation)."""
        return self.dst * relations + self.first + self.rows.remainder(self.width)


def _relation_blocks(graph: SortedGraph, relations: int, per_block: int):
    """The graph's edges split into blocks of per_block relations (a
    subsequence of dst-sorted edges stays sorted). One device->host sync per
    block (the edge counts), once per graph: eager only."""
    relation = graph.dst.remainder(relations)
    dst = graph.dst.div(relations, rounding_mode="floor")
    blocks = []
    for first in range(0, relations, per_block):
        width = min(per_block, relations - first)
        keep = ((relation >= first) & (relation < first + width)).nonzero().squeeze(1)
        rows = graph.src.index_select(0, keep) * width + relation.index_select(0, keep) - first
        blocks.append(_RelationBlock(rows, dst.index_select(0, keep), first, width))
    return blocks


class _GeotLayer:
    """What the five layers share: option checks and the per-layer graph slot."""

    def _geot_init(self) -> None:
        self._check_options()
        # (self_loops, num_relations) -> (edge_index, edge_type, variant, SortedGraph, version key): the last
        # graph of each variant the layer saw (see geot.nn.graph); _geot_graph: the last one stored.
        self._geot_graphs = {}
        self._geot_graph = None

    def _check_options(self) -> None:
        raise NotImplementedError


class GCNConv(_GeotLayer, pyg_nn.GCNConv):
    """``torch_geometric.nn.GCNConv`` on geot: the normalized sum is one
    ``index_weight_segment_reduce``; the self loops ``add_self_loops`` adds
    are a dense term, not extra edges. The normalization depends only on the
    graph, so it is computed once per graph and kept with the sorted graph
    (see :mod:`geot.nn.graph`): a new ``edge_index`` tensor or an in-place
    change of it recomputes it, as do a new ``edge_weight`` tensor, an
    in-place change of it, another node count, dtype or option; an
    ``edge_weight`` that requires grad is normalized on every call.
    ``cached=True`` keeps the sorted graph and its normalization from the
    first call, for every later call (as in PyG: later graphs are ignored);
    ``reset_parameters`` clears it. As in PyG 2.8, ``improved`` only changes
    the added loops' weight when ``edge_weight`` is given. A node's existing
    self loops are replaced by one loop whose weight is their sum (PyG keeps
    one of them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._geot_init()

    def _geot_init(self) -> None:
        super()._geot_init()
        self._geot_norm = None  # (SortedGraph, _GCNNorm, weights in transposed order) when cached

    def _check_options(self) -> None:
        _check_common(self)

    def reset_parameters(self):
        super().reset_parameters()
        self._geot_norm = None

    def forward(self, x: Tensor, edge_index, edge_weight: Optional[Tensor] = None) -> Tensor:
        if not isinstance(x, Tensor):
            raise ValueError("geot.nn.GCNConv takes x as one tensor (no bipartite message passing), "
                             f"got {type(x).__name__}")
        num_nodes = x.size(0)
        h = self.lin(x)
        graph, norm, edge_t = self._graph_and_norm(edge_index, edge_weight, num_nodes, x.dtype, h.dtype)
        out = _gather_reduce(graph, h, "sum", num_nodes, norm.edge, edge_t)
        if norm.loop is not None:
            out = torch.addcmul(out, norm.loop.to(h.dtype), h)
        return out if self.bias is None else out + self.bias

    def _graph_and_norm(self, edge_index, edge_weight: Optional[Tensor], num_nodes: int, dtype, out_dtype):
        """(sorted graph, _GCNNorm, its edge weights in transposed order or None):
        kept with the graph, or with the layer when cached."""
        if self.cached and self._geot_norm is not None:
            graph, norm, edge_t = self._geot_norm
            if torch.is_grad_enabled() and graph.transposed is None:  # cached by calls without gradients
                graph = with_transposed(graph)
                edge_t = _transposed_order(graph, norm.edge)
                if not torch.compiler.is_compiling():
                    self._geot_norm = (graph, norm, static_addresses(edge_t))
            return graph, norm, edge_t
        graph = sorted_graph(self, edge_index)
        key = ("gcn", self.normalize, self.add_self_loops, self.improved, edge_weight is None, num_nodes,
               dtype, out_dtype)
        norm = graph.derived(key, lambda: self._norm(graph, edge_weight, num_nodes, dtype, out_dtype), edge_weight)
        edge_t = None
        if graph.transposed is not None and norm.edge is not None:
            edge_t = graph.derived(key + ("transposed",), lambda: _transposed_order(graph, norm.edge), edge_weight)
        if self.cached:
            self._geot_norm = (graph, norm, edge_t)
        return graph, norm, edge_t

    def _norm(self, graph: SortedGraph, edge_weight: Optional[Tensor], num_nodes: int, dtype, out_dtype) -> _GCNNorm:
        """The normalization in dtype (x's), kept in out_dtype (lin(x)'s, as autocast makes it)."""
        edge, loop = self._normalize(graph, graph.edge_values(edge_weight), num_nodes, dtype)
        if edge is None:
            return _GCNNorm(None, None)
        return _GCNNorm(edge.to(out_dtype), None if loop is None else loop.to(out_dtype).unsqueeze(-1))

    def _normalize(self, graph: SortedGraph, weight: Optional[Tensor], num_nodes: int, dtype):
        """Edge weights D^-1/2 (A + loops) D^-1/2 [E] and the loops' [N], or
        the raw weights when normalize=False."""
        if not self.normalize:
            return weight, None
        loop_fill = 2.0 if self.improved and weight is not None else 1.0
        if weight is None:
            weight = torch.ones(graph.src.numel(), dtype=dtype, device=graph.src.device)
        loop_weight = None
        if self.add_self_loops:
            is_loop = graph.src == graph.dst
            existing = segment_reduce(graph.dst, torch.where(is_loop, weight, 0), "sum", num_nodes)
            has_loop = segment_reduce(graph.dst, is_loop.to(weight.dtype), "max", num_nodes) > 0
            loop_weight = torch.where(has_loop, existing, loop_fill)
            weight = torch.where(is_loop, 0, weight)
        degree = segment_reduce(graph.dst, weight, "sum", num_nodes)
        if loop_weight is not None:
            degree = degree + loop_weight
        inv_sqrt = degree.pow(-0.5).masked_fill(degree == 0, 0)
        norm = inv_sqrt.index_select(0, graph.src) * weight * inv_sqrt.index_select(0, graph.dst)
        return norm, None if loop_weight is None else inv_sqrt * loop_weight * inv_sqrt


class SAGEConv(_GeotLayer, pyg_nn.SAGEConv):
    """``torch_geometric.nn.SAGEConv`` on geot (aggr "mean", "sum"/"add" or
    "max": one ``index_segment_reduce``). For mean and sum with fewer output
    than input channels, ``lin_l`` is applied before the aggregation (they
    commute), so fewer features are gathered per edge; results then differ
    from PyG's by rounding only. Otherwise, in inference under autocast, x
    is cast before the aggregation (the Linears would cast the aggregate and
    x): half the bytes gathered and no float32 [N, F] aggregate or copy of x
    besides (peak memory); a mean or sum then differs from PyG's by that
    rounding of x, a max not at all. ``project=True`` and other
    aggregations are not supported."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._geot_init()

    def _check_options(self) -> None:
        _check_common(self, tuple(_REDUCE))
        if self.project:
            raise _unsupported(self, "project=True", "no projection before aggregation")

    def forward(self, x, edge_index, size=None) -> Tensor:
        x_src, x_dst = _pair(x)
        num_nodes = _num_targets(x_src, x_dst, size)
        graph, reduce = sorted_graph(self, edge_index), _REDUCE[self.aggr]
        root = None
        if self._project_first(x_src, reduce):
            cast, x_dst = _cast_for_matmul(x_src, x_dst)  # one cast for both projections
            # lin_l commutes with mean and sum: aggregate the narrower projected
            # rows (bias after, so a node without edges still gets it).
            if self.root_weight and x_dst is cast:
                projected, root = self._project_pair(cast)
            else:
                projected = F.linear(cast, self.lin_l.weight)
            out = _gather_reduce(graph, projected, reduce, num_nodes)
            out = out if self.lin_l.bias is None else out + self.lin_l.bias
        else:
            if not torch.is_grad_enabled() and _matmul_dtype(x_src) != x_src.dtype:
                x_src, x_dst = _cast_for_matmul(x_src, x_dst)  # lin_l casts the mean, lin_r x: cast x once, first
            out = self.lin_l(_gather_reduce(graph, x_src, reduce, num_nodes))
        if root is None and self.root_weight and x_dst is not None:
            root = self.lin_r(x_dst)
        out = out if root is None else out + root
        return F.normalize(out, p=2.0, dim=-1) if self.normalize else out

    def _project_pair(self, x: Tensor):
        """(x lin_l.weight^T, lin_r(x)); in compiled inference one op
        (geot::linear_pair: x freed before the aggregation, peak memory)."""
        weight, other, bias = self.lin_l.weight, self.lin_r.weight, self.lin_r.bias
        if not _ops.compiled_without_grad(x, weight, other, bias):
            return F.linear(x, weight), self.lin_r(x)
        bias = None if bias is None else bias.to(x.dtype)
        return torch.ops.geot.linear_pair(x, weight.to(x.dtype), other.to(x.dtype), bias)

    def _project_first(self, x_src: Tensor, reduce: str) -> bool:
        weight = self.lin_l.weight
        # isinstance rather than torch.nn.parameter.is_lazy, which torch.compile cannot trace
        return (reduce in ("mean", "sum") and not isinstance(weight, torch.nn.parameter.UninitializedParameter)
                and weight.size(0) < x_src.size(-1))


class GINConv(_GeotLayer, pyg_nn.GINConv):
    """``torch_geometric.nn.GINConv`` on geot: ``nn((1 + eps) x_i + sum_j x_j)``
    with the sum one ``index_segment_reduce``. In inference under autocast,
    where ``nn`` begins with a Linear (which casts the sum to the autocast
    dtype), x is cast first and the sum accumulates in float32 from those
    values: half the bytes gathered and no float32 [N, F] sum (peak memory);
    the output differs from PyG's by that rounding of x (1.16x PyG's error
    norm against float32, median of 30 random bf16 cases). On CUDA only
    where the half-precision sum keeps no fp32 rows (see
    :func:`_cast_first_saves_memory`). Training keeps PyG's float32 sum:
    there the rounding would also move which of nn's ReLUs fire, and with
    them the gradients. Inference on one x takes the sum and ``(1 + eps) x``
    as one op (geot::index_sum_plus_scaled: on CUDA one pass over the
    output; compiled, a lower peak)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._geot_init()

    def _check_options(self) -> None:
        _check_common(self)

    def forward(self, x, edge_index, size=None) -> Tensor:
        x_src, x_dst = _pair(x)
        num_nodes = _num_targets(x_src, x_dst, size)
        graph = sorted_graph(self, edge_index)
        if (not torch.is_grad_enabled() and _begins_with_linear(self.nn) and _matmul_dtype(x_src) != x_src.dtype
                and _cast_first_saves_memory(graph, x_src, num_nodes)):
            x_src, x_dst = _cast_for_matmul(x_src, x_dst)
        if x_dst is x_src and num_nodes == x_src.size(0) and _ops.records_no_grad(x_src, self.eps):
            out = _sum_plus_scaled(graph, x_src, 1 + self.eps)
            return self.nn(out)  # one op: see geot::index_sum_plus_scaled (one pass on CUDA, peak memory)
        out = _gather_reduce(graph, x_src, "sum", num_nodes)
        if x_dst is not None:  # in place on the sum (its backward does not read it): no second [N, F] (peak memory)
            out = out.addcmul_(x_dst, 1 + self.eps)
        return self.nn(out)


def _cast_first_saves_memory(graph: SortedGraph, x: Tensor, num_nodes: int) -> bool:
    """Whether summing x cast to half precision saves memory over PyG's
    float32 sum (4 N F bytes) and its cast for nn's Linear (2 N F): the cast
    copy (2 N F) and the output (2 N F) do where the sum keeps no fp32 rows
    (:func:`_sum_writes_half`). Where it keeps some (SR's chunk rows, 4 F
    bytes each) the saving is smaller and the time worse on the graphs
    measured (H100, compiled GIN bf16 inference, separate runs): citeseer
    112 MB and 0.43 ms cast first, 120 MB and 0.31 ms summing float32
    (PyG's fastest path: 120-121 MB, 0.39-0.40 ms); cora level in memory,
    its three bf16 sums 86 us against 57 us for the float32 first layer's
    alone (rows of an odd width take no vector loads). So it is not done
    there. Always on CPU (no buffer). On CUDA decided by eager code, once
    per graph and width (one device->host sync: the longest segment);
    compiled code reads that, or casts where no eager call decided."""
    if not x.is_cuda:
        return True
    key = ("cast first", x.size(-1), num_nodes)
    if torch.compiler.is_compiling() and key not in graph.memo:
        return True
    return graph.derived(key, lambda: _sum_writes_half(graph, x.size(-1), num_nodes))


def _sum_writes_half(graph: SortedGraph, num_features: int, num_nodes: int) -> bool:
    """Whether the CUDA fused sum of x's rows in half precision keeps no
    fp32 rows besides its output, mirroring the launch layer (``direct`` in
    csrc/segment_reduce_launch.cuh): SP with the long-segment level
    validation measures (here from the longest segment; segments past SP's
    cap take a few slots, counted as none). SR keeps its chunk rows (one per
    M_t edges, or one per segment), PR one per segment."""
    edges = graph.dst.numel()
    if not edges or not validation.validation_enabled():  # unvalidated SP: no level, the [S, F] buffer
        return False
    longest = int(torch.bincount(graph.dst, minlength=num_nodes).max())
    config = explain(edges, num_nodes, num_features, gathered=True, long_segments=long_segment_level(longest))
    return config.schedule == "SP"


def _begins_with_linear(module: torch.nn.Module) -> bool:
    """Whether module's first operation is a Linear (torch's or PyG's, alone,
    first in a Sequential or PyG's MLP): under autocast it casts its input."""
    while True:
        if isinstance(module, torch.nn.Sequential) and len(module):
            module = module[0]
        elif isinstance(module, pyg_nn.MLP):
            module = module.lins[0]
        else:
            return isinstance(module, (torch.nn.Linear, pyg_nn.Linear))


class GATConv(_GeotLayer, pyg_nn.GATConv):
    """``torch_geometric.nn.GATConv`` on geot: ``geot.edge_softmax`` over each
    node's incoming edges and one multi-head ``index_weight_segment_reduce``;
    in inference (no gradient recorded, no dropout) both in one pass,
    ``geot.attention_aggregate``. ``add_self_loops`` replaces the input's
    self loops by one per node, as PyG does (in training they stay in the
    edge list with zero attention, so the edge count does not depend on the
    data; in inference each node's loop is a term of its softmax). Not supported: ``edge_dim``
    (edge features), bipartite ``x``, ``size`` and ``return_attention_weights``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._geot_init()

    def _check_options(self) -> None:
        _check_common(self)
        if self.edge_dim is not None:
            raise _unsupported(self, f"edge_dim={self.edge_dim}", "no edge features")

    def forward(self, x: Tensor, edge_index, edge_attr: Optional[Tensor] = None, size=None,
                return_attention_weights: Optional[bool] = None) -> Tensor:
        if not isinstance(x, Tensor):
            raise _unsupported(self, "a pair x = (x_src, x_dst)", "no bipartite attention")
        if edge_attr is not None or size is not None or return_attention_weights is not None:
            raise _unsupported(self, "edge_attr, size or return_attention_weights", "plain graphs only")
        heads, channels, num_nodes = self.heads, self.out_channels, x.size(0)
        if self.lin is not None:
            h_src = h_dst = self.lin(x).view(-1, heads, channels)
        else:
            h_src, h_dst = self.lin_src(x).view(-1, heads, channels), self.lin_dst(x).view(-1, heads, channels)
        if _ops.records_no_grad(h_src, h_dst, self.att_src, self.att_dst) and not (self.training and self.dropout > 0):
            # Inference: softmax and sum in one pass, the self loops a term of each node's softmax (no
            # [E, H] attention, no self-looped edge list), the scores from the rows it loads (no [N, H]
            # scores) where the destinations' rows are the sources'.
            graph = sorted_graph(self, edge_index)
            score_dst = None if h_dst is h_src else (h_dst * self.att_dst).sum(-1)
            out = hetero.attention_aggregate(h_src, None, score_dst, graph.src, graph.dst, num_nodes,
                                             self.negative_slope, self.add_self_loops, att_src=self.att_src,
                                             att_dst=self.att_dst if score_dst is None else None)
            return self._finish(x, out, num_nodes)
        score_src, score_dst = (h_src * self.att_src).sum(-1), (h_dst * self.att_dst).sum(-1)
        graph = sorted_graph(self, edge_index, self_loops=num_nodes if self.add_self_loops else None)
        score = score_src.index_select(0, graph.src) + score_dst.index_select(0, graph.dst)
        score = F.leaky_relu(score, self.negative_slope)
        if graph.drop is not None:
            score = score.masked_fill(graph.drop.unsqueeze(-1), float("-inf"))
        # Without gradients the scores are not needed again: the softmax overwrites them (one [E, H] less).
        softmax = hetero.edge_softmax if torch.is_grad_enabled() and score.requires_grad else hetero.edge_softmax_
        alpha = F.dropout(softmax(score, graph.dst, num_nodes), p=self.dropout, training=self.training)
        return self._finish(x, _gather_reduce(graph, h_src, "sum", num_nodes, alpha), num_nodes)

    def _finish(self, x: Tensor, out: Tensor, num_nodes: int) -> Tensor:
        """The heads' [N, H, C] sums concatenated or averaged, the residual and the bias added."""
        out = out.reshape(num_nodes, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if self.res is not None:
            out = out + self.res(x)
        return out if self.bias is None else out + self.bias


class RGCNConv(_GeotLayer, pyg_nn.RGCNConv):
    """``torch_geometric.nn.RGCNConv`` on geot. Where C_out >= C_in, one
    ``index_segment_reduce`` into (node, relation) segments gives every
    relation's mean (or sum) at once, [N, R * C_in], then one matmul with the
    stacked relation weights. Where C_out < C_in it projects first (every
    x_j W_r, [N_src * R, C_out]) and gathers those narrower rows, weighted by
    1 / the edges of their (node, relation) segment for a mean: less to
    gather and a smaller table; in eager inference, where that table is wider
    than x, a few relations at a time (peak memory). ``num_bases`` is
    supported; ``num_blocks`` and featureless (index) ``x`` are not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._geot_init()

    def _check_options(self) -> None:
        _check_common(self, ("mean", "add", "sum"))
        if self.num_blocks is not None:
            raise _unsupported(self, f"num_blocks={self.num_blocks}", "no block-diagonal decomposition")

    def forward(self, x, edge_index, edge_type: Optional[Tensor] = None) -> Tensor:
        x_src, x_dst = _pair(x)
        if not x_src.is_floating_point():
            raise _unsupported(self, "x as node indices", "give node features")
        if edge_type is None:
            raise ValueError("geot.nn.RGCNConv needs edge_type, one relation per edge")
        relations, num_nodes = self.num_relations, x_dst.size(0)
        projects = self.out_channels < x_src.size(-1)
        # Gathering projected rows, the backward pass reads their own transposed edges, not the graph's.
        graph = sorted_graph(self, edge_index, edge_type=edge_type, num_relations=relations, transposed=not projects)
        weight = self.weight
        if self.num_bases is not None:
            weight = self.comp @ weight.view(self.num_bases, -1)
        weight = weight.view(relations, -1, self.out_channels)  # [R, C_in, C_out]
        if projects and self._in_blocks(graph, x_src, weight, num_nodes):
            cast, x_dst = _cast_for_matmul(x_src, x_dst)  # once, not per block and root
            out = self._project_then_reduce_in_blocks(graph, cast, weight, num_nodes)
        elif projects:
            out = self._project_then_reduce(graph, x_src, weight, num_nodes)
        else:
            per_relation = _gather_reduce(graph, x_src, _REDUCE[self.aggr], num_nodes * relations)
            out = per_relation.view(num_nodes, -1) @ weight.reshape(-1, self.out_channels)
        if self.root is not None:
            out = out + x_dst @ self.root
        return out if self.bias is None else out + self.bias

    def _project_then_reduce(self, graph: SortedGraph, x_src: Tensor, weight: Tensor, num_nodes: int) -> Tensor:
        """sum_r (mean or sum over j in N_r(i) of x_j W_r) as one weighted
        gather-reduce of the projected rows. What is kept with the graph:
        the edges and their transposed index once, a mean's edge weights
        per dtype."""
        relations, in_channels = self.num_relations, x_src.size(-1)
        projected = (x_src @ weight.transpose(0, 1).reshape(in_channels, -1)).view(-1, self.out_channels)
        edges = graph.derived(("rgcn rows", relations), lambda: _relation_edges(graph, relations))
        edge_weight = None
        if self.aggr == "mean":  # in the rows' dtype
            key = ("rgcn row weights", relations, num_nodes, projected.dtype)
            edge_weight = graph.derived(key, lambda: _inverse_counts(graph, num_nodes * relations, projected.dtype)
                                        .index_select(0, graph.dst))
        transposed = weight_t = None
        if projected.requires_grad and torch.is_grad_enabled():
            key = ("rgcn rows transposed", relations)
            transposed = graph.derived(key, lambda: transpose_index_as(edges.rows, edges.dst, edges.rows.dtype))
            if edge_weight is not None:
                weight_t = graph.derived(key + (num_nodes, projected.dtype),
                                         lambda: edge_weight.index_select(0, transposed.perm))
        return index._fused(edges.rows, edges.dst, edge_weight, projected, "sum", num_nodes, transposed,
                            None, None, weight_t)

    def _in_blocks(self, graph: SortedGraph, x_src: Tensor, weight: Tensor, num_nodes: int) -> bool:
        """Inference where the projected table [N_src, R * C_out] is wider
        than x: it is then made a few relations at a time, each block at most
        half x's width, so the peak stays under PyG's per-relation [N, C_in].
        H100, fp32, 2M / 3.2M-edge graphs, 128 -> 64 channels, 8 relations,
        against PyG in the same run: blocks as wide as x peaked 1.07x / 1.10x
        PyG's memory at 8.0x / 8.2x its speed; half as wide, 0.86x / 0.89x
        at 4.3x / 4.1x (each block re-reads x). Not in training (each
        block's table would be kept for backward anyway). Compiled code
        takes the blocks (and a mean's weights) an eager call made (their
        sizes are data-dependent, so it cannot split the edges itself), else
        the whole table."""
        records_grad = torch.is_grad_enabled() and (x_src.requires_grad or weight.requires_grad)
        if records_grad or self.num_relations * self.out_channels <= x_src.size(-1):
            return False  # no wider than x: one table (the edges training keeps, no blocks kept besides)
        kept = [key in graph.memo for key in self._blocks_keys(x_src, num_nodes) if key is not None]
        return not torch.compiler.is_compiling() or all(kept)

    def _blocks_keys(self, x_src: Tensor, num_nodes: int):
        """The memo keys (SortedGraph.derived) of this call's relation blocks
        and, for a mean, their edge weights in the projected rows' dtype."""
        blocks = ("rgcn blocks", self.num_relations, self._relations_per_block(x_src.size(-1)))
        if self.aggr != "mean":
            return blocks, None
        return blocks, ("rgcn block weights", *blocks[1:], num_nodes, _matmul_dtype(x_src))

    def _relations_per_block(self, in_channels: int) -> int:
        return max(1, in_channels // (2 * self.out_channels))

    def _project_then_reduce_in_blocks(self, graph: SortedGraph, x_src: Tensor, weight: Tensor,
                                       num_nodes: int) -> Tensor:
        """_project_then_reduce one block of relations at a time, summed."""
        relations, in_channels = self.num_relations, x_src.size(-1)
        per_block = self._relations_per_block(in_channels)
        blocks_key, weights_key = self._blocks_keys(x_src, num_nodes)
        blocks = graph.derived(blocks_key, lambda: _relation_blocks(graph, relations, per_block))
        block_weights = [None] * len(blocks)
        if weights_key is not None:
            def mean_weights():
                inverse = _inverse_counts(graph, num_nodes * relations, weights_key[-1])
                return [inverse.index_select(0, block.segments(relations)) for block in blocks]
            block_weights = graph.derived(weights_key, mean_weights)
        out = None
        for block, edge_weight in zip(blocks, block_weights):
            block_weight = weight[block.first:block.first + block.width].transpose(0, 1).reshape(in_channels, -1)
            projected = (x_src @ block_weight).view(-1, self.out_channels)
            part = index._fused(block.rows, block.dst, edge_weight, projected, "sum", num_nodes, None, None)
            if out is None:
                out = part
            elif torch.compiler.is_compiling():  # each part freed once added (see geot::accumulate_)
                torch.ops.geot.accumulate_(out, part)
            else:
                out.add_(part)
        return out
