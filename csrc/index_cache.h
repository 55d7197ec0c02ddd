// Per-index caches. Validating an index costs a pass and, on CUDA, a
// device->host sync; the SP schedule needs the segment offsets of a sorted
// index, another pass. A static graph pays both once: results are kept while
// the index tensor is unchanged. Entries are keyed by the storage (weakly
// held), offset, length, stride, dtype and version counter (bumped by any
// in-place change). Inference tensors (no version counter) and tensors
// without storage are never cached.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace geot {

// Whether `index` can be a key (it has storage and a version counter).
bool index_cacheable(const at::Tensor& index);

// Validation results. known_index_flags: the kLongSegment bits of an index
// known valid for `bound` (and sorted, if asked), else -1.
int known_index_flags(const at::Tensor& index, int64_t bound, bool sorted);
void remember_valid_index(const at::Tensor& index, int64_t bound, bool sorted, int flags);
// The same for offsets (ptr of segment_matmul): valid for exactly `total`
// rows, never taken for an index check or the other way round.
bool offsets_known_valid(const at::Tensor& ptr, int64_t total);
void remember_valid_offsets(const at::Tensor& ptr, int64_t total);

// Segment offsets of a sorted index with S segments, on its device: ptr
// [S + 1] int64 (segment s is rows ptr[s] .. ptr[s + 1]) and longest, a
// one-element int64 tensor holding the rows of the longest segment. The
// cache holds them strongly (8 (S + 1) bytes each, a few entries) until
// their index is freed or changed, or they are pushed out. pin: the entry
// found is read by a CUDA graph being captured, which keeps its address:
// from then on it is never pushed out or cleared, only freed with its index.
struct SegmentOffsets {
  at::Tensor ptr, longest;
};
std::optional<SegmentOffsets> cached_segment_offsets(const at::Tensor& index, int64_t S, bool pin = false);
// Indices declared static (their values do not change while CUDA graphs
// that read them are replayed): only theirs does a capture take from the
// cache. Another index may be a static buffer that a replay refills; its
// captured kernels derive offsets from its values on every replay. Keyed as
// the caches are, so an in-place change ends the declaration.
void mark_static_index(const at::Tensor& index);
bool is_static_index(const at::Tensor& index);
// Caches offsets in an unpinned entry (none free: not cached).
// An uninitialized CUDA tensor from the device's general pool, allocated on
// another thread: a CUDA-graph warm-up (torch.compile's reduce-overhead
// mode) sends its thread's allocations to the graph's private pool, where
// a cache entry, which outlives the function, has no place.
at::Tensor empty_outside_graph_pools(at::IntArrayRef sizes, const at::TensorOptions& options);
void remember_segment_offsets(const at::Tensor& index, int64_t S, const SegmentOffsets& offsets);
// Drops every cached offsets tensor no captured graph reads (frees their
// device memory), and the pinned ones of freed indices.
void clear_segment_offsets();
// Entries held (tests).
int64_t segment_offsets_cached();

}  // namespace geot
