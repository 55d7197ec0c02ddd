"""geot.nn.generic: PyG MessagePassing layers whose message is x_j or a
weighted x_j propagate on geot after patch; their outputs and gradients are
PyG's (float64, 1e-10), the rest stays on PyG's propagate."""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot.nn as gnn  # noqa: E402
import geot.nn.generic as generic  # noqa: E402
import geot.nn.propagations as propagations  # noqa: E402
from torch_geometric import EdgeIndex  # noqa: E402

F64 = {"rtol": 1e-10, "atol": 1e-10}


class OwnGATv2(pyg_nn.GATv2Conv):
    """A subclass of a layer geot has its own version of: patch gives it geot's propagate only."""


class OwnAPPNP(pyg_nn.APPNP):
    """The same for APPNP: PyG's forward (gcn_norm on every call), geot's propagate."""


# name -> (make the PyG layer, takes edge weights)
LAYERS = {
    "appnp": (lambda: pyg_nn.APPNP(K=3, alpha=0.1), True),
    "appnp-cached": (lambda: pyg_nn.APPNP(K=2, alpha=0.2, cached=True), True),
    "appnp-subclass": (lambda: OwnAPPNP(K=3, alpha=0.1), True),
    "sg": (lambda: pyg_nn.SGConv(6, 4, K=2), True),
    "tag": (lambda: pyg_nn.TAGConv(6, 4, K=2), True),
    "graph": (lambda: pyg_nn.GraphConv(6, 4), True),
    "graph-mean": (lambda: pyg_nn.GraphConv(6, 4, aggr="mean"), True),
    "graph-max": (lambda: pyg_nn.GraphConv(6, 4, aggr="max"), True),
    "cheb": (lambda: pyg_nn.ChebConv(6, 4, K=3), True),
    "lg": (lambda: pyg_nn.LGConv(), True),
    "simple-sum": (lambda: pyg_nn.SimpleConv(), True),
    "simple-min": (lambda: pyg_nn.SimpleConv(aggr="min"), True),
    "cluster-gcn": (lambda: pyg_nn.ClusterGCNConv(6, 4), False),
    "gatv2-subclass": (lambda: OwnGATv2(6, 3, heads=2), False),  # x_j * alpha with [N, H, C] rows
}


def graph(num_nodes, num_edges, device, generator):
    """Unsorted, with duplicated edges and self loops; isolated nodes where there are few edges."""
    edge_index = torch.randint(0, num_nodes, (2, num_edges), device=device, generator=generator)
    loops = torch.arange(0, num_nodes, 4, device=device).repeat(2, 1)
    return torch.cat([edge_index, edge_index[:, :3], loops, loops[:, :2]], dim=1)


def pair(name, device):
    torch.manual_seed(0)
    reference = LAYERS[name][0]().to(device).double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_()
    return gnn.patch(copy.deepcopy(reference)), reference


def outputs_and_grads(layer, x, *args, **kwargs):
    x = x.detach().clone().requires_grad_()
    out = layer(x, *args, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    return out, x.grad, {n: p.grad for n, p in layer.named_parameters()}


def assert_same(mine, reference, x, *args, **kwargs):
    out, grad_x, grads = outputs_and_grads(mine, x, *args, **kwargs)
    want, want_x, want_grads = outputs_and_grads(reference, x, *args, **kwargs)
    torch.testing.assert_close(out, want, **F64)
    assert out.is_contiguous() or not want.is_contiguous(), "output layout: PyG's is contiguous"  # users view it
    torch.testing.assert_close(grad_x, want_x, **F64)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], **F64, msg=f"gradient of {name}")


def assert_same_call(mine, reference, x, edge_index, grad: bool):
    """One call of each on the same inputs: equal outputs and, with grad, equal gradients of x."""
    out, expect = mine(x, edge_index), reference(x, edge_index)
    torch.testing.assert_close(out, expect, **F64)
    if grad:
        torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(expect.sum(), x)[0], **F64)


def sort_counting_backend(backward: bool):
    """A torch.compile backend (AOT autograd, graphs run as traced) that records the sorts of each compiled
    graph (forward; with backward, backward graphs too) and each compilation: (backend, sorts,
    compilations)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    sorts, compilations = [], []

    def count(graph_module, _):
        sorts.append(sum(node.target == torch.ops.aten.sort.stable for node in graph_module.graph.nodes))
        return make_boxed_func(graph_module)

    def backend(module, inputs):
        compilations.append(1)
        compilers = {"fw_compiler": count, **({"bw_compiler": count} if backward else {})}
        return aot_module_simplified(module, inputs, **compilers)
    return backend, sorts, compilations


@pytest.fixture
def geot_calls(monkeypatch):
    """How many propagations ran on geot's fused gather-reduce."""
    calls = []
    for name in ("gather_reduce", "gather_reduce_nodes"):  # (the second: static graphs' [B, N, F] rows)
        run = getattr(generic, name)
        monkeypatch.setattr(generic, name, lambda *a, run=run, **k: calls.append(1) or run(*a, **k))
    return calls


@pytest.mark.parametrize("static", [False, True], ids=["nodes", "static"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("edges", [40, 0], ids=["edges", "no-edges"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_patched_layer_matches_pyg(name, edges, weighted, static, device, geot_calls):
    """static: x [B, N, F], one graph for every batch entry (PyG's static graphs)."""
    if weighted and not LAYERS[name][1]:
        pytest.skip("the layer takes no edge weights")
    if static and name.startswith("gatv2"):
        pytest.skip("PyG's GATv2Conv takes no static graphs")
    mine, reference = pair(name, device)
    assert isinstance(mine, generic.GeotPropagate)
    generator = torch.Generator(device=device).manual_seed(1)
    edge_index = graph(13, edges, device, generator)
    x = torch.randn(*((3,) if static else ()), 13, 6, dtype=torch.float64, device=device, generator=generator)
    weight = () if not weighted else (torch.rand(edge_index.size(1), dtype=torch.float64, device=device,
                                                 generator=generator),)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        assert_same(mine, reference, x, edge_index, *weight)
    assert geot_calls, "no propagation ran on geot"


# name -> (the PyG layer, the width its propagations gather: narrowed to out_channels or not, takes edge weights)
NARROWING = {
    "sg": (lambda: pyg_nn.SGConv(6, 4, K=3), 4, True),
    "sg-cached": (lambda: pyg_nn.SGConv(6, 4, K=3, cached=True), 6, True),  # PyG's order: Â^K x is what it keeps
    "sg-widening": (lambda: pyg_nn.SGConv(6, 9, K=2), 6, True),
    "tag": (lambda: pyg_nn.TAGConv(6, 4, K=3), 4, True),
    "tag-unnormalized": (lambda: pyg_nn.TAGConv(6, 4, K=2, normalize=False, bias=False), 4, True),
    "tag-widening": (lambda: pyg_nn.TAGConv(6, 9, K=2), 6, True),
    "appnp": (lambda: pyg_nn.APPNP(K=3, alpha=0.1), 6, True),  # no Linear: a graph normalized once, x's width
    "cheb": (lambda: pyg_nn.ChebConv(6, 4, K=3), 6, True),
    "cheb-unnormalized": (lambda: pyg_nn.ChebConv(6, 4, K=2, normalization=None, bias=False), 6, True),
    "cluster-gcn": (lambda: pyg_nn.ClusterGCNConv(6, 4, diag_lambda=0.3), 4, False),
    "cluster-gcn-widening": (lambda: pyg_nn.ClusterGCNConv(6, 9), 6, False),
    "graph": (lambda: pyg_nn.GraphConv(6, 4), 4, True),
    "graph-mean": (lambda: pyg_nn.GraphConv(6, 4, aggr="mean", bias=False), 4, True),
    "graph-max": (lambda: pyg_nn.GraphConv(6, 4, aggr="max"), 6, True),  # max does not commute with lin_rel
    "graph-widening": (lambda: pyg_nn.GraphConv(6, 9), 6, True),
    "lg": (lambda: pyg_nn.LGConv(), 6, True),  # no Linear: a graph normalized once
}


@pytest.mark.parametrize("name", list(NARROWING))
def test_projections_first_where_they_narrow(name, device, monkeypatch):
    """SGConv, TAGConv, ClusterGCNConv and GraphConv (sum, mean) whose Linears narrow the rows propagate the
    projected rows (the K propagations gather out_channels features); elsewhere (and APPNP, ChebConv) x.
    PyG's outputs and gradients either way, over the graph normalized once."""
    make, width, weighted = NARROWING[name]
    widths = []
    run = generic.gather_reduce
    monkeypatch.setattr(generic, "gather_reduce", lambda graph, x, *a, **k: widths.append(x.size(-1)) or
                        run(graph, x, *a, **k))
    torch.manual_seed(0)
    reference = make().to(device).double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_()
    mine = gnn.patch(copy.deepcopy(reference))
    assert isinstance(mine, (gnn.SGConv, gnn.TAGConv, gnn.APPNP, gnn.ChebConv, gnn.ClusterGCNConv, gnn.GraphConv,
                             gnn.LGConv))
    generator = torch.Generator(device=device).manual_seed(3)
    edge_index = graph(13, 40, device, generator)
    x = torch.randn(13, 6, dtype=torch.float64, device=device, generator=generator)
    weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device, generator=generator)
    assert_same(mine, reference, x, edge_index, *((weight,) if weighted else ()))
    assert widths and set(widths) == {width}


def test_graph_conv_keeps_pyg_order_where_lin_rel_is_hooked(device, monkeypatch):
    """A hook on lin_rel sees its input, the aggregate: no projection first there."""
    widths, seen = [], []
    run = generic.gather_reduce
    monkeypatch.setattr(generic, "gather_reduce", lambda graph, x, *a, **k: widths.append(x.size(-1)) or
                        run(graph, x, *a, **k))
    mine, reference = pair("graph", device)
    mine.lin_rel.register_forward_hook(lambda module, args, out: seen.append(args[0].size(-1)))
    generator = torch.Generator(device=device).manual_seed(6)
    edge_index = graph(10, 30, device, generator)
    x = torch.randn(10, 6, dtype=torch.float64, device=device, generator=generator)
    assert_same(mine, reference, x, edge_index)
    assert widths == [6] and seen == [6]


@pytest.mark.parametrize("dst_none", [False, True], ids=["x_dst", "x_dst-None"])
def test_bipartite_pairs_and_edge_index_sizes(dst_none, device, geot_calls):
    """GraphConv on (x_src, x_dst) pairs with size, and on an EdgeIndex whose sparse size gives the rows."""
    mine, reference = pair("graph", device)
    generator = torch.Generator(device=device).manual_seed(2)
    x_src = torch.randn(9, 6, dtype=torch.float64, device=device, generator=generator)
    x_dst = None if dst_none else torch.randn(5, 6, dtype=torch.float64, device=device, generator=generator)
    edge_index = torch.stack([torch.randint(0, 9, (30,), device=device, generator=generator),
                              torch.randint(0, 5, (30,), device=device, generator=generator)])
    for call in ({"size": (9, 5)}, {}):
        if dst_none and not call:
            continue
        out = mine((x_src, x_dst), edge_index, **call)
        torch.testing.assert_close(out, reference((x_src, x_dst), edge_index, **call), **F64)
    indexed = EdgeIndex(edge_index, sparse_size=(9, 5))
    torch.testing.assert_close(mine((x_src, x_dst), indexed), reference((x_src, x_dst), indexed), **F64)
    assert len(geot_calls) >= 2


def test_flow_target_to_source(device, geot_calls):
    torch.manual_seed(0)
    reference = pyg_nn.SimpleConv(aggr="mean", flow="target_to_source").to(device)
    mine = gnn.patch(copy.deepcopy(reference))
    edge_index = graph(11, 30, device, torch.Generator(device=device).manual_seed(3))
    x = torch.randn(11, 5, dtype=torch.float64, device=device)
    assert_same(mine, reference, x, edge_index)
    assert geot_calls


@pytest.mark.parametrize("make", [lambda: pyg_nn.SimpleConv(aggr="sum", flow="target_to_source"),
                                  lambda: pyg_nn.GraphConv(5, 3, flow="target_to_source")], ids=["simple", "graph"])
def test_flow_target_to_source_with_a_pair_runs_pyg_propagate(make, device, geot_calls):
    """A pair under flow="target_to_source": PyG's generated collect gathers x[0] there (its _collect
    x[1]), so the pair takes PyG's propagate, with a warning; equal sizes too, where a pair read the other
    way round would give another result without an error."""
    torch.manual_seed(0)
    reference = make().to(device).double()
    mine = gnn.patch(copy.deepcopy(reference))
    edge_index = graph(8, 30, device, torch.Generator(device=device).manual_seed(5))
    x = (torch.randn(8, 5, dtype=torch.float64, device=device), torch.randn(8, 5, dtype=torch.float64, device=device))
    with pytest.warns(gnn.GeotFallbackWarning, match="target_to_source"):
        out = mine(x, edge_index)
    torch.testing.assert_close(out, reference(x, edge_index), **F64)
    assert not geot_calls


def test_sparse_adjacency_runs_pyg_propagate(device, geot_calls):
    """A sparse adjacency takes PyG's propagate (its own spmm), with one warning per layer and reason."""
    mine, reference = pair("appnp", device)
    edge_index = graph(10, 30, device, torch.Generator(device=device).manual_seed(4))
    adj_t = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), device=device,
                                                                   dtype=torch.float64), (10, 10)).coalesce()
    x = torch.randn(10, 6, dtype=torch.float64, device=device)
    with pytest.warns(gnn.GeotFallbackWarning, match="runs PyG's propagate for a sparse adjacency"):
        out = mine(x, adj_t)
    torch.testing.assert_close(out, reference(x, adj_t), **F64)
    assert not geot_calls


class WeightedMean(pyg_nn.MessagePassing):
    """A layer as users write them: its message scales x_j by a weight per edge."""

    def __init__(self):
        super().__init__(aggr="mean")

    def forward(self, x, edge_index, w):
        return self.propagate(edge_index, x=x, w=w)

    def message(self, x_j, w):
        return x_j * w[:, None]


class Difference(pyg_nn.MessagePassing):
    """A message of x_i and x_j: not geot's pattern."""

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=x)

    def message(self, x_i, x_j):
        return x_j - x_i


def test_custom_layers(device, geot_calls):
    """A user's layer with a weighted x_j message propagates on geot; one
    with another message is left as it is, and explain says why."""
    model = torch.nn.ModuleList([WeightedMean(), Difference()])
    reference = copy.deepcopy(model)
    gnn.patch(model)
    assert isinstance(model[0], generic.GeotPropagate) and type(model[1]) is Difference
    assert "geot's fused gather-reduce for a message of w * x_j (mean)" in gnn.explain(model[0])
    assert "PyG's propagate, for a message of (x_i, x_j)" in gnn.explain(model[1])
    edge_index = graph(12, 40, device, torch.Generator(device=device).manual_seed(5))
    x = torch.randn(12, 4, dtype=torch.float64, device=device)
    w = torch.rand(edge_index.size(1), dtype=torch.float64, device=device)
    torch.testing.assert_close(model[0](x, edge_index, w), reference[0](x, edge_index, w), **F64)
    assert geot_calls


def test_explain_names_the_path():
    layers = gnn.patch(torch.nn.ModuleList([pyg_nn.APPNP(2, 0.1), pyg_nn.SimpleConv(aggr="mul"),
                                            pyg_nn.EdgeConv(torch.nn.Linear(8, 4)), pyg_nn.GCNConv(4, 4)]))
    explained = [gnn.explain(layer) for layer in layers]
    assert explained[0] == "APPNP: geot's fused gather-reduce for a message of x_j or edge_weight * x_j (add)"
    assert explained[1] == "SimpleConv: PyG's propagate, for aggr='mul'"
    assert explained[2] == "EdgeConv: PyG's propagate, for a message of (x_i, x_j)"
    assert explained[3] == "GCNConv: geot's layer"
    assert gnn.explain(layers) == "\n".join(f"{i}: {line}" for i, line in enumerate(explained))
    assert gnn.explain(torch.nn.Linear(2, 2)) == "Linear holds no MessagePassing layer"


def test_patched_model_saves_and_loads(tmp_path):
    """torch.save of a patched model (a class geot_class made has no module attribute to be found by) loads
    again, also in a process that never made the class, and computes the same."""
    model = gnn.patch(torch.nn.ModuleList([pyg_nn.SimpleConv(aggr="mean"), WeightedMean()]))
    x, edge_index = torch.randn(12, 4), graph(12, 40, "cpu", torch.Generator().manual_seed(2))
    w = torch.rand(edge_index.size(1))
    torch.save(model, tmp_path / "model.pt")
    torch.save((x, edge_index, w, model[0](x, edge_index), model[1](x, edge_index, w)), tmp_path / "io.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert [type(m) for m in loaded] == [type(m) for m in model]
    torch.testing.assert_close(copy.deepcopy(loaded)[1](x, edge_index, w), model[1](x, edge_index, w))
    search_path = [os.path.dirname(os.path.abspath(__file__))] + sys.path  # this test's module and geot, as here
    script = (f"import sys; sys.path[:0] = {search_path!r}; import torch; "
              f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); "
              f"x, e, w, out0, out1 = torch.load({str(tmp_path / 'io.pt')!r}); "
              "assert type(m[0]).__module__ == 'geot.nn.generic', type(m[0]); "
              "torch.testing.assert_close(m[0](x, e), out0); torch.testing.assert_close(m[1](x, e, w), out1)")
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.parametrize("name", ["appnp", "graph-mean"])
def test_compiled_patched_layer_matches(name, device):
    """Compiled whole; APPNP normalizes its graph inside the compiled code, which then sorts it there."""
    torch._dynamo.reset()
    mine, reference = pair(name, device)
    edge_index = graph(13, 40, device, torch.Generator(device=device).manual_seed(6))
    x = torch.randn(13, 6, dtype=torch.float64, device=device)
    compiled = torch.compile(mine, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gnn.UncachedGraphWarning)
        for _ in range(2):
            torch.testing.assert_close(compiled(x, edge_index), reference(x, edge_index), **F64)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_compiled_propagations_of_one_graph_sort_it_once(grad, fullgraph, device):
    """An APPNP subclass's K propagations of the graph its forward makes (gcn_norm) sort it
    once in the compiled code (inference graphs get no common-subexpression
    pass), its edge weights put in order once, also where gcn_norm's boolean
    masks break the graph (fullgraph=False, torch.compile's default); results
    equal PyG's, gradients too, and a second call runs the same compiled code."""
    torch._dynamo.reset()
    mine, reference = pair("appnp-subclass", device)
    backend, sorts, compilations = sort_counting_backend(backward=False)

    edge_index = graph(13, 40, device, torch.Generator(device=device).manual_seed(8))
    x = torch.randn(13, 6, dtype=torch.float64, device=device, requires_grad=grad)
    compiled = torch.compile(mine, fullgraph=fullgraph, backend=backend)
    compiled_after = []  # compilations after each call
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", gnn.UncachedGraphWarning)
        for _ in range(3):
            assert_same_call(compiled, reference, x, edge_index, grad)
            compiled_after.append(len(compilations))
    assert max(sorts) <= 1, sorts
    if fullgraph:
        assert compiled_after == [1, 1, 1]
    else:  # the graph gcn_norm made enters the frame after the break as an input: the first one is kept
        # as a static graph (sorted at trace time), the second recompiles for graphs of one call
        assert len(compiled_after) == 3 and compiled_after[1] == compiled_after[2] and len(compilations) > 1
    assert not hasattr(mine, "_geot_traced")  # the memo lives for one call


def test_torchscript_scripts_pyg_layer():
    mine, reference = pair("sg", "cpu")
    scripted = torch.jit.script(mine)
    edge_index = graph(13, 40, "cpu", torch.Generator().manual_seed(7))
    x = torch.randn(13, 6, dtype=torch.float64)
    torch.testing.assert_close(scripted(x, edge_index), reference(x, edge_index), **F64)


# TransformerConv: a geot layer of its own (its message reads query_i) ------------------------------------

TRANSFORMER = {
    "heads2": {"heads": 2},
    "mean-heads": {"heads": 3, "concat": False},
    "beta": {"heads": 2, "beta": True},
    "no-root": {"heads": 2, "root_weight": False},
    "edge-dim": {"heads": 2, "edge_dim": 3},
    "edge-dim-beta-mean": {"heads": 2, "edge_dim": 3, "beta": True, "concat": False},
    "target-to-source": {"heads": 2, "flow": "target_to_source"},
}


@pytest.mark.parametrize("edges", [40, 0], ids=["edges", "no-edges"])
@pytest.mark.parametrize("name", list(TRANSFORMER))
def test_transformer_matches_pyg(name, edges, device, monkeypatch):
    """Outputs, gradients (x, edge features, parameters) and the attention
    weights (input edge order) are PyG's; the scores are one sddmm dot."""
    torch.manual_seed(0)
    kwargs = TRANSFORMER[name]
    reference = pyg_nn.TransformerConv(6, 4, **kwargs).to(device).double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_()
    mine = gnn.patch(copy.deepcopy(reference))
    assert type(mine) is gnn.TransformerConv
    dots = []
    sddmm = gnn.transformer.sddmm
    monkeypatch.setattr(gnn.transformer, "sddmm", lambda *a, **k: dots.append(1) or sddmm(*a, **k))
    generator = torch.Generator(device=device).manual_seed(1)
    edge_index = graph(13, edges, device, generator)
    x = torch.randn(13, 6, dtype=torch.float64, device=device, generator=generator)
    extra = ()
    if "edge_dim" in kwargs:
        extra = (torch.randn(edge_index.size(1), 3, dtype=torch.float64, device=device, generator=generator)
                 .requires_grad_(),)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.GeotFallbackWarning)
        assert_same(mine, reference, x, edge_index, *extra)
        out, (_, alpha) = mine(x, edge_index, *extra, return_attention_weights=True)
    want, (_, want_alpha) = reference(x, edge_index, *extra, return_attention_weights=True)
    torch.testing.assert_close(out, want, **F64)
    torch.testing.assert_close(alpha, want_alpha, **F64)
    assert dots, "the scores did not run on geot"


def test_transformer_bipartite(device):
    torch.manual_seed(0)
    reference = pyg_nn.TransformerConv((6, 5), 4, heads=2).to(device).double()
    mine = gnn.patch(copy.deepcopy(reference))
    x_src = torch.randn(9, 6, dtype=torch.float64, device=device)
    x_dst = torch.randn(4, 5, dtype=torch.float64, device=device)
    edge_index = torch.stack([torch.randint(0, 9, (25,), device=device), torch.randint(0, 4, (25,), device=device)])
    torch.testing.assert_close(mine((x_src, x_dst), edge_index), reference((x_src, x_dst), edge_index), **F64)


def test_transformer_falls_back_for_raw_edge_features(device):
    """edge_attr without edge_dim: PyG adds it to the values as given; that runs PyG's forward."""
    mine, reference = (pyg_nn.TransformerConv(4, 4).to(device).double() for _ in range(2))
    mine.load_state_dict(reference.state_dict())
    gnn.patch(mine)
    edge_index = graph(7, 10, device, torch.Generator(device=device).manual_seed(2))
    x = torch.randn(7, 4, dtype=torch.float64, device=device)
    edge_attr = torch.randn(edge_index.size(1), 1, 4, dtype=torch.float64, device=device)  # [E, H, C]
    with pytest.warns(gnn.GeotFallbackWarning, match="edge_attr without edge_dim"):
        out = mine(x, edge_index, edge_attr)
    torch.testing.assert_close(out, reference(x, edge_index, edge_attr), **F64)


def test_narrowing_layers_keep_the_normalized_graph(device):
    """SGConv, TAGConv and APPNP normalize a graph once (kept with edge_index, which the kept entry does not hold
    alive); a new edge_weight, or an in-place change of edge_index, normalizes again."""
    import gc
    import weakref
    generator = torch.Generator(device=device).manual_seed(4)
    x = torch.randn(13, 6, dtype=torch.float64, device=device, generator=generator)
    for make in (lambda: pyg_nn.SGConv(6, 4, K=2), lambda: pyg_nn.TAGConv(6, 4, K=2), lambda: pyg_nn.APPNP(2, 0.1)):
        torch.manual_seed(0)
        reference = make().to(device).double()
        mine = gnn.patch(copy.deepcopy(reference))
        edge_index = graph(13, 40, device, generator)
        options = (13, True, "source_to_target", torch.float64)
        first = propagations.kept_normalization(None, "gcn", edge_index, None, options)
        assert propagations.kept_normalization(None, "gcn", edge_index, None, options)[0] is first[0]
        weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device, generator=generator)
        for _ in range(2):
            torch.testing.assert_close(mine(x, edge_index, weight), reference(x, edge_index, weight), **F64)
        other = torch.rand_like(weight)
        torch.testing.assert_close(mine(x, edge_index, other), reference(x, edge_index, other), **F64)
        edge_index[0, :5] = edge_index[1, :5]  # in place: normalized again
        torch.testing.assert_close(mine(x, edge_index, weight), reference(x, edge_index, weight), **F64)
        gone = weakref.ref(edge_index)
        del edge_index, first, mine  # a layer keeps the last graph it saw
        gc.collect()
        assert gone() is None, "the kept normalization holds its edge_index alive"


def narrowing_case(name, device, seed):
    """(patched layer, PyG's, edge_index, x) of a NARROWING layer on a 13-node graph, float64."""
    torch.manual_seed(0)
    reference = NARROWING[name][0]().to(device).double()
    generator = torch.Generator(device=device).manual_seed(seed)
    edge_index = graph(13, 40, device, generator)
    x = torch.randn(13, 6, dtype=torch.float64, device=device, generator=generator)
    return gnn.patch(copy.deepcopy(reference)), reference, edge_index, x


@pytest.mark.parametrize("name", ["sg", "tag", "appnp", "cheb", "cluster-gcn", "lg"])
@pytest.mark.parametrize("kind", ["torch.sparse", "EdgeIndex"])
def test_narrowing_layers_other_graph_inputs(name, kind, device):
    """The layers of geot.nn.propagations on a torch.sparse adjacency or an EdgeIndex (the generic layer's
    forward): PyG's outputs and gradients."""
    if kind == "torch.sparse" and name in ("cheb", "cluster-gcn"):
        pytest.skip("PyG raises here (ChebConv's Laplacian of a sparse adjacency; ClusterGCNConv's float32 "
                    "weights in a float64 adjacency)")
    mine, reference, edge_index, x = narrowing_case(name, device, seed=5)
    if kind == "EdgeIndex":
        adj = EdgeIndex(edge_index, sparse_size=(13, 13))
    else:
        values = torch.ones(edge_index.size(1), dtype=torch.float64, device=device)
        adj = torch.sparse_coo_tensor(edge_index.flip(0), values, (13, 13)).coalesce().to_sparse_csr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gnn.GeotFallbackWarning)
        assert_same(mine, reference, x, adj)


@pytest.mark.parametrize("name", ["sg", "appnp", "lg"])
def test_eager_calls_normalize_once(name, device, monkeypatch):
    """Eager calls on one edge_index normalize it once (PyG: every call), with PyG's results each time."""
    normalizations = []
    normalize = propagations.NORMALIZATIONS["gcn"]
    monkeypatch.setitem(propagations.NORMALIZATIONS, "gcn",
                        lambda *a: normalizations.append(1) or normalize(*a))
    mine, reference, edge_index, x = narrowing_case(name, device, seed=8)
    for _ in range(3):
        torch.testing.assert_close(mine(x, edge_index), reference(x, edge_index), **F64)
    assert len(normalizations) == 1


def test_appnp_edge_dropout_as_pyg(device):
    """APPNP in training with edge dropout: from the same random state, PyG's outputs and gradients (each step
    drops from the last step's weights, as PyG's)."""
    torch.manual_seed(0)
    reference = pyg_nn.APPNP(K=3, alpha=0.1, dropout=0.5).to(device).double().train()
    mine = gnn.patch(copy.deepcopy(reference))
    generator = torch.Generator(device=device).manual_seed(6)
    edge_index = graph(13, 40, device, generator)
    x = torch.randn(13, 6, dtype=torch.float64, device=device, generator=generator)
    torch.manual_seed(7)
    out, grad_x, _ = outputs_and_grads(mine, x, edge_index)
    torch.manual_seed(7)
    want, want_x, _ = outputs_and_grads(reference, x, edge_index)
    torch.testing.assert_close(out, want, **F64)
    torch.testing.assert_close(grad_x, want_x, **F64)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", ["sg", "tag", "appnp", "cheb", "cluster-gcn", "lg"])
def test_compiled_kept_normalization_sorts_nothing(name, grad, device):
    """Compiled first (no eager call), the layers of geot.nn.propagations normalize and sort their graph while dynamo
    traces: the compiled graphs hold no sort, and a second call reuses them; PyG's results and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = NARROWING[name][0]().to(device).double()
    mine = gnn.patch(copy.deepcopy(reference))
    backend, sorts, compilations = sort_counting_backend(backward=True)

    edge_index = graph(13, 40, device, torch.Generator(device=device).manual_seed(9))
    x = torch.randn(13, 6, dtype=torch.float64, device=device, requires_grad=grad)
    compiled = torch.compile(mine, backend=backend)
    with torch.set_grad_enabled(grad):
        for _ in range(2):
            assert_same_call(compiled, reference, x, edge_index, grad)
    assert sorts and max(sorts) == 0, sorts
    assert len(compilations) == 1
