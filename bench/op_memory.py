#!/usr/bin/env python3
"""Time and memory of geot's fused ops with the configs the library picks.

For each graph x F x dtype, the learned (or heuristic) config of
  sum    geot.index_segment_reduce(src, dst, x, "sum", S)
  mean   geot.index_segment_reduce(src, dst, x, "mean", S)
  wsum   geot.index_weight_segment_reduce(src, dst, w, x, "sum", S)
is timed (CUDA events, warm-up, median, L2 flushed: bench/common.py) and
the memory a call allocates besides its output is measured (peak over a
call after a first one, which validates the index and caches its offsets).
Writes bench/out/op_memory_<device>[_<tag>].csv. To compare two builds
(e.g. before and after a kernel change), run it with each, then

  python bench/op_memory.py --tag before      # with the old build
  python bench/op_memory.py --tag after       # with the new build
  python bench/op_memory.py --compare bench/out/op_memory_<device>_before.csv \
      bench/out/op_memory_<device>_after.csv
"""
from __future__ import annotations

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import geot  # noqa: E402

GRAPHS = ["pubmed", "cora", "powerlaw:n=200000,deg=10", "uniform:n=200000,d=16", "hubs"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def op_calls(graph, x, weight):
    S = graph.num_nodes
    return {"sum": lambda: geot.index_segment_reduce(graph.src, graph.dst, x, "sum", S),
            "mean": lambda: geot.index_segment_reduce(graph.src, graph.dst, x, "mean", S),
            "wsum": lambda: geot.index_weight_segment_reduce(graph.src, graph.dst, weight, x, "sum", S)}


def extra_mb(call, device) -> float:
    """MB a call allocates besides its output, at its peak."""
    call()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before - out.nbytes) / 2**20


def measure(args, device) -> pd.DataFrame:
    rows = []
    for spec in args.graphs:
        graph = common.make_graph(spec, device=device)
        if graph is None:
            print(f"skipping {spec}: not found")
            continue
        weight = torch.rand(graph.num_edges, device=device)
        for F in args.F:
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                x = torch.randn(graph.num_nodes, F, device=device, dtype=dtype)
                for op, call in op_calls(graph, x, weight.to(dtype)).items():
                    memory = extra_mb(call, device)
                    ms = common.time_stats(call, warmup=args.warmup, reps=args.reps, device=device).median_ms
                    rows.append({"graph": graph.name, "F": F, "dtype": dtype_name, "op": op, "ms": ms,
                                 "extra_mb": memory, "tag": args.tag})
    return pd.DataFrame(rows)


def compare(before_csv: str, after_csv: str) -> None:
    """Per cell: time before / after (> 1: faster after) and both memories."""
    keys = ["graph", "F", "dtype", "op"]
    table = pd.read_csv(before_csv).merge(pd.read_csv(after_csv), on=keys, suffixes=("_before", "_after"))
    table["speedup"] = table["ms_before"] / table["ms_after"]
    common.print_table(table[keys + ["ms_before", "ms_after", "speedup", "extra_mb_before", "extra_mb_after"]])
    for dtype, cells in table.groupby("dtype"):
        print(f"{dtype}: geomean speedup {common.geomean(cells['speedup']):.3f} over {len(cells)} cells "
              f"(min {cells['speedup'].min():.3f}, max {cells['speedup'].max():.3f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS), help="names or generator specs (bench/common.py)")
    parser.add_argument("--F", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--tag", default="", help="names the run in the CSV's file name and rows")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE_CSV", "AFTER_CSV"),
                        help="print the change between two runs' CSVs instead of measuring")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not torch.cuda.is_available():
        sys.exit("op_memory.py measures CUDA memory: it needs a GPU")
    args.graphs, args.dtypes = common.split_graph_specs(args.graphs), args.dtypes.split(",")
    device = torch.device("cuda")
    table = measure(args, device)
    name = f"op_memory_{common.device_slug(device)}{'_' + args.tag if args.tag else ''}.csv"
    common.print_table(table)
    print("wrote " + ", ".join(common.write_csv(table, name)))


if __name__ == "__main__":
    main()
