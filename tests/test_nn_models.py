"""geot.nn.patch on PyG's model classes (torch_geometric.nn.models: GCN,
GraphSAGE, GIN, GAT and their options), as users build models: the patched
copy runs its convolutions on geot (no GeotFallbackWarning) and gives the
PyG model's outputs and parameter gradients, float64; models whose layers
geot has no version of (PNA, EdgeCNN) keep working unchanged."""
import copy
import warnings

import pytest
import torch

models = pytest.importorskip("torch_geometric.nn.models")
import geot.nn as gnn  # noqa: E402
from reference import graph_with_duplicates  # noqa: E402
from torch_geometric.nn.conv import MessagePassing  # noqa: E402

NUM_NODES, IN_CHANNELS = 40, 8
F64 = {"rtol": 1e-7, "atol": 1e-9}


def random_graph(device):
    """x [N, C] float64 and an edge_index in random order with duplicated edges and self loops."""
    x = torch.randn(NUM_NODES, IN_CHANNELS, dtype=torch.float64, device=device)
    return x, graph_with_duplicates(NUM_NODES, NUM_NODES, 200, device)


def sampled_hops(device):
    """A NeighborLoader-ordered batch of 10 seeds and two hops of 15 nodes: hop k's edges go from the
    nodes of hop k + 1 to those of hop k, hop 0's first (trim_to_layer's input)."""
    starts, edges = [0, 10, 25, 40], [60, 80]
    hops = [torch.stack([torch.randint(starts[k + 1], starts[k + 2], (edges[k],), device=device),
                         torch.randint(starts[k], starts[k + 1], (edges[k],), device=device)]) for k in range(2)]
    return torch.cat(hops, 1), dict(num_sampled_nodes_per_hop=[10, 15, 15], num_sampled_edges_per_hop=edges)


def assert_patched_matches(make, call, converted=True):
    """A float64 model and its patched copy: the same outputs and parameter gradients; with `converted`,
    every conv is a geot layer and no call falls back to PyG's forward."""
    reference = make().double().eval()
    patched = gnn.patch(copy.deepcopy(reference))
    convs = [m for m in patched.modules() if isinstance(m, MessagePassing)]
    if converted:
        assert convs and all(type(m).__module__.startswith("geot.") for m in convs), [type(m) for m in convs]
    expected = call(reference)
    expected.square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error" if converted else "ignore", gnn.GeotFallbackWarning)
        out = call(patched)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, **F64)
    for (name, p_ref), (_, p_out) in zip(reference.named_parameters(), patched.named_parameters()):
        assert (p_ref.grad is None) == (p_out.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p_out.grad, p_ref.grad, **F64, msg=lambda m, name=name: f"{name}: {m}")


BASIC = {"GCN": {}, "GraphSAGE": {}, "GIN": {}, "GAT": {"heads": 2}}


# Each jumping-knowledge mode once, each norm with two of them.
@pytest.mark.parametrize("jk,norm", [(None, None), ("last", "batch_norm"), ("cat", "layer_norm"), ("max", None),
                                     ("lstm", "batch_norm")])
@pytest.mark.parametrize("out_channels", [None, 5])
@pytest.mark.parametrize("model", list(BASIC))
def test_basic_gnn_options(device, model, jk, norm, out_channels):
    x, edge_index = random_graph(device)
    cls = getattr(models, model)
    # cuDNN's LSTM has no backward in eval mode (the models are compared in eval mode: no dropout)
    with torch.backends.cudnn.flags(enabled=False):
        assert_patched_matches(
            lambda: cls(IN_CHANNELS, 16, 3, out_channels, jk=jk, norm=norm, **BASIC[model]).to(device),
            lambda m: m(x, edge_index))


def test_gcn_edge_weight(device):
    x, edge_index = random_graph(device)
    weight = torch.rand(edge_index.size(1), dtype=torch.float64, device=device)
    if device == "cuda":
        # PyG keeps one weight of a node's repeated self loops (the last on CPU), on CUDA an arbitrary one
        # (an index_put with repeated indices): there a node's loops weigh the same.
        loop_weight = torch.rand(x.size(0), dtype=torch.float64, device=device)[edge_index[0]]
        weight = torch.where(edge_index[0] == edge_index[1], loop_weight, weight)
    assert_patched_matches(lambda: models.GCN(IN_CHANNELS, 16, 2).to(device),
                           lambda m: m(x, edge_index, edge_weight=weight))


@pytest.mark.parametrize("options", [dict(edge_dim=3), dict(v2=True, heads=2), dict(heads=2, concat=False),
                                     dict(v2=True, edge_dim=3, heads=2)], ids=str)
def test_gat_options(device, options):
    x, edge_index = random_graph(device)
    edge_attr = torch.randn(edge_index.size(1), 3, dtype=torch.float64, device=device)
    call = (lambda m: m(x, edge_index, edge_attr=edge_attr)) if "edge_dim" in options else (lambda m: m(x, edge_index))
    assert_patched_matches(lambda: models.GAT(IN_CHANNELS, 16, 2, **options).to(device), call)


@pytest.mark.parametrize("model", list(BASIC))
def test_trim_to_layer(device, model):
    """Sampled hops: each layer drops the last hop's edges and nodes (a new graph every layer)."""
    x, _ = random_graph(device)
    edge_index, hops = sampled_hops(device)
    assert_patched_matches(lambda: getattr(models, model)(IN_CHANNELS, 16, 2, **BASIC[model]).to(device),
                           lambda m: m(x, edge_index, **hops)[:10])


@pytest.mark.parametrize("model", ["PNA", "EdgeCNN"])
def test_models_without_geot_layers_unchanged(device, model):
    x, edge_index = random_graph(device)
    options = {"PNA": dict(aggregators=["mean", "max"], scalers=["identity"], deg=torch.tensor([0, 5, 10, 5]))}
    assert_patched_matches(lambda: getattr(models, model)(IN_CHANNELS, 16, 2, **options.get(model, {})).to(device),
                           lambda m: m(x, edge_index), converted=False)


def test_patched_graphsage_compiled_first():
    """The user's flow: patch, then torch.compile with no eager call; a second graph, then the first again."""
    torch.manual_seed(0)
    reference = models.GraphSAGE(IN_CHANNELS, 16, 2, jk="cat", norm="batch_norm").eval()
    compiled = torch.compile(gnn.patch(copy.deepcopy(reference)))
    graphs = [random_graph("cpu") for _ in range(2)]
    with pytest.warns(gnn.UncachedGraphWarning):  # the second graph: sorted inside the compiled code (documented)
        for x, edge_index in graphs + graphs[:1]:
            x = x.float()
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, edge_index), reference(x, edge_index), rtol=1e-5, atol=1e-5)
