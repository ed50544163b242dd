// The fused call of a group of one rank (N = 1): nothing to communicate, so no call state, no
// receive buffers, no waits: residual_out = partial + residual (rounded to T), normed =
// RMSNorm(residual_out) * weight, the row in registers while it fits (H x itemsize <= 16 KiB).
// Same arithmetic as every other variant: the sum in float32 in the order partial, residual.
// Up to 16 rows (sm_90) a row is cut across a cluster of 2-8 CTAs, one 16-byte vector per
// thread, that swap their sums of squares through distributed shared memory; past that, while
// two CTAs a row fit in one wave, a pair of CTAs holds a row (each loads it whole, stores
// half); otherwise one 512-thread block per row (grid-stride over rows).
//
// Why clusters: a block per row moves the whole row through one SM (at T = 1, H = 8192 bf16:
// 48 KiB in and 32 KiB out) with two vectors per thread; cut across eight CTAs with one vector
// per thread, a call took 2.03 us instead of 2.53 (RowCtas lists what else was measured).
//
// Why a kernel of its own: the protocol kernels pay the slot's state atomic, the end-of-call
// advance and their code size even when N = 1 (4.05 us per call at T = 1 on an H200 against
// 2.18 us for a minimal add + norm, benchmarks/results/2026-11-23-h200x1/fixed_cost.md; 2.47
// us with this kernel, benchmarks/results/2026-11-24-h200x1). A group of one never waits and
// no peer reads its slot state, so skipping the state is safe: every call of a one-rank comm
// takes this path (a closed comm still leaves NaN, below).
#include "cluster.cuh"
#include "common/device_facts.h"
#include "common/launch.cuh"
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kMaxLocalGrid = 4096;  // blocks at most; more rows are taken grid-stride

// The block's sum of v over its kBlock threads (every thread gets it). red: kBlock / 32 floats;
// the caller syncs before red is written again.
template <int kBlock>
__device__ __forceinline__ float BlockSum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kBlock / 32; ++i) total += red[i];
  return total;
}

// Vectors v0 .. v0 + nv - 1 of one row held in registers (nv <= kBlock * kU; the pointers are
// the row's starts): the sources' loads are issued first (they may miss to HBM; the weights
// hit L2), then row_total(this thread's sum of squares) gives the whole row's, and the normed
// vectors are written. kFull: nv == kBlock * kU, no bounds checks. only >= 0: every vector
// counts in the norm, but only step u == only is stored (and its weights loaded).
template <typename T, int kBlock, int kU, bool kFull, typename RowTotal>
__device__ __forceinline__ void RegisterRow(const KernelParams& p, const char* partial,
                                            const char* residual, char* normed, char* residual_out,
                                            int v0, int nv, RowTotal row_total, int only = -1) {
  constexpr int kN = Vec<T>::kN;
  const int tid = threadIdx.x;
  const auto live = [&](int u) { return kFull || tid + u * kBlock < nv; };
  const auto kept = [&](int u) { return live(u) && (only < 0 || u == only); };
  const auto at = [&](int u) { return v0 + tid + u * kBlock; };
  uint4 a[kU], b[kU];
  float4 w[kU][kN / 4];
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (live(u)) {
      a[u] = Ldg(partial + at(u) * 16);
      b[u] = Ldg(residual + at(u) * 16);
    }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (kept(u)) LoadWeights<T>(p, at(u), w[u]);
  float acc[kU][kN];
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (!live(u)) continue;
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[u][i] = 0.f;
    AddVec<T>(acc[u], a[u]);
    AddVec<T>(acc[u], b[u]);
    const uint4 rounded = PackRound<T>(acc[u]);
    if (kept(u)) St(residual_out + at(u) * 16, rounded);
#pragma unroll
    for (int i = 0; i < kN; ++i) ss += acc[u][i] * acc[u][i];
  }
  const float inv = rsqrtf(row_total(ss) / static_cast<float>(p.hidden) + p.eps);
  auto emit = [&](int v, uint4 o) { St(normed + v * 16, o); };
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (kept(u)) EmitNormed<T>(acc[u], w[u], inv, at(u), emit);
}

// NaN over vectors v0 .. v0 + nv - 1 of a row's outputs (a failed or closed comm), after the
// block's stores of them.
template <typename T, int kBlock>
__device__ __forceinline__ void PoisonRow(char* normed, char* residual_out, int v0, int nv) {
  __syncthreads();
  for (int v = v0 + threadIdx.x; v < v0 + nv; v += kBlock) {
    St(normed + v * 16, NanVec<T>());
    St(residual_out + v * 16, NanVec<T>());
  }
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
  WaitForPrerequisite();  // programmatic launch (launch.cuh): nothing is read before this
  AllowDependents();      // nothing here waits on another grid
  const uint32_t failed = LdVolatile(&p.rank_ctl[0]->failed);
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    const char* partial = static_cast<const char*>(p.partial) + row * rb;
    const char* residual = static_cast<const char*>(p.residual) + row * rb;
    char* normed = static_cast<char*>(p.normed) + row * rb;
    char* residual_out = static_cast<char*>(p.residual_out) + row * rb;
    if (kFull || kInRegisters || vpr <= kBlock * kU) {
      RegisterRow<T, kBlock, kU, kFull>(p, partial, residual, normed, residual_out, 0, vpr,
                                        [&](float ss) {
                                          const float total = BlockSum<kBlock>(ss, red);
                                          __syncthreads();  // red read before the next row
                                          return total;
                                        });
    } else {
      FusedRow<T, kBlock, kU, false>(
          p,
          [&](int v0, float(*acc)[Vec<T>::kN]) {
            const char* rows[2] = {partial, residual};
            LoadSum<T, kBlock, 2, kU>(acc, rows, 2, v0, vpr);
          },
          residual_out, normed, [&](int v, uint4 o) { St(normed + v * 16, o); }, red, 0);
    }
    if (failed != 0) PoisonRow<T, kBlock>(normed, residual_out, 0, vpr);
  }
}

// Grid (CTAs per row, T), clusters of the CTAs of a row (a power of two <= 8 that divides
// the row's vectors into shares of at most kBlock): CTA c holds vectors [c * nv, (c + 1) * nv)
// of its row, one per thread. Each CTA sums its squares and the cluster adds the sums
// (ClusterSum, distributed shared memory), in the same order in every CTA, so a row's CTAs
// share one norm. The cluster barrier's first phase is arrived at on entry, so its wait hides
// behind the loads. Compiled empty before sm_90, where it is never launched.
template <typename T, int kBlock>
__global__ void __launch_bounds__(kBlock)
    LocalRowsCutKernel(const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float red[kBlock / 32];
  __shared__ float sums[kMaxRowCtas];
  ClusterArriveRelaxed();
  WaitForPrerequisite();
  AllowDependents();
  const uint32_t failed = LdVolatile(&p.rank_ctl[0]->failed);
  const int ctas = gridDim.x, cta = blockIdx.x;
  const int nv = p.hidden / Vec<T>::kN / ctas, v0 = cta * nv;
  const int64_t at = static_cast<int64_t>(blockIdx.y) * p.hidden * sizeof(T);
  char* normed = static_cast<char*>(p.normed) + at;
  char* residual_out = static_cast<char*>(p.residual_out) + at;
  RegisterRow<T, kBlock, 1, false>(
      p, static_cast<const char*>(p.partial) + at, static_cast<const char*>(p.residual) + at,
      normed, residual_out, v0, nv,
      [&](float ss) { return ClusterSum(BlockSum<kBlock>(ss, red), sums, ctas, cta); });
  if (failed != 0) PoisonRow<T, kBlock>(normed, residual_out, v0, nv);
#endif
}

constexpr int kLocalBlock = kThreads, kLocalU = 2;  // rows of 8192 bf16 in registers

// Row g (blockIdx.y) held by two CTAs of kLocalBlock threads, no cluster: each loads the whole
// row and computes its norm exactly as a block per row does (thread t: vectors t and t +
// kLocalBlock, the same order), and CTA c (blockIdx.x) stores step c only, loading only its
// weights. Half the stores and weights per SM and twice the SMs of a block per row, with no
// cross-CTA step; the rows are bitwise those of a block per row. Taken past kPairMinRows rows
// while two CTAs a row fit in one wave. One H200, H = 8192 bf16, us at T = 16 / 24 / 32 / 48 /
// 64 (benchmarks/results/2026-11-26-h200x1/sixth_session, four machines): 2.21 / 2.25-2.29 /
// 2.31-2.36 / 2.47-2.55 / 2.67-2.79, against clusters of 8 2.18 / 2.34 / 2.53 and a block per
// row 2.63 / 2.69 / 2.67 / 2.72-2.81 / 2.80-2.84. The second read of the row costs 0.5 us at
// T = 64, but each way measured to avoid it costs more (2026-11-27-h200x1, sixth session): a
// cut across a cluster of two 3.1 us, a cluster-multicast bulk copy 2.9, halves that swap their
// sums through global memory 3.0-3.1, bulk copies of the whole row 2.8.
constexpr int kPairMinRows = 16;
template <typename T>
__global__ void __launch_bounds__(kLocalBlock)
    LocalRowsPairKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kLocalBlock / 32];
  WaitForPrerequisite();
  AllowDependents();
  const uint32_t failed = LdVolatile(&p.rank_ctl[0]->failed);
  const int vpr = p.hidden / Vec<T>::kN, half = blockIdx.x;
  const int64_t at = static_cast<int64_t>(blockIdx.y) * p.hidden * sizeof(T);
  char* normed = static_cast<char*>(p.normed) + at;
  char* residual_out = static_cast<char*>(p.residual_out) + at;
  RegisterRow<T, kLocalBlock, kLocalU, false>(
      p, static_cast<const char*>(p.partial) + at, static_cast<const char*>(p.residual) + at,
      normed, residual_out, 0, vpr, [&](float ss) { return BlockSum<kLocalBlock>(ss, red); }, half);
  const int v0 = half * kLocalBlock, v1 = min(vpr, v0 + kLocalBlock);
  if (failed != 0) PoisonRow<T, kLocalBlock>(normed, residual_out, v0, v1 - v0);
}

// Whether rows of vpr vectors take LocalRowsPairKernel: a row longer than one CTA's step that
// fits the registers, 2 x tokens CTAs in one wave, rows cut across at most two CTAs
// (JAX_TOKENWEAVE_ROW_CTAS, cluster.cuh; 1: a block per row).
bool PairRows(int tokens, int vpr, int sms) {
  return RowCtasCap() >= 2 && vpr > kLocalBlock && vpr <= kLocalBlock * kLocalU &&
         2 * tokens <= sms;
}

template <typename T, bool kInRegisters, int kMinBlocks>
constexpr auto kLocalKernel =
    LocalRowsKernel<T, kLocalBlock, kLocalU, false, kInRegisters, kMinBlocks>;

template <typename T>
cudaError_t LaunchFor(const KernelParams& p, cudaStream_t stream) {
  DeviceFacts facts{};
  if (cudaError_t e = CurrentDeviceFacts(&facts); e != cudaSuccess) return e;
  const int vpr = p.hidden / Vec<T>::kN;
  const bool programmatic = facts.major >= 9;  // launch.cuh
  const LaunchOptions o{0, 1, programmatic};
  // Past kPairMinRows rows the pair beats clusters; up to it, the pair only where rows are
  // not cut (before sm_90, or rows of another size).
  const bool pair = PairRows(p.tokens, vpr, facts.sms);
  const int ctas = pair && p.tokens > kPairMinRows
                       ? 1
                       : RowCtas(p.tokens, vpr, facts.major, kMaxRowCtas * p.tokens);
  if (ctas > 1) {
    const dim3 grid(ctas, p.tokens);
    const LaunchOptions oc{0, ctas, programmatic};
    return WithCutThreads(vpr / ctas, [&](auto threads) {
      return LaunchKernel(LocalRowsCutKernel<T, threads>, grid, dim3(threads), oc, stream, p);
    });
  }
  if (pair)
    return LaunchKernel(LocalRowsPairKernel<T>, dim3(2, p.tokens), dim3(kLocalBlock), o, stream, p);
  const dim3 grid(p.tokens < kMaxLocalGrid ? p.tokens : kMaxLocalGrid), block(kLocalBlock);
  if (vpr > kLocalBlock * kLocalU)
    return LaunchKernel(kLocalKernel<T, false, 1>, grid, block, o, stream, p);
  if (static_cast<int>(grid.x) > facts.sms)
    return LaunchKernel(kLocalKernel<T, true, 2>, grid, block, o, stream, p);
  return LaunchKernel(kLocalKernel<T, true, 1>, grid, block, o, stream, p);
}

template <typename T>
cudaError_t PreloadFor() {
  cudaFuncAttributes a;
  for (const void* k : {reinterpret_cast<const void*>(kLocalKernel<T, false, 1>),
                        reinterpret_cast<const void*>(kLocalKernel<T, true, 1>),
                        reinterpret_cast<const void*>(kLocalKernel<T, true, 2>),
                        reinterpret_cast<const void*>(LocalRowsCutKernel<T, 128>),
                        reinterpret_cast<const void*>(LocalRowsCutKernel<T, 256>),
                        reinterpret_cast<const void*>(LocalRowsCutKernel<T, 512>),
                        reinterpret_cast<const void*>(LocalRowsPairKernel<T>)})
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
