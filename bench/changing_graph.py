"""Full-graph models on a graph that changes every step, as in training on
random subgraphs (edge dropout, GraphSAINT-style node subsets, a temporal
window): each step keeps the edges into a random quarter of the nodes, as a
new edge_index tensor, and trains e2e's 3-layer models (GCN, SAGE, GIN;
2-layer 8-head GAT) on it with cross-entropy over that quarter, backward and
an Adam step.

No library can keep anything of one step's graph for the next: geot sorts
(or scatters in any order) once per step, and PyG recomputes what it
derives (GCN's normalization) every call. Timed per step with CUDA events,
median over the steps after --warmup steps (compilation included there; the
first step's time is reported apart), the paths taking turns step by step.
Building the subgraph is not timed (the same for every path).

    pyg           PyG's layers (eager)
    pyg-compile   torch.compile(dynamic=True) of the PyG model
    geot          geot.nn's layers (eager)
    geot-compile  torch.compile(dynamic=True) of the geot model

    python bench/changing_graph.py [--graph "powerlaw:n=1000000,deg=10"] [--models gcn,sage,gin,gat] [--hidden 128]
"""
import argparse
import os
import sys

import pandas as pd
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))
import common  # noqa: E402
from e2e import GeotNet, Net, fresh_state  # noqa: E402
from minibatch import path_steps, time_steps  # noqa: E402

import geot.nn as geot_nn  # noqa: E402

PATHS = ["pyg", "pyg-compile", "geot", "geot-compile"]
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def subgraphs(edge_index: torch.Tensor, num_nodes: int, count: int, fraction: float, generator):
    """count (edge_index, targets) pairs: the edges into a random `fraction` of the nodes, in input order."""
    pairs = []
    for _ in range(count):
        keep = torch.rand(num_nodes, device=edge_index.device, generator=generator) < fraction
        pairs.append((edge_index[:, keep[edge_index[1]]], keep.nonzero().squeeze(1)))
    return pairs


def training_step(model, runner, optimizer, x, labels, amp_dtype):
    def step(pair):
        edge_index, targets = pair
        model.train()
        optimizer.zero_grad()
        with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = runner(x, edge_index)
        F.cross_entropy(out.index_select(0, targets).float(), labels.index_select(0, targets)).backward()
        optimizer.step()
    return step


def renewed(pair):
    """The step's graph as a tensor no path saw before (libraries may cache per tensor)."""
    return pair[0].clone(), pair[1]


def run(args, device) -> pd.DataFrame:
    graph = common.make_graph(args.graph, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(graph.num_nodes, args.features, device=device, generator=generator)
    labels = torch.randint(0, args.classes, (graph.num_nodes,), device=device, generator=generator)
    order = torch.randperm(graph.num_edges, device=device, generator=generator)  # edges in random order
    edge_index = torch.stack([graph.src, graph.dst])[:, order]
    pool = subgraphs(edge_index, graph.num_nodes, args.warmup + args.steps, args.fraction, generator)
    edges = sum(pair[0].size(1) for pair in pool) / len(pool)
    print(f"{graph.name}: {graph.num_nodes} nodes, {graph.num_edges} edges; {edges:.0f} edges per step",
          flush=True)
    rows = []
    for model_name in args.models:
        for dtype_name in args.dtypes:
            fresh_state(device)
            torch.manual_seed(0)
            models = {"pyg": Net(pyg_nn, model_name, args.features, args.hidden, args.classes).to(device)}
            models["geot"] = GeotNet(geot_nn, model_name, args.features, args.hidden, args.classes).to(device)
            models["geot"].load_state_dict(models["pyg"].state_dict())
            steps = path_steps(models, args.paths, training_step, x, labels, DTYPES[dtype_name])
            timed = time_steps(steps, pool, args.warmup, device, renew=renewed)
            for path, (ms, first_ms) in timed.items():
                rows.append({"model": model_name, "hidden": args.hidden, "graph": graph.name,
                             "edges": graph.num_edges, "step_edges": edges, "dtype": dtype_name, "path": path,
                             "ms": ms, "first_ms": first_ms})
                print(f"  {model_name} {dtype_name} {path:<13} {ms:8.3f} ms per step (first {first_ms:.0f} ms)",
                      flush=True)
    df = pd.DataFrame(rows)
    keys = ["model", "dtype"]
    best = df[df["path"].str.startswith("pyg")].groupby(keys)["ms"].min().rename("best_pyg_ms")
    eager = df[df["path"] == "pyg"].set_index(keys)["ms"].rename("pyg_eager_ms")
    df = df.merge(best, on=keys).merge(eager, on=keys)
    df["speedup"] = df["best_pyg_ms"] / df["ms"]
    df["speedup_vs_eager"] = df["pyg_eager_ms"] / df["ms"]
    return df


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="powerlaw:n=1000000,deg=10", help="a generator spec (bench/common.py)")
    parser.add_argument("--models", default="gcn,sage,gin,gat")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.25, help="share of nodes whose in-edges a step keeps")
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps (distinct graphs)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny CPU check: a 3000-node graph, 3 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.graph, args.steps, args.warmup, args.hidden = "powerlaw:n=3000,deg=6", 3, 1, 16
    args.models, args.dtypes, args.paths = args.models.split(","), args.dtypes.split(","), args.paths.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch._dynamo.config.cache_size_limit = 64
    df = run(args, device)
    paths = common.write_csv(df, f"changing_graph_{common.device_slug(device)}{'_quick' if args.quick else ''}.csv")
    common.print_table(df[["model", "dtype", "path", "ms", "first_ms", "speedup", "speedup_vs_eager"]],
                       "ms per training step; speedup over the fastest PyG path, and over PyG eager",
                       floatfmt="{:.3f}")
    print(f"wrote {', '.join(paths)}")


if __name__ == "__main__":
    main()
