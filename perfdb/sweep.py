"""Perf database sweep: times every kernel config on a corpus of graphs x F.

For each kernel family (plain rows: segment_reduce; gathered rows:
index_weight_segment_reduce, whose rules the fused ops share) and each cell
(graph, F) it times every config of the pruned space that launches
differently (configs the launch layer maps onto the same kernel and grid are
timed once), plus the hand heuristic's pick, and appends the rows to
perfdb/<gpu>/<family>.csv. Cells already in the file (or in the committed
<family>.csv.gz, copied into it first) are skipped, so a sweep cut short
(--budget-s, a crash, the device's time limit) resumes where it stopped and
a sweep of more widths or graphs adds to the DB; --fresh starts over. GPU
only.

    python perfdb/sweep.py                    # default corpus, ~8 minutes on an H100
    python perfdb/sweep.py --full             # bigger corpus, every config
    python perfdb/sweep.py --graphs cora 'uniform:num_nodes=200000,degree=16' --F 64 128
    python perfdb/sweep.py --F 96 48 192      # widths the default sweep does not time

Timing: CUDA events around each launch, a 256 MB L2 flush before each and
a busy-wait that holds the GPU while the host queues the launch (GPU time,
as the operator benchmarks measure).
Every config is launched once; the --refine fastest and the heuristic's
pick are then timed again after a warm-up launch, median of --reps. The
launches of a pass are queued and read back after one synchronize.
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

import pandas as pd
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.dirname(os.path.abspath(__file__))]

import geot  # noqa: E402
from common import Graph, device_slug, flush_l2, hold_gpu  # noqa: E402
from corpus import Entry, make_entry, corpus  # noqa: E402
from tqdm import tqdm  # noqa: E402

FAMILIES = ("segment_reduce", "index_weight_segment_reduce")
DEFAULT_F = [1, 2, 4, 7, 8, 16, 32, 64, 128]  # 7: an odd width (Cora's classes)
MAX_ELEMENTS = 1 << 29  # E * F cap per cell (2 GB of fp32 rows)
CELL_KEY = ["graph", "F"]


def effective_config(cfg: geot.Config, F: int) -> geot.Config:
    """The config as the launch layer runs it: N_t halves until it divides F;
    PR blocks are T_N * T_M threads rounded up to a warp (written as T_N=32)."""
    n_t = cfg.N_t
    while F % n_t:
        n_t //= 2
    if cfg.schedule == "PR":
        threads = -(-cfg.T_N * cfg.T_M // 32) * 32
        return geot.Config(n_t, 32, cfg.M_t, threads // 32, cfg.G_t)
    return cfg._replace(N_t=n_t)


def worth_timing(cfg: geot.Config, F: int) -> bool:
    """Default-sweep pruning of SR/SP tilings that are hopeless for this F: a
    row's feature span N_t * T_N under F / 8 (a row split over more than 8
    blocks) or, for SR, over twice max(F, 16) (idle threads; SP puts spare
    threads to work as row lanes, and needs 16-32 of them for a cap of 1024
    rows, beyond the level-1 long-segment hint). --full times them too."""
    if cfg.schedule == "PR":
        return True
    span = cfg.N_t * cfg.T_N
    return F / 8 <= span and (cfg.schedule == "SP" or span <= 2 * max(F, 16))


def configs_for(F: int, full: bool) -> List[geot.Config]:
    seen: Dict[geot.Config, None] = {}
    for cfg in geot.config_space(narrow=True):
        eff = effective_config(cfg, F)
        if full or worth_timing(eff, F):
            seen.setdefault(eff)
    return list(seen)


def cell_inputs(family: str, g: Graph, F: int):
    """(call(config), bytes moved, flops) of one cell."""
    S, E = g.num_nodes, g.num_edges
    if family == "segment_reduce":
        src = torch.randn(E, F, device="cuda")
        moved = E * (F * 4 + 8) + S * F * 4
        return (lambda cfg: geot.segment_reduce(g.dst, src, "sum", S, config=cfg)), moved, E * F
    x = torch.randn(S, F, device="cuda")
    weight = torch.rand(E, device="cuda")
    moved = E * (F * 4 + 8 + 8 + 4) + S * F * 4  # gathered rows counted once per edge
    return (lambda cfg: geot.index_weight_segment_reduce(g.src, g.dst, weight, x, "sum", S, config=cfg)), moved, 2 * E * F


def time_configs(call, configs: List[geot.Config], warmup: int, reps: int) -> List[Optional[float]]:
    """Median ms per config (None where the launch layer refuses it). Reps go
    round-robin over the configs, so a transient slowdown of the GPU (seen:
    3-10x over a few consecutive launches) hits one rep of many configs
    rather than every rep of one."""
    timed: Dict[geot.Config, list] = {cfg: [] for cfg in configs}
    for _ in range(warmup):
        for cfg in list(timed):
            try_launch(timed, cfg, lambda: call(cfg))
    for _ in range(reps):
        for cfg in list(timed):
            try_launch(timed, cfg, lambda: timed[cfg].append(launch_timed(call, cfg)))
    torch.cuda.synchronize()
    medians = {cfg: sorted(s.elapsed_time(e) for s, e in pairs)[len(pairs) // 2] for cfg, pairs in timed.items()}
    return [medians.get(cfg) for cfg in configs]


def try_launch(timed: dict, cfg: geot.Config, launch) -> None:
    try:
        launch()
    except (RuntimeError, ValueError):  # refused by the launch layer (e.g. too many feature blocks)
        del timed[cfg]


# The host takes ~0.5 ms per timed launch here, longer than the flush keeps
# the GPU busy: without a hold the events would time host launch work too
# (every cell of a tiny graph then read ~8 us, whatever its config).
HOLD_CYCLES = 500_000


def launch_timed(call, cfg):
    flush_l2("cuda")
    hold_gpu(HOLD_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call(cfg)
    end.record()
    return start, end


def sweep_cell(family: str, entry: Entry, g: Graph, stats: dict, F: int, args) -> pd.DataFrame:
    call, moved, flops = cell_inputs(family, g, F)
    # arch=0: the hand heuristic, whatever learned rules this build has; the
    # long-segment level as index validation would report it.
    level = geot.config.long_segment_level(stats["max_deg"])
    heuristic = geot.explain(g.num_edges, g.num_nodes, F, gathered=family != "segment_reduce",
                             long_segments=level, arch=0)
    configs = [heuristic] + configs_for(F, args.full)
    # Untimed: validates the index and derives its SP segment offsets, both
    # cached per index, as for every call of a model after its first.
    call(geot.Config(N_t=1, T_N=32, M_t=8, T_M=8, G_t=0))
    # Two passes: one launch per config, then warm-up and the median of
    # --reps for the heuristic and the --refine fastest (the rest are far
    # from the best, and one launch ranks them well enough).
    times = time_configs(call, configs, warmup=0, reps=1)
    ranked = sorted((t, i) for i, t in enumerate(times) if t is not None and i > 0)
    finalists = [0] + [i for _, i in ranked[: args.refine]]
    for i, t in zip(finalists, time_configs(call, [configs[i] for i in finalists], args.warmup, args.reps)):
        times[i] = t
    base = dict(graph=entry.name, base_graph=entry.base_graph, kind=entry.kind, augmentation=entry.augmentation,
                E=g.num_edges, num_segments=g.num_nodes, F=F, **stats)
    rows = []
    for i, (cfg, ms) in enumerate(zip(configs, times)):
        if ms is None:
            continue
        rows.append(dict(base, schedule="heuristic" if i == 0 else cfg.schedule, **cfg._asdict(),
                         time_ms=float(f"{ms:.5g}"), gbps=round(moved / ms / 1e6, 1), gflops=round(flops / ms / 1e6, 1)))
    return pd.DataFrame(rows)


def degree_stats(g: Graph) -> dict:
    deg = torch.bincount(g.dst, minlength=g.num_nodes)
    max_deg = int(deg.max()) if deg.numel() else 0
    return dict(avg=g.num_edges / max(g.num_nodes, 1), max_deg=max_deg, long_segments=int(max_deg > 64))


def resumable(path: str, fresh: bool = False) -> str:
    """path (a family's CSV), ready for the sweep to append to: where only
    the committed gzipped DB is there (path + ".gz"), its cells are copied
    into path first, so the sweep skips them and the trainer, which reads
    the plain CSV where there is one, keeps them. fresh: both files go (the
    kernels changed: time every cell again)."""
    packed = path + ".gz"
    if fresh:
        for stale in (path, packed):
            if os.path.exists(stale):
                os.remove(stale)
    elif not os.path.exists(path) and os.path.exists(packed):
        with gzip.open(packed, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        print(f"resuming from {packed}")
    return path


def done_cells(path: str) -> set:
    if not os.path.exists(path):
        return set()
    return set(map(tuple, pd.read_csv(path, usecols=CELL_KEY).drop_duplicates().values.tolist()))


def write_device_json(out_dir: str) -> None:
    major, minor = torch.cuda.get_device_capability()
    with open(os.path.join(out_dir, "device.json"), "w") as f:
        json.dump({"name": torch.cuda.get_device_name(), "capability": [major, minor]}, f)
        f.write("\n")


def entries_from_args(args) -> List[Entry]:
    if not args.graphs:
        return corpus(full=args.full)
    return [make_entry(spec) for spec in args.graphs]


def sweep(args) -> None:
    out_dir = args.out_dir or os.path.join(ROOT, "perfdb", device_slug())
    os.makedirs(out_dir, exist_ok=True)
    write_device_json(out_dir)
    paths = {fam: resumable(os.path.join(out_dir, f"{fam}.csv"), args.fresh) for fam in args.families}
    done = {fam: done_cells(p) for fam, p in paths.items()}
    deadline = time.monotonic() + args.budget_s if args.budget_s else float("inf")
    entries = entries_from_args(args)
    progress = tqdm(total=len(entries) * len(args.F) * len(paths), desc="cells", mininterval=5)
    for entry in entries:
        if time.monotonic() > deadline:
            print(f"time budget of {args.budget_s} s spent; run again to resume")
            break
        g = entry.build("cuda")
        if g is None:
            progress.update(len(args.F) * len(paths))
            continue
        stats = degree_stats(g)
        for F in args.F:
            for fam, path in paths.items():
                progress.update(1)
                if (entry.name, F) in done[fam] or g.num_edges * F > MAX_ELEMENTS or time.monotonic() > deadline:
                    continue
                cell = sweep_cell(fam, entry, g, stats, F, args)
                cell.to_csv(path, mode="a", header=not os.path.exists(path), index=False)
        del g
        torch.cuda.empty_cache()
    progress.close()
    print("wrote " + ", ".join(paths.values()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", help="graph names or generator specs (default: the corpus)")
    parser.add_argument("--F", type=int, nargs="+", default=DEFAULT_F)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--full", action="store_true", help="bigger corpus, no config pruning")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting new graphs after this long")
    parser.add_argument("--warmup", type=int, default=1)
    # 11, not 7: cells of small graphs take 5-10 us, the same config times
    # 3-7% apart from rep to rep, and the top configs lie within 5% there.
    parser.add_argument("--reps", type=int, default=11, help="timed launches of the finalists (median)")
    parser.add_argument("--refine", type=int, default=32, help="finalists per cell, timed with --reps")
    parser.add_argument("--out-dir", default=None, help="default perfdb/<gpu>")
    parser.add_argument("--fresh", action="store_true",
                        help="time every cell again (after a kernel change): the DB's cells are dropped")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("perfdb/sweep.py times CUDA kernels: no GPU visible")
    # Validation stays on, as for users: it runs once per index (cached), and
    # its long-segment hint spares SP the overflow launch where no segment
    # can exceed the cap, which the timings must include.
    geot.set_validation(True)
    sweep(args)


if __name__ == "__main__":
    main()
