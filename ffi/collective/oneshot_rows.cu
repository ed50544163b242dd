// The decode-size one-shot kernel: a token row per 512-thread block (T <= grid), held in
// registers (H <= 2 x 512 vectors), or, up to kMaxCutRows rows on sm_90, a row cut across a
// cluster of 2-8 CTAs of a thread per vector (cluster.cuh: RowCtas, CutThreads) that swap
// their sums of squares and verdicts. Same protocol, buffers and state as the general one-shot
// kernel (oneshot.cu), so calls of either kind may follow each other on a slot. It is shorter on
// the critical path of a decode call (loopback, 16 CTAs, T = 16: 6.3 / 10.0 / 21.5 us at N = 2 / 4
// / 8 against 14.7 / 18.0 / 39.2 for the general kernel; benchmarks/results):
//   - the row's own inputs (partial, residual, weights) are loaded before the call state is
//     read, so both round trips overlap;
//   - the block that reduces row g is the block that pushes row g, from the registers it
//     already holds (no second load);
//   - the slot advances at the end (the general kernels advance it at once);
//   - one bounded poll loop for all of a step's sources, no per-source copies of it, no stack;
//   - a failure poisons only this block's rows (it alone writes them; a cut row's CTAs share
//     one verdict);
//   - on sm_90 it is a programmatic launch (launch.cuh): back to back, the next call's blocks
//     launch once every block of this one has its peers' rows, and wait for its end (loopback,
//     N = 2, T = 1, free-running: 3.96 us per call against 4.98).
// Partials are summed in rank order, then the residual, in float32, from their one-shot
// encodings (own partial included), so every rank's rows are bitwise identical.
#include "cluster.cuh"
#include "common/device_facts.h"
#include "common/launch.cuh"
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kRowV = 2;  // 16-byte vectors per thread per row (a row per block)

// NaN over vectors [v, end) of a row, v advancing by the block (`threads`).
template <typename T>
__device__ __forceinline__ void FillNan(char* row, int v, int end, int threads) {
#pragma unroll 1
  for (; v < end; v += threads) St(row + v * 16, NanVec<T>());
}

// The decode one-shot kernel. kCut (sm_90, T <= kMaxCutRows): a row is cut across a cluster of
// CTAs (cluster.cuh: RowCtas), CTA c of row g pushing, polling and norming vectors
// [c * nv, (c + 1) * nv), one per thread (CutThreads(nv) threads); the cluster adds the CTAs' sums
// of squares and their failures (ClusterSum2), so a row's CTAs share one norm and one verdict; the
// grid is the cut rows' CTAs, at most the call's CTA count (RowCtas). Else block g holds row g,
// kRowV vectors per thread. kCutBlock: the cut CTA's threads (CutThreads: 128, 256 or 512), 0
// for a row per block. An instance per thread count: one instance reading blockDim took 0.1 /
// 0.35 / 0.15 us more at T = 1, N = 2 / 4 / 8 (loopback, benchmarks/results/2026-11-27-h200x1).
template <typename T, int kMaxN, int kCutBlock>
__global__ void __launch_bounds__(kCutBlock > 0 ? kCutBlock : kThreads)
    OneShotRowsKernel(const __grid_constant__ KernelParams p) {
  constexpr bool kCut = kCutBlock > 0;
  constexpr int threads = kCut ? kCutBlock : kThreads;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (kCut) return;  // never launched before sm_90 (RowCtas)
#endif
  constexpr int kN = Vec<T>::kN;
  constexpr int kU = kCut ? 1 : kRowV;
  constexpr int kStep = kMaxN <= 4 ? kU : 1;  // vectors polled at once (registers)
  __shared__ float red[threads / 32];
  __shared__ float sums[kMaxRowCtas], failures[kMaxRowCtas];
  const int ctas = kCut ? ClusterCtas() : 1, cta = kCut ? ClusterRank() : 0;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens, g = blockIdx.x / ctas;
  const int vpr = p.hidden / kN, v0 = cta * (vpr / ctas), v1 = v0 + vpr / ctas;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  // A replicated residual (q = T): this rank owns every row, and no residual rows travel.
  const bool replicated = p.residual_replicated != 0;
  const int64_t seg = static_cast<int64_t>(replicated ? tokens : tokens + q) * rb;
  const int own_real = replicated ? tokens : max(0, min(q, tokens - r * q));  // own rows < T
  const bool has_row = g < tokens, sends_residual = !replicated && g < own_real;
  const int owner = replicated ? r : g / q, orow = replicated ? g : g % q;
  const char* partial = static_cast<const char*>(p.partial) + g * rb;
  const char* residual = static_cast<const char*>(p.residual);
  const auto vec = [&](int u) { return v0 + static_cast<int>(threadIdx.x) + u * threads; };
  if (kCut && has_row) ClusterArriveRelaxed();  // a whole cluster has a row or none
  WaitForPrerequisite();  // the call before may have written this one's inputs

  // (1) Loads that need no call state, in flight with the state's.
  uint4 own[kU], res_own[kU], res_send[kU];
  float4 w[kU][kN / 4];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int v = vec(u);
    if (v >= v1) continue;
    if (has_row) {
      own[u] = Canonical<T>(Ldg(partial + v * 16));
      LoadWeights<T>(p, v, w[u]);
      if (owner == r) res_own[u] = Ldg(residual + orow * rb + v * 16);
    }
    if (sends_residual) res_send[u] = Canonical<T>(Ldg(residual + g * rb + v * 16));
  }
  const CallState call = ReadCallState(p);
  const int64_t used = (n - 1) * seg;
  bool ok = !call.abort;
  const uint32_t buf = call.oneshot_buf;

  if (ok) {
    // (2) Push row g's partial, and own residual row g, to every peer (rotated order).
    for (int k = 1; k < n; ++k) {
      const int j = (r + k) % n;
      char* dst = p.oneshot[j] + buf * p.oneshot_bytes + PeerIndex(r, j, n) * seg;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = vec(u);
        if (v >= v1) continue;
        if (has_row) St(dst + g * rb + v * 16, own[u]);
        if (sends_residual) St(dst + (tokens + g) * rb + v * 16, res_send[u]);
      }
    }
    // (3) Clear what the previous one-shot call on this slot received (grid-stride).
    FillSentinel(PreviousOneShotBuffer(p, buf), call.oneshot_clear);
  }

  float acc[kU][kN];
  if (ok && has_row) {
    // (4) Row g: the N partials in rank order, then its owner's residual row; polled from
    // this rank's receive buffer where a peer sent them.
    const char* recv = p.oneshot[r] + buf * p.oneshot_bytes;
    const char* src_row[kMaxN + 1];
#pragma unroll
    for (int s = 0; s < kMaxN; ++s)
      src_row[s] = s < n && s != r ? recv + PeerIndex(s, r, n) * seg + g * rb : nullptr;
    src_row[kMaxN] =
        owner == r ? nullptr : recv + PeerIndex(owner, r, n) * seg + (tokens + orow) * rb;
    Deadline d;
#pragma unroll
    for (int u0 = 0; u0 < kU; u0 += kStep) {
      if (!ok) break;
      uint4 x[kMaxN + 1][kStep];
      auto each = [&](auto f) {
#pragma unroll
        for (int s = 0; s <= kMaxN; ++s)
#pragma unroll
          for (int u = 0; u < kStep; ++u)
            if (src_row[s] != nullptr && vec(u0 + u) < v1)
              f(x[s][u], src_row[s] + vec(u0 + u) * 16);
      };
      each([](uint4& xv, const char* a) { xv = LdVolatile16(a); });
      for (;;) {  // one bounded loop re-polls whatever has not arrived
        bool pending = false;
        each([&](uint4& xv, const char* a) {
          if (HasSentinel<T>(xv)) {
            xv = LdVolatile16(a);
            pending |= HasSentinel<T>(xv);
          }
        });
        if (!pending) break;
        const Deadline::Result t = d.Tick(p);
        if (t == Deadline::kWait) continue;
        if (t == Deadline::kExpired) {
          int missing = -1;
          for (int s = 0; s <= kMaxN && missing < 0; ++s)
            for (int u = 0; u < kStep; ++u)
              if (src_row[s] != nullptr && HasSentinel<T>(x[s][u])) missing = s < kMaxN ? s : owner;
          ReportTimeout(p, kStageOneShotData, missing, g, call.epoch, 0);
        }
        ok = false;
        break;
      }
#pragma unroll
      for (int u = 0; u < kStep; ++u) {
        const int uu = u0 + u;
#pragma unroll
        for (int i = 0; i < kN; ++i) acc[uu][i] = 0.f;
#pragma unroll
        for (int s = 0; s < kMaxN; ++s)
          if (s < n) AddVec<T>(acc[uu], s == r ? own[uu] : x[s][u]);
        AddVec<T>(acc[uu], owner == r ? res_own[uu] : x[kMaxN][u]);
      }
    }
  }
  if (has_row) {
    ok = __syncthreads_and(ok) != 0;  // every thread polled (or gave up): one verdict
    AllowDependents();                // no peer waits on this block any more (launch.cuh)
    // (5) Round, write the residual (owner only), RMSNorm (the cluster's verdict and sum of
    // squares where the row is cut), write the normed row.
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = vec(u);
      if (!ok || v >= v1) continue;
      const uint4 rounded = PackRound<T>(acc[u]);
      if (owner == r) St(static_cast<char*>(p.residual_out) + orow * rb + v * 16, rounded);
#pragma unroll
      for (int i = 0; i < kN; ++i) ss += acc[u][i] * acc[u][i];
    }
    float total = GroupSum<threads>(ss, red, 0);
    if (kCut) {
      const float2 both =
          ClusterSum2(make_float2(total, ok ? 0.f : 1.f), sums, failures, ctas, cta);
      total = both.x;
      ok = both.y == 0.f;
    }
    if (ok) {
      const float inv = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
      char* out = static_cast<char*>(p.normed) + g * rb;
      auto emit = [&](int v, uint4 o) { St(out + v * 16, o); };
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (vec(u) < v1) EmitNormed<T>(acc[u], w[u], inv, vec(u), emit);
    }
  }
  // (6) Own padding row g (q > own real rows) is carried through.
  if (g >= own_real && g < q)
    for (int v = vec(0); v < v1; v += threads)
      St(static_cast<char*>(p.residual_out) + g * rb + v * 16, Ldg(residual + g * rb + v * 16));

  // Only this block writes its rows' vectors: a failed wait (or an earlier failure) leaves
  // them NaN.
  if (__syncthreads_or(!ok)) {
    if (has_row) FillNan<T>(static_cast<char*>(p.normed) + g * rb, vec(0), v1, threads);
    if (has_row && owner == r)
      FillNan<T>(static_cast<char*>(p.residual_out) + orow * rb, vec(0), v1, threads);
    if (g >= own_real && g < q)
      FillNan<T>(static_cast<char*>(p.residual_out) + g * rb, vec(0), v1, threads);
  }
  AdvanceIfLast(p, call, used);
}

template <typename T, int kMaxN>
cudaError_t LaunchFor(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  DeviceFacts facts{};
  if (cudaError_t e = CurrentDeviceFacts(&facts); e != cudaSuccess) return e;
  const bool programmatic = facts.major >= 9;
  const int vpr = p.hidden / Vec<T>::kN;
  if (const int ctas = RowCtas(p.tokens, vpr, facts.major, num_ctas); ctas > 1) {
    const dim3 grid(ctas * p.tokens);
    const LaunchOptions cut{0, ctas, programmatic};
    return WithCutThreads(vpr / ctas, [&](auto threads) {
      return LaunchKernel(OneShotRowsKernel<T, kMaxN, threads>, grid, dim3(threads), cut, stream,
                          p);
    });
  }
  return LaunchKernel(OneShotRowsKernel<T, kMaxN, 0>, dim3(num_ctas), dim3(kThreads),
                      {0, 1, programmatic}, stream, p);
}

template <typename T>
cudaError_t LaunchRows(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  if (p.nranks <= 2) return LaunchFor<T, 2>(p, num_ctas, stream);
  if (p.nranks <= 4) return LaunchFor<T, 4>(p, num_ctas, stream);
  return LaunchFor<T, 8>(p, num_ctas, stream);
}

template <typename T, int kMaxN>
cudaError_t PreloadRowsOf() {
  cudaFuncAttributes a;
  for (const void* k : {reinterpret_cast<const void*>(OneShotRowsKernel<T, kMaxN, 0>),
                        reinterpret_cast<const void*>(OneShotRowsKernel<T, kMaxN, 128>),
                        reinterpret_cast<const void*>(OneShotRowsKernel<T, kMaxN, 256>),
                        reinterpret_cast<const void*>(OneShotRowsKernel<T, kMaxN, kMaxCutBlock>)})
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

template <typename T>
cudaError_t PreloadRowsFor() {
  for (cudaError_t e : {PreloadRowsOf<T, 2>(), PreloadRowsOf<T, 4>(), PreloadRowsOf<T, 8>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace

bool OneShotRowsFits(int tokens, int hidden, DType dtype, int num_ctas) {
  const int itemsize = dtype == DType::kF32 ? 4 : 2;
  return tokens <= num_ctas && hidden * itemsize <= kRowV * kThreads * 16;
}

cudaError_t LaunchOneShotRows(const KernelParams& p, DType dtype, int num_ctas,
                              cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return LaunchRows<float>(p, num_ctas, stream);
    case DType::kF16: return LaunchRows<__half>(p, num_ctas, stream);
    case DType::kBF16: return LaunchRows<__nv_bfloat16>(p, num_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PreloadOneShotRowsKernels() {
  for (cudaError_t e :
       {PreloadRowsFor<float>(), PreloadRowsFor<__half>(), PreloadRowsFor<__nv_bfloat16>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace tokenweave
