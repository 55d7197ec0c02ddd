"""Shared fixtures: the device parametrization and per-test seeding."""
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")

# Every value dtype the ops take (float64 also on CUDA unless an op says not).
DTYPES = [
    pytest.param(torch.float32, id="f32"),
    pytest.param(torch.float16, id="f16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float64, id="f64"),
]

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=requires_cuda),
]


@pytest.fixture(params=DEVICES)
def device(request):
    """Runs a test once on CPU and once on CUDA (skipped without a GPU)."""
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh but reproducible random inputs: the seed is derived from the test
    id, so each parametrization draws different data and a failure replays."""
    seed = zlib.crc32(request.node.nodeid.encode()) & 0x7FFFFFFF
    torch.manual_seed(seed)
    yield seed


@pytest.fixture(autouse=True)
def _restore_validation():
    """Tests may switch geot's index validation off; always switch it back."""
    try:
        import geot
    except Exception:  # geot not built yet: tests that need it fail on import anyway
        yield
        return
    before = geot.validation_enabled()
    yield
    geot.set_validation(before)
