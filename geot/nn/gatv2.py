"""GATv2Conv on geot."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import _ops
from .common import Nodes, flipped_pair_reason, gather_reduce, node_inputs, nodes_reason, sizes_reason
from .gat import AttentionHeads
from .graph import SortedGraph, checked, sorted_graph
from .inputs import edges_of
from .layer import GeotLayer


class GATv2Conv(GeotLayer, AttentionHeads, pyg_nn.GATv2Conv):
    """``torch_geometric.nn.GATv2Conv`` on geot: each edge's score
    ``att . leaky_relu(x_l[j] + x_r[i] (+ lin_edge(e_ij)))`` from rows
    gathered in destination order, ``geot.edge_softmax`` over each node's
    incoming edges, and one multi-head ``index_weight_segment_reduce`` of
    the ``x_l`` rows (no [E, H, C] messages). ``add_self_loops`` replaces
    the input's self loops by one per node, as PyG does (the input's stay in
    the kept self-looped graph with zero attention; with edge features or
    returned weights the layer runs over PyG's self-looped edge list).
    Takes one x or a bipartite pair (x_src, x_dst), an ``edge_index``
    (either ``flow``) or a sparse ``adj_t``, edge features (``edge_dim``,
    ``fill_value``), attention dropout in training (PyG's distribution; the
    mask differs from PyG's for a seed: the edges are in another order) and
    ``return_attention_weights`` (with an ``edge_index``: the self-looped
    edges and their weights in PyG's order). Edge features or attention
    weights over a sparse adjacency, and the inputs PyG raises for, run
    PyG's forward."""

    def forward(self, x, edge_index, edge_attr: Optional[Tensor] = None,
                return_attention_weights: Optional[bool] = None):
        nodes = node_inputs(x)
        reason = self._call_reason(nodes, edge_index, edge_attr, return_attention_weights)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_attr, return_attention_weights)
        x_l, x_r = self._projections(nodes)
        res = None if self.res is None else self.res(nodes.dst)
        loops = min(x_l.size(0), x_r.size(0)) if self.add_self_loops else None
        if edge_attr is not None or return_attention_weights:
            return self._with_edge_values(edge_index, x_l, x_r, res, edge_attr, loops, return_attention_weights)
        num_nodes = x_r.size(0)
        graph = checked(sorted_graph(self, edge_index, flipped=self._flipped(), self_loops=loops),
                        x_l.size(0), num_nodes)
        score = self._scores(graph, x_l, x_r)
        if graph.drop is not None:  # the input's self loops, replaced by the added ones
            score = score.masked_fill(graph.drop.unsqueeze(-1), float("-inf"))
        alpha = self._attention(score, graph, num_nodes)
        return self._finish(gather_reduce(graph, x_l, "sum", num_nodes, alpha), res, num_nodes)

    def _call_reason(self, nodes: Optional[Nodes], edge_index, edge_attr, attention) -> Optional[str]:
        reason = (self._option_reason() or self._input_reason(edge_index)
                  or nodes_reason(nodes, self.node_dim, max_dim=2))
        if reason is not None:
            return reason
        if nodes.dst is None:
            return "x_dst None (PyG raises)"
        edges = edges_of(edge_index)
        reason = flipped_pair_reason(nodes, edges, None, self._flipped())
        if reason is not None:
            return reason
        if edge_attr is not None:
            if self.lin_edge is None:
                return "edge_attr without edge_dim (PyG raises)"
            if edge_attr.size(0) != edges.index.size(1):
                return "edge_attr of another length than the edges (PyG raises)"
        if edges.kind != "edge_index":
            if edge_attr is not None or attention:
                return "edge features or attention weights over a sparse adjacency"
            if edges.kind == "SparseTensor" and self.add_self_loops and self.edge_dim is not None:
                return "a SparseTensor with add_self_loops and edge_dim (PyG raises)"
        return sizes_reason(nodes, edges, None)

    def _projections(self, nodes: Nodes) -> Tuple[Tensor, Tensor]:
        """(x_l, x_r) as [N, H, C]: one projection where both are of the same rows by the same weights."""
        heads, channels = self.heads, self.out_channels
        x_l = self.lin_l(nodes.src).view(-1, heads, channels)
        shared = self.share_weights if not nodes.paired else nodes.dst is nodes.src and self.lin_r is self.lin_l
        return x_l, x_l if shared else self.lin_r(nodes.dst).view(-1, heads, channels)

    def _with_edge_values(self, edge_index, x_l: Tensor, x_r: Tensor, res: Optional[Tensor],
                          edge_attr: Optional[Tensor], loops: Optional[int], attention):
        """Edge features or attention weights returned: over PyG's self-looped
        edge list (:meth:`_looped_edges`), the weights in PyG's order."""
        looped, graph, edge_attr = self._looped_edges(edge_index, edge_attr, loops)
        num_nodes = x_r.size(0)
        graph = checked(graph, x_l.size(0), num_nodes)
        edge = None if edge_attr is None else self._projected_edges(edge_attr)
        alpha = self._attention(self._scores(graph, x_l, x_r, edge), graph, num_nodes)
        out = self._finish(gather_reduce(graph, x_l, "sum", num_nodes, alpha), res, num_nodes)
        return (out, (looped, graph.input_order(alpha))) if attention else out

    def _projected_edges(self, edge_attr: Tensor) -> Tensor:
        """[E, H, C] lin_edge(edge_attr), a [E] vector read as one feature per edge."""
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        return self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)

    def _scores(self, graph: SortedGraph, x_l: Tensor, x_r: Tensor, edge: Optional[Tensor] = None) -> Tensor:
        """[E', H] att . leaky_relu(x_l[src] + x_r[dst] + edge), in graph
        order. Without a gradient or edge features: one kernel per edge and
        head, no [E', H, C] sums. Else (or where autocast left the rows in
        another dtype than ``att``) the sums are built in one buffer (no
        backward pass reads its terms), which the activation overwrites
        where no gradient is recorded: the op's own backward would rebuild
        them and add into both ends with atomics (a hub's row serializes),
        where this path's reads of x_r need no atomics."""
        if edge is None and _ops.records_no_grad(x_l, x_r, self.att) and x_l.dtype == x_r.dtype == self.att.dtype:
            return torch.ops.geot.edge_additive_score(graph.src, graph.dst, x_r, x_l, self.att,
                                                      self.negative_slope, self.heads)
        pair = x_l.index_select(0, graph.src).add_(torch.ops.geot.segment_broadcast(x_r, graph.dst))
        if edge is not None:
            pair.add_(edge)
        activated = F.leaky_relu(pair, self.negative_slope, inplace=not pair.requires_grad)
        return (activated * self.att).sum(-1)
