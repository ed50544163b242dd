// The fused call of a group of one rank (N = 1): nothing to communicate, so no call state, no
// receive buffers, no waits: residual_out = partial + residual (rounded to T), normed =
// RMSNorm(residual_out) * weight, one 512-thread block per row (grid-stride over rows), the
// row in registers while it fits (H x itemsize <= 16 KiB). Same arithmetic as every other
// variant: the sum in float32 in the order partial, residual.
//
// Why a kernel of its own: the protocol kernels pay the slot's state atomic, the end-of-call
// advance and their code size even when N = 1 (4.05 us per call at T = 1 on an H200 against
// 2.18 us for a minimal add + norm, benchmarks/results/2026-11-23-h200x1/fixed_cost.md; 2.47
// us with this kernel, benchmarks/results/2026-11-24-h200x1). A group of one never waits and
// no peer reads its slot state, so skipping the state is safe: every call of a one-rank comm
// takes this path (a closed comm still leaves NaN, below).
#include "device_facts.h"
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kMaxLocalGrid = 4096;  // blocks at most; more rows are taken grid-stride

// One row held in registers (vpr <= kBlock * kU): the sources' loads are issued first (they may
// miss to HBM; the weights hit L2), one block-wide sum of squares (a single barrier), then the
// normed row. kFull: vpr == kBlock * kU, no bounds checks.
template <typename T, int kBlock, int kU, bool kFull>
__device__ __forceinline__ void RegisterRow(const KernelParams& p, const char* partial,
                                            const char* residual, char* normed, char* residual_out,
                                            int vpr, float* red) {
  constexpr int kN = Vec<T>::kN;
  const int tid = threadIdx.x;
  uint4 a[kU], b[kU];
  float4 w[kU][kN / 4];
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (kFull || tid + u * kBlock < vpr) {
      a[u] = Ldg(partial + (tid + u * kBlock) * 16);
      b[u] = Ldg(residual + (tid + u * kBlock) * 16);
    }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (kFull || tid + u * kBlock < vpr) LoadWeights<T>(p, tid + u * kBlock, w[u]);
  float acc[kU][kN];
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (!kFull && tid + u * kBlock >= vpr) continue;
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[u][i] = 0.f;
    AddVec<T>(acc[u], a[u]);
    AddVec<T>(acc[u], b[u]);
    St(residual_out + (tid + u * kBlock) * 16, PackRound<T>(acc[u]));
#pragma unroll
    for (int i = 0; i < kN; ++i) ss += acc[u][i] * acc[u][i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (tid % 32 == 0) red[tid / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kBlock / 32; ++i) total += red[i];
  __syncthreads();  // every thread has read red before a next row writes it
  const float inv = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
  auto emit = [&](int v, uint4 o) { St(normed + v * 16, o); };
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (kFull || tid + u * kBlock < vpr) EmitNormed<T>(acc[u], w[u], inv, tid + u * kBlock, emit);
}

// kBlock threads per row, kU 16-byte vectors per thread; rows longer than kBlock * kU vectors
// take rowops' two-pass FusedRow. kFull: every row is exactly kBlock * kU vectors. kInRegisters:
// the launcher's promise that every row fits in registers, so the two-pass path is not compiled
// in (72 registers instead of 92 in bf16). kMinBlocks 2 caps that at 64 registers, two
// 512-thread blocks per multiprocessor, for more rows than multiprocessors: with one block per
// SM, T = 256 ran in two waves (5.2 us on an H200; 4.7 with two). Fewer rows keep the uncapped
// kernel (the capped one spills 8 bytes and was 0.17-0.27 us slower at T = 1-64). The comm's
// failure word is loaded first and looked at last (its latency hides behind the row's): a comm
// closed since a command buffer recorded this call leaves NaN, as every other variant does.
template <typename T, int kBlock, int kU, bool kFull, bool kInRegisters, int kMinBlocks>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
    LocalRowsKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kBlock / 32];
  const uint32_t failed = LdVolatile(&p.rank_ctl[0]->failed);
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    const char* partial = static_cast<const char*>(p.partial) + row * rb;
    const char* residual = static_cast<const char*>(p.residual) + row * rb;
    char* normed = static_cast<char*>(p.normed) + row * rb;
    char* residual_out = static_cast<char*>(p.residual_out) + row * rb;
    if (kFull || kInRegisters || vpr <= kBlock * kU) {
      RegisterRow<T, kBlock, kU, kFull>(p, partial, residual, normed, residual_out, vpr, red);
    } else {
      FusedRow<T, kBlock, kU, false>(
          p,
          [&](int v0, float(*acc)[Vec<T>::kN]) {
            const char* rows[2] = {partial, residual};
            LoadSum<T, kBlock, 2, kU>(acc, rows, 2, v0, vpr);
          },
          residual_out, normed, [&](int v, uint4 o) { St(normed + v * 16, o); }, red, 0);
    }
    if (failed != 0) {
      __syncthreads();  // after every thread's stores of the row
      for (int v = threadIdx.x; v < vpr; v += kBlock) {
        St(normed + v * 16, NanVec<T>());
        St(residual_out + v * 16, NanVec<T>());
      }
    }
  }
}

constexpr int kLocalBlock = kThreads, kLocalU = 2;  // rows of 8192 bf16 in registers

template <typename T, bool kInRegisters, int kMinBlocks>
constexpr auto kLocalKernel =
    LocalRowsKernel<T, kLocalBlock, kLocalU, false, kInRegisters, kMinBlocks>;

template <typename T>
cudaError_t LaunchFor(const KernelParams& p, cudaStream_t stream) {
  DeviceFacts facts{};
  if (cudaError_t e = CurrentDeviceFacts(&facts); e != cudaSuccess) return e;
  const int grid = p.tokens < kMaxLocalGrid ? p.tokens : kMaxLocalGrid;
  if (p.hidden / Vec<T>::kN > kLocalBlock * kLocalU)
    kLocalKernel<T, false, 1><<<grid, kLocalBlock, 0, stream>>>(p);
  else if (grid > facts.sms)
    kLocalKernel<T, true, 2><<<grid, kLocalBlock, 0, stream>>>(p);
  else
    kLocalKernel<T, true, 1><<<grid, kLocalBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PreloadFor() {
  cudaFuncAttributes a;
  for (const void* k : {reinterpret_cast<const void*>(kLocalKernel<T, false, 1>),
                        reinterpret_cast<const void*>(kLocalKernel<T, true, 1>),
                        reinterpret_cast<const void*>(kLocalKernel<T, true, 2>)})
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchLocalRows(const KernelParams& p, DType dtype, cudaStream_t stream) {
  if (p.nranks != 1 || p.tokens < 1 || p.rows != p.tokens) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kF32: return LaunchFor<float>(p, stream);
    case DType::kF16: return LaunchFor<__half>(p, stream);
    case DType::kBF16: return LaunchFor<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PreloadLocalRowsKernels() {
  for (cudaError_t e : {PreloadFor<float>(), PreloadFor<__half>(), PreloadFor<__nv_bfloat16>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace tokenweave
