"""geot.nn.RGATConv and geot.nn.HGTConv as drop-ins for PyG's: outputs and
gradients equal PyG's (float64 to 1e-10, float32 to 1e-5) for each option,
on graphs with duplicated edges, self loops, isolated nodes, relations
without edges and no edges at all; what geot does not run natively runs
PyG's forward with one warning. Written from PyG's documented behaviour."""
import copy
import random
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot  # noqa: E402
import geot.nn as gnn  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csr_tensor  # noqa: E402

F64 = {"rtol": 1e-10, "atol": 1e-10}
F32 = {"rtol": 1e-5, "atol": 1e-5}
# float32 on CUDA: both libraries sum gradients over edges with atomics (and
# cuBLAS picks its own orders), so sums of ~10^2 terms differ by a few 1e-5.
F32_CUDA = {"rtol": 1e-4, "atol": 1e-4}


def f32_tolerance(device):
    return F32_CUDA if str(device).startswith("cuda") else F32
RELATIONS = 4  # the last one has no edges
NODES = 11     # the last two have no edges


def relational_edges(device, num_edges=30):
    """(edge_index, edge_type): unsorted, duplicated edges and self loops, relation 3 and nodes 9, 10 unused."""
    src = torch.randint(0, NODES - 2, (num_edges,), device=device)
    dst = torch.randint(0, NODES - 2, (num_edges,), device=device)
    kind = torch.randint(0, RELATIONS - 1, (num_edges,), device=device)
    loops = torch.arange(0, NODES - 2, 3, device=device)
    src, dst = torch.cat([src, src[:4], loops]), torch.cat([dst, dst[:4], loops])
    kind = torch.cat([kind, kind[:4], torch.zeros_like(loops)])
    return torch.stack([src, dst]), kind


def no_edges(device):
    return torch.empty(2, 0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device)


def pair(geot_class, pyg_class, args, kwargs, device, dtype):
    """A PyG layer with random parameters and the geot layer holding the same (load_state_dict)."""
    pyg_layer = pyg_class(*args, **kwargs).to(device, dtype)
    with torch.no_grad():
        for p in pyg_layer.parameters():
            p.normal_()
    geot_layer = geot_class(*args, **kwargs).to(device, dtype)
    geot_layer.load_state_dict(pyg_layer.state_dict())
    return geot_layer, pyg_layer


def grads_of(loss, inputs, layer):
    params = [p for _, p in layer.named_parameters()]
    return torch.autograd.grad(loss, inputs + params, allow_unused=True)


def weighted_sum(out):
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)).sum()


def assert_close(got, want, tol, what):
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{what}: {m}")


def assert_grads(got, want, tol):
    for position, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            assert (g is None or not g.any()) and (w is None or not w.any()), f"gradient {position}"
            continue
        assert_close(g, w, tol, f"gradient {position}")


# RGATConv -------------------------------------------------------------------------------------

RGAT = {
    "additive-across": {},
    "multiplicative-across": {"attention_mode": "multiplicative-self-attention"},
    "additive-within": {"attention_mechanism": "within-relation"},
    "multiplicative-within": {"attention_mode": "multiplicative-self-attention",
                              "attention_mechanism": "within-relation"},
    "heads": {"heads": 3},
    "heads-mean": {"heads": 2, "concat": False},
    "dim": {"attention_mode": "multiplicative-self-attention", "heads": 2, "dim": 3},
    "dim-mean": {"attention_mode": "multiplicative-self-attention", "heads": 2, "dim": 2, "concat": False},
    "edge-dim": {"edge_dim": 4, "heads": 2},
    "edge-dim-multiplicative": {"edge_dim": 4, "attention_mode": "multiplicative-self-attention"},
    "edge-vector": {"edge_dim": 1},
    "no-bias": {"bias": False, "heads": 2},
    "bases": {"num_bases": 2, "heads": 2},
    "blocks": {"num_blocks": 2, "heads": 2},
    "mod-additive": {"mod": "additive", "heads": 2},
    "mod-additive-multiplicative": {"mod": "additive", "attention_mode": "multiplicative-self-attention",
                                    "dim": 2},
    "mod-scaled": {"mod": "scaled", "heads": 2},
    "mod-scaled-multiplicative": {"mod": "scaled", "attention_mode": "multiplicative-self-attention", "dim": 2},
    "mod-f-additive": {"mod": "f-additive"},
    "mod-f-scaled": {"mod": "f-scaled", "heads": 2},
    "dropout-eval": {"dropout": 0.5, "heads": 2},
    "target-to-source": {"flow": "target_to_source", "heads": 2},
}


def rgat_pair(kwargs, device, dtype):
    return pair(gnn.RGATConv, pyg_nn.RGATConv, (6, 4, RELATIONS), kwargs, device, dtype)


def rgat_call(layer, x, edge_index, edge_type, edge_attr, attention):
    x = x.detach().clone().requires_grad_()
    result = layer(x, edge_index, edge_type, edge_attr, return_attention_weights=attention or None)
    out, alpha = result if attention else (result, None)
    loss = weighted_sum(out) + (0 if alpha is None else weighted_sum(alpha[1]))
    return out, alpha, grads_of(loss, [x], layer)


def check_rgat(kwargs, device, dtype, tol, edges, attention=False):
    geot_layer, pyg_layer = rgat_pair(kwargs, device, dtype)
    geot_layer.eval(), pyg_layer.eval()
    edge_index, edge_type = edges
    # PyG's own gradients are wrong for int32 edges (its softmax's scatter): its int64 result is the reference.
    pyg_edges = edge_index.long(), edge_type.long()
    x = torch.randn(NODES, 6, device=device, dtype=dtype)
    edge_dim = kwargs.get("edge_dim")
    edge_attr = None
    if edge_dim is not None:
        shape = (edge_type.numel(),) if edge_dim == 1 else (edge_type.numel(), edge_dim)
        edge_attr = torch.randn(*shape, device=device, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)  # native: PyG's forward must not run
        for _ in range(2):  # the second call reads what the first kept
            got = rgat_call(geot_layer, x, edge_index, edge_type, edge_attr, attention)
    want = rgat_call(pyg_layer, x, *pyg_edges, edge_attr, attention)
    assert_close(got[0], want[0], tol, "output")
    if attention:
        assert got[1][0] is edge_index
        assert_close(got[1][1], want[1][1], tol, "attention weights")
    assert_grads(got[2], want[2], tol)


@pytest.mark.parametrize("name", list(RGAT))
def test_rgat_matches_pyg_float64(name, device):
    check_rgat(RGAT[name], device, torch.float64, F64, relational_edges(device))


@pytest.mark.parametrize("name", list(RGAT))
def test_rgat_matches_pyg_float32(name, device):
    check_rgat(RGAT[name], device, torch.float32, f32_tolerance(device), relational_edges(device))


@pytest.mark.parametrize("name", ["additive-across", "multiplicative-within", "edge-dim", "mod-scaled"])
def test_rgat_without_edges(name, device):
    check_rgat(RGAT[name], device, torch.float64, F64, no_edges(device))


@pytest.mark.parametrize("flow", ["source_to_target", "target_to_source"])
@pytest.mark.parametrize("mechanism", ["across-relation", "within-relation"])
def test_rgat_attention_weights_in_input_order(mechanism, flow, device):
    check_rgat({"attention_mechanism": mechanism, "heads": 2, "edge_dim": 3, "flow": flow}, device, torch.float64,
               F64, relational_edges(device), attention=True)


def test_rgat_sorted_and_int32_edges(device):
    edge_index, edge_type = relational_edges(device)
    order = (edge_index[1] * RELATIONS + edge_type).argsort(stable=True)
    check_rgat({"heads": 2}, device, torch.float64, F64, (edge_index[:, order].int(), edge_type[order].int()))


def test_rgat_size_matches_pyg():
    geot_layer, pyg_layer = rgat_pair({"heads": 2}, "cpu", torch.float64)
    edge_index, edge_type = relational_edges("cpu")
    x = torch.randn(NODES, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got = geot_layer(x, edge_index, edge_type, size=(NODES, NODES))
    torch.testing.assert_close(got, pyg_layer(x, edge_index, edge_type, size=(NODES, NODES)), **F64)
    with pytest.warns(gnn.GeotFallbackWarning, match="size"), pytest.raises(ValueError):
        geot_layer(x, edge_index, edge_type, size=(NODES + 1, NODES))  # PyG raises for a size x disagrees with


def test_rgat_dropout_trains_natively(device):
    """Dropout in training runs on geot: its mask differs from PyG's draw, so only the shapes and the
    dropped weights' mean are checked."""
    layer = gnn.RGATConv(6, 4, RELATIONS, heads=2, dropout=0.5).to(device)
    edge_index, edge_type = relational_edges(device)
    x = torch.randn(NODES, 6, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        out = layer(x, edge_index, edge_type)
    out.sum().backward()
    assert out.shape == (NODES, 8) and x.grad is not None


def test_rgat_sparse_adjacency_runs_pyg(device):
    geot_layer, pyg_layer = rgat_pair({}, device, torch.float64)
    edge_index, edge_type = relational_edges(device)
    adj = to_torch_coo_tensor(edge_index.flip(0), size=(NODES, NODES)).coalesce()
    x = torch.randn(NODES, 6, device=device, dtype=torch.float64)
    with pytest.warns(gnn.GeotFallbackWarning, match="sparse adjacency"):
        got = geot_layer(x, adj, edge_type[:adj._nnz()])
    torch.testing.assert_close(got, pyg_layer(x, adj, edge_type[:adj._nnz()]), **F64)


def test_rgat_edge_attr_without_edge_dim_raises_as_pyg():
    layer = gnn.RGATConv(6, 4, RELATIONS)
    edge_index, edge_type = relational_edges("cpu")
    with pytest.warns(gnn.GeotFallbackWarning), pytest.raises(AssertionError):
        layer(torch.randn(NODES, 6), edge_index, edge_type, torch.randn(edge_type.numel(), 3))


# RGCNConv with many relations ----------------------------------------------------------------

RGCN = {
    "mean": {},
    "add": {"aggr": "add"},
    "bases": {"num_bases": 3},
    "narrower": {"out_channels": 3},
    "no-root": {"root_weight": False},
    "target-to-source": {"flow": "target_to_source"},
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(RGCN))
def test_rgcn_with_more_segments_than_edges(name, dtype, device):
    """Many relations, few edges: RGCNConv projects each distinct (source, relation) pair once."""
    relations = 20
    kwargs = dict(RGCN[name])
    out_channels = kwargs.pop("out_channels", 5)
    args = (6, out_channels, relations)
    geot_layer, pyg_layer = pair(gnn.RGCNConv, pyg_nn.RGCNConv, args, kwargs, device, dtype)
    edge_index, _ = relational_edges(device)
    edge_type = torch.randint(0, relations - 1, (edge_index.size(1),), device=device)
    assert NODES * relations > edge_index.size(1)
    x = torch.randn(NODES, 6, device=device, dtype=dtype)
    tol = F64 if dtype == torch.float64 else f32_tolerance(device)

    def call(layer):
        x_in = x.clone().requires_grad_()
        out = layer(x_in, edge_index, edge_type)
        return out, grads_of(weighted_sum(out), [x_in], layer)

    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        for _ in range(2):
            got = call(geot_layer)
    want = call(pyg_layer)
    assert_close(got[0], want[0], tol, "output")
    assert_grads(got[1], want[1], tol)


def test_rgcn_pairs_bipartite_matches_pyg():
    geot_layer, pyg_layer = pair(gnn.RGCNConv, pyg_nn.RGCNConv, ((6, 4), 5, 20), {}, "cpu", torch.float64)
    edge_index = torch.stack([torch.randint(0, 9, (25,)), torch.randint(0, 7, (25,))])
    edge_type = torch.randint(0, 20, (25,))
    x = (torch.randn(9, 6, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64))
    torch.testing.assert_close(geot_layer(x, edge_index, edge_type), pyg_layer(x, edge_index, edge_type), **F64)


def random_rgcn_draw(rng, device):
    """(PyG RGCNConv, x or None, edge_index, edge_type, training) over every way geot computes RGCN: few or
    many relations (the (node, relation) table, the pairs), equal, narrower and wider widths (projecting
    first, blocks, relation ranges), bases, blocks, no root or bias, featureless nodes, typed graphs (each
    relation reaching its own node range), int32 ids, no edges, inference and training."""
    relations, in_channels = rng.choice([1, 2, 3, 7]), rng.choice([4, 8])
    out_channels = rng.choice([in_channels, in_channels, 2, 6])
    kwargs = {"aggr": rng.choice(["mean", "add", "sum"]), "root_weight": rng.choice([True, False]),
              "bias": rng.choice([True, False])}
    extra = rng.choice([None, "bases", "blocks"])
    if extra == "bases":
        kwargs["num_bases"] = rng.choice([1, 2])
    elif extra == "blocks" and out_channels % 2 == 0:
        kwargs["num_blocks"] = 2
    nodes, count = rng.choice([5, 30]), rng.choice([0, 1, 20, 300])
    edge_type = torch.randint(0, relations, (count,), device=device)
    dst = torch.randint(0, nodes, (count,), device=device)
    if rng.random() < 0.5:
        width = max(1, nodes // relations)
        dst = (edge_type * width + torch.randint(0, width, (count,), device=device)).clamp(max=nodes - 1)
    edge_index = torch.stack([torch.randint(0, nodes, (count,), device=device), dst])
    if rng.random() < 0.3:
        edge_index, edge_type = edge_index.int(), edge_type.int()
    featureless = "num_blocks" not in kwargs and rng.random() < 0.15
    x = None if featureless else torch.randn(nodes, in_channels, device=device, dtype=torch.float64)
    layer = pyg_nn.RGCNConv(nodes if featureless else in_channels, out_channels, relations, **kwargs)
    return layer.to(device, torch.float64), x, edge_index, edge_type, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(4))
def test_rgcn_random_options_match_pyg(seed, device):
    """geot's RGCNConv (gnn.patch) against PyG's over random draws (random_rgcn_draw), float64: the output,
    and in training the gradients of x and of every parameter; the second call reads what the first kept.
    PyG is given the same ids as int64 (geot's int32 ids are what is under test)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for trial in range(40):
        pyg_layer, x, edge_index, edge_type, training = random_rgcn_draw(rng, device)
        x_grad = training and x is not None and rng.random() < 0.7  # else the weights' gradients alone
        geot_layer = gnn.patch(copy.deepcopy(pyg_layer))
        what = (f"seed {seed} trial {trial}: {pyg_layer} {pyg_layer.aggr} {edge_index.dtype} "
                f"training={training} x_grad={x_grad}")

        def call(layer, ids, types):
            x_in = None if x is None else x.clone().requires_grad_(x_grad)
            with torch.set_grad_enabled(training):
                out = layer(x_in, ids, types)
                grads = grads_of(weighted_sum(out), [x_in] if x_grad else [], layer) if training else ()
            return out, grads

        want = call(pyg_layer, edge_index.long(), edge_type.long())
        for _ in range(2):
            got = call(geot_layer, edge_index, edge_type)
        assert_close(got[0], want[0], F64, what)
        assert_grads(got[1], want[1], F64)


# HGTConv --------------------------------------------------------------------------------------

COUNTS = {"author": 7, "paper": 5, "venue": 4, "orphan": 3}
EDGE_TYPES = [("author", "writes", "paper"), ("paper", "rev_writes", "author"), ("author", "knows", "author"),
              ("venue", "hosts", "paper"), ("paper", "in", "venue"), ("orphan", "to", "orphan")]


def hetero_inputs(device, dtype, widths, empty=False):
    """x_dict, edge_index_dict: duplicated edges and self loops, isolated nodes, an edge type without
    edges (venue -> paper), one in metadata but absent (paper -> venue, so venue's output is its bias),
    and no edges at all with empty=True."""
    x_dict = {t: torch.randn(n, widths[t], device=device, dtype=dtype) for t, n in COUNTS.items() if t != "orphan"}
    edge_index_dict = {}
    for src, rel, dst in EDGE_TYPES[:4]:
        count = 0 if empty or rel == "hosts" else 12
        edges = torch.stack([torch.randint(0, COUNTS[src] - 1, (count,)), torch.randint(0, COUNTS[dst] - 1, (count,))])
        if src == dst and not empty:
            loops = torch.arange(3).repeat(2)
            edges = torch.cat([edges, torch.stack([loops, loops]), edges[:, :3]], 1)
        edge_index_dict[src, rel, dst] = edges.to(device)
    return x_dict, edge_index_dict


METADATA = (list(COUNTS), EDGE_TYPES)

HGT = {
    "heads-1": ({"in_channels": 8, "out_channels": 8}, {t: 8 for t in COUNTS}),
    "heads-2": ({"in_channels": 8, "out_channels": 8, "heads": 2}, {t: 8 for t in COUNTS}),
    "no-skip": ({"in_channels": 6, "out_channels": 8, "heads": 4}, {t: 6 for t in COUNTS}),
    "wide-in": ({"in_channels": 16, "out_channels": 4, "heads": 2}, {t: 16 for t in COUNTS}),  # not composed
    "widths": ({"in_channels": {"author": 6, "paper": 8, "venue": 5, "orphan": 3}, "out_channels": 8,
                "heads": 2}, {"author": 6, "paper": 8, "venue": 5, "orphan": 3}),
}


def hgt_call(layer, x_dict, edge_index_dict):
    x_dict = {t: x.detach().clone().requires_grad_() for t, x in x_dict.items()}
    out = layer(x_dict, edge_index_dict)
    loss = sum(weighted_sum(value) * (i + 1) for i, value in enumerate(out.values()))
    return out, grads_of(loss, list(x_dict.values()), layer)


def check_hgt(name, device, dtype, tol, empty=False, adjacency=False):
    kwargs, widths = HGT[name]
    geot_layer, pyg_layer = pair(gnn.HGTConv, pyg_nn.HGTConv, (), dict(kwargs, metadata=METADATA), device, dtype)
    x_dict, edge_index_dict = hetero_inputs(device, dtype, widths, empty)
    if adjacency:
        edge_index_dict = {key: to_torch_csr_tensor(edges.flip(0), size=(COUNTS[key[-1]], COUNTS[key[0]]))
                           for key, edges in edge_index_dict.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        for _ in range(2):
            got = hgt_call(geot_layer, x_dict, edge_index_dict)
    want = hgt_call(pyg_layer, x_dict, edge_index_dict)
    assert list(got[0]) == list(want[0]), "output node types and their order"
    for key in want[0]:
        assert_close(got[0][key], want[0][key], tol, f"output {key}")
    assert_grads(got[1], want[1], tol)


@pytest.mark.parametrize("name", list(HGT))
def test_hgt_matches_pyg_float64(name, device):
    check_hgt(name, device, torch.float64, F64)


@pytest.mark.parametrize("name", list(HGT))
def test_hgt_matches_pyg_float32(name, device):
    check_hgt(name, device, torch.float32, f32_tolerance(device))


def test_hgt_without_edges(device):
    check_hgt("heads-2", device, torch.float64, F64, empty=True)


def test_hgt_sparse_adjacencies(device):
    check_hgt("heads-2", device, torch.float64, F64, adjacency=True)


@pytest.mark.parametrize("name", ["heads-2", "wide-in"])
def test_hgt_keeps_no_node_keys_or_values(name, device):
    """What training keeps for backward holds no [N, 3F] K | Q | V rows: no node-sized tensor kept is a
    column slice of wider rows (each edge type's K and V transforms composed with the K and V linears,
    or, x wider than K and V, the queries copied out)."""
    kwargs, widths = HGT[name]
    geot_layer, pyg_layer = pair(gnn.HGTConv, pyg_nn.HGTConv, (), dict(kwargs, metadata=METADATA), device,
                                 torch.float64)
    x_dict, edge_index_dict = hetero_inputs(device, torch.float64, widths)
    x_dict["author"] = torch.cat([x_dict["author"], x_dict["author"].new_zeros(13, widths["author"])])
    nodes = sum(x.size(0) for x in x_dict.values())  # 29: no weight's dimension, so no weight slice is counted
    views = []

    def pack(t):
        if t.dim() > 1 and t.size(0) == nodes and t.stride(0) > t[0].numel():
            views.append((tuple(t.shape), t.stride()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = hgt_call(geot_layer, x_dict, edge_index_dict)
    assert not views
    want = hgt_call(pyg_layer, x_dict, edge_index_dict)
    for key in want[0]:
        assert_close(got[0][key], want[0][key], F64, f"output {key}")
    assert_grads(got[1], want[1], F64)


def test_hgt_lazy_matches_pyg():
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float32, {t: 5 + i for i, t in enumerate(COUNTS)})
    geot_layer = gnn.HGTConv(-1, 8, METADATA, heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got = geot_layer(x_dict, edge_index_dict)
    pyg_layer = pyg_nn.HGTConv(-1, 8, METADATA, heads=2)
    pyg_layer(x_dict, edge_index_dict)  # materializes its parameters
    pyg_layer.load_state_dict(geot_layer.state_dict())
    want = pyg_layer(x_dict, edge_index_dict)
    for key in want:
        assert_close(got[key], want[key], F32, key)


def test_hgt_unknown_edge_type_raises_as_pyg():
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float32, {t: 8 for t in COUNTS})
    edge_index_dict["paper", "cites", "paper"] = torch.tensor([[0], [1]])
    with pytest.warns(gnn.GeotFallbackWarning, match="outside metadata"), pytest.raises(KeyError):
        gnn.HGTConv(8, 8, METADATA)(x_dict, edge_index_dict)


@pytest.fixture
def tf32_matmuls():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


def assert_as_accurate(got, peer, exact, what):
    """got (geot) no further from exact (PyG in float64) than 4x peer (PyG at got's precision), plus
    float32's rounding: a wrong result is off by far more than TF32's rounding of either library."""
    if exact is None:
        assert got is None or not got.any(), what
        return
    exact = exact.detach().double()
    error, peer_error = ((t.detach().double() - exact).abs().max().item() for t in (got, peer))
    scale = max(1.0, exact.abs().max().item())
    assert error <= 4 * peer_error + 1e-5 * scale, f"{what}: geot off by {error:.3g}, PyG by {peer_error:.3g}"


def assert_all_as_accurate(got, peer, exact, what):
    for position, tensors in enumerate(zip(got, peer, exact)):
        assert_as_accurate(*tensors, f"{what} {position}")


def test_grouped_gemm_path_as_accurate_as_pyg(device, tf32_matmuls):
    """At matmul precision "high" float32 takes geot.segment_matmul on CUDA too (TF32 tensor cores; PyG's
    matmuls round to TF32 as well): outputs and gradients as close to float64's as PyG's own. (A fixed
    tolerance does not hold: with N(0, 1) weights, TF32 puts either library's gradients a few % off.)"""
    geot_rgat, pyg_rgat = rgat_pair({"heads": 2, "edge_dim": 3}, device, torch.float32)
    exact_rgat = copy.deepcopy(pyg_rgat).double()
    for layer in (geot_rgat, pyg_rgat, exact_rgat):
        layer.eval()
    edge_index, edge_type = relational_edges(device)
    x, edge_attr = torch.randn(NODES, 6, device=device), torch.randn(edge_type.numel(), 3, device=device)
    for _ in range(2):  # the second call reads what the first kept
        got = rgat_call(geot_rgat, x, edge_index, edge_type, edge_attr, False)
    peer = rgat_call(pyg_rgat, x, edge_index, edge_type, edge_attr, False)
    exact = rgat_call(exact_rgat, x.double(), edge_index, edge_type, edge_attr.double(), False)
    assert_as_accurate(got[0], peer[0], exact[0], "RGAT output")
    assert_all_as_accurate(got[2], peer[2], exact[2], "RGAT gradient")

    kwargs, widths = HGT["heads-2"]
    geot_hgt, pyg_hgt = pair(gnn.HGTConv, pyg_nn.HGTConv, (), dict(kwargs, metadata=METADATA), device,
                             torch.float32)
    exact_hgt = copy.deepcopy(pyg_hgt).double()
    x_dict, edge_index_dict = hetero_inputs(device, torch.float32, widths)
    for _ in range(2):
        got = hgt_call(geot_hgt, x_dict, edge_index_dict)
    peer = hgt_call(pyg_hgt, x_dict, edge_index_dict)
    exact = hgt_call(exact_hgt, {t: x.double() for t, x in x_dict.items()}, edge_index_dict)
    assert_all_as_accurate(got[0].values(), peer[0].values(), exact[0].values(), "HGT output")
    assert_all_as_accurate(got[1], peer[1], exact[1], "HGT gradient")


@requires_cuda
@pytest.mark.parametrize("precision", ["high", "highest"])
def test_compiled_float32_on_cuda_is_one_graph(precision):
    """float32 on CUDA at either matmul precision (segment_matmul, or a torch matmul per type): RGCN (its
    pairs path), RGAT and HGT compile with fullgraph=True (torch 2.11's dynamo broke the graph where
    typed matmuls read the precision)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        torch._dynamo.reset()
        edge_index, edge_type = relational_edges("cuda")
        x = torch.randn(NODES, 6, device="cuda")
        rgcn = gnn.RGCNConv(6, 4, RELATIONS).cuda()  # 11 nodes x 4 relations > 37 edges: the pairs path
        rgat, _ = rgat_pair({"heads": 2}, "cuda", torch.float32)
        kwargs, widths = HGT["heads-2"]
        hgt, _ = pair(gnn.HGTConv, pyg_nn.HGTConv, (), dict(kwargs, metadata=METADATA), "cuda", torch.float32)
        x_dict, edge_index_dict = hetero_inputs("cuda", torch.float32, widths)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", gnn.GeotFallbackWarning)
            for layer, args in ((rgcn, (x, edge_index, edge_type)), (rgat, (x, edge_index, edge_type)),
                                (hgt, (x_dict, edge_index_dict))):
                torch.compile(layer, fullgraph=True, backend="eager")(*args)
    finally:
        torch.set_float32_matmul_precision(before)


def test_per_type_matmul_matches_segment_matmul():
    """The typed matmul of float32 on CUDA at torch's default precision (segment_matmul rounds to TF32)."""
    from geot.nn.common import per_type_matmul
    bounds = [0, 3, 3, 9, 10]  # type 1 empty
    x, weight = torch.randn(10, 5, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)
    want = geot.segment_matmul(x, torch.tensor(bounds), weight)
    torch.testing.assert_close(per_type_matmul(x, bounds, weight), want, **F64)
    no_rows = per_type_matmul(x[:0], [0] * 5, weight.requires_grad_())
    assert no_rows.shape == (0, 6) and no_rows.grad_fn is not None  # weight's gradient: zeros, as torch's


def compiled_without_fallback(layer, train_call, *args):
    """(inference output, train_call's result, the geot ops of the inference graph) of
    torch.compile(layer, fullgraph=True) with no eager call first; PyG's forward running raises."""
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        with torch.no_grad():
            out = torch.compile(layer, fullgraph=True, backend=recorder)(*args)
        trained = train_call(torch.compile(layer, fullgraph=True, backend="aot_eager"), *args)
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes
           if node.op == "call_function" and str(node.target).startswith("geot.")}
    return out, trained, ops


@pytest.mark.parametrize("kwargs", [{"heads": 2}, {"heads": 2, "edge_dim": 3, "mod": "scaled"}])
def test_compiled_rgat_runs_geot_on_its_graph(kwargs):
    """torch.compile(fullgraph=True) with no eager call first: the graph and its pairs are built while
    dynamo traces, the compiled code runs geot's ops (no fallback), and inference and training give
    PyG's results and gradients, the attention weights in input order too."""
    torch._dynamo.reset()
    geot_rgat, pyg_rgat = rgat_pair(kwargs, "cpu", torch.float64)
    edge_index, edge_type = relational_edges("cpu")
    x = torch.randn(NODES, 6, dtype=torch.float64)
    edge_attr = torch.randn(edge_type.numel(), 3, dtype=torch.float64) if "edge_dim" in kwargs else None
    got, trained, ops = compiled_without_fallback(geot_rgat, lambda layer, *args: rgat_call(layer, *args, True),
                                                  x, edge_index, edge_type, edge_attr)
    assert {"geot.segment_matmul", "geot.edge_softmax"} <= ops
    want = rgat_call(pyg_rgat, x, edge_index, edge_type, edge_attr, True)
    assert_close(got, want[0], F64, "inference")
    assert_close(trained[0], want[0], F64, "training")
    assert_close(trained[1][1], want[1][1], F64, "attention weights")
    assert_grads(trained[2], want[2], F64)


def test_compiled_rgat_on_a_changing_graph_runs_pyg_forward():
    """A compiled layer given another graph than the one it kept runs PyG's forward for it, with PyG's
    results, and geot's again for its own graph."""
    torch._dynamo.reset()
    geot_rgat, pyg_rgat = rgat_pair({"heads": 2}, "cpu", torch.float64)
    (edge_index, edge_type), (other, other_type) = relational_edges("cpu"), relational_edges("cpu")
    x = torch.randn(NODES, 6, dtype=torch.float64)
    compiled = torch.compile(geot_rgat, backend="aot_eager")
    with torch.no_grad():
        compiled(x, edge_index, edge_type)
        with pytest.warns(gnn.GeotFallbackWarning, match="torch.compile where the graph"):
            got = compiled(x, other, other_type)
        again = compiled(x, edge_index, edge_type)
        torch.testing.assert_close(got, pyg_rgat(x, other, other_type))
        torch.testing.assert_close(again, pyg_rgat(x, edge_index, edge_type))


@pytest.mark.parametrize("name", ["heads-2", "wide-in"])
def test_compiled_hgt_runs_geot_on_its_graph(name):
    """torch.compile(fullgraph=True) with no eager call first: the graph is built while dynamo traces,
    the compiled code runs geot's ops (no fallback), and inference and training give PyG's results and
    gradients; the training graph keeps its transposed index."""
    torch._dynamo.reset()
    kwargs, widths = HGT[name]
    geot_hgt, pyg_hgt = pair(gnn.HGTConv, pyg_nn.HGTConv, (), dict(kwargs, metadata=METADATA), "cpu",
                             torch.float64)
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float64, widths)
    got, trained, ops = compiled_without_fallback(geot_hgt, hgt_call, x_dict, edge_index_dict)
    assert {"geot.segment_matmul", "geot.edge_dot", "geot.edge_softmax"} <= ops
    want = hgt_call(pyg_hgt, x_dict, edge_index_dict)
    for key in want[0]:
        assert_close(got[key], want[0][key], F64, f"inference {key}")
        assert_close(trained[0][key], want[0][key], F64, f"training {key}")
    assert_grads(trained[1][:len(x_dict)], want[1][:len(x_dict)], F64)
    assert_grads(trained[1][len(x_dict):], want[1][len(x_dict):], F64)
    assert "transposed" in geot_hgt._geot_typed_graph.memo


def test_compiled_hgt_on_a_changing_graph_runs_pyg_forward():
    """A compiled layer given another graph than the one it kept runs PyG's forward for it (its pairs have
    data-dependent sizes), with PyG's results, and geot's again for its own graph."""
    torch._dynamo.reset()
    geot_hgt, pyg_hgt = pair(gnn.HGTConv, pyg_nn.HGTConv, (8, 8, METADATA), {"heads": 2}, "cpu", torch.float64)
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float64, {t: 8 for t in COUNTS})
    _, other_edges = hetero_inputs("cpu", torch.float64, {t: 8 for t in COUNTS})
    compiled = torch.compile(geot_hgt, backend="aot_eager")
    with torch.no_grad():
        compiled(x_dict, edge_index_dict)
        with pytest.warns(gnn.GeotFallbackWarning, match="torch.compile where the graph"):
            got = compiled(x_dict, other_edges)
        again = compiled(x_dict, edge_index_dict)
        want, want_again = pyg_hgt(x_dict, other_edges), pyg_hgt(x_dict, edge_index_dict)
    for key in want:
        assert_close(got[key], want[key], F64, f"output {key}")
        assert_close(again[key], want_again[key], F64, f"output {key}")


def test_compiled_hgt_with_sparse_adjacencies():
    """Sparse adjacencies, compiled: PyG's results (dynamo gives up on sparse inputs: the layer runs
    eagerly, its conversion of them too)."""
    torch._dynamo.reset()
    geot_hgt, pyg_hgt = pair(gnn.HGTConv, pyg_nn.HGTConv, (8, 8, METADATA), {"heads": 2}, "cpu", torch.float64)
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float64, {t: 8 for t in COUNTS})
    adjacency = {key: to_torch_csr_tensor(edges.flip(0), size=(COUNTS[key[-1]], COUNTS[key[0]]))
                 for key, edges in edge_index_dict.items()}
    with torch.no_grad():
        got = torch.compile(geot_hgt, backend="aot_eager")(x_dict, adjacency)
        want = pyg_hgt(x_dict, adjacency)
    for key in want:
        assert_close(got[key], want[key], F64, f"output {key}")


# patch ----------------------------------------------------------------------------------------

def test_patch_converts_rgat_and_hgt():
    model = torch.nn.ModuleDict({"rgat": pyg_nn.RGATConv(6, 4, RELATIONS, heads=2),
                                 "hgt": pyg_nn.HGTConv(8, 8, METADATA, heads=2)})
    torch.nn.init.normal_(model["rgat"].l2)  # PyG leaves it uninitialized
    state = {name: layer.state_dict() for name, layer in model.items()}
    gnn.patch(model)
    assert type(model["rgat"]) is gnn.RGATConv and type(model["hgt"]) is gnn.HGTConv
    edge_index, edge_type = relational_edges("cpu")
    x = torch.randn(NODES, 6)
    pyg_rgat = pyg_nn.RGATConv(6, 4, RELATIONS, heads=2)
    pyg_rgat.load_state_dict(state["rgat"])
    torch.testing.assert_close(model["rgat"](x, edge_index, edge_type), pyg_rgat(x, edge_index, edge_type))
    pyg_hgt = pyg_nn.HGTConv(8, 8, METADATA, heads=2)
    pyg_hgt.load_state_dict(state["hgt"])
    x_dict, edge_index_dict = hetero_inputs("cpu", torch.float32, {t: 8 for t in COUNTS})
    got, want = model["hgt"](x_dict, edge_index_dict), pyg_hgt(x_dict, edge_index_dict)
    for key in want:
        torch.testing.assert_close(got[key], want[key])
