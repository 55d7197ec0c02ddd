"""Tests of the fused ops (index_segment_reduce, index_weight_segment_reduce)
and their backward helpers against a float64 gather-then-reduce reference."""
import pytest
import torch

import geot
from conftest import DTYPES, requires_cuda
from reference import (
    REDUCES,
    RTOL,
    describe,
    distinct_src,
    huge_segment_index,
    index_from_degrees,
    one_segment_index,
    powerlaw_degrees,
    powerlaw_index,
    random_index,
    random_src,
    segment_counts,
    segment_reduce_ref,
    sum_tolerance,
)



def per_edge(weight, like):
    return weight.reshape(*weight.shape, *([1] * (like.dim() - weight.dim())))


def messages_ref(src_index, weight, x):
    """The [E, ...] messages weight[e] * x[src_index[e]] in float64 on CPU."""
    msg = x.detach().cpu().double()[src_index.cpu().long()]
    if weight is not None:
        msg = msg * per_edge(weight.detach().cpu().double(), msg)
    return msg


def assert_fused_matches(out, src_index, dst_index, weight, x, reduce, S, where):
    """Like reference.assert_matches_ref, with the messages as src: sum/mean
    within rounding of the inputs, max/min exact (one message, rounded)."""
    assert out.dtype == x.dtype and out.device == x.device, where
    assert tuple(out.shape) == (S, *x.shape[1:]), f"{where}: shape {tuple(out.shape)}"
    msg = messages_ref(src_index, weight, x)
    ref = segment_reduce_ref(dst_index, msg, reduce, S)
    got = out.detach().cpu().double()
    assert not torch.isnan(got).any(), f"{where}: NaN in output"
    if reduce in ("max", "min"):
        # products were formed in fp32 (half types) or the input precision
        bad = got != ref.to(x.dtype).double() if weight is None else ~torch.isclose(got, ref, rtol=RTOL[x.dtype] * 8, atol=0)
    else:
        tol = sum_tolerance(dst_index, msg.to(x.dtype) if x.dtype != torch.float64 else msg, reduce, S)
        bad = ~((got - ref).abs() <= tol * 4)
    assert not bad.any(), (
        f"{where}: {int(bad.sum())} wrong, first at {tuple(bad.nonzero()[0].tolist())}: "
        f"got {got[tuple(bad.nonzero()[0].tolist())].item()}, expected {ref[tuple(bad.nonzero()[0].tolist())].item()}"
    )
    empty = (segment_counts(dst_index, S) == 0).to(out.device)
    if empty.any():
        assert (out[empty] == 0).all(), f"{where}: nodes without edges not 0"


def edges(dst_index, num_src, generator=None):
    """Random sources for a sorted destination index."""
    return torch.randint(0, max(num_src, 1), (dst_index.numel(),), generator=generator)


# name -> (dst_index, S, num_src, feature shape)
GRAPHS = {
    "E0": lambda: (torch.zeros(0, dtype=torch.long), 5, 7, (4,)),
    "one_segment": lambda: (one_segment_index(50, 2), 4, 9, (8,)),
    "isolated_nodes": lambda: (random_index(80, 200, lo=10, hi=190), 200, 60, (5,)),
    "F1": lambda: (random_index(400, 50), 50, 70, (1,)),
    "F3": lambda: (random_index(400, 50), 50, 70, (3,)),
    "F33": lambda: (random_index(300, 40), 40, 30, (33,)),
    "F128": lambda: (random_index(200, 30), 30, 25, (128,)),
    "3d": lambda: (random_index(300, 40), 40, 20, (2, 6)),
    "powerlaw": lambda: (powerlaw_index(300, 4000), 300, 300, (16,)),
    "huge_degree": lambda: (huge_segment_index(50_000, 6, big=3), 6, 1000, (4,)),
}


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_forward_matches_reference(device, reduce, weighted, dtype, graph):
    dst, S, N, feat = GRAPHS[graph]()
    src = edges(dst, N)
    index_dtype = torch.int32 if dtype in (torch.float16, torch.float64) else torch.int64
    src, dst = src.to(device, index_dtype), dst.to(device, index_dtype)
    x = random_src(N, feat, dtype, device)
    weight = random_src(dst.numel(), (), dtype, device) if weighted else None
    if weighted:
        out = geot.index_weight_segment_reduce(src, dst, weight, x, reduce, S)
    else:
        out = geot.index_segment_reduce(src, dst, x, reduce, S)
    assert_fused_matches(out, src, dst, weight, x, reduce, S, f"{graph} ({describe(dst, S)})")


def test_self_loops_and_repeated_edges(device):
    dst = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3, 3], device=device)
    src = torch.tensor([0, 0, 0, 1, 2, 3, 3, 1, 1], device=device)  # self loops, repeats
    x = torch.arange(12.0, device=device).view(4, 3)
    w = torch.arange(1.0, 10.0, device=device)
    out = geot.index_weight_segment_reduce(src, dst, w, x, "sum", 4)
    expected = torch.zeros(4, 3, device=device)
    for e in range(9):
        expected[dst[e]] += w[e] * x[src[e]]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("heads,head_feat", [(4, (8,)), (3, (5,)), (2, (1,)), (8, (2, 3))])
@pytest.mark.parametrize("reduce", REDUCES)
def test_multi_head(device, reduce, heads, head_feat):
    dst, S, N = powerlaw_index(60, 700), 60, 45
    src = edges(dst, N).to(device)
    dst = dst.to(device)
    x = random_src(N, (heads, *head_feat), torch.float32, device)
    w = random_src(dst.numel(), (heads,), torch.float32, device)
    out = geot.index_weight_segment_reduce(src, dst, w, x, reduce, S)
    assert_fused_matches(out, src, dst, w, x, reduce, S, f"heads={heads}")


def test_mixed_index_dtypes(device):
    dst = random_index(300, 40).to(device)  # int64
    src = edges(dst, 25).to(device, torch.int32)
    x = random_src(25, (6,), torch.float32, device)
    out = geot.index_segment_reduce(src, dst, x, "mean", 40)
    assert_fused_matches(out, src, dst, None, x, "mean", 40, "int32 src, int64 dst")


def test_num_segments_omitted(device):
    dst = random_index(100, 30).to(device)
    src = edges(dst, 10).to(device)
    x = random_src(10, (4,), torch.float32, device)
    out = geot.index_segment_reduce(src, dst, x)
    assert out.shape[0] == int(dst[-1]) + 1


def test_noncontiguous_inputs(device):
    dst = random_index(200, 30).to(device)
    src = edges(dst, 20).to(device)
    x = random_src(8, (20,), torch.float32, device).t()  # [20, 8] with strides (1, 20)
    w = random_src(2 * dst.numel(), (), torch.float32, device)[::2]
    out = geot.index_weight_segment_reduce(src, dst, w, x, "sum", 30)
    assert_fused_matches(out, src, dst, w, x, "sum", 30, "non-contiguous x and weight")


# --------------------------------------------------------------------------- #
# backward
# --------------------------------------------------------------------------- #
def _grad_graph(device, S=7, N=6):
    dst = index_from_degrees(torch.tensor([3, 0, 4, 1, 5, 0, 2]))  # empty segments 1 and 5
    src = torch.tensor([0, 1, 1, 2, 5, 0, 3, 4, 4, 4, 1, 0, 2, 3, 5])
    return src.to(device), dst.to(device), S, N


@pytest.mark.parametrize("transposed", [False, True], ids=["atomic", "transposed"])
@pytest.mark.parametrize("heads", [0, 1, 3], ids=["unweighted", "w1", "w3"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_gradcheck(device, reduce, heads, transposed):
    src, dst, S, N = _grad_graph(device)
    E = dst.numel()
    feat = (heads, 2) if heads > 1 else (3,)
    # shifted off 0: 0 * w[e] would tie the messages of repeated sources
    x = (distinct_src(N, feat, torch.float64, device) + 0.0137).requires_grad_()
    t = geot.transpose_index(src, dst) if transposed else None
    if heads == 0:
        fn = lambda x: geot.index_segment_reduce(src, dst, x, reduce, S, transposed=t)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
        return
    w = (distinct_src(E, (heads,) if heads > 1 else (), torch.float64, device) + 2.0).requires_grad_()
    fn = lambda w, x: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, transposed=t)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (w, x), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("transposed", [False, True], ids=["atomic", "transposed"])
@pytest.mark.parametrize("heads", [0, 1, 3], ids=["unweighted", "w1", "w3"])
def test_mean_gradient_of_wide_rows(device, heads, transposed):
    """Rows at least 2 E / S wide, a weight without gradient: a mean's
    backward scales each edge by 1 / its destination's rows inside x's
    gathered sum (eager_autograd.cpp, divides_per_edge) rather than dividing
    the gradient's rows first; gradients and second derivatives hold."""
    src, dst, S, N = _grad_graph(device)
    E = dst.numel()
    width = -(-2 * E // S)
    x = (distinct_src(N, (heads, width) if heads > 1 else (width,), torch.float64, device) + 0.0137).requires_grad_()
    t = geot.transpose_index(src, dst) if transposed else None
    w = None if heads == 0 else distinct_src(E, (heads,) if heads > 1 else (), torch.float64, device) + 2.0

    def fn(x):
        if w is None:
            return geot.index_segment_reduce(src, dst, x, "mean", S, transposed=t)
        return geot.index_weight_segment_reduce(src, dst, w, x, "mean", S, transposed=t)

    assert "SortedReduce" in fn(x).grad_fn.name()
    tolerances = {"eps": 1e-6, "atol": 1e-8, "nondet_tol": 1e-12 if device == "cuda" and not transposed else 0.0}
    assert torch.autograd.gradcheck(fn, (x,), **tolerances)
    assert torch.autograd.gradgradcheck(fn, (x,), **tolerances)


@pytest.mark.parametrize("transposed", [False, True], ids=["atomic", "transposed"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_second_derivatives(device, reduce, weighted, transposed):
    """Eager sums and means record one C++ autograd node (geot._C.sorted_reduce); under create_graph its
    backward calls the ops through the dispatcher, so the gradient is differentiable again."""
    src, dst, S, N = _grad_graph(device)
    x = (distinct_src(N, (3,), torch.float64, device) + 0.0137).requires_grad_()
    t = geot.transpose_index(src, dst) if transposed else None
    # Without a transposed index CUDA's backward scatters with float atomics: two runs may differ in the
    # last bits (gradcheck's reentrancy check).
    tolerances = {"eps": 1e-6, "atol": 1e-8, "nondet_tol": 1e-12 if device == "cuda" and not transposed else 0.0}
    if not weighted:
        out = geot.index_segment_reduce(src, dst, x, reduce, S, transposed=t)
        assert "SortedReduce" in out.grad_fn.name()
        assert torch.autograd.gradgradcheck(
            lambda x: geot.index_segment_reduce(src, dst, x, reduce, S, transposed=t), (x,), **tolerances)
        return
    w = (distinct_src(dst.numel(), (), torch.float64, device) + 2.0).requires_grad_()
    fn = lambda w, x: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, transposed=t)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (w, x), **tolerances)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_extremum_ties_share_the_gradient(device, reduce, weighted):
    """Messages tied at a destination's max (min), from a duplicated edge, sources of equal rows and equal
    weights: each tied edge gets an even share of the gradient (for x and for the weights), as torch's
    scatter_reduce amax (amin) gives it, started from -inf (inf)."""
    src = torch.tensor([0, 1, 2, 0, 3, 4, 4], device=device)
    dst = torch.tensor([0, 0, 0, 1, 1, 2, 2], device=device)
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.5, 0.0], [2.0, 2.0], [2.0, 2.0]], dtype=torch.float64,
                     device=device, requires_grad=True)
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5], dtype=torch.float64, device=device,
                     requires_grad=True) if weighted else None
    g = torch.arange(1.0, 9.0, dtype=torch.float64, device=device).view(4, 2)
    out = geot.index_weight_segment_reduce(src, dst, w, x, reduce, 4) if weighted \
        else geot.index_segment_reduce(src, dst, x, reduce, 4)
    inputs = (x, w) if weighted else (x,)
    got = torch.autograd.grad(out, inputs, g)
    messages = x[src] * (w[:, None] if weighted else 1)
    start = torch.full((4, 2), -torch.inf if reduce == "max" else torch.inf, dtype=torch.float64, device=device)
    expect = start.scatter_reduce(0, dst[:, None].expand(-1, 2), messages, "a" + reduce, include_self=False)
    want = torch.autograd.grad(expect, inputs, g.masked_fill(expect.isinf(), 0))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", [(40, 15, 300, (1,)), (40, 15, 300, (33,)), (7, 30, 500, (130,)),
                                   (25, 9, 120, (2, 3)), (6, 4, 0, (5,)), (50, 1, 400, (8,))],
                         ids=["F1", "F33", "F130-hub", "F2x3", "E0", "one-segment"])
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_extremum_grad_op_matches_composite(device, reduce, shape, dtype, index_dtype):
    """geot::extremum_grad (a max/min backward without [E, F] messages) against a float64 reference of
    the rule (each tied edge's share rounded to the gradient's dtype, then added exactly) and, in float64,
    against the composite that a differentiable backward (create_graph) takes. Rows of small integers:
    most (segment, feature) extrema are ties, shared over duplicated edges, hubs and rows reached by
    several segments."""
    N, S, E, feat = shape
    gen = torch.Generator().manual_seed(E + N)
    src = torch.randint(0, N, (E,), generator=gen).to(device, index_dtype)
    dst = torch.sort(torch.randint(0, S, (E,), generator=gen))[0].to(device, index_dtype)
    x = torch.randint(-2, 3, (N, *feat), generator=gen).to(device, dtype).requires_grad_()
    g = torch.randn(S, *feat, generator=gen).to(device, dtype)
    out = geot.index_segment_reduce(src, dst, x, reduce, S)
    got = torch.autograd.grad(out, x, g, retain_graph=True)[0]
    s64, d64 = src.cpu().long(), dst.cpu().long()
    tied = (x.detach().cpu().double()[s64] == out.detach().cpu().double()[d64]).double()
    ties = torch.zeros(S, *feat, dtype=torch.float64).index_add_(0, d64, tied)
    share = (g.cpu().double() / ties.clamp(min=1)).to(dtype).double()
    want = torch.zeros(N, *feat, dtype=torch.float64).index_add_(0, s64, share[d64] * tied)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    assert E == 0 or got.abs().sum() > 0
    if dtype == torch.float64:
        composite = torch.autograd.grad(out, x, g, create_graph=True)[0]
        torch.testing.assert_close(got, composite.detach(), rtol=1e-12, atol=1e-12)


def test_extremum_grad_op_checks_its_arguments():
    src, dst = torch.tensor([0, 1]), torch.tensor([0, 0])
    x, out = torch.randn(2, 3), torch.randn(1, 3)
    with pytest.raises(ValueError, match="extremum must have shape"):
        torch.ops.geot.extremum_grad(src, dst, x, torch.randn(1, 4), out)
    with pytest.raises(ValueError, match="grad_out must have extremum's shape"):
        torch.ops.geot.extremum_grad(src, dst, x, out, torch.randn(2, 3))
    with pytest.raises(TypeError, match="grad_out must have the dtype of x"):
        torch.ops.geot.extremum_grad(src, dst, x, out, out.double())
    with pytest.raises(ValueError, match="same length"):
        torch.ops.geot.extremum_grad(src, dst[:1], x, out, out)


@pytest.mark.parametrize("heads", [0, 1, 3], ids=["unweighted", "w1", "w3"])
@pytest.mark.parametrize("reduce", REDUCES)
def test_gradients_without_edges(device, reduce, heads):
    """E = 0: zero rows out, and zero gradients of x and of the (empty) weights, of their shapes."""
    empty = torch.empty(0, dtype=torch.long, device=device)
    x = torch.randn(4, *((heads, 2) if heads > 1 else (3,)), dtype=torch.float64, device=device, requires_grad=True)
    if heads == 0:
        out = geot.index_segment_reduce(empty, empty, x, reduce, 5)
        inputs = (x,)
    else:
        w = torch.rand(0, *((heads,) if heads > 1 else ()), dtype=torch.float64, device=device, requires_grad=True)
        out = geot.index_weight_segment_reduce(empty, empty, w, x, reduce, 5)
        inputs = (w, x)
    assert out.shape == (5, *x.shape[1:]) and not out.any()
    grads = torch.autograd.grad(out.sum(), inputs)
    for grad, tensor in zip(grads, inputs):
        assert grad.shape == tensor.shape and not grad.any()


@pytest.mark.parametrize("transposed", [False, True], ids=["atomic", "transposed"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_backward_matches_reference_large(device, reduce, transposed):
    dst, S, N = powerlaw_index(500, 8000), 500, 400
    src = edges(dst, N).to(device)
    dst = dst.to(device)
    x = random_src(N, (16,), torch.float32, device).requires_grad_()
    w = random_src(dst.numel(), (), torch.float32, device).requires_grad_()
    g = random_src(S, (16,), torch.float32, device)
    t = geot.transpose_index(src, dst) if transposed else None
    geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, transposed=t).backward(g)
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    msg = x64[src.cpu()] * w64[:, None]
    segment_reduce_ref_autograd(dst.cpu(), msg, reduce, S).backward(g.cpu().double())
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.cpu().double(), w64.grad, rtol=1e-4, atol=1e-4)


def _large_skewed_graph(S=40_000, E=1_100_000):
    """Over 2^20 edges, one destination with 300k of them, many empty: the
    graphs on which gathered sums of wide rows take SR with shared ids."""
    deg = powerlaw_degrees(S, E - 300_000)
    deg[S // 2] += 300_000
    dst = index_from_degrees(deg)
    return dst, S, torch.randint(0, S, (dst.numel(),))


@requires_cuda
@pytest.mark.parametrize("F", [64, 96, 128, 192, 256, 384])  # 192 fp32 and 384 bf16: three column blocks of 16 lanes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", ["weighted_sum", "mean", "sum_plus_scaled"])
def test_wide_rows_on_large_skewed_graphs(op, dtype, F):
    dst, S, src = _large_skewed_graph()  # x: a row per destination too (sum_plus_scaled adds x[i] to out[i])
    _check_wide_rows(op, dtype, F, dst.cuda(), S, src.cuda())


@requires_cuda
@pytest.mark.parametrize("F", [128, 192])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("op", ["weighted_sum", "mean", "sum_plus_scaled", "two_heads"])
def test_half_rows_on_even_graphs(op, dtype, F):
    """Every destination of even in-degree 16, under 2^16 edges: half rows of
    a multiple of 8 features take SR with shared ids, 4-128 edges a group
    (shared_ids_rows); with two weight heads they take the rules' SP tile,
    which the launch widens for half rows (half_row_sp_config) on the H100."""
    S = 4_000
    dst = torch.arange(S, device="cuda").repeat_interleave(16)
    if op == "two_heads" and torch.cuda.get_device_name().startswith("NVIDIA H100"):  # the path under test is taken
        rule = geot.explain(dst.numel(), S, F, gathered=True, long_segments=0)
        assert (rule.N_t, rule.T_N, rule.G_t) == (4, 8, 0), rule
    _check_wide_rows(op, dtype, F, dst, S, torch.randint(0, S, (dst.numel(),), device="cuda"))


@requires_cuda
@pytest.mark.parametrize("F", [128, 200, 512])
@pytest.mark.parametrize("graph", ["cora_like", "skewed"])
@pytest.mark.parametrize("op", ["weighted_sum", "mean", "sum_plus_scaled"])
def test_fp32_wide_rows_on_small_graphs(op, graph, F):
    """fp32 rows of 128 features or more on graphs under 2^20 edges take SR
    with shared ids, 4-128 edges a group (use_shared_ids, shared_ids_rows):
    a 10k-edge graph of small degrees, and a 100k-edge one with a hub."""
    S = 3_000
    E = 10_000 if graph == "cora_like" else 100_000
    dst = torch.sort(torch.randint(0, S, (E,), device="cuda")).values
    if graph == "skewed":
        dst[-40_000:] = S // 2
        dst = torch.sort(dst).values
    _check_wide_rows(op, torch.float32, F, dst, S, torch.randint(0, S, (E,), device="cuda"))


@requires_cuda
@pytest.mark.parametrize("F", [64, 72, 100, 512])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("op", ["weighted_sum", "mean", "sum_plus_scaled"])
def test_half_rows_on_large_even_graphs(op, index_dtype, F):
    """Every destination of in-degree 32, over 2^20 edges: half rows of a
    multiple of 8 features take SR with shared ids at 8 features a lane
    (use_shared_ids), others (F = 100) the rules' config."""
    S = 40_000
    dst = torch.arange(S, device="cuda").repeat_interleave(32)
    src = torch.randint(0, S, (dst.numel(),), device="cuda")
    _check_wide_rows(op, torch.bfloat16, F, dst.to(index_dtype), S, src.to(index_dtype))


@requires_cuda
@pytest.mark.parametrize("F", [64, 200])
@pytest.mark.parametrize("graph", ["many_segments", "few_segments"])
@pytest.mark.parametrize("op", ["weighted_sum", "mean", "sum_plus_scaled"])
def test_half_rows_on_mid_size_graphs(op, graph, F):
    """2^16-2^20 edges: half rows take SR with shared ids, groups of 4-128
    edges (shared_ids_rows); with fewer segments than groups the
    partial sums go to an [S, F] buffer instead of chunk rows."""
    S = 20_000 if graph == "many_segments" else 300
    dst = torch.sort(torch.randint(0, S, (150_000,), device="cuda")).values
    src = torch.randint(0, S, (dst.numel(),), device="cuda")
    _check_wide_rows(op, torch.float16, F, dst, S, src)


@requires_cuda
@pytest.mark.parametrize("graph", ["even", "mid_size", "skewed"])
def test_half_rows_unaligned(graph):
    """x whose rows start off a 16-byte boundary (a view 1 element in):
    shared ids fall back to 4 features a lane and per-element loads."""
    if graph in ("even", "mid_size"):
        S = 40_000
        dst = torch.arange(S, device="cuda").repeat_interleave(32 if graph == "even" else 3)
        src = torch.randint(0, S, (dst.numel(),), device="cuda")
    else:
        dst, S, src = _large_skewed_graph()
        dst, src = dst.cuda(), src.cuda()
    _check_wide_rows("weighted_sum", torch.bfloat16, 128, dst, S, src, offset=1)


def _check_wide_rows(op, dtype, F, dst, S, src, offset=0):
    """The fused op on CUDA against a float64 reference (x has a row per
    destination too; offset: x a view that many elements into its storage)."""
    x = random_src(S * F + offset, (), dtype, "cuda")[offset:].view(S, F)
    heads = 2 if op == "two_heads" else 1
    w = random_src(dst.numel(), (heads,) if heads > 1 else (), dtype, "cuda") if "weighted" in op or heads > 1 else None
    scale = torch.tensor([1.25], device="cuda")
    if op == "weighted_sum":
        out = geot.index_weight_segment_reduce(src, dst, w, x, "sum", S)
    elif op == "two_heads":
        out = geot.index_weight_segment_reduce(src, dst, w, x.view(S, heads, F // heads), "sum", S).reshape(S, F)
    elif op == "mean":
        out = geot.index_segment_reduce(src, dst, x, "mean", S)
    else:
        out = torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale)
    # float64 reference on the GPU (the messages take ~1 GB)
    msg = x.double()[src.long()]
    if w is not None:
        msg = msg * (w.double().repeat_interleave(F // heads, dim=1) if heads > 1 else w.double()[:, None])
    ref = torch.zeros(S, F, dtype=torch.float64, device="cuda").index_add_(0, dst.long(), msg)
    magnitude = torch.zeros_like(ref).index_add_(0, dst.long(), msg.abs())
    if op == "mean":
        counts = torch.bincount(dst.long(), minlength=S).clamp_min(1).double()[:, None]
        ref, magnitude = ref / counts, magnitude / counts
    if op == "sum_plus_scaled":
        ref = ref + 1.25 * x.double()
        magnitude = magnitude + 1.25 * x.double().abs()
    rounding = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 0.0)  # of the output
    tol = 1e-5 * magnitude + rounding * ref.abs() + 1e-6
    bad = (out.double() - ref).abs() > tol
    assert out.dtype == dtype and not bad.any(), f"{int(bad.sum())} wrong of {bad.numel()}"


def segment_reduce_ref_autograd(index, src, reduce, S):
    out = torch.zeros((S, *src.shape[1:]), dtype=src.dtype).index_add(0, index, src)
    if reduce == "mean":
        out = out / segment_counts(index, S).clamp(min=1).to(src.dtype)[:, None]
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_backward_half(device, dtype):
    dst, S, N = powerlaw_index(100, 1500), 100, 80
    src = edges(dst, N).to(device)
    dst = dst.to(device)
    x = random_src(N, (8,), dtype, device).requires_grad_()
    w = random_src(dst.numel(), (), dtype, device).requires_grad_()
    geot.index_weight_segment_reduce(src, dst, w, x, "sum", S).sum().backward()
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    segment_reduce_ref_autograd(dst.cpu(), x64[src.cpu()] * w64[:, None], "sum", S).sum().backward()
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(w.grad.cpu().double(), w64.grad, rtol=2e-2, atol=5e-2)


def test_index_scatter_sum_any_order(device):
    """The no-sort gradient path: out[scatter[e]] += w[e] * x[gather[e]]."""
    E, N, S = 3000, 50, 70
    gather = torch.randint(0, N, (E,), device=device)
    scatter = torch.randint(0, S, (E,), device=device)  # unsorted
    x = random_src(N, (7,), torch.float32, device)
    w = random_src(E, (), torch.float32, device)
    out = torch.ops.geot.index_scatter_sum(gather, scatter, x, w, S)
    expected = torch.zeros(S, 7, dtype=torch.float64).index_add_(
        0, scatter.cpu(), x.cpu().double()[gather.cpu()] * w.cpu().double()[:, None]
    )
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,F", [(1, 1), (1, 37), (4, 8), (2, 130)])
def test_edge_dot(device, heads, F):
    E, S, N = 500, 30, 40
    src = torch.randint(0, N, (E,), device=device)
    dst = torch.randint(0, S, (E,), device=device)
    a = random_src(S, (F,), torch.float32, device)
    b = random_src(N, (F,), torch.float32, device)
    out = torch.ops.geot.edge_dot(src, dst, a, b, heads)
    prod = a.cpu().double()[dst.cpu()] * b.cpu().double()[src.cpu()]
    expected = prod.view(E, heads, -1).sum(-1)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #
def _ok(device):
    dst = torch.tensor([0, 0, 1, 3], device=device)
    src = torch.tensor([1, 2, 0, 2], device=device)
    return src, dst, torch.randn(3, 4, device=device), torch.randn(4, device=device)


def test_error_src_index_out_of_range(device):
    src, dst, x, w = _ok(device)
    with pytest.raises(ValueError, match="src_index has values >= x.size"):
        geot.index_segment_reduce(torch.tensor([1, 2, 0, 3], device=device), dst, x, "sum", 4)
    with pytest.raises(ValueError, match="src_index has negative"):
        geot.index_segment_reduce(torch.tensor([1, -2, 0, 1], device=device), dst, x, "sum", 4)


def test_error_dst_index(device):
    src, dst, x, w = _ok(device)
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        geot.index_segment_reduce(src, torch.tensor([0, 1, 0, 3], device=device), x, "sum", 4)
    with pytest.raises(ValueError, match="dst_index has values >= num_segments"):
        geot.index_segment_reduce(src, dst, x, "sum", 3)


def test_error_weight(device):
    src, dst, x, w = _ok(device)
    with pytest.raises(ValueError, match="weight must have shape"):
        geot.index_weight_segment_reduce(src, dst, w[:3], x, "sum", 4)
    with pytest.raises(ValueError, match=r"x must have shape \[N, H"):
        geot.index_weight_segment_reduce(src, dst, torch.randn(4, 2, device=device), x, "sum", 4)
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        geot.index_weight_segment_reduce(src, dst, w.double(), x, "sum", 4)


def test_error_types_and_shapes(device):
    src, dst, x, w = _ok(device)
    with pytest.raises(TypeError, match="x must be a float"):
        geot.index_segment_reduce(src, dst, x.long(), "sum", 4)
    with pytest.raises(TypeError, match="src_index must be an int32 or int64"):
        geot.index_segment_reduce(src.float(), dst, x, "sum", 4)
    with pytest.raises(ValueError, match="same length"):
        geot.index_segment_reduce(src[:3], dst, x, "sum", 4)
    with pytest.raises(ValueError, match="reduce must be one of"):
        geot.index_segment_reduce(src, dst, x, "prod", 4)
    with pytest.raises(ValueError, match="rebuild it"):
        t = geot.transpose_index(src[:3], dst[:3])
        geot.index_segment_reduce(src, dst, x.requires_grad_(), "sum", 4, transposed=t)


@requires_cuda
def test_error_device_mismatch():
    src, dst, x, w = _ok("cpu")
    with pytest.raises(ValueError, match="src_index must be on the device of x"):
        geot.index_segment_reduce(src, dst.cuda(), x.cuda(), "sum", 4)


def test_validation_cache_sees_in_place_changes(device):
    """A validated index is not re-checked, unless it is modified in place."""
    src, dst, x, w = _ok(device)
    geot.index_segment_reduce(src, dst, x, "sum", 4)
    src[1] = 7  # bumps the version counter
    with pytest.raises(ValueError, match="src_index has values"):
        geot.index_segment_reduce(src, dst, x, "sum", 4)
    edge_index = torch.stack([src.clone(), dst])
    edge_index[0, 1] = 2
    geot.index_segment_reduce(edge_index[0], edge_index[1], x, "sum", 4)  # fresh views, cached storage
    edge_index[1, 0] = 2  # unsorted now
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        geot.index_segment_reduce(edge_index[0], edge_index[1], x, "sum", 4)


def test_validation_off_out_of_range_no_crash(device):
    src, dst, x, w = _ok(device)
    with geot.validation.validation(False):
        out = geot.index_segment_reduce(torch.tensor([1, 99, 0, -5], device=device), dst, x, "sum", 4)
    assert out.shape == (4, 4)
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- #
# torch.compile, opcheck, CUDA configs
# --------------------------------------------------------------------------- #
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    dst = random_index(200, 30).to(device)
    src = edges(dst, 25).to(device)
    t = geot.transpose_index(src, dst)

    def fn(x, w):
        h = geot.index_weight_segment_reduce(src, dst, w, x, "sum", 30, transposed=t)
        return torch.relu(h).sum() + geot.index_segment_reduce(src, dst, x, "mean", 30).sum()

    x = random_src(25, (8,), torch.float32, device).requires_grad_()
    w = random_src(200, (), torch.float32, device).requires_grad_()
    compiled = torch.compile(fn, fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected = fn(x, w)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", REDUCES)
def test_opcheck(device, reduce):
    src, dst, S, N = _grad_graph(device)
    x = distinct_src(N, (4,), torch.float32, device).requires_grad_()
    w = (distinct_src(dst.numel(), (), torch.float32, device) + 2.0).requires_grad_()
    torch.library.opcheck(torch.ops.geot.index_segment_reduce.default, (src, dst, x, w, S, reduce))


@requires_cuda
@pytest.mark.parametrize("reduce", REDUCES)
def test_every_schedule_cuda(reduce):
    dst, S, N = powerlaw_index(3000, 40_000), 3000, 2000
    dst[-9000:] = 2999  # a hub at the end
    src = edges(dst, N).cuda()
    dst = dst.cuda()
    for feat in [(1,), (3,), (32,), (4, 8)]:
        x = random_src(N, feat, torch.float32, "cuda")
        w = random_src(dst.numel(), feat[:1] if len(feat) == 2 else (), torch.float32, "cuda")
        for cfg in geot.config_space(narrow=True)[::7]:
            out = geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, config=cfg)
            assert_fused_matches(out, src, dst, w, x, reduce, S, f"{cfg} feat={feat}")


# --------------------------------------------------------------------------- #
# index_sum_plus_scaled: GIN's scale * x + the sum of x[src] (a row of x per segment)
# --------------------------------------------------------------------------- #
def assert_sum_plus_scaled_matches(out, src, dst, x, scale, where):
    """Against float64: the scaled term is the segment's one more message; the
    sum may be rounded to x's dtype before the term is added (CPU, CUDA SP's
    long-segment slots)."""
    S = x.shape[0]
    x64 = x.detach().cpu().double()
    index = torch.cat([dst.cpu().long(), torch.arange(S)])
    messages = torch.cat([x64[src.cpu().long()], scale * x64])
    ref = segment_reduce_ref(index, messages, "sum", S)
    tol = sum_tolerance(index, messages.to(x.dtype) if x.dtype != torch.float64 else messages, "sum", S)
    sum_rounding = RTOL[x.dtype] * segment_reduce_ref(dst, messages[: dst.numel()], "sum", S).abs()
    assert out.dtype == x.dtype and out.shape == x.shape, where
    bad = ~((out.detach().cpu().double() - ref).abs() <= tol * 4 + sum_rounding)
    assert not bad.any(), f"{where}: {int(bad.sum())} wrong, first at {tuple(bad.nonzero()[0].tolist())}"


# name -> (dst_index, rows of x = segments, feature shape)
SELF_GRAPHS = {
    "E0": lambda: (torch.zeros(0, dtype=torch.long), 5, (4,)),
    "one_segment": lambda: (one_segment_index(50, 2), 4, (8,)),
    "isolated_nodes": lambda: (random_index(80, 200, lo=10, hi=190), 200, (5,)),
    "F1": lambda: (random_index(400, 50), 50, (1,)),
    "F33": lambda: (random_index(300, 40), 40, (33,)),
    "F128": lambda: (random_index(200, 30), 30, (128,)),
    "3d": lambda: (random_index(300, 40), 40, (2, 6)),
    "huge_degree": lambda: (huge_segment_index(50_000, 1000, big=3), 1000, (4,)),  # sources: 1000 rows
}


@pytest.mark.parametrize("graph", list(SELF_GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_plus_scaled_matches_reference(device, dtype, graph):
    dst, S, feat = SELF_GRAPHS[graph]()
    src, dst = edges(dst, S).to(device), dst.to(device)
    x = random_src(S, feat, dtype, device)
    # (scale, scale_offset): the term's factor is their sum (GIN passes eps and 1)
    for scale, offset in ((torch.tensor([1.3], device=device), 0.0),
                          (torch.tensor(0.0, device=device, dtype=torch.float64), 0.0),
                          (torch.tensor([-0.4], device=device), 1.0)):
        out = torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale, scale_offset=offset)
        factor = float(scale) + offset
        assert_sum_plus_scaled_matches(out, src, dst, x, factor, f"{graph} scale={float(scale)} offset={offset}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sum_plus_scaled_every_schedule_cuda(dtype):
    """The kernels add the scaled term as they store: SP (empty segments,
    overflow rows; after the sum with long segments' slots), SR (whole
    segments; straddling and empty ones in the pre-filled output, or in the
    finalize kernel of half-precision chunk slots), PR (pre-filled output):
    every config agrees."""
    S = 3000
    dst = powerlaw_index(S, 40_000)
    dst[-9000:] = S - 1  # a hub at the end
    dst[(dst >= 100) & (dst < 140)] = 99  # empty segments, and a long one
    dst = dst.sort().values
    src = edges(dst, S).cuda()
    dst = dst.cuda()
    # factor 0.7 as the scale alone, or as -0.3 plus an offset of 1 (GIN's eps and 1), by turns
    scales = [(torch.tensor([0.7], device="cuda"), 0.0), (torch.tensor([-0.3], device="cuda"), 1.0)]
    for feat in [(1,), (3,), (32,)]:
        x = random_src(S, feat, dtype, "cuda")
        for i, cfg in enumerate(geot.config_space(narrow=True)[::9]):
            scale, offset = scales[i % 2]
            out = torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale, list(cfg), offset)
            assert_sum_plus_scaled_matches(out, src, dst, x, 0.7, f"{cfg} feat={feat} offset={offset}")
    no_edges = torch.zeros(0, dtype=torch.long, device="cuda")  # the output is the term alone
    x = random_src(7, (5,), dtype, "cuda")
    for i, cfg in enumerate(geot.config_space(narrow=True)[::40]):
        scale, offset = scales[i % 2]
        out = torch.ops.geot.index_sum_plus_scaled(no_edges, no_edges, x, scale, list(cfg), offset)
        assert_sum_plus_scaled_matches(out, no_edges, no_edges, x, 0.7, f"{cfg} E=0 offset={offset}")


def test_sum_plus_scaled_errors(device):
    src, dst = torch.tensor([0, 2], device=device), torch.tensor([0, 1], device=device)
    x = torch.randn(3, 4, device=device)
    op = torch.ops.geot.index_sum_plus_scaled
    with pytest.raises(ValueError, match="scale must hold one value"):
        op(src, dst, x, torch.ones(2, device=device))
    with pytest.raises(TypeError, match="scale must be a floating-point"):
        op(src, dst, x, torch.ones(1, device=device, dtype=torch.long))
    with pytest.raises(ValueError, match="src_index has values >= x.size"):
        op(torch.tensor([0, 3], device=device), dst, x, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        op(src, torch.tensor([1, 0], device=device), x, torch.ones(1, device=device))
    if device == "cuda":
        with pytest.raises(ValueError, match="scale must be on the device of x"):
            op(src, dst, x, torch.ones(1))
