"""segment_reduce: reduce the rows of src that share a segment id; segment_broadcast: its adjoint."""
from typing import Optional, Sequence

import torch

from . import _C, _ops  # noqa: F401  (operator registration)
from .config import Config

REDUCTIONS = ("sum", "mean", "max", "min")


def _infer_num_segments(index: torch.Tensor, name: str = "index") -> int:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(index).__name__}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(index.shape)}")
    # index is sorted, so its last value is the largest (one device->host sync).
    return int(index[-1]) + 1 if index.numel() > 0 else 0


def segment_reduce(
    index: torch.Tensor,
    src: torch.Tensor,
    reduce: str = "sum",
    num_segments: Optional[int] = None,
    *,
    config: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Reduces the rows of ``src`` that share a segment id.

    ``out[s] = reduce(src[e] for e with index[e] == s)``.

    Args:
        index: 1-D int32/int64 tensor of length E, sorted non-decreasing
            (e.g. the destination row of an edge_index sorted by destination).
        src: [E, *] float32/float16/bfloat16/float64 tensor; trailing
            dimensions are features. fp16/bf16 accumulate in fp32.
        reduce: "sum", "mean", "max" or "min". Empty segments give 0.
        num_segments: number of output rows. Give it to avoid a device->host
            sync; omitted, it is ``index[-1] + 1``.
        config: CUDA only, a :class:`geot.Config` forcing the kernel tiling
            (for tuning); by default the library picks one.

    Returns:
        Tensor of shape [num_segments, *src.shape[1:]], dtype of src.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if num_segments is None:
        num_segments = _infer_num_segments(index)
    cfg = None if config is None else [int(v) for v in config]
    if _ops.needs_dispatcher(src):
        if _ops.eager_autograd(index, src):
            return _ops.SegmentReduce.apply(index, src, num_segments, reduce, cfg)
        return torch.ops.geot.segment_reduce(index, src, num_segments, reduce, cfg)
    return _C.segment_reduce_no_grad(index, src, num_segments, reduce, cfg)


def segment_broadcast(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Repeats each segment's row over the rows of its segment.

    ``out[e] = values[index[e]]``: the adjoint of a segment sum (its
    gradient is ``segment_reduce(index, grad, "sum", values.shape[0])``),
    e.g. per-destination values spread over the destination's edges.

    Args:
        values: [S, *] float tensor, a row per segment.
        index: 1-D int32/int64 tensor of length E, sorted non-decreasing,
            values in [0, S).

    Returns:
        Tensor of shape [E, *values.shape[1:]]. On CUDA a row read by many
        edges (a hub) is served from cache, where ``values.index_select(0,
        index)`` slows down on long runs of one id.
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a torch.Tensor, got {type(index).__name__}")
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    return torch.ops.geot.segment_broadcast(values, index)
