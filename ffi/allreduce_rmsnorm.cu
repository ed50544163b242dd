// The fused AllReduce + residual add + RMSNorm kernels (one launch per call).
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
//   Moves the least data: no copy into or out of the workspace.
// one-shot (small messages): push the whole partial and the own residual rows to every peer,
//   one barrier, every rank reduces and normalises all T rows itself.
// multimem (sm_90, opt-in): two-shot with multimem.ld_reduce / multimem.st on a multicast
//   mapping instead of the pushes.
// Partials are summed in rank order 0..N-1 and then the residual, in every variant, so every
// rank's normed rows are bitwise identical.
#include "kernels.cuh"

namespace tokenweave {
namespace {

constexpr int kGroup = 128;                  // threads per row: 4 rows per block at once
constexpr int kGroups = kThreads / kGroup;
constexpr int kU = 4;                        // vectors per source per thread (copies, multimem)

// Vectors per source per thread in the reduce phase of a kernel built for up to kMaxN ranks:
// all (kMaxN + 1) x kURows loads of a step are issued before the first add, 9-10 in flight.
template <int kMaxN>
constexpr int kURows = kMaxN <= 2 ? 3 : (kMaxN <= 4 ? 2 : 1);

__device__ __forceinline__ void GroupSync(int group) {
  asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(kGroup) : "memory");
}

// Sum over the kGroup threads of one row group (all of them get it). red: kThreads/32 floats.
__device__ __forceinline__ float GroupSum(float v, float* red, int group) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, w = (threadIdx.x % kGroup) / 32;
  GroupSync(group);  // the previous row's reads of red are done
  if (lane == 0) red[group * (kGroup / 32) + w] = v;
  GroupSync(group);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kGroup / 32; ++i) s += red[group * (kGroup / 32) + i];
  return s;
}

// One row, by one group of kGroup threads. load_sum(v, acc) adds vector v's partials + residual
// into acc. Pass 1 rounds the sum to T, writes it to res_out (if not null) and stages it in the
// thread's own `stage` locations (the normed row, overwritten in pass 2 by the same thread);
// pass 2 normalises and hands each normed vector to emit(v, o).
template <typename T, int kU, typename LoadSum, typename Emit>
__device__ __forceinline__ void FusedRow(const KernelParams& p, LoadSum load_sum, char* res_out,
                                         char* stage, Emit emit, float* red, int group) {
  constexpr int kN = Vec<T>::kN;
  const int vpr = p.hidden / kN, lane = threadIdx.x % kGroup;
  float ss = 0.f;
  for (int v0 = lane; v0 < vpr; v0 += kGroup * kU) {
    float acc[kU][kN];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int i = 0; i < kN; ++i) acc[u][i] = 0.f;
    load_sum(v0, acc);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * kGroup;
      if (v < vpr) {
        const uint4 rounded = PackRound<T>(acc[u]);
        if (res_out != nullptr) St(res_out + v * 16, rounded);
        St(stage + v * 16, rounded);
#pragma unroll
        for (int i = 0; i < kN; ++i) ss += acc[u][i] * acc[u][i];
      }
    }
  }
  const float inv = rsqrtf(GroupSum(ss, red, group) / static_cast<float>(p.hidden) + p.eps);
  for (int v0 = lane; v0 < vpr; v0 += kGroup * kU) {
    uint4 x[kU];
    float4 w[kU][kN / 4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * kGroup;
      if (v < vpr) {
        x[u] = *reinterpret_cast<const uint4*>(stage + v * 16);  // own pass-1 store
        const float4* wp = reinterpret_cast<const float4*>(p.weight + v * kN);
#pragma unroll
        for (int i = 0; i < kN / 4; ++i) w[u][i] = __ldg(wp + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * kGroup;
      if (v < vpr) {
        float f[kN];
        const T* e = reinterpret_cast<const T*>(&x[u]);
        const float* wf = reinterpret_cast<const float*>(w[u]);
#pragma unroll
        for (int i = 0; i < kN; ++i) f[i] = ToF(e[i]) * inv * wf[i];
        emit(v, PackRound<T>(f));
      }
    }
  }
}

// Adds vector v0 + u*kGroup (u < kU, v < vpr) of row `src` into acc[u]; kNc: read-only input.
template <typename T, bool kNc>
__device__ __forceinline__ void AddRow(float (*acc)[Vec<T>::kN], const char* row, int v0, int vpr) {
  uint4 x[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int v = v0 + u * kGroup;
    if (v < vpr) x[u] = kNc ? Ldg(row + v * 16) : Ldcg(row + v * 16);
  }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (v0 + u * kGroup < vpr) AddVec<T>(acc[u], x[u]);
}

// Adds vectors v0 + u*kGroup (u < kU, v < vpr) of the first `ns` of `rows` into acc[u], in row
// order. Every load of the step is issued before the first add (kS*kU in flight per thread):
// the reduce phase is bound by load latency, not bandwidth, at a handful of CTAs.
template <typename T, int kS, int kU>
__device__ __forceinline__ void LoadSum(float (*acc)[Vec<T>::kN], const char* const* rows, int ns,
                                        int v0, int vpr) {
  uint4 x[kS][kU];
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (s < ns && v0 + u * kGroup < vpr) x[s][u] = Ldcg(rows[s] + (v0 + u * kGroup) * 16);
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (s < ns && v0 + u * kGroup < vpr) AddVec<T>(acc[u], x[s][u]);
}

// residual_out row = residual row (padding rows past T), by one group.
__device__ __forceinline__ void CopyRow(const char* src, char* dst, int vpr) {
  for (int v = threadIdx.x % kGroup; v < vpr; v += kGroup) St(dst + v * 16, Ldg(src + v * 16));
}

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(KernelParams p) {
  __shared__ float red[kThreads / 32];
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
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
    d = p.data[j] + (PeerIndex(r, j, n) * q + row) * rb;
  });
  Barrier(p, 0);

  // (c) own rows.
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow(res_in, residual_out + row * rb, vpr);
      continue;
    }
    const char* rows[kMaxN + 1];  // the N partials in rank order, then the residual
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src < n)
        rows[src] = src == r ? partial + g * rb
                             : p.data[r] + (PeerIndex(src, r, n) * q + row) * rb;
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src == n) rows[src] = res_in;
    rows[kMaxN] = res_in;
    FusedRow<T, kURows<kMaxN>>(
        p,
        [&](int v0, float (*acc)[Vec<T>::kN]) {
          LoadSum<T, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        residual_out + row * rb, normed + g * rb,
        [&](int v, uint4 o) {
          St(normed + g * rb + v * 16, o);
          for (int k = 1; k < n; ++k) {
            const int j = (r + k) % n;
            St(p.data[j] + ag + (PeerIndex(r, j, n) * q + row) * rb + v * 16, o);
          }
        },
        red, group);
  }
  Barrier(p, 1);

  // (e) the peers' normed rows.
  RowCopy<false>((n - 1) * q, vpr, [&](int i, const char*& s, char*& d) {
    const int k = i / q, row = i % q;
    const int src = (r + 1 + k) % n, g = src * q + row;
    if (g >= tokens) return;
    s = p.data[r] + ag + (PeerIndex(src, r, n) * q + row) * rb;
    d = normed + g * rb;
  });
}

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) OneShotKernel(KernelParams p) {
  __shared__ float red[kThreads / 32];
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t res_area = (n - 1) * static_cast<int64_t>(tokens) * rb;  // after the partials
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);
  const int own_real = max(0, min(q, tokens - r * q));  // own rows below T

  // (a) every row of partial, then the own real residual rows, to every peer.
  RowCopy<true>((n - 1) * (tokens + q), vpr, [&](int i, const char*& s, char*& d) {
    const int k = i / (tokens + q), row = i % (tokens + q);
    const int j = (r + 1 + k) % n, pi = PeerIndex(r, j, n);
    if (row < tokens) {
      s = partial + row * rb;
      d = p.data[j] + (static_cast<int64_t>(pi) * tokens + row) * rb;
    } else if (row - tokens < own_real) {
      s = residual + (row - tokens) * rb;
      d = p.data[j] + res_area + (static_cast<int64_t>(pi) * q + row - tokens) * rb;
    }
  });
  Barrier(p, 0);

  // (c) all T rows here, then the own padding rows.
  for (int idx = blockIdx.x * kGroups + group; idx < tokens + q - own_real;
       idx += gridDim.x * kGroups) {
    if (idx >= tokens) {
      const int row = own_real + idx - tokens;
      CopyRow(residual + row * rb, residual_out + row * rb, vpr);
      continue;
    }
    const int g = idx, owner = g / q, row = g % q;
    const char* res_row =
        owner == r
            ? residual + row * rb
            : p.data[r] + res_area + (static_cast<int64_t>(PeerIndex(owner, r, n)) * q + row) * rb;
    const char* rows[kMaxN + 1];  // the N partials in rank order, then the residual
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src < n)
        rows[src] = src == r ? partial + g * rb
                             : p.data[r] +
                                   (static_cast<int64_t>(PeerIndex(src, r, n)) * tokens + g) * rb;
#pragma unroll
    for (int src = 0; src < kMaxN; ++src)
      if (src == n) rows[src] = res_row;
    rows[kMaxN] = res_row;
    FusedRow<T, kURows<kMaxN>>(
        p,
        [&](int v0, float (*acc)[Vec<T>::kN]) {
          LoadSum<T, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        owner == r ? residual_out + row * rb : nullptr, normed + g * rb,
        [&](int v, uint4 o) { St(normed + g * rb + v * 16, o); }, red, group);
  }
}

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) DirectKernel(KernelParams p) {
  __shared__ float red[kThreads / 32];
  __shared__ const char* peer_partial[kMaxRanks];
  __shared__ char* peer_normed[kMaxRanks];
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const char* residual = static_cast<const char*>(p.residual);
  char* residual_out = static_cast<char*>(p.residual_out);

  // (a) publish this rank's buffers; the barrier makes them visible to every peer.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long* box = reinterpret_cast<unsigned long long*>(p.data[r]);
    box[0] = reinterpret_cast<unsigned long long>(p.partial);
    box[1] = reinterpret_cast<unsigned long long>(p.normed);
  }
  Barrier(p, 0);
  if (threadIdx.x < n) {
    const unsigned long long* box =
        reinterpret_cast<const unsigned long long*>(p.data[threadIdx.x]);
    peer_partial[threadIdx.x] = reinterpret_cast<const char*>(__ldcg(box));
    peer_normed[threadIdx.x] = reinterpret_cast<char*>(__ldcg(box + 1));
  }
  __syncthreads();

  // (b) own rows: pull, reduce, norm, push to every rank (self first).
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow(res_in, residual_out + row * rb, vpr);
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
    FusedRow<T, kURows<kMaxN>>(
        p,
        [&](int v0, float (*acc)[Vec<T>::kN]) {
          LoadSum<T, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        residual_out + row * rb, own,
        [&](int v, uint4 o) {
          St(own + v * 16, o);
          for (int k = 1; k < n; ++k) St(peer_normed[(r + k) % n] + g * rb + v * 16, o);
        },
        red, group);
  }
  Barrier(p, 1);
}

// ---- multimem (NVLink SHARP) variant: sm_90 only, opt-in, never run on shared machines. ----
template <typename T> __device__ __forceinline__ uint4 MultimemLdReduce(const void* mc);
template <> __device__ __forceinline__ uint4 MultimemLdReduce<float>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(mc) : "memory");
#else
  __trap();
#endif
  return v;
}
template <> __device__ __forceinline__ uint4 MultimemLdReduce<__half>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(mc) : "memory");
#else
  __trap();
#endif
  return v;
}
template <> __device__ __forceinline__ uint4 MultimemLdReduce<__nv_bfloat16>(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(mc) : "memory");
#else
  __trap();
#endif
  return v;
}
__device__ __forceinline__ void MultimemSt(void* mc, uint4 v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
               ::"l"(mc), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void FenceProxyAlias() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.alias;" ::: "memory");
#endif
}

// Area layout (symmetric on every rank): IN [N*q rows][H], then OUT [N*q rows][H].
template <typename T>
__global__ void __launch_bounds__(kThreads) MultimemKernel(KernelParams p) {
  __shared__ float red[kThreads / 32];
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t out_area = static_cast<int64_t>(n) * q * rb;
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);

  // (a) partial into the own copy of the symmetric IN area.
  RowCopy<true>(tokens, vpr, [&](int i, const char*& s, char*& d) {
    s = partial + i * rb;
    d = p.data[r] + i * rb;
  });
  FenceProxyAlias();
  Barrier(p, 0);
  // (c) own rows: the switch sums the N copies; normed goes to every rank with one store.
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow(res_in, residual_out + row * rb, vpr);
      continue;
    }
    FusedRow<T, kU>(
        p,
        [&](int v0, float (*acc)[Vec<T>::kN]) {
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (v0 + u * kGroup < vpr)
              AddVec<T>(acc[u], MultimemLdReduce<T>(p.mc_data + g * rb + (v0 + u * kGroup) * 16));
          AddRow<T, true>(acc, res_in, v0, vpr);
        },
        residual_out + row * rb, normed + g * rb,
        [&](int v, uint4 o) { MultimemSt(p.mc_data + out_area + g * rb + v * 16, o); }, red,
        group);
  }
  FenceProxyAlias();
  Barrier(p, 1);
  // (e) all normed rows from the local OUT area.
  RowCopy<false>(tokens, vpr, [&](int i, const char*& s, char*& d) {
    s = p.data[r] + out_area + i * rb;
    d = normed + i * rb;
  });
}

template <typename T, int kMaxN>
void LaunchP2P(const KernelParams& p, Algo algo, int num_ctas, cudaStream_t stream) {
  if (algo == Algo::kOneShot)
    OneShotKernel<T, kMaxN><<<num_ctas, kThreads, 0, stream>>>(p);
  else if (algo == Algo::kDirect)
    DirectKernel<T, kMaxN><<<num_ctas, kThreads, 0, stream>>>(p);
  else
    TwoShotKernel<T, kMaxN><<<num_ctas, kThreads, 0, stream>>>(p);
}

template <typename T>
cudaError_t Launch(const KernelParams& p, Algo algo, bool multimem, int num_ctas,
                   cudaStream_t stream) {
  static_assert(kMaxRanks == 8, "LaunchP2P instances cover groups of up to 8 ranks");
  if (multimem)
    MultimemKernel<T><<<num_ctas, kThreads, 0, stream>>>(p);
  else if (p.nranks <= 2)
    LaunchP2P<T, 2>(p, algo, num_ctas, stream);
  else if (p.nranks <= 4)
    LaunchP2P<T, 4>(p, algo, num_ctas, stream);
  else
    LaunchP2P<T, 8>(p, algo, num_ctas, stream);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAllreduceRmsnorm(const KernelParams& p, DType dtype, Algo algo, bool multimem,
                                   int num_ctas, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return Launch<float>(p, algo, multimem, num_ctas, stream);
    case DType::kF16: return Launch<__half>(p, algo, multimem, num_ctas, stream);
    case DType::kBF16: return Launch<__nv_bfloat16>(p, algo, multimem, num_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace tokenweave
