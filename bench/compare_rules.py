#!/usr/bin/env python3
"""Times geot's config rule sets against each other on this GPU, in one
process: for each cell (graph, F) of bench/segment_reduce.py's (plain rows,
sum) and bench/spmm.py's forward (gathered rows, weighted sum), every rule
set's pick and the hand heuristic's are launched in turn, rep after rep
(CUDA events, an L2 flush and a GPU hold before each launch, median of
--reps), so drift between runs (10-16% on the 5-10 us cells of the small
graphs, between two bench processes on an H200) cannot pass for a
difference between rule sets. Rule sets that pick the same config share
its timing. Prints, per bench, each rule set's speedup over the first (the
first's time / its time: geomean over the cells and the worst cell) and
over the heuristic; the cells go to bench/out (and $OUT), for
`python bench/report.py --add compare_rules <csv> --gpu <gpu>`.

    python bench/compare_rules.py                                   # every compiled-in rule set
    python bench/compare_rules.py --rules nvidia-h100-80gb-hbm3 nvidia-h200
    python bench/compare_rules.py --quick                           # smoke test
"""
import argparse
import os
import sys
from typing import Callable, Dict, List

import numpy as np
import pandas as pd
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH_DIR), BENCH_DIR]
import common  # noqa: E402
import geot  # noqa: E402
from report import HEURISTIC, rule_set_summary  # noqa: E402

BENCHES = ("segment_reduce", "spmm")
GRAPHS = ["cora", "citeseer", "pubmed", "powerlaw", "uniform", "hubs", "powerlaw_small"]  # the two benches' defaults
F_VALUES = [1, 2, 4, 8, 16, 32, 64, 128]
QUICK_GRAPHS, QUICK_F = ["cora", "powerlaw_small"], [1, 32]


def bench_call(bench: str, g: common.Graph, F: int) -> Callable[[geot.Config], torch.Tensor]:
    """The op of a bench cell with an explicit config (what the rules would pass)."""
    if bench == "segment_reduce":
        src = torch.randn(g.num_edges, F, device="cuda")
        return lambda cfg: geot.segment_reduce(g.dst, src, "sum", g.num_nodes, config=cfg)
    x = torch.randn(g.num_nodes, F, device="cuda")
    weight = torch.rand(g.num_edges, device="cuda")
    return lambda cfg: geot.index_weight_segment_reduce(g.src, g.dst, weight, x, "sum", g.num_nodes, config=cfg)


def picks(bench: str, g: common.Graph, F: int, rules: List[str]) -> Dict[str, geot.Config]:
    """Each rule set's config for the cell, in the order given, and the
    heuristic's; the long-segment level as index validation reports it."""
    level = geot.config.long_segment_level(g.degree_stats()["max_deg"])
    shape = dict(num_rows=g.num_edges, num_segments=g.num_nodes, num_features=F, gathered=bench == "spmm",
                 long_segments=level)
    return {slug: geot.explain(**shape, **({"arch": 0} if slug == HEURISTIC else {"gpu": slug}))
            for slug in [*rules, HEURISTIC]}


def time_interleaved(call, configs: List[geot.Config], warmup: int, reps: int) -> Dict[geot.Config, float]:
    """Median ms of each config, its launches alternating with the others'."""
    events = {cfg: [] for cfg in configs}
    for rep in range(warmup + reps):
        for cfg in configs:
            common.flush_l2("cuda")
            common.hold_gpu()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(cfg)
            end.record()
            if rep >= warmup:
                events[cfg].append((start, end))
    torch.cuda.synchronize()
    return {cfg: float(np.median([s.elapsed_time(e) for s, e in pairs])) for cfg, pairs in events.items()}


def cell_rows(bench: str, g: common.Graph, F: int, rules: List[str], reps: int) -> List[dict]:
    call = bench_call(bench, g, F)
    chosen = picks(bench, g, F, rules)
    distinct = list(dict.fromkeys(chosen.values()))
    call(distinct[0])  # validates the index once (cached), as a model's first call does
    times = time_interleaved(call, distinct, warmup=2, reps=reps)
    return [dict(bench=bench, graph=g.name, E=g.num_edges, num_segments=g.num_nodes, F=F, rules=slug,
                 config=",".join(map(str, cfg)), ms=times[cfg]) for slug, cfg in chosen.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", nargs="+", default=None,
                    help=f"rule-set slugs or {HEURISTIC!r}, the first the reference (default: every compiled-in "
                         "one, this GPU's own last; the heuristic is timed in every run)")
    ap.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    ap.add_argument("--graphs", nargs="+", default=None, help=f"graph names or specs (default: {' '.join(GRAPHS)})")
    ap.add_argument("--F", type=int, nargs="+", default=None, help=f"widths (default: {F_VALUES})")
    ap.add_argument("--reps", type=int, default=51, help="timed launches per config (median)")
    ap.add_argument("--quick", action="store_true", help=f"graphs {' '.join(QUICK_GRAPHS)}, F {QUICK_F}")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not geot.cuda_built:
        sys.exit("bench/compare_rules.py times CUDA launches: it needs a GPU and geot built with CUDA")
    known = [r["slug"] for r in geot.rule_sets()]
    rules = args.rules or sorted(known, key=lambda s: s == common.device_slug())
    unknown = [slug for slug in rules if slug not in known + [HEURISTIC]]
    if unknown:
        sys.exit(f"--rules: no compiled-in rule set {unknown}; there are {known} (and {HEURISTIC!r})")
    geot.set_validation(True)  # its long-segment level reaches the launch, as for users
    rows = []
    for spec in args.graphs or (QUICK_GRAPHS if args.quick else GRAPHS):
        g = common.make_graph(spec, device="cuda")
        if g is None:
            continue
        for F in args.F or (QUICK_F if args.quick else F_VALUES):
            for bench in args.benches:
                rows += cell_rows(bench, g, F, rules, args.reps)
        del g
    cells = pd.DataFrame(rows)
    table = rule_set_summary(cells)
    print(f"\n{common.device_name()}: speedup of each rule set's picks, launched in turn in one process "
          "(geomean over the cells, worst cell)")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    common.write_csv(cells, f"compare_rules_{common.device_slug()}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
