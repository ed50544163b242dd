// The barrier-based fused AllReduce + residual add + RMSNorm kernels and the launcher of every
// variant (one launch per call).
//
// two-shot (P2P push):  (a) push the rows of `partial` owned by rank j into rank j's reduce-
//   scatter area; (b) barrier; (c) owner rows: sum the N partials + residual in float32, write
//   residual_out, RMSNorm, write normed locally and push it into every peer's all-gather area;
//   (d) barrier; (e) copy the peers' normed rows from the local all-gather area into `normed`.
// direct (P2P, nothing staged): each rank publishes the addresses of its own `partial` and
//   `normed` (XLA's buffers; peer access makes them reachable) in its workspace mailbox;
//   barrier; owner rows: pull the N partials' rows straight from the peers' `partial`, add the
//   residual, RMSNorm, store the normed rows into every rank's `normed`; barrier (so no rank
//   returns, and lets XLA reuse its buffers, while a peer still reads or writes them).
// The one-shot (Lamport, no barrier) kernel is in oneshot.cu, multimem in multimem.cuh.
// PreloadKernels loads every kernel into the current device's context up front: with CUDA's
// lazy loading (the default), a kernel's first launch can wait for the device to go idle,
// which never happens while a fused kernel spins waiting for a peer.
//
// Sync state lives on the device (kernels.cuh: BeginCall): the slot's epoch picks the
// data area's parity, so call k+1's pushes never land on what call k still reads. A wait that
// expires marks the group failed and the kernel returns with NaN outputs (no trap).
// Partials are summed in rank order 0..N-1 and then the residual, in every variant, so every
// rank's normed rows are bitwise identical.
#include "multimem.cuh"
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kGroup = 128;  // threads per row: 4 rows per block at once
constexpr int kGroups = kThreads / kGroup;

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kThreads / 32];
  const CallState call = BeginCall(p);
  if (call.abort) return PoisonOutputs<T>(p);
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t parity = (call.epoch & 1) * p.area_bytes;
  const int64_t ag = (n - 1) * q * rb;  // the all-gather area follows the reduce-scatter area
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);

  // (a) reduce-scatter by push, peers in rotated order (rank r starts with r+1).
  RowCopy<true>((n - 1) * q, vpr, [&](int i, const char*& s, char*& d) {
    const int k = i / q, row = i % q;
    const int j = (r + 1 + k) % n, g = j * q + row;
    if (g >= tokens) return;
    s = partial + g * rb;
    d = p.data[j] + parity + (PeerIndex(r, j, n) * q + row) * rb;
  });
  if (!Barrier(p, kStageBarrier0, call.epoch)) return PoisonOutputs<T>(p);

  // (c) own rows.
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow<kGroup>(res_in, residual_out + row * rb, vpr);
      continue;
    }
    const char* rows[kMaxN + 1];  // the N partials in rank order, then the residual
    StagedSources<kMaxN>(rows, n, r, partial, p.data[r] + parity, res_in, q, row, rb);
    FusedRow<T, kGroup, kURows<kMaxN>, false>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {
          LoadSum<T, kGroup, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        residual_out + row * rb, normed + g * rb,
        [&](int v, uint4 o) {
          St(normed + g * rb + v * 16, o);
          for (int k = 1; k < n; ++k) {
            const int j = (r + k) % n;
            St(p.data[j] + parity + ag + (PeerIndex(r, j, n) * q + row) * rb + v * 16, o);
          }
        },
        red, group);
  }
  if (!Barrier(p, kStageBarrier1, call.epoch)) return PoisonOutputs<T>(p);

  // (e) the peers' normed rows.
  RowCopy<false>((n - 1) * q, vpr, [&](int i, const char*& s, char*& d) {
    const int k = i / q, row = i % q;
    const int src = (r + 1 + k) % n, g = src * q + row;
    if (g >= tokens) return;
    s = p.data[r] + parity + ag + (PeerIndex(src, r, n) * q + row) * rb;
    d = normed + g * rb;
  });
}

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) DirectKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kThreads / 32];
  __shared__ const char* peer_partial[kMaxRanks];
  __shared__ char* peer_normed[kMaxRanks];
  const CallState call = BeginCall(p);
  if (call.abort) return PoisonOutputs<T>(p);
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t parity = (call.epoch & 1) * p.area_bytes;
  const char* residual = static_cast<const char*>(p.residual);
  char* residual_out = static_cast<char*>(p.residual_out);

  // (a) publish this rank's buffers; the barrier makes them visible to every peer. The mailbox
  // alternates with the epoch's parity, so a peer still reading call k's never sees call k+1's.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long* box = reinterpret_cast<unsigned long long*>(p.data[r] + parity);
    box[0] = reinterpret_cast<unsigned long long>(p.partial);
    box[1] = reinterpret_cast<unsigned long long>(p.normed);
  }
  if (!Barrier(p, kStageBarrier0, call.epoch)) return PoisonOutputs<T>(p);
  if (threadIdx.x < n) {
    const unsigned long long* box =
        reinterpret_cast<const unsigned long long*>(p.data[threadIdx.x] + parity);
    peer_partial[threadIdx.x] = reinterpret_cast<const char*>(__ldcg(box));
    peer_normed[threadIdx.x] = reinterpret_cast<char*>(__ldcg(box + 1));
  }
  __syncthreads();

  // (b) own rows: pull, reduce, norm, push to every rank (self first).
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow<kGroup>(res_in, residual_out + row * rb, vpr);
      continue;
    }
    const char* rows[kMaxN + 1];  // the N partials in rank order, then the residual
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src < n) rows[src] = peer_partial[src] + g * rb;
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src == n) rows[src] = res_in;
    rows[kMaxN] = res_in;
    char* own = static_cast<char*>(p.normed) + g * rb;
    FusedRow<T, kGroup, kURows<kMaxN>, false>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {
          LoadSum<T, kGroup, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        residual_out + row * rb, own,
        [&](int v, uint4 o) {
          St(own + v * 16, o);
          for (int k = 1; k < n; ++k) St(peer_normed[(r + k) % n] + g * rb + v * 16, o);
        },
        red, group);
  }
  if (!Barrier(p, kStageBarrier1, call.epoch)) return PoisonOutputs<T>(p);
}

template <typename T, int kMaxN>
void LaunchP2P(const KernelParams& p, Algo algo, int num_ctas, cudaStream_t stream) {
  if (algo == Algo::kDirect)
    DirectKernel<T, kMaxN><<<num_ctas, kThreads, 0, stream>>>(p);
  else
    TwoShotKernel<T, kMaxN><<<num_ctas, kThreads, 0, stream>>>(p);
}

template <typename T>
cudaError_t Launch(const KernelParams& p, Algo algo, bool multimem, int num_ctas,
                   cudaStream_t stream) {
  static_assert(kMaxRanks == 8, "LaunchP2P instances cover groups of up to 8 ranks");
  if (multimem) return LaunchMultimem<T>(p, num_ctas, stream);
  if (p.nranks <= 2)
    LaunchP2P<T, 2>(p, algo, num_ctas, stream);
  else if (p.nranks <= 4)
    LaunchP2P<T, 4>(p, algo, num_ctas, stream);
  else
    LaunchP2P<T, 8>(p, algo, num_ctas, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PreloadFor() {
  cudaFuncAttributes a;
  const void* kernels[] = {reinterpret_cast<const void*>(TwoShotKernel<T, 2>),
                           reinterpret_cast<const void*>(TwoShotKernel<T, 4>),
                           reinterpret_cast<const void*>(TwoShotKernel<T, 8>),
                           reinterpret_cast<const void*>(DirectKernel<T, 2>),
                           reinterpret_cast<const void*>(DirectKernel<T, 4>),
                           reinterpret_cast<const void*>(DirectKernel<T, 8>),
                           reinterpret_cast<const void*>(multimem::MultimemKernel<T>)};
  for (const void* k : kernels)
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace

cudaError_t PreloadKernels() {
  for (cudaError_t e : {PreloadFor<float>(), PreloadFor<__half>(), PreloadFor<__nv_bfloat16>()})
    if (e != cudaSuccess) return e;
  if (cudaError_t e = PreloadLocalRowsKernels(); e != cudaSuccess) return e;
  if (cudaError_t e = PreloadCeKernels(); e != cudaSuccess) return e;
  return PreloadOneShotKernels();
}

cudaError_t LaunchAllreduceRmsnorm(const KernelParams& p, DType dtype, Algo algo, bool multimem,
                                   int num_ctas, cudaStream_t stream) {
  if (p.residual_replicated != 0 &&
      !ResidualReplicatedFits(p.nranks, p.tokens, p.hidden, dtype, algo, multimem, num_ctas))
    return cudaErrorInvalidValue;  // the handlers refuse it first, with the reason
  if (p.nranks == 1 && !multimem) return LaunchLocalRows(p, dtype, stream);
  if (algo == Algo::kCopyEngine) return cudaErrorInvalidValue;  // stream work: IssueCopyEngineCall
  if (algo == Algo::kOneShot && !multimem) return LaunchOneShot(p, dtype, num_ctas, stream);
  switch (dtype) {
    case DType::kF32: return Launch<float>(p, algo, multimem, num_ctas, stream);
    case DType::kF16: return Launch<__half>(p, algo, multimem, num_ctas, stream);
    case DType::kBF16: return Launch<__nv_bfloat16>(p, algo, multimem, num_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tokenweave
