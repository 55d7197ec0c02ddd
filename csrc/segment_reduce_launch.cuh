// CUDA launch layer of the segment_reduce family: picks the config, sizes the
// grid and dispatches dtypes onto the kernels of segment_reduce_kernels.cuh.
// Included by segment_reduce_cuda.cu (plain rows) and
// index_segment_reduce_cuda.cu (gathered, weighted rows).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "launch_rules.h"
#include "launch_utils.cuh"
#include "segment_reduce.h"
#include "segment_reduce_kernels.cuh"
#include "uninitialized.h"

namespace geot {
namespace launch {

// Whether p is aligned for vector accesses of `bytes` (null counts as aligned).
inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// a's vector flags for n_t features a thread: F a multiple of n_t, the rows
// read (vector_loads) and written (vector_out) aligned to n_t elements.
template <typename scalar_t, typename acc_t, typename index_t>
void set_vector_flags(SegmentArgs<scalar_t, acc_t, index_t>& a, int n_t) {
  a.vector_loads = a.F % n_t == 0 && is_aligned(a.src, sizeof(scalar_t) * n_t);
  a.vector_out = a.F % n_t == 0 && is_aligned(a.out, sizeof(acc_t) * n_t) &&
                 is_aligned(a.final_out, sizeof(scalar_t) * n_t);
}

inline dim3 feature_row_grid(int64_t rows, int64_t row_tile, int64_t F, int N_T, const Config& c) {
  const int64_t col_blocks = ceil_div(ceil_div(F, N_T), c.T_N);
  TORCH_CHECK_VALUE(col_blocks <= 65535, "src has too many features (", std::to_string(F), ") for config ", config_to_string(c),
                    "; use a larger T_N or N_t");
  return dim3(static_cast<unsigned>(ceil_div(rows, row_tile)), static_cast<unsigned>(col_blocks));
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED, bool OVERFLOW_ONLY>
void launch_sr(const SegmentArgs<scalar_t, acc_t, index_t>& a, const Config& c, cudaStream_t stream) {
  const dim3 grid = feature_row_grid(ceil_div(a.E, c.M_t), c.T_M, a.F, N_T, c);
  if (a.partial) {
    segment_reduce_sr_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, OVERFLOW_ONLY, true>
        <<<grid, dim3(c.T_N, c.T_M), 0, stream>>>(a, c.M_t);
  } else {
    segment_reduce_sr_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, OVERFLOW_ONLY, false>
        <<<grid, dim3(c.T_N, c.T_M), 0, stream>>>(a, c.M_t);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T, bool DET>
void launch_shared_ids_kernel(const SegmentArgs<scalar_t, acc_t, index_t>& a, const Config& c, cudaStream_t stream) {
  const dim3 grid = feature_row_grid(ceil_div(a.E, c.M_t), c.T_M, a.F, N_T, c);
  const dim3 block(c.T_N, c.T_M);
  if (a.vector_loads && a.vector_out) {
    segment_reduce_shared_ids_kernel<scalar_t, acc_t, index_t, N_T, DET, true><<<grid, block, 0, stream>>>(a, c.M_t);
  } else {
    segment_reduce_shared_ids_kernel<scalar_t, acc_t, index_t, N_T, DET, false><<<grid, block, 0, stream>>>(a, c.M_t);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// SR with shared ids (c: shared_ids_config's). Half rows take 8 features a
// lane (16-byte loads) where F and the pointers allow: the lanes a row
// needs halve, so each load moves as many bytes as an fp32 row's. Outside
// deterministic mode c has them already (groups of up to a warp over 8 a
// lane; bf16 SpMM, H100, 3-8M-edge power-law and hub graphs, F = 64-256:
// 1.1-1.8x as fast as 4 a lane), and unaligned rows take 4 a lane over the
// same edges; the deterministic schedule keeps its measured tiles, 4 a lane
// or half their lanes at 8.
template <typename scalar_t, typename acc_t, typename index_t>
void launch_shared_ids(SegmentArgs<scalar_t, acc_t, index_t> a, Config c, cudaStream_t stream) {
  if constexpr (sizeof(scalar_t) == 2) {
    if (c.N_t == 8 || (a.partial && c.T_N >= 2)) {
      set_vector_flags(a, 8);
      if (a.vector_loads && a.vector_out) {
        if (c.N_t != 8) c.N_t = 8, c.T_N /= 2, c.T_M *= 2;  // deterministic: half its tile's lanes
        if (a.partial) return launch_shared_ids_kernel<scalar_t, acc_t, index_t, 8, true>(a, c, stream);
        return launch_shared_ids_kernel<scalar_t, acc_t, index_t, 8, false>(a, c, stream);
      }
      if (c.N_t == 8) c = shared_ids_config(a.F, 4, c.M_t);  // (the chunk slots follow M_t)
      set_vector_flags(a, 4);
    }
  }
  if (a.partial) return launch_shared_ids_kernel<scalar_t, acc_t, index_t, 4, true>(a, c, stream);
  launch_shared_ids_kernel<scalar_t, acc_t, index_t, 4, false>(a, c, stream);
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED>
void launch_pr(const SegmentArgs<scalar_t, acc_t, index_t>& a, const Config& c, cudaStream_t stream) {
  // Shuffles need whole warps: round the block up to a multiple of 32.
  const int threads = static_cast<int>(ceil_div(c.T_N * c.T_M, 32) * 32);
  const int64_t tiles = ceil_div(a.E, int64_t(c.G_t) * c.M_t) * ceil_div(a.F, N_T);
  const int64_t blocks = ceil_div(tiles, threads / c.G_t);
  TORCH_CHECK_VALUE(blocks < std::numeric_limits<int>::max(), "input too large for config ", config_to_string(c));
  const unsigned grid = static_cast<unsigned>(blocks);
  if (!a.partial) {
    segment_reduce_pr_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, false><<<grid, threads, 0, stream>>>(a, c.G_t, c.M_t);
  } else if constexpr (N_T == 4) {
    segment_reduce_pr_det4_kernel<scalar_t, acc_t, index_t, Op, FUSED><<<grid, threads, 0, stream>>>(a, c.G_t, c.M_t);
  } else {
    segment_reduce_pr_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, true><<<grid, threads, 0, stream>>>(a, c.G_t, c.M_t);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Row lanes of an SP thread group: the threads of a block row (T_N) that
// F / N_t features leave over, as a power of two up to a warp.
inline int sp_lanes(int64_t F, int n_t, const Config& c) {
  const int64_t columns = ceil_div(F, n_t);
  int lanes = 1;
  while (lanes < 32 && 2 * lanes * columns <= c.T_N) lanes *= 2;
  return lanes;
}

// The deterministic schedules (docs/design.md, "Determinism"): slots of a
// combine level's chunk, and rows per thread at least for SR's chunks and
// SP's overflow pass (fewer slots to combine; the tile shapes are kept
// otherwise). The one-pass combine adds a segment's slots in one launch, so
// its chunks can be shorter: more threads for the chunk pass (H100, a
// 10^5-edge graph with a 4.6k-edge hub, F = 1: 12.7 us at 32 rows, 7.9 at
// 16, where the default SR takes 5).
constexpr int kCombineRows = 32;                           // a thread's (rows kernel)
constexpr int kCombineIterations = 8;                      // a warp's 32 slots each (warp kernel)
constexpr int64_t kWarpCombineMaxElements = int64_t(3) << 20;  // slots * F of a warp-kernel level
constexpr int kDeterministicMinRows = 32;
constexpr int kOnePassMinRows = 16;

inline int deterministic_chunk_rows(const Config& c, bool one_pass) {
  return c.is_pr() ? c.G_t * c.M_t : std::max(c.M_t, one_pass ? kOnePassMinRows : kDeterministicMinRows);
}

// Whether the one-pass combine serves: validation bounds every segment to
// kLongSegmentRows[2] rows (a tile's lanes walk at most ~2^10 slots). A
// hub past that (or an unknown level) takes the combine levels, which
// spread its slots over many threads.
inline bool one_pass_combine(int long_segments) { return long_segments >= 0 && long_segments <= 2; }

// The combine levels, from the chunks of the deterministic pass: level k
// reads the 2 * chunks slots of level k - 1 (n) in chunks of its kernel's;
// a level of at most one chunk is the last (it stores every segment left).
// A level of few slot elements (slots * F) runs the warp kernel, whose
// chunks are 32 * kCombineIterations slots, else the rows kernel, whose
// chunks are kCombineRows (H100, 3M-edge hub graphs, F = 1-128: the levels
// took 0.4-0.85x the rows kernel's time on the warp kernel where level 0
// held up to 3.0M elements, 1.2-1.7x where it held 3.35M or more).
struct CombineLevel {
  int64_t n;  // slots
  bool warp;  // its kernel
};
inline std::vector<CombineLevel> combine_levels(int64_t chunks, int64_t F) {
  std::vector<CombineLevel> levels;
  for (int64_t n = 2 * chunks; n > 0;) {
    const bool warp = n * F <= kWarpCombineMaxElements;
    levels.push_back({n, warp});
    const int64_t chunk = warp ? 32 * kCombineIterations : kCombineRows;
    if (n <= (warp ? chunk : 2 * chunk)) break;  // (the rows kernel's last chunk may be twice its rows)
    n = 2 * ceil_div(n, chunk);
  }
  return levels;
}

// The one-pass combine (a.one_pass): 256-thread blocks of tiles of
// `lanes` threads, a tile's threads sharing N_t features; column tiles up
// to a warp's worth of features per segment, lanes as many as 64 threads
// leave (2-32). Most segments it adds have two or three parts, so more
// segments at once beat more lanes for the few long ones (H100, 10^5-edge
// graph, F = 64: 16 lanes took 22 us, the chunk pass 11; cora, citeseer,
// pubmed and a 10^5-edge power-law graph at F = 16-128, both ops:
// deterministic / default 1.35 -> 1.33 and 1.92 -> 1.84 at the geomean
// against 128 threads and 4-32 lanes, pubmed's SpMM at F = 64 1.86 -> 1.61).
// The blocks stride over the chunks, so their number is capped.
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op>
void launch_owned_combine(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t chunks, bool overflow_only,
                          cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = 2048;
  const int64_t columns = ceil_div(a.F, N_T);
  int column_tiles = 1;
  while (column_tiles < columns && column_tiles < 32) column_tiles *= 2;
  const int lanes = std::clamp(64 / column_tiles, 2, 32);
  const dim3 block(column_tiles * lanes, 256 / (column_tiles * lanes));
  const dim3 grid(static_cast<unsigned>(std::min(ceil_div(chunks, int64_t(block.y)), kMaxBlocks)),
                  static_cast<unsigned>(ceil_div(columns, column_tiles)));
  combine_owned_slots_kernel<scalar_t, acc_t, index_t, N_T, Op><<<grid, block, 0, stream>>>(a, chunks, lanes,
                                                                                             overflow_only);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The deterministic combine: the one-pass kernel where a.one_pass is set, else
// one launch per level, in order (a.partial, a.partial_code: level 0's
// slots, the levels' after them in one buffer).
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op>
void launch_combine(const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t chunks, bool overflow_only,
                    cudaStream_t stream) {
  if (a.one_pass) return launch_owned_combine<scalar_t, acc_t, index_t, N_T, Op>(a, chunks, overflow_only, stream);
  const int64_t columns = ceil_div(a.F, N_T);
  int x = 1;  // the rows kernel's block: x spans features
  while (x < 32 && x < columns) x *= 2;
  const dim3 rows_block(x, 256 / x);
  constexpr int kWarpBlock = 256;
  int64_t offset = 0;
  const std::vector<CombineLevel> levels = combine_levels(chunks, a.F);
  for (size_t k = 0; k < levels.size(); ++k) {
    const int64_t n = levels[k].n;
    const bool last = k + 1 == levels.size();
    SegmentArgs<scalar_t, acc_t, index_t> b = a;  // its partial: the next level's slots
    b.partial = last ? nullptr : a.partial + (offset + n) * a.F;
    b.partial_code = last ? nullptr : a.partial_code + offset + n;
    const acc_t* in = a.partial + offset * a.F;
    const int64_t* in_code = a.partial_code + offset;
    if (levels[k].warp) {
      const int iterations = last ? static_cast<int>(ceil_div(n, int64_t(32))) : kCombineIterations;
      const int64_t warps = ceil_div(n, int64_t(32) * iterations) * columns;
      const auto blocks = static_cast<unsigned>(ceil_div(warps * 32, int64_t(kWarpBlock)));
      combine_partials_warp_kernel<scalar_t, acc_t, index_t, N_T, Op><<<blocks, kWarpBlock, 0, stream>>>(
          b, in, in_code, n, iterations, overflow_only);
    } else {
      const int rows = last ? static_cast<int>(n) : kCombineRows;
      const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(n, rows), rows_block.y)),
                      static_cast<unsigned>(ceil_div(columns, rows_block.x)));
      combine_partials_rows_kernel<scalar_t, acc_t, index_t, N_T, Op><<<grid, rows_block, 0, stream>>>(
          b, in, in_code, n, rows, overflow_only);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    offset += n;
  }
}

// SP: the no-atomic pass over each segment's first a.cap rows (a.ptr and
// a.longest set by index_offsets), then, unless no segment can be longer, the
// SR pass over the overflow rows (it returns at once if none overflowed).
template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED>
void launch_sp(const SegmentArgs<scalar_t, acc_t, index_t>& a, const Config& c, cudaStream_t stream) {
  const dim3 grid = feature_row_grid(a.S, c.T_M, a.F, N_T, c);  // lanes > 1 only where one column block holds F
  if (a.lanes > 1) {
    segment_reduce_sp_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, true><<<grid, dim3(c.T_N, c.T_M), 0, stream>>>(a);
  } else {
    segment_reduce_sp_kernel<scalar_t, acc_t, index_t, N_T, Op, FUSED, false><<<grid, dim3(c.T_N, c.T_M), 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (a.E == 0 || !a.may_overflow) return;
  if (!a.partial) return launch_sr<scalar_t, acc_t, index_t, N_T, Op, FUSED, true>(a, c, stream);
  // Deterministic: SP left each long segment whole to chunks of the overflow pass.
  Config chunked = c;
  chunked.M_t = deterministic_chunk_rows(c, a.one_pass);
  launch_sr<scalar_t, acc_t, index_t, N_T, Op, FUSED, true>(a, chunked, stream);
  launch_combine<scalar_t, acc_t, index_t, N_T, Op>(a, ceil_div(a.E, chunked.M_t), true, stream);
}

// Segment offsets of a sorted index: for SP (with_longest: and the rows of
// its longest segment), SR's chunk slots, means (segment sizes), the
// finalize of non-sums and attention_aggregate. They are cached per index
// (with the exact longest segment): a static graph pays the pass once, where
// every call made it before (a pass over the E indices: on an H200, 40 of
// the 132 us of an fp32 mean at F = 1 on an 8.4M-edge graph). For indices
// that cannot be cached (inference tensors) they are fresh for this call,
// with a longest-segment counter the SP kernel raises where asked.
// Entries are made and read on the default stream, and off it only for an
// index declared static (mark_static_index; geot.nn's kept graphs): there
// run torch.compile's CUDA-graph warm-ups, whose entry the capture that
// follows then reads, so a compiled model replays no offsets pass. Such an
// entry's tensors come from the general pool (empty_outside_graph_pools)
// and are complete before the call returns (a stream sync, once per index).
// A capture makes none and reads one only for a static index (a replay may
// refill any other with new values), and pins it, since its kernels keep
// the address: an eviction would free it under the graph (an illegal access
// on replay, seen with compiled RGCN on an H100).
template <typename index_t>
SegmentOffsets index_offsets(const at::Tensor& index, int64_t S, bool with_longest, cudaStream_t stream) {
  const bool cacheable = index_cacheable(index);
  const bool on_default = stream == c10::cuda::getDefaultCUDAStream(index.device().index()).stream();
  const bool capturing = cacheable && capturing_cuda_graph();
  const bool declared_static = cacheable && !on_default && is_static_index(index);
  if (cacheable && (capturing ? declared_static : on_default || declared_static)) {
    if (auto cached = cached_segment_offsets(index, S, /*pin=*/capturing)) return *cached;
  }
  const bool cache = cacheable && !capturing && (on_default || declared_static);
  const auto kept = [&](int64_t rows) {
    const auto options = index.options().dtype(at::kLong);
    return cache && !on_default ? empty_outside_graph_pools({rows}, options) : uninitialized({rows}, options);
  };
  const int64_t E = index.numel();
  SegmentOffsets o;
  o.ptr = kept(S + 1);
  if (with_longest || cache) o.longest = kept(1);
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(E + 1, threads), 65536));
  EmptyRuns runs{nullptr, nullptr, 0};
  at::Tensor run_list;  // [capacity] runs (3 int64 each), then the count
  if (S >= kListedRunsMinSegments) {
    runs.capacity = (S + 1) / kSerialEmptyRun + 1;
    run_list = uninitialized({3 * runs.capacity + 1}, o.ptr.options());
    runs.runs = reinterpret_cast<EmptyRun*>(run_list.data_ptr<int64_t>());
    runs.count = reinterpret_cast<unsigned long long*>(run_list.data_ptr<int64_t>() + 3 * runs.capacity);
    C10_CUDA_CHECK(cudaMemsetAsync(runs.count, 0, sizeof(unsigned long long), stream));
  }
  segment_offsets_kernel<index_t><<<blocks, threads, 0, stream>>>(
      index.data_ptr<index_t>(), E, S, o.ptr.data_ptr<int64_t>(),
      with_longest && !cache ? o.longest.data_ptr<int64_t>() : nullptr, runs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (runs.runs) {
    constexpr int kFillBlock = 1024;
    const auto fill_blocks = static_cast<unsigned>(std::min<int64_t>(runs.capacity, 256));
    segment_offsets_fill_kernel<kFillBlock><<<fill_blocks, kFillBlock, 0, stream>>>(o.ptr.data_ptr<int64_t>(), runs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (cache) {
    at::amax_out(o.longest, o.ptr.slice(0, 1) - o.ptr.slice(0, 0, S), 0, /*keepdim=*/true);
    remember_segment_offsets(index, S, o);
    if (!on_default) C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return o;
}

// Whether some segment may hold more than `cap` rows, from the long-segment
// level validation measured (-1 unknown: maybe).
inline bool may_overflow(int long_segments, int64_t cap) {
  if (long_segments < 0 || long_segments >= kLongSegmentLevels) return true;
  return kLongSegmentRows[long_segments] > cap;
}

template <typename scalar_t, typename acc_t, typename index_t, int N_T, class Op, bool FUSED>
void launch_tiles(const SegmentArgs<scalar_t, acc_t, index_t>& a, const Config& c, cudaStream_t stream) {
  if (c.is_sp()) return launch_sp<scalar_t, acc_t, index_t, N_T, Op, FUSED>(a, c, stream);
  if (a.E == 0) return;  // the pre-filled output is the answer
  if constexpr (FUSED && std::is_same_v<Op, SumOp<acc_t>> && N_T == 4) {  // (shared_ids_config's N_t)
    if (a.shared_ids) {
      launch_shared_ids<scalar_t, acc_t, index_t>(a, c, stream);
      // Deterministic: a group's M_t rows are its chunk.
      if (a.partial) launch_combine<scalar_t, acc_t, index_t, N_T, Op>(a, ceil_div(a.E, c.M_t), false, stream);
      return;
    }
  }
  if (!a.partial) {
    if (c.is_sr()) return launch_sr<scalar_t, acc_t, index_t, N_T, Op, FUSED, false>(a, c, stream);
    return launch_pr<scalar_t, acc_t, index_t, N_T, Op, FUSED>(a, c, stream);
  }
  // Deterministic: the same tiles, chunks of fixed rows, then the combine.
  const int chunk_rows = deterministic_chunk_rows(c, a.one_pass);
  Config chunked = c;
  if (c.is_sr()) chunked.M_t = chunk_rows;
  if (c.is_sr()) launch_sr<scalar_t, acc_t, index_t, N_T, Op, FUSED, false>(a, chunked, stream);
  else launch_pr<scalar_t, acc_t, index_t, N_T, Op, FUSED>(a, c, stream);
  launch_combine<scalar_t, acc_t, index_t, N_T, Op>(a, ceil_div(a.E, chunk_rows), false, stream);
}

template <typename scalar_t, typename acc_t, typename index_t, class Op, bool FUSED>
void launch_reduce(SegmentArgs<scalar_t, acc_t, index_t> a, Config c, cudaStream_t stream) {
  c = with_head_aligned_n_t(c, a.F, a.heads);
  set_vector_flags(a, c.N_t);
  switch (c.N_t) {
    case 1: return launch_tiles<scalar_t, acc_t, index_t, 1, Op, FUSED>(a, c, stream);
    case 2: return launch_tiles<scalar_t, acc_t, index_t, 2, Op, FUSED>(a, c, stream);
    default: return launch_tiles<scalar_t, acc_t, index_t, 4, Op, FUSED>(a, c, stream);
  }
}

// Blocks of the finalize passes, which stride over the segments: a block
// per few segments (10^6 segments, 5 * 10^5 blocks) took 0.49 ms on an H100,
// mostly launching blocks whose threads had nothing to write.
constexpr int64_t kFinalizeBlocks = 8192;

inline at::Tensor identity_filled(int64_t S, int64_t F, at::ScalarType dtype, Reduce r, const at::Tensor& like,
                           cudaStream_t stream) {
  auto opts = like.options().dtype(dtype);
  if (r == Reduce::Max) return at::full({S, F}, -std::numeric_limits<double>::infinity(), opts);
  if (r == Reduce::Min) return at::full({S, F}, std::numeric_limits<double>::infinity(), opts);
  // A memset costs less host time than at::zeros (a dispatched fill kernel).
  at::Tensor out = uninitialized({S, F}, opts);
  C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), stream));
  return out;
}

// (*scale + offset) * src as a new tensor of out_type (src's dtype, or its
// accumulation type): the pre-fill of SR and PR sums with a self term. One
// launch of our own; at::mul's dispatch and TensorIterator cost more host
// time than the kernel takes on a small graph (GIN layers are host-bound
// there). scale: one element of src's accumulation type.
inline at::Tensor self_term_filled(const at::Tensor& src, const at::Tensor& scale, double offset,
                                   at::ScalarType out_type, cudaStream_t stream) {
  at::Tensor out = uninitialized(src.sizes(), src.options().dtype(out_type));
  const int64_t n = src.numel();
  if (n == 0) return out;
  const int threads = 256;
  const unsigned blocks = grid_stride_blocks(n, threads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "geot_self_term_fill", [&] {
    using in_t = typename cuda_type<scalar_t>::type;
    using acc_t = accumulate_t<scalar_t>;
    const auto launch = [&](auto* out_rows) {
      self_term_fill_kernel<<<blocks, threads, 0, stream>>>(out_rows, reinterpret_cast<const in_t*>(src.data_ptr()),
                                                            scale.data_ptr<acc_t>(), static_cast<acc_t>(offset), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (out_type == src.scalar_type()) {
      launch(reinterpret_cast<in_t*>(out.data_ptr()));
    } else {
      launch(out.data_ptr<acc_t>());
    }
  });
  return out;
}

// 256 threads, a row of up to 256 (at least a warp, F's power of two) per
// segment: a segment's F features take few strides even for wide F (rows
// of 32 threads took 17 us over cora's three bf16 GIN sums, the first of
// 1433 features).
inline dim3 segment_row_block(int64_t F) {
  unsigned x = 32;
  while (x < 256 && x < F) x *= 2;
  return dim3(x, 256 / x);
}

// finalize_straddling_segments_kernel over out (args.final_out): 8 features
// a thread where rows allow (16-byte stores), as many threads across a row
// as its packs of 8 (up to 256), the rest of the block across segments
// (H100, bf16, F = 128, 8.4M edges, 840k segments: a thread per feature and
// two segments a block took 329 us, 13% of the call); else segment_row_block's.
template <typename scalar_t, typename acc_t, typename index_t>
void launch_finalize_straddling(const acc_t* slots, const SegmentArgs<scalar_t, acc_t, index_t>& a, int64_t chunks,
                                cudaStream_t stream) {
  const bool eight = a.F % 8 == 0 && is_aligned(a.final_out, 16) && is_aligned(a.src, 16) && is_aligned(slots, 32);
  const auto launch = [&](auto packed) {
    constexpr int V = decltype(packed)::value;
    unsigned x = 1;
    while (x < 256 && x * V < a.F) x *= 2;
    const dim3 block = V == 1 ? segment_row_block(a.F) : dim3(x, 256 / x);
    finalize_straddling_segments_kernel<acc_t, scalar_t, V><<<grid_stride_blocks(a.S, block.y, kFinalizeBlocks), block, 0, stream>>>(
        slots, a.final_out, a.ptr, a.S, a.F, a.chunk_rows, chunks, a.mean, a.src, a.self_scale, a.self_offset);
  };
  if (eight) launch(std::integral_constant<int, 8>{});
  else launch(std::integral_constant<int, 1>{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// SR's half rows narrower than this take the [S, F] fp32 buffer, not chunk
// slots: a few floats a segment, whose finalize streams them, where a chunk
// slot's flush waits for its segment's offset and the straddling segments'
// finalize reads every segment's. H200, bf16 and fp16 SpMM (gathered) at
// F = 1-24: pubmed 1.12-1.39x as fast (at F = 1 the SR pass took 7.8 us and
// the finalize 4.3 with slots, the fp32 rows' pass 4.9), a 100k-edge
// power-law graph 0.98-1.07x; plain bf16 rows at F = 8-16 pubmed
// 1.05-1.17x and that graph 0.98-0.99x, at F = 24 0.92-0.95x there.
inline int64_t chunk_slots_min_features(bool gathered) { return gathered ? 32 : 24; }

// The learned rule set of a device (choose_rules: its model's, else its
// architecture's), looked up once per device: the config selector needs it
// on every call, and the lookup compares names.
inline int device_rules(int device) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cached[kCachedDevices] = {};  // rule set + 2; 0: not looked up yet
  auto lookup = [device] {
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return choose_rules(prop.name, prop.major * 10 + prop.minor).index;
  };
  if (device < 0 || device >= kCachedDevices) return lookup();
  int rules = cached[device].load(std::memory_order_relaxed) - 2;
  if (rules == -2) cached[device].store((rules = lookup()) + 2, std::memory_order_relaxed);
  return rules;
}

// What the launch rules (launch_rules.h) see of a reduction.
inline LaunchCase launch_case(const RowReduction& r, bool det) {
  const bool half = r.src.scalar_type() == at::kHalf || r.src.scalar_type() == at::kBFloat16;
  return {r.index.numel(), r.num_segments, r.src.size(1), r.gather.has_value(), half, r.heads, r.reduce,
          r.any_order, r.config.has_value(), r.long_segments, det};
}

// The learned rules' config of the device (or the caller's). Any-order input
// keeps the hand heuristic (rules -2): the learned rules were trained on
// sorted reductions.
inline Config rules_config(const RowReduction& r) {
  const int rules = r.any_order ? -2 : device_rules(r.src.get_device());
  return resolve_config(r.config, make_features(r.index.numel(), r.num_segments, r.src.size(1), r.gather.has_value(),
                                                r.long_segments, rules));
}

// The launch of every op of the family; FUSED instantiates the kernels for
// gathered / weighted rows (index_segment_reduce_cuda.cu) or plain rows
// (segment_reduce_cuda.cu), one per translation unit so they compile in
// parallel.
template <bool FUSED>
at::Tensor reduce_rows(const RowReduction& r) {
  const c10::cuda::CUDAGuard guard(r.src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t E = r.index.numel(), F = r.src.size(1), S = r.num_segments;
  // torch.use_deterministic_algorithms: the deterministic counterpart of the
  // config (the same tiles, no float atomics; any-order input was sorted by
  // its op), or on short segments SP walking each whole. Read per call: a
  // flag of the global context, no dispatch.
  const bool det = at::globalContext().deterministicAlgorithms() && !r.any_order;
  const LaunchCase call = launch_case(r, det);
  const bool half = call.half;
  const bool shared_ids = use_shared_ids(call);
  // launch_config (launch_rules.h), without the rules' selection where shared ids take the call
  const Config cfg = shared_ids ? shared_ids_tile(call) : tiled_config(call, rules_config(r));
  // SP stores every output element itself (0 for empty segments); where no
  // segment can pass its cap (no overflow pass adds to it) it writes the
  // output directly (SegmentArgs::final_out). Where validation saw no
  // segment over kLongSegmentRows[0] rows, the cap is raised to that: such
  // short segments cannot stall the grid, and the hint is no finer.
  const int lanes = cfg.is_sp() ? sp_lanes(F, with_head_aligned_n_t(cfg, F, r.heads).N_t, cfg) : 1;
  int64_t sp_cap = int64_t(cfg.M_t) * lanes;
  if (cfg.is_sp() && r.long_segments == 0) sp_cap = std::max(sp_cap, kLongSegmentRows[0]);
  if (cfg.is_sp() && det && r.long_segments == 1) sp_cap = std::max(sp_cap, kLongSegmentRows[1]);
  const bool overflow = cfg.is_sp() && may_overflow(r.long_segments, sp_cap);
  // Half types cannot take the overflow pass's additions in place (each
  // would round): SP still writes their output directly, and the segments
  // past the cap go whole to the overflow pass, into fp32 slots: at most
  // E / (cap + 1) of them where validation vouches for the index (its
  // segments are disjoint ranges), a small buffer instead of [S, F].
  // (fp32 sums and means keep adding in place; a mean divides afterwards.)
  const bool long_slots = overflow && r.long_segments > 0 && half && !det;
  const int64_t slots = long_slots ? std::min(S, E / (sp_cap + 1)) : 0;
  // SR writes half types directly too, the segments that straddle threads
  // into fp32 rows of one per thread's M_t rows: fewer than S rows where
  // segments average under M_t rows (else, and for narrow rows, the [S, F]
  // buffer below). Needs the index sorted (a thread's whole segments).
  const int64_t chunks = cfg.is_sr() ? ceil_div(E, int64_t(cfg.M_t)) : 0;
  const bool chunk_slots = half && cfg.is_sr() && !r.any_order && E > 0 && chunks < S && !det &&
                           F >= chunk_slots_min_features(call.gathered);
  // (For half types: SP with a validated index, or SR with chunk slots.
  // geot/nn/gin.py's _sum_writes_half mirrors the SP case to decide GIN's
  // cast; keep them in step.)
  // (Deterministic SP writes the output directly for every dtype: its
  // overflow rows end in stores of whole segments, no additions.)
  const bool direct = (cfg.is_sp() && (!overflow || long_slots || det)) || chunk_slots;
  // Deterministic SR (shared ids included) on half rows stores into the
  // output too, pre-filled for the segments no pass stores (empty ones: 0,
  // or the self term): the chunk pass and the combine store every other
  // segment whole, rounded, so no fp32 [S, F] buffer or finalize pass.
  const bool prefilled_out = det && half && cfg.is_sr();
  // The self term (r.self_scale) goes into the kernels' stores (SegmentArgs::
  // self_scale), unless SP's long segments go whole to slots (another pass
  // stores those): then it is added after the sum.
  const bool self_in_kernel = r.self_scale && !long_slots;
  // Otherwise fp16/bf16 accumulate in an fp32 buffer (atomics in half
  // precision would round every partial result) and a finalize pass makes
  // the output (rounding, mean's division, empty segments of max/min).
  const at::ScalarType acc_type = half ? at::kFloat : r.src.scalar_type();
  // The self term's scale in acc_type, 1-D: an fp32 [1] scale keeps the
  // product of half rows in fp32, where a 0-d one would round it.
  const at::Tensor self_scale = r.self_scale ? r.self_scale->to(acc_type).reshape({1}) : at::Tensor();
  // (SR and PR add to a pre-filled [S, F]: with a self term, filled with it.)
  at::Tensor acc = long_slots     ? identity_filled(slots, F, acc_type, r.reduce, r.src, stream)
                   : chunk_slots  ? identity_filled(chunks, F, acc_type, r.reduce, r.src, stream)
                   : direct || prefilled_out ? at::Tensor()
                   : cfg.is_sp()  ? uninitialized({S, F}, r.src.options().dtype(acc_type))
                   : r.self_scale ? self_term_filled(r.src, self_scale, r.self_offset, acc_type, stream)
                                  : identity_filled(S, F, acc_type, r.reduce, r.src, stream);
  // fp32 / fp64 means into acc divide as they add (SegmentArgs::
  // scale_by_rows): on a 10^7-edge graph at F = 128 the finalize pass read
  // and wrote the whole [S, F] once more (SpMM mean 1.06-1.37x the sum's
  // time on an H200). SP's own stores divide by the whole segment's rows,
  // its overflow pass's additions too.
  const bool scale_by_rows = r.reduce == Reduce::Mean && !half && !det && !direct && !r.any_order && !r.self_scale;
  const bool finalize = !direct && !prefilled_out && !scale_by_rows &&
                        (half || r.reduce == Reduce::Mean || (r.reduce != Reduce::Sum && !cfg.is_sp()));
  const auto prefilled = [&] {
    if (r.self_scale) return self_term_filled(r.src, self_scale, r.self_offset, r.src.scalar_type(), stream);
    return identity_filled(S, F, r.src.scalar_type(), Reduce::Sum, r.src, stream);  // zeros
  };
  at::Tensor out = prefilled_out ? prefilled() : direct || half ? uninitialized({S, F}, r.src.options()) : acc;
  if (S == 0 || F == 0) return out;
  // Nothing to read (every element is empty or out of range); the kernels
  // may read row 0 of src unconditionally, so they must not run.
  if (r.src.size(0) == 0) return out.zero_();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.src.scalar_type(), "geot_segment_reduce", [&] {
    using in_t = typename cuda_type<scalar_t>::type;
    using acc_t = accumulate_t<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(r.index.scalar_type(), "geot_segment_reduce_index", [&] {
      SegmentArgs<in_t, acc_t, index_t> args{};
      args.index = r.index.data_ptr<index_t>();
      args.src = reinterpret_cast<const in_t*>(r.src.data_ptr<scalar_t>());
      args.out = acc.defined() ? acc.data_ptr<acc_t>() : nullptr;
      args.final_out = direct || prefilled_out ? reinterpret_cast<in_t*>(out.data_ptr<scalar_t>()) : nullptr;
      args.mean = r.reduce == Reduce::Mean;
      args.scale_by_rows = scale_by_rows;
      args.E = E, args.F = F, args.S = S;
      args.gather = r.gather ? r.gather->data_ptr<index_t>() : nullptr;
      args.weight = r.weight ? reinterpret_cast<const in_t*>(r.weight->data_ptr<scalar_t>()) : nullptr;
      args.src_rows = r.src.size(0);
      args.heads = r.heads;
      args.whole_segment_stores = !r.any_order;
      args.shared_ids = shared_ids;
      // Offsets for SP, chunk slots, a mean's sizes where no finalize divides
      // and the finalize of non-sums; held until the launches are queued.
      SegmentOffsets offsets;
      if (cfg.is_sp() || chunk_slots || scale_by_rows || (prefilled_out && r.reduce == Reduce::Mean)) {
        offsets = index_offsets<index_t>(r.index, S, cfg.is_sp() || scale_by_rows, stream);
        args.ptr = offsets.ptr.data_ptr<int64_t>();
      }
      if (chunk_slots) {
        args.chunk_rows = cfg.M_t;
        args.chunk_slots = chunks;
      }
      if (cfg.is_sp()) {
        args.longest = offsets.longest.data_ptr<int64_t>();
        args.lanes = lanes;
        args.cap = sp_cap;
        args.may_overflow = overflow;
      }
      if (self_in_kernel) {
        args.self_scale = self_scale.data_ptr<acc_t>();
        args.self_offset = static_cast<acc_t>(r.self_offset);
      }
      // Deterministic: slots of the chunks' partial results, then those of
      // the combine levels (the one-pass combine reads level 0's alone).
      // (Shared ids: a group's M_t edges are its chunk, whichever combine follows.)
      const bool one_pass = one_pass_combine(r.long_segments);
      const int64_t det_chunk_rows = shared_ids ? cfg.M_t : deterministic_chunk_rows(cfg, one_pass);
      const int64_t det_chunks = det && E > 0 && (!cfg.is_sp() || overflow) ? ceil_div(E, det_chunk_rows) : 0;
      at::Tensor partial, partial_code;  // held until the launches are queued
      if (det_chunks > 0) {
        int64_t rows = 2 * det_chunks;  // level 0's slots: the one-pass combine's only ones
        if (!one_pass) {
          rows = 0;  // level 0's, then the combine levels'
          for (const CombineLevel& level : combine_levels(det_chunks, F)) rows += level.n;
        }
        partial = uninitialized({rows, F}, r.src.options().dtype(acc_type));
        partial_code = uninitialized({rows}, r.index.options().dtype(at::kLong));
        args.partial = partial.data_ptr<acc_t>();
        args.partial_code = partial_code.data_ptr<int64_t>();
        args.one_pass = one_pass;
      }
      at::Tensor slot_table, slot_segments;  // held until the launches are queued
      if (long_slots) {
        slot_table = uninitialized({S + 1}, r.index.options().dtype(at::kInt));  // slot per segment, then the count
        C10_CUDA_CHECK(cudaMemsetAsync(slot_table.data_ptr(), 0xff, S * sizeof(int), stream));  // -1: no slot
        C10_CUDA_CHECK(cudaMemsetAsync(slot_table.data_ptr<int>() + S, 0, sizeof(int), stream));
        slot_segments = uninitialized({std::max<int64_t>(slots, 1)}, offsets.ptr.options());
        args.long_slot = slot_table.data_ptr<int>();
        args.long_count = args.long_slot + S;
        args.long_segment = slot_segments.data_ptr<int64_t>();
        args.long_capacity = slots;
      }
      switch (r.reduce) {
        case Reduce::Max: launch_reduce<in_t, acc_t, index_t, MaxOp<acc_t>, FUSED>(args, cfg, stream); break;
        case Reduce::Min: launch_reduce<in_t, acc_t, index_t, MinOp<acc_t>, FUSED>(args, cfg, stream); break;
        default: launch_reduce<in_t, acc_t, index_t, SumOp<acc_t>, FUSED>(args, cfg, stream);
      }
      if (finalize) {
        // Segment sizes for mean and max/min's empty segments.
        if (r.reduce != Reduce::Sum && !offsets.ptr.defined()) offsets = index_offsets<index_t>(r.index, S, false, stream);
        const int64_t* ptr = r.reduce == Reduce::Sum ? nullptr : offsets.ptr.data_ptr<int64_t>();
        auto* final_rows = reinterpret_cast<in_t*>(out.data_ptr<scalar_t>());
        if (F < 32) {
          segment_finalize_flat_kernel<acc_t, in_t><<<grid_stride_blocks(S * F, 256, kFinalizeBlocks), 256, 0, stream>>>(
              acc.data_ptr<acc_t>(), final_rows, ptr, S, F, r.reduce);
        } else {
          const dim3 block(32, 8);
          segment_finalize_kernel<acc_t, in_t><<<grid_stride_blocks(S, block.y, kFinalizeBlocks), block, 0, stream>>>(
              acc.data_ptr<acc_t>(), final_rows, ptr, S, F, r.reduce);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (chunk_slots) launch_finalize_straddling(acc.data_ptr<acc_t>(), args, chunks, stream);
      if (long_slots && slots > 0) {
        const auto blocks = static_cast<unsigned>(std::min<int64_t>(slots, 1024));
        finalize_long_segments_kernel<acc_t, in_t><<<blocks, 128, 0, stream>>>(
            acc.data_ptr<acc_t>(), reinterpret_cast<in_t*>(out.data_ptr<scalar_t>()), args.ptr, args.long_segment,
            args.long_count, slots, F, args.mean);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  if (r.self_scale && !self_in_kernel) out.addcmul_(r.src, self_factor(r));
  return out;
}

}  // namespace launch
}  // namespace geot
