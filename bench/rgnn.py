"""Relational GNNs (RGCN, RGAT, HGT) on heterogeneous graphs: geot.nn against PyG.

Measured as Pigeon and Hector measure them: one layer with in = out = 64
channels and one head ("1x64"), and two layers of hidden 64 with 4 heads
("2x64h4"; RGCN has no heads: two layers of 64), each for inference and for
a training step (forward, log-softmax NLL loss against random labels,
backward, Adam step). Paths:

    geot              geot.nn.RGCNConv / RGATConv / HGTConv (eager)
    pyg               PyG's RGCNConv / RGATConv / HGTConv
    pyg-fast          PyG's FastRGCNConv (RGCN only)
    pyg-hetero        RGCN as PyG's heterogeneous models write it (RGCN only),
                      on the dicts: HeteroConv over the edge types, a SAGEConv
                      per edge type (its mean and weight), summed, plus one root
                      Linear with bias on every node type (HeteroRGCN: the
                      function RGCNConv computes)
    pyg-compile, pyg-fast-compile, pyg-hetero-compile, geot-compile
                      torch.compile of those
                      (--compile: one compilation per graph, model, variant
                      and path, with no eager call first, so the run takes
                      much longer)

Graphs are generated with the shapes (node types, edge types, nodes, edges)
of Pigeon's datasets (GRAPHS): node-type sizes and relation frequencies
Zipf-skewed, each relation between two node types, sources and destinations
drawn with power-law degrees, hubs at random ids; 64 random features per
node. RGCN and RGAT take the homogeneous view (ids offset by node type, one
relation per edge type, edges in random order); HGT and pyg-hetero the
dicts. A cell reports the median ms per step (CUDA events, L2 flush, host
time included, as bench/e2e.py; the median of 3 to 10 reps, a step slower
than --max-time timed once), the peak memory of a step, the seconds of a
mode's first call (``first_s``: compilation, for the compiled paths) and,
where a path runs out of memory, "OOM" (counted in the summary); speedups
are against the fastest PyG path of the cell. A compiled path whose first
(compiling) call of a mode takes longer than --compile-limit seconds is
noted, not timed: PyG's HGTConv traces every relation's ops into its graph,
which can take minutes (fb15k's 474 relations, one layer: over two minutes
on an H100). float32 matmuls run as TF32 on every path (``--precision
high``; geot's typed matmuls need it on CUDA, else they loop over types;
``--precision highest`` gives every path IEEE float32). No cell starts
after --budget seconds (those left are noted "skipped").

    python bench/rgnn.py                            # every graph, model, variant, eager path (H100: under 6 min)
    python bench/rgnn.py --compile --budget 3600    # with PyG's compiled paths
    python bench/rgnn.py --graphs aifb,mutag --models rgat
    python bench/rgnn.py --quick                    # tiny CPU check that everything runs
"""
import argparse
import contextlib
import os
import signal
import sys
import time
import traceback

import pandas as pd
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))
import common  # noqa: E402
from e2e import fresh_state  # noqa: E402
from report import with_speedups  # noqa: E402

import geot.nn as geot_nn  # noqa: E402

# name: (node types, edge types, nodes, edges), Pigeon's datasets
GRAPHS = {
    "aifb": (7, 104, 7_300, 48_800),
    "mutag": (5, 50, 27_200, 148_000),
    "bgs": (27, 122, 94_800, 673_000),
    "am": (7, 108, 1_890_000, 5_670_000),
    "mag": (4, 4, 1_940_000, 21_100_000),
    "wikikg2": (1, 535, 2_500_000, 16_100_000),
    "fb15k": (1, 474, 14_500, 620_000),
    "biokg": (5, 51, 93_800, 4_760_000),
}
MODELS = ("rgcn", "rgat", "hgt")
VARIANTS = {"1x64": (1, 1), "2x64h4": (2, 4)}  # (layers, heads)
PATHS = ("geot", "pyg", "pyg-fast", "pyg-hetero")
COMPILED = ("pyg-compile", "pyg-fast-compile", "pyg-hetero-compile", "geot-compile")
RGCN_ONLY = ("pyg-fast", "pyg-hetero")
CHANNELS = 64


# Graphs ---------------------------------------------------------------------------------------

def zipf_shares(count: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """[count] shares summing to 1, proportional to 1 / rank^exponent, in random order."""
    shares = 1.0 / torch.arange(1, count + 1, dtype=torch.float64).pow(exponent)
    return (shares / shares.sum())[torch.randperm(count, generator=gen)]


def split(total: int, shares: torch.Tensor, minimum: int) -> list:
    """total split by shares, each part at least minimum (the last part takes the rounding)."""
    parts = [max(minimum, int(total * float(s))) for s in shares]
    parts[-1] = max(minimum, total - sum(parts[:-1]))
    return parts


def skewed_ids(count: int, num_nodes: int, relabel: torch.Tensor, gen: torch.Generator, device) -> torch.Tensor:
    """count node ids in [0, num_nodes) with power-law frequencies (id k drawn ~ 1/k^0.8), hubs at the
    random ids relabel gives."""
    u = torch.rand(count, generator=gen, device=device, dtype=torch.float64)
    rank = (u.pow(5.0) * num_nodes).long().clamp_(max=num_nodes - 1)  # density ~ x^-0.8 on (0, 1]
    return relabel.index_select(0, rank)


def hetero_graph(name: str, scale: float = 1.0, seed: int = 0, device="cpu", max_types: int = 0) -> dict:
    """A generated heterogeneous graph with the shape of Pigeon's dataset ``name``: node counts per type,
    (src type, relation, dst type) -> [2, E_r] edges, the homogeneous view and 64-feature inputs.
    max_types: at most this many node and edge types (0: as the dataset)."""
    node_types, edge_types, nodes, edges = GRAPHS[name]
    if max_types:
        node_types, edge_types = min(node_types, max_types), min(edge_types, max_types)
    nodes, edges = max(node_types * 8, int(nodes * scale)), max(edge_types * 4, int(edges * scale))
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    counts = split(nodes, zipf_shares(node_types, 1.0, gen), 8)
    nodes = sum(counts)  # the minimums may add a few
    types = [f"n{t}" for t in range(node_types)]
    relabel = {t: torch.randperm(n, generator=dev_gen, device=device) for t, n in zip(types, counts)}
    per_relation = split(edges, zipf_shares(edge_types, 1.1, gen), 1)
    ends = torch.randint(0, node_types, (edge_types, 2), generator=gen)
    offsets = dict(zip(types, [0] + torch.tensor(counts).cumsum(0).tolist()[:-1]))
    count = dict(zip(types, counts))
    edge_index_dict = {}
    for r, (size, (s, d)) in enumerate(zip(per_relation, ends.tolist())):
        src_type, dst_type = types[s], types[d]
        src = skewed_ids(size, count[src_type], relabel[src_type], dev_gen, device)
        dst = skewed_ids(size, count[dst_type], relabel[dst_type], dev_gen, device)
        edge_index_dict[src_type, f"r{r}", dst_type] = torch.stack([src, dst])
    homogeneous = torch.cat([e + torch.tensor([[offsets[k[0]]], [offsets[k[-1]]]], device=device)
                             for k, e in edge_index_dict.items()], 1)
    edge_type = torch.cat([torch.full((e.size(1),), r, device=device) for r, e in enumerate(edge_index_dict.values())])
    order = torch.randperm(edge_type.numel(), generator=dev_gen, device=device)  # edges in no order, as users' are
    x = torch.randn(nodes, CHANNELS, generator=dev_gen, device=device)
    x_dict = {t: x[offsets[t]:offsets[t] + count[t]] for t in types}
    labels = torch.randint(0, CHANNELS, (nodes,), generator=dev_gen, device=device)
    return {"name": name, "num_nodes": nodes, "num_edges": int(edge_type.numel()), "num_relations": edge_types,
            "x": x, "edge_index": homogeneous[:, order], "edge_type": edge_type[order], "x_dict": x_dict,
            "edge_index_dict": edge_index_dict, "labels": labels,
            "metadata": (types, list(edge_index_dict)), "offsets": offsets}


# Models ---------------------------------------------------------------------------------------

class Relational(torch.nn.Module):
    """RGCN or RGAT layers on the homogeneous view (ReLU between layers)."""

    def __init__(self, layer_class, model: str, layers: int, heads: int, relations: int):
        super().__init__()
        if model == "rgcn":
            make = lambda: layer_class(CHANNELS, CHANNELS, relations)  # noqa: E731
        else:
            make = lambda: layer_class(CHANNELS, CHANNELS // heads, relations, heads=heads)  # noqa: E731
        self.convs = torch.nn.ModuleList([make() for _ in range(layers)])

    def forward(self, inputs):
        x = inputs["x"]
        for i, conv in enumerate(self.convs):
            x = conv(x, inputs["edge_index"], inputs["edge_type"])
            x = F.relu(x) if i < len(self.convs) - 1 else x
        return x


class Hetero(torch.nn.Module):
    """Layers on the dicts (HGT, or HeteroConv's RGCN) made by make_layer; the output: every node type's
    rows, concatenated in node order."""

    def __init__(self, make_layer, layers: int):
        super().__init__()
        self.convs = torch.nn.ModuleList([make_layer() for _ in range(layers)])

    def forward(self, inputs):
        x_dict = inputs["x_dict"]
        for i, conv in enumerate(self.convs):
            out = conv(x_dict, inputs["edge_index_dict"])
            x_dict = {t: out.get(t, x) for t, x in x_dict.items()}  # types no edge reaches keep their rows
            if i < len(self.convs) - 1:
                x_dict = {t: F.relu(x) for t, x in x_dict.items()}
        return torch.cat(list(x_dict.values()))


class HeteroRGCN(torch.nn.Module):
    """RGCNConv's function on the dicts, as a PyG user writes it: a HeteroConv of one SAGEConv per edge
    type (the relation's mean times its weight; no root, no bias), summed per destination type, plus one
    root Linear with RGCN's bias on every node type, those no edge reaches too."""

    def __init__(self, edge_types):
        super().__init__()
        self.relations = pyg_nn.HeteroConv({edge_type: pyg_nn.SAGEConv(CHANNELS, CHANNELS, root_weight=False,
                                                                       bias=False) for edge_type in edge_types},
                                           aggr="sum")
        self.root = torch.nn.Linear(CHANNELS, CHANNELS)

    def forward(self, x_dict, edge_index_dict):
        out = self.relations(x_dict, edge_index_dict)
        return {t: self.root(x) + out[t] if t in out else self.root(x) for t, x in x_dict.items()}


def build(model: str, path: str, variant: str, graph: dict) -> torch.nn.Module:
    layers, heads = VARIANTS[variant]
    lib = geot_nn if path.startswith("geot") else pyg_nn
    if model == "hgt":
        return Hetero(lambda: lib.HGTConv(CHANNELS, CHANNELS, graph["metadata"], heads=heads), layers)
    if path.startswith("pyg-hetero"):
        return Hetero(lambda: HeteroRGCN(graph["metadata"][1]), layers)
    layer_class = pyg_nn.FastRGCNConv if path.startswith("pyg-fast") else getattr(lib, model.upper() + "Conv")
    return Relational(layer_class, model, layers, heads, graph["num_relations"])


def paths_of(model: str, paths) -> list:
    return [p for p in paths if model == "rgcn" or not p.startswith(RGCN_ONLY)]


def step_functions(model: torch.nn.Module, runner, graph: dict):
    """(inference step, training step) of a model; runner is the model or its compiled version."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def infer():
        model.eval()
        with torch.no_grad():
            runner(graph)

    def train():
        model.train()
        optimizer.zero_grad()
        F.nll_loss(F.log_softmax(runner(graph), dim=-1), graph["labels"]).backward()
        optimizer.step()

    return infer, train


# Running --------------------------------------------------------------------------------------

def is_oom(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def bench_cells(model_name: str, variant: str, graph: dict, args, device, deadline: float) -> list:
    """Every (path, mode) cell of one model variant on one graph: per path one model (one compilation),
    its inference cell, then its training cell."""
    rows = []
    for path in paths_of(model_name, args.paths):
        cells = [{"model": model_name, "hidden": variant, "graph": graph["name"], "dtype": "fp32", "mode": mode,
                  "path": path, "ms": float("nan"), "peak_mb": float("nan"), "resident_mb": float("nan"),
                  "first_s": float("nan"),
                  "note": ""} for mode in ("inference", "train")]
        rows += cells
        if time.time() > deadline:
            for row in cells:
                row["note"] = "skipped: time budget"
            continue
        run_path(cells, model_name, variant, graph, args, device)
        for row in cells:
            print(f"  {model_name}/{variant} {graph['name']} {row['mode']:<9} {path:<16} "
                  f"{common.fmt_ms(row['ms'])} ms {row['note']}", flush=True)
    return rows


def run_path(cells: list, model_name: str, variant: str, graph: dict, args, device) -> None:
    """Times a path's inference and training cells; running out of memory (or another failure of a PyG
    path) is noted in the cell, not raised."""
    fresh_state(device)
    torch.manual_seed(0)
    model = runner = steps = None
    try:
        model = build(model_name, cells[0]["path"], variant, graph).to(device)
        runner = torch.compile(model, backend=args.backend) if cells[0]["path"].endswith("compile") else model
        steps = dict(zip(("inference", "train"), step_functions(model, runner, graph)))
        limit = args.compile_limit if runner is not model else 0
        for i, row in enumerate(cells):
            try:
                row["ms"], row["peak_mb"], row["resident_mb"], row["first_s"] = measure(
                    steps[row["mode"]], device, args.max_time, limit)
            except Exception as error:  # noqa: BLE001  (PyG running out of memory is a result)
                if compile_timed_out(error):  # the next mode would compile as long: not tried
                    for late in cells[i:]:
                        late["note"] = f"n/a: compilation over {limit:g} s"
                    torch._dynamo.reset()
                    break
                row["note"] = failure_note(error, row["path"])
            if row["note"]:  # the failed step's tensors are unreferenced once its traceback is gone
                fresh_state(device)
    except Exception as error:  # noqa: BLE001
        for row in cells:
            row["note"] = row["note"] or failure_note(error, row["path"])
    finally:
        del model, runner, steps  # freed by the next path's fresh_state


def failure_note(error: Exception, path: str) -> str:
    if is_oom(error):
        return "OOM"
    if path.startswith("geot"):  # geot failing otherwise is a bug: show where
        traceback.print_exception(error)
    return f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"


class CompileTimeout(Exception):
    pass


def compile_timed_out(error: BaseException) -> bool:
    """Whether CompileTimeout caused error (inductor wraps what its compilation raises)."""
    while error is not None:
        if isinstance(error, CompileTimeout):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises CompileTimeout in the main thread after seconds (0: no limit)."""
    if seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise CompileTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure(step, device, max_time: float, compile_limit: float = 0):
    """(median ms, peak MB, resident MB, seconds of the first call) of a step: one call not in the
    median (compilation, caches; at most compile_limit seconds, else CompileTimeout), then one whose
    peak memory is read
    (max_memory_allocated, from what is resident before it) and time kept, alone if it took over
    max_time; else 3 to 10 reps, as many as fit in max_time. CUDA events, host time included (as
    bench/e2e.py)."""
    cuda = device.type == "cuda"
    start = time.perf_counter()
    with time_limit(compile_limit):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - start
    peak = resident = float("nan")
    if cuda:
        common.release_flush_buffer(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / 2**20
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    once_ms = (time.perf_counter() - start) * 1e3
    if once_ms > max_time * 1e3:
        return once_ms, peak, resident, first_s
    reps = int(min(10, max(3, max_time * 1e3 / max(once_ms, 1e-3))))  # a median of 3 at least
    timing = common.time_stats(step, warmup=0, reps=reps, device=device, max_time_s=max_time, min_reps=3,
                               gate=False)
    return timing.median_ms, peak, resident, first_s


def summarize(df: pd.DataFrame) -> None:
    keys = ["model", "hidden", "graph", "mode"]
    wide = df.pivot_table(index=keys, columns="path", values="ms", sort=False).reset_index()
    common.print_table(wide, "ms per step (NaN: OOM, failed or skipped)")
    compiled = df[df["path"].str.endswith("compile") & df["first_s"].notna()]
    if len(compiled):
        first = compiled.pivot_table(index=keys, columns="path", values="first_s", sort=False).reset_index()
        common.print_table(first, "seconds of the first call of the compiled paths (compilation)")
    print("\ngeot's geomean speedup over the fastest PyG path of each cell; OOM cells per path")
    for model in df["model"].unique():
        for mode in ("inference", "train"):
            sel = df[(df["model"] == model) & (df["mode"] == mode) & (df["path"] == "geot")].dropna(subset=["speedup"])
            if len(sel):
                print(f"  {model:<5} {mode:<9} {common.geomean(sel['speedup']):.2f}x over {len(sel)} cells "
                      f"(worst {sel['speedup'].min():.2f}x)")
    ooms = df[df["note"] == "OOM"].groupby(["model", "path"]).size()
    for (model, path), count in ooms.items():
        print(f"  OOM: {model} {path} in {count} cells")
    ratio = df[df["path"] == "geot"]["peak_ratio"].dropna()
    if len(ratio):
        print(f"  geot's peak memory / the fastest PyG path's: geomean {common.geomean(ratio):.2f}x, "
              f"max {ratio.max():.2f}x")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default=",".join(sorted(GRAPHS, key=lambda name: GRAPHS[name][3])),
                        help="default: all, fewest edges first")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--compile", action="store_true",
                        help="add PyG's compiled paths (one compilation per graph, model, variant and path)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--scale", type=float, default=1.0, help="nodes and edges times this")
    parser.add_argument("--max-types", type=int, default=0, help="at most this many node and edge types")
    parser.add_argument("--precision", default="high", help="torch.set_float32_matmul_precision, every path")
    parser.add_argument("--max-time", type=float, default=1.0, help="seconds of timed work per cell at most")
    parser.add_argument("--compile-limit", type=float, default=120.0,
                        help="seconds a compiled path's first call (compilation) may take; 0: no limit")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds after which no cell starts")
    parser.add_argument("--quick", action="store_true",
                        help="tiny CPU check: aifb at 1/500 scale, at most 6 types, eager paths, 1 rep")
    args = parser.parse_args(argv)
    if args.quick:
        args.graphs, args.scale, args.max_types, args.max_time = "aifb", 0.002, 6, 0.05
    args.graphs, args.models, args.variants = (s.split(",") for s in (args.graphs, args.models, args.variants))
    args.paths = list(dict.fromkeys(args.paths.split(",") + (list(COMPILED) if args.compile else [])))
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_float32_matmul_precision(args.precision)
    torch._dynamo.config.cache_size_limit = 64
    if args.compile:  # inductor's one-off start (workers, imports) is no model's compilation time
        torch.compile(lambda t: t.sin() + 1)(torch.ones(4, device=device))
    deadline = time.time() + args.budget
    print(f"rgnn on {common.device_name(device)}: graphs {args.graphs}, models {args.models}, "
          f"paths {args.paths}, matmul precision {args.precision}", flush=True)
    name = f"rgnn_{common.device_slug(device)}{'_quick' if args.quick else ''}"
    rows = []
    for graph_name in args.graphs:
        graph = hetero_graph(graph_name, args.scale, device=device, max_types=args.max_types)
        print(f"{graph_name}: {graph['num_nodes']} nodes, {graph['num_edges']} edges, "
              f"{len(graph['metadata'][0])} node types, {graph['num_relations']} edge types", flush=True)
        for model_name in args.models:
            for variant in args.variants:
                rows += bench_cells(model_name, variant, graph, args, device, deadline)
        common.write_csv(with_speedups(pd.DataFrame(rows)), f"{name}.csv")  # a run cut off keeps its rows
        del graph
    df = with_speedups(pd.DataFrame(rows))
    paths = common.write_csv(df, f"{name}.csv")
    print(f"\nwrote {', '.join(paths)}")
    summarize(df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
