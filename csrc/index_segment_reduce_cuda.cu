// CUDA side of the fused family: the gathered / weighted instantiation of the
// row reduction (segment_reduce_launch.cuh), which runs the fused forward and
// its x-gradient, the per-edge kernels (the weight gradient's SDDMM,
// GATv2's scores) and the max/min x-gradient.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "index_segment_reduce.h"
#include "index_segment_reduce_kernels.cuh"
#include "segment_reduce_launch.cuh"

namespace geot {

at::Tensor reduce_rows_fused_cuda(const RowReduction& r) { return launch::reduce_rows<true>(r); }

namespace {

// 16-byte vector loads of a's and b's rows where every row offset allows them
// (head_size a multiple of the vector, 16-byte aligned bases), else one value
// per lane. (att, read one value per term, needs no alignment.)
template <typename scalar_t>
bool edge_term_vectors(const at::Tensor& a, const at::Tensor& b, int64_t head_size) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  return head_size % kVec == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0;
}

template <typename scalar_t, typename acc_t, typename index_t, int VEC, typename Term>
void launch_edge_term(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                      const at::Tensor& b, at::Tensor& out, int64_t head_size, Term term, cudaStream_t stream) {
  int group = 1;  // lanes per (edge, head): enough to cover the head's vectors, at most a warp
  while (group < 32 && group * VEC < head_size) group <<= 1;
  const int threads = 256;
  const int64_t E = out.size(0), heads = out.size(1);
  const int64_t blocks = std::min<int64_t>(ceil_div(E * heads, threads / group), 1 << 20);
  using in_t = typename cuda_type<scalar_t>::type;
  edge_term_kernel<in_t, acc_t, index_t, VEC><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      src_index.data_ptr<index_t>(), dst_index.data_ptr<index_t>(),
      reinterpret_cast<const in_t*>(a.data_ptr<scalar_t>()), reinterpret_cast<const in_t*>(b.data_ptr<scalar_t>()),
      reinterpret_cast<in_t*>(out.data_ptr<scalar_t>()), E, heads, head_size, a.size(0), b.size(0), group, term);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One launch of edge_term_kernel for the indices' and rows' dtypes: the dot
// product of the rows, or (att given) GATv2's additive score.
void dispatch_edge_term(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                        const at::Tensor& b, const at::Tensor* att, double negative_slope, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(b.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t head_size = b.size(1) / out.size(1);
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_term", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "geot_edge_term", [&] {
      using acc_t = accumulate_t<scalar_t>;
      using in_t = typename cuda_type<scalar_t>::type;
      constexpr int kVec = 16 / sizeof(scalar_t);
      const bool vector = edge_term_vectors<scalar_t>(a, b, head_size);
      auto launch = [&](auto term) {
        if (vector) {
          launch_edge_term<scalar_t, acc_t, index_t, kVec>(src_index, dst_index, a, b, out, head_size, term, stream);
        } else {
          launch_edge_term<scalar_t, acc_t, index_t, 1>(src_index, dst_index, a, b, out, head_size, term, stream);
        }
      };
      if (att == nullptr) {
        launch(geot::DotTerm<acc_t>{});
      } else {
        launch(geot::AdditiveTerm<in_t, acc_t>{reinterpret_cast<const in_t*>(att->data_ptr<scalar_t>()),
                                               static_cast<acc_t>(negative_slope)});
      }
    });
  });
}

}  // namespace

void edge_dot_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                   const at::Tensor& b, at::Tensor& out) {
  dispatch_edge_term(src_index, dst_index, a, b, nullptr, 0.0, out);
}

void edge_additive_score_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                              const at::Tensor& b, const at::Tensor& att, double negative_slope, at::Tensor& out) {
  dispatch_edge_term(src_index, dst_index, a, b, &att, negative_slope, out);
}

at::Tensor extremum_grad_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                              const at::Tensor& extremum, const at::Tensor& grad) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t E = src_index.numel(), F = x.size(1), S = extremum.size(0);
  const at::ScalarType acc_type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_x = at::zeros({x.size(0), F}, x.options().dtype(acc_type));
  if (E == 0 || F == 0) return grad_x.to(x.scalar_type());
  at::Tensor ties = at::zeros({S, F}, x.options().dtype(at::kInt));
  int lanes = 1;  // a warp's worth of features at most; the rest of the block takes more edges
  while (lanes < 32 && lanes < F) lanes *= 2;
  const dim3 block(lanes, 256 / lanes);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(E, int64_t(block.y)), 1 << 16));
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_extremum_grad", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "geot_extremum_grad", [&] {
      using acc_t = accumulate_t<scalar_t>;
      using in_t = typename cuda_type<scalar_t>::type;
      const auto rows = [](const at::Tensor& t) { return reinterpret_cast<const in_t*>(t.data_ptr<scalar_t>()); };
      auto launch = [&](auto share) {
        extremum_ties_kernel<in_t, acc_t, index_t, decltype(share)::value><<<blocks, block, 0, stream>>>(
            src_index.data_ptr<index_t>(), dst_index.data_ptr<index_t>(), rows(x), rows(extremum), rows(grad),
            ties.data_ptr<int>(), grad_x.data_ptr<acc_t>(), E, F, x.size(0), S);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      launch(std::false_type{});
      launch(std::true_type{});
    });
  });
  return grad_x.to(x.scalar_type());  // (itself where x is fp32 / fp64)
}

TORCH_LIBRARY_IMPL(geot, CUDA, m) {
  m.impl("index_segment_reduce", &index_segment_reduce_op);
  m.impl("index_scatter_sum", &index_scatter_sum_op);
  m.impl("index_sum_plus_scaled", &index_sum_plus_scaled_op);
  m.impl("edge_dot", &edge_dot_op);
  m.impl("edge_additive_score", &edge_additive_score_op);
  m.impl("extremum_grad", &extremum_grad_op);
}

}  // namespace geot
