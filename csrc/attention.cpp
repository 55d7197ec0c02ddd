// Attention aggregation: argument checks, the operator entry shared by CPU
// and CUDA, and the CPU kernel (parallel over destinations, each finding its
// first edge by binary search in the sorted dst_index; deterministic).
#include "attention.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "segment_reduce.h"
#include "uninitialized.h"

namespace geot {

namespace {

// The dtype the kernels compute in (and read the scores in): float32 for x
// in float16/bfloat16/float32, float64 for float64.
at::ScalarType accumulation_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_index(const at::Tensor& index, const char* name, const at::Tensor& x) {
  check_index_tensor(index, name);
  check_same_device(index, name, x, "x");
}

// The dtypes a score or attention vector may have: that of x, or float32
// for float16/bfloat16 x (autocast's x * att with float32 att).
void check_score_dtype(const at::Tensor& score, const char* name, const at::Tensor& x) {
  TORCH_CHECK_TYPE(score.scalar_type() == x.scalar_type() || score.scalar_type() == accumulation_type(x), name,
                   " must have the dtype of x (", x.scalar_type(), ") or ", accumulation_type(x), ", got ",
                   score.scalar_type());
  check_same_device(score, name, x, "x");
}

// One side of the logit: a score [rows, H], or an attention vector [H, C]
// (PyG's parameter [1, H, C] too) whose scores come from rows of x.
void check_side(const std::optional<at::Tensor>& score, const std::optional<at::Tensor>& att, const char* score_name,
                const char* att_name, int64_t rows, const char* rows_name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(score.has_value() != att.has_value(), "give one of ", score_name, " and ", att_name, ", got ",
                    score.has_value() ? "both" : "neither");
  const int64_t H = x.size(1), C = x.size(2);
  if (score) {
    check_score_dtype(*score, score_name, x);
    TORCH_CHECK_VALUE(score->dim() == 2 && score->size(0) == rows && score->size(1) == H, score_name,
                      " must have shape [", rows_name, ", H] = [", std::to_string(rows), ", ", std::to_string(H),
                      "], got ", shape_string(score->sizes()));
    return;
  }
  check_score_dtype(*att, att_name, x);
  const bool flat = att->dim() == 2 && att->size(0) == H && att->size(1) == C;
  const bool pyg = att->dim() == 3 && att->size(0) == 1 && att->size(1) == H && att->size(2) == C;
  TORCH_CHECK_VALUE(flat || pyg, att_name, " must have shape [H, C] = [", std::to_string(H), ", ", std::to_string(C),
                    "] (or [1, H, C]), got ", shape_string(att->sizes()));
  TORCH_CHECK_VALUE(rows <= x.size(0), att_name, " scores destinations by their rows of x: num_segments (",
                    std::to_string(rows), ") must be <= x.size(0) (", std::to_string(x.size(0)), ")");
}

void check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& score_src,
                  const std::optional<at::Tensor>& score_dst, const std::optional<at::Tensor>& att_src,
                  const std::optional<at::Tensor>& att_dst, const at::Tensor& src_index, const at::Tensor& dst_index,
                  int64_t num_segments, bool self_loops) {
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a float32, float16, bfloat16 or float64 tensor, got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 3, "x must have shape [N, H, C] (rows, heads, channels), got ", shape_string(x.sizes()));
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0, got ", std::to_string(num_segments));
  check_side(score_src, att_src, "score_src", "att_src", x.size(0), "N", x);
  check_side(score_dst, att_dst, "score_dst", "att_dst", num_segments, "num_segments", x);
  check_index(src_index, "src_index", x);
  check_index(dst_index, "dst_index", x);
  TORCH_CHECK_VALUE(src_index.size(0) == dst_index.size(0), "src_index and dst_index must have the same length, got ",
                    std::to_string(src_index.size(0)), " and ", std::to_string(dst_index.size(0)));
  TORCH_CHECK_VALUE(src_index.scalar_type() == dst_index.scalar_type(),
                    "src_index and dst_index must have the same dtype, got ", src_index.scalar_type(), " and ",
                    dst_index.scalar_type());
  TORCH_CHECK_VALUE(!self_loops || num_segments <= x.size(0), "self_loops needs a row of x per destination: "
                    "num_segments (", std::to_string(num_segments), ") must be <= x.size(0) (",
                    std::to_string(x.size(0)), ")");
}

// A score or attention vector as the kernels read it: in the accumulation
// dtype, contiguous (a vector flat, [H * C]); undefined where not given.
at::Tensor as_read(const std::optional<at::Tensor>& t, at::ScalarType acc_type) {
  if (!t) return at::Tensor();
  const at::Tensor read = t->to(acc_type).contiguous();
  return read.dim() == 3 ? read.view({-1}) : read;
}

template <typename acc_t>
acc_t leaky_relu(acc_t v, acc_t slope) {
  return v > acc_t(0) ? v : v * slope;
}

// Destinations [s_begin, s_end) from their first edge e. Two passes per
// destination: the largest logit of each head, then the exp-weighted sums.
template <typename scalar_t, typename index_t>
void aggregate_rows(const AttentionInputs& in, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x = in.x.data_ptr<scalar_t>();
  const acc_t* score_src = in.score_src.data_ptr<acc_t>();
  const acc_t* score_dst = in.score_dst.data_ptr<acc_t>();
  const index_t* src = in.src_index.data_ptr<index_t>();
  const index_t* dst = in.dst_index.data_ptr<index_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t E = in.src_index.size(0), S = in.num_segments, H = in.heads, F = in.x.size(1), C = F / H;
  const int64_t rows = in.x.size(0);
  const acc_t slope = acc_t(in.negative_slope);
  const int64_t work = std::max<int64_t>(1, (E / std::max<int64_t>(S, 1) + 1) * F);
  at::parallel_for(0, S, std::max<int64_t>(1, 16384 / work), [&](int64_t s_begin, int64_t s_end) {
    std::vector<acc_t> max(H), sum(H), acc(F);
    int64_t e = std::lower_bound(dst, dst + E, s_begin, [](index_t v, int64_t s) { return int64_t(v) < s; }) - dst;
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t begin = e;
      while (e < E && int64_t(dst[e]) == s) ++e;
      // The messages of s: its edges (without input loops where loops are added), then its loop.
      auto for_each_message = [&](auto&& body) {
        for (int64_t k = begin; k < e; ++k) {
          const int64_t j = src[k];
          if (j < 0 || j >= rows || (in.self_loops && j == s)) continue;
          body(j);
        }
        if (in.self_loops) body(s);
      };
      auto logit = [&](int64_t j, int64_t h) {
        return leaky_relu(score_src[j * H + h] + score_dst[s * H + h], slope);
      };
      std::fill(max.begin(), max.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(sum.begin(), sum.end(), acc_t(0));
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for_each_message([&](int64_t j) {
        for (int64_t h = 0; h < H; ++h) max[h] = std::max(max[h], logit(j, h));
      });
      for_each_message([&](int64_t j) {
        for (int64_t h = 0; h < H; ++h) {
          const acc_t l = logit(j, h);
          if (l == -std::numeric_limits<acc_t>::infinity()) continue;  // no weight (also if max is -inf)
          const acc_t p = std::exp(l - max[h]);
          sum[h] += p;
          for (int64_t c = 0; c < C; ++c) acc[h * C + c] += p * acc_t(x[j * F + h * C + c]);
        }
      });
      for (int64_t f = 0; f < F; ++f) {
        const acc_t total = sum[f / C];
        o[s * F + f] = scalar_t(total == acc_t(0) ? acc_t(0) : acc[f] / total);
      }
    }
  });
}

}  // namespace

at::Tensor attention_aggregate_op(const at::Tensor& x, const std::optional<at::Tensor>& score_src,
                                  const std::optional<at::Tensor>& score_dst, const at::Tensor& src_index,
                                  const at::Tensor& dst_index, int64_t num_segments, double negative_slope,
                                  bool self_loops, const std::optional<at::Tensor>& att_src,
                                  const std::optional<at::Tensor>& att_dst) {
  check_inputs(x, score_src, score_dst, att_src, att_dst, src_index, dst_index, num_segments, self_loops);
  const int long_segments = validate_indices({{dst_index, num_segments, true, "dst_index", "num_segments"},
                                             {src_index, x.size(0), false, "src_index", "x.size(0)"}})[0];
  const int64_t H = x.size(1), C = x.size(2);
  at::Tensor out = uninitialized({num_segments, H, C}, x.options());
  if (out.numel() == 0) return out;
  const at::ScalarType acc_type = accumulation_type(x);
  AttentionInputs in{x.contiguous().view({x.size(0), H * C}),
                     as_read(score_src, acc_type),
                     as_read(score_dst, acc_type),
                     as_read(att_src, acc_type),
                     as_read(att_dst, acc_type),
                     src_index.contiguous(),
                     dst_index.contiguous(),
                     H,
                     num_segments,
                     long_segments,
                     negative_slope,
                     self_loops};
  at::Tensor rows = out.view({num_segments, H * C});
#ifdef GEOT_WITH_CUDA
  if (x.is_cuda()) {
    attention_aggregate_cuda(std::move(in), rows);
    return out;
  }
#endif
  attention_aggregate_cpu(std::move(in), rows);
  return out;
}

void scores_from_attention(AttentionInputs& in) {
  const int64_t H = in.heads, C = in.x.size(1) / H;
  auto scores = [&](const at::Tensor& rows, const at::Tensor& att) {
    return (rows.view({rows.size(0), H, C}).to(att.scalar_type()) * att.view({1, H, C})).sum(-1).contiguous();
  };
  if (in.att_src.defined()) in.score_src = scores(in.x, std::exchange(in.att_src, at::Tensor()));
  if (in.att_dst.defined()) {
    in.score_dst = scores(in.x.narrow(0, 0, in.num_segments), std::exchange(in.att_dst, at::Tensor()));
  }
}

void attention_aggregate_cpu(AttentionInputs in, at::Tensor& out) {
  scores_from_attention(in);
  AT_DISPATCH_INDEX_TYPES(in.dst_index.scalar_type(), "geot_attention_aggregate_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.x.scalar_type(), "geot_attention_aggregate_cpu",
                                    [&] { aggregate_rows<scalar_t, index_t>(in, out); });
  });
}

TORCH_LIBRARY_IMPL(geot, CPU, m) { m.impl("attention_aggregate", &attention_aggregate_op); }

}  // namespace geot
