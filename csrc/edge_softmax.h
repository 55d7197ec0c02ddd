// Softmax over the edges of each destination (GAT attention): operator
// entries (one function for CPU and CUDA) and the per-device kernels.
#pragma once

#include <ATen/ATen.h>

namespace geot {

// out[e, h] = exp(score[e, h] - max_d) / sum over the edges e' of d of
// exp(score[e', h] - max_d), d = dst_index[e] (sorted); score [E] or [E, H].
at::Tensor edge_softmax_op(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments);
// The same in place: score (contiguous) becomes the softmax.
void edge_softmax_inplace_op(at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments);

// grad_score[e, h] = y[e, h] * (grad[e, h] - sum over the edges e' of d of
// grad[e', h] * y[e', h]), y the forward output.
at::Tensor edge_softmax_backward_op(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                                    int64_t num_segments);

// Per-device kernels on contiguous [E, H] inputs; out [E, H] preallocated
// (the forward kernels allow out to be score itself).
void edge_softmax_cpu(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments, at::Tensor& out);
void edge_softmax_cuda(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments, at::Tensor& out);
void edge_softmax_backward_cpu(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                               int64_t num_segments, at::Tensor& out);
void edge_softmax_backward_cuda(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                                int64_t num_segments, at::Tensor& out);

// The composed CUDA softmax's per-edge steps (all [E, H] contiguous, the
// per-destination [S, H] in the accumulation type): y = exp(values -
// max[index]); out = y / sum[index] in out's dtype; out = y * (grad -
// dot[index]).
at::Tensor exp_shift_cuda(const at::Tensor& values, const at::Tensor& max, const at::Tensor& index);
void normalize_cuda(const at::Tensor& y, const at::Tensor& sum, const at::Tensor& index, at::Tensor& out);
void softmax_grad_cuda(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dot, const at::Tensor& index,
                       at::Tensor& out);

}  // namespace geot
