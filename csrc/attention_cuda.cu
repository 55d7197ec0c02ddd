// CUDA side of attention_aggregate: the segment offsets, the features per
// thread and the lanes per destination, the hub pass where one may be
// needed, the scores of attention vectors where a head's lanes cannot sum
// them; dispatches dtypes onto attention_kernels.cuh.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "attention.h"
#include "attention_kernels.cuh"
#include "launch_utils.cuh"
#include "segment_reduce.h"
#include "segment_reduce_launch.cuh"  // index_offsets

namespace geot {

namespace {

// N_t: the widest of 4, 2, 1 features that divides a head's C and whose
// loads x's rows are aligned for.
int features_per_thread(int64_t C, const at::Tensor& x) {
  const auto address = reinterpret_cast<uintptr_t>(x.data_ptr());
  for (int n : {4, 2}) {
    if (C % n == 0 && address % (n * x.element_size()) == 0) return n;
  }
  return 1;
}

// FL feature lanes cover a row (up to 32); edge lanes fill the group up to
// the average messages per destination, within a warp.
void pick_lanes(int64_t F, int n_t, int64_t messages, int64_t S, int& feature_lanes, int& group) {
  const int64_t columns = ceil_div(F, n_t), average = ceil_div(messages, std::max<int64_t>(S, 1));
  feature_lanes = 1;
  while (feature_lanes < 32 && feature_lanes < columns) feature_lanes <<= 1;
  int edge_lanes = 1;
  while (feature_lanes * edge_lanes < 32 && edge_lanes < average) edge_lanes <<= 1;
  group = feature_lanes * edge_lanes;
}

// The hub pass where a destination may have more than kHubEdges edges (the
// long-segment level from validation; -1 unknown), then the main kernel.
template <typename scalar_t, typename acc_t, typename index_t, int N_T>
void launch_attention(attention::Args<scalar_t, acc_t, index_t> a, int long_segments, const at::Tensor& like) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  static_assert(attention::kHubEdges == kLongSegmentRows[1], "the hub pass is skipped by the level of its size");
  a.columns = ceil_div(a.F, N_T);
  const int64_t windows = ceil_div(a.E, attention::kHubEdges);
  at::Tensor hub_states;  // held until the kernels are queued
  if (windows > 0 && (long_segments < 0 || long_segments >= 2)) {
    const int64_t values = windows * 2 * a.columns * int64_t(sizeof(attention::State<acc_t, N_T>) / sizeof(acc_t));
    hub_states = at::empty({values}, like.options().dtype(std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat));
    a.hub_states = hub_states.data_ptr<acc_t>();
    TORCH_CHECK_VALUE(windows <= std::numeric_limits<int>::max(), "too many edges: ", std::to_string(a.E));
    attention::attention_hub_kernel<scalar_t, acc_t, index_t, N_T>
        <<<static_cast<unsigned>(windows), attention::kThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t blocks = ceil_div(a.S, attention::kThreads / a.group);
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max(), "num_segments too large: ", std::to_string(a.S));
  attention::attention_aggregate_kernel<scalar_t, acc_t, index_t, N_T>
      <<<static_cast<unsigned>(blocks), attention::kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether a head's lanes can sum its scores from an attention vector: C / N_t
// neighbouring lanes, a power of two within a warp (a head's features then
// lie in one pass of the feature lanes).
bool heads_fit_lanes(int64_t C, int n_t) {
  const int64_t lanes = C / n_t;
  return lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

template <typename acc_t>
const acc_t* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

}  // namespace

void attention_aggregate_cuda(AttentionInputs in, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(in.x.device());
  const int64_t F = in.x.size(1), C = F / in.heads, E = in.src_index.size(0);
  const int n_t = features_per_thread(C, in.x);
  if (!heads_fit_lanes(C, n_t)) scores_from_attention(in);
  AT_DISPATCH_INDEX_TYPES(in.dst_index.scalar_type(), "geot_attention_aggregate", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "geot_attention_aggregate", [&] {
      using in_t = typename cuda_type<scalar_t>::type;
      using acc_t = accumulate_t<scalar_t>;
      attention::Args<in_t, acc_t, index_t> a{};
      a.x = reinterpret_cast<const in_t*>(in.x.data_ptr<scalar_t>());
      a.score_src = data_or_null<acc_t>(in.score_src);
      a.score_dst = data_or_null<acc_t>(in.score_dst);
      a.att_src = data_or_null<acc_t>(in.att_src);
      a.att_dst = data_or_null<acc_t>(in.att_dst);
      a.head_lanes = static_cast<int>(C / n_t);
      a.src = in.src_index.data_ptr<index_t>();
      a.dst = in.dst_index.data_ptr<index_t>();
      // Cached per index (index_offsets): a static graph's pass runs once.
      const at::Tensor ptr =
          launch::index_offsets<index_t>(in.dst_index, in.num_segments, false, c10::cuda::getCurrentCUDAStream()).ptr;
      a.ptr = ptr.data_ptr<int64_t>();
      a.out = reinterpret_cast<in_t*>(out.data_ptr<scalar_t>());
      a.E = E, a.S = in.num_segments, a.rows = in.x.size(0), a.H = in.heads, a.C = C, a.F = F;
      a.negative_slope = static_cast<acc_t>(in.negative_slope);
      a.self_loops = in.self_loops;
      a.vector_access = true;  // n_t divides F; x checked aligned, out fresh (aligned)
      pick_lanes(F, n_t, E + (in.self_loops ? in.num_segments : 0), in.num_segments, a.feature_lanes, a.group);
      switch (n_t) {
        case 4: return launch_attention<in_t, acc_t, index_t, 4>(a, in.long_segments, in.x);
        case 2: return launch_attention<in_t, acc_t, index_t, 2>(a, in.long_segments, in.x);
        default: return launch_attention<in_t, acc_t, index_t, 1>(a, in.long_segments, in.x);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(geot, CUDA, m) { m.impl("attention_aggregate", &attention_aggregate_op); }

}  // namespace geot
