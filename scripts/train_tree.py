"""Trains the learned kernel-config rules from the perf databases.

For every perfdb/<gpu>/device.json, fits a decision tree per kernel family
(segment_reduce.csv: plain rows; index_weight_segment_reduce.csv: gathered
rows) and writes csrc/generated/rules_sm<major><minor>.h, then
csrc/generated/rules_index.h listing the architectures. Rebuild the extension
afterwards (python -m geot.tune does all of it).

    python scripts/train_tree.py
    python scripts/train_tree.py --perfdb perfdb --out csrc/generated

The tree: each cell (graph, F) is a sample with the features of rule_features;
its target is the vector gain[c] = log2(oracle_time / time of config c) over
every config of the swept space (0 for the best one). A node picks the config
with the largest summed gain over its cells, and each split is the one that
most increases the summed gain of the two children's picks: the tree
maximises the geomean of oracle/pick, the figure it is judged by, directly,
with the schedule (SR/PR/SP) part of the pick. Depth and minimum cells per
leaf are chosen by cross-validation over held-out graphs (GroupKFold by
base_graph); the figures printed for held-out graphs come from nested
cross-validation, so that choice is not evaluated on its own folds.
"""
import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import pandas as pd
from sklearn.model_selection import GroupKFold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (family, CSV file, selector name in the generated header)
FAMILIES = (
    ("plain", "segment_reduce.csv", "plain_config"),
    ("gathered", "index_weight_segment_reduce.csv", "gathered_config"),
)
FEATURES = ("log2_E", "log2_S", "avg", "F", "long_segments")  # the fields of RuleInputs (csrc/rules.h)
CONFIG_COLUMNS = ["N_t", "T_N", "M_t", "T_M", "G_t"]
REQUIRED_COLUMNS = ["graph", "base_graph", "E", "num_segments", "long_segments", "F", "schedule", "time_ms"]
DEPTHS = tuple(range(1, 9))
MIN_CELLS_PER_LEAF = (16, 8, 4, 2, 1)  # simplest first: ties go to the first
MAX_FOLDS = 5


def rule_features(E: int, num_segments: int, F: int, long_segments: int) -> Tuple[float, ...]:
    """rule_inputs() of csrc/rules.h, formula for formula (float64, libm log2)."""
    avg = E / num_segments if num_segments > 0 else float(E)
    return (math.log2(max(E, 1)), math.log2(max(num_segments, 1)), avg, float(F), 0.0 if long_segments == 0 else 1.0)


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

    cells: pd.DataFrame  # graph, F, base_graph, E, num_segments, long_segments, heuristic_ms; sorted
    configs: np.ndarray  # [C, 5] every config timed, sorted
    times: np.ndarray  # [cells, C] ms; a config timed under no equivalent launch counts as the cell's slowest
    X: np.ndarray  # [cells, len(FEATURES)]

    @property
    def gain(self) -> np.ndarray:
        return np.log2(self.times.min(axis=1, keepdims=True) / self.times)

    @property
    def heuristic_gain(self) -> np.ndarray:
        return np.log2(self.times.min(axis=1) / self.cells.heuristic_ms.to_numpy())


def finished_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """Cells with a heuristic row and at least half the configs of the most
    complete cell with the same F (the dedupe depends on F); a sweep cut off
    mid-cell leaves the rest out."""
    timed = rows[rows.schedule != "heuristic"]
    counts = timed.groupby(["graph", "F"]).size().rename("configs").reset_index()
    counts = counts[counts.configs * 2 >= counts.groupby("F").configs.transform("max")]
    heuristic = rows[rows.schedule == "heuristic"].groupby(["graph", "F"]).time_ms.min().rename("heuristic_ms")
    cells = counts.merge(heuristic.reset_index(), on=["graph", "F"])
    meta = timed.groupby(["graph", "F"])[["base_graph", "E", "num_segments", "long_segments"]].first().reset_index()
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
    missing = np.isnan(times)
    if missing.any():
        print(f"  warning: {missing.sum()} of {missing.size} (cell, config) pairs have no timing under an "
              "equivalent launch; counted as the cell's slowest")
        times = np.where(missing, np.nanmax(times, axis=1, keepdims=True), times)
    return times


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
    X = np.array([rule_features(int(c.E), int(c.num_segments), int(c.F), int(c.long_segments))
                  for c in cells.itertuples()])
    return Family(cells, configs, time_table(timed, cells, configs), X)


@dataclass
class Node:
    pick: int  # the config with the largest summed gain over the node's cells
    feature: int = -1  # a split sends x[feature] <= threshold left; -1: a leaf
    threshold: float = 0.0
    left: Optional["Node"] = None
    right: Optional["Node"] = None


def best_split(X: np.ndarray, gain: np.ndarray, min_leaf: int, parent_value: float):
    """(feature, threshold) whose two picks have the largest summed gain, if it
    beats the parent's pick; else None."""
    best, best_value = None, parent_value + 1e-9 * len(X)
    sizes = np.arange(1, len(X))  # cells left of each split point
    for feature in range(X.shape[1]):
        order = np.argsort(X[:, feature], kind="stable")
        values = X[order, feature]
        prefix = np.cumsum(gain[order], axis=0)
        value = prefix[:-1].max(axis=1) + (prefix[-1] - prefix[:-1]).max(axis=1)
        allowed = (values[:-1] < values[1:]) & (sizes >= min_leaf) & (len(X) - sizes >= min_leaf)
        if not allowed.any():
            continue
        i = np.flatnonzero(allowed)[np.argmax(value[allowed])]
        if value[i] > best_value:
            threshold = (values[i] + values[i + 1]) / 2
            # Adjacent floats: the midpoint rounds onto the right value.
            best, best_value = (feature, threshold if threshold < values[i + 1] else values[i]), value[i]
    return best


def fit_tree(X: np.ndarray, gain: np.ndarray, max_depth: int, min_leaf: int) -> Node:
    def grow(rows: np.ndarray, depth: int) -> Node:
        totals = gain[rows].sum(axis=0)
        node = Node(pick=int(np.argmax(totals)))
        split = best_split(X[rows], gain[rows], min_leaf, totals[node.pick]) if depth < max_depth else None
        if split is not None:
            node.feature, node.threshold = split
            goes_left = X[rows, node.feature] <= node.threshold
            node.left, node.right = grow(rows[goes_left], depth + 1), grow(rows[~goes_left], depth + 1)
        return node

    return grow(np.arange(len(X)), 0)


def predict(tree: Node, X: np.ndarray, max_depth: int = max(DEPTHS)) -> np.ndarray:
    """Config index each row of X gets (the tree cut at max_depth)."""
    picks = []
    for x in X:
        node, depth = tree, 0
        while node.feature >= 0 and depth < max_depth:
            node, depth = (node.left if x[node.feature] <= node.threshold else node.right), depth + 1
        picks.append(node.pick)
    return np.array(picks, dtype=np.int64)


def leaves(tree: Node) -> int:
    return 1 if tree.feature < 0 else leaves(tree.left) + leaves(tree.right)


def group_folds(groups: np.ndarray):
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise ValueError(f"cross-validation needs cells of at least 2 base graphs, got {n_groups}")
    return GroupKFold(n_splits=min(MAX_FOLDS, n_groups)).split(np.zeros(len(groups)), groups=groups)


def select_hyperparameters(X: np.ndarray, gain: np.ndarray, groups: np.ndarray) -> Tuple[int, int]:
    """(max_depth, min cells per leaf) with the best mean held-out gain; the
    simplest on a tie. One tree per fold and leaf size serves every depth (a
    shallower tree is the deeper one cut: growth is greedy, top-down)."""
    held_out = {}
    for train, test in group_folds(groups):
        for min_leaf in MIN_CELLS_PER_LEAF:
            tree = fit_tree(X[train], gain[train], max(DEPTHS), min_leaf)
            for depth in DEPTHS:
                held_out.setdefault((depth, min_leaf), []).append(gain[test, predict(tree, X[test], depth)])
    scores = {choice: np.concatenate(parts).mean() for choice, parts in held_out.items()}
    ordered = [(depth, min_leaf) for min_leaf in MIN_CELLS_PER_LEAF for depth in DEPTHS]
    return max(ordered, key=lambda choice: (round(scores[choice], 9), -choice[0]))


def held_out_gain(X: np.ndarray, gain: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Gain of each cell's pick by a tree that never saw its base graph, with
    hyperparameters chosen without it too (nested cross-validation)."""
    out = np.empty(len(X))
    for train, test in group_folds(groups):
        depth, min_leaf = select_hyperparameters(X[train], gain[train], groups[train])
        out[test] = gain[test, predict(fit_tree(X[train], gain[train], depth, min_leaf), X[test])]
    return out


@dataclass
class Trained:
    tree: Node
    configs: np.ndarray
    summary: dict


def ratios(gains: np.ndarray) -> Tuple[float, float]:
    """(geomean, worst) of oracle / pick."""
    return float(2 ** gains.mean()), float(2 ** gains.min())


def train_family(family: Family) -> Trained:
    X, gain, groups = family.X, family.gain, family.cells.base_graph.to_numpy()
    depth, min_leaf = select_hyperparameters(X, gain, groups)
    tree = fit_tree(X, gain, depth, min_leaf)
    summary = dict(cells=len(X), graphs=len(np.unique(groups)), configs=len(family.configs), depth=depth,
                   min_leaf=min_leaf, leaves=leaves(tree))
    for name, gains in (("cv", held_out_gain(X, gain, groups)), ("heuristic", family.heuristic_gain),
                        ("train", gain[np.arange(len(X)), predict(tree, X)])):
        summary[f"{name}_geomean"], summary[f"{name}_worst"] = ratios(gains)
    return Trained(tree, family.configs, summary)


def describe(summary: dict) -> List[str]:
    s = summary
    return [
        f"{s['cells']} cells of {s['graphs']} graphs, {s['configs']} configs; depth {s['depth']}, "
        f">= {s['min_leaf']} cells per leaf, {s['leaves']} leaves",
        f"oracle/pick on held-out graphs: geomean {s['cv_geomean']:.3f}, worst {s['cv_worst']:.3f} "
        f"(hand heuristic: {s['heuristic_geomean']:.3f}, worst {s['heuristic_worst']:.3f}; "
        f"training set: {s['train_geomean']:.3f}, worst {s['train_worst']:.3f})",
    ]


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
    first, second = describe(trained.summary)
    comment = [f"// {family} rows: {first}", f"//   {second}"]
    if trained.tree.feature < 0:
        return comment + [f"inline Config {name}(const Features&) {{",
                          "  " + config_literal(trained.configs[trained.tree.pick]), "}"]
    return (comment + [f"inline Config {name}(const Features& f) {{", "  const RuleInputs x = rule_inputs(f);"]
            + emit_node(trained.tree, trained.configs, "  ") + ["}"])


def arch_namespace(arch: int) -> str:
    return f"sm{arch}"


def emit_header(source: str, device_name: str, arch: int, trained: dict) -> str:
    csvs = ", ".join(csv for family, csv, _ in FAMILIES if family in trained)
    lines = [
        f"// Generated by scripts/train_tree.py from {source}/ ({csvs}):",
        f"// {device_name}, sm_{arch}. Do not edit; rerun python scripts/train_tree.py.",
        "#pragma once",
        "",
        '#include "../rules.h"',
        "",
        f"namespace geot {{\nnamespace generated {{\nnamespace {arch_namespace(arch)} {{",
    ]
    for family, _, name in FAMILIES:
        if family in trained:
            lines += [""] + emit_selector(name, family, trained[family])
    lines += ["", f"}}  // namespace {arch_namespace(arch)}", "}  // namespace generated", "}  // namespace geot"]
    return "\n".join(lines) + "\n"


def emit_index(rule_sets: List[Tuple[int, str, List[str]]]) -> str:
    """rule_sets: (arch, source, families) sorted by arch."""
    lines = ["// Generated by scripts/train_tree.py: the architectures with learned rules.",
             "// Do not edit; rerun python scripts/train_tree.py.", "#pragma once", "", "#include <array>", "",
             '#include "../rules.h"']
    lines += [f'#include "rules_sm{arch}.h"' for arch, _, _ in rule_sets]
    lines += ["", "namespace geot {\nnamespace generated {", ""]
    if not rule_sets:
        lines.append("inline constexpr std::array<RuleSet, 0> kRuleSets = {};")
    else:
        lines.append(f"inline constexpr std::array<RuleSet, {len(rule_sets)}> kRuleSets = {{{{")
        for arch, source, families in rule_sets:
            selectors = [f"&{arch_namespace(arch)}::{name}" if family in families else "nullptr"
                         for family, _, name in FAMILIES]
            lines.append(f'    {{{arch}, {json.dumps(source)}, {", ".join(selectors)}}},')
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
        return str(device["name"]), int(major) * 10 + int(minor)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f'{path}: want {{"name": ..., "capability": [major, minor]}}, got {device}') from None


def train_device(db_dir: str, source: str) -> dict:
    trained = {}
    for family, csv, _ in FAMILIES:
        path = os.path.join(db_dir, csv)
        if os.path.exists(path):
            print(f"{source}/{csv} ({family} rows):")
            trained[family] = train_family(load_family(path))
            print("\n".join("  " + line for line in describe(trained[family].summary)))
    return trained


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perfdb", default=os.path.join(ROOT, "perfdb"), help="perf DB root (default perfdb/)")
    parser.add_argument("--out", default=os.path.join(ROOT, "csrc", "generated"), help="header directory")
    args = parser.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    archs, rule_sets, table = {}, [], []
    for device_json in sorted(glob.glob(os.path.join(args.perfdb, "*", "device.json"))):
        db_dir = os.path.dirname(device_json)
        source = f"{os.path.basename(os.path.normpath(args.perfdb))}/{os.path.basename(db_dir)}"
        device_name, arch = read_device(device_json)
        if arch in archs:
            raise ValueError(f"{archs[arch]} and {source} are both sm_{arch}: keep one perf DB per architecture")
        archs[arch] = source
        trained = train_device(db_dir, source)
        if not trained:
            print(f"{source}: no family CSV, skipped")
            continue
        write(os.path.join(args.out, f"rules_sm{arch}.h"), emit_header(source, device_name, arch, trained))
        rule_sets.append((arch, source, sorted(trained)))
        table += [dict(arch=f"sm_{arch}", family=family, **t.summary) for family, t in trained.items()]

    kept = {f"rules_sm{arch}.h" for arch, _, _ in rule_sets}
    for stale in sorted(glob.glob(os.path.join(args.out, "rules_sm*.h"))):
        if os.path.basename(stale) not in kept:
            os.remove(stale)
            print(f"removed {stale}")
    write(os.path.join(args.out, "rules_index.h"), emit_index(sorted(rule_sets)))
    summary = pd.DataFrame(table)
    print_summary(summary)
    return summary


def print_summary(summary: pd.DataFrame) -> None:
    if summary.empty:
        print("no perf DB found (perfdb/<gpu>/device.json): the rules index lists no architecture")
        return
    columns = ["arch", "family", "cells", "graphs", "depth", "leaves", "cv_geomean", "cv_worst",
               "heuristic_geomean", "heuristic_worst", "train_geomean"]
    print("\noracle/pick (geomean, worst): cv = held-out graphs, nested cross-validation")
    print(summary[columns].to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        sys.exit(f"train_tree.py: {err}")
