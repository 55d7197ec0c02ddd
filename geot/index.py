"""Fused gather + segment reduce (GeoT §IV): message passing straight from
the edge list, without a sparse format and without an [E, F] temporary.

``out[d] = reduce(weight[e] * x[src_index[e]] for e with dst_index[e] == d)``
"""
from typing import NamedTuple, Optional, Sequence

import torch

from . import _C, _ops  # noqa: F401  (operator registration)
from .segment import REDUCTIONS, _infer_num_segments


class TransposedIndex(NamedTuple):
    """The edge list sorted by source, for the backward pass with respect to x.

    Without it, the gradient of x is accumulated with atomics in edge order
    (no sort, but one atomic per edge and feature); with it, the gradient runs
    the same fused kernel as the forward pass over edges grouped by source.
    Build it once per static graph with :func:`transpose_index` and pass it to
    every call on that graph. It must describe the same (src_index,
    dst_index): rebuild it when the graph changes.
    """

    perm: torch.Tensor  # [E] int64: edge e of the transposed order is edge perm[e]
    src: torch.Tensor   # [E] src_index[perm], sorted
    dst: torch.Tensor   # [E] dst_index[perm]


def transpose_index(src_index: torch.Tensor, dst_index: torch.Tensor) -> TransposedIndex:
    """Sorts the edges by source (stably, so ties keep the destination order)."""
    src_sorted, perm = torch.sort(src_index, stable=True)
    return TransposedIndex(perm, src_sorted, dst_index.index_select(0, perm))


def index_segment_reduce(
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    x: torch.Tensor,
    reduce: str = "sum",
    num_segments: Optional[int] = None,
    *,
    transposed: Optional[TransposedIndex] = None,
    config: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Gathers rows of ``x`` along the edges and reduces them per destination.

    ``out[d] = reduce(x[src_index[e]] for e with dst_index[e] == d)``.

    Args:
        src_index: [E] int32/int64, the source node of each edge, any order.
        dst_index: [E] int32/int64, the destination of each edge, sorted
            non-decreasing (an edge_index sorted by destination).
        x: [N_src, *] float32/float16/bfloat16/float64 node features.
        reduce: "sum", "mean", "max" or "min"; nodes without edges get 0.
        num_segments: output rows; omitted, ``dst_index[-1] + 1`` (a sync).
        transposed: optional :class:`TransposedIndex` of this graph, reused
            by the backward pass (see there).
        config: CUDA only, a :class:`geot.Config` forcing the kernel tiling.

    Returns:
        [num_segments, *x.shape[1:]], dtype of x.
    """
    return _fused(src_index, dst_index, None, x, reduce, num_segments, transposed, config)


def index_weight_segment_reduce(
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    reduce: str = "sum",
    num_segments: Optional[int] = None,
    *,
    transposed: Optional[TransposedIndex] = None,
    config: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """SpMM from the edge list: ``out[d] = reduce(weight[e] * x[src_index[e]])``.

    ``weight`` is [E] (a scalar per edge) or [E, H] with ``x`` [N_src, H, *]
    (multi-head: head h is scaled by weight[:, h], as in GAT). Gradients flow
    to ``x`` and ``weight``. Other arguments as in :func:`index_segment_reduce`.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    return _fused(src_index, dst_index, weight, x, reduce, num_segments, transposed, config)


def _fused(src_index, dst_index, weight, x, reduce, num_segments, transposed, config, counts=None, weight_t=None):
    """counts ([num_segments], rows per segment clamped to >= 1, for mean) and
    weight_t (weight in ``transposed`` order) are per-graph values a caller
    may keep (geot.nn does) to spare the backward pass recomputing them."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if num_segments is None:
        num_segments = _infer_num_segments(dst_index, "dst_index")
    cfg = None if config is None else [int(v) for v in config]
    if _ops.needs_dispatcher(x) or (weight is not None and _ops.needs_dispatcher(weight)):
        transposed = _check_transposed(transposed, src_index)
        if _ops.eager_autograd(src_index, dst_index, x, weight):
            if reduce in ("sum", "mean"):  # one C++ call with its own autograd node
                return _C.sorted_reduce(src_index, dst_index, x, weight, num_segments, reduce == "mean", cfg,
                                        *transposed, counts, weight_t)
            return _ops.IndexSegmentReduce.apply(src_index, dst_index, x, weight, num_segments, reduce, cfg)
        t_perm, t_src, t_dst = transposed
        return torch.ops.geot.index_segment_reduce(
            src_index, dst_index, x, weight, num_segments, reduce, cfg, t_perm, t_src, t_dst
        )
    return _C.index_segment_reduce_no_grad(src_index, dst_index, x, weight, num_segments, reduce, cfg)


def _check_transposed(transposed, src_index):
    if transposed is None:
        return None, None, None
    if not isinstance(transposed, TransposedIndex):
        raise TypeError(f"transposed must be a geot.TransposedIndex, got {type(transposed).__name__}")
    if any(t.shape != src_index.shape for t in transposed):
        raise ValueError(
            f"transposed describes {transposed.perm.numel()} edges, src_index has {src_index.numel()}; "
            "rebuild it with geot.transpose_index(src_index, dst_index)"
        )
    return transposed
