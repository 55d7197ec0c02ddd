"""Fits geot's kernel-config rules to this GPU, from a source checkout.

    python -m geot.tune [all] [sweep options]   sweep, train, rebuild (default; needs a GPU)
    python -m geot.tune sweep [sweep options]   perfdb/sweep.py only (needs a GPU)
    python -m geot.tune train [--no-build] [train_tree.py options]
                                                scripts/train_tree.py on the perf DBs there are, then
                                                the rebuild (works without a GPU)

Sweep options (e.g. --full, --budget-s) go to perfdb/sweep.py unchanged.
The perf DB (perfdb/<gpu>/) and the generated rules (csrc/generated/) are
left in the checkout to commit.
"""
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("all", "sweep", "train")


def fail(message: str) -> None:
    raise SystemExit(f"geot.tune: {message}")


def checkout_file(*parts: str) -> str:
    path = os.path.join(ROOT, *parts)
    if not os.path.exists(path):
        fail(f"{os.path.join(*parts)} not found under {ROOT}: run from a geot source checkout")
    return path


def run_sweep(sweep_args: List[str]) -> None:
    import torch

    import geot

    if not torch.cuda.is_available():
        fail("the sweep times kernels on a CUDA GPU and none is visible; "
             "`python -m geot.tune train` fits the rules to the perf DBs already in perfdb/")
    if not geot.cuda_built:
        fail("geot was built without its CUDA kernels; rebuild with a CUDA toolkit (python setup.py build_ext --inplace)")
    command = [sys.executable, checkout_file("perfdb", "sweep.py"), *sweep_args]
    print(f"geot.tune: sweep: {' '.join(command[1:])}", flush=True)
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        fail("the sweep failed (it resumes where it stopped when run again)")


def run_training(train_args: List[str]):
    """scripts/train_tree.py's main; returns its summary table."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        fail("training needs scikit-learn: pip install scikit-learn")
    spec = importlib.util.spec_from_file_location("train_tree", checkout_file("scripts", "train_tree.py"))
    train_tree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tree)
    print("geot.tune: training the config rules (scripts/train_tree.py)", flush=True)
    try:
        return train_tree, train_tree.main(train_args)
    except ValueError as err:
        fail(str(err))


def rebuild() -> None:
    print("geot.tune: rebuilding the extension (python setup.py build_ext --inplace)", flush=True)
    build = subprocess.run([sys.executable, checkout_file("setup.py"), "build_ext", "--inplace"], cwd=ROOT,
                           capture_output=True, text=True)
    if build.returncode != 0:
        print((build.stdout + build.stderr)[-6000:], file=sys.stderr)
        fail("the build failed (output above)")


def report_dispatch() -> None:
    """Which rules the rebuilt extension uses here, and their host cost (a
    fresh interpreter: this one holds the old extension)."""
    probe = (
        "import geot\n"
        "from geot import _C\n"
        "from geot.config import _device_arch, _device_name\n"
        "arch, name = _device_arch(), _device_name()\n"
        "source = geot.explain_source(1 << 20, 1 << 16, 64)\n"
        "ns = _C.selection_cost_ns(1 << 20, 1 << 16, 64, False, 1, arch, 1000000)\n"
        "print(f'dispatch for {name} (sm_{arch}), E=2^20, F=64: {source}; {ns:.1f} ns per call')\n"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


@contextlib.contextmanager
def timed(seconds: Dict[str, float], step: str):
    start = time.monotonic()
    yield
    seconds[step] = time.monotonic() - start


def main(argv: List[str] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    command = argv.pop(0) if argv[:1] and argv[0] in COMMANDS else "all"
    build = "--no-build" not in argv
    argv = [arg for arg in argv if arg != "--no-build"]
    seconds = {}  # wall time of each step, printed at the end (a GPU's whole run should fit in minutes)
    if command in ("all", "sweep"):
        with timed(seconds, "sweep"):
            run_sweep(argv)
        if command == "sweep":
            return
    with timed(seconds, "training"):
        train_tree, summary = run_training(argv if command == "train" else [])
    if build:
        with timed(seconds, "rebuild"):
            rebuild()
        report_dispatch()
    train_tree.print_summary(summary)
    steps = ", ".join(f"{step} {s:.0f} s" for step, s in seconds.items())
    print(f"geot.tune: done ({steps}; {sum(seconds.values()):.0f} s in all); "
          "`git status perfdb csrc/generated` shows what to commit")


if __name__ == "__main__":
    main()
