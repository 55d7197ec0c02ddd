// Typed (segment) matmul: argument checks, ptr validation, the operator
// entries shared by CPU and CUDA, and the CPU kernels (one at::mm per type:
// every type is a dense GEMM, which the CPU BLAS already does well).
#include "segment_matmul.h"

#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "segment_reduce.h"
#include "uninitialized.h"

namespace geot {

namespace {

void check_rows(const at::Tensor& t, const char* name, const char* shape) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name,
                   " must be a float32, float16, bfloat16 or float64 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D ", shape, ", got shape ", shape_string(t.sizes()));
}

// ptr: [T + 1] int64 on the device of `a`. Returns T.
int64_t check_ptr(const at::Tensor& ptr, const at::Tensor& a, const char* a_name) {
  TORCH_CHECK_TYPE(ptr.scalar_type() == at::kLong, "ptr must be an int64 tensor, got ", ptr.scalar_type());
  TORCH_CHECK_VALUE(ptr.dim() == 1 && ptr.numel() >= 1,
                    "ptr must be 1-D with T + 1 >= 1 offsets (ptr[t]:ptr[t+1] are the rows of type t), got shape ",
                    shape_string(ptr.sizes()));
  check_same_device(ptr, "ptr", a, a_name);
  return ptr.numel() - 1;
}

// weight [T, K, N] with the dtype and device of `a`, T matching ptr.
void check_weight(const at::Tensor& weight, int64_t T, const at::Tensor& a, const char* a_name) {
  TORCH_CHECK_TYPE(weight.scalar_type() == a.scalar_type(), "weight must have the dtype of ", a_name, " (",
                   a.scalar_type(), "), got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.dim() == 3, "weight must be 3-D [T, K, N], got shape ", shape_string(weight.sizes()));
  TORCH_CHECK_VALUE(weight.size(0) == T, "weight.size(0) must be the number of types T = ptr.numel() - 1 = ",
                    std::to_string(T), ", got weight of shape ", shape_string(weight.sizes()));
  check_same_device(weight, "weight", a, a_name);
}

int offsets_flags_cpu(const int64_t* ptr, int64_t n, int64_t total) {
  int flags = ptr[0] != 0 ? kNotFromZero : 0;
  for (int64_t i = 0; i + 1 < n; ++i)
    if (ptr[i + 1] < ptr[i]) flags |= kDecreasing;
  return flags | (ptr[n - 1] != total ? kNotToTotal : 0);
}

void raise_offsets_errors(int flags, int64_t total) {
  TORCH_CHECK_VALUE(!(flags & kDecreasing),
                    "ptr must be non-decreasing: rows of type t are ptr[t]:ptr[t+1] (an empty type repeats an "
                    "offset). Group the rows by type first, e.g. `perm, ptr = geot.group_by_type(types); x = x[perm]`");
  TORCH_CHECK_VALUE(!(flags & kNotFromZero), "ptr must start at 0 (ptr[0] == 0)");
  TORCH_CHECK_VALUE(!(flags & kNotToTotal), "ptr must end at the number of rows, x.size(0) = ", std::to_string(total),
                    " (ptr[-1] == x.size(0))");
}

// Like validate_indices: when validation is on, checks a ptr the cache does
// not know yet (one device->host sync on CUDA) and remembers it.
void validate_offsets(const at::Tensor& ptr, int64_t total) {
  if (!validation_enabled() || offsets_known_valid(ptr, total)) return;
  const at::Tensor p = ptr.contiguous();
  int flags = 0;
  if (p.is_cuda()) {
#ifdef GEOT_WITH_CUDA
    if (capturing_cuda_graph()) return;  // unvalidated, as in validate_indices
    const c10::DeviceGuard guard(p.device());
    at::Tensor device_flags = at::zeros({1}, p.options().dtype(at::kInt));
    offsets_flags_cuda(p, total, device_flags.data_ptr<int>());
    flags = device_flags.item<int>();  // the one sync
#endif
  } else {
    flags = offsets_flags_cpu(p.data_ptr<int64_t>(), p.numel(), total);
  }
  raise_offsets_errors(flags, total);
  remember_valid_offsets(ptr, total);
}

// Rows of type t, clamped into [0, M] so that a bad ptr (validation off) can
// give a wrong result but never an out-of-bounds access.
std::pair<int64_t, int64_t> type_rows(const int64_t* ptr, int64_t t, int64_t M) {
  const int64_t begin = std::clamp<int64_t>(ptr[t], 0, M);
  return {begin, std::clamp<int64_t>(ptr[t + 1], begin, M)};
}

bool reduced_precision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// fp16/bf16 run in fp32 on CPU (fp32 accumulation, as on CUDA).
at::Tensor compute_type(const at::Tensor& t) { return reduced_precision(t) ? t.to(at::kFloat) : t; }

// A bad ptr (validation off) may leave rows uncovered: start from zeros then.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return validation_enabled() ? uninitialized(sizes, options) : at::zeros(sizes, options);
}

// The entry of segment_matmul and its transposed form: a [M, A] against
// weight [T, K, N] with A = K (or A = N, transposed).
at::Tensor segment_matmul_entry(const at::Tensor& a, const char* a_name, const at::Tensor& ptr,
                                const at::Tensor& weight, bool transpose_weight) {
  check_rows(a, a_name, transpose_weight ? "[M, N]" : "[M, K]");
  const int64_t T = check_ptr(ptr, a, a_name);
  check_weight(weight, T, a, a_name);
  const int64_t inner = weight.size(transpose_weight ? 2 : 1), cols = weight.size(transpose_weight ? 1 : 2);
  TORCH_CHECK_VALUE(a.size(1) == inner, a_name, ".size(1) must be weight.size(", transpose_weight ? "2" : "1",
                    ") (", std::to_string(inner), "), got ", a_name, " of shape ", shape_string(a.sizes()),
                    " and weight of shape ", shape_string(weight.sizes()));
  validate_offsets(ptr, a.size(0));
  at::Tensor out = new_output({a.size(0), cols}, a.options());
  if (out.numel() == 0) return out;
  const at::Tensor a_c = a.contiguous(), p = ptr.contiguous(), w = weight.contiguous();
#ifdef GEOT_WITH_CUDA
  if (a.is_cuda()) {
    segment_matmul_cuda(a_c, p, w, transpose_weight, out);
    return out;
  }
#endif
  segment_matmul_cpu(a_c, p, w, transpose_weight, out);
  return out;
}

}  // namespace

at::Tensor segment_matmul_op(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& weight) {
  return segment_matmul_entry(x, "x", ptr, weight, false);
}

at::Tensor segment_matmul_transposed_op(const at::Tensor& grad, const at::Tensor& ptr, const at::Tensor& weight) {
  return segment_matmul_entry(grad, "grad", ptr, weight, true);
}

at::Tensor segment_matmul_weight_grad_op(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad) {
  check_rows(x, "x", "[M, K]");
  check_rows(grad, "grad", "[M, N]");
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), "grad must have the dtype of x (", x.scalar_type(),
                   "), got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.size(0) == x.size(0), "x and grad must have the same rows, got shapes ",
                    shape_string(x.sizes()), " and ", shape_string(grad.sizes()));
  check_same_device(grad, "grad", x, "x");
  const int64_t T = check_ptr(ptr, x, "x");
  validate_offsets(ptr, x.size(0));
  at::Tensor out = at::empty({T, x.size(1), grad.size(1)}, x.options());
  if (out.numel() == 0) return out;
  const at::Tensor x_c = x.contiguous(), p = ptr.contiguous(), g = grad.contiguous();
#ifdef GEOT_WITH_CUDA
  if (x.is_cuda()) {
    segment_matmul_weight_grad_cuda(x_c, p, g, out);
    return out;
  }
#endif
  segment_matmul_weight_grad_cpu(x_c, p, g, out);
  return out;
}

void segment_matmul_cpu(const at::Tensor& a, const at::Tensor& ptr, const at::Tensor& weight, bool transpose_weight,
                        at::Tensor& out) {
  const int64_t M = a.size(0);
  const int64_t* p = ptr.data_ptr<int64_t>();
  const at::Tensor a_c = compute_type(a), w_c = compute_type(weight);
  at::Tensor out_c = reduced_precision(out) ? at::empty(out.sizes(), out.options().dtype(at::kFloat)) : out;
  // Sequential over types: at::mm parallelizes each product itself.
  for (int64_t t = 0; t < weight.size(0); ++t) {
    const auto [begin, end] = type_rows(p, t, M);
    if (end == begin) continue;
    at::Tensor rows = out_c.narrow(0, begin, end - begin);
    const at::Tensor w = transpose_weight ? w_c[t].t() : w_c[t];
    at::mm_out(rows, a_c.narrow(0, begin, end - begin), w);
  }
  if (out_c.data_ptr() != out.data_ptr()) out.copy_(out_c);
}

void segment_matmul_weight_grad_cpu(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& grad,
                                    at::Tensor& out) {
  const int64_t M = x.size(0);
  const int64_t* p = ptr.data_ptr<int64_t>();
  const at::Tensor x_c = compute_type(x), g_c = compute_type(grad);
  at::Tensor out_c = reduced_precision(out) ? at::empty(out.sizes(), out.options().dtype(at::kFloat)) : out;
  out_c.zero_();  // empty types
  for (int64_t t = 0; t < out.size(0); ++t) {
    const auto [begin, end] = type_rows(p, t, M);
    if (end == begin) continue;
    at::Tensor w = out_c[t];
    at::mm_out(w, x_c.narrow(0, begin, end - begin).t(), g_c.narrow(0, begin, end - begin));
  }
  if (out_c.data_ptr() != out.data_ptr()) out.copy_(out_c);
}

TORCH_LIBRARY_IMPL(geot, CPU, m) {
  m.impl("segment_matmul", &segment_matmul_op);
  m.impl("segment_matmul_transposed", &segment_matmul_transposed_op);
  m.impl("segment_matmul_weight_grad", &segment_matmul_weight_grad_op);
}

}  // namespace geot
