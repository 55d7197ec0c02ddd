// CUDA kernels of the fused family beyond the shared row reduction
// (segment_reduce_kernels.cuh runs the fused forward itself): the per-edge
// kernels (the SDDMM of the weight gradient, GATv2's scores) and the max/min
// gradient's. Holds no torch types.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "segment_reduce_kernels.cuh"

namespace geot {

// The per-feature terms that the edge kernels sum over a head; f is the
// feature's column in the [rows, heads * head_size] row.
template <typename acc_t>
struct DotTerm {  // <a, b>: the SDDMM of the weight gradient
  __device__ acc_t operator()(acc_t a, acc_t b, int64_t) const { return a * b; }
};

template <typename scalar_t, typename acc_t>
struct AdditiveTerm {  // att . leaky_relu(a + b): GATv2's score
  const scalar_t* att;  // [heads * head_size]
  acc_t negative_slope;
  __device__ acc_t operator()(acc_t a, acc_t b, int64_t f) const {
    const acc_t z = a + b;
    return to_acc(att[f]) * (z > acc_t(0) ? z : z * negative_slope);
  }
};

// out[e, h] = the sum over head h's features of term(a[dst[e], f], b[src[e], f]).
// A tile of `group` lanes (a power of two <= 32) takes one (edge, head) item:
// lanes stride over the features VEC at a time (one vector load each from a
// and b: the caller checks alignment), then reduce with shuffles. A narrow
// head (32 fp32 features: 8 lanes) leaves a warp four items per iteration,
// so fewer dependent index -> row loads wait per value. Out-of-range rows
// (possible with validation off) give 0.
template <typename scalar_t, typename acc_t, typename index_t, int VEC, typename Term>
__global__ void edge_term_kernel(const index_t* __restrict__ src_index, const index_t* __restrict__ dst_index,
                                 const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                 scalar_t* __restrict__ out, int64_t E, int64_t heads, int64_t head_size,
                                 int64_t a_rows, int64_t b_rows, int group, Term term) {
  using Vec = Pack<scalar_t, VEC>;  // VEC values in one 16-byte (or narrower) load
  const int lane = threadIdx.x & (group - 1);
  const unsigned tile_mask =
      group == 32 ? 0xffffffffu : ((1u << group) - 1u) << (threadIdx.x & 31 & ~(group - 1));
  const int64_t F = heads * head_size;
  const int64_t tiles = int64_t(gridDim.x) * (blockDim.x / group);
  for (int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / group; item < E * heads;
       item += tiles) {
    const int64_t e = heads == 1 ? item : item / heads, h = item - e * heads;
    const int64_t s = src_index[e], d = dst_index[e];
    acc_t sum = 0;
    if (s >= 0 && s < b_rows && d >= 0 && d < a_rows) {
      const scalar_t* pa = a + d * F + h * head_size;
      const scalar_t* pb = b + s * F + h * head_size;
      for (int64_t f = int64_t(lane) * VEC; f < head_size; f += int64_t(group) * VEC) {
        const Vec va = *reinterpret_cast<const Vec*>(pa + f), vb = *reinterpret_cast<const Vec*>(pb + f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) sum += term(to_acc(va.v[k]), to_acc(vb.v[k]), h * head_size + f + k);
      }
    }
    for (int offset = group >> 1; offset > 0; offset >>= 1) sum += __shfl_xor_sync(tile_mask, sum, offset, group);
    if (lane == 0) out[item] = from_acc<scalar_t>(sum);
  }
}

// The gradient of a gathered max or min with respect to x, without the
// [E, F] messages a composite materializes: each (segment, feature) gradient
// splits evenly among the edges whose row holds the extremum (ties). Pass 1
// (SHARE false) counts them per (segment, feature) in ties; pass 2 adds each
// tied edge's share, rounded to the gradient's dtype as the composite's is,
// into grad_x (acc_t rows). Edges are grid-strided, blockDim.y per block,
// blockDim.x lanes striding over features (coalesced rows); atomics only
// where a row ties. Out-of-range ids (validation off) add nothing.
template <typename scalar_t, typename acc_t, typename index_t, bool SHARE>
__global__ void extremum_ties_kernel(const index_t* __restrict__ src_index, const index_t* __restrict__ dst_index,
                                     const scalar_t* __restrict__ x, const scalar_t* __restrict__ extremum,
                                     const scalar_t* __restrict__ grad, int* __restrict__ ties,
                                     acc_t* __restrict__ grad_x, int64_t E, int64_t F, int64_t x_rows,
                                     int64_t segments) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; e < E; e += stride) {
    const int64_t s = src_index[e], d = dst_index[e];
    if (s < 0 || s >= x_rows || d < 0 || d >= segments) continue;
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
      if (!(to_acc(x[s * F + f]) == to_acc(extremum[d * F + f]))) continue;
      if constexpr (SHARE) {
        const scalar_t share = from_acc<scalar_t>(to_acc(grad[d * F + f]) / acc_t(ties[d * F + f]));
        atomicAdd(grad_x + s * F + f, to_acc(share));
      } else {
        atomicAdd(ties + d * F + f, 1);
      }
    }
  }
}

}  // namespace geot
