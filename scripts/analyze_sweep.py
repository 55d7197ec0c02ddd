"""Summarises a perf-DB sweep: per (graph, F) the best config of each schedule
and the heuristic's time, as ratios to the oracle (best of all configs)."""
import sys

import pandas as pd



def main(path):
    df = pd.read_csv(path)
    rows = []
    for (graph, F), cell in df.groupby(["graph", "F"], sort=False):
        best = cell.loc[cell[cell.schedule != "heuristic"].time_ms.idxmin()]
        row = dict(graph=graph, F=F, avg=round(best.avg, 1), max_deg=best.max_deg, oracle_ms=best.time_ms,
                   oracle=f"{best.schedule}<{best.N_t},{best.T_N},{best.M_t},{best.T_M},{best.G_t}>")
        for schedule, group in cell.groupby("schedule"):
            row[schedule] = round(best.time_ms / group.time_ms.min(), 3)
        heuristic = cell[cell.schedule == "heuristic"]
        row["heuristic"] = round(best.time_ms / heuristic.time_ms.iloc[0], 3) if len(heuristic) else float("nan")
        rows.append(row)
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main(sys.argv[1])
