"""The README's demo: segment_reduce on a generated power-law graph.

Checks geot against a plain-torch float64 reference for every reduction and
times it against torch's own scatter_reduce_ and segment_reduce, on the GPU
when there is one. Run: ``python -m geot.demo``.
"""
import argparse
import statistics
import time

import torch

import geot


def power_law_index(num_nodes: int, avg_degree: float, exponent: float, device) -> torch.Tensor:
    """Sorted destination ids whose in-degrees follow a Zipf-like law."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(num_nodes, generator=gen).pow(-1.0 / (exponent - 1.0))
    degrees = torch.poisson(weights / weights.mean() * avg_degree, generator=gen).long()
    return torch.repeat_interleave(torch.arange(num_nodes), degrees).to(device)


def median_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=None, help="default: 200k on GPU, 20k on CPU")
    parser.add_argument("--features", type=int, default=32)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and geot.cuda_built else "cpu"
    nodes = args.nodes or (200_000 if device == "cuda" else 20_000)
    index = power_law_index(nodes, avg_degree=10.0, exponent=2.2, device=device)
    src = torch.randn(index.numel(), args.features, device=device)
    print(f"geot demo on {device}: {nodes} segments, {index.numel()} rows, F={args.features}, "
          f"largest segment {int(torch.bincount(index).max())} rows")

    rows = []
    for reduce in ("sum", "mean", "max", "min"):
        out = geot.segment_reduce(index, src, reduce, num_segments=nodes)
        expect = torch.zeros(nodes, args.features, dtype=torch.float64, device=device).scatter_reduce_(
            0, index[:, None].expand_as(src), src.double(), {"max": "amax", "min": "amin"}.get(reduce, reduce),
            include_self=False)
        error = ((out.double() - expect).norm() / expect.norm()).item()
        geot.set_validation(False)
        t_geot = median_ms(lambda: geot.segment_reduce(index, src, reduce, num_segments=nodes))
        geot.set_validation(True)
        torch_reduce = {"max": "amax", "min": "amin"}.get(reduce, reduce)
        t_scatter = median_ms(lambda: torch.zeros(nodes, args.features, device=device).scatter_reduce_(
            0, index[:, None].expand_as(src), src, torch_reduce, include_self=False))
        rows.append((reduce, error, t_geot, t_scatter))

    print(f"{'reduce':<6} {'rel. error':>10} {'geot ms':>9} {'torch scatter_reduce_ ms':>25} {'speedup':>8}")
    for reduce, error, t_geot, t_scatter in rows:
        print(f"{reduce:<6} {error:>10.1e} {t_geot:>9.3f} {t_scatter:>25.3f} {t_scatter / t_geot:>7.2f}x")
    assert all(error < 1e-5 for _, error, _, _ in rows), "geot disagrees with the reference"


if __name__ == "__main__":
    main()
