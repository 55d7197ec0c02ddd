"""PyTorch Geometric layers on geot's kernels (needs torch_geometric).

* ``GCNConv``, ``SAGEConv``, ``GINConv``, ``GATConv``, ``GATv2Conv``, ``RGCNConv``, ``RGATConv``,
  ``HGTConv``, ``SGConv``, ``TAGConv``, ``APPNP``, ``ChebConv``, ``ClusterGCNConv``,
  ``GraphConv``, ``LGConv``, ``TransformerConv``: drop-in
  subclasses of PyG's layers, same constructor, parameters and forward; a
  call geot does not run natively runs PyG's forward
  (:class:`GeotFallbackWarning`).
* :func:`patch`: converts the PyG layers of an existing model in place;
  other ``MessagePassing`` layers whose message is ``x_j`` or a weighted
  ``x_j`` propagate on geot (:mod:`geot.nn.generic`, :func:`explain`).
* :class:`SegmentAggregation`: ``MessagePassing(aggr=SegmentAggregation("sum"))``.
"""
try:
    import torch_geometric  # noqa: F401
except ImportError as error:  # geot itself does not need PyG; geot.nn does
    raise ImportError("geot.nn needs PyTorch Geometric: pip install torch-geometric") from error

from .aggr import SegmentAggregation
from .gat import GATConv
from .gatv2 import GATv2Conv
from .gcn import GCNConv
from .generic import explain, geot_class
from .gin import GINConv
from .graph import SortedGraph, UncachedGraphWarning, sorted_graph, sorted_index
from .hgt import HGTConv
from .layer import GeotFallbackWarning
from .propagations import APPNP, ChebConv, ClusterGCNConv, GraphConv, LGConv, SGConv, TAGConv
from .patch import patch
from .rgat import RGATConv
from .rgcn import RGCNConv
from .sage import SAGEConv
from .transformer import TransformerConv

__all__ = ["APPNP", "ChebConv", "ClusterGCNConv", "GATConv", "GATv2Conv", "GCNConv", "GeotFallbackWarning", "GINConv",
           "GraphConv", "HGTConv", "LGConv", "RGATConv", "RGCNConv", "SAGEConv", "SGConv", "SegmentAggregation", "SortedGraph", "TAGConv",
           "TransformerConv", "UncachedGraphWarning", "explain", "geot_class", "patch", "sorted_graph",
           "sorted_index"]
