// segment_reduce on CPU, plus the argument checks shared with the CUDA path.
// Parallel over segments (at::parallel_for); each task finds its first row by
// binary search in the sorted index and walks its segments' rows in order, so
// the result is deterministic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>

#include "segment_reduce.h"

namespace geot {

namespace {
std::atomic<bool> g_validation{true};
}

bool validation_enabled() { return g_validation.load(std::memory_order_relaxed); }
void set_validation(bool on) { g_validation.store(on, std::memory_order_relaxed); }

Reduce parse_reduce(c10::string_view reduce) {
  if (reduce == "sum") return Reduce::Sum;
  if (reduce == "mean") return Reduce::Mean;
  if (reduce == "max") return Reduce::Max;
  if (reduce == "min") return Reduce::Min;
  TORCH_CHECK_VALUE(false, "reduce must be one of 'sum', 'mean', 'max', 'min', got '", std::string(reduce), "'");
}

void check_segment_inputs(const at::Tensor& index, const at::Tensor& src, int64_t num_segments) {
  TORCH_CHECK_TYPE(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
                   "index must be an int32 or int64 tensor, got ", index.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(src.scalar_type()),
                   "src must be a float32, float16, bfloat16 or float64 tensor, got ", src.scalar_type());
  TORCH_CHECK_VALUE(index.dim() == 1, "index must be 1-D, got shape ", shape_string(index.sizes()));
  TORCH_CHECK_VALUE(src.dim() >= 1, "src must have at least one dimension (rows), got a 0-d tensor");
  TORCH_CHECK_VALUE(index.size(0) == src.size(0), "index and src must have the same length along dim 0, got ",
                    std::to_string(index.size(0)), " and ", std::to_string(src.size(0)));
  TORCH_CHECK_VALUE(index.device() == src.device(), "index and src must be on the same device, got ",
                    index.device().str(), " and ", src.device().str());
  TORCH_CHECK_VALUE(num_segments >= 0, "num_segments must be >= 0, got ", std::to_string(num_segments));
}

std::string shape_string(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t d = 0; d < sizes.size(); ++d) text += (d ? ", " : "") + std::to_string(sizes[d]);
  return text + "]";
}

at::Tensor as_rows(const at::Tensor& src) {
  int64_t F = 1;
  for (int64_t d = 1; d < src.dim(); ++d) F *= src.size(d);
  return src.reshape({src.size(0), F}).contiguous();
}

std::vector<int64_t> segment_output_sizes(const at::Tensor& src, int64_t num_segments) {
  std::vector<int64_t> sizes = src.sizes().vec();
  sizes[0] = num_segments;
  return sizes;
}

void raise_index_errors(int flags, int64_t num_segments) {
  // Unsorted first: it also explains a wrong inferred num_segments.
  TORCH_CHECK_VALUE(!(flags & 4),
                    "index must be sorted in non-decreasing order. Sort once and reuse: "
                    "`index, perm = index.sort(stable=True); src = src[perm]` (for a PyG edge_index, "
                    "torch_geometric.utils.sort_edge_index(edge_index, sort_by_row=False) sorts by destination)");
  TORCH_CHECK_VALUE(!(flags & 1), "index has negative values; segment ids must be in [0, num_segments)");
  TORCH_CHECK_VALUE(!(flags & 2), "index has values >= num_segments (", std::to_string(num_segments),
                    "); pass a larger num_segments or fix the index");
}

Config resolve_config(at::OptionalIntArrayRef override_config, int64_t E, int64_t S, int64_t F) {
  if (!override_config.has_value()) return heuristic_config(make_features(E, S, F));
  const auto v = *override_config;
  TORCH_CHECK_VALUE(v.size() == 5, "config must be (N_t, T_N, M_t, T_M, G_t), got ", std::to_string(v.size()), " values");
  const Config cfg{int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4])};
  try {
    check_config(cfg);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return cfg;
}

namespace {

template <typename index_t>
void check_index_values_cpu(const index_t* index, int64_t E, int64_t num_segments) {
  std::atomic<int> flags{0};
  at::parallel_for(0, E, 1 << 16, [&](int64_t begin, int64_t end) {
    int bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t v = index[i];
      bad |= (v < 0 ? 1 : 0) | (v >= num_segments ? 2 : 0);
      if (i + 1 < E && int64_t(index[i + 1]) < v) bad |= 4;
    }
    if (bad) flags.fetch_or(bad);
  });
  raise_index_errors(flags.load(), num_segments);
}

template <typename acc_t>
struct CpuReduce {
  Reduce kind;
  acc_t identity() const {
    if (kind == Reduce::Max) return -std::numeric_limits<acc_t>::infinity();
    if (kind == Reduce::Min) return std::numeric_limits<acc_t>::infinity();
    return acc_t(0);
  }
  acc_t finish(acc_t v, int64_t count) const {
    if (count == 0) return acc_t(0);
    return kind == Reduce::Mean ? v / acc_t(count) : v;
  }
};

// Runs body(segment, first_row, end_row) for every segment, in parallel, with
// grains of roughly equal work.
template <typename index_t, typename Body>
void for_each_segment(const index_t* index, int64_t E, int64_t S, int64_t F, const Body& body) {
  const int64_t work_per_segment = std::max<int64_t>(1, (E / std::max<int64_t>(S, 1) + 1) * F);
  const int64_t grain = std::max<int64_t>(1, 32768 / work_per_segment);
  at::parallel_for(0, S, grain, [&](int64_t s_begin, int64_t s_end) {
    int64_t e = std::lower_bound(index, index + E, static_cast<index_t>(s_begin)) - index;
    for (int64_t s = s_begin; s < s_end; ++s) {
      int64_t end = e;
      while (end < E && int64_t(index[end]) == s) ++end;
      body(s, e, end);
      e = end;
    }
  });
}

template <typename scalar_t, typename index_t>
void segment_reduce_rows(const index_t* index, const scalar_t* src, scalar_t* out, int64_t E, int64_t S, int64_t F,
                         Reduce kind) {
  using acc_t = at::opmath_type<scalar_t>;
  const CpuReduce<acc_t> op{kind};
  for_each_segment(index, E, S, F, [&](int64_t s, int64_t begin, int64_t end) {
    std::vector<acc_t> acc(F, op.identity());
    for (int64_t e = begin; e < end; ++e) {
      const scalar_t* row = src + e * F;
      switch (kind) {
        case Reduce::Max:
          for (int64_t f = 0; f < F; ++f) acc[f] = std::max(acc[f], acc_t(row[f]));
          break;
        case Reduce::Min:
          for (int64_t f = 0; f < F; ++f) acc[f] = std::min(acc[f], acc_t(row[f]));
          break;
        default:
          for (int64_t f = 0; f < F; ++f) acc[f] += acc_t(row[f]);
      }
    }
    for (int64_t f = 0; f < F; ++f) out[s * F + f] = scalar_t(op.finish(acc[f], end - begin));
  });
}

}  // namespace

at::Tensor segment_reduce_cpu(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                              c10::string_view reduce_name, at::OptionalIntArrayRef /*config: CUDA only*/) {
  check_segment_inputs(index, src, num_segments);
  const Reduce reduce = parse_reduce(reduce_name);
  const at::Tensor rows = as_rows(src), idx = index.contiguous();
  const int64_t E = rows.size(0), F = rows.size(1), S = num_segments;
  at::Tensor out = at::empty({S, F}, src.options());
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "geot_segment_reduce_cpu", [&] {
    if (validation_enabled()) check_index_values_cpu(idx.data_ptr<index_t>(), E, S);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "geot_segment_reduce_cpu", [&] {
      segment_reduce_rows(idx.data_ptr<index_t>(), rows.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), E, S, F,
                          reduce);
    });
  });
  return out.view(segment_output_sizes(src, num_segments));
}

at::Tensor segment_arg_cpu(const at::Tensor& index, const at::Tensor& src, const at::Tensor& out) {
  const int64_t S = out.size(0);
  check_segment_inputs(index, src, S);
  const at::Tensor rows = as_rows(src), idx = index.contiguous();
  const at::Tensor out_rows = out.reshape({S, -1}).contiguous();
  const int64_t E = rows.size(0), F = rows.size(1);
  at::Tensor arg = at::full({S, F}, E, src.options().dtype(at::kLong));
  int64_t* arg_data = arg.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "geot_segment_arg_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "geot_segment_arg_cpu", [&] {
      const scalar_t* src_data = rows.data_ptr<scalar_t>();
      const scalar_t* out_data = out_rows.data_ptr<scalar_t>();
      for_each_segment(idx.data_ptr<index_t>(), E, S, F, [&](int64_t s, int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e)
          for (int64_t f = 0; f < F; ++f)
            if (arg_data[s * F + f] == E && src_data[e * F + f] == out_data[s * F + f]) arg_data[s * F + f] = e;
      });
    });
  });
  return arg;
}

TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("segment_reduce", &segment_reduce_cpu);
  m.impl("segment_arg", &segment_arg_cpu);
}

}  // namespace geot
