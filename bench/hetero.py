#!/usr/bin/env python3
"""Microbenchmark: geot's typed matmul and edge softmax against what a user
would write instead.

Sections (each a table, a CSV under bench/out and $OUT, and geomeans):
  matmul    geot.segment_matmul(x, ptr, W) over M rows grouped into T types,
            T in {4, 16, 64, 512}, K = N in {16, 64, 128}, even and skewed
            (Zipf) type sizes; forward and forward + backward (x and W):
              loop       per-type torch.mm (forward: into slices of one output,
                         with host offsets; backward: autograd through the
                         slices and torch.cat)
              bmm        torch.bmm on x padded to [T, max rows, K], padded
                         outside the timing (the bound of the padded approach)
              bmm_total  the same with the padding and unpadding timed
  softmax   geot.edge_softmax(score [E, H], dst, S), H in {1, 4, 8}, forward
            and forward + backward:
              pyg        torch_geometric.utils.softmax (when importable)
              composite  scatter_reduce amax + exp + index_add + divide
  attention GAT's inference aggregation of projected rows x [N, H, 64 / H]
            with attention vectors att_src / att_dst [H, C], H in {1, 4, 8}:
            geot.attention_aggregate (scores, softmax and sum in one pass)
            against
              pyg        PyG GATConv's steps: scores, gathered logits,
                         torch_geometric.utils.softmax, scatter of the
                         weighted rows (when importable)
              two_op     geot's scores (gather_rows, segment_broadcast), then
                         geot.edge_softmax + geot.index_weight_segment_reduce
                         (what geot's GATConv trains with, and runs inference
                         with for few heads on large graphs or wide heads)

  python bench/hetero.py                              # everything (GPU)
  python bench/hetero.py --quick --device cpu         # smoke test
  python bench/hetero.py --sections matmul --T 16 --KN 64 --dtypes bfloat16
  python bench/hetero.py --sections attention --dtypes float32 bfloat16
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

SECTIONS = ["matmul", "softmax", "attention"]
DEFAULT_GRAPHS = ["cora", "citeseer", "pubmed", "powerlaw", "hubs_small"]
QUICK_GRAPHS = ["cora", "powerlaw_small"]
BMM_BYTES_CAP = 8 << 30  # padded tensors beyond this are not timed


# ----------------------------------------------------------------------------
# segment_matmul
# ----------------------------------------------------------------------------
def type_sizes(M: int, T: int, dist: str, seed: int = 0) -> list:
    """Rows per type summing to M: "even", or "skewed" (Zipf, exponent 1.2,
    sizes shuffled: a few huge types, many small, some empty for large T)."""
    if dist == "even":
        sizes = [M // T] * T
    else:
        weights = torch.arange(1, T + 1, dtype=torch.float64).pow(-1.2)
        sizes = (weights / weights.sum() * M).floor().long()
        sizes = sizes[torch.randperm(T, generator=torch.Generator().manual_seed(seed))].tolist()
    sizes[0] += M - sum(sizes)
    return sizes


class MatmulProblem:
    def __init__(self, M, T, K, N, dist, dtype, device):
        self.M, self.T, self.K, self.N, self.dist, self.dtype = M, T, K, N, dist, dtype
        self.sizes = type_sizes(M, T, dist)
        bounds = [0]
        for s in self.sizes:
            bounds.append(bounds[-1] + s)
        self.bounds = bounds  # host offsets for the loop (outside the timing)
        self.ptr = torch.tensor(bounds, device=device)
        self.x = torch.randn(M, K, device=device, dtype=dtype)
        self.w = torch.randn(T, K, N, device=device, dtype=dtype) / K ** 0.5
        self.grad = torch.randn(M, N, device=device, dtype=dtype)
        # Padded layout: row i of type t sits at [t, i - ptr[t]].
        types = torch.repeat_interleave(torch.arange(T, device=device), torch.tensor(self.sizes, device=device))
        self.types = types
        self.slot = torch.arange(M, device=device) - self.ptr[types]
        self.L = max(self.sizes)
        self.bmm_fits = T * self.L * max(K, N) * self.x.element_size() * 3 <= BMM_BYTES_CAP

    def pad(self, rows, width):
        padded = rows.new_zeros((self.T, self.L, width))
        padded[self.types, self.slot] = rows
        return padded

    def unpad(self, padded):
        return padded[self.types, self.slot]

    # forward ---------------------------------------------------------------
    def geot(self):
        return geot.segment_matmul(self.x, self.ptr, self.w)

    def loop(self):
        out = self.x.new_empty((self.M, self.N))
        for t in range(self.T):
            a, b = self.bounds[t], self.bounds[t + 1]
            if b > a:
                torch.mm(self.x[a:b], self.w[t], out=out[a:b])
        return out

    def bmm_fns(self):
        x_pad = self.pad(self.x, self.K)
        return (lambda: torch.bmm(x_pad, self.w),
                lambda: self.unpad(torch.bmm(self.pad(self.x, self.K), self.w)))

    # forward + backward ----------------------------------------------------
    def leaves(self):
        return self.x.detach().requires_grad_(), self.w.detach().requires_grad_()

    def geot_step(self):
        x, w = self.leaves()
        geot.segment_matmul(x, self.ptr, w).backward(self.grad)
        return x.grad, w.grad

    def loop_step(self):
        x, w = self.leaves()
        parts = [x[self.bounds[t]:self.bounds[t + 1]] @ w[t] for t in range(self.T)]
        torch.cat(parts).backward(self.grad)
        return x.grad, w.grad

    def bmm_steps(self):
        x_pad0, g_pad = self.pad(self.x, self.K), self.pad(self.grad, self.N)

        def padded():
            x_pad, w = x_pad0.detach().requires_grad_(), self.w.detach().requires_grad_()
            torch.bmm(x_pad, w).backward(g_pad)
            return x_pad.grad, w.grad

        def total():
            x, w = self.leaves()
            self.unpad(torch.bmm(self.pad(x, self.K), w)).backward(self.grad)
            return x.grad, w.grad

        return padded, total


def check_close(got, ref, what, rel=2e-2):
    """Loose check (TF32 / half inputs): relative Frobenius error."""
    err = float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    if not err < rel:
        raise AssertionError(f"{what}: relative error {err:.3g}")


def timed(fn, args):
    return common.time_cuda(fn, warmup=args.warmup, reps=args.reps, device=args.device, max_time_s=5.0)


def matmul_row(p: MatmulProblem, args, backward: bool):
    row = {"T": p.T, "K": p.K, "N": p.N, "dist": p.dist, "dtype": str(p.dtype).replace("torch.", ""),
           "max_rows": p.L}
    if backward:
        gx, gw = p.geot_step()
        rx, rw = p.loop_step()
        check_close(gx, rx, "grad x")
        check_close(gw, rw, "grad w")
        fns = {"geot": p.geot_step, "loop": p.loop_step}
        if p.bmm_fits:
            fns["bmm"], fns["bmm_total"] = p.bmm_steps()
    else:
        check_close(p.geot(), p.loop(), "forward")
        fns = {"geot": p.geot, "loop": p.loop}
        if p.bmm_fits:
            fns["bmm"], fns["bmm_total"] = p.bmm_fns()
    for name in ("geot", "loop", "bmm", "bmm_total"):
        row[name] = timed(fns[name], args) if name in fns else float("nan")
    return row


# ----------------------------------------------------------------------------
# edge_softmax
# ----------------------------------------------------------------------------
def try_pyg_softmax():
    try:
        from torch_geometric.utils import softmax
        return softmax
    except Exception:  # PyG is optional
        return None


def composite_softmax(score, dst, S):
    heads = score.shape[1]
    top = torch.full((S, heads), float("-inf"), device=score.device, dtype=score.dtype).scatter_reduce(
        0, dst[:, None].expand_as(score), score.detach(), "amax", include_self=True)
    e = (score - top.index_select(0, dst)).exp()
    total = score.new_zeros((S, heads)).index_add_(0, dst, e)
    return e / total.index_select(0, dst)


def softmax_row(g: common.Graph, heads: int, args, backward: bool):
    S = g.num_nodes
    score0 = torch.randn(g.num_edges, heads, device=args.device)
    grad = torch.randn_like(score0)
    impls = {"geot": lambda s: geot.edge_softmax(s, g.dst, S), "composite": lambda s: composite_softmax(s, g.dst, S)}
    pyg = try_pyg_softmax()
    if pyg is not None:
        impls["pyg"] = lambda s: pyg(s, g.dst, num_nodes=S)

    def forward_fn(impl):
        return lambda: impl(score0)

    def step_fn(impl):
        def step():
            score = score0.detach().requires_grad_()
            impl(score).backward(grad)
            return score.grad
        return step

    make = step_fn if backward else forward_fn
    ref = make(impls["composite"])()
    row = {"graph": g.name, "E": g.num_edges, "H": heads, "pass": "fwdbwd" if backward else "fwd"}
    for name, impl in impls.items():
        fn = make(impl)
        try:
            check_close(fn(), ref, f"{g.name} H={heads} {name}", rel=1e-4)
            row[name] = timed(fn, args)
        except Exception as err:  # a peer without support for this case
            print(f"  {g.name} H={heads} {name}: {type(err).__name__}: {str(err)[:100]}")
            row[name] = float("nan")
    return row


# ----------------------------------------------------------------------------
# attention_aggregate
# ----------------------------------------------------------------------------
ATTENTION_FEATURES = 64  # H * C: GAT's 8 heads of 8 channels


def gat_logits(x, att_src, att_dst, src, dst, slope=0.2):
    """[E, H] leaky_relu(score_src[src] + score_dst[dst]) as PyG's GATConv makes them."""
    score_src, score_dst = (x * att_src).sum(-1), (x * att_dst).sum(-1)
    return torch.nn.functional.leaky_relu(score_src.index_select(0, src) + score_dst.index_select(0, dst), slope)


def geot_logits(x, att_src, att_dst, src, dst, slope=0.2):
    """gat_logits as geot.nn's GATConv makes them: its gathers of [N, H] scores (torch's index_select of
    such narrow rows took 16 ms on a 12.8M-edge graph at H = 4 on an H200, 26x the gather)."""
    score = (torch.ops.geot.gather_rows((x * att_src).sum(-1), src)
             + torch.ops.geot.segment_broadcast((x * att_dst).sum(-1), dst))
    return torch.nn.functional.leaky_relu(score, slope)


def attention_row(g: common.Graph, heads: int, dtype, args):
    N, C = g.num_nodes, ATTENTION_FEATURES // heads
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(N, heads, C, device=args.device, generator=gen).to(dtype)
    att_src, att_dst = (torch.randn(heads, C, device=args.device, generator=gen).to(dtype) for _ in range(2))
    src, dst = g.src, g.dst

    def one_pass():
        return geot.attention_aggregate(x, None, None, src, dst, N, att_src=att_src, att_dst=att_dst)

    def two_op():
        alpha = geot.edge_softmax(geot_logits(x, att_src, att_dst, src, dst), dst, N)
        return geot.index_weight_segment_reduce(src, dst, alpha, x, "sum", N)

    impls = {"geot": one_pass, "two_op": two_op}
    pyg = try_pyg_softmax()
    if pyg is not None:
        from torch_geometric.utils import scatter

        def pyg_steps():
            alpha = pyg(gat_logits(x, att_src, att_dst, src, dst), dst, num_nodes=N)
            return scatter(x.index_select(0, src) * alpha.unsqueeze(-1), dst, 0, dim_size=N, reduce="sum")
        impls["pyg"] = pyg_steps

    row = {"graph": g.name, "E": g.num_edges, "H": heads, "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        ref = two_op().float()
        for name, fn in impls.items():
            check_close(fn().float(), ref, f"{g.name} H={heads} {name}", rel=1e-4 if dtype == torch.float32 else 2e-2)
            row[name] = timed(fn, args)
    return row


# ----------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------
def report(df, title, peers, filename, keys):
    for peer in peers:
        if peer in df:
            df[f"x_vs_{peer}"] = df[peer] / df["geot"]
    common.print_table(df, title)
    for peer in peers:
        col = f"x_vs_{peer}"
        if col in df and df[col].notna().any():
            worst = df.loc[df[col].idxmin()]
            where = ", ".join(f"{k}={worst[k]}" for k in keys)
            print(f"  geomean speedup vs {peer}: {common.geomean(df[col]):.2f}x   worst: {worst[col]:.2f}x ({where})")
    common.write_csv(df, filename)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--M", type=int, default=100_000, help="rows of the typed matmul")
    ap.add_argument("--T", nargs="+", type=int, default=[4, 16, 64, 512])
    ap.add_argument("--KN", nargs="+", type=int, default=[16, 64, 128], help="K = N")
    ap.add_argument("--dists", nargs="+", default=["even", "skewed"], choices=["even", "skewed"])
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--graphs", nargs="+", default=None)
    ap.add_argument("--heads", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    args.graphs = args.graphs or (QUICK_GRAPHS if args.quick else DEFAULT_GRAPHS)
    if args.quick:
        args.M, args.T, args.KN, args.heads = 5000, [4, 64], [16, 64], [1, 4]
        args.warmup, args.reps = 1, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    slug = common.device_slug(args.device)
    print(f"device: {common.device_name(args.device)}")
    if "matmul" in args.sections:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            problems = [MatmulProblem(args.M, T, KN, KN, dist, dtype, args.device)
                        for T in args.T for KN in args.KN for dist in args.dists]
            for backward, label in ((False, "fwd"), (True, "fwdbwd")):
                rows = [matmul_row(p, args, backward) for p in problems]
                report(pd.DataFrame(rows), f"segment_matmul {label}, M={args.M}, {dtype_name} (ms)",
                       ("loop", "bmm", "bmm_total"), f"hetero_matmul_{label}_{dtype_name}_{slug}.csv",
                       ("T", "K", "dist"))
    if "softmax" in args.sections:
        graphs = [g for g in (common.make_graph(s, args.device) for s in args.graphs) if g]
        for backward, label in ((False, "fwd"), (True, "fwdbwd")):
            rows = [softmax_row(g, h, args, backward) for g in graphs for h in args.heads]
            report(pd.DataFrame(rows), f"edge_softmax {label}, fp32 (ms)", ("pyg", "composite"),
                   f"hetero_softmax_{label}_{slug}.csv", ("graph", "H"))
    if "attention" in args.sections:
        graphs = [g for g in (common.make_graph(s, args.device) for s in args.graphs) if g]
        for dtype_name in args.dtypes:
            rows = [attention_row(g, h, getattr(torch, dtype_name), args) for g in graphs for h in args.heads]
            report(pd.DataFrame(rows), f"attention_aggregate (GAT inference, F = {ATTENTION_FEATURES}), {dtype_name} "
                   "(ms)", ("pyg", "two_op"), f"hetero_attention_{dtype_name}_{slug}.csv", ("graph", "H"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
