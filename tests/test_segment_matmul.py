"""Tests of geot.segment_matmul (typed matmul), its gradients and
geot.group_by_type against a float64 per-type loop."""
import pytest
import torch

import geot
from conftest import DTYPES, requires_cuda


# Allowed |got - ref| = OUT * |ref| + ACC * (|x| @ |w|): OUT is the rounding of
# the result to the output dtype, ACC the rounding of the products and sums
# (fp32 accumulation; on CUDA fp32 inputs are rounded to TF32, 2^-11).
OUT = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ACC = {torch.float64: 1e-13, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
ACC_CUDA_TF32 = 2e-3
TINY = {torch.float16: 1e-7}  # fp16 subnormal spacing is 6e-8


def ptr_from_sizes(sizes, device="cpu"):
    sizes = torch.as_tensor(sizes, dtype=torch.long)
    return torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(device)


def matmul_ref(x, ptr, weight):
    """float64 loop over types on CPU."""
    x64, w64, p = x.detach().cpu().double(), weight.detach().cpu().double(), ptr.tolist()
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=torch.float64)
    for t in range(weight.shape[0]):
        out[p[t]:p[t + 1]] = x64[p[t]:p[t + 1]] @ w64[t]
    return out


def assert_close_to_ref(out, ref, scale, dtype, device, where=""):
    acc = ACC_CUDA_TF32 if (device == "cuda" and dtype == torch.float32) else ACC[dtype]
    got = out.detach().cpu().double()
    assert got.shape == ref.shape, f"{where}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{where}: NaN"
    bad = (got - ref).abs() > OUT[dtype] * ref.abs() + acc * scale + TINY.get(dtype, 1e-30)
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{where}: {int(bad.sum())}/{bad.numel()} wrong, first at {first}: "
                             f"got {got[first].item()}, expected {ref[first].item()}")


def random_inputs(sizes, K, N, dtype, device):
    M = int(sum(sizes))
    x = torch.randn(M, K, dtype=torch.float64).to(dtype).to(device)
    w = torch.randn(len(sizes), K, N, dtype=torch.float64).to(dtype).to(device)
    return x, ptr_from_sizes(sizes, device), w


# name -> (type sizes, K, N)
CASES = {
    "even": ([30] * 5, 8, 12),
    "empty_types": ([0, 17, 0, 0, 40, 0], 16, 16),
    "T1": ([50], 5, 3),
    "one_huge": ([3, 1000, 2, 0, 5], 24, 40),
    "odd_KN": ([11, 7, 64, 1], 7, 13),
    "M0": ([0, 0, 0], 4, 6),
    "many_small": (torch.randint(0, 5, (200,)).tolist(), 16, 8),
    "multi_tile": ([70, 130, 65], 130, 70),
    "K1_N1": ([9, 4], 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(device, dtype, case):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on CPU only (see test_cuda_float64_refused)")
    sizes, K, N = CASES[case]
    x, ptr, w = random_inputs(sizes, K, N, dtype, device)
    out = geot.segment_matmul(x, ptr, w)
    assert out.dtype == dtype and out.device == x.device
    ref = matmul_ref(x, ptr, w)
    scale = matmul_ref(x.abs(), ptr, w.abs())
    assert_close_to_ref(out, ref, scale, dtype, device, case)


def test_empty_types_give_no_rows(device):
    x, ptr, w = random_inputs([0, 5, 0], 4, 3, torch.float32, device)
    w[0] = float("nan")  # weights of empty types are never read into a row
    w[2] = float("nan")
    out = geot.segment_matmul(x, ptr, w)
    assert not torch.isnan(out).any()


def test_noncontiguous_inputs(device):
    sizes = [20, 0, 33]
    x = torch.randn(8, 53, device=device).t()  # [53, 8], strides (1, 53)
    w = torch.randn(3, 6, 8, device=device).transpose(1, 2)  # [3, 8, 6]
    ptr = ptr_from_sizes(sizes, device)
    out = geot.segment_matmul(x, ptr, w)
    scale = matmul_ref(x.abs(), ptr, w.abs())
    assert_close_to_ref(out, matmul_ref(x, ptr, w), scale, torch.float32, device)


@pytest.mark.parametrize("skew", ["even", "skewed"])
def test_large_matches_reference(device, skew):
    T, M, K, N = 64, 20000, 64, 48
    if skew == "even":
        sizes = [M // T] * T
    else:
        weights = torch.rand(T).pow(4)
        sizes = (weights / weights.sum() * M).long().tolist()
    x, ptr, w = random_inputs(sizes, K, N, torch.float32, device)
    out = geot.segment_matmul(x, ptr, w)
    assert_close_to_ref(out, matmul_ref(x, ptr, w), matmul_ref(x.abs(), ptr, w.abs()), torch.float32, device)


# --------------------------------------------------------------------------- #
# backward
# --------------------------------------------------------------------------- #
def grads_ref(x, ptr, w, grad_out):
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    p = ptr.tolist()
    out = torch.cat([x64[p[t]:p[t + 1]] @ w64[t] for t in range(w.shape[0])])
    out.backward(grad_out.detach().cpu().double())
    return x64.grad, w64.grad


@pytest.mark.parametrize("case", ["even", "empty_types", "one_huge", "odd_KN", "many_small", "multi_tile"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference(device, dtype, case):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on CPU only")
    sizes, K, N = CASES[case]
    x, ptr, w = random_inputs(sizes, K, N, dtype, device)
    x.requires_grad_()
    w.requires_grad_()
    grad_out = torch.randn(x.shape[0], N, dtype=torch.float64).to(dtype).to(device)
    geot.segment_matmul(x, ptr, w).backward(grad_out)
    gx_ref, gw_ref = grads_ref(x, ptr, w, grad_out)
    g_abs = grad_out.detach().abs()
    # grad_x = grad_out @ w_t^T; grad_w[t] = x_t^T @ grad_out_t
    scale_x = matmul_ref(g_abs, ptr, w.detach().abs().transpose(1, 2))
    p = ptr.tolist()
    scale_w = torch.stack([x.detach().cpu().double().abs()[p[t]:p[t + 1]].t() @ g_abs.cpu().double()[p[t]:p[t + 1]]
                           for t in range(len(sizes))])
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert_close_to_ref(x.grad, gx_ref, scale_x, dtype, device, f"{case} grad x")
    assert_close_to_ref(w.grad, gw_ref, scale_w, dtype, device, f"{case} grad weight")


def test_weight_grad_of_empty_type_is_zero(device):
    x, ptr, w = random_inputs([0, 6, 0, 3], 5, 4, torch.float32, device)
    w.requires_grad_()
    geot.segment_matmul(x, ptr, w).sum().backward()
    assert (w.grad[0] == 0).all() and (w.grad[2] == 0).all()
    assert (w.grad[1] != 0).any()


def test_gradcheck_cpu():
    x, ptr, w = random_inputs([3, 0, 4, 1], 3, 2, torch.float64, "cpu")
    x.requires_grad_()
    w.requires_grad_()
    fn = lambda x, w: geot.segment_matmul(x, ptr, w)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))


def test_gradcheck_backward_ops_cpu():
    x, ptr, w = random_inputs([2, 3, 0], 3, 4, torch.float64, "cpu")
    g = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda g, w: torch.ops.geot.segment_matmul_transposed(g, ptr, w), (g, w))
    assert torch.autograd.gradcheck(lambda x, g: torch.ops.geot.segment_matmul_weight_grad(x, ptr, g), (x, g))


@requires_cuda
def test_cuda_gradients_match_cpu():
    """CUDA has no float64 kernels: compare its float32 (TF32) gradients with
    CPU's, within the TF32 bound scaled by the magnitudes summed."""
    sizes, K, N = [40, 0, 129, 7], 20, 33
    x, ptr, w = random_inputs(sizes, K, N, torch.float32, "cpu")
    grad = torch.randn(x.shape[0], N)
    results = []
    for device in ("cpu", "cuda"):
        # detach: on CPU .to() returns x itself, which would then be a leaf requiring grad for the CUDA copy too
        xd, wd = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        geot.segment_matmul(xd, ptr.to(device), wd).backward(grad.to(device))
        results.append((xd.grad.cpu(), wd.grad.cpu()))
    scale_x = torch.einsum("mn,tkn->tmk", grad.abs(), w.abs()).max()  # over every type: an upper bound
    p = ptr.tolist()
    scale_w = max(float((x.abs()[p[t]:p[t + 1]].t() @ grad.abs()[p[t]:p[t + 1]]).max())
                  for t in range(len(sizes)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=ACC_CUDA_TF32 * float(scale_x))
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=ACC_CUDA_TF32 * scale_w)


# --------------------------------------------------------------------------- #
# group_by_type
# --------------------------------------------------------------------------- #
def test_group_by_type(device):
    types = torch.randint(0, 6, (300,), device=device)
    types[types == 4] = 5  # type 4 empty
    perm, ptr = geot.group_by_type(types, 8)  # types 6, 7 empty too
    assert ptr.dtype == torch.long and perm.dtype == torch.long and ptr.numel() == 9
    assert int(ptr[0]) == 0 and int(ptr[-1]) == 300
    grouped = types[perm]
    for t in range(8):
        rows = perm[ptr[t]:ptr[t + 1]]
        assert (grouped[ptr[t]:ptr[t + 1]] == t).all()
        assert (rows.diff() > 0).all(), "stable: rows of one type keep their order"
    x = torch.randn(300, 5, device=device)
    w = torch.randn(8, 5, 3, device=device)
    out_grouped = geot.segment_matmul(x[perm], ptr, w)
    out = torch.empty_like(out_grouped).index_copy_(0, perm, out_grouped)
    expected = torch.bmm(x.unsqueeze(1), w[types]).squeeze(1)
    torch.testing.assert_close(out, expected, rtol=5e-3, atol=2e-2)  # TF32 on CUDA


def test_group_by_type_infers_num_types_and_checks(device):
    types = torch.tensor([2, 0, 2, 1], device=device, dtype=torch.int32)
    perm, ptr = geot.group_by_type(types)
    assert ptr.tolist() == [0, 1, 2, 4]
    assert perm.tolist() == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="outside"):
        geot.group_by_type(types, 2)
    with pytest.raises(TypeError, match="integer"):
        geot.group_by_type(types.float())
    perm, ptr = geot.group_by_type(torch.zeros(0, dtype=torch.long, device=device), 3)
    assert ptr.tolist() == [0, 0, 0, 0]


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #
def _ok(device):
    return random_inputs([4, 0, 6], 3, 5, torch.float32, device)


def test_error_ptr_values(device):
    x, ptr, w = _ok(device)
    with pytest.raises(ValueError, match="ptr must start at 0"):
        geot.segment_matmul(x, torch.tensor([1, 4, 4, 10], device=device), w)
    with pytest.raises(ValueError, match="ptr must be non-decreasing"):
        geot.segment_matmul(x, torch.tensor([0, 6, 4, 10], device=device), w)
    with pytest.raises(ValueError, match=r"ptr must end at the number of rows, x.size\(0\) = 10"):
        geot.segment_matmul(x, torch.tensor([0, 4, 4, 9], device=device), w)


def test_error_types_and_shapes(device):
    x, ptr, w = _ok(device)
    with pytest.raises(TypeError, match="ptr must be an int64"):
        geot.segment_matmul(x, ptr.int(), w)
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        geot.segment_matmul(x, ptr, w.half())
    with pytest.raises(TypeError, match="x must be a float"):
        geot.segment_matmul(x.long(), ptr, w.long())
    with pytest.raises(ValueError, match=r"x.size\(1\) must be weight.size\(1\)"):
        geot.segment_matmul(x[:, :2], ptr, w)
    with pytest.raises(ValueError, match="weight must be 3-D"):
        geot.segment_matmul(x, ptr, w[0])
    with pytest.raises(ValueError, match=r"weight.size\(0\) must be the number of types"):
        geot.segment_matmul(x, ptr, w[:2])
    with pytest.raises(ValueError, match="x must be 2-D"):
        geot.segment_matmul(x[None], ptr, w)
    with pytest.raises(ValueError, match="ptr must be 1-D"):
        geot.segment_matmul(x, ptr[None], w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        geot.segment_matmul(x, ptr, [[1.0]])


@requires_cuda
def test_error_device_mismatch():
    x, ptr, w = _ok("cpu")
    with pytest.raises(ValueError, match="ptr must be on the device of x"):
        geot.segment_matmul(x.cuda(), ptr, w.cuda())
    with pytest.raises(ValueError, match="weight must be on the device of x"):
        geot.segment_matmul(x.cuda(), ptr.cuda(), w)


@requires_cuda
def test_cuda_float64_refused():
    x, ptr, w = _ok("cuda")
    with pytest.raises(TypeError, match="float64 runs on CPU"):
        geot.segment_matmul(x.double(), ptr, w.double())


def test_validation_cache_sees_in_place_changes(device):
    x, ptr, w = _ok(device)
    geot.segment_matmul(x, ptr, w)
    ptr[1] = 7  # bumps the version counter: [0, 7, 4, 10]
    with pytest.raises(ValueError, match="non-decreasing"):
        geot.segment_matmul(x, ptr, w)


def test_validation_cache_checks_the_row_count(device):
    x, ptr, w = _ok(device)
    geot.segment_matmul(x, ptr, w)
    with pytest.raises(ValueError, match="ptr must end"):
        geot.segment_matmul(x[:9], ptr, w)


def test_validation_off_bad_ptr_no_crash(device):
    x, ptr, w = _ok(device)
    with geot.validation.validation(False):
        for bad in ([0, 99, 3, 10], [-5, 4, 4, 2], [3, 2, 1, 0]):
            out = geot.segment_matmul(x, torch.tensor(bad, device=device), w)
            assert out.shape == (10, 5)
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- #
# torch.compile, opcheck
# --------------------------------------------------------------------------- #
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    x, ptr, w = random_inputs([7, 0, 12, 5], 6, 4, torch.float32, device)

    def fn(x, w):
        return torch.relu(geot.segment_matmul(x, ptr, w)).sum()

    x.requires_grad_()
    w.requires_grad_()
    loss = torch.compile(fn, fullgraph=True)(x, w)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected = fn(x, w)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_opcheck(device):
    x, ptr, w = random_inputs([3, 0, 5], 4, 6, torch.float32, device)
    g = torch.randn(8, 6, device=device)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.geot.segment_matmul.default, (x, ptr, w))
    torch.library.opcheck(torch.ops.geot.segment_matmul_transposed.default, (g, ptr, w))
    torch.library.opcheck(torch.ops.geot.segment_matmul_weight_grad.default, (x, ptr, g))
