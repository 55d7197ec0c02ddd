"""geot: format-agnostic GPU kernels for GNN message passing.

Plain index tensors in, dense tensors out. Operators are registered as
torch.ops.geot.* with CPU and CUDA kernels, autograd and fake kernels.
"""
from . import _ops  # noqa: F401
from ._version import __version__
from ._C import cuda_built
from .config import Config, config_space, explain, explain_source, rule_sets, rules_mode, set_rules
from .hetero import attention_aggregate, edge_softmax, edge_softmax_, group_by_type, segment_matmul
from .index import TransposedIndex, index_segment_reduce, index_weight_segment_reduce, transpose_index
from .sddmm import sddmm
from .segment import segment_broadcast, segment_reduce
from .validation import clear_cache, mark_static_index, set_validation, validation_enabled

__all__ = [
    "__version__",
    "attention_aggregate",
    "Config",
    "clear_cache",
    "config_space",
    "cuda_built",
    "edge_softmax",
    "edge_softmax_",
    "explain",
    "explain_source",
    "group_by_type",
    "index_segment_reduce",
    "index_weight_segment_reduce",
    "mark_static_index",
    "rule_sets",
    "rules_mode",
    "sddmm",
    "segment_broadcast",
    "segment_matmul",
    "segment_reduce",
    "set_rules",
    "set_validation",
    "transpose_index",
    "TransposedIndex",
    "validation_enabled",
]
