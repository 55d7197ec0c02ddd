// Host side of unordered_graph.h: tickets and the counts on CPU.
#include "unordered_graph.h"

#include <atomic>

#include "index_cache.h"
#include "segment_reduce.h"

namespace geot {

int64_t deferred_index_check(const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst,
                             bool dst_sorted) {
  TORCH_CHECK_VALUE(src.dim() == 1 && dst.dim() == 1 && src.numel() == dst.numel(),
                    "deferred_index_check takes two 1-D indices of one length");
  TORCH_CHECK_VALUE(src.is_cuda() && dst.device() == src.device(), "deferred_index_check takes CUDA indices");
  TORCH_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "deferred_index_check takes indices of one dtype");
  remember_valid_index(dst, num_dst, dst_sorted, kLongSegmentBits);
  remember_valid_index(src, num_src, false, kLongSegmentBits);
  static std::atomic<int64_t> last_ticket{0};
  const int64_t ticket = ++last_ticket;
#ifdef GEOT_WITH_CUDA
  deferred_index_check_cuda(src, dst, num_src, num_dst, ticket);
#else
  TORCH_CHECK(false, "geot was built without CUDA");
#endif
  return ticket;
}

int64_t take_failed_check() {
#ifdef GEOT_WITH_CUDA
  return take_failed_check_cuda();
#else
  return 0;
#endif
}

at::Tensor any_order_counts(const at::Tensor& index, int64_t num_segments, bool float64) {
  TORCH_CHECK_VALUE(index.dim() == 1, "index must be 1-D");
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0");
  at::Tensor counts = at::zeros({num_segments}, index.options().dtype(float64 ? at::kDouble : at::kFloat));
  if (index.is_cuda()) {
#ifdef GEOT_WITH_CUDA
    count_rows_cuda(index, counts);
#endif
  } else {
    const at::Tensor in_range = index.masked_select((index >= 0) & (index < num_segments));
    counts.index_add_(0, in_range, at::ones({}, counts.options()).expand({in_range.numel()}));
  }
  return counts.clamp_min_(1);
}

}  // namespace geot
