"""python -m geot.info reports the build, the rules compiled in and the GPU
seen; the version is set once (geot/_version.py) and read everywhere."""
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import geot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_info(*args):
    result = subprocess.run([sys.executable, "-m", "geot.info", *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_info_prints_build_rules_and_gpu():
    lines = run_info().splitlines()
    assert lines[0].startswith(f"geot       {geot.__version__} (")
    build = next(line for line in lines if line.startswith("build"))
    assert ("CUDA kernels for sm_" in build) == geot.cuda_built, build
    assert "compiled against torch" in build
    assert any(line.startswith("torch ") for line in lines)
    rules = next(line for line in lines if line.startswith("rules"))
    # sm_90's fallback: the larger perf DB's rules (the H200's 495 cells a family against the H100's 379)
    assert "nvidia-h100-80gb-hbm3 (sm_90) from perfdb/nvidia-h100-80gb-hbm3 (plain, gathered rows)" in rules
    assert "nvidia-h200 (sm_90, its fallback) from perfdb/nvidia-h200 (plain, gathered rows)" in rules
    assert any(line.startswith("GPU") for line in lines)


def test_info_json_matches_the_build():
    report = json.loads(run_info("--json"))
    assert report["version"] == geot.__version__
    assert report["cuda_built"] == geot.cuda_built
    assert bool(report["cuda_archs"]) == geot.cuda_built and (report["cuda"] is not None) == geot.cuda_built
    assert report["torch_at_build"].split(".")[:2] == report["torch"].split(".")[:2]
    assert {(r["slug"], r["arch"], r["source"], r["arch_fallback"]) for r in report["rules"]} >= {
        ("nvidia-h100-80gb-hbm3", 90, "perfdb/nvidia-h100-80gb-hbm3", False), ("nvidia-h200", 90, "perfdb/nvidia-h200", True)}
    assert report["rules_mode"] in ["learned", "heuristic"] + [r["slug"] for r in report["rules"]]
    import torch

    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_runs_on_same_major_at_or_above_the_compiled_minor():
    from geot.info import runs_on

    assert runs_on([90], 90) and runs_on([80], 86) and runs_on([80, 90], 89)
    assert not runs_on([90], 80) and not runs_on([86], 80) and not runs_on([90], 100) and not runs_on([], 90)


def test_one_version():
    from geot import _version

    assert geot.__version__ == _version.__version__
    try:
        assert importlib.metadata.version("geot") == geot.__version__
    except importlib.metadata.PackageNotFoundError:  # imported from the checkout, not installed
        pass
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "geot._version.__version__"}
