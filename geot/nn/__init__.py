"""PyTorch Geometric layers on geot's kernels (needs torch_geometric).

* ``GCNConv``, ``SAGEConv``, ``GINConv``, ``GATConv``, ``RGCNConv``: drop-in
  subclasses of PyG's layers, same constructor, parameters and forward.
* :func:`patch`: converts the PyG layers of an existing model in place.
* :class:`SegmentAggregation`: ``MessagePassing(aggr=SegmentAggregation("sum"))``.
"""
try:
    import torch_geometric  # noqa: F401
except ImportError as error:  # geot itself does not need PyG; geot.nn does
    raise ImportError("geot.nn needs PyTorch Geometric: pip install torch-geometric") from error

from .aggr import SegmentAggregation
from .conv import GATConv, GCNConv, GINConv, RGCNConv, SAGEConv
from .graph import SortedGraph, UncachedGraphWarning, sorted_graph, sorted_index
from .patch import patch

__all__ = ["GATConv", "GCNConv", "GINConv", "RGCNConv", "SAGEConv", "SegmentAggregation", "SortedGraph",
           "UncachedGraphWarning", "patch", "sorted_graph", "sorted_index"]
