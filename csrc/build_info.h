// What a build of the extension holds, for python -m geot.info: the CUDA
// architectures its kernels were compiled for and the CUDA toolkit version.
#pragma once

#include <string>

namespace geot {

#ifdef GEOT_WITH_CUDA
// nvcc's __CUDA_ARCH_LIST__ for this library's kernels, e.g. "900" (sm_90)
// or "800,900": the architectures named by TORCH_CUDA_ARCH_LIST at build time.
std::string cuda_arch_list();
// CUDART_VERSION of the toolkit the kernels were compiled with, e.g. 13000.
int cuda_toolkit_version();
#endif

}  // namespace geot
