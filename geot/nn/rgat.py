"""RGATConv on geot."""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import hetero, index
from .common import Nodes, Pairs, distinct_pairs, sizes_reason, typed_matmul
from .graph import (SortedGraph, call_at_trace_time, checked, kept_graph, prepare_for_compiled, sorted_graph,
                    transpose_index_as)
from .inputs import edges_of, input_kind
from .layer import GeotLayer

_MODS = ("additive", "scaled", "f-additive", "f-scaled")


class _RelationGraph(NamedTuple):
    """RGAT's view of a graph sorted by (destination, relation)."""
    dst: Tensor        # [E] destination node, sorted
    sources: Pairs     # (source, relation) pairs
    targets: Pairs     # (destination, relation) pairs
    degree: Tensor     # [N] edges into each node (the scaled mods), float32
    segment: Tensor    # [E] each edge's (destination, relation) segment among the non-empty ones, sorted
    segments: int      # how many are non-empty (within-relation softmax: not N * R segments)


def _relation_graph(graph: SortedGraph, num_nodes: int, relations: int) -> _RelationGraph:
    if graph.src.numel() and bool((graph.src.min() < 0) | (graph.src.max() >= num_nodes)
                                  | (graph.dst.max() >= num_nodes * relations)):
        raise ValueError(f"edge_index has ids outside [0, {num_nodes})")
    relation = graph.dst.remainder(relations)
    dst = graph.dst.div(relations, rounding_mode="floor")
    degree = torch.bincount(dst.long(), minlength=num_nodes).float()
    distinct, segment = torch.unique_consecutive(graph.dst, return_inverse=True)
    return _RelationGraph(dst, distinct_pairs(graph.src, relation, num_nodes, relations),
                          distinct_pairs(dst, relation, num_nodes, relations), degree,
                          segment.to(graph.dst.dtype), distinct.numel())


class RGATConv(GeotLayer, pyg_nn.RGATConv):
    """``torch_geometric.nn.RGATConv`` on geot. Every distinct (source,
    relation) pair's projection x_j W_r is one row of a table made by one
    ``geot.segment_matmul`` (pairs grouped by relation), and its key
    ``x_j W_r k`` comes from that table; the queries are ``x_i (W_r q)``
    for each distinct (destination, relation) pair (the weights multiplied
    first: [C_in, H * dim] per relation, not [C_in, H * C]). The attention
    is one ``geot.edge_softmax`` per destination (across relations) or per
    (destination, relation) segment (within), and the weighted sum one
    multi-head ``index_weight_segment_reduce`` that gathers the table's rows
    (no [E, H * C] messages). Runs ``num_bases``, ``num_blocks``, both
    attention modes and mechanisms, ``heads``, ``dim``, ``concat``, every
    ``mod``, ``dropout``, ``edge_dim`` with ``edge_attr`` and
    ``return_attention_weights`` (the weights in the input's edge order)
    over an ``edge_index``; a sparse adjacency runs PyG's forward. Inside
    ``torch.compile`` the graph and its pairs are built while dynamo
    traces, from the compiled model's ``edge_index`` and ``edge_type``
    inputs (no eager warm-up), and kept; a layer whose graph changes
    between calls, or is computed inside the compiled code, runs PyG's
    forward there (the pairs have data-dependent sizes)."""

    def forward(self, x, edge_index, edge_type: Optional[Tensor] = None, edge_attr: Optional[Tensor] = None,
                size=None, return_attention_weights=None):
        reason = self._call_reason(x, edge_index, edge_type, edge_attr, size)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_type, edge_attr, size, return_attention_weights)
        num_nodes, relations = x.size(0), self.num_relations
        if torch.compiler.is_compiling():
            graph = self._compiled_graph(edge_index, edge_type, num_nodes)
            if graph is None:
                return self._pyg_forward("torch.compile where the graph is not the one the layer was compiled "
                                         "on (its pairs have data-dependent sizes)", x, edge_index, edge_type,
                                         edge_attr, size, return_attention_weights)
        else:
            graph = self._graph(edge_index, edge_type, num_nodes)
        rel = graph.derived(("rgat pairs", relations, num_nodes),
                            lambda: _relation_graph(graph, num_nodes, relations))
        projected, alpha = self._attention(rel, x, graph.edge_values(edge_attr), num_nodes)
        out = self._aggregate(graph, rel, projected, alpha, num_nodes)
        out = self._update(out, num_nodes)
        if isinstance(return_attention_weights, bool):
            return out, (edge_index, graph.input_order(alpha))
        return out

    def _call_reason(self, x, edge_index, edge_type, edge_attr, size) -> Optional[str]:
        reason = self._option_reason() or self._input_reason(edge_index)
        if reason is not None:
            return reason
        if input_kind(edge_index) != "edge_index":
            return "a sparse adjacency"
        if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
            return "x that is not a [N, F] float tensor"
        edges = edges_of(edge_index)
        if not isinstance(edge_type, Tensor) or edge_type.shape != (edges.index.size(1),):
            return "edge_type that is not one relation per edge"
        if edge_attr is not None and (self.lin_edge is None or edge_attr.dim() > 2
                                      or edge_attr.size(0) != edge_type.numel()):
            return "edge_attr without edge_dim, or not one row per edge"
        return sizes_reason(Nodes(x, x, False), edges, size)

    def _graph(self, edge_index, edge_type: Tensor, num_nodes: int) -> SortedGraph:
        graph = sorted_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                             num_relations=self.num_relations, transposed=False, keep_perm=True)
        return checked(graph, num_nodes, num_nodes * self.num_relations, self.num_relations)

    def _compiled_graph(self, edge_index, edge_type: Tensor, num_nodes: int) -> Optional[SortedGraph]:
        """Inside torch.compile: the layer's graph with its pairs, built while dynamo traces where the layer
        has none (guarded by identity); None where its graph is another one, or computed in compiled code."""
        call_at_trace_time(_prepare_for_compiled, self, edge_index, edge_type, num_nodes, torch.is_grad_enabled())
        graph = kept_graph(self, edge_index, flipped=self._flipped(), edge_type=edge_type,
                           num_relations=self.num_relations, keep_perm=True)
        if graph is None or ("rgat pairs", self.num_relations, num_nodes) not in graph.memo:
            return None
        return graph

    def _attention(self, rel: _RelationGraph, x: Tensor, edge_attr: Optional[Tensor], num_nodes: int):
        """(each source pair's x_j W_r [U, H * C], the attention [E, H * dim] in graph order)."""
        weight = self._relation_weights()
        sources, targets = rel.sources, rel.targets
        projected = typed_matmul(x.index_select(0, sources.node), sources.ptr, sources.bounds, weight)
        key = projected @ self.k
        query = typed_matmul(x.index_select(0, targets.node), targets.ptr, targets.bounds,
                             weight @ self.q.to(weight.dtype))
        score = self._scores(query.index_select(0, targets.of_edge), key.index_select(0, sources.of_edge),
                             edge_attr)
        if self.attention_mechanism == "within-relation":
            return projected, hetero.edge_softmax(score, rel.segment, rel.segments)
        return projected, hetero.edge_softmax(score, rel.dst, num_nodes)

    def _relation_weights(self) -> Tensor:
        """[R, C_in, H * C]: each relation's weight, bases combined, blocks laid on the diagonal."""
        relations, in_channels = self.num_relations, self.in_channels
        if self.num_bases is not None:
            return (self.att @ self.basis.view(self.num_bases, -1)).view(relations, in_channels, -1)
        if self.num_blocks is None:
            return self.weight
        blocks = self.num_blocks
        diagonal = torch.eye(blocks, dtype=self.weight.dtype, device=self.weight.device)
        return torch.einsum("rbio,bc->rbico", self.weight, diagonal).reshape(relations, in_channels, -1)

    def _scores(self, query: Tensor, key: Tensor, edge_attr: Optional[Tensor]) -> Tensor:
        """[E, H * dim] attention logits, in graph order."""
        edge = None
        if edge_attr is not None:
            edge_attr = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
            edge = edge_attr @ (self.lin_edge.weight.t() @ self.e).to(edge_attr.dtype)
        if self.attention_mode == "additive-self-attention":
            score = query + key if edge is None else query + key + edge
            return F.leaky_relu(score, self.negative_slope)
        return query * key if edge is None else query * key * edge

    def _aggregate(self, graph: SortedGraph, rel: _RelationGraph, projected: Tensor, alpha: Tensor,
                   num_nodes: int) -> Tensor:
        """[N, H, dim, C]: sum over each node's edges of the message PyG's ``mod`` makes."""
        heads, dim, channels = self.heads, self.dim, self.out_channels
        mod = self.mod if self.mod in _MODS else None
        weights = alpha
        if mod == "f-additive":
            weights = torch.where(alpha > 0, alpha + 1, alpha)
        elif mod == "f-scaled":
            weights = alpha * rel.degree.to(alpha.dtype).index_select(0, rel.dst).unsqueeze(-1)
        elif mod is None and self.training and self.dropout > 0:
            weights = F.dropout(alpha, p=self.dropout, training=True)
        rows = projected.view(-1, heads, 1, channels)
        table = rows.expand(-1, heads, dim, channels).reshape(-1, heads * dim, channels) if dim > 1 else \
            projected.view(-1, heads, channels)
        out = self._gather(graph, rel, table, weights, num_nodes).view(num_nodes, heads, dim, channels)
        if mod == "additive":
            out = out + self.w * self._gather(graph, rel, projected.view(-1, heads, channels), None,
                                              num_nodes).view(num_nodes, heads, 1, channels)
        elif mod == "scaled":
            degree = rel.degree.to(out.dtype).view(-1, 1)
            scale = torch.relu(degree @ self.l1 + self.b1) @ self.l2 + self.b2
            out = out * scale.view(num_nodes, 1, 1, channels)
        return out

    def _gather(self, graph: SortedGraph, rel: _RelationGraph, table: Tensor, weights: Optional[Tensor],
                num_nodes: int) -> Tensor:
        """out[i] = sum over edges e into i of weights[e] * table[pair of e's source]."""
        rows, dst = rel.sources.of_edge, rel.dst
        transposed = None
        if torch.is_grad_enabled() and table.requires_grad:
            transposed = graph.derived(("rgat transposed", self.num_relations, num_nodes),
                                       lambda: transpose_index_as(rows, dst, rows.dtype))
        return index._fused(rows, dst, weights, table, "sum", num_nodes, transposed, None)

    def _update(self, out: Tensor, num_nodes: int) -> Tensor:
        """The heads concatenated or averaged (PyG's ``update``), the bias added."""
        out = out.reshape(num_nodes, -1) if self.concat else out.mean(dim=1).reshape(num_nodes, -1)
        return out if self.bias is None else out + self.bias


def _prepare_for_compiled(layer: RGATConv, edge_index, edge_type: Tensor, num_nodes: int, grad: bool) -> None:
    """Run while dynamo traces (see geot.nn.graph.call_at_trace_time): the layer's first graph, its pairs
    and, where the call records gradients, its transposed pairs, built eagerly and kept."""
    relations = layer.num_relations
    if not prepare_for_compiled(layer, edge_index, layer._flipped(), False, edge_type=edge_type,
                                num_relations=relations, keep_perm=True):
        return
    graph = layer._graph(edge_index, edge_type, num_nodes)
    rel = graph.derived(("rgat pairs", relations, num_nodes), lambda: _relation_graph(graph, num_nodes, relations))
    if grad:
        graph.derived(("rgat transposed", relations, num_nodes),
                      lambda: transpose_index_as(rel.sources.of_edge, rel.dst, rel.sources.of_edge.dtype))
