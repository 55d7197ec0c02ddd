#include <cuda_runtime_api.h>

#include "build_info.h"

#define GEOT_STRINGIFY_(...) #__VA_ARGS__
#define GEOT_STRINGIFY(...) GEOT_STRINGIFY_(__VA_ARGS__)

namespace geot {

std::string cuda_arch_list() {
#ifdef __CUDA_ARCH_LIST__
  return GEOT_STRINGIFY(__CUDA_ARCH_LIST__);
#else
  return "";  // nvcc before CUDA 11.5 does not define it
#endif
}

int cuda_toolkit_version() { return CUDART_VERSION; }

}  // namespace geot
