"""SAGEConv on geot."""
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import _ops
from .common import (REDUCE, cast_for_matmul, gather_reduce_nodes, linear_relu, linear_sum, matmul_dtype,
                     node_inputs)
from .layer import GeotLayer


class SAGEConv(GeotLayer, pyg_nn.SAGEConv):
    """``torch_geometric.nn.SAGEConv`` on geot (aggr "mean", "sum"/"add",
    "max" or "min": one ``index_segment_reduce``), for one x or a bipartite
    pair (x_src, x_dst or None) with ``size``, an ``edge_index`` (either
    ``flow``) or a sparse ``adj_t``, static graphs ``x`` [B, N, F], and
    ``project``. For mean and sum with fewer output than input channels,
    ``lin_l`` is applied before the aggregation (they commute), so fewer
    features are gathered per edge; results then differ from PyG's by
    rounding only. Otherwise, in inference under autocast, x is cast before
    the aggregation (the Linears would cast the aggregate and x): half the
    bytes gathered and no float32 [N, F] aggregate or copy of x besides
    (peak memory); a mean or sum then differs from PyG's by that rounding of
    x, a max not at all. With ``project``, inference projects the sources
    with the ReLU in the GEMM's epilogue. Aggregation lists and modules
    (multi-aggregation, LSTM, ...) run PyG's forward."""

    _aggregations = tuple(REDUCE)

    def forward(self, x, edge_index, size=None) -> Tensor:
        nodes = node_inputs(x)
        reason = self._pair_call_reason(nodes, edge_index, size)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, size)
        x_src, x_dst = nodes.src, nodes.dst
        if self.project:  # the sources' rows only: PyG's root term reads x_dst as given
            projected = linear_relu(self.lin, x_src)  # in inference one GEMM with the ReLU in its epilogue
            x_src = self.lin(x_src).relu() if projected is None else projected
        reduce = REDUCE[self.aggr]
        graph, num_nodes, weight = self._aggregation_graph(nodes, edge_index, size,
                                                           any_order=reduce in ("sum", "mean"))
        if self._project_first(x_src, reduce):
            root = None
            cast, x_dst = cast_for_matmul(x_src, x_dst)  # one cast for both projections
            # lin_l commutes with mean and sum: aggregate the narrower projected
            # rows (bias after, so a node without edges still gets it).
            if self.root_weight and x_dst is cast and num_nodes == cast.size(-2):
                projected, root = self._project_pair(cast)
            else:
                projected = F.linear(cast, self.lin_l.weight)
            out = gather_reduce_nodes(graph, projected, reduce, num_nodes, weight)
            out = out if self.lin_l.bias is None else out + self.lin_l.bias
            if root is None and self.root_weight and x_dst is not None:
                root = self.lin_r(x_dst)
            out = out if root is None else out + root
        else:
            if not torch.is_grad_enabled() and matmul_dtype(x_src) != x_src.dtype:
                x_src, x_dst = cast_for_matmul(x_src, x_dst)  # lin_l casts the mean, lin_r x: cast x once, first
            terms = [(gather_reduce_nodes(graph, x_src, reduce, num_nodes, weight), self.lin_l)]
            if self.root_weight and x_dst is not None:
                terms.append((x_dst, self.lin_r))
            out = linear_sum(terms)
        return F.normalize(out, p=2.0, dim=-1) if self.normalize else out

    def _project_pair(self, x: Tensor):
        """(x lin_l.weight^T, lin_r(x)); in compiled inference one op
        (geot::linear_pair: x freed before the aggregation, peak memory)."""
        weight, other, bias = self.lin_l.weight, self.lin_r.weight, self.lin_r.bias
        if x.dim() != 2 or not _ops.compiled_without_grad(x, weight, other, bias):
            return F.linear(x, weight), self.lin_r(x)
        bias = None if bias is None else bias.to(x.dtype)
        return torch.ops.geot.linear_pair(x, weight.to(x.dtype), other.to(x.dtype), bias)

    def _project_first(self, x_src: Tensor, reduce: str) -> bool:
        weight = self.lin_l.weight
        # isinstance rather than torch.nn.parameter.is_lazy, which torch.compile cannot trace
        return (reduce in ("mean", "sum") and not isinstance(weight, torch.nn.parameter.UninitializedParameter)
                and weight.size(0) < x_src.size(-1))

