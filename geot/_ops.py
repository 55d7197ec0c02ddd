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
