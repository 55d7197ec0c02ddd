"""Builds geot._C: CPU kernels always, CUDA kernels when a CUDA toolkit is found.

Project metadata is in pyproject.toml, the version in geot/_version.py.

    python setup.py build_ext --inplace                   # in place (make build)
    pip wheel --no-build-isolation --no-deps -w dist .    # a wheel for this torch

Environment:
  FORCE_CUDA=1           build the CUDA kernels even if no GPU is visible
  GEOT_NO_CUDA=1         build the CPU kernels only
  TORCH_CUDA_ARCH_LIST   GPU architectures (default: the visible GPU's, else "9.0")
  CUDA_HOME              CUDA toolkit (default: /usr/local/cuda when it has nvcc)
"""
import glob
import os

from setuptools import setup

if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"  # torch would guess from the nvcc on PATH

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def with_cuda() -> bool:
    if os.environ.get("GEOT_NO_CUDA") == "1":
        return False
    if os.environ.get("FORCE_CUDA") == "1":
        return True
    return CUDA_HOME is not None and torch.version.cuda is not None


def extension():
    sources = sorted(glob.glob("csrc/*.cpp"))
    cxx = ["-O3", "-fopenmp"]
    if not with_cuda():
        return CppExtension("geot._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        print("geot: no GPU visible, building for TORCH_CUDA_ARCH_LIST=9.0 (sm_90)")
    nvcc = ["-O3", "-lineinfo"]
    return CUDAExtension(
        "geot._C",
        sources + sorted(glob.glob("csrc/*.cu")),
        define_macros=[("GEOT_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"],
    )


def torch_requirement() -> str:
    """The extension links against this torch's C++ ABI: the wheel needs the
    same minor version at run time."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
    install_requires=[torch_requirement(), "numpy"],
)
