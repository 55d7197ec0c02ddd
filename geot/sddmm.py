"""sddmm: a value per edge from the rows at its two ends (FeatGraph's
generalized SDDMM), with no [E, F] gather for ``dot``.

``out[e] = op(a[src_index[e]], b[dst_index[e]])``
"""
import torch

from . import _ops  # noqa: F401  (operator registration, edge_dot's autograd formula)

OPS = ("dot", "add", "sub", "mul", "div")
_ELEMENTWISE = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def sddmm(src_index: torch.Tensor, dst_index: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
          op: str = "dot") -> torch.Tensor:
    """Per-edge values from source rows ``a`` and destination rows ``b``.

    Args:
        src_index, dst_index: [E] int32/int64, the two ends of each edge, any
            order (a link-prediction batch, a graph's edge list).
        a: [N_src, F] or [N_src, H, C] float rows of the sources.
        b: [N_dst, F] or [N_dst, H, C] rows of the destinations, same
            trailing shape and dtype as ``a``.
        op: ``"dot"``: the dot product of the two rows, [E] (or [E, H], one
            per head: GAT-style scores, link-prediction decoders), one fused
            kernel that never materializes the gathered rows, forward and
            backward (the gradients scatter with atomics, so they are not
            bitwise repeatable on CUDA). ``"add"``, ``"sub"``, ``"mul"``,
            ``"div"``: the elementwise result, [E, *trailing shape] (torch's
            gathers and op: the output is as large as the gathered rows).

    Gradients flow to ``a`` and ``b``.
    """
    _check(src_index, dst_index, a, b, op)
    if op != "dot":
        _check_range(src_index, a.size(0), "src_index", "a")  # index_select on CUDA would assert on the device
        _check_range(dst_index, b.size(0), "dst_index", "b")
        return _ELEMENTWISE[op](a.index_select(0, src_index), b.index_select(0, dst_index))
    heads = 1 if a.dim() == 2 else a.size(1)
    out = torch.ops.geot.edge_dot(src_index, dst_index, b, a, heads)  # its autograd formula: geot._ops
    return out.view(-1) if a.dim() == 2 else out


def _check(src_index, dst_index, a, b, op) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    for name, index in (("src_index", src_index), ("dst_index", dst_index)):
        if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got "
                            f"{getattr(index, 'dtype', type(index).__name__)} of shape {tuple(getattr(index, 'shape', ()))}")
    if src_index.shape != dst_index.shape:
        raise ValueError(f"src_index and dst_index must have the same length, got {src_index.numel()} and "
                         f"{dst_index.numel()}")
    for name, rows in (("a", a), ("b", b)):
        if not isinstance(rows, torch.Tensor) or not rows.is_floating_point() or rows.dim() not in (2, 3):
            raise TypeError(f"{name} must be a float tensor of shape [N, F] or [N, H, C], got "
                            f"{getattr(rows, 'dtype', type(rows).__name__)} of shape {tuple(getattr(rows, 'shape', ()))}")
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
        raise ValueError(f"a and b must have the same row shape and dtype, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")


def _check_range(index: torch.Tensor, rows: int, name: str, rows_name: str) -> None:
    if index.numel() and not torch.compiler.is_compiling() and bool((index.min() < 0) | (index.max() >= rows)):
        raise ValueError(f"{name} has values outside [0, {rows_name}.size(0) = {rows})")
