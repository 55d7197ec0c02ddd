"""Switch for index value validation (sorted, in range).

On by default. It costs one pass over the index and, on CUDA, one
device->host sync, once per index tensor: results are cached (keyed by
storage, offset, length, stride, dtype and version counter), so a static
graph is checked once. Turn it off to skip even that; the kernel selector
then lacks the long-segment hint the check records. With it off the kernels still never read or write out of bounds:
out-of-range ids are skipped and an unsorted index gives a wrong result.
"""
import contextlib

from . import _C


def set_validation(enabled: bool) -> None:
    _C.set_validation(bool(enabled))


def validation_enabled() -> bool:
    return _C.validation_enabled()


@contextlib.contextmanager
def validation(enabled: bool):
    """Context manager: ``with geot.validation.validation(False): ...``."""
    previous = validation_enabled()
    set_validation(enabled)
    try:
        yield
    finally:
        set_validation(previous)
