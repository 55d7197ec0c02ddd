"""A pytest plugin that runs PyG's own tests with geot's layers in place of
PyG's GCNConv, SAGEConv, GINConv, GATConv and RGCNConv (a conformance
check of geot.nn as a drop-in). With PyG's test files at the installed
version's tag (from a PyG checkout):

    PYTHONPATH=$PWD:$PWD/scripts python -m pytest -p pyg_swap \\
        $PYG/test/nn/conv/test_{gcn,sage,gin,gat,rgcn}_conv.py
"""
import torch_geometric.nn as pyg_nn
import torch_geometric.nn.conv as pyg_conv

import geot.nn

for _name in ("GCNConv", "SAGEConv", "GINConv", "GATConv", "RGCNConv"):
    setattr(pyg_nn, _name, getattr(geot.nn, _name))
    setattr(pyg_conv, _name, getattr(geot.nn, _name))
