// The autograd nodes of eager_autograd.h.
#include "eager_autograd.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include "index_segment_reduce.h"
#include "segment_reduce.h"
#include "unordered_graph.h"

namespace geot {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

OptionalTensor defined_or_none(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// A value per row ([S] counts) viewed to broadcast over rows [S, ...] of rank `rank`.
at::Tensor per_row(const at::Tensor& values, int64_t rank) {
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape.resize(std::max<int64_t>(rank, values.dim()), 1);
  return values.view(shape);
}

// The backward's ops: through the dispatcher (their registered autograd
// formulas) where the backward is recorded (create_graph), else the kernels.
at::Tensor edge_dot(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& grad, const at::Tensor& x,
                    int64_t heads) {
  if (!at::GradMode::is_enabled()) return edge_dot_op(src, dst, grad, x, heads);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::edge_dot", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t)>();
  return op.call(src, dst, grad, x, heads);
}

at::Tensor gather_rows(const at::Tensor& values, const at::Tensor& index) {
  if (!at::GradMode::is_enabled()) return gather_rows_op(values, index);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::gather_rows", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(values, index);
}

at::Tensor segment_sum(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x, const OptionalTensor& weight,
                       int64_t num_segments) {
  if (!at::GradMode::is_enabled())
    return index_segment_reduce_op(src, dst, x, weight, num_segments, "sum", std::nullopt, std::nullopt, std::nullopt,
                                   std::nullopt);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::index_segment_reduce", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const OptionalTensor&, int64_t, c10::string_view,
                                               at::OptionalIntArrayRef, const OptionalTensor&,
                                               const OptionalTensor&, const OptionalTensor&)>();
  return op.call(src, dst, x, weight, num_segments, "sum", std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

at::Tensor scatter_sum(const at::Tensor& gather_index, const at::Tensor& scatter_index, const at::Tensor& x,
                       const OptionalTensor& weight, int64_t num_out) {
  if (!at::GradMode::is_enabled()) return index_scatter_sum_op(gather_index, scatter_index, x, weight, num_out);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::index_scatter_sum", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const OptionalTensor&, int64_t)>();
  return op.call(gather_index, scatter_index, x, weight, num_out);
}

// The weight's gradient, out[e, h] = <grad[dst[e], h], x[src[e], h]>, shaped as the weight.
at::Tensor weight_gradient(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& grad, const at::Tensor& x,
                           const at::Tensor& weight) {
  const int64_t heads = weight.dim() == 1 ? 1 : weight.size(1);
  return edge_dot(src, dst, grad, x, heads).reshape(weight.sizes());
}

struct AnyOrderReduce : public torch::autograd::Function<AnyOrderReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const OptionalTensor& weight, int64_t num_out, bool mean) {
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
      const int64_t num_src = ctx->saved_data["num_src"].toInt();
      grad_x = AnyOrderReduce::apply(dst, src, grad, defined_or_none(weight), num_src, false);
    }
    if (ctx->saved_data["weight_grad"].toBool()) grad_weight = weight_gradient(src, dst, grad, x, weight);
    return {at::Tensor(), at::Tensor(), grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

// Rows per segment of a sorted index, at least 1: a mean's divisor in the backward.
at::Tensor mean_counts(const at::Tensor& dst, int64_t num_segments) {
  const at::Tensor bounds = at::arange(num_segments + 1, dst.options());
  return at::searchsorted(dst, bounds).diff().clamp_min_(1);
}

// A mean's gradient is grad's rows divided by their segments' sizes. Where
// only x takes a gradient and grad's rows are wide against the mean degree
// (F >= 2 E / S), the division rides in x's gathered sum as a per-edge scale
// instead: a gather of E scales in place of a pass over [S, F] (10^7 edges
// into 10^6 segments at F = 128: 0.1 GB against 1 GB). fp32 / fp64 only,
// so no scale is rounded to a half type.
bool divides_per_edge(const at::Tensor& grad, int64_t edges, bool weight_grad) {
  const bool full_precision = grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kDouble;
  return !weight_grad && full_precision && grad.size(0) > 0 && grad.numel() >= 2 * edges;
}

// Per-edge weights ([E] or [E, H]; undefined: none) times a per-edge scale [E].
at::Tensor scaled_weight(const at::Tensor& weight, const at::Tensor& scale) {
  if (!weight.defined()) return scale;
  return weight.dim() == 1 ? weight * scale : weight * scale.unsqueeze(1);
}

struct SortedReduce : public torch::autograd::Function<SortedReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const OptionalTensor& weight, int64_t num_segments, bool mean,
                            const std::optional<std::vector<int64_t>>& config, const OptionalTensor& t_perm,
                            const OptionalTensor& t_src, const OptionalTensor& t_dst, const OptionalTensor& counts,
                            const OptionalTensor& weight_t) {
    const at::OptionalIntArrayRef launch = config ? at::OptionalIntArrayRef(*config) : at::OptionalIntArrayRef();
    at::Tensor out = index_segment_reduce_op(src, dst, x, weight, num_segments, mean ? "mean" : "sum", launch,
                                             std::nullopt, std::nullopt, std::nullopt);
    const bool weight_grad = weight && weight->requires_grad();
    // x only where the backward reads it (a weight's gradient): saving it keeps it alive.
    ctx->save_for_backward({src, dst, weight_grad ? x : at::Tensor(), weight.value_or(at::Tensor()),
                            t_perm.value_or(at::Tensor()), t_src.value_or(at::Tensor()), t_dst.value_or(at::Tensor())});
    // Per-graph values, unchanged while their graph is kept (as the Python formula holds them).
    ctx->saved_data["counts"] = counts.value_or(at::Tensor());
    ctx->saved_data["weight_t"] = weight_t.value_or(at::Tensor());
    ctx->saved_data["num_segments"] = num_segments;
    ctx->saved_data["num_src"] = x.size(0);
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["x_grad"] = x.requires_grad();
    ctx->saved_data["weight_grad"] = weight_grad;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &src = saved[0], &dst = saved[1], &x = saved[2], &weight = saved[3];
    const at::Tensor &t_perm = saved[4], &t_src = saved[5], &t_dst = saved[6];
    at::Tensor grad = grads[0];
    const bool weight_grad = ctx->saved_data["weight_grad"].toBool();
    at::Tensor inverse_counts;  // a mean's 1 / counts, where the x gradient's kernel scales its edges by them
    if (ctx->saved_data["mean"].toBool()) {
      at::Tensor counts = ctx->saved_data["counts"].toTensor();
      if (!counts.defined()) counts = mean_counts(dst, ctx->saved_data["num_segments"].toInt());
      if (divides_per_edge(grad, src.numel(), weight_grad)) {
        inverse_counts = at::reciprocal(counts.to(grad.scalar_type()));
      } else {
        grad = grad.div(per_row(counts.to(grad.scalar_type()), grad.dim()));
      }
    }
    at::Tensor grad_x, grad_weight;
    if (ctx->saved_data["x_grad"].toBool()) {
      const int64_t num_src = ctx->saved_data["num_src"].toInt();
      if (t_perm.defined()) {  // the fused sum over edges grouped by source
        at::Tensor weight_t = ctx->saved_data["weight_t"].toTensor();
        if (!weight_t.defined() && weight.defined()) weight_t = gather_rows(weight, t_perm);
        if (inverse_counts.defined()) weight_t = scaled_weight(weight_t, inverse_counts.index_select(0, t_dst));
        grad_x = segment_sum(t_dst, t_src, grad, defined_or_none(weight_t), num_src);
      } else {  // no transposed index: atomics in edge order
        const at::Tensor scaled = inverse_counts.defined() ? scaled_weight(weight, inverse_counts.index_select(0, dst))
                                                           : weight;
        grad_x = scatter_sum(dst, src, grad, defined_or_none(scaled), num_src);
      }
    }
    if (weight_grad) grad_weight = weight_gradient(src, dst, grad, x, weight);
    variable_list result(12);
    result[2] = grad_x;
    result[3] = grad_weight;
    return result;
  }
};

}  // namespace

at::Tensor any_order_reduce(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, int64_t num_out, bool mean) {
  return AnyOrderReduce::apply(src, dst, x, weight, num_out, mean);
}

at::Tensor sorted_reduce(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                         const std::optional<at::Tensor>& weight, int64_t num_segments, bool mean,
                         const std::optional<std::vector<int64_t>>& config, const std::optional<at::Tensor>& t_perm,
                         const std::optional<at::Tensor>& t_src, const std::optional<at::Tensor>& t_dst,
                         const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& weight_t) {
  return SortedReduce::apply(src, dst, x, weight, num_segments, mean, config, t_perm, t_src, t_dst, counts, weight_t);
}

}  // namespace geot
