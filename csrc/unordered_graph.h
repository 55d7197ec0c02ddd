// Helpers for graphs used in input order (geot.nn's graphs of one step, left
// unsorted and summed with atomics): a check of their ids that needs no
// device->host sync, and the per-row edge counts of a mean.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace geot {

// Records src and dst as valid for num_src / num_dst rows (dst sorted if
// dst_sorted), so the ops skip their synchronizing validation, and queues a
// check of their values on the current stream. A failed check shows up later
// in take_failed_check, under the ticket returned here (tickets start at 1).
int64_t deferred_index_check(const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst,
                             bool dst_sorted);
// The ticket of a failed deferred check seen since the last call (0: none
// seen yet; checks still queued report at a later call).
int64_t take_failed_check();

// max(rows with index == s, 1) for s in [0, num_segments), index in any
// order, in float64 or else float32: a mean's divisor (half types would
// round degrees past 256). Ids out of range are not counted.
at::Tensor any_order_counts(const at::Tensor& index, int64_t num_segments, bool float64);

#ifdef GEOT_WITH_CUDA
void deferred_index_check_cuda(const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst,
                               int64_t ticket);
int64_t take_failed_check_cuda();
void count_rows_cuda(const at::Tensor& index, at::Tensor& counts);
#endif

}  // namespace geot
