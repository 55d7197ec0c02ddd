"""Loads the extension and registers the Python side of torch.ops.geot.*:
fake (meta) kernels for torch.compile and autograd formulas."""
import torch

from . import _C  # noqa: F401  (registers the C++ operators)

__all__ = ["_C"]


@torch.library.register_fake("geot::segment_reduce")
def _segment_reduce_fake(index, src, num_segments, reduce="sum", config=None):
    return src.new_empty((num_segments, *src.shape[1:]))


@torch.library.register_fake("geot::segment_arg")
def _segment_arg_fake(index, src, out):
    features = 1
    for size in src.shape[1:]:
        features *= size
    return out.new_empty((out.shape[0], features), dtype=torch.long)


def segment_lengths(index, num_segments):
    """Rows per segment of a sorted index, without a device->host sync."""
    bounds = torch.arange(num_segments + 1, device=index.device, dtype=index.dtype)
    return torch.searchsorted(index, bounds).diff()


def _segment_reduce_setup(ctx, inputs, output):
    index, src, num_segments, reduce, _config = inputs
    ctx.reduce, ctx.num_segments = reduce, num_segments
    ctx.src_shape = src.shape
    if reduce in ("max", "min"):
        ctx.save_for_backward(index, src, output)
    else:
        ctx.save_for_backward(index)


def _segment_reduce_backward(ctx, grad_out):
    index = ctx.saved_tensors[0]
    if ctx.reduce == "sum":
        grad_src = grad_out.index_select(0, index)
    elif ctx.reduce == "mean":
        counts = segment_lengths(index, ctx.num_segments).clamp_(min=1)
        scale = counts.to(grad_out.dtype).view(-1, *([1] * (grad_out.dim() - 1)))
        grad_src = (grad_out / scale).index_select(0, index)
    else:
        # Route each (segment, feature) gradient to its arg row; empty segments
        # point at row E, a scratch row dropped afterwards.
        _, src, out = ctx.saved_tensors
        arg = torch.ops.geot.segment_arg(index, src, out)
        rows = src.shape[0]
        grad = grad_out.reshape(arg.shape)
        grad_src = grad.new_zeros((rows + 1, grad.shape[1])).scatter(0, arg, grad)[:rows]
        grad_src = grad_src.reshape(ctx.src_shape)
    return None, grad_src, None, None, None


torch.library.register_autograd(
    "geot::segment_reduce", _segment_reduce_backward, setup_context=_segment_reduce_setup
)


@torch.library.register_fake("geot::index_segment_reduce")
def _index_segment_reduce_fake(src_index, dst_index, x, weight, num_segments, reduce="sum", config=None,
                               t_perm=None, t_src=None, t_dst=None):
    return x.new_empty((num_segments, *x.shape[1:]))


@torch.library.register_fake("geot::index_scatter_sum")
def _index_scatter_sum_fake(gather_index, scatter_index, x, weight, num_out):
    return x.new_empty((num_out, *x.shape[1:]))


@torch.library.register_fake("geot::edge_dot")
def _edge_dot_fake(src_index, dst_index, a, b, heads):
    return b.new_empty((src_index.shape[0], heads))


def _index_segment_reduce_setup(ctx, inputs, output):
    src_index, dst_index, x, weight, num_segments, reduce, _config, t_perm, t_src, t_dst = inputs
    ctx.reduce, ctx.num_segments, ctx.num_src = reduce, num_segments, x.shape[0]
    ctx.heads = 1 if weight is None or weight.dim() == 1 else weight.shape[1]
    ctx.has_weight, ctx.has_transposed = weight is not None, t_perm is not None
    extremum = output if reduce in ("max", "min") else None
    ctx.save_for_backward(src_index, dst_index, x, weight, extremum, t_perm, t_src, t_dst)


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
        counts = segment_lengths(dst_index, ctx.num_segments).clamp_(min=1).to(grad.dtype)
        grad = grad / counts.view(-1, *([1] * (grad.dim() - 1)))
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        if ctx.has_transposed:  # the fused kernel over edges grouped by source
            weight_t = None if weight is None else weight.index_select(0, t_perm)
            grad_x = torch.ops.geot.index_segment_reduce(t_dst, t_src, grad, weight_t, ctx.num_src, "sum")
        else:  # no sort: atomics in edge order
            grad_x = torch.ops.geot.index_scatter_sum(dst_index, src_index, grad, weight, ctx.num_src)
    if ctx.has_weight and ctx.needs_input_grad[3]:
        grad_w = torch.ops.geot.edge_dot(src_index, dst_index, grad, x, ctx.heads).reshape(weight.shape)
    return None, None, grad_x, grad_w, None, None, None, None, None, None


def _fused_extremum_backward(ctx, grad_out, src_index, dst_index, x, weight, extremum):
    """max/min: each (segment, feature) gradient goes to its arg edge. Unlike
    the forward pass, this materializes the [E, F] messages."""
    messages = x.index_select(0, src_index)
    if weight is not None:
        messages = messages * _per_edge(weight, messages)
    arg = torch.ops.geot.segment_arg(dst_index, messages, extremum)
    num_edges = messages.shape[0]
    grad = grad_out.reshape(arg.shape)
    # Empty segments point at edge E, a scratch row dropped afterwards.
    grad_messages = grad.new_zeros((num_edges + 1, grad.shape[1])).scatter(0, arg, grad)[:num_edges]
    grad_messages = grad_messages.reshape(messages.shape)
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        scaled = grad_messages if weight is None else grad_messages * _per_edge(weight, grad_messages)
        grad_x = torch.zeros_like(x).index_add_(0, src_index, scaled)
    if weight is not None and ctx.needs_input_grad[3]:
        products = grad_messages * x.index_select(0, src_index)
        grad_w = products.reshape(num_edges, ctx.heads, -1).sum(-1).reshape(weight.shape)
    return grad_x, grad_w


torch.library.register_autograd(
    "geot::index_segment_reduce", _index_segment_reduce_backward, setup_context=_index_segment_reduce_setup
)
