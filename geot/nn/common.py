"""Helpers the geot layers share: node inputs, output sizes, the fused
gather-reduce over a sorted graph, dtypes under autocast."""
from typing import NamedTuple, Optional

import torch
import torch_geometric.nn as pyg_nn
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary
from torch_geometric.utils import add_self_loops, remove_self_loops

from .. import _C, _ops, index
from ..hetero import segment_matmul
from .._ops import mean_counts
from .graph import SortedGraph, checked
from .inputs import Edges

# PyG's aggr strings -> geot's reductions
REDUCE = {"add": "sum", "sum": "sum", "mean": "mean", "max": "max", "min": "min"}


class Nodes(NamedTuple):
    """A layer's x: one tensor, or a (source, destination) pair (PyG's bipartite input)."""
    src: Tensor
    dst: Optional[Tensor]   # the pair's second tensor (may be None); for one tensor, that tensor
    paired: bool


def node_inputs(x) -> Optional[Nodes]:
    """x as Nodes, or None for an x geot does not take (PyG's forward decides)."""
    if isinstance(x, Tensor):
        return Nodes(x, x, False)
    if (isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], Tensor)
            and (x[1] is None or isinstance(x[1], Tensor))):
        return Nodes(x[0], x[1], True)
    return None


def nodes_reason(nodes: Optional[Nodes], node_dim: int, max_dim: int = 3) -> Optional[str]:
    """Why these node features run PyG's forward, or None. geot takes [N, F]
    rows, and [B, N, F] (a static graph) where the node axis is -2."""
    if nodes is None:
        return "x of this type"
    for x in (nodes.src, nodes.dst):
        if x is None:
            continue
        if x.dim() not in (2, 3) or x.dim() > max_dim:
            return f"x of {x.dim()} dimensions"
        if node_dim % x.dim() != x.dim() - 2:
            return f"node_dim={node_dim} with x of {x.dim()} dimensions"
    if nodes.dst is not None and nodes.dst.dim() != nodes.src.dim():
        return "x_src and x_dst of different dimensions"
    return None


def sizes_reason(nodes: Nodes, edges: Edges, size) -> Optional[str]:
    """Why these sizes run PyG's forward (which raises where they disagree), or None."""
    given = [size] if size is not None else []
    if edges.size is not None:
        given.append(edges.size)
    for sizes in given:
        if len(sizes) != 2:
            return f"size={sizes}"
        if sizes[0] is not None and sizes[0] != nodes.src.size(-2):
            return "a size that disagrees with x"
        if sizes[1] is not None and nodes.dst is not None and sizes[1] != nodes.dst.size(-2):
            return "a size that disagrees with x"
    return None


def flipped_pair_reason(nodes: Nodes, edges: Edges, size, flipped: bool) -> Optional[str]:
    """Why a (x_src, x_dst) pair under flow="target_to_source" runs PyG's forward, or None. PyG's
    generated collect then gathers x_src by edge_index[1] into edge_index[0] but counts the output rows
    from x_src and size[0]: geot's result is the same where both sides have one row count (elsewhere
    PyG's forward mostly raises, or sums into x_src's rows)."""
    if not flipped or not nodes.paired:
        return None
    rows = _rows(nodes.src)
    sizes = [tuple(s) for s in (size, edges.size) if s is not None]
    if nodes.dst is None or _rows(nodes.dst) != rows or any(s != (rows, rows) for s in sizes):
        return "flow='target_to_source' with x_src and x_dst of different sizes"
    return None


def _rows(x: Tensor) -> int:
    """Node rows of features [N, F] or static [B, N, F], or of node indices [N] (RGCN)."""
    return x.size(-2) if x.dim() >= 2 else x.size(0)


def num_targets(nodes: Nodes, edges: Edges, size, graph: Optional[SortedGraph]) -> int:
    """Output rows, as PyG counts them: size[1], the adjacency's rows, x_dst's
    rows; for a pair (x_src, None) without either, the largest destination
    + 1 (one device->host sync, as PyG's scatter)."""
    if size is not None and size[1] is not None:
        return int(size[1])
    if edges.size is not None:
        return int(edges.size[1])
    if nodes.dst is not None:
        return nodes.dst.size(-2)
    if graph is None or graph.dst.numel() == 0:
        return 0
    return int(graph.dst[-1] if graph.ordered else graph.dst.max()) + 1


_looped = WeakTensorKeyDictionary()  # edge_index -> (version key, PyG's self-looped edge_index)


def pyg_looped(edge_index: Tensor, loops: int) -> Tensor:
    """PyG's self-looped edge_index (input loops removed, loops 0..loops-1
    appended), kept with edge_index so the sorted graph is kept too."""
    key = (edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape), loops)
    entry = None if torch.compiler.is_compiling() else _looped.get(edge_index)
    if entry is not None and entry[0] == key:
        return entry[1]
    looped = add_self_loops(remove_self_loops(edge_index)[0], num_nodes=loops)[0]
    if not torch.compiler.is_compiling():
        _looped[edge_index] = (key, looped)
    return looped


def pyg_looped_attr(edge_index: Tensor, edge_attr: Tensor, fill_value, loops: int) -> Tensor:
    """The edge features of :func:`pyg_looped`'s edges: the input loops' dropped, the
    added loops' made from ``fill_value`` as PyG's ``add_self_loops`` makes them.
    Over int64 ids: a "mean" fill is torch's scatter_reduce, whose gradient is
    wrong for int32 ids (torch 2.14, CPU: it fails gradcheck)."""
    edge_index = edge_index.long()
    return add_self_loops(*remove_self_loops(edge_index, edge_attr), fill_value=fill_value, num_nodes=loops)[1]


def gather_reduce(graph: SortedGraph, x: Tensor, reduce: str, num_nodes: int, weight: Optional[Tensor] = None,
                  weight_t: Optional[Tensor] = None) -> Tensor:
    """out[d] = reduce over the edges into d of weight[e] * x[src[e]]; x
    [N, *] rows (see :func:`gather_reduce_nodes` for a static graph's).

    weight_t: weight in the graph's transposed order, when kept with the
    graph (the backward pass would gather it on every call). A mean's edge
    counts are kept with the graph, for the same reason. A graph in input
    order (``graph.ordered`` False) takes sum or mean only: atomics."""
    checked(graph, x.size(0), num_nodes)
    if not graph.ordered:
        return _scatter_reduce(graph, x, reduce, num_nodes, weight)
    counts = None
    if reduce == "mean" and x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        counts = graph.derived(("mean counts", num_nodes, x.dtype),
                               lambda: mean_counts(graph.dst, num_nodes).to(x.dtype))
    if weight is not None:
        weight, weight_t = weight.to(x.dtype), None if weight_t is None else weight_t.to(x.dtype)
    # Without gradients nothing reads the transposed index (nor must compiled code guard on it: a compiled
    # inference would recompile once a training call had built it).
    transposed = graph.transposed if torch.is_grad_enabled() else None
    return index._fused(graph.src, graph.dst, weight, x, reduce, num_nodes, transposed, None, counts, weight_t)


def _scatter_reduce(graph: SortedGraph, x: Tensor, reduce: str, num_nodes: int, weight: Optional[Tensor]) -> Tensor:
    """gather_reduce of a graph in input order: a sum scattered with atomics (geot::index_scatter_sum, the
    same backward), a mean that sum over the edge counts."""
    if reduce not in ("sum", "mean"):
        raise ValueError(f"a graph in input order takes sum or mean, not {reduce!r}")
    weight = None if weight is None else weight.to(x.dtype)
    if _ops.eager_autograd(x, weight):  # one C++ call with its own autograd node (mini-batch host time)
        return _C.any_order_reduce(graph.src, graph.dst, x, weight, num_nodes, reduce == "mean")
    return _ScatterSum.apply(graph.src, graph.dst, x, weight, num_nodes, reduce == "mean")


def _any_order_counts(dst: Tensor, num_nodes: int, float64: bool) -> Tensor:
    """max(edges into each row, 1): one kernel eagerly, torch ops in compiled code (which fuses them)."""
    if not torch.compiler.is_compiling():
        return _C.any_order_counts(dst, num_nodes, float64)
    counts = torch.zeros(num_nodes, dtype=torch.float64 if float64 else torch.float32, device=dst.device)
    return counts.index_add_(0, dst, counts.new_ones(()).expand(dst.numel())).clamp_(min=1)


class _ScatterSum(torch.autograd.Function):
    """out[dst[e]] += weight[e] * x[src[e]], edges in any order, divided by
    each row's edge count for a mean; its backward scatters the other way.
    For tracers (torch.compile, torch.func); eager code takes
    geot._C.any_order_reduce, the same in C++."""

    @staticmethod
    def forward(ctx, src, dst, x, weight, num_nodes, mean):
        out = torch.ops.geot.index_scatter_sum(src, dst, x, weight, num_nodes)
        counts = None
        if mean:  # counted and divided in float32 at least, the result rounded once
            counts = _any_order_counts(dst, num_nodes, x.dtype == torch.float64).view(-1, *[1] * (x.dim() - 1))
            out = out.div_(counts) if out.dtype == counts.dtype else (out / counts).to(x.dtype)
        ctx.save_for_backward(src, dst, x if weight is not None else None, weight, counts)
        ctx.num_src = x.size(0)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        src, dst, x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous() if counts is None else (grad / counts).to(grad.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_x = torch.ops.geot.index_scatter_sum(dst, src, grad, weight, ctx.num_src)
        if ctx.needs_input_grad[3]:
            heads = 1 if weight.dim() == 1 else weight.size(1)
            grad_w = torch.ops.geot.edge_dot(src, dst, grad, x, heads).reshape(weight.shape)
        return None, None, grad_x, grad_w, None, None


def gather_reduce_nodes(graph: SortedGraph, x: Tensor, reduce: str, num_nodes: int,
                        weight: Optional[Tensor] = None, weight_t: Optional[Tensor] = None) -> Tensor:
    """gather_reduce of node features [N, F], or [B, N, F] (PyG's static
    graphs: one graph, nodes on axis -2), as [B, N_out, F]."""
    if x.dim() == 2:
        return gather_reduce(graph, x, reduce, num_nodes, weight, weight_t)
    rows = x.transpose(0, 1).contiguous()  # [N, B, F]: a node's rows side by side, one gather per edge
    # Contiguous as PyG's: users reshape it with view.
    return gather_reduce(graph, rows, reduce, num_nodes, weight, weight_t).transpose(0, 1).contiguous()


def matmul_dtype(x: Tensor):
    """The dtype of x @ W: autocast's where it casts x (it leaves float64 alone)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


def cast_for_matmul(x_src: Tensor, x_dst: Optional[Tensor]):
    """(x_src, x_dst) in the dtype of x @ W, x cast once where both are one
    tensor: compiled code would otherwise make each cast copy up front."""
    cast = x_src.to(matmul_dtype(x_src))
    return cast, cast if x_dst is x_src else x_dst


def has_module_hooks(module: Optional[torch.nn.Module]) -> bool:
    """Whether a module has forward or backward hooks of its own (a model summary's, a profiler's)."""
    return module is not None and bool(module._forward_hooks or module._forward_pre_hooks or
                                       module._backward_hooks or module._backward_pre_hooks)


def _plain_linear(lin) -> bool:
    """Whether calling lin is F.linear(x, lin.weight, lin.bias) and nothing
    else: torch's or PyG's Linear, initialized, with no hooks."""
    return (type(lin).forward in _LINEAR_FORWARDS and not has_module_hooks(lin)
            and not isinstance(lin.weight, torch.nn.parameter.UninitializedParameter))


_LINEAR_FORWARDS = (torch.nn.Linear.forward, pyg_nn.Linear.forward)


def linear_sum(terms, bias: Optional[Tensor] = None) -> Tensor:
    """``sum(lin(x) for x, lin in terms) + bias``, as PyG's layers write it
    (SAGE's ``lin_l(aggr) + lin_r(x)``), with no [N, out] pass per term: the
    first product takes every bias in its GEMM and each further one adds into
    that buffer in its own (``addmm_``). Eager, at 10^6 rows and 128
    features, each separate add read and wrote 1 GB more. Results differ from
    the separate adds by rounding. Compiled code, rows that are not
    matrices, lazy or hooked Linears: each Linear called, as PyG does
    (inductor fuses those adds into the next pointwise kernel; an addmm it
    keeps would copy its input first)."""
    if torch.compiler.is_compiling() or not all(x.dim() == 2 and _plain_linear(lin) for x, lin in terms):
        out = None
        for x, lin in terms:
            out = lin(x) if out is None else out + lin(x)
        return out if bias is None else out + bias
    total = None
    for b in [lin.bias for _, lin in terms] + [bias]:
        if b is not None:
            total = b if total is None else total + b
    (first, lin), rest = terms[0], terms[1:]
    out = torch.nn.functional.linear(first, lin.weight, total)
    for x, lin in rest:  # (autocast leaves in-place ops alone: cast as it would)
        out = out.addmm_(x.to(out.dtype), lin.weight.to(out.dtype).t())
    return out


def linear_relu(lin, x: Tensor) -> Optional[Tensor]:
    """``relu(lin(x))`` as one GEMM with the ReLU in its epilogue
    (``torch._addmm_activation``: cuBLASLt's bias + ReLU epilogue on CUDA), or
    None where that is not the same call: gradients recorded (the op has no
    autograd formula), rows that are not matrices, a Linear that is not plain
    or has no bias, autocast or dtypes that would cast, global module hooks.
    Eager at 10^6 rows and 128 features, the separate ReLU read and wrote
    1 GB more; compiled, inductor keeps it a kernel of its own after cuBLAS's
    GEMM."""
    if (x.dim() != 2 or not _plain_linear(lin) or lin.bias is None or not _ops.records_no_grad(x, lin.weight, lin.bias)
            or matmul_dtype(x) != x.dtype or lin.weight.dtype != x.dtype or lin.bias.dtype != x.dtype
            or _global_module_hooks()):
        return None
    return torch._addmm_activation(lin.bias, x, lin.weight.t())


def _global_module_hooks() -> bool:
    """Whether hooks registered for every module (register_module_forward_hook) are in force."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def transposed_order(graph: SortedGraph, edge_values: Optional[Tensor]) -> Optional[Tensor]:
    """Per-edge values of the graph's order in its transposed order, for the
    backward pass; None where there is nothing to keep (no values, or values
    that require grad: those are gathered on every call, in their autograd graph)."""
    if edge_values is None or edge_values.requires_grad or graph.transposed is None:
        return None
    return edge_values.index_select(0, graph.transposed.perm)


def typed_matmul(x: Tensor, ptr: Tensor, bounds, weight: Tensor) -> Tensor:
    """Rows ptr[t]:ptr[t+1] of x times weight[t] ([T, K, N]): one
    ``geot.segment_matmul`` where its precision is what torch's matmul would
    give. Its CUDA kernel rounds float32 to TF32, so float32 on CUDA under
    ``torch.get_float32_matmul_precision() == "highest"`` (torch's default),
    and float64 on CUDA, take one torch matmul per non-empty type instead
    (bounds: ptr on the host)."""
    dtype = matmul_dtype(x)
    x, weight = x.to(dtype), weight.to(dtype)
    if not x.is_cuda or dtype in (torch.float16, torch.bfloat16) or (dtype == torch.float32 and _tf32_matmuls()):
        return segment_matmul(x, ptr, weight)
    return per_type_matmul(x, bounds, weight)


@torch.compiler.assume_constant_result
def _tf32_matmuls() -> bool:
    """Whether torch's float32 matmuls may round to TF32 (precision not "highest"). A constant to
    torch.compile, read when it traces: some torch versions' dynamo break the graph at
    get_float32_matmul_precision (torch 2.11: a graph per typed matmul, compiled RGCN 1.5-2.5x eager's
    time on the H100), so compiled code keeps the precision it was compiled under."""
    return torch.get_float32_matmul_precision() != "highest"


def per_type_matmul(x: Tensor, bounds, weight: Tensor) -> Tensor:
    """typed_matmul as one torch matmul per non-empty type."""
    parts = [x[start:end] @ weight[t] for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])) if end > start]
    if not parts:  # no rows: still a product of x and weight, so that their gradients are zeros, not missing
        return x[:0] @ weight[0] if weight.size(0) else x.new_zeros(0, weight.size(-1))
    return torch.cat(parts)


class Pairs(NamedTuple):
    """The distinct (node, relation) pairs at one end of a graph's edges:
    each pair's projection x_node W_rel is computed once, however many edges
    share it (compact materialization)."""
    node: Tensor      # [U] node of each pair, pairs grouped by relation
    ptr: Tensor       # [R + 1] int64: pairs of relation r are ptr[r]:ptr[r+1]
    bounds: list      # ptr on the host
    of_edge: Tensor   # [E] each edge's pair, in the graph's order


def distinct_pairs(nodes: Tensor, relation: Tensor, num_nodes: int, relations: int) -> Pairs:
    key = relation.long() * num_nodes + nodes.long()
    distinct, of_edge = torch.unique(key, sorted=True, return_inverse=True)
    ptr = torch.searchsorted(distinct, torch.arange(relations + 1, device=key.device) * num_nodes)
    return Pairs(distinct.remainder(num_nodes), ptr, ptr.tolist(), of_edge.to(nodes.dtype))
