"""Fast GPU check for kernel work: every config of the space against a float64
reference, then a small timing table (sum, fp32) against torch peers.
Run on a GPU machine after building: ``python scripts/gpu_smoke.py``."""
import sys
import time

import torch

import geot


def power_law_index(nodes, avg, exponent, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(nodes, generator=gen).pow(-1.0 / (exponent - 1.0))
    deg = torch.poisson(w / w.mean() * avg, generator=gen).long()
    return torch.repeat_interleave(torch.arange(nodes), deg).to(device)


def reference(index, src, reduce, S):
    out = torch.zeros(S, src.shape[1], dtype=torch.float64, device=src.device)
    name = {"max": "amax", "min": "amin"}.get(reduce, reduce)
    return out.scatter_reduce_(0, index[:, None].expand_as(src), src.double(), name, include_self=False)


def check_configs():
    from collections import Counter
    by_group = Counter()
    failures = 0
    index = power_law_index(3000, 6.0, 2.0)
    S = 3001  # one trailing empty segment
    for F in (1, 3, 32):
        src = torch.randn(index.numel(), F, device="cuda")
        for reduce in ("sum", "max", "mean", "min"):
            ref = reference(index, src, reduce, S)
            for cfg in geot.config_space():
                out = geot.segment_reduce(index, src, reduce, S, config=cfg).double()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < 1e-5:
                    failures += 1
                    by_group[(cfg.schedule, F, reduce, cfg.N_t)] += 1
                    if failures < 10:
                        print(f"FAIL F={F} {reduce} {cfg}: rel err {err}")
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for itype in (torch.int32, torch.int64):
            src = torch.randn(index.numel(), 7, device="cuda", dtype=dtype)
            for reduce in ("sum", "mean", "max", "min"):
                ref = reference(index, src, reduce, S)
                out = geot.segment_reduce(index.to(itype), src, reduce, S).double()
                err = ((out - ref).norm() / ref.norm()).item()
                tol = 1e-12 if dtype == torch.float64 else 1e-2
                if not err < tol:
                    failures += 1
                    print(f"FAIL {dtype} {itype} {reduce}: rel err {err}")
    for key, count in sorted(by_group.items()):
        print("failures", key, count)
    print(f"config check: {failures} failures over {len(geot.config_space())} configs x 12 cases + dtypes")
    return failures


def time_ms(fn, reps=30):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timing_table():
    geot.set_validation(False)
    graphs = {
        "powerlaw-2M": power_law_index(200_000, 10.0, 2.2, seed=1),
        "uniform-2M": torch.arange(125_000, device="cuda").repeat_interleave(16),
        "cora-like": power_law_index(2708, 3.9, 2.5, seed=2),
    }
    print(f"{'graph':<12} {'F':>4} {'geot':>8} {'scatter':>8} {'idx_add':>8} {'t.segred':>8}  config")
    for name, index in graphs.items():
        S = int(index[-1]) + 1
        lengths = torch.bincount(index, minlength=S)
        for F in (1, 2, 4, 8, 16, 32, 64, 128):
            src = torch.randn(index.numel(), F, device="cuda")
            exp = index[:, None].expand_as(src)
            t = [
                time_ms(lambda: geot.segment_reduce(index, src, "sum", S)),
                time_ms(lambda: torch.zeros(S, F, device="cuda").scatter_reduce_(0, exp, src, "sum", include_self=False)),
                time_ms(lambda: torch.zeros(S, F, device="cuda").index_add_(0, index, src)),
                time_ms(lambda: torch.segment_reduce(src, "sum", lengths=lengths, unsafe=True)),
            ]
            cfg = geot.explain(index.numel(), S, F)
            print(f"{name:<12} {F:>4} " + " ".join(f"{v:8.4f}" for v in t) + f"  {cfg}")


if __name__ == "__main__":
    t0 = time.time()
    bad = check_configs()
    print(f"checked in {time.time() - t0:.0f}s")
    timing_table()
    sys.exit(1 if bad else 0)
