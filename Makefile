# Quick start:  make demo   (builds, then trains a GCN on geot layers vs PyG: geot.demo)
#               make test   (builds, then runs the test suite)
#               make wheel  (dist/geot-*.whl with the compiled kernels, for this torch)
PYTHON ?= python3
CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)
export CUDA_HOME
MAX_JOBS ?= $(shell nproc)
export MAX_JOBS

.PHONY: deps build demo test bench wheel clean

deps:  # torch only if missing: a GPU machine keeps the torch it has
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.14.1
	@$(PYTHON) -c "import numpy, pytest, ninja, pandas, tqdm, torch_geometric, scipy, matplotlib, sklearn" 2>/dev/null || \
		$(PYTHON) -m pip install -q numpy pytest ninja pandas tqdm torch-geometric scipy matplotlib scikit-learn

build: deps  # in place, incremental (ninja): geot imports from the checkout
	$(PYTHON) setup.py build_ext --inplace

demo: build
	$(PYTHON) -m geot.demo

test: build
	$(PYTHON) -m pytest -q tests

bench: build
	$(PYTHON) bench/segment_reduce.py

wheel: deps  # in the tree: reuses the in-place build's objects
	$(PYTHON) -m pip wheel --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build dist geot/*.so
