"""geot.nn against torch_geometric: same parameters, same outputs and gradients."""
import copy
import pickle
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot  # noqa: E402
import geot.nn as gnn  # noqa: E402
from geot.data import load_dataset  # noqa: E402
from torch_geometric import EdgeIndex  # noqa: E402
from conftest import requires_cuda  # noqa: E402

NUM_RELATIONS = 4

# (name, geot class, pyg class, constructor args, kwargs); in_channels 12
LAYERS = [
    ("gcn", gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {}),
    ("gcn-improved-nobias", gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"improved": True, "bias": False}),
    ("gcn-noloops", gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"add_self_loops": False}),
    ("gcn-raw", gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"normalize": False}),
    ("sage-mean", gnn.SAGEConv, pyg_nn.SAGEConv, (12, 8), {}),
    ("sage-sum-norm", gnn.SAGEConv, pyg_nn.SAGEConv, (12, 8), {"aggr": "sum", "normalize": True}),
    ("sage-max-noroot", gnn.SAGEConv, pyg_nn.SAGEConv, (12, 8), {"aggr": "max", "root_weight": False}),
    ("gin", gnn.GINConv, pyg_nn.GINConv, (), {"eps": 0.3, "train_eps": True}),
    ("gat", gnn.GATConv, pyg_nn.GATConv, (12, 5), {"heads": 3}),
    ("gat-mean-noloops", gnn.GATConv, pyg_nn.GATConv, (12, 5),
     {"heads": 2, "concat": False, "add_self_loops": False, "negative_slope": 0.1}),
    ("gat-residual", gnn.GATConv, pyg_nn.GATConv, ((12, 12), 5), {"heads": 2, "residual": True}),
    ("gatv2", gnn.GATv2Conv, pyg_nn.GATv2Conv, (12, 5), {"heads": 3}),
    ("gatv2-shared-mean-residual", gnn.GATv2Conv, pyg_nn.GATv2Conv, (12, 5),
     {"heads": 2, "share_weights": True, "concat": False, "residual": True}),
    ("rgcn-mean", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 8, NUM_RELATIONS), {}),
    ("rgcn-sum-bases", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 8, NUM_RELATIONS), {"aggr": "add", "num_bases": 2}),
    ("rgcn-noroot", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 8, NUM_RELATIONS), {"root_weight": False}),
    # C_out < C_in above: RGCN projects before gathering; here it reduces first
    ("rgcn-widen", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 16, NUM_RELATIONS), {}),
    ("rgcn-widen-sum", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 16, NUM_RELATIONS), {"aggr": "add"}),
    # C_out = C_in: reduces first in inference, projects first in training
    ("rgcn-same-width", gnn.RGCNConv, pyg_nn.RGCNConv, (12, 12, NUM_RELATIONS), {}),
]
LAYER_PARAMS = [pytest.param(*spec[1:], id=spec[0]) for spec in LAYERS]

# (num_nodes, num_edges): tiny, isolated nodes (more nodes than edges), denser
SIZES = [pytest.param(1, 3, id="n1"), pytest.param(40, 25, id="isolated"), pytest.param(200, 1500, id="n200")]


def build_pair(geot_class, pyg_class, args, kwargs, device):
    if geot_class is gnn.GINConv:  # the MLP is shared state: build it once, copy it
        args = (torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)),)
    pyg_layer = pyg_class(*args, **kwargs).to(device).double()
    geot_layer = geot_class(*args, **kwargs).to(device).double()
    with torch.no_grad():  # random bias / eps too, so they are compared
        for p in pyg_layer.parameters():
            p.normal_()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    return geot_layer, pyg_layer


def random_graph(num_nodes, num_edges, device):
    """Unsorted, with duplicates and a few self loops (at most one per node)."""
    edge_index = torch.randint(0, num_nodes, (2, num_edges), device=device)
    loops = torch.randperm(num_nodes, device=device)[: max(1, num_nodes // 10)]
    edge_index = torch.cat([edge_index, loops.repeat(2, 1)], dim=1)
    keep = torch.ones(edge_index.size(1), dtype=torch.bool, device=device)
    keep[: num_edges] = edge_index[0, :num_edges] != edge_index[1, :num_edges]  # random loops could repeat
    return edge_index[:, keep][:, torch.randperm(int(keep.sum()), device=device)]


def extra_inputs(geot_class, num_edges, device):
    if geot_class is gnn.RGCNConv:
        return (torch.randint(0, NUM_RELATIONS, (num_edges,), device=device),)
    return ()


def outputs_and_grads(layer, x, edge_index, extra):
    x = x.detach().clone().requires_grad_()
    out = layer(x, edge_index, *extra)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out, x.grad, grads


# The layers run in float64, where geot and PyG differ by rounding only; a
# looser bound (the 1e-5 of float32) would let a float32 step slip through.
FLOAT64_TOL = {"rtol": 1e-10, "atol": 1e-10}


def assert_same(geot_layer, pyg_layer, x, edge_index, pyg_edge_index, extra):
    out, grad_x, grads = outputs_and_grads(geot_layer, x, edge_index, extra)
    ref, ref_grad_x, ref_grads = outputs_and_grads(pyg_layer, x, pyg_edge_index, extra)
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    torch.testing.assert_close(grad_x, ref_grad_x, **FLOAT64_TOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FLOAT64_TOL, msg=f"grad of {name}")


def assert_same_gradients(out, expect, x, layer, pyg_layer):
    """The gradients of out.square().sum() in x and in each parameter of
    layer equal those of expect in x and pyg_layer's (default tolerance)."""
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    expect_grads = torch.autograd.grad(expect.square().sum(), [x, *pyg_layer.parameters()])
    assert len(grads) == len(expect_grads)
    for got, want in zip(grads, expect_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_nodes,num_edges", SIZES)
@pytest.mark.parametrize("geot_class,pyg_class,args,kwargs", LAYER_PARAMS)
def test_matches_pyg(geot_class, pyg_class, args, kwargs, num_nodes, num_edges, device):
    geot_layer, pyg_layer = build_pair(geot_class, pyg_class, args, kwargs, device)
    edge_index = random_graph(num_nodes, num_edges, device)
    x = torch.randn(num_nodes, 12, dtype=torch.float64, device=device)
    extra = extra_inputs(geot_class, edge_index.size(1), device)
    assert_same(geot_layer, pyg_layer, x, edge_index, edge_index, extra)


def counted_one_passes(monkeypatch) -> list:
    """A list that gets an item for each call GATConv makes to attention_aggregate (its one pass)."""
    calls = []
    aggregate = geot.attention_aggregate
    monkeypatch.setattr(gnn.gat.hetero, "attention_aggregate",
                        lambda *args, **kwargs: calls.append(1) or aggregate(*args, **kwargs))
    return calls


@pytest.mark.parametrize("channels,kwargs", [((12, 5), {"heads": 3}),
                                             ((12, 5), {"heads": 2, "concat": False, "add_self_loops": False}),
                                             (((12, 12), 4), {"heads": 2})],
                         ids=["loops", "no-loops-mean", "separate-projections"])
@pytest.mark.parametrize("input_loops", [True, False], ids=["input-loops", "no-input-loops"])
def test_gat_inference_in_one_pass(input_loops, channels, kwargs, device, monkeypatch):
    """Without gradients (and without dropout) GAT's softmax and sum are one
    op (geot.attention_aggregate: no [E, H] attention, no self-looped edge
    list; scores from the attention vectors, or the destination's given where
    it has a projection of its own); training keeps the two ops, with a drop
    mask only where the input has self loops. The output is PyG's either way."""
    geot_layer, pyg_layer = build_pair(gnn.GATConv, pyg_nn.GATConv, channels, kwargs, device)
    edge_index = random_graph(200, 1500, device)
    if not input_loops:
        edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    x = torch.randn(200, 12, dtype=torch.float64, device=device)
    one_pass = counted_one_passes(monkeypatch)
    with torch.no_grad():
        out, ref = geot_layer(x, edge_index), pyg_layer(x, edge_index)
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    assert one_pass == [1]
    assert_same(geot_layer, pyg_layer, x, edge_index, edge_index, ())  # training: the two ops
    assert one_pass == [1]
    if kwargs.get("add_self_loops", True):
        assert (geot_layer._geot_graph_200_0_0_0[3].drop is None) == (not input_loops)


@pytest.mark.parametrize("out_channels,heads,one_pass", [(5, 4, True), (40, 4, False), (8, 2, False)],
                         ids=["narrow", "wide-heads", "few-heads"])
def test_gat_inference_picks_one_pass_by_heads(out_channels, heads, one_pass, device, monkeypatch):
    """Inference takes attention_aggregate for narrow heads (at most 32 channels each), and for fewer
    than 4 heads only below 2^18 edges; else the two ops, faster there. PyG's result either way."""
    monkeypatch.setattr(gnn.gat, "ONE_PASS_ANY_HEADS_EDGES", 1000)  # (the graph below has 1500 edges)
    geot_layer, pyg_layer = build_pair(gnn.GATConv, pyg_nn.GATConv, (12, out_channels), {"heads": heads}, device)
    edge_index = random_graph(200, 1500, device)
    x = torch.randn(200, 12, dtype=torch.float64, device=device)
    calls = counted_one_passes(monkeypatch)
    with torch.no_grad():
        out, ref = geot_layer(x, edge_index), pyg_layer(x, edge_index)
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    assert calls == ([1] if one_pass else [])


def test_gat_dropout_without_gradients_overwrites_its_scores(device, monkeypatch):
    """Training with dropout under no_grad takes the two ops, the softmax in place (one [E, H] tensor less)."""
    layer = gnn.GATConv(12, 5, heads=3, dropout=0.5).to(device).train()
    overwrites = []
    in_place = geot.edge_softmax_
    monkeypatch.setattr(gnn.gat.hetero, "edge_softmax_", lambda *args: overwrites.append(1) or in_place(*args))
    with torch.no_grad():
        out = layer(torch.randn(200, 12, device=device), random_graph(200, 1500, device))
    assert overwrites == [1] and torch.isfinite(out).all()


@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("in_channels,out_channels,relations", [(12, 8, 4), (12, 3, 5), (24, 8, 6), (8, 8, 3)])
def test_rgcn_inference_in_relation_blocks(aggr, in_channels, out_channels, relations, device):
    """Eager inference where C_out <= C_in < R * C_out projects a few
    relations at a time (peak memory), at equal widths reduces one relation
    at a time over the destinations it reaches; same result as PyG, and as
    the one-table path."""
    torch.manual_seed(1)
    pyg_layer = pyg_nn.RGCNConv(in_channels, out_channels, relations, aggr=aggr).to(device).double()
    geot_layer = gnn.RGCNConv(in_channels, out_channels, relations, aggr=aggr).to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_index = random_graph(60, 400, device)
    edge_type = torch.randint(0, relations, (edge_index.size(1),), device=device)
    x = torch.randn(60, in_channels, dtype=torch.float64, device=device)
    with torch.no_grad():
        out, ref = geot_layer(x, edge_index, edge_type), pyg_layer(x, edge_index, edge_type)
    memo = geot_layer._geot_graph[3].memo
    blocks = memo[next(iter(memo))][2]
    if in_channels == out_channels:
        assert [key[0] for key in memo] == ["rgcn relation ranges"]
        assert [part.relation for part in blocks] == sorted(set(edge_type.tolist()))
        assert all(part.dst.min() == 0 and part.dst.max() == part.hi - part.lo for part in blocks)
        assert sum(part.src.numel() for part in blocks) == edge_index.size(1)
    else:
        assert [key[0] for key in memo] == ["rgcn blocks"] + (["rgcn block weights"] if aggr == "mean" else [])
        assert len(blocks) == -(-relations // max(1, in_channels // (2 * out_channels)))
        assert sum(block.rows.numel() for block in blocks) == edge_index.size(1)
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    torch.testing.assert_close(out, geot_layer(x, edge_index, edge_type).detach(), **FLOAT64_TOL)  # one table


@pytest.mark.parametrize("aggr", ["mean", "add"])
def test_rgcn_inference_in_typed_relation_ranges(aggr, device):
    """Equal widths, a typed graph (relation r reaches nodes 12r..12r+11 alone, nodes 48-59 none): each
    relation's aggregate covers its own destinations only; PyG's result, root and bias on every node."""
    torch.manual_seed(4)
    relations, channels = 4, 8
    pyg_layer = pyg_nn.RGCNConv(channels, channels, relations, aggr=aggr).to(device).double()
    geot_layer = gnn.RGCNConv(channels, channels, relations, aggr=aggr).to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_type = torch.randint(0, relations, (300,), device=device)
    dst = 12 * edge_type + torch.randint(0, 12, (300,), device=device)
    edge_index = torch.stack([torch.randint(0, 60, (300,), device=device), dst])
    x = torch.randn(60, channels, dtype=torch.float64, device=device)
    with torch.no_grad():
        out = geot_layer(x, edge_index, edge_type)
        torch.testing.assert_close(out, pyg_layer(x, edge_index, edge_type), **FLOAT64_TOL)
    ranges = geot_layer._geot_graph[3].memo["rgcn relation ranges", relations][2]
    assert [part.relation for part in ranges] == list(range(relations))
    assert all(12 * part.relation <= part.lo <= part.hi <= 12 * part.relation + 11 for part in ranges)


def typed_relation_graph(relations, per_relation, num_edges, device):
    """(edge_index, edge_type) over 13 * relations nodes: relation r from nodes 13r+1..13r+12 (none from 13r)
    into nodes per_relation * r onwards, per_relation of them (the last 13 nodes receive no edge)."""
    edge_type = torch.randint(0, relations, (num_edges,), device=device)
    src = 13 * edge_type + 1 + torch.randint(0, 12, (num_edges,), device=device)
    dst = per_relation * edge_type + torch.randint(0, per_relation, (num_edges,), device=device)
    return torch.stack([src, dst]), edge_type


@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("x_requires_grad", [True, False], ids=["x-grad", "weights-only"])
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_rgcn_training_in_relation_ranges(aggr, x_requires_grad, typed, device):
    """Training at equal widths takes one relation at a time, over the sources and destinations it reaches
    (_RangesProduct): PyG's output and gradients (x, weights, root, bias). What autograd keeps is x and
    weight-sized: nothing of [N * R, C], and no relation's aggregate (where x takes no gradient, backward
    makes each again)."""
    torch.manual_seed(3)
    relations, channels, nodes = NUM_RELATIONS, 12, 13 * NUM_RELATIONS
    pyg_layer = pyg_nn.RGCNConv(channels, channels, relations, aggr=aggr).to(device).double()
    geot_layer = gnn.RGCNConv(channels, channels, relations, aggr=aggr).to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    if typed:
        edge_index, edge_type = typed_relation_graph(relations, 9, 300, device)
    else:
        edge_index = random_graph(nodes, 300, device)
        edge_type = torch.randint(0, relations, (edge_index.size(1),), device=device)
    x = torch.randn(nodes, channels, dtype=torch.float64, device=device, requires_grad=x_requires_grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = geot_layer(x, edge_index, edge_type)
    ranges = geot_layer._geot_graph[3].memo["rgcn relation ranges", relations][2]
    input_addresses = {t.data_ptr() for t in [x, *geot_layer.parameters()]}
    aggregates = [t for t in saved if t.dim() == 2 and t.size(1) == channels and t.data_ptr() not in input_addresses]
    assert aggregates == [] and all(t.numel() <= x.numel() or t.data_ptr() in input_addresses for t in saved)
    if typed:
        assert all(part.src_hi - part.src_lo <= 11 and part.hi - part.lo <= 8 for part in ranges)
    ref = pyg_layer(x, edge_index, edge_type)
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    loss_weights = torch.randn_like(ref)
    inputs = [x] if x_requires_grad else []
    grads = torch.autograd.grad((out * loss_weights).sum(), inputs + list(geot_layer.parameters()))
    want = torch.autograd.grad((ref * loss_weights).sum(), inputs + list(pyg_layer.parameters()))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, **FLOAT64_TOL)


def test_rgcn_training_in_relation_ranges_from_a_plain_sum(device):
    """out.sum().backward(): the output's gradient is an expanded tensor (stride 0), which the relation
    ranges' backward slices and reduces over the edges by source; PyG's gradients."""
    torch.manual_seed(6)
    pyg_layer = pyg_nn.RGCNConv(8, 8, 3, aggr="add").to(device).double()
    geot_layer = gnn.RGCNConv(8, 8, 3, aggr="add").to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_index = random_graph(40, 300, device)
    edge_type = torch.randint(0, 3, (edge_index.size(1),), device=device)
    x = torch.randn(40, 8, dtype=torch.float64, device=device, requires_grad=True)
    got = torch.autograd.grad(geot_layer(x, edge_index, edge_type).sum(), [x, geot_layer.weight])
    want = torch.autograd.grad(pyg_layer(x, edge_index, edge_type).sum(), [x, pyg_layer.weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FLOAT64_TOL)
    assert ("rgcn relation ranges", 3, "by source") in geot_layer._geot_graph[3].memo


@pytest.mark.parametrize("aggr", ["mean", "add"])
def test_rgcn_training_in_relation_ranges_twice_differentiable(aggr, device):
    """A gradient penalty through training's relation ranges (create_graph): PyG's second derivatives."""
    torch.manual_seed(5)
    pyg_layer = pyg_nn.RGCNConv(6, 6, 3, aggr=aggr, num_bases=2).to(device).double()
    geot_layer = gnn.RGCNConv(6, 6, 3, aggr=aggr, num_bases=2).to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_index = random_graph(30, 200, device)
    edge_type = torch.randint(0, 3, (edge_index.size(1),), device=device)
    x = torch.randn(30, 6, dtype=torch.float64, device=device, requires_grad=True)

    def penalty_grads(layer):
        out = layer(x, edge_index, edge_type)
        grad_x, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        return torch.autograd.grad(grad_x.square().sum(), [x, *layer.parameters()])
    for got, want in zip(penalty_grads(geot_layer), penalty_grads(pyg_layer)):
        torch.testing.assert_close(got, want, **FLOAT64_TOL)
    assert ("rgcn relation ranges", 3) in geot_layer._geot_graph[3].memo


@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("in_channels,out_channels", [(12, 8), (5, 9)])
def test_rgcn_inference_pairs_in_relation_blocks(aggr, in_channels, out_channels, device, monkeypatch):
    """Many relations ((node, relation) segments outnumber the edges), inference
    past PAIR_BLOCK_MIN_BYTES of table: the pairs' projections a range of pairs
    at a time (peak memory), a relation's pairs split where it has more than
    a range; same result as PyG and as the one-table path (training)."""
    from geot.nn import rgcn
    monkeypatch.setattr(rgcn, "PAIR_BLOCK_MIN_BYTES", 0)
    torch.manual_seed(2)
    relations = 20
    pyg_layer = pyg_nn.RGCNConv(in_channels, out_channels, relations, aggr=aggr).to(device).double()
    geot_layer = gnn.RGCNConv(in_channels, out_channels, relations, aggr=aggr).to(device).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_index = random_graph(60, 400, device)
    edge_type = torch.randint(0, relations - 2, (edge_index.size(1),), device=device)  # the last two unused
    edge_type[::2] = 3  # one relation with about half the pairs: split over blocks
    x = torch.randn(60, in_channels, dtype=torch.float64, device=device)
    with torch.no_grad():
        out, ref = geot_layer(x, edge_index, edge_type), pyg_layer(x, edge_index, edge_type)
    memo = geot_layer._geot_graph[3].memo
    derived = [key for key in memo if key[0] != "checked"]  # ("checked", counts): the ids checked
    assert [key[-1] for key in derived] == ["blocks"]  # kept in place of the pairs, not besides them
    blocks = memo[derived[0]][2]
    parts, pairs = blocks.parts, blocks.node.numel()
    assert len(parts) == rgcn._pair_range_count(pairs, 60) > 2
    assert [b.start for b in parts] == [0] + [b.end for b in parts[:-1]]
    assert parts[-1].end == pairs and sum(b.rows.numel() for b in parts) == edge_index.size(1)
    assert max(b.end - b.start for b in parts) <= -(-pairs // len(parts))  # however skewed the relations
    torch.testing.assert_close(out, ref, **FLOAT64_TOL)
    torch.testing.assert_close(out, geot_layer(x, edge_index, edge_type).detach(), **FLOAT64_TOL)  # one table


@pytest.mark.parametrize("aggr", ["mean", "add"])
@pytest.mark.parametrize("ranges", [False, True], ids=["whole-table", "pair-ranges"])
def test_compiled_rgcn_pairs_in_one_graph(aggr, ranges, monkeypatch):
    """Many relations, torch.compile(fullgraph=True) with no eager call first: the pair tables (in
    inference the pair ranges, past PAIR_BLOCK_MIN_BYTES) are made while dynamo traces, so inference
    and training compile to one graph each with no table of data-dependent size (PyG's compiled
    RGCNConv fails under fullgraph); PyG's results and gradients."""
    from geot.nn import rgcn
    if ranges:
        monkeypatch.setattr(rgcn, "PAIR_BLOCK_MIN_BYTES", 0)
    torch._dynamo.reset()
    torch.manual_seed(4)
    relations = 20
    pyg_layer = pyg_nn.RGCNConv(8, 6, relations, aggr=aggr).double()
    geot_layer = gnn.RGCNConv(8, 6, relations, aggr=aggr).double()
    geot_layer.load_state_dict(pyg_layer.state_dict())
    edge_index = random_graph(60, 400, "cpu")
    edge_type = torch.randint(0, relations, (edge_index.size(1),))
    x = torch.randn(60, 8, dtype=torch.float64, requires_grad=True)
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(geot_layer, fullgraph=True, backend=recorder)(x, edge_index, edge_type)
    trained = torch.compile(geot_layer, fullgraph=True, backend="aot_eager")(x, edge_index, edge_type)
    (trained * torch.linspace(-1, 1, trained.numel(), dtype=torch.float64).view_as(trained)).sum().backward()
    want = pyg_layer(x.detach().requires_grad_(), edge_index, edge_type)
    torch.testing.assert_close(out, want.detach(), **FLOAT64_TOL)
    torch.testing.assert_close(trained, want, **FLOAT64_TOL)
    (want * torch.linspace(-1, 1, want.numel(), dtype=torch.float64).view_as(want)).sum().backward()
    for name, parameter in geot_layer.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(pyg_layer.named_parameters())[name].grad, **FLOAT64_TOL)
    assert len(graphs) == 1
    memo = geot_layer._geot_graph[3].memo
    assert any(key[-1] == "blocks" for key in memo) == ranges


@requires_cuda
def test_kept_graph_is_a_static_input_for_cuda_graphs():
    """What a layer keeps with its graph (the sorted edges, the transposed
    index, GCN's normalization) is marked as a static input, so CUDA graphs
    read it in place instead of copying it on every replay."""
    layer = gnn.GCNConv(8, 4).cuda()
    edge_index = random_graph(30, 120, "cuda")
    for _ in range(2):  # the second call on the graph adds the transposed index
        layer(torch.randn(30, 8, device="cuda"), edge_index).sum().backward()
    graph = layer._geot_graph[3]
    kept = [graph.src, graph.dst, *graph.transposed]
    for _, _, value in graph.memo.values():  # a tensor, a tuple of them, or a flag (ids checked)
        values = value if isinstance(value, tuple) else (value,)
        kept += [t for t in values if isinstance(t, torch.Tensor)]
    assert len(kept) >= 6
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in kept)
    # and its indices declared static to geot: captures read their cached segment offsets
    indices = [t for t in kept if t.dim() == 1 and t.dtype in (torch.int32, torch.int64)]
    assert any(t is graph.dst for t in indices) and all(geot._C.is_static_index(t) for t in indices)


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("geot_class,pyg_class,args,kwargs", LAYER_PARAMS)
def test_autocast_matches_float32(geot_class, pyg_class, args, kwargs, amp_dtype, device):
    """Under autocast (as e2e's bf16 runs) every layer runs forward and
    backward, and its error against float32 PyG is no larger than PyG's own
    under autocast (some layers here are ill-conditioned in half precision).
    CUDA autocast runs some ops (pow, reciprocal, ...) in float32, so
    per-graph values made with them must be cast to the features' dtype."""
    if device == "cpu" and amp_dtype == torch.float16:
        pytest.skip("CPU autocast is bf16")
    geot_layer, pyg_layer = build_pair(geot_class, pyg_class, args, kwargs, device)
    geot_layer, pyg_layer = geot_layer.float(), pyg_layer.float()
    edge_index = random_graph(200, 1500, device)
    x = torch.randn(200, 12, device=device)
    extra = extra_inputs(geot_class, edge_index.size(1), device)
    ref = outputs_and_grads(pyg_layer, x, edge_index, extra)[:2]
    with torch.autocast(device, dtype=amp_dtype):
        got = outputs_and_grads(geot_layer, x, edge_index, extra)[:2]
        pyg_amp = outputs_and_grads(pyg_layer, x, edge_index, extra)[:2]
    for name, g, p, r in zip(("output", "grad of x"), got, pyg_amp, ref):
        error, pyg_error = (g.float() - r).abs().max().item(), (p.float() - r).abs().max().item()
        assert error <= 2 * pyg_error + 2e-3 * r.abs().max().item(), (name, error, pyg_error)


def record_aggregated_dtypes(monkeypatch):
    """The dtype of every x geot.nn's layers aggregate from now on, in call order."""
    dtypes = []
    for module, name in ((gnn.gin, "gather_reduce_nodes"), (gnn.gin, "_sum_plus_scaled"),
                         (gnn.sage, "gather_reduce_nodes")):
        aggregate = getattr(module, name)
        monkeypatch.setattr(module, name, lambda graph, h, *a, aggregate=aggregate: dtypes.append(h.dtype) or
                            aggregate(graph, h, *a))
    return dtypes


def bf16_inference(geot_layer, pyg_layer, x, edge_index, device):
    """(geot's and PyG's outputs under bf16 autocast, PyG's in float32), without gradients."""
    with torch.no_grad():
        ref = pyg_layer(x, edge_index)
        with torch.autocast(device, dtype=torch.bfloat16):
            return geot_layer(x, edge_index), pyg_layer(x, edge_index), ref


@pytest.mark.parametrize("cast", [True, False], ids=["no-buffer", "fp32-rows"])
def test_gin_inference_under_autocast_sums_cast_x(monkeypatch, device, cast):
    """In inference under autocast GIN sums x cast to the autocast dtype (its
    nn begins with a Linear, which would cast the sum): half the bytes
    gathered. Its output error against float32 stays near PyG's under
    autocast (1.07-1.28x over 30 seeds); training sums in float32 as PyG.
    On CUDA only where the half-precision sum keeps no fp32 rows; else x is
    summed in float32 as PyG does."""
    if device == "cpu" and not cast:
        pytest.skip("CPU always casts first")
    monkeypatch.setattr(gnn.gin, "_sum_writes_half", lambda *args: cast)
    geot_layer, pyg_layer = build_pair(gnn.GINConv, pyg_nn.GINConv, (), {"eps": 0.3, "train_eps": True}, device)
    geot_layer, pyg_layer = geot_layer.float(), pyg_layer.float()
    edge_index, x = random_graph(200, 1500, device), torch.randn(200, 12, device=device)
    amp_dtype = torch.bfloat16
    summed = record_aggregated_dtypes(monkeypatch)
    got, pyg_amp, ref = bf16_inference(geot_layer, pyg_layer, x, edge_index, device)
    summed_dtype = amp_dtype if cast else torch.float32
    assert summed == [summed_dtype]
    assert (got.float() - ref).norm() <= 1.5 * (pyg_amp.float() - ref).norm()
    with torch.autocast(device, dtype=amp_dtype):
        geot_layer(x, edge_index)
    assert summed == [summed_dtype, torch.float32], "training keeps the float32 sum"


@requires_cuda
@pytest.mark.parametrize("num_edges", [6000, 30000, 120000])
def test_gin_cast_first_follows_the_sum_schedule(num_edges):
    """GIN's choice to cast x first (inference under autocast) follows the
    rules' config for the CUDA sum: SP (writes bf16 itself) casts; SR (fp32
    rows, one per M_t edges where fewer than the nodes) and PR sum x in
    float32; decided once per graph and width, kept with the graph. The
    half-precision sum allocates no more fp32 rows than the config it
    launches keeps (explain with its dtype: the hand rules after the rules'
    too, e.g. shared ids for rows of 64 features)."""
    nodes, width = 3000, 64
    layer = gnn.GINConv(torch.nn.Linear(width, 8)).cuda()
    edge_index = random_graph(nodes, num_edges, "cuda")
    x = torch.randn(nodes, width, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x, edge_index)
    graph = layer._geot_graph[3]
    decided = graph.memo[("cast first", width, nodes)][2]
    edges = graph.dst.numel()  # random_graph's count, less repeated loops, plus one loop per tenth node
    longest = int(torch.bincount(graph.dst, minlength=nodes).max())
    level = geot.config.long_segment_level(longest)

    def fp32_rows(config):
        chunks = -(-edges // config.M_t)
        return {"SP": 0, "SR": min(chunks, nodes)}.get(config.schedule, nodes)
    config = geot.explain(edges, nodes, width, gathered=True, long_segments=level)
    assert decided == (fp32_rows(config) == 0), config
    config = geot.explain(edges, nodes, width, gathered=True, long_segments=level, dtype=torch.bfloat16)
    rows = fp32_rows(config)
    x_half = x.bfloat16()
    geot.index_segment_reduce(graph.src, graph.dst, x_half, "sum", nodes)  # warm-up: validation (and SP's offsets) cached
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = geot.index_segment_reduce(graph.src, graph.dst, x_half, "sum", nodes)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.nbytes
    assert extra <= rows * width * 4 + 8 * (nodes + 1) + 4096, (config, rows, extra)


def test_rgcn_keeps_indices_once_for_every_dtype():
    """RGCN gathering projected rows keeps their edges and transposed index
    once whatever the dtype (a mean's weights per dtype), and no transposed
    index of the graph (its backward does not read it)."""
    layer = gnn.RGCNConv(12, 4, 3)  # 3 relations * 4 <= 12 channels: one table, also in inference
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 12)
    edge_type = torch.randint(0, 3, (edge_index.size(1),))
    for amp in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            layer(x, edge_index, edge_type).float().sum().backward()
            with torch.no_grad():  # a table no wider than x: inference reads the same edges, no blocks
                layer(x, edge_index, edge_type)
    graph = layer._geot_graph[3]
    assert graph.transposed is None
    per_dtype = [(name, 3, 60, dtype) for name in ("rgcn row weights", "rgcn rows transposed")
                 for dtype in (torch.float32, torch.bfloat16)]
    assert set(graph.memo) == {("rgcn rows", 3), ("rgcn rows transposed", 3), *per_dtype}


@pytest.mark.parametrize("geot_class,pyg_class,args,kwargs", LAYER_PARAMS[:1] + LAYER_PARAMS[4:5] + LAYER_PARAMS[8:9])
def test_edge_index_input(geot_class, pyg_class, args, kwargs, device):
    geot_layer, pyg_layer = build_pair(geot_class, pyg_class, args, kwargs, device)
    edge_index = random_graph(60, 300, device)
    x = torch.randn(60, 12, dtype=torch.float64, device=device)
    for sort in (False, True):
        plain = edge_index if not sort else edge_index[:, torch.argsort(edge_index[1], stable=True)]
        typed = EdgeIndex(plain, sparse_size=(60, 60), sort_order="col" if sort else None)
        assert_same(geot_layer, pyg_layer, x, typed, plain, ())


def test_gcn_edge_weight_and_cached(device):
    geot_layer, pyg_layer = build_pair(gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"improved": True}, device)
    edge_index = random_graph(50, 200, device)
    weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device)
    x = torch.randn(50, 12, dtype=torch.float64, device=device)
    torch.testing.assert_close(geot_layer(x, edge_index, weight), pyg_layer(x, edge_index, weight))

    cached, _ = build_pair(gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"cached": True}, device)
    first = cached(x, edge_index)
    assert torch.equal(cached(x, random_graph(50, 100, device)), first), "cached=True must reuse the first graph"
    cached.reset_parameters()
    assert cached._geot_norm is None


def test_graph_cache_invalidation():
    layer = gnn.SAGEConv(4, 3, aggr="sum")
    edge_index = torch.tensor([[0, 1, 2], [2, 0, 1]])
    x = torch.randn(3, 4)
    layer(x, edge_index)
    first = layer._geot_graph[3]
    assert first.transposed is None, "a graph's first call: atomics in the backward pass, no transposed index"
    layer(x, edge_index)
    assert layer._geot_graph[3].src is first.src and layer._geot_graph[3].transposed is not None, \
        "the second call on the graph adds the transposed index to the sorted graph"
    first = layer._geot_graph[3]
    layer(x, edge_index)
    assert layer._geot_graph[3] is first, "same tensor: the sorted graph is reused"
    other = gnn.SAGEConv(4, 3)
    other(x, edge_index)
    assert other._geot_graph[3] is first, "layers share the sorted graph"
    edge_index[0, 0] = 1  # in place: the version counter changes
    out = layer(x, edge_index)
    assert layer._geot_graph[3] is not first
    expect = pyg_nn.SAGEConv(4, 3, aggr="sum")
    expect.load_state_dict(layer.state_dict())
    torch.testing.assert_close(out, expect(x, edge_index))


def test_graph_kept_in_int32_when_ids_fit():
    """An int64 edge_index is kept as int32 (sorted edges, perm, transposed
    index); ids past int32, or RGCN rows src * R + relation past it, keep int64."""
    from geot.nn.graph import _survey
    layer = gnn.GCNConv(4, 3)
    edge_index = torch.tensor([[0, 1, 2, 4], [2, 0, 1, 3]])
    for _ in range(2):  # the second call adds the transposed index
        layer(torch.randn(5, 4), edge_index)
    graph = layer._geot_graph[3]
    kept = [graph.src, graph.dst, graph.perm, *graph.transposed]
    assert all(t.dtype == torch.int32 for t in kept)
    in_order = torch.tensor([[3, 1, 4], [0, 2, 2]])  # sorted: views, no copy
    for _ in range(2):
        layer(torch.randn(5, 4), in_order)
    graph = layer._geot_graph[3]
    assert graph.perm is None and graph.src.data_ptr() == in_order.data_ptr() and graph.src.dtype == torch.int64
    assert all(t.dtype == torch.int32 for t in graph.transposed)
    src, dst = torch.tensor([0, 2**31 - 1]), torch.tensor([0, 1])
    assert _survey(src, dst, 0, None) == (False, True, False)
    assert _survey(src + 1, dst, 0, None) == (False, False, False), "a source id past int32"
    assert _survey(dst, src + 1, 0, None) == (False, False, False), "a destination id past int32"
    assert _survey(src - 2**31, dst, 0, None) == (False, True, False), "negative ids that int32 holds"
    assert _survey(src - 2**31 - 1, dst, 0, None) == (False, False, False)
    assert _survey(torch.tensor([0, 2**31 // 8]), dst, 8, None) == (False, False, False), "RGCN rows past int32"
    assert _survey(torch.tensor([0, 2**31 // 8 - 1]), dst.flip(0), 8, None) == (True, True, False)
    assert _survey(src.int(), dst.int(), 0, torch.tensor(True)) == (False, False, True), "int32 input: kept as is"


def _gcn_norm_entries(layer):
    return [v for k, v in layer._geot_graph[3].memo.items() if k[0] == "gcn" and k[-1] != "transposed"]


@pytest.mark.parametrize("cached", [False, True])
def test_transposed_index_made_when_gradients_first_recorded(cached, device):
    """Inference alone keeps no transposed index; the first call recording
    gradients adds it (the graph's memo carried over) and matches PyG."""
    geot_layer, pyg_layer = build_pair(gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"cached": cached}, device)
    edge_index = random_graph(50, 200, device)
    x = torch.randn(50, 12, dtype=torch.float64, device=device)
    with torch.no_grad():
        torch.testing.assert_close(geot_layer(x, edge_index), pyg_layer(x, edge_index))
    graph = geot_layer._geot_graph[3]
    assert graph.transposed is None and ("gcn" in [k[0] for k in graph.memo])
    assert_same(geot_layer, pyg_layer, x, edge_index, edge_index, ())
    trained = geot_layer._geot_norm[0] if cached else geot_layer._geot_graph[3]
    assert trained.transposed is not None and trained.src is graph.src
    assert cached or trained.memo is graph.memo
    kept_t = geot_layer._geot_norm[2] if cached else [v for k, v in trained.memo.items() if k[-1] == "transposed"]
    assert kept_t is not None and len(kept_t), "the normalization in transposed order is kept"
    other = gnn.GCNConv(12, 8).to(device).double()
    other(x, edge_index)
    assert cached or other._geot_graph[3] is trained, "the shared cache holds the graph with its transposed index"


def test_gcn_norm_kept_with_graph(device):
    """The normalization is computed once per graph; a new tensor or an
    in-place change of edge_index or edge_weight computes it again."""
    geot_layer, pyg_layer = build_pair(gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {}, device)
    edge_index = random_graph(50, 200, device)
    x = torch.randn(50, 12, dtype=torch.float64, device=device)
    for _ in range(2):  # the second call runs on the kept normalization, gradients included
        assert_same(geot_layer, pyg_layer, x, edge_index, edge_index, ())
    (first,) = _gcn_norm_entries(geot_layer)
    other = gnn.GCNConv(12, 8).to(device).double()
    other(x, edge_index)
    assert _gcn_norm_entries(other) == [first], "layers share the graph and its normalization"
    edge_index[0, :20] = edge_index[0, 20:40].clone()  # in place: the graph and its normalization go
    assert_same(geot_layer, pyg_layer, x, edge_index, edge_index, ())
    assert _gcn_norm_entries(geot_layer)[0] is not first
    new = random_graph(50, 150, device)  # a new tensor
    assert_same(geot_layer, pyg_layer, x, new, new, ())

    weight = torch.rand(new.size(1), dtype=torch.float64, device=device)
    for scale in (1.0, 3.0):
        weight.mul_(scale)  # in place: normalized again
        torch.testing.assert_close(geot_layer(x, new, weight), pyg_layer(x, new, weight))
    torch.testing.assert_close(geot_layer(x, new), pyg_layer(x, new))  # and without weights again


def test_gcn_learned_edge_weight(device):
    """An edge_weight that requires grad is normalized on every call, its gradient as in PyG."""
    geot_layer, pyg_layer = build_pair(gnn.GCNConv, pyg_nn.GCNConv, (12, 8), {"improved": True}, device)
    edge_index = random_graph(40, 160, device)
    x = torch.randn(40, 12, dtype=torch.float64, device=device)
    grads = []
    for layer in (geot_layer, pyg_layer, geot_layer):
        weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device,
                            generator=torch.Generator(device).manual_seed(0)).requires_grad_()
        layer(x, edge_index, weight).square().sum().backward()
        grads.append(weight.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[2], grads[1])


def test_inference_mode_then_training():
    """A graph first seen under inference_mode is not reused by training (its
    tensors cannot be saved for backward)."""
    edge_index, x = random_graph(30, 100, "cpu"), torch.randn(30, 4)
    for layer in (gnn.GCNConv(4, 3), gnn.SAGEConv(4, 3)):
        with torch.inference_mode():
            expect = layer(x, edge_index)
        out = layer(x, edge_index)
        out.sum().backward()
        torch.testing.assert_close(out, expect)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("weighted", [False, True])
def test_eager_autograd_matches_registered_op(reduce, weighted, device):
    """geot's eager autograd nodes (sums and means: C++, geot._C.sorted_reduce;
    max: IndexSegmentReduce) and the registered op's autograd give the same
    outputs, gradients and (create_graph) second derivatives."""
    edge_index = random_graph(30, 120, device)
    dst, perm = torch.sort(edge_index[1], stable=True)
    src = edge_index[0][perm]
    transposed = geot.transpose_index(src, dst)
    x0 = torch.randn(30, 5, dtype=torch.float64, device=device)
    w0 = torch.rand(src.numel(), dtype=torch.float64, device=device) if weighted else None
    results = []
    for eager in (True, False):
        x = x0.clone().requires_grad_()
        w = None if w0 is None else w0.clone().requires_grad_()
        if eager:
            out = geot.index._fused(src, dst, w, x, reduce, 30, transposed, None)
            node = "IndexSegmentReduceBackward" if reduce == "max" else "SortedReduce"
            assert node in out.grad_fn.name()
        else:
            out = torch.ops.geot.index_segment_reduce(src, dst, x, w, 30, reduce, None, *transposed)
        inputs = (x,) if w is None else (x, w)
        grads = torch.autograd.grad(out.square().sum(), inputs, create_graph=reduce == "sum")
        # x's gradient is the op again (edge_dot, the weight's, has no derivative)
        second = torch.autograd.grad(grads[0].square().sum(), inputs) if reduce == "sum" else ()
        results.append((out, *grads, *second))
    for got, expect in zip(*results):
        torch.testing.assert_close(got, expect)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_segment_aggregation(reduce, device):
    class Sum(pyg_nn.MessagePassing):
        def forward(self, x, edge_index):
            return self.propagate(edge_index, x=x)

    edge_index = random_graph(30, 120, device)
    x = torch.randn(30, 6, dtype=torch.float64, device=device, requires_grad=True)
    for index in (edge_index, edge_index[:, torch.argsort(edge_index[1])]):
        got = Sum(aggr=gnn.SegmentAggregation(reduce))(x, index)
        expect = Sum(aggr=reduce)(x, index)
        torch.testing.assert_close(got, expect)
        grad, = torch.autograd.grad(got.sum(), x)
        expect_grad, = torch.autograd.grad(expect.sum(), x)
        torch.testing.assert_close(grad, expect_grad)


def test_patch():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList([pyg_nn.GCNConv(12, 8), pyg_nn.SAGEConv(8, 8), pyg_nn.GATConv(8, 4)])
            self.other = torch.nn.Linear(4, 2)

        def forward(self, x, edge_index):
            for conv in self.convs:
                x = conv(x, edge_index).relu()
            return self.other(x)

    model = Net().double()
    edge_index = random_graph(40, 160, "cpu")
    x = torch.randn(40, 12, dtype=torch.float64)
    expect = model(x, edge_index)
    params = list(model.parameters())
    assert gnn.patch(model) is model
    assert [type(c) for c in model.convs] == [gnn.GCNConv, gnn.SAGEConv, gnn.GATConv]
    assert all(a is b for a, b in zip(model.parameters(), params)), "patch keeps the parameter tensors"
    torch.testing.assert_close(model(x, edge_index), expect)


def test_patched_model_compiles_whole_where_pyg_was_compiled_first():
    """A model compiled with PyG's layers, then patched and compiled again
    (as a user comparing the two in one process does): PyG's GCN breaks its
    graph inside the model's layer loop, so dynamo gave up on that forward;
    patch makes it compile again, as one graph (without: one per layer)."""
    from torch._dynamo.testing import CompileCounter

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList([pyg_nn.GCNConv(8, 16), pyg_nn.GCNConv(16, 4)])

        def forward(self, x, edge_index):
            for conv in self.convs:
                x = conv(x, edge_index).relu()
            return x

    torch._dynamo.reset()
    model, x, edge_index = Net(), torch.randn(20, 8), random_graph(20, 60, "cpu")
    pyg_count, geot_count = CompileCounter(), CompileCounter()
    expect = torch.compile(model, backend=pyg_count)(x, edge_index)
    if pyg_count.frame_count == 1:
        pytest.skip("PyG's compiled GCN has no graph break in this PyG version")
    got = torch.compile(gnn.patch(model), backend=geot_count, fullgraph=True)(x, edge_index)
    assert geot_count.frame_count == 1
    torch.testing.assert_close(got, expect)
    torch._dynamo.reset()


def assert_checkpointed_steps_match(geot_layer, pyg_layer, x, edge_index, extra=(), steps=3):
    """Training steps under torch.utils.checkpoint (non-reentrant), which recomputes the forward pass in
    the backward pass and checks that it saves what the forward saved: outputs and gradients as PyG's."""
    from torch.utils.checkpoint import checkpoint

    for _ in range(steps):
        results = []
        for layer in (geot_layer, pyg_layer):
            x_step = x.clone().requires_grad_()
            out = checkpoint(layer, x_step, edge_index, *extra, use_reentrant=False)
            results.append((out,) + torch.autograd.grad(out.square().sum(), (x_step, *layer.parameters())))
        for mine, theirs in zip(*results):
            torch.testing.assert_close(mine, theirs, **FLOAT64_TOL)


@pytest.mark.parametrize("geot_class,pyg_class,args,kwargs", LAYER_PARAMS)
def test_under_activation_checkpointing(geot_class, pyg_class, args, kwargs, device):
    """A layer's second call on a graph, the recomputation, keeps the graph's layout: a graph first seen
    under checkpointing gets its transposed index at once."""
    geot_layer, pyg_layer = build_pair(geot_class, pyg_class, args, kwargs, device)
    edge_index = random_graph(40, 160, device)
    x = torch.randn(40, 12, dtype=torch.float64, device=device)
    assert_checkpointed_steps_match(geot_layer, pyg_layer, x, edge_index,
                                    extra_inputs(geot_class, edge_index.size(1), device))


@pytest.mark.parametrize("make", [lambda: pyg_nn.APPNP(3, 0.1), lambda: pyg_nn.TAGConv(12, 8, K=2),
                                  lambda: pyg_nn.GraphConv(12, 8)], ids=["appnp", "tag", "graphconv"])
def test_patched_layers_under_activation_checkpointing(make, device):
    """As above for layers geot.nn.patch makes; APPNP and TAGConv propagate over their graph several times
    per call (each a call on the graph they keep)."""
    pyg_layer = make().to(device).double()
    x = torch.randn(40, 12, dtype=torch.float64, device=device)
    assert_checkpointed_steps_match(gnn.patch(copy.deepcopy(pyg_layer)), pyg_layer, x, random_graph(40, 160, device))


def _trained_layers(device):
    """Layers of several kinds after a training and an inference call: they keep sorted graphs,
    transposed indices and derived values (GCN's normalization with edge weights, held by weak reference)."""
    edge_index = random_graph(30, 120, device)
    x = torch.randn(30, 12, dtype=torch.float64, device=device)
    weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device)
    layers = torch.nn.ModuleList([gnn.GCNConv(12, 8), gnn.GCNConv(12, 8, cached=True), gnn.SAGEConv(12, 8),
                                  gnn.GATConv(12, 4, heads=2), gnn.patch(pyg_nn.TAGConv(12, 8))]).to(device).double()
    calls = [(x, edge_index, weight), (x, edge_index, weight), (x, edge_index), (x, edge_index), (x, edge_index)]
    for layer, args in zip(layers, calls):
        layer(*args).sum().backward()
        with torch.no_grad():
            layer(*args)
    return layers, calls


def test_layers_pickle_after_calls(tmp_path, device):
    """torch.save and copy.deepcopy of layers that have run: the graphs they keep are left out (remade at
    the next call), GCN's cached normalization kept (as PyG pickles it); the copies compute the same."""
    layers, calls = _trained_layers(device)
    expect = [layer(*args) for layer, args in zip(layers, calls)]
    assert any(name.startswith("_geot_graph_") for name in layers[0].__dict__)
    torch.save(layers, tmp_path / "layers.pt")
    for copied in (torch.load(tmp_path / "layers.pt", weights_only=False), copy.deepcopy(layers)):
        assert [type(layer) for layer in copied] == [type(layer) for layer in layers]
        assert not any(name.startswith("_geot_graph_") for layer in copied for name in layer.__dict__)
        assert copied[1]._cached_edge_index is not None
        for layer, args, out in zip(copied, calls, expect):
            torch.testing.assert_close(layer(*args), out, **FLOAT64_TOL)


def test_torch_package_exports_pyg_layers(tmp_path):
    """torch.package (externing PyG's modules alone, as for a PyG model) exports geot's layers as PyG's:
    the loaded layers are PyG's classes with the same parameters, and compute the same."""
    layers, calls = _trained_layers("cpu")
    path = tmp_path / "layers.pt"
    with torch.package.PackageExporter(str(path)) as exporter:
        exporter.extern(["torch_geometric.**", "_operator"])
        exporter.save_pickle("model", "layers.pkl", layers)
    loaded = torch.package.PackageImporter(str(path)).load_pickle("model", "layers.pkl")
    for mine, theirs, args in zip(layers, loaded, calls):
        assert type(theirs).__module__.startswith("torch_geometric.") and isinstance(mine, type(theirs))
        torch.testing.assert_close(theirs(*args), mine(*args), **FLOAT64_TOL)


def test_patch_strict_names_the_layer_that_runs_pyg():
    """patch converts every layer; strict=True raises for one whose options
    keep every call on PyG's forward, and leaves it a PyG layer."""
    holder = _Holder(pyg_nn.SAGEConv(8, 8, aggr="lstm"))
    with pytest.raises(NotImplementedError, match="layer convs.0 runs PyG's forward: aggr='lstm'"):
        gnn.patch(holder, strict=True)
    assert type(holder.convs[0]) is pyg_nn.SAGEConv
    gnn.patch(holder)
    assert type(holder.convs[0]) is gnn.SAGEConv


class _Holder(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.convs = torch.nn.ModuleList([conv])


def test_bad_inputs():
    layer, x = gnn.GCNConv(4, 2), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\]"):
        layer(x, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="edge_index must be int32 or int64"):
        layer(x, torch.zeros(2, 4))
    rgcn = gnn.RGCNConv(4, 2, 3)
    edge_index = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="needs edge_type"):
        rgcn(x, edge_index)
    with pytest.raises(ValueError, match="edge_type has values outside"):
        rgcn(x, edge_index, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"edge_type must have shape \[2\]"):
        rgcn(x, edge_index, torch.tensor([0, 1, 2]))


_ID_CHECKED = {"GCN": lambda: gnn.GCNConv(4, 2), "SAGE": lambda: gnn.SAGEConv(4, 2),
               "GIN": lambda: gnn.GINConv(torch.nn.Linear(4, 2)), "GAT": lambda: gnn.GATConv(4, 2, heads=2),
               "GATv2": lambda: gnn.GATv2Conv(4, 2), "Transformer": lambda: gnn.TransformerConv(4, 2),
               "RGCN": lambda: gnn.RGCNConv(4, 2, 2), "RGAT": lambda: gnn.RGATConv(4, 2, 2)}


@pytest.mark.parametrize("layer", list(_ID_CHECKED))
@pytest.mark.parametrize("bad_edges,role", [([[0, 7], [1, 2]], "source"), ([[0, 1], [1, 5]], "destination"),
                                            ([[-1, 1], [1, 2]], "source")], ids=["source", "destination", "negative"])
def test_ids_outside_the_nodes_name_edge_index(device, layer, bad_edges, role):
    """A layer's first graph with ids outside [0, N): a ValueError naming edge_index and the ids' role, not an
    op's own argument names (its kernels' index names)."""
    conv = _ID_CHECKED[layer]().to(device)
    x, edge_index = torch.randn(5, 4, device=device), torch.tensor(bad_edges, device=device)
    args = (torch.tensor([0, 1], device=device),) if layer.startswith("R") else ()
    with pytest.raises(ValueError, match=f"edge_index has {role} ids in .*, outside \\[0, 5\\)"):
        conv(x, edge_index, *args)


def test_import_error_names_the_package(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch_geometric", None)
    for name in [m for m in sys.modules if m.startswith("geot.nn")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match="pip install torch-geometric"):
        import geot.nn  # noqa: F401


def test_compile_fullgraph_gcn_matches_eager(device):
    class GCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = gnn.GCNConv(12, 16), gnn.GCNConv(16, 4)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    torch._dynamo.reset()
    model = GCN().to(device)
    edge_index = random_graph(80, 400, device)
    x = torch.randn(80, 12, device=device)
    eager = model(x, edge_index)  # fills the layers' graph slots
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x, edge_index), eager)
    other = random_graph(80, 300, device)  # not seen eagerly: sorted inside the compiled graph
    torch.testing.assert_close(compiled(x, other), model(x, other))
    loss = compiled(x, edge_index).square().sum()
    loss.backward()
    assert model.conv1.lin.weight.grad is not None


class _CallRecorder:
    """A torch.compile backend that records the ops of each graph it is given and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, inputs):
        self.graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    def sorts(self) -> int:
        return sum("sort" in target for graph in self.graphs for target in graph)


class _FloatInputRecorder(_CallRecorder):
    """A _CallRecorder that also notes graph inputs made of Python floats
    (dynamo passes a symbolic float as a float64 scalar tensor)."""

    def __init__(self):
        super().__init__()
        self.float_inputs = []

    def __call__(self, gm, inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and (isinstance(value, torch.SymFloat) or (
                    isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64)):
                self.float_inputs.append(node.name)
        return super().__call__(gm, inputs)


@pytest.mark.parametrize("geot_layer, pyg_layer, option, value", [
    (lambda: gnn.GATConv(12, 4, heads=2, negative_slope=0.3),
     lambda: pyg_nn.GATConv(12, 4, heads=2, negative_slope=0.3), "negative_slope", 0.05),
    (lambda: gnn.APPNP(K=2, alpha=0.2), lambda: pyg_nn.APPNP(K=2, alpha=0.2), "alpha", 0.6),
], ids=["gat-negative_slope", "appnp-alpha"])
def test_compile_dynamic_holds_float_options_as_constants(geot_layer, pyg_layer, option, value):
    """torch.compile(dynamic=True) makes a module's float a symbolic float,
    a CPU scalar tensor in the graph (inductor builds a C++ kernel for it,
    and dynamo traces again where an op cannot take it): geot's layers hold
    float options so that the graph has them as numbers, and a new value
    recompiles. Layers built and patched from PyG's alike; pickling and
    PyG's own layer (for TorchScript) keep PyG's attribute."""
    x, edge_index = torch.randn(40, 12), random_graph(40, 200, "cpu")
    for layer in (geot_layer(), gnn.patch(pyg_layer())):
        torch._dynamo.reset()
        recorder = _FloatInputRecorder()
        compiled = torch.compile(layer, dynamic=True, backend=recorder)
        torch.testing.assert_close(compiled(x, edge_index), layer(x, edge_index))
        assert recorder.float_inputs == []
        graphs = len(recorder.graphs)
        setattr(layer, option, value)
        assert getattr(layer, option) == value
        torch.testing.assert_close(compiled(x, edge_index), layer(x, edge_index))
        assert len(recorder.graphs) > graphs, "a new value recompiles"
        assert recorder.float_inputs == []
        assert getattr(pickle.loads(pickle.dumps(layer)), option) == value
        assert getattr(copy.deepcopy(layer), option) == value
        assert layer._as_pyg_layer().__dict__[option] == value


def _two_layer_gcns():
    """(a two-layer GCN of geot's layers, the same model of PyG's)"""
    class GCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = pyg_nn.GCNConv(12, 16), pyg_nn.GCNConv(16, 4)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    reference = GCN()
    return gnn.patch(copy.deepcopy(reference)), reference


def test_compiling_first_sorts_a_static_graph_once():
    """A model compiled before any eager call sorts its graph while dynamo
    traces, not in the compiled code, and keeps it (with the transposed index
    for training): no warning, no sort per call, one compilation per grad
    mode, PyG's results."""
    torch.manual_seed(0)
    model, reference = _two_layer_gcns()
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 12)
    torch._dynamo.reset()
    recorder = _CallRecorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.UncachedGraphWarning)
        for _ in range(3):
            out = compiled(x, edge_index)
            out.square().sum().backward()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, edge_index), reference(x, edge_index))
    reference(x, edge_index).square().sum().backward()
    torch.testing.assert_close(out, reference(x, edge_index))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, 3 * dict(reference.named_parameters())[name].grad)
    assert len(recorder.graphs) == 2 and recorder.sorts() == 0, recorder.graphs
    assert model.conv1._geot_graph[3].transposed is not None


def test_compiled_model_on_a_new_graph_every_call():
    """A layer's later graphs are sorted inside the compiled code (it warns
    once per compilation): PyG's results and gradients for each, no compilation per
    graph, and in training one sort per step for both layers (the
    partitioner torch.compile uses merges theirs) and no transposed index."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    torch.manual_seed(0)
    model, reference = _two_layer_gcns()
    x = torch.randn(60, 12)
    torch._dynamo.reset()
    recorder = _CallRecorder()  # of the forward graphs after AOTAutograd
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(
        fw_compiler=recorder, bw_compiler=lambda gm, inputs: gm.forward,
        partition_fn=min_cut_rematerialization_partition))
    compiled(x, random_graph(60, 300, "cpu")).sum().backward()  # the first graph: sorted while tracing
    with pytest.warns(gnn.UncachedGraphWarning, match="sorts edge_index"):
        compiled(x, random_graph(60, 300, "cpu")).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gnn.UncachedGraphWarning)  # again where shapes become dynamic
        for edges in (300, 300, 250, 320):
            edge_index = random_graph(60, edges, "cpu")
            model.zero_grad()
            reference.zero_grad()
            compiled(x, edge_index).square().sum().backward()
            reference(x, edge_index).square().sum().backward()
            for name, parameter in reference.named_parameters():
                torch.testing.assert_close(dict(model.named_parameters())[name].grad, parameter.grad)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, edge_index), reference(x, edge_index))
    assert len(recorder.graphs) <= 4, "the first graph, the later ones (and their dynamic shapes), inference"
    assert all(sum("sort" in target for target in graph) <= 1 for graph in recorder.graphs[:-1]), recorder.graphs


@requires_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_first_on_cuda_static_then_new_graphs(mode):
    """CUDA, inductor, CUDA graphs too: compiled before any eager call, a
    static graph's results and gradients are PyG's on every call, and so are
    those of new graphs given later (a CUDA graph never replays a stale
    sort)."""
    torch.manual_seed(0)
    model, reference = (m.cuda() for m in _two_layer_gcns())
    x = torch.randn(60, 12, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, mode=mode)
    graphs = [random_graph(60, 300, "cuda")] * 3 + [random_graph(60, 300, "cuda") for _ in range(3)]
    for edge_index in graphs:
        model.zero_grad()
        reference.zero_grad()
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(x, edge_index)
        out.square().sum().backward()
        expect = reference(x, edge_index)
        expect.square().sum().backward()
        torch.testing.assert_close(out, expect)
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, parameter.grad)


@pytest.mark.parametrize("make_layer", [
    lambda: gnn.SAGEConv(12, 4, aggr="mean"),  # projects before aggregating (4 < 12)
    lambda: gnn.SAGEConv(12, 16, aggr="max"),
    lambda: gnn.GINConv(torch.nn.Linear(12, 4)),
    lambda: gnn.GATConv(12, 4, heads=2),
    lambda: gnn.GATv2Conv(12, 4, heads=2),
    lambda: gnn.RGCNConv(12, 4, 3),
], ids=["sage-mean", "sage-max", "gin", "gat", "gatv2", "rgcn"])
def test_compile_fullgraph_layers_match_eager(make_layer):
    """Every layer traces whole (e2e.py compiles them with fullgraph=True),
    compiled before any eager call without sorting per call; aot_eager keeps
    it quick on CPU."""
    torch._dynamo.reset()
    layer = make_layer()
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 12, requires_grad=True)
    extra = (torch.randint(0, 3, (300,)),) if isinstance(layer, gnn.RGCNConv) else ()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gnn.UncachedGraphWarning)  # compiled first: sorted while tracing
        out = compiled(x, edge_index, *extra)
        out.sum().backward()
        with torch.no_grad():  # inference traces another graph (the op without autograd)
            torch.testing.assert_close(compiled(x, edge_index, *extra), layer(x, edge_index, *extra))
    torch.testing.assert_close(out, layer(x, edge_index, *extra))
    assert x.grad is not None


class _TwoLayers(torch.nn.Module):
    """Two layers with a ReLU between: later layers read the graph (and its derived values) the first kept."""

    def __init__(self, make_layer, relational: bool):
        super().__init__()
        self.convs = torch.nn.ModuleList([make_layer(12, 8), make_layer(8, 8)])
        self.relational = relational

    def forward(self, x, edge_index, edge_type=None):
        for conv in self.convs:
            x = torch.relu(conv(x, edge_index, edge_type) if self.relational else conv(x, edge_index))
        return x


@pytest.mark.parametrize("make_layer", [
    lambda a, b: gnn.GCNConv(a, b), lambda a, b: gnn.SAGEConv(a, b), lambda a, b: gnn.GINConv(torch.nn.Linear(a, b)),
    lambda a, b: gnn.RGCNConv(a, b, 3), lambda a, b: gnn.RGCNConv(12, 12, 3), lambda a, b: gnn.RGCNConv(a, b, 8),
], ids=["gcn", "sage", "gin", "rgcn", "rgcn-equal-widths", "rgcn-pairs"])  # pairs: nodes * relations > edges
@pytest.mark.parametrize("changing", [False, True], ids=["static", "changing"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
def test_compile_layer_stack(make_layer, changing, dynamic):
    """torch.compile, compiled before any eager call: a later layer reading what an earlier one kept traces
    without a guard failing on its own frame (GCN's norm and RGCN's relation ranges, made while dynamo
    traces: with dynamic=True on symbolic sizes; a later layer's after an earlier one read the graph's
    memo). A static graph compiles once; graphs of one step of other sizes once more (no recompile per
    node count)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    torch.manual_seed(0)
    relational = isinstance(make_layer(4, 4), gnn.RGCNConv)
    model = _TwoLayers(make_layer, relational)
    reference = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, dynamic=dynamic, backend=counter)
    frames = []
    for step in range(4):
        num_nodes = 60 + (7 * step if changing else 0)
        if changing or step == 0:
            edge_index = random_graph(num_nodes, 5 * num_nodes, "cpu")
            extra = (torch.randint(0, 3, (edge_index.size(1),)),) if relational else ()
        x = torch.randn(num_nodes, 12)
        x_mine, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gnn.UncachedGraphWarning)
            out = compiled(x_mine, edge_index, *extra)
        expect = reference(x_ref, edge_index.clone(), *extra)  # (a graph of its own: no memo shared)
        out.square().sum().backward()
        expect.square().sum().backward()
        torch.testing.assert_close(out, expect)
        torch.testing.assert_close(x_mine.grad, x_ref.grad)
        frames.append(counter.frame_count)
    assert frames == ([1, 2, 2, 2] if changing else [1, 1, 1, 1]), frames


@pytest.mark.parametrize("make_layer", [
    lambda: gnn.GCNConv(12, 4), lambda: gnn.SAGEConv(12, 4, aggr="mean"), lambda: gnn.SAGEConv(12, 16, aggr="max"),
    lambda: gnn.GINConv(torch.nn.Linear(12, 4)),
], ids=["gcn", "sage-mean", "sage-max", "gin"])
def test_compiled_inference_outlives_training(make_layer):
    """Inference compiled before any training call stays valid once training has given the graph its
    transposed index: an evaluation before training, then training and evaluation, compile twice."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    layer = make_layer()
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 12, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        compiled(x, edge_index)
    compiled(x, edge_index).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, edge_index), layer(x, edge_index))
    assert counter.frame_count == 2


@pytest.mark.parametrize("eager_first", [True, False], ids=["eager-first", "compiled-first"])
@pytest.mark.parametrize("channels,kept", [((12, 5), ["rgcn blocks", "rgcn block weights"]),
                                           ((8, 8), ["rgcn relation ranges"])], ids=["blocks", "ranges"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_compiled_rgcn_inference_takes_blocks(amp, channels, kept, eager_first, monkeypatch):
    """Compiled inference reads the relation blocks (or, at equal widths, ranges) kept with the graph, made
    by an eager call or, with none first, while dynamo traces (it cannot split the edges itself): same
    peak memory as eager, same result. Autocast at equal widths takes blocks (the matmul's dtype is not
    x's)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = gnn.RGCNConv(*channels, 3)  # 3 relations * C_out > C_in: blocks of one relation
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, channels[0])
    edge_type = torch.randint(0, 3, (edge_index.size(1),))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    if amp and channels[0] == channels[1]:
        kept = ["rgcn blocks", "rgcn block weights"]

    def one_table(*args):
        raise AssertionError("compiled inference built the whole projected table")

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        if eager_first:
            eager = layer(x, edge_index, edge_type)
        monkeypatch.setattr(gnn.RGCNConv, "_project_then_reduce", one_table)
        out = compiled(x, edge_index, edge_type)
        assert [key[0] for key in layer._geot_graph[3].memo] == kept
        monkeypatch.undo()
        if not eager_first:
            eager = layer(x, edge_index, edge_type)
        torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_rgcn_inference_in_ranges_starts_from_the_root_term(bias):
    """Compiled inference in relation ranges starts the output from x @ root (+ bias) and adds each
    relation into its rows: nothing is added to the output after the last relation (a root product made
    besides the output would raise the peak over eager's, which adds it in place)."""
    from torch._dynamo.backends.common import aot_autograd
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = gnn.RGCNConv(8, 8, 3, bias=bias)
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 8)
    edge_type = torch.randint(0, 3, (edge_index.size(1),))
    recorder = _CallRecorder()
    compiled = torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=recorder))
    with torch.no_grad():
        out = compiled(x, edge_index, edge_type)
        torch.testing.assert_close(out, layer(x, edge_index, edge_type))
    ops = recorder.graphs[-1]
    assert ops[-1] == "aten.slice_scatter.default" and ops.count("aten.slice_scatter.default") == 3, ops
    assert ops.index("aten.addmm.default" if bias else "aten.mm.default") < ops.index("aten.slice_scatter.default")


@pytest.mark.parametrize("x_requires_grad", [True, False], ids=["x-grad", "weights-only"])
@pytest.mark.parametrize("eager_first", [False, True], ids=["compiled-first", "eager-first"])
def test_compiled_rgcn_training_takes_relation_ranges(x_requires_grad, eager_first, monkeypatch):
    """Compiled training at equal widths reads the relation ranges kept with the graph, made by an eager
    call or while dynamo traces, as eager training does (one graph): same output and gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = gnn.RGCNConv(8, 8, 3, aggr="mean")
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 8, requires_grad=x_requires_grad)
    edge_type = torch.randint(0, 3, (edge_index.size(1),))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")

    def step(model):
        out = model(x, edge_index, edge_type)
        return out, torch.autograd.grad(out.square().sum(), ([x] if x_requires_grad else []) + [layer.weight])

    def one_table(*args):
        raise AssertionError("compiled training built the whole projected table")
    if eager_first:
        eager = step(layer)
    monkeypatch.setattr(gnn.RGCNConv, "_project_then_reduce", one_table)
    got = step(compiled)
    # the edges by source too, whether x takes a gradient or not (a later layer's x may)
    assert list(layer._geot_graph[3].memo) == [("rgcn relation ranges", 3), ("rgcn relation ranges", 3, "by source")]
    monkeypatch.undo()
    if not eager_first:
        eager = step(layer)
    torch.testing.assert_close(got, eager)


def test_compiled_two_layer_rgcn_training():
    """Two RGCN layers on one graph, compiled with no eager call first: the second layer's x takes a
    gradient, the first's not; they share the graph's ranges (a single compilation, no failed guard) and
    give eager's gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([gnn.RGCNConv(8, 8, 3), gnn.RGCNConv(8, 8, 3)])
    edge_index, x = random_graph(60, 300, "cpu"), torch.randn(60, 8)
    edge_type = torch.randint(0, 3, (edge_index.size(1),))

    def loss(x, edge_index, edge_type):
        return layers[1](layers[0](x, edge_index, edge_type).relu(), edge_index, edge_type).square().sum()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        got = torch.autograd.grad(compiled(x, edge_index, edge_type), list(layers.parameters()))
    want = torch.autograd.grad(loss(x, edge_index, edge_type), list(layers.parameters()))
    torch.testing.assert_close(got, want)


def test_accumulate_op():
    """geot::accumulate_ (the blocks' in-place sum in compiled code) passes torch's op checks."""
    total, part = torch.randn(5, 3), torch.randn(5, 3)
    expect = total + part
    torch.library.opcheck(torch.ops.geot.accumulate_, (total.clone(), part))
    torch.ops.geot.accumulate_(total, part)
    torch.testing.assert_close(total, expect)


def test_index_sum_plus_scaled_op(device):
    """geot::index_sum_plus_scaled (GIN's aggregation in inference)
    passes torch's op checks and adds (scale + scale_offset) * x to the sum of x[src]."""
    nodes, edges = 30, 200
    src = torch.randint(0, nodes, (edges,), device=device)
    dst = torch.randint(0, nodes, (edges,), device=device).sort().values
    x, scale = torch.randn(nodes, 5, device=device), torch.tensor([1.3], device=device)
    torch.library.opcheck(torch.ops.geot.index_sum_plus_scaled, (src, dst, x, scale))
    torch.library.opcheck(torch.ops.geot.index_sum_plus_scaled, (src, dst, x, scale), {"scale_offset": 1.0})
    expect = (1.3 * x.double()).index_add(0, dst, x.double().index_select(0, src))
    torch.testing.assert_close(torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale), expect.float())
    expect = (2.3 * x.double()).index_add(0, dst, x.double().index_select(0, src))
    torch.testing.assert_close(torch.ops.geot.index_sum_plus_scaled(src, dst, x, scale, scale_offset=1.0),
                               expect.float())


class _RecordedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a block of eager code dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gin_inference_is_one_op_then_nn(device):
    """GINConv's inference aggregation is one op that is passed eps and adds
    the 1 itself: no ``1 + eps`` op (a kernel launch per layer where small
    graphs are host-bound), nothing but the op before nn's Linear."""
    layer = gnn.GINConv(torch.nn.Linear(8, 8), eps=0.3, train_eps=True).to(device).eval()
    x, edge_index = torch.randn(20, 8, device=device), torch.randint(0, 20, (2, 60), device=device)
    with torch.no_grad():
        expect = layer(x, edge_index)  # the graph sorted and kept
        with _RecordedOps() as recorded:
            out = layer(x, edge_index)
    assert recorded.names == ["geot.index_sum_plus_scaled.default", "aten.t.default", "aten.addmm.default"]
    torch.testing.assert_close(out, expect)


@pytest.mark.parametrize("case", ["inference", "mlp", "train", "hooked", "autocast", "no-bias", "mlp-norm"])
def test_gin_inference_takes_linear_and_relu_as_one_gemm(device, case):
    """In inference GINConv's nn of Linear, ReLU, ... (a Sequential, or PyG's
    two-layer MLP as its GIN model builds it) takes the first two as one
    GEMM with the ReLU in its epilogue (no ReLU pass over [N, hidden]); a
    call recording gradients, a hooked ReLU, autocast, a Linear without bias
    and an MLP with a norm call each module. Results PyG's, up to rounding."""
    if case.startswith("mlp"):
        mlp = pyg_nn.MLP([12, 16, 8], norm="batch_norm" if case == "mlp-norm" else None)
        layer, pyg_layer = gnn.GINConv(copy.deepcopy(mlp)), pyg_nn.GINConv(mlp)  # (each resets its nn)
        layer.load_state_dict(pyg_layer.state_dict())
        layer, pyg_layer = layer.to(device).double().eval(), pyg_layer.to(device).double().eval()
    else:
        layer, pyg_layer = build_pair(gnn.GINConv, pyg_nn.GINConv, (), {}, device)
    if case == "no-bias":
        for mlp in (layer.nn, pyg_layer.nn):
            mlp[0].bias = None
    if case == "hooked":
        layer.nn[1].register_forward_hook(lambda module, inputs, output: None)
    dtype = torch.float32 if case == "autocast" else torch.float64  # (autocast leaves float64 alone)
    layer, pyg_layer = layer.to(dtype), pyg_layer.to(dtype)
    x = torch.randn(20, 12, device=device, dtype=dtype, requires_grad=case == "train")
    edge_index = random_graph(20, 60, device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case == "autocast")
    with torch.set_grad_enabled(case == "train"), autocast:
        layer(x, edge_index)  # the graph sorted and kept
        with _RecordedOps() as recorded:
            out = layer(x, edge_index)
        expect = pyg_layer(x, edge_index)
    fused = "aten._addmm_activation.default" in recorded.names
    assert fused == (case in ("inference", "mlp")), recorded.names
    assert ("aten.relu.default" in recorded.names) != fused, recorded.names
    if case != "autocast":  # (there x is cast before the sum: see test_gin_inference_under_autocast_sums_cast_x)
        torch.testing.assert_close(out, expect)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "train"])
def test_sage_projection_takes_its_relu_in_the_gemm(device, grad):
    """SAGEConv(project=True) in inference projects the sources with the
    ReLU in the GEMM's epilogue; training keeps the two ops. Results and
    gradients PyG's."""
    layer, pyg_layer = build_pair(gnn.SAGEConv, pyg_nn.SAGEConv, (12, 16), {"project": True}, device)
    x = torch.randn(20, 12, device=device, dtype=torch.float64, requires_grad=grad)
    edge_index = random_graph(20, 60, device)
    with torch.set_grad_enabled(grad):
        layer(x, edge_index)  # the graph sorted and kept
        with _RecordedOps() as recorded:
            out = layer(x, edge_index)
        expect = pyg_layer(x, edge_index)
    assert ("aten._addmm_activation.default" in recorded.names) != grad, recorded.names
    torch.testing.assert_close(out, expect)
    if grad:
        assert_same_gradients(out, expect, x, layer, pyg_layer)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "train"])
@pytest.mark.parametrize("variant", ["plain", "batch-norm", "dropout"])
def test_gin_with_pygs_mlp_sums_its_narrower_projection(monkeypatch, device, grad, variant):
    """GINConv with PyG's two-layer MLP (torch_geometric.nn.models.GIN's)
    whose first Linear narrows sums that Linear's projections, as with a
    Sequential; with a norm in between, or a dropout in training, it sums x.
    Results and gradients PyG's up to rounding."""
    mlp = pyg_nn.MLP([12, 4, 4], norm="batch_norm" if variant == "batch-norm" else None,
                     dropout=0.5 if variant == "dropout" else 0.0)
    layer, pyg_layer = gnn.GINConv(copy.deepcopy(mlp), train_eps=True), pyg_nn.GINConv(mlp, train_eps=True)
    layer.load_state_dict(pyg_layer.state_dict())
    layer, pyg_layer = layer.to(device).double(), pyg_layer.to(device).double()
    widths = []
    summed = gnn.GINConv._sum
    monkeypatch.setattr(gnn.GINConv, "_sum", lambda self, graph, x_src, *rest: (widths.append(x_src.size(-1)),
                                                                                summed(self, graph, x_src, *rest))[1])
    x = torch.randn(20, 12, device=device, dtype=torch.float64, requires_grad=grad)
    edge_index = random_graph(20, 60, device)
    layer.train(grad), pyg_layer.train(grad)
    with torch.set_grad_enabled(grad):
        torch.manual_seed(1)  # the same dropout masks for both
        out = layer(x, edge_index)
        torch.manual_seed(1)
        expect = pyg_layer(x, edge_index)
    assert widths == [12 if variant == "batch-norm" or (variant == "dropout" and grad) else 4]
    torch.testing.assert_close(out, expect)
    if grad:
        assert_same_gradients(out, expect, x, layer, pyg_layer)


@pytest.mark.parametrize("name,kwargs", [("SAGEConv", {}), ("SAGEConv", {"aggr": "max"}), ("GraphConv", {}),
                                         ("ClusterGCNConv", {})], ids=["sage", "sage-max", "graph", "cluster-gcn"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "train"])
def test_root_term_adds_in_the_gemm(device, name, kwargs, grad):
    """Eager layers whose output is ``lin(aggregate) + lin_root(x)`` add the
    root product into the first one's buffer in its GEMM (addmm_): no add
    pass over [N, out] (1 GB of traffic at 10^6 rows, 128 features); results
    and gradients PyG's up to rounding."""
    layer, pyg_layer = build_pair(getattr(gnn, name), getattr(pyg_nn, name), (8, 8), kwargs, device)
    x = torch.randn(20, 8, device=device, dtype=torch.float64, requires_grad=grad)
    edge_index = random_graph(20, 60, device)
    with torch.set_grad_enabled(grad):
        layer(x, edge_index)  # the graph sorted and kept
        with _RecordedOps() as recorded:
            out = layer(x, edge_index)
        expect = pyg_layer(x, edge_index)
    assert "aten.addmm_.default" in recorded.names and "aten.add.Tensor" not in recorded.names, recorded.names
    torch.testing.assert_close(out, expect)
    if grad:
        assert_same_gradients(out, expect, x, layer, pyg_layer)


def test_linear_pair_op(device):
    """geot::linear_pair (SAGE's two projections in compiled inference) passes torch's op checks."""
    x, weight, other, bias = (torch.randn(*shape, device=device) for shape in ((7, 5), (3, 5), (4, 5), (4,)))
    torch.library.opcheck(torch.ops.geot.linear_pair, (x, weight, other, bias))
    projected, root = torch.ops.geot.linear_pair(x, weight, other, None)
    torch.testing.assert_close(projected, x @ weight.T)
    torch.testing.assert_close(root, x @ other.T)


@pytest.mark.parametrize("make_layer,op", [
    (lambda: gnn.GINConv(torch.nn.Linear(12, 4), eps=0.3), "index_sum_plus_scaled"),
    (lambda: gnn.SAGEConv(12, 4), "linear_pair"),
], ids=["gin", "sage"])
def test_compiled_inference_takes_one_op_for_peak_memory(make_layer, op):
    """Compiled inference takes GIN's sum and (1 + eps) x, and SAGE's two
    projections, as one op each (peak memory: see the ops) and matches
    eager; with gradients the layers keep their plain ops."""
    layer = make_layer()
    edge_index = random_graph(60, 300, "cpu")
    for grad in (False, True):
        x = torch.randn(60, 12, requires_grad=grad)
        torch._dynamo.reset()
        calls = []

        def backend(gm, inputs):
            calls.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward

        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        with torch.set_grad_enabled(grad):
            eager = layer(x.relu(), edge_index)
            torch.testing.assert_close(compiled(x.relu(), edge_index), eager)
        assert any(op in call for call in calls) != grad, calls


@pytest.mark.parametrize("aggr", ["mean", "max"])
def test_sage_inference_under_autocast_aggregates_cast_x(monkeypatch, device, aggr):
    """Where SAGE aggregates first (out_channels >= in_channels), in
    inference under autocast it aggregates x cast to the autocast dtype (its
    Linears would cast the aggregate and x): a max aggregates PyG's rows, a
    mean differs by the rounding of x (error norm near PyG's under
    autocast); training aggregates float32 x, as PyG. (The root product adds
    into lin_l's in its GEMM, one bf16 rounding fewer than PyG's add.)"""
    geot_layer, pyg_layer = build_pair(gnn.SAGEConv, pyg_nn.SAGEConv, (12, 16), {"aggr": aggr}, device)
    geot_layer, pyg_layer = geot_layer.float(), pyg_layer.float()
    edge_index, x = random_graph(200, 1500, device), torch.randn(200, 12, device=device)
    aggregated = record_aggregated_dtypes(monkeypatch)
    got, pyg_amp, ref = bf16_inference(geot_layer, pyg_layer, x, edge_index, device)
    assert aggregated == [torch.bfloat16]
    if aggr == "max":  # within a rounding of PyG's bf16 sum
        torch.testing.assert_close(got.float(), pyg_amp.float(), rtol=2 ** -7, atol=2 ** -7 * pyg_amp.abs().max())
    assert (got.float() - ref).norm() <= 1.5 * (pyg_amp.float() - ref).norm()
    with torch.autocast(device, dtype=torch.bfloat16):
        geot_layer(x, edge_index)
    assert aggregated == [torch.bfloat16, torch.float32], "training keeps the float32 aggregate"


def test_cora_accuracy_matches_pyg():
    data = load_dataset("cora")
    if data is None:
        pytest.skip("cora.npz not found (see geot.data.data_dirs)")
    from geot.demo import train_gcn

    accuracies = {}
    for layer_class in (pyg_nn.GCNConv, gnn.GCNConv):
        torch.manual_seed(0)
        accuracies[layer_class] = train_gcn(data, layer_class, epochs=200)[1]
    pyg_acc, geot_acc = accuracies[pyg_nn.GCNConv], accuracies[gnn.GCNConv]
    assert geot_acc > 0.78, f"geot GCN reached {geot_acc:.3f} on Cora"
    assert abs(geot_acc - pyg_acc) <= 0.01, f"geot {geot_acc:.3f} vs PyG {pyg_acc:.3f}"


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("num_edges", [0, 1, 150])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_gather_reduce_of_a_graph_in_input_order(reduce, weighted, num_edges, traced, device, monkeypatch):
    """A graph of one step left unsorted (what a layer summing in any order
    gets on CUDA) reduces with atomics: the float64 reference's values, and
    gradcheck's gradients for x and the edge weights, both in eager code (a
    C++ autograd node, twice differentiable) and as tracers see it (an
    autograd.Function)."""
    from geot import _ops
    from geot.nn.common import gather_reduce
    from geot.nn.graph import _unordered
    if traced:
        monkeypatch.setattr(_ops, "eager_autograd", lambda *tensors: False)
    edge_index = torch.randint(0, 20, (2, num_edges), device=device)
    graph = _unordered(edge_index, flipped=False)._replace(deferred=False)  # ids known valid: no device check
    assert not graph.ordered
    x = torch.randn(20, 3, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.rand(num_edges, dtype=torch.float64, device=device, requires_grad=True) if weighted else None
    src, dst = edge_index
    messages = x[src] * (1 if weight is None else weight[:, None])
    expect = torch.zeros(25, 3, dtype=torch.float64, device=device).index_add(0, dst, messages)
    if reduce == "mean":
        expect = expect / torch.bincount(dst, minlength=25).clamp(min=1)[:, None]
    torch.testing.assert_close(gather_reduce(graph, x, reduce, 25, weight), expect)
    inputs = (x,) if weight is None else (x, weight)
    assert torch.autograd.gradcheck(lambda *t: gather_reduce(graph, t[0], reduce, 25, *t[1:]), inputs)
    if not traced:
        assert torch.autograd.gradgradcheck(lambda *t: gather_reduce(graph, t[0], reduce, 25, *t[1:]), inputs)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_gather_reduce_in_input_order_with_a_weight_per_head(reduce, device):
    """Weights [E, H] over rows [N, H, C]: each head's rows scaled by its own weight, both gradients checked."""
    from geot.nn.common import gather_reduce
    from geot.nn.graph import _unordered
    edge_index = torch.randint(0, 9, (2, 40), device=device)
    graph = _unordered(edge_index, flipped=False)._replace(deferred=False)
    x = torch.randn(9, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.rand(40, 2, dtype=torch.float64, device=device, requires_grad=True)
    src, dst = edge_index
    expect = torch.zeros(11, 2, 3, dtype=torch.float64, device=device).index_add(0, dst, x[src] * weight[..., None])
    if reduce == "mean":
        expect = expect / torch.bincount(dst, minlength=11).clamp(min=1)[:, None, None]
    torch.testing.assert_close(gather_reduce(graph, x, reduce, 11, weight), expect)
    assert torch.autograd.gradcheck(lambda x, w: gather_reduce(graph, x, reduce, 11, w), (x, weight))


def test_mean_in_input_order_of_half_rows_counts_in_float32(device):
    """A hub's edge count past bf16's integers (256) still divides exactly."""
    from geot.nn.common import gather_reduce
    from geot.nn.graph import _unordered
    edge_index = torch.stack([torch.arange(1000, device=device) % 7, torch.zeros(1000, dtype=torch.long,
                                                                                 device=device)])
    graph = _unordered(edge_index, flipped=False)._replace(deferred=False)
    x = torch.ones(7, 4, dtype=torch.bfloat16, device=device)
    assert (gather_reduce(graph, x, "mean", 2, None)[0] == 1).all()


@requires_cuda
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_graph_of_one_step_left_unsorted_only_when_small(large, monkeypatch):
    """A SAGE layer's second graph (a new graph every step) on CUDA is summed
    in input order up to UNORDERED_MAX_EDGES edges and sorted past it (hubs'
    atomics cost more than the sort); both give PyG's result."""
    from geot.nn import graph as graph_module
    monkeypatch.setattr(graph_module, "UNORDERED_MAX_EDGES", 50)
    torch.manual_seed(0)
    conv = gnn.SAGEConv(8, 4).cuda()
    reference = pyg_nn.SAGEConv(8, 4).cuda()
    reference.load_state_dict(conv.state_dict())
    x = torch.randn(30, 8, device="cuda")
    conv(x, torch.randint(0, 30, (2, 40), device="cuda"))  # the layer's first graph
    edge_index = torch.randint(0, 30, (2, 80 if large else 40), device="cuda")
    torch.testing.assert_close(conv(x, edge_index), reference(x, edge_index))
    assert graph_module._shared_lookup(edge_index, (None, 0, False, False, False), None).ordered == large


INTROSPECTED = ["GCNConv", "SAGEConv", "GINConv", "GATConv", "GATv2Conv", "RGCNConv", "RGATConv", "HGTConv",
                "TransformerConv", "APPNP", "SGConv", "GraphConv", "ChebConv", "SimpleConv"]


@pytest.mark.parametrize("name", INTROSPECTED)
def test_layer_class_introspects_as_pyg(name):
    """What code reads of a layer class to tell what it supports (PyG's
    cheatsheet: the paper in the docstring, the inputs in forward's
    annotations, static graphs from __init__'s source; PyG's Inspector: the
    arguments forward passes to propagate) is PyG's; geot's notes follow
    PyG's docstring."""
    import inspect

    from torch_geometric.inspector import Inspector

    from geot.nn.generic import geot_class

    pyg_class = getattr(pyg_nn, name)
    mine = getattr(gnn, name) if hasattr(gnn, name) else geot_class(pyg_class)
    assert mine is not pyg_class and issubclass(mine, pyg_class)
    assert inspect.getdoc(mine).startswith(inspect.cleandoc(pyg_class.__doc__))
    assert str(inspect.signature(mine.forward)) == str(inspect.signature(pyg_class.forward))
    assert inspect.signature(mine) == inspect.signature(pyg_class)
    assert inspect.getsource(mine.__init__) == inspect.getsource(pyg_class.__init__)
    for method in ("propagate", "edge_updater"):  # what PyG's Inspector parses from forward's source
        excluded = [0, "edge_index", "size"]  # as MessagePassing asks
        assert (Inspector(mine).get_params_from_method_call(method, exclude=excluded)
                == Inspector(pyg_class).get_params_from_method_call(method, exclude=excluded)), method
    layer = mine(*INTROSPECTION_ARGS.get(name, (4, 4)))  # the generated constructor still builds geot's layer
    assert layer._geot_graph is None


# Constructor arguments of the layers whose signature is not (in_channels, out_channels).
INTROSPECTION_ARGS = {"GINConv": (torch.nn.Linear(4, 4),), "APPNP": (2, 0.1), "SimpleConv": (),
                      "ChebConv": (4, 4, 2), "RGCNConv": (4, 4, 2), "RGATConv": (4, 4, 2),
                      "HGTConv": (4, 4, (["a"], [("a", "to", "a")]))}


def test_user_subclass_keeps_its_own_docstring_and_signature():
    import inspect

    class MyConv(gnn.GCNConv):
        """Mine."""

        def forward(self, x, edge_index):  # noqa: D102
            return super().forward(x, edge_index)

    assert MyConv.__doc__ == "Mine."
    assert list(inspect.signature(MyConv.forward).parameters) == ["self", "x", "edge_index"]
    x, edge_index = torch.randn(5, 4), torch.tensor([[0, 1, 2], [1, 2, 3]])
    assert MyConv(4, 3)(x, edge_index).shape == (5, 3)
