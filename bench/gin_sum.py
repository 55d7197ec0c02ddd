#!/usr/bin/env python3
"""Microbenchmark: GIN's inference aggregation (1 + eps) x[d] + sum of x[src]
over the edges into d, as one op (geot::index_sum_plus_scaled, what
geot.nn.GINConv runs without gradients) against what PyG's compiled GINConv
runs: inductor's fused gather / scatter_add plus the scaled term.

Each call is timed inside a CUDA graph of --calls calls (median of --reps
replays, per call), so neither library pays launch costs and L2 stays warm,
as in a compiled model's replay: on small graphs kernel counts and tails
decide. Rows: the op with the default config, geot's sum alone
(index_segment_reduce), inductor's fused version, and with --configs every
config of the narrow space forced (which the rules might pick instead).
The graph's indices are declared static (geot.mark_static_index), as
geot.nn declares a compiled model's kept graph: the warm-up caches their
segment offsets and the replays read them.
GPU only; writes bench/out/gin_sum_<gpu>.csv.

    python bench/gin_sum.py [--graphs cora,citeseer,pubmed] [--F 64 128] [--configs]
"""
import argparse
import os
import statistics
import sys

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

import geot  # noqa: E402
from geot.config import config_space, explain, long_segment_level  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def graph_us(fn, calls: int, reps: int) -> float:
    """Median µs per call of fn, replayed `calls` at a time in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and any lazy setup) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def inductor_gin_sum(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, eps: torch.Tensor):
    """PyG GINConv's aggregation as its compiled model runs it: specialized
    to each shape and dtype, as a model's layers are (dynamic shapes took
    inductor's scatter off its fused kernel: 5-10x slower)."""
    def gin_sum(x):
        index = dst.view(-1, 1).expand(-1, x.size(1))
        return x.new_zeros(num_nodes, x.size(1)).scatter_add_(0, index, x.index_select(0, src)) + (1 + eps) * x
    return torch.compile(gin_sum, dynamic=False)


def bench_graph(graph, args) -> list:
    src, dst, n = graph.src, graph.dst, graph.num_nodes
    for index in (src, dst):
        geot.mark_static_index(index)
    level = long_segment_level(int(torch.bincount(dst, minlength=n).max()))
    eps = torch.tensor([0.0], device="cuda")  # PyG's default eps; geot.nn.GINConv passes it and a 1 to add
    op = torch.ops.geot.index_sum_plus_scaled
    # One compiled function per graph: its (F, dtype) variants of earlier
    # graphs would pass dynamo's recompile limit, which runs the rest eagerly.
    torch._dynamo.reset()
    peer = inductor_gin_sum(src, dst, n, eps)
    rows = []
    for dtype_name in args.dtypes:
        for F in args.F:
            x = torch.randn(n, F, device="cuda", dtype=DTYPES[dtype_name])
            cell = dict(graph=graph.name, E=graph.num_edges, N=n, F=F, dtype=dtype_name)
            picked = tuple(explain(graph.num_edges, n, F, gathered=True, long_segments=level))
            timed = {"geot": lambda: op(src, dst, x, eps, scale_offset=1.0),
                     "geot_sum_only": lambda: geot.index_segment_reduce(src, dst, x, "sum", n),
                     "inductor": lambda: peer(x)}
            for method, fn in timed.items():
                config = picked if method.startswith("geot") else None
                rows.append({**cell, "method": method, "config": config, "us": graph_us(fn, args.calls, args.reps)})
            for config in config_space(narrow=True) if args.configs else []:
                try:
                    us = graph_us(lambda: op(src, dst, x, eps, list(config), 1.0), 5, 7)
                except (RuntimeError, ValueError):  # a config this shape cannot take
                    continue
                rows.append({**cell, "method": "geot_config", "config": tuple(config), "us": us})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default="cora,citeseer,pubmed", help="names or generator specs (bench/common.py)")
    parser.add_argument("--F", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--calls", type=int, default=10, help="calls per CUDA graph")
    parser.add_argument("--reps", type=int, default=15, help="timed replays (median)")
    parser.add_argument("--configs", action="store_true", help="also every config of the narrow space, forced")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gin_sum.py times CUDA graphs: it needs a GPU")
    rows = []
    for spec in common.split_graph_specs(args.graphs):
        graph = common.make_graph(spec, device="cuda")
        if graph is not None:
            rows += bench_graph(graph, args)
    df = pd.DataFrame(rows)
    paths = common.write_csv(df, f"gin_sum_{common.device_slug()}.csv")
    main_rows = df[df["method"] != "geot_config"]
    table = main_rows.pivot_table(index=["graph", "F", "dtype"], columns="method", values="us", sort=False)
    table["inductor / geot"] = table["inductor"] / table["geot"]
    common.print_table(table.reset_index(), "µs per call in CUDA graphs", floatfmt="{:.2f}")
    if args.configs:
        best = df[df["method"] == "geot_config"].groupby(["graph", "F", "dtype"], sort=False)["us"].min()
        print("\nfastest forced config / default pick: "
              + ", ".join(f"{g} F={f} {d} {best[g, f, d] / table.loc[(g, f, d), 'geot']:.2f}" for g, f, d in best.index))
    print(f"\ngeomean inductor / geot: {common.geomean(table['inductor / geot']):.2f}x; wrote {', '.join(paths)}")


if __name__ == "__main__":
    main()
