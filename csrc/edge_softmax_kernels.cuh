// CUDA kernels of edge_softmax, forward and backward, each fused into one
// kernel. Holds no torch types; the launch layer is edge_softmax_cuda.cu.
//
// Schedule: a block of kThreads takes kThreads / G consecutive destinations,
// a group of G lanes (a power of two <= 32, picked from the average degree)
// per destination. Two binary searches in the sorted dst_index give the
// block's edge range and two more, inside that range, each destination's
// edges: no offsets array, so no extra pass and no host sync. A destination's
// [edges, H] values are contiguous; the lanes stride over them. When H is a
// power of two <= G, every lane sees a single head and xor shuffles inside
// the group combine the lanes of one head; otherwise each lane takes whole
// heads. Destinations with more than 32 values per lane (hubs) are left to
// the whole block afterwards, one at a time, with a shared-memory reduction.
//
// Each destination takes two passes over its values: one reduction (the
// forward pass keeps a running max and a sum of exp rescaled whenever the max
// grows, so max and sum need one pass together; the backward pass sums
// grad * y), and one that writes the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "segment_reduce_kernels.cuh"

namespace geot {
namespace softmax {

constexpr int kThreads = 256;

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

template <typename acc_t> struct MaxSum {
  acc_t max, sum;  // sum of exp(v - max) over the values seen
};

// sum * exp(max - new_max); 0 for a part that saw no finite value yet.
template <typename acc_t> __device__ __forceinline__ acc_t rescale(acc_t sum, acc_t max, acc_t new_max) {
  return max == lowest_value<acc_t>() ? acc_t(0) : sum * exp_acc(max - new_max);
}

// y = exp(score - max) / sum over each destination and head. out may be
// score (in place): not __restrict__. Every value is read before it is
// written, by the thread that writes it (the passes below keep that).
template <typename scalar_t, typename acc_t>
struct ForwardOp {
  using Acc = MaxSum<acc_t>;
  const scalar_t* score;
  scalar_t* out;

  __device__ __forceinline__ Acc identity() const { return {lowest_value<acc_t>(), acc_t(0)}; }
  __device__ __forceinline__ Acc add(Acc a, int64_t i) const {
    const acc_t v = to_acc(score[i]);
    if (v > a.max) return {v, rescale(a.sum, a.max, v) + acc_t(1)};
    // -inf adds nothing (also before any finite value); NaN propagates.
    return {a.max, a.sum + (v == lowest_value<acc_t>() ? acc_t(0) : exp_acc(v - a.max))};
  }
  __device__ __forceinline__ Acc merge(Acc a, Acc b) const {
    const acc_t max = a.max > b.max ? a.max : b.max;
    return {max, rescale(a.sum, a.max, max) + rescale(b.sum, b.max, max)};
  }
  __device__ __forceinline__ Acc finish(Acc a) const { return {a.max, acc_t(1) / a.sum}; }
  __device__ __forceinline__ void write(int64_t i, Acc t) const {
    out[i] = from_acc<scalar_t>(exp_acc(to_acc(score[i]) - t.max) * t.sum);
  }
};

// grad_score = y * (grad - sum of grad * y) over each destination and head.
template <typename scalar_t, typename acc_t>
struct BackwardOp {
  using Acc = acc_t;
  const scalar_t* __restrict__ y;
  const scalar_t* __restrict__ grad;
  scalar_t* __restrict__ out;

  __device__ __forceinline__ Acc identity() const { return acc_t(0); }
  __device__ __forceinline__ Acc add(Acc a, int64_t i) const { return a + to_acc(y[i]) * to_acc(grad[i]); }
  __device__ __forceinline__ Acc merge(Acc a, Acc b) const { return a + b; }
  __device__ __forceinline__ Acc finish(Acc a) const { return a; }
  __device__ __forceinline__ void write(int64_t i, Acc dot) const {
    out[i] = from_acc<scalar_t>(to_acc(y[i]) * (to_acc(grad[i]) - dot));
  }
};

template <typename T> __device__ __forceinline__ T shfl_xor(T v, int offset, int width) {
  return __shfl_xor_sync(0xffffffffu, v, offset, width);
}
template <typename T> __device__ __forceinline__ MaxSum<T> shfl_xor(MaxSum<T> v, int offset, int width) {
  return {shfl_xor(v.max, offset, width), shfl_xor(v.sum, offset, width)};
}

__device__ __forceinline__ bool power_of_two(int64_t v) { return (v & (v - 1)) == 0; }

// Both passes over edges [begin, end), one thread per head (H too large for
// the lanes to share heads).
template <typename Op>
__device__ __forceinline__ void whole_heads(const Op& op, int64_t begin, int64_t end, int64_t H, int rank, int lanes) {
  for (int64_t h = rank; h < H; h += lanes) {
    typename Op::Acc acc = op.identity();
    for (int64_t e = begin; e < end; ++e) acc = op.add(acc, e * H + h);
    acc = op.finish(acc);
    for (int64_t e = begin; e < end; ++e) op.write(e * H + h, acc);
  }
}

// One destination's edges [begin, end) by a group of `group` lanes (rank in
// the group). Every lane of the warp must call it (the shuffles span the
// warp); lanes without a destination pass an empty range.
template <typename Op>
__device__ __forceinline__ void group_pass(const Op& op, int64_t begin, int64_t end, int64_t H, int rank,
                                           int group) {
  if (!(power_of_two(H) && H <= group)) return whole_heads(op, begin, end, H, rank, group);
  // group is a multiple of H: lane `rank` only sees head rank % H.
  const int64_t first = begin * H, last = end * H;
  typename Op::Acc acc = op.identity();
#pragma unroll 4
  for (int64_t i = first + rank; i < last; i += group) acc = op.add(acc, i);
  for (int offset = group >> 1; offset >= H; offset >>= 1) acc = op.merge(acc, shfl_xor(acc, offset, group));
  acc = op.finish(acc);
#pragma unroll 4
  for (int64_t i = first + rank; i < last; i += group) op.write(i, acc);
}

// One long destination by the whole block. partial / total: kThreads
// entries of shared memory each. Called by every thread; ends with a barrier
// so the next call may reuse the shared memory.
template <typename Op>
__device__ __forceinline__ void block_pass(const Op& op, int64_t begin, int64_t end, int64_t H,
                                           typename Op::Acc* partial, typename Op::Acc* total) {
  const int tid = threadIdx.x;
  if (H > kThreads) {
    whole_heads(op, begin, end, H, tid, kThreads);
    return;  // no shared memory used
  }
  const int heads = int(H), used = (kThreads / heads) * heads;  // thread tid < used takes head tid % H
  const int64_t first = begin * H, last = end * H;
  typename Op::Acc acc = op.identity();
  if (tid < used) {
#pragma unroll 4
    for (int64_t i = first + tid; i < last; i += used) acc = op.add(acc, i);
  }
  int count;  // partial results per head, `heads` apart in `partial`
  if (power_of_two(heads) && heads <= 32) {
    for (int offset = 16; offset >= heads; offset >>= 1) acc = op.merge(acc, shfl_xor(acc, offset, 32));
    if ((tid & 31) < heads) partial[(tid >> 5) * heads + (tid & 31)] = acc;
    count = kThreads / 32;
  } else {
    if (tid < used) partial[tid] = acc;
    count = used / heads;
  }
  __syncthreads();
  if (tid < heads) {
    typename Op::Acc t = partial[tid];
    for (int k = 1; k < count; ++k) t = op.merge(t, partial[k * heads + tid]);
    total[tid] = op.finish(t);
  }
  __syncthreads();
  if (tid < used) {
    const typename Op::Acc t = total[tid % heads];
#pragma unroll 4
    for (int64_t i = first + tid; i < last; i += used) op.write(i, t);
  }
  __syncthreads();
}

template <typename index_t>
struct Destinations {
  const index_t* __restrict__ index;  // [E] sorted
  int64_t E, H, S;
  int group;  // lanes per destination, a power of two <= 32
};

// Runs op over every destination: reduction pass, then write pass. Edges
// whose destination is outside [0, S) (possible with validation off) are not
// touched.
template <typename Op, typename index_t>
__global__ void __launch_bounds__(kThreads) edge_softmax_kernel(Op op, Destinations<index_t> d) {
  using Acc = typename Op::Acc;
  __shared__ int64_t range[2];
  __shared__ int64_t long_edges[kThreads][2];
  __shared__ int num_long;
  __shared__ Acc partial[kThreads], total[kThreads];
  const int per_block = kThreads / d.group;
  const int64_t first_seg = int64_t(blockIdx.x) * per_block;
  const int64_t end_seg = min(d.S, first_seg + per_block);
  if (threadIdx.x == 0) {
    range[0] = lower_bound_index(d.index, d.E, first_seg);
    num_long = 0;
  }
  if (threadIdx.x == 32) range[1] = lower_bound_index(d.index, d.E, end_seg);
  __syncthreads();
  const int64_t lo = range[0], hi = max(range[0], range[1]);  // hi < lo only if unsorted
  const int rank = threadIdx.x & (d.group - 1);
  const int64_t seg = first_seg + threadIdx.x / d.group;
  int64_t begin = lo, end = lo;
  if (seg < end_seg) {
    begin = lo + lower_bound_index(d.index + lo, hi - lo, seg);
    end = max(begin, lo + lower_bound_index(d.index + lo, hi - lo, seg + 1));
  }
  if ((end - begin) * d.H > int64_t(32) * d.group) {  // long: the block takes it below
    if (rank == 0) {
      const int slot = atomicAdd(&num_long, 1);
      long_edges[slot][0] = begin;
      long_edges[slot][1] = end;
    }
    end = begin;
  }
  group_pass(op, begin, end, d.H, rank, d.group);
  __syncthreads();
  for (int i = 0; i < num_long; ++i) block_pass(op, long_edges[i][0], long_edges[i][1], d.H, partial, total);
}

// The composed softmax's per-edge steps: each value of [E, H] meets its
// destination's value of [S, H] (max, sum or dot). A hub's value is read by
// many threads at once: read-only loads keep it in L1, where torch's row
// gather of [S, H] by dst_index (16-byte rows) stalled on a 10^6-edge hub.
// Edges whose destination lies outside [0, S) (validation off) get 0.
template <typename index_t, typename acc_t, typename Op>
__global__ void per_edge_kernel(Op op, const index_t* __restrict__ index, const acc_t* __restrict__ per_destination,
                                int64_t E, int64_t H, int64_t S) {
  const int64_t total = E * H;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = H == 1 ? i : i / H;
    const int64_t d = index[e];
    if (d < 0 || d >= S) {
      op.skip(i);
    } else {
      op(i, __ldg(per_destination + d * H + (i - e * H)));
    }
  }
}

// y = exp(value - max of its destination); -inf values give 0.
template <typename acc_t>
struct ExpShiftOp {
  const acc_t* value;
  acc_t* y;
  __device__ __forceinline__ void operator()(int64_t i, acc_t max) const { y[i] = exp_acc(value[i] - max); }
  __device__ __forceinline__ void skip(int64_t i) const { y[i] = acc_t(0); }
};

// out = y / sum of its destination, rounded to out_t.
template <typename acc_t, typename out_t>
struct NormalizeOp {
  const acc_t* y;
  out_t* out;
  __device__ __forceinline__ void operator()(int64_t i, acc_t sum) const { out[i] = from_acc<out_t>(y[i] / sum); }
  __device__ __forceinline__ void skip(int64_t i) const { out[i] = from_acc<out_t>(acc_t(0)); }
};

// grad_score = y * (grad - sum of grad * y over its destination).
template <typename scalar_t, typename acc_t>
struct SoftmaxGradOp {
  const scalar_t* y;
  const scalar_t* grad;
  scalar_t* out;
  __device__ __forceinline__ void operator()(int64_t i, acc_t dot) const {
    out[i] = from_acc<scalar_t>(to_acc(y[i]) * (to_acc(grad[i]) - dot));
  }
  __device__ __forceinline__ void skip(int64_t i) const { out[i] = from_acc<scalar_t>(acc_t(0)); }
};

}  // namespace softmax
}  // namespace geot
