"""Where a model step's time goes: torch.profiler over one e2e model step,
eager vs torch.compile, host (CPU) and device time, of geot's model or
(--library pyg) PyG's own.

    python bench/profile_step.py --model gcn --graph pubmed --hidden 64 --mode train [--compile-mode reduce-overhead]
    python bench/profile_step.py --model gin --graph cora --hidden 32 --dtype bf16 --library pyg
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402

import torch_geometric.nn as pyg_nn  # noqa: E402

import geot.nn as geot_nn  # noqa: E402


def per_step_ms(fn, device, reps=20):
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gcn", choices=[*e2e.MODELS, *e2e.GENERIC_MODELS, *e2e.VARIANT_MODELS])
    parser.add_argument("--graph", default="pubmed")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--mode", default="train", choices=["train", "inference"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--dtype", default="fp32", choices=list(e2e.DTYPES), help="autocast dtype")
    parser.add_argument("--library", default="geot", choices=["geot", "pyg"])
    parser.add_argument("--rows", type=int, default=15, help="profiler rows per table")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = e2e.load_inputs(args.graph, device)
    torch.manual_seed(0)
    lib = geot_nn if args.library == "geot" else pyg_nn
    model = e2e.Net(lib, args.model, inputs["x"].size(1), args.hidden, inputs["num_classes"]).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    # PyG's layers are compiled as the e2e benchmark compiles them (graph breaks allowed).
    compiled = torch.compile(model, fullgraph=args.library == "geot", backend=args.backend, mode=args.compile_mode)
    for label, runner in (("eager", model), ("compiled", compiled)):
        infer, train = e2e.step_functions(model, runner, inputs, inputs["edge_index"], e2e.DTYPES[args.dtype], device,
                                         compiled=label == "compiled")
        step = train if args.mode == "train" else infer
        ms = per_step_ms(step, device)  # also the warm-up (and compilation) before profiling
        with profile(activities=activities) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        print(f"\n== {args.library} {label}: {ms:.3f} ms per step (wall, back to back); "
              f"{len(prof.events())} profiled events")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        runtime = [e for e in events if e.key.startswith(("cuda", "cu"))]
        print("CUDA runtime calls: " + ", ".join(f"{e.key} x{e.count} {e.cpu_time_total:.0f} us"
                                                 for e in sorted(runtime, key=lambda e: -e.cpu_time_total)))
        if device.type == "cuda":
            print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
