"""Learned config rules: the trainer (scripts/train_tree.py) on a synthetic
perf DB with planted best configs, its generated C++, and the runtime
dispatch (rule-set matching, fallback, the heuristic switch, its cost)."""
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import geot
from geot import _C, tune

pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("train_tree", os.path.join(ROOT, "scripts", "train_tree.py"))
train_tree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tree)

ARCH = 90
F_VALUES = (4, 8, 16, 32, 64)
# The planted best config of each region of the feature space.
# The regions are cut on features the trees split on (not log2 E: SHAPE_FEATURES).
SMALL_GRAPH = geot.Config(1, 32, 8, 4, 1)  # under 4096 segments
SMALL_F = geot.Config(1, 32, 8, 8, 32)  # F <= 8
EVEN = geot.Config(2, 32, 64, 8, 0)  # no long segment
SKEWED = geot.Config(4, 32, 64, 2, 1)  # long segments


def planted(S, F, long_segments):
    if S < 4096:
        return SMALL_GRAPH
    if F <= 8:
        return SMALL_F
    return SKEWED if long_segments else EVEN


def swept_configs(rng):
    """The planted configs and a random sample of the space, deduplicated
    like the sweep (one config per distinct launch)."""
    space = geot.config_space()
    sample = [space[i] for i in rng.choice(len(space), 40, replace=False)]
    configs, seen = [], set()
    for cfg in [SMALL_GRAPH, SMALL_F, EVEN, SKEWED] + sample:
        key = tuple(train_tree.launch_keys(np.array([cfg]), np.array([4]))[0])
        if key not in seen:
            seen.add(key)
            configs.append(cfg)
    return configs


GENERATORS = ("powerlaw", "uniform", "hubs")  # generator families, as perfdb/corpus.py names them


def family_rows(rng, configs, base_graphs):
    """Rows of one family CSV: every config is 1.15-2x slower than the
    planted one of its region, with 3% noise; the heuristic always takes
    SKEWED."""
    slowdown = 1.15 + 0.85 * rng.random((4, len(configs)))  # per region
    rows = []
    for base, (E0, avg, long_segments) in enumerate(base_graphs):
        for aug, scale in enumerate((1.0, 1.3, 0.8)):
            E = int(E0 * scale)
            S = max(1, int(E / avg))
            graph = dict(graph=f"g{base}_{aug}", base_graph=f"{GENERATORS[base % 3]}(g{base})",
                         kind="augmented" if aug else "generated",
                         augmentation=f"scale{scale}", E=E, num_segments=S, avg=avg,
                         max_deg=200 if long_segments else 32, long_segments=long_segments)
            for F in F_VALUES:
                best = planted(S, F, long_segments)
                region = [SMALL_GRAPH, SMALL_F, EVEN, SKEWED].index(best)
                base_ms = 1e-6 * E * F + 0.005
                for i, cfg in enumerate(configs):
                    ms = base_ms * (1.0 if cfg == best else slowdown[region, i]) * rng.lognormal(0, 0.03)
                    rows.append(dict(graph, F=F, schedule=cfg.schedule, **cfg._asdict(), time_ms=ms))
                heuristic_ms = base_ms * (1.0 if best == SKEWED else slowdown[region, configs.index(SKEWED)])
                rows.append(dict(graph, F=F, schedule="heuristic", **SKEWED._asdict(), time_ms=heuristic_ms))
    return pd.DataFrame(rows)


def make_perfdb(root, seed=0, base_graphs=16, name="Test GPU", families=None):
    """perfdb/<slug of name> with both families (or those named); returns the perfdb directory."""
    rng = np.random.default_rng(seed)
    configs = swept_configs(rng)
    db = os.path.join(root, "perfdb", train_tree.device_slug(name))
    os.makedirs(db)
    with open(os.path.join(db, "device.json"), "w") as f:
        json.dump({"name": name, "capability": [ARCH // 10, ARCH % 10]}, f)
    for family, csv, _ in train_tree.FAMILIES:
        graphs = [(int(2 ** rng.uniform(12, 22)), float(rng.uniform(2, 40)), i % 2) for i in range(base_graphs)]
        rows = family_rows(rng, configs, graphs)
        if families is None or family in families:
            rows.to_csv(os.path.join(db, csv), index=False)
    return os.path.dirname(db)


HEADER = "rules_test-gpu.h"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The perf DB, the generated directory, the printed summary and the
    plain family's trained tree."""
    root = tmp_path_factory.mktemp("db")
    perfdb = make_perfdb(str(root))
    out = os.path.join(str(root), "csrc", "generated")
    summary = train_tree.main(["--perfdb", perfdb, "--out", out])
    family = train_tree.load_family(os.path.join(perfdb, "test-gpu", "segment_reduce.csv"))
    return perfdb, out, summary, family, train_tree.train_family(family)


def test_trainer_beats_heuristic_on_held_out_graphs(trained):
    _, _, summary, _, _ = trained
    assert list(summary.family) == ["plain", "gathered"]
    for row in summary.itertuples():
        assert row.graph_geomean >= 0.95, row
        assert row.graph_geomean > row.heuristic_geomean + 0.05, row
        assert row.train_geomean >= row.graph_geomean - 1e-9, row
        assert row.graph_worst <= row.graph_worst_graph <= row.graph_geomean, row
        assert 0 < row.family_geomean <= row.train_geomean + 1e-9, row
        for holdout in ("graph", "base", "family"):  # a tolerance only raises the figures, up to 1
            assert getattr(row, f"{holdout}_geomean") <= getattr(row, f"{holdout}_noise_aware_geomean") <= 1, row
            assert getattr(row, f"{holdout}_worst_graph") <= getattr(row, f"{holdout}_noise_aware_worst_graph"), row
        assert 0 < row.repeat_spread < 0.1, row  # the synthetic sweep's 3% noise on cells under 10^4 edges


def test_trainer_finds_planted_configs(trained):
    _, _, _, family, result = trained
    cases = [(2 ** 14, 500, 64, 1), (2 ** 20, 50000, 4, 1), (2 ** 20, 50000, 128, 0), (2 ** 21, 60000, 32, 1)]
    X = np.array([train_tree.rule_features(E, S, F, long) for E, S, F, long in cases])
    picks = [geot.Config(*map(int, family.configs[i])) for i in train_tree.predict(result.tree, X)]
    assert picks == [planted(S, F, long) for _, S, F, long in cases]


def test_training_is_deterministic(trained, tmp_path):
    perfdb, out, _, _, _ = trained
    again = str(tmp_path / "again")
    train_tree.main(["--perfdb", perfdb, "--out", again, "--no-eval"])  # the headers do not depend on it
    assert sorted(os.listdir(out)) == sorted(os.listdir(again)) == ["rules_index.h", HEADER]
    for name in os.listdir(out):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name


def test_generated_header_is_marked_and_small(trained):
    _, out, _, _, _ = trained
    with open(os.path.join(out, HEADER)) as f:
        header = f.read()
    assert header.startswith("// Generated by scripts/train_tree.py from perfdb/test-gpu/")
    assert "Do not edit" in header.splitlines()[1]
    for selector in ("plain_config", "gathered_config"):
        assert f"inline Config {selector}(const Features& f)" in header
    # No split whose two sides return the same config.
    lines = [line.strip() for line in header.splitlines()]
    for i, line in enumerate(lines):
        if line == "} else {" and lines[i - 1].startswith("return") and lines[i + 1].startswith("return"):
            assert lines[i - 1] != lines[i + 1], f"redundant split at line {i}"


def test_generated_header_compiles_to_the_trained_tree(trained, tmp_path):
    """The C++ selector picks what predict() picks, on the training cells and
    on random features (same feature formulae, same thresholds)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    _, out, _, family, result = trained
    csrc = tmp_path / "csrc"
    shutil.copytree(out, csrc / "generated")
    for name in ("rules.h", "config.h"):
        shutil.copy(os.path.join(ROOT, "csrc", name), csrc)
    rng = np.random.default_rng(1)
    cases = [(int(c.E), int(c.num_segments), int(c.F), train_tree.long_level(int(c.max_deg)))
             for c in family.cells.itertuples()]
    cases += [(int(2 ** rng.uniform(0, 30)), int(rng.integers(0, 10 ** 6)), int(rng.integers(1, 300)),
               int(rng.integers(-1, 4))) for _ in range(300)]  # level -1: unknown
    calls = "\n".join(f"  print(generated::kRuleSets[0].plain(make_features({E}, {S}, {F}, false, {long}, 0)));"
                      for E, S, F, long in cases)
    (tmp_path / "main.cpp").write_text(
        '#include <cstdio>\n#include "generated/rules_index.h"\nusing namespace geot;\n'
        'void print(const Config& c) { std::printf("%d %d %d %d %d\\n", c.N_t, c.T_N, c.M_t, c.T_M, c.G_t); }\n'
        f"int main() {{\n{calls}\n}}\n")
    binary = str(tmp_path / "selector")
    subprocess.run([compiler, "-std=c++17", "-I", str(csrc), str(tmp_path / "main.cpp"), "-o", binary], check=True)
    printed = subprocess.run([binary], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]
    X = np.array([train_tree.rule_features(*case) for case in cases])
    expected = [" ".join(map(str, family.configs[i])) for i in train_tree.predict(result.tree, X)]
    assert printed == expected


def test_unfinished_cells_are_left_out(trained, tmp_path):
    perfdb, _, _, family, _ = trained
    rows = pd.read_csv(os.path.join(perfdb, "test-gpu", "segment_reduce.csv"))
    no_heuristic = (rows.graph == "g0_0") & (rows.F == 4) & (rows.schedule == "heuristic")
    cut_off = (rows.graph == "g1_0") & (rows.F == 8) & (rows.schedule != "heuristic")
    cut_off &= cut_off.cumsum() > cut_off.sum() // 3  # a third of the configs timed
    rows[~(no_heuristic | cut_off)].to_csv(tmp_path / "cut.csv", index=False)
    cells = train_tree.load_family(str(tmp_path / "cut.csv")).cells
    assert len(cells) == len(family.cells) - 2
    assert not ((cells.graph == "g0_0") & (cells.F == 4)).any() and not ((cells.graph == "g1_0") & (cells.F == 8)).any()


def test_donated_cells_only_at_widths_of_the_own_db(trained, tmp_path):
    """A GPU's DB is joined by another's cells of the graphs it lacks, at
    the widths its own sweep timed: a width only the donor swept (here 64)
    gets no rules learned from the donor's cells alone."""
    perfdb, _, _, family, _ = trained
    rows = pd.read_csv(os.path.join(perfdb, "test-gpu", "segment_reduce.csv"))
    own_rows = rows[rows.graph.str.startswith(("g0_", "g1_", "g2_", "g3_")) & (rows.F != 64)]
    own_rows.to_csv(tmp_path / "own.csv", index=False)
    own = train_tree.load_family(str(tmp_path / "own.csv"))
    pooled = train_tree.with_donors(own, [family])
    donated = pooled.cells[pooled.donated]
    assert len(donated) and set(donated.F) == set(own.cells.F) == set(F_VALUES) - {64}
    assert not donated.graph.isin(own.cells.graph).any()
    lacking = ~family.cells.graph.isin(own.cells.graph) & (family.cells.F != 64)
    assert len(donated) == int(lacking.sum())


def test_launch_keys_merge_identical_launches():
    configs = np.array([[4, 32, 8, 2, 1], [1, 32, 8, 2, 1], [2, 16, 8, 1, 16], [1, 8, 8, 4, 16], [1, 32, 8, 2, 0]])
    keys = train_tree.launch_keys(configs, np.full(len(configs), 3))  # odd F: N_t falls to 1
    assert (keys[0] == keys[1]).all()  # SR, N_t 4 -> 1
    assert (keys[2] == keys[3]).all()  # PR, blocks of 16 and 32 threads round up to one warp
    assert not (keys[1] == keys[4]).all()  # SR and SP differ
    assert train_tree.launch_keys(configs[:1], np.array([8]))[0, 0] == 4


def test_trainer_rejects_bad_csv(tmp_path):
    db = tmp_path / "perfdb" / "gpu"
    db.mkdir(parents=True)
    (db / "device.json").write_text(json.dumps({"name": "x", "capability": [9, 0]}))
    pd.DataFrame({"graph": ["g"], "F": [1], "time_ms": [1.0]}).to_csv(db / "segment_reduce.csv", index=False)
    with pytest.raises(ValueError, match="missing columns.*base_graph"):
        train_tree.main(["--perfdb", str(tmp_path / "perfdb"), "--out", str(tmp_path / "out")])
    (db / "device.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="capability"):
        train_tree.main(["--perfdb", str(tmp_path / "perfdb"), "--out", str(tmp_path / "out")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_tune_sweep_needs_a_gpu():
    with pytest.raises(SystemExit, match="geot.tune: the sweep times kernels on a CUDA GPU"):
        tune.main(["sweep", "--budget-s", "60"])


def test_tune_train_without_gpu(trained, tmp_path, capsys):
    perfdb, out, _, _, _ = trained
    tune.main(["train", "--no-build", "--perfdb", perfdb, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "graph_geomean" in printed and "family_geomean" in printed and "test-gpu" in printed
    assert re.search(r"geot.tune: done \(training \d+ s; \d+ s in all\)", printed), printed[-300:]
    with open(os.path.join(out, HEADER)) as a, open(tmp_path / HEADER) as b:
        assert a.read() == b.read()


@pytest.mark.parametrize(
    "arch, known, expected",
    [
        (90, [80, 90], 1),  # exact
        (89, [80, 86], 1),  # nearest of the same major
        (87, [86, 89], 0),
        (85, [86, 84], 1),  # a tie goes to the older
        (88, [86, 90], 0),  # never another major
        (100, [90], -1),
        (0, [90], -1),  # CPU / unknown
        (90, [], -1),
    ],
)
def test_nearest_arch(arch, known, expected):
    assert _C.nearest_arch(arch, known) == expected


def archs_without_rules():
    majors = {arch // 10 for arch in _C.learned_archs()}
    return [arch for arch in (0, 75, 80, 90, 100, 120) if arch == 0 or arch // 10 not in majors]


@pytest.mark.parametrize("gathered", [False, True])
def test_explain_falls_back_to_heuristic(gathered):
    for arch in archs_without_rules():
        for long in (None, False, True):
            for E, S, F in ((1000, 100, 8), (1 << 20, 1 << 16, 64), (1 << 22, 1 << 18, 3)):
                hint = -1 if long is None else int(long)
                heuristic = geot.Config(*_C.heuristic_config(E, S, F, gathered, hint))
                assert geot.explain(E, S, F, gathered, long, arch=arch) == heuristic
                assert geot.explain_source(E, S, F, gathered, long, arch=arch).startswith("hand heuristic (no learned")


def test_explain_defaults_and_verbose(capsys):
    here = dict(arch=geot.config._device_arch(), gpu=geot.config._device_name())
    assert geot.explain(1 << 20, 1 << 16, 64) == geot.explain(1 << 20, 1 << 16, 64, **here)
    cfg = geot.explain(1 << 20, 1 << 16, 64, arch=0, verbose=True)
    assert capsys.readouterr().out == f"{cfg}: hand heuristic (no learned rules for arch 0: CPU or unknown)\n"
    with pytest.raises(ValueError, match="arch"):
        geot.explain(10, 2, 4, arch=-1)
    with pytest.raises(ValueError, match="gpu must be"):
        geot.explain(10, 2, 4, gpu=90)


H100 = dict(arch=90, gpu="NVIDIA H100 80GB HBM3")


def test_explain_with_dtype_reports_the_launch():
    """With dtype, explain gives what the CUDA launch layer runs: the rules'
    config, then the hand rules (csrc/launch_rules.h); without, the rules'."""
    cora = (10556, 2708)
    rules_512 = geot.explain(*cora, 512, True, 1, **H100)
    assert geot.explain(*cora, 512, True, 1, dtype=None, **H100) == rules_512
    # fp32 rows of 128 features or more under 2^20 edges: shared ids, 16 edges a group on so few edges
    assert geot.explain(*cora, 512, True, 1, dtype=torch.float32, deterministic=False, **H100) == (4, 32, 16, 8, 1)
    assert geot.explain_source(*cora, 512, True, 1, dtype=torch.float32, deterministic=False, **H100).endswith(
        "; then SR with shared ids (use_shared_ids)")
    # ... in deterministic mode too (a group's edges are its chunk), but not for a max, nor at F = 96
    assert geot.explain(*cora, 512, True, 1, dtype=torch.float32, deterministic=True, **H100) == (4, 32, 16, 8, 1)
    # ... where validation bounds segments to 16384 rows under 2^20 edges, 32 edges a chunk past 1024
    assert geot.explain(*cora, 512, True, 2, dtype=torch.float32, deterministic=True, **H100) == (4, 32, 32, 8, 1)
    for sizes in ((2_000_000, 100_000, 512, True, 1), (*cora, 512, True, 3)):
        rules = geot.explain(*sizes, **H100)
        assert geot.explain(*sizes, dtype=torch.bfloat16, deterministic=True, **H100) == rules
        assert geot.explain(*sizes, dtype=torch.bfloat16, deterministic=False, **H100) != rules
    assert geot.explain(*cora, 512, True, 1, dtype=torch.float32, reduce="max", deterministic=False,
                        **H100) == rules_512
    rules_96 = geot.explain(*cora, 96, True, 1, **H100)
    assert geot.explain(*cora, 96, True, 1, dtype=torch.float32, deterministic=False, **H100) == rules_96
    # half rows of a multiple of 8 features: 8 features a lane, on any graph; 4 edges a group where groups are
    # of 8 lanes (F = 64) or the graph is small, else 16 or more (shared_ids_rows)
    assert geot.explain(*cora, 64, True, 1, dtype=torch.bfloat16, deterministic=False, **H100) == (8, 8, 4, 32, 1)
    pubmed = (88_648, 19_717)
    assert geot.explain(*pubmed, 64, True, 1, dtype=torch.bfloat16, deterministic=False, **H100).M_t == 4
    assert geot.explain(*pubmed, 128, True, 1, dtype=torch.bfloat16, deterministic=False, **H100).M_t == 16
    # deterministic chunks: 8 edges where edges * lanes an edge (8 features a lane for half rows, 4 for fp32)
    # stay within 2^19, else 16
    det_rows = {(dtype, F): geot.explain(*cora, F, True, 1, dtype=dtype, deterministic=True, **H100).M_t
                for dtype in (torch.float32, torch.bfloat16) for F in (128, 256, 512)}
    assert det_rows == {(torch.float32, 128): 8, (torch.float32, 256): 16, (torch.float32, 512): 16,
                        (torch.bfloat16, 128): 8, (torch.bfloat16, 256): 8, (torch.bfloat16, 512): 16}
    assert geot.explain(*pubmed, 64, True, 1, dtype=torch.bfloat16, deterministic=True, **H100).M_t == 16
    # several weight heads keep the rules' config, SP's 8-lane tile widened for half rows
    even = (64_000, 4_000, 128, True, 0)
    rules_even = geot.explain(*even, **H100)
    widened = geot.explain(*even, dtype=torch.float16, heads=2, deterministic=False, **H100)
    if (rules_even.N_t, rules_even.T_N, rules_even.G_t) == (4, 8, 0):
        assert (widened.T_N, widened.T_M) == (16, 4)
        assert "half_row_sp_config" in geot.explain_source(*even, dtype=torch.float16, heads=2, deterministic=False,
                                                           **H100)
    # deterministic mode on short segments: SP walking each whole, unless the rules' config is SP already
    plain = geot.explain(*cora, 32, False, 1, **H100)  # SR in the committed rules
    det = geot.explain(*cora, 32, False, 1, dtype=torch.float32, deterministic=True, **H100)
    det_source = geot.explain_source(*cora, 32, False, 1, dtype=torch.float32, deterministic=True, **H100)
    assert ("short_segment_config" in det_source) == (plain.schedule != "SP") and det.schedule == "SP"
    assert geot.explain(*cora, 32, False, 1, dtype=torch.float32, deterministic=False, **H100) == plain
    # deterministic fp32 sums on small graphs: PR of 64-row chunks past 1024-row segments (both ops, F <= 32),
    # for gathered rows of pubmed's size (F <= 32) and cora's (F = 33-64) where the rules' pick is not SP
    powerlaw_small = (100_239, 10_000)
    for F, gathered in ((1, True), (3, False), (16, True), (32, False)):
        det = geot.explain(*powerlaw_small, F, gathered, 2, dtype=torch.float32, deterministic=True, **H100)
        m_t = {1: 2, 3: 2, 16: 4, 32: 8}[F]
        assert det == ({1: 1, 3: 1, 16: 4, 32: 4}[F], 32, m_t, 8, 64 // m_t), (F, det)
        assert "deterministic_pr_config" in geot.explain_source(*powerlaw_small, F, gathered, 2, dtype=torch.float32,
                                                                deterministic=True, **H100)
        for other in (dict(dtype=torch.float32, deterministic=False), dict(dtype=torch.bfloat16, deterministic=True),
                      dict(dtype=torch.float32, reduce="max", deterministic=True)):
            assert "deterministic_pr_config" not in geot.explain_source(*powerlaw_small, F, gathered, 2, **other,
                                                                        **H100)
    assert "deterministic_pr_config" not in geot.explain_source(*powerlaw_small, 64, True, 2, dtype=torch.float32,
                                                                deterministic=True, **H100)
    for sizes, pr in (((*pubmed, 16, True, 1), (4, 32, 4, 8, 16)), ((*cora, 64, True, 1), (4, 32, 2, 8, 8))):
        rules = geot.explain(*sizes, **H100)
        assert rules.schedule != "SP", "the committed H100 rules pick SP here: choose other sizes"
        assert geot.explain(*sizes, dtype=torch.float32, deterministic=True, **H100) == pr
    # ... but plain rows of pubmed keep SP walking each segment whole, as do cora's gathered 16 features
    for sizes in ((*pubmed, 16, False, 1), (*cora, 16, True, 1)):
        assert "deterministic_pr_config" not in geot.explain_source(*sizes, dtype=torch.float32, deterministic=True,
                                                                    **H100)
    # deterministic mode: the rules' SP where a segment may pass its cap takes SR with the same tiles
    sp_picks = 0
    for sizes in ((3_000_000, 300_000, F, False, level) for F in (8, 16, 64, 128) for level in (2, 3)):
        rules = geot.explain(*sizes, **H100)
        det = geot.explain(*sizes, dtype=torch.float32, deterministic=True, **H100)
        if rules.schedule == "SP":
            sp_picks += 1
            assert det == (*rules[:4], 1), (sizes, rules, det)
            assert geot.explain(*sizes, dtype=torch.float32, deterministic=False, **H100) == rules
    assert sp_picks > 0, "the committed H100 rules pick no SP here: choose other sizes"
    for bad, match in ((dict(dtype=torch.int64), "dtype"), (dict(dtype=torch.float32, reduce="prod"), "reduce"),
                       (dict(dtype=torch.float32, heads=0), "heads")):
        with pytest.raises(ValueError, match=match):
            geot.explain(*cora, 64, True, 1, **bad, **H100)


@pytest.mark.parametrize("dtype, F, lanes", [
    (torch.float32, 64, 16), (torch.float32, 96, 32), (torch.float32, 128, 32), (torch.float32, 192, 16),
    (torch.float32, 256, 32), (torch.float32, 384, 32), (torch.bfloat16, 96, 16), (torch.bfloat16, 192, 32),
    (torch.bfloat16, 384, 16), (torch.bfloat16, 512, 32)])
def test_shared_ids_lanes_leave_fewer_idle(dtype, F, lanes):
    """The shared-ids tile (gathered sums of wide rows on a large skewed
    graph) takes groups of 16 lanes where 32 would leave more lanes past F
    idle (fp32 F = 192: 48 lanes of 4 features, three blocks of 16; bf16
    F = 384: 48 lanes of 8), else up to 32; 256 threads a block."""
    sizes = (3_000_000, 300_000, F, True, 2)
    assert geot.explain_source(*sizes, dtype=dtype, deterministic=False, **H100).endswith("(use_shared_ids)")
    tile = geot.explain(*sizes, dtype=dtype, deterministic=False, **H100)
    assert (tile.N_t, tile.T_N, tile.T_N * tile.T_M) == (4 if dtype == torch.float32 else 8, lanes, 256)


def test_rules_by_gpu_model_then_architecture():
    sets = geot.rule_sets()
    assert sets, "no learned rules compiled in"
    for r in sets:
        source = f"learned rules {r['slug']} from {r['source']}"
        for gpu in (r["device"], r["slug"]):
            assert geot.explain_source(1 << 20, 1 << 16, 64, arch=r["arch"], gpu=gpu) == (
                f"{source} (trained on this GPU model, {r['device']})")
    fallbacks = {r["arch"]: r for r in sets if r["arch_fallback"]}
    assert sorted(fallbacks) == sorted(_C.learned_archs())
    for arch, r in fallbacks.items():
        source = f"learned rules {r['slug']} from {r['source']} (sm_{arch} fallback: no rules for this GPU model"
        assert geot.explain_source(1 << 20, 1 << 16, 64, arch=arch) == source + ")"
        assert geot.explain_source(1 << 20, 1 << 16, 64, arch=arch, gpu="Some Other GPU") == source + ")"
        assert geot.explain_source(1 << 20, 1 << 16, 64, arch=arch + 1) == (
            source + f", nearest architecture to sm_{arch + 1})")
        assert geot.explain(1 << 20, 1 << 16, 64, arch=arch) == geot.explain(1 << 20, 1 << 16, 64, gpu=r["slug"])


def test_device_slug_matches_the_benches(monkeypatch):
    """The runtime matches a GPU's name to a rule set by the slug its perf DB
    directory has (bench/common.py's device_slug)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import common

    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "  NVIDIA A100-SXM4-80GB ", "NVIDIA GeForce RTX 4090"):
        monkeypatch.setattr(common, "device_name", lambda device=None, name=name: name)
        assert _C.device_slug(name) == train_tree.device_slug(name) == common.device_slug()
    assert _C.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_set_rules_forces_heuristic_or_a_rule_set():
    before = geot.rules_mode()
    try:
        geot.set_rules("heuristic")
        assert geot.rules_mode() == "heuristic"
        assert geot.explain_source(1 << 20, 1 << 16, 64, arch=90) == "hand heuristic (rules forced to 'heuristic')"
        for r in geot.rule_sets():
            geot.set_rules(r["slug"])
            assert geot.rules_mode() == r["slug"]
            for arch in (0, 80, r["arch"]):  # whatever the GPU, even none
                assert geot.explain_source(1 << 20, 1 << 16, 64, arch=arch) == (
                    f"learned rules {r['slug']} from {r['source']} (forced by GEOT_RULES / geot.set_rules)")
            assert geot.explain(1 << 18, 1 << 12, 7, arch=0) == geot.explain(1 << 18, 1 << 12, 7, gpu=r["slug"])
        geot.set_rules("learned")
        assert geot.rules_mode() == "learned"
    finally:
        geot.set_rules(before)
    with pytest.raises(ValueError, match="rules must be 'learned', 'heuristic' or a rule set, '.*'; got 'fast'"):
        geot.set_rules("fast")


@pytest.mark.parametrize("mode", ["heuristic", "first rule set"])
def test_geot_rules_environment_forces_rules(mode):
    mode = geot.rule_sets()[0]["slug"] if mode == "first rule set" else mode
    env = dict(os.environ, GEOT_RULES=mode)
    run = subprocess.run([sys.executable, "-c", "import geot; print(geot.rules_mode())"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == mode


def test_geot_rules_environment_rejects_other_values():
    env = dict(os.environ, GEOT_RULES="fastest")
    run = subprocess.run([sys.executable, "-c", "import geot; geot.rules_mode()"], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "GEOT_RULES must be 'learned', 'heuristic' or a rule set" in run.stderr
    assert "got 'fastest'" in run.stderr


def test_rules_index_of_two_gpus_compiles_and_dispatches(tmp_path):
    """Two GPUs of one architecture: each model gets its own rules, any
    other GPU of the architecture the larger DB's, another architecture none
    (rules.cpp compiled against the generated index)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    make_perfdb(str(tmp_path), seed=0, base_graphs=8)
    perfdb = make_perfdb(str(tmp_path), seed=1, base_graphs=4, name="Test GPU Max", families=("plain",))
    csrc = tmp_path / "csrc"
    train_tree.main(["--perfdb", perfdb, "--out", str(csrc / "generated"), "--no-eval"])
    assert sorted(os.listdir(csrc / "generated")) == ["rules_index.h", "rules_test-gpu-max.h", HEADER]
    for name in ("rules.h", "rules.cpp", "config.h", "config.cpp"):
        shutil.copy(os.path.join(ROOT, "csrc", name), csrc)
    names = [("Test GPU", ARCH), ("TEST gpu max", ARCH), ("Test GPU Pro", ARCH), ("", ARCH + 1), ("Test GPU", 0),
             ("Other", 80)]
    calls = "\n".join(f'  show("{name}", {arch});' for name, arch in names)
    (tmp_path / "main.cpp").write_text(
        '#include <cstdio>\n#include "rules.h"\nusing namespace geot;\n'
        "void show(const char* name, int arch) {\n"
        "  const RuleChoice c = choose_rules(name, arch);\n"
        "  const Features f = make_features(1 << 20, 1 << 16, 64, true, 1, c.index);\n"
        '  std::printf("%d %d|%s\\n", c.index, int(c.match), config_source(f, c).c_str());\n}\n'
        f"int main() {{\n{calls}\n}}\n")
    binary = str(tmp_path / "dispatch")
    subprocess.run([compiler, "-std=c++17", "-I", str(csrc), str(tmp_path / "main.cpp"), str(csrc / "rules.cpp"),
                    str(csrc / "config.cpp"), "-o", binary], check=True)
    env = {k: v for k, v in os.environ.items() if k != "GEOT_RULES"}
    printed = subprocess.run([binary], check=True, capture_output=True, text=True, env=env).stdout.splitlines()
    gpu, gpu_max = "learned rules test-gpu from perfdb/test-gpu", "test-gpu-max from perfdb/test-gpu-max"
    assert printed == [
        f"0 1|{gpu} (trained on this GPU model, Test GPU)",
        f"1 1|hand heuristic (no learned rules for gathered rows in {gpu_max})",  # its DB has plain rows only
        f"0 2|{gpu} (sm_{ARCH} fallback: no rules for this GPU model)",  # the larger DB
        f"0 2|{gpu} (sm_{ARCH} fallback: no rules for this GPU model, nearest architecture to sm_{ARCH + 1})",
        f"0 1|{gpu} (trained on this GPU model, Test GPU)",
        "-1 0|hand heuristic (no learned rules for sm_80)",
    ]


@pytest.mark.parametrize("arch", [0, 90])
def test_selection_cost_is_under_a_microsecond(arch):
    ns = min(_C.selection_cost_ns(1 << 20, 1 << 16, 64, gathered, 1, arch, 200_000) for gathered in (False, True))
    assert 0 < ns < 1000
    with pytest.raises(ValueError, match="n must be >= 1"):
        _C.selection_cost_ns(1, 1, 1, False, 1, arch, 0)


def test_long_segment_thresholds_match_the_extension():
    assert train_tree.LONG_SEGMENT_ROWS == geot.config.LONG_SEGMENT_ROWS
    for longest in (1, 64, 65, 1025, 20000):
        assert train_tree.long_level(longest) == geot.config.long_segment_level(longest)


def test_skew_bounds_bracket_the_longest_segment():
    """skew_lo, skew_hi: log2 of the level's bounds on the longest segment
    (the upper one at most E) over the mean; level -1 (unknown) is level 3."""
    names = list(train_tree.FEATURES)
    lo, hi = names.index("skew_lo"), names.index("skew_hi")
    x = train_tree.rule_features(20000 * 128, 20000, 8, 1)  # even degree 128: over 64, at most 1024 rows
    assert (x[lo], x[hi]) == pytest.approx((-1.0, 3.0), abs=1e-12)
    x = train_tree.rule_features(4096, 1024, 8, 3)  # at most E = 4096 rows, mean 4
    assert (x[lo], x[hi]) == pytest.approx((14.0 - 2.0, 12.0 - 2.0), abs=1e-12)
    assert train_tree.rule_features(4096, 1024, 8, -1) == x
    for E, S, longest in ((10556, 2708, 168), (100239, 10000, 4598), (2000, 500, 4), (372303, 50000, 190395)):
        x = train_tree.rule_features(E, S, 8, train_tree.long_level(longest))
        assert x[lo] <= math.log2(longest * S / E) <= x[hi] + 1e-12
    # The vectorised form sample_shapes uses agrees.
    log2_E, log2_S, level = np.log2([2.0 ** 21, 4096.0]), np.log2([20000.0, 1024.0]), np.array([1, 3])
    got = np.stack(train_tree.skew_bounds(log2_E, log2_S, level), axis=1)
    want = [train_tree.rule_features(2 ** 21, 20000, 8, 1)[lo:], train_tree.rule_features(4096, 1024, 8, 3)[lo:]]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def load_sweep():
    """perfdb/sweep.py as a module (its functions run without a GPU)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(ROOT, "perfdb", "sweep.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_sweep_resumes_from_the_committed_gzipped_db(tmp_path):
    """A sweep where only the committed <family>.csv.gz is there appends to
    a copy of its cells (and skips them): the trainer reads the plain CSV,
    so a sweep of more widths must not leave the gzipped cells behind.
    --fresh drops both."""
    sweep = load_sweep()
    rows = pd.DataFrame({"graph": ["cora", "cora", "pubmed"], "F": [1, 2, 1], "time_ms": [0.1, 0.2, 0.3]})
    path = str(tmp_path / "segment_reduce.csv")
    rows.to_csv(path + ".gz", index=False)
    assert sweep.resumable(path) == path
    pd.testing.assert_frame_equal(pd.read_csv(path), rows)
    assert sweep.done_cells(path) == {("cora", 1), ("cora", 2), ("pubmed", 1)}
    pd.DataFrame({"graph": ["cora"], "F": [96], "time_ms": [0.4]}).to_csv(path, mode="a", header=False, index=False)
    assert sweep.resumable(path) == path and len(pd.read_csv(path)) == 4  # a plain CSV is resumed as it is
    sweep.resumable(path, fresh=True)
    assert not os.path.exists(path) and not os.path.exists(path + ".gz")
    assert sweep.done_cells(path) == set()


def test_sweep_dedupe_agrees_with_the_trainer():
    """perfdb/sweep.py times one config per launch (effective_config); the
    trainer maps configs to launches with launch_keys. Both restate the launch
    layer's rules, so they must agree: a config and its effective form launch
    the same, and configs with the same effective form share a key."""
    sweep = load_sweep()
    space = geot.config_space(narrow=True)
    for F in (1, 2, 3, 4, 7, 8, 64, 128):
        effective = [sweep.effective_config(cfg, F) for cfg in space]
        keys = train_tree.launch_keys(np.array(space), np.full(len(space), F))
        assert (train_tree.launch_keys(np.array(effective), np.full(len(space), F)) == keys).all(), F
        by_effective = {}
        for cfg, key in zip(effective, map(tuple, keys)):
            assert by_effective.setdefault(cfg, key) == key, (F, cfg)


def retrain_and_compare(out: str) -> None:
    """Retrains the committed perf DBs into out (no held-out evaluation, which the headers do not hold) and
    compares every header with csrc/generated byte for byte; skips (fails under CI) where this machine's
    numpy or scikit-learn is not the committed rules' (other versions may move a few splits)."""
    committed = os.path.join(ROOT, "csrc", "generated")
    with open(os.path.join(committed, "rules_nvidia-h100-80gb-hbm3.h")) as f:
        made_with = next(line[3:].strip() for line in f if line.startswith("// Trained with"))
    if made_with != train_tree.TRAINED_WITH:
        message = (f"the committed rules say {made_with!r}; this machine has {train_tree.TRAINED_WITH!r} (other "
                   "versions may move a few splits): retrain, or pin the versions")
        if os.environ.get("CI"):  # .ci/run pins the versions the committed rules were made with
            pytest.fail(message)
        pytest.skip(message)
    train_tree.main(["--perfdb", os.path.join(ROOT, "perfdb"), "--out", out, "--no-eval"])
    gpus = [os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ROOT, "perfdb", "*", "device.json"))]
    assert sorted(os.listdir(out)) == sorted(os.listdir(committed)) == sorted(
        ["rules_index.h"] + [f"rules_{gpu}.h" for gpu in gpus])
    assert len(gpus) >= 2, "the H100's and the H200's perf DBs"
    for name in os.listdir(out):
        with open(os.path.join(out, name), "rb") as made, open(os.path.join(committed, name), "rb") as kept:
            assert made.read() == kept.read(), f"csrc/generated/{name} differs from what scripts/train_tree.py makes"


def test_committed_rules_are_what_the_committed_perf_db_trains(tmp_path):
    """python scripts/train_tree.py, run on this machine, makes csrc/generated byte for byte from perfdb/: a
    header for every GPU's perf DB, and the index."""
    retrain_and_compare(str(tmp_path / "generated"))


class _OffByOneUlp:
    """numpy, but log2 returns every other element one ulp up: another CPU's SIMD kernel (AVX-512 or not)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def log2(values):
        out = np.log2(values)
        if isinstance(out, np.ndarray) and out.size:
            flat = out.reshape(-1)
            flat[::2] = np.nextafter(flat[::2], np.inf)
        return out


def test_committed_rules_do_not_follow_the_last_bit_of_log2(tmp_path, monkeypatch):
    """The rules are the same bytes where numpy's log2 rounds differently (machines with and without
    AVX-512 differ so, and the committed rules once followed it)."""
    monkeypatch.setattr(train_tree, "np", _OffByOneUlp())
    retrain_and_compare(str(tmp_path / "generated"))
