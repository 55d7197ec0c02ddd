"""Speeding up an existing PyG model without rewriting it."""
import warnings

import torch
import torch_geometric.nn as pyg_nn

from . import conv

GEOT_LAYERS = {
    pyg_nn.GCNConv: conv.GCNConv,
    pyg_nn.SAGEConv: conv.SAGEConv,
    pyg_nn.GINConv: conv.GINConv,
    pyg_nn.GATConv: conv.GATConv,
    pyg_nn.RGCNConv: conv.RGCNConv,
}


def patch(model: torch.nn.Module, strict: bool = True) -> torch.nn.Module:
    """Turns every PyG GCNConv, SAGEConv, GINConv, GATConv and RGCNConv in
    ``model`` (the model itself included) into its geot version, in place.

    The layer's class changes, nothing else: it keeps its parameters (the
    same tensors, so an optimizer built before still trains them), buffers,
    hooks and options. Subclasses of the PyG layers are left alone (their
    forward may differ). A layer with an option geot does not support raises
    ``NotImplementedError`` (``strict=False``: it stays a PyG layer, with a
    warning). Returns ``model``.
    """
    for name, module in model.named_modules():
        geot_class = GEOT_LAYERS.get(type(module))
        if geot_class is None:
            continue
        pyg_class = module.__class__
        module.__class__ = geot_class
        try:
            module._geot_init()
        except NotImplementedError as error:
            module.__class__ = pyg_class
            if strict:
                raise NotImplementedError(f"patch: layer {name or '<model>'}: {error}") from error
            warnings.warn(f"geot.nn.patch: layer {name or '<model>'} left as PyG: {error}")
    return model
