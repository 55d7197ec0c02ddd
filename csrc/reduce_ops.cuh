// Reduction functors shared by the CUDA kernels: identity, combine and the
// atomic that merges a partial result into the output. Holds no torch types.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "config.h"

namespace geot {

template <typename T> __device__ __forceinline__ T lowest_value();
template <> __device__ __forceinline__ float lowest_value<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double lowest_value<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

// Float max/min atomics through integer ordering: for floats with the sign bit
// clear the signed-int order matches the float order, for those with it set
// the unsigned order is reversed. One hardware atomic instead of a CAS loop.
// Branching on the sign bit (not v >= 0) keeps -0.0 right.
__device__ __forceinline__ void atomic_max(float* addr, float v) {
  if (__float_as_int(v) >= 0) atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
  else atomicMin(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_min(float* addr, float v) {
  if (__float_as_int(v) >= 0) atomicMin(reinterpret_cast<int*>(addr), __float_as_int(v));
  else atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}
__device__ __forceinline__ void atomic_max(double* addr, double v) {
  if (__double_as_longlong(v) >= 0) atomicMax(reinterpret_cast<long long*>(addr), __double_as_longlong(v));
  else atomicMin(reinterpret_cast<unsigned long long*>(addr),
                 static_cast<unsigned long long>(__double_as_longlong(v)));
}
__device__ __forceinline__ void atomic_min(double* addr, double v) {
  if (__double_as_longlong(v) >= 0) atomicMin(reinterpret_cast<long long*>(addr), __double_as_longlong(v));
  else atomicMax(reinterpret_cast<unsigned long long*>(addr),
                 static_cast<unsigned long long>(__double_as_longlong(v)));
}

// Sum also serves mean: the division by the count happens in the finalize pass.
template <typename acc_t> struct SumOp {
  __device__ __forceinline__ static acc_t identity() { return acc_t(0); }
  __device__ __forceinline__ static acc_t combine(acc_t a, acc_t b) { return a + b; }
  __device__ __forceinline__ static void atomic(acc_t* addr, acc_t v) { atomicAdd(addr, v); }
};

template <typename acc_t> struct MaxOp {
  __device__ __forceinline__ static acc_t identity() { return lowest_value<acc_t>(); }
  __device__ __forceinline__ static acc_t combine(acc_t a, acc_t b) { return b > a ? b : a; }
  __device__ __forceinline__ static void atomic(acc_t* addr, acc_t v) { atomic_max(addr, v); }
};

template <typename acc_t> struct MinOp {
  __device__ __forceinline__ static acc_t identity() { return -lowest_value<acc_t>(); }
  __device__ __forceinline__ static acc_t combine(acc_t a, acc_t b) { return b < a ? b : a; }
  __device__ __forceinline__ static void atomic(acc_t* addr, acc_t v) { atomic_min(addr, v); }
};

}  // namespace geot
