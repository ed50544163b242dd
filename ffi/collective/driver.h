// Driver API entry points looked up at run time (cudaGetDriverEntryPointByVersion), so the
// module imports on machines without a CUDA driver, and the CUresult check.
#pragma once

#include <cuda.h>  // driver API types only
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace tokenweave {

template <typename Fn>
Fn DriverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12010, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr)
    throw std::runtime_error(std::string("jax-tokenweave: driver entry point ") + name +
                             " is unavailable");
  return reinterpret_cast<Fn>(fn);
}

inline void CheckCu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("jax-tokenweave: ") + what + " failed with CUresult " +
                             std::to_string(static_cast<int>(r)));
}

}  // namespace tokenweave
