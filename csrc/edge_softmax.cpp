// edge_softmax: argument checks, the operator entries shared by CPU and
// CUDA, and the CPU kernels. Parallel over destinations (at::parallel_for);
// each task finds its first edge by binary search in the sorted dst_index and
// walks its destinations' edges in order, so the result is deterministic.
#include "edge_softmax.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "segment_reduce.h"
#include "uninitialized.h"

namespace geot {

namespace {

// score-like [E] or [E, H] floating tensor. Returns H.
int64_t check_edge_values(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name,
                   " must be a float32, float16, bfloat16 or float64 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 || t.dim() == 2, name, " must have shape [E] or [E, H], got ",
                    shape_string(t.sizes()));
  return t.dim() == 2 ? t.size(1) : 1;
}

// Returns dst_index's long-segment level (see validate_indices).
int check_dst_index(const at::Tensor& dst_index, const at::Tensor& values, const char* name, int64_t num_segments) {
  check_index_tensor(dst_index, "dst_index");
  TORCH_CHECK_VALUE(dst_index.size(0) == values.size(0), name, " and dst_index must have the same length E, got ",
                    std::to_string(values.size(0)), " and ", std::to_string(dst_index.size(0)));
  check_same_device(dst_index, "dst_index", values, name);
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0, got ", std::to_string(num_segments));
  return validate_indices({{dst_index, num_segments, true, "dst_index", "num_segments"}})[0];
}

// The fused CUDA kernels give a destination to one block: a hub of 10^5 edges
// is walked by one SM while the rest of the GPU idles. The segment reduce
// splits long segments over blocks, so a graph with a destination past the
// last long-segment level takes the softmax composed of it and of per-edge
// kernels (more memory passes and launches, so not for small graphs).
constexpr int64_t kComposedMinValues = int64_t(1) << 16;

bool composed_on_cuda(const at::Tensor& values, int level) {
  return values.is_cuda() && level >= kLongSegmentLevels && values.numel() >= kComposedMinValues;
}

// y = exp(score - max) / sum per destination and head, from segment reduces,
// into out_rows (may be rows itself: each value is read before it is written).
void softmax_composed(const at::Tensor& rows, const at::Tensor& index, int64_t S, at::Tensor& out_rows) {
#ifdef GEOT_WITH_CUDA
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor values = rows.to(at::toOpMathType(rows.scalar_type()));
  const at::Tensor max = segment_reduce_op(index, values, S, "max", std::nullopt);
  const at::Tensor y = exp_shift_cuda(values, max, index);  // -inf scores give 0
  const at::Tensor sum = segment_reduce_op(index, y, S, "sum", std::nullopt);
  normalize_cuda(y, sum, index, out_rows);
#endif
}

// grad_score = y * (grad - sum of grad * y) per destination and head, from a segment sum.
void softmax_backward_composed(const at::Tensor& y_rows, const at::Tensor& g_rows, const at::Tensor& index, int64_t S,
                               at::Tensor& out_rows) {
#ifdef GEOT_WITH_CUDA
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto acc = at::toOpMathType(y_rows.scalar_type());
  const at::Tensor dot = segment_reduce_op(index, y_rows.to(acc) * g_rows.to(acc), S, "sum", std::nullopt);
  softmax_grad_cuda(y_rows, g_rows, dot, index, out_rows);
#endif
}

// Every edge belongs to a destination once dst_index is valid; with
// validation off, edges outside [0, num_segments) are left at 0.
at::Tensor new_output(const at::Tensor& like) {
  return validation_enabled() ? uninitialized(like.sizes(), like.options())
                              : at::zeros_like(like, at::MemoryFormat::Contiguous);
}

at::Tensor as_edge_rows(const at::Tensor& t, int64_t H) { return t.reshape({t.size(0), H}).contiguous(); }

// Runs body(first_edge, end_edge, scratch) for every destination in
// parallel; scratch holds 2 * H accumulators of the task.
template <typename acc_t, typename index_t, typename Body>
void for_each_destination(const index_t* index, int64_t E, int64_t S, int64_t H, const Body& body) {
  const int64_t work = std::max<int64_t>(1, (E / std::max<int64_t>(S, 1) + 1) * H);
  at::parallel_for(0, S, std::max<int64_t>(1, 16384 / work), [&](int64_t s_begin, int64_t s_end) {
    std::vector<acc_t> scratch(2 * H);
    int64_t e = std::lower_bound(index, index + E, s_begin, [](index_t v, int64_t s) { return int64_t(v) < s; }) -
                index;
    for (int64_t s = s_begin; s < s_end; ++s) {
      int64_t end = e;
      while (end < E && int64_t(index[end]) == s) ++end;
      body(e, end, scratch.data());
      e = end;
    }
  });
}

// The CPU kernels accumulate in double: a hub's float sum of 10^4+ terms
// would be off by more than float32's tolerance.
using cpu_acc_t = double;

template <typename scalar_t, typename index_t>
void softmax_rows(const scalar_t* score, const index_t* index, scalar_t* out, int64_t E, int64_t H, int64_t S) {
  using acc_t = cpu_acc_t;
  for_each_destination<acc_t>(index, E, S, H, [&](int64_t begin, int64_t end, acc_t* scratch) {
    acc_t* max = scratch;
    acc_t* sum = scratch + H;
    std::fill_n(max, H, -std::numeric_limits<acc_t>::infinity());
    std::fill_n(sum, H, acc_t(0));
    for (int64_t e = begin; e < end; ++e)
      for (int64_t h = 0; h < H; ++h) max[h] = std::max(max[h], acc_t(score[e * H + h]));
    for (int64_t e = begin; e < end; ++e)
      for (int64_t h = 0; h < H; ++h) sum[h] += std::exp(acc_t(score[e * H + h]) - max[h]);
    for (int64_t e = begin; e < end; ++e)
      for (int64_t h = 0; h < H; ++h) out[e * H + h] = scalar_t(std::exp(acc_t(score[e * H + h]) - max[h]) / sum[h]);
  });
}

template <typename scalar_t, typename index_t>
void softmax_backward_rows(const scalar_t* y, const scalar_t* grad, const index_t* index, scalar_t* out, int64_t E,
                           int64_t H, int64_t S) {
  using acc_t = cpu_acc_t;
  for_each_destination<acc_t>(index, E, S, H, [&](int64_t begin, int64_t end, acc_t* dot) {
    std::fill_n(dot, H, acc_t(0));
    for (int64_t e = begin; e < end; ++e)
      for (int64_t h = 0; h < H; ++h) dot[h] += acc_t(y[e * H + h]) * acc_t(grad[e * H + h]);
    for (int64_t e = begin; e < end; ++e)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t i = e * H + h;
        out[i] = scalar_t(acc_t(y[i]) * (acc_t(grad[i]) - dot[h]));
      }
  });
}

}  // namespace

at::Tensor edge_softmax_op(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments) {
  const int64_t H = check_edge_values(score, "score");
  const int level = check_dst_index(dst_index, score, "score", num_segments);
  at::Tensor out = new_output(score);
  if (out.numel() == 0) return out;
  const at::Tensor rows = as_edge_rows(score, H), index = dst_index.contiguous();
  at::Tensor out_rows = out.view({score.size(0), H});
  if (composed_on_cuda(score, level)) {
    softmax_composed(rows, index, num_segments, out_rows);
    return out;
  }
#ifdef GEOT_WITH_CUDA
  if (score.is_cuda()) {
    edge_softmax_cuda(rows, index, num_segments, out_rows);
    return out;
  }
#endif
  edge_softmax_cpu(rows, index, num_segments, out_rows);
  return out;
}

void edge_softmax_inplace_op(at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments) {
  const int64_t H = check_edge_values(score, "score");
  const int level = check_dst_index(dst_index, score, "score", num_segments);
  TORCH_CHECK_VALUE(score.is_contiguous(), "score must be contiguous to be overwritten by edge_softmax_");
  if (score.numel() == 0) return;
  // Each value is read before it is written, by the thread that writes it.
  at::Tensor rows = score.view({score.size(0), H});
  const at::Tensor index = dst_index.contiguous();
  if (composed_on_cuda(score, level)) return softmax_composed(rows, index, num_segments, rows);
#ifdef GEOT_WITH_CUDA
  if (score.is_cuda()) return edge_softmax_cuda(rows, index, num_segments, rows);
#endif
  edge_softmax_cpu(rows, index, num_segments, rows);
}

at::Tensor edge_softmax_backward_op(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                                    int64_t num_segments) {
  const int64_t H = check_edge_values(y, "y");
  check_edge_values(grad, "grad");
  TORCH_CHECK_TYPE(grad.scalar_type() == y.scalar_type(), "grad must have the dtype of y (", y.scalar_type(),
                   "), got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.sizes() == y.sizes(), "grad must have the shape of y (", shape_string(y.sizes()), "), got ",
                    shape_string(grad.sizes()));
  check_same_device(grad, "grad", y, "y");
  const int level = check_dst_index(dst_index, y, "y", num_segments);
  at::Tensor out = new_output(y);
  if (out.numel() == 0) return out;
  const at::Tensor y_rows = as_edge_rows(y, H), g_rows = as_edge_rows(grad, H), index = dst_index.contiguous();
  at::Tensor out_rows = out.view({y.size(0), H});
  if (composed_on_cuda(y, level)) {
    softmax_backward_composed(y_rows, g_rows, index, num_segments, out_rows);
    return out;
  }
#ifdef GEOT_WITH_CUDA
  if (y.is_cuda()) {
    edge_softmax_backward_cuda(y_rows, g_rows, index, num_segments, out_rows);
    return out;
  }
#endif
  edge_softmax_backward_cpu(y_rows, g_rows, index, num_segments, out_rows);
  return out;
}

void edge_softmax_cpu(const at::Tensor& score, const at::Tensor& dst_index, int64_t num_segments, at::Tensor& out) {
  const int64_t E = score.size(0), H = score.size(1);
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_softmax_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, score.scalar_type(), "geot_edge_softmax_cpu", [&] {
      softmax_rows(score.data_ptr<scalar_t>(), dst_index.data_ptr<index_t>(), out.data_ptr<scalar_t>(), E, H,
                   num_segments);
    });
  });
}

void edge_softmax_backward_cpu(const at::Tensor& y, const at::Tensor& grad, const at::Tensor& dst_index,
                               int64_t num_segments, at::Tensor& out) {
  const int64_t E = y.size(0), H = y.size(1);
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_softmax_backward_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "geot_edge_softmax_backward_cpu", [&] {
      softmax_backward_rows(y.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), dst_index.data_ptr<index_t>(),
                            out.data_ptr<scalar_t>(), E, H, num_segments);
    });
  });
}

TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("edge_softmax", &edge_softmax_op);
  m.impl("edge_softmax_", &edge_softmax_inplace_op);
  m.impl("edge_softmax_backward", &edge_softmax_backward_op);
}

}  // namespace geot
