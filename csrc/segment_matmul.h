// Typed (segment) matmul: rows of x grouped by type, one weight per type.
// Operator entries (one function for CPU and CUDA) and the per-device
// kernels they call.
#pragma once

#include <ATen/ATen.h>

namespace geot {

// out[ptr[t]:ptr[t+1]] = x[ptr[t]:ptr[t+1]] @ weight[t]; x [M, K], ptr [T + 1]
// int64 offsets, weight [T, K, N] -> out [M, N].
at::Tensor segment_matmul_op(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& weight);

// The gradient of x: out[ptr[t]:ptr[t+1]] = grad[ptr[t]:ptr[t+1]] @ weight[t]^T;
// grad [M, N], weight [T, K, N] -> out [M, K].
at::Tensor segment_matmul_transposed_op(const at::Tensor& grad, const at::Tensor& ptr, const at::Tensor& weight);

// The gradient of the weight: out[t] = x_t^T @ grad_t, [T, K, N]; empty
// types get 0. num_types = T (the rows of ptr minus one).
at::Tensor segment_matmul_weight_grad_op(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad);

// Per-device kernels on checked, contiguous inputs. a [M, A], weight
// [T, K, N], out preallocated: [M, N] (a @ w_t, A = K) or, with
// transpose_weight, [M, K] (a @ w_t^T, A = N).
void segment_matmul_cpu(const at::Tensor& a, const at::Tensor& ptr, const at::Tensor& weight, bool transpose_weight,
                        at::Tensor& out);
void segment_matmul_cuda(const at::Tensor& a, const at::Tensor& ptr, const at::Tensor& weight, bool transpose_weight,
                         at::Tensor& out);
// out [T, K, N] (zeroed by the callee where it needs it).
void segment_matmul_weight_grad_cpu(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad,
                                    at::Tensor& out);
void segment_matmul_weight_grad_cuda(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad,
                                     at::Tensor& out);

#ifdef GEOT_WITH_CUDA
// Launches the check of ptr on the current stream; ORs OffsetsFlag bits into
// *flags (device memory).
void offsets_flags_cuda(const at::Tensor& ptr, int64_t total, int* flags);
#endif
enum OffsetsFlag : int { kNotFromZero = 1, kDecreasing = 2, kNotToTotal = 4 };

}  // namespace geot
