// segment_reduce on CPU, the operator entry shared with CUDA, and the
// argument checks and index validation every op of the family uses.
// Parallel over segments (at::parallel_for); each task finds its first row by
// binary search in the sorted index and walks its segments' rows in order, so
// the result is deterministic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <c10/core/DeviceGuard.h>
#ifdef GEOT_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

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

bool capturing_cuda_graph() {
#ifdef GEOT_WITH_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

Reduce parse_reduce(c10::string_view reduce) {
  if (reduce == "sum") return Reduce::Sum;
  if (reduce == "mean") return Reduce::Mean;
  if (reduce == "max") return Reduce::Max;
  if (reduce == "min") return Reduce::Min;
  TORCH_CHECK_VALUE(false, "reduce must be one of 'sum', 'mean', 'max', 'min', got '", std::string(reduce), "'");
}

void check_index_tensor(const at::Tensor& index, const char* name) {
  TORCH_CHECK_TYPE(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt, name,
                   " must be an int32 or int64 tensor, got ", index.scalar_type());
  TORCH_CHECK_VALUE(index.dim() == 1, name, " must be 1-D, got shape ", shape_string(index.sizes()));
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on the device of ", like_name, " (",
                    like.device().str(), "), got ", t.device().str());
}

void check_segment_inputs(const at::Tensor& index, const at::Tensor& src, int64_t num_segments) {
  check_index_tensor(index, "index");
  TORCH_CHECK_TYPE(at::isFloatingType(src.scalar_type()),
                   "src must be a float32, float16, bfloat16 or float64 tensor, got ", src.scalar_type());
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
  if (src.dim() == 2 && src.is_contiguous()) return src;  // the common case, without a dispatched reshape
  int64_t F = 1;
  for (int64_t d = 1; d < src.dim(); ++d) F *= src.size(d);
  return src.reshape({src.size(0), F}).contiguous();
}

at::Tensor shaped_like_rows_of(const at::Tensor& rows, const at::Tensor& src) {
  if (src.dim() == 2) return rows;
  std::vector<int64_t> sizes = src.sizes().vec();
  sizes[0] = rows.size(0);
  return rows.view(sizes);
}

void raise_index_errors(int flags, const IndexCheck& check) {
  const std::string name = check.name, bound = std::to_string(check.bound);
  // Unsorted first: it also explains a wrong inferred num_segments.
  TORCH_CHECK_VALUE(!(flags & kUnsorted), name,
                    " must be sorted in non-decreasing order. Sort once and reuse: "
                    "`index, perm = index.sort(stable=True); src = src[perm]` (for a PyG edge_index, "
                    "torch_geometric.utils.sort_edge_index(edge_index, sort_by_row=False) sorts by destination)");
  TORCH_CHECK_VALUE(!(flags & kNegative), name, " has negative values; they must be in [0, ", check.bound_name,
                    ")");
  TORCH_CHECK_VALUE(!(flags & kTooLarge), name, " has values >= ", check.bound_name, " (", bound,
                    "); pass a larger ", check.bound_name, " or fix ", name);
}

Config resolve_config(at::OptionalIntArrayRef override_config, const Features& features) {
  if (!override_config.has_value()) return select_config(features);
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

// Hints as levels for sorted checks; -1 where the check was not for sorted.
std::vector<int> finish_hints(std::vector<int> hints, const std::vector<IndexCheck>& checks) {
  for (size_t i = 0; i < checks.size(); ++i)
    hints[i] = !checks[i].sorted || hints[i] < 0 ? -1 : long_segment_level(hints[i]);
  return hints;
}

// The kLongSegment bits row i proves; the longer thresholds are only
// looked at once the shorter one holds.
template <typename index_t>
int long_segment_bits(const index_t* index, int64_t i, int64_t E, int64_t v) {
  int bits = 0;
  for (int k = 0; k < kLongSegmentLevels; ++k) {
    const int64_t ahead = i + kLongSegmentRows[k];
    if (ahead >= E || int64_t(index[ahead]) != v) break;
    bits |= kLongSegment << k;
  }
  return bits;
}

template <typename index_t>
int index_flags_cpu(const index_t* index, int64_t E, int64_t bound, bool sorted) {
  std::atomic<int> flags{0};
  at::parallel_for(0, E, 1 << 16, [&](int64_t begin, int64_t end) {
    int bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t v = index[i];
      bad |= (v < 0 ? kNegative : 0) | (v >= bound ? kTooLarge : 0);
      if (sorted && i + 1 < E && int64_t(index[i + 1]) < v) bad |= kUnsorted;
      if (sorted) bad |= long_segment_bits(index, i, E, v);
    }
    if (bad) flags.fetch_or(bad);
  });
  return flags.load();
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

// One element's contribution: weight[e, head] * src[gather[e], f], or src[e, f].
template <typename scalar_t, typename index_t>
struct RowReader {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* src;
  const index_t* gather;   // null: element e reads row e
  const scalar_t* weight;  // null: unscaled
  int64_t rows, F, heads, head_size;

  // Null for a gathered row out of range (possible with validation off).
  const scalar_t* row(int64_t e) const {
    const int64_t r = gather ? int64_t(gather[e]) : e;
    return r >= 0 && r < rows ? src + r * F : nullptr;
  }
  acc_t scale(int64_t e, int64_t head) const { return weight ? acc_t(weight[e * heads + head]) : acc_t(1); }

  // Calls combine(f, value) for every feature of element e, if its row exists.
  template <typename Combine>
  void for_each_value(int64_t e, const Combine& combine) const {
    const scalar_t* r = row(e);
    if (!r) return;
    for (int64_t h = 0; h < heads; ++h) {
      const acc_t w = scale(e, h);
      for (int64_t f = h * head_size; f < (h + 1) * head_size; ++f) combine(f, acc_t(r[f]) * w);
    }
  }
};

template <typename scalar_t, typename index_t>
void reduce_sorted_rows(const index_t* index, const RowReader<scalar_t, index_t>& in, scalar_t* out, int64_t E,
                        int64_t S, Reduce kind) {
  using acc_t = at::opmath_type<scalar_t>;
  const CpuReduce<acc_t> op{kind};
  const int64_t F = in.F;
  for_each_segment(index, E, S, F, [&](int64_t s, int64_t begin, int64_t end) {
    std::vector<acc_t> acc(F, op.identity());
    for (int64_t e = begin; e < end; ++e) {
      switch (kind) {
        case Reduce::Max: in.for_each_value(e, [&](int64_t f, acc_t v) { acc[f] = std::max(acc[f], v); }); break;
        case Reduce::Min: in.for_each_value(e, [&](int64_t f, acc_t v) { acc[f] = std::min(acc[f], v); }); break;
        default: in.for_each_value(e, [&](int64_t f, acc_t v) { acc[f] += v; });
      }
    }
    for (int64_t f = 0; f < F; ++f) out[s * F + f] = scalar_t(op.finish(acc[f], end - begin));
  });
}

// Sum into segments in any order: parallel over feature slices so no two
// tasks write the same output element.
template <typename scalar_t, typename index_t>
void scatter_sum_rows(const index_t* index, const RowReader<scalar_t, index_t>& in, scalar_t* out, int64_t E,
                      int64_t S) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t F = in.F;
  std::vector<acc_t> acc(S * F, acc_t(0));
  at::parallel_for(0, F, std::max<int64_t>(1, F / at::get_num_threads()), [&](int64_t f_begin, int64_t f_end) {
    for (int64_t e = 0; e < E; ++e) {
      const scalar_t* row = in.row(e);
      const int64_t s = index[e];
      if (!row || s < 0 || s >= S) continue;
      acc_t* dst = acc.data() + s * F;
      for (int64_t f = f_begin; f < f_end; ++f) dst[f] += acc_t(row[f]) * in.scale(e, f / in.head_size);
    }
  });
  for (int64_t i = 0; i < S * F; ++i) out[i] = scalar_t(acc[i]);
}

}  // namespace

std::vector<int> validate_indices(const std::vector<IndexCheck>& checks) {
  std::vector<int> hints(checks.size(), -1);
  if (!validation_enabled()) return hints;
  std::vector<const IndexCheck*> pending;
  std::vector<size_t> pending_at;
  for (size_t i = 0; i < checks.size(); ++i) {
    const IndexCheck& c = checks[i];
    const int known = c.index.numel() > 0 ? known_index_flags(c.index, c.bound, c.sorted) : 0;
    if (known >= 0) {
      hints[i] = known;
    } else {
      pending.push_back(&c);
      pending_at.push_back(i);
    }
  }
  if (pending.empty()) return finish_hints(hints, checks);
  std::vector<int> flags(pending.size(), 0);
  if (pending.front()->index.is_cuda()) {
#ifdef GEOT_WITH_CUDA
    if (capturing_cuda_graph()) return finish_hints(hints, checks);
    const c10::DeviceGuard guard(pending.front()->index.device());
    at::Tensor device_flags = at::zeros({int64_t(pending.size())}, pending.front()->index.options().dtype(at::kInt));
    for (size_t i = 0; i < pending.size(); ++i)
      index_flags_cuda(pending[i]->index, pending[i]->bound, pending[i]->sorted, device_flags.data_ptr<int>() + i);
    const at::Tensor host_flags = device_flags.cpu();  // the one sync
    std::copy_n(host_flags.data_ptr<int>(), pending.size(), flags.begin());
#endif
  } else {
    for (size_t i = 0; i < pending.size(); ++i) {
      const at::Tensor idx = pending[i]->index.contiguous();
      AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "geot_index_flags_cpu", [&] {
        flags[i] = index_flags_cpu(idx.data_ptr<index_t>(), idx.numel(), pending[i]->bound, pending[i]->sorted);
      });
    }
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    raise_index_errors(flags[i], *pending[i]);
    remember_valid_index(pending[i]->index, pending[i]->bound, pending[i]->sorted, flags[i]);
    hints[pending_at[i]] = flags[i] & kLongSegmentBits;
  }
  return finish_hints(hints, checks);
}

at::Tensor reduce_rows_cpu(const RowReduction& r) {
  const int64_t E = r.index.numel(), F = r.src.size(1), S = r.num_segments;
  at::Tensor out = at::empty({S, F}, r.src.options());
  if (S == 0 || F == 0) return out;
  AT_DISPATCH_INDEX_TYPES(r.index.scalar_type(), "geot_reduce_rows_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.src.scalar_type(), "geot_reduce_rows_cpu", [&] {
      const RowReader<scalar_t, index_t> in{r.src.data_ptr<scalar_t>(),
                                            r.gather ? r.gather->data_ptr<index_t>() : nullptr,
                                            r.weight ? r.weight->data_ptr<scalar_t>() : nullptr, r.src.size(0), F, r.heads,
                                            F / r.heads};
      if (r.any_order) {
        scatter_sum_rows(r.index.data_ptr<index_t>(), in, out.data_ptr<scalar_t>(), E, S);
      } else {
        reduce_sorted_rows(r.index.data_ptr<index_t>(), in, out.data_ptr<scalar_t>(), E, S, r.reduce);
      }
    });
  });
  if (r.self_scale) out.addcmul_(r.src, self_factor(r));
  return out;
}

at::Tensor reduce_rows(const RowReduction& r) {
#ifdef GEOT_WITH_CUDA
  if (r.src.is_cuda()) return reduce_rows_cuda(r);
#endif
  return reduce_rows_cpu(r);
}

at::Tensor segment_reduce_op(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                             c10::string_view reduce_name, at::OptionalIntArrayRef config) {
  check_segment_inputs(index, src, num_segments);
  RowReduction r;
  r.reduce = parse_reduce(reduce_name);
  r.long_segments = validate_indices({{index, num_segments, true, "index", "num_segments"}})[0];
  r.index = index.contiguous();
  r.src = as_rows(src);
  r.num_segments = num_segments;
  r.config = config;  // ignored on CPU
  return shaped_like_rows_of(reduce_rows(r), src);
}

// out[e] = values[index[e]] over the leading dimension, an index already
// checked (with validation off, ids outside [0, values.size(0)) read 0 rows).
static at::Tensor gather_checked_rows(const at::Tensor& values, const at::Tensor& index) {
  std::vector<int64_t> sizes = values.sizes().vec();
  sizes[0] = index.size(0);
#ifdef GEOT_WITH_CUDA
  if (values.is_cuda()) {
    at::Tensor out = at::empty(sizes, values.options());
    if (out.numel() == 0) return out;
    at::Tensor out_rows = out.view({index.size(0), out.numel() / index.size(0)});
    gather_rows_cuda(as_rows(values), index.contiguous(), out_rows);
    return out;
  }
#endif
  if (validation_enabled()) return values.index_select(0, index);
  const at::Tensor invalid = (index < 0) | (index >= values.size(0));
  std::vector<int64_t> mask_shape(values.dim(), 1);
  mask_shape[0] = index.size(0);
  return values.index_select(0, index.masked_fill(invalid, 0)).masked_fill_(invalid.view(mask_shape), 0);
}

static at::Tensor gather_rows_of(const at::Tensor& values, const at::Tensor& index, bool sorted) {
  check_index_tensor(index, "index");
  TORCH_CHECK_TYPE(at::isFloatingType(values.scalar_type()),
                   "values must be a float32, float16, bfloat16 or float64 tensor, got ", values.scalar_type());
  TORCH_CHECK_VALUE(values.dim() >= 1, "values must have at least one dimension (rows), got a 0-d tensor");
  check_same_device(index, "index", values, "values");
  validate_indices({{index, values.size(0), sorted, "index", "values.size(0)"}});
  return gather_checked_rows(values, index);
}

at::Tensor segment_broadcast_op(const at::Tensor& values, const at::Tensor& index) {
  return gather_rows_of(values, index, true);
}

at::Tensor gather_rows_op(const at::Tensor& values, const at::Tensor& index) {
  return gather_rows_of(values, index, false);
}

TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("segment_reduce", &segment_reduce_op);
  m.impl("segment_broadcast", &segment_broadcast_op);
  m.impl("gather_rows", &gather_rows_op);
}

}  // namespace geot
