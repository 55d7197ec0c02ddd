"""Building blocks of heterogeneous and attention GNN layers.

* :func:`segment_matmul`: a typed linear layer (RGCN, HGT): the rows of x are
  grouped by type and type t is multiplied by its own weight, in one kernel.
* :func:`group_by_type`: the permutation and offsets that group rows by type.
* :func:`edge_softmax`: softmax over the incoming edges of each node (GAT).
* :func:`attention_aggregate`: GAT's softmax and weighted sum in one pass
  (inference).
"""
from typing import Optional, Tuple

import torch

from . import _ops  # noqa: F401  (operator registration)
from .segment import _infer_num_segments
from .validation import validation_enabled


def _check_tensor(value, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def segment_matmul(x: torch.Tensor, ptr: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Typed matmul: ``out[ptr[t]:ptr[t+1]] = x[ptr[t]:ptr[t+1]] @ weight[t]``.

    Args:
        x: [M, K] float32/float16/bfloat16 (float64 on CPU) rows, grouped by
            type: the rows of type t are ``ptr[t]:ptr[t+1]``. Use
            :func:`group_by_type` when they are not.
        ptr: [T + 1] int64 offsets: ``ptr[0] == 0``, non-decreasing,
            ``ptr[-1] == M``; empty types are allowed. Validated once per
            tensor (on CUDA, one device->host sync; see geot.set_validation).
        weight: [T, K, N], dtype of x.

    Returns:
        [M, N], dtype of x. Gradients flow to x and weight. On CUDA the
        products run on tensor cores with fp32 accumulation; float32 inputs
        are rounded to TF32 (10-bit mantissa), like torch.mm with
        ``torch.backends.cuda.matmul.allow_tf32 = True``.
    """
    _check_tensor(x, "x")
    _check_tensor(ptr, "ptr")
    _check_tensor(weight, "weight")
    return torch.ops.geot.segment_matmul(x, ptr, weight)


def group_by_type(type_vector: torch.Tensor, num_types: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Groups rows by type for :func:`segment_matmul`.

    Returns ``(perm, ptr)``: ``type_vector[perm]`` is sorted (stably, so rows
    of one type keep their order) and the rows of type t are
    ``perm[ptr[t]:ptr[t+1]]``. Typical use::

        perm, ptr = geot.group_by_type(edge_type, num_relations)
        out_grouped = geot.segment_matmul(x[perm], ptr, weight)
        out = torch.empty_like(out_grouped).index_copy_(0, perm, out_grouped)

    Args:
        type_vector: [M] integer tensor of types in ``[0, num_types)``.
        num_types: T; omitted, ``type_vector.max() + 1`` (a device->host sync).

    Returns:
        perm [M] int64 and ptr [T + 1] int64, on the device of type_vector.
    """
    _check_tensor(type_vector, "type_vector")
    if type_vector.dtype.is_floating_point or type_vector.dtype.is_complex or type_vector.dtype == torch.bool:
        raise TypeError(f"type_vector must be an integer tensor, got {type_vector.dtype}")
    if type_vector.dim() != 1:
        raise ValueError(f"type_vector must be 1-D, got shape {tuple(type_vector.shape)}")
    types = type_vector.long()
    if num_types is None:
        num_types = int(types.max()) + 1 if types.numel() > 0 else 0
    num_types = int(num_types)
    if num_types < 0:
        raise ValueError(f"num_types must be >= 0, got {num_types}")
    sorted_types, perm = torch.sort(types, stable=True)
    bounds = torch.arange(num_types + 1, device=types.device, dtype=torch.long)
    ptr = torch.searchsorted(sorted_types, bounds)
    if validation_enabled() and types.numel() > 0 and not torch.compiler.is_compiling():
        # Types out of range leave rows outside ptr[0]:ptr[-1] (one sync).
        if bool((ptr[0] != 0) | (ptr[-1] != types.numel())):
            raise ValueError(f"type_vector has values outside [0, num_types = {num_types})")
    return perm, ptr


def edge_softmax(score: torch.Tensor, dst_index: torch.Tensor, num_segments: Optional[int] = None) -> torch.Tensor:
    """Softmax over the incoming edges of each destination node.

    ``out[e, h] = exp(score[e, h]) / sum(exp(score[e', h]) for e' with
    dst_index[e'] == dst_index[e])``, computed with the maximum of each
    destination subtracted (numerically stable); fp16/bf16 accumulate in fp32.

    Args:
        score: [E] or [E, H] float32/float16/bfloat16/float64 edge scores
            (H attention heads).
        dst_index: [E] int32/int64 destination of each edge, sorted
            non-decreasing (an edge_index sorted by destination).
        num_segments: number of destination nodes; omitted,
            ``dst_index[-1] + 1`` (a device->host sync).

    Returns:
        Tensor of the shape and dtype of score. Gradients flow to score.
        Feeds :func:`geot.index_weight_segment_reduce` as GAT attention
        weights.
    """
    _check_tensor(score, "score")
    if num_segments is None:
        num_segments = _infer_num_segments(dst_index, "dst_index")
    return torch.ops.geot.edge_softmax(score, dst_index, int(num_segments))


def edge_softmax_(score: torch.Tensor, dst_index: torch.Tensor, num_segments: Optional[int] = None) -> torch.Tensor:
    """:func:`edge_softmax` written over ``score``, which it returns: for
    inference, where the scores are not needed afterwards, it saves a second
    [E, H] tensor (GAT's largest). ``score`` must be contiguous and must not
    require grad while grad mode is on (nothing could be differentiated).
    With validation off, edges whose destination is out of range keep their
    score (:func:`edge_softmax` gives them 0)."""
    _check_tensor(score, "score")
    if score.requires_grad and torch.is_grad_enabled():
        raise ValueError("edge_softmax_ overwrites score, which requires grad: use geot.edge_softmax to "
                         "differentiate, or call it under torch.no_grad()")
    if num_segments is None:
        num_segments = _infer_num_segments(dst_index, "dst_index")
    torch.ops.geot.edge_softmax_(score, dst_index, int(num_segments))
    return score


def attention_aggregate(x: torch.Tensor, score_src: Optional[torch.Tensor], score_dst: Optional[torch.Tensor],
                        src_index: torch.Tensor, dst_index: torch.Tensor, num_segments: Optional[int] = None,
                        negative_slope: float = 0.2, self_loops: bool = False, *,
                        att_src: Optional[torch.Tensor] = None, att_dst: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GAT's attention and aggregation in one pass, for inference.

    ``out[d, h] = sum_e a[e, h] * x[src_index[e], h]`` over the edges e into
    d, with ``a[., h]`` the softmax over d's edges of ``leaky_relu(
    score_src[src_index[e], h] + score_dst[d, h], negative_slope)``: the same
    as :func:`edge_softmax` of those scores fed to
    :func:`geot.index_weight_segment_reduce`, but the weights are computed on
    the fly (an online softmax), so no [E, H] tensor exists; fp16/bf16
    accumulate in fp32. Destinations without edges get 0.

    Args:
        x: [N, H, C] projected source rows (H heads of C channels).
        score_src: [N, H] each source's half of the attention logit
            (``(x * att_src).sum(-1)`` in PyG's GATConv), dtype of x or, for
            float16/bfloat16 x, float32 (what autocast gives); the logits
            are computed in float32 (float64 for float64 x). None: from
            ``att_src``.
        score_dst: [num_segments, H] each destination's half, the same
            (None: from ``att_dst``).
        src_index, dst_index: [E] int32/int64 (the same dtype) edge list,
            dst_index sorted non-decreasing.
        num_segments: destinations; omitted, ``score_dst.size(0)`` (with
            ``att_dst``, ``x.size(0)``).
        negative_slope: of the leaky ReLU.
        self_loops: leave out edges with ``src == dst`` and give every
            destination d one loop (row x[d], logit from score_src[d]), as
            PyG's ``add_self_loops`` does; needs num_segments <= N.
        att_src, att_dst: instead of a score, its attention vector, [H, C]
            or PyG's [1, H, C] parameter (dtype rules as the scores'):
            ``score_src = (x * att_src).sum(-1)``, ``score_dst =
            (x[:num_segments] * att_dst).sum(-1)``, computed from the rows
            the kernel loads anyway, so no [N, H] score tensors exist
            either. Give one of each pair.

    Returns:
        [num_segments, H, C], dtype of x. No gradient: raises if one would be
        recorded (train with edge_softmax + index_weight_segment_reduce).
    """
    given = [(t, name) for t, name in ((x, "x"), (score_src, "score_src"), (score_dst, "score_dst"),
                                       (att_src, "att_src"), (att_dst, "att_dst")) if t is not None]
    for value, name in given:
        _check_tensor(value, name)
    if torch.is_grad_enabled() and any(t.requires_grad for t, _ in given):
        raise ValueError("attention_aggregate has no gradient (inference only): call it under torch.no_grad(), or "
                         "use geot.edge_softmax with geot.index_weight_segment_reduce to differentiate")
    if num_segments is None:
        num_segments = score_dst.size(0) if score_dst is not None else x.size(0)
    return torch.ops.geot.attention_aggregate(x, score_src, score_dst, src_index, dst_index, int(num_segments),
                                              float(negative_slope), bool(self_loops), att_src, att_dst)
