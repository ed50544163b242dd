// The current CUDA device's multiprocessor count and compute capability, read once per device
// (launchers size grids and pick kernels by them; host code only).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace tokenweave {

// The current device's multiprocessor count and compute capability major (read once each).
struct DeviceFacts {
  int sms, major;
};
inline cudaError_t CurrentDeviceFacts(DeviceFacts* facts) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms[kMaxDevices], major[kMaxDevices];
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (sms[device].load() == 0) {
    int s = 0, m = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&s, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess)
      return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device);
        e != cudaSuccess)
      return e;
    major[device].store(m);
    sms[device].store(s);
  }
  *facts = {sms[device].load(), major[device].load()};
  return cudaSuccess;
}

}  // namespace tokenweave
