"""Trains the learned kernel-config rules from the perf databases.

For every perfdb/<gpu>/device.json (one GPU model each), fits a decision tree
per kernel family (segment_reduce.csv: plain rows;
index_weight_segment_reduce.csv: gathered rows) and writes
csrc/generated/rules_<gpu-slug>.h, then csrc/generated/rules_index.h listing
the GPU models and, per architecture, the rule set a GPU of no listed model
falls back to (the largest DB's). A GPU's cells are joined by the cells of
the graphs its DB lacks from the other DBs of its architecture
(with_donors), which are not scored. Rebuild the extension afterwards
(python -m geot.tune does all of it).

    python scripts/train_tree.py              # every perfdb/<gpu>/, with the held-out figures
    python scripts/train_tree.py --no-eval    # the same headers, without the held-out evaluation
    python scripts/train_tree.py --perfdb perfdb --out csrc/generated

The trees: each cell (graph, F) is a sample with the features of
rule_features (log2 E, log2 num_segments, avg = E / num_segments, F, the
long-segment level index validation measures, and the bounds it and E set on
log2(longest segment / avg)); its target is the vector
gain[c] = log2(oracle_time / time of config c) over the configs the sweep
timed for that F (0 for the best one), floored at GAIN_FLOOR for fitting
(scoring keeps the true gains). Per swept F, the candidates are cut to a
greedy cover of COVER_CONFIGS configs; one scikit-learn multi-output
ExtraTreesRegressor, over the cells of every F, fits the gains of the union
of the covers from the shape features (log2 S, avg, the long level and its
skew bounds; not log2 E: see SHAPE_FEATURES) and log2 F (forest_inputs). Per F, the forest's
pick (the candidate timed for that F of largest predicted gain, which
maximises the geomean of oracle/pick, the figure the rules are judged by) is
distilled into one DecisionTreeClassifier, small enough to be an if/else
(distill). The schedule (SR/PR/SP) is part of the pick, so the SR/PR switch
is learned with the rest rather than fixed (GeoT's F > 4 -> SR). An if/else
on F (geometric midpoints between swept widths) sits on top. The printed
held-out figures are cross-validation (GroupKFold) leaving out graphs, base
graphs (with their augmentations) and whole generator families (HOLDOUTS):
no hyperparameter is chosen on them (the forest grows full trees; the
distilled tree has a fixed leaf budget); beside the strict figures it prints
noise-aware ones, where a pick within the DB's repeat spread of the oracle on
a cell under NOISY_EDGES edges counts as the oracle. The headers hold no
held-out figure, so --no-eval writes them byte for byte the same.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import pandas as pd
import sklearn
from joblib import Parallel, delayed
from sklearn.model_selection import GroupKFold
from sklearn.ensemble import ExtraTreesRegressor
from sklearn.tree import DecisionTreeClassifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, CSV file, selector name in the generated header)
FAMILIES = (
    ("plain", "segment_reduce.csv", "plain_config"),
    ("gathered", "index_weight_segment_reduce.csv", "gathered_config"),
)
FEATURES = ("log2_E", "log2_S", "avg", "F", "long_level", "skew_lo", "skew_hi")  # the fields of RuleInputs (csrc/rules.h)
F_FEATURE = FEATURES.index("F")
# What the per-F trees split on (the forest also on log2 F: forest_inputs):
# not log2_E, which is log2_S + log2(avg) anyway.
# The launch follows the segment count (blocks) and the segment length (rows
# per block); a cut on their product groups unlike graphs (uniform degree 2
# with power-law ones of the same E) and held out worse on the H100 DBs:
# held-out graphs (base graphs) plain 0.888 (0.873) -> 0.918 (0.903), gathered
# 0.933 (0.903) -> 0.934 (0.907); dropping log2_S instead: 0.903 (0.897),
# 0.936 (0.921).
SHAPE_FEATURES = [i for i, name in enumerate(FEATURES) if name not in ("F", "log2_E")]
# skew_lo and skew_hi bound log2(longest segment / mean) from what the runtime
# knows (the long level, E and S; skew_bounds): the longest segment of level L
# exceeds LONG_SEGMENT_ROWS[L - 1] rows (1 at level 0) and is at most
# LONG_SEGMENT_ROWS[L] rows, and E. Cuts on the level alone treat a
# degree-128 graph of level 1 (every segment just over 64 rows) like a
# power-law one of the same level. On the committed DBs (forest picks, mean
# over 3 forest seeds and the 4 GPU/family pairs) held-out families 0.837 ->
# 0.861 (worst family graph 0.38-0.55 -> 0.55-0.59), held-out graphs 0.943 ->
# 0.942 (within the spread between seeds); either bound alone 0.858, 0.857,
# the lower one floored at 0 0.857.
# kLongSegmentRows (csrc/segment_reduce.h; geot.config.LONG_SEGMENT_ROWS): a copy, so the
# trainer runs without the extension built; a test checks they agree.
LONG_SEGMENT_ROWS = (64, 1024, 16384)
CONFIG_COLUMNS = ["N_t", "T_N", "M_t", "T_M", "G_t"]
REQUIRED_COLUMNS = ["graph", "base_graph", "E", "num_segments", "max_deg", "F", "schedule", "time_ms"]
MAX_FOLDS = 5
# Per F, a cover of this many configs: greedily, the configs that together
# come closest to the oracle on the training cells; the pick at F is among
# the union of the covers of every F (forest_inputs) that the sweep timed at F
# (50-63 configs on the H100 DBs). With all of them (~560) the fit is mostly
# noise; with a single tree per F a cover of 8 held out 2-3 points better
# than 4, 16 or all; with a forest per F, 8, 16 and 64 held out within 0.002
# of each other; in place of the union, one greedy cover over the cells of
# every F held out 0.9520, 0.9511 (64 configs), 0.9502, 0.9492 (32), against
# 0.9526, 0.9519.
COVER_CONFIGS = 8
# The trees fit gains floored here (log2: 2x slower than the oracle): a config
# that slow is a miss whatever its factor. Unfloored, the few 10-100x misses
# (an untimed config counts as the slowest) dominate the squared error and
# the cover, and the splits chase them instead of separating the near-best
# configs. With a forest of 100 trees on the committed H100 DBs, held-out
# graphs (plain, gathered): floor -0.5 0.953, 0.951; -1 0.952, 0.950; -2
# 0.950, 0.948; -10 0.948, 0.944.
GAIN_FLOOR = -1.0
# Extremely randomized trees (random cut points, grown until each leaf
# holds one cell, averaged over FOREST_TREES) fit the floored gains; the
# averaging does the smoothing a depth limit did for a single tree, without
# a depth to choose. On the committed H100 DBs, held-out graphs (base
# graphs): plain 0.924 (0.910) -> 0.953 (0.939), gathered 0.907 (0.903) ->
# 0.950 (0.933), against a single tree of depth and cells per leaf chosen by
# nested cross-validation; random forests (bootstrap, best cut) held out
# 0.94, 0.93. 64 trees held out as 100 did (within 0.001) in 0.6x the time.
# Cells weigh the same. With a forest per F, weighting each base graph the
# same per F (the augmented variants of cora, citeseer and pubmed are most
# of the graphs under 10^5 edges) held out plain 0.9475, gathered 0.9505
# (forest and cover weighted; the forest only: 0.9506, 0.9486), each log2 E
# octave pair the same 0.9469, 0.9464, against 0.9527, 0.9499; with the
# pooled forest (forest_inputs), base graphs weighted the same moved both
# by +0.0005 on average over 6 forest seeds, under the spread between seeds.
FOREST_TREES = 64
# The forest becomes one tree for the C++ if/else: a classifier of the
# forest's pick on the cells and DISTILL_POINTS sampled shapes, grown best
# cut first up to DISTILL_LEAVES leaves. On the H100 DBs, 64 or 128 leaves
# held out as well as the forest itself (within 0.001), 16 lost 0.004-0.012;
# picking the size by agreement with the forest lost 0.004. With the pooled
# forest, 128 leaves held out 0.9526, 0.9519 against the forest's (an
# unlimited tree) 0.9522, 0.9533; 64 leaves 0.9519, 0.9487. Regret-aware
# distillation did not help, the forest being the limit: a multi-output
# DecisionTreeRegressor of the predicted gains (a leaf picks the argmax of
# their mean) 0.9514, 0.9516 (per F: 0.9504, 0.9492); the same on regrets
# (gain - best predicted) 0.9508, 0.9492; the classifier with points weighted
# by best - mean predicted gain 0.9524, 0.9532 (mean over 4 seeds within
# 0.0003 of unweighted); relabelling the classifier's leaves with the argmax
# of the mean predicted gain 0.9523, 0.9518.
# 10000 points held out within 0.002 of 20000 (H100 DBs, by graph: plain
# 0.951 against 0.953, gathered 0.951 against 0.952) in about half the time
# (the forest's predictions on them are most of a fit).
DISTILL_POINTS = 10000
DISTILL_LEAVES = 128
# The oracle is a min over noisy timings: on cells under NOISY_EDGES edges
# (5-10 us a launch) one launch timed twice (the heuristic's row and the
# sweep's of the same launch) differs at the median by 4.0% (plain rows) and
# 2.6-2.7% (gathered) on the H100 and H200 DBs, under 0.2% on larger cells:
# there the strict oracle / pick is partly the luckiest rep.
# Beside the strict figures, the noise-aware ones count a pick within that
# median spread (repeat_spread) of the oracle on such cells as the oracle.
NOISY_EDGES = 10_000
# Tried on the committed DBs and not kept (mean over the 4 GPU/family pairs,
# held-out graphs / families; as committed 0.9395 / 0.8625, other forest
# seeds 0.9393-0.9419 / 0.8542-0.8634): fitting gains with configs within
# the repeat spread of the best tied at 0 (4% under NOISY_EDGES) 0.9393 /
# 0.8612, and 1% above 0.9406 / 0.8614; gain floors -0.5, -2, -3 0.9395 /
# 0.8007, 0.9369 / 0.8665, 0.9378 / 0.8636; cells weighted by log2 E
# 0.9403 / 0.8593, by the stakes (minus the median floored gain) 0.9404 /
# 0.8628, donated cells at half weight 0.9386 / 0.8591; 256 distilled leaves
# 0.9397 / 0.8618; the other GPU's gains averaged into the targets of the
# graphs both DBs have (half, 30%) 0.9362 / 0.8601, 0.9357 / 0.8605; a cost
# model (ridge regression of the gains on degree-2 products of the forest's
# inputs, avg logged) alone 0.885 / 0.827, 30% of it blended with the forest
# 0.936 / 0.857. The exact longest segment in place of the level's bounds
# (log2 max / avg: what a validation pass could measure), H100 DB, held-out
# graphs plain 0.948 -> 0.947 (worst 0.784 -> 0.745), gathered 0.950 ->
# 0.926: the worst graphs (uniform degree 64-128) lack neighbours in the
# corpus, not a feature.


def stable(values):
    """values rounded to 1e-9: numpy's log2 and power take CPU-specific SIMD
    kernels (AVX-512 or not) that differ in the last bit, and the trees'
    near-tie splits would follow that bit; rounded, the rules come out the
    same bytes on any machine."""
    return np.round(values, 9)


def long_level(max_deg: int) -> int:
    """What index validation reports (Features.long_segments): how many of
    LONG_SEGMENT_ROWS the longest segment exceeds."""
    return sum(max_deg > rows for rows in LONG_SEGMENT_ROWS)


# log2 of the long-segment level's bounds on the longest segment: above
# LEVEL_FLOOR_LOG2[L] rows (a segment of level 0 has at least one row) and
# at most LEVEL_CEIL_LOG2[L] (level 3: E bounds it).
LEVEL_FLOOR_LOG2 = (0.0,) + tuple(math.log2(rows) for rows in LONG_SEGMENT_ROWS)
LEVEL_CEIL_LOG2 = tuple(math.log2(rows) for rows in LONG_SEGMENT_ROWS) + (math.inf,)


def skew_bounds(log2_E, log2_S, level):
    """(skew_lo, skew_hi): log2 of the long level's lower and upper bounds on
    the longest segment (the upper one capped at E) over the mean segment
    (log2_E - log2_S). Scalars or numpy arrays (level an int array)."""
    log2_avg = log2_E - log2_S
    floor = np.asarray(LEVEL_FLOOR_LOG2)[level]
    ceil = np.minimum(np.asarray(LEVEL_CEIL_LOG2)[level], log2_E)
    return floor - log2_avg, ceil - log2_avg


def rule_features(E: int, num_segments: int, F: int, level: int) -> Tuple[float, ...]:
    """rule_inputs() of csrc/rules.h, formula for formula (float64, libm log2);
    level -1 (unknown: validation off) counts as the most skewed."""
    avg = E / num_segments if num_segments > 0 else float(E)
    level = 3 if level < 0 or level > 3 else level
    log2_E, log2_S = math.log2(max(E, 1)), math.log2(max(num_segments, 1))
    log2_avg = log2_E - log2_S
    skew_lo = LEVEL_FLOOR_LOG2[level] - log2_avg
    skew_hi = min(LEVEL_CEIL_LOG2[level], log2_E) - log2_avg
    return (log2_E, log2_S, avg, float(F), float(level), skew_lo, skew_hi)


def launch_keys(configs: np.ndarray, F: np.ndarray) -> np.ndarray:
    """What each config launches with F features (csrc/segment_reduce_launch.cuh):
    N_t halves until it divides F, and a PR block is T_N * T_M threads rounded
    up to whole warps, whatever T_N and T_M are. Equal keys, equal launches."""
    keys = configs.copy()
    n_t = keys[:, 0]
    while (odd := F % n_t != 0).any():
        n_t[odd] //= 2
    pr = keys[:, 4] > 1
    keys[pr, 1] = -(-(keys[pr, 1] * keys[pr, 3]) // 32) * 32
    keys[pr, 3] = 0
    return keys


@dataclass
class Family:
    """One family's perf DB as a cells x configs table."""

    cells: pd.DataFrame  # graph, F, base_graph, E, num_segments, max_deg, heuristic_ms; sorted
    configs: np.ndarray  # [C, 5] every config timed, sorted
    times: np.ndarray  # [cells, C] ms; NaN: no equivalent launch timed (the sweep pruned it for that F)
    X: np.ndarray  # [cells, len(FEATURES)]
    noise: float = 0.0  # repeat_spread of this GPU's DB (log2)
    donated: Optional[np.ndarray] = None  # [cells] bool: a cell of another GPU's DB (with_donors); None: none

    @property
    def own(self) -> np.ndarray:
        """The cells of this GPU's DB: the ones scored."""
        return np.ones(len(self.X), bool) if self.donated is None else ~self.donated

    @property
    def timed(self) -> np.ndarray:
        return ~np.isnan(self.times)

    @property
    def gain(self) -> np.ndarray:
        """log2(oracle / time) per cell and config; an untimed config counts as the cell's slowest."""
        times = np.where(self.timed, self.times, np.nanmax(self.times, axis=1, keepdims=True))
        return stable(np.log2(times.min(axis=1, keepdims=True) / times))

    @property
    def target(self) -> np.ndarray:
        """What the trees fit: gain floored at GAIN_FLOOR."""
        return np.maximum(self.gain, GAIN_FLOOR)

    @property
    def heuristic_gain(self) -> np.ndarray:
        return np.log2(np.nanmin(self.times, axis=1) / self.cells.heuristic_ms.to_numpy())

    def noise_aware(self, gains: np.ndarray) -> np.ndarray:
        """Gains of the own cells with a loss within the repeat spread, on
        cells under NOISY_EDGES edges, counted as none."""
        noisy = self.cells.E.to_numpy()[self.own] < NOISY_EDGES
        return np.where(noisy, np.minimum(gains + self.noise, 0.0), gains)


def finished_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """Cells with a heuristic row and at least half the configs of the most
    complete cell with the same F (the dedupe depends on F); a sweep cut off
    mid-cell leaves the rest out."""
    timed = rows[rows.schedule != "heuristic"]
    counts = timed.groupby(["graph", "F"]).size().rename("configs").reset_index()
    counts = counts[counts.configs * 2 >= counts.groupby("F").configs.transform("max")]
    heuristic = rows[rows.schedule == "heuristic"].groupby(["graph", "F"]).time_ms.min().rename("heuristic_ms")
    cells = counts.merge(heuristic.reset_index(), on=["graph", "F"])
    meta = timed.groupby(["graph", "F"])[["base_graph", "E", "num_segments", "max_deg"]].first().reset_index()
    return cells.merge(meta, on=["graph", "F"]).drop(columns="configs").sort_values(["graph", "F"], ignore_index=True)


def time_table(timed: pd.DataFrame, cells: pd.DataFrame, configs: np.ndarray) -> np.ndarray:
    """[cells, configs] time of each config, read off the row that launched the same."""
    key_columns = [f"key_{c}" for c in CONFIG_COLUMNS]
    timed = timed.assign(**dict(zip(key_columns, launch_keys(timed[CONFIG_COLUMNS].to_numpy(), timed.F.to_numpy()).T)))
    measured = timed.groupby(["graph", "F", *key_columns]).time_ms.min().reset_index()
    wanted = []
    for F, cells_of_F in cells.groupby("F"):
        keys = pd.DataFrame(launch_keys(configs, np.full(len(configs), F)), columns=key_columns)
        keys["config"] = np.arange(len(configs))
        wanted.append(cells_of_F[["graph", "F"]].assign(cell=cells_of_F.index).merge(keys, how="cross"))
    found = pd.concat(wanted).merge(measured, on=["graph", "F", *key_columns], how="left")
    times = np.full((len(cells), len(configs)), np.nan)
    times[found.cell.to_numpy(), found.config.to_numpy()] = found.time_ms.to_numpy()
    return times


def repeat_spread(rows: pd.DataFrame) -> float:
    """Median |log2| of the heuristic's time over the sweep's for the same
    launch, on cells under NOISY_EDGES edges; 0 if there is none."""
    key_columns = [f"key_{c}" for c in CONFIG_COLUMNS]
    small = rows[rows.E < NOISY_EDGES]
    small = small.assign(**dict(zip(key_columns, launch_keys(small[CONFIG_COLUMNS].to_numpy(), small.F.to_numpy()).T)))
    is_heuristic = small.schedule == "heuristic"
    swept = small[~is_heuristic].groupby(["graph", "F", *key_columns]).time_ms.min().rename("swept_ms")
    pairs = small[is_heuristic].merge(swept.reset_index(), on=["graph", "F", *key_columns])
    return float(np.median(np.abs(np.log2(pairs.time_ms / pairs.swept_ms)))) if len(pairs) else 0.0


def load_family(path: str) -> Family:
    rows = pd.read_csv(path)
    absent = [c for c in REQUIRED_COLUMNS + CONFIG_COLUMNS if c not in rows.columns]
    if absent:
        raise ValueError(f"{path}: missing columns {absent}")
    if (rows.time_ms <= 0).any() or rows.time_ms.isna().any():
        raise ValueError(f"{path}: time_ms must be positive")
    cells = finished_cells(rows)
    if cells.empty:
        raise ValueError(f"{path}: no finished cell (a heuristic row and at least half the configs)")
    timed = rows[(rows.schedule != "heuristic") & rows.set_index(["graph", "F"]).index.isin(
        cells.set_index(["graph", "F"]).index)]
    configs = np.unique(timed[CONFIG_COLUMNS].to_numpy(dtype=np.int64), axis=0)
    X = np.array([rule_features(int(c.E), int(c.num_segments), int(c.F), long_level(int(c.max_deg)))
                  for c in cells.itertuples()])
    return Family(cells, configs, time_table(timed, cells, configs), X, repeat_spread(rows))


def with_donors(own: Family, donors: List[Family]) -> Family:
    """own's cells, then the cells of the graphs own lacks from donors (the
    DBs of other GPUs of its architecture, in order), marked donated, at the
    widths own's sweep timed (a width only another GPU swept would get rules
    of that GPU's cells alone). Within an architecture the ranking of
    configs carries over far better than nothing: a DB cut short by its
    sweep budget (the H200's, 26 of the H100's 46 graphs) held out, by
    graph, plain 0.907 -> 0.934, gathered 0.913 -> 0.931; by base graph
    0.865 -> 0.921, 0.880 -> 0.914."""
    parts, seen = [own], set(own.cells.graph)
    widths = set(own.cells.F)
    for donor in donors:
        lacking = (~donor.cells.graph.isin(seen) & donor.cells.F.isin(widths)).to_numpy()
        if not lacking.any():
            continue
        seen |= set(donor.cells.graph[lacking])
        column = {tuple(c): i for i, c in enumerate(donor.configs.tolist())}
        times = np.full((int(lacking.sum()), len(own.configs)), np.nan)
        for j, config in enumerate(own.configs.tolist()):
            if tuple(config) in column:
                times[:, j] = donor.times[lacking, column[tuple(config)]]
        parts.append(Family(donor.cells[lacking], own.configs, times, donor.X[lacking], donor.noise))
    donated = np.concatenate([np.full(len(part.X), part is not own) for part in parts])
    return Family(pd.concat([part.cells for part in parts], ignore_index=True), own.configs,
                  np.concatenate([part.times for part in parts]), np.concatenate([part.X for part in parts]),
                  own.noise, donated if donated.any() else None)


@dataclass
class Node:
    pick: int  # leaf: the config picked (index into Family.configs)
    feature: int = -1  # a split sends x[feature] <= threshold left; -1: a leaf
    threshold: float = 0.0
    left: Optional["Node"] = None
    right: Optional["Node"] = None


def from_sklearn(model: DecisionTreeClassifier, candidates: np.ndarray, node: int = 0) -> Node:
    """The fitted tree as Nodes; a leaf picks the forest's most frequent choice
    among its points. Splits whose two leaves pick the same config are merged."""
    tree = model.tree_
    if tree.children_left[node] < 0:
        return Node(int(candidates[model.classes_[int(np.argmax(tree.value[node][0]))]]))
    left = from_sklearn(model, candidates, tree.children_left[node])
    right = from_sklearn(model, candidates, tree.children_right[node])
    if left.feature < 0 and right.feature < 0 and left.pick == right.pick:
        return left
    return Node(-1, SHAPE_FEATURES[tree.feature[node]], float(tree.threshold[node]), left, right)


def greedy_cover(gain: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """k of the candidate configs, added one at a time, each the one that most
    raises the mean over cells of the best gain among those chosen."""
    chosen: List[int] = []
    best = np.full(len(gain), -np.inf)
    for _ in range(min(k, len(candidates))):
        scores = np.maximum(best[:, None], gain[:, candidates]).mean(axis=0)
        scores[np.isin(candidates, chosen)] = -np.inf
        pick = int(candidates[int(np.argmax(scores))])
        chosen.append(pick)
        best = np.maximum(best, gain[:, pick])
    return np.array(sorted(chosen), dtype=np.int64)


def sample_shapes(X: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random feature rows spread over (a little beyond) the shapes of the
    cells X, keeping only shapes an index can have: a long level L needs the
    longest segment, so E and avg, between its thresholds."""
    log2_S = rng.uniform(X[:, 1].min() - 1, X[:, 1].max() + 1, n)
    log2_avg = rng.uniform(0, stable(np.log2(X[:, 2].max())) + 1, n)
    level = rng.integers(0, len(LONG_SEGMENT_ROWS) + 1, n)
    thresholds = stable(np.log2((1,) + LONG_SEGMENT_ROWS + (np.inf,)))
    possible = (log2_avg <= thresholds[level + 1]) & (log2_S + log2_avg >= thresholds[level])
    log2_E = log2_S + log2_avg
    rows = np.stack([log2_E, log2_S, stable(2 ** log2_avg), np.zeros(n), level.astype(float),
                     *skew_bounds(log2_E, log2_S, level)], axis=1)
    return rows[possible]


# The forest is one over the cells of every swept F, log2 F a feature beside
# the shape ones, rather than one per F (46 cells each): neighbouring widths
# pick alike, and the forest splits on F only where the gains differ. On the
# committed H100 DBs, held-out graphs (base graphs), per F -> pooled: plain
# 0.9527 (0.9389) -> 0.9526 (0.9420), gathered 0.9499 (0.9329) -> 0.9519
# (0.9381); mean over 6 forest seeds: plain 0.9513 -> 0.9521, gathered 0.9502
# -> 0.9514 (pooled gathered 0.9498-0.9531 over the seeds). The gain is on
# graphs of 10^4 edges or more; those under (17% of the cells) hold out
# 0.89, 0.88, near the floor their measurements set: one launch timed twice
# (the heuristic row and the sweep's) differs by 3-4% median, 10-18% at the
# 90th percentile. Tried and not kept: picking among the F's own cover only
# 0.9516, 0.9504; F unlogged 0.9523, 0.9503; log2 avg for the forest 0.9504,
# 0.9524; one forest over both families 0.9532, 0.9515.
def forest_inputs(X: np.ndarray) -> np.ndarray:
    """What the forest splits on: the shape features and log2 F (its random
    cut points are uniform over a node's range, and the swept widths are
    powers of two but for 7)."""
    return np.column_stack([X[:, SHAPE_FEATURES], stable(np.log2(X[:, F_FEATURE]))])


def distill(forest: ExtraTreesRegressor, X: np.ndarray, F: float, outputs: np.ndarray, configs: np.ndarray) -> Node:
    """One tree of at most DISTILL_LEAVES leaves that picks what the forest
    picks at width F among its outputs `outputs` (configs[outputs]), on the
    cells X and on shapes sampled around them."""
    points = np.concatenate([X, sample_shapes(X, DISTILL_POINTS, np.random.default_rng(0))])
    points[:, F_FEATURE] = F
    choice = np.argmax(forest.predict(forest_inputs(points))[:, outputs], axis=1)
    tree = DecisionTreeClassifier(max_leaf_nodes=DISTILL_LEAVES, random_state=0)
    tree.fit(points[:, SHAPE_FEATURES], choice)
    return from_sklearn(tree, configs[outputs])


def fit_tree(X: np.ndarray, gain: np.ndarray, timed: np.ndarray) -> Node:
    """Per swept F, a cover (greedy_cover) of the configs the sweep timed in
    all of its cells; one forest of extremely randomized trees regresses the
    gains of the union of the covers from the shape features and log2 F over
    the cells of every F; per F, distill() turns the forest, restricted to
    the configs timed in all cells of that F (so a pick is never a config
    pruned for it), into one if/else tree, under an if/else on F (the
    configs worth timing differ with F: N_t must divide it, the feature span
    must fit it)."""
    values = np.unique(X[:, F_FEATURE])
    of_F = [X[:, F_FEATURE] == F for F in values]
    timed_in_all = [timed[rows].all(axis=0) for rows in of_F]
    covers = [greedy_cover(gain[rows], np.flatnonzero(ok), COVER_CONFIGS) for rows, ok in zip(of_F, timed_in_all)]
    candidates = np.unique(np.concatenate(covers))
    forest = ExtraTreesRegressor(n_estimators=FOREST_TREES, max_features=None, random_state=0)
    forest.fit(forest_inputs(X), gain[:, candidates])
    subtrees = [distill(forest, X[rows], F, np.flatnonzero(ok[candidates]), candidates)
                for F, rows, ok in zip(values, of_F, timed_in_all)]
    return split_on_F(values, subtrees)


def split_on_F(values: np.ndarray, subtrees: List[Node]) -> Node:
    """A balanced if/else over the swept F values, cut at geometric midpoints
    (a width between two swept ones takes the rules of the nearer in ratio)."""
    if len(values) == 1:
        return subtrees[0]
    mid = len(values) // 2
    threshold = float(math.sqrt(values[mid - 1] * values[mid]))
    return Node(-1, F_FEATURE, threshold, split_on_F(values[:mid], subtrees[:mid]),
                split_on_F(values[mid:], subtrees[mid:]))


def predict(tree: Node, X: np.ndarray) -> np.ndarray:
    """Config index each row of X gets."""
    picks = []
    for x in X:
        node = tree
        while node.feature >= 0:
            node = node.left if x[node.feature] <= node.threshold else node.right
        picks.append(node.pick)
    return np.array(picks, dtype=np.int64)


def leaves(tree: Node) -> int:
    return 1 if tree.feature < 0 else leaves(tree.left) + leaves(tree.right)


def depth(tree: Node) -> int:
    return 0 if tree.feature < 0 else 1 + max(depth(tree.left), depth(tree.right))


def group_folds(groups: np.ndarray):
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise ValueError(f"cross-validation needs cells of at least 2 groups, got {n_groups}")
    return GroupKFold(n_splits=min(MAX_FOLDS, n_groups)).split(np.zeros(len(groups)), groups=groups)


def graph_family(base_graph: str) -> str:
    """The generator of a corpus graph (perfdb/corpus.py): 'powerlaw',
    'uniform', 'hubs' for generated ones ('uniform(num_nodes=...)'), 'real'
    for the shared graphs and their augmentations."""
    return base_graph.split("(", 1)[0] if "(" in base_graph else "real"


# What the held-out figures leave out together: a graph (each augmented
# variant a graph of its own, as in GeoT), a base graph with all its
# augmentations, a whole generator family.
HOLDOUTS = (("graph", "graph"), ("base", "base_graph"), ("family", "family"))


def holdout_groups(cells: pd.DataFrame, holdout: str) -> np.ndarray:
    column = dict(HOLDOUTS)[holdout]
    if column == "family":
        return cells.base_graph.map(graph_family).to_numpy()
    return cells[column].to_numpy()


def held_out_folds(family: Family, groups: np.ndarray) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(train, test) cell indices of the folds that leave out groups (of
    cells from any GPU's DB) and test some own cell."""
    return [(train, test) for train, test in group_folds(groups) if family.own[test].any()]


def held_out_gain(family: Family, folds, trees: List[Node]) -> np.ndarray:
    """Gain of each own cell's pick by the tree of the fold that left it out
    (the trainer has no hyperparameter chosen on held-out cells to nest)."""
    out = np.full(len(family.X), np.nan)
    for (_, test), tree in zip(folds, trees):
        out[test] = family.gain[test, predict(tree, family.X[test])]
    return out[family.own]


@dataclass
class Trained:
    tree: Node
    configs: np.ndarray
    summary: dict


def ratios(gains: np.ndarray, graphs: np.ndarray) -> Tuple[float, float, float]:
    """(geomean, worst cell, worst graph) of oracle / pick; a graph's figure
    is the geomean over its cells (one per swept F)."""
    per_graph = pd.Series(gains).groupby(graphs).mean()
    return float(2 ** gains.mean()), float(2 ** gains.min()), float(2 ** per_graph.min())


def train_family(family: Family, evaluate: bool = True) -> Trained:
    """The tree on every cell; with `evaluate`, also scored on held-out cells
    (HOLDOUTS), against the hand heuristic's picks and on the training set.
    The fits run in parallel processes (each tree is the same either way)."""
    own = family.own
    graphs = family.cells.graph.to_numpy()[own]
    folds = {}
    for holdout, _ in HOLDOUTS if evaluate else ():
        groups = holdout_groups(family.cells, holdout)
        if len(np.unique(groups[own])) > 1:  # a DB of one generator family has no family-out figure
            folds[holdout] = held_out_folds(family, groups)
    fits = [np.arange(len(family.X))] + [train for holdout in folds for train, _ in folds[holdout]]
    fit = delayed(fit_tree)
    trees = Parallel(n_jobs=min(len(fits), os.cpu_count() or 1))(
        fit(family.X[train], family.target[train], family.timed[train]) for train in fits)
    tree = trees.pop(0)
    summary = dict(cells=int(own.sum()), graphs=len(np.unique(graphs)), donated=int((~own).sum()),
                   configs=len(family.configs), depth=depth(tree), leaves=leaves(tree))
    scored = [("train", family.gain[own][np.arange(own.sum()), predict(tree, family.X[own])])]
    for holdout, holdout_folds in folds.items():
        scored.append((holdout, held_out_gain(family, holdout_folds, trees[:len(holdout_folds)])))
        del trees[:len(holdout_folds)]
    if evaluate:
        scored.append(("heuristic", family.heuristic_gain[own]))
    for name, gains in scored:
        summary[f"{name}_geomean"], summary[f"{name}_worst"], summary[f"{name}_worst_graph"] = ratios(gains, graphs)
        if name in dict(HOLDOUTS):
            aware = ratios(family.noise_aware(gains), graphs)
            summary[f"{name}_noise_aware_geomean"], summary[f"{name}_noise_aware_worst_graph"] = aware[0], aware[2]
    summary["repeat_spread"] = float(2 ** family.noise - 1)
    return Trained(tree, family.configs, summary)


def describe(summary: dict) -> List[str]:
    """The summary's lines: the tree, then the held-out figures if evaluated."""
    s = summary
    donated = f" (and {s['donated']} of graphs it lacks from DBs of its architecture)" if s["donated"] else ""
    lines = [f"{s['cells']} cells of {s['graphs']} graphs{donated}, {s['configs']} configs; distilled tree of depth "
             f"{s['depth']}, {s['leaves']} leaves; training set: oracle/pick geomean {s['train_geomean']:.3f}, "
             f"worst cell {s['train_worst']:.3f}"]
    if "heuristic_geomean" in s:
        figures = [f"{name} {s[name + '_geomean']:.3f} (worst cell {s[name + '_worst']:.3f}, "
                   f"graph {s[name + '_worst_graph']:.3f})" for name, _ in HOLDOUTS if name + "_geomean" in s]
        lines.append("oracle/pick held out by " + ", ".join(figures) + "; hand heuristic "
                     f"{s['heuristic_geomean']:.3f} (worst cell {s['heuristic_worst']:.3f}, "
                     f"graph {s['heuristic_worst_graph']:.3f})")
        aware = [f"{name} {s[name + '_noise_aware_geomean']:.3f} (worst graph "
                 f"{s[name + '_noise_aware_worst_graph']:.3f})" for name, _ in HOLDOUTS if name + "_geomean" in s]
        lines.append(f"noise-aware (a pick within the repeat spread, {100 * s['repeat_spread']:.1f}%, of the oracle "
                     f"on cells under {NOISY_EDGES} edges counts as the oracle): " + ", ".join(aware))
    return lines


# ---- code generation ----

def config_literal(config: np.ndarray) -> str:
    n_t, t_n, m_t, t_m, g_t = (int(v) for v in config)
    schedule = {0: "SP", 1: "SR"}.get(g_t, "PR")
    return f"return {{{n_t}, {t_n}, {m_t}, {t_m}, {g_t}}};  // {schedule}"


def emit_node(node: Node, configs: np.ndarray, indent: str) -> List[str]:
    if node.feature < 0:
        return [indent + config_literal(configs[node.pick])]
    return ([f"{indent}if (x.{FEATURES[node.feature]} <= {float(node.threshold)!r}) {{"]
            + emit_node(node.left, configs, indent + "  ")
            + [f"{indent}}} else {{"]
            + emit_node(node.right, configs, indent + "  ")
            + [f"{indent}}}"])


def emit_selector(name: str, family: str, trained: Trained) -> List[str]:
    comment = [f"// {family} rows: {describe(trained.summary)[0]}"]
    if trained.tree.feature < 0:
        return comment + [f"inline Config {name}(const Features&) {{",
                          "  " + config_literal(trained.configs[trained.tree.pick]), "}"]
    return (comment + [f"inline Config {name}(const Features& f) {{", "  const RuleInputs x = rule_inputs(f);"]
            + emit_node(trained.tree, trained.configs, "  ") + ["}"])


@dataclass
class RuleSetEntry:
    """One GPU's rules, as rules_index.h lists them."""

    slug: str  # device_slug(device): the runtime matches a GPU's name to it
    device: str
    arch: int
    source: str  # "perfdb/<dir>"
    families: List[str]
    cells: int  # finished cells over its families: the arch fallback is the largest DB

    @property
    def namespace(self) -> str:
        return "gpu_" + self.slug.replace("-", "_")

    @property
    def header(self) -> str:
        return f"rules_{self.slug}.h"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3', as bench/common.py
    and device_slug in csrc/rules.cpp make it."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# The libraries whose versions the headers' bytes depend on (other versions
# may move a few splits); tests/test_train_tree.py reads this line back.
TRAINED_WITH = f"Trained with numpy {np.__version__} and scikit-learn {sklearn.__version__}."


def emit_header(entry: RuleSetEntry, trained: dict) -> str:
    csvs = ", ".join(csv for family, csv, _ in FAMILIES if family in trained)
    lines = [
        f"// Generated by scripts/train_tree.py from {entry.source}/ ({csvs}):",
        f"// {entry.device}, sm_{entry.arch}. Do not edit; rerun python scripts/train_tree.py.",
        f"// {TRAINED_WITH}",
        "#pragma once",
        "",
        '#include "../rules.h"',
        "",
        f"namespace geot {{\nnamespace generated {{\nnamespace {entry.namespace} {{",
    ]
    for family, _, name in FAMILIES:
        if family in trained:
            lines += [""] + emit_selector(name, family, trained[family])
    lines += ["", f"}}  // namespace {entry.namespace}", "}  // namespace generated", "}  // namespace geot"]
    return "\n".join(lines) + "\n"


def arch_fallbacks(entries: List[RuleSetEntry]) -> List[Tuple[int, int]]:
    """(arch, index into entries) per architecture: the rule set of the
    largest perf DB of that architecture (the first slug on a tie)."""
    best = {}
    for i, entry in enumerate(entries):
        if entry.arch not in best or entry.cells > entries[best[entry.arch]].cells:
            best[entry.arch] = i
    return sorted(best.items())


def emit_index(entries: List[RuleSetEntry]) -> str:
    """entries: sorted by slug."""
    lines = ["// Generated by scripts/train_tree.py: the GPU models with learned rules, and the rule set",
             "// each architecture falls back to. Do not edit; rerun python scripts/train_tree.py.", "#pragma once",
             "", "#include <array>", "", '#include "../rules.h"']
    lines += [f'#include "{entry.header}"' for entry in entries]
    lines += ["", "namespace geot {\nnamespace generated {", ""]
    if not entries:
        lines.append("inline constexpr std::array<RuleSet, 0> kRuleSets = {};")
    else:
        lines.append(f"inline constexpr std::array<RuleSet, {len(entries)}> kRuleSets = {{{{")
        for entry in entries:
            selectors = [f"&{entry.namespace}::{name}" if family in entry.families else "nullptr"
                         for family, _, name in FAMILIES]
            fields = [json.dumps(entry.slug), json.dumps(entry.device), str(entry.arch), json.dumps(entry.source)]
            lines.append(f"    {{{', '.join(fields + selectors)}}},")
        lines.append("}};")
    fallbacks = arch_fallbacks(entries)
    lines += ["", "// Per architecture, the largest perf DB's rules: for GPUs of no listed model."]
    if not fallbacks:
        lines.append("inline constexpr std::array<ArchFallback, 0> kArchFallbacks = {};")
    else:
        lines.append(f"inline constexpr std::array<ArchFallback, {len(fallbacks)}> kArchFallbacks = {{{{")
        lines += [f"    {{{arch}, {i}}},  // {entries[i].slug}" for arch, i in fallbacks]
        lines.append("}};")
    lines += ["", "}  // namespace generated", "}  // namespace geot"]
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> None:
    with open(path, "w", newline="\n") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}")


def read_device(path: str) -> Tuple[str, int]:
    with open(path) as f:
        device = json.load(f)
    try:
        major, minor = device["capability"]
        name = str(device["name"])
        if not device_slug(name):
            raise ValueError
        return name, int(major) * 10 + int(minor)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f'{path}: want {{"name": ..., "capability": [major, minor]}}, got {device}') from None


@dataclass
class PerfDB:
    """One perfdb/<gpu>/: its device and its families' tables."""

    source: str  # "perfdb/<dir>"
    device: str
    arch: int
    families: dict  # family -> Family

    @property
    def slug(self) -> str:
        return device_slug(self.device)


def load_perfdb(device_json: str, root: str) -> PerfDB:
    db_dir = os.path.dirname(device_json)
    source = f"{os.path.basename(os.path.normpath(root))}/{os.path.basename(db_dir)}"
    device, arch = read_device(device_json)
    families = {}
    for family, csv, _ in FAMILIES:
        paths = [p for p in (os.path.join(db_dir, csv), os.path.join(db_dir, csv + ".gz")) if os.path.exists(p)]
        if paths:  # the committed DBs are gzipped; a sweep in progress writes plain CSV
            families[family] = load_family(paths[0])
    return PerfDB(source, device, arch, families)


def train_device(db: PerfDB, donors: List[PerfDB], evaluate: bool) -> dict:
    """Each family's rules for db's GPU, from its cells and the donors' of
    graphs it lacks (with_donors)."""
    trained = {}
    for family, csv, _ in FAMILIES:
        if family in db.families:
            gave = [donor for donor in donors if family in donor.families]
            print(f"{db.source}/{csv} ({family} rows"
                  + (f"; graphs it lacks from {', '.join(d.source for d in gave)}" if gave else "") + "):", flush=True)
            pooled = with_donors(db.families[family], [donor.families[family] for donor in gave])
            trained[family] = train_family(pooled, evaluate)
            print("\n".join("  " + line for line in describe(trained[family].summary)), flush=True)
    return trained


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perfdb", default=os.path.join(ROOT, "perfdb"), help="perf DB root (default perfdb/)")
    parser.add_argument("--out", default=os.path.join(ROOT, "csrc", "generated"), help="header directory")
    parser.add_argument("--no-eval", dest="evaluate", action="store_false",
                        help="skip the held-out evaluation (the headers come out the same)")
    args = parser.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    dbs = {}
    for device_json in sorted(glob.glob(os.path.join(args.perfdb, "*", "device.json"))):
        db = load_perfdb(device_json, args.perfdb)
        if db.slug in dbs:
            raise ValueError(f"{dbs[db.slug].source} and {db.source} are both {db.device}: keep one perf DB per GPU")
        if not db.families:
            print(f"{db.source}: no family CSV, skipped")
            continue
        dbs[db.slug] = db
    entries, table = [], []
    for slug in sorted(dbs):
        db = dbs[slug]
        donors = [dbs[other] for other in sorted(dbs) if other != slug and dbs[other].arch == db.arch]
        trained = train_device(db, donors, args.evaluate)
        entry = RuleSetEntry(slug, db.device, db.arch, db.source, sorted(trained),
                             sum(t.summary["cells"] for t in trained.values()))
        entries.append(entry)
        write(os.path.join(args.out, entry.header), emit_header(entry, trained))
        table += [dict(gpu=slug, arch=f"sm_{db.arch}", family=family, **t.summary) for family, t in trained.items()]

    kept = {entry.header for entry in entries} | {"rules_index.h"}
    for stale in sorted(glob.glob(os.path.join(args.out, "rules_*.h"))):
        if os.path.basename(stale) not in kept:
            os.remove(stale)
            print(f"removed {stale}")
    write(os.path.join(args.out, "rules_index.h"), emit_index(entries))
    summary = pd.DataFrame(table)
    print_summary(summary)
    return summary


def print_summary(summary: pd.DataFrame) -> None:
    if summary.empty:
        print("no perf DB found (perfdb/<gpu>/device.json): the rules index lists no GPU")
        return
    columns = ["gpu", "family", "cells", "graphs", "leaves", "train_geomean"]
    names = [name for name, _ in HOLDOUTS] + ["heuristic"]
    held_out = [f"{name}_{figure}" for name in names for figure in ("geomean", "worst", "worst_graph")]
    aware = [f"{name}_noise_aware_{figure}" for name, _ in HOLDOUTS for figure in ("geomean", "worst_graph")]
    columns += [c for c in held_out + aware if c in summary.columns]
    print("\noracle/pick: geomean, worst cell, worst graph; held out by graph, base graph (with its "
          "augmentations), generator family (GroupKFold); the hand heuristic's; noise-aware (a pick within "
          f"the DB's repeat spread of the oracle on cells under {NOISY_EDGES} edges counts as the oracle)")
    print(summary[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        sys.exit(f"train_tree.py: {err}")
