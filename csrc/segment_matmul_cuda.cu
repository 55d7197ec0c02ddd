// CUDA side of segment_matmul: the device-side tile schedule, the launches of
// the tensor-core GEMM (forward and x-gradient: one kernel, the weight read
// as is or transposed) and of the weight-gradient GEMM, and the ptr check.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "launch_utils.cuh"
#include "segment_matmul.h"
#include "segment_matmul_kernels.cuh"

namespace geot {

namespace {

namespace sg = segment_gemm;

// An attribute of the current device (cheap: no cudaDeviceProp query).
int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

void check_cuda_support(const at::Tensor& a) {
  const at::ScalarType dtype = a.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "segment_matmul on CUDA takes float32, float16 or bfloat16 (tensor cores), got ", dtype,
                   "; float64 runs on CPU");
  TORCH_CHECK(device_attribute(cudaDevAttrComputeCapabilityMajor) >= 8,
              "segment_matmul on CUDA needs compute capability 8.0 or newer (TF32 / bf16 tensor cores)");
}

// First tile of each type, [T + 1], computed on the device: no host sync.
at::Tensor tile_offsets(const at::Tensor& ptr, int64_t M, int64_t tile_rows, cudaStream_t stream) {
  const int64_t T = ptr.numel() - 1;
  at::Tensor tile_ptr = at::empty({T + 1}, ptr.options());
  sg::tile_offsets_kernel<<<1, sg::kScanThreads, 0, stream>>>(ptr.data_ptr<int64_t>(), T, M, tile_rows,
                                                              tile_ptr.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return tile_ptr;
}

// 16-byte copies need 16-byte aligned rows.
bool vector_rows(const void* data, int64_t row_elements, size_t element_size) {
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 && (row_elements * int64_t(element_size)) % 16 == 0;
}

// The grid: the bound ceil(M / rows) + T on the row tiles, times the tiles
// of the output columns; blocks past the last tile exit at once.
unsigned grid_size(int64_t M, int64_t T, int64_t tile_rows, int64_t col_tiles) {
  const int64_t blocks = (ceil_div(M, tile_rows) + T) * col_tiles;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int>::max(), "segment_matmul: too many tiles (",
                    std::to_string(blocks), ") for one launch");
  return static_cast<unsigned>(blocks);
}

template <typename T>
void launch_gemm(const at::Tensor& a, const at::Tensor& ptr, const at::Tensor& weight, bool transpose_weight,
                 at::Tensor& out, cudaStream_t stream) {
  sg::GemmArgs<T> p{};
  p.a = reinterpret_cast<const T*>(a.data_ptr());
  p.w = reinterpret_cast<const T*>(weight.data_ptr());
  p.out = reinterpret_cast<T*>(out.data_ptr());
  p.M = a.size(0), p.types = weight.size(0), p.Kd = a.size(1), p.Nd = out.size(1), p.w_ld = weight.size(2);
  p.vec_a = vector_rows(p.a, p.Kd, sizeof(T));
  p.vec_b = vector_rows(p.w, p.w_ld, sizeof(T));
  const at::Tensor tile_ptr = tile_offsets(ptr, p.M, sg::BM, stream);
  p.ptr = ptr.data_ptr<int64_t>();
  p.tile_ptr = tile_ptr.data_ptr<int64_t>();
  const unsigned blocks = grid_size(p.M, p.types, sg::BM, ceil_div(p.Nd, sg::BN));
  if (transpose_weight)
    sg::segment_gemm_kernel<T, nvcuda::wmma::col_major><<<blocks, sg::kThreads, 0, stream>>>(p);
  else
    sg::segment_gemm_kernel<T, nvcuda::wmma::row_major><<<blocks, sg::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rows per chunk of the weight gradient: enough chunks for ~8 blocks per SM
// (big types split, so they spread over the GPU), at least 4 BK steps each
// (amortizes the atomic epilogue). Deterministic: sized for a nominal 132
// SMs (an H100's), so that the chunks, and the order of the sums, do not
// depend on the GPU.
int64_t weight_grad_chunk_rows(int64_t M, int64_t tiles_per_chunk, bool deterministic) {
  const int64_t sms = deterministic ? 132 : device_attribute(cudaDevAttrMultiProcessorCount);
  const int64_t chunks = std::max<int64_t>(1, 8 * sms / tiles_per_chunk);
  const int64_t rows = std::max<int64_t>(4 * sg::BK, ceil_div(M, chunks));
  return ceil_div(rows, sg::BK) * sg::BK;
}

template <typename T>
void launch_weight_grad(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad, at::Tensor& acc,
                        cudaStream_t stream) {
  sg::WeightGradArgs<T> p{};
  p.x = reinterpret_cast<const T*>(x.data_ptr());
  p.grad = reinterpret_cast<const T*>(grad.data_ptr());
  p.out = acc.data_ptr<float>();
  p.M = x.size(0), p.types = acc.size(0), p.K = x.size(1), p.N = grad.size(1);
  p.vec_x = vector_rows(p.x, p.K, sizeof(T));
  p.vec_grad = vector_rows(p.grad, p.N, sizeof(T));
  const int64_t tiles = ceil_div(p.K, sg::BM) * ceil_div(p.N, sg::BN);
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  p.chunk_rows = weight_grad_chunk_rows(p.M, tiles, deterministic);
  const at::Tensor chunk_ptr = tile_offsets(ptr, p.M, p.chunk_rows, stream);
  p.ptr = ptr.data_ptr<int64_t>();
  p.chunk_ptr = chunk_ptr.data_ptr<int64_t>();
  const unsigned blocks = grid_size(p.M, p.types, p.chunk_rows, tiles);
  // Deterministic: chunks store their products (at most as many as the
  // grid's bound on chunks), then one pass adds each type's in order.
  at::Tensor partial;  // held until the launches are queued
  if (deterministic) {
    partial = at::empty({int64_t(blocks / tiles), p.K * p.N}, acc.options());
    p.partial = partial.data_ptr<float>();
  }
  sg::segment_gemm_weight_grad_kernel<T><<<blocks, sg::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!p.partial) return;
  const int64_t total = p.types * p.K * p.N;
  const auto combine_blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, 256), 65536));
  if (total == 0) return;
  sg::combine_weight_grad_kernel<<<combine_blocks, 256, 0, stream>>>(p.partial, p.chunk_ptr, p.types, p.K * p.N,
                                                                     p.out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void segment_matmul_cuda(const at::Tensor& a, const at::Tensor& ptr, const at::Tensor& weight, bool transpose_weight,
                         at::Tensor& out) {
  check_cuda_support(a);
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (a.scalar_type()) {
    case at::kHalf: return launch_gemm<__half>(a, ptr, weight, transpose_weight, out, stream);
    case at::kBFloat16: return launch_gemm<__nv_bfloat16>(a, ptr, weight, transpose_weight, out, stream);
    default: return launch_gemm<float>(a, ptr, weight, transpose_weight, out, stream);
  }
}

void segment_matmul_weight_grad_cuda(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad,
                                     at::Tensor& out) {
  check_cuda_support(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Chunks of a type add fp32 partial sums; half types round once at the end.
  at::Tensor acc = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, acc.nbytes(), stream));
  if (x.size(0) > 0) {
    switch (x.scalar_type()) {
      case at::kHalf: launch_weight_grad<__half>(x, ptr, grad, acc, stream); break;
      case at::kBFloat16: launch_weight_grad<__nv_bfloat16>(x, ptr, grad, acc, stream); break;
      default: launch_weight_grad<float>(x, ptr, grad, acc, stream);
    }
  }
  if (acc.data_ptr() != out.data_ptr()) out.copy_(acc);
}

void offsets_flags_cuda(const at::Tensor& ptr, int64_t total, int* flags) {
  const int64_t n = ptr.numel();
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 1024));
  sg::check_offsets_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(ptr.data_ptr<int64_t>(), n,
                                                                                      total, flags);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(geot, CUDA, m) {
  m.impl("segment_matmul", &segment_matmul_op);
  m.impl("segment_matmul_transposed", &segment_matmul_transposed_op);
  m.impl("segment_matmul_weight_grad", &segment_matmul_weight_grad_op);
}

}  // namespace geot
