// The one-shot fused kernel for small messages: a Lamport-style protocol with no barrier.
//
// Every rank pushes its whole `partial` [T, H] and its own real residual rows into every
// peer's receive buffer, encoded so that no element is the sentinel (kernels.cuh); then it
// polls its *local* receive buffer until the elements it needs are no longer the sentinel
// (a negative-zero sent as +0 changes no sum), and reduces
// and RMSNorms all T rows itself (partials in rank order, then the residual, float32: the same
// bits on every rank and as the two-shot/direct kernels). No flag, no round trip.
//
// Receive buffers rotate in three per slot (SlotControl::word holds the next one). Call k
// writes buffer k%3 on its peers and clears its own buffer (k-1)%3, which it finished reading
// in call k-1 (so every word a peer wrote there had arrived); a peer can be at most one call
// ahead (call k+1 needs this rank's call-k data), so it writes buffer (k+1)%3, cleared during
// call k-1, and the earliest write into (k-1)%3 again is call k+2, after this kernel ended.
// Layout of one buffer (per receiver): N-1 segments by PeerIndex(src, dst), each
// [T partial rows | q residual rows] of H elements.
#include "rowops.cuh"

namespace tokenweave {
namespace {

// Like LoadSum, but sources with from[s] >= 0 are this rank's receive buffer, written by rank
// from[s]: polled until no word is the sentinel. `ok` turns false (and stays false) when a wait
// expired or the group failed; the caller then poisons its outputs.
template <typename T, int kGroup, int kS, int kU>
__device__ __forceinline__ void PollSum(const KernelParams& p, float (*acc)[Vec<T>::kN],
                                        const char* const* rows, const int* from, int ns, int v0,
                                        int vpr, uint32_t epoch, bool& ok) {
  uint4 x[kS][kU];
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (s < ns && v0 + u * kGroup < vpr) {
        const char* a = rows[s] + (v0 + u * kGroup) * 16;
        x[s][u] = from[s] < 0 ? Ldg(a) : LdVolatile16(a);
      }
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (s < ns && v0 + u * kGroup < vpr && from[s] >= 0 && HasSentinel<T>(x[s][u])) {
        const char* a = rows[s] + (v0 + u * kGroup) * 16;
        Deadline d;
        while (ok && HasSentinel<T>(x[s][u] = LdVolatile16(a))) {
          const Deadline::Result r = d.Tick(p);
          if (r == Deadline::kWait) continue;
          if (r == Deadline::kExpired) ReportTimeout(p, kStageOneShotData, from[s], -1, epoch, 0);
          ok = false;
        }
      }
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (s < ns && v0 + u * kGroup < vpr) AddVec<T>(acc[u], x[s][u]);
}

// Vectors per source per thread: 512-thread rows hold H=8192 bf16 in registers with 2, 256-
// thread rows with 4 (one pass, kernels.cuh FusedRow), at up to 4 and 2 ranks.
template <int kMaxN, int kGroup>
constexpr int kOneShotU = kGroup == kThreads ? (kMaxN <= 4 ? 2 : 1)
                          : kGroup == 256    ? (kMaxN <= 2 ? 4 : (kMaxN <= 4 ? 2 : 1))
                                             : (kMaxN <= 2 ? 2 : kURows<kMaxN>);

// Writes NaN into the rows this block's group owns in (c) and (d) below: the same partition,
// so a failed call leaves NaN in every output element (only the owner writes an element, and
// its NaN comes after its own earlier write in program order).
template <typename T, int kGroup>
__device__ __forceinline__ void PoisonOwnRows(const KernelParams& p, int own_real) {
  constexpr int kGroups = kThreads / kGroup;
  const int group = threadIdx.x / kGroup, q = p.rows, vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const uint4 nan = NanVec<T>();
  auto fill = [&](char* row) {
    for (int v = threadIdx.x % kGroup; v < vpr; v += kGroup) St(row + v * 16, nan);
  };
  for (int g = blockIdx.x * kGroups + group; g < p.tokens; g += gridDim.x * kGroups) {
    fill(static_cast<char*>(p.normed) + g * rb);
    if (g / q == p.rank) fill(static_cast<char*>(p.residual_out) + (g % q) * rb);
  }
  for (int row = own_real + blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups)
    fill(static_cast<char*>(p.residual_out) + row * rb);
}

template <typename T, int kMaxN, int kGroup>
__global__ void __launch_bounds__(kThreads) OneShotKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kThreads / 32];
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t seg = static_cast<int64_t>(tokens + q) * rb;
  const CallState call = BeginCall(p, (n - 1) * seg);
  constexpr int kGroups = kThreads / kGroup;
  constexpr int kU = kOneShotU<kMaxN, kGroup>;
  const int group = threadIdx.x / kGroup;
  const int own_real = max(0, min(q, tokens - r * q));  // own residual rows below T
  if (call.abort) return PoisonOwnRows<T, kGroup>(p, own_real);
  const int vpr = p.hidden / Vec<T>::kN;
  const uint32_t buf = call.oneshot_buf;
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);
  const char* recv = p.oneshot[r] + buf * p.oneshot_bytes;

  // (a) partial rows, then own real residual rows (segment rows T..), to every peer, rotated.
  const int send_rows = tokens + own_real;
  RowCopy<true, T>((n - 1) * send_rows, vpr, [&](int i, const char*& s, char*& d) {
    const int k = i / send_rows, row = i % send_rows;
    const int j = (r + 1 + k) % n;
    s = row < tokens ? partial + row * rb : residual + (row - tokens) * rb;
    d = p.oneshot[j] + buf * p.oneshot_bytes + PeerIndex(r, j, n) * seg + row * rb;
  });

  // (b) clear what the previous one-shot call on this slot received.
  FillSentinel(PreviousOneShotBuffer(p, buf), call.oneshot_clear);

  // (c) every row here: N partials in rank order, then its owner's residual row.
  bool ok = true;
  for (int g = blockIdx.x * kGroups + group; g < tokens; g += gridDim.x * kGroups) {
    const int owner = g / q, orow = g % q;
    const char* res_row = owner == r ? residual + orow * rb
                                     : recv + PeerIndex(owner, r, n) * seg + (tokens + orow) * rb;
    const char* rows[kMaxN + 1];
    int from[kMaxN + 1];
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src < n) {
        rows[src] = src == r ? partial + g * rb : recv + PeerIndex(src, r, n) * seg + g * rb;
        from[src] = src == r ? -1 : src;
      }
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src == n) {
        rows[src] = res_row;
        from[src] = owner == r ? -1 : owner;
      }
    rows[kMaxN] = res_row;
    from[kMaxN] = owner == r ? -1 : owner;
    FusedRow<T, kGroup, kU, (kGroup >= 256)>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {
          PollSum<T, kGroup, kMaxN + 1, kU>(p, acc, rows, from, n + 1, v0, vpr, call.epoch, ok);
        },
        owner == r ? residual_out + orow * rb : nullptr, normed + g * rb,
        [&](int v, uint4 o) { St(normed + g * rb + v * 16, o); }, red, group);
  }
  // (d) own padding rows of the residual are carried through.
  for (int row = own_real + blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups)
    CopyRow<kGroup>(residual + row * rb, residual_out + row * rb, vpr);

  // Only a block whose own wait failed lacks data; every other block's rows are complete.
  if (__syncthreads_or(!ok)) PoisonOwnRows<T, kGroup>(p, own_real);
}

template <typename T, int kMaxN>
void LaunchN(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  // The widest rows that still give every row its own group (decode sizes): a row's reduce
  // and norm are latency-bound, so rows in parallel beat rows in sequence.
  if (p.tokens <= num_ctas)
    OneShotKernel<T, kMaxN, kThreads><<<num_ctas, kThreads, 0, stream>>>(p);
  else if (p.tokens <= 2 * num_ctas)
    OneShotKernel<T, kMaxN, 256><<<num_ctas, kThreads, 0, stream>>>(p);
  else
    OneShotKernel<T, kMaxN, 128><<<num_ctas, kThreads, 0, stream>>>(p);
}

template <typename T>
cudaError_t Launch(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  if (p.nranks <= 2)
    LaunchN<T, 2>(p, num_ctas, stream);
  else if (p.nranks <= 4)
    LaunchN<T, 4>(p, num_ctas, stream);
  else
    LaunchN<T, 8>(p, num_ctas, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PreloadFor() {
  cudaFuncAttributes a;
  const void* kernels[] = {reinterpret_cast<const void*>(OneShotKernel<T, 2, 128>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 4, 128>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 8, 128>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 2, 256>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 4, 256>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 8, 256>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 2, kThreads>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 4, kThreads>),
                           reinterpret_cast<const void*>(OneShotKernel<T, 8, kThreads>)};
  for (const void* k : kernels)
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

__global__ void FillSentinelKernel(char* dst, int64_t bytes) { FillSentinel(dst, bytes); }

}  // namespace

cudaError_t LaunchOneShot(const KernelParams& p, DType dtype, int num_ctas, cudaStream_t stream) {
  if (OneShotRowsFits(p.tokens, p.hidden, dtype, num_ctas))
    return LaunchOneShotRows(p, dtype, num_ctas, stream);
  switch (dtype) {
    case DType::kF32: return Launch<float>(p, num_ctas, stream);
    case DType::kF16: return Launch<__half>(p, num_ctas, stream);
    case DType::kBF16: return Launch<__nv_bfloat16>(p, num_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PreloadOneShotKernels() {
  for (cudaError_t e : {PreloadFor<float>(), PreloadFor<__half>(), PreloadFor<__nv_bfloat16>(),
                        PreloadOneShotRowsKernels()})
    if (e != cudaSuccess) return e;
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(FillSentinelKernel));
}

cudaError_t LaunchFillSentinel(void* ptr, int64_t bytes, cudaStream_t stream) {
  if (bytes % 16 != 0) return cudaErrorInvalidValue;
  FillSentinelKernel<<<256, 256, 0, stream>>>(static_cast<char*>(ptr), bytes);
  return cudaGetLastError();
}

}  // namespace tokenweave
