#!/usr/bin/env python3
"""Times geot's config rule sets against each other on this GPU: runs
bench/segment_reduce.py and bench/spmm.py (fwd) once per rule set (--rules,
a process each) and prints, per bench, each rule set's speedup over the
first one (the first's time / its time: geomean over the cells and worst
cell) and over the hand heuristic (timed in every run). CSVs go to
bench/out (and $OUT).

    python bench/compare_rules.py                                   # every compiled-in rule set
    python bench/compare_rules.py --rules nvidia-h200 nvidia-h100-80gb-hbm3
    python bench/compare_rules.py --quick                           # smoke test
"""
import argparse
import os
import subprocess
import sys

import numpy as np
import pandas as pd

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import common  # noqa: E402

# bench -> (keys of a cell, geot's time column, the heuristic's)
BENCHES = {
    "segment_reduce": (["graph", "F", "reduce", "dtype"], "geot_ms", "geot_heuristic_ms"),
    "spmm": (["graph", "F", "dtype"], "geot", "geot_heuristic"),
}


def run_bench(bench: str, rules: str, quick: bool) -> pd.DataFrame:
    slug = common.device_slug()
    if bench == "segment_reduce":
        # One peer (the rule sets are the comparison): the run takes a minute or two.
        args, csv = ["--max-time", "0.2", "--methods", "index_add"], f"segment_reduce_{slug}_rules-{rules}.csv"
    else:
        args, csv = ["--sections", "fwd"], f"spmm_fwd_{slug}_rules-{rules}.csv"
    command = [sys.executable, os.path.join(BENCH_DIR, f"{bench}.py"), *args, "--rules", rules]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command + (["--quick"] if quick else []), check=True, stdout=subprocess.DEVNULL)
    return pd.read_csv(os.path.join(common.out_dir(), csv))


def geomean(ratios: pd.Series) -> float:
    ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
    return float(np.exp(np.log(ratios).mean())) if len(ratios) else float("nan")


def compare(bench: str, runs: dict) -> pd.DataFrame:
    """Per rule set: geomean and worst cell of (first rule set's time / its
    time) and of (heuristic time / its time)."""
    keys, geot_ms, heuristic_ms = BENCHES[bench]
    reference = list(runs)[0]
    base = runs[reference].set_index(keys)[geot_ms]
    rows = []
    for rules, df in runs.items():
        df = df.set_index(keys)
        vs_reference = base.reindex(df.index) / df[geot_ms]
        vs_heuristic = df[heuristic_ms] / df[geot_ms]
        rows.append({"bench": bench, "rules": rules, "cells": int(np.isfinite(vs_reference).sum()),
                     f"vs {reference}": geomean(vs_reference), "worst cell": float(vs_reference.min()),
                     "vs heuristic": geomean(vs_heuristic), "worst vs heuristic": float(vs_heuristic.min())})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", nargs="+", default=None,
                    help="rule-set slugs (default: every compiled-in one, this GPU's own last)")
    ap.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    ap.add_argument("--quick", action="store_true", help="the benches' --quick")
    args = ap.parse_args(argv)
    import geot

    rules = args.rules or sorted((r["slug"] for r in geot.rule_sets()), key=lambda s: s == common.device_slug())
    tables = [compare(bench, {r: run_bench(bench, r, args.quick) for r in rules}) for bench in args.benches]
    table = pd.concat(tables, ignore_index=True)
    print(f"\n{common.device_name()}: speedup of each rule set's geot times (geomean over the cells, worst cell)")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    common.write_csv(table, f"compare_rules_{common.device_slug()}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
