"""The edge list in geot's layout (sorted by destination), built once per graph.

geot's ops need the destination index sorted. A layer gets ``edge_index`` in
any order, so it sorts it (stably) and keeps the result, with the source-sorted
:class:`geot.TransposedIndex` its backward pass uses (made when a call first
records gradients on a graph the layer saw before: inference alone, and a
graph used for one step, do not pay for its sort; their backward pass takes
atomics). A graph whose ids fit in int32 is kept in int32, whatever the dtype
of ``edge_index``: half the memory, half the index bytes per kernel. Once a
layer's graph has changed, a new graph on CUDA is built without a
device->host sync (sorted without a look first, its ids checked on the
device: :func:`checked`) and gets that layout at the layer's second call on
it. Kept:

* eagerly, in a cache shared by all layers, keyed by the ``edge_index``
  tensor object and checked against its data pointer, shape, stride and
  version counter: a new tensor, or an in-place change of this one, sorts
  again; an entry goes when its tensor is freed. The first look-up of a graph
  costs one device->host sync (is it sorted already, do its ids fit in
  int32?).
* each layer also remembers the last graph it saw per variant (GAT's
  self-looped graph for training, its plain one for inference), with the
  same check: eagerly, a call on that graph is answered from there (no
  shared look-up).
  Inside ``torch.compile`` that is the only cache (the shared one is not
  traceable): a compiled call with the same ``edge_index`` object reuses it
  (dynamo guards on the identity). No eager warm-up is needed: while dynamo
  traces a layer whose slot is empty, the graph it is given (an input of the
  compiled model) is sorted eagerly, on its real values, with its transposed
  index where the call records gradients, and kept in the slot before the
  compiled code reads it (:func:`call_at_trace_time`; GCN keeps its
  normalization the same way). A layer's later graphs (a new graph every
  step) are sorted inside the compiled code, one compiled version for all of
  them: a sort per call (in training shared by the layers: the partitioner
  computes the same sort of the same input once), and atomics in the
  backward pass, as eagerly for a graph of one step; compiling that warns
  (:class:`UncachedGraphWarning`, once per compilation).
  In-place changes to an ``edge_index`` are not seen by compiled code.
  What the caches keep is marked as a static input (static_addresses), so
  CUDA graphs read it in place instead of copying it on every replay.

Values derived from the graph alone (GCN's normalization, the edge counts
of a mean's backward pass) are kept with its :class:`SortedGraph`
(:meth:`SortedGraph.derived`), so they go with it: a new ``edge_index``
tensor or an in-place change of it starts afresh.
"""
import operator
import warnings
import weakref
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from .. import _C
from ..index import TransposedIndex, transpose_index
from ..validation import mark_static_index
from .inputs import edges_of

# A graph of one step with more edges than this is sorted even where its caller sums in any order: past
# ~10^5 edges, atomics on a hub's row (and its count, for a mean) serialize and cost more than the sort
# (H100, 2.5M edges into random nodes of a 10^6-node power-law graph, F=128: the atomic sums and counts
# took 11.9 ms of a 28 ms SAGE training step).
UNORDERED_MAX_EDGES = 1 << 17


class UncachedGraphWarning(UserWarning):
    """Compiled code sorts a graph, or builds its transposed index, on every
    call. Expected for graphs that change every call (mini-batches): one
    compiled version serves them all. A graph that is an input of the
    compiled model and the first a layer sees is sorted once, while dynamo
    traces, and kept."""


def warn_at_trace_time(message: str, category: type) -> None:
    """A warning while dynamo traces (once per compilation, not per call)."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:  # no trace-time hook in this torch: no warning
        return
    # A comptime function may not close over variables: it reads both from this frame.
    comptime(lambda ctx: warnings.warn(ctx.get_local("message").as_python_constant(),
                                       ctx.get_local("category").as_python_constant()))


def call_at_trace_time(function, *args) -> None:
    """Calls ``function(*args)`` while dynamo traces (not in the compiled
    code), with the real values of its arguments: the tensors must be inputs
    of the compiled graph, the rest constants or modules. Nothing is called
    where a value is not known at trace time (a tensor computed inside the
    compiled code, a dynamic size) or this torch has no trace-time hook."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:
        return
    comptime(lambda ctx: _call_with_real_values(ctx.get_local("function"), ctx.get_local("args"), ctx))


def fixed_sizes(*sizes) -> Tuple[int, ...]:
    """sizes as the ints they are now, for call_at_trace_time's preparation
    of a kept graph's derived values, which runs only on known values. Under
    dynamic=True sizes are symbolic: operator.index fixes each (a guard, as
    the look-up of a value keyed by it adds anyway). Unfixed, a first layer
    would skip its preparation, read the graph's memo without the value, and
    a later layer (its sizes fixed by that key by then) would prepare and
    store it: a change to what the traced read saw (dynamo: "Guard failed on
    the same frame it was created"). Only for kept graphs: a graph of one
    step with fixed sizes would recompile for each size."""
    return tuple(operator.index(size) for size in sizes)


_trace_side_effects = None  # while call_at_trace_time's function runs: the objects the running trace holds


def held_by_trace(obj) -> bool:
    """Whether the trace that runs call_at_trace_time's function has read
    obj (a memo dict) already. Its code must then leave obj as it is: dynamo
    keeps what it read, would not see the change, and guards on what it saw
    ("Guard failed on the same frame it was created"). An earlier layer's
    read of a shared graph's memo makes it so for a later layer."""
    try:
        return _trace_side_effects is not None and obj in _trace_side_effects
    except Exception:  # an internal of this torch's tracer that differs: as if not read
        return False


def _call_with_real_values(function, args, ctx) -> None:
    global _trace_side_effects
    try:
        values = [_real_value(item) for item in args._i_will_not_complain_if_bc_breaks_VariableTracker().items]
    except _NotKnown:
        return
    import torch.compiler as compiler
    if not isinstance(getattr(compiler, "_is_compiling_flag", None), bool):
        return  # eager code would take itself for compiled code
    tracing, compiler._is_compiling_flag = compiler._is_compiling_flag, False  # set while tracing in some torch
    try:
        _trace_side_effects = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.side_effects
    except Exception:
        _trace_side_effects = None
    try:
        function.as_python_constant()(*values)
    except Exception:  # e.g. a bad graph: the compiled code, which validates, reports it
        pass
    finally:
        compiler._is_compiling_flag = tracing
        _trace_side_effects = None


class _NotKnown(Exception):
    pass


def _real_value(tracker):
    """The value a dynamo variable tracker holds at trace time: a graph
    input's real tensor, a constant, a module; else raises _NotKnown."""
    try:
        from torch._dynamo.comptime import ComptimeVar
        tracker = tracker.realize() if hasattr(tracker, "realize") else tracker
        var = ComptimeVar(tracker)
        if var.is_python_constant():
            return var.as_python_constant()
        if isinstance(getattr(tracker, "value", None), torch.nn.Module):
            return tracker.value
        graph_arg = var.as_proxy().node.meta.get("grapharg")
        value = None if graph_arg is None else graph_arg.example
        if isinstance(value, Tensor):
            return value
    except Exception:  # an internal of this torch's tracer that differs: not known
        pass
    raise _NotKnown


def _warn_at_compile_time(layer: torch.nn.Module, what: str) -> None:
    """An UncachedGraphWarning while dynamo traces (once per compilation, not per call)."""
    warn_at_trace_time(f"geot.nn.{type(layer).__name__}: compiled code {what} on every call (expected for a "
                       "graph that changes every call; see geot.nn.graph)", UncachedGraphWarning)


class SortedGraph(NamedTuple):
    src: Tensor                  # [E'] source of each edge, edges in destination order
    dst: Tensor                  # [E'] destination (segment id), sorted non-decreasing
    perm: Optional[Tensor]       # [E'] input position of each edge; None: input order kept, or not kept
                                 # (the self-loop variant: GAT has no per-edge inputs to put in order)
    transposed: Optional[TransposedIndex]  # for the gradient of x; None until a call records gradients
    drop: Optional[Tensor]       # [E'] bool, input self loops replaced by added ones (self-loop variant; None: none)
    index_dtype: torch.dtype     # of the index tensors the graph makes: int32 where its ids fit
    memo: dict                   # derived values: see derived()
    deferred: bool = False       # built without a device->host sync, for a graph of one step (see sorted_graph)
    ordered: bool = True         # False: dst left in input order (a graph of one step whose caller sums in any
                                 # order, see sorted_graph's any_order)
    traced: bool = False         # made by compiled code (its memo stays empty there)

    def derived(self, key, compute, values: Optional[Tensor] = None):
        """``compute()``, computed once per key for this graph and kept with it.

        ``key`` names what compute depends on besides the graph (dtype, node
        count, options). ``values`` (per-edge input, e.g. edge weights) may
        be given: its tensor object and version are checked, so a new tensor
        or an in-place change recomputes; if it requires grad nothing is kept
        (its graph must be recorded on every call). Inside torch.compile
        values are read, not stored (the check is not traceable).
        """
        if values is not None and values.requires_grad and torch.is_grad_enabled():
            return compute()
        if torch.compiler.is_compiling():
            # (No look-up in the memo of a graph the compiled code made, empty: a key holding a dynamic size
            # would fix it, and recompile for each.)
            entry = self.memo.get(key) if values is None and not self.traced else None
            return entry[2] if entry is not None and entry[0] is None else compute()
        entry = self.memo.get(key)
        if entry is not None and _same_values(entry, values):
            return entry[2]
        result = static_addresses(compute())
        if not held_by_trace(self.memo):  # (at trace time, one an earlier layer read is left as it was)
            self.memo[key] = (None if values is None else weakref.ref(values),
                              None if values is None else _version_key(values), result)
        return result

    def edge_values(self, values: Optional[Tensor]) -> Optional[Tensor]:
        """Per-edge values given in input order, put in this graph's order."""
        if values is None or self.perm is None:
            return values
        return values.index_select(0, self.perm)

    def input_order(self, values: Tensor) -> Tensor:
        """Per-edge values in this graph's order, put back in input order (with
        ``keep_perm``, the added self loops last, as PyG appends them)."""
        if self.perm is None:
            return values
        return torch.empty_like(values).index_copy_(0, self.perm.long(), values)


_graphs = WeakTensorKeyDictionary()   # edge_index -> {variant: (version key, edge_type ref, SortedGraph)}
_indices = WeakTensorKeyDictionary()  # base of an index view -> {view key: (perm, sorted index)}


def sorted_graph(layer: torch.nn.Module, edge_index, *, flipped: bool = False, self_loops: Optional[int] = None,
                 edge_type: Optional[Tensor] = None, num_relations: int = 0, transposed: bool = True,
                 keep_perm: bool = False, any_order: bool = False) -> SortedGraph:
    """The graph input (any kind :mod:`geot.nn.inputs` takes) sorted by
    destination, from the caches when possible.

    flipped: row 0 of edge_index holds the destinations (PyG's
    flow="target_to_source"). self_loops=N: input self loops are marked in
    ``drop`` (None where eager code saw none) and one loop per node 0..N-1
    is added (GAT); keep_perm keeps that graph's ``perm`` (input positions,
    the added loops at E..E+N-1). edge_type with num_relations=R: the
    segment of an edge is ``dst * R + edge_type`` (RGCN's per-relation
    mean); its ``perm`` too is kept only with keep_perm (per-edge inputs).
    transposed=False: the caller's backward pass does not read the graph's
    transposed index (RGCN gathering projected rows has its own), so a call
    recording gradients does not add it. any_order: the caller sums or
    averages in any order (:func:`geot.nn.common.gather_reduce` takes
    ``ordered=False`` graphs), so a graph of one step on CUDA with at most
    UNORDERED_MAX_EDGES edges is not sorted at all: its sum scatters with
    atomics, forward and backward (for the small graphs of sampled
    mini-batches the sort would cost more than the layer).
    """
    edges = edges_of(edge_index)
    tensor = _checked_edges(edges.index)
    slot = (self_loops, num_relations, flipped, keep_perm)
    grad = torch.is_grad_enabled() and transposed
    known_sorted = edges.sorted and not flipped
    plain = self_loops is None and edge_type is None and not keep_perm
    if torch.compiler.is_compiling():
        call_at_trace_time(_prepare_for_compiled, layer, tensor, edge_type, self_loops, num_relations, flipped,
                           keep_perm, known_sorted, grad)
        return _compiled_graph(layer, tensor, edge_type, slot, known_sorted, grad, any_order and plain)
    build = (tensor, known_sorted, flipped, self_loops, edge_type, num_relations, keep_perm)
    return _eager_graph(layer, tensor, edge_type, slot, build, grad, any_order=any_order and plain)


def _slot_attr(slot) -> str:
    """The layer attribute holding the last graph of a variant: one attribute per variant, so that compiled
    code reads each after the trace-time build of it (see call_at_trace_time)."""
    self_loops, num_relations, flipped, keep_perm = slot
    return f"_geot_graph_{self_loops}_{num_relations}_{int(flipped)}_{int(keep_perm)}"


def _compiled_graph(layer, tensor: Tensor, edge_type, slot, known_sorted: bool, grad: bool,
                    any_order: bool) -> SortedGraph:
    """Inside torch.compile: the layer's slot, guarded by identity (versions are not traceable), or else, as
    eagerly for a graph of one step, the graph in input order (any_order, on CUDA) or sorted."""
    last = getattr(layer, _slot_attr(slot), None)
    if last is not None and last[0] is tensor and last[1] is edge_type and last[2][:4] == slot:
        graph = last[3]
        if grad and graph.transposed is None:
            _warn_at_compile_time(layer, "builds the transposed index (eager calls kept the graph without one)")
            return with_transposed(graph)
        return graph
    if any_order and _may_stay_unordered(tensor):
        return _unordered(tensor, flipped=slot[2])
    _warn_at_compile_time(layer, "sorts edge_index (the layer's graph changed, or is computed inside the "
                                 "compiled code)")
    # As eagerly for a graph of one step: its backward pass takes atomics, not the sort of a transposed index.
    self_loops, num_relations, flipped, keep_perm = slot
    return _build(tensor, known_sorted, flipped, self_loops, edge_type, num_relations, keep_perm, eager=False,
                  transposed=False)


def _prepare_for_compiled(layer, tensor: Tensor, edge_type, self_loops, num_relations, flipped, keep_perm,
                          known_sorted, grad) -> bool:
    """Run eagerly while dynamo traces, on the real graph: a layer's first graph gets its static layout (and
    its transposed index where gradients are recorded) before the compiled code reads the layer's slot, so
    compiling needs no eager warm-up. A layer that saw another graph first is left as it is: its graph
    changes, and compiled code sorts each (one compiled version for all of them, not one per graph).
    True where the layer keeps the graph."""
    slot = (self_loops, num_relations, flipped, keep_perm)
    last = layer.__dict__.get(_slot_attr(slot))
    if last is not None and last[0] is not tensor:
        return False
    build = (tensor, known_sorted, flipped, self_loops, edge_type, num_relations, keep_perm)
    with torch.set_grad_enabled(grad):
        _eager_graph(layer, tensor, edge_type, slot, build, grad, static=True)
    return True


def prepare_for_compiled(layer, edge_index, flipped: bool, grad: bool, edge_type: Optional[Tensor] = None,
                         num_relations: int = 0, keep_perm: bool = False) -> bool:
    """For code run by call_at_trace_time: the layer's first graph (an
    edge_index; with edge_type, sorted_graph's relational variant) built as
    compiled code will read it (see sorted_graph); True where the layer
    keeps it, so that values derived from it may be computed eagerly too."""
    edges = edges_of(edge_index)
    return edges.kind == "edge_index" and _prepare_for_compiled(
        layer, _checked_edges(edges.index), edge_type, None, num_relations, flipped, keep_perm,
        edges.sorted and not flipped, grad)


def kept_graph(layer, edge_index, *, flipped: bool = False, edge_type: Optional[Tensor] = None,
               num_relations: int = 0, keep_perm: bool = False) -> Optional[SortedGraph]:
    """Inside torch.compile: the graph the layer keeps for this edge_index
    (and edge_type) object, or None, for layers whose tables of a graph have
    data-dependent sizes and so cannot be made in compiled code."""
    last = getattr(layer, _slot_attr((None, num_relations, flipped, keep_perm)), None)
    tensor = _checked_edges(edges_of(edge_index).index)
    if last is None or last[0] is not tensor or last[1] is not edge_type:
        return None
    return last[3]


def _eager_graph(layer, tensor: Tensor, edge_type, slot, build, grad: bool, static: bool = False,
                 any_order: bool = False) -> SortedGraph:
    """sorted_graph outside torch.compile. static: build the static layout (and transposed index) at once."""
    attr = _slot_attr(slot)
    last = layer.__dict__.get(attr)
    # Tensors made in inference mode cannot be saved for backward: such a graph is kept apart.
    variant = slot + (torch.is_inference_mode_enabled(),)
    key = _graph_key(tensor, edge_type)
    seen = last is not None and last[0] is tensor and last[1] is edge_type and last[2] == variant and last[4] == key
    if seen and not last[3].deferred and (last[3].transposed is not None or not grad):
        return last[3]  # the graph this layer saw last, unchanged: no shared look-up, no slot update
    # Under torch.utils.checkpoint the recomputation (this layer's next call on the graph) must save what the
    # forward saved: the graph gets its static layout and transposed index at once, not at that next call.
    static = static or (grad and _under_checkpoint())
    again = seen or static  # a graph worth its static layout and its transposed index
    graph = _shared_lookup(tensor, variant, edge_type)
    if graph is not None and not graph.ordered and not (any_order and not again):
        graph = None  # a layer summing in any order left it unsorted: this caller needs it sorted
    if graph is None:
        # A layer whose graph changes (a new graph every step) builds the next one without a sync on CUDA, its
        # ids checked without one (deferred), unsorted where the caller sums in any order; a layer's first
        # graph, which may be static, gets its layout.
        changing = last is not None and not again and tensor.is_cuda
        # Deterministic mode sorts it: its sum takes the segment schedules (an
        # any-order sum would sort it on every call, forward and backward).
        if (changing and any_order and not build[1] and _may_stay_unordered(tensor)
                and not torch.are_deterministic_algorithms_enabled()):
            graph = _unordered(tensor, flipped=build[2])
        else:
            graph = _build(*build, eager=True, transposed=False, survey=not changing)
        graph = graph if graph.deferred else static_addresses(graph)
    if again and graph.deferred:  # this layer's second call on the graph: a static graph's layout
        graph = static_addresses(_build(*build, eager=True, transposed=False))
    if grad and graph.transposed is None and again:
        # This layer's second call on the graph: worth the sort of an atomic-free backward pass (a graph
        # of one step, seen once by each layer, takes atomics and no sort).
        graph = with_transposed(graph)
    _shared_store(tensor, variant, edge_type, graph)
    # Straight into __dict__: Module.__setattr__ costs microseconds per call, and this runs per layer and step.
    layer.__dict__["_geot_graph"] = layer.__dict__[attr] = (tensor, edge_type, variant, graph, key)
    return graph


def _under_checkpoint() -> bool:
    """Whether torch.utils.checkpoint (non-reentrant) runs this call, in its
    forward pass or in the recomputation of it, which must save tensors of
    the shapes and dtypes the forward saved. Read from the saved-tensor
    hooks in force (torch has no public query)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return bool(hooks) and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _checked_edges(edge_index: Tensor) -> Tensor:
    """The plain [2, E] index tensor of an edge_index (an EdgeIndex's data)."""
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
    if edge_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"edge_index must be int32 or int64, got {edge_index.dtype}")
    return edge_index.as_tensor() if hasattr(edge_index, "as_tensor") else edge_index


_checked_counts = {}  # ticket -> (num_src, num_dst) of the deferred checks of recent calls


def checked(graph: SortedGraph, num_src: int, num_dst: int, relations: int = 1) -> SortedGraph:
    """graph, its ids checked against this call's node counts: raises for
    an earlier deferred check that failed; a deferred graph is checked here
    without a device->host sync (:func:`check_deferred`), once per counts.
    relations: a relational graph's destinations are (node, relation) keys,
    node * relations + relation, and num_dst counts the keys."""
    if torch.compiler.is_compiling():  # compiled code sorts each call and its ops validate
        return graph
    raise_failed_checks()
    if ("checked", num_src, num_dst) not in graph.memo:
        if graph.deferred:
            check_deferred(graph, num_src, num_dst)
        else:
            check_ids(graph, num_src, num_dst, relations)
        graph.memo["checked", num_src, num_dst] = (None, None, True)
    return graph


def check_ids(graph: SortedGraph, num_src: int, num_dst: int, relations: int = 1) -> None:
    """Raises ValueError naming edge_index where its ids leave this call's node
    counts (the ops would name their own arguments); on CUDA one sync, once
    per graph and counts, as the ops' own validation of a static graph. Off
    with validation (geot.set_validation(False)), as theirs."""
    if graph.src.numel() == 0 or not _C.validation_enabled():
        return
    lo_src, hi_src, lo_dst, hi_dst = torch.stack([*torch.aminmax(graph.src), *torch.aminmax(graph.dst)]).tolist()
    lo_dst, hi_dst, num_dst = lo_dst // relations, hi_dst // relations, num_dst // relations
    for role, lo, hi, count in (("source", lo_src, hi_src, num_src), ("destination", lo_dst, hi_dst, num_dst)):
        if lo < 0 or hi >= count:
            raise ValueError(f"edge_index has {role} ids in [{lo}, {hi}], outside [0, {count}) (this call's "
                             f"{role} nodes)")


def check_deferred(graph: SortedGraph, num_src: int, num_dst: int) -> None:
    """Checks a deferred graph's ids against node counts without a
    device->host sync: one kernel checks them on the device and reports a
    failure through mapped host memory; :func:`raise_failed_checks` (at
    every later call of a geot layer) raises for it. Meanwhile the kernels
    read no row out of bounds (they skip such ids). The indices are recorded
    as valid, so the ops skip their own (synchronizing) validation."""
    ticket = _C.deferred_index_check(graph.src, graph.dst, num_src, num_dst, graph.ordered)
    if len(_checked_counts) >= 1024:
        _checked_counts.clear()
    _checked_counts[ticket] = (num_src, num_dst)


def raise_failed_checks() -> None:
    """Raises ValueError for a deferred check (check_deferred) seen failed."""
    ticket = _C.take_failed_check()
    if ticket:
        num_src, num_dst = _checked_counts.get(ticket, ("num_src", "num_dst"))
        raise ValueError(f"edge_index has ids out of range for this call's nodes (sources must lie in "
                         f"[0, {num_src}), destinations in [0, {num_dst})); geot.nn checks a new graph "
                         "without a sync, so this reports an earlier call")


def with_transposed(graph: SortedGraph) -> SortedGraph:
    """graph with its transposed index (sharing its memo); eagerly, marked static."""
    transposed = transpose_index_as(graph.src, graph.dst, graph.index_dtype)
    return graph._replace(transposed=transposed if torch.compiler.is_compiling() else static_addresses(transposed))


def transpose_index_as(src: Tensor, dst: Tensor, dtype: torch.dtype) -> TransposedIndex:
    """transpose_index with all three tensors in dtype (torch.sort's perm is int64)."""
    perm, src_t, dst_t = transpose_index(src, dst)
    return TransposedIndex(perm.to(dtype), src_t.to(dtype), dst_t.to(dtype))


def clear_cache() -> None:
    """Drops the graphs the shared caches keep (layers keep the last graph
    each saw until called with another)."""
    _graphs.clear()
    _indices.clear()


def static_addresses(value):
    """value, its CUDA tensors (in tuples and lists too) marked as static
    inputs for torch.compile. What a graph keeps does not change while kept,
    so CUDA graphs (mode="reduce-overhead") may read it in place; unmarked,
    every replay would first copy it into the graph's own buffers (E-sized
    index and weight copies per layer and step). Its indices are declared
    static to geot too, so captures read their cached segment offsets
    (geot.mark_static_index)."""
    if isinstance(value, Tensor):
        if value.is_cuda:
            torch._dynamo.mark_static_address(value)
            if value.dim() == 1 and value.dtype in (torch.int32, torch.int64):
                mark_static_index(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            static_addresses(item)
    return value


def _version_key(t: Tensor):
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.device)


def _same_values(entry, values) -> bool:
    ref, key, _ = entry
    if values is None:
        return ref is None
    return ref is not None and ref() is values and key == _version_key(values)


def _graph_key(edge_index, edge_type):
    return (_version_key(edge_index), edge_type is not None and _version_key(edge_type))


def _shared_lookup(edge_index, variant, edge_type) -> Optional[SortedGraph]:
    entry = _graphs.get(edge_index, {}).get(variant)
    if entry is None:
        return None
    key, type_ref, graph = entry
    same_type = (type_ref is None and edge_type is None) or (type_ref is not None and type_ref() is edge_type)
    return graph if same_type and key == _graph_key(edge_index, edge_type) else None


def _shared_store(edge_index, variant, edge_type, graph) -> None:
    type_ref = None if edge_type is None else weakref.ref(edge_type)
    _graphs.setdefault(edge_index, {})[variant] = (_graph_key(edge_index, edge_type), type_ref, graph)


def _may_stay_unordered(edges: Tensor) -> bool:
    """Whether a graph of one step, for a caller summing in any order, is left in input order (CUDA, at most
    UNORDERED_MAX_EDGES edges)."""
    return edges.is_cuda and edges.size(1) <= UNORDERED_MAX_EDGES


def _unordered(edges: Tensor, flipped: bool) -> SortedGraph:
    """A graph of one step left in input order (no sort, no sync): for callers summing in any order."""
    src, dst = (edges[1], edges[0]) if flipped else (edges[0], edges[1])
    return SortedGraph(src, dst, None, None, None, src.dtype, {}, deferred=True, ordered=False,
                       traced=torch.compiler.is_compiling())


def _build(edges: Tensor, known_sorted: bool, flipped: bool, self_loops, edge_type, num_relations, keep_perm: bool,
           eager: bool, transposed: bool, survey: bool = True) -> SortedGraph:
    """The sorted graph; eager and survey: with one device->host sync, to
    keep it in int32 and skip the sort where it is sorted already."""
    src, dst = (edges[1], edges[0]) if flipped else (edges[0], edges[1])
    num_edges = src.numel()
    input_loops = (src == dst).any() if self_loops is not None and eager and survey and num_edges else None
    if self_loops is not None:
        loops = torch.arange(self_loops, device=src.device, dtype=src.dtype)
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
    if edge_type is not None:
        dst = dst * num_relations + _checked_types(edge_type, num_edges, num_relations, eager).to(dst.dtype)
        known_sorted = False
    index_dtype, unsorted, has_loops = src.dtype, True, True  # no survey (no sync): it sorts
    if eager and survey:  # one sync: is it sorted, do its ids fit in int32, has the input self loops
        unsorted, fits, has_loops = _survey(src, dst, num_relations, input_loops)
        index_dtype = torch.int32 if fits else src.dtype
    # Added loops are never in order, and drop needs perm to tell them apart.
    if self_loops is None and (known_sorted or not unsorted):
        perm = None  # src, dst: views of edge_index, left in its dtype (a copy would add memory)
    else:
        src, dst = src.to(index_dtype), dst.to(index_dtype)
        dst, perm = torch.sort(dst, stable=True)
        src, perm = src.index_select(0, perm), perm.to(index_dtype)
    # Without input self loops nothing is dropped: no mask to keep or apply.
    drop = None if self_loops is None or not has_loops else (src == dst) & (perm < num_edges)
    if (self_loops is not None or edge_type is not None) and not keep_perm:
        perm = None  # read by nothing else: not kept (E [+ N] indices less: GAT's training graph, RGCN's)
    graph = SortedGraph(src, dst, perm, None, drop, index_dtype, {}, eager and not survey, traced=not eager)
    # Only a backward pass reads the transposed index: without gradients it is added when first needed.
    return with_transposed(graph) if transposed else graph


def _survey(src: Tensor, dst: Tensor, num_relations: int, input_loops: Optional[Tensor]) -> Tuple[bool, bool, bool]:
    """(dst unsorted, the graph may be kept in int32, input_loops), with one
    device->host sync (input_loops: a bool tensor fetched with them; None
    reads as False).

    A graph kept in int32 takes half the memory (sorted edges, perm, the
    transposed index) and its kernels read half the index bytes. RGCN's
    table rows (src * R + relation) must fit too.
    """
    flags = [(dst[1:] < dst[:-1]).any()]
    checks_fit = src.dtype != torch.int32 and src.numel() > 0
    if checks_fit:
        limit = 2**31 // max(num_relations, 1)
        flags.append((torch.minimum(src.min(), dst.min()) >= -2**31) & (src.max() < limit) & (dst.max() < 2**31))
    if input_loops is not None:
        flags.append(input_loops)
    values = torch.stack(flags).tolist()
    unsorted, fits = values[0], checks_fit and values[1]
    return unsorted, fits, input_loops is not None and values[-1]


def _checked_types(edge_type, num_edges: int, num_relations: int, eager: bool) -> Tensor:
    if not isinstance(edge_type, Tensor) or edge_type.dtype.is_floating_point or edge_type.dtype == torch.bool:
        raise TypeError(f"edge_type must be an integer tensor, got {getattr(edge_type, 'dtype', type(edge_type))}")
    if edge_type.shape != (num_edges,):
        raise ValueError(f"edge_type must have shape [{num_edges}] (one per edge), got {tuple(edge_type.shape)}")
    if eager and num_edges and bool((edge_type.min() < 0) | (edge_type.max() >= num_relations)):
        raise ValueError(f"edge_type has values outside [0, num_relations = {num_relations})")
    return edge_type


def sorted_index(index: Tensor) -> Tuple[Optional[Tensor], Tensor]:
    """(perm, index[perm] sorted), perm None when index is sorted already.

    For aggregations, whose index is a fresh view such as ``edge_index[1]``
    on every call: cached on the viewed tensor (offset, shape, stride and
    version must match). Not cached inside compiled code (sorted there).
    """
    if torch.compiler.is_compiling():
        ordered, perm = torch.sort(index, stable=True)
        return perm, ordered
    owner = index if index._base is None else index._base
    key = (index.storage_offset(), tuple(index.shape), index.stride(), index.device, owner._version)
    cached = _indices.get(owner)
    if cached is not None and cached[0] == key:
        return cached[1]
    if bool((index[1:] < index[:-1]).any()):
        ordered, perm = torch.sort(index, stable=True)
        result = (perm, ordered)
    else:
        result = (None, index)
    _indices[owner] = (key, result)
    return result
