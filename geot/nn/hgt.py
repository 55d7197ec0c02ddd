"""HGTConv on geot."""
import math
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor

from .. import hetero, index
from ..sddmm import sddmm
from .common import Pairs, distinct_pairs, typed_matmul
from .graph import call_at_trace_time, static_addresses, transpose_index_as
from .inputs import edges_of, input_kind
from .layer import GeotLayer


class _TypedGraph(NamedTuple):
    """Every edge type's edges as one graph over the concatenated node types."""
    key: tuple         # the inputs it was built from (tensor identities, versions, node counts)
    inputs: tuple      # those tensors, kept so that their identities stay theirs
    dst: Tensor        # [E] destination row (its type's offset added), sorted
    sources: Pairs    # distinct (source row, edge type) pairs, grouped by edge type
    memo: dict         # the transposed index, made when a call first records gradients


@torch.library.custom_op("geot::cat_parameters", mutates_args=())
def cat_parameters(tensors: List[Tensor]) -> Tensor:
    """torch.cat(tensors) as one opaque op in compiled code: inductor would make the cat of hundreds of
    per-edge-type parameters (HGT's p_rel) one generated kernel with as many inputs, minutes of
    compilation on a knowledge graph."""
    return torch.cat(tensors)


@cat_parameters.register_fake
def _cat_parameters_fake(tensors):
    return torch.cat(tensors)


def _cat_parameters_setup(ctx, inputs, output):
    ctx.sizes = [t.size(0) for t in inputs[0]]


def _cat_parameters_backward(ctx, grad):
    return list(grad.split(ctx.sizes))


cat_parameters.register_autograd(_cat_parameters_backward, setup_context=_cat_parameters_setup)


def _input_key(adj) -> tuple:
    """What says an edge input is unchanged: the object (kept with the graph, so that its id stays its own)
    and its (converted) index tensor's storage, version and shape. A plain edge_index is read directly:
    hundreds of edge types are checked on every call."""
    index = adj if isinstance(adj, Tensor) and adj.layout == torch.strided else edges_of(adj).index
    return (id(adj), index.data_ptr(), index._version, index.shape, index.device)


class HGTConv(GeotLayer, pyg_nn.HGTConv):
    """``torch_geometric.nn.HGTConv`` on geot. Where the node types share a
    width, the queries are one ``geot.segment_matmul`` over the
    concatenated node features, and each edge type's K and V transforms
    (its heads' matrices on a block diagonal, the prior ``p_rel / sqrt(D)``
    folded into K), composed with its source type's K and V linears, one
    ``segment_matmul`` each over the distinct (source node, edge type)
    pairs' features only (compact materialization and linear-operator
    reordering: no node's K or V, and not every node of every source type,
    as PyG's, nor every edge). Where a pair's features are wider than its
    K and V together, or the types' widths differ, every node's K, Q and V
    (one ``segment_matmul``, or PyG's per-type linears), then the
    transforms over the pairs. The scores are one ``geot.sddmm`` dot,
    their softmax one ``geot.edge_softmax`` per destination over all edge
    types, the sum one multi-head ``index_weight_segment_reduce``; the
    output projections one more ``segment_matmul``. Takes ``edge_index``
    tensors and sparse adjacencies in ``edge_index_dict``; calls PyG's
    forward would reject (edge types outside ``metadata``, node types
    without features) run it. Inside ``torch.compile`` the graph is built
    while dynamo traces, from the compiled model's ``edge_index`` inputs
    (no eager warm-up), and kept; a layer whose graph changes between
    calls, or whose graph is computed inside the compiled code, runs PyG's
    forward there (the pairs have data-dependent sizes)."""

    def forward(self, x_dict: Dict[str, Tensor], edge_index_dict) -> Dict[str, Optional[Tensor]]:
        reason = self._call_reason(x_dict, edge_index_dict)
        if reason is not None:
            return self._pyg_forward(reason, x_dict, edge_index_dict)
        types = [t for t in self.kqv_lin.lins if t in x_dict]
        bounds = [0]
        for t in types:
            bounds.append(bounds[-1] + x_dict[t].size(0))
        if torch.compiler.is_compiling():
            graph = self._compiled_typed_graph(edge_index_dict, types, bounds)
            if graph is None:
                return self._pyg_forward("torch.compile where the graph is not the one the layer was compiled "
                                         "on (its pairs have data-dependent sizes)", x_dict, edge_index_dict)
        else:
            graph = self._typed_graph(edge_index_dict, types, bounds)
        key, query, value = self._key_query_value(graph, x_dict, types, bounds)
        out = self._attend(graph, key, query, value, bounds[-1])
        out = typed_matmul(F.gelu(out.view(-1, self.out_channels)), self._ptr(bounds, out.device), bounds,
                           self._stacked(self.out_lin, types, out.dtype))
        return self._outputs(out, x_dict, types, bounds)

    def _key_query_value(self, graph: _TypedGraph, x_dict, types, bounds):
        """([U, H, D], [N, H, D], [U, H, D]): each (source, edge type) pair's relation-transformed key, each
        node's query and each pair's transformed value. Where the node types share a width and kqv_lin
        is plain (materialized, with biases), its linears are ``segment_matmul`` s over x with a column of
        ones appended (their biases; 8 columns, for aligned rows); and where a pair's x is no wider than
        its K and V together, each edge type's K and V transforms are composed with them (linear-operator
        reordering: one gather of x per pair, no node's K or V rows). Else PyG's per-type linears."""
        lins = [self.kqv_lin.lins[t] for t in types]
        if (hasattr(self.kqv_lin, "_hook") or len({x_dict[t].size(-1) for t in types}) != 1
                or any(lin.bias is None for lin in lins)):
            projected = self.kqv_lin(x_dict)
            return self._transformed(graph, torch.cat([projected[t] for t in types]))
        x = F.pad(torch.cat([x_dict[t] for t in types]), (0, 8))  # one copy of x, its ones column set in place
        x[:, -8] = 1
        if x.size(1) > 2 * self.out_channels:
            kqv = typed_matmul(x, self._ptr(bounds, x.device), bounds, self._kqv_weights(types).to(x.dtype))
            return self._transformed(graph, kqv)
        return self._composed(graph, x, types, bounds)

    def _composed(self, graph: _TypedGraph, x: Tensor, types, bounds):
        """_key_query_value's composed transforms, from x with its ones columns."""
        heads, channels = self.heads, self.out_channels
        ptr = self._ptr(bounds, x.device)
        query_weight, key_weight, value_weight = self._composed_weights(types, x.dtype)
        query = typed_matmul(x, ptr, bounds, query_weight)
        sources = graph.sources
        rows = x.index_select(0, sources.node)
        key = typed_matmul(rows, sources.ptr, sources.bounds, key_weight)
        value = typed_matmul(rows, sources.ptr, sources.bounds, value_weight)
        return tuple(t.view(-1, heads, channels // heads) for t in (key, query, value))

    def _kqv_weights(self, types) -> Tensor:
        """[T, C_in + 8, 3F] kqv_lin's weights (K | Q | V columns) in type order, each bias as the row after
        them, zeros after it."""
        biases = torch.stack([self.kqv_lin.lins[t].bias for t in types]).unsqueeze(1)
        return F.pad(torch.cat([self._stacked(self.kqv_lin, types, biases.dtype), biases], dim=1), (0, 0, 0, 7))

    def _composed_weights(self, types, dtype):
        """([T, C_in + 8, F], [ET, C_in + 8, F], [ET, C_in + 8, F]): the node types' Q linears and the edge
        types' K and V transforms composed with their source types' K and V linears (_kqv_weights'
        rows). Composed in the parameters' dtype, outside autocast; an edge type whose source type has no
        features in this call has no pairs, and zeros."""
        channels = self.out_channels
        with torch.autocast(self.k_rel.weight.device.type, enabled=False):
            stacked = self._kqv_weights(types)
            key_rel, value_rel = self._relation_weights(stacked.dtype)
            with_zeros = F.pad(stacked, (0, 0, 0, 0, 0, 1))  # row T: an absent source type's zeros
            per_edge_type = with_zeros.index_select(0, self._source_rows(types, stacked.device))
            key = per_edge_type[..., :channels] @ key_rel
            value = per_edge_type[..., 2 * channels:] @ value_rel
            query = stacked[..., channels:2 * channels]
        return query.to(dtype), key.to(dtype), value.to(dtype)

    def _source_rows(self, types, device) -> Tensor:
        """[ET] each edge type's source type's position in types (len(types) where it has no features in
        this call), kept per types: one gather makes the per-edge-type weights, however many edge types."""
        key = (tuple(types), device)
        kept = self.__dict__.get("_geot_source_rows")
        if kept is not None and kept[0] == key:
            return kept[1]
        position = {t: i for i, t in enumerate(types)}
        rows = torch.tensor([position.get(edge_type[0], len(types)) for edge_type in self.edge_types], device=device)
        if not torch.compiler.is_compiling():
            self.__dict__["_geot_source_rows"] = (key, rows)
        return rows

    def _transformed(self, graph: _TypedGraph, kqv: Tensor):
        """_key_query_value from every node's K | Q | V, [N, 3F]: the query its own tensor, so that kqv
        can go."""
        channels, heads = self.out_channels, self.heads
        key_rel, value_rel = self._relation_weights(kqv.dtype)
        sources = graph.sources

        def transformed(rows: Tensor, weight: Tensor) -> Tensor:
            out = typed_matmul(rows.index_select(0, sources.node), sources.ptr, sources.bounds, weight)
            return out.view(-1, heads, channels // heads)

        key, value = transformed(kqv[:, :channels], key_rel), transformed(kqv[:, 2 * channels:], value_rel)
        query = kqv[:, channels:2 * channels].contiguous().view(-1, heads, channels // heads)
        return key, query, value

    def _attend(self, graph: _TypedGraph, key: Tensor, query: Tensor, value: Tensor, num_nodes: int) -> Tensor:
        """[N, H, D]: each node's attention-weighted sum of its sources' relation-transformed values."""
        src, dst = graph.sources.of_edge, graph.dst
        alpha = hetero.edge_softmax(sddmm(src, dst, key, query), dst, num_nodes)
        return index._fused(src, dst, alpha, value, "sum", num_nodes, self._transposed(graph, value), None)

    def _call_reason(self, x_dict, edge_index_dict) -> Optional[str]:
        reason = self._option_reason()
        if reason is not None:
            return reason
        if self.flow != "source_to_target":
            return f"flow={self.flow!r}"
        if not isinstance(x_dict, dict) or not isinstance(edge_index_dict, dict) or not edge_index_dict:
            return "inputs that are not dicts of features and of edges"
        if any(not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point() for x in x_dict.values()):
            return "node features that are not [N, F] float tensors"
        known = {t for t in self.kqv_lin.lins if t in x_dict}
        for edge_type, adj in edge_index_dict.items():
            if edge_type not in self.edge_types_map or edge_type[0] not in known or edge_type[-1] not in known:
                return "an edge type outside metadata or between node types without features"
            kind = input_kind(adj)
            if kind is None or (kind == "torch.sparse" and (adj.dim() != 2 or adj.values().dim() != 1)):
                return "an adjacency of this kind"
        if any(t not in self.out_lin.lins for t in known):
            return "node types outside out_lin"
        return None

    def _ptr(self, bounds, device) -> Tensor:
        """bounds as a device tensor, kept per value (segment_matmul validates a ptr once per tensor); compiled
        code reads the one kept while dynamo traced."""
        key = (tuple(bounds), device)
        if torch.compiler.is_compiling():
            kept = getattr(self, "_geot_ptrs", {}).get(key)
            return kept if kept is not None else torch.tensor(bounds, device=device)
        cache = self.__dict__.setdefault("_geot_ptrs", {})
        if key not in cache:
            cache.clear()
            cache[key] = static_addresses(torch.tensor(bounds, device=device))
        return cache[key]

    def _stacked(self, linears, types, dtype) -> Tensor:
        """[T, C_in, C_out] the per-type Linear weights, transposed and stacked in type order."""
        return torch.stack([linears.lins[t].weight for t in types]).transpose(1, 2).to(dtype)

    def _relation_weights(self, dtype):
        """([ET, F, F], [ET, F, F]): each edge type's K transform (times p_rel / sqrt(D)) and V
        transform, the heads' matrices on the block diagonal."""
        heads, width, count = self.heads, self.out_channels // self.heads, len(self.edge_types)
        diagonal = torch.eye(heads, dtype=dtype, device=self.k_rel.weight.device)

        def blocks(weight):  # HeteroLinear's [H * ET, D, D], type h * ET + e -> [ET, H * D, H * D]
            per_type = weight.view(heads, count, width, width).transpose(0, 1).to(dtype)
            return torch.einsum("ehij,hg->ehigj", per_type, diagonal).reshape(count, heads * width, -1)

        priors = self._priors()
        prior = (cat_parameters(priors) if torch.compiler.is_compiling() else torch.cat(priors)).to(dtype)
        scale = (prior / math.sqrt(width)).repeat_interleave(width, dim=1).unsqueeze(1)
        return blocks(self.k_rel.weight) * scale, blocks(self.v_rel.weight)

    def _priors(self):
        """p_rel's [1, H] parameters in edge-type order, read from the module's own table (PyG's
        ParameterDict maps every key on each lookup: milliseconds over hundreds of edge types)."""
        names = self.__dict__.get("_geot_prior_names")
        if names is None:
            names = [self.p_rel.to_internal_key("__".join(t)) for t in self.edge_types]
            self.__dict__["_geot_prior_names"] = names
        table = self.p_rel._parameters
        return [table[name] for name in names]

    def _typed_graph(self, edge_index_dict, types, bounds) -> _TypedGraph:
        """The concatenated graph, kept for the next call with the same edge tensors and node counts."""
        inputs = tuple(edge_index_dict.values())
        key = (tuple(edge_index_dict), tuple(bounds), tuple(map(_input_key, inputs)))
        kept = self.__dict__.get("_geot_typed_graph")
        if kept is not None and kept.key == key and not torch.compiler.is_compiling():
            return kept
        graph = self._build_typed_graph(edge_index_dict, types, bounds, key, inputs)
        self.__dict__["_geot_typed_graph"] = graph
        return graph

    def _compiled_typed_graph(self, edge_index_dict, types, bounds) -> Optional[_TypedGraph]:
        """Inside torch.compile: the graph kept for these edge tensors (guarded by identity), built while
        dynamo traces where the layer has none (see geot.nn.graph.call_at_trace_time); None where the
        layer's graph is another one, or where the graph is computed inside the compiled code."""
        keys, inputs = tuple(edge_index_dict), tuple(edge_index_dict.values())
        call_at_trace_time(_prepare_for_compiled, self, keys, tuple(types), tuple(bounds), torch.is_grad_enabled(),
                           *inputs)
        kept = getattr(self, "_geot_typed_graph", None)
        if kept is None or not _built_from(kept, keys, bounds, inputs):
            return None
        return kept

    def _build_typed_graph(self, edge_index_dict, types, bounds, key, inputs) -> _TypedGraph:
        offset = dict(zip(types, bounds))
        sources, targets, relations = [], [], []
        for edge_type, adj in edge_index_dict.items():
            src, dst = edges_of(adj).index
            sources.append(src.long() + offset[edge_type[0]])
            targets.append(dst.long() + offset[edge_type[-1]])
            relations.append(torch.full_like(sources[-1], self.edge_types_map[edge_type]))
        src, dst, relation = torch.cat(sources), torch.cat(targets), torch.cat(relations)
        if src.numel() and bool((src.min() < 0) | (dst.min() < 0) | (src.max() >= bounds[-1])
                                | (dst.max() >= bounds[-1])):
            raise ValueError("edge_index_dict has node ids out of range of x_dict")
        dtype = torch.int32 if max(bounds[-1], src.numel()) < 2**31 else torch.int64
        dst, perm = torch.sort(dst, stable=True)
        pairs = distinct_pairs(src.index_select(0, perm), relation.index_select(0, perm), bounds[-1],
                               len(self.edge_types))
        dst, pairs = static_addresses((dst.to(dtype), pairs._replace(of_edge=pairs.of_edge.to(dtype))))
        return _TypedGraph(key, inputs, dst, pairs, {})

    def _transposed(self, graph: _TypedGraph, value: Tensor):
        """The graph's transposed index for the backward pass, made once where gradients are recorded."""
        if not (torch.is_grad_enabled() and value.requires_grad):
            return None
        if not torch.compiler.is_compiling():
            _keep_transposed(graph)
        return graph.memo.get("transposed")  # compiled code without it: the backward pass takes atomics

    def _outputs(self, out: Tensor, x_dict, types, bounds) -> Dict[str, Tensor]:
        """Each destination type's rows, its out_lin bias added, gated with its input where widths agree."""
        out_dict = {}
        for t, start, end in zip(types, bounds[:-1], bounds[1:]):
            if t not in self.dst_node_types:
                continue
            rows = out[start:end]
            bias = self.out_lin.lins[t].bias
            rows = rows if bias is None else rows + bias
            if rows.size(-1) == x_dict[t].size(-1):
                gate = self.skip[t].sigmoid()
                rows = gate * rows + (1 - gate) * x_dict[t]
            out_dict[t] = rows
        return out_dict


def _built_from(graph: _TypedGraph, keys, bounds, inputs) -> bool:
    """Whether graph was built from these edge types, node counts and edge tensors (the tensor objects)."""
    return (graph.key[:2] == (keys, tuple(bounds)) and len(graph.inputs) == len(inputs)
            and all(kept is given for kept, given in zip(graph.inputs, inputs)))


def _prepare_for_compiled(layer: HGTConv, keys, types, bounds, grad: bool, *inputs) -> None:
    """Run while dynamo traces, on the real edge tensors: the layer's first graph (and its transposed index,
    where the call records gradients) built and kept before the compiled code reads it. A layer that kept
    another graph is left as it is: its graph changes, and compiled code runs PyG's forward for it."""
    kept = layer.__dict__.get("_geot_typed_graph")
    if kept is not None and not _built_from(kept, keys, bounds, inputs):
        return
    graph = layer._typed_graph(dict(zip(keys, inputs)), list(types), list(bounds))
    layer._ptr(list(bounds), inputs[0].device)
    if grad:
        _keep_transposed(graph)


def _keep_transposed(graph: _TypedGraph) -> None:
    """The graph's transposed index for the backward pass, made once."""
    if "transposed" not in graph.memo:
        graph.memo["transposed"] = static_addresses(transpose_index_as(graph.sources.of_edge, graph.dst,
                                                                       graph.dst.dtype))
