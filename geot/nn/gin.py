"""GINConv on geot."""
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import _ops, validation
from ..config import explain, long_segment_level
from .common import cast_for_matmul, gather_reduce_nodes, has_module_hooks, linear_relu, matmul_dtype, node_inputs
from .graph import SortedGraph, checked
from .layer import GeotLayer


class GINConv(GeotLayer, pyg_nn.GINConv):
    """``torch_geometric.nn.GINConv`` on geot: ``nn((1 + eps) x_i + sum_j x_j)``
    with the sum one ``index_segment_reduce``, for one x or a bipartite pair
    (x_src, x_dst or None) with ``size``, an ``edge_index`` (either
    ``flow``) or a sparse ``adj_t`` (a ``torch.sparse`` one's values weight
    the sum, as in PyG), and static graphs ``x`` [B, N, F]. In inference
    under autocast, where ``nn`` begins with a Linear (which casts the sum
    to the autocast dtype), x is cast first and the sum accumulates in
    float32 from those values: half the bytes gathered and no float32 [N, F]
    sum (peak memory); the output differs from PyG's by that rounding of x
    (1.16x PyG's error norm against float32, median of 30 random bf16
    cases). On CUDA only where the half-precision sum keeps no fp32 rows
    (see :func:`_cast_first_saves_memory`). Training keeps PyG's float32
    sum: there the rounding would also move which of nn's ReLUs fire, and
    with them the gradients. Inference on one x takes the sum and ``(1 +
    eps) x`` as one op (geot::index_sum_plus_scaled: on CUDA one pass over
    the output; compiled, a lower peak). Where ``nn`` is a Linear, a
    Sequential that begins with one or PyG's two-layer MLP with no norm,
    and that Linear has fewer output than input features (and no autocast
    cast), it is applied before the sum (they commute), so fewer features
    are gathered per edge; results then differ from PyG's by rounding only. In inference, an ``nn`` that is a Sequential
    beginning with a Linear (with bias) and a ReLU, or PyG's two-layer MLP
    with no norm (as ``torch_geometric.nn.models.GIN`` builds it), takes
    that Linear and ReLU as one GEMM with the ReLU in its epilogue
    (``torch._addmm_activation``), where no autocast cast or hook would make
    it another call: no ReLU pass over the hidden rows."""

    def forward(self, x, edge_index, size=None) -> Tensor:
        nodes = node_inputs(x)
        reason = self._pair_call_reason(nodes, edge_index, size)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, size)
        x_src, x_dst = nodes.src, nodes.dst
        # Inference takes the sorted graph (its sum and (1 + eps) x are one op there).
        graph, num_nodes, weight = self._aggregation_graph(nodes, edge_index, size,
                                                           any_order=torch.is_grad_enabled())
        linear = _narrowing_linear(self.nn, x_src)
        if linear is not None:
            return self._project_first(linear, graph, x_src, x_dst, weight, num_nodes)
        if (not torch.is_grad_enabled() and _begins_with_linear(self.nn) and matmul_dtype(x_src) != x_src.dtype
                and _cast_first_saves_memory(graph, x_src, num_nodes)):
            x_src, x_dst = cast_for_matmul(x_src, x_dst)
        return _apply_nn(self.nn, self._sum(graph, x_src, x_dst, weight, num_nodes))

    def _project_first(self, linear, graph: SortedGraph, x_src: Tensor, x_dst, weight, num_nodes: int) -> Tensor:
        """nn's first Linear commutes with the sum: the sum of its narrower
        projections, its bias after (a node without edges gets it too), then
        the rest of nn."""
        projected_src = F.linear(x_src, linear.weight)
        projected_dst = projected_src if x_dst is x_src or x_dst is None else F.linear(x_dst, linear.weight)
        out = self._sum(graph, projected_src, None if x_dst is None else projected_dst, weight, num_nodes)
        out = out if linear.bias is None else out + linear.bias.to(out.dtype)
        if _two_layer_relu_mlp(self.nn):  # MLP.forward after its first Linear (no norm, no dropout in effect)
            return self.nn.lins[1](self.nn.act(out))
        for module in ([] if self.nn is linear else list(self.nn)[1:]):
            out = module(out)
        return out

    def _sum(self, graph: SortedGraph, x_src: Tensor, x_dst, weight, num_nodes: int) -> Tensor:
        """(1 + eps) x_dst + the sum of x_src over each node's edges (no self term where x_dst is None)."""
        if (graph.ordered and x_dst is x_src and x_src.dim() == 2 and weight is None and num_nodes == x_src.size(0)
                and _ops.records_no_grad(x_src, self.eps)):
            return _sum_plus_scaled(checked(graph, x_src.size(0), num_nodes), x_src, self.eps)
        out = gather_reduce_nodes(graph, x_src, "sum", num_nodes, weight)
        if x_dst is not None:  # in place on the sum (its backward does not read it): no second [N, F] (peak memory)
            out = out.addcmul_(x_dst, 1 + self.eps)
        return out


def _apply_nn(module: torch.nn.Module, h: Tensor) -> Tensor:
    """module(h); in inference, where module begins with a Linear and a ReLU
    (a Sequential, or PyG's MLP of two layers with no norm: GIN's usual
    MLPs), those two as one GEMM with the ReLU in its epilogue
    (:func:`geot.nn.common.linear_relu`), then the rest."""
    if (type(module) is torch.nn.Sequential and len(module) >= 2 and type(module[1]) is torch.nn.ReLU
            and not has_module_hooks(module) and not has_module_hooks(module[1])):
        out = linear_relu(module[0], h)
        if out is not None:
            for later in list(module)[2:]:
                out = later(out)
            return out
    elif _two_layer_relu_mlp(module):
        out = linear_relu(module.lins[0], h)
        if out is not None:  # MLP.forward's dropouts: none in eval
            return module.lins[1](out)
    return module(h)


def _two_layer_relu_mlp(module: torch.nn.Module) -> bool:
    """Whether module is PyG's MLP([in, hidden, out]) as GIN models build it
    (torch_geometric.nn.models.GIN) whose forward is ``lins[1](act(lins[0](x)))``:
    no norm, a ReLU, no dropout in effect and no hooks."""
    if type(module) is not pyg_nn.MLP or len(module.lins) != 2 or not module.plain_last:
        return False
    if type(module.act) is not torch.nn.ReLU or type(module.norms[0]) is not torch.nn.Identity:
        return False
    dropout = module.dropout if isinstance(module.dropout, (list, tuple)) else [module.dropout]
    if module.training and any(p > 0 for p in dropout):
        return False
    return not any(has_module_hooks(m) for m in (module, module.act, module.norms[0], module.lins[1]))


def _narrowing_linear(module: torch.nn.Module, x: Tensor):
    """nn's first Linear where nn is that Linear, a Sequential beginning
    with it or PyG's two-layer MLP of :func:`_two_layer_relu_mlp`, it has
    fewer output than input features, no hooks, and x is in the dtype it
    multiplies in (no autocast cast); else None."""
    if matmul_dtype(x) != x.dtype:
        return None
    if _two_layer_relu_mlp(module):
        first = module.lins[0]
    else:
        first = module[0] if isinstance(module, torch.nn.Sequential) and len(module) else module
    if not isinstance(first, (torch.nn.Linear, pyg_nn.Linear)):
        return None
    weight = first.weight
    if isinstance(weight, torch.nn.parameter.UninitializedParameter) or weight.size(0) >= x.size(-1):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (module, first)):
        return None
    return first


def _sum_plus_scaled(graph: SortedGraph, x: Tensor, eps: Tensor) -> Tensor:
    """(1 + eps) x[d] + the sum of x over the edges into d, one op without
    an autograd formula (GIN's inference; on CUDA one pass over the output,
    compiled a lower peak). The op adds the 1 itself: ``1 + eps`` would be a
    kernel launch of its own, and small graphs' layers are host-bound."""
    return torch.ops.geot.index_sum_plus_scaled(graph.src, graph.dst, x, eps, scale_offset=1.0)


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
    M_t edges, or one per segment), PR one per segment. (Rows of 64 or more
    features, a multiple of 8, take SR with shared ids whatever the rules
    say, keeping one chunk row per 16-256
    edges; this still reports the rules' schedule, so casting first stays
    where they pick SP: the half-row sum reads half the bytes.)"""
    edges = graph.dst.numel()
    if not edges or not validation.validation_enabled():  # unvalidated SP: no level, the [S, F] buffer
        return False
    level = long_segment_level(int(torch.bincount(graph.dst, minlength=num_nodes).max()))
    if edges < 2**16 and num_features <= 32 and level <= 1:  # half_short_segments: SP
        return True
    return explain(edges, num_nodes, num_features, gathered=True, long_segments=level).schedule == "SP"


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
