"""The graph inputs PyG layers take, as one edge list.

A layer's ``edge_index`` may be a [2, E] index tensor (or PyG's
``EdgeIndex``), a ``torch.sparse`` adjacency ``adj_t`` (COO, CSR or CSC, of
shape [N_dst, N_src]) or a ``torch_sparse.SparseTensor`` ``adj_t``.
:func:`edges_of` turns each into an :class:`Edges`: a
[2, E] tensor whose row 0 holds the sources and row 1 the destinations, the
adjacency's values and sizes. An adjacency is converted once per input
tensor and kept with it (a new tensor, or an in-place change of this one,
converts again), so the graph caches of :mod:`geot.nn.graph`, keyed by the
edge tensor, work for every input kind. (PyG's ``flow="target_to_source"``
reads row 0 as destinations: a variant of the sorted graph, see there.)
"""
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary
from torch_geometric.typing import SparseTensor


class Edges(NamedTuple):
    index: Tensor                     # [2, E]: row 0 sources, row 1 destinations
    values: Optional[Tensor]          # [E] an adjacency's values as given (None: an edge_index, or none)
    weights: Optional[Tensor]         # [E] its floating-point values, None where none or all one
    size: Optional[Tuple[int, int]]   # (sources, destinations) of an adjacency; None for an edge_index
    kind: str                         # "edge_index", "torch.sparse" or "SparseTensor"
    sorted: bool                      # whether row 1 is known to be sorted


_converted = WeakTensorKeyDictionary()  # adjacency -> (version key, Edges)


def input_kind(edge_index) -> Optional[str]:
    """"edge_index", "torch.sparse", "SparseTensor", or None for anything else."""
    if isinstance(edge_index, SparseTensor):
        return "SparseTensor"
    if not isinstance(edge_index, Tensor):
        return None
    if edge_index.layout == torch.strided:
        return "edge_index"
    return "torch.sparse" if edge_index.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc) else None


def edges_of(edge_index) -> Edges:
    """The graph input (of a kind :func:`input_kind` names) as an :class:`Edges`."""
    kind = input_kind(edge_index)
    if kind == "edge_index":
        return Edges(edge_index, None, None, None, kind, bool(getattr(edge_index, "is_sorted_by_col", False)))
    if torch.compiler.is_compiling():
        return _convert_eagerly(edge_index)
    key = _input_version(edge_index, kind)
    entry = _converted.get(edge_index)
    if entry is not None and entry[0] == key:
        return entry[1]
    edges = _convert(edge_index, kind)
    _converted[edge_index] = (key, edges)
    return edges


@torch.compiler.disable
def _convert_eagerly(edge_index):
    """Compiled code converts outside the graph (sparse layouts are not traceable)."""
    return edges_of(edge_index)


def _convert(edge_index, kind: str) -> Edges:
    if kind == "SparseTensor":
        dst, src, values = edge_index.coo()
        num_dst, num_src = edge_index.sparse_sizes()
        return Edges(torch.stack([src, dst]), values, _weights(values), (num_src, num_dst), kind, True)
    return _convert_torch_sparse(edge_index)


def _convert_torch_sparse(adj_t: Tensor) -> Edges:
    """A torch.sparse adj_t [N_dst, N_src]: row r, column c is an edge c -> r."""
    if adj_t.dim() != 2:
        raise ValueError(f"a sparse adjacency must be 2-D [num_dst, num_src], got shape {tuple(adj_t.shape)}")
    num_dst, num_src = adj_t.shape
    if adj_t.layout == torch.sparse_coo:
        adj_t = adj_t.coalesce()  # as PyG's spmm (duplicates summed)
        dst, src = adj_t.indices()
        is_sorted = True
    elif adj_t.layout == torch.sparse_csr:
        src = adj_t.col_indices()
        dst = _expand(adj_t.crow_indices(), src)
        is_sorted = True
    else:  # CSC
        dst = adj_t.row_indices()
        src = _expand(adj_t.ccol_indices(), dst)
        is_sorted = False
    values = adj_t.values()
    if values.dim() != 1:
        raise ValueError(f"a sparse adjacency must hold one value per edge, got values of shape "
                         f"{tuple(values.shape)}")
    return Edges(torch.stack([src, dst]), values, _weights(values), (num_src, num_dst), "torch.sparse", is_sorted)


def _expand(pointers: Tensor, like: Tensor) -> Tensor:
    """Compressed pointers [R + 1] to the row of each of their entries."""
    rows = torch.arange(pointers.numel() - 1, device=pointers.device, dtype=like.dtype)
    return torch.repeat_interleave(rows, pointers.diff(), output_size=like.numel())


def _input_version(edge_index, kind: str):
    if kind == "SparseTensor":
        row, col, value = edge_index.coo()
        tensors = (row, col) if value is None else (row, col, value)
    elif kind == "edge_index":
        tensors = (edge_index,)
    elif edge_index.layout == torch.sparse_coo:
        tensors = (edge_index._indices(), edge_index._values())
    elif edge_index.layout == torch.sparse_csr:
        tensors = (edge_index.crow_indices(), edge_index.col_indices(), edge_index.values())
    else:
        tensors = (edge_index.ccol_indices(), edge_index.row_indices(), edge_index.values())
    return tuple((t.data_ptr(), t._version, tuple(t.shape), t.device) for t in tensors)


@torch.compiler.disable  # a sync (and dynamo fails on frames holding a sparse adjacency's values)
def _weights(values: Optional[Tensor]) -> Optional[Tensor]:
    """An adjacency's floating-point values, or None where they are all one
    (the unweighted kernels then run): one device->host sync per adjacency."""
    if values is None or not values.is_floating_point() or values.dim() != 1:
        return None
    return None if bool((values == 1).all()) else values
