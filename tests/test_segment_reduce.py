"""Tests of geot.segment_reduce against the float64 reference in reference.py."""
import gc
import itertools

import pytest
import torch

import geot
from conftest import DTYPES, requires_cuda
from reference import (
    REDUCES,
    RTOL,
    assert_matches_ref,
    describe,
    distinct_src,
    graph_case,
    huge_segment_index,
    index_from_degrees,
    one_segment_index,
    powerlaw_degrees,
    powerlaw_index,
    random_index,
    random_src,
    segment_counts,
    segment_reduce_ref,
    segment_reduce_ref_grad,
    sum_tolerance,
)

INDEX_DTYPES = [pytest.param(torch.int32, id="i32"), pytest.param(torch.int64, id="i64")]


def poison_allocator(shape, dtype, device):
    """On CUDA, fill a block of the caching allocator with NaN and free it, so
    that the next allocation of this size (the output) likely starts as NaN: a
    kernel that forgets to write some output element (e.g. an empty segment)
    then leaves a NaN behind instead of a lucky 0."""
    if torch.device(device).type == "cuda":
        t = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
        del t


def make_src(E, feat, dtype, device, layout="contig"):
    """Random src of shape [E, *feat] in one of several memory layouts."""
    if layout == "contig":
        x = random_src(E, feat, dtype, device)
        assert x.is_contiguous()
        return x
    if layout == "transposed":  # [E, F] view of an [F, E] tensor: strides (1, E)
        (F,) = feat
        x = random_src(F, (E,), dtype, device).t()
    elif layout == "strided_cols":  # every other column of an [E, 2F] tensor
        (F,) = feat
        x = random_src(E, (2 * F,), dtype, device)[:, ::2]
    elif layout == "strided_rows":  # every other row, with an offset
        x = random_src(2 * E + 1, feat, dtype, device)[1::2]
    elif layout == "expanded":  # stride 0 along the features
        (F,) = feat
        x = random_src(E, (1,), dtype, device).expand(E, F)
    elif layout == "permuted3d":  # [E, 3, 5] view of a [5, E, 3] tensor
        a, b = feat
        x = random_src(b, (E, a), dtype, device).permute(1, 2, 0)
    else:
        raise KeyError(layout)
    assert tuple(x.shape) == (E,) + tuple(feat)
    if E > 1:
        assert not x.is_contiguous()
    return x


# name -> () -> (index int64 CPU, num_segments, feature shape, src layout)
FORWARD_CASES = {
    "E0_S0": lambda: (torch.zeros(0, dtype=torch.long), 0, (4,), "contig"),
    "E0_S5": lambda: (torch.zeros(0, dtype=torch.long), 5, (4,), "contig"),
    "one_segment": lambda: (one_segment_index(64), 1, (8,), "contig"),
    "one_segment_middle": lambda: (one_segment_index(37, 3), 7, (5,), "contig"),
    "single_element": lambda: (torch.tensor([2]), 4, (3,), "contig"),
    "many_empty": lambda: (random_index(60, 300, lo=7, hi=290), 300, (6,), "contig"),
    "sparse_huge_S": lambda: (random_index(10, 100_000, lo=50, hi=99_000), 100_000, (3,), "contig"),
    "F1": lambda: (random_index(500, 60), 60, (1,), "contig"),
    "F3": lambda: (random_index(500, 60), 60, (3,), "contig"),
    "F7": lambda: (random_index(500, 60), 60, (7,), "contig"),
    "F33": lambda: (random_index(400, 50), 50, (33,), "contig"),
    "F128": lambda: (random_index(300, 40), 40, (128,), "contig"),
    "3d": lambda: (random_index(200, 30, lo=1, hi=29), 30, (3, 5), "contig"),
    "huge_segment": lambda: (huge_segment_index(100_000, 5, big=2), 5, (4,), "contig"),
    "huge_segment_F1": lambda: (huge_segment_index(100_000, 3, big=1), 3, (1,), "contig"),
    "powerlaw": lambda: (powerlaw_index(400, 5000), 400, (16,), "contig"),
    "powerlaw_F5": lambda: (powerlaw_index(300, 3000), 300, (5,), "contig"),
    "noncontig_transposed": lambda: (random_index(300, 40), 40, (8,), "transposed"),
    "noncontig_transposed_F3": lambda: (random_index(300, 40, lo=2, hi=37), 40, (3,), "transposed"),
    "noncontig_strided_cols": lambda: (random_index(300, 40), 40, (8,), "strided_cols"),
    "noncontig_strided_rows": lambda: (random_index(300, 40), 40, (6,), "strided_rows"),
    "noncontig_expanded": lambda: (random_index(300, 40), 40, (8,), "expanded"),
    "noncontig_3d": lambda: (random_index(200, 30), 30, (3, 5), "permuted3d"),
}
CUDA_ONLY_CASES = {
    "huge_segment_1M": lambda: (huge_segment_index(1_000_000, 9, big=4), 9, (2,), "contig"),
    "powerlaw_large": lambda: (powerlaw_index(20_000, 400_000), 20_000, (32,), "contig"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES) + list(CUDA_ONLY_CASES))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
def test_forward_matches_reference(device, reduce, dtype, index_dtype, case):
    if case in CUDA_ONLY_CASES:
        if device != "cuda":
            pytest.skip("large case, CUDA only")
        index, S, feat, layout = CUDA_ONLY_CASES[case]()
    else:
        index, S, feat, layout = FORWARD_CASES[case]()
    index = index.to(device=device, dtype=index_dtype)
    src = make_src(index.numel(), feat, dtype, device, layout)
    src_before = src.clone()
    index_before = index.clone()
    poison_allocator((S,) + tuple(feat), dtype, device)
    out = geot.segment_reduce(index, src, reduce, S)
    where = f"{case} ({describe(index, S)}, feat={feat}, layout={layout}, index {index_dtype})"
    assert_matches_ref(out, index, src, reduce, S, where=where)
    # inputs are left alone
    assert torch.equal(src, src_before)
    assert torch.equal(index, index_before)
    # empty segments are exactly 0 (not -inf / +inf / NaN) for every reduce
    empty = (segment_counts(index, S) == 0).to(out.device)
    if empty.any():
        assert (out[empty] == 0).all(), f"{where}: empty segments not 0"


@pytest.mark.parametrize("reduce", REDUCES)
def test_forward_all_negative_and_all_positive(device, reduce):
    """max of all-negative rows / min of all-positive rows must not be clamped
    by a 0 initial value, and empty segments next to them must still be 0."""
    index = torch.tensor([0, 0, 0, 2, 2, 3], device=device)
    neg = -(torch.rand(6, 4, device=device) + 0.5)
    pos = torch.rand(6, 4, device=device) + 0.5
    for src in (neg, pos):
        out = geot.segment_reduce(index, src, reduce, 5)
        assert_matches_ref(out, index, src, reduce, 5, where="sign case")


@pytest.mark.parametrize("reduce", REDUCES)
def test_forward_fp16_needs_wide_accumulator(device, reduce):
    """Segment 0: 50 * 1500 - 14 * 1000 = 61000 fits in fp16 (max 65504), but
    a running fp16 sum would pass 65504 (inf) on the way; fp32 accumulation
    gives the right answer in any order."""
    index = torch.tensor([0] * 64 + [1] * 3, device=device)
    src = torch.empty(67, 2, dtype=torch.float16, device=device)
    src[:50] = 1500.0
    src[50:64] = -1000.0
    src[64:] = torch.tensor([[3.0, -2.0], [1.0, 5.0], [-4.0, 0.5]], dtype=torch.float16, device=device)
    out = geot.segment_reduce(index, src, reduce, 2)
    assert torch.isfinite(out).all(), f"fp16 overflow: {out}"
    assert_matches_ref(out, index, src, reduce, 2, where="fp16 wide accumulator")


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_forward_infinities(device, reduce):
    x = torch.randn(6, 3, device=device)
    x[1, 0] = float("inf")
    x[2, 1] = float("-inf")
    x[4, 2] = float("inf")
    x[5, 2] = float("-inf")
    idx = torch.tensor([0, 0, 0, 2, 2, 2], device=device)
    out = geot.segment_reduce(idx, x, reduce, 3)
    ref = segment_reduce_ref(idx, x, reduce, 3).float()
    assert torch.equal(out.cpu(), ref), f"got {out}, expected {ref}"


# --------------------------------------------------------------------------- #
# num_segments / defaults / config on CPU
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case", ["uniform", "leading_trailing_empty", "powerlaw"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_num_segments_omitted(device, reduce, case):
    index, _ = graph_case(case)
    index = index.to(device)
    src = random_src(index.numel(), (5,), torch.float32, device)
    S = int(index[-1]) + 1
    out = geot.segment_reduce(index, src, reduce)
    assert out.shape == (S, 5)
    # CUDA sums merge partial results with float atomics in any order, so two
    # runs agree to rounding, not bit for bit.
    torch.testing.assert_close(out, geot.segment_reduce(index, src, reduce, S), rtol=1e-5, atol=1e-5)
    assert_matches_ref(out, index, src, reduce, S, where=case)


def test_num_segments_omitted_empty(device):
    index = torch.zeros(0, dtype=torch.long, device=device)
    src = torch.randn(0, 7, device=device)
    for reduce in REDUCES:
        out = geot.segment_reduce(index, src, reduce)
        assert out.shape == (0, 7) and out.dtype == torch.float32 and out.device == src.device


def test_default_reduce_is_sum(device):
    index = random_index(100, 12).to(device)
    src = random_src(100, (4,), torch.float32, device)
    S = int(index[-1]) + 1
    out = geot.segment_reduce(index, src)
    assert_matches_ref(out, index, src, "sum", S)
    # Equal up to the order of float atomics (a segment split across threads).
    torch.testing.assert_close(out, geot.segment_reduce(index, src, "sum", S))


def test_config_ignored_on_cpu():
    index, S = graph_case("powerlaw")
    src = random_src(index.numel(), (6,), torch.float32)
    space = geot.config_space()
    picks = [space[0], space[len(space) // 2], space[-1]]
    picks += [c for c in space if c.G_t == 1][:1] + [c for c in space if c.G_t > 1][:1]
    for reduce in REDUCES:
        expected = geot.segment_reduce(index, src, reduce, S)
        for cfg in picks:
            out = geot.segment_reduce(index, src, reduce, S, config=cfg)
            assert torch.equal(out, expected), f"config {cfg} changed the CPU result"


def test_config_space():
    space = geot.config_space()
    assert all(isinstance(c, geot.Config) for c in space)
    assert geot.Config._fields == ("N_t", "T_N", "M_t", "T_M", "G_t")
    expected = {
        geot.Config(N_t, T_N, M_t, T_M, G_t)
        for N_t, T_N, M_t, T_M, G_t in itertools.product(
            [1, 2, 4], [16, 32, 64], [8, 16, 32, 64], [1, 2, 4, 8], [1, 8, 16, 32]
        )
    }
    assert len(space) == len(set(space)), "duplicate configs"
    missing = expected - set(space)
    assert not missing, f"{len(missing)} configs of the pruned SR+PR space missing, e.g. {sorted(missing)[:3]}"
    # extra schedules (a G_t outside SR/PR) are tolerated, but the tiling
    # fields must stay inside the pruned space
    for c in space:
        assert c.N_t in (1, 2, 4) and c.T_N in (16, 32, 64) and c.M_t in (8, 16, 32, 64) and c.T_M in (1, 2, 4, 8), c


def test_heuristic_follows_the_long_segment_hint():
    E, S = 3_000_000, 300_000  # large enough to leave the small-graph rules

    def heuristic(*args, **kwargs):
        return geot.explain(*args, **kwargs, arch=0)  # arch 0: no learned rules

    for F in (2, 8, 16):
        even = heuristic(E, S, F, long_segments=False)
        assert even.G_t == 1 and even.T_N * even.N_t <= F, even  # narrow SR
        assert heuristic(E, S, F, long_segments=True) == heuristic(E, S, F), "unknown must mean skewed"
    assert heuristic(E, S, 4, long_segments=True).G_t > 1  # PR
    assert heuristic(E, S, 128, gathered=True, long_segments=False).G_t == 0  # SP
    assert heuristic(E, S, 128, gathered=True, long_segments=True).G_t == 1  # SR
    assert heuristic(E, S, 128, gathered=True) == heuristic(E, S, 128, gathered=True, long_segments=True)
    # Every pick is launchable, the heuristic's and the learned rules' (every known architecture).
    for arch in [0, *geot._C.learned_archs()]:
        for F in range(1, 300, 7):
            for gathered, hint in itertools.product((False, True), (None, False, True)):
                geot.explain(E, S, F, gathered, hint, arch=arch).validate()
                geot.explain(1000, 100, F, gathered, hint, arch=arch).validate()


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_validation_measures_long_segments(device, index_dtype):
    """Index validation reports how many of the thresholds 64, 1024, 16384
    rows the longest segment exceeds (the selectors' skew feature)."""
    expected = {1: 0, 64: 0, 65: 1, 1024: 1, 1025: 2, 16384: 2, 16385: 3}
    for longest, level in expected.items():
        lengths = torch.tensor([3, longest, 0, 5, 1])  # the long one in the middle, an empty one after
        index = torch.repeat_interleave(torch.arange(5), lengths).to(device, index_dtype)
        assert geot._C.long_segment_level(index, 5) == level, longest
    assert [geot.config.long_segment_level(n) for n in expected] == list(expected.values())
    with geot.validation.validation(False):
        assert geot._C.long_segment_level(torch.zeros(100, dtype=index_dtype, device=device), 1) == -1


def test_op_registered():
    assert hasattr(torch.ops.geot, "segment_reduce")


# --------------------------------------------------------------------------- #
# backward
# --------------------------------------------------------------------------- #
# 20 elements in 7 segments; segment 2 and the trailing segment 6 are empty
GRADCHECK_DEG = torch.tensor([3, 4, 0, 5, 1, 7, 0])


@pytest.mark.parametrize("layout", ["contig", "transposed"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
def test_gradcheck(device, reduce, index_dtype, layout):
    index = index_from_degrees(GRADCHECK_DEG).to(device=device, dtype=index_dtype)
    S = GRADCHECK_DEG.numel()
    E = index.numel()
    if layout == "contig":
        src = distinct_src(E, (3,), torch.float64, device)
    else:
        src = distinct_src(3, (E,), torch.float64, device).t()
    src.requires_grad_()

    def fn(x):
        return geot.segment_reduce(index, x, reduce, S)

    assert torch.autograd.gradcheck(fn, (src,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("reduce", REDUCES)
def test_gradcheck_3d(device, reduce):
    index = index_from_degrees(torch.tensor([0, 2, 3, 0, 4])).to(device)
    src = distinct_src(9, (2, 3), torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: geot.segment_reduce(index, x, reduce, 5), (src,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_extremum_ties_share_the_gradient(device, reduce, dtype):
    """With ties each tied row gets an even share of the gradient (exact: shares of 1/2 and 1/4)."""
    index = torch.tensor([0, 0, 0, 0, 1, 1, 3, 3, 3], device=device)  # segments 2, 4 empty
    src = torch.tensor(
        [
            [2.0, 7.0, 1.0],
            [5.0, 7.0, 1.0],
            [5.0, 7.0, 0.0],
            [1.0, 7.0, 0.0],
            [3.0, 0.0, 4.0],
            [3.0, 1.0, 4.0],
            [-1.0, 2.0, 9.0],
            [-1.0, 2.0, 9.0],
            [-4.0, 2.0, 9.0],
        ],
        dtype=dtype,
        device=device,
        requires_grad=True,
    )
    S = 5
    g = (4 * torch.arange(S * 3, dtype=torch.float64).view(S, 3) + 4).to(dtype).to(device)
    out = geot.segment_reduce(index, src, reduce, S)
    out.backward(g)
    # (row e, feature f): (segment s, rows tied with e), e getting g[s, f] / ties
    if reduce == "max":
        shares = {(1, 0): (0, 2), (2, 0): (0, 2), (4, 0): (1, 2), (5, 0): (1, 2), (6, 0): (3, 2), (7, 0): (3, 2),
                  (0, 1): (0, 4), (1, 1): (0, 4), (2, 1): (0, 4), (3, 1): (0, 4), (5, 1): (1, 1), (6, 1): (3, 3),
                  (7, 1): (3, 3), (8, 1): (3, 3), (0, 2): (0, 2), (1, 2): (0, 2), (4, 2): (1, 2), (5, 2): (1, 2),
                  (6, 2): (3, 3), (7, 2): (3, 3), (8, 2): (3, 3)}
    else:
        shares = {(3, 0): (0, 1), (4, 0): (1, 2), (5, 0): (1, 2), (8, 0): (3, 1), (0, 1): (0, 4), (1, 1): (0, 4),
                  (2, 1): (0, 4), (3, 1): (0, 4), (4, 1): (1, 1), (6, 1): (3, 3), (7, 1): (3, 3), (8, 1): (3, 3),
                  (2, 2): (0, 2), (3, 2): (0, 2), (4, 2): (1, 2), (5, 2): (1, 2), (6, 2): (3, 3), (7, 2): (3, 3),
                  (8, 2): (3, 3)}
    expected = torch.zeros(9, 3, dtype=torch.float64)
    for (e, f), (s, ties) in shares.items():
        expected[e, f] = float(g[s, f]) / ties
    assert src.grad is not None and src.grad.dtype == dtype and src.grad.shape == src.shape
    got = src.grad.detach().cpu().double()
    shared_by_three = torch.tensor([(e, f) in shares and shares[e, f][1] == 3 for e in range(9) for f in range(3)])
    exact = ~shared_by_three.view(9, 3)  # thirds round in the dtype
    assert torch.equal(got[exact], expected[exact]), f"grad with ties:\n{got}\nexpected\n{expected}"
    torch.testing.assert_close(got, expected, rtol=RTOL[dtype], atol=0)
    torch.testing.assert_close(got, segment_reduce_ref_grad(index, src, reduce, S, g), rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_extremum_ties_grad_random(device, reduce, dtype):
    """Many ties (small integer values) on a power-law graph: each tied row's share of the gradient."""
    index = powerlaw_index(300, 4000).to(device)
    S = 300
    src = torch.randint(-3, 4, (index.numel(), 9)).to(dtype).to(device).requires_grad_()
    g = torch.randint(1, 100, (S, 9)).to(dtype).to(device)
    geot.segment_reduce(index, src, reduce, S).backward(g)
    expected = segment_reduce_ref_grad(index, src, reduce, S, g).to(dtype).double()  # the share, rounded
    got = src.grad.detach().cpu().double()
    bad = ~torch.isclose(got, expected, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-6, atol=0)
    assert not bad.any(), (
        f"{int(bad.sum())} grad entries wrong, first at {bad.nonzero()[0].tolist()}: "
        f"got {got[bad][:5].tolist()} expected {expected[bad][:5].tolist()}"
    )


@pytest.mark.parametrize("layout", ["contig", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
def test_backward_matches_reference(device, reduce, dtype, layout):
    S = 500
    deg = powerlaw_degrees(S, 6000)
    deg[:3] = 0  # leading empty segments
    deg[-3:] = 0  # trailing empty segments
    index = index_from_degrees(deg).to(device)
    src = make_src(index.numel(), (16,), dtype, device, layout).requires_grad_()
    g = random_src(S, (16,), dtype, device)
    out = geot.segment_reduce(index, src, reduce, S)
    assert out.requires_grad
    assert_matches_ref(out, index, src, reduce, S, where="forward with requires_grad")
    out.backward(g)
    grad = src.grad
    assert grad.shape == src.shape and grad.dtype == dtype and grad.device == src.device
    expected = segment_reduce_ref_grad(index, src, reduce, S, g)
    got = grad.detach().cpu().double()
    if reduce in ("max", "min"):
        # the gradient of max/min is g or a share of it among ties: exact up to the share's rounding
        expected = expected.to(dtype).double()
        assert torch.equal(got, expected), f"{int((got != expected).sum())} wrong grad entries"
    else:
        torch.testing.assert_close(got, expected, rtol=RTOL[dtype], atol=RTOL[dtype] * 1e-2)


@pytest.mark.parametrize("reduce", REDUCES)
def test_backward_through_sum_loss(device, reduce):
    """out.sum().backward() hands the op an expanded (stride 0) grad_out."""
    index, S = graph_case("leading_trailing_empty")
    index = index.to(device)
    src = random_src(index.numel(), (2, 3), torch.float32, device).requires_grad_()
    geot.segment_reduce(index, src, reduce, S).sum().backward()
    g = torch.ones(S, 2, 3, dtype=torch.float64)
    expected = segment_reduce_ref_grad(index, src, reduce, S, g)
    torch.testing.assert_close(src.grad.cpu().double(), expected, rtol=1e-6, atol=1e-7)


def test_backward_empty_input(device):
    for reduce in REDUCES:
        index = torch.zeros(0, dtype=torch.long, device=device)
        src = torch.randn(0, 4, device=device, requires_grad=True)
        out = geot.segment_reduce(index, src, reduce, 3)
        assert torch.equal(out.detach().cpu(), torch.zeros(3, 4))
        out.backward(torch.randn(3, 4, device=device))
        assert src.grad is not None and src.grad.shape == (0, 4)


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #
def _ok_inputs(device, E=6, S=3):
    index = torch.tensor([0, 0, 1, 1, 2, 2][:E], device=device)
    src = torch.randn(E, 4, device=device)
    return index, src, S


@pytest.mark.parametrize("bad_dtype", [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_error_index_dtype(device, bad_dtype):
    index, src, S = _ok_inputs(device)
    with pytest.raises(TypeError, match="index"):
        geot.segment_reduce(index.to(bad_dtype), src, "sum", S)


@pytest.mark.parametrize("bad_dtype", [torch.int32, torch.int64, torch.bool])
def test_error_src_dtype(device, bad_dtype):
    index, src, S = _ok_inputs(device)
    with pytest.raises(TypeError, match="src"):
        geot.segment_reduce(index, src.to(bad_dtype), "sum", S)


def test_error_index_not_1d(device):
    index, src, S = _ok_inputs(device)
    with pytest.raises(ValueError, match="index"):
        geot.segment_reduce(index.view(2, 3), src, "sum", S)
    with pytest.raises(ValueError, match="index"):
        geot.segment_reduce(index.view(2, 3), src, "sum")
    with pytest.raises(ValueError, match="index"):
        geot.segment_reduce(torch.tensor(0, device=device), src[:1], "sum", S)


@pytest.mark.parametrize("E_index", [5, 7, 0])
def test_error_length_mismatch(device, E_index):
    _, src, S = _ok_inputs(device)
    index = torch.zeros(E_index, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="index|src"):
        geot.segment_reduce(index, src, "sum", S)


def test_error_src_0dim(device):
    index = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="src"):
        geot.segment_reduce(index, torch.tensor(1.0, device=device), "sum", 1)


@pytest.mark.parametrize("bad", ["prod", "add", "", "Sum", "amax"])
def test_error_reduce(device, bad):
    index, src, S = _ok_inputs(device)
    with pytest.raises(ValueError, match="reduce"):
        geot.segment_reduce(index, src, bad, S)


def test_error_num_segments_negative(device):
    index, src, _ = _ok_inputs(device)
    with pytest.raises(ValueError, match="num_segments"):
        geot.segment_reduce(index, src, "sum", -1)
    with pytest.raises(ValueError, match="num_segments"):
        geot.segment_reduce(index[:0], src[:0], "sum", -3)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_error_index_negative(device, index_dtype):
    index = torch.tensor([-1, 0, 0, 1, 2, 2], device=device, dtype=index_dtype)
    src = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match="index"):
        geot.segment_reduce(index, src, "sum", 3)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_error_index_out_of_range(device, index_dtype):
    index, src, _ = _ok_inputs(device)
    index = index.to(index_dtype)
    with pytest.raises(ValueError, match="index|num_segments"):
        geot.segment_reduce(index, src, "max", 2)  # index[-1] == 2 == num_segments
    with pytest.raises(ValueError, match="index|num_segments"):
        geot.segment_reduce(index, src, "sum", 0)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_error_index_unsorted(device, index_dtype):
    index = torch.tensor([0, 1, 0, 1, 2, 2], device=device, dtype=index_dtype)
    src = torch.randn(6, 4, device=device)
    with pytest.raises(ValueError, match="sorted"):
        geot.segment_reduce(index, src, "sum", 3)
    # unsorted only at the very end
    index = torch.tensor([0, 0, 1, 1, 2, 1], device=device, dtype=index_dtype)
    with pytest.raises(ValueError, match="sorted"):
        geot.segment_reduce(index, src, "mean", 3)


@requires_cuda
def test_error_device_mismatch():
    index, src, S = _ok_inputs("cpu")
    with pytest.raises((ValueError, RuntimeError)):
        geot.segment_reduce(index.cuda(), src, "sum", S)
    with pytest.raises((ValueError, RuntimeError)):
        geot.segment_reduce(index, src.cuda(), "sum", S)


# --------------------------------------------------------------------------- #
# validation switch
# --------------------------------------------------------------------------- #
def test_validation_switch():
    assert geot.validation_enabled() is True  # on by default
    geot.set_validation(False)
    assert geot.validation_enabled() is False
    geot.set_validation(True)
    assert geot.validation_enabled() is True


def test_validation_off_valid_input_still_right(device):
    geot.set_validation(False)
    index, S = graph_case("leading_trailing_empty")
    index = index.to(device)
    src = random_src(index.numel(), (7,), torch.float32, device)
    for reduce in REDUCES:
        assert_matches_ref(geot.segment_reduce(index, src, reduce, S), index, src, reduce, S, where="validation off")


def test_validation_remembers_a_hetero_models_indices(device):
    """An index checked once is not checked again while it is unchanged, even
    after 40 other indices were checked (a heterogeneous model's graphs and
    their transposes): a change behind its version counter (``.data``) goes
    unnoticed, as a remembered check does (the kernels skip the id it puts
    out of range)."""
    src = random_src(4, (3,), torch.float32, device)
    first = torch.tensor([0, 0, 1, 3], device=device)
    geot.segment_reduce(first, src, "sum", 4)
    others = [torch.tensor([0, 1, 2, 3], device=device) for _ in range(40)]
    for index in others:
        geot.segment_reduce(index, src, "sum", 4)
    first.data[3] = 100
    out = geot.segment_reduce(first, src, "sum", 4)  # checked again, it would raise
    assert_matches_ref(out, first[:3], src[:3], "sum", 4, where="a remembered index")


def test_validation_off_keeps_type_and_shape_errors(device):
    geot.set_validation(False)
    index, src, S = _ok_inputs(device)
    with pytest.raises(TypeError, match="index"):
        geot.segment_reduce(index.float(), src, "sum", S)
    with pytest.raises(TypeError, match="src"):
        geot.segment_reduce(index, src.long(), "sum", S)
    with pytest.raises(ValueError, match="reduce"):
        geot.segment_reduce(index, src, "prod", S)
    with pytest.raises(ValueError, match="index|src"):
        geot.segment_reduce(index[:-1], src, "sum", S)


# --------------------------------------------------------------------------- #
# torch.compile
# --------------------------------------------------------------------------- #
def test_torch_compile_forward(device):
    torch._dynamo.reset()
    S = 30

    def fn(index, src):
        return tuple(geot.segment_reduce(index, src, r, num_segments=S) for r in REDUCES)

    compiled = torch.compile(fn, fullgraph=True)
    index = random_index(200, S, lo=1, hi=28).to(device)
    src = random_src(200, (8,), torch.float32, device)
    got = compiled(index, src)
    expected = fn(index, src)
    for r, a, b in zip(REDUCES, got, expected):
        assert a.shape == (S, 8) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"compiled {r} differs from eager")
        assert_matches_ref(a, index, src, r, S, where=f"compiled {r}")


def test_torch_compile_sum_backward(device):
    torch._dynamo.reset()
    S = 25

    def fn(index, src):
        return torch.tanh(geot.segment_reduce(index, src, "sum", num_segments=S)) * 2.0

    compiled = torch.compile(fn, fullgraph=True)
    index = random_index(150, S, lo=2, hi=24).to(device)
    base = random_src(150, (6,), torch.float32, device)
    g = random_src(S, (6,), torch.float32, device)
    x1 = base.clone().requires_grad_()
    x2 = base.clone().requires_grad_()
    out1 = compiled(index, x1)
    out2 = fn(index, x2)
    torch.testing.assert_close(out1, out2, rtol=1e-6, atol=1e-6)
    out1.backward(g)
    out2.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-6)
    # and against the reference chain rule
    ref = segment_reduce_ref(index, base, "sum", S)
    gy = g.cpu().double() * 2.0 * (1.0 - torch.tanh(ref) ** 2)
    torch.testing.assert_close(
        x1.grad.cpu().double(), segment_reduce_ref_grad(index, base, "sum", S, gy), rtol=1e-5, atol=1e-6
    )


def test_torch_compile_varying_num_edges(device):
    """A second call with another E (same S) recompiles with a symbolic E or
    reuses the graph; either way the answers must stay right."""
    torch._dynamo.reset()
    S = 12

    def fn(index, src):
        return geot.segment_reduce(index, src, "mean", num_segments=S) + 1.0

    compiled = torch.compile(fn, fullgraph=True)
    for E in (40, 57, 90):
        index = random_index(E, S).to(device)
        src = random_src(E, (3,), torch.float32, device)
        got = compiled(index, src)
        ref = segment_reduce_ref(index, src, "mean", S) + 1.0
        torch.testing.assert_close(got.double().cpu(), ref.cpu(), rtol=1e-5, atol=1e-6)


def _op_args(index, src, reduce, num_segments):
    """Arguments of torch.ops.geot.segment_reduce, matched by schema name."""
    schema = torch.ops.geot.segment_reduce.default._schema
    known = {"index": index, "src": src, "reduce": reduce, "num_segments": num_segments, "config": None}
    args = []
    for a in schema.arguments:
        if a.name in known:
            args.append(known[a.name])
        elif a.has_default_value():
            break
        else:
            pytest.skip(f"unknown argument {a.name} in schema {schema}")
    return tuple(args)


@pytest.mark.parametrize("reduce", REDUCES)
def test_opcheck(device, reduce):
    """torch.library.opcheck: schema, fake (meta) kernel, autograd registration."""
    index = index_from_degrees(torch.tensor([2, 0, 3, 1, 4, 0])).to(device)
    src = distinct_src(index.numel(), (5,), torch.float32, device).requires_grad_()
    args = _op_args(index, src, reduce, 6)
    torch.library.opcheck(torch.ops.geot.segment_reduce.default, args)


# --------------------------------------------------------------------------- #
# CUDA: every kernel config
# --------------------------------------------------------------------------- #
def _config_graph():
    """Medium power-law graph with leading/trailing empty segments and a hub
    big enough to need many tiles along the edge dimension."""
    deg = torch.cat([torch.zeros(5, dtype=torch.long), powerlaw_degrees(2990, 20_000), torch.zeros(5, dtype=torch.long)])
    deg[1234] += 7000
    return index_from_degrees(deg), deg.numel()


@requires_cuda
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("F", [1, 3, 32])
@pytest.mark.parametrize("reduce", REDUCES)
def test_every_config_cuda(reduce, F, index_dtype):
    index, S = _config_graph()
    index = index.to(device="cuda", dtype=index_dtype)
    src = random_src(index.numel(), (F,), torch.float32, "cuda")
    ref = segment_reduce_ref(index, src, reduce, S).cuda()
    if reduce in ("max", "min"):
        expected, tol = ref.float(), None
    else:
        expected = ref
        tol = sum_tolerance(index, src, reduce, S).cuda()
    failures = []
    for cfg in geot.config_space():
        poison_allocator((S, F), torch.float32, "cuda")
        try:
            out = geot.segment_reduce(index, src, reduce, S, config=cfg)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - record and report every failing config
            failures.append(f"{cfg}: raised {type(exc).__name__}: {str(exc)[:200]}")
            if "CUDA" in str(exc) or "cuda" in str(exc):
                break  # the context may be gone; stop here
            continue
        if out.shape != (S, F) or out.dtype != torch.float32:
            failures.append(f"{cfg}: shape {tuple(out.shape)} dtype {out.dtype}")
            continue
        if tol is None:
            bad = out != expected
        else:
            bad = ~((out.double() - expected).abs() <= tol)  # NaN counts as bad
        nbad = int(bad.sum())
        if nbad:
            first = tuple(bad.nonzero()[0].tolist())
            failures.append(
                f"{cfg}: {nbad} wrong, first at {first} got {out[first].item()!r} expected {expected[first].item()!r}"
            )
    assert not failures, (
        f"{len(failures)}/{len(geot.config_space())} configs wrong ({describe(index, S)}, F={F}, {reduce}):\n"
        + "\n".join(failures[:20])
    )


@requires_cuda
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_every_config_cuda_half(reduce):
    """fp16/bf16 through every config on a smaller graph."""
    index, S = powerlaw_index(500, 6000), 500
    index = index.cuda()
    failures = []
    for dtype in (torch.float16, torch.bfloat16):
        src = random_src(index.numel(), (7,), dtype, "cuda")
        for cfg in geot.config_space():
            out = geot.segment_reduce(index, src, reduce, S, config=cfg)
            try:
                assert_matches_ref(out, index, src, reduce, S, where=str(cfg))
            except AssertionError as exc:
                failures.append(str(exc)[:300])
    assert not failures, f"{len(failures)} failing (config, dtype) pairs:\n" + "\n".join(failures[:20])


# --------------------------------------------------------------------------- #
# CUDA: segment offsets of the SP schedule, cached per index
# --------------------------------------------------------------------------- #
# 16 rows per lane: with F = 4..8, 4 row lanes cap SP at 64 rows, longer segments overflow
SP = geot.Config(N_t=1, T_N=32, M_t=16, T_M=8, G_t=0)
SP_CAP_64 = geot.Config(N_t=2, T_N=4, M_t=64, T_M=32, G_t=0)  # F = 8: one lane, 64 rows
SR = geot.Config(N_t=1, T_N=32, M_t=8, T_M=8, G_t=1)


def _cached():
    return geot._C.segment_offsets_cached()


def test_static_index_declaration_is_keyed_like_the_caches():
    """A declaration holds for that index's values: a copy is not declared,
    and an in-place change ends it (a capture would read stale offsets)."""
    index = torch.arange(100)
    other = index.clone()
    assert not geot._C.is_static_index(index)
    geot.mark_static_index(index)
    assert geot._C.is_static_index(index) and geot._C.is_static_index(index[:])
    assert not geot._C.is_static_index(other) and not geot._C.is_static_index(index[1:])
    index.add_(1)
    assert not geot._C.is_static_index(index)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_long_runs_of_empty_segments(device, index_dtype):
    """Ids at both ends of 2^17 segments and one in the middle: runs of tens
    of thousands of empty segments, whose offsets (SP's, and the sizes of a
    mean) the CUDA launch writes in parallel past a few hundred. Every
    reduction, learned or SP config, matches the reference."""
    S = 1 << 17
    ids = torch.cat([torch.randint(0, 50, (300,)), torch.full((40,), 70_000), torch.randint(S - 30, S, (300,))])
    index = ids.sort().values.to(device, index_dtype)
    src = random_src(index.numel(), (5,), torch.float32, device)
    for reduce, config in itertools.product(REDUCES, (None, SP)):
        out = geot.segment_reduce(index, src, reduce, S, config=config)
        assert_matches_ref(out, index, src, reduce, S, where=f"{reduce}, config {config}")


@requires_cuda
def test_sp_offsets_rebuilt_after_in_place_change():
    geot.clear_cache()
    S = 300
    index = powerlaw_index(S, 5000).cuda()
    src = random_src(index.numel(), (8,), torch.float32, "cuda")
    assert_matches_ref(geot.segment_reduce(index, src, "sum", S, config=SP), index, src, "sum", S)
    assert _cached() == 1
    assert_matches_ref(geot.segment_reduce(index, src, "max", S, config=SP), index, src, "max", S)
    assert _cached() == 1  # reused
    # Same storage, new values: the version counter moves, so stale offsets
    # (which would misplace every row) must not be taken.
    index.copy_(powerlaw_index(S, 5000).cuda())
    assert_matches_ref(geot.segment_reduce(index, src, "sum", S, config=SP), index, src, "sum", S)
    assert _cached() == 2
    geot.clear_cache()
    assert _cached() == 0


@requires_cuda
def test_sp_offsets_keyed_by_num_segments():
    geot.clear_cache()
    index = powerlaw_index(200, 3000).cuda()
    src = random_src(index.numel(), (4,), torch.float32, "cuda")
    for S in (200, 260, 200):
        assert_matches_ref(geot.segment_reduce(index, src, "mean", S, config=SP), index, src, "mean", S)
    assert _cached() == 2


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sr_offsets_cached_with_sp(dtype):
    """SR reads segment offsets for a mean's sizes, the finalize of max/min
    and half types' chunk slots: one entry per index, made by the first call
    that needs it and shared with SP's."""
    geot.clear_cache()
    S = 3000  # more segments than SR's chunks of 8 rows: half rows of 32 features or more take chunk slots
    index = powerlaw_index(S, 4000).cuda()
    src = random_src(index.numel(), (32,), dtype, "cuda")
    geot.segment_reduce(index, src, "sum", S, config=SR)
    assert _cached() == (1 if dtype == torch.bfloat16 else 0)  # fp32 sums need no offsets
    for reduce in REDUCES:
        assert_matches_ref(geot.segment_reduce(index, src, reduce, S, config=SR), index, src, reduce, S)
    assert _cached() == 1
    assert_matches_ref(geot.segment_reduce(index, src, "sum", S, config=SP), index, src, "sum", S)
    assert _cached() == 1  # SP took SR's entry


@requires_cuda
def test_sp_offsets_freed_with_the_index():
    geot.clear_cache()
    index = powerlaw_index(200, 3000).cuda()
    geot.segment_reduce(index, torch.randn(3000, 4, device="cuda"), "sum", 200, config=SP)
    assert _cached() == 1
    del index
    assert _cached() == 0


@requires_cuda
@pytest.mark.parametrize("reduce", REDUCES)
def test_sp_inference_tensors_not_cached(reduce):
    """Inference tensors have no version counter: offsets (and the overflow
    of hub segments past the cap) are derived on every call."""
    geot.clear_cache()
    with torch.inference_mode():
        index = powerlaw_index(300, 6000).cuda()
        index[-500:] = 299  # a hub far past the cap
        src = random_src(index.numel(), (5,), torch.float32, "cuda")
        for cfg in (SP, SP_CAP_64):
            assert_matches_ref(geot.segment_reduce(index, src, reduce, 300, config=cfg), index, src, reduce, 300)
    assert _cached() == 0


@requires_cuda
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("config", [SP, SP_CAP_64], ids=["SP", "SP_cap64"])
@pytest.mark.parametrize("gathered", [False, True], ids=["plain", "weighted_gather"])
def test_sp_overflow_rows_wherever_long_segments_lie(index_dtype, config, gathered):
    """SP's overflow pass reduces the rows past a segment's cap as one run
    per thread (only the segment a thread's rows begin in can have any
    there): long segments first, last, and beginning part-way through a
    thread's rows, beside segments one row over, at and under the cap and
    empty ones; every reduce, plain rows and weighted gathered rows."""
    deg = torch.tensor([700, 3, 0, 65, 64, 63, 1, 1018, 5, 129, 0, 2, 33, 900])
    index = index_from_degrees(deg).to("cuda", index_dtype)
    S, E, F = deg.numel(), int(deg.sum()), 8
    gen = torch.Generator().manual_seed(5)
    src = random_src(E, (F,), torch.float32, "cuda", generator=gen)
    for reduce in REDUCES:
        if gathered:
            x = random_src(40, (F,), torch.float32, "cuda", generator=gen)
            rows = torch.randint(0, 40, (E,), generator=gen).to("cuda", index_dtype)
            weight = torch.rand(E, generator=gen).cuda() + 0.5
            out = geot.index_weight_segment_reduce(rows, index, weight, x, reduce, S, config=config)
            src = x[rows.long()] * weight[:, None]
        else:
            out = geot.segment_reduce(index, src, reduce, S, config=config)
        assert_matches_ref(out, index, src, reduce, S, where=f"{reduce}, {config}")


@requires_cuda
@pytest.mark.parametrize("validation", [True, False])
def test_sp_segments_of_exactly_the_cap(validation):
    """With validation on, an index without segments over 64 rows skips the
    overflow pass of a 64-row SP cap: a 64-row segment must still be whole.
    With it off the pass runs (the hint is unknown)."""
    deg = torch.randint(0, 65, (500,))
    deg[[0, 17, 499]] = 64
    index = index_from_degrees(deg).cuda()
    src = random_src(index.numel(), (8,), torch.float32, "cuda")
    with geot.validation.validation(validation):
        for reduce in REDUCES:
            out = geot.segment_reduce(index, src, reduce, 500, config=SP_CAP_64)
            assert_matches_ref(out, index, src, reduce, 500)
        deg[3] = 65  # one row over the cap
        index = index_from_degrees(deg).cuda()
        src = random_src(index.numel(), (8,), torch.float32, "cuda")
        assert_matches_ref(geot.segment_reduce(index, src, "sum", 500, config=SP_CAP_64), index, src, "sum", 500)


@requires_cuda
@pytest.mark.parametrize("validation", [True, False])
@pytest.mark.parametrize(
    "cfg, F, lanes",
    [
        (geot.Config(1, 64, 8, 4, 0), 1, 32),  # a warp per segment: cap 256 rows
        (geot.Config(1, 16, 8, 1, 0), 1, 16),  # a 16-thread block: a partial warp shuffles
        (geot.Config(2, 32, 8, 2, 0), 2, 32),  # one float2 column, 32 lanes
        (geot.Config(1, 32, 8, 1, 0), 3, 8),   # 3 columns x 8 lanes, 8 threads idle
        (geot.Config(1, 8, 16, 32, 0), 2, 4),  # narrow: 2 columns x 4 lanes, cap 64
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sp_row_lanes(cfg, F, lanes, validation, dtype):
    """SP threads the features leave over split a segment's rows as lanes:
    segments of exactly the cap (lanes * M_t rows), one row over it, far over
    it, and empty ones, for every reduction."""
    cap = lanes * cfg.M_t
    deg = torch.randint(0, 2 * lanes, (300,))
    deg[[0, 5, 299]] = 0
    deg[[1, 100]] = cap
    deg[[2, 200]] = cap + 1
    deg[150] = 5 * cap + 3
    index = index_from_degrees(deg).cuda()
    src = random_src(index.numel(), (F,), dtype, "cuda")
    with geot.validation.validation(validation):
        for reduce in REDUCES:
            out = geot.segment_reduce(index, src, reduce, 300, config=cfg)
            assert_matches_ref(out, index, src, reduce, 300, where=f"{cfg}, {reduce}")
            x = random_src(64, (F,), dtype, "cuda")
            gather = torch.randint(0, 64, (index.numel(),), device="cuda")
            fused = geot.index_segment_reduce(gather, index, x, reduce, 300, config=cfg)
            assert_matches_ref(fused, index, x[gather], reduce, 300, where=f"fused {cfg}, {reduce}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg, F", [
    (geot.Config(N_t=2, T_N=32, M_t=32, T_M=4, G_t=0), 64),  # 32 columns of 2 features: one lane, 32 rows
    (geot.Config(N_t=1, T_N=32, M_t=4, T_M=4, G_t=0), 8),    # 8 columns x 4 row lanes of 4 rows: 16
])
def test_sp_without_overflow_writes_the_output_itself(dtype, cfg, F):
    """Where validation shows no segment over 64 rows, SP takes every row
    (its cap raised to 64) and writes the output itself, a
    mean divided in the kernel: the call allocates its output and nothing
    else (no fp32 buffer for half types)."""
    deg = torch.randint(0, 65, (4000,))
    deg[[0, 7, 3999]] = 0
    deg[[1, 9]] = 64
    index = index_from_degrees(deg).cuda()
    src = random_src(index.numel(), (F,), dtype, "cuda")
    for reduce in REDUCES:
        for gathered in (False, True):
            out, extra = _second_call_memory(index, src, reduce, 4000, cfg, gathered)
            assert extra <= 1024, (reduce, gathered)
            assert_matches_ref(out, index, src, reduce, 4000, where=f"{reduce}, gathered={gathered}")


def _second_call_memory(index, src, reduce, S, cfg, gathered):
    """(output, bytes allocated besides it at peak) of a call after a first
    one (which validates the index and caches its offsets); gathered: the
    fused op, gathering row e as row e."""
    rows = torch.arange(index.numel(), device=index.device)

    def call():
        if gathered:
            return geot.index_segment_reduce(rows, index, src, reduce, S, config=cfg)
        return geot.segment_reduce(index, src, reduce, S, config=cfg)

    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before - out.nbytes


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("validation", [True, False])
def test_sp_long_segments_of_half_types_take_slots(dtype, validation):
    """Half types past the SP cap: with validation on, SP still writes the
    output itself and each segment over the cap goes whole to the overflow
    pass, into an fp32 slot (at most E / (cap + 1) of them) instead of an
    [S, F] fp32 buffer; with it off (no hint), the buffer. Segments of
    exactly the cap, one row over, far over, and empty ones."""
    cfg, F = geot.Config(N_t=2, T_N=32, M_t=32, T_M=4, G_t=0), 64  # one lane: cap 32 rows
    cap, S = 32, 4000
    deg = torch.randint(0, 12, (S,))
    deg[[0, 7, S - 1]] = 0
    deg[[1, 9]] = cap
    deg[[2, 300, S - 2]] = cap + 1
    deg[[150, 151]] = 20 * cap + 5
    index = index_from_degrees(deg).cuda()
    E = index.numel()
    src = random_src(E, (F,), dtype, "cuda")
    slots = E // (cap + 1)
    slot_bytes = 4 * (S + 1) + slots * (8 + 4 * F)
    assert slot_bytes < S * F * 4 // 2  # the test tells the two apart
    with geot.validation.validation(validation):
        for reduce in REDUCES:
            for gathered in (False, True):
                out, extra = _second_call_memory(index, src, reduce, S, cfg, gathered)
                if validation:
                    assert extra <= slot_bytes + 2048, (reduce, gathered, extra)
                else:
                    assert extra >= S * F * 4, (reduce, gathered, extra)
                assert_matches_ref(out, index, src, reduce, S, where=f"{reduce}, gathered={gathered}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg, F", [
    (geot.Config(N_t=4, T_N=16, M_t=16, T_M=4, G_t=1), 64),  # vector loads, 4-wide flushes
    (geot.Config(N_t=1, T_N=32, M_t=8, T_M=8, G_t=1), 45),   # odd F: scalar
    (geot.Config(N_t=1, T_N=32, M_t=8, T_M=8, G_t=1), 13),   # under 32 features: the [S, F] buffer
])
def test_sr_half_types_write_directly_with_chunk_slots(dtype, cfg, F):
    """SR on half rows of 32 features or more (plain rows: 24) where
    segments average fewer rows than M_t: each segment one thread sees whole
    is written to the output by that thread; those straddling threads' rows
    (two, several, a hub) meet in fp32 rows of one per M_t rows, not an
    [S, F] buffer (narrower rows take the buffer: a few floats a segment,
    chunk_slots_min_features). Empty segments first, last and between;
    segments of exactly M_t rows; plain, gathered (a permutation, so rows
    are not in order) and weighted."""
    m = cfg.M_t
    S = 3000
    deg = torch.randint(0, 6, (S,))
    deg[[0, 1, 1500, S - 1]] = 0
    deg[[10, 11, 12]] = m
    deg[[20, 700]] = 3 * m + 5
    deg[2000] = 40 * m
    index = index_from_degrees(deg).cuda()
    E = index.numel()
    chunks = -(-E // m)
    assert chunks * 4 * F + 8 * (S + 1) < S * F * 4 // 2  # the test tells slots from the [S, F] buffer
    src = random_src(E, (F,), dtype, "cuda")
    for reduce in REDUCES:
        for gathered in (False, True):
            out, extra = _second_call_memory(index, src, reduce, S, cfg, gathered)
            if F >= 32:
                assert extra <= chunks * 4 * F + 8 * (S + 1) + 2048, (reduce, gathered, extra)
            else:
                assert extra >= S * F * 4, (reduce, gathered, extra)
            assert_matches_ref(out, index, src, reduce, S, where=f"{reduce}, gathered={gathered}")
    order = torch.randperm(E, device="cuda")
    signs = torch.randint(0, 2, (E,), device="cuda") * 2 - 1
    weight = (signs * 2.0 ** torch.randint(-2, 3, (E,), device="cuda")).to(dtype)  # exact products: a half reference
    for reduce in REDUCES:
        out = geot.index_weight_segment_reduce(order, index, weight, src, reduce, S, config=cfg)
        messages = weight.double()[:, None] * src.double()[order]
        assert_matches_ref(out, index, messages.to(dtype), reduce, S, where=f"weighted {reduce}")


@requires_cuda
def test_sp_under_cuda_graph_capture():
    """With no cached offsets (no eager SP call before it), a capture derives
    them in the graph (allocated in its pool): used on replay, never cached."""
    geot.clear_cache()
    S = 400
    index = powerlaw_index(S, 8000).cuda()
    src = random_src(index.numel(), (16,), torch.float32, "cuda")
    geot.segment_reduce(index, src, "sum", S, config=SR)  # validates (a sync: not capturable)
    graph, out, allocated = _capture(lambda: geot.segment_reduce(index, src, "sum", S, config=SP))
    assert allocated > out.nbytes
    assert _cached() == 0
    assert_replay_sums_new_rows(graph, out, index, src, S)


@requires_cuda
def test_offsets_cached_off_the_default_stream_only_for_static_indices():
    """torch.compile's CUDA graphs warm up on a side stream with the thread's
    allocations routed to the graph's private pool (a MemPool here): an
    index not declared static gets offsets per call there, none kept; a
    static one (a compiled model's kept graph) gets a cache entry, which the
    capture after the warm-up reads, allocated in the general pool: no live
    block of the private pool holds it."""
    geot.clear_cache()
    S = 400
    index = powerlaw_index(S, 8000).cuda()
    src = random_src(index.numel(), (16,), torch.float32, "cuda")
    stream, pool = torch.cuda.Stream(), torch.cuda.MemPool()

    def warm_up():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
            out = geot.segment_reduce(index, src, "sum", S, config=SP)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    assert_matches_ref(warm_up(), index, src, "sum", S)
    assert _cached() == 0
    geot.mark_static_index(index)
    out = warm_up()
    assert _cached() == 1
    assert_matches_ref(out, index, src, "sum", S)
    torch.cuda.synchronize()
    entry_bytes = {8 * (S + 1), 8}  # ptr, longest
    in_pool = [block for segment in pool.snapshot(include_traces=False) for block in segment["blocks"]
               if block["state"] != "inactive" and block["requested_size"] in entry_bytes]
    assert in_pool == [], "a cache entry in the private pool"
    graph, captured, _ = _capture(lambda: geot.segment_reduce(index, src, "sum", S, config=SP))
    assert _cached() == 1  # read, not made again
    assert_replay_sums_new_rows(graph, captured, index, src, S)


@requires_cuda
def test_compiled_cuda_graphs_read_a_static_index_offsets():
    """torch.compile's reduce-overhead mode, compiled before any eager call:
    its warm-up makes the offsets of an index declared static (a mean needs
    them) and its capture reads them, so replays run no offsets pass; the
    replays are right after the rows change."""
    geot.clear_cache()
    before = _cached()  # entries pinned by earlier tests' live graphs
    S = 400
    index = powerlaw_index(S, 8000).cuda()
    src = random_src(index.numel(), (16,), torch.float32, "cuda")
    geot.mark_static_index(index)
    torch._dynamo.reset()
    mean = torch.compile(lambda rows: geot.segment_reduce(index, rows, "mean", S), mode="reduce-overhead")
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        mean(src)
    assert _cached() == before + 1
    src.copy_(random_src(index.numel(), (16,), torch.float32, "cuda"))
    torch.compiler.cudagraph_mark_step_begin()
    assert_matches_ref(mean(src).clone(), index, src, "mean", S)


def assert_replay_sums_new_rows(graph, out, index, src, S):
    """New rows into src (F = 16), a replay of graph, and its output out checked as their sum."""
    src.copy_(random_src(index.numel(), (16,), torch.float32, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_ref(out, index, src, "sum", S)


def _capture(fn):
    """(graph, fn's output, peak bytes allocated while capturing fn) of fn in a
    CUDA graph (the peak: fn's temporaries are freed to the graph's pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    gc.collect()  # as torch.cuda.graph does on entry, so garbage is not freed inside
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out, torch.cuda.max_memory_allocated() - before


@requires_cuda
def test_captured_sp_call_reads_and_pins_the_cache():
    """A capture reads the offsets an eager call cached for an index declared
    static (no offsets pass on replay, none allocated) and pins them: its kernels keep the address, so
    neither clear_cache nor eviction by other indices may free them while the
    index lives; the replay after both is still right."""
    geot.clear_cache()
    pinned_before = _cached()  # entries earlier tests' graphs pinned, if their indices live on
    S = 400
    index = powerlaw_index(S, 8000).cuda()
    src = random_src(index.numel(), (16,), torch.float32, "cuda")
    geot.segment_reduce(index, src, "sum", S, config=SR)  # validates (a sync: not capturable); caches nothing
    geot.mark_static_index(index)

    def sp_sum():
        return geot.segment_reduce(index, src, "sum", S, config=SP)

    fresh_graph, fresh_out, fresh_bytes = _capture(sp_sum)  # derives its own offsets (a temporary)
    assert _cached() == pinned_before
    sp_sum()
    assert _cached() == pinned_before + 1
    graph, out, cached_bytes = _capture(sp_sum)
    assert fresh_bytes - cached_bytes >= 8 * (S + 1)  # no offsets made in the graph
    geot.clear_cache()
    assert _cached() == pinned_before + 1  # pinned
    others = [powerlaw_index(S, 7000 + i).cuda() for i in range(10)]  # more than the cache holds
    for other in others:
        geot.segment_reduce(other, src[: other.numel()], "sum", S, config=SP)
    junk = [torch.full((S + 1,), 2**40, dtype=torch.long, device="cuda") for _ in range(8)]  # reuse freed blocks
    src.copy_(random_src(index.numel(), (16,), torch.float32, "cuda"))
    graph.replay()
    fresh_graph.replay()
    torch.cuda.synchronize()
    assert_matches_ref(out, index, src, "sum", S)
    assert_matches_ref(fresh_out, index, src, "sum", S)
    del junk, others
    geot.clear_cache()
    assert _cached() == pinned_before + 1  # the pinned entry outlived eviction and clearing


@requires_cuda
def test_capture_derives_offsets_of_an_index_not_declared_static():
    """An index not declared static may be a static buffer that each replay
    refills with another graph (the usual CUDA graph pattern): a capture
    derives its offsets in the graph even when an eager call cached them, so
    a replay after the index changes in place is right."""
    geot.clear_cache()
    S = 400
    index = powerlaw_index(S, 8000).cuda()
    src = random_src(index.numel(), (16,), torch.float32, "cuda")
    geot.segment_reduce(index, src, "sum", S, config=SP)  # caches its offsets
    graph, out, _ = _capture(lambda: geot.segment_reduce(index, src, "sum", S, config=SP))
    index.copy_(powerlaw_index(S, 8000, alpha=1.5).cuda())  # same length, other segments
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_ref(out, index, src, "sum", S)


@requires_cuda
def test_pinned_offsets_freed_with_the_index():
    geot.clear_cache()
    pinned_before = _cached()
    S = 300
    index = powerlaw_index(S, 5000).cuda()
    src = random_src(index.numel(), (8,), torch.float32, "cuda")
    geot.mark_static_index(index)
    geot.segment_reduce(index, src, "sum", S, config=SP)
    graph, _, _ = _capture(lambda: geot.segment_reduce(index, src, "sum", S, config=SP))
    geot.clear_cache()
    assert _cached() == pinned_before + 1  # pinned
    del graph, index
    gc.collect()
    geot.clear_cache()
    assert _cached() == pinned_before


@requires_cuda
def test_index_first_seen_under_cuda_graph_capture():
    """An index made inside the capture (as torch.compile's CUDA graphs make
    RGCN's per-block edges) cannot be validated there (a sync cannot be
    captured): it is passed over, not an error, and the replay is right.
    The same for segment_matmul's ptr."""
    S, E = 300, 5000
    index = powerlaw_index(S, E).cuda()
    gather = torch.randint(0, 64, (E,), device="cuda")
    x = random_src(64, (16,), torch.float32, "cuda")
    ptr = torch.tensor([0, 20, 20, 64], device="cuda")
    weight = torch.randn(3, 16, 8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fresh_index, fresh_gather, fresh_ptr = index + 0, gather + 0, ptr + 0
        out = geot.index_segment_reduce(fresh_gather, fresh_index, x, "sum", S)
        typed = geot.segment_matmul(x, fresh_ptr, weight)
    x.copy_(random_src(64, (16,), torch.float32, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_ref(out, index, x[gather], "sum", S)
    bounds = zip(ptr[:-1].tolist(), ptr[1:].tolist())
    ref = torch.cat([x[a:b].double() @ weight[t].double() for t, (a, b) in enumerate(bounds)])
    torch.testing.assert_close(typed.double(), ref, rtol=5e-3, atol=2e-2)  # fp32 inputs run as TF32


# --------------------------------------------------------------------------- #
# CUDA: validation off never crashes (keep these last: a CUDA fault would
# poison the context for every later test)
# --------------------------------------------------------------------------- #
@requires_cuda
@pytest.mark.parametrize("kind", ["too_large", "way_too_large", "negative", "int32_extremes", "unsorted"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_cuda_validation_off_out_of_range_no_crash(reduce, kind):
    """Also bf16 through SR with chunk slots (64 rows per thread: 32 chunks
    for 50 segments; rows of 32 features), whose slot rows come from segment
    offsets."""
    geot.set_validation(False)
    S = 50
    index = random_index(2000, S).cuda()
    if kind == "unsorted":
        index = index[torch.randperm(index.numel(), device="cuda")]
    elif kind == "too_large":
        index[-40:] = torch.arange(S, S + 40, device="cuda")
    elif kind == "way_too_large":
        index[-3:] = torch.tensor([10**6, 10**9, 2**40], device="cuda")
    elif kind == "negative":
        index[:10] = torch.arange(-10, 0, device="cuda")
    else:
        index[:2] = torch.tensor([-(2**31), -5], device="cuda")
        index[-2:] = torch.tensor([2**31 - 2, 2**31 - 1], device="cuda")
        index = index.to(torch.int32)
    space = geot.config_space()
    chunked_sr = geot.Config(N_t=1, T_N=16, M_t=64, T_M=4, G_t=1)
    configs = [None, space[0], [c for c in space if c.G_t > 1][0], space[-1], chunked_sr]
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(index.numel(), 32, device="cuda", dtype=dtype)
        for cfg in configs:
            out = geot.segment_reduce(index, src, reduce, S, config=cfg)
            torch.cuda.synchronize()
            assert out.shape == (S, 32)
    # the context is still usable and validation back on still catches it
    geot.set_validation(True)
    ok_index = random_index(100, 10).cuda()
    ok_src = torch.randn(100, 4, device="cuda")
    assert_matches_ref(geot.segment_reduce(ok_index, ok_src, reduce, 10), ok_index, ok_src, reduce, 10)
    with pytest.raises(ValueError, match="index|num_segments"):
        geot.segment_reduce(index, src, reduce, S)
    torch.cuda.synchronize()


# segment_broadcast: out[e] = values[index[e]], the adjoint of a segment sum ------------------------------

@pytest.mark.parametrize("case", list(FORWARD_CASES) + list(CUDA_ONLY_CASES))
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_broadcast_matches_reference(device, dtype, index_dtype, case):
    if case in CUDA_ONLY_CASES and torch.device(device).type != "cuda":
        pytest.skip("CUDA-only case")
    index, S, feat, layout = (CUDA_ONLY_CASES.get(case) or FORWARD_CASES[case])()
    values = make_src(S, feat, dtype, device, layout)
    index = index.to(device=device, dtype=index_dtype)
    poison_allocator((index.numel(), *feat), dtype, device)
    got = geot.segment_broadcast(values, index)
    want = values.double().cpu()[index.long().cpu()]  # float64 reference: a plain row gather
    assert got.dtype == dtype and got.shape == (index.numel(), *feat)
    assert torch.equal(got.double().cpu(), want), describe(case=case, dtype=dtype)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_segment_broadcast_gradcheck(device, index_dtype):
    index = powerlaw_index(30, 200).to(device=device, dtype=index_dtype)
    values = torch.randn(30, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: geot.segment_broadcast(v, index), (values,))
    assert torch.autograd.gradgradcheck(lambda v: geot.segment_broadcast(v, index), (values,))


def test_segment_broadcast_is_the_adjoint_of_a_segment_sum(device):
    """<broadcast(v), x> == <v, segment_sum(x)>, as an adjoint must."""
    index = powerlaw_index(50, 1000).to(device)
    values = torch.randn(50, 4, dtype=torch.float64, device=device)
    x = torch.randn(1000, 4, dtype=torch.float64, device=device)
    left = (geot.segment_broadcast(values, index) * x).sum()
    right = (values * geot.segment_reduce(index, x, "sum", 50)).sum()
    assert torch.allclose(left, right)


@pytest.mark.parametrize("bad,message", [
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([0, 4], device=d)), "index"),
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([2, 1], device=d)), "sorted"),
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([[0, 1]], device=d)), "1-D"),
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([0.0, 1.0], device=d)), "index"),
    (lambda d: (torch.tensor([1, 2], device=d), torch.tensor([0, 1], device=d)), "values"),
], ids=["out_of_range", "unsorted", "2d_index", "float_index", "int_values"])
def test_segment_broadcast_rejects_bad_input(device, bad, message):
    values, index = bad(device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        geot.segment_broadcast(values, index)


# gather_rows: out[e] = values[index[e]], ids in any order ---------------------------------------------------

@pytest.mark.parametrize("rows,edges,shape", [(1, 0, (3,)), (5, 1, (1,)), (40, 3000, (7,)), (300, 20000, (8,)),
                                              (20, 500, (2, 3)), (1, 400, (4,))],
                         ids=["no_edges", "one_edge", "odd_width", "heads", "3d_rows", "one_row_hub"])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_rows_matches_reference(device, dtype, index_dtype, rows, edges, shape):
    gen = torch.Generator().manual_seed(rows + edges)
    index = torch.randint(0, rows, (edges,), generator=gen)  # unsorted, duplicated ids
    values = torch.randn(rows, *shape, generator=gen).to(device=device, dtype=dtype)
    poison_allocator((edges, *shape), dtype, device)
    got = torch.ops.geot.gather_rows(values, index.to(device=device, dtype=index_dtype))
    want = values.double().cpu()[index]  # float64 reference: a plain row gather
    assert got.dtype == dtype and got.shape == (edges, *shape)
    assert torch.equal(got.double().cpu(), want)


def test_gather_rows_gradcheck(device):
    index = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(3)).to(device)
    values = torch.randn(30, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: torch.ops.geot.gather_rows(v, index), (values,))
    assert torch.autograd.gradgradcheck(lambda v: torch.ops.geot.gather_rows(v, index), (values,))


@pytest.mark.parametrize("bad,message", [
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([3, 4], device=d)), "index"),
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([0, -1], device=d)), "index"),
    (lambda d: (torch.randn(4, 2, device=d), torch.tensor([[0, 1]], device=d)), "1-D"),
    (lambda d: (torch.tensor([1, 2], device=d), torch.tensor([0, 1], device=d)), "values"),
], ids=["out_of_range", "negative", "2d_index", "int_values"])
def test_gather_rows_rejects_bad_input(device, bad, message):
    values, index = bad(device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        torch.ops.geot.gather_rows(values, index)
