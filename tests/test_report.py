"""bench/report.py: the benchmark report (docs/benchmarks.md, its plots and
the README's headline table) regenerates from bench/results/*.csv, and the
committed report is what the current CSVs give (a stale one fails here)."""
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "report.py")
RESULTS = os.path.join(ROOT, "bench", "results")

pytest.importorskip("matplotlib")


def run(*args, cwd=ROOT):
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    return result


def test_committed_report_matches_the_results():
    result = run("--check")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_report_regenerates_identically(tmp_path):
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    docs.mkdir()
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    result = run("--docs", str(docs), "--readme", str(readme))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        assert (docs / "benchmarks.md").read_text() == f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert readme.read_text() == f.read()
    images = sorted(p.name for p in (docs / "img").iterdir())
    assert images == sorted(os.path.basename(p) for p in os.listdir(os.path.join(ROOT, "docs", "img")))
    for name in os.listdir(RESULTS):
        bench, _, gpu = name[: -len(".csv")].rpartition("_")
        assert f"{bench}_{gpu}.png" in images, name


def test_every_results_csv_is_one_bench_on_one_gpu():
    names = sorted(os.listdir(RESULTS))
    assert names, "bench/results/ is empty"
    for name in names:
        assert name.endswith(".csv") and "_" in name, name
        assert not pd.read_csv(os.path.join(RESULTS, name)).empty, name


def test_add_merges_a_run_into_the_current_results(tmp_path):
    results, docs, readme = tmp_path / "results", tmp_path / "docs", tmp_path / "README.md"
    results.mkdir()
    docs.mkdir()
    shutil.copy(os.path.join(RESULTS, "spmm_h100.csv"), results)
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    current = pd.read_csv(results / "spmm_h100.csv")
    rerun = current[current["graph"] == "cora"].assign(geot=lambda d: d["geot"] / 2)
    rerun.to_csv(tmp_path / "run.csv", index=False)
    result = run("--add", "spmm", str(tmp_path / "run.csv"), "--gpu", "h100", "--results", str(results),
                 "--docs", str(docs), "--readme", str(readme))
    assert result.returncode == 0, result.stderr[-3000:]
    merged = pd.read_csv(results / "spmm_h100.csv")
    assert len(merged) == len(current)  # the run's cells replaced the same cells
    cora = merged[merged["graph"] == "cora"].set_index("F")["geot"]
    # CSV text round trips may differ in the last digit between pandas versions
    pd.testing.assert_series_equal(cora, current[current["graph"] == "cora"].set_index("F")["geot"] / 2, rtol=1e-12)
    expected = current.copy()
    expected.loc[expected["graph"] == "cora", "geot"] /= 2
    pd.testing.assert_frame_equal(merged[["graph", "F", "geot", "cusparse"]], expected[["graph", "F", "geot", "cusparse"]])
    assert "spmm_h100.png" in os.listdir(docs / "img")


def test_add_recomputes_e2e_speedups(tmp_path):
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    docs.mkdir()
    current = pd.read_csv(os.path.join(RESULTS, "e2e_h100.csv"))
    cell = (current["model"] == "gcn") & (current["graph"] == "cora") & (current["hidden"] == 32)
    run_rows = current[cell & (current["path"] == "geot-compile")].drop(
        columns=["best_pyg_ms", "best_pyg_peak_mb", "speedup", "peak_ratio"]).assign(ms=lambda d: d["ms"] * 2)
    run_rows.to_csv(tmp_path / "run.csv", index=False)
    current.to_csv(results / "e2e_h100.csv", index=False)
    result = run("--add", "e2e", str(tmp_path / "run.csv"), "--gpu", "h100", "--results", str(results),
                 "--docs", str(docs), "--readme", "")
    assert result.returncode == 0, result.stderr[-3000:]
    merged = pd.read_csv(results / "e2e_h100.csv")
    assert len(merged) == len(current)
    keys = ["model", "hidden", "graph", "dtype", "mode", "path"]
    before = current[cell & (current["path"] == "geot-compile")].set_index(keys)["speedup"]
    after = merged.set_index(keys).loc[before.index, "speedup"]
    pd.testing.assert_series_equal(after, before / 2, check_names=False)


def test_add_rgnn_run_makes_its_section(tmp_path):
    """bench/rgnn.py's rows (here a quick CPU run's, OOM and skipped cells included) merge into the results and
    give a section, a plot and headline rows."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    results.mkdir()
    docs.mkdir()
    rows = []
    for model in ("rgcn", "rgat"):
        for mode in ("inference", "train"):
            for path, ms, note in (("geot", 1.0, ""), ("pyg", 3.0, ""), ("pyg-compile", float("nan"), "OOM")):
                rows.append({"model": model, "hidden": "1x64", "graph": "aifb", "dtype": "fp32", "mode": mode,
                             "path": path, "ms": ms, "peak_mb": 10.0, "resident_mb": 1.0, "note": note})
    pd.DataFrame(rows).to_csv(tmp_path / "run.csv", index=False)
    result = run("--add", "rgnn", str(tmp_path / "run.csv"), "--gpu", "h100", "--results", str(results),
                 "--docs", str(docs), "--readme", "")
    assert result.returncode == 0, result.stderr[-3000:]
    merged = pd.read_csv(results / "rgnn_h100.csv")
    assert (merged[merged["path"] == "geot"]["speedup"] == 3.0).all()
    text = (docs / "benchmarks.md").read_text()
    assert "Relational GNNs on heterogeneous graphs" in text and "pyg-compile: 4" in text
    assert "rgnn_h100.png" in os.listdir(docs / "img")


def test_rgnn_headline_names_each_peer_with_the_graphs_it_ran_on():
    """A peer that ran on some graphs only is named with them; one that never ran (all failed) is not named."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import report
    nan = float("nan")
    df = pd.DataFrame({"graph": ["a", "a", "a", "a", "b", "b", "b", "b"],
                       "path": ["geot", "pyg", "pyg-compile", "pyg-fast-compile"] * 2,
                       "ms": [1.0, 2.0, 3.0, nan, 1.0, 2.0, nan, nan]})
    assert report.RelationalGNN.peers_that_ran(df) == ["pyg", "pyg-compile (a)"]


@pytest.mark.parametrize("rules", [["nvidia-h100-80gb-hbm3", "nvidia-h200"], ["heuristic", "nvidia-h200"]],
                         ids=["two-rule-sets", "heuristic-first"])
def test_compare_rules_section_and_headline(rules, tmp_path):
    """bench/compare_rules.py's cells (each rule set's time per cell, the heuristic's last unless named
    first): speedups against the run's first rule set and the heuristic, the cells 5% or more apart listed,
    a plot, one headline row for the last rule set."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import report
    ms = {"nvidia-h100-80gb-hbm3": [1.0, 2.0], "nvidia-h200": [0.8, 2.0], "heuristic": [1.6, 2.2]}
    order = list(dict.fromkeys(rules + ["heuristic"]))
    cells = pd.DataFrame([{"bench": bench, "graph": "cora", "F": F, "rules": slug, "config": "1,32,8,4,1",
                           "ms": ms[slug][i] * (2 if bench == "spmm" else 1)}
                          for bench in ("segment_reduce", "spmm") for i, F in enumerate((1, 8)) for slug in order])
    summary = report.rule_set_summary(cells).set_index(["bench", "rules"])
    assert summary.loc[("spmm", "nvidia-h200"), "vs heuristic"] == pytest.approx((2.0 * 1.1) ** 0.5)
    section = report.CompareRules().section(cells, "h200", str(tmp_path))
    assert "compare_rules_h200.png" in os.listdir(tmp_path)
    headline, = report.CompareRules().headline(cells)
    if rules[0] == "heuristic":
        assert summary.columns[1] == "vs heuristic" and "5% or more apart" not in section
        assert headline[1:] == ["hand heuristic", "1.48× segment_reduce, 1.48× spmm"]
    else:
        assert summary.loc[("segment_reduce", "nvidia-h200"), "vs nvidia-h100-80gb-hbm3"] == pytest.approx(
            (1.25 * 1.0) ** 0.5)
        assert "| segment_reduce | cora | 1 | 1000.0 (1,32,8,4,1) | 800.0 (1,32,8,4,1) | 1.25× |" in section
        assert headline[1:] == ["hand heuristic / nvidia-h100-80gb-hbm3's rules",
                                "1.48× / 1.12× segment_reduce, 1.48× / 1.12× spmm"]
