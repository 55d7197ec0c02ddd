// segment_reduce: entry points of the CPU and CUDA implementations and the
// argument checks they share.
#pragma once

#include <ATen/ATen.h>

#include "config.h"

namespace geot {

// Index value validation (sorted, in range). On by default; costs one pass
// over the index and, on CUDA, a device->host sync. Toggled from Python.
bool validation_enabled();
void set_validation(bool on);

Reduce parse_reduce(c10::string_view reduce);

// Error messages format numbers with std::to_string, never by streaming them:
// with some torch builds (2.11 wheels with a newer host compiler) inserting an
// integer into an ostream from this library crashes in libstdc++'s locale code.
std::string shape_string(at::IntArrayRef sizes);

// Dtype, shape and device checks with messages that name the argument.
void check_segment_inputs(const at::Tensor& index, const at::Tensor& src, int64_t num_segments);

// src viewed as [E, F] contiguous, F = product of the trailing dims.
at::Tensor as_rows(const at::Tensor& src);

// Output sizes: [num_segments, *src.shape[1:]].
std::vector<int64_t> segment_output_sizes(const at::Tensor& src, int64_t num_segments);

// Turns the index-check kernels' bit flags (1 negative, 2 >= S, 4 unsorted)
// into a ValueError naming the argument and the fix.
void raise_index_errors(int flags, int64_t num_segments);

// The config the kernels will use: the override if given, else the selector.
Config resolve_config(at::OptionalIntArrayRef override_config, int64_t E, int64_t S, int64_t F);

at::Tensor segment_reduce_cpu(const at::Tensor& index, const at::Tensor& src, int64_t num_segments,
                              c10::string_view reduce, at::OptionalIntArrayRef config);
at::Tensor segment_arg_cpu(const at::Tensor& index, const at::Tensor& src, const at::Tensor& out);

}  // namespace geot
