"""Index validation (sorted, in range) and the per-index caches.

Validation is on by default. It costs one pass over the index and, on CUDA,
one device->host sync, once per index tensor: results are cached (keyed by
storage, offset, length, stride, dtype and version counter), so a static
graph is checked once. Turn it off to skip even that; the kernel selector
then lacks the long-segment hint the check records. With it off the kernels
still never read or write out of bounds: out-of-range ids are skipped and an
unsorted index gives a wrong result.

The segment-parallel CUDA schedule (SP) reads segment offsets rather than
the index. They are derived once per sorted index, keyed the same way, and
held on the GPU (8 bytes per segment, a few indices at most) until the index
is freed or changed in place, or :func:`clear_cache` is called. Inference
tensors have no version counter: they are never cached, and SP derives
their offsets on every call. A CUDA graph capture reads the cached offsets
only of indices declared static (:func:`mark_static_index`).
"""
import contextlib

from . import _C


def set_validation(enabled: bool) -> None:
    _C.set_validation(bool(enabled))


def validation_enabled() -> bool:
    return _C.validation_enabled()


def clear_cache() -> None:
    """Frees the segment offsets cached on the GPU for sorted indices, but
    for those a captured CUDA graph reads (freed with their index)."""
    _C.clear_segment_offsets()


def mark_static_index(index) -> None:
    """Declares that ``index``'s values stay as they are while CUDA graphs
    that read it are replayed (a static graph, as geot.nn keeps). A CUDA
    graph capture then reads the segment offsets an eager call cached for
    it (and keeps them, pinned, until the index is freed) instead of deriving
    them on every replay. Without it a capture derives its own: the index
    may be a static buffer that each replay refills with a new graph. An
    in-place change of the index ends the declaration."""
    _C.mark_static_index(index)


@contextlib.contextmanager
def validation(enabled: bool):
    """Context manager: ``with geot.validation.validation(False): ...``."""
    previous = validation_enabled()
    set_validation(enabled)
    try:
        yield
    finally:
        set_validation(previous)
