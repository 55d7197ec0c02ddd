"""GATConv on geot."""
from typing import Optional

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import _ops, hetero
from .common import (Nodes, flipped_pair_reason, gather_reduce, node_inputs, nodes_reason, num_targets,
                     pyg_looped, pyg_looped_attr, sizes_reason)
from .graph import SortedGraph, checked, sorted_graph
from .inputs import Edges, edges_of
from .layer import GeotLayer


# Where GAT inference takes attention_aggregate's one pass (see GATConv._one_pass).
ONE_PASS_MAX_CHANNELS = 32       # per head
ONE_PASS_MIN_HEADS = 4           # on graphs of ONE_PASS_ANY_HEADS_EDGES edges or more
ONE_PASS_ANY_HEADS_EDGES = 1 << 18


class AttentionHeads:
    """What GATConv and GATv2Conv share once the [E, H] scores are made (a
    mixin listed before the PyG layer: it reads PyG's heads, out_channels,
    concat, dropout, bias)."""

    def _looped_edges(self, edge_index: Tensor, edge_attr: Optional[Tensor], loops: Optional[int]):
        """(PyG's self-looped edge list: input loops removed, one loop per
        node appended; its sorted graph, kept per graph with its permutation so
        the weights go back to PyG's order; the edge features of those edges,
        loops filled as ``fill_value`` says, in the graph's order, or None)."""
        looped = edge_index if loops is None else pyg_looped(edge_index, loops)
        graph = sorted_graph(self, looped, flipped=self._flipped(), keep_perm=True)
        if edge_attr is not None and loops is not None:
            edge_attr = pyg_looped_attr(edge_index, edge_attr, self.fill_value, loops)
        return looped, graph, None if edge_attr is None else graph.edge_values(edge_attr)

    def _attention(self, score: Tensor, graph: SortedGraph, num_nodes: int) -> Tensor:
        # Without gradients the scores are not needed again: the softmax overwrites them (one [E, H] less).
        softmax = hetero.edge_softmax if torch.is_grad_enabled() and score.requires_grad else hetero.edge_softmax_
        return F.dropout(softmax(score, graph.dst, num_nodes), p=self.dropout, training=self.training)

    def _finish(self, out: Tensor, res: Optional[Tensor], num_nodes: int) -> Tensor:
        """The heads' [N, H, C] sums concatenated or averaged, the residual and the bias added."""
        out = out.reshape(num_nodes, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if res is not None:
            out = out + res
        return out if self.bias is None else out + self.bias


class GATConv(GeotLayer, AttentionHeads, pyg_nn.GATConv):
    """``torch_geometric.nn.GATConv`` on geot: ``geot.edge_softmax`` over
    each node's incoming edges and one multi-head
    ``index_weight_segment_reduce``; in inference (no gradient recorded, no
    dropout, no edge features, no attention weights returned) both in one
    pass, ``geot.attention_aggregate``. ``add_self_loops`` replaces the
    input's self loops by one per node, as PyG does (in training they stay
    in the edge list with zero attention, so the edge count does not depend
    on the data; in inference each node's loop is a term of its softmax).
    Takes one x or a bipartite pair (x_src, x_dst or None) with ``size``,
    an ``edge_index`` (either ``flow``) or a sparse ``adj_t``, edge features
    (``edge_dim``, ``fill_value``) and ``return_attention_weights`` (with an
    ``edge_index``: the self-looped edges and their weights in PyG's order);
    attention weights over a sparse adjacency run PyG's forward."""

    def forward(self, x, edge_index, edge_attr: Optional[Tensor] = None, size=None,
                return_attention_weights: Optional[bool] = None):
        nodes = node_inputs(x)
        edge_attr = edge_attr if self.lin_edge is not None else None  # PyG reads it only with edge_dim
        reason = self._call_reason(nodes, edge_index, edge_attr, size, return_attention_weights)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_attr, size, return_attention_weights)
        heads, channels = self.heads, self.out_channels
        lin_src, lin_dst = (self.lin, self.lin) if self.lin is not None else (self.lin_src, self.lin_dst)
        h_src = lin_src(nodes.src).view(-1, heads, channels)
        h_dst = None
        if nodes.dst is not None:
            h_dst = h_src if nodes.dst is nodes.src and lin_dst is lin_src else \
                lin_dst(nodes.dst).view(-1, heads, channels)
        res = None if self.res is None or nodes.dst is None else self.res(nodes.dst)
        edges = edges_of(edge_index)
        if edge_attr is not None or return_attention_weights:
            return self._with_edge_values(nodes, edges, edge_index, h_src, h_dst, res, edge_attr, size,
                                          return_attention_weights)
        loops = self._loops(nodes, edges, size)
        if self._one_pass(nodes, h_src, h_dst, loops, edges.index.size(1)):
            graph = sorted_graph(self, edge_index, flipped=self._flipped())
            num_nodes = num_targets(nodes, edges, size, graph)
            self._check_ids(graph, h_src, num_nodes)
            score_dst = None if h_dst is h_src else (h_dst * self.att_dst).sum(-1)
            out = hetero.attention_aggregate(h_src, None, score_dst, graph.src, graph.dst, num_nodes,
                                             self.negative_slope, loops is not None, att_src=self.att_src,
                                             att_dst=self.att_dst if score_dst is None else None)
            return self._finish(out, res, num_nodes)
        graph = sorted_graph(self, edge_index, flipped=self._flipped(), self_loops=loops)
        num_nodes = num_targets(nodes, edges, size, graph)
        self._check_ids(graph, h_src, num_nodes)
        score = self._scores(graph, h_src, h_dst)
        if graph.drop is not None:
            score = score.masked_fill(graph.drop.unsqueeze(-1), float("-inf"))
        alpha = self._attention(score, graph, num_nodes)
        return self._finish(gather_reduce(graph, h_src, "sum", num_nodes, alpha), res, num_nodes)

    @staticmethod
    def _check_ids(graph: SortedGraph, h_src: Tensor, num_nodes: int) -> None:
        """A static graph's ids against the node counts before the first op reads them (a ValueError naming
        edge_index). A graph of one step is left to the ops' own validation until the sum (gather_reduce
        checks it on the device and vouches for its indices: the attention kernels would take their
        most conservative configs)."""
        if not graph.deferred:
            checked(graph, h_src.size(0), num_nodes)

    def _call_reason(self, nodes: Optional[Nodes], edge_index, edge_attr, size, attention) -> Optional[str]:
        reason = (self._option_reason() or self._input_reason(edge_index)
                  or nodes_reason(nodes, self.node_dim, max_dim=2))
        if reason is not None:
            return reason
        edges = edges_of(edge_index)
        if edges.kind != "edge_index" and (edge_attr is not None or attention):
            return "edge features or attention weights over a sparse adjacency"
        return sizes_reason(nodes, edges, size) or flipped_pair_reason(nodes, edges, size, self._flipped())

    def _loops(self, nodes: Nodes, edges: Edges, size) -> Optional[int]:
        """How many nodes get a self loop (PyG's count), None without loops."""
        if not self.add_self_loops:
            return None
        if size is not None:
            return min(size)
        if edges.size is not None:
            return min(edges.size)
        count = nodes.src.size(0)
        return count if nodes.dst is None else min(count, nodes.dst.size(0))

    def _one_pass(self, nodes: Nodes, h_src: Tensor, h_dst: Optional[Tensor], loops: Optional[int],
                  num_edges: int) -> bool:
        """Whether attention_aggregate runs the call: inference (no gradient
        recorded, no dropout), with a destination score, a loop for every
        destination where there are loops, and heads it is the faster for.

        attention_aggregate walks a destination's edges with the lanes of its
        heads: with fewer than 4 heads a hub's walk is long, and with more
        than 32 channels per head, the two ops (edge_softmax, then the
        weighted sum, which split long segments) are the faster. H200, fp32
        and bf16, 6 graphs of 8.9e4-1.3e7 edges, 1-8 heads of 8-128
        channels: this choice reaches 0.955 of the faster per cell at the
        geomean, one pass everywhere 0.872 (worst 0.37: 1 head of 128 on a
        3M-edge power-law graph); small graphs take one pass at any head
        count."""
        if (h_dst is None or not _ops.records_no_grad(h_src, h_dst, self.att_src, self.att_dst)
                or (self.training and self.dropout > 0)):
            return False
        if h_src.size(-1) > ONE_PASS_MAX_CHANNELS or (h_src.size(-2) < ONE_PASS_MIN_HEADS
                                                      and num_edges >= ONE_PASS_ANY_HEADS_EDGES):
            return False
        return loops is None or not nodes.paired or loops == h_dst.size(0)

    def _scores(self, graph: SortedGraph, h_src: Tensor, h_dst: Optional[Tensor],
                score_edge: Optional[Tensor] = None) -> Tensor:
        """[E, H] leaky_relu(a_src . h_src[src] + a_dst . h_dst[dst] + edge term), in graph order."""
        score = torch.ops.geot.gather_rows((h_src * self.att_src).sum(-1), graph.src)
        if h_dst is not None:
            score = score + torch.ops.geot.segment_broadcast((h_dst * self.att_dst).sum(-1), graph.dst)
        if score_edge is not None:
            score = score + score_edge
        return F.leaky_relu(score, self.negative_slope)

    def _with_edge_values(self, nodes: Nodes, edges: Edges, edge_index, h_src, h_dst, res, edge_attr, size,
                          attention):
        """Edge features or attention weights returned: over PyG's self-looped
        edge list (:meth:`_looped_edges`), the weights in PyG's order."""
        looped, graph, edge_attr = self._looped_edges(edge_index, edge_attr, self._loops(nodes, edges, size))
        num_nodes = num_targets(nodes, edges, size, graph)
        self._check_ids(graph, h_src, num_nodes)
        score_edge = None if edge_attr is None else self._edge_scores(edge_attr)
        alpha = self._attention(self._scores(graph, h_src, h_dst, score_edge), graph, num_nodes)
        out = self._finish(gather_reduce(graph, h_src, "sum", num_nodes, alpha), res, num_nodes)
        if not attention:
            return out
        return out, (looped, graph.input_order(alpha))

    def _edge_scores(self, edge_attr: Tensor) -> Tensor:
        """[E, H] a_edge . lin_edge(edge_attr)."""
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        projected = self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)
        return (projected * self.att_edge).sum(-1)
