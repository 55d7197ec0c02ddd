"""Deterministic mode (torch.use_deterministic_algorithms): every geot op,
forward and backward, gives bitwise-identical results call after call and
process after process, and still matches the float64 references. The CUDA
tests use hub graphs (a segment of 2 * 10^5 rows among many small ones),
where the default schedules add a hub's partial sums with atomics."""
import contextlib
import hashlib
import os
import subprocess
import sys

import pytest
import torch

import geot
from conftest import requires_cuda
from reference import assert_matches_ref, index_from_degrees, segment_reduce_ref

# torch's own matmuls (geot.nn's Linear layers) refuse deterministic mode without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDUCES = ["sum", "mean", "max", "min"]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
HUB_ROWS = 200_000


@contextlib.contextmanager
def deterministic(on=True, warn_only=False):
    before, before_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)


def hub_graph(device, hub=HUB_ROWS, small=20_000, index_dtype=torch.int64):
    """(src, dst sorted, S): one hub of `hub` edges, `small` nodes of 0..8
    edges (some empty), a second hub of hub // 4 edges between them."""
    deg = torch.randint(0, 9, (small,))
    deg[small // 3] = hub
    deg[2 * small // 3] = hub // 4
    dst = index_from_degrees(deg)
    src = torch.randint(0, small, (dst.numel(),))
    return src.to(device, index_dtype), dst.to(device, index_dtype), small


def same_bits(a, b):
    """Bitwise equality (NaNs included), for tensors or tuples of them."""
    if isinstance(a, (tuple, list)):
        return all(same_bits(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_repeatable(run, times=3):
    """run() under deterministic mode, several times: bitwise the same."""
    with deterministic():
        first = run()
        for _ in range(times - 1):
            assert same_bits(run(), first), "deterministic mode gave different bits on the same input"
    return first


# --------------------------------------------------------------------------- #
# The flag (CPU)
# --------------------------------------------------------------------------- #
def test_dispatch_reads_the_flag_per_call():
    """The C++ dispatch reads torch's global flag: on, off again, warn_only."""
    assert not geot._C.deterministic_algorithms()
    with deterministic():
        assert geot._C.deterministic_algorithms()
    assert not geot._C.deterministic_algorithms()
    with deterministic(warn_only=True):
        assert geot._C.deterministic_algorithms()
    assert not geot._C.deterministic_algorithms()


@pytest.mark.parametrize("warn_only", [False, True])
def test_ops_neither_raise_nor_warn(warn_only, recwarn):
    """Every op has a deterministic implementation: no error, no warning."""
    src, dst, S = hub_graph("cpu", hub=300, small=50)
    x = torch.randn(S, 4, requires_grad=True)
    w = torch.rand(src.numel(), requires_grad=True)
    with deterministic(warn_only=warn_only):
        out = geot.index_weight_segment_reduce(src, dst, w, x, "sum", S)
        out = out + geot.segment_reduce(dst, x.index_select(0, src), "mean", S)
        out.sum().backward()
        torch.ops.geot.index_scatter_sum(dst, src, x.detach(), None, S)
        geot.edge_softmax(torch.randn(src.numel(), 2), dst, S)
    assert not [w for w in recwarn.list if "determinis" in str(w.message)]


def test_cpu_results_unchanged_by_the_mode():
    """The CPU kernels are deterministic already: the mode changes nothing."""
    src, dst, S = hub_graph("cpu", hub=2000, small=200)
    x = torch.randn(S, 8, dtype=torch.float64)
    plain = geot.index_segment_reduce(src, dst, x, "sum", S)
    with deterministic():
        det = geot.index_segment_reduce(src, dst, x, "sum", S)
    assert same_bits(plain, det)
    assert_matches_ref(det, dst, x.index_select(0, src), "sum", S, "cpu")


# --------------------------------------------------------------------------- #
# CUDA: repeatable and right, every op
# --------------------------------------------------------------------------- #
# One config per schedule, forced, so that each deterministic counterpart
# runs whatever the rules pick: SR, PR (at N_t = 1, and at 4: a kernel of
# its own, registers capped), SP with row lanes, SP without.
CONFIGS = [None, (2, 32, 8, 4, 1), (1, 32, 4, 8, 16), (4, 32, 4, 8, 16), (1, 64, 8, 4, 0), (4, 16, 16, 8, 0)]


# Hub sizes and the combine they take: past 16384 rows the combine levels;
# up to it (validation's long-segment level 2) the one-pass combine, at its
# largest; a hub of 1000 rows (level 1): SP walking every segment whole for
# up to 16 features, the one-pass combine for more.
HUBS = [pytest.param(HUB_ROWS, id="levels"), pytest.param(16_384, id="one-pass"),
        pytest.param(1000, id="short-segments")]


@requires_cuda
@pytest.mark.parametrize("hub", HUBS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "auto" if c is None else ",".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
def test_segment_reduce(reduce, dtype, config, hub):
    _, dst, S = hub_graph("cuda", hub=hub)
    src = torch.randn(dst.numel(), 16, device="cuda").to(dtype)
    kw = {} if config is None else {"config": config}
    out = assert_repeatable(lambda: geot.segment_reduce(dst, src, reduce, S, **kw))
    assert_matches_ref(out.cpu(), dst.cpu(), src.cpu(), reduce, S, f"segment_reduce {config}")


@requires_cuda
@pytest.mark.parametrize("hub", HUBS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "auto" if c is None else ",".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
def test_weighted_reduce(reduce, dtype, config, hub):
    src, dst, S = hub_graph("cuda", hub=hub, index_dtype=torch.int32)
    x = torch.randn(S, 32, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    kw = {} if config is None else {"config": config}
    out = assert_repeatable(lambda: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, **kw))
    rows = w.cpu().double()[:, None] * x.cpu().double().index_select(0, src.cpu().long())  # exact products
    if reduce in ("sum", "mean"):
        ref = segment_reduce_ref(dst.cpu().long(), rows, reduce, S)
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                   atol=1e-1 if dtype == torch.bfloat16 else 1e-2)
    else:  # one of the products, rounded once: exact
        assert_matches_ref(out.cpu(), dst.cpu().long(), rows.to(dtype), reduce, S, f"weighted {config}")


@requires_cuda
@pytest.mark.parametrize("hub", [pytest.param(16_384, id="one-pass"), pytest.param(1000, id="short-segments")])
@pytest.mark.parametrize("features", [1, 3, 16, 17, 30, 64, 67, 256])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_feature_widths(reduce, features, hub):
    """The schedules without combine levels at every vector width (4, 2 and
    1 features a thread, and rows wider than a column block), on both sides
    of the width where short segments stop being walked whole."""
    src, dst, S = hub_graph("cuda", hub=hub, small=3000)
    x = torch.randn(S, features, device="cuda")
    w = torch.rand(src.numel(), device="cuda")
    out = assert_repeatable(lambda: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S))
    rows = w.cpu().double()[:, None] * x.cpu().double().index_select(0, src.cpu())
    ref = segment_reduce_ref(dst.cpu(), rows, reduce, S)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-3)


@requires_cuda
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "plain"])
@pytest.mark.parametrize("features", [1, 3, 8, 16, 30, 32])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_pr_chunks_of_small_graphs(reduce, features, gathered):
    """fp32 sums and means of up to 32 features under 2^20 edges with a
    segment past 1024 rows: PR tiles of 64-row chunks, then the one-pass
    combine (deterministic_pr_config)."""
    src, dst, S = hub_graph("cuda", hub=5_000, small=20_000)
    sizes = (dst.numel(), S, features, gathered, geot.config.long_segment_level(5_000))
    source = geot.explain_source(*sizes, dtype=torch.float32, reduce=reduce, deterministic=True)
    assert "deterministic_pr_config" in source, source
    x = torch.randn(S, features, device="cuda")
    if not gathered:
        rows = x.index_select(0, src)
        out = assert_repeatable(lambda: geot.segment_reduce(dst, rows, reduce, S))
        return assert_matches_ref(out.cpu(), dst.cpu(), rows.cpu(), reduce, S, "deterministic PR")
    w = torch.rand(src.numel(), device="cuda")
    out = assert_repeatable(lambda: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S))
    ref = segment_reduce_ref(dst.cpu(), (w.double()[:, None] * x.double()[src]).cpu(), reduce, S)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("features", [8, 16, 64])
@pytest.mark.parametrize("reduce", REDUCES)
def test_sp_picks_past_their_cap_take_sr(reduce, features):
    """Plain rows of a graph with a hub past 16384 rows whose rules pick SP:
    SR with the same tiles in deterministic mode (deterministic_sp_as_sr)."""
    _, dst, S = hub_graph("cuda", hub=HUB_ROWS, small=280_000)
    sizes = (dst.numel(), S, features, False, geot.config.long_segment_level(HUB_ROWS))
    if geot.explain(*sizes).schedule != "SP":
        pytest.skip(f"this GPU's rules pick {geot.explain(*sizes)} here")
    assert "deterministic_sp_as_sr" in geot.explain_source(*sizes, dtype=torch.float32, reduce=reduce,
                                                           deterministic=True)
    src = torch.randn(dst.numel(), features, device="cuda")
    out = assert_repeatable(lambda: geot.segment_reduce(dst, src, reduce, S))
    assert_matches_ref(out.cpu(), dst.cpu(), src.cpu(), reduce, S, "deterministic SR for an SP pick")


@requires_cuda
@pytest.mark.parametrize("hub", [pytest.param(300_000, id="levels"), pytest.param(10_000, id="one-pass")])
@pytest.mark.parametrize("features", [64, 132])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_wide_rows_of_large_graphs(reduce, dtype, features, hub):
    """Gathered sums of 64 features or more over 2^20 edges with a hub: SR
    with shared ids, each group's 256 edges a chunk, then either combine."""
    src, dst, S = hub_graph("cuda", hub=hub, small=280_000)
    assert dst.numel() >= 2**20
    x = torch.randn(S, features, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    out = assert_repeatable(lambda: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S))
    rows = w.double()[:, None] * x.double()[src]  # the float64 reference on the GPU (~1 GB)
    ref = torch.zeros(S, features, dtype=torch.float64, device="cuda").index_add_(0, dst, rows)
    if reduce == "mean":
        ref /= torch.bincount(dst, minlength=S).clamp_min(1).double()[:, None]
    torch.testing.assert_close(out.double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=1e-1 if dtype == torch.bfloat16 else 1e-2)


@requires_cuda
@pytest.mark.parametrize("hub", [600, 5_000])
@pytest.mark.parametrize("small", [1_500, 20_000])
@pytest.mark.parametrize("features", [128, 200])
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float16, id="f16")])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_wide_rows_of_small_graphs(reduce, dtype, features, small, hub):
    """Gathered sums of wide rows under 2^20 edges, no segment over 16384
    rows: SR with shared ids, each group's 8-128 edges a chunk
    (shared_ids_tile; 32 or more past 1024 rows), then the one-pass combine;
    half rows store into the pre-filled output."""
    src, dst, S = hub_graph("cuda", hub=hub, small=small)
    assert dst.numel() < 2**20
    x = torch.randn(S, features, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    launch = dict(dtype=dtype, reduce=reduce, deterministic=True)
    sizes = (dst.numel(), S, features, True, geot.config.long_segment_level(hub))
    launched, source = geot.explain(*sizes, **launch), geot.explain_source(*sizes, **launch)
    assert source.endswith("(use_shared_ids)") and 8 <= launched.M_t < 256, (launched, source)
    out = assert_repeatable(lambda: geot.index_weight_segment_reduce(src, dst, w, x, reduce, S))
    rows = w.double()[:, None] * x.double()[src]
    ref = torch.zeros(S, features, dtype=torch.float64, device="cuda").index_add_(0, dst, rows)
    if reduce == "mean":
        ref /= torch.bincount(dst, minlength=S).clamp_min(1).double()[:, None]
    low = dtype != torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=2e-2 if low else 1e-4, atol=2e-1 if low else 1e-2)


@requires_cuda
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_combine_levels_of_many_slot_elements(reduce):
    """A combine level of more than 3 * 2^20 slot elements (slots * F) runs
    the rows kernel, the smaller levels after it the warp kernel: both in
    one call (the other tests' levels are small enough for the warp kernel
    alone)."""
    _, dst, S = hub_graph("cuda", hub=300_000, small=280_000)
    features, chunk_rows = 64, 32  # SR's deterministic chunks: max(M_t, 32) rows with the levels
    assert 2 * -(-dst.numel() // chunk_rows) * features > 3 << 20
    src = torch.randn(dst.numel(), features, device="cuda")
    out = assert_repeatable(lambda: geot.segment_reduce(dst, src, reduce, S, config=(2, 32, 8, 4, 1)))
    assert_matches_ref(out.cpu(), dst.cpu(), src.cpu(), reduce, S, "combine levels of many slot elements")


@requires_cuda
@pytest.mark.parametrize("hub", HUBS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [32, 128])
def test_gin_sum_plus_self_term(features, dtype, hub):
    """The self term reaches every segment, empty ones included (half rows
    of SR's schedules store into an output pre-filled with it)."""
    src, dst, S = hub_graph("cuda", hub=hub)
    x = torch.randn(S, features, device="cuda").to(dtype)
    scale = torch.tensor([1.5], device="cuda")
    out = assert_repeatable(lambda: torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale, None))
    ref = 1.5 * x.cpu().double() + segment_reduce_ref(dst.cpu(), x.cpu().double().index_select(0, src.cpu()), "sum", S)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-1 if dtype == torch.bfloat16 else 1e-2)


def fused_grads(src, dst, x, w, reduce, S, transposed):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = geot.index_weight_segment_reduce(src, dst, w, x, reduce, S, transposed=transposed)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype))
    return out.detach(), x.grad, w.grad


@requires_cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["no_transposed", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("hub", [pytest.param(100_000, id="levels"), pytest.param(10_000, id="one-pass")])
def test_fused_gradients(reduce, dtype, transposed, hub):
    """The gradient of x (atomics in edge order by default; sorted in this
    mode) and of the weight: repeatable, and equal to float64's."""
    src, dst, S = hub_graph("cuda", hub=hub, small=5000)
    x = torch.randn(S, 16, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    t = geot.transpose_index(src, dst) if transposed else None
    out, gx, gw = assert_repeatable(lambda: fused_grads(src, dst, x, w, reduce, S, t))
    if reduce in ("max", "min"):
        return  # arg routing is checked by test_index_segment_reduce; here: repeatable
    _, ref_gx, ref_gw = fused_grads(src.cpu(), dst.cpu(), x.cpu().double(), w.cpu().double(), reduce, S, None)
    tol = dict(rtol=3e-2, atol=3e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(gx.cpu().double(), ref_gx, **tol)
    torch.testing.assert_close(gw.cpu().double(), ref_gw, **tol)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_index_scatter_sum_any_order(dtype):
    """Edges in any order: sorted in this mode, then the segment schedules."""
    src, dst, S = hub_graph("cuda")
    order = torch.randperm(src.numel(), device="cuda")
    src, dst = src[order], dst[order]
    x = torch.randn(S, 32, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    out = assert_repeatable(lambda: torch.ops.geot.index_scatter_sum(src, dst, x, w, S))
    ref = torch.zeros(S, 32, dtype=torch.float64).index_add_(
        0, dst.cpu(), w.cpu().double()[:, None] * x.cpu().double().index_select(0, src.cpu()))
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-1 if dtype == torch.bfloat16 else 1e-2)


@requires_cuda
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_softmax(dtype, heads):
    """A hub past 16384 edges: the composed softmax (segment sums)."""
    _, dst, S = hub_graph("cuda")
    score = torch.randn(dst.numel(), heads, device="cuda").to(dtype)

    def run():
        s = score.detach().requires_grad_()
        y = geot.edge_softmax(s, dst, S)
        y.backward(torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype))
        return y.detach(), s.grad

    y, _ = assert_repeatable(run)
    ref = geot.edge_softmax(score.cpu().double(), dst.cpu(), S)
    torch.testing.assert_close(y.cpu().double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_aggregate(dtype):
    src, dst, S = hub_graph("cuda")
    x = torch.randn(S, 2, 16, device="cuda").to(dtype)
    a_src, a_dst = torch.randn(S, 2, device="cuda"), torch.randn(S, 2, device="cuda")
    assert_repeatable(lambda: geot.attention_aggregate(x, a_src, a_dst, src, dst, num_segments=S))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_segment_matmul(dtype):
    """Forward, and both gradients: the weight's adds its chunks in order."""
    M, K, N, T = 300_000, 32, 48, 4
    types = torch.randint(0, T, (M,))
    types[: M // 2] = 1  # one big type, split over many chunks
    perm, ptr = geot.group_by_type(types.cuda(), T)
    x = torch.randn(M, K, device="cuda").to(dtype)
    weight = torch.randn(T, K, N, device="cuda").to(dtype)

    def run():
        xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
        out = geot.segment_matmul(xs, ptr, ws)
        out.backward(torch.ones_like(out))
        return out.detach(), xs.grad, ws.grad

    _, _, gw = assert_repeatable(run)
    p = ptr.cpu()
    ref = torch.stack([x[p[t]:p[t + 1]].cpu().double().sum(0)[:, None].expand(K, N) for t in range(T)])
    torch.testing.assert_close(gw.cpu().double(), ref, rtol=2e-2, atol=2.0)  # fp32 runs as TF32


@requires_cuda
def test_nn_graph_of_one_step():
    """geot.nn on a new unsorted graph every step (any-order sums by
    default): repeatable training steps."""
    from geot.nn import GCNConv

    def steps():
        torch.manual_seed(0)
        conv = GCNConv(16, 8).cuda()
        opt = torch.optim.SGD(conv.parameters(), lr=0.1)
        x = torch.randn(5000, 16, device="cuda")
        losses = []
        for step in range(4):
            g = torch.Generator("cuda").manual_seed(step)
            edge_index = torch.randint(0, 5000, (2, 200_000), device="cuda", generator=g)
            edge_index[1, : 50_000] = 7  # a hub
            loss = conv(x, edge_index).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    assert_repeatable(steps, times=2)


@requires_cuda
def test_mode_toggles_back():
    """Off again, the default schedules run: results still right."""
    _, dst, S = hub_graph("cuda")
    src = torch.randn(dst.numel(), 8, device="cuda")
    with deterministic():
        det = geot.segment_reduce(dst, src, "sum", S)
    assert not torch.are_deterministic_algorithms_enabled()
    plain = geot.segment_reduce(dst, src, "sum", S)
    assert_matches_ref(plain.cpu(), dst.cpu(), src.cpu(), "sum", S, "default")
    torch.testing.assert_close(plain, det, rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------- #
# Two processes
# --------------------------------------------------------------------------- #
CHILD = r"""
import hashlib, sys, torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
import geot
from test_determinism import hub_graph, fused_grads
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
digest = hashlib.sha256()
for (src, dst, S), dtype in [(hub_graph("cuda", hub=hub), dtype) for hub in (200_000, 16_384)
                             for dtype in (torch.float32, torch.bfloat16)]:
    x = torch.randn(S, 32, device="cuda").to(dtype)
    w = torch.rand(src.numel(), device="cuda").to(dtype)
    for reduce in ("sum", "mean", "max"):
        for t in fused_grads(src, dst, x, w, reduce, S, None):
            digest.update(t.cpu().view(torch.uint8).numpy().tobytes())
    rows = x.index_select(0, src)
    digest.update(geot.segment_reduce(dst, rows, "sum", S).cpu().view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


@requires_cuda
def test_two_processes_agree():
    def child():
        done = subprocess.run([sys.executable, "-c", CHILD, REPO], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    first, second = child(), child()
    assert len(first) == 64 and first == second
