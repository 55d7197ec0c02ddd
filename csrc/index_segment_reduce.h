// Fused gather + segment reduce (GeoT §IV): operator entries (one function
// for CPU and CUDA), and the SDDMM of the weight gradient per device.
#pragma once

#include <ATen/ATen.h>

namespace geot {

// out[d] = reduce over e with dst_index[e] == d of weight[e] * x[src_index[e]].
// The t_* tensors (a transposed index, see geot.TransposedIndex) are for the
// backward pass and ignored here.
at::Tensor index_segment_reduce_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                                   const std::optional<at::Tensor>& weight, int64_t num_segments,
                                   c10::string_view reduce, at::OptionalIntArrayRef config,
                                   const std::optional<at::Tensor>& t_perm, const std::optional<at::Tensor>& t_src,
                                   const std::optional<at::Tensor>& t_dst);

// out[scatter_index[e]] += weight[e] * x[gather_index[e]], scatter_index in
// any order: the backward of the fused op with respect to x, without a sort.
at::Tensor index_scatter_sum_op(const at::Tensor& gather_index, const at::Tensor& scatter_index, const at::Tensor& x,
                                const std::optional<at::Tensor>& weight, int64_t num_out);

// GIN's aggregation: (scale + scale_offset) * x[d] plus the sum of
// x[src_index[e]] over e with dst_index[e] == d, a row of x per segment;
// scale holds one value (GIN's eps, with an offset of 1). On CUDA
// the kernels add the scaled term as they store (one pass over [N, F]).
at::Tensor index_sum_plus_scaled_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                                    const at::Tensor& scale, at::OptionalIntArrayRef config, double scale_offset);

// out[e, h] = <a[dst_index[e], h], b[src_index[e], h]>: the weight gradient.
at::Tensor edge_dot_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                       const at::Tensor& b, int64_t heads);

// out[e, h] = att[h] . leaky_relu(a[dst_index[e], h] + b[src_index[e], h]):
// GATv2's scores without the [E, H, C] sums.
at::Tensor edge_additive_score_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                                  const at::Tensor& b, const at::Tensor& att, double negative_slope, int64_t heads);

// The gradient of index_segment_reduce's max or min (no weight) with respect
// to x: grad_out[d] split evenly among the edges e into d whose row
// x[src_index[e]] holds the extremum, per feature (torch's amax/amin rule).
// extremum and grad_out: [num_segments, ...] as the op's output.
at::Tensor extremum_grad_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                            const at::Tensor& extremum, const at::Tensor& grad_out);

// Device kernels of the two on contiguous [rows, heads * head_size] inputs
// (att: [heads * head_size]), indices of one dtype; out is [E, heads].
void edge_dot_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                  const at::Tensor& b, at::Tensor& out);
void edge_dot_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                   const at::Tensor& b, at::Tensor& out);
void edge_additive_score_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                             const at::Tensor& b, const at::Tensor& att, double negative_slope, at::Tensor& out);
void edge_additive_score_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                              const at::Tensor& b, const at::Tensor& att, double negative_slope, at::Tensor& out);
// The max/min gradient on contiguous [rows, F] x, extremum and grad, indices of one dtype.
at::Tensor extremum_grad_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                             const at::Tensor& extremum, const at::Tensor& grad);
at::Tensor extremum_grad_cuda(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                              const at::Tensor& extremum, const at::Tensor& grad);

}  // namespace geot
