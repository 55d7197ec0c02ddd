"""GCNConv on geot."""
from typing import NamedTuple, Optional

import torch
import torch_geometric.nn as pyg_nn
from torch import Tensor

from ..segment import segment_reduce
from .common import gather_reduce_nodes, node_inputs, nodes_reason, transposed_order
from .graph import (SortedGraph, call_at_trace_time, checked, fixed_sizes, kept_graph, prepare_for_compiled,
                    sorted_graph, static_addresses, with_transposed)
from .inputs import edges_of, input_kind
from .layer import GeotLayer


class _GCNNorm(NamedTuple):
    edge: Optional[Tensor]    # [E'] per-edge weight in graph order (None: unweighted, normalize=False)
    loop: Optional[Tensor]    # [N, 1] added self loops' weight (None without them)


# How the self loops GCN adds meet the input's, per input kind (as PyG's gcn_norm does it):
# an edge_index's loops are replaced by one per node, weighted as the node's last input loop where
# edge_weight is given; a torch.sparse adjacency keeps its loops and gains one of fill weight per node;
# a SparseTensor's diagonal is set to the fill weight.
_LOOPS = {"edge_index": "replace", "torch.sparse": "add", "SparseTensor": "fill"}


class GCNConv(GeotLayer, pyg_nn.GCNConv):
    """``torch_geometric.nn.GCNConv`` on geot: the normalized sum is one
    ``index_weight_segment_reduce``; the self loops ``add_self_loops`` adds
    are a dense term, not extra edges. The normalization depends only on the
    graph, so it is computed once per graph and kept with the sorted graph
    (see :mod:`geot.nn.graph`): a new ``edge_index`` tensor or an in-place
    change of it recomputes it, as do a new ``edge_weight`` tensor, an
    in-place change of it, another node count, dtype or option; an
    ``edge_weight`` that requires grad is normalized on every call.
    ``cached=True`` keeps the sorted graph and its normalization from the
    first call, for every later call (as in PyG: later graphs are ignored);
    ``reset_parameters`` clears it. Takes what PyG's layer takes: an
    ``edge_index`` (either ``flow``), a ``torch.sparse`` or ``SparseTensor``
    ``adj_t`` (its values are the edge weights), static graphs ``x`` [B, N,
    F]; other aggregations, explain mode and message-passing hooks run
    PyG's forward."""

    def _geot_init(self) -> None:
        super()._geot_init()
        self._geot_norm = None  # (SortedGraph, _GCNNorm, weights in transposed order) when cached
        if "_cached_edge_index" in self.__dict__:  # a patched PyG layer's cache: now behind the property
            self._cached_edge_index = self.__dict__.pop("_cached_edge_index")

    def reset_parameters(self):
        super().reset_parameters()
        self._geot_norm = None

    # PyG's cache of the normalized graph, read by its forward (the fallback) and by users: made from
    # geot's own cache where that is set.
    @property
    def _cached_edge_index(self):
        if self.__dict__.get("_geot_norm") is not None:
            return _as_pyg_cache(*self._geot_norm[:2], self._flipped())
        return self.__dict__.get("_geot_pyg_cache")

    @_cached_edge_index.setter
    def _cached_edge_index(self, value):
        self.__dict__["_geot_pyg_cache"] = value
        if value is None:
            self.__dict__["_geot_norm"] = None

    def _pyg_attributes(self) -> dict:
        return {"_cached_edge_index": self._cached_edge_index}

    def _kept_caches(self) -> dict:
        return {"_geot_pyg_cache": self._cached_edge_index}  # in PyG's form: the sorted graph is remade

    def forward(self, x: Tensor, edge_index, edge_weight: Optional[Tensor] = None) -> Tensor:
        reason = self._call_reason(x, edge_index)
        if reason is not None:
            return self._pyg_forward(reason, x, edge_index, edge_weight)
        num_nodes = x.size(-2)
        h = self.lin(x)
        graph, norm, edge_t = self._graph_and_norm(edge_index, edge_weight, num_nodes, x.dtype, h.dtype)
        out = gather_reduce_nodes(graph, h, "sum", num_nodes, norm.edge, edge_t)
        if norm.loop is not None:
            out = torch.addcmul(out, norm.loop.to(h.dtype), h)
        return out if self.bias is None else out + self.bias

    def _call_reason(self, x, edge_index) -> Optional[str]:
        reason = self._option_reason() or self._input_reason(edge_index)
        if reason is not None:
            return reason
        nodes = node_inputs(x)
        if nodes is None or nodes.paired:
            return "x of this type (PyG's GCNConv takes one tensor)"
        reason = nodes_reason(nodes, self.node_dim)
        if reason is None and input_kind(edge_index) != "edge_index":
            if edges_of(edge_index).size != (x.size(-2), x.size(-2)):
                return "an adjacency that is not [N, N]"
        return reason

    def _graph_and_norm(self, edge_index, edge_weight: Optional[Tensor], num_nodes: int, dtype, out_dtype):
        """(sorted graph, _GCNNorm, its edge weights in transposed order or None):
        kept with the graph, or with the layer when cached."""
        if self.cached and self._geot_norm is not None:
            return self._cached_norm()
        if self.cached and self.__dict__.get("_geot_pyg_cache") is not None:
            edge_index, edge_weight = self.__dict__["_geot_pyg_cache"]  # normalized by PyG's forward
            return self._graph_and_weights(edge_index, edge_weight, out_dtype)
        edges = edges_of(edge_index)
        graph = checked(sorted_graph(self, edge_index, flipped=self._flipped()), num_nodes, num_nodes)
        weight = edge_weight if edges.kind == "edge_index" else edges.values
        if torch.compiler.is_compiling() and kept_graph(self, edge_index, flipped=self._flipped()) is not None:
            # The kept graph's norm, made eagerly before the compiled code reads it (a graph of one step has
            # its norm made in the compiled code: SortedGraph.derived looks nothing up there).
            (num_nodes,) = fixed_sizes(num_nodes)
            call_at_trace_time(_prepare_for_compiled, self, edge_index, edge_weight, num_nodes, dtype, out_dtype,
                               torch.is_grad_enabled())
        key = ("gcn", edges.kind, self.normalize, self.add_self_loops, self.improved, weight is None, num_nodes,
               dtype, out_dtype)
        norm = graph.derived(key, lambda: self._norm(graph, weight, edges.kind, num_nodes, dtype, out_dtype), weight)
        edge_t = None
        if torch.is_grad_enabled() and graph.transposed is not None and norm.edge is not None:
            edge_t = graph.derived(key + ("transposed",), lambda: transposed_order(graph, norm.edge), weight)
        if self.cached and self.normalize:
            self._geot_norm = (graph, norm, edge_t)
        return graph, norm, edge_t

    def _cached_norm(self):
        graph, norm, edge_t = self._geot_norm
        if torch.is_grad_enabled() and graph.transposed is None:  # cached by calls without gradients
            graph = with_transposed(graph)
            edge_t = transposed_order(graph, norm.edge)
            if not torch.compiler.is_compiling():
                self._geot_norm = (graph, norm, static_addresses(edge_t))
        return graph, norm, edge_t

    def _graph_and_weights(self, edge_index, edge_weight: Optional[Tensor], out_dtype):
        """An edge_index and weights to sum with as given (no normalization, no loops)."""
        graph = sorted_graph(self, edge_index, flipped=self._flipped())
        edge = graph.edge_values(edge_weight)
        edge = None if edge is None else edge.to(out_dtype)
        return graph, _GCNNorm(edge, None), transposed_order(graph, edge)

    def _norm(self, graph: SortedGraph, edge_weight: Optional[Tensor], kind: str, num_nodes: int, dtype,
              out_dtype) -> _GCNNorm:
        """The normalization in dtype (x's), kept in out_dtype (lin(x)'s, as autocast makes it)."""
        edge, loop = self._normalize(graph, graph.edge_values(edge_weight), _LOOPS[kind], num_nodes, dtype)
        if edge is None:
            return _GCNNorm(None, None)
        return _GCNNorm(edge.to(out_dtype), None if loop is None else loop.to(out_dtype).unsqueeze(-1))

    def _normalize(self, graph: SortedGraph, weight: Optional[Tensor], loops: str, num_nodes: int, dtype):
        """Edge weights D^-1/2 (A + loops) D^-1/2 [E] and the loops' [N], or
        the raw weights when normalize=False."""
        if not self.normalize:
            return weight, None
        # PyG fills an edge_index's loops with 2 under improved only where edge_weight is given.
        fill = 2.0 if self.improved and (weight is not None or loops != "replace") else 1.0
        given = weight is not None
        weight = torch.ones(graph.src.numel(), device=graph.src.device) if weight is None else weight
        weight = weight.to(dtype)
        loop_weight = None
        if self.add_self_loops:
            loop_weight = torch.full((num_nodes,), fill, dtype=weight.dtype, device=weight.device)
            if loops != "add":
                is_loop = graph.src == graph.dst
                if loops == "replace" and given and weight.numel():
                    loop_weight = _last_loop_weight(graph, is_loop, weight, loop_weight)
                weight = torch.where(is_loop, 0, weight)
        degree = segment_reduce(graph.dst, weight, "sum", num_nodes)
        if loop_weight is not None:
            degree = degree + loop_weight
        inv_sqrt = degree.pow(-0.5).masked_fill(degree == 0, 0)
        norm = inv_sqrt.index_select(0, graph.src) * weight * inv_sqrt.index_select(0, graph.dst)
        return norm, None if loop_weight is None else inv_sqrt * loop_weight * inv_sqrt


def _prepare_for_compiled(layer: GCNConv, edge_index, edge_weight, num_nodes: int, dtype, out_dtype,
                          grad: bool) -> None:
    """Run while dynamo traces (see geot.nn.graph.call_at_trace_time): the
    layer's first graph and its normalization, computed eagerly and kept."""
    if not layer.cached and prepare_for_compiled(layer, edge_index, layer._flipped(), grad):
        with torch.set_grad_enabled(grad):
            layer._graph_and_norm(edge_index, edge_weight, num_nodes, dtype, out_dtype)


def _last_loop_weight(graph: SortedGraph, is_loop: Tensor, weight: Tensor, fill: Tensor) -> Tensor:
    """[N] the weight of each node's last input self loop (input order: the
    sort is stable), fill where it has none: what PyG's
    add_remaining_self_loops keeps where a node has several. Its gradient
    goes to every input loop of the node, the dropped copies too, as the
    gradient of PyG's indexed assignment does."""
    position = torch.arange(weight.numel(), device=weight.device)
    last = torch.full_like(fill, -1, dtype=torch.long).scatter_reduce_(
        0, graph.dst.long(), torch.where(is_loop, position, -1), "amax")
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return torch.where(last >= 0, weight.index_select(0, last.clamp(min=0)), fill)
    kept = weight.detach().index_select(0, last.clamp(min=0))
    # zero in value; the gradient of node v's loop weight reaches each of v's input loops
    each_copy = segment_reduce(graph.dst, torch.where(is_loop, weight - weight.detach(), 0), "sum", fill.numel())
    return torch.where(last >= 0, kept + each_copy, fill)


def _as_pyg_cache(graph: SortedGraph, norm: _GCNNorm, flipped: bool):
    """geot's normalized graph as PyG's cache: (edge_index [2, E + N] with
    one loop per node last, edge weights)."""
    if norm.edge is None:
        return None
    edge_index = torch.stack([graph.dst, graph.src] if flipped else [graph.src, graph.dst]).long()
    if norm.loop is None:
        return edge_index, norm.edge
    loops = torch.arange(norm.loop.size(0), device=edge_index.device).expand(2, -1)
    return torch.cat([edge_index, loops], dim=1), torch.cat([norm.edge, norm.loop.squeeze(-1)])
