// Kernel launches beyond <<<>>>: thread-block clusters and programmatic dependent launches
// (sm_90), with the device side of the latter. Shared by the decode attention kernels
// (paged_decode.cu) and the decode-size fused kernels (local_rows.cu, oneshot_rows.cu).
//
// A programmatic launch lets a grid's blocks start while the grid before it in the stream
// drains: they wait in WaitForPrerequisite until that grid has ended and its writes are
// visible, so nothing may be read before it. The grid before lets them launch with
// AllowDependents (or by ending). A fused kernel that waits for peers calls AllowDependents only
// once its peers' data is in: a dependent's blocks that wait earlier could hold the SMs that a
// peer sharing the GPU still needs (the loopback harness: a wait expired at N = 8).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace tokenweave {

// Waits for the grid this one depends on (programmatic launch); a no-op before sm_90 and after
// a plain launch.
__device__ __forceinline__ void WaitForPrerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the dependent grid's blocks launch (they wait for this grid's end before reading).
__device__ __forceinline__ void AllowDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct LaunchOptions {
  size_t smem = 0;            // dynamic shared memory per block
  int cluster = 1;            // CTAs per cluster along x (1: no cluster)
  bool programmatic = false;  // a programmatic dependent of the work before it (sm_90 on)
};

// Launches kernel<<<grid, block, o.smem, stream>>>(args...) with the options' attributes.
template <typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Args...), dim3 grid, dim3 block, const LaunchOptions& o,
                         cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = o.smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  unsigned n = 0;
  if (o.cluster > 1) {
    attributes[n].id = cudaLaunchAttributeClusterDimension;
    attributes[n].val.clusterDim.x = o.cluster;
    attributes[n].val.clusterDim.y = 1;
    attributes[n].val.clusterDim.z = 1;
    ++n;
  }
  if (o.programmatic) {
    attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attributes;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace tokenweave
