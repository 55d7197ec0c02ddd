"""Times every kernel config on a corpus of graphs x feature sizes.

Writes one row per (graph, F, config) to perfdb/<gpu>/segment_reduce.csv
(pandas-readable), resuming where an earlier run stopped. Run on a GPU:

    python perfdb/sweep.py                 # default corpus
    python perfdb/sweep.py --graphs uniform:num_nodes=200000,degree=16 --F 64 128
"""
import argparse
import os
import sys

import pandas as pd
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import geot  # noqa: E402
from common import device_slug, make_graph, time_cuda  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # progress bar is optional
    def tqdm(iterable, **_):
        return iterable

DEFAULT_GRAPHS = [  # small, skewed, even and hub-heavy graphs
    "cora", "pubmed",
    "powerlaw:num_nodes=300000,avg_degree=10",
    "uniform:num_nodes=200000,degree=16",
    "uniform:num_nodes=1000000,degree=4",
    "hubs:num_nodes=1000000",
]
DEFAULT_F = [1, 2, 4, 8, 16, 32, 64, 128]


def sweep_cell(graph, F, configs, reps):
    index, S = graph.dst, graph.num_nodes
    src = torch.randn(graph.num_edges, F, device="cuda")
    degree = torch.bincount(index, minlength=S)
    base = dict(graph=graph.name, E=graph.num_edges, num_segments=S, avg=graph.num_edges / max(S, 1),
                max_deg=int(degree.max()) if S else 0, F=F)
    moved = (graph.num_edges * (F * 4 + 8) + S * F * 4) / 1e9
    heuristic = geot.explain(graph.num_edges, S, F, long_segments=base["max_deg"] > 64)
    ms = time_cuda(lambda: geot.segment_reduce(index, src, "sum", S), warmup=2, reps=reps)
    rows = [dict(base, schedule="heuristic", **heuristic._asdict(), time_ms=ms, gbps=moved / ms * 1e3)]
    for cfg in configs:
        ms = time_cuda(lambda: geot.segment_reduce(index, src, "sum", S, config=cfg), warmup=2, reps=reps)
        rows.append(dict(base, schedule=cfg.schedule, **cfg._asdict(), time_ms=ms, gbps=moved / ms * 1e3))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=DEFAULT_GRAPHS)
    parser.add_argument("--F", type=int, nargs="+", default=DEFAULT_F)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="CSV path (default perfdb/<gpu>/segment_reduce.csv)")
    args = parser.parse_args()

    geot.set_validation(False)
    out = args.out or os.path.join(ROOT, "perfdb", device_slug(), "segment_reduce.csv")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    done = pd.read_csv(out) if os.path.exists(out) else pd.DataFrame(columns=["graph", "F"])
    finished = set(zip(done["graph"], done["F"]))
    configs = geot.config_space(narrow=True)
    for spec in args.graphs:
        graph = make_graph(spec, device="cuda")
        if graph is None:
            continue
        for F in tqdm(args.F, desc=graph.name):
            if (graph.name, F) in finished:
                continue
            cell = pd.DataFrame(sweep_cell(graph, F, configs, args.reps))
            cell.to_csv(out, mode="a", header=not os.path.exists(out), index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
