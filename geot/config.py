"""Kernel configurations: the tiling space the CUDA kernels accept."""
from itertools import product
from typing import List, NamedTuple, Optional

from . import _C

# The pruned space of GeoT (§III-B); the perf database sweeps it.
T_N_VALUES = (16, 32, 64)
T_M_VALUES = (1, 2, 4, 8)
M_T_VALUES = (8, 16, 32, 64)
N_T_VALUES = (1, 2, 4)
G_T_VALUES = (8, 16, 32)
# Narrow feature tilings beyond GeoT's space (small F wastes threads at T_N >=
# 16); swept with 256-thread blocks, SR and SP only.
NARROW_T_N_VALUES = (1, 2, 4, 8)


class Config(NamedTuple):
    """Tiling of one kernel launch.

    N_t: features per thread; T_N: threads along features per block (SR) or,
    with T_M, the block size (PR); M_t: rows per thread (SR) or row
    iterations per tile (PR) or rows per segment and lane (SP: the T_N
    threads that F / N_t features leave over split a segment's rows as
    lanes, a power of two up to 32); T_M: row groups (SR, PR) or segments
    (SP) per block; G_t: 1 selects the sequential-reduction schedule (SR),
    8/16/32 the parallel one (PR) with tiles of G_t lanes, 0 the
    segment-parallel one (SP).
    """

    N_t: int
    T_N: int
    M_t: int
    T_M: int
    G_t: int

    @property
    def schedule(self) -> str:
        return {0: "SP", 1: "SR"}.get(self.G_t, "PR")

    def validate(self) -> "Config":
        try:
            _C.check_config(*self)
        except ValueError as err:  # std::invalid_argument
            raise ValueError(str(err)) from None
        return self


def config_space(schedules=("SR", "PR", "SP"), narrow: bool = False) -> List[Config]:
    """Every config of the pruned space: SR (G_t=1), PR (G_t in 8/16/32) and
    SP (G_t=0, geot's no-atomic segment-parallel schedule); with `narrow`,
    also SR/SP tilings with fewer than 16 threads across the features."""
    tilings = list(product(N_T_VALUES, T_N_VALUES, M_T_VALUES, T_M_VALUES))
    space = []
    for schedule, group_sizes in (("SR", (1,)), ("SP", (0,)), ("PR", G_T_VALUES)):
        if schedule in schedules:
            space += [Config(n, tn, m, tm, g) for n, tn, m, tm in tilings for g in group_sizes]
    if narrow:
        space += [
            Config(n, tn, m, 256 // tn, g)
            for n, tn, m, g in product(N_T_VALUES, NARROW_T_N_VALUES, M_T_VALUES, (1, 0))
            if ("SR" if g else "SP") in schedules
        ]
    return space


# Thresholds of the long-segment level index validation measures
# (kLongSegmentRows in csrc/segment_reduce.h).
LONG_SEGMENT_ROWS = tuple(_C.long_segment_rows)


def long_segment_level(longest_segment: int) -> int:
    """The level index validation reports for an index whose longest segment
    has this many rows: how many of LONG_SEGMENT_ROWS it exceeds (0..3)."""
    return sum(longest_segment > rows for rows in LONG_SEGMENT_ROWS)


def _device_arch() -> int:
    """The current CUDA device's compute capability as major * 10 + minor; 0 without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _device_name() -> str:
    """The current CUDA device's name, "" without a GPU."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def _select(num_rows, num_segments, num_features, gathered, long_segments, arch, gpu, launch=None):
    """(config, source) from the rules; launch: (dtype, reduce, heads,
    deterministic) to apply the launch layer's hand rules after them."""
    hint = -1 if long_segments is None else int(long_segments)
    if not -1 <= hint <= 3 or (hint == -1 and long_segments is not None):
        raise ValueError(f"long_segments must be None, a bool or a level 0..3, got {long_segments!r}")
    if arch is None and gpu is None:
        arch, gpu = _device_arch(), _device_name()
    if not isinstance(arch, (int, type(None))) or (arch or 0) < 0:
        raise ValueError(f"arch must be None or major * 10 + minor (e.g. 90 for sm_90), got {arch!r}")
    if not isinstance(gpu, (str, type(None))):
        raise ValueError(f"gpu must be None or a GPU name or slug (e.g. 'NVIDIA H200'), got {gpu!r}")
    if launch is None:
        config, source = _C.select_config(num_rows, num_segments, num_features, gathered, hint, arch or 0, gpu or "")
    else:
        config, source = _C.launch_config(num_rows, num_segments, num_features, gathered, hint, arch or 0, gpu or "",
                                          *_launch_arguments(*launch))
    return Config(*config), source


def _launch_arguments(dtype, reduce, heads, deterministic):
    """explain's dtype, reduce, heads and deterministic as the launch rules take them."""
    import torch

    from .segment import REDUCTIONS

    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be None or a floating torch dtype (torch.float32, torch.bfloat16, ...), "
                         f"got {dtype!r}")
    if not isinstance(reduce, str) or reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return dtype in (torch.float16, torch.bfloat16), heads, reduce, bool(deterministic)


def explain(
    num_rows: int,
    num_segments: int,
    num_features: int,
    gathered: bool = False,
    long_segments: Optional[int] = None,
    arch: Optional[int] = None,
    verbose: bool = False,
    gpu: Optional[str] = None,
    *,
    dtype=None,
    reduce: str = "sum",
    heads: int = 1,
    deterministic: Optional[bool] = None,
) -> Config:
    """The config a CUDA call with these sizes would use.

    num_rows is E (edges); gathered=True for the fused ops that read rows
    through src_index (index_segment_reduce, index_weight_segment_reduce),
    which have their own rules; long_segments: how many of 64, 1024 and
    16384 rows the longest segment exceeds, 0..3 (True counts as 1; index
    validation measures it and caches it per index; None: unknown, as with
    validation off). The GPU picks the learned rules (csrc/generated/): those
    trained on its model, else its architecture's fallback, else the hand
    heuristic. gpu: a GPU name or rule-set slug ("NVIDIA H200",
    "nvidia-h200"); arch: compute capability as major * 10 + minor (90 for
    sm_90); both None: the current GPU's (none without one). verbose prints
    which rules chose and why (explain_source).

    With dtype None the config is the rules' alone, as the perf DB's sweep
    times it (fp32 rows). With dtype (torch.float32, torch.bfloat16, ...) it
    is the config a sorted call of that dtype launches: the hand rules the
    sweep does not cover yet apply after the rules (docs/tuning.md; the
    shared-ids schedule for wide gathered sums, deterministic mode's
    short-segment SP, ...), for that reduce ("sum", "mean", "max", "min"),
    that many weight heads, and deterministic mode (None: as torch has it
    now); explain_source then names the hand rule that applied."""
    launch = None if dtype is None else (dtype, reduce, heads, deterministic)
    config, source = _select(num_rows, num_segments, num_features, gathered, long_segments, arch, gpu, launch)
    if verbose:
        print(f"{config}: {source}")
    return config


def explain_source(
    num_rows: int,
    num_segments: int,
    num_features: int,
    gathered: bool = False,
    long_segments: Optional[int] = None,
    arch: Optional[int] = None,
    gpu: Optional[str] = None,
    *,
    dtype=None,
    reduce: str = "sum",
    heads: int = 1,
    deterministic: Optional[bool] = None,
) -> str:
    """Which selector explain() (and a CUDA call) uses for these arguments,
    and why: "learned rules <slug> from perfdb/<gpu> (trained on this GPU
    model, ...)", "(... sm_90 fallback: no rules for this GPU model)",
    "(forced by GEOT_RULES / geot.set_rules)" or "hand heuristic (why)";
    with dtype, followed by "; then <the hand rule>" where one applies."""
    launch = None if dtype is None else (dtype, reduce, heads, deterministic)
    return _select(num_rows, num_segments, num_features, gathered, long_segments, arch, gpu, launch)[1]


def set_rules(mode: str) -> None:
    """"learned" (default): each GPU's own rules (its model's, else its
    architecture's); "heuristic": always the hand heuristic; a rule set's
    slug (geot.rule_sets()): that rule set on every GPU. The environment
    variable GEOT_RULES sets the same at startup, e.g. to compare the H200's
    rules with the H100's and the heuristic in one build."""
    try:
        _C.set_rules(mode)
    except ValueError as err:
        raise ValueError(str(err)) from None


def rules_mode() -> str:
    """"learned", "heuristic" or the forced rule set's slug (see set_rules)."""
    return _C.rules_mode()


def rule_sets() -> List[dict]:
    """The learned rule sets compiled in (csrc/generated/rules_index.h): slug,
    device, arch, source (perf DB), plain / gathered (which families have
    rules), arch_fallback (used by GPUs of that architecture and no rules of
    their own model)."""
    keys = ("slug", "device", "arch", "source", "plain", "gathered", "arch_fallback")
    return [dict(zip(keys, row)) for row in _C.learned_rule_sets()]
