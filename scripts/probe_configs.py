"""Times hand-picked configs against the default pick (learned rules, else the
heuristic) and the strongest peer on a few (graph, F) cells: a quick look
before a full sweep. GPU only.

    python scripts/probe_configs.py
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import geot  # noqa: E402
from common import make_graph, time_cuda  # noqa: E402


def candidates(F, fused):
    out = []
    for n_t in (1, 2, 4):
        if F % n_t:
            continue
        cols = max(1, F // n_t)
        for t_n in sorted({min(cols, 64), 16, 32}):
            if t_n > 64:
                continue
            t_m = max(1, 256 // t_n)
            for m_t in (8, 16, 32, 64):
                out.append((n_t, t_n, m_t, t_m, 1))
                out.append((n_t, t_n, m_t, t_m, 0))
        for g in (8, 16, 32):
            for m_t in (4, 8, 16):
                out.append((n_t, 32, m_t, 8, g))
    return out


def probe_plain(graph, F):
    idx = graph.dst
    S = graph.num_nodes
    src = torch.randn(graph.num_edges, F, device="cuda")
    lengths = torch.bincount(idx, minlength=S)
    peer = time_cuda(lambda: torch.segment_reduce(src, "sum", lengths=lengths, unsafe=True), reps=10)
    picked = time_cuda(lambda: geot.segment_reduce(idx, src, "sum", S), reps=10)
    return peer, picked, lambda cfg: geot.segment_reduce(idx, src, "sum", S, config=cfg), idx, S


def probe_fused(graph, F):
    S = graph.num_nodes
    x = torch.randn(S, F, device="cuda")
    w = torch.rand(graph.num_edges, device="cuda")
    a = torch.sparse_csr_tensor(
        torch.searchsorted(graph.dst, torch.arange(S + 1, device="cuda")), graph.src, w, (S, S))
    peer = time_cuda(lambda: torch.sparse.mm(a, x), reps=10)
    src, dst = graph.src, graph.dst
    picked = time_cuda(lambda: geot.index_weight_segment_reduce(src, dst, w, x, "sum", S), reps=10)
    return peer, picked, lambda cfg: geot.index_weight_segment_reduce(src, dst, w, x, "sum", S, config=cfg), dst, S


def main():
    torch.manual_seed(0)
    cells = [("plain", "uniform", F) for F in (2, 4, 8, 16, 32)]
    cells += [("plain", "powerlaw", F) for F in (4, 8, 16)]
    cells += [("fused", g, F) for g in ("powerlaw", "hubs", "uniform", "pubmed") for F in (1, 32, 64, 128)]
    for kind, name, F in cells:
        graph = make_graph(name, device="cuda", data_dir=os.environ.get("GEOT_DATA"))
        peer, picked, run, idx, S = (probe_plain if kind == "plain" else probe_fused)(graph, F)
        results = []
        for cfg in candidates(F, kind == "fused"):
            try:
                results.append((time_cuda(lambda: run(cfg), warmup=1, reps=5), cfg))
            except (RuntimeError, ValueError):  # an unlaunchable config
                continue
        results.sort()
        best = ", ".join(f"{c}:{t*1e3:.0f}" for t, c in results[:4])
        longest = int(torch.bincount(idx, minlength=S).max())
        explain = tuple(geot.explain(idx.numel(), S, F, kind == "fused", geot.config.long_segment_level(longest)))
        print(f"{kind:5} {name:9} F={F:3}  peer {peer*1e3:7.1f}us  pick {picked*1e3:7.1f}us {explain}  "
              f"pick/peer {peer/picked:5.2f}  best/peer {peer/results[0][0]:5.2f}  best: {best}", flush=True)


if __name__ == "__main__":
    main()
