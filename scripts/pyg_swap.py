"""A pytest plugin that runs PyG's own tests with geot's layers in place of
PyG's: GCNConv, SAGEConv, GINConv, GATConv, GATv2Conv, RGCNConv, RGATConv,
HGTConv and TransformerConv, and the layers
that propagate on geot through geot.nn.generic (APPNP, SGConv, TAGConv,
GraphConv, ChebConv, LGConv, SimpleConv, ClusterGCNConv), also inside
PyG's models (GCN, GraphSAGE, GIN, GAT, ...): a conformance check of
geot.nn as a drop-in. With PyG's test files at the installed version's tag
(from a PyG checkout):

    PYTHONPATH=$PWD:$PWD/scripts python -m pytest -p pyg_swap $PYG/test/nn

(PyG 2.8: every test passes. With FULL_TEST=1, TorchScript checks run too:
on torch 2.14 seven of them fail for PyG alone (GATConv, GATv2Conv,
RGATConv, AttentiveFP, SAGPooling), and
TransformerConv's compares PyG's scripted forward with geot's output under
allclose's default tolerance, which values near 0 miss by a rounding bit in
some draws of the random inputs.)
"""
import sys

import torch_geometric.nn as pyg_nn
import torch_geometric.nn.conv  # noqa: F401  (every layer's module imported before the swap)

import geot.nn

GENERIC = ("APPNP", "SGConv", "TAGConv", "GraphConv", "ChebConv", "LGConv", "SimpleConv", "ClusterGCNConv")

_swapped = {}
for _name in ("GCNConv", "SAGEConv", "GINConv", "GATConv", "GATv2Conv", "RGCNConv", "RGATConv", "HGTConv",
              "TransformerConv") + GENERIC:
    _pyg_layer = getattr(pyg_nn, _name)
    _swapped[_pyg_layer] = getattr(geot.nn, _name) if hasattr(geot.nn, _name) else geot.nn.geot_class(_pyg_layer)

# Every PyG module that bound a layer's name at import (torch_geometric.nn,
# .conv, and users of them such as .models.basic_gnn's GCN, GraphSAGE, GIN
# and GAT) gets geot's; the module defining a layer keeps PyG's, which pickle
# finds there by name (a torch.package export stores geot's layers as PyG's).
for _module in [m for name, m in sys.modules.items() if name.startswith("torch_geometric") and m is not None]:
    for _attr, _value in list(vars(_module).items()):
        if isinstance(_value, type) and _value in _swapped and _value.__module__ != _module.__name__:
            setattr(_module, _attr, _swapped[_value])
