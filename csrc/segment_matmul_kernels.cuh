// CUDA kernels of segment_matmul: a tensor-core GEMM (nvcuda::wmma; fp16 /
// bf16 inputs, fp32 inputs as TF32; fp32 accumulation) over all types in one
// launch. Holds no torch types; the launch layer is segment_matmul_cuda.cu.
//
// Schedule: type t owns tiles_t = ceil(rows_t / tile_rows) row tiles.
// tile_offsets_kernel writes their prefix on the device (no host sync), and
// the grid covers the bound ceil(M / tile_rows) + T row tiles (times the
// column tiles); a block finds its (type, row tile) by binary search in the
// prefix and exits if it is past the last tile. So many small types and a
// few huge ones cost the same: every block gets at most one full tile.
//
// Block tile BM x BN = 64 x 64, 4 warps of 32 x 32 (2 x 2 wmma fragments of
// 16 x 16), the reduction in steps of BK = 32 through a two-stage cp.async
// pipeline in shared memory. Tails (rows of a type, K or N not multiples of
// the tile) are zero-filled in shared memory; rows or columns that are not
// multiples of 16 bytes fall back to predicated scalar loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "segment_reduce_kernels.cuh"

namespace geot {
namespace segment_gemm {

namespace wmma = nvcuda::wmma;

constexpr int BM = 64, BN = 64, BK = 32;
constexpr int kThreads = 128;  // 4 warps, 2 x 2 over the block tile
constexpr int kScanThreads = 1024;

// Fragment types per input: fp16 / bf16 as they are, fp32 as TF32 (k = 8).
template <typename T> struct Mma;
template <> struct Mma<__half> {
  using frag_t = __half;
  static constexpr int kStep = 16, kPad = 8;  // pad: 16 bytes, keeps wmma pointers 32-byte aligned
};
template <> struct Mma<__nv_bfloat16> {
  using frag_t = __nv_bfloat16;
  static constexpr int kStep = 16, kPad = 8;
};
template <> struct Mma<float> {
  using frag_t = wmma::precision::tf32;
  static constexpr int kStep = 8, kPad = 4;
};

// Shared memory of one stage: each operand tile is R x C with C contiguous
// (A: BM x BK row-major or BK x BM col-major, B: BK x BN or BN x BK), padded.
template <typename T> struct Smem {
  static constexpr int kPad = Mma<T>::kPad;
  static constexpr int kOperand = (BM * (BK + kPad) > BK * (BM + kPad)) ? BM * (BK + kPad) : BK * (BM + kPad);
  static constexpr int kStage = 2 * kOperand;  // A then B
  static constexpr int kLdC = BN + 4;          // fp32 epilogue tile, aliases the stages
  static constexpr int kBytes = 2 * kStage * int(sizeof(T));
  static_assert(BM * kLdC * 4 <= kBytes, "epilogue tile must fit in the pipeline buffers");
};

// Leading dimension in shared memory of a logical Rows x Cols operand tile
// stored with Layout (row-major: rows of Cols, column-major: columns of Rows).
template <typename T, typename Layout, int Rows, int Cols> struct TileLd;
template <typename T, int Rows, int Cols> struct TileLd<T, wmma::row_major, Rows, Cols> {
  static constexpr int value = Cols + Mma<T>::kPad;
};
template <typename T, int Rows, int Cols> struct TileLd<T, wmma::col_major, Rows, Cols> {
  static constexpr int value = Rows + Mma<T>::kPad;
};

// Element (row, col) of a logical matrix stored with `Layout` and leading dim ld.
template <typename Layout> __device__ __forceinline__ int at(int row, int col, int ld);
template <> __device__ __forceinline__ int at<wmma::row_major>(int row, int col, int ld) { return row * ld + col; }
template <> __device__ __forceinline__ int at<wmma::col_major>(int row, int col, int ld) { return col * ld + row; }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // src-size 0 zero-fills the 16 bytes without reading gmem.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T> __device__ __forceinline__ T zero() { return from_acc<T>(0.0f); }

// Copies a Rows x Cols tile of a row-major global matrix (g: the tile's first
// element, ld_g: its row stride) to shared memory (row stride ld_s). Entries
// past rows_valid / cols_valid become 0. vec: 16-byte copies (cp.async); the
// caller guarantees 16-byte aligned rows and cols_valid a multiple of
// 16 / sizeof(T). `safe` is any valid global address (zero-filled copies
// still carry one).
template <typename T, int Rows, int Cols>
__device__ __forceinline__ void load_tile(T* s, int ld_s, const T* g, int64_t ld_g, int rows_valid, int cols_valid,
                                          bool vec, const T* safe) {
  if (vec) {
    constexpr int V = 16 / sizeof(T), kChunksPerRow = Cols / V;
#pragma unroll
    for (int i = threadIdx.x; i < Rows * kChunksPerRow; i += kThreads) {
      const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * V;
      const bool valid = r < rows_valid && c < cols_valid;
      cp_async16(s + r * ld_s + c, valid ? g + r * ld_g + c : safe, valid);
    }
  } else {
    for (int i = threadIdx.x; i < Rows * Cols; i += kThreads) {
      const int r = i / Cols, c = i % Cols;
      s[r * ld_s + c] = (r < rows_valid && c < cols_valid) ? g[r * ld_g + c] : zero<T>();
    }
  }
}

template <typename T, typename Use, typename Layout>
using Fragment = wmma::fragment<Use, 16, 16, Mma<T>::kStep, typename Mma<T>::frag_t, Layout>;
template <typename T>
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, Mma<T>::kStep, float>;

template <typename Frag> __device__ __forceinline__ void round_inputs(Frag&, __half*) {}
template <typename Frag> __device__ __forceinline__ void round_inputs(Frag&, __nv_bfloat16*) {}
template <typename Frag> __device__ __forceinline__ void round_inputs(Frag& f, float*) {
#pragma unroll
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = wmma::__float_to_tf32(f.x[i]);
}

// One BK step of the warp's 32 x 32 sub-tile: A (BM x BK) and B (BK x BN)
// from shared memory, in their layouts.
template <typename T, typename LayoutA, typename LayoutB>
__device__ __forceinline__ void mma_step(const T* As, const T* Bs, Accumulator<T> (&acc)[2][2], int warp_m,
                                         int warp_n) {
  constexpr int lda = TileLd<T, LayoutA, BM, BK>::value, ldb = TileLd<T, LayoutB, BK, BN>::value;
#pragma unroll
  for (int k = 0; k < BK; k += Mma<T>::kStep) {
    Fragment<T, wmma::matrix_a, LayoutA> a[2];
    Fragment<T, wmma::matrix_b, LayoutB> b[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wmma::load_matrix_sync(a[i], As + at<LayoutA>(warp_m * 32 + i * 16, k, lda), lda);
      round_inputs(a[i], static_cast<T*>(nullptr));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::load_matrix_sync(b[j], Bs + at<LayoutB>(k, warp_n * 32 + j * 16, ldb), ldb);
      round_inputs(b[j], static_cast<T*>(nullptr));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
  }
}

// The pipelined reduction over `steps` BK steps: load(step, As, Bs) fills a
// stage, two stages in flight. Ends with every thread past its last read of
// shared memory, so the caller may reuse it.
template <typename T, typename LayoutA, typename LayoutB, typename Load>
__device__ __forceinline__ void mainloop(T* smem, int steps, const Load& load, Accumulator<T> (&acc)[2][2]) {
  const int warp = threadIdx.x / 32, warp_m = warp / 2, warp_n = warp % 2;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  if (steps > 0) load(0, smem, smem + Smem<T>::kOperand);
  cp_async_commit();
  for (int step = 0; step < steps; ++step) {
    T* stage = smem + (step & 1) * Smem<T>::kStage;
    if (step + 1 < steps) {
      T* next = smem + ((step + 1) & 1) * Smem<T>::kStage;
      load(step + 1, next, next + Smem<T>::kOperand);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    mma_step<T, LayoutA, LayoutB>(stage, stage + Smem<T>::kOperand, acc, warp_m, warp_n);
    __syncthreads();  // the next step's load refills this stage
  }
}

// Writes the accumulators to the fp32 tile C (BM x kLdC) in shared memory.
template <typename T>
__device__ __forceinline__ void stage_accumulators(float* C, Accumulator<T> (&acc)[2][2]) {
  const int warp = threadIdx.x / 32, warp_m = warp / 2, warp_n = warp % 2;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(C + (warp_m * 32 + i * 16) * Smem<T>::kLdC + warp_n * 32 + j * 16, acc[i][j],
                              Smem<T>::kLdC, wmma::mem_row_major);
  __syncthreads();
}

// Rows of type t clamped into [0, M]: a bad ptr (validation off) gives a
// wrong result, never an out-of-bounds access. Same clamp as the CPU code.
__device__ __forceinline__ void type_rows(const int64_t* ptr, int64_t t, int64_t M, int64_t& begin, int64_t& end) {
  begin = min(max(ptr[t], int64_t(0)), M);
  end = min(max(ptr[t + 1], begin), M);
}

// tile_ptr[t] = sum over u < t of ceil(rows_u / tile_rows), t in [0, T].
// One block: thread i sums a run of types, a block scan offsets the runs.
__global__ void __launch_bounds__(kScanThreads) tile_offsets_kernel(const int64_t* __restrict__ ptr, int64_t T,
                                                                    int64_t M, int64_t tile_rows,
                                                                    int64_t* __restrict__ tile_ptr) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  const int64_t per = (T + kScanThreads - 1) / kScanThreads;
  const int64_t first = min(T, int64_t(threadIdx.x) * per), last = min(T, first + per);
  auto tiles = [&](int64_t t) {
    int64_t b, e;
    type_rows(ptr, t, M, b, e);
    return (e - b + tile_rows - 1) / tile_rows;
  };
  int64_t sum = 0;
  for (int64_t t = first; t < last; ++t) sum += tiles(t);
  // Inclusive scan in the warp, then over the warp totals.
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t scan = sum;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, scan, offset);
    if (lane >= offset) scan += v;
  }
  if (lane == 31) warp_sums[warp] = scan;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kScanThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int64_t v = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += v;
    }
    if (lane < kScanThreads / 32) warp_sums[lane] = w;
  }
  __syncthreads();
  int64_t running = scan - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int64_t t = first; t < last; ++t) {
    tile_ptr[t] = running;
    running += tiles(t);
  }
  if (threadIdx.x == kScanThreads - 1) tile_ptr[T] = running;
}

// The (type, first row, rows) of row tile `slot`, or type -1 past the last
// tile. Run by one thread.
struct TileRef {
  int64_t type, row0, rows;
};
__device__ __forceinline__ TileRef find_tile(const int64_t* ptr, const int64_t* tile_ptr, int64_t T, int64_t M,
                                             int64_t tile_rows, int64_t slot) {
  if (slot >= tile_ptr[T]) return {-1, 0, 0};
  // The last t with tile_ptr[t] <= slot: its tiles hold the slot (empty types
  // share their offset with the next type and are skipped).
  int64_t lo = 0, hi = T;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (tile_ptr[mid] <= slot) lo = mid; else hi = mid - 1;
  }
  int64_t begin, end;
  type_rows(ptr, lo, M, begin, end);
  const int64_t row0 = begin + (slot - tile_ptr[lo]) * tile_rows;
  return {lo, row0, min(tile_rows, end - row0)};
}

template <typename T>
struct GemmArgs {
  const T* __restrict__ a;   // [M, Kd] rows grouped by type
  const T* __restrict__ w;   // [T, K, N]: B_t = w_t ([K, N], Kd = K) or w_t^T (Kd = N)
  T* __restrict__ out;       // [M, Nd]
  const int64_t* __restrict__ ptr;       // [T + 1]
  const int64_t* __restrict__ tile_ptr;  // [T + 1] first BM-row tile of each type
  int64_t M, types, Kd, Nd;
  int64_t w_ld;  // row stride of w_t (its N)
  bool vec_a, vec_b;
};

// out[rows of t] = a[rows of t] @ B_t. B_t is read row-major from w_t or, for
// the gradient of x (a = grad_out), column-major: B_t = w_t^T.
template <typename T, typename LayoutB>
__global__ void __launch_bounds__(kThreads) segment_gemm_kernel(GemmArgs<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // TF32 / bf16 wmma and cp.async need sm_80; the launch layer refuses older GPUs
#else
  __shared__ __align__(128) unsigned char smem_bytes[Smem<T>::kBytes];
  __shared__ TileRef tile;
  T* smem = reinterpret_cast<T*>(smem_bytes);
  const int64_t col_tiles = (p.Nd + BN - 1) / BN;
  if (threadIdx.x == 0) tile = find_tile(p.ptr, p.tile_ptr, p.types, p.M, BM, int64_t(blockIdx.x) / col_tiles);
  __syncthreads();
  const TileRef ref = tile;
  if (ref.type < 0) return;
  const int64_t n0 = (int64_t(blockIdx.x) % col_tiles) * BN;
  constexpr bool kColB = std::is_same<LayoutB, wmma::col_major>::value;
  const T* a_tile = p.a + ref.row0 * p.Kd;
  const T* w_t = p.w + ref.type * p.Kd * p.Nd;
  const int rows = int(ref.rows), cols = int(min(int64_t(BN), p.Nd - n0));
  auto load = [&](int step, T* As, T* Bs) {
    const int64_t k0 = int64_t(step) * BK;
    const int k_valid = int(min(int64_t(BK), p.Kd - k0));
    load_tile<T, BM, BK>(As, BK + Mma<T>::kPad, a_tile + k0, p.Kd, rows, k_valid, p.vec_a, p.a);
    if (kColB)  // B^T tile: rows n of w_t, k contiguous
      load_tile<T, BN, BK>(Bs, BK + Mma<T>::kPad, w_t + n0 * p.w_ld + k0, p.w_ld, cols, k_valid, p.vec_b, p.w);
    else
      load_tile<T, BK, BN>(Bs, BN + Mma<T>::kPad, w_t + k0 * p.w_ld + n0, p.w_ld, k_valid, cols, p.vec_b, p.w);
  };
  Accumulator<T> acc[2][2];
  mainloop<T, wmma::row_major, LayoutB>(smem, int((p.Kd + BK - 1) / BK), load, acc);
  float* C = reinterpret_cast<float*>(smem_bytes);
  stage_accumulators<T>(C, acc);
  T* out = p.out + ref.row0 * p.Nd + n0;
  for (int i = threadIdx.x; i < rows * cols; i += kThreads) {
    const int r = i / cols, c = i - r * cols;
    out[int64_t(r) * p.Nd + c] = from_acc<T>(C[r * Smem<T>::kLdC + c]);
  }
#endif
}

template <typename T>
struct WeightGradArgs {
  const T* __restrict__ x;     // [M, K]
  const T* __restrict__ grad;  // [M, N]
  float* __restrict__ out;     // [T, K, N], zeroed; partial sums are added atomically
  const int64_t* __restrict__ ptr;         // [T + 1]
  const int64_t* __restrict__ chunk_ptr;   // [T + 1] first row chunk of each type
  int64_t M, types, K, N, chunk_rows;
  bool vec_x, vec_grad;
  // Deterministic (set): chunk c stores its [K, N] product in partial[c]
  // instead of adding it to out; combine_weight_grad_kernel adds a type's
  // chunks in order.
  float* __restrict__ partial;
};

// out[t] += x[chunk]^T @ grad[chunk] for one chunk of rows of type t and one
// BM x BN tile of [K, N]: the reduction runs over the chunk's rows, so x is
// the column-major A operand. Chunks of one type meet through fp32 atomics.
template <typename T>
__global__ void __launch_bounds__(kThreads) segment_gemm_weight_grad_kernel(WeightGradArgs<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  __shared__ __align__(128) unsigned char smem_bytes[Smem<T>::kBytes];
  __shared__ TileRef chunk;
  T* smem = reinterpret_cast<T*>(smem_bytes);
  const int64_t k_tiles = (p.K + BM - 1) / BM, n_tiles = (p.N + BN - 1) / BN;
  const int64_t tiles = k_tiles * n_tiles;
  if (threadIdx.x == 0)
    chunk = find_tile(p.ptr, p.chunk_ptr, p.types, p.M, p.chunk_rows, int64_t(blockIdx.x) / tiles);
  __syncthreads();
  const TileRef ref = chunk;
  if (ref.type < 0) return;
  const int64_t tile = int64_t(blockIdx.x) % tiles;
  const int64_t k0 = (tile / n_tiles) * BM, n0 = (tile % n_tiles) * BN;
  const int k_valid = int(min(int64_t(BM), p.K - k0)), n_valid = int(min(int64_t(BN), p.N - n0));
  const T* x_rows = p.x + ref.row0 * p.K + k0;
  const T* g_rows = p.grad + ref.row0 * p.N + n0;
  auto load = [&](int step, T* As, T* Bs) {
    const int64_t r0 = int64_t(step) * BK;
    const int r_valid = int(min(int64_t(BK), ref.rows - r0));
    load_tile<T, BK, BM>(As, BM + Mma<T>::kPad, x_rows + r0 * p.K, p.K, r_valid, k_valid, p.vec_x, p.x);
    load_tile<T, BK, BN>(Bs, BN + Mma<T>::kPad, g_rows + r0 * p.N, p.N, r_valid, n_valid, p.vec_grad, p.grad);
  };
  Accumulator<T> acc[2][2];
  mainloop<T, wmma::col_major, wmma::row_major>(smem, int((ref.rows + BK - 1) / BK), load, acc);
  float* C = reinterpret_cast<float*>(smem_bytes);
  stage_accumulators<T>(C, acc);
  if (p.partial) {
    float* part = p.partial + (int64_t(blockIdx.x) / tiles) * p.K * p.N + k0 * p.N + n0;
    for (int i = threadIdx.x; i < k_valid * n_valid; i += kThreads) {
      const int r = i / n_valid, c = i - r * n_valid;
      part[int64_t(r) * p.N + c] = C[r * Smem<T>::kLdC + c];
    }
    return;
  }
  float* out = p.out + ref.type * p.K * p.N + k0 * p.N + n0;
  for (int i = threadIdx.x; i < k_valid * n_valid; i += kThreads) {
    const int r = i / n_valid, c = i - r * n_valid;
    atomicAdd(out + int64_t(r) * p.N + c, C[r * Smem<T>::kLdC + c]);
  }
#endif
}

// The deterministic weight gradient's sum: out[t] = the partial products of
// type t's chunks (chunk_ptr[t] .. chunk_ptr[t + 1]), added in chunk order.
__global__ void combine_weight_grad_kernel(const float* __restrict__ partial, const int64_t* __restrict__ chunk_ptr,
                                           int64_t types, int64_t KN, float* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < types * KN;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / KN, e = i - t * KN;
    float sum = 0.f;
    for (int64_t c = chunk_ptr[t]; c < chunk_ptr[t + 1]; ++c) sum += partial[c * KN + e];
    out[i] = sum;
  }
}

// ptr validation, flags as OffsetsFlag: 1 ptr[0] != 0, 2 decreasing,
// 4 ptr[-1] != total.
__global__ void check_offsets_kernel(const int64_t* __restrict__ ptr, int64_t n, int64_t total, int* flags) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = ptr[i];
    int bad = (i == 0 && v != 0) ? 1 : 0;
    if (i + 1 < n && ptr[i + 1] < v) bad |= 2;
    if (i == n - 1 && v != total) bad |= 4;
    if (bad) atomicOr(flags, bad);
  }
}

}  // namespace segment_gemm
}  // namespace geot
