// segment_reduce family: entry points of the CPU and CUDA implementations and
// the argument checks they share. The fused ops (index_segment_reduce.cpp)
// run on the same row-reduction core.
#pragma once

#include <ATen/ATen.h>

#include "config.h"
#include "index_cache.h"
#include "rules.h"

namespace geot {

// Index value validation (sorted, in range). On by default; costs one pass
// over the index and, on CUDA, a device->host sync. Toggled from Python.
bool validation_enabled();
void set_validation(bool on);

Reduce parse_reduce(c10::string_view reduce);

// Error messages format numbers with std::to_string, never by streaming them:
// with some torch builds (2.11 wheels with a newer host compiler) inserting an
// integer into an ostream from this library crashes in libstdc++'s locale code.
std::string shape_string(at::IntArrayRef sizes);

// Dtype, shape and device checks with messages that name the argument.
// An index: int32 or int64, 1-D.
void check_index_tensor(const at::Tensor& index, const char* name);
// t on the device of `like` (named like_name in the message).
void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name);
void check_segment_inputs(const at::Tensor& index, const at::Tensor& src, int64_t num_segments);

// src viewed as [E, F] contiguous, F = product of the trailing dims.
at::Tensor as_rows(const at::Tensor& src);

// rows [num_segments, F] viewed as [num_segments, *src.shape[1:]] (no
// dispatched view when src is already 2-D).
at::Tensor shaped_like_rows_of(const at::Tensor& rows, const at::Tensor& src);

// One index to validate: values in [0, bound), and non-decreasing if sorted.
// name / bound_name go into the error message ("dst_index", "num_segments").
struct IndexCheck {
  at::Tensor index;
  int64_t bound;
  bool sorted;
  const char* name;
  const char* bound_name;
};
// The kLongSegment bits are no error: a sorted index has a segment of more
// than kLongSegmentRows[k] rows (bit kLongSegment << k). Validation gets them
// almost for free (row i is in such a segment iff row i + rows has its id)
// and the config selectors use them: segment-parallel schedules suit graphs
// without long segments, and hubs of thousands of rows punish schedules
// that put many atomics on one output row.
enum IndexFlag : int { kNegative = 1, kTooLarge = 2, kUnsorted = 4, kLongSegment = 8 };
constexpr int kLongSegmentLevels = 3;
constexpr int64_t kLongSegmentRows[kLongSegmentLevels] = {64, 1024, 16384};
constexpr int kLongSegmentBits = kLongSegment * ((1 << kLongSegmentLevels) - 1);

// How many of the kLongSegmentRows thresholds some segment exceeds (0..3).
inline int long_segment_level(int flags) {
  int level = 0;
  while (level < kLongSegmentLevels && (flags & (kLongSegment << level))) ++level;
  return level;
}

// Turns an index check's bit flags into a ValueError naming the argument
// and the fix.
void raise_index_errors(int flags, const IndexCheck& check);

// When validation is on, checks every index the cache does not know yet
// (with one device->host sync for all of them on CUDA) and remembers them.
// Returns the shape hint of each sorted index: its long_segment_level (0 if
// no segment exceeds 64 rows), -1 if unknown (validation off, or no sorted
// check).
std::vector<int> validate_indices(const std::vector<IndexCheck>& checks);

// Whether the current CUDA stream is capturing a CUDA graph. A device->host
// sync cannot be captured, so validation then passes over what it has not
// seen (hint -1): torch.compile's CUDA graphs (cudagraph trees) run each
// function eagerly before recording it, and that run validates its inputs.
// CUDA tensors' callers only (it may create a CUDA context).
bool capturing_cuda_graph();

#ifdef GEOT_WITH_CUDA
// Launches the check of `index` on the current stream; ORs its flags into
// *flags (device memory).
void index_flags_cuda(const at::Tensor& index, int64_t bound, bool sorted, int* flags);
#endif

// The config the kernels will use: the override if given, else the selector
// (select_config: the learned rules features.rules names, else the hand heuristic).
Config resolve_config(at::OptionalIntArrayRef override_config, const Features& features);

// The core every op of the family runs on:
//   out[index[e]] op= weight[e, head] * src[gather[e]]   (gather, weight optional)
// index sorted, except with any_order (sum only, CUDA SR schedule: the
// transposed product of the fused backward without a sort).
struct RowReduction {
  at::Tensor index;                  // [E] segment ids, contiguous
  at::Tensor src;                    // [rows, F] contiguous
  std::optional<at::Tensor> gather;  // [E] rows of src, dtype of index
  std::optional<at::Tensor> weight;  // [E * heads] contiguous, dtype of src
  int64_t heads = 1;                 // src rows hold `heads` heads of F / heads features
  int64_t num_segments = 0;
  Reduce reduce = Reduce::Sum;
  at::OptionalIntArrayRef config;    // override of the selector (CUDA)
  int long_segments = -1;            // long_segment_level from validate_indices, -1 unknown
  bool any_order = false;
  // Sum only, src with a row per segment: out[s] += (self_scale + self_offset)
  // * src[s] (GIN's (1 + eps) x: eps and 1). self_scale: one element on src's
  // device; the CUDA kernels add the term as they store (no second pass over
  // [S, F]; SP's long-segment slots and CPU add it after the sum).
  std::optional<at::Tensor> self_scale;
  double self_offset = 0;
};
// The self term's factor as a tensor, self_scale + self_offset in the rows'
// accumulation type as the CUDA kernels add it (a float32 scale plus 1 in
// float32 would round the factor of float64 rows), for the passes that add
// the term after the sum.
inline at::Tensor self_factor(const RowReduction& r) {
  const at::Tensor scale = r.self_scale->to(r.src.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  return r.self_offset != 0 ? scale + r.self_offset : scale;
}
at::Tensor reduce_rows_cpu(const RowReduction& r);  // [num_segments, F]
at::Tensor reduce_rows_cuda(const RowReduction& r);
at::Tensor reduce_rows_fused_cuda(const RowReduction& r);  // r with a gather or a weight

// Dispatches on the device of r.src.
at::Tensor reduce_rows(const RowReduction& r);

// Operator entries (the same function serves CPU and CUDA).
at::Tensor segment_reduce_op(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                             c10::string_view reduce, at::OptionalIntArrayRef config);
// out[e] = values[index[e]]: each segment's row repeated over its rows (the
// adjoint of a segment sum; index sorted, checked so its backward can take
// the sum). Rows whose index lies outside [0, S) (validation off) get 0.
at::Tensor segment_broadcast_op(const at::Tensor& values, const at::Tensor& index);
at::Tensor gather_rows_op(const at::Tensor& values, const at::Tensor& index);  // any order
#ifdef GEOT_WITH_CUDA
void gather_rows_cuda(const at::Tensor& values_rows, const at::Tensor& index, at::Tensor& out_rows);
#endif

}  // namespace geot
