"""Shared helpers for the geot benchmarks: graphs, timing, bandwidth, tables.

Graphs
    load_graphs(names)            shared .npz graphs (cora, citeseer, pubmed, ...)
    powerlaw_graph / uniform_graph / hubs_graph
                                  seeded generators, vectorized torch (GPU-fast);
                                  each returns (src_index, dst_index, num_nodes)
                                  with dst_index sorted non-decreasing.
    make_graph(spec)              a graph from a name or "kind:key=val,..." spec.
Timing
    time_cuda(fn)                 median ms; CUDA events + L2 flush on GPU,
                                  time.perf_counter on CPU.
    copy_bandwidth_gbs(device)    measured device-to-device copy rate.
Reporting
    geomean, print_table, device_slug, gpu_tag
    write_csv(df, name)           bench/out/<name> (scratch, not tracked) and $OUT/<name>
                                  when $OUT is set; `python bench/report.py --add`
                                  merges a run into the tracked bench/results/.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import statistics
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)

# ----------------------------------------------------------------------------
# Deterministic mode (--deterministic of the benches)
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def deterministic_mode():
    """torch.use_deterministic_algorithms(True) inside, the previous mode after."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


# ----------------------------------------------------------------------------
# Graphs
# ----------------------------------------------------------------------------


@dataclass
class Graph:
    """A graph as the benchmarks use it: dst is sorted non-decreasing."""

    name: str
    src: torch.Tensor  # int64 [E]
    dst: torch.Tensor  # int64 [E], sorted
    num_nodes: int
    kind: str = "shared"  # "shared" or the generator's name
    params: Dict[str, object] = field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        return int(self.dst.numel())

    def to(self, device) -> "Graph":
        return Graph(self.name, self.src.to(device), self.dst.to(device), self.num_nodes, self.kind, dict(self.params))

    def degree_stats(self) -> Dict[str, float]:
        deg = torch.bincount(self.dst, minlength=self.num_nodes)
        return {
            "max_deg": int(deg.max()) if deg.numel() else 0,
            "avg_deg": float(self.num_edges) / max(self.num_nodes, 1),
            "empty_frac": float((deg == 0).sum()) / max(self.num_nodes, 1),
        }


def data_dirs(data_dir: Optional[str] = None) -> List[str]:
    """Directories searched for <name>.npz, in order (geot.data.data_dirs)."""
    from geot.data import data_dirs as package_data_dirs

    return package_data_dirs(data_dir)


def find_graph_file(name: str, data_dir: Optional[str] = None) -> Optional[str]:
    for d in data_dirs(data_dir):
        path = os.path.join(d, f"{name}.npz")
        if os.path.isfile(path):
            return path
    return None


def load_graph(name: str, data_dir: Optional[str] = None, device="cpu") -> Optional[Graph]:
    """One shared graph, or None (with a printed note) when no file is found."""
    path = find_graph_file(name, data_dir)
    if path is None:
        print(f"note: graph {name!r} not found (searched {', '.join(data_dirs(data_dir))}); skipped")
        return None
    with np.load(path) as z:  # lazy: only the arrays read here are loaded
        edge_index = np.asarray(z["edge_index"], dtype=np.int64)
        num_nodes = int(z["num_nodes"])
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"{path}: edge_index must be [2, E], got {edge_index.shape}")
    src = torch.from_numpy(np.ascontiguousarray(edge_index[0])).to(device)
    dst = torch.from_numpy(np.ascontiguousarray(edge_index[1])).to(device)
    if dst.numel() > 1 and bool((dst[1:] < dst[:-1]).any()):
        # The shared files are sorted by destination; sort anyway rather than fail.
        print(f"note: {name}: edge_index not sorted by destination; sorting")
        dst, perm = torch.sort(dst, stable=True)
        src = src[perm]
    return Graph(name, src, dst, num_nodes, kind="shared", params={"path": path})


def load_graphs(names: Iterable[str], data_dir: Optional[str] = None, device="cpu") -> List[Graph]:
    """Shared graphs by name (<name>.npz with edge_index [2,E] sorted by row 1,
    num_nodes). Search order: data_dir, $GEOT_DATA, <repo>/../shared/data,
    <repo>/.data. Names not found are skipped with a printed note."""
    graphs = []
    for name in names:
        g = load_graph(name, data_dir, device)
        if g is not None:
            graphs.append(g)
    return graphs


def _generator(device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


def _from_degrees(deg: torch.Tensor, gen: torch.Generator, sort_src: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Edges with dst = node repeated deg[node] times (sorted) and uniform
    random sources; within a destination the sources are sorted when sort_src."""
    n = deg.numel()
    device = deg.device
    deg = deg.to(torch.int64)
    num_edges = int(deg.sum())
    dst = torch.repeat_interleave(torch.arange(n, device=device), deg, output_size=num_edges)
    src = torch.randint(0, max(n, 1), (num_edges,), device=device, generator=gen)
    if sort_src and num_edges:
        key = dst * n + src  # dst already sorted: sorting the key sorts src within each dst
        key, _ = torch.sort(key)
        dst = torch.div(key, n, rounding_mode="floor")
        src = key - dst * n
    return src, dst


def powerlaw_graph(
    num_nodes: int,
    avg_degree: float = 10.0,
    exponent: float = 2.1,
    max_degree: Optional[int] = None,
    dist: str = "zipf",
    sigma: float = 1.5,
    seed: int = 0,
    device="cpu",
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Power-law in-degrees. dist="zipf": continuous Pareto tail
    P(deg >= k) ~ k^-(exponent-1), scaled to avg_degree and rounded down (so
    some nodes get no edge); dist="lognormal": exp(N(mu, sigma)) with mu set
    for avg_degree. Degrees are i.i.d. per node, so heavy nodes lie at random
    ids. Returns (src_index, dst_index sorted, num_nodes)."""
    gen = _generator(device, seed)
    u = torch.rand(num_nodes, device=device, generator=gen, dtype=torch.float64).clamp_(min=1e-12)
    if dist == "zipf":
        if exponent <= 1.0:
            raise ValueError("exponent must be > 1")
        x = u.pow(-1.0 / (exponent - 1.0))  # Pareto(xmin=1)
    elif dist == "lognormal":
        z = torch.randn(num_nodes, device=device, generator=gen, dtype=torch.float64)
        x = torch.exp(z * sigma)
    else:
        raise ValueError(f"unknown dist {dist!r}")
    cap = float(max_degree if max_degree is not None else num_nodes)
    # Scale so the mean after capping is avg_degree (two fixed-point steps suffice).
    scale = avg_degree / float(x.mean())
    for _ in range(2):
        scale *= avg_degree / max(float((x * scale).clamp(max=cap).mean()), 1e-12)
    deg = torch.floor((x * scale).clamp_(max=cap) + 0.5).to(torch.int64)
    src, dst = _from_degrees(deg, gen)
    return src, dst, num_nodes


def uniform_graph(num_nodes: int, degree: int = 16, seed: int = 0, device="cpu") -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Every node has exactly `degree` in-edges from uniform random sources."""
    gen = _generator(device, seed)
    deg = torch.full((num_nodes,), int(degree), dtype=torch.int64, device=device)
    src, dst = _from_degrees(deg, gen)
    return src, dst, num_nodes


def hubs_graph(
    num_nodes: int,
    avg_degree: float = 2.0,
    num_hubs: int = 4,
    hub_min: int = 100_000,
    hub_max: int = 1_000_000,
    seed: int = 0,
    device="cpu",
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Mostly small in-degrees (uniform in [0, 2*avg_degree]) plus `num_hubs`
    nodes at random ids with log-uniform in-degrees in [hub_min, hub_max]."""
    gen = _generator(device, seed)
    hi = max(int(round(2 * avg_degree)), 0)
    deg = torch.randint(0, hi + 1, (num_nodes,), device=device, generator=gen)
    num_hubs = min(int(num_hubs), num_nodes)
    if num_hubs > 0:
        hubs = torch.randperm(num_nodes, device=device, generator=gen)[:num_hubs]
        lo, up = math.log(hub_min), math.log(hub_max)
        r = torch.rand(num_hubs, device=device, generator=gen, dtype=torch.float64)
        hub_deg = torch.exp(lo + r * (up - lo)).round().to(torch.int64)
        deg[hubs] = hub_deg
    src, dst = _from_degrees(deg, gen)
    return src, dst, num_nodes


GENERATORS: Dict[str, Callable] = {
    "powerlaw": powerlaw_graph,
    "uniform": uniform_graph,
    "hubs": hubs_graph,
}

# Named generated graphs (about 2-4M edges unless "small").
GENERATED: Dict[str, Tuple[str, Dict[str, object]]] = {
    "powerlaw": ("powerlaw", {"num_nodes": 300_000, "avg_degree": 10.0, "exponent": 2.3, "max_degree": 50_000}),
    "uniform": ("uniform", {"num_nodes": 200_000, "degree": 16}),
    "hubs": ("hubs", {"num_nodes": 1_000_000, "avg_degree": 2.0, "num_hubs": 4}),
    "powerlaw_small": ("powerlaw", {"num_nodes": 10_000, "avg_degree": 10.0, "exponent": 2.3}),
    "hubs_small": ("hubs", {"num_nodes": 50_000, "avg_degree": 2.0, "num_hubs": 2, "hub_min": 50_000, "hub_max": 200_000}),
}

_PARAM_ALIASES = {"n": "num_nodes", "deg": "avg_degree", "d": "degree", "alpha": "exponent", "hubs": "num_hubs"}


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_graph_spec(spec: str) -> Tuple[str, str, Dict[str, object]]:
    """'powerlaw' -> the named default; 'powerlaw:n=1000000,deg=8' -> the
    generator with those parameters. Returns (kind, name, params); kind is
    "shared" for names that are neither."""
    if ":" in spec:
        kind, _, rest = spec.partition(":")
        if kind not in GENERATORS:
            raise ValueError(f"unknown generator {kind!r} in {spec!r}; have {sorted(GENERATORS)}")
        params: Dict[str, object] = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            params[_PARAM_ALIASES.get(key.strip(), key.strip())] = _parse_value(value.strip())
        return kind, spec, params
    if spec in GENERATED:
        kind, params = GENERATED[spec]
        return kind, spec, dict(params)
    return "shared", spec, {}


def split_graph_specs(text: str) -> List[str]:
    """'cora,powerlaw:n=1000,deg=8' -> ['cora', 'powerlaw:n=1000,deg=8']: a
    comma-separated list of graph names and specs, whose parameters keep theirs."""
    specs: List[str] = []
    for item in filter(None, text.split(",")):
        if specs and ":" in specs[-1] and "=" in item and ":" not in item:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def make_graph(spec: str, device="cpu", seed: int = 0, data_dir: Optional[str] = None) -> Optional[Graph]:
    """A shared or generated graph on `device`, or None when a shared one is missing."""
    kind, name, params = parse_graph_spec(spec)
    if kind == "shared":
        return load_graph(name, data_dir, device)
    params.setdefault("seed", seed)
    src, dst, n = GENERATORS[kind](device=device, **params)
    return Graph(name, src, dst, n, kind=kind, params=params)


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------

L2_FLUSH_BYTES = 256 << 20
_flush_buffers: Dict[str, torch.Tensor] = {}


def own_code(cls: type) -> type:
    """A subclass of the model class cls whose forward is a copy of cls's with
    a code object of its own, for the second library's model in a process
    that compiles both. Dynamo keeps compiled code, and the frames it gave up
    on, per code object: PyG's compiled models break their graph inside the
    layer loop of a shared forward, dynamo then stops compiling that code, and
    the other model sharing it ran as one compiled region per layer with eager
    steps in between (compiled GCN training on the H200: 1.4-1.6x eager's
    time on cora and citeseer). A user's process compiles one of the two
    models."""
    forward = cls.forward
    copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                              forward.__defaults__, forward.__closure__)
    return type(cls.__name__, (cls,), {"forward": copy, "__module__": cls.__module__})


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    buf = _flush_buffers.get(key)
    if buf is None:
        buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        _flush_buffers[key] = buf
    return buf


def release_flush_buffer(device) -> None:
    """Frees the L2-flush buffer (so a memory peak measured next leaves it out)."""
    _flush_buffers.pop(str(torch.device(device)), None)


def flush_l2(device) -> None:
    """Evicts the GPU's L2 by writing a 256 MB buffer (H100 L2 is 50 MB)."""
    _flush_buffer(torch.device(device)).zero_()


def _device_of(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    times_ms: List[float]


_GATE_CYCLES = 1_000_000  # GPU clock cycles, ~0.5 ms at H100 clocks


def hold_gpu(cycles: int = _GATE_CYCLES) -> None:
    """Queues a busy-wait kernel: the GPU stays on it while the host queues
    what comes next (a start event, the kernels to time), so host launch
    time and host stalls stay out of the GPU time measured after it."""
    torch.cuda._sleep(cycles)


def time_stats(
    fn: Callable[[], object],
    warmup: int = 5,
    reps: int = 30,
    device=None,
    flush: bool = True,
    max_time_s: Optional[float] = None,
    min_reps: int = 3,
    gate: bool = True,
) -> Timing:
    """Times fn() and returns its statistics in ms.

    CUDA: each rep is bracketed by torch.cuda.Events; when `flush`, a 256 MB
    buffer is written before each rep (outside the events), so every rep
    starts with a cold L2. With `gate`, a busy-wait kernel then holds the
    GPU while the host queues the start event and fn's kernels, so host
    launch overhead stays out: the numbers are GPU time (operator
    benchmarks). Without it, host time the flush does not cover counts
    (end-to-end steps, where it is part of the cost). Events are read after
    one final synchronize.
    CPU: time.perf_counter around each call (no cache flush).

    max_time_s caps the timed work: the first call is timed once, and warmup
    and reps shrink (to no fewer than min_reps) so that a very slow function
    does not stall the run.
    """
    dev = _device_of(device)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    # One probe call: catches errors early and estimates the cost.
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    probe_s = time.perf_counter() - t0
    if max_time_s is not None and probe_s * (warmup + reps) > max_time_s:
        budget_reps = int(max_time_s / max(probe_s, 1e-9))
        reps = max(min_reps, min(reps, budget_reps))
        warmup = min(warmup, 1) if budget_reps > reps else 0  # the probe warmed up already
    for _ in range(warmup):
        fn()
    sync()

    times: List[float] = []
    if cuda:
        buf = _flush_buffer(dev) if flush else None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if buf is not None:
                buf.zero_()
            # A stalled host (seen on the device machine: whole cells 5-30x
            # slow) must not leak into the GPU time.
            if gate:
                hold_gpu()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(dev)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), max(times), reps, times)


def time_cuda(
    fn: Callable[[], object],
    warmup: int = 5,
    reps: int = 30,
    device=None,
    flush: bool = True,
    max_time_s: Optional[float] = None,
) -> float:
    """Median ms of fn(): CUDA events with an L2 flush between reps on GPU,
    time.perf_counter on CPU. See time_stats."""
    return time_stats(fn, warmup=warmup, reps=reps, device=device, flush=flush, max_time_s=max_time_s).median_ms


def copy_bandwidth_gbs(device=None, nbytes: Optional[int] = None, reps: int = 20) -> float:
    """Measured device-to-device copy rate in GB/s (1e9 B/s), counting bytes
    read plus bytes written, of a large contiguous copy (1 GiB on GPU, 256 MiB
    on CPU: both far beyond the last-level cache)."""
    dev = _device_of(device)
    if nbytes is None:
        nbytes = (1 << 30) if dev.type == "cuda" else (256 << 20)
    n = nbytes // 4
    a = torch.ones(n, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    ms = time_cuda(lambda: b.copy_(a), warmup=3, reps=reps, device=dev, flush=False)
    del a, b
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of the finite positive values (NaN when none)."""
    vals = [float(v) for v in values if v is not None and np.isfinite(v) and v > 0]
    if not vals:
        return float("nan")
    return float(math.exp(sum(math.log(v) for v in vals) / len(vals)))


def device_name(device=None) -> str:
    dev = _device_of(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def device_slug(device=None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return slug or "device"


def gpu_tag(name: str) -> str:
    """Short GPU name for the file names of bench/results/: 'NVIDIA H100 80GB
    HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX
    4090' -> 'rtx4090', 'cpu' -> 'cpu'."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    if not words:
        return "device"
    if words[0] in ("rtx", "gtx", "quadro") and len(words) > 1:
        return words[0] + words[1]
    return words[0]


def out_dir() -> str:
    """bench/out/: where every run writes its CSVs and plots (scratch, not
    tracked). The current figures live in bench/results/ (bench/report.py)."""
    path = os.path.join(BENCH_DIR, "out")
    os.makedirs(path, exist_ok=True)
    return path




def write_csv(df, filename: str, also_out: bool = True) -> List[str]:
    """Writes df to bench/out/<filename> and, when $OUT is set, to
    $OUT/<filename>. Returns the paths written."""
    paths = [os.path.join(out_dir(), filename)]
    out = os.environ.get("OUT")
    if also_out and out:
        os.makedirs(out, exist_ok=True)
        paths.append(os.path.join(out, filename))
    for path in paths:
        df.to_csv(path, index=False)
    return paths


def print_table(df, title: Optional[str] = None, floatfmt: str = "{:.3f}") -> None:
    """Prints a pandas DataFrame without truncation."""
    import pandas as pd

    if title:
        print(f"\n{title}")
    with pd.option_context(
        "display.max_rows", None,
        "display.max_columns", None,
        "display.width", 250,
        "display.float_format", floatfmt.format,
    ):
        print(df.to_string(index=False))


def fmt_ms(ms: float) -> str:
    if ms is None or not np.isfinite(ms):
        return "nan"
    if ms >= 100:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.3f}"
    return f"{ms:.4f}"
