// Autograd nodes in C++ for eager calls that record a gradient (geot.nn's
// layers, the public ops' sums and means): one pybind call where a Python
// autograd.Function cost several plain ops of host time (host time is what
// small graphs' steps cost).
// Their gradients are the registered ops' formulas (geot/_ops.py), and they
// are twice differentiable: under create_graph the backward calls the ops
// through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace geot {

// out[dst[e]] += weight[e] * x[src[e]], edges in any order (atomics on CUDA),
// divided by each row's edge count (any_order_counts) for a mean; weight
// [E] or [E, heads], or none: geot.nn's graphs of one step. Its adjoint is
// the same scatter the other way.
at::Tensor any_order_reduce(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, int64_t num_out, bool mean);

// index_segment_reduce's sum or mean (dst sorted), as torch.ops.geot.index_segment_reduce
// computes it: geot.nn's kept graphs. t_perm, t_src, t_dst: the transposed index
// (the backward's sum over edges grouped by source; without it, atomics in
// edge order). counts ([num_segments], at least 1) and weight_t (weight in
// transposed order) are per-graph values the caller keeps; either may be
// absent (then the backward computes it).
at::Tensor sorted_reduce(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& x,
                         const std::optional<at::Tensor>& weight, int64_t num_segments, bool mean,
                         const std::optional<std::vector<int64_t>>& config, const std::optional<at::Tensor>& t_perm,
                         const std::optional<at::Tensor>& t_src, const std::optional<at::Tensor>& t_dst,
                         const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& weight_t);

}  // namespace geot
