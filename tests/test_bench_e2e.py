"""bench/e2e.py --quick runs end to end on CPU: every path of a model is timed
and the summary (speedups, compiled vs eager) is printed."""
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("torch_geometric")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("processes", ["one", "per-library"])
def test_e2e_quick_times_every_path(tmp_path, processes):
    """per-library: each library's paths in a child process, rows merged (the
    default on CUDA when both compiled paths run)."""
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--quick", "--models", "gcn",
                             "--paths", "pyg,pyg-csr,geot,geot-compile", "--processes", processes,
                             "--memory-snapshot", str(tmp_path / "snapshots")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "geomean speedup of geot-compile over geot eager" in result.stdout
    assert ("in a process of their own" in result.stdout) == (processes == "per-library")
    df = pd.read_csv(tmp_path / "e2e_cpu_quick.csv")
    assert set(df["path"]) == {"pyg", "pyg-csr", "geot", "geot-compile"}
    assert set(df["mode"]) == {"inference", "train"}
    assert df["ms"].notna().all() and (df["ms"] > 0).all(), df
    assert "resident_mb" in df and not any((tmp_path / "snapshots").iterdir()), "memory figures are CUDA's only"


def test_e2e_quick_runs_patched_pyg_layers(tmp_path):
    """The PyG models that geot.nn.patch converts (a weightless propagation
    between Linears, an attention layer PyG has no CSR path for) are timed on
    both libraries; the CSR cell of the attention layer is marked n/a."""
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--quick", "--models",
                             "lg,gatv2", "--paths", "pyg,pyg-csr,geot,geot-compile"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(tmp_path / "e2e_cpu_quick.csv")
    measured = df[df["ms"].notna()]
    assert set(zip(measured["model"], measured["path"])) == {
        (model, path) for model in ("lg", "gatv2") for path in ("pyg", "pyg-csr", "geot", "geot-compile")
        if (model, path) != ("gatv2", "pyg-csr")}
    assert len(measured) == 14 and (measured["ms"] > 0).all(), df


def test_e2e_summarizes_measured_rows():
    """--summarize prints the summary of rows already measured, speedups
    recomputed over all the files given (the current H100 results here)."""
    measured = os.path.join(ROOT, "bench", "results", "e2e_h100.csv")
    rows = pd.read_csv(measured)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--summarize", measured],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = rows[rows["model"].isin(["gcn", "gin", "sage"]) & (rows["path"] == "geot-compile")
                    & (rows["mode"] == "train")]
    geomean = math.exp(compiled["speedup"].map(math.log).mean())
    expected = f"GCN/GIN/SAGE  train     geot-compile {geomean:.2f}x"
    assert expected in result.stdout, (expected, result.stdout[-2000:])
    assert "GCN/GIN/SAGE geot-compile by graph:" in result.stdout


def test_changing_graph_quick_times_each_step_on_a_new_graph(tmp_path):
    """bench/changing_graph.py --quick: every path of each model timed on
    graphs it never saw, speedups against PyG eager and the fastest PyG path."""
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "changing_graph.py"), "--quick",
                             "--models", "sage,gin", "--paths", "pyg,geot"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(tmp_path / "changing_graph_cpu_quick.csv")
    assert len(df) == 4 and set(df["path"]) == {"pyg", "geot"} and set(df["model"]) == {"sage", "gin"}
    assert (df["ms"] > 0).all() and (df["step_edges"] < df["edges"]).all(), df
    pyg = df[df["path"] == "pyg"]
    assert (pyg["speedup_vs_eager"] == 1).all() and (df["speedup"] <= df["speedup_vs_eager"] + 1e-12).all()


def test_geot_model_compiles_whole_beside_a_compiled_pyg_model():
    """e2e compiles PyG's and geot's models in one process. PyG's breaks its
    graph in the layer loop, and dynamo stops compiling that forward's code;
    geot's model, with a code object of its own, still compiles as one frame
    (sharing Net.forward, it compiled as one frame per layer)."""
    import torch
    import torch_geometric.nn as pyg_nn
    from torch._dynamo.testing import CompileCounter

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import e2e
    import geot.nn

    torch._dynamo.reset()
    x, edge_index = torch.randn(20, 8), torch.randint(0, 20, (2, 60))
    pyg_count, geot_count = CompileCounter(), CompileCounter()
    torch.compile(e2e.Net(pyg_nn, "gcn", 8, 16, 4), backend=pyg_count)(x, edge_index)
    if pyg_count.frame_count == 1:  # else: the shared forward skipped, its layers compiled one by one
        pytest.skip("PyG's compiled GCN has no graph break in this PyG version")
    torch.compile(e2e.GeotNet(geot.nn, "gcn", 8, 16, 4), backend=geot_count, fullgraph=True)(x, edge_index)
    assert geot_count.frame_count == 1
    torch._dynamo.reset()
