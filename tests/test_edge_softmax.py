"""Tests of geot.edge_softmax (softmax over the edges of each destination)
and its gradient against a float64 scatter-based reference."""
import re

import pytest
import torch

import geot
from conftest import DTYPES, requires_cuda
from reference import huge_segment_index, index_from_degrees, powerlaw_index, random_index

# Allowed |got - ref| = RTOL * |ref| + ATOL: the rounding of y in [0, 1] to
# the output dtype and of the fp32 sum of exp over a destination's edges
# (fp16/bf16 compute in fp32).
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ATOL = {torch.float64: 1e-14, torch.float32: 1e-7, torch.float16: 1e-5, torch.bfloat16: 1e-4}


def softmax_ref(score, dst_index, S):
    """float64, CPU: max per destination (scatter amax), exp, sum, divide."""
    s = score.detach().cpu().double()
    rows = s.reshape(s.shape[0], s.shape[1] if s.dim() == 2 else 1)
    dst = dst_index.cpu().long()
    heads = rows.shape[1]
    full = dst[:, None].expand_as(rows)
    top = torch.full((S, heads), float("-inf"), dtype=torch.float64).scatter_reduce(0, full, rows, "amax")
    e = (rows - top[dst]).exp()
    total = torch.zeros(S, heads, dtype=torch.float64).index_add_(0, dst, e)
    return (e / total[dst]).reshape(s.shape)


def softmax_ref_autograd(score64, dst_index, S):
    rows = score64.reshape(score64.shape[0], score64.shape[1] if score64.dim() == 2 else 1)
    dst = dst_index.cpu().long()
    top = torch.full((S, rows.shape[1]), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, dst[:, None].expand_as(rows), rows.detach(), "amax")
    e = (rows - top[dst]).exp()
    total = torch.zeros(S, rows.shape[1], dtype=torch.float64).index_add(0, dst, e)
    return (e / total[dst]).reshape(score64.shape)


def assert_softmax_close(out, ref, dtype, where=""):
    got = out.detach().cpu().double()
    assert got.shape == ref.shape, f"{where}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    bad = ~((got - ref).abs() <= RTOL[dtype] * ref.abs() + ATOL[dtype])
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{where}: {int(bad.sum())}/{bad.numel()} wrong, first at {first}: "
                             f"got {got[first].item()}, expected {ref[first].item()}")


# name -> (dst_index, S, heads: None for 1-D score)
GRAPHS = {
    "E0": lambda: (torch.zeros(0, dtype=torch.long), 5, 4),
    "1d": lambda: (random_index(400, 60), 60, None),
    "H1": lambda: (random_index(400, 60), 60, 1),
    "H4_empty_segments": lambda: (random_index(150, 200, lo=10, hi=190), 200, 4),
    "H3": lambda: (powerlaw_index(80, 900), 80, 3),
    "H8_powerlaw": lambda: (powerlaw_index(300, 5000), 300, 8),
    "H40": lambda: (random_index(300, 20), 20, 40),
    "hub_1d": lambda: (huge_segment_index(6000, 50, big=7), 50, None),
    "hub_H4": lambda: (huge_segment_index(6000, 50, big=49), 50, 4),
    "hub_H3": lambda: (huge_segment_index(3000, 9, big=0), 9, 3),
    # a destination past the last long-segment level: on CUDA the softmax composed of segment reduces
    "big_hub_H4": lambda: (huge_segment_index(40000, 30, big=11), 30, 4),
    "big_hub_1d": lambda: (huge_segment_index(70000, 5, big=4), 5, None),
    "one_segment": lambda: (torch.zeros(700, dtype=torch.long), 1, 2),
    "degree_1": lambda: (torch.arange(500), 500, 2),
}


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(device, dtype, graph):
    dst, S, heads = GRAPHS[graph]()
    shape = (dst.numel(),) if heads is None else (dst.numel(), heads)
    score = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype).to(device)
    index_dtype = torch.int32 if dtype in (torch.float16, torch.float64) else torch.int64
    out = geot.edge_softmax(score, dst.to(device, index_dtype), S)
    assert out.dtype == dtype and out.device == score.device and out.shape == score.shape
    assert_softmax_close(out, softmax_ref(score, dst, S), dtype, graph)


def test_sums_to_one_and_num_segments_omitted(device):
    dst = powerlaw_index(100, 2000).to(device)
    score = torch.randn(dst.numel(), 4, device=device)
    out = geot.edge_softmax(score, dst)
    S = int(dst[-1]) + 1
    sums = torch.zeros(S, 4, device=device).index_add_(0, dst, out)
    nonempty = torch.bincount(dst, minlength=S) > 0
    torch.testing.assert_close(sums[nonempty], torch.ones_like(sums[nonempty]))


@pytest.mark.parametrize("graph", ["hub_H4", "big_hub_H4"])
def test_masked_scores_get_zero(device, graph):
    """-inf scores (GAT's masked input self loops) get 0 and leave the rest a
    softmax, in the fused kernels and in the composed path of big hubs."""
    dst, S, heads = GRAPHS[graph]()
    score = torch.randn(dst.numel(), heads, dtype=torch.float64)
    masked = (torch.arange(dst.numel()) % 7 == 0) & (dst == torch.bincount(dst).argmax())  # in the hub only
    score[masked] = float("-inf")
    out = geot.edge_softmax(score.to(device, torch.float32), dst.to(device), S)
    assert (out[masked.to(device)] == 0).all()
    assert_softmax_close(out, softmax_ref(score, dst, S), torch.float32, graph)


def test_numerically_stable(device):
    """Scores far beyond exp's range: the max is subtracted first."""
    dst = torch.tensor([0, 0, 0, 1, 1, 2], device=device)
    score = torch.tensor([1000.0, 1001.0, 999.0, -2000.0, -2001.0, 5e4], device=device)
    out = geot.edge_softmax(score, dst, 3)
    assert torch.isfinite(out).all()
    assert_softmax_close(out, softmax_ref(score, dst, 3), torch.float32)
    half = geot.edge_softmax(score.half().clamp(-6e4, 6e4), dst, 3)
    assert torch.isfinite(half).all()


def test_masked_scores(device):
    """-inf scores (masked edges) get 0; the others share the mass."""
    dst = torch.tensor([0, 0, 0, 1, 1], device=device)
    score = torch.tensor([[0.5, float("-inf")], [float("-inf"), 1.0], [1.5, 2.0], [0.0, 0.0], [1.0, float("-inf")]],
                         device=device)
    out = geot.edge_softmax(score, dst, 2)
    assert_softmax_close(out, softmax_ref(score, dst, 2), torch.float32)
    assert out[1, 0] == 0 and out[0, 1] == 0 and out[4, 1] == 0


def test_noncontiguous_score(device):
    dst = random_index(300, 40).to(device)
    score = torch.randn(4, dst.numel(), device=device).t()  # [E, 4], strides (1, E)
    out = geot.edge_softmax(score, dst, 40)
    assert_softmax_close(out, softmax_ref(score, dst, 40), torch.float32)


# --------------------------------------------------------------------------- #
# in place (edge_softmax_)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_matches_out_of_place(device, dtype, graph):
    """edge_softmax_ overwrites score with exactly what edge_softmax returns
    (the same kernels: each value read before the thread writes it; up to
    rounding where big hubs take the composed path on CUDA)."""
    dst, S, heads = GRAPHS[graph]()
    dst = dst.to(device)
    shape = (dst.numel(),) if heads is None else (dst.numel(), heads)
    score = (torch.randn(shape, device=device) * 3).to(dtype)
    expected = geot.edge_softmax(score, dst, S)
    overwritten = score.clone()
    assert geot.edge_softmax_(overwritten, dst.int(), S) is overwritten
    if graph.startswith("big_hub") and device == "cuda":  # composed of segment reduces, whose atomics add in any order
        torch.testing.assert_close(overwritten, expected)
    else:
        assert torch.equal(overwritten, expected)


def test_in_place_errors(device):
    dst = torch.tensor([0, 0, 1, 3], device=device)
    score = torch.randn(4, 2, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="edge_softmax_ overwrites score, which requires grad"):
        geot.edge_softmax_(score, dst, 4)
    with torch.no_grad():
        geot.edge_softmax_(score, dst, 4)  # nothing to differentiate: allowed
    with pytest.raises(ValueError, match="score must be contiguous to be overwritten"):
        geot.edge_softmax_(torch.randn(2, 4, device=device).t(), dst, 4)
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        geot.edge_softmax_(torch.randn(4, 2, device=device), torch.tensor([0, 1, 0, 3], device=device), 4)


def test_in_place_compiled(device):
    """Inductor runs the mutating op on its own temporary, not on a copy of
    it (two [E, H] buffers: leaky_relu's, overwritten, and the product's),
    and gives the eager result."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    dst = powerlaw_index(300, 5000).to(device)

    def attention(score):
        return geot.edge_softmax_(torch.nn.functional.leaky_relu(score, 0.2), dst, 300) * 2

    score = torch.randn(dst.numel(), 4, device=device)
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(attention, fullgraph=True), score)
        torch.testing.assert_close(out, attention(score))
    assert len(re.findall(r"empty_strided_\w+\(\(5000, 4\)", code)) == 2, code
    torch.library.opcheck(torch.ops.geot.edge_softmax_.default, (score.clone(), dst, 300))


# --------------------------------------------------------------------------- #
# backward
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("graph", ["1d", "H4_empty_segments", "H3", "H8_powerlaw", "H40", "hub_H4", "hub_H3",
                                   "big_hub_H4", "big_hub_1d"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference(device, dtype, graph):
    dst, S, heads = GRAPHS[graph]()
    shape = (dst.numel(),) if heads is None else (dst.numel(), heads)
    score = torch.randn(shape, dtype=torch.float64).to(dtype).to(device).requires_grad_()
    grad = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    geot.edge_softmax(score, dst.to(device), S).backward(grad)
    score64 = score.detach().cpu().double().requires_grad_()
    softmax_ref_autograd(score64, dst, S).backward(grad.cpu().double())
    assert score.grad.dtype == dtype
    # |grad_score| <= y * (|g| + max |g|): scale the tolerance by max |g|
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(score.grad.cpu().double(), score64.grad, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("heads", [None, 1, 3])
def test_gradcheck(device, heads):
    dst = index_from_degrees(torch.tensor([3, 0, 4, 1, 5, 0, 2])).to(device)
    shape = (dst.numel(),) if heads is None else (dst.numel(), heads)
    score = torch.randn(shape, dtype=torch.float64, device=device).requires_grad_()
    fn = lambda s: geot.edge_softmax(s, dst, 7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (score,))
    if device == "cpu":
        assert torch.autograd.gradgradcheck(fn, (score,))


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #
def test_errors(device):
    dst = torch.tensor([0, 0, 1, 3], device=device)
    score = torch.randn(4, 2, device=device)
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        geot.edge_softmax(score, torch.tensor([0, 1, 0, 3], device=device), 4)
    with pytest.raises(ValueError, match="dst_index has values >= num_segments"):
        geot.edge_softmax(score, dst, 3)
    with pytest.raises(ValueError, match="dst_index has negative"):
        geot.edge_softmax(score, torch.tensor([-1, 0, 1, 3], device=device), 4)
    with pytest.raises(ValueError, match="score and dst_index must have the same length"):
        geot.edge_softmax(score[:3], dst, 4)
    with pytest.raises(ValueError, match=r"score must have shape \[E\] or \[E, H\]"):
        geot.edge_softmax(score[..., None], dst, 4)
    with pytest.raises(TypeError, match="score must be a float"):
        geot.edge_softmax(score.long(), dst, 4)
    with pytest.raises(TypeError, match="dst_index must be an int32 or int64"):
        geot.edge_softmax(score, dst.float(), 4)
    with pytest.raises(ValueError, match="dst_index must be 1-D"):
        geot.edge_softmax(score, dst[None], 4)
    with pytest.raises(ValueError, match="num_segments must be >= 0"):
        geot.edge_softmax(score, dst, -1)
    with pytest.raises(TypeError, match="score must be a torch.Tensor"):
        geot.edge_softmax([1.0], dst, 4)


def test_backward_op_errors(device):
    dst = torch.tensor([0, 0, 1], device=device)
    y = torch.rand(3, 2, device=device)
    with pytest.raises(ValueError, match="grad must have the shape of y"):
        torch.ops.geot.edge_softmax_backward(y, y[:, :1], dst, 2)
    with pytest.raises(TypeError, match="grad must have the dtype of y"):
        torch.ops.geot.edge_softmax_backward(y, y.double(), dst, 2)


@requires_cuda
def test_error_device_mismatch():
    with pytest.raises(ValueError, match="dst_index must be on the device of score"):
        geot.edge_softmax(torch.randn(3, device="cuda"), torch.tensor([0, 0, 1]), 2)


def test_validation_off_out_of_range_no_crash(device):
    score = torch.randn(5, 2, device=device)
    with geot.validation.validation(False):
        out = geot.edge_softmax(score, torch.tensor([0, 1, 9, 9, -3], device=device), 3)
        assert out.shape == (5, 2)
        out = geot.edge_softmax(score, torch.tensor([2, 1, 0, 1, 0], device=device), 3)
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- #
# torch.compile, opcheck
# --------------------------------------------------------------------------- #
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    dst = random_index(200, 30).to(device)

    def fn(score):
        return (geot.edge_softmax(score, dst, 30) * torch.arange(4.0, device=score.device)).sum()

    score = torch.randn(200, 4, device=device, requires_grad=True)
    loss = torch.compile(fn, fullgraph=True)(score)
    loss.backward()
    grad = score.grad.clone()
    score.grad = None
    expected = fn(score)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, score.grad)


@pytest.mark.parametrize("heads", [None, 4])
def test_opcheck(device, heads):
    dst = index_from_degrees(torch.tensor([3, 0, 4, 1, 5])).to(device)
    shape = (dst.numel(),) if heads is None else (dst.numel(), heads)
    score = torch.randn(shape, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.geot.edge_softmax.default, (score, dst, 5))
    y = torch.rand(shape, device=device, requires_grad=True)
    g = torch.randn(shape, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.geot.edge_softmax_backward.default, (y, g, dst, 5))
