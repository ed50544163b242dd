// Row operations shared by the fused kernels: a group of kGroup threads reduces one token row
// (N partials in rank order, then the residual, in float32), writes the rounded sum, and
// RMSNorms it. All ranks sum in the same order, so their normed rows are bitwise identical.
#pragma once

#include "kernels.cuh"

namespace tokenweave {

// Vectors per source per thread in the reduce phase of a kernel built for up to kMaxN ranks,
// rows of 128 threads: all (kMaxN + 1) x kURows loads of a step are issued before the first
// add, 9-10 in flight.
template <int kMaxN>
constexpr int kURows = kMaxN <= 2 ? 3 : (kMaxN <= 4 ? 2 : 1);

template <int kGroup>
__device__ __forceinline__ void GroupSync(int group) {
  if constexpr (kGroup == kThreads) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(kGroup) : "memory");
  }
}

// Sum over the kGroup threads of one row group (all of them get it). red: kThreads/32 floats.
template <int kGroup>
__device__ __forceinline__ float GroupSum(float v, float* red, int group) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  constexpr int kWarps = kGroup / 32;
  const int lane = threadIdx.x % 32, w = (threadIdx.x % kGroup) / 32;
  GroupSync<kGroup>(group);  // the previous row's reads of red are done
  if (lane == 0) red[group * kWarps + w] = v;
  GroupSync<kGroup>(group);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) s += red[group * kWarps + i];
  return s;
}

// One step of pass 1: acc = the sources of vectors v0 + u*kGroup (u < kU) via load_sum,
// rounded to T (acc keeps the rounded values), written to res_out and stage (each if not
// null). Returns the step's sum of squares.
template <typename T, int kGroup, int kU, typename LoadSum>
__device__ __forceinline__ float SumStep(LoadSum& load_sum, int v0, int vpr,
                                         float (*acc)[Vec<T>::kN], char* res_out, char* stage) {
  constexpr int kN = Vec<T>::kN;
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int i = 0; i < kN; ++i) acc[u][i] = 0.f;
  load_sum(v0, acc);
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int v = v0 + u * kGroup;
    if (v < vpr) {
      const uint4 rounded = PackRound<T>(acc[u]);
      if (res_out != nullptr) St(res_out + v * 16, rounded);
      if (stage != nullptr) St(stage + v * 16, rounded);
#pragma unroll
      for (int i = 0; i < kN; ++i) ss += acc[u][i] * acc[u][i];
    }
  }
  return ss;
}

// The weights of vector v (kN floats), from float32 or from the rows' dtype (one 16-byte load,
// converted exactly).
template <typename T>
__device__ __forceinline__ void LoadWeights(const KernelParams& p, int v, float4* w) {
  if (sizeof(T) == 2 && p.weight_in_dtype) {
    const uint4 x = Ldg(static_cast<const char*>(p.weight) + v * 16);
    const T* e = reinterpret_cast<const T*>(&x);
    float* f = reinterpret_cast<float*>(w);
#pragma unroll
    for (int i = 0; i < Vec<T>::kN; ++i) f[i] = ToF(e[i]);
    return;
  }
#pragma unroll
  for (int i = 0; i < Vec<T>::kN / 4; ++i)
    w[i] = __ldg(
        reinterpret_cast<const float4*>(static_cast<const float*>(p.weight) + v * Vec<T>::kN) + i);
}

// emit(v, x * inv * w), rounded to T.
template <typename T, typename Emit>
__device__ __forceinline__ void EmitNormed(const float* x, const float4* w, float inv, int v,
                                           Emit& emit) {
  float f[Vec<T>::kN];
  const float* wf = reinterpret_cast<const float*>(w);
#pragma unroll
  for (int i = 0; i < Vec<T>::kN; ++i) f[i] = x[i] * inv * wf[i];
  emit(v, PackRound<T>(f));
}

// One row, by one group of kGroup threads, kU vectors per thread per step. load_sum(v0, acc)
// adds vectors v0 + u*kGroup (u < kU) of the partials + residual into acc[u]. Pass 1 rounds the
// sum to T and writes it to res_out (if not null); pass 2 normalises and hands each normed
// vector to emit(v, o). A row that fits in one step stays in registers (weights loaded with the
// sources) when kOnePass; otherwise, or when it is longer, it is staged in the thread's own
// `stage` locations (the normed row, which pass 2 overwrites in the same thread). kOnePass costs
// registers: the 128-thread row kernels, which rarely fit a row in one step, leave it off.
template <typename T, int kGroup, int kU, bool kOnePass, typename LoadSum, typename Emit>
__device__ __forceinline__ void FusedRow(const KernelParams& p, LoadSum load_sum, char* res_out,
                                         char* stage, Emit emit, float* red, int group) {
  constexpr int kN = Vec<T>::kN;
  const int vpr = p.hidden / kN, lane = threadIdx.x % kGroup;
  auto norm = [&](float ss) {
    return rsqrtf(GroupSum<kGroup>(ss, red, group) / static_cast<float>(p.hidden) + p.eps);
  };
  if (kOnePass && vpr <= kGroup * kU) {  // one pass, nothing staged in memory
    float4 w[kU][kN / 4];
#pragma unroll
    for (int u = 0; u < kU; ++u)  // in flight with the sources' loads
      if (lane + u * kGroup < vpr) LoadWeights<T>(p, lane + u * kGroup, w[u]);
    float acc[kU][kN];
    const float inv = norm(SumStep<T, kGroup, kU>(load_sum, lane, vpr, acc, res_out, nullptr));
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (lane + u * kGroup < vpr) EmitNormed<T>(acc[u], w[u], inv, lane + u * kGroup, emit);
    return;
  }
  float ss = 0.f;
  for (int v0 = lane; v0 < vpr; v0 += kGroup * kU) {
    float acc[kU][kN];
    ss += SumStep<T, kGroup, kU>(load_sum, v0, vpr, acc, res_out, stage);
  }
  const float inv = norm(ss);
  for (int v0 = lane; v0 < vpr; v0 += kGroup * kU) {
    uint4 x[kU];
    float4 w[kU][kN / 4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * kGroup;
      if (v < vpr) {
        x[u] = *reinterpret_cast<const uint4*>(stage + v * 16);  // own pass-1 store
        LoadWeights<T>(p, v, w[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * kGroup;
      if (v < vpr) {
        float xf[kN];
        const T* e = reinterpret_cast<const T*>(&x[u]);
#pragma unroll
        for (int i = 0; i < kN; ++i) xf[i] = ToF(e[i]);
        EmitNormed<T>(xf, w[u], inv, v, emit);
      }
    }
  }
}

// Adds vectors v0 + u*kGroup (u < kU, v < vpr) of the first `ns` of `rows` into acc[u], in row
// order. Every load of the step is issued before the first add (kS*kU in flight per thread):
// at a handful of CTAs the reduce phase is bound by load latency, not bandwidth.
template <typename T, int kGroup, int kS, int kU>
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

// The sources of own row `row` (token g = rank * q + row) of a kernel that staged the peers'
// rows: the N partials in rank order (this rank's `own` row g, a peer's at slice
// PeerIndex(src, rank) of `staged`, q rows a slice), then `res_in`; rows[kMaxN] = res_in too.
template <int kMaxN>
__device__ __forceinline__ void StagedSources(const char* (&rows)[kMaxN + 1], int n, int rank,
                                              const char* own, const char* staged,
                                              const char* res_in, int q, int row, int64_t rb) {
  const int g = rank * q + row;
#pragma unroll
  for (int src = 0; src < kMaxN; ++src)
    if (src < n)
      rows[src] = src == rank ? own + g * rb : staged + (PeerIndex(src, rank, n) * q + row) * rb;
#pragma unroll
  for (int src = 0; src < kMaxN; ++src)
    if (src == n) rows[src] = res_in;
  rows[kMaxN] = res_in;
}

// residual_out row = residual row (padding rows past T), by one group.
template <int kGroup>
__device__ __forceinline__ void CopyRow(const char* src, char* dst, int vpr) {
  for (int v = threadIdx.x % kGroup; v < vpr; v += kGroup) St(dst + v * 16, Ldg(src + v * 16));
}

}  // namespace tokenweave
