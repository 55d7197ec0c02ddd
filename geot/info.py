"""What this installation of geot holds: ``python -m geot.info [--json]``.

Prints the geot version and where it was imported from; the build (whether
the CUDA kernels were compiled, for which GPU architectures, with which CUDA
toolkit, against which torch) next to the torch running now; the learned
config rules compiled in; and each GPU seen, with whether the build has
kernels for it and which rules its calls use (or "none" without a GPU).
"""
import argparse
import json
import os
import sys
from typing import Dict, List

import torch

import geot
from geot import _C


def _arch_name(arch: int) -> str:
    return f"sm_{arch}"


def build_info() -> Dict:
    """The version and what the extension was compiled with."""
    built = _C.build_info()
    archs = sorted({int(a) // 10 for a in built["cuda_arch_list"].split(",") if a.strip()})
    return {
        "version": geot.__version__,
        "path": os.path.dirname(os.path.abspath(geot.__file__)),
        "cuda_built": bool(geot.cuda_built),
        "cuda_archs": archs,  # major * 10 + minor, e.g. 90 for sm_90
        "cuda": built["cuda"],
        "torch_at_build": built["torch"],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def rule_sets() -> List[Dict]:
    """The learned rule sets compiled in (csrc/generated/rules_index.h)."""
    return geot.rule_sets()


def runs_on(cuda_archs: List[int], arch: int) -> bool:
    """Whether kernels compiled for cuda_archs run on a GPU of compute
    capability arch: the same major version at the same or a lower minor."""
    return any(a // 10 == arch // 10 and a <= arch for a in cuda_archs)


def gpus(info: Dict) -> List[Dict]:
    """Each visible GPU, whether the build has kernels for it, and which
    selector picks its configs."""
    if not torch.cuda.is_available():
        return []
    seen = []
    for device in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(device)
        arch = major * 10 + minor
        seen.append({
            "index": device,
            "name": torch.cuda.get_device_name(device),
            "arch": arch,
            "kernels": info["cuda_built"] and runs_on(info["cuda_archs"], arch),
            "config_rules": geot.explain_source(1 << 20, 1 << 16, 64, arch=arch,
                                                gpu=torch.cuda.get_device_name(device)),
        })
    return seen


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def report() -> Dict:
    info = build_info()
    return {**info, "rules": rule_sets(), "rules_mode": geot.rules_mode(), "gpus": gpus(info)}


def print_report(r: Dict) -> None:
    print(f"geot       {r['version']} ({r['path']})")
    if r["cuda_built"]:
        archs = ", ".join(map(_arch_name, r["cuda_archs"])) or "unknown architectures"
        build = f"CUDA and CPU kernels; CUDA kernels for {archs}, CUDA {r['cuda']}"
    else:
        build = "CPU kernels only (built without a CUDA toolkit, or with GEOT_NO_CUDA=1)"
    print(f"build      {build}; compiled against torch {r['torch_at_build']}")
    print(f"torch      {r['torch']} (CUDA {r['torch_cuda'] or 'none'})")
    if _minor(r["torch"]) != _minor(r["torch_at_build"]):
        print(f"           warning: geot was compiled against torch {r['torch_at_build']}; rebuild it for this torch")
    sets = [f"{s['slug']} ({_arch_name(s['arch'])}{', its fallback' if s['arch_fallback'] else ''}) from "
            f"{s['source']} (" + ", ".join(family for family in ("plain", "gathered") if s[family]) + " rows)"
            for s in r["rules"]]
    print(f"rules      {'; '.join(sets) or 'none'}; mode {r['rules_mode']} "
          "(a GPU uses its model's rules, else its architecture's fallback (the nearest of the same major "
          "version), else the hand heuristic)")
    if not r["gpus"]:
        print("GPU        none")
    for gpu in r["gpus"]:
        kernels = "kernels compiled for it" if gpu["kernels"] else (
            f"no kernels for {_arch_name(gpu['arch'])} in this build: rebuild with "
            f"TORCH_CUDA_ARCH_LIST={gpu['arch'] // 10}.{gpu['arch'] % 10}" if r["cuda_built"] else "CPU-only build")
        print(f"GPU {gpu['index']:<6} {gpu['name']} ({_arch_name(gpu['arch'])}): {kernels}; "
              f"configs: {gpu['config_rules']}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    r = report()
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
    else:
        print_report(r)


if __name__ == "__main__":
    main()
