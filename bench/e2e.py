"""End-to-end GNN models: geot layers vs PyG's own fast paths.

Models: 3-layer GCN, GIN, GraphSAGE (hidden 128 and 256), 2-layer GAT (8
heads of 16, hidden 128) and RGCN (8 random relations, hidden 128). Each is timed for inference
and for a full training step (forward, cross-entropy, backward, Adam step) as

    pyg        PyG's layers on edge_index
    pyg-csr    PyG's layers on a torch.sparse_csr adjacency (GCN, GIN, SAGE; else n/a)
    pyg-compile  torch.compile of the PyG model
    geot       geot.nn layers (eager)
    geot-compile torch.compile(fullgraph=True) of the geot model, compiled
                 before any eager call, as users do (--warm-eagerly: one eager
                 call of each grad mode first)

and, named in --models, PyG models of other layers (GraphConv, TAGConv,
APPNP, SGConv, ChebConv, LGConv, SimpleConv, ClusterGCNConv, GATv2Conv,
TransformerConv) patched by geot.nn.patch; their geot-compile path compiles
as PyG's does (fullgraph=False): the layers run PyG's forward, whose boolean
masks (ChebConv's Laplacian) break graphs, and fullgraph=True leaves Inductor
reductions over data-dependent sizes (one 30 ms kernel per ChebConv layer on
a 10M-edge graph); "sage-max" in --models adds SAGE with max aggregation

on cora, citeseer, pubmed (the file's features, or random width-128 ones) and
generated graphs of 2M, 3.2M and 10M edges, in fp32 and bf16 autocast. Reports the
median ms per step (CUDA events, warm-up, L2 flush: bench/common.py), the
speedup of geot over the fastest PyG path and the peak memory (with the
memory resident when a step begins; a model's inference cells run before
its training cells, so an inference peak leaves out what training keeps;
--memory-snapshot DIR writes torch's
memory snapshot of each cell's peak-memory calls, for
https://pytorch.org/memory_viz); writes
bench/out/e2e_<gpu>.csv and a bar chart next to it (bench/report.py --add
merges a run into bench/results/); prints the table and
the geomean speedups last. Each model starts from a fresh state (fresh_state).
Each model's cells are timed in --rounds rounds (fastest round kept), the
paths of a (dtype, mode) back to back; --compile-mode picks torch.compile's
mode for both compiled paths (reduce-overhead: CUDA graphs); on CUDA, when
both libraries' compiled paths run with CUDA graphs, each library's paths run
in a process of their own (run_libraries_apart; --processes); otherwise all
paths share one process, so their rounds take turns under the same host
conditions (small graphs are host-bound). On CUDA the
inputs (features, labels, edge_index, edge types) are marked as static
inputs, as a full-batch model's are: CUDA graphs of both libraries read them
in place rather than copying them on every replay (x alone is 100 MB on the
large graphs, ~70 us of copy per step on an H100).

    python bench/e2e.py [--models gcn,gat] [--graphs cora,pubmed] [--dtypes fp32] [--hidden 64] [--no-compile]
    python bench/e2e.py --quick    # tiny CPU check that everything runs
    python bench/e2e.py --minibatch [bench/minibatch.py's options]   # sampled training, a new graph every step
    python bench/e2e.py --deterministic [--models gcn,gat] [--graphs ...] [--steps 50]

--deterministic trains each model (geot layers, eager) for --steps steps
under torch.use_deterministic_algorithms(True), twice from the same seed
(geot's caches cleared in between), and checks that the two runs' losses
agree bitwise (CUBLAS_WORKSPACE_CONFIG=:4096:8 is set for torch's matmuls).
"""
import argparse
import gc
import math
import os
import re
import subprocess
import sys
import traceback
from typing import Optional

import pandas as pd
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))
import common  # noqa: E402
from report import with_speedups  # noqa: E402  (each path against the fastest PyG path of its cell)

import geot  # noqa: E402
import geot.nn as geot_nn  # noqa: E402
from geot.data import load_dataset  # noqa: E402
from geot.nn import graph as graph_cache  # noqa: E402
from geot.nn.graph import static_addresses  # noqa: E402

NUM_RELATIONS = 8
MODELS = {"gcn": (128, 256), "gin": (128, 256), "sage": (128, 256), "gat": (128,), "rgcn": (128,)}
# PyG layers that propagate on geot once patched (geot.nn.generic); run when named in --models
GENERIC_MODELS = {name: (128,) for name in ("graphconv", "tag", "appnp", "sg", "cheb", "lg", "simple",
                                             "clustergcn", "gatv2", "transformer")}
# Options of the layers above, run when named in --models: SAGE with max aggregation (its backward
# gathers the [E, F] messages and splits each gradient among the tied ones)
VARIANT_MODELS = {"sage-max": (128,)}
PROPAGATIONS = {"lg": "LGConv", "simple": "SimpleConv"}  # weightless layers, each after a Linear
ATTENTION = {"gat": "GATConv", "gatv2": "GATv2Conv", "transformer": "TransformerConv"}  # 8 heads, then 1
# 2.0M, 3.2M and 10M edges
GRAPHS = ["cora", "citeseer", "pubmed", "powerlaw:n=200000,deg=10", "uniform:n=200000,d=16",
          "powerlaw:n=1000000,deg=10"]
PATHS = ["pyg", "pyg-csr", "pyg-compile", "geot", "geot-compile"]
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class Net(torch.nn.Module):
    """A stack of conv layers with ReLU in between; ``lib`` is torch_geometric.nn or geot.nn."""

    def __init__(self, lib, model: str, in_channels: int, hidden: int, num_classes: int):
        super().__init__()
        relu_after = None  # every layer but the last
        if model in ATTENTION:
            conv = getattr(lib, ATTENTION[model])
            self.convs = torch.nn.ModuleList([conv(in_channels, hidden // 8, heads=8), conv(hidden, num_classes)])
        elif model == "rgcn":
            self.convs = torch.nn.ModuleList([lib.RGCNConv(in_channels, hidden, NUM_RELATIONS),
                                              lib.RGCNConv(hidden, num_classes, NUM_RELATIONS)])
        elif model == "appnp":  # an MLP, then K = 10 propagation steps
            self.convs = torch.nn.ModuleList([_Dense(in_channels, hidden), _Dense(hidden, num_classes),
                                              lib.APPNP(K=10, alpha=0.1)])
            relu_after = {0}
        elif model in PROPAGATIONS:  # Linear, propagate, ReLU, Linear, propagate
            propagation = getattr(lib, PROPAGATIONS[model])
            kwargs = {"aggr": "mean"} if model == "simple" else {}
            self.convs = torch.nn.ModuleList([_Dense(in_channels, hidden), propagation(**kwargs),
                                              _Dense(hidden, num_classes), propagation(**kwargs)])
            relu_after = {1}
        elif model == "sg":
            self.convs = torch.nn.ModuleList([lib.SGConv(in_channels, num_classes, K=2)])
        else:
            sizes = [in_channels, hidden, hidden, num_classes]
            self.convs = torch.nn.ModuleList([self._layer(lib, model, a, b) for a, b in zip(sizes, sizes[1:])])
        self.relational = model == "rgcn"
        self.relu_after = set(range(len(self.convs) - 1)) if relu_after is None else relu_after

    @staticmethod
    def _layer(lib, model, in_channels, out_channels):
        if model == "gcn":
            return lib.GCNConv(in_channels, out_channels)
        if model == "sage":
            return lib.SAGEConv(in_channels, out_channels)
        if model == "sage-max":
            return lib.SAGEConv(in_channels, out_channels, aggr="max")
        if model == "graphconv":
            return lib.GraphConv(in_channels, out_channels)
        if model == "tag":
            return lib.TAGConv(in_channels, out_channels, K=2)
        if model == "cheb":
            return lib.ChebConv(in_channels, out_channels, K=2)
        if model == "clustergcn":
            return lib.ClusterGCNConv(in_channels, out_channels)
        mlp = torch.nn.Sequential(torch.nn.Linear(in_channels, out_channels), torch.nn.ReLU(),
                                  torch.nn.Linear(out_channels, out_channels))
        return lib.GINConv(mlp)

    def forward(self, x, adj, edge_type=None):
        for i, conv in enumerate(self.convs):
            x = conv(x, adj, edge_type) if self.relational else conv(x, adj)
            if i in self.relu_after:
                x = F.relu(x)
        return x


GeotNet = common.own_code(Net)  # the geot paths' Net (see own_code)


class _Dense(torch.nn.Linear):
    """A Linear in the conv stack (takes the graph, reads nothing of it)."""

    def forward(self, x, adj=None):
        return super().forward(x)


def load_inputs(spec: str, device):
    """x, labels, edge_index (edges in random order, as a user's often are), CSR adjacency, edge types."""
    graph = common.make_graph(spec, device="cpu")
    if graph is None:
        return None
    data = load_dataset(spec) if graph.kind == "shared" else None
    gen = torch.Generator().manual_seed(0)
    x = data["x"] if data is not None and "x" in data else torch.randn(graph.num_nodes, 128, generator=gen)
    y = data["y"] if data is not None and "y" in data else torch.randint(0, 8, (graph.num_nodes,), generator=gen)
    edge_index = torch.stack([graph.src, graph.dst])[:, torch.randperm(graph.num_edges, generator=gen)]
    ptr = torch.searchsorted(graph.dst, torch.arange(graph.num_nodes + 1))
    adj_t = torch.sparse_csr_tensor(ptr, graph.src, torch.ones(graph.num_edges), (graph.num_nodes,) * 2)
    edge_type = torch.randint(0, NUM_RELATIONS, (graph.num_edges,), generator=gen)
    inputs = {"name": graph.name, "x": x.to(device), "y": y.to(device), "edge_index": edge_index.to(device),
              "adj_t": adj_t.to(device), "edge_type": edge_type.to(device), "num_classes": int(y.max()) + 1}
    # A full-batch model's inputs never change: CUDA graphs may read them in place.
    static_addresses([inputs[key] for key in ("x", "y", "edge_index", "edge_type")])
    return inputs


def step_functions(model, runner, inputs, adj, amp_dtype, device, compiled: bool, warm_eagerly: bool = False):
    """(inference step, training step) closures of one model and input path.
    A compiled step starts with torch.compiler.cudagraph_mark_step_begin(), as
    torch's docs ask where CUDA-graph models are invoked in turn: each step
    is a new generation of the CUDA graph tree, not a continuation of the
    step before. (It did not undo the slowdown between the two libraries'
    compiled models that run_libraries_apart avoids.) warm_eagerly: each
    grad mode's first call runs the model eagerly once before the compiled
    one (--warm-eagerly; users compile first, and geot.nn needs no eager
    call)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = (inputs["edge_type"],) if model.relational else ()
    warmed = set()

    def forward():
        mode = torch.is_grad_enabled()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            if warm_eagerly and mode not in warmed:
                warmed.add(mode)
                model(inputs["x"], adj, *extra)
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            return runner(inputs["x"], adj, *extra)

    def infer():
        model.eval()
        with torch.no_grad():
            forward()

    def train():
        model.train()
        optimizer.zero_grad()
        F.cross_entropy(forward().float(), inputs["y"]).backward()
        optimizer.step()

    return infer, train


def measure(fn, device, args, snapshot: Optional[str] = None):
    """(median ms, peak MB, resident MB) of fn. The peak is
    max_memory_allocated over the second and third calls, the benchmark's
    L2-flush buffer not counted. A CUDA-graph path (reduce-overhead) warms
    up on its first call and records on its second, allocating its
    intermediates in the graph's pool then; later replays allocate nothing,
    so a peak over a replay alone would miss every intermediate (torch's and
    geot's alike). Resident is what is allocated when those calls begin
    (inputs, model, optimizer state and what a library keeps between steps,
    such as geot's graph caches): peak - resident is the step's own.
    snapshot: a file for torch's memory snapshot of those two calls
    (--memory-snapshot; open it at https://pytorch.org/memory_viz)."""
    # Two untimed calls first: compilation (and a recompile for the other grad
    # mode), the optimizer's lazy state. Otherwise time_stats' probe would
    # include them and cut a compiled path to its minimum reps, no warm-up.
    fn()
    peak = resident = float("nan")
    cuda = device.type == "cuda"
    if cuda:
        common.release_flush_buffer(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / 2**20
        if snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
    fn()
    if cuda:
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        if snapshot:
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    # No gate: a model step's host time is part of what it costs.
    timing = common.time_stats(fn, warmup=args.warmup, reps=args.reps, device=device, max_time_s=args.max_time,
                               gate=False)
    return timing.median_ms, peak, resident


def snapshot_file(args, row) -> Optional[str]:
    """Where measure writes the memory snapshot of a cell's first round (None: no snapshots)."""
    if not args.memory_snapshot or not math.isnan(row["peak_mb"]):
        return None
    name = "_".join(str(row[key]) for key in ("model", "hidden", "graph", "dtype", "mode", "path"))
    return os.path.join(args.memory_snapshot, re.sub(r"[^A-Za-z0-9_.-]+", "-", name) + ".pickle")


def bench_graph(inputs, args, device):
    rows = []
    for model_name in args.models:
        for hidden in MODELS[model_name]:
            rows += bench_model(model_name, hidden, inputs, args, device)
    return rows


def fresh_state(device) -> None:
    """Each model starts as in a process of its own: no compiled code or CUDA
    graphs of an earlier model (dynamo caches code per function, and PyG's
    layers share propagate; with them, PyG's compiled GIN and SAGE on pubmed
    ran 2-4x slower on an H100), no graphs geot kept for an earlier model,
    no cached allocator blocks."""
    torch._dynamo.reset()  # cudagraph trees included
    graph_cache.clear_cache()
    geot.validation.clear_cache()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_model(model_name, hidden, inputs, args, device):
    """Every (dtype, mode, path) cell of one model; the cells of a (dtype, mode)
    are timed back to back, in ``args.rounds`` rounds, and each keeps its
    fastest round's median: a slow spell of the host then hits one round of
    every path alike rather than one path's only measurement."""
    fresh_state(device)
    torch.manual_seed(0)
    pyg_model = Net(pyg_nn, model_name, inputs["x"].size(1), hidden, inputs["num_classes"]).to(device)
    if model_name in GENERIC_MODELS:  # PyG's model, patched
        geot_model = geot_nn.patch(GeotNet(pyg_nn, model_name, inputs["x"].size(1), hidden, inputs["num_classes"]))
        geot_model = geot_model.to(device)
    else:
        geot_model = GeotNet(geot_nn, model_name, inputs["x"].size(1), hidden, inputs["num_classes"]).to(device)
    geot_model.load_state_dict(pyg_model.state_dict())
    steps = {}  # (path, dtype) -> {"inference": fn, "train": fn}
    for path in args.paths:
        model = pyg_model if path.startswith("pyg") else geot_model
        runner = model
        if path.endswith("compile"):  # one compiled module per library, reused across dtypes and modes
            runner = torch.compile(model, fullgraph=path.startswith("geot") and model_name not in GENERIC_MODELS,
                                   backend=args.backend, mode=args.compile_mode)
        adj = inputs["adj_t"] if path == "pyg-csr" else inputs["edge_index"]
        for dtype_name in args.dtypes:
            infer, train = step_functions(model, runner, inputs, adj, DTYPES[dtype_name], device,
                                          compiled=path.endswith("compile"),
                                          warm_eagerly=args.warm_eagerly and path == "geot-compile")
            steps[path, dtype_name] = {"inference": infer, "train": train}
    # Inference cells first (each dtype's), then training: an inference peak is what an inference-only
    # process holds, without the caches a training step leaves (a graph's transposed index, its weights in
    # that order); those stay resident in a process that trains first (e.g. pubmed GAT: +2.1 MB).
    cells = []
    for mode in ("inference", "train"):
        for dtype_name in args.dtypes:
            for path in args.paths:
                row = {"model": model_name, "hidden": hidden, "graph": inputs["name"], "dtype": dtype_name,
                       "mode": mode, "path": path, "ms": float("nan"), "peak_mb": float("nan"),
                       "resident_mb": float("nan")}
                if path == "pyg-csr" and model_name in ("rgcn", *ATTENTION):
                    row["note"] = "n/a"
                cells.append((row, steps[path, dtype_name][mode]))
    for _ in range(args.rounds):
        for row, fn in cells:
            if "note" in row:
                continue
            try:
                ms, peak, resident = measure(fn, device, args, snapshot_file(args, row))
            except Exception as error:  # a path PyG does not support here: recorded, not fatal
                row["note"] = _failure_note(error)
                if row["path"].startswith("geot"):  # geot failing is a bug, not a missing feature: show where
                    traceback.print_exc()
                continue
            if math.isnan(row["ms"]) or ms < row["ms"]:  # the fastest round
                row["ms"] = ms
            if math.isnan(row["peak_mb"]):  # the first round's: a CUDA-graph path records then (see measure)
                row["peak_mb"], row["resident_mb"] = peak, resident
    for row, _ in cells:
        print(f"  {model_name}/{hidden} {inputs['name']} {row['dtype']} {row['mode']:<9} {row['path']:<12} "
              f"{common.fmt_ms(row['ms'])} ms {row.get('note', '')}", flush=True)
    return [row for row, _ in cells]


def _failure_note(error: Exception) -> str:
    first_line = str(error).splitlines()[0][:120] if str(error) else ""
    return f"n/a: {type(error).__name__}: {first_line}"


def summarize(df):
    keys = ["model", "hidden", "graph", "dtype", "mode"]
    wide = df.pivot_table(index=keys, columns="path", values="ms", sort=False)
    speedups = df[df["path"].str.startswith("geot")].pivot_table(index=keys, columns="path", values="speedup",
                                                                  sort=False)
    wide = wide.join(speedups.add_prefix("x "), how="left").reset_index()
    common.print_table(wide, "ms per step; x = speedup over the fastest PyG path", floatfmt="{:.3f}")
    print("\ngeomean speedup over the fastest PyG path")
    groups = {"GCN/GIN/SAGE": ["gcn", "gin", "sage"], "GAT": ["gat"], "RGCN": ["rgcn"]}
    for label, models in groups.items():
        for mode in ("inference", "train"):
            for path in ("geot", "geot-compile"):
                sel = df[df["model"].isin(models) & (df["mode"] == mode) & (df["path"] == path)].dropna(
                    subset=["speedup"])
                if len(sel):
                    worst = sel.loc[sel["speedup"].idxmin()]
                    print(f"  {label:<13} {mode:<9} {path:<12} {common.geomean(sel['speedup']):.2f}x "
                          f"(worst {worst['speedup']:.2f}x, {worst['model']}/{worst['hidden']} {worst['graph']} "
                          f"{worst['dtype']}; {int((sel['speedup'] < 1).sum())} of {len(sel)} below 1)")
    compiled = df[df["model"].isin(groups["GCN/GIN/SAGE"]) & (df["path"] == "geot-compile")].dropna(subset=["speedup"])
    for by in ("model", "graph", "dtype"):
        if compiled[by].nunique() > 1:
            table = compiled.groupby([by, "mode"])["speedup"].apply(common.geomean).unstack("mode")
            print(f"  GCN/GIN/SAGE geot-compile by {by}: " + "; ".join(
                f"{key} " + ", ".join(f"{row[mode]:.2f}x" for mode in table.columns) for key, row in table.iterrows())
                + f" ({', '.join(table.columns)})")
    if df["peak_ratio"].notna().any():
        print("\npeak memory / the fastest PyG path's: geomean, largest, cells above 1")
        for label, models in groups.items():
            for path in ("geot", "geot-compile"):
                ratio = df[df["model"].isin(models) & (df["path"] == path)]["peak_ratio"].dropna()
                if len(ratio):
                    print(f"  {label:<13} {path:<12} {common.geomean(ratio):.2f}x, max {ratio.max():.3f}x, "
                          f"{int((ratio > 1).sum())} of {len(ratio)} above")
    if {"geot", "geot-compile"} <= set(wide):
        both = wide.dropna(subset=["geot", "geot-compile"])
        print("\ngeomean speedup of geot-compile over geot eager")
        for mode in ("inference", "train"):
            sel = both[both["mode"] == mode]
            if len(sel):
                print(f"  {mode:<9} {common.geomean(sel['geot'] / sel['geot-compile']):.2f}x over {len(sel)} cells")


def plot(df, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geot_rows = df[df["path"].str.startswith("geot") & df["speedup"].notna()]
    if geot_rows.empty:  # no PyG path was run: nothing to compare with
        return
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.35 * len(geot_rows) / 2), 8), squeeze=False)
    for ax, mode in zip(axes[:, 0], ("inference", "train")):
        sel = geot_rows[geot_rows["mode"] == mode]
        table = sel.assign(case=sel["model"] + "/" + sel["hidden"].astype(str) + " " + sel["graph"] + " "
                           + sel["dtype"]).pivot_table(index="case", columns="path", values="speedup", sort=False)
        table.plot.bar(ax=ax, width=0.8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"{mode}: speedup vs fastest PyG")
        ax.set_xlabel("")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--graphs", default=",".join(GRAPHS), help="names or generator specs (bench/common.py)")
    parser.add_argument("--dtypes", default=None, help="fp32,bf16 (default: both on GPU, fp32 on CPU)")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--hidden", default=None,
                        help="hidden sizes to run, e.g. 64,128 (default: each model's own; GAT's: multiples of 8)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile paths")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode for both compiled paths, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--warm-eagerly", action="store_true",
                        help="run the geot model eagerly once per grad mode before its compiled path")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over each model's cells (fastest kept)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-time", type=float, default=2.0, help="seconds of timed work per cell at most")
    parser.add_argument("--processes", choices=["one", "per-library"], default=None,
                        help="run each library's paths in a process of its own (run_libraries_apart) or all in "
                             "one; default: per library on CUDA when both libraries' compiled paths run with CUDA "
                             "graphs (--compile-mode reduce-overhead or max-autotune)")
    parser.add_argument("--memory-snapshot", default=None, metavar="DIR",
                        help="CUDA: write torch's memory snapshot of each cell's peak-memory calls to DIR")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="CSV",
                        help="print the summary of rows already measured (one or more e2e CSVs, e.g. several runs "
                             "of the same code) and exit")
    parser.add_argument("--rows-csv", default=None, help=argparse.SUPPRESS)  # run_libraries_apart's children
    parser.add_argument("--deterministic", action="store_true",
                        help="train each model twice in deterministic mode, compare the losses bitwise")
    parser.add_argument("--steps", type=int, default=50, help="training steps of --deterministic")
    parser.add_argument("--quick", action="store_true",
                        help="tiny CPU check: one 500-node graph, hidden 32, fp32, aot_eager compile, 2 reps")
    args = parser.parse_args()
    args.models = args.models.split(",")
    if args.memory_snapshot:
        os.makedirs(args.memory_snapshot, exist_ok=True)
    MODELS.update({name: GENERIC_MODELS[name] for name in args.models if name in GENERIC_MODELS})
    MODELS.update({name: VARIANT_MODELS[name] for name in args.models if name in VARIANT_MODELS})
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; have {list(MODELS)}")
    args.paths = [p for p in args.paths.split(",") if not (args.no_compile and p.endswith("compile"))]
    args.graphs = common.split_graph_specs(args.graphs)
    if args.hidden:
        for model in MODELS:
            MODELS[model] = tuple(int(h) for h in args.hidden.split(","))
    if args.quick:
        args.graphs, args.reps, args.warmup, args.backend = ["powerlaw:n=500,deg=6"], 2, 1, "aot_eager"
        args.rounds = 1
        for model in MODELS:
            MODELS[model] = MODELS[model][:1]
    default_dtypes = "fp32,bf16" if torch.cuda.is_available() and not args.quick else "fp32"
    args.dtypes = (args.dtypes or default_dtypes).split(",")
    return args


def library_of(path: str) -> str:
    return path.split("-")[0]


def run_libraries_apart(args) -> pd.DataFrame:
    """Each library's paths in a process of its own (this script again, with
    --paths cut to them), their rows merged. With CUDA graphs, two compiled
    models in one process slowed each other: geot's compiled GCN step on
    pubmed took 0.33 ms next to PyG's compiled model and 0.11 ms alone on an
    H100, the same in both with cudagraph_mark_step_begin, while the eager
    paths did not move; a user runs one of the two. The child writes its
    rows as it goes, so a run cut off keeps what it timed."""
    frames = []
    for library in ("pyg", "geot"):
        paths = [p for p in args.paths if library_of(p) == library]
        if not paths:
            continue
        rows_csv = os.path.join(common.out_dir(), f"{args.name}_{library}_rows.csv")
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--paths", ",".join(paths),
                   "--rows-csv", rows_csv]
        print(f"--- {library} paths in a process of their own: {paths}", flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"--- the {library} process failed; its rows so far are kept", flush=True)
        if os.path.exists(rows_csv):
            frames.append(pd.read_csv(rows_csv))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def time_in_process(args, device) -> pd.DataFrame:
    rows = []
    for spec in args.graphs:
        inputs = load_inputs(spec, device)
        if inputs is not None:
            print(f"{inputs['name']}: {inputs['x'].size(0)} nodes, {inputs['edge_index'].size(1)} edges, "
                  f"{inputs['x'].size(1)} features", flush=True)
            rows += bench_graph(inputs, args, device)
            so_far = pd.DataFrame(rows)  # written as it grows: a cut-off run keeps it
            if args.rows_csv:
                so_far.to_csv(args.rows_csv, index=False)
            else:
                common.write_csv(with_speedups(so_far), f"{args.name}.csv")
        torch._dynamo.reset()  # compiled models of the previous graph are not used again
    return pd.DataFrame(rows)


def deterministic_losses(model_name, hidden, inputs, amp_dtype, device, steps):
    """Losses of `steps` training steps of a fresh geot model (seeded), in deterministic mode."""
    graph_cache.clear_cache()
    geot.clear_cache()
    torch.manual_seed(0)
    model = Net(geot_nn, model_name, inputs["x"].size(1), hidden, inputs["num_classes"]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    extra = (inputs["edge_type"],) if model.relational else ()
    losses = []
    with common.deterministic_mode():
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                out = model(inputs["x"], inputs["edge_index"], *extra)
            loss = F.cross_entropy(out.float(), inputs["y"])
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    return torch.stack(losses)


def check_deterministic(args, device) -> int:
    """--deterministic: two runs per (graph, model, dtype), their losses compared bitwise."""
    rows = []
    for spec in args.graphs:
        inputs = load_inputs(spec, device)
        if inputs is None:
            continue
        for model_name in args.models:
            for dtype in args.dtypes:
                hidden = MODELS[model_name][0]
                runs = [deterministic_losses(model_name, hidden, inputs, DTYPES[dtype], device, args.steps).cpu()
                        for _ in range(2)]
                same = common.same_bits(runs[0], runs[1])
                differ = (runs[0] != runs[1]).nonzero()
                rows.append({"graph": inputs["name"], "model": model_name, "dtype": dtype, "steps": args.steps,
                             "bitwise_identical": same, "first_loss": float(runs[0][0]),
                             "last_loss": float(runs[0][-1]),
                             "first_differing_step": int(differ[0]) if len(differ) else -1})
                print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    common.print_table(df, f"deterministic mode: losses of two runs of {args.steps} training steps")
    common.write_csv(df, f"e2e_deterministic_{common.device_slug(device)}.csv")
    identical = bool(len(df)) and bool(df["bitwise_identical"].all())
    print(f"bitwise-identical losses in {int(df['bitwise_identical'].sum()) if len(df) else 0}/{len(df)} cells")
    return 0 if identical else 1


def summarize_files(paths) -> None:
    """summarize() of the rows of several e2e CSVs, speedups recomputed over them all."""
    rows = pd.concat([pd.read_csv(path) for path in paths], ignore_index=True)
    rows = rows.drop(columns=["best_pyg_ms", "best_pyg_peak_mb", "speedup", "peak_ratio"], errors="ignore")
    summarize(with_speedups(rows))


def main():
    if "--minibatch" in sys.argv:  # sampled mini-batch training: bench/minibatch.py, its own options
        import minibatch
        return minibatch.main([arg for arg in sys.argv[1:] if arg != "--minibatch"])
    args = parse_args()
    if args.summarize:
        return summarize_files(args.summarize)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's matmuls, read when cuBLAS starts
        return check_deterministic(args, device)
    torch._dynamo.config.cache_size_limit = 64  # modes x dtypes x layers recompile the same code
    args.name = f"e2e_{common.device_slug(device)}{'_quick' if args.quick else ''}"
    both_compiled = len({library_of(p) for p in args.paths if p.endswith("compile")}) > 1
    cuda_graphs = args.compile_mode in ("reduce-overhead", "max-autotune")
    apart = not args.rows_csv and (args.processes == "per-library" or (
        args.processes is None and device.type == "cuda" and both_compiled and cuda_graphs))
    if args.rows_csv:  # a child of run_libraries_apart: time, write the rows, leave the summary to the parent
        time_in_process(args, device)
        return
    print(f"e2e on {common.device_name(device)}: models {args.models}, paths {args.paths}, dtypes {args.dtypes}")
    df = with_speedups(run_libraries_apart(args) if apart else time_in_process(args, device))
    paths = common.write_csv(df, f"{args.name}.csv")
    for csv_path in paths:
        plot(df, csv_path[: -len(".csv")] + ".png")
    print(f"\nwrote {', '.join(paths)} and .png charts next to them")
    summarize(df)


if __name__ == "__main__":
    sys.exit(main())
