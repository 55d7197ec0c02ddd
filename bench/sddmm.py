"""geot.sddmm "dot" (a link-prediction decoder: the dot product of the two
ends' embeddings per edge, then its backward) against what a user writes
instead: torch's ``(z[src] * z[dst]).sum(-1)``, eagerly and under
``torch.compile``. Median ms of forward + backward (CUDA events, L2
flushed, bench/common.py) over the edges of a generated graph, per width.

    python bench/sddmm.py [--graph "powerlaw:n=1000000,deg=10"] [--widths 64,128] [--dtype fp32]
"""
import argparse
import os
import sys

import pandas as pd
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.dirname(BENCH_DIR))
import common  # noqa: E402

import geot  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dot(z, src, dst):
    return (z.index_select(0, src) * z.index_select(0, dst)).sum(-1)


def paths(src, dst):
    compiled = torch.compile(torch_dot, fullgraph=True)
    return {"geot": lambda z: geot.sddmm(src, dst, z, z), "torch": lambda z: torch_dot(z, src, dst),
            "torch-compile": lambda z: compiled(z, src, dst)}


def run(args, device) -> pd.DataFrame:
    graph = common.make_graph(args.graph, device=device)
    src, dst = graph.src, graph.dst[torch.randperm(graph.num_edges, device=device)]  # pairs in any order
    print(f"{graph.name}: {graph.num_edges} edges, {graph.num_nodes} nodes", flush=True)
    rows = []
    for width in args.widths:
        z = torch.randn(graph.num_nodes, width, device=device, dtype=DTYPES[args.dtype], requires_grad=True)
        grad = torch.randn(graph.num_edges, device=device, dtype=z.dtype)
        row = {"graph": graph.name, "edges": graph.num_edges, "F": width, "dtype": args.dtype}
        for name, fn in paths(src, dst).items():
            def step():
                z.grad = None
                fn(z).backward(grad)
            timing = common.time_stats(step, warmup=args.warmup, reps=args.reps, device=device)
            row[name] = timing.median_ms
        row["x torch"], row["x torch-compile"] = row["torch"] / row["geot"], row["torch-compile"] / row["geot"]
        print(f"  F={width}: geot {row['geot']:.3f} ms, torch {row['torch']:.3f}, torch.compile "
              f"{row['torch-compile']:.3f} (x {row['x torch']:.2f}, {row['x torch-compile']:.2f})", flush=True)
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="powerlaw:n=1000000,deg=10")
    parser.add_argument("--widths", default="64,128")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny CPU check")
    args = parser.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.graph, args.widths, args.reps, args.warmup = "powerlaw:n=2000,deg=5", [8], 2, 1
    df = run(args, device)
    print(df.to_string(index=False))
    written = common.write_csv(df, f"sddmm_{common.device_slug(device)}.csv")
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
