// Attention aggregation (GAT inference): the softmax over each destination's
// incoming edges and the weighted sum of their rows in one pass, with no
// [E, H] attention tensor. Operator entry (one function for CPU and CUDA)
// and the per-device kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace geot {

// out[d, h, :] = sum over the edges e into d of a[e, h] * x[src_index[e], h, :],
// a[., h] = softmax over d's edges of leaky_relu(score_src[src_index[e], h] +
// score_dst[d, h], negative_slope); dst_index sorted. self_loops: edges with
// src == dst are left out and every d < num_segments takes one loop (row
// x[d], score score_src[d] + score_dst[d]), as PyG's GATConv adds them.
// Destinations without edges get 0. x [N, H, C], score_src [N, H],
// score_dst [num_segments, H] (dtype of x, or float32 for half x); out
// [num_segments, H, C], dtype of x. Either score may instead come from an
// attention vector, att_src / att_dst [H, C] (or PyG's [1, H, C]): score_src
// = (x * att_src).sum(-1), score_dst = (x[:num_segments] * att_dst).sum(-1),
// computed from the rows the kernel loads anyway (no [N, H] tensors).
at::Tensor attention_aggregate_op(const at::Tensor& x, const std::optional<at::Tensor>& score_src,
                                  const std::optional<at::Tensor>& score_dst, const at::Tensor& src_index,
                                  const at::Tensor& dst_index, int64_t num_segments, double negative_slope,
                                  bool self_loops, const std::optional<at::Tensor>& att_src,
                                  const std::optional<at::Tensor>& att_dst);

// The per-device kernels, on contiguous inputs (x viewed [N, H * C], the
// scores or attention vectors in float32, float64 for float64 x: of each
// side one defined, the vector viewed [H * C]); out [num_segments, H * C]
// preallocated.
struct AttentionInputs {
  at::Tensor x, score_src, score_dst, att_src, att_dst, src_index, dst_index;
  int64_t heads, num_segments;
  int long_segments;  // dst_index's long-segment level from validation, -1 unknown
  double negative_slope;
  bool self_loops;
};
// Computes the scores of the sides given as attention vectors (the vectors
// then undefined): the CPU kernel's way, and CUDA's where a head's lanes
// cannot sum them.
void scores_from_attention(AttentionInputs& in);
void attention_aggregate_cpu(AttentionInputs in, at::Tensor& out);
void attention_aggregate_cuda(AttentionInputs in, at::Tensor& out);

}  // namespace geot
