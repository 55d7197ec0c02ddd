"""Speeding up an existing PyG model without rewriting it."""
import torch
import torch_geometric.nn as pyg_nn

from .gat import GATConv
from .gatv2 import GATv2Conv
from .gcn import GCNConv
from .generic import geot_class, propagates_on_geot
from .gin import GINConv
from .hgt import HGTConv
from .propagations import APPNP, ChebConv, ClusterGCNConv, GraphConv, LGConv, SGConv, TAGConv
from .rgat import RGATConv
from .rgcn import RGCNConv
from .sage import SAGEConv
from .transformer import TransformerConv

GEOT_LAYERS = {
    pyg_nn.GCNConv: GCNConv,
    pyg_nn.SAGEConv: SAGEConv,
    pyg_nn.GINConv: GINConv,
    pyg_nn.GATConv: GATConv,
    pyg_nn.GATv2Conv: GATv2Conv,
    pyg_nn.RGCNConv: RGCNConv,
    pyg_nn.TransformerConv: TransformerConv,
    pyg_nn.RGATConv: RGATConv,
    pyg_nn.HGTConv: HGTConv,
    pyg_nn.SGConv: SGConv,
    pyg_nn.TAGConv: TAGConv,
    pyg_nn.APPNP: APPNP,
    pyg_nn.ChebConv: ChebConv,
    pyg_nn.ClusterGCNConv: ClusterGCNConv,
    pyg_nn.GraphConv: GraphConv,
    pyg_nn.LGConv: LGConv,
}


def patch(model: torch.nn.Module, strict: bool = False) -> torch.nn.Module:
    """Turns every PyG GCNConv, SAGEConv, GINConv, GATConv, GATv2Conv, RGCNConv, RGATConv,
    HGTConv, SGConv, TAGConv, APPNP, ChebConv, ClusterGCNConv, GraphConv,
    LGConv and TransformerConv in
    ``model`` (the model itself included, and the per-edge-type copies that
    ``to_hetero`` and ``HeteroConv`` hold) into its geot version, in place,
    and gives every other ``MessagePassing`` layer whose message geot
    understands (``x_j`` or a per-edge weight times ``x_j``, see
    :mod:`geot.nn.generic`) geot's propagate.

    The layer's class changes, nothing else: it keeps its parameters (the
    same tensors, so an optimizer built before still trains them), buffers,
    hooks and options. Subclasses of those PyG layers get geot's
    propagate only (their forward may differ). A call with an input or option geot does not run
    natively runs PyG's forward (one :class:`geot.nn.GeotFallbackWarning`
    per layer and reason), so a patched model runs wherever PyG's does.
    ``strict=True`` raises ``NotImplementedError`` instead for a layer whose
    options keep every call on PyG's forward. Returns ``model``.

    torch.compile then compiles the patched model whole, even where the
    process compiled it (or another model of its class) with PyG's layers
    first: see :func:`_recompile_containers`.
    """
    patched = []
    for name, module in model.named_modules():
        new_class = GEOT_LAYERS.get(type(module))
        if new_class is None and propagates_on_geot(module):
            new_class = geot_class(type(module))
        if new_class is None:
            continue
        pyg_class = module.__class__
        module.__class__ = new_class
        reason = module.unsupported_options()  # reads PyG's attributes only
        if strict and reason is not None:
            module.__class__ = pyg_class
            raise NotImplementedError(f"patch: layer {name or '<model>'} runs PyG's forward: {reason}")
        module._geot_init()
        patched.append(name)
    _recompile_containers(model, patched)
    return model


def _recompile_containers(model: torch.nn.Module, patched) -> None:
    """Forgets what dynamo compiled, or gave up compiling, of the forward of
    every module holding a patched layer. PyG's compiled layers break their
    graph (GCN's normalization, for one), and a break inside a loop over the
    layers makes dynamo skip that forward's code for good: compiled after
    patch, the model would run as one compiled graph per layer with eager
    steps between (on the H200, a GCN training step on cora and citeseer
    took 1.4-1.6x eager's time so). Other compiled models of the same
    classes recompile on their next call."""
    forget = getattr(torch._dynamo.eval_frame, "remove_from_cache", None)  # a torch internal: absent, skip
    if not patched or forget is None or torch.compiler.is_compiling():
        return
    holders = {".".join(parts[:i]) for parts in (name.split(".") for name in patched if name)
               for i in range(len(parts))}  # the ancestors' names ("" is the model)
    modules = dict(model.named_modules())
    for name in holders:
        forward = getattr(type(modules[name]), "forward", None)
        if hasattr(forward, "__code__"):
            forget(forward)
