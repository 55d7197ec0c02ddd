"""bench/op_memory.py: --compare reads two runs' CSVs and reports the change
per dtype; measuring needs a GPU and says so without one."""
import os
import subprocess
import sys

import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "op_memory.py")


def test_compare_reports_speedups_per_dtype(tmp_path):
    cells = [("pubmed", 64, dtype, op) for dtype in ("bf16", "fp32") for op in ("sum", "mean")]
    before = pd.DataFrame([dict(graph=g, F=f, dtype=d, op=o, ms=2.0, extra_mb=4.8, tag="before")
                           for g, f, d, o in cells])
    after = before.assign(ms=[1.0, 1.0, 2.0, 4.0], extra_mb=1.4, tag="after")
    before.to_csv(tmp_path / "before.csv", index=False)
    after.to_csv(tmp_path / "after.csv", index=False)
    result = subprocess.run([sys.executable, SCRIPT, "--compare", str(tmp_path / "before.csv"),
                             str(tmp_path / "after.csv")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bf16: geomean speedup 2.000 over 2 cells" in result.stdout
    assert "fp32: geomean speedup 0.707 over 2 cells (min 0.500, max 1.000)" in result.stdout


def test_measuring_needs_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, SCRIPT, "--graphs", "cora"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode != 0 and "needs a GPU" in result.stderr
