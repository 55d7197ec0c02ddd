// Small helpers shared by the CUDA launch layers.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "config.h"  // ceil_div

namespace geot {

// at:: half types -> their CUDA builtin twins (same bit layout).
template <typename T> struct cuda_type { using type = T; };
template <> struct cuda_type<at::Half> { using type = __half; };
template <> struct cuda_type<at::BFloat16> { using type = __nv_bfloat16; };

// What a scalar type accumulates in: double for double, float otherwise
// (fp16 and bf16 sum in fp32).
template <typename scalar_t>
using accumulate_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Blocks of a grid-stride loop over `items`: one per `threads` items, at
// least 1, at most `cap` (the loop covers the rest).
inline unsigned grid_stride_blocks(int64_t items, int threads, int64_t cap = 65536) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(items, threads), cap)));
}

}  // namespace geot
