// Host side of unordered_graph.h: tickets, the counts on CPU, and the any-order reduction's autograd.
#include "unordered_graph.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

#include "index_cache.h"
#include "index_segment_reduce.h"
#include "segment_reduce.h"

namespace geot {

int64_t deferred_index_check(const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst,
                             bool dst_sorted) {
  TORCH_CHECK_VALUE(src.dim() == 1 && dst.dim() == 1 && src.numel() == dst.numel(),
                    "deferred_index_check takes two 1-D indices of one length");
  TORCH_CHECK_VALUE(src.is_cuda() && dst.device() == src.device(), "deferred_index_check takes CUDA indices");
  TORCH_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "deferred_index_check takes indices of one dtype");
  remember_valid_index(dst, num_dst, dst_sorted, kLongSegmentBits);
  remember_valid_index(src, num_src, false, kLongSegmentBits);
  static std::atomic<int64_t> last_ticket{0};
  const int64_t ticket = ++last_ticket;
#ifdef GEOT_WITH_CUDA
  deferred_index_check_cuda(src, dst, num_src, num_dst, ticket);
#else
  TORCH_CHECK(false, "geot was built without CUDA");
#endif
  return ticket;
}

int64_t take_failed_check() {
#ifdef GEOT_WITH_CUDA
  return take_failed_check_cuda();
#else
  return 0;
#endif
}

at::Tensor any_order_counts(const at::Tensor& index, int64_t num_segments, bool float64) {
  TORCH_CHECK_VALUE(index.dim() == 1, "index must be 1-D");
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0");
  at::Tensor counts = at::zeros({num_segments}, index.options().dtype(float64 ? at::kDouble : at::kFloat));
  if (index.is_cuda()) {
#ifdef GEOT_WITH_CUDA
    count_rows_cuda(index, counts);
#endif
  } else {
    const at::Tensor in_range = index.masked_select((index >= 0) & (index < num_segments));
    counts.index_add_(0, in_range, at::ones({}, counts.options()).expand({in_range.numel()}));
  }
  return counts.clamp_min_(1);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A value per row ([S] counts) viewed to broadcast over rows [S, ...] of rank `rank`.
at::Tensor per_row(const at::Tensor& values, int64_t rank) {
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape.resize(std::max<int64_t>(rank, values.dim()), 1);
  return values.view(shape);
}

// out[e, h] = <grad[dst[e], h], x[src[e], h]>: the weight's gradient. Through the dispatcher (its
// registered autograd formula) where the backward is recorded, else the kernel directly.
at::Tensor weight_gradient(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& grad,
                           const at::Tensor& x, int64_t heads) {
  if (!at::GradMode::is_enabled()) return edge_dot_op(src, dst, grad, x, heads);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::edge_dot", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t)>();
  return op.call(src, dst, grad, x, heads);
}

struct AnyOrderReduce : public torch::autograd::Function<AnyOrderReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, int64_t num_out, bool mean) {
    at::Tensor out = index_scatter_sum_op(src, dst, x, weight, num_out);
    at::Tensor counts;
    if (mean) {  // counted and divided in float32 at least, the result rounded once
      counts = per_row(any_order_counts(dst, num_out, x.scalar_type() == at::kDouble), x.dim());
      out = out.scalar_type() == counts.scalar_type() ? out.div_(counts) : out.div(counts).to(x.scalar_type());
    }
    const bool weight_grad = weight && weight->requires_grad();
    ctx->save_for_backward({src, dst, weight_grad ? x : at::Tensor(), weight.value_or(at::Tensor()), counts});
    ctx->saved_data["num_src"] = x.size(0);
    ctx->saved_data["x_grad"] = x.requires_grad();
    ctx->saved_data["weight_grad"] = weight_grad;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &src = saved[0], &dst = saved[1], &x = saved[2], &weight = saved[3], &counts = saved[4];
    const at::Tensor grad = counts.defined() ? grads[0].div(counts).to(grads[0].scalar_type()) : grads[0].contiguous();
    at::Tensor grad_x, grad_weight;
    if (ctx->saved_data["x_grad"].toBool()) {
      const std::optional<at::Tensor> w = weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt;
      grad_x = AnyOrderReduce::apply(dst, src, grad, w, ctx->saved_data["num_src"].toInt(), false);
    }
    if (ctx->saved_data["weight_grad"].toBool()) {
      const int64_t heads = weight.dim() == 1 ? 1 : weight.size(1);
      grad_weight = weight_gradient(src, dst, grad, x, heads).reshape(weight.sizes());
    }
    return {at::Tensor(), at::Tensor(), grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor any_order_reduce(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, int64_t num_out, bool mean) {
  return AnyOrderReduce::apply(src, dst, x, weight, num_out, mean);
}

}  // namespace geot
