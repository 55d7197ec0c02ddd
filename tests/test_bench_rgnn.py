"""bench/rgnn.py --quick runs end to end on CPU: every model, variant and eager path is timed."""
import os
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("torch_geometric")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rgnn_quick_times_every_cell(tmp_path):
    """aifb's shape at 1/500 scale: every model, variant and eager path has a time."""
    # One thread: on a loaded CPU, OpenMP's waits make each tiny op take milliseconds.
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rgnn.py"), "--quick"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "geot's geomean speedup" in result.stdout
    df = pd.read_csv(tmp_path / "rgnn_cpu_quick.csv")
    assert set(df["model"]) == {"rgcn", "rgat", "hgt"} and set(df["hidden"]) == {"1x64", "2x64h4"}
    assert set(df["path"]) == {"geot", "pyg", "pyg-fast", "pyg-hetero"} and set(df["mode"]) == {"inference", "train"}
    assert df["ms"].notna().all() and (df["ms"] > 0).all(), df
    assert set(df[df["path"].isin(["pyg-fast", "pyg-hetero"])]["model"]) == {"rgcn"}


def test_generated_graph_has_the_requested_shape():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rgnn
    graph = rgnn.hetero_graph("bgs", scale=0.01)
    assert len(graph["metadata"][0]) == 27 and graph["num_relations"] == 122
    assert abs(graph["num_edges"] - 6730) < 200 and graph["edge_type"].max() < 122
    assert sum(x.size(0) for x in graph["x_dict"].values()) == graph["num_nodes"]


def test_a_compilation_over_the_limit_is_noted_not_timed():
    """A compiled path whose first call outlasts --compile-limit: both of its cells say so, and the
    bench goes on (the eager path on the same graph is timed)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rgnn
    args = rgnn.parse_args(["--graphs", "aifb", "--models", "rgcn", "--variants", "1x64", "--paths", "pyg",
                            "--compile", "--scale", "0.002", "--max-types", "4", "--max-time", "0.01",
                            "--compile-limit", "1e-3"])
    compiled = ["pyg-compile", "pyg-fast-compile", "pyg-hetero-compile", "geot-compile"]
    assert args.paths == ["pyg"] + compiled
    graph = rgnn.hetero_graph("aifb", args.scale, max_types=args.max_types)
    rows = rgnn.bench_cells("rgcn", "1x64", graph, args, rgnn.torch.device("cpu"), deadline=float("inf"))
    notes = {(row["path"], row["mode"]): row["note"] for row in rows}
    for path in compiled:
        for mode in ("inference", "train"):
            assert notes[path, mode] == "n/a: compilation over 0.001 s"
    timed = [row for row in rows if row["path"] == "pyg"]
    assert all(row["ms"] > 0 and row["first_s"] > 0 and not row["note"] for row in timed), timed


def test_pyg_hetero_computes_rgcn():
    """The pyg-hetero peer with RGCNConv's weights gives RGCNConv's output on the homogeneous view: every
    node type's rows, those no edge reaches too (root and bias)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rgnn
    graph = rgnn.hetero_graph("mag", scale=0.0005)
    hetero = rgnn.build("rgcn", "pyg-hetero", "1x64", graph).double()
    rgcn = rgnn.build("rgcn", "pyg", "1x64", graph).double()
    layer, conv = hetero.convs[0], rgcn.convs[0]
    assert len(graph["x_dict"]) > len({dst for _, _, dst in graph["metadata"][1]})  # a type no edge reaches
    with rgnn.torch.no_grad():
        for r, sage in enumerate(layer.relations.convs.values()):
            conv.weight[r] = sage.lin_l.weight.t()
        conv.root.copy_(layer.root.weight.t())
        conv.bias.copy_(layer.root.bias)
        inputs = dict(graph, x=graph["x"].double(), x_dict={t: x.double() for t, x in graph["x_dict"].items()})
        rgnn.torch.testing.assert_close(hetero(inputs), rgcn(inputs))
