// Rows cut across a thread-block cluster (sm_90): the cluster barrier, stores into another CTA's
// shared memory, and how many CTAs a decode-size row is cut across (launch.cuh launches the
// clusters). Shared by the one-rank kernel (local_rows.cu) and the decode one-shot kernel
// (oneshot_rows.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

namespace tokenweave {

constexpr int kMaxRowCtas = 8;     // a portable cluster
constexpr int kMaxCutBlock = 512;  // threads of a CTA of a cut row (a 16-byte vector each)
constexpr int kMaxCutRows = 32;    // rows up to which a row is cut (see RowCtas)

// CTAs per row: for up to kMaxCutRows rows (sm_90), the largest cluster of 2-8 that divides
// the row's `vpr` 16-byte vectors into shares of at most kMaxCutBlock; else 1 (a block per
// row). One rank (N = 1) on an H200, H = 8192 bf16, us at T = 1 / 16 / 32 / 64
// (benchmarks/results/2026-11-25-h200x1): a block per row 2.52 / 2.62 / 2.70 / 2.84,
// clusters of 8 2.02 / 2.18 / 2.50 / 2.85, of 4 2.10 / 2.23 / 2.58, of 2 2.45 / 2.60 / - /
// 3.10. A positive JAX_TOKENWEAVE_ROW_CTAS caps it (1: a block per row), read at each
// launch, for measurements side by side. The one-rank kernel cuts only up to 16 rows: past
// that its pair of CTAs a row, with no cluster, is faster (local_rows.cu).
// At most max_ctas CTAs in all (the caller's CTA budget: the fused kernel runs beside GEMMs).
inline int RowCtasCap() {
  if (const char* s = std::getenv("JAX_TOKENWEAVE_ROW_CTAS"); s != nullptr && *s != 0)
    return std::max(1, std::atoi(s));
  return kMaxRowCtas;
}
inline int RowCtas(int tokens, int vpr, int compute_major, int max_ctas) {
  const int cap = RowCtasCap();
  if (compute_major < 9 || tokens > kMaxCutRows) return 1;
  for (int c = kMaxRowCtas; c >= 2; c /= 2)
    if (c <= cap && c * tokens <= max_ctas && vpr % c == 0 && vpr / c <= kMaxCutBlock) return c;
  return 1;
}

// Threads of a CTA that holds nv vectors of a cut row, one each: 128, 256 or kMaxCutBlock. A
// CTA of idle threads costs its warps' launch and barriers: the decode one-shot kernel's cut
// rows on 512-thread CTAs, loopback N = 2, T = 1 / 16 at 64 CTAs, took 3.95 / 5.00 us per
// free-running call against 3.56 / 4.18 on these (benchmarks/results/2026-11-27-h200x1).
constexpr int CutThreads(int nv) { return nv <= 128 ? 128 : (nv <= 256 ? 256 : kMaxCutBlock); }

// launch(std::integral_constant<int, CutThreads(nv)>{}): the launchers keep a kernel instance
// per thread count (one reading blockDim was slower: oneshot_rows.cu).
template <typename Launch>
cudaError_t WithCutThreads(int nv, Launch launch) {
  switch (CutThreads(nv)) {
    case 128: return launch(std::integral_constant<int, 128>{});
    case 256: return launch(std::integral_constant<int, 256>{});
    default: return launch(std::integral_constant<int, kMaxCutBlock>{});
  }
}

// The device side: PTX of sm_90. Before sm_90 a CTA is a cluster of one (the launchers never
// cut rows there), and these reduce to that.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
__device__ __forceinline__ int ClusterCtas() { return 1; }
__device__ __forceinline__ int ClusterRank() { return 0; }
__device__ __forceinline__ void ClusterArriveRelaxed() {}
__device__ __forceinline__ float ClusterSum(float mine, float*, int, int) { return mine; }
__device__ __forceinline__ float2 ClusterSum2(float2 mine, float*, float*, int, int) {
  return mine;
}
#else
// CTAs in this CTA's cluster, and this CTA's rank in it.
__device__ __forceinline__ int ClusterCtas() {
  uint32_t n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return static_cast<int>(n);
}
__device__ __forceinline__ int ClusterRank() {
  uint32_t r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// *x (this CTA's shared memory) in the cluster's CTA of rank `cta` = v.
__device__ __forceinline__ void StoreToClusterCta(float* x, int cta, float v) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(x));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(cta));
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// The cluster's sum of one value per CTA, added in CTA order (the same bits in every CTA).
// Every thread of every CTA calls it, once per kernel, after ClusterArriveRelaxed on entry:
// the barrier's first phase (every CTA runs, so its shared memory may be written) then costs
// nothing here. slots: kMaxRowCtas floats of shared memory.
__device__ __forceinline__ float ClusterSum(float mine, float* slots, int ctas, int cta) {
  ClusterWait();
  if (static_cast<int>(threadIdx.x) < ctas) StoreToClusterCta(&slots[cta], threadIdx.x, mine);
  ClusterArrive();
  ClusterWait();  // nothing remote follows: no CTA waits for the others to leave
  float total = 0.f;
  for (int i = 0; i < ctas; ++i) total += slots[i];
  return total;
}

// ClusterSum of two values at once (one barrier). xs, ys: kMaxRowCtas floats each.
__device__ __forceinline__ float2 ClusterSum2(float2 mine, float* xs, float* ys, int ctas,
                                              int cta) {
  ClusterWait();
  if (static_cast<int>(threadIdx.x) < ctas) {
    StoreToClusterCta(&xs[cta], threadIdx.x, mine.x);
    StoreToClusterCta(&ys[cta], threadIdx.x, mine.y);
  }
  ClusterArrive();
  ClusterWait();  // nothing remote follows: no CTA waits for the others to leave
  float2 total = make_float2(0.f, 0.f);
  for (int i = 0; i < ctas; ++i) total.x += xs[i], total.y += ys[i];
  return total;
}
#endif

}  // namespace tokenweave
