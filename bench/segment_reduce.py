#!/usr/bin/env python3
"""Microbenchmark: geot.segment_reduce against PyTorch's own reductions.

For each graph x F x reduce x dtype it times
  geot       geot.segment_reduce(index, src, reduce, num_segments=S)
  index_add  torch.zeros(S, F).index_add_(0, index, src)                  (sum only)
  scatter    torch.zeros(S, F).scatter_reduce_(0, index[:, None].expand(-1, F), src,
                                               reduce, include_self=False)
  segred     torch.segment_reduce(src, reduce, offsets|lengths=..., unsafe=True)
             (offsets and lengths precomputed outside the timing; the faster
             of the two counts; F=1 passes 1-D data, which takes its CUB path)
  ts_*       torch_scatter.segment_coo / segment_csr / scatter, when importable
checks every peer's output against geot's once per cell, and prints a table,
geomean speedups and the worst cell. The full CSV goes to
bench/out/segment_reduce_<device>.csv (and $OUT when set).

  python bench/segment_reduce.py                       # default sweep (GPU)
  python bench/segment_reduce.py --quick --device cpu  # smoke test
  python bench/segment_reduce.py --graphs hubs powerlaw:n=1000000,deg=4 --F 8 64
  python bench/segment_reduce.py --quick --config 2,32,8,4,1
  python bench/segment_reduce.py --deterministic       # also under torch.use_deterministic_algorithms(True)

--deterministic times geot and the torch-native peers again in deterministic
mode (a peer that raises there is left out), checks that two deterministic
geot calls agree bitwise, and adds the columns det (geot's deterministic
time), det/def (its ratio to the default mode) and x_det (the fastest native
peer in deterministic mode / det).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402

DEFAULT_GRAPHS = ["cora", "citeseer", "pubmed", "powerlaw", "uniform", "hubs", "powerlaw_small"]
QUICK_GRAPHS = ["cora", "pubmed", "powerlaw_small", "hubs_small"]
DEFAULT_F = [1, 2, 4, 8, 16, 32, 64, 128]
QUICK_F = [1, 32]
REDUCES = ("sum", "mean", "max", "min")
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64,
}
# rtol of the output check, per dtype (geot accumulates fp16/bf16 in fp32).
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# Peers: key -> (table label, native torch op?)
PEERS = {
    "index_add": ("index_add_", True),
    "scatter": ("scatter_reduce_", True),
    "segred": ("torch.segment_reduce", True),
    "ts_coo": ("torch_scatter.segment_coo", False),
    "ts_csr": ("torch_scatter.segment_csr", False),
    "ts_scatter": ("torch_scatter.scatter", False),
}
NATIVE = [k for k, (_, native) in PEERS.items() if native]


def import_geot():
    """geot from the repo checkout when built there, else the installed one."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    try:
        import geot  # noqa: F401
    except ImportError:
        sys.path.remove(REPO_ROOT)
        for name in [m for m in sys.modules if m == "geot" or m.startswith("geot.")]:
            del sys.modules[name]
        import geot  # noqa: F401  (raises when neither is available)
    return sys.modules["geot"]


def import_torch_scatter():
    try:
        import torch_scatter  # noqa: F401

        return torch_scatter
    except Exception:  # not installed, or built for another torch: skip quietly
        return None


def split_list(values: Optional[List[str]]) -> Optional[List[str]]:
    """['1,2', '4'] -> ['1', '2', '4']."""
    if values is None:
        return None
    out: List[str] = []
    for v in values:
        out.extend(x for x in v.split(",") if x)
    return out


def short_error(err: BaseException) -> str:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {msg}"[:160]


# ----------------------------------------------------------------------------
# Output check
# ----------------------------------------------------------------------------


def check_close(out: torch.Tensor, ref: torch.Tensor, reduce: str, dtype, lengths: torch.Tensor, rows: Optional[torch.Tensor] = None):
    """(ok, max scaled error). The tolerance per element is
    rtol*|ref| + atol_row, atol_row = rtol * (typical magnitude of the row's
    result for N(0,1) inputs): sqrt(len) for sum, 1/sqrt(len) for mean, 1 for
    max/min. Summation order differs between methods, so a plain rtol would
    fail on rows whose sum cancels to near zero. rows: only these rows
    (a bool mask) are compared."""
    rtol = RTOL.get(dtype, 1e-4)
    out = out.reshape(ref.shape).double()
    ref = ref.double()
    n = lengths.double().clamp(min=1).view(-1, *([1] * (ref.dim() - 1)))
    if reduce == "sum":
        scale = n.sqrt()
    elif reduce == "mean":
        scale = n.rsqrt()
    else:
        scale = torch.ones_like(n)
    if rows is not None:
        out, ref, scale = out[rows], ref[rows], scale[rows]
    if out.numel() == 0:
        return True, 0.0
    err = (out - ref).abs() / (rtol * (ref.abs() + scale))
    err = torch.nan_to_num(err, nan=float("inf"))
    worst = float(err.max())
    return worst <= 1.0, worst


# ----------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------


def build_peers(reduce: str, src: torch.Tensor, index64: torch.Tensor, offsets: torch.Tensor,
                lengths: torch.Tensor, num_segments: int, ts) -> Dict[str, Dict[str, Callable]]:
    """peer key -> {variant name: fn}; a peer with several variants counts
    with its fastest."""
    S, F = num_segments, src.shape[1]
    dev, dtype = src.device, src.dtype
    peers: Dict[str, Dict[str, Callable]] = {}
    if reduce == "sum":
        peers["index_add"] = {"": lambda: torch.zeros(S, F, dtype=dtype, device=dev).index_add_(0, index64, src)}
    amode = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]
    idx2 = index64.view(-1, 1).expand(-1, F)
    peers["scatter"] = {
        "": lambda: torch.zeros(S, F, dtype=dtype, device=dev).scatter_reduce_(0, idx2, src, reduce=amode, include_self=False)
    }
    data = src.view(-1) if F == 1 else src  # 1-D data: torch's CUB path on CUDA
    peers["segred"] = {
        "offsets": lambda: torch.segment_reduce(data, reduce, offsets=offsets, unsafe=True),
        "lengths": lambda: torch.segment_reduce(data, reduce, lengths=lengths, unsafe=True),
    }
    if ts is not None:
        indptr = offsets
        peers["ts_coo"] = {"": lambda: ts.segment_coo(src, index64, dim_size=S, reduce=reduce)}
        peers["ts_csr"] = {"": lambda: ts.segment_csr(src, indptr, reduce=reduce)}
        peers["ts_scatter"] = {"": lambda: ts.scatter(src, index64, dim=0, dim_size=S, reduce=reduce)}
    return peers


def reference_fp32(reduce: str, src: torch.Tensor, index64: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The reduction of src upcast to fp32 (what geot's fp32 accumulation
    should match for fp16/bf16 inputs)."""
    x = src.float()
    out = torch.zeros(num_segments, x.shape[1], dtype=torch.float32, device=x.device)
    if reduce == "sum":
        return out.index_add_(0, index64, x)
    amode = {"mean": "mean", "max": "amax", "min": "amin"}[reduce]
    return out.scatter_reduce_(0, index64.view(-1, 1).expand_as(x), x, reduce=amode, include_self=False)


def first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def time_with_heuristic(geot, fn, tkw) -> float:
    """Median ms of fn with the hand heuristic forced instead of the rules
    in force (--rules; the same where the GPU has none)."""
    mode = geot.rules_mode()
    geot.set_rules("heuristic")
    try:
        return common.time_stats(fn, **tkw).median_ms
    finally:
        geot.set_rules(mode)


def run_cell(args, geot, ts, g: common.Graph, gidx, index64, offsets, lengths, nonempty, F, reduce, dtype, copy_bw, stats):
    dev = index64.device
    S, E = g.num_nodes, g.num_edges
    tkw = dict(warmup=args.warmup, reps=args.reps, device=dev, flush=not args.no_flush, max_time_s=args.max_time)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + F)
    src = torch.randn(E, F, dtype=torch.float32, device=dev, generator=gen).to(dtype)

    row = {
        "graph": g.name, "kind": g.kind, "num_segments": S, "num_edges": E,
        "max_deg": stats["max_deg"], "empty_frac": round(stats["empty_frac"], 4),
        "F": F, "reduce": reduce, "dtype": str(dtype).replace("torch.", ""),
        "index_dtype": str(gidx.dtype).replace("torch.", ""),
    }

    # geot
    kwargs = {} if args.config is None else {"config": args.config}
    geot_fn = lambda: geot.segment_reduce(gidx, src, reduce, num_segments=S, **kwargs)  # noqa: E731
    ref = None
    try:
        ref = geot_fn()
        if args.device_type == "cuda":
            torch.cuda.synchronize(dev)
        t = common.time_stats(geot_fn, **tkw)
        row["geot_ms"], row["geot_reps"], row["geot_err"] = t.median_ms, t.reps, ""
    except Exception as err:  # noqa: BLE001
        row["geot_ms"], row["geot_reps"], row["geot_err"] = float("nan"), 0, short_error(err)
        ref = None
        if args.verbose:
            traceback.print_exc()
    row["geot_heuristic_ms"] = time_with_heuristic(geot, geot_fn, tkw) if args.config is None and ref is not None \
        and args.device_type == "cuda" else float("nan")
    row["geot_ok"], row["geot_maxerr"] = None, float("nan")
    if ref is not None and not args.no_check and dtype in (torch.float16, torch.bfloat16):
        try:  # low precision: also check geot itself against an fp32 computation
            ok, worst = check_close(ref, reference_fp32(reduce, src, index64, S), reduce, dtype, lengths)
            row["geot_ok"], row["geot_maxerr"] = ok, worst
        except Exception as err:  # noqa: BLE001
            row["geot_err"] = (row["geot_err"] + "; " if row["geot_err"] else "") + "fp32 check: " + short_error(err)
    try:
        level = geot.config.long_segment_level(stats["max_deg"]) if geot.validation_enabled() else None
        cfg = geot.explain(E, S, F, long_segments=level)
        row["geot_config"] = "" if args.device_type != "cuda" else ",".join(str(v) for v in cfg)
        row["geot_rules"] = geot.explain_source(E, S, F, long_segments=level) if args.device_type == "cuda" else ""
    except Exception:  # noqa: BLE001
        row["geot_config"], row["geot_rules"] = "", ""
    if args.config is not None:
        row["geot_config"] = ",".join(str(v) for v in args.config) + " (forced)"
    nbytes = E * F * src.element_size() + E * gidx.element_size() + S * F * src.element_size()
    row["bytes"] = nbytes
    row["geot_gbs"] = nbytes / (row["geot_ms"] * 1e-3) / 1e9 if math.isfinite(row["geot_ms"]) else float("nan")
    row["geot_bw_frac"] = row["geot_gbs"] / copy_bw if copy_bw else float("nan")

    # peers
    peers = build_peers(reduce, src, index64, offsets, lengths, S, ts)
    for key in PEERS:
        if args.methods and key not in args.methods:
            continue
        variants = peers.get(key)
        if variants is None:
            if key in NATIVE:  # not applicable (index_add_ for reduce != sum)
                row[f"{key}_ms"], row[f"{key}_ok"], row[f"{key}_err"] = float("nan"), None, "n/a"
            continue
        best_ms, best_var, errs, ok, worst, reps = float("nan"), "", [], None, float("nan"), 0
        for var, fn in variants.items():
            try:
                out = first_tensor(fn())
                if ref is not None and not args.no_check:
                    # torch.segment_reduce fills empty segments with -inf (max),
                    # +inf (min) or nan (mean): compare non-empty rows only.
                    rows = nonempty if key == "segred" else None
                    ok_v, worst_v = check_close(out, ref, reduce, dtype, lengths, rows)
                    ok = ok_v if ok is None else (ok and ok_v)
                    worst = worst_v if not math.isfinite(worst) else max(worst, worst_v)
                del out
                t = common.time_stats(fn, **tkw)
                if not math.isfinite(best_ms) or t.median_ms < best_ms:
                    best_ms, best_var, reps = t.median_ms, var, t.reps
            except Exception as err:  # noqa: BLE001  (unsupported dtype, OOM, ...)
                errs.append((var + ": " if var else "") + short_error(err))
                if args.verbose:
                    traceback.print_exc()
        row[f"{key}_ms"] = best_ms
        row[f"{key}_ok"] = ok
        row[f"{key}_maxerr"] = worst
        row[f"{key}_err"] = "; ".join(errs)
        row[f"{key}_reps"] = reps
        if key == "segred":
            row["segred_variant"] = best_var
    if args.deterministic and ref is not None:
        deterministic_cell(row, geot_fn, peers, tkw)
    del src, ref, peers
    return row


def deterministic_cell(row, geot_fn, peers, tkw) -> None:
    """--deterministic: geot and the torch-native peers again in deterministic mode."""
    with common.deterministic_mode():
        row["det_bitwise"] = common.same_bits(geot_fn(), geot_fn())
        row["geot_det_ms"] = common.time_stats(geot_fn, **tkw).median_ms
        best = float("nan")
        for key in NATIVE:
            for fn in peers.get(key, {}).values():
                try:
                    fn()
                    t = common.time_stats(fn, **tkw).median_ms
                except Exception:  # noqa: BLE001  (raises in deterministic mode, or unsupported)
                    continue
                best = t if not math.isfinite(best) else min(best, t)
        row["best_native_det_ms"] = best
    row["det_ratio"] = row["geot_det_ms"] / row["geot_ms"]
    row["x_det_vs_best_native"] = best / row["geot_det_ms"]


def add_speedups(df: pd.DataFrame) -> pd.DataFrame:
    for key in PEERS:
        if f"{key}_ms" in df:
            df[f"speedup_vs_{key}"] = df[f"{key}_ms"] / df["geot_ms"]
    native_cols = [f"{k}_ms" for k in NATIVE if f"{k}_ms" in df]
    native = df[native_cols].astype(float)
    df["best_native_ms"] = native.min(axis=1, skipna=True)
    df["best_native"] = native.idxmin(axis=1, skipna=True).where(native.notna().any(axis=1), "").map(
        lambda c: PEERS[c[:-3]][0] if c else "")
    df["speedup_vs_best_native"] = df["best_native_ms"] / df["geot_ms"]
    all_cols = [f"{k}_ms" for k in PEERS if f"{k}_ms" in df]
    df["best_peer_ms"] = df[all_cols].astype(float).min(axis=1, skipna=True)
    df["speedup_vs_best_peer"] = df["best_peer_ms"] / df["geot_ms"]
    df["speedup_vs_heuristic"] = df["geot_heuristic_ms"] / df["geot_ms"]  # learned rules vs hand heuristic
    df["heuristic_vs_best_native"] = df["best_native_ms"] / df["geot_heuristic_ms"]
    return df


def compact_table(df: pd.DataFrame, multi_reduce: bool, multi_dtype: bool) -> pd.DataFrame:
    def cell(ms, ok, err):
        if ms is None or not np.isfinite(ms):
            return "n/a" if err == "n/a" else ("err" if err else "nan")
        return common.fmt_ms(ms) + ("!" if ok is False else "")

    out = pd.DataFrame({"graph": df["graph"], "F": df["F"]})
    if multi_reduce:
        out["reduce"] = df["reduce"]
    if multi_dtype:
        out["dtype"] = df["dtype"]
    out["geot"] = [cell(m, ok, e) for m, ok, e in zip(df["geot_ms"], df["geot_ok"], df["geot_err"])]
    for key, (label, _) in PEERS.items():
        if f"{key}_ms" not in df:
            continue
        out[label.replace("torch_scatter.", "ts.")] = [
            cell(m, ok, e) for m, ok, e in zip(df[f"{key}_ms"], df[f"{key}_ok"], df[f"{key}_err"])]
    fmt = lambda v: f"{v:.2f}" if np.isfinite(v) else "nan"  # noqa: E731
    if "speedup_vs_scatter" in df:
        out["x_scatter"] = df["speedup_vs_scatter"].map(fmt)
    out["x_best"] = df["speedup_vs_best_native"].map(fmt)
    out["%copyBW"] = (100 * df["geot_bw_frac"]).map(lambda v: f"{v:.1f}" if np.isfinite(v) else "nan")
    if "geot_det_ms" in df:
        out["det"] = [cell(m, ok, "") + ("" if same else "#") for m, ok, same in
                      zip(df["geot_det_ms"], df["geot_ok"], df["det_bitwise"])]
        out["det/def"] = df["det_ratio"].map(fmt)
        out["x_det"] = df["x_det_vs_best_native"].map(fmt)
    return out


def summarize_deterministic(df: pd.DataFrame) -> None:
    """--deterministic: the ratio to the default mode, and the worst cell against the native peers."""
    if "det_ratio" not in df or not df["det_ratio"].notna().any():
        return
    ratio, lead = df["det_ratio"].dropna(), df["x_det_vs_best_native"].dropna()
    print(f"\nDeterministic mode: geot det / default time, geomean {common.geomean(ratio):.3f}x "
          f"(max {ratio.max():.2f}x) over {len(ratio)} cells; bitwise repeatable in "
          f"{int(df['det_bitwise'].sum())}/{int(df['det_bitwise'].notna().sum())} cells")
    if len(lead):
        worst = df.loc[df["x_det_vs_best_native"].idxmin()]
        print(f"  vs the fastest torch-native peer in deterministic mode: geomean {common.geomean(lead):.2f}x, "
              f"worst {worst['x_det_vs_best_native']:.2f}x ({worst['graph']}, F={worst['F']}, {worst['reduce']}, "
              f"{worst['dtype']}); geot faster in {int((lead > 1).sum())}/{len(lead)} cells")


def summarize(df: pd.DataFrame, copy_bw: float) -> None:
    print("\nGeomean speedup of geot (peer ms / geot ms; >1 means geot is faster):")
    lines = [("scatter_reduce_", "speedup_vs_scatter"), ("index_add_ (sum)", "speedup_vs_index_add"),
             ("torch.segment_reduce", "speedup_vs_segred")]
    for key in ("ts_coo", "ts_csr", "ts_scatter"):
        if f"speedup_vs_{key}" in df:
            lines.append((PEERS[key][0], f"speedup_vs_{key}"))
    lines += [("fastest torch-native peer", "speedup_vs_best_native"), ("fastest peer overall", "speedup_vs_best_peer"),
              ("geot, hand heuristic", "speedup_vs_heuristic")]
    for label, col in lines:
        if col in df:
            vals = df[col].astype(float)
            n = int(np.isfinite(vals).sum())
            gm = common.geomean(vals)
            print(f"  vs {label:<28} " + (f"{gm:7.3f}x" if np.isfinite(gm) else "    n/a ") + f"   ({n} cells)")
    if np.isfinite(df["heuristic_vs_best_native"].astype(float)).any():
        print(f"  (with the hand heuristic's configs instead: {common.geomean(df['heuristic_vs_best_native']):.3f}x "
              "vs the fastest torch-native peer)")
    groups = df.groupby(["reduce", "dtype"], sort=False)
    if groups.ngroups > 1:
        print("  per reduce/dtype, vs fastest torch-native peer:")
        for (red, dt), sub in groups:
            print(f"    {red:>4} {dt:<9} {common.geomean(sub['speedup_vs_best_native']):7.3f}x")
    by_graph = df.groupby("graph", sort=False)["speedup_vs_best_native"].apply(common.geomean)
    print("  per graph, vs fastest torch-native peer: "
          + ", ".join(f"{g} {v:.2f}x" for g, v in by_graph.items()))
    valid = df[np.isfinite(df["speedup_vs_best_native"].astype(float))]
    if len(valid):
        w = valid.loc[valid["speedup_vs_best_native"].astype(float).idxmin()]
        print(f"\nWorst cell (lowest speedup vs fastest torch-native peer): graph={w['graph']} F={w['F']} "
              f"reduce={w['reduce']} dtype={w['dtype']} (S={w['num_segments']}, E={w['num_edges']}, max_deg={w['max_deg']})")
        print(f"  geot {common.fmt_ms(w['geot_ms'])} ms ({w['geot_gbs']:.1f} GB/s, {100 * w['geot_bw_frac']:.1f}% of copy BW, "
              f"config {w.get('geot_config', '') or '-'}) vs {w['best_native']} {common.fmt_ms(w['best_native_ms'])} ms "
              f"-> {w['speedup_vs_best_native']:.3f}x")
        others = [f"{PEERS[k][0]} {common.fmt_ms(w[f'{k}_ms'])}" for k in PEERS
                  if f"{k}_ms" in w and np.isfinite(w[f"{k}_ms"])]
        print("  all peers (ms): " + ", ".join(others))
    bad = df[df["geot_err"].astype(str) != ""]
    if len(bad):
        print(f"\ngeot FAILED in {len(bad)} cells, e.g. {bad.iloc[0]['graph']} F={bad.iloc[0]['F']}: {bad.iloc[0]['geot_err']}")
    mism = []
    m = df[df["geot_ok"] == False]  # noqa: E712
    if len(m):
        mism.append(f"geot vs fp32 reference: {len(m)} cells (max scaled err {m['geot_maxerr'].max():.3g})")
    for key, (label, _) in PEERS.items():
        if f"{key}_ok" in df:
            m = df[df[f"{key}_ok"] == False]  # noqa: E712
            if len(m):
                mism.append(f"{label}: {len(m)} cells (max scaled err {m[f'{key}_maxerr'].max():.3g})")
    if mism:
        print("\nOutput mismatches ('!' in the table; peers vs geot, scaled error > 1 fails): " + "; ".join(mism))
        if any(d in set(df["dtype"]) for d in ("float16", "bfloat16")):
            print("  (fp16/bf16: geot accumulates in fp32 and is checked against an fp32 computation; peers that "
                  "accumulate in fp16/bf16 drift on long segments)")
    print(f"\nMeasured copy bandwidth: {copy_bw:.1f} GB/s (read + write)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", nargs="+", help=f"names or generator specs, e.g. 'powerlaw:n=1000000,deg=8,alpha=2.1' "
                   f"(default: {' '.join(DEFAULT_GRAPHS)}; also: hubs_small)")
    p.add_argument("--F", nargs="+", help=f"feature sizes (default: {' '.join(map(str, DEFAULT_F))})")
    p.add_argument("--reduce", nargs="+", default=["sum"], help="any of sum mean max min (default: sum)")
    p.add_argument("--dtype", nargs="+", default=["float32"], help="float32 float16 bfloat16 float64 (default: float32)")
    p.add_argument("--index-dtype", default="int64", choices=["int64", "int32"], help="geot's index dtype (peers use int64)")
    p.add_argument("--quick", action="store_true", help=f"graphs {' '.join(QUICK_GRAPHS)}, F {QUICK_F}")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--config", default=None, help="N_t,T_N,M_t,T_M,G_t forced on geot (CUDA tuning experiments)")
    p.add_argument("--rules", default=None,
                   help="geot's config rules: learned (each GPU's own, the default), heuristic, or a rule set's slug "
                        "(geot.rule_sets(), e.g. nvidia-h100-80gb-hbm3); the CSV name gets _rules-<mode> and its "
                        "geot_rules column says which rules ran (GEOT_RULES sets the same)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 10 on GPU, 1 on CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed calls, median reported (default 50 on GPU, 5 on CPU)")
    p.add_argument("--max-time", type=float, default=None,
                   help="seconds of timed calls per method and cell; slow methods get fewer reps (>=3). "
                        "Default 1 on GPU, 2 on CPU")
    p.add_argument("--no-flush", action="store_true", help="don't flush L2 between reps (warm-cache numbers)")
    p.add_argument("--methods", nargs="+", help=f"restrict peers to these keys: {' '.join(PEERS)}")
    p.add_argument("--no-check", action="store_true", help="skip the output check against geot")
    p.add_argument("--no-validation", action="store_true",
                   help="geot.set_validation(False): no index check, and no long-segment hint for the selector")
    p.add_argument("--deterministic", action="store_true",
                   help="also time geot and the native peers under torch.use_deterministic_algorithms(True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="directory of <name>.npz graphs (searched first)")
    p.add_argument("--csv", default=None, help="CSV file name under bench/out (default segment_reduce_<device>.csv)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    args.graphs = split_list(args.graphs) or (QUICK_GRAPHS if args.quick else DEFAULT_GRAPHS)
    args.F = [int(f) for f in (split_list(args.F) or (QUICK_F if args.quick else DEFAULT_F))]
    args.reduce = split_list(args.reduce)
    for r in args.reduce:
        if r not in REDUCES:
            p.error(f"--reduce: {r!r} is not one of {REDUCES}")
    for d in split_list(args.dtype):
        if d not in DTYPES:
            p.error(f"--dtype: {d!r} is not one of {sorted(DTYPES)}")
    args.dtype = [DTYPES[d] for d in split_list(args.dtype)]
    args.methods = split_list(args.methods)
    if args.methods:
        for m in args.methods:
            if m not in PEERS:
                p.error(f"--methods: {m!r} is not one of {list(PEERS)}")
    if args.config is not None:
        args.config = [int(v) for v in args.config.replace(" ", "").split(",")]
        if len(args.config) != 5:
            p.error("--config needs 5 integers: N_t,T_N,M_t,T_M,G_t")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device_type = torch.device(args.device).type
    gpu = args.device_type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (10 if gpu else 1)
    args.reps = args.reps if args.reps is not None else (50 if gpu else 5)
    args.max_time = args.max_time if args.max_time is not None else (1.0 if gpu else 2.0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    geot = import_geot()
    geot.set_validation(not args.no_validation)
    if args.rules is not None:
        geot.set_rules(args.rules)
    ts = import_torch_scatter()
    if args.methods:
        ts = ts if any(m.startswith("ts_") for m in args.methods) else None

    cuda_built = geot.cuda_built() if callable(geot.cuda_built) else geot.cuda_built
    print(f"device: {common.device_name(dev)} | torch {torch.__version__} | geot {getattr(geot, '__version__', '?')} "
          f"({os.path.dirname(geot.__file__)}, cuda_built={cuda_built}) | torch_scatter: "
          f"{getattr(ts, '__version__', 'yes') if ts else 'not available (skipped)'}")
    if geot.validation_enabled():
        print("geot index validation: on (the default); cached per index, so only the first call of a graph "
              "runs the check, outside the timed reps")
    else:
        print("geot index validation: OFF (--no-validation); the selector lacks the long-segment hint")
    print(f"geot config rules: {geot.rules_mode()} (--rules / GEOT_RULES)")
    copy_bw = common.copy_bandwidth_gbs(dev)
    print(f"copy bandwidth: {copy_bw:.1f} GB/s (read + write, {'1 GiB' if dev.type == 'cuda' else '256 MiB'} copy_)")
    if dev.type == "cuda":
        timing = (f"CUDA events, median of {args.reps} reps after {args.warmup} warm-up"
                  + ("" if args.no_flush else "; L2 flushed (256 MB write) before each rep, outside the timing")
                  + f"; methods slower than {args.max_time}s/cell get fewer reps (>=3)")
    else:
        timing = f"time.perf_counter, median of {args.reps} reps after {args.warmup} warm-up (no cache flush)"
    print(f"timing: {timing}")
    print(f"graphs: {' '.join(args.graphs)} | F: {args.F} | reduce: {args.reduce} | "
          f"dtype: {[str(d).replace('torch.', '') for d in args.dtype]} | geot index: {args.index_dtype}"
          + (f" | geot config forced: {args.config}" if args.config else ""))

    rows = []
    for spec in args.graphs:
        t0 = time.perf_counter()
        try:
            g = common.make_graph(spec, device=dev, seed=args.seed, data_dir=args.data_dir)
        except Exception as err:  # noqa: BLE001
            print(f"note: graph {spec!r} could not be made ({short_error(err)}); skipped")
            continue
        if g is None:
            continue
        index64 = g.dst.to(torch.int64).contiguous()
        gidx = index64.to(getattr(torch, args.index_dtype))
        S = g.num_nodes
        lengths = torch.bincount(index64, minlength=S)
        offsets = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        nonempty = lengths > 0
        stats = g.degree_stats()
        print(f"graph {g.name}: S={S} E={g.num_edges} avg_deg={stats['avg_deg']:.2f} max_deg={stats['max_deg']} "
              f"empty={100 * stats['empty_frac']:.1f}% ({time.perf_counter() - t0:.2f}s to load/generate)", flush=True)
        g.src = None  # not needed here
        for dtype in args.dtype:
            for reduce in args.reduce:
                for F in args.F:
                    try:
                        row = run_cell(args, geot, ts, g, gidx, index64, offsets, lengths, nonempty, F, reduce, dtype,
                                       copy_bw, stats)
                    except torch.cuda.OutOfMemoryError as err:
                        print(f"  skip {g.name} F={F} {reduce} {dtype}: {short_error(err)}")
                        torch.cuda.empty_cache()
                        continue
                    row.update({"device": common.device_name(dev), "torch": torch.__version__,
                                "copy_bw_gbs": copy_bw, "l2_flush": dev.type == "cuda" and not args.no_flush,
                                "validation": geot.validation_enabled()})
                    rows.append(row)
        del index64, gidx, lengths, offsets, nonempty
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if not rows:
        print("no cells were run")
        return 1
    df = add_speedups(pd.DataFrame(rows))
    multi_reduce, multi_dtype = len(args.reduce) > 1, len(args.dtype) > 1
    common.print_table(compact_table(df, multi_reduce, multi_dtype),
                       title="Times in ms (median). x_scatter / x_best: geot speedup vs scatter_reduce_ / vs the fastest "
                             "torch-native peer; %copyBW: geot bytes moved / time as % of the measured copy rate.")
    print("Notes: index_add_ and scatter_reduce_ include their torch.zeros(S, F) output; geot allocates its own. "
          "torch.segment_reduce: unsafe=True, offsets and lengths precomputed outside the timing, the faster one counts, "
          "F=1 passed as 1-D data (its CUB path); its check skips empty segments. Peers use an int64 index. "
          "'!' = output differs from geot's (on geot: from an fp32 computation, fp16/bf16 only); 'n/a' = not applicable; 'err'/'nan' = the peer failed (see CSV *_err); "
          "'#' on det = two deterministic calls differed.")
    summarize(df, copy_bw)
    summarize_deterministic(df)

    rules = f"_rules-{args.rules}" if args.rules is not None else ""
    name = args.csv or f"segment_reduce_{common.device_slug(dev)}{rules}.csv"
    paths = common.write_csv(df, name)
    print(f"\nCSV: {', '.join(paths)}")
    print(f"total time: {time.perf_counter() - t_start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
