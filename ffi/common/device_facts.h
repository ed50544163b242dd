// The current CUDA device's multiprocessor count, compute capability and opt-in shared memory
// per block, read once per device (launchers size grids and pick kernels by them; host code
// only).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace tokenweave {

// The current device's multiprocessor count, compute capability major and the most dynamic
// shared memory a block may opt in to, in bytes (read once each).
struct DeviceFacts {
  int sms, major, smem_optin;
};
inline cudaError_t CurrentDeviceFacts(DeviceFacts* facts) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices], major[kMaxDevices], smem_optin[kMaxDevices];
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (sms[device].load() == 0) {
    int s = 0, m = 0, o = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&s, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device);
        e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&o, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        e != cudaSuccess)
      return e;
    major[device].store(m);
    smem_optin[device].store(o);
    sms[device].store(s);
  }
  *facts = {sms[device].load(), major[device].load(), smem_optin[device].load()};
  return cudaSuccess;
}

}  // namespace tokenweave
