// CUDA side of edge_softmax: picks the lanes per destination and dispatches
// dtypes onto the fused kernels of edge_softmax_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "edge_softmax.h"
#include "edge_softmax_kernels.cuh"
#include "launch_utils.cuh"
#include "uninitialized.h"

namespace geot {

namespace {

// Lanes per destination: the average values per destination rounded up to a
// power of two (<= 32), and at least H when H is a power of two <= 32, so
// that a lane sees one head.
int lanes_per_destination(int64_t E, int64_t H, int64_t S) {
  const int64_t average = ceil_div(E * H, std::max<int64_t>(S, 1));
  int group = 1;
  while (group < 32 && group < average) group <<= 1;
  if (H <= 32 && (H & (H - 1)) == 0) group = std::max(group, static_cast<int>(H));
  return group;
}

template <typename Op, typename index_t>
void launch(const Op& op, const at::Tensor& dst_index, int64_t E, int64_t H, int64_t S) {
  softmax::Destinations<index_t> d{dst_index.data_ptr<index_t>(), E, H, S, lanes_per_destination(E, H, S)};
  const int64_t blocks = ceil_div(S, softmax::kThreads / d.group);
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max(), "num_segments too large: ", std::to_string(S));
  softmax::edge_softmax_kernel<Op, index_t>
      <<<static_cast<unsigned>(blocks), softmax::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(op, d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename index_t, typename acc_t, typename Op>
void launch_per_edge(const Op& op, const at::Tensor& index, const at::Tensor& per_destination, int64_t E, int64_t H) {
  const int threads = 256;
  const unsigned blocks = grid_stride_blocks(E * H, threads);
  softmax::per_edge_kernel<index_t, acc_t, Op><<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      op, index.data_ptr<index_t>(), per_destination.data_ptr<acc_t>(), E, H, per_destination.size(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor exp_shift_cuda(const at::Tensor& values, const at::Tensor& max, const at::Tensor& index) {
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor y = uninitialized(values.sizes(), values.options());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "geot_exp_shift", [&] {
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "geot_exp_shift", [&] {
      const softmax::ExpShiftOp<scalar_t> op{values.data_ptr<scalar_t>(), y.data_ptr<scalar_t>()};
      launch_per_edge<index_t, scalar_t>(op, index, max, values.size(0), values.size(1));
    });
  });
  return y;
}

void normalize_cuda(const at::Tensor& y, const at::Tensor& sum, const at::Tensor& index, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(y.device());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "geot_normalize", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "geot_normalize", [&] {
      using out_t = typename cuda_type<scalar_t>::type;
      using acc_t = accumulate_t<scalar_t>;
      const softmax::NormalizeOp<acc_t, out_t> op{y.data_ptr<acc_t>(), reinterpret_cast<out_t*>(out.data_ptr<scalar_t>())};
      launch_per_edge<index_t, acc_t>(op, index, sum, y.size(0), y.size(1));
    });
  });
}

void softmax_grad_cuda(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dot, const at::Tensor& index,
                       at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(y.device());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "geot_softmax_grad", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "geot_softmax_grad", [&] {
      using in_t = typename cuda_type<scalar_t>::type;
      using acc_t = accumulate_t<scalar_t>;
      const softmax::SoftmaxGradOp<in_t, acc_t> op{reinterpret_cast<const in_t*>(y.data_ptr<scalar_t>()),
                                                   reinterpret_cast<const in_t*>(grad.data_ptr<scalar_t>()),
                                                   reinterpret_cast<in_t*>(out.data_ptr<scalar_t>())};
      launch_per_edge<index_t, acc_t>(op, index, dot, y.size(0), y.size(1));
    });
  });
}

void edge_softmax_cuda(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments, at::Tensor& out) {
  if (num_segments == 0) return;  // no edge has a destination (validation off): out stays 0
  const c10::cuda::CUDAGuard guard(score.device());
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_softmax", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, score.scalar_type(), "geot_edge_softmax", [&] {
      using in_t = typename cuda_type<scalar_t>::type;
      using acc_t = accumulate_t<scalar_t>;
      const softmax::ForwardOp<in_t, acc_t> op{reinterpret_cast<const in_t*>(score.data_ptr<scalar_t>()),
                                               reinterpret_cast<in_t*>(out.data_ptr<scalar_t>())};
      launch<softmax::ForwardOp<in_t, acc_t>, index_t>(op, dst_index, score.size(0), score.size(1), num_segments);
    });
  });
}

void edge_softmax_backward_cuda(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                                int64_t num_segments, at::Tensor& out) {
  if (num_segments == 0) return;
  const c10::cuda::CUDAGuard guard(y.device());
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_softmax_backward", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "geot_edge_softmax_backward", [&] {
      using in_t = typename cuda_type<scalar_t>::type;
      using acc_t = accumulate_t<scalar_t>;
      const softmax::BackwardOp<in_t, acc_t> op{reinterpret_cast<const in_t*>(y.data_ptr<scalar_t>()),
                                                reinterpret_cast<const in_t*>(grad.data_ptr<scalar_t>()),
                                                reinterpret_cast<in_t*>(out.data_ptr<scalar_t>())};
      launch<softmax::BackwardOp<in_t, acc_t>, index_t>(op, dst_index, y.size(0), y.size(1), num_segments);
    });
  });
}

TORCH_LIBRARY_IMPL(geot, CUDA, m) {
  m.impl("edge_softmax", &edge_softmax_op);
  m.impl("edge_softmax_", &edge_softmax_inplace_op);
  m.impl("edge_softmax_backward", &edge_softmax_backward_op);
}

}  // namespace geot
