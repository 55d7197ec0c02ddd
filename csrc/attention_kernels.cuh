// CUDA kernel of attention_aggregate (GAT inference): each destination's
// softmax and weighted sum in one pass over its edges. Holds no torch types;
// the launch layer is attention_cuda.cu.
//
// Online softmax: a lane keeps the largest logit it has seen, the sum of
// exp(logit - max) and the exp-weighted sums of its features, rescaling
// both whenever the max grows, so the logits are computed once, on the fly
// (score_src[src] + score_dst[dst], leaky ReLU), and no [E, H] tensor exists.
// Lanes that split a destination's edges merge their states at the end.
// Given attention vectors instead of scores, a score is the dot product of
// the row just loaded with the vector, summed over the head's lanes: no
// [N, H] score tensors either.
//
// Schedule: a block of kThreads takes kThreads / G consecutive destinations,
// a group of G lanes each: FL feature lanes (N_t features each, one head)
// times G / FL edge lanes; segment offsets (ptr) give each destination's
// edges. Three sizes of destination:
//  * up to kEdgesPerLane edges per edge lane: its group;
//  * up to kHubEdges: the whole block, after its groups (one at a time);
//  * hubs, more than kHubEdges: the hub pass first reduces each window of
//    kHubEdges consecutive edges (a block per window, balanced whatever the
//    degrees) into one state per hub it meets (at most two: a window cannot
//    hold a whole hub), and the hub's group merges its windows' states.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "edge_softmax_kernels.cuh"
#include "segment_reduce_kernels.cuh"  // load_columns, to_acc

namespace geot {
namespace attention {

constexpr int kThreads = 256;
constexpr int kEdgesPerLane = 32;
// Edges of a hub pass window; also the long-segment level validation reports
// for it (kLongSegmentRows[1]), so a graph known to have no hubs skips that pass.
constexpr int64_t kHubEdges = 1024;

template <typename scalar_t, typename acc_t, typename index_t>
struct Args {
  const scalar_t* __restrict__ x;          // [rows, F], F = H * C
  // Of each side one: the scores, or the attention vector ([H * C], a
  // score from a row of x: its source's, or its destination's, row seg).
  const acc_t* __restrict__ score_src;     // [rows, H]
  const acc_t* __restrict__ score_dst;     // [S, H]
  const acc_t* __restrict__ att_src;       // [F]
  const acc_t* __restrict__ att_dst;       // [F]
  const index_t* __restrict__ src;         // [E]
  const index_t* __restrict__ dst;         // [E], sorted
  scalar_t* __restrict__ out;              // [S, F]
  const int64_t* __restrict__ ptr;         // [S + 1] segment offsets of dst
  // Hub pass states: two per window (its first and last destination) per
  // column of N_t features, State<acc_t, N_t> each; null: no hub pass ran
  // (no destination has more than kHubEdges edges).
  acc_t* hub_states;
  int64_t E, S, rows, H, C, F, columns;
  acc_t negative_slope;
  bool self_loops;
  bool vector_access;  // x and out rows aligned to N_t elements
  int feature_lanes;   // FL: a power of two <= 32, at least F / N_t where that is <= 32
  int group;           // G: lanes per destination, a power of two, FL <= G <= 32
  int head_lanes;      // C / N_t, with an attention vector: a power of two <= FL
};

// A lane's share of one destination's softmax-weighted sum.
template <typename acc_t, int N_T>
struct State {
  acc_t max;  // the largest logit seen (lowest_value: none)
  acc_t sum;  // of exp(logit - max)
  acc_t acc[N_T];
};

template <typename acc_t, int N_T>
__device__ __forceinline__ State<acc_t, N_T> empty_state() {
  State<acc_t, N_T> s;
  s.max = lowest_value<acc_t>();
  s.sum = acc_t(0);
#pragma unroll
  for (int j = 0; j < N_T; ++j) s.acc[j] = acc_t(0);
  return s;
}

// Adds a message of weight exp(logit) and features v. A -inf logit adds
// nothing; a NaN one makes the sum NaN.
template <typename acc_t, int N_T>
__device__ __forceinline__ void add(State<acc_t, N_T>& s, acc_t logit, const acc_t (&v)[N_T]) {
  if (logit > s.max) {
    const acc_t scale = softmax::rescale(acc_t(1), s.max, logit);
    s.sum = s.sum * scale + acc_t(1);
#pragma unroll
    for (int j = 0; j < N_T; ++j) s.acc[j] = s.acc[j] * scale + v[j];
    s.max = logit;
  } else if (logit != lowest_value<acc_t>()) {
    const acc_t p = softmax::exp_acc(logit - s.max);
    s.sum += p;
#pragma unroll
    for (int j = 0; j < N_T; ++j) s.acc[j] += p * v[j];
  }
}

template <typename acc_t, int N_T>
__device__ __forceinline__ State<acc_t, N_T> merge(const State<acc_t, N_T>& a, const State<acc_t, N_T>& b) {
  State<acc_t, N_T> m;
  m.max = a.max > b.max ? a.max : b.max;
  const acc_t scale_a = softmax::rescale(acc_t(1), a.max, m.max), scale_b = softmax::rescale(acc_t(1), b.max, m.max);
  m.sum = a.sum * scale_a + b.sum * scale_b;
#pragma unroll
  for (int j = 0; j < N_T; ++j) m.acc[j] = a.acc[j] * scale_a + b.acc[j] * scale_b;
  return m;
}

template <typename acc_t, int N_T>
__device__ __forceinline__ State<acc_t, N_T> shfl_xor(const State<acc_t, N_T>& s, int offset) {
  State<acc_t, N_T> t;
  t.max = __shfl_xor_sync(0xffffffffu, s.max, offset);
  t.sum = __shfl_xor_sync(0xffffffffu, s.sum, offset);
#pragma unroll
  for (int j = 0; j < N_T; ++j) t.acc[j] = __shfl_xor_sync(0xffffffffu, s.acc[j], offset);
  return t;
}

template <typename acc_t>
__device__ __forceinline__ acc_t leaky_relu(acc_t v, acc_t slope) {
  return v > acc_t(0) ? v : v * slope;
}

// Features col0 .. col0 + N_T of row j of x (0 past F).
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void load_features(const Args<scalar_t, acc_t, index_t>& a, int64_t j, int64_t col0,
                                              acc_t (&v)[N_T]) {
  load_columns<N_T>(a.x + j * a.F + col0, col0, a.F, a.vector_access, acc_t(0), v);
}

// A head's score of a row: the dot product of its features v (this lane's
// N_T of them) with the attention vector's w, summed over the head's
// head_lanes neighbouring lanes (all of them here, on the same row: they
// share the destination and edge lane). Every lane gets the same bits.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ acc_t head_score(const Args<scalar_t, acc_t, index_t>& a, const acc_t (&v)[N_T],
                                            const acc_t (&w)[N_T]) {
  acc_t dot = acc_t(0);
#pragma unroll
  for (int j = 0; j < N_T; ++j) dot += v[j] * w[j];
  const int hl = a.head_lanes, lane = threadIdx.x & 31;
  const unsigned mask = hl == 32 ? 0xffffffffu : ((1u << hl) - 1) << (lane & ~(hl - 1));
  for (int offset = 1; offset < hl; offset <<= 1) dot += __shfl_xor_sync(mask, dot, offset);
  return dot;
}

// The attention vector's features col0 .. col0 + N_T (col0 < F).
template <int N_T, typename acc_t>
__device__ __forceinline__ void load_attention(const acc_t* att, int64_t col0, acc_t (&w)[N_T]) {
#pragma unroll
  for (int j = 0; j < N_T; ++j) w[j] = att[col0 + j];
}

// Adds the messages of destination seg that fall to one lane: edges begin +
// k * stride of [begin, end), and the self loop if `loop`. col0 < F.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void add_messages(const Args<scalar_t, acc_t, index_t>& a, State<acc_t, N_T>& s,
                                             int64_t seg, int64_t col0, int64_t begin, int64_t end, int stride,
                                             bool loop) {
  const int64_t head = col0 / a.C;
  acc_t w_src[N_T], own[N_T];  // own: row seg, the loop's and the destination's score's
  if (a.att_src) load_attention<N_T>(a.att_src, col0, w_src);
  if (loop || a.att_dst) load_features<N_T>(a, seg, col0, own);
  acc_t to_dst;
  if (a.att_dst) {
    acc_t w_dst[N_T];
    load_attention<N_T>(a.att_dst, col0, w_dst);
    to_dst = head_score<N_T>(a, own, w_dst);
  } else {
    to_dst = a.score_dst[seg * a.H + head];
  }
  auto logit = [&](int64_t j, const acc_t(&v)[N_T]) {
    const acc_t from_src = a.att_src ? head_score<N_T>(a, v, w_src) : a.score_src[j * a.H + head];
    return leaky_relu(from_src + to_dst, a.negative_slope);
  };
  if (loop) add(s, logit(seg, own), own);
  // Edges BATCH at a time: their loads are issued before the first is combined.
  constexpr int BATCH = 4;
  for (int64_t e0 = begin; e0 < end; e0 += BATCH * int64_t(stride)) {
    int64_t j[BATCH];
    bool take[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int64_t e = e0 + b * int64_t(stride);
      j[b] = e < end ? int64_t(a.src[e]) : -1;
      // Out-of-range sources (validation off) are skipped; added loops replace the input's.
      take[b] = static_cast<uint64_t>(j[b]) < static_cast<uint64_t>(a.rows) && !(a.self_loops && j[b] == seg);
    }
    acc_t logits[BATCH], rows[BATCH][N_T];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (take[b]) load_features<N_T>(a, j[b], col0, rows[b]);
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (take[b]) logits[b] = logit(j[b], rows[b]);
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      if (take[b]) add(s, logits[b], rows[b]);
  }
}

// The softmax-weighted mean of the state: 0 where no message had weight.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void store(const Args<scalar_t, acc_t, index_t>& a, int64_t seg, int64_t col0,
                                      const State<acc_t, N_T>& s) {
  scalar_t* o = a.out + seg * a.F + col0;
  acc_t r[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) r[j] = s.sum == acc_t(0) ? acc_t(0) : s.acc[j] / s.sum;
  if (a.vector_access) {
    Pack<scalar_t, N_T> pack;
#pragma unroll
    for (int j = 0; j < N_T; ++j) pack.v[j] = from_acc<scalar_t>(r[j]);
    *reinterpret_cast<Pack<scalar_t, N_T>*>(o) = pack;
    return;
  }
#pragma unroll
  for (int j = 0; j < N_T; ++j)
    if (col0 + j < a.F) o[j] = from_acc<scalar_t>(r[j]);
}

// A destination's state reduced by the whole block: edge lane el of
// kThreads / FL takes every (kThreads / FL)-th edge of [begin, end) (and the
// loop, if `loop`, el 0); warps merge with shuffles, then through shared
// memory (partial: one state per thread). sink(col0, state) takes each
// column's result on threads tid < FL. Called by every thread; ends with a
// barrier so the next call may reuse partial.
template <int N_T, class Sink, typename scalar_t, typename acc_t, typename index_t>
__device__ void block_reduce(const Args<scalar_t, acc_t, index_t>& a, int64_t seg, int64_t begin, int64_t end,
                             bool loop, State<acc_t, N_T>* partial, const Sink& sink) {
  const int tid = threadIdx.x, FL = a.feature_lanes, lane = tid & 31, warp = tid >> 5;
  const int fl = tid & (FL - 1), el = tid / FL, edge_lanes = kThreads / FL;
  for (int64_t col0 = int64_t(fl) * N_T; col0 - int64_t(fl) * N_T < a.F; col0 += int64_t(FL) * N_T) {
    State<acc_t, N_T> s = empty_state<acc_t, N_T>();
    if (col0 < a.F) add_messages<N_T>(a, s, seg, col0, begin + el, end, edge_lanes, loop && el == 0);
    for (int offset = FL; offset < 32; offset <<= 1) s = merge(s, shfl_xor(s, offset));
    if (lane < FL) partial[warp * FL + lane] = s;
    __syncthreads();
    if (tid < FL && col0 < a.F) {
      State<acc_t, N_T> t = partial[tid];
      for (int w = 1; w < kThreads / 32; ++w) t = merge(t, partial[w * FL + tid]);
      sink(col0, t);
    }
    __syncthreads();
  }
}

// The hub pass state of window `window`'s slot (0: the hub the window starts
// in, 1: the one it ends in) for column col0 / N_t.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ State<acc_t, N_T>& hub_state(const Args<scalar_t, acc_t, index_t>& a, int64_t window,
                                                        int slot, int64_t col0) {
  return reinterpret_cast<State<acc_t, N_T>*>(a.hub_states)[(window * 2 + slot) * a.columns + col0 / N_T];
}

__device__ __forceinline__ bool is_hub(int64_t begin, int64_t end) { return end - begin > kHubEdges; }

// Hub pass: block b reduces window b's edges [b, b + 1) * kHubEdges of the
// hubs among its first and last destination (no loops: the merge adds them).
template <typename scalar_t, typename acc_t, typename index_t, int N_T>
__global__ void __launch_bounds__(kThreads) attention_hub_kernel(Args<scalar_t, acc_t, index_t> a) {
  __shared__ State<acc_t, N_T> partial[kThreads];
  const int64_t window = blockIdx.x, w0 = window * kHubEdges, w1 = min(a.E, w0 + kHubEdges);
  const int64_t first = a.dst[w0], last = a.dst[w1 - 1];
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t seg = slot == 0 ? first : last;
    if ((slot == 1 && last == first) || seg < 0 || seg >= a.S) continue;
    const int64_t begin = a.ptr[seg], end = max(a.ptr[seg + 1], begin);
    if (!is_hub(begin, end)) continue;
    block_reduce<N_T>(a, seg, max(w0, begin), min(w1, end), false, partial,
                      [&](int64_t col0, const State<acc_t, N_T>& t) { hub_state<N_T>(a, window, slot, col0) = t; });
  }
}

// A hub's state for column col0: its windows' states merged, and its loop.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ State<acc_t, N_T> merged_hub(const Args<scalar_t, acc_t, index_t>& a, int64_t seg, int64_t col0,
                                        int64_t begin, int64_t end) {
  State<acc_t, N_T> s = empty_state<acc_t, N_T>();
  add_messages<N_T>(a, s, seg, col0, begin, begin, 1, a.self_loops);  // the loop only
  for (int64_t window = begin / kHubEdges; window <= (end - 1) / kHubEdges; ++window)
    s = merge(s, hub_state<N_T>(a, window, window * kHubEdges < begin ? 1 : 0, col0));
  return s;
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T>
__global__ void __launch_bounds__(kThreads) attention_aggregate_kernel(Args<scalar_t, acc_t, index_t> a) {
  __shared__ int64_t long_segs[kThreads];
  __shared__ int num_long;
  __shared__ State<acc_t, N_T> partial[kThreads];
  if (threadIdx.x == 0) num_long = 0;
  __syncthreads();
  const int rank = threadIdx.x & (a.group - 1), FL = a.feature_lanes;
  const int fl = rank & (FL - 1), el = rank / FL, edge_lanes = a.group / FL;
  const int64_t seg = int64_t(blockIdx.x) * (kThreads / a.group) + threadIdx.x / a.group;
  int64_t begin = 0, end = 0;
  if (seg < a.S) {
    begin = a.ptr[seg];
    end = max(a.ptr[seg + 1], begin);  // max: offsets of an unsorted index (validation off)
  }
  const bool merges_windows = a.hub_states && is_hub(begin, end);
  const bool is_long = !merges_windows && end - begin > int64_t(kEdgesPerLane) * edge_lanes;
  if (is_long && rank == 0) long_segs[atomicAdd(&num_long, 1)] = seg;
  const bool mine = seg < a.S && !is_long;
  // Every lane of the warp takes part in the shuffles (an idle one with an empty state).
  for (int64_t col0 = int64_t(fl) * N_T; col0 - int64_t(fl) * N_T < a.F; col0 += int64_t(FL) * N_T) {
    State<acc_t, N_T> s = empty_state<acc_t, N_T>();
    if (mine && col0 < a.F) {
      if (!merges_windows) add_messages<N_T>(a, s, seg, col0, begin + el, end, edge_lanes, a.self_loops && el == 0);
      else if (el == 0) s = merged_hub<N_T>(a, seg, col0, begin, end);
    }
    for (int offset = FL; offset < a.group; offset <<= 1) s = merge(s, shfl_xor(s, offset));
    if (mine && el == 0 && col0 < a.F) store<N_T>(a, seg, col0, s);
  }
  __syncthreads();
  for (int k = 0; k < num_long; ++k) {
    const int64_t s = long_segs[k];
    block_reduce<N_T>(a, s, a.ptr[s], max(a.ptr[s + 1], a.ptr[s]), a.self_loops, partial,
                      [&](int64_t col0, const State<acc_t, N_T>& t) { store<N_T>(a, s, col0, t); });
  }
}

}  // namespace attention
}  // namespace geot
