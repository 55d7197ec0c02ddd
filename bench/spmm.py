#!/usr/bin/env python3
"""Microbenchmark: geot's fused gather + segment reduce (SpMM from the edge
list) against what a PyG user would call instead.

Sections (each a table, a CSV under bench/out and $OUT, and geomeans):
  fwd       fp32 weighted sum, graphs x F:
              geot       geot.index_weight_segment_reduce(src, dst, w, x, "sum", S)
              cusparse   torch.sparse.mm(A, x), A a CSR tensor built outside the timing
              pyg_spmm   torch_geometric.utils.spmm(A, x) (when importable)
              composite  zeros(S, F).index_add_(0, dst, x.index_select(0, src) * w[:, None])
  dtypes    the same for float16 / bfloat16 (geot, cusparse, composite)
  heads     multi-head weights [E, H], x [N, H, F/H] (geot vs composite)
  fwdbwd    forward + backward wrt x and w (fp32 and bf16: --fwdbwd-dtypes):
            geot (atomic x-grad), geot with a cached geot.TransposedIndex,
            the composite with autograd, and cusparse (x-grad only: torch
            has no CSR value gradient here)
  overhead  host time per call on a small graph: many calls back to back,
            wall clock / count (validation on with its cache, and off);
            geot_C: the C++ entry, geot_op: the dispatcher path of compiled graphs

  python bench/spmm.py                         # everything (GPU)
  python bench/spmm.py --quick --device cpu    # smoke test
  python bench/spmm.py --sections fwd --graphs cora powerlaw --F 1 128
  python bench/spmm.py --sections fwd --deterministic   # also under torch.use_deterministic_algorithms(True)

--deterministic (fwd and dtypes sections): geot, cusparse and composite again
in deterministic mode (a peer that raises there is left out); columns
geot_det, det_ratio (geot_det / geot), det_bitwise (two deterministic calls
agree) and x_det_vs_native (the fastest native peer in deterministic mode /
geot_det).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import geot  # noqa: E402

DEFAULT_GRAPHS = ["cora", "citeseer", "pubmed", "powerlaw", "uniform", "hubs", "powerlaw_small"]
QUICK_GRAPHS = ["cora", "powerlaw_small"]
DEFAULT_F = [1, 2, 4, 8, 16, 32, 64, 128]
SECTIONS = ["fwd", "dtypes", "heads", "fwdbwd", "overhead"]


def try_pyg_spmm():
    try:
        from torch_geometric.utils import spmm
        return spmm
    except Exception:  # PyG is optional
        return None


class Problem:
    """A graph on the device with the weights, the CSR adjacency and the
    cached transposed index, built once per graph."""

    def __init__(self, g: common.Graph, device):
        self.name, self.num_nodes = g.name, g.num_nodes
        self.src, self.dst = g.src.to(device), g.dst.to(device)
        self.E = self.dst.numel()
        self.w = torch.rand(self.E, device=device) + 0.5
        self.transposed = geot.transpose_index(self.src, self.dst)
        self._csr = {}

    def csr(self, dtype):
        if dtype not in self._csr:
            crow = torch.searchsorted(self.dst, torch.arange(self.num_nodes + 1, device=self.dst.device))
            self._csr[dtype] = torch.sparse_csr_tensor(
                crow, self.src, self.w.to(dtype), (self.num_nodes, self.num_nodes))
        return self._csr[dtype]

    def composite(self, w, x):
        msg = x.index_select(0, self.src) * w.reshape(*w.shape, *([1] * (x.dim() - w.dim())))
        return x.new_zeros((self.num_nodes, *x.shape[1:])).index_add_(0, self.dst, msg)

    def reference(self, w, x, chunk_elements=1 << 27):
        """The composite in float64, a chunk of edges at a time (1 GB of
        messages; all of a 10M-edge graph's at F = 512 take 40 GB)."""
        w, x = w.double(), x.double()
        edges_per_chunk = max(1, chunk_elements // max(1, x[0].numel()))
        out = x.new_zeros((self.num_nodes, *x.shape[1:]))
        for begin in range(0, self.E, edges_per_chunk):
            end = min(begin + edges_per_chunk, self.E)
            part = w[begin:end]
            msg = x.index_select(0, self.src[begin:end]) * part.reshape(*part.shape, *([1] * (x.dim() - w.dim())))
            out.index_add_(0, self.dst[begin:end], msg)
        return out

    def geot(self, w, x, transposed=None):
        return geot.index_weight_segment_reduce(self.src, self.dst, w, x, "sum", self.num_nodes,
                                                transposed=transposed)


def moved_bytes(p: Problem, F: int, esize: int) -> int:
    """Traffic model: indices and weight per edge, one gathered row per edge,
    the output once."""
    return p.E * (2 * p.src.element_size() + esize) + p.E * F * esize + p.num_nodes * F * esize


def check(out, ref, scale, rtol):
    """|out - ref| <= rtol * scale elementwise, scale = the same sum over
    |w| * |x| (fp32 sums over hub rows of 10^5 edges round by ~1e-5 of it)."""
    err = (out.double() - ref).abs()
    bound = rtol * scale + 1e-6
    if bool((err > bound).any()):
        raise AssertionError(f"wrong result: max error {float(err.max()):.3g}, allowed {float(bound.max()):.3g}")


def timed(fn, args, ref=None, scale=None, rtol=1e-4):
    out = fn()
    if ref is not None:
        check(out, ref, scale, rtol)
    return common.time_cuda(fn, warmup=args.warmup, reps=args.reps, device=args.device, max_time_s=5.0)


def with_heuristic(fn):
    """fn() with the hand heuristic's configs forced instead of the rules in
    force (two host calls more per launch: negligible at these sizes)."""
    mode = geot.rules_mode()
    geot.set_rules("heuristic")
    try:
        return fn()
    finally:
        geot.set_rules(mode)


def forward_rows(p: Problem, F: int, dtype, args, peers):
    x = torch.randn(p.num_nodes, F, device=args.device, dtype=dtype)
    w = p.w.to(dtype)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    ref = p.reference(p.w, x)
    scale = p.reference(p.w.abs(), x.abs())
    fns = {"geot": lambda: p.geot(w, x), "composite": lambda: p.composite(w, x)}
    if "geot_heuristic" in peers:
        fns["geot_heuristic"] = lambda: with_heuristic(lambda: p.geot(w, x))
    if "cusparse" in peers:
        A = p.csr(dtype)
        fns["cusparse"] = lambda: torch.sparse.mm(A, x)
    pyg_spmm = try_pyg_spmm()
    if "pyg_spmm" in peers and pyg_spmm is not None:
        A = p.csr(dtype)
        fns["pyg_spmm"] = lambda: pyg_spmm(A, x, "sum")
    row = {"graph": p.name, "E": p.E, "F": F, "dtype": str(dtype).replace("torch.", ""), "rules": geot.rules_mode()}
    for name, fn in fns.items():
        try:
            row[name] = timed(fn, args, ref, scale, rtol)
        except Exception as err:  # a peer without support for this case
            print(f"  {p.name} F={F} {name}: {type(err).__name__}: {str(err)[:100]}")
            row[name] = float("nan")
    row["geot_GBps"] = moved_bytes(p, F, x.element_size()) / (row["geot"] * 1e-3) / 1e9
    if args.deterministic:
        deterministic_columns(row, fns, args, ref, scale, rtol)
    return row


def deterministic_columns(row, fns, args, ref, scale, rtol):
    """--deterministic: geot and the torch-native peers (cusparse, composite) in deterministic mode."""
    with common.deterministic_mode():
        row["det_bitwise"] = common.same_bits(fns["geot"](), fns["geot"]())
        for name in ("geot", "cusparse", "composite"):
            if name not in fns:
                continue
            try:
                row[f"{name}_det"] = timed(fns[name], args, ref, scale, rtol)
            except Exception as err:  # noqa: BLE001  (raises in deterministic mode)
                print(f"  {row['graph']} F={row['F']} {name} (deterministic): {type(err).__name__}: {str(err)[:100]}")
                row[f"{name}_det"] = float("nan")
    row["det_ratio"] = row["geot_det"] / row["geot"]
    native = [row[k] for k in ("cusparse_det", "composite_det") if k in row and row[k] == row[k]]
    row["x_det_vs_native"] = min(native) / row["geot_det"] if native else float("nan")


def report_deterministic(df):
    if "det_ratio" not in df:
        return
    worst = df.loc[df["x_det_vs_native"].idxmin()] if df["x_det_vs_native"].notna().any() else None
    print(f"  deterministic mode: geot det / default geomean {common.geomean(df['det_ratio']):.3f}x "
          f"(max {df['det_ratio'].max():.2f}x); bitwise repeatable in {int(df['det_bitwise'].sum())}/{len(df)} cells"
          + ("" if worst is None else
             f"; vs the fastest native peer in deterministic mode: geomean "
             f"{common.geomean(df['x_det_vs_native'].dropna()):.2f}x, worst {worst['x_det_vs_native']:.2f}x "
             f"({worst['graph']}, F={worst['F']}), geot faster in "
             f"{int((df['x_det_vs_native'] > 1).sum())}/{int(df['x_det_vs_native'].notna().sum())} cells"))


def head_rows(p: Problem, heads: int, F: int, args):
    x = torch.randn(p.num_nodes, heads, F // heads, device=args.device)
    w = torch.rand(p.E, heads, device=args.device)
    ref = p.reference(w, x)
    scale = p.reference(w.abs(), x.abs())
    fns = {"geot": lambda: p.geot(w, x), "composite": lambda: p.composite(w, x)}
    row = {"graph": p.name, "E": p.E, "F": F, "heads": heads}
    for name, fn in fns.items():
        row[name] = timed(fn, args, ref, scale)
    return row


def fwdbwd_rows(p: Problem, F: int, dtype, args):
    x0 = torch.randn(p.num_nodes, F, device=args.device, dtype=dtype)
    w0 = p.w.to(dtype)
    grad = torch.randn(p.num_nodes, F, device=args.device, dtype=dtype)

    def step(forward, with_w=True):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_(with_w)
        forward(w, x).backward(grad)
        return x.grad

    fns = {
        "geot": lambda: step(p.geot),
        "geot_transposed": lambda: step(lambda w, x: p.geot(w, x, p.transposed)),
        "composite": lambda: step(p.composite),
    }
    A = p.csr(dtype)
    fns["cusparse_xgrad"] = lambda: step(lambda w, x: torch.sparse.mm(A, x), with_w=False)
    # x-gradient reference: the transposed product in float64
    w64, g64 = w0.double(), grad.double()
    ref = torch.zeros_like(x0, dtype=torch.float64).index_add_(0, p.src, g64.index_select(0, p.dst) * w64[:, None])
    scale = torch.zeros_like(ref).index_add_(0, p.src, g64.abs().index_select(0, p.dst) * w64.abs()[:, None])
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    row = {"graph": p.name, "E": p.E, "F": F, "dtype": str(dtype).replace("torch.", "")}
    for name, fn in fns.items():
        try:
            row[name] = timed(fn, args, ref, scale, rtol)
        except Exception as err:
            print(f"  {p.name} F={F} {row['dtype']} {name}: {type(err).__name__}: {str(err)[:100]}")
            row[name] = float("nan")
    return row


def host_overhead_rows(p: Problem, F: int, args, calls: int = 2000):
    x = torch.randn(p.num_nodes, F, device=args.device)
    A = p.csr(torch.float32)
    fns = {"geot": lambda: p.geot(p.w, x), "composite": lambda: p.composite(p.w, x),
           "cusparse": lambda: torch.sparse.mm(A, x),
           # the C++ entry without the Python wrapper: what the wrapper costs
           "geot_C": lambda: geot._C.index_segment_reduce_no_grad(p.src, p.dst, x, p.w, p.num_nodes, "sum", None),
           # the dispatcher, as a compiled graph calls the op (no gradient recorded)
           "geot_op": lambda: torch.ops.geot.index_segment_reduce.default(p.src, p.dst, x, p.w, p.num_nodes, "sum",
                                                                          None, None, None, None)}
    pyg_spmm = try_pyg_spmm()
    if pyg_spmm is not None:
        fns["pyg_spmm"] = lambda: pyg_spmm(A, x, "sum")
    rows = []
    for validation in (True, False):
        geot.set_validation(validation)
        for name, fn in fns.items():
            if not name.startswith("geot") and not validation:
                continue
            for _ in range(20):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            label = name if validation else f"{name}_no_validation"
            rows.append({"graph": p.name, "F": F, "op": label, "us_per_call": (time.perf_counter() - t0) / calls * 1e6})
    geot.set_validation(True)
    return rows


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def speedups(df, peers):
    for peer in peers:
        if peer in df:
            df[f"x_vs_{peer}"] = df[peer] / df["geot"]
    return df


def report(df, title, peers, filename):
    df = speedups(df, peers)
    common.print_table(df, title)
    for peer in peers:
        col = f"x_vs_{peer}"
        if col in df and df[col].notna().any():
            worst = df.loc[df[col].idxmin()]
            print(f"  geomean speedup vs {peer}: {common.geomean(df[col]):.2f}x   worst: {worst[col]:.2f}x "
                  f"({worst['graph']}, F={worst['F']})")
    report_deterministic(df)
    common.write_csv(df, filename)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", nargs="+", default=None)
    ap.add_argument("--F", nargs="+", type=int, default=None)
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="two small graphs, F in {1, 32}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--deterministic", action="store_true",
                    help="fwd, dtypes: also time geot and the native peers in deterministic mode")
    ap.add_argument("--fwdbwd-dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "float16", "bfloat16"], help="fwdbwd: the dtypes of x, w and the gradient")
    ap.add_argument("--rules", default=None,
                    help="geot's config rules: learned (each GPU's own, the default), heuristic, or a rule set's slug "
                         "(geot.rule_sets()); the CSV names get _rules-<mode> (GEOT_RULES sets the same)")
    args = ap.parse_args(argv)
    args.graphs = args.graphs or (QUICK_GRAPHS if args.quick else DEFAULT_GRAPHS)
    args.F = args.F or ([1, 32] if args.quick else DEFAULT_F)
    args.fwdbwd_dtypes = [getattr(torch, name) for name in args.fwdbwd_dtypes]
    if args.quick:
        args.warmup, args.reps = 1, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.rules is not None:
        geot.set_rules(args.rules)
    slug = common.device_slug(args.device) + (f"_rules-{args.rules}" if args.rules is not None else "")
    print(f"geot config rules: {geot.rules_mode()}; device: {common.device_name(args.device)}, copy bandwidth "
          f"{common.copy_bandwidth_gbs(args.device):.0f} GB/s")
    problems = [Problem(g, args.device) for g in (common.make_graph(s, args.device) for s in args.graphs) if g]
    if "fwd" in args.sections:
        rows = [forward_rows(p, F, torch.float32, args, ("cusparse", "pyg_spmm", "geot_heuristic"))
                for p in problems for F in args.F]
        df = pd.DataFrame(rows)
        report(df, "forward, fp32 weighted sum (ms)", ("cusparse", "pyg_spmm", "composite", "geot_heuristic"),
               f"spmm_fwd_{slug}.csv")
        heuristic_vs_cusparse = df["cusparse"] / df["geot_heuristic"]
        print(f"  (with the hand heuristic's configs instead: {common.geomean(heuristic_vs_cusparse):.2f}x vs cusparse, "
              f"worst {heuristic_vs_cusparse.min():.2f}x)")
    if "dtypes" in args.sections:
        rows = [forward_rows(p, F, dt, args, ("cusparse",)) for dt in (torch.float16, torch.bfloat16)
                for p in problems for F in args.F]
        report(pd.DataFrame(rows), "forward, half types (ms)", ("cusparse", "composite"), f"spmm_dtypes_{slug}.csv")
    if "heads" in args.sections:
        rows = [head_rows(p, h, F, args) for p in problems for h in (4, 8) for F in args.F if F >= h and F % h == 0]
        report(pd.DataFrame(rows), "forward, multi-head [E, H] weights (ms)", ("composite",),
               f"spmm_heads_{slug}.csv")
    if "fwdbwd" in args.sections:
        rows = [fwdbwd_rows(p, F, dtype, args)
                for dtype in args.fwdbwd_dtypes for p in problems for F in args.F]
        df = pd.DataFrame(rows)
        df["geot_transposed_vs_geot"] = df["geot"] / df["geot_transposed"]
        report(df, "forward + backward wrt x and w (ms)", ("composite", "cusparse_xgrad"),
               f"spmm_fwdbwd_{slug}.csv")
        print(f"  geomean speedup of the cached transposed index over the atomic x-grad: "
              f"{common.geomean(df['geot_transposed_vs_geot']):.2f}x")
        df["x_vs_composite"] = df["composite"] / df["geot_transposed"]
        print(f"  geomean speedup vs composite with the transposed index: {common.geomean(df['x_vs_composite']):.2f}x")
    if "overhead" in args.sections and problems:
        small = min(problems, key=lambda p: p.E)
        df = pd.DataFrame(host_overhead_rows(small, 16, args, calls=200 if args.quick else 2000))
        common.print_table(df, f"host overhead per call, {small.name}, F=16 (us)")
        common.write_csv(df, f"spmm_overhead_{slug}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
