// Operator schemas (torch.ops.geot.*) and the Python module geot._C.
// Implementations register per device in segment_reduce_cpu.cpp,
// index_segment_reduce.cpp, segment_matmul.cpp, edge_softmax.cpp, attention.cpp and the .cu
// files; fake kernels and autograd formulas are Python (geot/_ops.py), the
// latter reached through python_autograd.cpp's Autograd kernel.
#include <torch/extension.h>
#include <torch/library.h>

#include <chrono>

#include "build_info.h"
#include "config.h"
#include "eager_autograd.h"
#include "index_cache.h"
#include "index_segment_reduce.h"
#include "launch_rules.h"
#include "python_autograd.h"
#include "rules.h"
#include "segment_reduce.h"
#include "unordered_graph.h"

TORCH_LIBRARY(geot, m) {
  // Output row counts are SymInt: compiled code with dynamic shapes (a new
  // graph every step) passes them symbolically instead of recompiling per size.
  m.def("segment_reduce(Tensor index, Tensor src, SymInt num_segments, str reduce=\"sum\", int[]? config=None) -> Tensor");
  // out[e] = values[index[e]], index sorted: a segment sum's adjoint.
  m.def("segment_broadcast(Tensor values, Tensor index) -> Tensor");
  // out[e] = values[index[e]], any order (torch's gather of short rows, e.g.
  // attention scores [N, H], ran at ~50 GB/s on an H100).
  m.def("gather_rows(Tensor values, Tensor index) -> Tensor");
  // Fused gather + segment reduce; t_perm / t_src / t_dst: an optional
  // transposed index (geot.TransposedIndex) that the backward pass reuses.
  m.def(
      "index_segment_reduce(Tensor src_index, Tensor dst_index, Tensor x, Tensor? weight, SymInt num_segments, "
      "str reduce=\"sum\", int[]? config=None, Tensor? t_perm=None, Tensor? t_src=None, Tensor? t_dst=None) "
      "-> Tensor");
  // out[scatter_index[e]] += weight[e] * x[gather_index[e]], any order.
  m.def("index_scatter_sum(Tensor gather_index, Tensor scatter_index, Tensor x, Tensor? weight, SymInt num_out) -> Tensor");
  // The max/min gradient of index_segment_reduce (no weight) with respect to x.
  m.def("extremum_grad(Tensor src_index, Tensor dst_index, Tensor x, Tensor extremum, Tensor grad_out) -> Tensor");
  // out[e, h] = <a[dst_index[e], h], b[src_index[e], h]> (SDDMM).
  m.def("edge_dot(Tensor src_index, Tensor dst_index, Tensor a, Tensor b, int heads) -> Tensor");
  // out[e, h] = att[h] . leaky_relu(a[dst_index[e], h] + b[src_index[e], h]) (GATv2's scores).
  m.def("edge_additive_score(Tensor src_index, Tensor dst_index, Tensor a, Tensor b, Tensor att, "
        "float negative_slope, int heads) -> Tensor");
  // Typed matmul (segment_matmul.cpp): rows ptr[t]:ptr[t+1] of x times
  // weight[t]; its gradients grad_t @ weight[t]^T and x_t^T @ grad_t.
  m.def("segment_matmul(Tensor x, Tensor ptr, Tensor weight) -> Tensor");
  m.def("segment_matmul_transposed(Tensor grad, Tensor ptr, Tensor weight) -> Tensor");
  m.def("segment_matmul_weight_grad(Tensor x, Tensor ptr, Tensor grad) -> Tensor");
  // Softmax over the edges of each destination (edge_softmax.cpp); the
  // backward takes the forward output y.
  m.def("edge_softmax(Tensor score, Tensor dst_index, SymInt num_segments) -> Tensor");
  // The same written over score (inference: no second [E, H] tensor).
  m.def("edge_softmax_(Tensor(a!) score, Tensor dst_index, SymInt num_segments) -> ()");
  m.def("edge_softmax_backward(Tensor y, Tensor grad, Tensor dst_index, SymInt num_segments) -> Tensor");
  // GAT's softmax and weighted sum in one pass, no [E, H] tensor (attention.cpp);
  // no gradient: inference only.
  m.def(
      "attention_aggregate(Tensor x, Tensor? score_src, Tensor? score_dst, Tensor src_index, Tensor dst_index, "
      "SymInt num_segments, float negative_slope, bool self_loops, Tensor? att_src=None, Tensor? att_dst=None) -> Tensor");
  // Ops of geot.nn inference (no gradients), each one where two would cost
  // more. GIN's aggregation (index_segment_reduce.cpp): (scale + scale_offset)
  // * x + the sum of x[src_index] into dst_index's segments, one per row of x;
  // on CUDA one pass (a second, an addcmul, took 13-20% of GIN inference's
  // kernel time on a 3.2M-edge graph, H100). Compiled as two ops, inductor
  // gave the sum a copy of a computed x (relu(h)) and computed x again from h
  // for the scaled term: h, the copy and the sum alive at once (peak memory).
  // scale_offset: GIN passes eps and 1, so 1 + eps is no kernel of its own.
  m.def("index_sum_plus_scaled(Tensor src_index, Tensor dst_index, Tensor x, Tensor scale, int[]? config=None, "
        "float scale_offset=0.) -> Tensor");
  // SAGE's two projections of one cast copy of x: (x weight^T, x
  // other_weight^T + other_bias). As two matmuls, inductor ran the second
  // after the aggregation that reads the first (its output can then take the
  // first's memory), keeping the copy alive on top of the aggregation's own
  // buffers, which it does not see.
  m.def("linear_pair(Tensor x, Tensor weight, Tensor other_weight, Tensor? other_bias) -> (Tensor, Tensor)");
}

namespace geot {
namespace {

std::tuple<at::Tensor, at::Tensor> linear_pair(const at::Tensor& x, const at::Tensor& weight,
                                               const at::Tensor& other_weight,
                                               const std::optional<at::Tensor>& other_bias) {
  return {at::linear(x, weight), at::linear(x, other_weight, other_bias)};
}

}  // namespace
}  // namespace geot

// Device-agnostic: the same functions for each device.
TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("linear_pair", &geot::linear_pair);
}
#ifdef GEOT_WITH_CUDA
TORCH_LIBRARY_IMPL(geot, CUDA, m) {
  m.impl("linear_pair", &geot::linear_pair);
}
#endif

namespace {

// Bad input leaves as pybind11's own exception types (ValueError,
// TypeError), which pybind11 translates itself, whatever torch version the
// module was built against.
template <typename Call>
at::Tensor with_python_errors(const Call& call) {
  try {
    return call();
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

// Calls an op below the autograd layer: the Python-registered autograd
// kernel costs several microseconds per call, too much for small graphs, and
// calls that need no gradient can skip it.
template <typename Call>
at::Tensor below_autograd(const Call& call) {
  const at::AutoDispatchBelowADInplaceOrView guard;
  return with_python_errors(call);
}

at::OptionalIntArrayRef as_config(const std::optional<std::vector<int64_t>>& config) {
  return config ? at::OptionalIntArrayRef(*config) : at::OptionalIntArrayRef();
}

at::Tensor segment_reduce_no_grad(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                                  const std::string& reduce, std::optional<std::vector<int64_t>> config) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::segment_reduce", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, c10::string_view,
                                               at::OptionalIntArrayRef)>();
  return below_autograd([&] { return op.call(index, src, num_segments, reduce, as_config(config)); });
}

at::Tensor index_segment_reduce_no_grad(const at::Tensor& src_index, const at::Tensor& dst_index,
                                        const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                        int64_t num_segments, const std::string& reduce,
                                        std::optional<std::vector<int64_t>> config) {
  using Optional = const std::optional<at::Tensor>&;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("geot::index_segment_reduce", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, Optional, int64_t,
                            c10::string_view, at::OptionalIntArrayRef, Optional, Optional, Optional)>();
  return below_autograd([&] {
    return op.call(src_index, dst_index, x, weight, num_segments, reduce, as_config(config), std::nullopt,
                   std::nullopt, std::nullopt);
  });
}

pybind11::tuple config_tuple(const geot::Config& c) {
  return pybind11::make_tuple(c.N_t, c.T_N, c.M_t, c.T_M, c.G_t);
}

// Host time of the selection a kernel call makes (features, then learned
// rules or heuristic), in ns per call, averaged over n calls; the rule set
// is chosen before, as a device's is once (device_rules).
double selection_cost_ns(int64_t E, int64_t S, int64_t F, bool gathered, int long_segments, int arch, int64_t n) {
  if (n < 1) throw pybind11::value_error("n must be >= 1, got " + std::to_string(n));
  const int rules = geot::choose_rules("", arch).index;
  int sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    // E varies so the compiler cannot hoist the call out of the loop.
    const auto f = geot::make_features(E + (i & 1), S, F, gathered, long_segments, rules);
    sink += geot::resolve_config(at::OptionalIntArrayRef(), f).M_t;
  }
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  volatile int keep = sink;
  (void)keep;
  return elapsed.count() / double(n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "geot kernels; the operators live in torch.ops.geot";
  m.def("segment_reduce_no_grad", &segment_reduce_no_grad, "segment_reduce without autograd (fast path)");
  m.def("index_segment_reduce_no_grad", &index_segment_reduce_no_grad,
        "index_segment_reduce without autograd (fast path)");
  m.def("set_python_autograd", &geot::set_python_autograd,
        "Registers the Python autograd formula of torch.ops.geot.<op_name> (calls that record a gradient)");
  m.def("python_autograd_ops", [] {
    return std::vector<std::string>(std::begin(geot::kPythonAutogradOps), std::end(geot::kPythonAutogradOps));
  }, "The ops whose autograd formulas are Python");
  m.def("set_validation", &geot::set_validation, "Turn index value validation on or off");
  m.def("validation_enabled", &geot::validation_enabled);
  m.def("deterministic_algorithms", [] { return at::globalContext().deterministicAlgorithms(); },
        "The flag the CUDA dispatch reads per call to pick the deterministic schedules (tests)");
  m.def("clear_segment_offsets", &geot::clear_segment_offsets,
        "Free the cached segment offsets of sorted indices (CUDA memory)");
  m.def("segment_offsets_cached", &geot::segment_offsets_cached, "Cached segment offsets held (tests)");
  m.def("mark_static_index", &geot::mark_static_index,
        "Declare an index's values fixed while CUDA graphs reading it replay (captures may read its cached offsets)");
  m.def("is_static_index", &geot::is_static_index, "Whether an index is declared static (tests)");
  m.def("vouch_index", [](const at::Tensor& index, int64_t bound, bool sorted) {
        // As validated, its segments assumed as long as any (the conservative configs): the caller checks
        // the values itself, without a sync (geot.nn's deferred checks).
        geot::remember_valid_index(index, bound, sorted, geot::kLongSegmentBits);
      },
      "Record an index as valid for bound (and sorted): its calls skip validation");
  m.def("deferred_index_check", &geot::deferred_index_check,
        "Vouch for a graph's CUDA indices and queue a check of their ids without a sync; returns its ticket");
  m.def("take_failed_check", &geot::take_failed_check,
        "The ticket of a failed deferred_index_check seen since the last call, 0 if none");
  m.def("any_order_counts", &geot::any_order_counts, "Rows per segment of an index in any order, at least 1, in float64 or float32 (a mean's divisor)");
  m.def("any_order_reduce", &geot::any_order_reduce,
        "Sum (or mean) of weight * x[src] into dst, edges in any order, with its autograd node",
        pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("num_out"), pybind11::arg("mean"));
  m.def("sorted_reduce", [](const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, int64_t num_segments, bool mean,
                            const std::optional<std::vector<int64_t>>& config, const std::optional<at::Tensor>& t_perm,
                            const std::optional<at::Tensor>& t_src, const std::optional<at::Tensor>& t_dst,
                            const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& weight_t) {
        return with_python_errors([&] {
          return geot::sorted_reduce(src, dst, x, weight, num_segments, mean, config, t_perm, t_src, t_dst, counts,
                                     weight_t);
        });
      },
      "index_segment_reduce's sum or mean (dst sorted) with its autograd node",
      pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("x"), pybind11::arg("weight"),
      pybind11::arg("num_segments"), pybind11::arg("mean"), pybind11::arg("config"), pybind11::arg("t_perm"),
      pybind11::arg("t_src"), pybind11::arg("t_dst"), pybind11::arg("counts"), pybind11::arg("weight_t"));
#ifdef GEOT_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.def(
      "heuristic_config",
      [](int64_t E, int64_t S, int64_t F, bool gathered, int long_segments) {
        return config_tuple(geot::heuristic_config(geot::make_features(E, S, F, gathered, long_segments, 0)));
      },
      "The hand-written heuristic's config for (E, num_segments, F, gathered, long_segments)");
  m.def(
      "select_config",
      [](int64_t E, int64_t S, int64_t F, bool gathered, int long_segments, int arch, const std::string& gpu) {
        const geot::RuleChoice choice = geot::choose_rules(gpu, arch);
        const auto f = geot::make_features(E, S, F, gathered, long_segments, choice.index);
        return pybind11::make_tuple(config_tuple(geot::select_config(f)), geot::config_source(f, choice));
      },
      "(config, source) a sorted reduction picks for (E, num_segments, F, gathered, long_segments, arch, "
      "GPU name or slug, '' for none)");
  m.def(
      "launch_config",
      [](int64_t E, int64_t S, int64_t F, bool gathered, int long_segments, int arch, const std::string& gpu,
         bool half, int64_t heads, const std::string& reduce, bool det) {
        const geot::RuleChoice choice = geot::choose_rules(gpu, arch);
        const auto f = geot::make_features(E, S, F, gathered, long_segments, choice.index);
        const geot::LaunchCase call{E, S, F, gathered, half, heads, geot::parse_reduce(reduce), false, false,
                                    long_segments, det};
        const geot::Config rules = geot::select_config(f);
        std::string source = geot::config_source(f, choice);
        if (const char* rule = geot::launch_rule(call, rules)) source += std::string("; then ") + rule;
        return pybind11::make_tuple(config_tuple(geot::launch_config(call, rules)), source);
      },
      "(config, source) a sorted CUDA reduction launches for (E, num_segments, F, gathered, long_segments, arch, "
      "GPU name or slug, half rows, weight heads, reduce, deterministic): the rules' config, then the hand rules");
  m.def(
      "nearest_arch",
      [](int arch, const std::vector<int>& known) {
        return geot::nearest_arch(arch, known.data(), static_cast<int>(known.size()));
      },
      "Index in `known` of the rules used for arch (exact, else nearest of the same major), -1 if none");
  m.def("device_slug", &geot::device_slug, "'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'");
  m.def("learned_archs", &geot::learned_archs, "Architectures (major * 10 + minor) with a fallback rule set");
  m.def(
      "learned_rule_sets",
      [] {
        pybind11::list sets;
        for (const auto& r : geot::learned_rule_sets())
          sets.append(pybind11::make_tuple(r.slug, r.device, r.arch, r.source, r.plain, r.gathered, r.arch_fallback));
        return sets;
      },
      "(slug, device, arch, perf DB, has plain-row rules, has gathered-row rules, is its architecture's fallback) "
      "of each compiled-in rule set");
  m.def(
      "build_info",
      [] {
        pybind11::dict info;
        info["torch"] = TORCH_VERSION;
#ifdef GEOT_WITH_CUDA
        const int cuda = geot::cuda_toolkit_version();
        info["cuda"] = std::to_string(cuda / 1000) + "." + std::to_string(cuda % 1000 / 10);
        info["cuda_arch_list"] = geot::cuda_arch_list();
#else
        info["cuda"] = pybind11::none();
        info["cuda_arch_list"] = "";
#endif
        return info;
      },
      "torch version the extension was compiled against, CUDA toolkit version and __CUDA_ARCH_LIST__ "
      "(None and '' in a CPU-only build)");
  m.def("set_rules", &geot::set_rules,
        "'learned' (default: each GPU's own rules), 'heuristic' or a rule set's slug: force that everywhere");
  m.def("rules_mode", &geot::rules_mode);
  m.def("selection_cost_ns", &selection_cost_ns,
        "ns per call of the config selection for (E, num_segments, F, gathered, long_segments, arch, n)");
  m.attr("long_segment_rows") = std::vector<int64_t>(geot::kLongSegmentRows,
                                                      geot::kLongSegmentRows + geot::kLongSegmentLevels);
  m.def(
      "long_segment_level",
      [](const at::Tensor& index, int64_t num_segments) {
        return geot::validate_indices({{index, num_segments, true, "index", "num_segments"}})[0];
      },
      "Validates a sorted index (when validation is on) and returns how many of the long-segment "
      "thresholds (64, 1024, 16384 rows) some segment exceeds; -1 when validation is off");
  m.def("check_config", [](int N_t, int T_N, int M_t, int T_M, int G_t) {
    geot::check_config({N_t, T_N, M_t, T_M, G_t});
  });
}
