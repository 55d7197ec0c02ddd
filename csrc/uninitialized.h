// Output and scratch tensors that geot's kernels overwrite whole.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#ifdef GEOT_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#endif

namespace geot {

// An uninitialized tensor, as at::empty makes one, minus the NaN fill that
// at::empty adds under torch.use_deterministic_algorithms
// (fill_uninitialized_memory): a pass over every buffer that the kernels
// then overwrite anyway, the largest part of the deterministic mode's cost
// on small graphs. Only for tensors whose every element a kernel writes.
inline at::Tensor uninitialized(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef GEOT_WITH_CUDA
  if (options.device().is_cuda()) return at::detail::empty_cuda(sizes, options);
#endif
  if (options.device().is_cpu()) return at::detail::empty_cpu(sizes, options);
  return at::empty(sizes, options);
}

}  // namespace geot
