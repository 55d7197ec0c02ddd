"""Tests of geot.attention_aggregate (GAT's softmax and weighted sum in one
pass, inference only) against a float64 reference built from stock torch ops,
and against geot's two-op route (edge_softmax + index_weight_segment_reduce)."""
import pytest
import torch
import torch.nn.functional as F

import geot
from conftest import DTYPES
from reference import huge_segment_index, index_from_degrees, powerlaw_index, random_index

# Allowed |got - ref| = TOL * (max |x| + |ref|): the output is a convex
# combination of rows of x, rounded to its dtype (weights in fp32 for half x;
# fp32 sums of up to 3000 terms).
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def attention_ref(x, score_src, score_dst, src, dst, S, slope=0.2, self_loops=False):
    """float64, CPU: the self loops made explicit edges, logits, a scatter softmax, index_add."""
    x, ss, sd = (t.detach().cpu().double() for t in (x, score_src, score_dst))
    src, dst = src.cpu().long(), dst.cpu().long()
    if self_loops:
        keep = src != dst
        loops = torch.arange(S)
        src, dst = torch.cat([src[keep], loops]), torch.cat([dst[keep], loops])
    logit = F.leaky_relu(ss[src] + sd[dst], slope)  # [E, H]
    top = torch.full((S, x.size(1)), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, dst[:, None].expand_as(logit), logit, "amax")
    weight = (logit - top[dst]).exp()
    total = torch.zeros(S, x.size(1), dtype=torch.float64).index_add_(0, dst, weight)
    alpha = weight / total[dst]
    return torch.zeros(S, *x.shape[1:], dtype=torch.float64).index_add_(0, dst, alpha[:, :, None] * x[src])


def assert_close_to_ref(out, ref, x, dtype, where=""):
    got = out.detach().cpu().double()
    assert got.shape == ref.shape, f"{where}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = x.detach().abs().max().item() if x.numel() else 0.0
    bad = ~((got - ref).abs() <= TOL[dtype] * (scale + ref.abs()))
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{where}: {int(bad.sum())}/{bad.numel()} wrong, first at {first}: "
                             f"got {got[first].item()}, expected {ref[first].item()}")


# name -> (dst_index, S, N (rows of x), H, C)
GRAPHS = {
    "E0": lambda: (torch.zeros(0, dtype=torch.long), 5, 5, 2, 4),
    "F1": lambda: (random_index(400, 60), 60, 60, 1, 1),
    "empty_segments": lambda: (random_index(150, 200, lo=10, hi=190), 200, 200, 4, 2),
    "odd_C": lambda: (powerlaw_index(80, 900), 80, 80, 3, 5),
    "gat_layer": lambda: (powerlaw_index(300, 5000), 300, 300, 8, 8),
    "wide_row": lambda: (random_index(600, 50), 50, 50, 1, 70),     # 35 threads of features: two passes of 32
    "wider_heads": lambda: (random_index(300, 20), 20, 30, 2, 100),  # more rows than destinations
    "hub": lambda: (huge_segment_index(6000, 50, big=7), 50, 50, 8, 8),
    # Hubs past the hub pass's windows of 1024 edges: adjacent (a window holding the end of one and the
    # start of the next), first and last; between them destinations of 64-1024 edges (the block's pass).
    "hubs": lambda: (index_from_degrees(torch.tensor([1500, 3, 0, 2500, 1100, 300, 90, 1025, 700, 2])), 10, 10, 4, 2),
    "hubs_wide": lambda: (index_from_degrees(torch.tensor([2100, 5, 3000, 200])), 4, 4, 1, 70),
    "hub_narrow": lambda: (huge_segment_index(3000, 9, big=0), 9, 9, 1, 3),
    "one_segment": lambda: (torch.zeros(700, dtype=torch.long), 1, 40, 2, 6),
    "degree_1": lambda: (torch.arange(500), 500, 500, 2, 2),
    # A head's lanes summing scores of attention vectors (CUDA): 4 of them, with idle feature lanes past F;
    # 8 over hubs and the block's destinations; 32, two passes of the feature lanes.
    "head_lanes_4": lambda: (powerlaw_index(120, 2000), 120, 150, 3, 16),
    "head_lanes_8_hubs": lambda: (index_from_degrees(torch.tensor([1500, 3, 0, 2500, 1100, 300, 90])), 7, 9, 2, 32),
    "head_lanes_32": lambda: (powerlaw_index(100, 3000), 100, 100, 2, 128),
}


def inputs(graph, dtype, device, scores_dtype=None, with_input_loops=False):
    dst, S, N, H, C = GRAPHS[graph]()
    src = torch.randint(0, N, (dst.numel(),))
    if with_input_loops and dst.numel():
        src[::3] = dst[::3]  # every third edge a self loop
    x = torch.randn(N, H, C, dtype=torch.float64).to(dtype)
    score_src = torch.randn(N, H, dtype=torch.float64).to(scores_dtype or dtype)
    score_dst = torch.randn(S, H, dtype=torch.float64).to(scores_dtype or dtype)
    return [t.to(device) for t in (x, score_src, score_dst, src, dst)] + [S]


@pytest.mark.parametrize("self_loops", [False, True], ids=["plain", "self_loops"])
@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, dtype, graph, self_loops):
    x, score_src, score_dst, src, dst, S = inputs(graph, dtype, device, with_input_loops=self_loops)
    index_dtype = torch.int32 if dtype in (torch.float16, torch.float64) else torch.int64
    src, dst = src.to(index_dtype), dst.to(index_dtype)
    out = geot.attention_aggregate(x, score_src, score_dst, src, dst, S, 0.2, self_loops)
    assert out.dtype == dtype and out.device == x.device and out.shape == (S, *x.shape[1:])
    ref = attention_ref(x, score_src, score_dst, src, dst, S, 0.2, self_loops)
    assert_close_to_ref(out, ref, x, dtype, f"{graph} self_loops={self_loops}")


def scores_of(x, att, rows):
    """float64 (x[:rows] * att).sum(-1) of an attention vector [H, C] or [1, H, C]."""
    return (x[:rows].double() * att.double().view(1, *x.shape[1:])).sum(-1)


@pytest.mark.parametrize("self_loops", [False, True], ids=["plain", "self_loops"])
@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_vectors(device, dtype, graph, self_loops):
    """Scores from attention vectors (PyG's [1, H, C] parameter for the source side, [H, C] for the
    destination's): the same as the scores they make, given."""
    x, _, _, src, dst, S = inputs(graph, dtype, device, with_input_loops=self_loops)
    N, H, C = x.shape
    att_src = torch.randn(1, H, C, dtype=torch.float64).to(dtype).to(device)
    att_dst = torch.randn(H, C, dtype=torch.float64).to(dtype).to(device)
    out = geot.attention_aggregate(x, None, None, src, dst, S, 0.2, self_loops, att_src=att_src, att_dst=att_dst)
    assert out.dtype == dtype and out.shape == (S, H, C)
    ref = attention_ref(x, scores_of(x, att_src, N), scores_of(x, att_dst, S), src, dst, S, 0.2, self_loops)
    assert_close_to_ref(out, ref, x, dtype, f"{graph} self_loops={self_loops}")


@pytest.mark.parametrize("graph", ["gat_layer", "head_lanes_8_hubs"])
def test_one_side_from_a_vector(device, graph):
    """A given score on one side and an attention vector (float32 for bf16 rows, as autocast has it) on the other."""
    x, score_src, score_dst, src, dst, S = inputs(graph, torch.bfloat16, device, scores_dtype=torch.float32)
    N, H, C = x.shape
    att = torch.randn(H, C, device=device)
    out = geot.attention_aggregate(x, score_src, None, src, dst, S, 0.1, True, att_dst=att)
    ref = attention_ref(x, score_src, scores_of(x, att, S), src, dst, S, 0.1, True)
    assert_close_to_ref(out, ref, x, torch.bfloat16, "att_dst")
    out = geot.attention_aggregate(x, None, score_dst, src, dst, S, 0.1, True, att_src=att)
    ref = attention_ref(x, scores_of(x, att, N), score_dst, src, dst, S, 0.1, True)
    assert_close_to_ref(out, ref, x, torch.bfloat16, "att_src")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_float32_scores_with_half_rows(device, dtype):
    """Autocast's x * att (float32 att) gives float32 scores for half rows: taken as they are."""
    x, score_src, score_dst, src, dst, S = inputs("gat_layer", dtype, device, scores_dtype=torch.float32)
    out = geot.attention_aggregate(x, score_src, score_dst, src, dst, S, negative_slope=0.1, self_loops=True)
    assert out.dtype == dtype
    assert_close_to_ref(out, attention_ref(x, score_src, score_dst, src, dst, S, 0.1, True), x, dtype)


def test_matches_the_two_op_route(device):
    """The same as geot.edge_softmax of the logits fed to index_weight_segment_reduce."""
    x, score_src, score_dst, src, dst, S = inputs("gat_layer", torch.float32, device)
    logit = F.leaky_relu(score_src[src] + score_dst[dst], 0.2)
    expected = geot.index_weight_segment_reduce(src, dst, geot.edge_softmax(logit, dst, S), x, "sum", S)
    torch.testing.assert_close(geot.attention_aggregate(x, score_src, score_dst, src, dst, S), expected)


def test_empty_destinations_get_zero_and_huge_logits_stay_finite(device):
    dst = index_from_degrees(torch.tensor([3, 0, 2, 0])).to(device)
    src = torch.tensor([1, 2, 3, 0, 1], device=device)
    x = torch.randn(4, 2, 3, device=device)
    score_src = torch.tensor([[1e4, -1e4], [2e4, 0.0], [-3e4, 5.0], [0.0, 0.0]], device=device)
    score_dst = torch.zeros(4, 2, device=device)
    out = geot.attention_aggregate(x, score_src, score_dst, src, dst, 4)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[3] == 0).all()
    assert_close_to_ref(out, attention_ref(x, score_src, score_dst, src, dst, 4), x, torch.float32)


def test_nan_propagates(device):
    dst = torch.tensor([0, 0, 1], device=device)
    src = torch.tensor([0, 1, 1], device=device)
    score_src = torch.tensor([[float("nan")], [0.0]], device=device)
    out = geot.attention_aggregate(torch.ones(2, 1, 2, device=device), score_src, torch.zeros(2, 1, device=device),
                                   src, dst, 2)
    assert out[0].isnan().all() and not out[1].isnan().any()


def test_errors(device):
    x, score_src, score_dst, src, dst, S = inputs("empty_segments", torch.float32, device)
    call = geot.attention_aggregate
    with pytest.raises(ValueError, match="inference only"):
        call(x.requires_grad_(), score_src, score_dst, src, dst, S)
    x = x.detach()
    with pytest.raises(ValueError, match=r"x must have shape \[N, H, C\]"):
        call(x.flatten(1), score_src, score_dst, src, dst, S)
    with pytest.raises(ValueError, match=r"score_dst must have shape \[num_segments, H\]"):
        call(x, score_src, score_dst[:-1], src, dst, S)
    with pytest.raises(TypeError, match="score_src must have the dtype of x"):
        call(x, score_src.double(), score_dst, src, dst, S)
    with pytest.raises(ValueError, match="dst_index must be sorted"):
        call(x, score_src, score_dst, src, dst.flip(0), S)
    with pytest.raises(ValueError, match=r"src_index has values >= x.size\(0\)"):
        call(x, score_src, score_dst, src + x.size(0), dst, S)
    with pytest.raises(ValueError, match="src_index and dst_index must have the same dtype"):
        call(x, score_src, score_dst, src.int(), dst, S)
    wide = torch.randn(S + 1, x.size(1), device=device)
    with pytest.raises(ValueError, match="self_loops needs a row of x per destination"):
        call(x, score_src, wide, src, dst, S + 1, 0.2, True)
    H, C = x.shape[1:]
    att = torch.randn(H, C, device=device)
    with pytest.raises(ValueError, match="give one of score_src and att_src, got both"):
        call(x, score_src, score_dst, src, dst, S, att_src=att)
    with pytest.raises(ValueError, match="give one of score_dst and att_dst, got neither"):
        call(x, score_src, None, src, dst, S)
    with pytest.raises(ValueError, match=r"att_src must have shape \[H, C\]"):
        call(x, None, score_dst, src, dst, S, att_src=att.t())
    with pytest.raises(TypeError, match="att_dst must have the dtype of x"):
        call(x, score_src, None, src, dst, S, att_dst=att.double())
    with pytest.raises(ValueError, match=r"att_dst scores destinations by their rows of x"):
        call(x, score_src, None, src, dst, x.size(0) + 1, att_dst=att)
    with pytest.raises(ValueError, match="inference only"):
        call(x, score_src, None, src, dst, S, att_dst=att.requires_grad_())
    with pytest.raises(RuntimeError, match="no gradient"):
        torch.ops.geot.attention_aggregate(x, score_src.requires_grad_(), score_dst, src, dst, S, 0.2,
                                           False).sum().backward()


@pytest.mark.parametrize("graph", ["gat_layer", "hubs"])
def test_validation_off_skips_bad_sources(device, graph):
    """Unchecked out-of-range sources are left out, never read (and, with no
    validation to say there are no hubs, the hub pass runs)."""
    x, score_src, score_dst, src, dst, S = inputs(graph, torch.float32, device)
    bad = src.clone()
    bad[::5] = x.size(0) + 10**6
    geot.set_validation(False)
    out = geot.attention_aggregate(x, score_src, score_dst, bad, dst, S)
    keep = bad < x.size(0)
    expected = attention_ref(x, score_src, score_dst, src[keep], dst[keep], S)
    assert_close_to_ref(out, expected, x, torch.float32)


def test_compiled(device):
    torch._dynamo.reset()
    x, score_src, score_dst, src, dst, S = inputs("gat_layer", torch.float32, device)

    def layer(x, score_src, score_dst):
        return geot.attention_aggregate(x * 2, score_src, score_dst, src, dst, S, 0.2, True).relu()

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x, score_src, score_dst),
                                   layer(x, score_src, score_dst))
    att = torch.randn(1, *x.shape[1:], device=device)

    def layer_of_vectors(x, att):
        return geot.attention_aggregate(x * 2, None, None, src, dst, S, 0.2, True, att_src=att, att_dst=att).relu()

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer_of_vectors, fullgraph=True)(x, att), layer_of_vectors(x, att))
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.geot.attention_aggregate.default, (x, score_src, score_dst, src, dst, S, 0.2, True),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.geot.attention_aggregate.default, (x, None, score_dst, src, dst, S, 0.2, True),
                          {"att_src": att}, test_utils=checks)
