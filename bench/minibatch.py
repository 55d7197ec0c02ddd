"""Sampled mini-batch training, as users train large graphs: GraphSAGE on
bipartite neighbour-sampled blocks, a new graph every step.

Each step takes 1024 seed nodes, samples their neighbourhood hop by hop
(fan-out 15 then 10 by default: a node with more in-neighbours keeps that
many, drawn uniformly; one with fewer keeps all), and runs a 2-layer
SAGEConv model (hidden 128) over the blocks the way PyG's NeighborSampler
examples do: ``conv((x, x[:size[1]]), edge_index, size)``, then
cross-entropy on the seeds, backward and an Adam step. The sampler is plain
torch on the device (no pyg-lib), the same batches for every path. Timed
per step (CUDA events, median over the batches, after --warmup steps that
compile and warm the allocator), gathering the batch's features included,
sampling not (the same for every path; its time is printed). Every step
meets a graph of new tensors (no path can reuse what it kept of another). Paths:

    pyg           PyG's SAGEConv (eager)
    pyg-compile   torch.compile(dynamic=True) of the PyG model
    geot          geot.nn.SAGEConv (eager)
    geot-compile  torch.compile(dynamic=True) of the geot model
    no-mp         the same step with message passing left out: each layer
                  applies both Linears to its targets' rows. What a step
                  costs besides aggregation (features, Linears, loss,
                  backward, Adam: host-bound at this size), so no layer
                  library can make a step faster than this path.

    python bench/minibatch.py --graph "powerlaw:n=1000000,deg=12" [--fanouts 15,10] [--batch 1024]
    python bench/e2e.py --minibatch    # the same, from e2e's options
"""
import argparse
import copy
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Tuple

import pandas as pd
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))
import common  # noqa: E402

import geot.nn as geot_nn  # noqa: E402

PATHS = ["pyg", "pyg-compile", "geot", "geot-compile", "no-mp"]


class Block(NamedTuple):
    edge_index: torch.Tensor   # [2, E] local ids: row 0 into the block's sources, row 1 its targets (sorted)
    size: Tuple[int, int]      # (sources, targets); the targets are the first sources


class Batch(NamedTuple):
    nodes: torch.Tensor        # [N] global ids of every node the blocks read; the seeds first
    blocks: List[Block]        # outermost hop first: the order the layers run them
    seeds: int


class NeighborSampler:
    """Uniform neighbour sampling over the in-edges of a graph, on its device."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, num_nodes: int, fanouts: List[int]):
        order = torch.argsort(dst, stable=True)
        self.sources = src[order]
        self.rowptr = torch.searchsorted(dst[order], torch.arange(num_nodes + 1, device=dst.device))
        self.fanouts = fanouts
        self.local = torch.full((num_nodes,), -1, dtype=torch.long, device=dst.device)

    def sample(self, seeds: torch.Tensor, generator: torch.Generator) -> Batch:
        nodes, blocks = seeds, []
        for fanout in self.fanouts:
            edge_index, nodes, size = self._hop(nodes, fanout, generator)
            blocks.append(Block(edge_index, size))
        return Batch(nodes, blocks[::-1], seeds.numel())

    def _hop(self, targets: torch.Tensor, fanout: int, generator: torch.Generator):
        start, degree = self.rowptr[targets], self.rowptr[targets + 1] - self.rowptr[targets]
        kept = torch.clamp(degree, max=fanout)
        total = int(kept.sum())
        target = torch.repeat_interleave(torch.arange(targets.numel(), device=targets.device), kept,
                                         output_size=total)
        rank = torch.arange(total, device=targets.device) - (torch.cumsum(kept, 0) - kept)[target]
        draw = (torch.rand(total, device=targets.device, generator=generator) * degree[target]).long()
        position = start[target] + torch.where(degree[target] <= fanout, rank, draw)
        neighbours = self.sources[position]
        self.local[targets] = torch.arange(targets.numel(), device=targets.device)
        new = torch.unique(neighbours[self.local[neighbours] < 0])
        self.local[new] = torch.arange(targets.numel(), targets.numel() + new.numel(), device=targets.device)
        edge_index = torch.stack([self.local[neighbours], target])
        nodes = torch.cat([targets, new])
        self.local[nodes] = -1
        return edge_index, nodes, (nodes.numel(), targets.numel())


class NoMessagePassing(torch.nn.Module):
    """SAGEConv's Linears without its aggregation: lin_l and lin_r both read the targets' rows."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.lin_l = torch.nn.Linear(in_channels, out_channels)
        self.lin_r = torch.nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x, edge_index, size):
        return self.lin_l(x[1]) + self.lin_r(x[1])


NO_MP = type("NoMessagePassingLibrary", (), {"SAGEConv": NoMessagePassing})


class SAGE(torch.nn.Module):
    """SAGEConv layers over bipartite blocks (``lib``: torch_geometric.nn or geot.nn)."""

    def __init__(self, lib, in_channels: int, hidden: int, num_classes: int, layers: int):
        super().__init__()
        sizes = [in_channels] + [hidden] * (layers - 1) + [num_classes]
        self.convs = torch.nn.ModuleList([lib.SAGEConv(a, b) for a, b in zip(sizes, sizes[1:])])

    def forward(self, x: torch.Tensor, blocks: List[Block]) -> torch.Tensor:
        for i, (conv, block) in enumerate(zip(self.convs, blocks)):
            x = conv((x, x[:block.size[1]]), block.edge_index, size=block.size)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


GeotSAGE = common.own_code(SAGE)  # the geot paths' SAGE (see own_code)


def training_step(model, runner, optimizer, features, labels, amp_dtype):
    def step(batch: Batch):
        model.train()
        optimizer.zero_grad()
        x = features.index_select(0, batch.nodes)
        with torch.autocast(features.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = runner(x, batch.blocks)
        F.cross_entropy(out.float(), labels.index_select(0, batch.nodes[:batch.seeds])).backward()
        optimizer.step()
    return step


def fresh(batch: Batch) -> Batch:
    """The batch with new index tensors: each path, and each step, meets a graph it never saw (libraries may
    cache per tensor)."""
    return batch._replace(blocks=[block._replace(edge_index=block.edge_index.clone()) for block in batch.blocks])


def path_steps(models: Dict[str, torch.nn.Module], paths: List[str], make_step: Callable, x, labels,
               amp_dtype) -> Dict[str, Callable]:
    """path -> its training step, make_step(model, runner, optimizer, x, labels, amp_dtype): a path "lib"
    runs a copy of models["lib"], "lib-compile" torch.compile(dynamic=True) of another; each path has a
    model and an Adam of its own, as a user trains one of them: with a model shared, one path's compiled
    code and kept graphs changed another's host time (H200: geot eager took 1.08x PyG eager's time per
    step beside a compiled path on its model, 0.98-1.03x without one)."""
    steps = {}
    for path in paths:
        model = copy.deepcopy(models[path.split("-")[0]])
        runner = torch.compile(model, dynamic=True) if path.endswith("compile") else model
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        steps[path] = make_step(model, runner, optimizer, x, labels, amp_dtype)
    return steps


def time_steps(steps: Dict[str, Callable], batches: List, warmup: int, device,
               renew: Callable = None) -> Dict[str, Tuple[float, float]]:
    """path -> (median ms per step over the batches after the first warmup,
    ms of the first step: compilation included). Every path steps every
    batch once, each path its own copy (renew, default fresh); the timed
    steps take turns across paths, batch by batch, so drift of the host's
    speed (host-bound steps) reaches all paths alike."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    renew = renew or fresh
    own = {path: [renew(batch) for batch in batches] for path in steps}
    first = {}
    for path, step in steps.items():
        sync()
        begin = time.perf_counter()
        step(own[path][0])
        sync()
        first[path] = (time.perf_counter() - begin) * 1e3
        for batch in own[path][1:warmup]:
            step(batch)
    times = {path: [] for path in steps}
    for i in range(warmup, len(batches)):
        for path, step in steps.items():
            sync()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(own[path][i])
                end.record()
                end.synchronize()
                times[path].append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step(own[path][i])
                times[path].append((time.perf_counter() - begin) * 1e3)
    return {path: (statistics.median(times[path]), first[path]) for path in steps}


def run(args, device) -> pd.DataFrame:
    graph = common.make_graph(args.graph, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    features = torch.randn(graph.num_nodes, args.features, device=device, generator=generator)
    labels = torch.randint(0, args.classes, (graph.num_nodes,), device=device, generator=generator)
    sampler = NeighborSampler(graph.src, graph.dst, graph.num_nodes, args.fanouts)
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    batches = [sampler.sample(torch.randperm(graph.num_nodes, device=device, generator=generator)[:args.batch],
                              generator) for _ in range(args.warmup + args.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    sample_ms = (time.perf_counter() - begin) * 1e3 / len(batches)
    edges = statistics.mean(sum(b.edge_index.size(1) for b in batch.blocks) for batch in batches)
    print(f"{graph.name}: {graph.num_nodes} nodes, {graph.num_edges} edges; batches of {args.batch} seeds, "
          f"fan-outs {args.fanouts}: {edges:.0f} sampled edges per step on average, sampled in "
          f"{sample_ms:.2f} ms", flush=True)
    rows = []
    for dtype_name in args.dtypes:
        torch.manual_seed(0)
        models = {"pyg": SAGE(pyg_nn, args.features, args.hidden, args.classes, len(args.fanouts)).to(device)}
        models["geot"] = GeotSAGE(geot_nn, args.features, args.hidden, args.classes, len(args.fanouts)).to(device)
        models["geot"].load_state_dict(models["pyg"].state_dict())
        models["no"] = SAGE(NO_MP, args.features, args.hidden, args.classes, len(args.fanouts)).to(device)
        steps = path_steps(models, args.paths, training_step, features, labels, DTYPES[dtype_name])
        for path, (ms, first_ms) in time_steps(steps, batches, args.warmup, device).items():
            rows.append({"graph": graph.name, "edges": graph.num_edges, "fanouts": "/".join(map(str, args.fanouts)),
                         "batch": args.batch, "hidden": args.hidden, "dtype": dtype_name, "path": path,
                         "ms": ms, "first_ms": first_ms, "sampled_edges": edges, "sample_ms": sample_ms})
            print(f"  {dtype_name} {path:<13} {ms:8.3f} ms per step (first step {first_ms:.0f} ms)", flush=True)
    df = pd.DataFrame(rows)
    pyg = df[df["path"].str.startswith("pyg")].groupby("dtype")["ms"].min().rename("best_pyg_ms")
    df = df.merge(pyg, on="dtype")
    df["speedup"] = df["best_pyg_ms"] / df["ms"]
    return df


DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--graph", default="powerlaw:n=1000000,deg=12", help="a generator spec (bench/common.py)")
    parser.add_argument("--fanouts", default="15,10", help="neighbours kept per node, hop by hop from the seeds")
    parser.add_argument("--batch", type=int, default=1024, help="seed nodes per step")
    parser.add_argument("--mb-hidden", dest="hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed steps (distinct batches)")
    parser.add_argument("--mb-warmup", dest="warmup", type=int, default=5)
    parser.add_argument("--mb-paths", dest="mb_paths", default=",".join(PATHS))


def finish_arguments(args) -> None:
    args.fanouts = [int(f) for f in str(args.fanouts).split(",")]
    args.paths = args.mb_paths.split(",")
    if not getattr(args, "dtypes", None):
        args.dtypes = ["fp32"]
    elif isinstance(args.dtypes, str):
        args.dtypes = args.dtypes.split(",")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--quick", action="store_true", help="tiny CPU check: a 5000-node graph, 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.graph, args.steps, args.warmup, args.batch = "powerlaw:n=5000,deg=8", 4, 1, 64
    finish_arguments(args)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    torch._dynamo.config.cache_size_limit = 64
    df = run(args, device)
    paths = common.write_csv(df, f"minibatch_{common.device_slug(device)}{'_quick' if args.quick else ''}.csv")
    common.print_table(df[["dtype", "path", "ms", "first_ms", "speedup"]],
                       "ms per training step; speedup over the fastest PyG path", floatfmt="{:.3f}")
    print(f"wrote {', '.join(paths)}")


if __name__ == "__main__":
    main()
