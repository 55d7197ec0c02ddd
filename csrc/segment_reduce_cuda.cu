// CUDA side of segment_reduce: the plain-row instantiation of the launch
// layer (segment_reduce_launch.cuh), index validation and gather_rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "segment_reduce_launch.cuh"

namespace geot {

void index_flags_cuda(const at::Tensor& index, int64_t bound, bool sorted, int* flags) {
  const at::Tensor idx = index.contiguous();
  const int64_t E = idx.numel();
  if (E == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(E, threads), 4096));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  static_assert(LongSegmentRows::kLevels == kLongSegmentLevels, "one threshold per kLongSegment bit");
  LongSegmentRows long_rows{};
  std::copy_n(kLongSegmentRows, kLongSegmentLevels, long_rows.rows);
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "geot_check_index", [&] {
    check_index_kernel<index_t><<<blocks, threads, 0, stream>>>(idx.data_ptr<index_t>(), E, bound, sorted,
                                                                long_rows, flags);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor reduce_rows_cuda(const RowReduction& r) {
  if (r.gather || r.weight) return reduce_rows_fused_cuda(r);
  return launch::reduce_rows<false>(r);
}

void gather_rows_cuda(const at::Tensor& values_rows, const at::Tensor& index, at::Tensor& out_rows) {
  const c10::cuda::CUDAGuard guard(values_rows.device());
  const int64_t E = out_rows.size(0), F = out_rows.size(1);
  const int threads = 256;
  const unsigned blocks = grid_stride_blocks(E * F, threads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values_rows.scalar_type(), "geot_gather_rows", [&] {
    using in_t = typename cuda_type<scalar_t>::type;
    AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "geot_gather_rows_index", [&] {
      gather_rows_kernel<in_t, index_t><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const in_t*>(values_rows.data_ptr<scalar_t>()), index.data_ptr<index_t>(),
          reinterpret_cast<in_t*>(out_rows.data_ptr<scalar_t>()), E, F, values_rows.size(0));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(geot, CUDA, m) {
  m.impl("segment_reduce", &segment_reduce_op);
  m.impl("segment_broadcast", &segment_broadcast_op);
  m.impl("gather_rows", &gather_rows_op);
}

}  // namespace geot
