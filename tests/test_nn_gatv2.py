"""geot.nn.GATv2Conv as a drop-in for PyG's: outputs, returned attention
weights and gradients equal PyG's (float64 to 1e-10, float32 to 1e-5) for
each option, on graphs with duplicated edges, duplicated self loops,
isolated nodes and no edges; what geot does not run natively runs PyG's
forward with one warning. Written from PyG's documented behaviour: the
score ``att . leaky_relu(W_l x_j + W_r x_i (+ W_e e_ij))`` per head, a
softmax over each node's incoming edges (one self loop per node replacing
the input's, edge features of loops from ``fill_value``), the heads
concatenated or averaged, then the residual and the bias."""
import copy
import warnings
from dataclasses import dataclass, field

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot.nn as gnn  # noqa: E402
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor  # noqa: E402

F64 = {"rtol": 1e-10, "atol": 1e-10, "grad_atol": 1e-10}
# fp32: a gradient sums over every edge in an order atomics decide on CUDA (PyG's too), so an element
# that cancels to ~0 carries that sum's rounding: a few 1e-5 of its terms' scale.
F32 = {"rtol": 1e-5, "atol": 1e-5, "grad_atol": 5e-5}
NUM_SRC, NUM_DST = 13, 9  # NUM_DST: x_dst's rows in bipartite calls


# Graphs ---------------------------------------------------------------------------------------

def duplicated_graph(num_src, num_dst, device):
    """Unsorted edges with duplicated edges and duplicated self loops; the
    last two sources and destinations have no edges (isolated nodes)."""
    src = torch.randint(0, num_src - 2, (4 * num_dst,), device=device)
    dst = torch.randint(0, num_dst - 2, (4 * num_dst,), device=device)
    loops = torch.arange(0, min(num_src, num_dst) - 2, 3, device=device)
    src = torch.cat([src, src[:5], loops, loops])
    dst = torch.cat([dst, dst[:5], loops, loops])
    order = torch.randperm(src.numel(), device=device)
    return torch.stack([src[order], dst[order]])


GRAPHS = {
    "duplicates": duplicated_graph,
    "no-edges": lambda num_src, num_dst, device: torch.empty(2, 0, dtype=torch.long, device=device),
}


def adjacency(edge_index, num_src, num_dst, layout):
    """PyG's adj_t [num_dst, num_src] of edge_index in a torch.sparse layout."""
    make = {"csr": to_torch_csr_tensor, "csc": to_torch_csc_tensor, "coo": to_torch_coo_tensor}[layout]
    return make(edge_index.flip(0), size=(num_dst, num_src))


# Cases ----------------------------------------------------------------------------------------

@dataclass
class Case:
    kwargs: dict = field(default_factory=dict)   # the constructor's options besides the widths
    bipartite: bool = False                      # x is (x_src [13, 6], x_dst [9, dst_width])
    dst_width: int = 3
    edge_attr: int = 0                           # edge feature width (1: a [E] vector)
    attention: bool = False                      # return_attention_weights=True
    layout: str = "edge_index"                   # or csr / csc / coo adj_t


NATIVE = {
    "heads": Case({"heads": 3}),
    "mean-no-loops": Case({"heads": 2, "concat": False, "add_self_loops": False}),
    "slope-no-bias": Case({"heads": 2, "negative_slope": 0.05, "bias": False}),
    "share-weights-residual": Case({"heads": 2, "share_weights": True, "residual": True}),
    "dropout-eval": Case({"heads": 2, "dropout": 0.5}),  # compared in eval mode: no dropout
    "flow": Case({"heads": 2, "flow": "target_to_source"}),
    "flow-edges-attention": Case({"heads": 2, "flow": "target_to_source", "edge_dim": 2, "residual": True},
                                 edge_attr=2, attention=True),
    "bipartite": Case({"heads": 2, "residual": True}, bipartite=True),
    "bipartite-mean": Case({"heads": 2, "concat": False, "add_self_loops": False}, bipartite=True),
    "bipartite-share-weights": Case({"heads": 2, "share_weights": True}, bipartite=True, dst_width=6),
    "edge-dim": Case({"heads": 2, "edge_dim": 3}, edge_attr=3),
    "edge-vector-fill": Case({"heads": 2, "edge_dim": 1, "fill_value": 0.5}, edge_attr=1),
    "edge-fill-add": Case({"heads": 2, "edge_dim": 3, "fill_value": "add"}, edge_attr=3),
    "edge-fill-max": Case({"heads": 2, "edge_dim": 3, "fill_value": "max"}, edge_attr=3),
    "edge-fill-tensor": Case({"heads": 2, "edge_dim": 2, "fill_value": torch.tensor([0.5, -1.0])}, edge_attr=2),
    "edge-no-loops": Case({"heads": 2, "edge_dim": 3, "add_self_loops": False}, edge_attr=3),
    "edge-dim-without-edge-attr": Case({"heads": 2, "edge_dim": 3}),
    "attention": Case({"heads": 2}, attention=True),
    "attention-no-loops": Case({"heads": 2, "add_self_loops": False}, attention=True),
    "attention-bipartite-edges": Case({"heads": 2, "edge_dim": 2, "residual": True}, bipartite=True, edge_attr=2,
                                      attention=True),
    "csr": Case({"heads": 2}, layout="csr"),
    "csc-residual": Case({"heads": 2, "residual": True}, layout="csc"),
    "coo-bipartite": Case({"heads": 2}, bipartite=True, layout="coo"),
    "csr-no-loops-edge-dim": Case({"heads": 2, "add_self_loops": False, "edge_dim": 2}, layout="csr"),
}


def build_pair(case: Case, dtype, device):
    """PyG's layer with random parameters (bias and attention too) and geot's holding the same."""
    channels = (6, case.dst_width) if case.bipartite else 6
    torch.manual_seed(0)
    pyg_layer = pyg_nn.GATv2Conv(channels, 4, **case.kwargs).to(device, dtype)
    with torch.no_grad():
        for p in pyg_layer.parameters():
            p.normal_()
    geot_layer = gnn.GATv2Conv(channels, 4, **case.kwargs).to(device, dtype)
    geot_layer.load_state_dict(pyg_layer.state_dict())
    return geot_layer, pyg_layer


def make_call(case: Case, graph: str, dtype, device):
    """(x, graph input, kwargs) of one call; edge_index rows swapped for flow="target_to_source"."""
    num_dst = NUM_DST if case.bipartite else NUM_SRC
    edge_index = GRAPHS[graph](NUM_SRC, num_dst, device)
    x_src = torch.randn(NUM_SRC, 6, dtype=dtype, device=device)
    x = (x_src, torch.randn(num_dst, case.dst_width, dtype=dtype, device=device)) if case.bipartite else x_src
    graph_input = edge_index.flip(0) if case.kwargs.get("flow") == "target_to_source" else edge_index
    if case.layout != "edge_index":
        graph_input = adjacency(edge_index, NUM_SRC, num_dst, case.layout)
    kwargs = {}
    if case.edge_attr:
        shape = (edge_index.size(1),) + (() if case.edge_attr == 1 else (case.edge_attr,))
        kwargs["edge_attr"] = torch.randn(*shape, dtype=dtype, device=device)
    if case.attention:
        kwargs["return_attention_weights"] = True
    return x, graph_input, kwargs


def run(layer, x, graph_input, kwargs):
    """(output, attention or None, gradients of x and the parameters) of one call."""
    x = tuple(t.detach().clone().requires_grad_() for t in x) if isinstance(x, tuple) \
        else x.detach().clone().requires_grad_()
    result = layer(x, graph_input, **kwargs)
    out, attention = result if kwargs.get("return_attention_weights") else (result, None)
    loss = weighted_sum(out) + (0 if attention is None else weighted_sum(attention[1]))
    inputs = list(x) if isinstance(x, tuple) else [x]
    grads = torch.autograd.grad(loss, inputs + list(layer.parameters()), allow_unused=True)
    return out, attention, grads


def weighted_sum(values):
    return (values * torch.linspace(-1, 1, values.numel(), dtype=values.dtype,
                                    device=values.device).view_as(values)).sum()


def assert_close(got, want, tol, what, atol=None):
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    atol = (tol["atol"] if atol is None else atol) * scale
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def assert_same_results(got, want, tol):
    assert_close(got[0], want[0], tol, "output")
    if want[1] is not None:
        assert torch.equal(got[1][0], want[1][0]), "attention edges (PyG's self-looped edge_index)"
        assert_close(got[1][1], want[1][1], tol, "attention weights")
    for position, (g, w) in enumerate(zip(got[2], want[2])):
        if w is None or g is None:
            assert (g is None or not g.any()) and (w is None or not w.any()), f"gradient {position}"
            continue
        assert_close(g, w, tol, f"gradient {position}", tol["grad_atol"])


def assert_native_matches(case: Case, graph: str, dtype, device, tol):
    geot_layer, pyg_layer = build_pair(case, dtype, device)  # in training mode
    if case.kwargs.get("dropout", 0) > 0:  # compared without dropout: the masks are drawn in other edge orders
        geot_layer.eval(), pyg_layer.eval()
    x, graph_input, kwargs = make_call(case, graph, dtype, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)  # native: PyG's forward must not run
        for _ in range(2):  # the second call reads what the first kept
            got = run(geot_layer, x, graph_input, kwargs)
    if case.layout == "csc":  # PyG's GATv2Conv takes no CSC (geot does): the same matrix as CSR
        graph_input = graph_input.to_sparse_csr()
    assert_same_results(got, run(pyg_layer, x, graph_input, kwargs), tol)


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", list(NATIVE))
def test_native_matches_pyg_float64(name, graph, device):
    assert_native_matches(NATIVE[name], graph, torch.float64, device, F64)


@pytest.mark.parametrize("name", list(NATIVE))
def test_native_matches_pyg_float32(name, device):
    assert_native_matches(NATIVE[name], "duplicates", torch.float32, device, F32)


@pytest.mark.parametrize("name", ["heads", "bipartite", "edge-fill-add", "attention-bipartite-edges", "csr",
                                  "flow-edges-attention"])
def test_inference_without_gradients_matches_pyg(name, device):
    """Without gradients the score sums and the softmax are written over in place."""
    case = NATIVE[name]
    geot_layer, pyg_layer = build_pair(case, torch.float64, device)
    geot_layer.eval(), pyg_layer.eval()
    x, graph_input, kwargs = make_call(case, "duplicates", torch.float64, device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got, want = geot_layer(x, graph_input, **kwargs), pyg_layer(x, graph_input, **kwargs)
    if case.attention:
        assert torch.equal(got[1][0], want[1][0])
        assert_close(got[1][1], want[1][1], F64, "attention weights")
        got, want = got[0], want[0]
    assert_close(got, want, F64, "output")


def test_attention_dropout_in_training(device):
    """Dropout in training runs on geot: each returned weight is dropped or
    scaled by 1 / (1 - p), as PyG's attention dropout, and the output is the
    sum of x_l's rows by those weights. (The mask itself differs from PyG's
    for a seed: the edges are drawn in another order.)"""
    case = Case({"heads": 2, "dropout": 0.5}, attention=True)
    geot_layer, pyg_layer = build_pair(case, torch.float64, device)
    x, edge_index, _ = make_call(case, "duplicates", torch.float64, device)
    pyg_layer.eval()
    _, (looped, undropped) = pyg_layer(x, edge_index, return_attention_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        out, (edges, alpha) = geot_layer(x, edge_index, return_attention_weights=True)
    assert torch.equal(edges, looped)
    kept = alpha != 0
    assert 0 < int(kept.sum()) < alpha.numel()
    assert_close(alpha[kept], undropped[kept] * 2, F64, "kept weights")
    x_l = geot_layer.lin_l(x).view(-1, 2, 4)
    summed = torch.zeros(NUM_SRC, 2, 4, dtype=torch.float64, device=device)
    summed.index_add_(0, looped[1], alpha.unsqueeze(-1) * x_l[looped[0]])
    assert_close(out, summed.view(NUM_SRC, 8) + geot_layer.bias, F64, "output")
    out.sum().backward()  # gradients flow through the dropped weights


def test_compiled_matches_pyg():
    """torch.compile(fullgraph=True) traces the native path (no fallback)."""
    for case in (NATIVE["heads"], NATIVE["attention-bipartite-edges"]):
        geot_layer, pyg_layer = build_pair(case, torch.float64, "cpu")
        x, edge_index, kwargs = make_call(case, "duplicates", torch.float64, "cpu")
        compiled = torch.compile(geot_layer, fullgraph=True, backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error", gnn.GeotFallbackWarning)
            warnings.simplefilter("ignore", gnn.UncachedGraphWarning)
            got = run(compiled, x, edge_index, kwargs)
        assert_same_results(got, run(pyg_layer, x, edge_index, kwargs), F64)


# Fallbacks: PyG's forward, one warning per layer and reason --------------------------------------

FALLBACK = {
    "aggr-mean": (Case({"heads": 2, "aggr": "mean"}), "aggr='mean'"),
    "attention-over-csr": (Case({"heads": 2}, attention=True, layout="csr"), "attention weights over a sparse"),
    "flow-bipartite-sizes": (Case({"heads": 2, "flow": "target_to_source"}, bipartite=True), "different sizes"),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_fallback_runs_pyg_with_one_warning(name, device):
    case, reason = FALLBACK[name]
    geot_layer, pyg_layer = build_pair(case, torch.float64, device)
    x, graph_input, kwargs = make_call(case, "duplicates", torch.float64, device)
    with pytest.warns(gnn.GeotFallbackWarning, match=reason):
        got = run(geot_layer, x, graph_input, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)  # once per layer and reason
        run(geot_layer, x, graph_input, kwargs)
    want = run(pyg_layer, x, graph_input, kwargs)
    assert_close(got[0], want[0], F64, "output")
    if want[1] is not None:
        assert_close(got[1][1], want[1][1], F64, "attention weights")


@pytest.mark.parametrize("call", ["x_dst None", "edge_attr without edge_dim"])
def test_inputs_pyg_raises_for_run_pyg(call):
    """PyG's forward asserts on these: the geot layer runs it, so it raises the same."""
    conv = gnn.GATv2Conv(6, 4, heads=2)
    x, edge_index = torch.randn(NUM_SRC, 6), duplicated_graph(NUM_SRC, NUM_SRC, "cpu")
    args = ((x, None), edge_index) if call == "x_dst None" else \
        (x, edge_index, torch.randn(edge_index.size(1), 3))
    with pytest.warns(gnn.GeotFallbackWarning, match=call), pytest.raises(AssertionError):
        conv(*args)


# patch ----------------------------------------------------------------------------------------

class TwoLayers(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.conv1 = pyg_nn.GATv2Conv(6, 4, heads=2, **kwargs)
        self.conv2 = pyg_nn.GATv2Conv(8, 3, heads=1, **kwargs)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


def test_patch_converts_in_place(device):
    reference = TwoLayers(residual=True).to(device)
    model = copy.deepcopy(reference)
    params = list(model.parameters())
    assert gnn.patch(model) is model
    assert type(model.conv1) is gnn.GATv2Conv and type(model.conv2) is gnn.GATv2Conv
    assert all(a is b for a, b in zip(model.parameters(), params)), "patch keeps the parameter tensors"
    x, edge_index = torch.randn(NUM_SRC, 6, device=device), duplicated_graph(NUM_SRC, NUM_SRC, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got = run(model, x, edge_index, {})
    assert_same_results(got, run(reference, x, edge_index, {}), F32)


def test_patch_strict_raises_for_options_that_run_pyg():
    with pytest.raises(NotImplementedError, match="conv1.*aggr='max'"):
        gnn.patch(TwoLayers(aggr="max"), strict=True)
    model = gnn.patch(TwoLayers(aggr="max"))
    assert type(model.conv1) is gnn.GATv2Conv

