// The multimem (NVLink SHARP) variant: two-shot with multimem.ld_reduce / multimem.st on a
// multicast mapping of the data area instead of the pushes. sm_90 only and opt-in: the comm
// refuses to create the multicast object where NCCL_NVLS_ENABLE=0 (every lent machine), so this
// code is compiled in every build but never run there.
#pragma once

#include "rowops.cuh"

namespace tokenweave {
namespace multimem {

constexpr int kGroup = 128;
constexpr int kGroups = kThreads / kGroup;
constexpr int kU = 4;

// Adds vectors v0 + u*kGroup (u < kU, v < vpr) of the residual row into acc[u].
template <typename T>
__device__ __forceinline__ void AddResidual(float (*acc)[Vec<T>::kN], const char* row, int v0,
                                            int vpr) {
  uint4 x[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (v0 + u * kGroup < vpr) x[u] = Ldg(row + (v0 + u * kGroup) * 16);
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (v0 + u * kGroup < vpr) AddVec<T>(acc[u], x[u]);
}

template <typename T>
__device__ __forceinline__ uint4 MultimemLdReduce(const void* mc);
template <>
__device__ __forceinline__ uint4 MultimemLdReduce<float>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
#endif
  return v;
}
template <>
__device__ __forceinline__ uint4 MultimemLdReduce<__half>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
#endif
  return v;
}
template <>
__device__ __forceinline__ uint4 MultimemLdReduce<__nv_bfloat16>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
#endif
  return v;
}
__device__ __forceinline__ void MultimemSt(void* mc, uint4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};" ::"l"(mc), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#endif
}
__device__ __forceinline__ void FenceProxyAlias() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.alias;" ::: "memory");
#endif
}

// Area layout (symmetric on every rank): IN [N*q rows][H], then OUT [N*q rows][H].
template <typename T>
__global__ void __launch_bounds__(kThreads) MultimemKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kThreads / 32];
  const CallState call = BeginCall(p);
  if (call.abort) return PoisonOutputs<T>(p);
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t out_area = static_cast<int64_t>(n) * q * rb;
  const int64_t parity = (call.epoch & 1) * p.area_bytes;
  char* own = p.data[r] + parity;
  char* mc = p.mc_data + parity;
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);

  // (a) partial into the own copy of the symmetric IN area.
  RowCopy<true>(tokens, vpr, [&](int i, const char*& s, char*& d) {
    s = partial + i * rb;
    d = own + i * rb;
  });
  FenceProxyAlias();
  if (!Barrier(p, kStageBarrier0, call.epoch)) return PoisonOutputs<T>(p);
  // (c) own rows: the switch sums the N copies; normed goes to every rank with one store.
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow<kGroup>(res_in, residual_out + row * rb, vpr);
      continue;
    }
    FusedRow<T, kGroup, kU, false>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (v0 + u * kGroup < vpr)
              AddVec<T>(acc[u], MultimemLdReduce<T>(mc + g * rb + (v0 + u * kGroup) * 16));
          AddResidual<T>(acc, res_in, v0, vpr);
        },
        residual_out + row * rb, normed + g * rb,
        [&](int v, uint4 o) { MultimemSt(mc + out_area + g * rb + v * 16, o); }, red, group);
  }
  FenceProxyAlias();
  if (!Barrier(p, kStageBarrier1, call.epoch)) return PoisonOutputs<T>(p);
  // (e) all normed rows from the local OUT area.
  RowCopy<false>(tokens, vpr, [&](int i, const char*& s, char*& d) {
    s = own + out_area + i * rb;
    d = normed + i * rb;
  });
}

}  // namespace multimem

template <typename T>
cudaError_t LaunchMultimem(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  multimem::MultimemKernel<T><<<num_ctas, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tokenweave
