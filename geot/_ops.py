"""Loads the extension and registers the Python side of torch.ops.geot.*:
fake (meta) kernels for torch.compile and autograd formulas."""
import math

import torch

from . import _C  # noqa: F401  (registers the C++ operators)

__all__ = ["_C"]


def _register_autograd(name, backward, setup_context):
    """The autograd formula of torch.ops.geot.<name>, as
    torch.library.register_autograd takes it (setup_context(ctx, inputs,
    output); backward(ctx, *grads), a gradient per input), made into an
    autograd.Function that runs the op below autograd. The op's Autograd
    kernel (csrc/python_autograd.cpp) calls it where a call records a
    gradient, and runs the rest in C++ (why: see there)."""
    op = getattr(torch.ops.geot, name).default

    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            output = op(*inputs)
        setup_context(ctx, inputs, output)
        return output

    formula = type(f"{name}_formula", (torch.autograd.Function,),
                   {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    FORMULAS[name] = formula
    _C.set_python_autograd(name, formula.apply)


FORMULAS = {}  # op name -> the autograd.Function of _register_autograd


@torch.library.register_fake("geot::segment_reduce")
def _segment_reduce_fake(index, src, num_segments, reduce="sum", config=None):
    return src.new_empty((num_segments, *src.shape[1:]))


@torch.library.register_fake("geot::segment_broadcast")
def _segment_broadcast_fake(values, index):
    return values.new_empty((index.shape[0], *values.shape[1:]))


def _segment_broadcast_setup(ctx, inputs, output):
    values, index = inputs
    ctx.num_segments = values.shape[0]
    ctx.save_for_backward(index)


def _segment_broadcast_backward(ctx, grad):
    index, = ctx.saved_tensors
    return torch.ops.geot.segment_reduce(index, grad.contiguous(), ctx.num_segments, "sum", None), None


_register_autograd("segment_broadcast", _segment_broadcast_backward, _segment_broadcast_setup)


@torch.library.register_fake("geot::gather_rows")
def _gather_rows_fake(values, index):
    return values.new_empty((index.shape[0], *values.shape[1:]))


def _gather_rows_setup(ctx, inputs, output):
    values, index = inputs
    ctx.values_shape = values.shape
    ctx.save_for_backward(index)


def _gather_rows_backward(ctx, grad):
    index, = ctx.saved_tensors
    return grad.new_zeros(ctx.values_shape).index_add_(0, index, grad), None


_register_autograd("gather_rows", _gather_rows_backward, _gather_rows_setup)


def segment_lengths(index, num_segments):
    """Rows per segment of a sorted index, without a device->host sync."""
    bounds = torch.arange(num_segments + 1, device=index.device, dtype=index.dtype)
    return torch.searchsorted(index, bounds).diff()


def mean_counts(index, num_segments):
    """Rows per segment clamped to >= 1: what a mean's gradient divides by."""
    return segment_lengths(index, num_segments).clamp_(min=1)


def _segment_reduce_setup(ctx, inputs, output):
    index, src, num_segments, reduce, _config = inputs
    ctx.reduce, ctx.num_segments = reduce, num_segments
    if reduce in ("max", "min"):
        ctx.save_for_backward(index, src, output)
    else:
        ctx.save_for_backward(index)


def _segment_reduce_backward(ctx, grad_out):
    index = ctx.saved_tensors[0]
    if ctx.reduce == "sum":
        grad_src = torch.ops.geot.segment_broadcast(grad_out.contiguous(), index)
    elif ctx.reduce == "mean":
        counts = mean_counts(index, ctx.num_segments)
        scale = counts.to(grad_out.dtype).view(-1, *([1] * (grad_out.dim() - 1)))
        grad_src = torch.ops.geot.segment_broadcast(grad_out / scale, index)
    else:
        _, src, out = ctx.saved_tensors
        grad_src = tied_share(index, src, out, grad_out, ctx.num_segments)
    return None, grad_src, None, None, None


def tied_share(index, rows, extremum, grad_out, num_segments):
    """The gradient of a segment max or min with respect to its rows [E, ...]:
    each (segment, feature) gradient split evenly among the rows that hold
    the extremum, as torch's scatter_reduce amax/amin (PyG's max and min
    aggregation) splits it; ties are common (rows of a ReLU's zeros)."""
    at_extremum = rows == torch.ops.geot.segment_broadcast(extremum.contiguous(), index)
    count_dtype = torch.promote_types(grad_out.dtype, torch.float32)  # half types round counts past 256
    ties = torch.ops.geot.segment_reduce(index, at_extremum.to(count_dtype), num_segments, "sum", None)
    share = (grad_out / ties.clamp(min=1)).to(grad_out.dtype).contiguous()
    # masked in place: the gradient takes a single [E, ...] buffer beside the saved rows
    return torch.ops.geot.segment_broadcast(share, index).mul_(at_extremum)


_register_autograd("segment_reduce", _segment_reduce_backward, _segment_reduce_setup)


@torch.library.register_fake("geot::index_segment_reduce")
def _index_segment_reduce_fake(src_index, dst_index, x, weight, num_segments, reduce="sum", config=None,
                               t_perm=None, t_src=None, t_dst=None):
    return x.new_empty((num_segments, *x.shape[1:]))


@torch.library.register_fake("geot::index_scatter_sum")
def _index_scatter_sum_fake(gather_index, scatter_index, x, weight, num_out):
    return x.new_empty((num_out, *x.shape[1:]))


def _index_scatter_sum_setup(ctx, inputs, output):
    gather_index, scatter_index, x, weight, _num_out = inputs
    ctx.num_src, ctx.has_weight = x.shape[0], weight is not None
    ctx.heads = 1 if weight is None or weight.dim() == 1 else weight.shape[1]
    keep_x = weight is not None and ctx.needs_input_grad[3]  # only a weight's gradient reads x
    ctx.save_for_backward(gather_index, scatter_index, x if keep_x else None, weight)


def _index_scatter_sum_backward(ctx, grad):
    """out[scatter[e]] += weight[e] * x[gather[e]]: x's gradient is the same scatter the other way, the
    weight's the per-edge dot <grad[scatter[e]], x[gather[e]]>. (The atomic backward of
    index_segment_reduce and edge_dot's backward call this op: a create_graph through either needs it.)"""
    gather_index, scatter_index, x, weight = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        grad_x = torch.ops.geot.index_scatter_sum(scatter_index, gather_index, grad, weight, ctx.num_src)
    if ctx.has_weight and ctx.needs_input_grad[3]:
        grad_w = torch.ops.geot.edge_dot(gather_index, scatter_index, grad, x, ctx.heads).reshape(weight.shape)
    return None, None, grad_x, grad_w, None


_register_autograd("index_scatter_sum", _index_scatter_sum_backward, _index_scatter_sum_setup)


@torch.library.register_fake("geot::edge_dot")
def _edge_dot_fake(src_index, dst_index, a, b, heads):
    return b.new_empty((src_index.shape[0], heads))


def _edge_dot_setup(ctx, inputs, output):
    src_index, dst_index, a, b, heads = inputs
    ctx.save_for_backward(src_index, dst_index, a, b)
    ctx.heads = heads


def _edge_dot_backward(ctx, grad):
    """out[e, h] = <a[dst[e], h], b[src[e], h]>: each side's gradient scatters the other side's rows, scaled
    by the edge's gradient (one fused kernel each, atomics, no [E, F] rows)."""
    src_index, dst_index, a, b = ctx.saved_tensors
    weight = grad.contiguous()  # [E, heads], one weight per edge and head

    def scatter(gather, to, rows, like):
        width = math.prod(rows.shape[1:]) // ctx.heads  # not -1: rows may be empty
        heads_rows = rows.reshape(rows.size(0), ctx.heads, width)
        return torch.ops.geot.index_scatter_sum(gather, to, heads_rows, weight, like.size(0)).reshape(like.shape)

    grad_a = scatter(src_index, dst_index, b, a) if ctx.needs_input_grad[2] else None
    grad_b = scatter(dst_index, src_index, a, b) if ctx.needs_input_grad[3] else None
    return None, None, grad_a, grad_b, None


_register_autograd("edge_dot", _edge_dot_backward, _edge_dot_setup)


@torch.library.register_fake("geot::extremum_grad")
def _extremum_grad_fake(src_index, dst_index, x, extremum, grad_out):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("geot::edge_additive_score")
def _edge_additive_score_fake(src_index, dst_index, a, b, att, negative_slope, heads):
    return b.new_empty((src_index.shape[0], heads))


def _edge_additive_score_setup(ctx, inputs, output):
    src_index, dst_index, a, b, att, negative_slope, heads = inputs
    ctx.save_for_backward(src_index, dst_index, a, b, att)
    ctx.negative_slope, ctx.heads = negative_slope, heads


def _edge_additive_score_backward(ctx, grad):
    """out[e, h] = att[h] . leaky_relu(z), z = a[dst[e], h] + b[src[e], h]: the backward rebuilds the
    [E, H, C] sums (the forward never held them) and scatters att * leaky_relu'(z) * grad to both sides."""
    src_index, dst_index, a, b, att = ctx.saved_tensors
    heads = ctx.heads
    a_rows, b_rows = a.reshape(a.size(0), heads, -1), b.reshape(b.size(0), heads, -1)
    z = a_rows.index_select(0, dst_index) + b_rows.index_select(0, src_index)
    slope = torch.where(z > 0, z.new_ones(()), z.new_tensor(ctx.negative_slope))  # leaky_relu'(z)
    edge_grad = grad.unsqueeze(-1)  # [E, H, 1]
    grad_z = edge_grad * att.reshape(heads, -1) * slope
    grad_a = grad_b = grad_att = None
    if ctx.needs_input_grad[2]:
        grad_a = torch.zeros_like(a_rows).index_add_(0, dst_index, grad_z).reshape(a.shape)
    if ctx.needs_input_grad[3]:
        grad_b = torch.zeros_like(b_rows).index_add_(0, src_index, grad_z).reshape(b.shape)
    if ctx.needs_input_grad[4]:
        grad_att = (edge_grad * z * slope).sum(0).reshape(att.shape)
    return None, None, grad_a, grad_b, grad_att, None, None


_register_autograd("edge_additive_score", _edge_additive_score_backward, _edge_additive_score_setup)


def _index_segment_reduce_setup(ctx, inputs, output):
    src_index, dst_index, x, weight, num_segments, reduce, _config, t_perm, t_src, t_dst = inputs
    ctx.reduce, ctx.num_segments, ctx.num_src = reduce, num_segments, x.shape[0]
    ctx.heads = 1 if weight is None or weight.dim() == 1 else weight.shape[1]
    ctx.has_weight, ctx.has_transposed = weight is not None, t_perm is not None
    extremum = reduce in ("max", "min")
    # x only where the backward reads it (max/min, a weight's gradient): saving it keeps it alive.
    keep_x = extremum or (weight is not None and ctx.needs_input_grad[3])
    ctx.save_for_backward(src_index, dst_index, x if keep_x else None, weight, output if extremum else None,
                          t_perm, t_src, t_dst)


def _per_edge(weight, like):
    """weight [E] or [E, H] shaped to broadcast against like [E, (H,) ...]."""
    return weight.reshape(*weight.shape, *([1] * (like.dim() - weight.dim())))


def _index_segment_reduce_backward(ctx, grad_out):
    src_index, dst_index, x, weight, extremum, t_perm, t_src, t_dst = ctx.saved_tensors
    if ctx.reduce in ("max", "min"):
        grad_x, grad_w = _fused_extremum_backward(ctx, grad_out, src_index, dst_index, x, weight, extremum)
        return None, None, grad_x, grad_w, None, None, None, None, None, None
    grad = grad_out
    if ctx.reduce == "mean":
        counts = mean_counts(dst_index, ctx.num_segments)
        grad = grad / counts.to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        if ctx.has_transposed:  # the fused kernel over edges grouped by source
            weight_t = None if weight is None else torch.ops.geot.gather_rows(weight, t_perm)
            grad_x = _index_reduce(t_dst, t_src, grad, weight_t, ctx.num_src)
        else:  # no sort: atomics in edge order
            grad_x = torch.ops.geot.index_scatter_sum(dst_index, src_index, grad, weight, ctx.num_src)
    if ctx.has_weight and ctx.needs_input_grad[3]:
        grad_w = torch.ops.geot.edge_dot(src_index, dst_index, grad, x, ctx.heads).reshape(weight.shape)
    return None, None, grad_x, grad_w, None, None, None, None, None, None


def _fused_extremum_backward(ctx, grad_out, src_index, dst_index, x, weight, extremum):
    """max/min: each (segment, feature) gradient split among its edges that
    hold the extremum (tied_share). Without a weight, one op
    (geot::extremum_grad: two passes over the gathered rows, no [E, F]
    buffer), unless the gradient must be differentiable (create_graph) or
    bitwise repeatable on CUDA (its float atomics); otherwise this
    materializes the [E, F] messages."""
    if weight is None and not torch.is_grad_enabled() and not (
            x.is_cuda and torch.are_deterministic_algorithms_enabled()):
        grad_x = None
        if ctx.needs_input_grad[2]:
            grad_x = torch.ops.geot.extremum_grad(src_index, dst_index, x, extremum, grad_out.contiguous())
        return grad_x, None
    messages = x.index_select(0, src_index)
    if weight is not None:
        messages = messages * _per_edge(weight, messages)
    grad_messages = tied_share(dst_index, messages, extremum, grad_out, ctx.num_segments)
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        scaled = grad_messages if weight is None else grad_messages * _per_edge(weight, grad_messages)
        grad_x = torch.zeros_like(x).index_add_(0, src_index, scaled)
    if weight is not None and ctx.needs_input_grad[3]:
        products = grad_messages * x.index_select(0, src_index)
        width = math.prod(products.shape[1:]) // ctx.heads  # not -1: there may be no edges
        grad_w = products.reshape(products.shape[0], ctx.heads, width).sum(-1).reshape(weight.shape)
    return grad_x, grad_w


_register_autograd("index_segment_reduce", _index_segment_reduce_backward, _index_segment_reduce_setup)


def needs_dispatcher(src) -> bool:
    """Autograd, torch.compile tracing and tensor subclasses need the full
    torch.ops path; plain inference calls take the C++ fast path."""
    return (
        type(src) is not torch.Tensor
        or (src.requires_grad and torch.is_grad_enabled())
        or torch.compiler.is_compiling()
    )


def _index_reduce(src_index, dst_index, x, weight, num_segments):
    """The sum in a backward pass: the C++ fast path, unless autograd must
    record it (create_graph) or a tracer must see it."""
    if needs_dispatcher(x) or (weight is not None and needs_dispatcher(weight)):
        return torch.ops.geot.index_segment_reduce(src_index, dst_index, x, weight, num_segments, "sum")
    return _C.index_segment_reduce_no_grad(src_index, dst_index, x, weight, num_segments, "sum", None)


def records_no_grad(*tensors) -> bool:
    """Whether a call records no gradient: it may then call an op without an
    autograd formula."""
    return (not torch._C._are_functorch_transforms_active()
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)))


def compiled_without_grad(*tensors) -> bool:
    """Whether a traced call records no gradient: it may then call an op
    without an autograd formula (geot::linear_pair)."""
    return torch.compiler.is_compiling() and records_no_grad(*tensors)


def eager_autograd(*tensors) -> bool:
    """Whether an eager node (_C.sorted_reduce, IndexSegmentReduce) may stand
    in for the registered op: eager code on plain tensors (tracers,
    subclasses and torch.func see the op)."""
    return (all(t is None or type(t) is torch.Tensor for t in tensors)
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active())


class SegmentReduce(torch.autograd.Function):
    """geot::segment_reduce with its registered autograd formulas, for eager
    calls (why: see IndexSegmentReduce)."""

    @staticmethod
    def forward(ctx, index, src, num_segments, reduce, config):
        output = _C.segment_reduce_no_grad(index, src, num_segments, reduce, config)
        _segment_reduce_setup(ctx, (index, src, num_segments, reduce, config), output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        return _segment_reduce_backward(ctx, grad_out)


class IndexSegmentReduce(torch.autograd.Function):
    """geot::index_segment_reduce's max or min with the registered autograd
    formula, for eager calls (sums and means: geot._C.sorted_reduce, the same
    in C++). Through the registered op a call that records a gradient costs
    about ten plain ops of host time (the dispatcher boxes it into Python,
    whose formula redispatches below autograd); this calls the C++ kernel
    directly. Old-style (forward(ctx, ...)): a setup_context costs an
    inspect.signature per call."""

    @staticmethod
    def forward(ctx, src_index, dst_index, x, weight, num_segments, reduce, config):
        output = _C.index_segment_reduce_no_grad(src_index, dst_index, x, weight, num_segments, reduce, config)
        _index_segment_reduce_setup(
            ctx, (src_index, dst_index, x, weight, num_segments, reduce, config, None, None, None), output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        return (*_index_segment_reduce_backward(ctx, grad_out)[:4], None, None, None)


# --------------------------------------------------------------------------- #
# segment_matmul: every op of the family is linear in each argument, so each
# one's gradients are other ops of the family (double backward included).
# --------------------------------------------------------------------------- #
@torch.library.register_fake("geot::segment_matmul")
def _segment_matmul_fake(x, ptr, weight):
    return x.new_empty((x.shape[0], weight.shape[2]))


@torch.library.register_fake("geot::segment_matmul_transposed")
def _segment_matmul_transposed_fake(grad, ptr, weight):
    return grad.new_empty((grad.shape[0], weight.shape[1]))


@torch.library.register_fake("geot::segment_matmul_weight_grad")
def _segment_matmul_weight_grad_fake(x, ptr, grad):
    return x.new_empty((ptr.shape[0] - 1, x.shape[1], grad.shape[1]))


def _save_all_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _segment_matmul_backward(ctx, grad_out):
    x, ptr, weight = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:  # grad_t @ weight[t]^T
        grad_x = torch.ops.geot.segment_matmul_transposed(grad_out, ptr, weight)
    if ctx.needs_input_grad[2]:  # x_t^T @ grad_t
        grad_w = torch.ops.geot.segment_matmul_weight_grad(x, ptr, grad_out)
    return grad_x, None, grad_w


def _segment_matmul_transposed_backward(ctx, grad_out):
    grad, ptr, weight = ctx.saved_tensors  # out_t = grad_t @ weight[t]^T
    d_grad = d_weight = None
    if ctx.needs_input_grad[0]:
        d_grad = torch.ops.geot.segment_matmul(grad_out, ptr, weight)
    if ctx.needs_input_grad[2]:
        d_weight = torch.ops.geot.segment_matmul_weight_grad(grad_out, ptr, grad)
    return d_grad, None, d_weight


def _segment_matmul_weight_grad_backward(ctx, grad_out):
    x, ptr, grad = ctx.saved_tensors  # out[t] = x_t^T @ grad_t
    d_x = d_grad = None
    if ctx.needs_input_grad[0]:
        d_x = torch.ops.geot.segment_matmul_transposed(grad, ptr, grad_out)
    if ctx.needs_input_grad[2]:
        d_grad = torch.ops.geot.segment_matmul(x, ptr, grad_out)
    return d_x, None, d_grad


for _name, _backward in (
    ("segment_matmul", _segment_matmul_backward),
    ("segment_matmul_transposed", _segment_matmul_transposed_backward),
    ("segment_matmul_weight_grad", _segment_matmul_weight_grad_backward),
):
    _register_autograd(_name, _backward, _save_all_setup)


# --------------------------------------------------------------------------- #
# edge_softmax
# --------------------------------------------------------------------------- #
@torch.library.register_fake("geot::edge_softmax")
def _edge_softmax_fake(score, dst_index, num_segments):
    return torch.empty_like(score, memory_format=torch.contiguous_format)


@torch.library.register_fake("geot::edge_softmax_")
def _edge_softmax_inplace_fake(score, dst_index, num_segments):
    return None


@torch.library.register_fake("geot::edge_softmax_backward")
def _edge_softmax_backward_fake(y, grad, dst_index, num_segments):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _edge_softmax_setup(ctx, inputs, output):
    _score, dst_index, num_segments = inputs
    ctx.num_segments = num_segments
    ctx.save_for_backward(output, dst_index)


def _edge_softmax_backward(ctx, grad):
    y, dst_index = ctx.saved_tensors
    return torch.ops.geot.edge_softmax_backward(y, grad, dst_index, ctx.num_segments), None, None


def _edge_softmax_backward_setup(ctx, inputs, output):
    y, grad, dst_index, num_segments = inputs
    ctx.num_segments = num_segments
    ctx.save_for_backward(y, grad, dst_index)


def _destination_sum(values, dst_index, num_segments):
    """sum over the edges of each destination, gathered back to the edges."""
    sums = torch.ops.geot.segment_reduce(dst_index, values, num_segments, "sum", None)
    return torch.ops.geot.segment_broadcast(sums, dst_index)


def _edge_softmax_backward_backward(ctx, upstream):
    # out = y * (g - s), s = sum_d(g * y): d/dg = y * (u - sum_d(u * y)), the
    # same op; d/dy = u * (g - s) - g * sum_d(u * y).
    y, grad, dst_index = ctx.saved_tensors
    d_y = d_grad = None
    if ctx.needs_input_grad[1]:
        d_grad = torch.ops.geot.edge_softmax_backward(y, upstream, dst_index, ctx.num_segments)
    if ctx.needs_input_grad[0]:
        s = _destination_sum(grad * y, dst_index, ctx.num_segments)
        t = _destination_sum(upstream * y, dst_index, ctx.num_segments)
        d_y = upstream * (grad - s) - grad * t
    return d_y, d_grad, None, None


_register_autograd("edge_softmax", _edge_softmax_backward, _edge_softmax_setup)
_register_autograd("edge_softmax_backward", _edge_softmax_backward_backward, _edge_softmax_backward_setup)


# --------------------------------------------------------------------------- #
# attention_aggregate (inference only)
# --------------------------------------------------------------------------- #
@torch.library.register_fake("geot::attention_aggregate")
def _attention_aggregate_fake(x, score_src, score_dst, src_index, dst_index, num_segments, negative_slope,
                              self_loops, att_src=None, att_dst=None):
    return x.new_empty((num_segments, x.size(1), x.size(2)))


def _attention_aggregate_setup(ctx, inputs, output):
    pass


def _attention_aggregate_backward(ctx, grad):
    raise RuntimeError("geot attention_aggregate has no gradient (inference only): differentiate "
                       "geot.edge_softmax followed by geot.index_weight_segment_reduce instead")


_register_autograd("attention_aggregate", _attention_aggregate_backward, _attention_aggregate_setup)


# --------------------------------------------------------------------------- #
# A sum compiled code keeps where it stands.
# --------------------------------------------------------------------------- #
@torch.library.custom_op("geot::accumulate_", mutates_args=("total",))
def accumulate_(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part. Inductor fuses a chain of adds into one kernel at its
    end, so every part stays alive until then: for RGCN's relation blocks,
    as much memory as the whole table the blocks avoid. As an op it runs in
    place, where it stands in the chain."""
    total.add_(part)


# --------------------------------------------------------------------------- #
# Ops of geot.nn inference (csrc/ops.cpp says why each is one op).
# --------------------------------------------------------------------------- #
@torch.library.register_fake("geot::index_sum_plus_scaled")
def _index_sum_plus_scaled_fake(src_index, dst_index, x, scale, config=None, scale_offset=0.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("geot::linear_pair")
def _linear_pair_fake(x, weight, other_weight, other_bias):
    rows = x.shape[:-1]
    return x.new_empty((*rows, weight.size(0))), x.new_empty((*rows, other_weight.size(0)))
