"""Summarises a perf DB directory (perfdb/<gpu>): per kernel family, how close
the hand heuristic's pick comes to the oracle (the best config of each cell),
and the best of each schedule alone.

    python scripts/analyze_sweep.py perfdb/nvidia-h100-80gb-hbm3 [--cells]
"""
import argparse
import glob
import math
import os

import pandas as pd


def geomean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def cell_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """oracle time / time of the heuristic and of each schedule's best, per cell."""
    rows = []
    for (graph, F), cell in df.groupby(["graph", "F"], sort=False):
        swept = cell[cell.schedule != "heuristic"]
        heuristic = cell[cell.schedule == "heuristic"]
        if swept.empty or heuristic.empty:
            continue
        best = swept.loc[swept.time_ms.idxmin()]
        row = dict(graph=graph[:48], F=F, E=best.E, avg=round(best.avg, 1), oracle_ms=best.time_ms,
                   oracle=f"{best.schedule}<{best.N_t},{best.T_N},{best.M_t},{best.T_M},{best.G_t}>",
                   heuristic=best.time_ms / heuristic.time_ms.iloc[0])
        for schedule, group in swept.groupby("schedule"):
            row[schedule] = best.time_ms / group.time_ms.min()
        rows.append(row)
    return pd.DataFrame(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db_dir")
    parser.add_argument("--cells", action="store_true", help="print every cell, not just the summary")
    args = parser.parse_args()
    for path in sorted(glob.glob(os.path.join(args.db_dir, "*.csv*"))):
        ratios = cell_ratios(pd.read_csv(path))
        family = os.path.basename(path).split(".")[0]
        if args.cells:
            with pd.option_context("display.width", 250, "display.max_rows", None, "display.float_format", "{:.3f}".format):
                print(ratios.to_string(index=False))
        worst = ratios.loc[ratios.heuristic.idxmin()]
        print(f"{family}: {len(ratios)} cells, {ratios.graph.nunique()} graphs; heuristic/oracle geomean "
              f"{geomean(ratios.heuristic):.3f}, worst {worst.heuristic:.3f} ({worst.graph} F={worst.F}); "
              + ", ".join(f"best {s} alone {geomean(ratios[s]):.3f}" for s in ("SR", "PR", "SP") if s in ratios))


if __name__ == "__main__":
    main()
