// Fused gather + segment reduce: argument checks, the operator entries (shared
// by CPU and CUDA: they run on the row reduction of segment_reduce_cpu.cpp /
// segment_reduce_cuda.cu with a gather and a weight), and the per-edge ops
// (edge_dot, edge_additive_score) with their CPU kernels.
#include "index_segment_reduce.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "segment_reduce.h"
#include "uninitialized.h"

namespace geot {

namespace {

void check_features(const at::Tensor& x, const char* name) {
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), name,
                   " must be a float32, float16, bfloat16 or float64 tensor, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, name, " must have at least one dimension (rows), got a 0-d tensor");
}

// Checks the edge list (src_index, dst_index) against x and returns E.
int64_t check_edges(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x) {
  check_index_tensor(src_index, "src_index");
  check_index_tensor(dst_index, "dst_index");
  check_features(x, "x");
  TORCH_CHECK_VALUE(src_index.size(0) == dst_index.size(0), "src_index and dst_index must have the same length, got ",
                    std::to_string(src_index.size(0)), " and ", std::to_string(dst_index.size(0)));
  check_same_device(src_index, "src_index", x, "x");
  check_same_device(dst_index, "dst_index", x, "x");
  return src_index.size(0);
}

// weight [E] (heads = 1) or [E, H] with x [N, H, ...]. Returns the heads.
int64_t check_weight(const at::Tensor& weight, int64_t E, const at::Tensor& x) {
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "weight must have the dtype of x (", x.scalar_type(),
                   "), got ", weight.scalar_type());
  check_same_device(weight, "weight", x, "x");
  TORCH_CHECK_VALUE((weight.dim() == 1 || weight.dim() == 2) && weight.size(0) == E,
                    "weight must have shape [E] or [E, H] with E = ", std::to_string(E), " edges, got ",
                    shape_string(weight.sizes()));
  if (weight.dim() == 1) return 1;
  const int64_t heads = weight.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.size(1) == heads, "with weight of shape [E, H] = ",
                    shape_string(weight.sizes()), ", x must have shape [N, H, ...], got ", shape_string(x.sizes()));
  return heads;
}

// The fused op's row reduction with gather = src_index in dst_index's dtype.
RowReduction fused_reduction(const at::Tensor& segment_index, const at::Tensor& gather_index, const at::Tensor& x,
                             const std::optional<at::Tensor>& weight, int64_t heads, int64_t num_segments) {
  RowReduction r;
  // Each call here is a dispatched op only when it changes something: on
  // small graphs host time is the cost that counts.
  r.index = segment_index.contiguous();
  const bool same_dtype = gather_index.scalar_type() == r.index.scalar_type();
  r.gather = (same_dtype ? gather_index : gather_index.to(r.index.scalar_type())).contiguous();
  r.src = as_rows(x);
  if (weight) r.weight = weight->dim() == 1 ? weight->contiguous() : weight->contiguous().view(-1);
  r.heads = heads;
  r.num_segments = num_segments;
  return r;
}

}  // namespace

at::Tensor index_segment_reduce_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                                   const std::optional<at::Tensor>& weight, int64_t num_segments,
                                   c10::string_view reduce, at::OptionalIntArrayRef config,
                                   const std::optional<at::Tensor>& /*t_perm*/,
                                   const std::optional<at::Tensor>& /*t_src*/,
                                   const std::optional<at::Tensor>& /*t_dst*/) {
  const int64_t E = check_edges(src_index, dst_index, x);
  const int64_t heads = weight ? check_weight(*weight, E, x) : 1;
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0, got ", std::to_string(num_segments));
  const Reduce kind = parse_reduce(reduce);
  const int long_segments = validate_indices({{dst_index, num_segments, true, "dst_index", "num_segments"},
                                             {src_index, x.size(0), false, "src_index", "x.size(0)"}})[0];
  RowReduction r = fused_reduction(dst_index, src_index, x, weight, heads, num_segments);
  r.long_segments = long_segments;
  r.reduce = kind;
  r.config = config;
  return shaped_like_rows_of(reduce_rows(r), x);
}

at::Tensor index_scatter_sum_op(const at::Tensor& gather_index, const at::Tensor& scatter_index, const at::Tensor& x,
                                const std::optional<at::Tensor>& weight, int64_t num_out) {
  const int64_t E = check_edges(gather_index, scatter_index, x);
  const int64_t heads = weight ? check_weight(*weight, E, x) : 1;
  TORCH_CHECK_VALUE(num_out >= 0, "num_out must be >= 0, got ", std::to_string(num_out));
  validate_indices({{scatter_index, num_out, false, "scatter_index", "num_out"},
                    {gather_index, x.size(0), false, "gather_index", "x.size(0)"}});
  if (x.is_cuda() && at::globalContext().deterministicAlgorithms()) {
    // Deterministic: no atomics in edge order; the edges sorted (stably) by
    // scatter_index take the sorted, deterministic segment schedules.
    const auto [sorted, perm] = at::sort(scatter_index, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const std::optional<at::Tensor> sorted_weight =
        weight ? std::optional<at::Tensor>(weight->index_select(0, perm)) : std::nullopt;
    RowReduction r = fused_reduction(sorted, gather_index.index_select(0, perm), x, sorted_weight, heads, num_out);
    return shaped_like_rows_of(reduce_rows(r), x);
  }
  RowReduction r = fused_reduction(scatter_index, gather_index, x, weight, heads, num_out);
  r.any_order = true;
  return shaped_like_rows_of(reduce_rows(r), x);
}

at::Tensor index_sum_plus_scaled_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                                    const at::Tensor& scale, at::OptionalIntArrayRef config, double scale_offset) {
  check_edges(src_index, dst_index, x);
  check_same_device(scale, "scale", x, "x");
  TORCH_CHECK_TYPE(at::isFloatingType(scale.scalar_type()), "scale must be a floating-point tensor, got ",
                   scale.scalar_type());
  TORCH_CHECK_VALUE(scale.numel() == 1, "scale must hold one value, got shape ", shape_string(scale.sizes()));
  const int64_t rows = x.size(0);
  const int long_segments = validate_indices({{dst_index, rows, true, "dst_index", "x.size(0)"},
                                             {src_index, rows, false, "src_index", "x.size(0)"}})[0];
  RowReduction r = fused_reduction(dst_index, src_index, x, std::nullopt, 1, rows);
  r.long_segments = long_segments;
  r.config = config;
  r.self_scale = scale;
  r.self_offset = scale_offset;
  return shaped_like_rows_of(reduce_rows(r), x);
}

namespace {

// The checks of the per-edge ops; returns E and the contiguous indices and rows.
struct EdgeRows {
  int64_t E;
  at::Tensor src, dst, a_rows, b_rows;
};

EdgeRows edge_rows(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                   const at::Tensor& b, int64_t heads) {
  const int64_t E = check_edges(src_index, dst_index, b);
  check_features(a, "a");
  check_same_device(a, "a", b, "b");
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "a and b must have one dtype, got ", a.scalar_type(),
                   " and ", b.scalar_type());
  at::Tensor a_rows = as_rows(a), b_rows = as_rows(b);
  const int64_t F = b_rows.size(1);
  TORCH_CHECK_VALUE(a_rows.size(1) == F, "a and b must have the same features per row, got shapes ",
                    shape_string(a.sizes()), " and ", shape_string(b.sizes()));
  TORCH_CHECK_VALUE(heads >= 1 && F % heads == 0, "heads (", std::to_string(heads),
                    ") must divide the features per row (", std::to_string(F), ")");
  validate_indices({{dst_index, a.size(0), false, "dst_index", "a.size(0)"},
                    {src_index, b.size(0), false, "src_index", "b.size(0)"}});
  at::Tensor dst = dst_index.contiguous(), src = src_index.to(dst.scalar_type()).contiguous();
  return {E, std::move(src), std::move(dst), std::move(a_rows), std::move(b_rows)};
}

// out[e, h] = the sum over head h's features f of term(a[dst[e], f], b[src[e], f], f) (acc_t values).
template <typename scalar_t, typename index_t, typename Term>
void edge_term_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                   const at::Tensor& b, at::Tensor& out, Term term) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t E = out.size(0), heads = out.size(1), F = b.size(1), head_size = F / heads;
  const int64_t a_rows = a.size(0), b_rows = b.size(0);
  const index_t* src = src_index.data_ptr<index_t>();
  const index_t* dst = dst_index.data_ptr<index_t>();
  const scalar_t* pa = a.data_ptr<scalar_t>();
  const scalar_t* pb = b.data_ptr<scalar_t>();
  scalar_t* po = out.data_ptr<scalar_t>();
  at::parallel_for(0, E, std::max<int64_t>(1, 8192 / std::max<int64_t>(F, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t s = src[e], d = dst[e];
      const bool valid = s >= 0 && s < b_rows && d >= 0 && d < a_rows;
      for (int64_t h = 0; h < heads; ++h) {
        acc_t sum = 0;
        for (int64_t f = h * head_size; valid && f < (h + 1) * head_size; ++f)
          sum += term(acc_t(pa[d * F + f]), acc_t(pb[s * F + f]), f);
        po[e * heads + h] = scalar_t(sum);
      }
    }
  });
}

}  // namespace

at::Tensor edge_dot_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                       const at::Tensor& b, int64_t heads) {
  const EdgeRows r = edge_rows(src_index, dst_index, a, b, heads);
  at::Tensor out = uninitialized({r.E, heads}, b.options());
  if (r.E == 0) return out;
#ifdef GEOT_WITH_CUDA
  if (b.is_cuda()) {
    edge_dot_cuda(r.src, r.dst, r.a_rows, r.b_rows, out);
    return out;
  }
#endif
  edge_dot_cpu(r.src, r.dst, r.a_rows, r.b_rows, out);
  return out;
}

at::Tensor edge_additive_score_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                                  const at::Tensor& b, const at::Tensor& att, double negative_slope, int64_t heads) {
  const EdgeRows r = edge_rows(src_index, dst_index, a, b, heads);
  check_same_device(att, "att", b, "b");
  TORCH_CHECK_TYPE(att.scalar_type() == b.scalar_type(), "att must have the dtype of a and b (", b.scalar_type(),
                   "), got ", att.scalar_type());
  TORCH_CHECK_VALUE(att.numel() == r.b_rows.size(1), "att must hold one value per feature (",
                    std::to_string(r.b_rows.size(1)), "), got shape ", shape_string(att.sizes()));
  at::Tensor out = uninitialized({r.E, heads}, b.options());
  if (r.E == 0) return out;
  const at::Tensor att_values = att.contiguous().view({-1});
#ifdef GEOT_WITH_CUDA
  if (b.is_cuda()) {
    edge_additive_score_cuda(r.src, r.dst, r.a_rows, r.b_rows, att_values, negative_slope, out);
    return out;
  }
#endif
  edge_additive_score_cpu(r.src, r.dst, r.a_rows, r.b_rows, att_values, negative_slope, out);
  return out;
}

void edge_dot_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                  const at::Tensor& b, at::Tensor& out) {
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_dot_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "geot_edge_dot_cpu", [&] {
      edge_term_cpu<scalar_t, index_t>(src_index, dst_index, a, b, out, [](auto x, auto y, int64_t) { return x * y; });
    });
  });
}

void edge_additive_score_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& a,
                             const at::Tensor& b, const at::Tensor& att, double negative_slope, at::Tensor& out) {
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_edge_additive_score_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.scalar_type(), "geot_edge_additive_score_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* att_values = att.data_ptr<scalar_t>();
      const acc_t slope = static_cast<acc_t>(negative_slope);
      edge_term_cpu<scalar_t, index_t>(src_index, dst_index, a, b, out, [=](acc_t x, acc_t y, int64_t f) {
        const acc_t z = x + y;
        return acc_t(att_values[f]) * (z > acc_t(0) ? z : z * slope);
      });
    });
  });
}

at::Tensor extremum_grad_op(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                            const at::Tensor& extremum, const at::Tensor& grad_out) {
  check_edges(src_index, dst_index, x);
  for (const auto& [t, name] : {std::pair{&extremum, "extremum"}, std::pair{&grad_out, "grad_out"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == x.scalar_type(), name, " must have the dtype of x (", x.scalar_type(),
                     "), got ", t->scalar_type());
    check_same_device(*t, name, x, "x");
    TORCH_CHECK_VALUE(t->dim() == x.dim() && t->sizes().slice(1) == x.sizes().slice(1), name,
                      " must have shape [num_segments, ...] with x's trailing dimensions ",
                      shape_string(x.sizes().slice(1)), ", got ", shape_string(t->sizes()));
  }
  TORCH_CHECK_VALUE(grad_out.size(0) == extremum.size(0), "grad_out must have extremum's shape ",
                    shape_string(extremum.sizes()), ", got ", shape_string(grad_out.sizes()));
  const at::Tensor dst = dst_index.contiguous(), src = src_index.to(dst.scalar_type()).contiguous();
  const at::Tensor rows = as_rows(x), ext = as_rows(extremum), grad = as_rows(grad_out);
#ifdef GEOT_WITH_CUDA
  if (x.is_cuda()) return extremum_grad_cuda(src, dst, rows, ext, grad).view(x.sizes());
#endif
  return extremum_grad_cpu(src, dst, rows, ext, grad).view(x.sizes());
}

// Features split among threads, every thread over all edges: no races.
at::Tensor extremum_grad_cpu(const at::Tensor& src_index, const at::Tensor& dst_index, const at::Tensor& x,
                             const at::Tensor& extremum, const at::Tensor& grad) {
  const int64_t E = src_index.numel(), F = x.size(1), S = extremum.size(0), N = x.size(0);
  at::Tensor grad_x = at::zeros_like(x);
  AT_DISPATCH_INDEX_TYPES(dst_index.scalar_type(), "geot_extremum_grad_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "geot_extremum_grad_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const index_t* src = src_index.data_ptr<index_t>();
      const index_t* dst = dst_index.data_ptr<index_t>();
      const scalar_t *px = x.data_ptr<scalar_t>(), *pe = extremum.data_ptr<scalar_t>(), *pg = grad.data_ptr<scalar_t>();
      scalar_t* out = grad_x.data_ptr<scalar_t>();
      at::parallel_for(0, F, 1, [&](int64_t begin, int64_t end) {
        const int64_t width = end - begin;
        std::vector<int32_t> ties(S * width, 0);
        std::vector<acc_t> sums(N * width, acc_t(0));
        // Visits each (edge, feature of this range) whose row holds its segment's extremum.
        const auto for_each_tie = [&](const auto& visit) {
          for (int64_t e = 0; e < E; ++e) {
            const int64_t s = src[e], d = dst[e];
            if (s < 0 || s >= N || d < 0 || d >= S) continue;
            for (int64_t f = begin; f < end; ++f)
              if (acc_t(px[s * F + f]) == acc_t(pe[d * F + f])) visit(s, d, f);
          }
        };
        for_each_tie([&](int64_t, int64_t d, int64_t f) { ++ties[d * width + f - begin]; });
        // Each tie's share, rounded to the gradient's dtype as the composite's is.
        for_each_tie([&](int64_t s, int64_t d, int64_t f) {
          sums[s * width + f - begin] += acc_t(scalar_t(acc_t(pg[d * F + f]) / acc_t(ties[d * width + f - begin])));
        });
        for (int64_t n = 0; n < N; ++n)
          for (int64_t f = begin; f < end; ++f) out[n * F + f] = scalar_t(sums[n * width + f - begin]);
      });
    });
  });
  return grad_x;
}

TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("index_segment_reduce", &index_segment_reduce_op);
  m.impl("index_scatter_sum", &index_scatter_sum_op);
  m.impl("index_sum_plus_scaled", &index_sum_plus_scaled_op);
  m.impl("edge_dot", &edge_dot_op);
  m.impl("edge_additive_score", &edge_additive_score_op);
  m.impl("extremum_grad", &extremum_grad_op);
}

}  // namespace geot
