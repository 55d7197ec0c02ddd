"""TransformerConv on geot."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import hetero
from ..sddmm import sddmm
from ..segment import segment_reduce
from .common import flipped_pair_reason, gather_reduce, node_inputs
from .graph import SortedGraph, checked, sorted_graph
from .inputs import edges_of, input_kind
from .layer import GeotLayer


class TransformerConv(GeotLayer, pyg_nn.TransformerConv):
    """``torch_geometric.nn.TransformerConv`` on geot: each head's scores
    ``query_i . key_j / sqrt(C)`` are one ``geot.sddmm`` dot (no gathered
    [E, H, C] rows), their softmax over each node's incoming edges is
    ``geot.edge_softmax``, and the attention-weighted sum of ``value_j`` is
    one multi-head ``index_weight_segment_reduce``. With ``edge_dim``, the
    projected edge features join the keys and the values per edge (an
    [E, H, C] term, as in PyG). Takes one x or a bipartite pair, an
    ``edge_index`` (either ``flow``), ``beta``, ``root_weight``, ``concat``,
    ``dropout`` and ``return_attention_weights`` (the weights in the input's
    edge order); a sparse adjacency, ``edge_attr`` without ``edge_dim``,
    hooks and explain mode run PyG's forward."""

    _aggregations = ("add", "sum")

    def forward(self, x, edge_index, edge_attr: Optional[Tensor] = None,
                return_attention_weights: Optional[bool] = None):
        reason = self._call_reason(x, edge_index, edge_attr)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_attr, return_attention_weights)
        heads, channels = self.heads, self.out_channels
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        query = self.lin_query(x_dst).view(-1, heads, channels)
        key = self.lin_key(x_src).view(-1, heads, channels)
        value = self.lin_value(x_src).view(-1, heads, channels)
        num_nodes = x_dst.size(0)
        graph = checked(sorted_graph(self, edge_index, flipped=self._flipped()), x_src.size(0), num_nodes)
        edge = None
        if edge_attr is not None:  # [E', H, C] in graph order, added to each edge's key and value
            edge = self.lin_edge(graph.edge_values(edge_attr)).view(-1, heads, channels)
        alpha = hetero.edge_softmax(self._scores(graph, query, key, edge), graph.dst, num_nodes)
        weights = F.dropout(alpha, p=self.dropout, training=self.training)
        out = gather_reduce(graph, value, "sum", num_nodes, weights)
        if edge is not None:
            out = out + segment_reduce(graph.dst, weights.unsqueeze(-1) * edge, "sum", num_nodes)
        out = out.reshape(num_nodes, heads * channels) if self.concat else out.mean(dim=1)
        out = self._with_root(out, x_dst)
        if isinstance(return_attention_weights, bool):
            return out, (edge_index, graph.input_order(alpha))
        return out

    def _call_reason(self, x, edge_index, edge_attr) -> Optional[str]:
        reason = self._option_reason() or self._input_reason(edge_index)
        if reason is not None:
            return reason
        if input_kind(edge_index) != "edge_index":
            return "a sparse adjacency"
        if edge_attr is not None and self.lin_edge is None:
            return "edge_attr without edge_dim (added to the values as given)"
        pair = x if isinstance(x, (tuple, list)) else (x, x)
        if len(pair) != 2 or not all(isinstance(t, Tensor) and t.dim() == 2 and t.is_floating_point()
                                     for t in pair):
            return "x of this kind"
        return flipped_pair_reason(node_inputs(x), edges_of(edge_index), None, self._flipped())

    def _scores(self, graph: SortedGraph, query: Tensor, key: Tensor, edge: Optional[Tensor]) -> Tensor:
        """[E', H] query_i . (key_j + edge) / sqrt(C), in graph order."""
        score = sddmm(graph.src, graph.dst, key, query)
        if edge is not None:
            score = score + (torch.ops.geot.segment_broadcast(query, graph.dst) * edge).sum(-1)
        return score / math.sqrt(self.out_channels)

    def _with_root(self, out: Tensor, x_dst: Tensor) -> Tensor:
        """The skip connection, gated by beta where the layer has one (as PyG)."""
        if not self.root_weight:
            return out
        x_r = self.lin_skip(x_dst)
        if self.lin_beta is None:
            return out + x_r
        beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
        return beta * x_r + (1 - beta) * out
