// Operator schemas (torch.ops.geot.*) and the Python module geot._C.
// Implementations register per device in segment_reduce_cpu.cpp and
// segment_reduce_cuda.cu; autograd and fake kernels are registered from
// Python (geot/_ops.py).
#include <torch/extension.h>
#include <torch/library.h>

#include "config.h"
#include "segment_reduce.h"

TORCH_LIBRARY(geot, m) {
  m.def("segment_reduce(Tensor index, Tensor src, int num_segments, str reduce=\"sum\", int[]? config=None) -> Tensor");
  // For max/min backward: [S, F] int64, the smallest row of each segment that
  // holds the extremum per feature, E where the segment is empty.
  m.def("segment_arg(Tensor index, Tensor src, Tensor out) -> Tensor");
}

namespace {

// The op below the autograd layer: the Python-registered autograd kernel
// costs several microseconds per call, too much for small graphs, and calls
// that need no gradient can skip it.
at::Tensor segment_reduce_no_grad(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                                  const std::string& reduce, std::optional<std::vector<int64_t>> config) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("geot::segment_reduce", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, c10::string_view,
                                               at::OptionalIntArrayRef)>();
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  // Bad input leaves as pybind11's own exception types, which pybind11
  // translates itself, whatever torch version the module was built against.
  try {
    return op.call(index, src, num_segments, reduce,
                   config ? at::OptionalIntArrayRef(*config) : at::OptionalIntArrayRef());
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

pybind11::tuple config_tuple(const geot::Config& c) {
  return pybind11::make_tuple(c.N_t, c.T_N, c.M_t, c.T_M, c.G_t);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "geot kernels; the operators live in torch.ops.geot";
  m.def("segment_reduce_no_grad", &segment_reduce_no_grad, "segment_reduce without autograd (fast path)");
  m.def("set_validation", &geot::set_validation, "Turn index value validation on or off");
  m.def("validation_enabled", &geot::validation_enabled);
#ifdef GEOT_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.def(
      "heuristic_config",
      [](int64_t E, int64_t S, int64_t F) { return config_tuple(geot::heuristic_config(geot::make_features(E, S, F))); },
      "The hand-written heuristic's config for (E, num_segments, F)");
  m.def("check_config", [](int N_t, int T_N, int M_t, int T_M, int G_t) {
    geot::check_config({N_t, T_N, M_t, T_M, G_t});
  });
}
