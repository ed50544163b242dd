// Paged attention, decode rows (tile == 1): the split-K kernel and the merge of the splits.
// Grid (split, kv head, row), 128 threads. A row's keys 0..p are cut into at most `splits`
// pieces (multiples of 32 keys, at least 128, so a short row uses fewer); a block streams its
// piece's K and V rows with 16-byte loads (a key row of head_dim elements is read by
// head_dim / 8 threads) and scores them against every query head of its kv head (GQA: one read
// of K/V serves `G` heads), an online softmax per thread in float32 with base-2 exponentials,
// then merges its threads and writes unnormalised partial sums with their max and total. The
// merge kernel combines the splits of each (row, head).
#include "attention_common.cuh"

namespace tokenweave {
namespace attn {
namespace {

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) DecodeSplitKernel(AttentionParams p) {
  constexpr int kVec = 8;                        // elements per 16-byte load
  constexpr int kTpk = D / kVec;                 // threads per key row
  constexpr int kKeysPerPass = kThreads / kTpk;  // keys the block reads per pass
  constexpr int kUnroll = G > 4 ? 2 : 4;         // passes whose loads are in flight together
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_m[kWarps][G], s_l[kWarps][G];
  __shared__ float s_acc[kWarps][G][D];

  const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
  const int ctx = Context(p, row);
  const int chunk = SplitKeys(ctx, p.splits);
  const int k0 = split * chunk;
  if (k0 >= ctx) return;  // the merge reads only the splits under ctx
  const int k1 = min(ctx, k0 + chunk);
  const int tid = threadIdx.x, slot = tid / kTpk, d0 = (tid % kTpk) * kVec;
  const int bs = p.block_size;
  const int32_t* table = p.tables + static_cast<int64_t>(row) * p.width;

  // This thread's dims of the G query heads, pre-scaled.
  const float qscale = p.scale * kLog2e;
  float q[G][kVec];
  const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    Unpack8<T>(*reinterpret_cast<const uint4*>(qrow + g * D + d0), q[g]);
#pragma unroll
    for (int i = 0; i < kVec; ++i) q[g][i] *= qscale;
  }
  float m[G], l[G], acc[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
  }
  __syncthreads();

  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int64_t pos_stride = static_cast<int64_t>(p.kvh) * D;
  constexpr int kStep = kKeysPerPass * kUnroll;
  // Loads of the pass starting at `base` into kw, vw (zeros past k1).
  const auto load = [&](int base, uint4 (&kw)[kUnroll], uint4 (&vw)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = base + u * kKeysPerPass + slot;
      if (key < k1) {
        const int64_t at = (BlockId(table, key / bs, p.num_blocks) * bs + key % bs) *
                               pos_stride + h * D + d0;
        kw[u] = __ldg(reinterpret_cast<const uint4*>(kc + at));
        vw[u] = __ldg(reinterpret_cast<const uint4*>(vc + at));
      } else {
        kw[u] = vw[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  for (int base = k0; base < k1; base += kStep) {
    // Every load of the pass is issued before the first is used (kUnroll rows in flight).
    uint4 kw[kUnroll], vw[kUnroll];
    bool valid[kUnroll];
    load(base, kw, vw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) valid[u] = base + u * kKeysPerPass + slot < k1;
    float s[kUnroll][G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kVec];
      Unpack8<T>(kw[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) dot = fmaf(q[g][i], kf[i], dot);
#pragma unroll
        for (int o = kTpk / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[u][g] = valid[u] ? dot : -INFINITY;
      }
    }
    // Online softmax: new maxima and rescaling first, then each V row converted once and
    // accumulated into every head.
    float m_new[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_new[g] = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new[g] = fmaxf(m_new[g], s[u][g]);
      // Still -inf: no valid key for this thread yet (exp2 of s - 0 then gives 0).
      const float safe = m_new[g] == -INFINITY ? 0.f : m_new[g];
      if (m_new[g] != m[g]) {
        const float corr = exp2f(m[g] - safe);
        l[g] *= corr;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[g][i] *= corr;
      }
      m[g] = m_new[g];
      m_new[g] = safe;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kVec];
      Unpack8<T>(vw[u], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pu = exp2f(s[u][g] - m_new[g]);  // 0 for an invalid key
        l[g] += pu;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[g][i] = fmaf(pu, vf[i], acc[g][i]);
      }
    }
  }

  // Merge the key slots of a warp (lanes kTpk apart hold the same dims), then the warps.
#pragma unroll
  for (int o = kTpk; o < 32; o *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mn = fmaxf(m[g], mo);
      const float ca = mn == -INFINITY ? 0.f : exp2f(m[g] - mn);
      const float cb = mn == -INFINITY ? 0.f : exp2f(mo - mn);
      l[g] = l[g] * ca + lo * cb;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        acc[g][i] = acc[g][i] * ca + ao * cb;
      }
      m[g] = mn;
    }
  }
  const int warp = tid / 32, lane = tid % 32;
  if (lane < kTpk) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) s_m[warp][g] = m[g], s_l[warp][g] = l[g];
#pragma unroll
      for (int i = 0; i < kVec; ++i) s_acc[warp][g][d0 + i] = acc[g][i];
    }
  }
  __syncthreads();
  // Thread t writes element t of (G heads x (D sums + max + total)) of this split.
  float* work = p.work + ((static_cast<int64_t>(row) * p.kvh + h) * p.splits + split) * G * (D + 2);
  for (int e = tid; e < G * (D + 2); e += kThreads) {
    const int g = e / (D + 2), i = e % (D + 2);
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float c = s_m[w][g] == -INFINITY ? 0.f : exp2f(s_m[w][g] - mx);
      v += c * (i < D ? s_acc[w][g][i] : (i == D + 1 ? s_l[w][g] : 0.f));
    }
    work[e] = i == D ? mx : v;
  }
}

// Grid (row, kv head), G warps: warp g merges head g of the group over the row's splits: its
// lanes take the splits' maxima and totals side by side (warp reductions), then dims
// lane, lane + 32, ... summing over the splits, and write the normalised output.
template <typename T, int D, int G>
__global__ void __launch_bounds__(32 * G) DecodeMergeKernel(AttentionParams p) {
  const int row = blockIdx.x, h = blockIdx.y, g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ctx = Context(p, row), chunk = SplitKeys(ctx, p.splits);
  const int n = ctx > 0 ? (ctx + chunk - 1) / chunk : 0;
  const float* work = p.work + (static_cast<int64_t>(row) * p.kvh + h) * p.splits * G * (D + 2) +
                      g * (D + 2);
  constexpr int kStride = G * (D + 2);  // from one split's entry to the next one's
  float mx = -INFINITY;
  for (int s = lane; s < n; s += 32) mx = fmaxf(mx, work[s * kStride + D]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const auto weight = [&](int s) {
    const float m = work[s * kStride + D];
    return m == -INFINITY ? 0.f : exp2f(m - mx);
  };
  float total = 0.f;
  for (int s = lane; s < n; s += 32) total += weight(s) * work[s * kStride + D + 1];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  float sum[D / 32] = {};
#pragma unroll 4
  for (int s = 0; s < n; ++s) {
    const float c = weight(s);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) sum[i] = fmaf(c, work[s * kStride + lane + 32 * i], sum[i]);
  }
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G + g) * D;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) out[lane + 32 * i] = Vec<T>::FromFloat(sum[i] * inv);
}


template <typename T, int D, int G>
cudaError_t LaunchDecode(const AttentionParams& p, cudaStream_t stream) {
  const int rows = p.groups;
  DecodeSplitKernel<T, D, G><<<dim3(p.splits, p.kvh, rows), kThreads, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DecodeMergeKernel<T, D, G><<<dim3(rows, p.kvh), 32 * G, 0, stream>>>(p);
  return cudaGetLastError();
}


template <typename T, int D>
cudaError_t LaunchForDim(const AttentionParams& p, cudaStream_t stream) {
  switch (p.hq / p.kvh) {
    case 1: return LaunchDecode<T, D, 1>(p, stream);
    case 2: return LaunchDecode<T, D, 2>(p, stream);
    case 4: return LaunchDecode<T, D, 4>(p, stream);
    case 8: return LaunchDecode<T, D, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchForType(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return LaunchForDim<T, 64>(p, stream);
    case 128: return LaunchForDim<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchDecodeAttention(const AttentionParams& p, AttnDType dtype,
                                  cudaStream_t stream) {
  return dtype == AttnDType::kBF16 ? LaunchForType<__nv_bfloat16>(p, stream)
                                   : LaunchForType<__half>(p, stream);
}

}  // namespace attn
}  // namespace tokenweave
