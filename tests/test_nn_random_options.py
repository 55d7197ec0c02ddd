"""geot.nn.patch against PyG over random combinations of each layer's
options and inputs (float64): the output and the gradients of x, of the
per-edge inputs and of the parameters equal PyG's. Combinations are drawn
from PyG's documented constructor options and input kinds: one x or a
bipartite pair with or without ``size``, static graphs [B, N, F],
int32/int64 ``edge_index``, an ``EdgeIndex``, a torch.sparse ``adj_t``,
either ``flow``, edge weights and features, attention weights returned, no
edges, duplicated edges and self loops, train and eval mode. Where geot runs
PyG's forward (a GeotFallbackWarning), the reference is PyG's call on the
same inputs; elsewhere PyG's call with int64 ids (PyG 2.8 gets some
gradients wrong for int32 ids: torch's scatter mean)."""
import copy
import random
import warnings

import pytest
import torch

pyg_nn = pytest.importorskip("torch_geometric.nn")
import geot.nn as gnn  # noqa: E402
from torch_geometric import EdgeIndex  # noqa: E402
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csr_tensor  # noqa: E402

TRIALS = 60  # per seed


def _gin(i, o, pick):
    nn = torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o))
    return pyg_nn.GINConv(nn, eps=pick(0.0, 0.5), train_eps=pick(False, True))


# name: (make(in, out, pick) -> PyG layer; takes edge weights, edge features, pairs, static graphs, a sparse adj_t)
LAYERS = {
    "gcn": (lambda i, o, p: pyg_nn.GCNConv(i, o, improved=p(False, True), cached=p(False, False, True),
                                           add_self_loops=p(True, True, False), normalize=p(True, True, False),
                                           bias=p(True, False)), "weight", False, True, True),
    "sage": (lambda i, o, p: pyg_nn.SAGEConv(p(i, -1), o, aggr=p("mean", "sum", "max", "min"),
                                             normalize=p(False, True), root_weight=p(True, False),
                                             project=p(False, False, True), bias=p(True, False)),
             None, True, True, True),
    "gin": (_gin, None, True, True, True),
    "gat": (lambda i, o, p: pyg_nn.GATConv(p(i, -1), o, heads=p(1, 2, 3), concat=p(True, False),
                                           negative_slope=p(0.2, 0.05), add_self_loops=p(True, True, False),
                                           bias=p(True, False), residual=p(False, True),
                                           fill_value=p("mean", "add", 0.5), edge_dim=p(None, 1, 2)),
            "attr", True, False, True),
    "gatv2": (lambda i, o, p: pyg_nn.GATv2Conv(p(i, -1), o, heads=p(1, 2), concat=p(True, False),
                                               add_self_loops=p(True, False), share_weights=p(False, True),
                                               bias=p(True, False), residual=p(False, True), edge_dim=p(None, 2)),
              "attr", True, False, True),
    "transformer": (lambda i, o, p: pyg_nn.TransformerConv(i, o, heads=p(1, 2), concat=p(True, False),
                                                           beta=p(False, True), root_weight=p(True, False),
                                                           bias=p(True, False), edge_dim=p(None, 2)),
                    "attr", True, False, True),
    "graphconv": (lambda i, o, p: pyg_nn.GraphConv(i, o, aggr=p("add", "mean", "max"), bias=p(True, False)),
                  "weight", True, True, True),
    "tag": (lambda i, o, p: pyg_nn.TAGConv(i, o, K=p(1, 2, 3), normalize=p(True, False), bias=p(True, False)),
            "weight", False, True, True),
    "sg": (lambda i, o, p: pyg_nn.SGConv(i, o, K=p(1, 2), cached=p(False, True), add_self_loops=p(True, False),
                                         bias=p(True, False)), "weight", False, True, True),
    "appnp": (lambda i, o, p: pyg_nn.APPNP(K=p(1, 3), alpha=p(0.1, 0.5), cached=p(False, True),
                                           add_self_loops=p(True, False), normalize=p(True, False)),
              "weight", False, True, True),
    "cheb": (lambda i, o, p: pyg_nn.ChebConv(i, o, p(1, 2, 3), normalization=p("sym", "rw", None), bias=p(True, False)),
             "weight", False, True, True),
    "lg": (lambda i, o, p: pyg_nn.LGConv(normalize=p(True, False)), "weight", False, True, True),
    "simple": (lambda i, o, p: pyg_nn.SimpleConv(aggr=p("sum", "mean", "max"), combine_root=p(None, "sum", "cat")),
               "weight", True, True, True),
    "clustergcn": (lambda i, o, p: pyg_nn.ClusterGCNConv(i, o, diag_lambda=p(0.0, 0.3),
                                                         add_self_loops=p(True, False), bias=p(True, False)),
                   None, False, True, False),
}
ATTENTION = ("gat", "gatv2", "transformer")  # no flow option exercised (PyG's attention layers check it)


def edges(num_src, num_dst, pick):
    """[2, E] ids, E in {0, 1, 5, 40}, with duplicated edges and self loops half the time."""
    count = pick(0, 1, 5, 40)
    src, dst = torch.randint(0, num_src, (count,)), torch.randint(0, num_dst, (count,))
    if count and pick(False, True):
        loops = torch.randint(0, min(num_src, num_dst), (3,))
        src, dst = torch.cat([src, src[:2], loops, loops]), torch.cat([dst, dst[:2], loops, loops])
    return torch.stack([src, dst])


def draw_call(name, pick):
    """(PyG layer, x, graph input, kwargs) of one random call, or None where the draw makes no call."""
    make, per_edge, pairs, static_ok, sparse_ok = LAYERS[name]
    width, out = pick(3, 4), pick(2, 4)
    flow = "source_to_target" if name in ATTENTION or name == "cheb" else pick("source_to_target", "target_to_source")
    try:
        layer = make(width, out, pick)
    except ValueError:  # options PyG's constructor rejects together
        return None
    layer.flow = flow
    paired = pairs and pick(False, True)
    num_src, num_dst = 7, (5 if paired else 7)
    edge_index = edges(num_src, num_dst, pick)
    num_edges = edge_index.size(1)
    kwargs = {}
    if paired:
        x = (torch.randn(num_src, width), pick(torch.randn(num_dst, width), None))
        if x[1] is None or pick(False, True):
            kwargs["size"] = (num_src, num_dst)
    else:
        static = static_ok and pick(False, False, True)
        x = torch.randn(3, num_src, width) if static else torch.randn(num_src, width)
    if per_edge == "weight" and pick(False, True):  # one weight per (source, destination): copies share it
        kwargs["edge_weight"] = torch.rand(num_src)[edge_index[0]] + torch.rand(num_dst)[edge_index[1]] + 0.1
    edge_dim = getattr(layer, "edge_dim", None)
    if per_edge == "attr" and edge_dim is not None:
        vector = edge_dim == 1 and pick(False, True)  # a [E] vector for edge_dim 1
        kwargs["edge_attr"] = torch.randn(num_edges) if vector else torch.randn(num_edges, edge_dim)
    if name in ATTENTION and pick(False, False, True):
        kwargs["return_attention_weights"] = True
    kind = pick("plain", "int32", "EdgeIndex", "sparse" if sparse_ok and flow == "source_to_target" else "plain")
    if flow == "target_to_source":
        edge_index = edge_index.flip(0)
    if kind == "int32":
        edge_index = edge_index.int()
    elif kind == "EdgeIndex" and not paired and flow == "source_to_target":
        order = torch.argsort(edge_index[1], stable=True)
        edge_index = EdgeIndex(edge_index[:, order], sparse_size=(num_src, num_dst), sort_order="col")
        kwargs = {k: (v[order] if k in ("edge_weight", "edge_attr") else v) for k, v in kwargs.items()}
    elif kind == "sparse" and "edge_attr" not in kwargs and "return_attention_weights" not in kwargs:
        convert = pick(to_torch_csr_tensor, to_torch_coo_tensor)
        edge_index = convert(edge_index.flip(0), kwargs.pop("edge_weight", None), size=(num_dst, num_src))
        kwargs.pop("size", None)
    layer.train(pick(False, True))
    return layer, x, edge_index, kwargs


def leaves_of(x, kwargs):
    """x and the per-edge float inputs as fresh leaves requiring grad."""
    def leaf(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided:
            return t.detach().clone().requires_grad_()
        return t
    x = tuple(leaf(t) for t in x) if isinstance(x, tuple) else leaf(x)
    return x, {k: leaf(v) for k, v in kwargs.items()}


def materialized_as(layer, reference, x, edge_index, kwargs) -> bool:
    """A lazy layer (in_channels -1) given its parameters by a call, then the reference's values; whether
    that call ran PyG's forward (a layer warns once per reason: the compared call then does not)."""
    if not any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in layer.parameters()):
        return False
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        layer(x, edge_index, **kwargs)
    layer.load_state_dict(reference.state_dict())
    return any(issubclass(w.category, gnn.GeotFallbackWarning) for w in caught)


def call(layer, x, edge_index, kwargs):
    """(output, attention weights or None, gradients of the leaves and the parameters); twice, so that
    a cached layer's second call (which reads its cache) is the one compared."""
    for _ in range(2):
        xs, kw = leaves_of(x, kwargs)
        result = layer(xs, edge_index, **kw)
    out, attention = result if isinstance(result, tuple) else (result, None)
    inputs = [t for t in (list(xs) if isinstance(xs, tuple) else [xs]) + list(kw.values())
              if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in layer.parameters() if not isinstance(p, torch.nn.parameter.UninitializedParameter)]
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), inputs + params, allow_unused=True)
    return out.detach(), attention, grads


def assert_same(got, want, what):
    out, attention, grads = got
    torch.testing.assert_close(out, want[0], rtol=1e-7, atol=1e-9, equal_nan=True, msg=lambda m: f"{what}: {m}")
    if want[1] is not None:
        assert torch.equal(attention[0], want[1][0]), what
        torch.testing.assert_close(attention[1].detach(), want[1][1].detach(), rtol=1e-7, atol=1e-9)
    for index, (g, w) in enumerate(zip(grads, want[2])):
        if g is None or w is None:
            assert not (g if g is not None else w if w is not None else torch.zeros(1)).any(), f"{what}: grad {index}"
        else:
            torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9, equal_nan=True,
                                       msg=lambda m: f"{what}: gradient {index}: {m}")


@pytest.mark.parametrize("seed", range(6))
def test_random_options_match_pyg(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pick = lambda *choices: rng.choice(choices)  # noqa: E731
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for trial in range(TRIALS):
            name = rng.choice(list(LAYERS))
            draw = draw_call(name, pick)
            if draw is None:
                continue
            pyg_layer, x, edge_index, kwargs = draw
            same_ids, geot_layer = copy.deepcopy(pyg_layer), gnn.patch(copy.deepcopy(pyg_layer))
            ids64 = edge_index.long() if type(edge_index) is torch.Tensor and edge_index.layout == torch.strided \
                else edge_index
            try:
                want = call(pyg_layer, x, ids64, kwargs)
            except Exception:
                continue  # PyG itself rejects the draw
            materialized_as(same_ids, pyg_layer, x, edge_index, kwargs)
            fell_back = materialized_as(geot_layer, pyg_layer, x, edge_index, kwargs)
            what = f"seed {seed} trial {trial}: {name} {pyg_layer} flow={pyg_layer.flow} {type(edge_index).__name__}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = call(geot_layer, x, edge_index, kwargs)
            fell_back = fell_back or any(issubclass(w.category, gnn.GeotFallbackWarning) for w in caught)
            if fell_back and ids64 is not edge_index:
                want = call(same_ids, x, edge_index, kwargs)  # PyG's forward ran on these ids
            assert_same(got, want, what)
    finally:
        torch.set_default_dtype(old_dtype)
