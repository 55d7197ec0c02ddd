// CUDA side of unordered_graph.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>

#include "launch_utils.cuh"
#include "unordered_graph.h"

namespace geot {
namespace {

// One flag per device in mapped pinned memory: a kernel that meets a bad id
// stores its ticket there, and the host reads it whenever it likes. No
// event, copy or allocation per check; a zero only means "no failure seen yet".
constexpr int kMaxDevices = 64;
std::atomic<int64_t*> allocated_flags{nullptr};

int64_t* failure_flags() {
  static int64_t* flags = [] {
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, kMaxDevices * sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable));
    std::fill_n(static_cast<int64_t*>(host), kMaxDevices, int64_t(0));
    allocated_flags.store(static_cast<int64_t*>(host));
    return static_cast<int64_t*>(host);
  }();
  return flags;
}

template <typename index_t>
__global__ void deferred_check_kernel(const index_t* __restrict__ src, const index_t* __restrict__ dst, int64_t E,
                                      int64_t num_src, int64_t num_dst, volatile int64_t* flag, int64_t ticket) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = src[i], d = dst[i];
    if (s < 0 || s >= num_src || d < 0 || d >= num_dst) {
      *flag = ticket;  // any failing thread's store will do
      return;
    }
  }
}

template <typename index_t, typename count_t>
__global__ void count_rows_kernel(const index_t* __restrict__ index, int64_t E, int64_t S, count_t* counts) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < E; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = index[i];
    if (s >= 0 && s < S) atomicAdd(counts + s, count_t(1));
  }
}

}  // namespace

void deferred_index_check_cuda(const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst,
                               int64_t ticket) {
  const int64_t E = src.numel();
  if (E == 0) return;
  const int device = src.get_device();
  TORCH_CHECK(device < kMaxDevices, "deferred_index_check: device ", device, " beyond ", kMaxDevices);
  const c10::cuda::CUDAGuard guard(src.device());
  int64_t* device_flag = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), failure_flags() + device, 0));
  const at::Tensor s = src.contiguous(), d = dst.contiguous();
  const int threads = 256;
  AT_DISPATCH_INDEX_TYPES(s.scalar_type(), "geot_deferred_check", [&] {
    deferred_check_kernel<index_t><<<grid_stride_blocks(E, threads, 4096), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        s.data_ptr<index_t>(), d.data_ptr<index_t>(), E, num_src, num_dst, device_flag, ticket);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t take_failed_check_cuda() {
  int64_t* flags = allocated_flags.load();  // none before the first check: nothing to read (or allocate)
  for (int i = 0; flags != nullptr && i < kMaxDevices; ++i) {
    // Read and clear in one step: a device store landing meanwhile is kept for the next call.
    const int64_t ticket = __atomic_exchange_n(flags + i, int64_t(0), __ATOMIC_ACQ_REL);
    if (ticket != 0) return ticket;
  }
  return 0;
}

void count_rows_cuda(const at::Tensor& index, at::Tensor& counts) {
  const int64_t E = index.numel();
  if (E == 0) return;
  const c10::cuda::CUDAGuard guard(index.device());
  const at::Tensor idx = index.contiguous();
  const int threads = 256;
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "geot_count_rows", [&] {
    AT_DISPATCH_FLOATING_TYPES(counts.scalar_type(), "geot_count_rows", [&] {
      count_rows_kernel<index_t, scalar_t><<<grid_stride_blocks(E, threads, 4096), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          idx.data_ptr<index_t>(), E, counts.size(0), counts.data_ptr<scalar_t>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace geot
