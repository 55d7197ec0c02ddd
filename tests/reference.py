"""Plain-torch float64 reference for geot.segment_reduce, and input generators.

Everything here is deliberately simple: the reference works on CPU in float64
and uses only stock torch ops (index_add_ / scatter_reduce_),
so that it is easy to convince oneself that it is right. tests/test_reference.py
cross-checks it against an explicit Python loop and against torch.scatter_reduce.
"""
from typing import Optional, Sequence, Tuple

import torch

REDUCES = ("sum", "mean", "max", "min")


# --------------------------------------------------------------------------- #
# reference forward / backward
# --------------------------------------------------------------------------- #
def _prep(index: torch.Tensor, src: torch.Tensor, num_segments: Optional[int]):
    idx = index.detach().to("cpu", torch.long)
    x = src.detach().to("cpu", torch.float64)
    if num_segments is None:
        num_segments = int(idx[-1]) + 1 if idx.numel() > 0 else 0
    return idx, x, int(num_segments)


def segment_counts(index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Number of elements of every segment, int64 [num_segments] on CPU."""
    idx = index.detach().to("cpu", torch.long)
    return torch.bincount(idx, minlength=num_segments)[:num_segments]


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshapes a [N] tensor to [N, 1, 1, ...] so it broadcasts against `like`."""
    return v.view((-1,) + (1,) * (like.dim() - 1))


def segment_reduce_ref(index, src, reduce="sum", num_segments=None) -> torch.Tensor:
    """out[s] = reduce(src[e] for e with index[e] == s); empty segments are 0.

    Returns a float64 CPU tensor of shape [num_segments, *src.shape[1:]].
    """
    if reduce not in REDUCES:
        raise ValueError(f"unknown reduce {reduce!r}")
    idx, x, S = _prep(index, src, num_segments)
    out = torch.zeros((S,) + tuple(x.shape[1:]), dtype=torch.float64)
    if idx.numel() == 0:
        return out
    if reduce in ("sum", "mean"):
        out.index_add_(0, idx, x)
        if reduce == "mean":
            cnt = segment_counts(idx, S).clamp(min=1).to(torch.float64)
            out /= _bcast(cnt, out)
    else:
        # include_self=False: a row that no index hits keeps its value (0).
        full_idx = _bcast(idx, x).expand_as(x)
        out.scatter_reduce_(0, full_idx, x, "amax" if reduce == "max" else "amin", include_self=False)
    return out


def segment_reduce_ref_grad(index, src, reduce, num_segments, grad_out) -> torch.Tensor:
    """d(sum(out * grad_out)) / d src under the geot contract, float64 CPU.

    sum:  grad[e] = g[index[e]]
    mean: grad[e] = g[index[e]] / count[index[e]]
    max/min: for each (segment, feature) the gradient is split evenly among
             the e that attain the extremum (ties share it, as torch's
             scatter_reduce amax/amin splits it); every other e gets 0.
    """
    idx, x, S = _prep(index, src, num_segments)
    g = grad_out.detach().to("cpu", torch.float64)
    assert g.shape == (S,) + tuple(x.shape[1:])
    E = idx.numel()
    if E == 0:
        return torch.zeros_like(x)
    g_e = g[idx]
    if reduce == "sum":
        return g_e
    if reduce == "mean":
        cnt = segment_counts(idx, S).to(torch.float64)
        return g_e / _bcast(cnt[idx], g_e)
    out = segment_reduce_ref(idx, x, reduce, S)
    hit = x == out[idx]
    ties = torch.zeros(out.shape, dtype=torch.float64).index_add_(0, idx, hit.double())
    return torch.where(hit, g_e / ties[idx], torch.zeros_like(g_e))


def segment_reduce_loop(index, src, reduce="sum", num_segments=None) -> torch.Tensor:
    """The slow, obviously-right version: a Python loop over segments."""
    idx, x, S = _prep(index, src, num_segments)
    out = torch.zeros((S,) + tuple(x.shape[1:]), dtype=torch.float64)
    for s in range(S):
        rows = x[idx == s]
        if rows.shape[0] == 0:
            continue
        if reduce == "sum":
            out[s] = rows.sum(0)
        elif reduce == "mean":
            out[s] = rows.sum(0) / rows.shape[0]
        elif reduce == "max":
            out[s] = rows.max(0).values
        elif reduce == "min":
            out[s] = rows.min(0).values
        else:
            raise ValueError(reduce)
    return out


def segment_reduce_loop_grad(index, src, reduce, num_segments, grad_out) -> torch.Tensor:
    """Loop version of segment_reduce_ref_grad (for the reference self-test)."""
    idx, x, S = _prep(index, src, num_segments)
    g = grad_out.detach().to("cpu", torch.float64)
    E = idx.numel()
    xf = x.reshape(E, -1)
    gf = g.reshape(S, -1)
    grad = torch.zeros_like(xf)
    for e in range(E):
        s = int(idx[e])
        members = [k for k in range(E) if int(idx[k]) == s]
        for f in range(xf.shape[1]):
            if reduce == "sum":
                grad[e, f] = gf[s, f]
            elif reduce == "mean":
                grad[e, f] = gf[s, f] / len(members)
            else:
                vals = [float(xf[k, f]) for k in members]
                best = max(vals) if reduce == "max" else min(vals)
                grad[e, f] = gf[s, f] / vals.count(best) if float(xf[e, f]) == best else 0.0
    return grad.reshape(x.shape)


# --------------------------------------------------------------------------- #
# comparison helper
# --------------------------------------------------------------------------- #
# Tolerances for sum/mean, per src dtype:
#   RTOL: relative to |ref| (rounding of the result to the output dtype; the
#         contract's ~1e-2 for fp16/bf16, ~1e-5 for fp32, ~1e-12 for fp64);
#   ACC:  relative to the segment's sum of magnitudes reduce(|src|) (rounding
#         during accumulation; fp16/bf16 accumulate in fp32).
RTOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
ACC = {
    torch.float64: 1e-14,
    torch.float32: 1e-6,
    torch.float16: 1e-5,
    torch.bfloat16: 1e-5,
}


def sum_tolerance(index, src, reduce, num_segments) -> torch.Tensor:
    """Element-wise allowed |got - ref| for sum/mean (float64, CPU)."""
    ref = segment_reduce_ref(index, src, reduce, num_segments)
    scale = segment_reduce_ref(index, src.abs(), reduce, num_segments)
    dtype = src.dtype
    return RTOL[dtype] * ref.abs() + ACC[dtype] * scale + ACC[dtype] * 1e-3


def assert_matches_ref(out, index, src, reduce, num_segments, where=""):
    """Checks a geot result against the float64 reference.

    sum/mean: |out - ref| <= RTOL * |ref| + ACC * reduce(|src|) element-wise
      (see above), so a half type accumulated in half precision fails.
    max/min: the result is one of the inputs, so it must be exact.
    """
    dtype = src.dtype
    assert out.dtype == dtype, f"{where}: dtype {out.dtype} != {dtype}"
    assert out.device == src.device, f"{where}: device {out.device} != {src.device}"
    S = num_segments
    if S is None:
        S = int(index[-1]) + 1 if index.numel() > 0 else 0
    exp_shape = (S,) + tuple(src.shape[1:])
    assert tuple(out.shape) == exp_shape, f"{where}: shape {tuple(out.shape)} != {exp_shape}"
    got = out.detach().to("cpu", torch.float64)
    assert not torch.isnan(got).any(), f"{where}: NaN in output at {torch.isnan(got).nonzero()[:5].tolist()}"
    ref = segment_reduce_ref(index, src, reduce, S)
    if reduce in ("max", "min"):
        # the reference of the rounded inputs, rounded back, is exact
        ref = ref.to(dtype).to(torch.float64)
        bad = got != ref
    else:
        bad = ~((got - ref).abs() <= sum_tolerance(index, src, reduce, S))
    if bad.any():
        pos = bad.nonzero()
        first = tuple(pos[0].tolist())
        cnt = segment_counts(index, S)
        raise AssertionError(
            f"{where}: {int(bad.sum())}/{bad.numel()} elements wrong for reduce={reduce} "
            f"dtype={dtype}; first at {first} (segment size {int(cnt[first[0]])}): "
            f"got {got[first].item()!r}, expected {ref[first].item()!r}; "
            f"wrong segments: {pos[:, 0].unique()[:10].tolist()}"
        )


# --------------------------------------------------------------------------- #
# graph / input generators (all return int64 CPU index tensors)
# --------------------------------------------------------------------------- #
def index_from_degrees(deg: torch.Tensor) -> torch.Tensor:
    """Sorted index in which segment s appears deg[s] times."""
    deg = deg.to(torch.long)
    return torch.repeat_interleave(torch.arange(deg.numel()), deg)


def random_index(E: int, S: int, *, lo: int = 0, hi: Optional[int] = None, generator=None) -> torch.Tensor:
    """E values drawn uniformly from [lo, hi) (default [0, S)), sorted.

    Segments outside [lo, hi) are empty, so lo > 0 gives leading and hi < S
    trailing empty segments; E < S makes many interior ones empty as well.
    """
    hi = S if hi is None else hi
    assert 0 <= lo <= hi <= S
    if E == 0:
        return torch.zeros(0, dtype=torch.long)
    assert hi > lo, "need a non-empty range for E > 0"
    return torch.randint(lo, hi, (E,), generator=generator).sort().values


def one_segment_index(E: int, segment: int = 0) -> torch.Tensor:
    """All E elements in one segment (others, if any, empty)."""
    return torch.full((E,), segment, dtype=torch.long)


def huge_segment_index(E: int, S: int, big: int, small_deg: int = 2, generator=None) -> torch.Tensor:
    """Segment `big` takes almost all of E; the other segments get
    0..small_deg elements each (some empty)."""
    deg = torch.randint(0, small_deg + 1, (S,), generator=generator)
    deg[big] = 0
    deg[big] = max(E - int(deg.sum()), 1)
    return index_from_degrees(deg)


def powerlaw_degrees(S: int, E: int, alpha: float = 2.1, generator=None) -> torch.Tensor:
    """Degrees of S segments summing to E, heavy-tailed (Pareto-weighted
    multinomial): a few hubs, many small and some empty segments."""
    u = torch.rand(S, generator=generator, dtype=torch.float64).clamp_min(1e-12)
    w = u.pow(-1.0 / (alpha - 1.0))
    if E == 0 or S == 0:
        return torch.zeros(S, dtype=torch.long)
    picks = torch.multinomial(w, E, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=S)


def powerlaw_index(S: int, E: int, alpha: float = 2.1, generator=None) -> torch.Tensor:
    return index_from_degrees(powerlaw_degrees(S, E, alpha, generator))


def random_src(E: int, feat: Sequence[int], dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Standard-normal values (never all zero), made in float64 then cast."""
    x = torch.randn((E,) + tuple(feat), dtype=torch.float64, generator=generator)
    return x.to(dtype).to(device)


def distinct_src(E: int, feat: Sequence[int], dtype=torch.float64, device="cpu", generator=None) -> torch.Tensor:
    """All values distinct and well separated (a shuffled grid in [-1, 1)):
    max/min are tie-free, so their gradient is well defined for gradcheck."""
    n = E
    for f in feat:
        n *= f
    perm = torch.randperm(n, generator=generator).to(torch.float64)
    x = (perm / max(n, 1)) * 2.0 - 1.0
    return x.view((E,) + tuple(feat)).to(dtype).to(device)


def describe(index: torch.Tensor, num_segments: int) -> str:
    """A short description of a graph for failure messages."""
    cnt = segment_counts(index, num_segments)
    return (
        f"E={index.numel()} S={num_segments} max_deg={int(cnt.max()) if cnt.numel() else 0} "
        f"empty={int((cnt == 0).sum())}"
    )


def graph_case(name: str, generator=None) -> Tuple[torch.Tensor, int]:
    """Named index layouts used by several tests: returns (index int64, S)."""
    if name == "uniform":
        return random_index(300, 40, generator=generator), 40
    if name == "leading_trailing_empty":
        return random_index(120, 64, lo=9, hi=50, generator=generator), 64
    if name == "powerlaw":
        return powerlaw_index(500, 4000, generator=generator), 500
    raise KeyError(name)


def graph_with_duplicates(num_src, num_dst, num_edges, device):
    """Unsorted edges with duplicated edges and duplicated self loops; a few
    destinations and sources left without edges."""
    src = torch.randint(0, max(1, num_src - 2), (num_edges,), device=device)
    dst = torch.randint(0, max(1, num_dst - 2), (num_edges,), device=device)
    loops = torch.arange(0, min(num_src, num_dst) - 2, 3, device=device)
    src = torch.cat([src, src[:5], loops, loops])
    dst = torch.cat([dst, dst[:5], loops, loops])
    perm = torch.randperm(src.numel(), device=device)
    return torch.stack([src[perm], dst[perm]])
