"""RGCNConv on geot."""
import bisect
import contextlib
from typing import NamedTuple, Optional

import torch
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import index
from ..validation import validation
from .._ops import mean_counts
from .common import (REDUCE, Nodes, Pairs, cast_for_matmul, distinct_pairs, flipped_pair_reason, gather_reduce,
                     matmul_dtype, typed_matmul)
from .graph import (SortedGraph, call_at_trace_time, checked, fixed_sizes, kept_graph, sorted_graph,
                    transpose_index_as)
from .inputs import edges_of
from .layer import GeotLayer


class _RelationEdges(NamedTuple):
    """RGCN's edges over the projected table [N_src * R, C_out] (RGCNConv._project_then_reduce),
    in the graph's order. Index tensors only: kept once for every dtype."""
    rows: Tensor                # [E'] row an edge reads: src * R + its relation
    dst: Tensor                 # [E'] destination node, sorted (the graph's segment // R)


def _relation_edges(graph: SortedGraph, relations: int) -> _RelationEdges:
    relation = graph.dst.remainder(relations)
    return _RelationEdges(graph.src * relations + relation, graph.dst.div(relations, rounding_mode="floor"))


def _inverse_counts(graph: SortedGraph, num_segments: int, dtype) -> Tensor:
    """[S] 1 / the edge count of each segment (1 where empty), in dtype (_inverse)."""
    return _inverse(mean_counts(graph.dst, num_segments), dtype)


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


class _RelationRange(NamedTuple):
    """The edges of one relation, within the range of destinations [lo, hi] and of sources [src_lo, src_hi]
    it reaches (in a typed graph, one node type's ids each)."""
    src: Tensor                # [E_r] source node less src_lo
    dst: Tensor                # [E_r] destination node less lo, sorted
    relation: int
    lo: int
    hi: int
    src_lo: int
    src_hi: int


def _relation_ranges(graph: SortedGraph, relations: int) -> list:
    """The graph's edges split by relation (a subsequence of dst-sorted edges stays sorted), each with the
    ranges of nodes it reaches. Relations without edges are left out. One device->host sync per relation,
    once per graph: eager only."""
    relation = graph.dst.remainder(relations)
    dst = graph.dst.div(relations, rounding_mode="floor")
    ranges = []
    for r in range(relations):
        keep = (relation == r).nonzero().squeeze(1)
        if keep.numel() == 0:
            continue
        dst_r, src_r = dst.index_select(0, keep), graph.src.index_select(0, keep)
        lo, hi, src_lo, src_hi = torch.stack([dst_r[0], dst_r[-1], src_r.min(), src_r.max()]).tolist()
        ranges.append(_RelationRange(src_r - src_lo, dst_r - lo, r, lo, hi, src_lo, src_hi))
    return ranges


def _relation_aggregate(part: _RelationRange, x_src: Tensor, reduce: str) -> Tensor:
    """[hi - lo + 1, C_in] the relation's mean or sum of x over the destinations it reaches."""
    return index._fused(part.src, part.dst, None, x_src[part.src_lo:part.src_hi + 1], reduce, part.hi - part.lo + 1,
                        None, None)


def _add_relation_products(out: Tensor, ranges: list, x_src: Tensor, weight: Tensor, reduce: str) -> None:
    """out[lo:hi + 1] += (each relation's aggregate) @ W_r, in place, one relation at a time: its
    aggregate is let go before the next is made."""
    with _derived_indices():
        for part in ranges:
            out[part.lo:part.hi + 1].addmm_(_relation_aggregate(part, x_src, reduce), weight[part.relation])


class _RangeBySource(NamedTuple):
    """A relation range's edges in source order: what x's gradient reduces over (sorted, no atomics)."""
    src: Tensor                # [E_r] source node less src_lo, sorted
    dst: Tensor                # [E_r] destination node less lo


def _by_source(part: _RelationRange) -> _RangeBySource:
    src, order = part.src.sort(stable=True)
    return _RangeBySource(src, part.dst.index_select(0, order))


class _RangesProduct(torch.autograd.Function):
    """Training's sum_r aggr over j in N_r(i) of x_j W_r in relation ranges (_reduce_then_project_in_ranges).
    Kept for backward: x and the weights alone. Where x takes no gradient, W_r's gradient reads the
    relation's aggregate, made again one relation at a time: one more gather pass in backward, where PyG
    keeps every relation's aggregate from forward (on mag at 64 channels, about 300 MB). Else the
    gradient of each relation's aggregate, reduced to its sources over the range's edges in source order
    (by_source), gives both W_r's gradient and x's. Peak: the output and one relation's rows, not a
    [N * R, C] table and its gradient."""

    @staticmethod
    def forward(ctx, x_src, weight, ranges, by_source, reduce, num_nodes):
        out = x_src.new_zeros(num_nodes, weight.size(-1))
        _add_relation_products(out, ranges, x_src, weight, reduce)
        ctx.save_for_backward(x_src, weight)
        ctx.ranges, ctx.by_source, ctx.reduce = ranges, by_source, reduce
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_src, weight = ctx.saved_tensors
        x_grad = ctx.needs_input_grad[0]
        grad_x = torch.zeros_like(x_src) if x_grad else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with _derived_indices():
            for i, part in enumerate(ctx.ranges):
                grad_rows = grad_out[part.lo:part.hi + 1]
                if not x_grad:
                    grad_w[part.relation] = _relation_aggregate(part, x_src, ctx.reduce).t() @ grad_rows
                    continue
                if ctx.reduce == "mean":
                    grad_rows = grad_rows / mean_counts(part.dst, grad_rows.size(0)).unsqueeze(1).to(grad_rows.dtype)
                edges = ctx.by_source[i]
                to_sources = index._fused(edges.dst, edges.src, None, grad_rows, "sum", part.src_hi - part.src_lo + 1,
                                          None, None)
                if grad_w is not None:
                    grad_w[part.relation] = x_src[part.src_lo:part.src_hi + 1].t() @ to_sources
                grad_x[part.src_lo:part.src_hi + 1].addmm_(to_sources, weight[part.relation].t())
        return grad_x, grad_w, None, None, None, None


class _Finished(NamedTuple):
    """A layer's output with its root and bias terms in it already (RGCNConv._reduce_then_project_in_ranges)."""
    out: Tensor


class _SourcePairs(NamedTuple):
    """RGCN's edges over the projections of their distinct (source, relation) pairs."""
    sources: Pairs
    dst: Tensor        # [E] destination node, sorted


def _source_pairs(graph: SortedGraph, num_src: int, num_dst: int, relations: int) -> _SourcePairs:
    if graph.src.numel() and bool((graph.src.min() < 0) | (graph.src.max() >= num_src)
                                  | (graph.dst.max() >= num_dst * relations)):
        raise ValueError(f"edge_index has ids out of range ([0, {num_src}) sources, [0, {num_dst}) destinations)")
    relation = graph.dst.remainder(relations)
    return _SourcePairs(distinct_pairs(graph.src, relation, num_src, relations),
                        graph.dst.div(relations, rounding_mode="floor"))


# Inference whose table of pair projections [U, C_out] would pass PAIR_BLOCK_MIN_BYTES takes the pairs in
# ranges, each range's projections reduced before the next range's are made: one range's rows at a time,
# not all pairs' gathered inputs and projections at once (peak memory). Each range adds a few host-bound
# launches and a pass over an [N, C_out] partial sum, which with the output is the floor of the peak: a
# range holds about N / PAIR_RANGE_SHARE pairs (2 to 32 ranges). H100, 1x64: the whole table
# peaked at 1.44x PyG's per-relation loop on wikikg2's shape (2.5M pairs), 1.42x its compiled loop on
# biokg's (520k pairs over 94k nodes, a 127 MiB table); in this rule's 16 ranges 0.97x, at 3.8 ms a call
# against the whole table's 0.85. Smaller tables stay whole (fb15k's shape: 262k pairs, 64 MiB).
PAIR_BLOCK_MIN_BYTES = 96 << 20
PAIR_RANGE_SHARE = 3


def _pair_range_count(pairs: int, num_nodes: int) -> int:
    """How many ranges blocked inference takes the pairs in (see PAIR_RANGE_SHARE)."""
    return min(32, max(2, PAIR_RANGE_SHARE * pairs // max(num_nodes, 1)))


class _PairBlock(NamedTuple):
    """The edges reading pairs start:end (of relations [first, last)) over those pairs' projections."""
    rows: Tensor               # [E_b] the pair each edge reads, less start
    dst: Tensor                # [E_b] destination node, sorted
    counts: Optional[Tensor]   # [E_b] the edges of each edge's (node, relation) segment (mean), index dtype
    ptr: Tensor                # [last - first + 1] int64 its pairs by relation, less start (kept, not sliced
                               # per call)
    bounds: list               # ptr on the host
    first: int
    last: int
    start: int
    end: int


class _PairBlocks(NamedTuple):
    """What blocked inference keeps in place of _SourcePairs (as many per-edge values, none of them also
    kept whole)."""
    node: Tensor               # [U] each pair's source node, pairs grouped by relation
    parts: list                # [_PairBlock]


def _pair_ranges(bounds: list, blocks: int):
    """[(start, end, first, last)]: blocks ranges of about as many pairs (grouped by relation, from their
    host offsets), each with the relations [first, last) whose pairs it holds (a relation's pairs may
    span ranges: no block is larger than its share however skewed the relations are)."""
    total = bounds[-1]
    size = max(-(-total // blocks), 1)
    return [(start, min(start + size, total), bisect.bisect_right(bounds, start) - 1,
             bisect.bisect_left(bounds, min(start + size, total))) for start in range(0, total, size)]


def _pair_blocks(graph: SortedGraph, pairs: _SourcePairs, num_nodes: int, mean: bool) -> _PairBlocks:
    """The graph's edges split by ranges of the pairs they read (a subsequence of dst-sorted edges stays
    sorted). One device->host sync per block (its edge count), once per graph: eager only."""
    counts = _segment_counts(graph.dst) if mean else None
    sources, parts = pairs.sources, []
    ranges = _pair_ranges(sources.bounds, _pair_range_count(sources.bounds[-1], num_nodes))
    for start, end, first, last in ranges:
        keep = ((sources.of_edge >= start) & (sources.of_edge < end)).nonzero().squeeze(1)
        ptr = sources.ptr[first:last + 1].clamp(start, end) - start
        bounds = [min(max(bound, start), end) - start for bound in sources.bounds[first:last + 1]]
        parts.append(_PairBlock(sources.of_edge.index_select(0, keep) - start, pairs.dst.index_select(0, keep),
                                None if counts is None else counts.index_select(0, keep),
                                ptr, bounds, first, last, start, end))
    return _PairBlocks(sources.node, parts)


def _derived_indices():
    """Validation off, for the per-range indices geot.nn derives from a graph it has checked: three a range,
    up to 96, more than validation's cache holds, each would be checked again, with a device->host sync,
    on every call."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else validation(False)


def _add_part(out: Optional[Tensor], part: Tensor) -> Tensor:
    """out + part, in place on out (None: part); compiled, geot::accumulate_, so each part is freed once added."""
    if out is None:
        return part
    if torch.compiler.is_compiling():
        torch.ops.geot.accumulate_(out, part)
        return out
    return out.add_(part)


def _eager_inference() -> bool:
    """Whether this call may add into the layer's own output in place (compiled code fuses the adds)."""
    return not (torch.compiler.is_compiling() or torch.is_grad_enabled())


def _plus(out: Tensor, term: Tensor) -> Tensor:
    """out + term: in place on out (the layer's own) in eager inference where the sum keeps out's dtype
    and shape (peak memory: the root and bias terms)."""
    if (_eager_inference() and torch.result_type(out, term) == out.dtype
            and torch.broadcast_shapes(out.shape, term.shape) == out.shape):
        return out.add_(term)
    return out + term


def _plus_product(out: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """out + x @ weight: in eager inference added in place by the matmul (no [N, C_out] product besides
    out) where the product's dtype and shape are out's (no autocast)."""
    if (_eager_inference() and not torch.is_autocast_enabled(x.device.type)
            and out.dtype == x.dtype == weight.dtype and out.shape == (x.size(0), weight.size(-1))):
        return out.addmm_(x, weight)
    return out + x @ weight


def _records_grad(x_src: Tensor, weight: Tensor) -> bool:
    """Whether this call records gradients for x or the relation weights (training)."""
    return torch.is_grad_enabled() and (x_src.requires_grad or weight.requires_grad)


def _segment_counts(segments: Tensor) -> Tensor:
    """[E] the edges of each edge's segment (sorted segment ids), in their dtype; no [segments] tensor."""
    _, inverse, counts = torch.unique_consecutive(segments, return_inverse=True, return_counts=True)
    return counts.to(segments.dtype).index_select(0, inverse)


def _inverse(counts: Tensor, dtype) -> Tensor:
    """1 / counts in dtype, divided in float64, which autocast leaves alone (CUDA autocast runs a
    half-precision reciprocal in float32)."""
    return counts.to(torch.float64).reciprocal().to(dtype)


def _embedding_edges(graph: SortedGraph, relations: int, in_channels: int, x_src: Tensor) -> _RelationEdges:
    """Featureless RGCN's edges over the weights [R * C_in, C_out]: the row
    of edge j -> i of relation r is r * C_in + x_src[j]."""
    relation = graph.dst.remainder(relations)
    node = x_src.to(graph.src.dtype).index_select(0, graph.src)
    return _RelationEdges(relation * in_channels + node, graph.dst.div(relations, rounding_mode="floor"))


class RGCNConv(GeotLayer, pyg_nn.RGCNConv):
    """``torch_geometric.nn.RGCNConv`` on geot. Where C_out > C_in, one
    ``index_segment_reduce`` into (node, relation) segments gives every
    relation's mean (or sum) at once, [N, R * C_in], then one matmul with
    the stacked relation weights. Where C_out <= C_in it projects first
    (every x_j W_r, [N_src * R, C_out]) and gathers those rows, weighted by
    1 / the edges of their (node, relation) segment for a mean: no wider
    rows to gather, a table no larger, and no [N, R * C_in] aggregate kept
    for backward (peak memory); in eager inference, where that table is
    wider than x, a few relations at a time, and at equal widths (training
    too) one relation at a time reduced first, over the destinations it
    reaches (peak memory). Where
    the (node, relation) segments outnumber the edges (many relations),
    x_j W_r once per distinct (source, relation) pair (one
    ``segment_matmul``), gathered over the edges: no [N * R, C] table; in
    inference past PAIR_BLOCK_MIN_BYTES of table, a range of pairs at a
    time (peak memory). ``num_bases`` as PyG; ``num_blocks``: every
    relation's aggregate, then its blocks; featureless nodes (``x`` None or
    node indices, also in a pair): rows gathered straight from the weights.
    Takes an ``edge_index`` (either ``flow``) or a ``SparseTensor`` adj_t
    holding the relations."""

    _aggregations = ("mean", "add", "sum")

    def _pyg_attributes(self) -> dict:
        # PyG's forward sets this on its first call, before which TorchScript cannot type it; False is its
        # value without pyg-lib's segment_matmul.
        if self.__dict__.get("_use_segment_matmul_heuristic_output") is None:
            return {"_use_segment_matmul_heuristic_output": False}
        return {}

    def forward(self, x, edge_index, edge_type: Optional[Tensor] = None) -> Tensor:
        x_src, x_dst = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        every_node = x_src is None  # featureless: node j's embedding is row j of each relation's weight
        if every_node:
            x_src = torch.arange(self.in_channels_l, device=self.weight.device)
        x_dst = x_src if not isinstance(x, tuple) else x_dst
        reason = self._call_reason(x_src, x_dst, edge_index)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_type)
        edges = edges_of(edge_index)
        if edges.kind == "SparseTensor":
            edge_type = edges.values
        if edge_type is None:
            raise ValueError("geot.nn.RGCNConv needs edge_type, one relation per edge")
        num_nodes = x_dst.size(0)
        weight = self.weight
        if self.num_bases is not None:
            weight = self.comp @ weight.view(self.num_bases, -1)
        if self.num_blocks is not None:
            out = self._reduce_then_blocks(edge_index, edge_type, x_src, weight, num_nodes)
        else:
            out = self._relations(edge_index, edge_type, x_src, x_dst,
                                  weight.view(self.num_relations, -1, self.out_channels), num_nodes, every_node)
            if isinstance(out, _Finished):
                return out.out
        if self.root is not None:
            out = (_plus_product(out, x_dst, self.root) if x_dst.is_floating_point()
                   else _plus(out, self.root.index_select(0, x_dst)))
        return out if self.bias is None else _plus(out, self.bias)

    def _call_reason(self, x_src, x_dst, edge_index) -> Optional[str]:
        reason = self._option_reason() or self._input_reason(edge_index)
        if reason is not None:
            return reason
        if not isinstance(x_src, Tensor) or not isinstance(x_dst, Tensor):
            return "x of this type"
        if any(t.dim() != (2 if t.is_floating_point() else 1) for t in (x_src, x_dst)):
            return "x of this shape"
        if self.num_blocks is not None and not (x_src.is_floating_point() and x_dst.is_floating_point()):
            return "num_blocks with node indices for x"
        edges = edges_of(edge_index)
        if edges.kind == "torch.sparse":
            return "a torch.sparse adjacency (its values are not relations)"
        return flipped_pair_reason(Nodes(x_src, x_dst, x_dst is not x_src), edges, None, self._flipped())

    def _relations(self, edge_index, edge_type: Tensor, x_src: Tensor, x_dst: Tensor, weight: Tensor,
                   num_nodes: int, every_node: bool) -> Tensor:
        """sum_r aggr over j in N_r(i) of x_j W_r, for the three ways it is computed cheapest."""
        relations = self.num_relations
        if not x_src.is_floating_point():
            graph = sorted_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                                 num_relations=relations, transposed=False)
            return self._gather_embeddings(graph, x_src, weight, num_nodes, every_node)
        graph = None
        if num_nodes * relations > edges_of(edge_index).index.size(1):
            graph = sorted_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                                 num_relations=relations, transposed=False)
            compiling = torch.compiler.is_compiling()
            if not compiling or self._kept(edge_index, edge_type):
                if compiling:  # the pair tables, made while dynamo traces (data-dependent sizes)
                    num_src, num_nodes = fixed_sizes(x_src.size(0), num_nodes)
                    call_at_trace_time(_prepare_pairs_for_compiled, self, edge_index, edge_type, num_src,
                                       num_nodes, _records_grad(x_src, weight), matmul_dtype(x_src))
                return self._project_pairs_then_reduce(graph, x_src, weight, num_nodes)
            # A graph of one step in compiled code: its pair tables' sizes are data-dependent (they would
            # break the graph, and recompile for each step); the other ways take the graph as sorted there
            # (with no transposed index either way).
        projects = self._projects_first(x_src.size(-1))
        if graph is None:  # gathering projected rows, the backward pass reads their own transposed edges
            graph = sorted_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                                 num_relations=relations, transposed=not projects)
        if projects and torch.compiler.is_compiling() and self._kept(edge_index, edge_type):
            in_channels, num_nodes = fixed_sizes(x_src.size(-1), num_nodes)
            call_at_trace_time(_prepare_blocks_for_compiled, self, edge_index, edge_type, in_channels, num_nodes,
                               matmul_dtype(x_src), x_src.dtype, _records_grad(x_src, weight))
        if projects and self._trains_in_ranges(graph, x_src, weight):
            return self._reduce_then_project_in_ranges(graph, x_src, weight, num_nodes)
        if projects and self._in_blocks(graph, x_src, weight, num_nodes):
            cast, _ = cast_for_matmul(x_src, None)  # once, not per block
            if self._in_ranges(x_src.size(-1), cast.dtype, x_src.dtype):
                return self._reduce_then_project_in_ranges(graph, cast, weight, num_nodes, x_dst)
            return self._project_then_reduce_in_blocks(graph, cast, weight, num_nodes)
        if projects:
            return self._project_then_reduce(graph, x_src, weight, num_nodes)
        per_relation = gather_reduce(graph, x_src, REDUCE[self.aggr], num_nodes * relations)
        return per_relation.view(num_nodes, -1) @ weight.reshape(-1, self.out_channels)

    def _kept(self, edge_index, edge_type: Tensor) -> bool:
        """Inside torch.compile: whether the layer keeps this call's graph (values derived from it may be)."""
        return kept_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                          num_relations=self.num_relations) is not None

    def _projects_first(self, in_channels: int) -> bool:
        """Whether the rows gathered are x_j W_r (C_out features) rather than x_j (C_in): where that is no
        more features. At equal widths: reducing first, training keeps the [N, R * C_in] aggregate for the
        weights' gradient, and inference makes it whole; projecting first, training keeps nothing of
        [N * R, C] size (the table's gradient needs only the edges, the weights' x), and inference makes a
        block of relations at a time (_in_blocks). H100, bench/rgnn.py's mag (21M edges, 4 relations), two
        layers 64 -> 64, a training step: reducing first 24.1 ms and 1.10x PyG's peak memory, projecting
        first 21.7 ms and 0.67x; one layer 11.7 and 12.0 ms, 0.93x and 0.82x. One layer's inference,
        reducing first: 1.03x the peak of PyG's compiled loop."""
        return self.out_channels <= in_channels

    def _project_pairs_then_reduce(self, graph: SortedGraph, x_src: Tensor, weight: Tensor,
                                   num_nodes: int) -> Tensor:
        """Where (node, relation) segments outnumber the edges (many relations: most segments are empty,
        and an [N * R, C] table would be mostly zeros, or not fit): x_j W_r once per distinct (source,
        relation) pair, one ``segment_matmul`` over the pairs grouped by relation ([U, C_out], U <= E),
        then one gather-reduce of those rows over the edges, weighted by 1 / the edges of their
        (node, relation) segment for a mean."""
        relations = self.num_relations
        checked(graph, x_src.size(0), num_nodes * relations, relations)
        key = ("rgcn pairs", relations, x_src.size(0), num_nodes)
        grad, dtype = _records_grad(x_src, weight), matmul_dtype(x_src)
        blocks = None if grad else self._kept_pair_blocks(graph, x_src.size(0), dtype, num_nodes, key)
        if blocks is not None:
            return self._project_pairs_in_blocks(blocks, x_src, weight, num_nodes)
        pairs, edge_weight, transposed, weight_t = self._pair_tables(graph, key, dtype, grad)
        sources = pairs.sources
        table = typed_matmul(x_src.index_select(0, sources.node), sources.ptr, sources.bounds, weight)
        return index._fused(sources.of_edge, pairs.dst, edge_weight, table, "sum", num_nodes, transposed,
                            None, None, weight_t)

    def _pair_tables(self, graph: SortedGraph, key, dtype: torch.dtype, grad: bool):
        """(the pairs, a mean's edge weights, and where the call records gradients the transposed edges
        and weights of the backward pass; None where not needed), kept with the graph. key: the pairs'
        ("rgcn pairs", relations, source count, node count)."""
        relations, num_src, num_nodes = key[1:]
        pairs = graph.derived(key, lambda: _source_pairs(graph, num_src, num_nodes, relations))
        edge_weight = transposed = weight_t = None
        if self.aggr == "mean":
            edge_weight = graph.derived(("rgcn pair weights", relations, dtype),
                                        lambda: _inverse(_segment_counts(graph.dst), dtype))
        if grad:
            transposed = graph.derived(key + ("transposed",), lambda: transpose_index_as(
                pairs.sources.of_edge, pairs.dst, pairs.sources.of_edge.dtype))
            if edge_weight is not None:
                weight_t = graph.derived(key + ("transposed weights", dtype),
                                         lambda: edge_weight.index_select(0, transposed.perm))
        return pairs, edge_weight, transposed, weight_t

    def _kept_pair_blocks(self, graph: SortedGraph, num_src: int, dtype: torch.dtype, num_nodes: int,
                          key) -> Optional[_PairBlocks]:
        """Inference's ranges of pairs, where their table (of dtype) would pass PAIR_BLOCK_MIN_BYTES (None:
        the whole table). Kept in place of the pairs, which an eager call makes once and keeps only where
        it takes the whole table. Compiled code takes the blocks made eagerly (their sizes are
        data-dependent: see _prepare_pairs_for_compiled), else the whole table."""
        blocks_key = key + ("blocks",)
        if blocks_key in graph.memo:
            return graph.memo[blocks_key][2]
        if torch.compiler.is_compiling():
            return None
        kept = graph.memo.get(key)
        pairs = kept[2] if kept is not None else _source_pairs(graph, num_src, num_nodes, self.num_relations)
        if pairs.sources.bounds[-1] * self.out_channels * dtype.itemsize <= PAIR_BLOCK_MIN_BYTES:
            graph.derived(key, lambda: pairs)
            return None
        return graph.derived(blocks_key, lambda: _pair_blocks(graph, pairs, num_nodes, self.aggr == "mean"))

    def _project_pairs_in_blocks(self, blocks: _PairBlocks, x_src: Tensor, weight: Tensor,
                                 num_nodes: int) -> Tensor:
        """_project_pairs_then_reduce one range of pairs at a time, summed; each range's rows are let go
        before the next range's are made."""
        out = None
        with _derived_indices():
            for block in blocks.parts:
                table = typed_matmul(x_src.index_select(0, blocks.node[block.start:block.end]), block.ptr,
                                     block.bounds, weight[block.first:block.last])
                edge_weight = None if block.counts is None else _inverse(block.counts, table.dtype)
                part = index._fused(block.rows, block.dst, edge_weight, table, "sum", num_nodes, None, None)
                del table, edge_weight
                out = _add_part(out, part)
                del part
        return out

    def _reduce_then_blocks(self, edge_index, edge_type: Tensor, x_src: Tensor, weight: Tensor,
                            num_nodes: int) -> Tensor:
        """Block-diagonal weights: every relation's aggregate [N, R, C_in] at
        once, then each relation's blocks applied to it."""
        relations, blocks = self.num_relations, self.num_blocks
        graph = sorted_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                             num_relations=relations)
        per_relation = gather_reduce(graph, x_src, REDUCE[self.aggr], num_nodes * relations)
        per_relation = per_relation.view(num_nodes, relations, blocks, -1)
        out = torch.einsum("nrbi,rbio->nbo", per_relation, weight.view(relations, blocks, weight.size(-2), -1))
        return out.reshape(num_nodes, self.out_channels)

    def _gather_embeddings(self, graph: SortedGraph, x_src: Tensor, weight: Tensor, num_nodes: int,
                           every_node: bool) -> Tensor:
        """Featureless nodes (x_src: node indices into the weights): sum_r aggr
        over j in N_r(i) of W_r[x_src[j]], gathered straight from the weights
        [R * C_in, C_out], weighted by 1 / the edges of their (node, relation)
        segment for a mean. The rows are kept with the graph (and, for given
        indices, checked against that tensor)."""
        relations, table = self.num_relations, weight.reshape(-1, self.out_channels)
        key = ("rgcn embedding rows", relations, weight.size(1), every_node)
        given = None if every_node else x_src  # every node's own row: the rows depend on the graph alone
        edges = graph.derived(key, lambda: _embedding_edges(graph, relations, weight.size(1), x_src), given)
        edge_weight = None
        if self.aggr == "mean":
            edge_weight = graph.derived(("rgcn row weights", relations, num_nodes, table.dtype),
                                        lambda: _inverse_counts(graph, num_nodes * relations, table.dtype)
                                        .index_select(0, graph.dst))
        transposed = weight_t = None
        if table.requires_grad and torch.is_grad_enabled():
            transposed = graph.derived(key + ("transposed",),
                                       lambda: transpose_index_as(edges.rows, edges.dst, edges.rows.dtype), given)
            if edge_weight is not None:
                weight_t = edge_weight.index_select(0, transposed.perm)
        return index._fused(edges.rows, edges.dst, edge_weight, table, "sum", num_nodes, transposed,
                            None, None, weight_t)

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
        takes the blocks (and a mean's weights) made eagerly, by an eager
        call or while dynamo traces (_prepare_blocks_for_compiled: their
        sizes are data-dependent, so it cannot split the edges itself), else
        the whole table."""
        if _records_grad(x_src, weight) or not self._wider_than_x(x_src.size(-1)):
            return False  # no wider than x: one table (the edges training keeps, no blocks kept besides)
        in_channels, dtype = x_src.size(-1), matmul_dtype(x_src)
        keys = self._blocks_keys(in_channels, dtype, num_nodes, self._in_ranges(in_channels, dtype, x_src.dtype))
        return not torch.compiler.is_compiling() or all(key in graph.memo for key in keys if key is not None)

    def _trains_in_ranges(self, graph: SortedGraph, x_src: Tensor, weight: Tensor) -> bool:
        """Training at equal widths where a projected table would be wider than x (_RangesProduct): its
        peak is the output and one relation's rows, not a [N_src * R, C] table and its gradient. H100,
        bench/rgnn.py's mag (21M edges, 4 relations, 64 channels), a training step against the projected
        table in the same run: one layer 9.9 ms and 3386 MB peak against 11.7 ms and 4613 MB, two layers
        20.0 and 4439 against 21.1 and 5561 (x's gradient over the edges by source; with atomics in edge
        order, keeping no more edges, 27.7 ms). Compiled code takes the ranges made eagerly (see
        _in_blocks)."""
        in_channels = x_src.size(-1)
        if not (_records_grad(x_src, weight) and self._wider_than_x(in_channels)
                and self._in_ranges(in_channels, matmul_dtype(x_src), x_src.dtype)):
            return False
        return not torch.compiler.is_compiling() or self._ranges_key() in graph.memo

    def _wider_than_x(self, in_channels: int) -> bool:
        return self.num_relations * self.out_channels > in_channels

    def _blocks_keys(self, in_channels: int, dtype: torch.dtype, num_nodes: int, ranges: bool):
        """The memo keys (SortedGraph.derived) of this call's relation blocks and, for a mean, their edge
        weights in the matmul's dtype; or of its relation ranges (_in_ranges) and None."""
        if ranges:
            return self._ranges_key(), None
        blocks = ("rgcn blocks", self.num_relations, self._relations_per_block(in_channels))
        if self.aggr != "mean":
            return blocks, None
        return blocks, ("rgcn block weights", *blocks[1:], num_nodes, dtype)

    def _ranges_key(self):
        return "rgcn relation ranges", self.num_relations

    def _relations_per_block(self, in_channels: int) -> int:
        return max(1, in_channels // (2 * self.out_channels))

    def _project_then_reduce_in_blocks(self, graph: SortedGraph, x_src: Tensor, weight: Tensor,
                                       num_nodes: int) -> Tensor:
        """_project_then_reduce one block of relations at a time, summed."""
        in_channels = x_src.size(-1)
        blocks, block_weights = self._kept_blocks(graph, in_channels, x_src.dtype, num_nodes, False)
        block_weights = block_weights or [None] * len(blocks)
        out = None
        for block, edge_weight in zip(blocks, block_weights):
            block_weight = weight[block.first:block.first + block.width].transpose(0, 1).reshape(in_channels, -1)
            projected = (x_src @ block_weight).view(-1, self.out_channels)
            part = index._fused(block.rows, block.dst, edge_weight, projected, "sum", num_nodes, None, None)
            del projected  # each block's rows let go before the next block's are made
            out = _add_part(out, part)
            del part
        return out

    def _kept_blocks(self, graph: SortedGraph, in_channels: int, dtype: torch.dtype, num_nodes: int,
                     ranges: bool):
        """(blocked inference's relation blocks and a mean's block weights in dtype, the matmul's, or None;
        or with ranges its relation ranges and None), made once per graph and kept with it."""
        relations = self.num_relations
        blocks_key, weights_key = self._blocks_keys(in_channels, dtype, num_nodes, ranges)
        if ranges:
            return graph.derived(blocks_key, lambda: _relation_ranges(graph, relations)), None
        per_block = self._relations_per_block(in_channels)
        blocks = graph.derived(blocks_key, lambda: _relation_blocks(graph, relations, per_block))
        if weights_key is None:
            return blocks, None

        def mean_weights():
            inverse = _inverse_counts(graph, num_nodes * relations, dtype)
            return [inverse.index_select(0, block.segments(relations)) for block in blocks]
        return blocks, graph.derived(weights_key, mean_weights)

    def _in_ranges(self, in_channels: int, dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
        """Whether blocked inference (and training, _trains_in_ranges) takes one relation at a time, its
        mean (or sum) of x first, over the destinations it reaches alone, then its weight, added into the
        output's rows of that range (_reduce_then_project_in_ranges): at equal widths, where the rows it
        gathers are no wider than projected rows, and where the output may be written in place (the
        matmul's dtype is x's)."""
        return in_channels == self.out_channels and dtype == x_dtype

    def _reduce_then_project_in_ranges(self, graph: SortedGraph, x_src: Tensor, weight: Tensor,
                                       num_nodes: int, x_dst: Optional[Tensor] = None):
        """sum_r aggr over j in N_r(i) of x_j W_r, one relation at a time: its aggregate [hi - lo + 1, C]
        over the destinations it reaches, times W_r, added in place into those rows of the output. The
        peak is the output and one relation's aggregate (in a typed graph, one node type's rows), not a
        projected table and a partial sum of every node; no edge weights are kept (the kernel's mean).
        Training: _RangesProduct. Inference given x_dst starts the output from the root and bias terms
        where it can (_root_and_bias), and returns it _Finished: compiled code then makes no root product
        besides the output (it cannot add that in place), so its peak is eager's."""
        ranges, _ = self._kept_blocks(graph, x_src.size(-1), x_src.dtype, num_nodes, True)
        if _records_grad(x_src, weight):
            by_source = self._kept_by_source(graph, ranges) if x_src.requires_grad else None
            return _RangesProduct.apply(x_src, weight, ranges, by_source, REDUCE[self.aggr], num_nodes)
        start = None if x_dst is None else self._root_and_bias(x_dst)
        out = x_src.new_zeros(num_nodes, self.out_channels) if start is None else start
        _add_relation_products(out, ranges, x_src, weight, REDUCE[self.aggr])
        return out if start is None else _Finished(out)

    def _root_and_bias(self, x_dst: Tensor) -> Optional[Tensor]:
        """x_dst @ root + bias as a new tensor, where the layer has a root weight and x_dst, root and bias
        share a dtype; else None."""
        if self.root is None or not x_dst.is_floating_point() or x_dst.dtype != self.root.dtype:
            return None
        if self.bias is None:
            return x_dst @ self.root
        return torch.addmm(self.bias, x_dst, self.root) if self.bias.dtype == x_dst.dtype else None

    def _kept_by_source(self, graph: SortedGraph, ranges: list) -> list:
        """[_RangeBySource] of the relation ranges, made once where x takes a gradient."""
        return graph.derived(self._ranges_key() + ("by source",), lambda: list(map(_by_source, ranges)))


def _prepare_blocks_for_compiled(layer: RGCNConv, edge_index, edge_type: Tensor, in_channels: int, num_nodes: int,
                                 dtype: torch.dtype, x_dtype: torch.dtype, grad: bool) -> None:
    """Run while dynamo traces (see geot.nn.graph.call_at_trace_time): blocked inference's relation blocks
    or ranges, and training's ranges with their edges by source: their sizes are data-dependent. Made
    eagerly and kept with the graph the layer keeps, so that a model compiled with no eager call first
    takes them too (not the whole projected table). The edges by source are made with training's ranges
    even where this layer's x takes no gradient: a later layer's may, and dynamo reads the graph's memo
    as the first layer found it."""
    graph = kept_graph(layer, edge_index, flipped=layer._flipped(), edge_type=edge_type,
                       num_relations=layer.num_relations)
    in_ranges = layer._in_ranges(in_channels, dtype, x_dtype)
    if graph is None or not layer._wider_than_x(in_channels) or (grad and not in_ranges):
        return
    blocks, _ = layer._kept_blocks(graph, in_channels, dtype, num_nodes, in_ranges)
    if grad:
        layer._kept_by_source(graph, blocks)


def _prepare_pairs_for_compiled(layer: RGCNConv, edge_index, edge_type: Tensor, num_src: int, num_nodes: int,
                                grad: bool, dtype: torch.dtype) -> None:
    """Run while dynamo traces (see geot.nn.graph.call_at_trace_time), on the graph the layer keeps for
    the compiled model's edge_index: what _project_pairs_then_reduce reads (in inference the pair ranges
    or the pairs; in training the pairs and their transposed edges; a mean's weights), made eagerly and
    kept, so that the compiled code makes no table of data-dependent size (one graph, fullgraph=True)."""
    relations = layer.num_relations
    graph = kept_graph(layer, edge_index, flipped=layer._flipped(), edge_type=edge_type, num_relations=relations)
    if graph is None:
        return
    key = ("rgcn pairs", relations, num_src, num_nodes)
    if grad or layer._kept_pair_blocks(graph, num_src, dtype, num_nodes, key) is None:
        layer._pair_tables(graph, key, dtype, grad)
