"""A PyG ``Aggregation`` on geot's segment reductions."""
from typing import Optional

from torch import Tensor
from torch_geometric.nn.aggr import Aggregation

from ..index import index_segment_reduce
from ..segment import REDUCTIONS, segment_reduce
from .graph import sorted_index


class SegmentAggregation(Aggregation):
    """``aggr=`` for any ``MessagePassing`` layer: sum, mean, max or min of the
    messages per destination, on geot.

    ``MessagePassing(aggr=geot.nn.SegmentAggregation("mean"))`` reduces the
    [E, *] messages with ``geot.segment_reduce`` when the destination index
    is sorted (or PyG passes ``ptr``), else with ``geot.index_segment_reduce``
    over the destination-sorted order, which reads the messages in place (no
    permuted copy). That order is cached on the tensor the index is a view
    of (usually ``edge_index``); see :func:`geot.nn.graph.sorted_index`.
    Empty segments give 0 (PyG's max/min give 0 too).
    """

    def __init__(self, reduce: str = "sum"):
        super().__init__()
        reduce = "sum" if reduce == "add" else reduce
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS} (or 'add'), got {reduce!r}")
        self.reduce = reduce

    def forward(self, x: Tensor, index: Optional[Tensor] = None, ptr: Optional[Tensor] = None,
                dim_size: Optional[int] = None, dim: int = -2, max_num_elements: Optional[int] = None) -> Tensor:
        if dim % x.dim() != 0:
            raise ValueError(f"SegmentAggregation reduces dimension 0 of the messages, got dim={dim} "
                             f"for x of shape {tuple(x.shape)}")
        if index is None:
            raise ValueError("SegmentAggregation needs the index of the messages' destinations")
        if ptr is not None:  # PyG passes ptr only for an index sorted by destination
            return segment_reduce(index, x, self.reduce, dim_size)
        perm, ordered = sorted_index(index)
        if perm is None:
            return segment_reduce(index, x, self.reduce, dim_size)
        return index_segment_reduce(perm, ordered, x, self.reduce, dim_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reduce!r})"
