"""A pytest plugin that runs PyG's own tests with geot's layers in place of
PyG's: GCNConv, SAGEConv, GINConv, GATConv, GATv2Conv, RGCNConv, RGATConv,
HGTConv and TransformerConv, and the layers
that propagate on geot through geot.nn.generic (APPNP, SGConv, TAGConv,
GraphConv, ChebConv, LGConv, SimpleConv, ClusterGCNConv): a
conformance check of geot.nn as a drop-in. With PyG's test files at the
installed version's tag (from a PyG checkout):

    PYTHONPATH=$PWD:$PWD/scripts python -m pytest -p pyg_swap \\
        $PYG/test/nn/conv/test_{gcn,sage,gin,gat,gatv2,rgcn,rgat,hgt}_conv.py $PYG/test/nn/conv/test_appnp.py ...
"""
import torch_geometric.nn as pyg_nn
import torch_geometric.nn.conv as pyg_conv

import geot.nn

GENERIC = ("APPNP", "SGConv", "TAGConv", "GraphConv", "ChebConv", "LGConv", "SimpleConv", "ClusterGCNConv")

for _name in ("GCNConv", "SAGEConv", "GINConv", "GATConv", "GATv2Conv", "RGCNConv", "RGATConv", "HGTConv",
              "TransformerConv") + GENERIC:
    _layer = getattr(geot.nn, _name) if hasattr(geot.nn, _name) else geot.nn.geot_class(getattr(pyg_nn, _name))
    setattr(pyg_nn, _name, _layer)
    setattr(pyg_conv, _name, _layer)
