"""Self-tests of tests/reference.py (no geot needed).

The reference is checked against an explicit Python loop and against torch's
own scatter_reduce, so that the geot tests compare against something known to
be right.
"""
import pytest
import torch

from reference import (
    REDUCES,
    assert_matches_ref,
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
    segment_reduce_loop,
    segment_reduce_loop_grad,
    segment_reduce_ref,
    segment_reduce_ref_grad,
)


def _scatter_reduce(index, src, reduce, S):
    """torch.scatter_reduce(include_self=False) with empty segments set to 0."""
    x = src.double()
    idx = index.view((-1,) + (1,) * (x.dim() - 1)).expand_as(x)
    name = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]
    base = torch.zeros((S,) + tuple(x.shape[1:]), dtype=torch.float64)
    return base.scatter_reduce(0, idx, x, name, include_self=False)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("case", ["uniform", "leading_trailing_empty", "powerlaw", "3d", "E0"])
def test_reference_against_loop_and_scatter(reduce, case):
    if case == "3d":
        index, S = random_index(50, 9, lo=1, hi=8), 9
        src = random_src(50, (3, 5))
    elif case == "E0":
        index, S = torch.zeros(0, dtype=torch.long), 4
        src = random_src(0, (3,))
    else:
        index, S = graph_case(case)
        src = random_src(index.numel(), (6,))
    ref = segment_reduce_ref(index, src, reduce, S)
    torch.testing.assert_close(ref, segment_reduce_loop(index, src, reduce, S), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref, _scatter_reduce(index, src, reduce, S), rtol=1e-12, atol=1e-12)
    assert ref.dtype == torch.float64 and ref.shape == (S,) + tuple(src.shape[1:])
    empty = segment_counts(index, S) == 0
    assert (ref[empty] == 0).all()


def test_reference_against_torch_segment_reduce():
    # torch.segment_reduce takes lengths; give a positive initial-free check on
    # non-empty segments only.
    deg = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    index = index_from_degrees(deg)
    src = random_src(index.numel(), (4,), torch.float64)
    for reduce, name in [("sum", "sum"), ("mean", "mean"), ("max", "max"), ("min", "min")]:
        expected = torch.segment_reduce(src, name, lengths=deg, axis=0)
        torch.testing.assert_close(segment_reduce_ref(index, src, reduce, 8), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduce", REDUCES)
def test_reference_grad_against_loop(reduce):
    index, S = random_index(25, 8, lo=1, hi=7), 8
    # integer values: plenty of ties for max/min
    src = torch.randint(-2, 3, (25, 3)).double()
    g = torch.randn(S, 3, dtype=torch.float64)
    torch.testing.assert_close(
        segment_reduce_ref_grad(index, src, reduce, S, g),
        segment_reduce_loop_grad(index, src, reduce, S, g),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_reference_grad_against_autograd(reduce):
    index, S = random_index(40, 10, lo=2, hi=9), 10
    src = random_src(40, (2, 3), torch.float64).requires_grad_()
    g = torch.randn(S, 2, 3, dtype=torch.float64)
    # index_add_ based reference is differentiable for sum/mean
    out = torch.zeros(S, 2, 3, dtype=torch.float64).index_add(0, index, src)
    if reduce == "mean":
        out = out / segment_counts(index, S).clamp(min=1).double().view(-1, 1, 1)
    (out * g).sum().backward()
    torch.testing.assert_close(segment_reduce_ref_grad(index, src, reduce, S, g), src.grad)


def test_reference_max_grad_is_shared_by_ties():
    index = torch.tensor([0, 0, 0, 2, 2])
    src = torch.tensor([[1.0, 5.0], [3.0, 5.0], [3.0, 4.0], [7.0, 7.0], [7.0, 6.0]], dtype=torch.float64)
    g = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]], dtype=torch.float64)
    expected = torch.tensor([[0.0, 10.0], [5.0, 10.0], [5.0, 0.0], [25.0, 60.0], [25.0, 0.0]], dtype=torch.float64)
    assert torch.equal(segment_reduce_ref_grad(index, src, "max", 3, g), expected)


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_reference_extremum_grad_is_torch_scatter_reduce(reduce):
    """The reference's max/min gradient is torch's scatter_reduce amax/amin's, started from -inf/inf (so no
    initial value ties; from zeros, as PyG starts, torch also counts a 0 output's start as a tie)."""
    index, S = random_index(40, 9, lo=0, hi=8), 9
    src = torch.randint(-2, 3, (40, 3)).double().requires_grad_()
    g = torch.randn(S, 3, dtype=torch.float64)
    start = torch.full((S, 3), -torch.inf if reduce == "max" else torch.inf, dtype=torch.float64)
    out = start.scatter_reduce(0, index.view(-1, 1).expand(-1, 3), src, "a" + reduce[:3], include_self=False)
    torch.testing.assert_close(segment_reduce_ref_grad(index, src, reduce, S, g),
                               torch.autograd.grad(out, src, g)[0], rtol=1e-12, atol=1e-12)


def test_generators():
    g = torch.Generator().manual_seed(0)
    idx = random_index(100, 20, lo=3, hi=17, generator=g)
    assert idx.numel() == 100 and (idx[1:] >= idx[:-1]).all()
    assert int(idx.min()) >= 3 and int(idx.max()) < 17
    assert (one_segment_index(7, 2) == 2).all()
    h = huge_segment_index(10_000, 50, big=20, generator=g)
    cnt = segment_counts(h, 50)
    assert h.numel() == 10_000 and int(cnt.argmax()) == 20 and int(cnt[20]) > 9_800
    assert (h[1:] >= h[:-1]).all()
    deg = powerlaw_degrees(1000, 20_000, generator=g)
    assert int(deg.sum()) == 20_000
    assert int(deg.max()) > 10 * 20  # heavy tail: a hub far above the mean degree
    assert int((deg == 0).sum()) > 0
    p = powerlaw_index(100, 500, generator=g)
    assert (p[1:] >= p[:-1]).all() and p.numel() == 500
    d = distinct_src(20, (3,))
    assert d.unique().numel() == 60


def test_assert_matches_ref_can_fail():
    index, S = random_index(50, 10), 10
    src = random_src(50, (4,))
    good = segment_reduce_ref(index, src, "sum", S).float()
    assert_matches_ref(good, index, src, "sum", S)
    bad = good.clone()
    bad[3, 1] += 1e-3
    with pytest.raises(AssertionError, match="wrong"):
        assert_matches_ref(bad, index, src, "sum", S)
    mx = segment_reduce_ref(index, src, "max", S).float()
    assert_matches_ref(mx, index, src, "max", S)
    mx[int(index[0]), 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_matches_ref(mx, index, src, "max", S)
    with pytest.raises(AssertionError, match="shape"):
        assert_matches_ref(good[:-1], index, src, "sum", S)
    with pytest.raises(AssertionError, match="dtype"):
        assert_matches_ref(good.double(), index, src, "sum", S)
