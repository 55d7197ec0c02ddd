"""geot.nn as a drop-in for PyG's layers: every input and option PyG's layer
takes gives PyG's outputs and gradients, on geot's kernels where geot runs
it (no GeotFallbackWarning) and through PyG's forward where it does not
(one warning). Written from PyG's documented behaviour: x a tensor or a
bipartite pair with ``size``, ``edge_index`` in either ``flow`` or a sparse
``adj_t``, static graphs ``x`` [B, N, F], and each layer's own options."""
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot  # noqa: E402
import geot.nn as gnn  # noqa: E402
from geot.nn.layer import pyg_base  # noqa: E402
from reference import graph_with_duplicates  # noqa: E402
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor  # noqa: E402

NUM_RELATIONS = 3
F64 = {"rtol": 1e-10, "atol": 1e-10}
# fp32: outputs within 1e-5 (scaled by the reference's largest magnitude); a gradient sums over every
# edge in an order atomics decide (PyG's too), so an element that cancels to ~0 carries that sum's
# rounding: 1e-5 of its terms' scale, a few times over (seen on CUDA: 1.5e-5 on a GAT attention vector).
F32 = {"rtol": 1e-5, "atol": 1e-5, "grad_atol": 5e-5}


# Graphs ---------------------------------------------------------------------------------------

GRAPHS = {
    "duplicates": lambda n_src, n_dst, device: graph_with_duplicates(n_src, n_dst, 4 * n_dst, device),
    "no-edges": lambda n_src, n_dst, device: torch.empty(2, 0, dtype=torch.long, device=device),
}


def adjacency(edge_index, num_src, num_dst, layout, values=None):
    """PyG's adj_t [num_dst, num_src] of edge_index in a torch.sparse layout."""
    flipped, size = edge_index.flip(0), (num_dst, num_src)
    if layout == "csr":
        return to_torch_csr_tensor(flipped, values, size=size)
    if layout == "csc":
        return to_torch_csc_tensor(flipped, values, size=size)
    return to_torch_coo_tensor(flipped, values, size=size)


# Cases ----------------------------------------------------------------------------------------

@dataclass
class Case:
    """A layer and a call: make(cls) builds it; call(layer, x, edge_index, extra) runs it."""
    layer: str
    make: Callable
    bipartite: bool = False       # x is (x_src, x_dst)
    dst_none: bool = False        # x is (x_src, None) with size
    static: bool = False          # x is [B, N, F]
    layout: str = "edge_index"    # or csr / csc / coo adj_t
    weighted: bool = False        # edge_weight (GCN), adjacency values (GIN, SAGE, GCN)
    edge_attr: int = 0            # GAT edge feature width (1: a [E] vector)
    attention: bool = False       # GAT return_attention_weights
    flow: str = "source_to_target"
    relations: bool = False       # RGCN edge_type
    x_kind: str = "features"      # RGCN: "none", "index" (featureless)
    in_channels: int = 6
    kwargs: dict = field(default_factory=dict)


GIN_NNS = {  # narrowing ones are applied before the sum
    "widening": lambda: torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5)),
    "narrowing": lambda: torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU(), torch.nn.Linear(3, 5)),
    "narrowing-linear": lambda: torch.nn.Linear(6, 4),
}


def _layer(name):
    return {
        "gcn": lambda cls, **kw: cls(6, 5, **kw),
        "sage": lambda cls, **kw: cls(kw.pop("channels", 6), 5, **kw),
        "gin": lambda cls, **kw: cls(GIN_NNS[kw.pop("nn", "widening")](), **kw),
        "gat": lambda cls, **kw: cls(kw.pop("channels", 6), 4, **kw),
        "rgcn": lambda cls, **kw: cls(kw.pop("channels", 6), kw.pop("out", 5), NUM_RELATIONS, **kw),
    }[name]


def case(layer, **options):
    kwargs = options.pop("kwargs", {})
    return Case(layer, _layer(layer), kwargs=kwargs, **options)


NATIVE = {
    # GCN
    "gcn": case("gcn"),
    "gcn-weighted": case("gcn", weighted=True),
    "gcn-weighted-improved": case("gcn", weighted=True, kwargs={"improved": True}),
    "gcn-improved": case("gcn", kwargs={"improved": True}),
    "gcn-no-loops": case("gcn", kwargs={"add_self_loops": False}),
    "gcn-raw-weighted": case("gcn", weighted=True, kwargs={"normalize": False}),
    "gcn-no-bias": case("gcn", kwargs={"bias": False}),
    "gcn-cached": case("gcn", kwargs={"cached": True}),
    "gcn-flow": case("gcn", weighted=True, flow="target_to_source"),
    "gcn-static": case("gcn", static=True),
    "gcn-csr": case("gcn", layout="csr"),
    "gcn-csc-weighted": case("gcn", layout="csc", weighted=True),
    "gcn-coo-improved": case("gcn", layout="coo", kwargs={"improved": True}),
    "gcn-csr-raw": case("gcn", layout="csr", weighted=True, kwargs={"normalize": False}),
    # SAGE
    "sage-mean": case("sage"),
    "sage-sum": case("sage", kwargs={"aggr": "sum"}),
    "sage-max": case("sage", kwargs={"aggr": "max"}),
    "sage-min": case("sage", kwargs={"aggr": "min"}),
    "sage-project": case("sage", kwargs={"project": True}),
    "sage-normalize-no-root": case("sage", kwargs={"normalize": True, "root_weight": False}),
    "sage-narrow": case("sage", kwargs={"channels": 6}, in_channels=6),
    "sage-bipartite": case("sage", bipartite=True, kwargs={"channels": (6, 3)}),
    "sage-bipartite-max": case("sage", bipartite=True, kwargs={"channels": (6, 3), "aggr": "max"}),
    "sage-dst-none": case("sage", dst_none=True, kwargs={"channels": (6, 3)}),
    "sage-project-bipartite": case("sage", bipartite=True, kwargs={"channels": (6, 3), "project": True}),
    "sage-flow": case("sage", flow="target_to_source"),
    "sage-static": case("sage", static=True),
    "sage-csr": case("sage", layout="csr"),
    "sage-coo-sum-weighted": case("sage", layout="coo", weighted=True, kwargs={"aggr": "sum"}),
    "sage-csc-bipartite": case("sage", layout="csc", bipartite=True, kwargs={"channels": (6, 3)}),
    "sage-csr-max-weighted": case("sage", layout="csr", weighted=True, kwargs={"aggr": "max"}),
    # GIN
    "gin": case("gin", kwargs={"eps": 0.3, "train_eps": True}),
    "gin-bipartite": case("gin", bipartite=True, kwargs={"eps": 0.2}),
    "gin-dst-none": case("gin", dst_none=True),
    "gin-flow": case("gin", flow="target_to_source"),
    "gin-static": case("gin", static=True, kwargs={"train_eps": True}),
    "gin-csr-weighted": case("gin", layout="csr", weighted=True),
    "gin-csc-bipartite": case("gin", layout="csc", bipartite=True),
    "gin-narrowing": case("gin", kwargs={"nn": "narrowing", "eps": 0.3, "train_eps": True}),
    "gin-narrowing-bipartite": case("gin", bipartite=True, kwargs={"nn": "narrowing", "eps": 0.2}),
    "gin-narrowing-dst-none": case("gin", dst_none=True, kwargs={"nn": "narrowing-linear"}),
    "gin-narrowing-static": case("gin", static=True, kwargs={"nn": "narrowing", "train_eps": True}),
    "gin-narrowing-csr-weighted": case("gin", layout="csr", weighted=True, kwargs={"nn": "narrowing-linear"}),
    # GAT
    "gat": case("gat", kwargs={"heads": 3}),
    "gat-mean-no-loops": case("gat", kwargs={"heads": 2, "concat": False, "add_self_loops": False}),
    "gat-residual": case("gat", kwargs={"heads": 2, "residual": True, "negative_slope": 0.1}),
    "gat-bipartite": case("gat", bipartite=True, kwargs={"channels": (6, 3), "heads": 2, "residual": True}),
    "gat-bipartite-shared": case("gat", bipartite=True, in_channels=6, kwargs={"heads": 2}),
    "gat-dst-none": case("gat", dst_none=True, kwargs={"channels": (6, 3), "heads": 2}),
    "gat-flow": case("gat", flow="target_to_source", kwargs={"heads": 2}),
    "gat-edge-dim": case("gat", edge_attr=3, kwargs={"heads": 2, "edge_dim": 3}),
    "gat-edge-vector-fill": case("gat", edge_attr=1, kwargs={"heads": 2, "edge_dim": 1, "fill_value": 0.5}),
    "gat-edge-fill-add": case("gat", edge_attr=3, kwargs={"heads": 2, "edge_dim": 3, "fill_value": "add"}),
    "gat-edge-no-loops": case("gat", edge_attr=3, kwargs={"heads": 2, "edge_dim": 3, "add_self_loops": False}),
    "gat-attention": case("gat", attention=True, kwargs={"heads": 2}),
    "gat-attention-edge-bipartite": case("gat", attention=True, edge_attr=2, bipartite=True,
                                         kwargs={"channels": (6, 3), "heads": 2, "edge_dim": 2}),
    "gat-csr": case("gat", layout="csr", kwargs={"heads": 2}),
    "gat-coo-bipartite": case("gat", layout="coo", bipartite=True, kwargs={"channels": (6, 3), "heads": 2}),
    # RGCN
    "rgcn-mean": case("rgcn", relations=True),
    "rgcn-sum-bases": case("rgcn", relations=True, kwargs={"aggr": "add", "num_bases": 2}),
    "rgcn-blocks": case("rgcn", relations=True, kwargs={"num_blocks": 3, "channels": 6, "out": 9}),
    "rgcn-blocks-sum": case("rgcn", relations=True, kwargs={"num_blocks": 1, "aggr": "sum"}),
    # featureless: x None stands for every node's index, so the nodes are the input channels
    "rgcn-featureless": case("rgcn", relations=True, x_kind="none", kwargs={"channels": 13}),
    "rgcn-featureless-index-sum": case("rgcn", relations=True, x_kind="index",
                                       kwargs={"channels": 13, "aggr": "sum", "num_bases": 2}),
    "rgcn-bipartite": case("rgcn", relations=True, bipartite=True, kwargs={"channels": (6, 3)}),
    "rgcn-featureless-bipartite": case("rgcn", relations=True, bipartite=True, x_kind="index",
                                       kwargs={"channels": (15, 9)}),
    "rgcn-flow-no-root": case("rgcn", relations=True, flow="target_to_source", kwargs={"root_weight": False}),
}

CLASSES = {"gcn": (gnn.GCNConv, pyg_nn.GCNConv), "sage": (gnn.SAGEConv, pyg_nn.SAGEConv),
           "gin": (gnn.GINConv, pyg_nn.GINConv), "gat": (gnn.GATConv, pyg_nn.GATConv),
           "rgcn": (gnn.RGCNConv, pyg_nn.RGCNConv)}


def build_pair(spec: Case, dtype, device):
    geot_class, pyg_class = CLASSES[spec.layer]
    torch.manual_seed(0)
    pyg_layer = spec.make(pyg_class, flow=spec.flow, **dict(spec.kwargs)).to(device, dtype)
    geot_layer = spec.make(geot_class, flow=spec.flow, **dict(spec.kwargs)).to(device, dtype)
    with torch.no_grad():  # random bias / eps too, so they are compared
        for p in pyg_layer.parameters():
            p.normal_()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    return geot_layer, pyg_layer


def make_call(spec: Case, graph: str, dtype, device):
    """(x, graph input, kwargs): one call's inputs."""
    num_src, num_dst = 13, (9 if spec.bipartite or spec.dst_none else 13)
    edge_index = GRAPHS[graph](num_src, num_dst, device)
    stored = edge_index.flip(0) if spec.flow == "target_to_source" else edge_index
    num_edges = edge_index.size(1)
    features = spec.kwargs.get("channels", spec.in_channels)
    src_width, dst_width = features if isinstance(features, tuple) else (features, features)
    batch = (4,) if spec.static else ()
    x_src = torch.randn(*batch, num_src, src_width, dtype=dtype, device=device)
    if spec.x_kind == "none":
        x_src = None
    elif spec.x_kind == "index":
        x_src = torch.randperm(src_width, device=device)[:num_src]
    kwargs = {}
    if spec.bipartite:
        x_dst = (torch.randn(num_dst, dst_width, dtype=dtype, device=device) if spec.x_kind == "features"
                 else torch.randperm(dst_width, device=device)[:num_dst])
        x = (x_src, x_dst)
    elif spec.dst_none:
        x, kwargs["size"] = (x_src, None), (num_src, num_dst)
    else:
        x = x_src
    weight = None
    if spec.weighted:  # a self loop's copies share a weight: which copy PyG keeps is not defined on CUDA
        weight = torch.rand(num_src, dtype=dtype, device=device).index_select(0, edge_index[0]) + 0.5
        weight = torch.where(edge_index[0] == edge_index[1], weight, torch.rand_like(weight) + 0.5)
    graph_input = stored
    if spec.layout != "edge_index":
        values = weight if weight is not None else torch.ones(num_edges, dtype=dtype, device=device)
        graph_input = adjacency(edge_index, num_src, num_dst, spec.layout, values)
        kwargs.pop("size", None)
    elif weight is not None:
        kwargs["edge_weight"] = weight
    if spec.edge_attr:
        shape = (num_edges,) if spec.edge_attr == 1 else (num_edges, spec.edge_attr)
        kwargs["edge_attr"] = torch.randn(*shape, dtype=dtype, device=device)
    if spec.attention:
        kwargs["return_attention_weights"] = True
    if spec.relations:
        kwargs["edge_type"] = torch.randint(0, NUM_RELATIONS, (num_edges,), device=device)
    return x, graph_input, kwargs


def run(layer, x, graph_input, kwargs):
    """(output, gradients of the float inputs and parameters) of one call."""
    x = tuple(t if t is None or not t.is_floating_point() else t.detach().clone().requires_grad_() for t in x) \
        if isinstance(x, tuple) else (x.detach().clone().requires_grad_() if x is not None and x.is_floating_point()
                                      else x)
    result = layer(x, graph_input, **kwargs)
    out, attention = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)).sum()
    if attention is not None:
        loss = loss + attention[1].sum()
    inputs = [t for t in (x if isinstance(x, tuple) else (x,)) if t is not None and t.requires_grad]
    params = [p for _, p in layer.named_parameters()]
    grads = torch.autograd.grad(loss, inputs + params, allow_unused=True)
    return out, attention, grads


def assert_matches(spec, graph, dtype, device, tol):
    if device == "cuda" and spec.layout != "edge_index" and spec.kwargs.get("aggr") in ("max", "min"):
        pytest.skip("PyG has no max or min over a torch.sparse adjacency on CUDA (its CPU result is checked)")
    geot_layer, pyg_layer = build_pair(spec, dtype, device)
    x, graph_input, kwargs = make_call(spec, graph, dtype, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)  # native: PyG's forward must not run
        for _ in range(2):  # the second call reads what the first kept
            got = run(geot_layer, x, graph_input, kwargs)
    if spec.layer == "gcn" and spec.layout == "csc":  # PyG's gcn_norm takes no CSC: the same matrix as CSR
        graph_input = graph_input.to_sparse_csr()
    want = run(pyg_layer, x, graph_input, kwargs)
    assert_close(got[0], want[0], tol, "output")
    # Users reshape outputs with view (PyG's own static-graph test does): a contiguous output stays so.
    assert got[0].is_contiguous() or not want[0].is_contiguous(), "output layout: PyG's is contiguous"
    if want[1] is not None:
        assert torch.equal(got[1][0], want[1][0]), "attention edges (PyG's order)"
        assert_close(got[1][1], want[1][1], tol, "attention weights")
    for index, (g, w) in enumerate(zip(got[2], want[2])):
        if w is None or g is None:
            assert g is None or not g.any(), f"gradient {index}"
            continue
        assert_close(g, w, tol, f"gradient {index}", tol.get("grad_atol", tol["atol"]))


def assert_close(got, want, tol, what, atol=None):
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    atol = (tol["atol"] if atol is None else atol) * scale
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", list(NATIVE))
def test_native_matches_pyg_float64(name, graph, device):
    assert_matches(NATIVE[name], graph, torch.float64, device, F64)


@pytest.mark.parametrize("name", list(NATIVE))
def test_native_matches_pyg_float32(name, device):
    assert_matches(NATIVE[name], "duplicates", torch.float32, device, F32)


# Fallbacks: PyG's forward, one warning per layer and reason --------------------------------------

FALLBACK = {
    "gcn-mean": (case("gcn", kwargs={"aggr": "mean"}), "aggr='mean'"),
    "sage-lstm": (case("sage", kwargs={"aggr": "lstm"}), "aggr='lstm'"),
    "sage-multi": (case("sage", kwargs={"aggr": ["mean", "max", "std"]}), "aggr=\\['mean', 'max', 'std'\\]"),
    "gat-mean-aggr": (case("gat", kwargs={"aggr": "mean"}), "aggr='mean'"),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_fallback_runs_pyg_with_one_warning(name, device):
    spec, reason = FALLBACK[name]
    if spec.kwargs.get("aggr") == "lstm":
        pytest.skip("LSTM aggregation needs a sorted index: checked in test_lstm_fallback")
    geot_layer, pyg_layer = build_pair(spec, torch.float64, device)
    x, graph_input, kwargs = make_call(spec, "duplicates", torch.float64, device)
    with pytest.warns(gnn.GeotFallbackWarning, match=reason):
        got = run(geot_layer, x, graph_input, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)  # once per layer and reason
        run(geot_layer, x, graph_input, kwargs)
    want = run(pyg_layer, x, graph_input, kwargs)
    torch.testing.assert_close(got[0], want[0], **F64)


@pytest.mark.parametrize("layer", ["sage", "gin", "gat", "rgcn"])
@pytest.mark.parametrize("rows", [(9, 9), (9, 6), (6, 9), (9, None)], ids=["same", "fewer", "more", "dst-none"])
def test_flow_target_to_source_with_a_pair(layer, rows, device):
    """Under flow="target_to_source" PyG's generated collect gathers a pair's x[0] by edge_index[1] into
    edge_index[0] and counts the output rows from x[0]: geot runs a pair of equal sizes natively (PyG's
    result) and the others on PyG's forward, with a warning (PyG's result, or PyG's exception)."""
    spec = case(layer, flow="target_to_source", relations=layer == "rgcn",
                kwargs={"heads": 2} if layer == "gat" else {})
    geot_layer, pyg_layer = build_pair(spec, torch.float64, device)
    generator = torch.Generator(device=device).manual_seed(0)
    x = tuple(None if n is None else torch.randn(n, 6, dtype=torch.float64, device=device, generator=generator)
              for n in rows)
    targets = min(n for n in rows if n is not None)
    edge_index = torch.stack([torch.randint(0, targets, (30,), device=device, generator=generator),
                              torch.randint(0, rows[0], (30,), device=device, generator=generator)])
    kwargs = {"edge_type": torch.randint(0, NUM_RELATIONS, (30,), device=device, generator=generator)} \
        if layer == "rgcn" else {}
    try:
        want = run(pyg_layer, x, edge_index, kwargs)
    except Exception as error:  # PyG raises for most pairs of different sizes: so does PyG's forward in geot's
        with pytest.warns(gnn.GeotFallbackWarning), pytest.raises(type(error)):
            run(geot_layer, x, edge_index, kwargs)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gnn.GeotFallbackWarning)
        got = run(geot_layer, x, edge_index, kwargs)
    fell_back = any(issubclass(w.category, gnn.GeotFallbackWarning) for w in caught)
    assert fell_back == (rows[0] != rows[1]), "native exactly where both sides have one size"
    assert_close(got[0].detach(), want[0].detach(), F64, "output")
    for g, w in zip(got[2], want[2]):
        if w is not None and g is not None:
            assert_close(g, w, F64, "gradient")


@pytest.mark.parametrize("layer", [gnn.GATConv, gnn.GATv2Conv])
def test_mean_filled_loop_features_have_exact_gradients_with_int32_ids(layer, device):
    """The added loops' "mean" edge features (PyG's add_self_loops) are computed over int64 ids: torch's
    scatter mean gets its gradient wrong for int32 ids (PyG's layer with them too)."""
    torch.manual_seed(0)
    conv = layer(4, 3, heads=2, edge_dim=2).to(device).double()
    edge_index = torch.randint(0, 7, (2, 13), device=device, dtype=torch.int32)
    x = torch.randn(7, 4, dtype=torch.float64, device=device)
    attr = torch.randn(13, 2, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: conv(x, edge_index, a), (attr,))


def test_lstm_fallback():
    conv, ref = gnn.SAGEConv(6, 5, aggr="lstm"), None
    pyg = pyg_nn.SAGEConv(6, 5, aggr="lstm")
    pyg.load_state_dict(conv.state_dict())
    x, edge_index = torch.randn(4, 6), torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])
    with pytest.warns(gnn.GeotFallbackWarning, match="aggr='lstm'"):
        out = conv(x, edge_index)
    ref = pyg(x, edge_index)
    torch.testing.assert_close(out, ref)


def test_hooks_and_explain_run_pyg():
    """Message-passing hooks and explain mode need PyG's propagate: it runs, and calls them."""
    conv = gnn.GCNConv(6, 5)
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    seen = []
    handle = conv.register_message_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    with pytest.warns(gnn.GeotFallbackWarning, match="hooks"):
        conv(x, edge_index)
    assert seen, "the hook ran"
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        conv(x, edge_index)


@pytest.mark.parametrize("layer", [lambda: gnn.GCNConv(6, 5), lambda: gnn.SAGEConv(6, 5),
                                   lambda: gnn.geot_class(pyg_nn.GraphConv)(6, 5)], ids=["gcn", "sage", "generic"])
def test_hooks_on_aggr_module_run_pyg(layer):
    """A forward hook on aggr_module (a model summary's) sees PyG's aggregation: geot's kernels do not
    call the module, so the layer runs PyG's forward while it has one."""
    conv = layer()
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    before = conv(x, edge_index)
    seen = []
    handle = conv.aggr_module.register_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    with pytest.warns(gnn.GeotFallbackWarning, match="aggr_module"):
        out = conv(x, edge_index)
    assert len(seen) == 1, "the hook ran once"
    torch.testing.assert_close(out, before)
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        conv(x, edge_index)


def test_onnx_export_runs_pyg(monkeypatch):
    """geot's ops have no ONNX form: inside an ONNX export the layers run PyG's forward."""
    conv = gnn.SAGEConv(6, 5)
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    with pytest.warns(gnn.GeotFallbackWarning, match="ONNX"):
        conv(x, edge_index)


def test_onnx_export_of_a_patched_model(tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model = gnn.patch(pyg_nn.GraphSAGE(6, 8, 2, 5))
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    path = str(tmp_path / "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x, edge_index), path, input_names=("x", "edge_index"), dynamo=True)
    out = ort.InferenceSession(path).run(None, {"x": x.numpy(), "edge_index": edge_index.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(out), model(x, edge_index), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layer", [lambda: gnn.GCNConv(6, 5), lambda: gnn.GATConv(6, 5, heads=2),
                                   lambda: gnn.geot_class(pyg_nn.GraphConv)(6, 5)], ids=["gcn", "gat", "generic"])
def test_torch_func_transforms_run_pyg(layer):
    """geot's ops have no functorch rules: under torch.func.grad and vmap the layers run PyG's forward,
    and give its gradients."""
    conv = layer()
    pyg = pyg_base(type(conv))(6, 5, **({"heads": 2} if isinstance(conv, gnn.GATConv) else {}))
    pyg.load_state_dict(conv.state_dict())
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    params = {name: p.detach() for name, p in conv.named_parameters()}
    grads = [torch.func.grad(lambda p: torch.func.functional_call(m, p, (x, edge_index)).square().sum())(params)
             for m in (conv, pyg)]
    torch.testing.assert_close(grads[0], grads[1])
    batch = torch.randn(3, 7, 6)
    torch.testing.assert_close(torch.func.vmap(lambda rows: conv(rows, edge_index))(batch),
                               torch.stack([pyg(rows, edge_index) for rows in batch]))


def test_duplicated_self_loops_match_pyg():
    """PyG drops every input self loop and adds one per node; a node with its
    loop twice gets one loop (the last one's weight, where weights are given)."""
    edge_index = torch.tensor([[0, 0, 1, 2, 2, 2, 3], [0, 0, 2, 1, 2, 2, 1]])
    weight = torch.tensor([0.5, 2.0, 1.0, 1.0, 3.0, 0.25, 1.0], dtype=torch.float64)
    x = torch.randn(5, 6, dtype=torch.float64)
    for kwargs in ({}, {"improved": True}):
        pyg = pyg_nn.GCNConv(6, 5, **kwargs).double()
        conv = gnn.GCNConv(6, 5, **kwargs).double()
        conv.load_state_dict(pyg.state_dict())
        torch.testing.assert_close(conv(x, edge_index), pyg(x, edge_index), **F64)
        torch.testing.assert_close(conv(x, edge_index, weight), pyg(x, edge_index, weight), **F64)


@pytest.mark.parametrize("improved", [False, True])
def test_duplicated_self_loops_weight_gradients_match_pyg(improved, device):
    """The gradient of a node's loop weight reaches each copy of its input self loop, the dropped ones
    too (the gradient of PyG's indexed assignment), and the edge weights' gradients equal PyG's. A
    loop's copies share a weight here: which copy PyG keeps on CUDA is not defined."""
    # (every looped node has another in-edge: a node with only its loop has a normalized weight of 1)
    edge_index = torch.tensor([[0, 0, 1, 2, 2, 2, 3, 3, 4], [0, 0, 2, 1, 2, 2, 1, 3, 0]], device=device)
    weight = torch.tensor([0.5, 0.5, 1.0, 1.5, 3.0, 3.0, 1.0, 0.7, 2.0], dtype=torch.float64, device=device)
    x = torch.randn(5, 6, dtype=torch.float64, device=device)
    pyg = pyg_nn.GCNConv(6, 5, improved=improved).to(device).double()
    conv = gnn.GCNConv(6, 5, improved=improved).to(device).double()
    conv.load_state_dict(pyg.state_dict())
    grads = []
    for layer in (conv, pyg):
        w = weight.clone().requires_grad_()
        out = layer(x, edge_index, w)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype,
                                                                device=device).view_as(out)).sum(), w)[0])
    torch.testing.assert_close(grads[0], grads[1], **F64)
    assert grads[0][0] == grads[0][1] and grads[0][4] == grads[0][5]
    assert grads[0][[0, 4]].abs().min() > 1e-3


def test_gcn_cached_reads_as_pyg_cache():
    """cached=True: PyG's _cached_edge_index holds the normalized graph (its
    forward, when it runs, uses it), and reset_parameters clears it."""
    conv = gnn.GCNConv(6, 5, cached=True).double()
    pyg = pyg_nn.GCNConv(6, 5, cached=True).double()
    pyg.load_state_dict(conv.state_dict())
    x, edge_index = torch.randn(7, 6, dtype=torch.float64), graph_with_duplicates(7, 7, 20, "cpu")
    out = conv(x, edge_index)
    assert conv._cached_edge_index is not None
    other = graph_with_duplicates(7, 7, 10, "cpu")
    torch.testing.assert_close(conv(x, other), out, **F64)  # later graphs ignored, as in PyG
    pyg(x, edge_index)
    torch.testing.assert_close(pyg_nn.GCNConv.forward(conv, x, other), pyg(x, other), **F64)
    conv.reset_parameters()
    assert conv._cached_edge_index is None


def test_torchscript_scripts_pyg_layer():
    conv = gnn.SAGEConv(6, 5)
    x, edge_index = torch.randn(7, 6), graph_with_duplicates(7, 7, 20, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated
        scripted = torch.jit.script(conv)
    torch.testing.assert_close(scripted(x, edge_index), conv(x, edge_index), rtol=1e-6, atol=1e-6)
    assert isinstance(conv, gnn.SAGEConv), "the layer itself stays geot's"


# Heterogeneous models ------------------------------------------------------------------------------

def hetero_data(device):
    from torch_geometric.data import HeteroData
    data = HeteroData()
    data["paper"].x = torch.randn(14, 6, device=device)
    data["author"].x = torch.randn(9, 6, device=device)
    data["paper", "cites", "paper"].edge_index = graph_with_duplicates(14, 14, 40, device)
    data["author", "writes", "paper"].edge_index = graph_with_duplicates(9, 14, 30, device)
    data["paper", "rev_writes", "author"].edge_index = graph_with_duplicates(14, 9, 30, device)
    return data


class HomogeneousNet(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv1, self.conv2 = conv(), conv()

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


CONVS = {
    "sage": lambda: pyg_nn.SAGEConv((-1, -1), 6),
    "gin": lambda: pyg_nn.GINConv(torch.nn.Linear(6, 6), train_eps=True),
    "gat": lambda: pyg_nn.GATConv((-1, -1), 6, add_self_loops=False, heads=1),
}


def assert_hetero_matches(model, data, device):
    """The patched model against itself unpatched: outputs and gradients."""
    import copy
    inputs = (data.x_dict, data.edge_index_dict)
    model(*inputs)  # initializes lazy modules
    patched = gnn.patch(copy.deepcopy(model))
    assert any(isinstance(m, gnn.layer.GeotLayer) for m in patched.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got = patched(*inputs)
    want = model(*inputs)
    for key in want:
        assert_close(got[key], want[key], F32, key)
    loss, ref_loss = sum(v.sum() for v in got.values()), sum(v.sum() for v in want.values())
    for (name, g), (_, w) in zip(_grads(patched, loss), _grads(model, ref_loss)):
        assert_close(g, w, F32, name, F32["grad_atol"])


def _grads(model, loss):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return [(n, g) for (n, _), g in zip(named, grads) if g is not None]


@pytest.mark.parametrize("conv", list(CONVS))
def test_to_hetero_patched_matches(conv, device):
    from torch_geometric.nn import to_hetero
    data = hetero_data(device)
    model = to_hetero(HomogeneousNet(CONVS[conv]), data.metadata(), aggr="sum").to(device)
    assert_hetero_matches(model, data, device)


def test_hetero_conv_patched_matches(device):
    data = hetero_data(device)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = pyg_nn.HeteroConv({
                ("paper", "cites", "paper"): pyg_nn.GCNConv(-1, 6),
                ("author", "writes", "paper"): pyg_nn.SAGEConv((-1, -1), 6),
                ("paper", "rev_writes", "author"): pyg_nn.GATConv((-1, -1), 6, add_self_loops=False),
            }, aggr="sum")

        def forward(self, x_dict, edge_index_dict):
            return self.conv(x_dict, edge_index_dict)

    assert_hetero_matches(Net().to(device), data, device)



# A new graph every step, on CUDA: no device->host sync ---------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


@requires_cuda
@pytest.mark.parametrize("layer", ["gcn", "sage", "gin"])
def test_new_graph_every_step_makes_no_sync(layer):
    """Once a layer's graph has changed, each new graph (a sampled block, a
    new edge_index each step) is sorted and its ids checked on the device:
    forward and backward make no device->host sync."""
    conv = _layer(layer)(CLASSES[layer][0]).cuda()
    x = torch.randn(13, 6, device="cuda", requires_grad=True)
    conv(x, graph_with_duplicates(13, 13, 40, "cuda")).sum().backward()  # the first graph: its static layout
    for _ in range(3):
        edge_index = graph_with_duplicates(13, 13, 40, "cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            conv(x, edge_index).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.parametrize("layer,kwargs,pair", [
    ("sage", {}, False), ("sage", {}, True), ("sage", {"aggr": "sum", "channels": 8}, False),
    ("sage", {"aggr": "max"}, False), ("gin", {}, False), ("gin", {}, True), ("gcn", {}, False)],
    ids=["sage-mean", "sage-mean-pair", "sage-sum-projected-first", "sage-max", "gin", "gin-pair", "gcn"])
def test_new_graphs_every_step_match_pyg(layer, kwargs, pair):
    """After a layer's first graph, each new one (sums and means left in
    input order, with atomics both ways; the rest sorted without a sync)
    gives PyG's outputs and gradients (float64), in training and inference."""
    geot_layer, pyg_layer = build_pair(case(layer, kwargs=kwargs), torch.float64, "cuda")
    num_dst = 9 if pair else 13
    call = {"size": (13, num_dst)} if pair else {}

    def inputs():
        x = torch.randn(13, kwargs.get("channels", 6), dtype=torch.float64, device="cuda")
        return ((x, x[:num_dst]) if pair else x), graph_with_duplicates(13, num_dst, 40, "cuda")

    for step in range(4):
        x, edge_index = inputs()
        got, want = run(geot_layer, x, edge_index, call), run(pyg_layer, x, edge_index, call)
        assert_close(got[0], want[0], F64, f"output of step {step}")
        for g, w in zip(got[2], want[2]):
            assert_close(g, w, F64, f"gradient of step {step}")
        x, edge_index = inputs()
        with torch.no_grad():
            assert_close(geot_layer(x, edge_index, **call), pyg_layer(x, edge_index, **call), F64,
                         f"inference output of step {step}")


@requires_cuda
@pytest.mark.parametrize("bad_edges", [[[0, 7], [1, 2]], [[0, 1], [1, 5]], [[-1, 1], [1, 2]]],
                         ids=["source", "destination", "negative"])
def test_ids_out_of_range_are_reported_by_a_later_call(bad_edges):
    conv = gnn.SAGEConv(6, 5).cuda()
    x = torch.randn(5, 6, device="cuda")
    conv(x, torch.tensor([[0, 1], [1, 2]], device="cuda"))
    conv(x, torch.tensor(bad_edges, device="cuda"))  # a new graph: checked on the device
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="out of range"):
        conv(x, torch.tensor([[0, 1], [1, 2]], device="cuda"))
    conv(x, torch.tensor([[0, 1], [1, 2]], device="cuda"))  # reported once


@pytest.mark.parametrize("float64", [False, True])
def test_any_order_counts_are_each_rows_edges_at_least_one(device, float64):
    """The divisor of a mean over a graph in input order: ids out of range are not counted."""
    index = torch.tensor([3, 1, 1, 7, -1, 3, 3, 0], device=device)
    got = geot._C.any_order_counts(index, 5, float64)
    want = torch.tensor([1, 2, 1, 3, 1], dtype=torch.float64 if float64 else torch.float32, device=device)
    assert torch.equal(got, want)
    assert torch.equal(geot._C.any_order_counts(index[:0], 3, float64), torch.ones_like(want[:3]))


# torch_sparse.SparseTensor adj_t (torch_sparse is not installed here: a stand-in with its interface) ----------

from torch_geometric.typing import SparseTensor  # noqa: E402


class StandInSparseTensor(SparseTensor):
    """adj_t with torch_sparse's coo() and sparse_sizes(), rows (destinations) sorted."""

    def __init__(self, edge_index, value, num_src, num_dst):  # noqa: super().__init__ raises without torch_sparse
        order = torch.argsort(edge_index[1], stable=True)
        self._coo = (edge_index[1, order], edge_index[0, order], None if value is None else value[order])
        self._sizes = (num_dst, num_src)

    def coo(self):
        return self._coo

    def sparse_sizes(self):
        return self._sizes


@pytest.mark.parametrize("layer", ["gcn", "sage", "gin", "rgcn"])
def test_sparse_tensor_adjacency_matches_edge_index(layer, device):
    """A SparseTensor adj_t as PyG reads it: GCN weights by its values and
    sets its diagonal; SAGE and GIN drop its values; RGCN reads them as the
    relations. Compared with PyG's layer on the same edges as an edge_index."""
    spec = case(layer, relations=layer == "rgcn")
    geot_layer, pyg_layer = build_pair(spec, torch.float64, device)
    x, edge_index, kwargs = make_call(spec, "duplicates", torch.float64, device)
    relations = kwargs.pop("edge_type", None)
    adj_t = StandInSparseTensor(edge_index, relations, 13, 13)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        got = run(geot_layer, x, adj_t, {})
    want = run(pyg_layer, x, edge_index, {} if relations is None else {"edge_type": relations})
    assert_close(got[0], want[0], F64, "output")
    for g, w in zip(got[2], want[2]):
        assert_close(g, w, F64, "gradient")
