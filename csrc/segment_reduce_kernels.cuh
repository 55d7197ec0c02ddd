// CUDA kernels of the segment_reduce family (GeoT §III): out[index[e]] op= src[e]
// with index sorted, and its fused forms (GeoT §IV): the row of element e is
// gathered, src[gather[e]], and optionally scaled, weight[e] * src[gather[e]],
// inside the load, so no [E, F] temporary exists. Holds no torch types; the
// launch layer is segment_reduce_cuda.cu.
//
// Work is split by rows (edges), not by segments, so a huge segment is spread
// over many threads and tiny segments are packed together. Partial results
// meet in the output through atomics, only at segment boundaries:
//  * SR (sequential reduction): a thread walks M_t consecutive rows for N_t
//    features and flushes its accumulator whenever the segment changes (a
//    segment it saw whole it stores, no atomic). For half types the
//    segments that straddle several threads' rows meet in a small fp32
//    buffer of one row per thread's rows (only a thread's last segment can
//    run on past them), and the rest is written to the output directly.
//  * PR (parallel reduction): a tile of G_t lanes takes G_t consecutive rows at
//    a time, reduces them with a segmented shuffle reduction, and the lane that
//    heads each segment flushes; the tile's last segment is carried into the
//    next iteration so a long segment costs one atomic per tile, not per row.
//  * SP (segment parallel, G_t = 0): no atomics and no pre-filled output.
//    Segment offsets come from one pass over the index (cached per index by
//    the launch layer); a thread group per segment reduces the segment's
//    first M_t rows per lane (threads the features leave over split the
//    rows into lanes) and stores the result.
//    Rows past that cap (hubs) are left to an SR pass with atomics, so one
//    huge segment cannot stall the grid. For half types (whose output
//    cannot take those additions without rounding each) such a segment
//    goes to that pass whole, into a small fp32 buffer of one row per long
//    segment, and a last pass writes it. Best on graphs of even degree.
// Segment ids outside [0, S) are skipped, so a bad index can give a wrong
// answer but never an out-of-bounds write.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "reduce_ops.cuh"

namespace geot {

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_acc(double v) { return T(v); }

// A segment's result as the output holds it: 0 when empty (rows <= 0),
// divided by its rows for a mean, rounded to out_t.
template <typename out_t, typename acc_t>
__device__ __forceinline__ out_t finished(acc_t v, int64_t rows, bool mean) {
  return from_acc<out_t>(rows <= 0 ? acc_t(0) : mean ? v / acc_t(rows) : v);
}

template <typename scalar_t, typename acc_t, typename index_t>
struct SegmentArgs {
  const index_t* __restrict__ index;  // [E], sorted (SR also takes any order)
  const scalar_t* __restrict__ src;   // [src_rows, F], row-major contiguous
  acc_t* __restrict__ out;            // [S, F], pre-filled with the identity
  int64_t E, F, S;
  bool vector_loads;                  // F % N_t == 0 and src aligned to N_t elements
  bool vector_out;                    // F % N_t == 0, out and final_out aligned to N_t elements
  // SR: a thread stores (not adds) the segments it sees whole, from their
  // first row to their last. Needs a sorted index; off for any-order input.
  bool whole_segment_stores;
  // SR of gathered sums: a group of lanes loads its rows' ids together
  // (segment_reduce_shared_ids_kernel).
  bool shared_ids;
  // Fused ops: element e reads row gather[e] of src (null: row e) scaled by
  // weight[e, head] (null: unscaled), where a row holds `heads` heads of
  // F / heads features. Rows outside [0, src_rows) read as the identity.
  const index_t* __restrict__ gather;
  const scalar_t* __restrict__ weight;
  int64_t src_rows, heads;
  // SP schedule only: segment offsets [S + 1], rows per segment the SP pass
  // takes (the rest is overflow for an SR pass), its row lanes, and rows of
  // the longest segment (exact when cached; else zeroed by the offsets pass
  // and raised by the SP pass, only past the cap: all the overflow pass
  // needs to know).
  const int64_t* __restrict__ ptr;
  int64_t cap;                        // lanes * M_t
  int lanes;                          // threads per (segment, N_t features), a power of two <= 32
  int64_t* longest;
  bool may_overflow;  // host side: false when no segment can exceed cap (no overflow pass)
  // SP: the SP pass writes its segments' results itself here, divided for a
  // mean and rounded to scalar_t (no fp32 buffer for half types, no
  // finalize pass), where no segment can exceed cap (out is then null) or
  // long segments have slots (below); else null.
  scalar_t* __restrict__ final_out;
  bool mean;
  // Means of fp32 / fp64 rows into out: every store and atomic add of a
  // segment's rows takes 1 / its rows (ptr), so out holds the mean when the
  // last one lands, with no finalize pass over [S, F].
  bool scale_by_rows;
  // SP with slots for long segments: the SP pass leaves a segment of more
  // than cap rows whole to the overflow pass, which reduces it into row
  // long_slot[seg] of out (then a buffer of long_capacity rows, not S);
  // finalize_long_segments_kernel writes its result. The SP pass claims the
  // slots: long_count counts them, long_segment[slot] names the segment.
  int* long_slot;                     // [S], -1 for segments the SP pass writes
  int64_t* long_segment;              // [long_capacity]
  int* long_count;
  int64_t long_capacity;
  // SR writing half types directly (chunk_rows = M_t; 0: off): a segment a
  // thread sees whole goes to final_out from that thread; one that
  // straddles several threads' rows adds into row ptr[seg] / chunk_rows of
  // out, a buffer of chunk_slots = ceil(E / M_t) rows (the thread where the
  // segment begins owns that row: only its last segment can run on), and
  // finalize_straddling_segments_kernel writes it.
  int64_t chunk_rows;
  int64_t chunk_slots;
  // Sums with a row of src per segment (null: off): *self_scale * src[seg] is
  // added to each segment. SP adds it as it stores (empty segments included);
  // SR adds it to the segments it stores whole, and the launch layer
  // pre-fills out with the term for the rest (SR's straddling and empty
  // segments, and PR's, which only add), or with chunk slots
  // finalize_straddling_segments_kernel adds it to them. The factor is
  // *self_scale + self_offset (GIN passes eps and 1: no kernel for 1 + eps).
  const acc_t* self_scale;
  acc_t self_offset;
  // Deterministic schedules (partial set; torch.use_deterministic_algorithms):
  // no float atomics. Rows are cut into chunks of fixed size (SR and SP's
  // overflow pass: a thread's M_t rows; PR: a tile's G_t * M_t), never of
  // the grid's. A chunk stores the segments it sees whole; of a segment
  // that began before it, it writes its part into slot 2c (head) of
  // partial, of one that goes on past it, into slot 2c + 1 (tail).
  // partial_code[slot] = slot_code(segment, written): unwritten slots hold
  // no values. The combine levels (combine_partials_*_kernel) then add each
  // segment's slots in slot order, level by level, and store the result.
  acc_t* partial;                     // [2 * chunks, F]
  int64_t* partial_code;              // [2 * chunks]
  // The one-pass combine (one_pass; where validation bounds every segment
  // to ~10^3 chunks): combine_owned_slots_kernel adds the slots of each
  // segment that a chunk's written tail slot begins (its owner chunk) at
  // once, instead of the combine levels.
  bool one_pass;
};

// A partial slot's segment and whether it holds a value, as one sortable
// code (segments clamped to [-1, S] by the writers, so the code is >= 0).
__device__ __forceinline__ int64_t slot_code(int64_t seg, bool written) { return ((seg + 1) << 1) | int64_t(written); }
__device__ __forceinline__ int64_t code_segment(int64_t code) { return (code >> 1) - 1; }

// The two ends of a chunk of rows [begin, end) (begin < end) of a sorted
// sequence of segments: head, its first segment began before the chunk;
// tail, its last goes on past it (and is not the head's).
struct ChunkEnds {
  int64_t chunk, first, last;
  bool head, tail;
};
template <class SegmentOf>
__device__ __forceinline__ ChunkEnds chunk_ends(const SegmentOf& segment_of, int64_t n, int64_t begin, int64_t end,
                                                int64_t chunk) {
  ChunkEnds c{chunk, segment_of(begin), segment_of(end - 1), false, false};
  c.head = begin > 0 && segment_of(begin - 1) == c.first;
  c.tail = end < n && segment_of(end) == c.last && !(c.head && c.first == c.last);
  return c;
}

template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

// fp16/bf16 rows (accumulated in float): only these take the direct-output
// paths of SR, which fp32/fp64 kernels then compile without.
template <typename scalar_t, typename acc_t>
constexpr bool kHalfRows = !std::is_same_v<scalar_t, acc_t>;

// Head of the weight that scales features col0 .. col0 + N_T - 1 (the launch
// layer keeps N_T dividing the head size, so one head covers them all).
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ int64_t weight_head(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t col0) {
  return a.heads > 1 ? col0 / (a.F / a.heads) : 0;
}

// Features col0 .. col0 + N_T of a row of F (p: its element col0) in acc_t
// registers, `fill` past F; vector: one aligned Pack load.
template <int N_T, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_columns(const scalar_t* p, int64_t col0, int64_t F, bool vector, acc_t fill,
                                             acc_t (&v)[N_T]) {
  if (vector) {
    const Pack<scalar_t, N_T> pack = *reinterpret_cast<const Pack<scalar_t, N_T>*>(p);
#pragma unroll
    for (int j = 0; j < N_T; ++j) v[j] = to_acc(pack.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N_T; ++j) v[j] = col0 + j < F ? to_acc(p[j]) : fill;
  }
}

// acc += (*self_scale + self_offset) * src[seg]'s features col0 .. col0 + N_T - 1,
// where self_scale is set (SegmentArgs::self_scale).
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void add_self_term(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg,
                                              int64_t col0, acc_t (&acc)[N_T]) {
  if (!a.self_scale) return;
  acc_t own[N_T];
  load_columns<N_T>(a.src + seg * a.F + col0, col0, a.F, a.vector_loads, acc_t(0), own);
  const acc_t scale = *a.self_scale + a.self_offset;
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] += scale * own[j];
}

// Loads element `row`'s features col0 : col0 + N_T (src[row], or the gathered
// and weighted row of the fused ops) into acc_t registers; features past F
// get the identity so they can be combined blindly. `row` must be in
// [0, E); with take == false (or a gathered row out of range) the values are
// the identity. No branch guards the loads (an unused element reads row 0 of
// src), so the compiler can issue a whole batch of gathered loads
// before the first one returns instead of branching around each.
// FUSED = false (plain segment_reduce: no gather, no weight) skips that
// work: the shuffle-heavy PR schedule is issue-bound enough to feel it.
template <bool FUSED, int N_T, class Op, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void load_row(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t row,
                                         int64_t col0, int64_t head, bool take, acc_t (&v)[N_T]) {
  const int64_t src_row = FUSED && a.gather && take ? int64_t(a.gather[row]) : row;
  take = take && (!FUSED || static_cast<uint64_t>(src_row) < static_cast<uint64_t>(a.src_rows));
  load_columns<N_T>(a.src + (take ? src_row : 0) * a.F + col0, col0, a.F, a.vector_loads, Op::identity(), v);
  if (!FUSED) return;  // callers of the plain path skip rows they do not take
  const acc_t w = a.weight && take ? to_acc(a.weight[row * a.heads + head]) : acc_t(1);
#pragma unroll
  for (int j = 0; j < N_T; ++j) v[j] = take && col0 + j < a.F ? (a.weight ? v[j] * w : v[j]) : Op::identity();
}

// load_row for both paths: the fused path loads branch-free, the plain path
// branches around rows it does not take (cheaper when loads are coalesced).
template <bool FUSED, int N_T, class Op, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void load_or_identity(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t row,
                                                 int64_t col0, int64_t head, bool take, acc_t (&v)[N_T]) {
  if (FUSED || take) {
    load_row<FUSED, N_T, Op>(a, row, col0, head, take, v);
  } else {
#pragma unroll
    for (int j = 0; j < N_T; ++j) v[j] = Op::identity();
  }
}

// Whether segment seg was left whole to the overflow pass (it has a slot).
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ bool has_slot(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg) {
  return seg >= 0 && seg < a.S && a.long_slot[seg] >= 0;
}

// What a partial result of segment seg is multiplied by as it lands in out:
// 1 / its rows where SegmentArgs::scale_by_rows (then it has rows), else 1.
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ acc_t rows_scale(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg) {
  // (max(.., 1): offsets of an unsorted index, validation off, stay finite.)
  return a.scale_by_rows ? acc_t(1) / acc_t(max(a.ptr[seg + 1] - a.ptr[seg], int64_t(1))) : acc_t(1);
}

// Merges a partial result into out[seg] (with slots: out[long_slot[seg]];
// CHUNKED, SR with chunk slots where set: the row of the chunk where the
// segment begins) with atomics. VECTOR_OUT: a.vector_out known to be set
// (the per-element fallback, and its registers, compiled out).
template <int N_T, class Op, bool CHUNKED = false, bool VECTOR_OUT = false, typename scalar_t, typename acc_t,
          typename index_t>
__device__ __forceinline__ void flush(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg,
                                      int64_t col0, const acc_t (&acc)[N_T]) {
  if (seg < 0 || seg >= a.S) return;
  int64_t row = a.long_slot ? a.long_slot[seg] : seg;
  if constexpr (CHUNKED) {
    if (a.chunk_rows) row = min(a.ptr[seg] / a.chunk_rows, a.chunk_slots - 1);
  }
  if (row < 0) return;
  acc_t* o = a.out + row * a.F + col0;
  acc_t part[N_T];
  const acc_t scale = rows_scale(a, seg);
#pragma unroll
  for (int j = 0; j < N_T; ++j) part[j] = acc[j] * scale;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // sm_90 has 2- and 4-wide float atomicAdd: one atomic per 4 (or 2) features, not one each.
  constexpr bool kVectorAtomics = std::is_same_v<Op, SumOp<float>> && (N_T % 4 == 0 || N_T == 2);
#else
  constexpr bool kVectorAtomics = false;
#endif
  if (kVectorAtomics && (VECTOR_OUT || a.vector_out)) {
    if constexpr (N_T == 2) {
      atomicAdd(reinterpret_cast<float2*>(o), make_float2(part[0], part[1]));
    } else {
#pragma unroll
      for (int j = 0; j < N_T; j += 4)
        atomicAdd(reinterpret_cast<float4*>(o + j), make_float4(part[j], part[j + 1], part[j + 2], part[j + 3]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < N_T; ++j)
      if (col0 + j < a.F) Op::atomic(o + j, part[j]);
  }
}

// Writes a whole segment's output (as segment_finalize_kernel would make
// it) into final_out[seg]: no other thread touches it.
template <int N_T, bool VECTOR_OUT = false, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void store_finished(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg,
                                               int64_t col0, const acc_t (&acc)[N_T], int64_t rows) {
  scalar_t* o = a.final_out + seg * a.F + col0;
  if (VECTOR_OUT || a.vector_out) {
    Pack<scalar_t, N_T> pack;
#pragma unroll
    for (int j = 0; j < N_T; ++j) pack.v[j] = finished<scalar_t>(acc[j], rows, a.mean);
    *reinterpret_cast<Pack<scalar_t, N_T>*>(o) = pack;
  } else {
#pragma unroll
    for (int j = 0; j < N_T; ++j)
      if (col0 + j < a.F) o[j] = finished<scalar_t>(acc[j], rows, a.mean);
  }
}

// Writes a thread's N_T accumulators at o (features col0.. of a row of F):
// one vector store where `vector` (aligned, F % N_T == 0), else each one in range.
template <int N_T, typename acc_t>
__device__ __forceinline__ void write_row(acc_t* o, int64_t col0, int64_t F, bool vector, const acc_t (&acc)[N_T]) {
  if (vector) {
    Pack<acc_t, N_T> pack;
#pragma unroll
    for (int j = 0; j < N_T; ++j) pack.v[j] = acc[j];
    *reinterpret_cast<Pack<acc_t, N_T>*>(o) = pack;
    return;
  }
#pragma unroll
  for (int j = 0; j < N_T; ++j)
    if (col0 + j < F) o[j] = acc[j];
}

// Writes a whole segment, with its self term, into out[seg] (SR with chunk
// slots: its output into final_out[seg]): no other thread touches it.
// DET: a deterministic schedule's store, where fp32 / fp64 rows may write
// final_out too (SP's); the default kernels of those compile without it.
// VECTOR_OUT: as flush's.
template <int N_T, bool DET = false, bool VECTOR_OUT = false, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void store(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg, int64_t col0,
                                      acc_t (&acc)[N_T]) {
  if (seg < 0 || seg >= a.S) return;
  add_self_term(a, seg, col0, acc);
  if constexpr (DET || kHalfRows<scalar_t, acc_t>) {
    if (a.final_out) return store_finished<N_T, VECTOR_OUT>(a, seg, col0, acc, a.mean ? a.ptr[seg + 1] - a.ptr[seg] : 1);
  }
  if constexpr (!kHalfRows<scalar_t, acc_t>) {
    const acc_t scale = rows_scale(a, seg);
#pragma unroll
    for (int j = 0; j < N_T; ++j) acc[j] *= scale;
  }
  write_row<N_T>(a.out + seg * a.F + col0, col0, a.F, VECTOR_OUT || a.vector_out, acc);
}

// Writes a partial result into slot `slot` of the deterministic schedules' partial rows.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void write_slot(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t slot, int64_t col0,
                                           const acc_t (&acc)[N_T]) {
  // col0 is a multiple of N_T and the buffer fresh: aligned where F is too.
  write_row<N_T>(a.partial + slot * a.F + col0, col0, a.F, a.F % N_T == 0, acc);
}

// The deterministic schedules' end of a run of rows of segment seg in a
// chunk (valid: it holds rows to add): the chunk's head or tail slot, or,
// for a segment the chunk saw whole, the store. Returns 1 for the head
// slot, 2 for the tail slot, else 0.
template <int N_T, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ int emit_run(const SegmentArgs<scalar_t, acc_t, index_t>& a, const ChunkEnds& c,
                                        int64_t seg, int64_t col0, acc_t (&acc)[N_T], bool valid) {
  if (!valid || seg < 0 || seg >= a.S) return 0;
  if (c.head && seg == c.first) return write_slot<N_T>(a, 2 * c.chunk, col0, acc), 1;
  if (c.tail && seg == c.last) return write_slot<N_T>(a, 2 * c.chunk + 1, col0, acc), 2;
  store<N_T, true>(a, seg, col0, acc);
  return 0;
}

// Whether rows of segment seg are reduced by the pass: in range, and for
// SP's deterministic overflow pass a segment past the cap (SP left it whole).
template <bool OVERFLOW_ONLY, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ bool reduced_segment(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t seg) {
  if (seg < 0 || seg >= a.S) return false;
  return !OVERFLOW_ONLY || a.ptr[seg + 1] - a.ptr[seg] > a.cap;
}

// The slot codes of a chunk of the deterministic schedules: a slot holds a
// value where the chunk's head / tail segment is one the pass reduces.
template <bool OVERFLOW_ONLY, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void write_codes(const SegmentArgs<scalar_t, acc_t, index_t>& a, const ChunkEnds& c) {
  const int64_t first = min(max(c.first, int64_t(-1)), a.S), last = min(max(c.last, int64_t(-1)), a.S);
  a.partial_code[2 * c.chunk] = slot_code(first, c.head && reduced_segment<OVERFLOW_ONLY>(a, c.first));
  a.partial_code[2 * c.chunk + 1] = slot_code(last, c.tail && reduced_segment<OVERFLOW_ONLY>(a, c.last));
}

// SP's overflow rows among a thread's rows [begin, end), when the pass adds
// in place (no slots, not deterministic) and end - begin <= cap: a segment
// that starts after `begin` has fewer than cap rows by `end`, so only the
// segment of row `begin` can have overflow rows here, and they are one run,
// [ptr[s] + cap, ptr[s + 1]) clipped to the thread's rows. The run is
// reduced with no per-row segment ids and flushed once: the per-row test
// (two dependent id loads a row before the row's) kept this pass
// latency-bound on hub-heavy graphs.
template <bool FUSED, int N_T, class Op, typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ void reduce_overflow_run(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t begin,
                                                    int64_t end, int64_t col0, int64_t head) {
  const int64_t seg = a.index[begin];
  if (seg < 0 || seg >= a.S) return;
  const int64_t first = max(begin, a.ptr[seg] + a.cap), last = min(end, a.ptr[seg + 1]);
  if (first >= last) return;
  acc_t acc[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
  constexpr int BATCH = 8;  // no segment ids held: twice SR's batch of 4-feature rows in flight
  for (int64_t r0 = first; r0 < last; r0 += BATCH) {
    acc_t v[BATCH][N_T];
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      load_or_identity<FUSED, N_T, Op>(a, min(r0 + b, last - 1), col0, head, r0 + b < last, v[b]);
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], v[b][j]);
  }
  flush<N_T, Op>(a, seg, col0, acc);
}

// SR. Block (T_N, T_M): x spans features (N_t each), y spans row chunks of
// rows_per_thread (M_t). Grid (row chunks / T_M, feature columns / T_N).
// OVERFLOW_ONLY: the SR pass after SP, which takes only the rows past the SP
// cap of their segment, or with slots every row of a segment that has one
// (and returns at once when no segment overflowed).
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED,
          bool OVERFLOW_ONLY, bool DET>
__global__ void segment_reduce_sr_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, int rows_per_thread) {
  const int64_t col0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N_T;
  const int64_t row_begin = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * rows_per_thread;
  if (col0 >= a.F || row_begin >= a.E) return;
  if (OVERFLOW_ONLY && *a.longest <= a.cap) return;  // (the combine levels return as well)
  const int64_t head = weight_head(a, col0);
  const int64_t row_end = min(row_begin + int64_t(rows_per_thread), a.E);
  if constexpr (OVERFLOW_ONLY && !DET) {
    if (!a.long_slot && rows_per_thread <= a.cap)
      return reduce_overflow_run<FUSED, N_T, Op>(a, row_begin, row_end, col0, head);
  }
  // Deterministic (DET: a.partial set): each run of a segment ends in
  // emit_run, not in an atomic. A template parameter: the default kernels
  // compile without its code (it took them from 64 to 96 registers).
  constexpr bool det = DET;
  ChunkEnds ends{};
  if constexpr (det) {
    ends = chunk_ends([&](int64_t r) { return int64_t(a.index[r]); }, a.E, row_begin, row_end,
                      row_begin / rows_per_thread);
    if (col0 == 0) write_codes<OVERFLOW_ONLY>(a, ends);
  }

  acc_t acc[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
  int64_t seg = a.index[row_begin];
  bool touched = !OVERFLOW_ONLY;  // acc holds a row (overflow pass: skip empty flushes)
  // The current segment began in this thread's rows: if it also ends in
  // them, the thread saw it whole and stores it without an atomic.
  const bool stores = !OVERFLOW_ONLY && a.whole_segment_stores;
  constexpr bool CHUNKED = !OVERFLOW_ONLY && kHalfRows<scalar_t, acc_t>;  // chunk slots possible
  bool began_here = stores && (row_begin == 0 || int64_t(a.index[row_begin - 1]) != seg);

  // Rows are fetched BATCH at a time before any is combined, so several loads
  // are in flight per thread. Rows past row_end repeat the last segment id
  // with identity values: they never trigger a flush.
  constexpr int BATCH = N_T == 4 ? 4 : 8;
  for (int64_t r0 = row_begin; r0 < row_end; r0 += BATCH) {
    int64_t s[BATCH];
    bool take[BATCH];
    acc_t v[BATCH][N_T];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int64_t r = r0 + b;
      s[b] = a.index[min(r, row_end - 1)];
      take[b] = r < row_end;
      // Row r is past its segment's first cap rows iff row r - cap is in the
      // same segment (the index is sorted).
      if (OVERFLOW_ONLY && take[b])
        take[b] = det           ? reduced_segment<true>(a, s[b])
                  : a.long_slot ? has_slot(a, s[b])
                                : r >= a.cap && int64_t(a.index[r - a.cap]) == s[b];
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
      load_or_identity<FUSED, N_T, Op>(a, min(r0 + b, row_end - 1), col0, head, take[b], v[b]);
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      if (s[b] != seg) {
        if constexpr (det) emit_run<N_T>(a, ends, seg, col0, acc, touched);
        else if (began_here) store<N_T>(a, seg, col0, acc);
        else if (touched) flush<N_T, Op, CHUNKED>(a, seg, col0, acc);
        seg = s[b];
        began_here = stores;
        touched = !OVERFLOW_ONLY;
#pragma unroll
        for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
      }
      if (OVERFLOW_ONLY) touched |= take[b];
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], v[b][j]);
    }
  }
  if constexpr (det) emit_run<N_T>(a, ends, seg, col0, acc, touched);
  else if (began_here && (row_end == a.E || int64_t(a.index[row_end]) != seg)) store<N_T>(a, seg, col0, acc);
  else if (touched) flush<N_T, Op, CHUNKED>(a, seg, col0, acc);
}

// Minimum blocks an SM of the shared-ids kernel below, whose blocks are
// 256 threads (shared_ids_config). Its default variant for half rows waits
// on its loads: registers capped (80 a thread with 8 features a lane, 64
// with 4) keep more rows in flight an SM.
template <typename scalar_t, typename acc_t, bool DET, int N_T>
constexpr int kSharedIdsMinBlocks = kHalfRows<scalar_t, acc_t> && !DET ? (N_T == 8 ? 3 : 4) : 1;

// A batch's gathered row in registers: half rows as stored (they widen as
// they are added, so a batch in flight takes half the registers), others in
// acc_t.
template <typename scalar_t, typename acc_t, int N_T>
using BatchRow = Pack<std::conditional_t<kHalfRows<scalar_t, acc_t>, scalar_t, acc_t>, N_T>;

// Features col0 .. col0 + N_T of `row` (a row of F) into v, 0 past F; a lane
// past F (!in_range) loads values it never adds. VECTOR (F % N_T == 0 and
// aligned, known): one load, from the row's start past F. Else one aligned
// load where `vector` and in range, per element otherwise. (Half rows ran
// faster with the unconditional load, fp32 rows with the branch: H100.)
template <bool VECTOR, int N_T, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_batch_row(const scalar_t* row, int64_t col0, int64_t F, bool in_range,
                                               bool vector, BatchRow<scalar_t, acc_t, N_T>& v) {
  if constexpr (kHalfRows<scalar_t, acc_t> && VECTOR) {
    v = *reinterpret_cast<const Pack<scalar_t, N_T>*>(row + (in_range ? col0 : 0));
  } else if constexpr (kHalfRows<scalar_t, acc_t>) {
    if (vector && in_range) {
      v = *reinterpret_cast<const Pack<scalar_t, N_T>*>(row + col0);
    } else {
      v = {};  // zero bits: 0 in every float type
#pragma unroll
      for (int j = 0; j < N_T; ++j)
        if (col0 + j < F) v.v[j] = row[col0 + j];
    }
  } else {
    load_columns<N_T>(row + col0, col0, F, vector && in_range, acc_t(0), v.v);
  }
}

// SR with shared ids, for gathered rows of wide F (the fused sums; the launch
// layer picks it: use_shared_ids in launch_rules.h). A group of blockDim.x lanes (a
// power of two up to a warp) holds N_T features each of one column block and
// walks rows_per_thread consecutive edges, as an SR thread does. The group
// loads the ids of blockDim.x edges at once, one edge per lane (coalesced),
// and hands them round with shuffles, so each row load issues at once; SR's
// lanes would each first wait on the ids of every row. Segments the group
// sees whole are stored, the rest flushed (atomics), as in SR, chunk slots
// included; DET (a.partial set): a group's rows are its chunk, and its runs
// end in emit_run, as SR's. Sums only, one weight head, a.gather set: a row
// out of range adds weight 0. VECTOR: a.vector_loads and a.vector_out set
// (their per-element fallbacks compiled out: the registers they hold, with
// the loads kept half, took the half-row kernel from spilling 156 bytes at
// 8 features a lane to none).
template <typename scalar_t, typename acc_t, typename index_t, int N_T, bool DET, bool VECTOR>
__global__ void __launch_bounds__(256, (kSharedIdsMinBlocks<scalar_t, acc_t, DET, N_T>))
    segment_reduce_shared_ids_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, int rows_per_thread) {
  using Op = SumOp<acc_t>;
  const int width = blockDim.x, lane = threadIdx.x;
  const int64_t col0 = (int64_t(blockIdx.y) * width + lane) * N_T;
  const int64_t row_begin = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * rows_per_thread;
  if (row_begin >= a.E) return;  // the whole group: its lanes share row_begin
  const int64_t row_end = min(row_begin + int64_t(rows_per_thread), a.E);
  const bool columns_in_range = col0 < a.F;
  const bool vector_loads = VECTOR || a.vector_loads;
  const int first_lane = (threadIdx.y * width) & 31;
  const unsigned group_mask = width == 32 ? 0xffffffffu : ((1u << width) - 1u) << first_lane;
  constexpr bool CHUNKED = kHalfRows<scalar_t, acc_t> && !DET;
  ChunkEnds ends{};
  if constexpr (DET) {
    ends = chunk_ends([&](int64_t r) { return int64_t(a.index[r]); }, a.E, row_begin, row_end,
                      row_begin / rows_per_thread);
    if (col0 == 0) write_codes<false>(a, ends);
  }

  acc_t acc[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
  // Ids travel between lanes in index_t: one shuffle each for 32-bit ids
  // (the common case) where int64 takes two, and fewer registers, which the
  // capped half-row kernel needs. (Against 64-bit ids, the weight always
  // shuffled and no cap: half rows 1.04-1.29x as fast, fp32 rows 0.97-0.99x;
  // H100, bench/spmm.py.)
  index_t seg = a.index[row_begin];
  bool began_here = row_begin == 0 || a.index[row_begin - 1] != seg;
  const auto finish_run = [&](bool whole) {
    if (!columns_in_range) return;
    if constexpr (DET) emit_run<N_T>(a, ends, seg, col0, acc, true);
    else if (whole) store<N_T, false, VECTOR>(a, seg, col0, acc);
    else flush<N_T, Op, CHUNKED, VECTOR>(a, seg, col0, acc);
  };
  constexpr int BATCH = 4;
  for (int64_t r0 = row_begin; r0 < row_end; r0 += width) {
    // This lane's edge of the next `width`: its source row (-1: out of
    // range, adds nothing), weight and segment.
    const int n = static_cast<int>(min(int64_t(width), row_end - r0));
    const int64_t r = r0 + min(lane, n - 1);
    const index_t src_row = a.gather[r];
    const bool in_range = lane < n && static_cast<uint64_t>(src_row) < static_cast<uint64_t>(a.src_rows);
    const index_t lane_src = in_range ? src_row : index_t(-1);
    const acc_t lane_weight = a.weight ? to_acc(a.weight[r]) : acc_t(1);
    const index_t lane_seg = a.index[r];  // past n: the last edge's segment, so padding never ends a run
    for (int j0 = 0; j0 < n; j0 += BATCH) {
      index_t s[BATCH];
      acc_t w[BATCH];
      BatchRow<scalar_t, acc_t, N_T> v[BATCH];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int j = min(j0 + b, n - 1);
        const index_t row = __shfl_sync(group_mask, lane_src, j, width);
        const acc_t weight = a.weight ? __shfl_sync(group_mask, lane_weight, j, width) : acc_t(1);
        w[b] = j0 + b < n && row >= 0 ? weight : acc_t(0);
        s[b] = __shfl_sync(group_mask, lane_seg, j, width);
        load_batch_row<VECTOR, N_T, scalar_t, acc_t>(a.src + int64_t(row < 0 ? 0 : row) * a.F, col0, a.F,
                                                      columns_in_range, vector_loads, v[b]);
      }
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        if (s[b] != seg) {
          finish_run(began_here);
          seg = s[b];
          began_here = true;
#pragma unroll
          for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
        }
#pragma unroll
        for (int j = 0; j < N_T; ++j) acc[j] += w[b] * to_acc(v[b].v[j]);
      }
    }
  }
  finish_run(began_here && (row_end == a.E || a.index[row_end] != seg));
}

// Empty segments one thread of segment_offsets_kernel writes at most where
// runs are listed: the rest of a longer run goes to the list, which
// segment_offsets_fill_kernel writes in parallel. Unlisted, one thread
// wrote every empty segment between two ids (26 ms on an H100 for RGCN's
// (node, relation) segments of a 21M-edge graph with 4 relations, whose
// node types without such edges make runs of millions). The list costs a
// memset and a launch: only past kListedRunsMinSegments segments, where
// an unlisted run could take over ~0.2 ms.
constexpr int64_t kSerialEmptyRun = 256;
constexpr int64_t kListedRunsMinSegments = int64_t(1) << 15;

// Entries [begin, end) of ptr that take `value`.
struct EmptyRun {
  int64_t begin, end, value;
};

// Long runs of empty segments handed from segment_offsets_kernel to the
// fill kernel: count (zeroed before) and up to capacity runs. For a sorted
// index runs are disjoint and over kSerialEmptyRun long, so capacity
// (S + 1) / kSerialEmptyRun + 1 always suffices; past it (an unsorted index,
// validation off) a thread writes its run itself.
struct EmptyRuns {
  EmptyRun* runs;
  unsigned long long* count;
  int64_t capacity;
};

// ptr[s] = first row of segment s, ptr[S] = E, from one pass over the index:
// position e writes the entries of the segments that start at e. Ids are
// clamped to [-1, S] so a bad index cannot write out of bounds. With a run
// list (runs.runs set), a run of empty segments past kSerialEmptyRun goes
// to it. It also clears the longest-segment counter (when given) the SP
// kernel raises.
template <typename index_t>
__global__ void segment_offsets_kernel(const index_t* __restrict__ index, int64_t E, int64_t S,
                                       int64_t* __restrict__ ptr, int64_t* longest, EmptyRuns runs) {
  if (longest && blockIdx.x == 0 && threadIdx.x == 0) *longest = 0;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e <= E; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t prev = e == 0 ? -1 : min(max(int64_t(index[e - 1]), int64_t(-1)), S);
    const int64_t cur = e == E ? S : min(max(int64_t(index[e]), int64_t(-1)), S);
    int64_t last = cur;
    if (runs.runs && cur - prev > kSerialEmptyRun) {
      const auto slot = static_cast<int64_t>(atomicAdd(runs.count, 1ull));
      if (slot < runs.capacity) {
        last = prev + kSerialEmptyRun;
        runs.runs[slot] = {last + 1, cur + 1, e};
      }
    }
    for (int64_t seg = prev + 1; seg <= last; ++seg) ptr[seg] = e;
  }
}

// Writes the runs segment_offsets_kernel listed: a block of BLOCK threads per run.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) segment_offsets_fill_kernel(int64_t* __restrict__ ptr, EmptyRuns runs) {
  const int64_t listed = min(static_cast<int64_t>(*runs.count), runs.capacity);
  for (int64_t r = blockIdx.x; r < listed; r += gridDim.x) {
    const EmptyRun run = runs.runs[r];
    for (int64_t s = run.begin + threadIdx.x; s < run.end; s += BLOCK) ptr[s] = run.value;
  }
}

// SP. Block (T_N, T_M): y spans segments; x spans features, and where the
// features take fewer than T_N threads, also rows: a tile of `lanes`
// neighbouring x threads (a power of two, within a warp) splits a segment's
// rows and reduces them with shuffles, so small F does not leave threads
// idle and a segment of a few hundred rows costs one round of loads, not
// one per row. Every output element is stored exactly once (empty segments
// get 0), so the output needs no pre-fill; overflow rows (past cap = lanes *
// M_t) are then added by the OVERFLOW_ONLY SR pass, or with slots (see
// SegmentArgs) a segment past the cap is left whole to that pass.
// ROW_LANES = false compiles the one-lane kernel with the lane arithmetic
// folded away (a runtime lane count of 1 cost gathered rows ~20% on H100).
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED, bool ROW_LANES>
__global__ void segment_reduce_sp_kernel(SegmentArgs<scalar_t, acc_t, index_t> a) {
  const int lanes = ROW_LANES ? a.lanes : 1;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t col0 = (int64_t(blockIdx.y) * (blockDim.x / lanes) + threadIdx.x / lanes) * N_T;
  const int64_t seg = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  // Threads past F or S still take part in the shuffles (whole warps), as identity.
  const bool active = col0 < a.F && seg < a.S;
  if (!active && lanes == 1) return;
  int64_t begin = 0, end = 0;
  if (active) {  // clamped: offsets from an unsorted index (validation off) stay in bounds
    begin = min(max(a.ptr[seg], int64_t(0)), a.E);
    end = min(max(a.ptr[seg + 1], begin), a.E);
  }
  const bool long_segment = end - begin > a.cap;
  // Left whole to the overflow pass: into a slot, or (deterministic) to its chunks.
  const bool left_whole = long_segment && (a.long_slot || a.partial);
  const int64_t stop = left_whole ? begin : min(end, begin + a.cap);
  if (long_segment && threadIdx.x == 0 && blockIdx.y == 0) {  // one thread per segment
    atomicMax(reinterpret_cast<unsigned long long*>(a.longest), static_cast<unsigned long long>(end - begin));
    if (left_whole && a.long_slot) {
      const int slot = atomicAdd(a.long_count, 1);
      if (slot < a.long_capacity) {  // always, for a validated index (its segments are disjoint ranges)
        a.long_slot[seg] = slot;
        a.long_segment[slot] = seg;
      }
    }
  }
  const int64_t head = weight_head(a, col0);

  acc_t acc[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
  constexpr int BATCH = N_T == 4 ? 4 : 8;
  const int64_t stride = lanes;
  for (int64_t r0 = begin + lane; r0 < stop; r0 += stride * BATCH) {
    acc_t v[BATCH][N_T];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int64_t r = r0 + b * stride;
      load_or_identity<FUSED, N_T, Op>(a, min(r, stop - 1), col0, head, r < stop, v[b]);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b)
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], v[b][j]);
  }
  if (ROW_LANES && lanes > 1) {
    // The threads of this warp (the block's last warp may be partial; lanes
    // divides T_N, so its tiles are whole).
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int in_warp = min(32, int(blockDim.x * blockDim.y) - (tid & ~31));
    const unsigned mask = in_warp == 32 ? 0xffffffffu : (1u << in_warp) - 1u;
    for (int d = lanes >> 1; d > 0; d >>= 1)
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], __shfl_xor_sync(mask, acc[j], d, lanes));
  }
  if (!active || lane != 0 || left_whole) return;
  const bool self_term = a.self_scale != nullptr;
  add_self_term(a, seg, col0, acc);
  // rows + self_term: an empty segment stores its own term, not 0.
  if (a.final_out) return store_finished<N_T>(a, seg, col0, acc, end - begin + self_term);
  acc_t* o = a.out + seg * a.F + col0;
  const acc_t scale = rows_scale(a, seg);  // (a mean's overflow rows, added later, take it too)
#pragma unroll
  for (int j = 0; j < N_T; ++j)
    if (col0 + j < a.F) o[j] = begin == end && !self_term ? acc_t(0) : acc[j] * scale;
}

// Segmented reduction in a tile of `group` lanes (a power of two up to a
// warp; the tile's lanes tile_shift.. of the warp, tile_bits its mask from
// there) holding sorted segment ids s and values v: each run of one
// segment is added into its first lane. Since ids are sorted, s[lane] ==
// s[lane + d] means the whole span is one segment. FLAG: `flag` is ORed
// over each run the same way. Returns whether this lane heads a run and
// the tile's last head.
struct RunHeads {
  bool head;
  int last;
};
template <bool FLAG, int N_T, class Op, typename acc_t>
__device__ __forceinline__ RunHeads reduce_runs(int64_t s, acc_t (&v)[N_T], bool& flag, int lane, int group,
                                                int tile_shift, unsigned tile_bits) {
  constexpr unsigned FULL = 0xffffffffu;
  for (int d = 1; d < group; d <<= 1) {
    const int64_t s_other = __shfl_down_sync(FULL, s, d, group);
    bool flag_other = false;
    if constexpr (FLAG) flag_other = __shfl_down_sync(FULL, flag, d, group);
    acc_t v_other[N_T];
#pragma unroll
    for (int j = 0; j < N_T; ++j) v_other[j] = __shfl_down_sync(FULL, v[j], d, group);
    if (lane + d < group && s_other == s) {
      if constexpr (FLAG) flag |= flag_other;
#pragma unroll
      for (int j = 0; j < N_T; ++j) v[j] = Op::combine(v[j], v_other[j]);
    }
  }
  const int64_t s_prev = __shfl_up_sync(FULL, s, 1, group);
  const bool head = lane == 0 || s_prev != s;
  const unsigned heads = (__ballot_sync(FULL, head) >> tile_shift) & tile_bits;
  return {head, 31 - __clz(heads)};
}

// PR. 1-D blocks whose size is a multiple of 32; consecutive `group` lanes
// form a tile. Tiles are numbered with the feature column fastest, so the
// tiles of one warp read neighbouring columns of the same rows.
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED, bool DET>
__device__ __forceinline__ void reduce_pr_tile(const SegmentArgs<scalar_t, acc_t, index_t>& a, int group,
                                               int iterations) {
  constexpr unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & (group - 1);
  const int tile_shift = threadIdx.x & 31 & ~(group - 1);  // tile's first lane in the warp
  const unsigned tile_bits = group == 32 ? FULL : ((1u << group) - 1u);
  const int64_t tile = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int64_t columns = (a.F + N_T - 1) / N_T;
  const int64_t col0 = (tile % columns) * N_T;
  const int64_t row_base = (tile / columns) * group * int64_t(iterations);
  const int64_t head = weight_head(a, col0);
  const int64_t past_end = std::numeric_limits<int64_t>::max();  // sorts after every segment

  acc_t carry[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) carry[j] = Op::identity();
  int64_t carry_seg = past_end;

  // Deterministic (DET: a.partial set; a template parameter, as SR's): the
  // tile's rows are its chunk; each segment's result (found in one lane,
  // once) ends in emit_run instead of an atomic.
  constexpr bool det = DET;
  ChunkEnds ends{};
  if (det && row_base < a.E) {
    ends = chunk_ends([&](int64_t r) { return int64_t(a.index[r]); }, a.E, row_base,
                      min(row_base + int64_t(group) * iterations, a.E), tile / columns);
    if (col0 == 0 && lane == 0) write_codes<false>(a, ends);
  }
  auto finish = [&](int64_t seg, const acc_t (&part)[N_T]) {
    if constexpr (!det) {
      flush<N_T, Op>(a, seg, col0, part);
    } else {
      acc_t copy[N_T];
#pragma unroll
      for (int j = 0; j < N_T; ++j) copy[j] = part[j];
      emit_run<N_T>(a, ends, seg, col0, copy, seg != past_end);
    }
  };

  // Every lane runs every iteration (shuffles need the whole warp); lanes
  // without a row hold the past_end segment and identity values. The next
  // iteration's row is loaded before this one is reduced, so its load is in
  // flight during the shuffles.
  auto fetch = [&](int it, int64_t& s, acc_t (&v)[N_T]) {
    const int64_t r = row_base + int64_t(it) * group + lane;
    const bool has_row = it < iterations && r < a.E;
    s = has_row ? int64_t(a.index[r]) : past_end;
    load_or_identity<FUSED, N_T, Op>(a, has_row ? r : 0, col0, head, has_row, v);
  };
  int64_t s_next;
  acc_t v_next[N_T];
  fetch(0, s_next, v_next);
  for (int it = 0; it < iterations; ++it) {
    const int64_t s = s_next;
    acc_t v[N_T];
#pragma unroll
    for (int j = 0; j < N_T; ++j) v[j] = v_next[j];
    fetch(it + 1, s_next, v_next);

    bool no_flag = false;  // each run's values into its first lane
    const RunHeads runs = reduce_runs<false, N_T, Op>(s, v, no_flag, lane, group, tile_shift, tile_bits);
    const bool head = runs.head;
    const int last_head = runs.last;

    // The carried segment either goes on at lane 0 or has ended.
    if (lane == 0) {
      if (s == carry_seg) {
#pragma unroll
        for (int j = 0; j < N_T; ++j) v[j] = Op::combine(v[j], carry[j]);
      } else {
        finish(carry_seg, carry);
      }
    }
    // The tile's last segment may go on in the next rows: keep it in lane 0.
    if (head && lane != last_head) finish(s, v);
    const int64_t s_last = __shfl_sync(FULL, s, last_head, group);
#pragma unroll
    for (int j = 0; j < N_T; ++j) carry[j] = __shfl_sync(FULL, v[j], last_head, group);
    carry_seg = s_last;
  }
  if (lane == 0) finish(carry_seg, carry);
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED, bool DET>
__global__ void segment_reduce_pr_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, int group, int iterations) {
  reduce_pr_tile<scalar_t, acc_t, index_t, N_T, Op, FUSED, DET>(a, group, iterations);
}

// Deterministic PR at N_t = 4 with its registers capped: uncapped it takes
// 70 where the default kernel takes 52, and the schedule is bound by load
// latency, so it wants the warps (H100, 3M-edge hub graphs, F = 4-8, both
// ops: the chunk pass up to 11% faster at 64 registers in 7 of 8 cells, 1%
// slower in one; 16 bytes spilled). At N_t = 1 and 2, caps that reach the
// default's occupancy spill 40-170 bytes: mixed, and up to 34% slower.
constexpr int kPrDetRegistersAt4 = 64;
template <typename scalar_t, typename acc_t, typename index_t, class Op, bool FUSED>
__global__ void __maxnreg__(kPrDetRegistersAt4)
    segment_reduce_pr_det4_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, int group, int iterations) {
  reduce_pr_tile<scalar_t, acc_t, index_t, 4, Op, FUSED, true>(a, group, iterations);
}

// One level of the deterministic combine, for levels of many slot elements
// (combine_partials_warp_kernel for the others). Its rows are the slots of
// the level before (in: values, in_code: slot codes, n rows), in chunks of
// rows_per_thread, sorted by segment like any index: a thread adds, for N_t
// features, the written rows of each run of one segment in its chunk in
// order, and ends each run as the schedules end theirs (emit_run: the store
// of a segment it saw whole, else the head / tail slot of a.partial, the
// next level's rows), counting as written only runs that held a written
// row. The last level is one chunk (a.partial null): it stores every
// segment left. overflow_only: SP's overflow pass, which wrote nothing
// where no segment passed the cap. Block (32, T_M): x spans features.
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op>
__global__ void combine_partials_rows_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, const acc_t* __restrict__ in,
                                             const int64_t* __restrict__ in_code, int64_t n, int rows_per_thread,
                                             bool overflow_only) {
  const int64_t col0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N_T;
  const int64_t chunk = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t begin = chunk * rows_per_thread;
  if (col0 >= a.F || begin >= n) return;
  if (overflow_only && *a.longest <= a.cap) return;
  const int64_t end = min(begin + int64_t(rows_per_thread), n);
  const ChunkEnds ends =
      chunk_ends([&](int64_t r) { return code_segment(in_code[r]); }, n, begin, end, chunk);
  acc_t acc[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
  int64_t seg = ends.first;
  bool valid = false;  // the run holds a written row
  int written = 0;     // 1: head slot written, 2: tail slot
  constexpr int BATCH = 8;
  for (int64_t r0 = begin; r0 < end; r0 += BATCH) {
    int64_t code[BATCH];
    acc_t v[BATCH][N_T];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) code[b] = r0 + b < end ? in_code[r0 + b] : slot_code(ends.last, false);
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      if (code[b] & 1) {
        load_columns<N_T>(in + (r0 + b) * a.F + col0, col0, a.F, a.F % N_T == 0, Op::identity(), v[b]);
      } else {
#pragma unroll
        for (int j = 0; j < N_T; ++j) v[b][j] = Op::identity();
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int64_t s = code_segment(code[b]);
      if (s != seg) {
        written |= emit_run<N_T>(a, ends, seg, col0, acc, valid);
        seg = s;
        valid = false;
#pragma unroll
        for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
      }
      valid |= (code[b] & 1) != 0;
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], v[b][j]);
    }
  }
  written |= emit_run<N_T>(a, ends, seg, col0, acc, valid);
  if (a.partial_code && col0 == 0) {  // the next level's codes (all columns write the same slots)
    a.partial_code[2 * chunk] = slot_code(ends.first, written & 1);
    a.partial_code[2 * chunk + 1] = slot_code(ends.last, (written & 2) != 0);
  }
}

// One level of the deterministic combine, for levels of few slot elements.
// Its rows are the slots of the level before (in: values, in_code: slot
// codes, n rows), sorted by segment like any index, in chunks of
// 32 * iterations slots, a warp's: as in PR's tiles, each iteration a lane
// takes one slot (the identity where it holds no value), a shuffle tree
// adds each run of one segment into its first lane, and the last run goes
// on in lane 0's carry. A run ends as the schedules end theirs (emit_run:
// the store of a segment the chunk saw whole, else the chunk's head / tail
// slot of a.partial, the next level's rows), counting as written only runs
// that held a written slot (a flag that travels with the values). The last
// level is one chunk (a.partial null): it stores every segment left. Where
// the rows kernel's threads are few, each walking its chunk alone is bound
// by instruction latency (7-14 us a level on the H100 however few the
// slots); where they are many, they beat this kernel's shuffles.
// overflow_only: SP's overflow pass, which wrote nothing where no segment
// passed the cap. 1-D blocks of whole warps; a warp's tile has the feature
// column fastest, as PR's.
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op>
__global__ void combine_partials_warp_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, const acc_t* __restrict__ in,
                                             const int64_t* __restrict__ in_code, int64_t n, int iterations,
                                             bool overflow_only) {
  constexpr unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t tile = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t columns = (a.F + N_T - 1) / N_T;
  const int64_t col0 = (tile % columns) * N_T;
  const int64_t chunk = tile / columns;
  const int64_t begin = chunk * 32 * iterations;
  if (begin >= n) return;  // the whole warp
  if (overflow_only && *a.longest <= a.cap) return;
  const int64_t end = min(begin + int64_t(32) * iterations, n);
  const ChunkEnds ends = chunk_ends([&](int64_t r) { return code_segment(in_code[r]); }, n, begin, end, chunk);
  const int64_t past_end = std::numeric_limits<int64_t>::max();  // sorts after every segment

  acc_t carry[N_T];
#pragma unroll
  for (int j = 0; j < N_T; ++j) carry[j] = Op::identity();
  int64_t carry_seg = past_end;
  bool carry_valid = false;
  int written = 0;  // 1: head slot written, 2: tail slot (this lane's emits)
  auto finish = [&](int64_t seg, const acc_t (&part)[N_T], bool valid) {
    acc_t copy[N_T];
#pragma unroll
    for (int j = 0; j < N_T; ++j) copy[j] = part[j];
    written |= emit_run<N_T>(a, ends, seg, col0, copy, valid);
  };
  auto fetch = [&](int it, int64_t& s, bool& valid, acc_t (&v)[N_T]) {
    const int64_t r = begin + int64_t(it) * 32 + lane;
    const int64_t code = it < iterations && r < end ? in_code[r] : 0;
    s = it < iterations && r < end ? code_segment(code) : past_end;
    valid = (code & 1) != 0;
    if (valid) {
      load_columns<N_T>(in + r * a.F + col0, col0, a.F, a.F % N_T == 0, Op::identity(), v);
    } else {
#pragma unroll
      for (int j = 0; j < N_T; ++j) v[j] = Op::identity();
    }
  };
  int64_t s_next;
  bool valid_next;
  acc_t v_next[N_T];
  fetch(0, s_next, valid_next, v_next);
  for (int it = 0; it < iterations; ++it) {
    const int64_t s = s_next;
    bool valid = valid_next;
    acc_t v[N_T];
#pragma unroll
    for (int j = 0; j < N_T; ++j) v[j] = v_next[j];
    fetch(it + 1, s_next, valid_next, v_next);
    const RunHeads runs = reduce_runs<true, N_T, Op>(s, v, valid, lane, 32, 0, FULL);
    const bool head = runs.head;
    const int last_head = runs.last;
    if (lane == 0) {  // the carried run goes on at lane 0 or has ended
      if (s == carry_seg) {
        valid |= carry_valid;
#pragma unroll
        for (int j = 0; j < N_T; ++j) v[j] = Op::combine(carry[j], v[j]);
      } else if (carry_seg != past_end) {
        finish(carry_seg, carry, carry_valid);
      }
    }
    if (head && lane != last_head && s != past_end) finish(s, v, valid);
    carry_seg = __shfl_sync(FULL, s, last_head);
    carry_valid = __shfl_sync(FULL, valid, last_head);
#pragma unroll
    for (int j = 0; j < N_T; ++j) carry[j] = __shfl_sync(FULL, v[j], last_head);
  }
  if (lane == 0 && carry_seg != past_end) finish(carry_seg, carry, carry_valid);
  written = (__ballot_sync(FULL, written & 1) ? 1 : 0) | (__ballot_sync(FULL, written & 2) ? 2 : 0);
  if (a.partial_code && col0 == 0 && lane == 0) {  // the next level's codes (all columns write the same slots)
    a.partial_code[2 * chunk] = slot_code(ends.first, written & 1);
    a.partial_code[2 * chunk + 1] = slot_code(ends.last, (written & 2) != 0);
  }
}

// The one-pass deterministic combine. A segment that runs over chunks
// c0 < c1 left its parts in slot 2 c0 + 1 (c0's tail) and the head slots
// 2 c of chunks c0 + 1 .. c1, consecutive and the only slots of its code.
// A tile of `lanes` threads (neighbours in a warp, sharing N_t features)
// per such segment: lane l adds parts l, l + lanes, ... in order, then a
// shuffle tree in a fixed order adds the lanes (so the sum's order depends
// only on the index and the tile shape), and lane 0 stores the segment.
// Block (column tiles * lanes, T_M): y strides over the chunks, and a tile
// takes those whose tail slot was written, c0 (their codes say so: no list
// of them to count, so no counter to clear before the chunk pass).
// overflow_only: after SP's overflow pass, which writes no codes where no
// segment overflowed.
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op>
__global__ void combine_owned_slots_kernel(SegmentArgs<scalar_t, acc_t, index_t> a, int64_t chunks, int lanes,
                                           bool overflow_only) {
  if (overflow_only && *a.longest <= a.cap) return;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t col0 = (int64_t(blockIdx.y) * (blockDim.x / lanes) + threadIdx.x / lanes) * N_T;
  if (col0 >= a.F) return;  // the whole tile: its lanes share col0
  const unsigned tile_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << (threadIdx.x & 31 & ~(lanes - 1));
  constexpr int BATCH = 8;
  for (int64_t c0 = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; c0 < chunks; c0 += int64_t(gridDim.x) * blockDim.y) {
    const int64_t tail = a.partial_code[2 * c0 + 1];
    if (!(tail & 1)) continue;  // no segment begun in chunk c0 runs on (the whole tile skips)
    const int64_t seg = code_segment(tail);
    acc_t acc[N_T];
#pragma unroll
    for (int j = 0; j < N_T; ++j) acc[j] = Op::identity();
    bool more = true;
    for (int64_t t0 = lane; more; t0 += int64_t(lanes) * BATCH) {
      int64_t slot[BATCH];
      bool written[BATCH];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {  // part t: the tail slot of c0, then the head slots after it
        const int64_t t = t0 + int64_t(b) * lanes, c = c0 + t;
        slot[b] = t == 0 ? 2 * c0 + 1 : 2 * c;
        const int64_t code = t == 0 ? slot_code(seg, true) : c < chunks ? a.partial_code[slot[b]] : slot_code(a.S, false);
        written[b] = code_segment(code) == seg && (code & 1);
        more = code_segment(code) == seg;  // the parts are consecutive: one past them ends the walk
      }
      acc_t v[BATCH][N_T];
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        if (written[b]) {
          load_columns<N_T>(a.partial + slot[b] * a.F + col0, col0, a.F, a.F % N_T == 0, Op::identity(), v[b]);
        } else {
#pragma unroll
          for (int j = 0; j < N_T; ++j) v[b][j] = Op::identity();
        }
      }
#pragma unroll
      for (int b = 0; b < BATCH; ++b)
#pragma unroll
        for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], v[b][j]);
    }
    for (int d = lanes >> 1; d > 0; d >>= 1)
#pragma unroll
      for (int j = 0; j < N_T; ++j) acc[j] = Op::combine(acc[j], __shfl_xor_sync(tile_mask, acc[j], d, lanes));
    if (lane == 0) store<N_T, true>(a, seg, col0, acc);
  }
}

template <typename index_t>
__device__ __forceinline__ int64_t lower_bound_index(const index_t* __restrict__ index, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (int64_t(index[mid]) < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Turns the accumulator into the output: mean divides by the segment size,
// empty segments become 0 (max/min leave the identity there), half types are
// rounded from their fp32 accumulator. Block (32, 8): y picks the segment.
// ptr: segment offsets (segment_offsets_kernel) where sizes matter (not for
// sum); a per-segment binary search over the index instead was 40% of a
// SAGE mean layer's GPU time on a 2M-edge graph.
template <typename acc_t, typename out_t>
// acc and out may be the same buffer (in-place), hence no __restrict__.
__global__ void segment_finalize_kernel(const acc_t* acc, out_t* out, const int64_t* __restrict__ ptr, int64_t S,
                                        int64_t F, Reduce reduce) {
  for (int64_t seg = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; seg < S; seg += int64_t(gridDim.x) * blockDim.y) {
    const int64_t count = ptr ? ptr[seg + 1] - ptr[seg] : 1;
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x)
      out[seg * F + f] = finished<out_t>(acc[seg * F + f], count, reduce == Reduce::Mean);
  }
}

// segment_finalize_kernel for rows narrower than a warp: a thread per
// element of the [S, F] output, 1-D, so a warp writes 32 consecutive
// elements (a warp a segment left 31 of 32 lanes idle at F = 1).
template <typename acc_t, typename out_t>
__global__ void segment_finalize_flat_kernel(const acc_t* acc, out_t* out, const int64_t* __restrict__ ptr,
                                             int64_t S, int64_t F, Reduce reduce) {
  const int64_t n = S * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t seg = ptr ? i / F : 0;
    const int64_t count = ptr ? ptr[seg + 1] - ptr[seg] : 1;
    out[i] = finished<out_t>(acc[i], count, reduce == Reduce::Mean);
  }
}

// The results of the segments SP left whole to its overflow pass: slot n of
// acc holds segment long_segment[n]'s (not empty) reduction, divided here
// for a mean and rounded to out_t. 1-D blocks stride over the slots.
template <typename acc_t, typename out_t>
__global__ void finalize_long_segments_kernel(const acc_t* __restrict__ acc, out_t* __restrict__ out,
                                              const int64_t* __restrict__ ptr, const int64_t* __restrict__ long_segment,
                                              const int* __restrict__ long_count, int64_t capacity, int64_t F,
                                              bool mean) {
  const int64_t slots = min(int64_t(*long_count), capacity);
  for (int64_t n = blockIdx.x; n < slots; n += gridDim.x) {
    const int64_t seg = long_segment[n];
    const acc_t scale = mean ? acc_t(1) / acc_t(ptr[seg + 1] - ptr[seg]) : acc_t(1);
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) out[seg * F + f] = from_acc<out_t>(acc[n * F + f] * scale);
  }
}

// The SR segments of half types that straddle several threads' rows (chunks
// of chunk_rows): their result from their fp32 row of `slots` (that of the
// chunk they begin in), divided for a mean and rounded to out_t; and 0 for
// empty segments. With self_scale (sums), (*self_scale + self_offset) * self_src[seg] is
// added to both before rounding. The SR pass wrote every other segment
// itself. 2-D blocks: y strides over the segments, x over their features, V
// at a time (V > 1: F % V == 0 and every row aligned to V elements; most
// segments need no store, so a block covers many of them: their offsets
// are the pass's latency).
template <typename acc_t, typename out_t, int V>
__global__ void finalize_straddling_segments_kernel(const acc_t* __restrict__ slots, out_t* __restrict__ out,
                                                    const int64_t* __restrict__ ptr, int64_t S, int64_t F,
                                                    int64_t chunk_rows, int64_t chunk_slots, bool mean,
                                                    const out_t* __restrict__ self_src,
                                                    const acc_t* __restrict__ self_scale, acc_t self_offset) {
  constexpr bool vector = V > 1;
  for (int64_t seg = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; seg < S; seg += int64_t(gridDim.x) * blockDim.y) {
    const int64_t begin = ptr[seg], end = max(ptr[seg + 1], begin);  // max: offsets of an unsorted index (validation off)
    if (begin < end && begin / chunk_rows == (end - 1) / chunk_rows) continue;  // one thread saw it whole
    const acc_t* slot = slots + min(begin / chunk_rows, chunk_slots - 1) * F;
    for (int64_t f = int64_t(threadIdx.x) * V; f < F; f += int64_t(blockDim.x) * V) {
      acc_t v[V];
      load_columns<V>(slot + f, f, F, vector, acc_t(0), v);
      Pack<out_t, V> pack;
      if (self_scale) {
        acc_t own[V];
        load_columns<V>(self_src + seg * F + f, f, F, vector, acc_t(0), own);
#pragma unroll
        for (int j = 0; j < V; ++j)
          pack.v[j] = from_acc<out_t>((begin < end ? v[j] : acc_t(0)) + (*self_scale + self_offset) * own[j]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) pack.v[j] = finished<out_t>(v[j], end - begin, mean);
      }
      if (vector) {
        *reinterpret_cast<Pack<out_t, V>*>(out + seg * F + f) = pack;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (f + j < F) out[seg * F + f + j] = pack.v[j];
      }
    }
  }
}

// out[i] = (*scale + offset) * src[i] over n elements, rounded to out_t: the
// output pre-filled with the self term, for SR and PR sums that add into it.
template <typename in_t, typename out_t, typename acc_t>
__global__ void self_term_fill_kernel(out_t* __restrict__ out, const in_t* __restrict__ src,
                                      const acc_t* __restrict__ scale, acc_t offset, int64_t n) {
  const acc_t factor = *scale + offset;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_acc<out_t>(factor * to_acc(src[i]));
}

// out[e, f] = values[index[e], f] (0 for ids outside [0, S)). A hub's row is
// read by many threads at once: read-only loads serve it from L1 (torch's
// vectorized row gather stalled on one: 6 ms for a 10^6-edge hub, 4 features).
template <typename scalar_t, typename index_t>
__global__ void gather_rows_kernel(const scalar_t* __restrict__ values, const index_t* __restrict__ index,
                                   scalar_t* __restrict__ out, int64_t E, int64_t F, int64_t S) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const scalar_t zero = from_acc<scalar_t>(acc_t(0));
  const int64_t total = E * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = F == 1 ? i : i / F;
    const int64_t s = index[e];
    out[i] = s >= 0 && s < S ? __ldg(values + s * F + (i - e * F)) : zero;
  }
}

// Thresholds of the kLongSegment bits (segment_reduce.h), passed by value.
struct LongSegmentRows {
  static constexpr int kLevels = 3;
  int64_t rows[kLevels];
};

// Index validation, flags as IndexFlag: 1 negative, 2 >= bound, 4 not sorted
// (checked only if `sorted`), 8 << k (sorted only, no error) a segment longer
// than long_rows.rows[k]: row i and row i + rows[k] share their segment.
template <typename index_t>
__global__ void check_index_kernel(const index_t* __restrict__ index, int64_t E, int64_t bound, bool sorted,
                                   LongSegmentRows long_rows, int* flags) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = index[i];
    int bad = (v < 0 ? 1 : 0) | (v >= bound ? 2 : 0);
    if (sorted && i + 1 < E && int64_t(index[i + 1]) < v) bad |= 4;
    for (int k = 0; sorted && k < LongSegmentRows::kLevels; ++k) {  // longer thresholds only once a shorter holds
      const int64_t ahead = i + long_rows.rows[k];
      if (ahead >= E || int64_t(index[ahead]) != v) break;
      bad |= 8 << k;
    }
    if (bad) atomicOr(flags, bad);
  }
}

}  // namespace geot
