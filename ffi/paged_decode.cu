// Paged attention, decode rows (tile == 1): the split-K kernel and the merge of the splits.
// Grid (split, kv head, row), 128 threads. A row's keys 0..p are cut into pieces of a multiple
// of 32 keys (at least 128): as many as make the step's live rows (`live`, rows with a
// position >= 0) fill kTargetBlocks blocks, at most `splits` (the grid's x). A block streams
// its piece's K and V through shared memory in tiles of 16 KiB (32 keys at head_dim 128):
// cp.async, three stages, so two tiles are in flight while one is scored. Each key row is
// scored by head_dim / 8 threads against every query head of the block's kv head (GQA: one
// read of K/V serves `G` heads), with an online softmax per thread in float32 and base-2
// exponentials; the threads are then merged. A row cut in one piece is normalised and written
// to the output here; otherwise the block writes unnormalised partial sums with their max and
// total, and the merge kernel combines the pieces of each (row, head).
#include "attention_common.cuh"

namespace tokenweave {
namespace attn {
namespace {

constexpr int kStages = 3;              // key tiles in shared memory
constexpr int kTileBytes = 16384;       // K and V of one tile
constexpr int kTargetBlocks = 4 * 132;  // decode blocks to aim for: 4 per SM of an H100/H200

// A row's context and how it is cut: `n` pieces of `chunk` keys (the last may be shorter).
// The split and merge kernels call this alike, so they agree on the pieces.
struct RowSplit {
  int ctx, chunk, n;
};
__device__ __forceinline__ RowSplit SplitRow(const AttentionParams& p, int row) {
  const int ctx = Context(p, row);
  const int pairs = max(*p.live, 1) * p.kvh;
  const int pieces = max(1, min(p.splits, (kTargetBlocks + pairs - 1) / pairs));
  const int chunk = SplitKeys(ctx, pieces);
  return {ctx, chunk, ctx > 0 ? (ctx + chunk - 1) / chunk : 0};
}

__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(full ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads, G > 4 ? 3 : 4) DecodeSplitKernel(AttentionParams p) {
  constexpr int kVec = 8;                        // elements per 16-byte word
  constexpr int kTpk = D / kVec;                 // threads per key row
  constexpr int kKeysPerPass = kThreads / kTpk;  // keys the block scores at once
  constexpr int kKeys = kTileBytes / (4 * D);    // keys per tile (K and V, 2 bytes each)
  constexpr int kPasses = kKeys / kKeysPerPass;
  constexpr int kCopies = kKeys * kTpk / kThreads;  // 16-byte copies of K (and of V) per thread
  constexpr int kSub = G > 4 ? 2 : 4;            // passes scored before their V is summed
  constexpr int kWarps = kThreads / 32;
  static_assert(kPasses % kSub == 0 && kCopies * kThreads == kKeys * kTpk);
  static_assert(kWarps * G * (D + 2) * sizeof(float) <= kStages * kTileBytes);
  __shared__ __align__(16) unsigned char smem[kStages * kTileBytes];

  const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
  const RowSplit rs = SplitRow(p, row);
  const int k0 = split * rs.chunk;
  if (k0 >= rs.ctx) return;  // the merge reads only the pieces under ctx
  const int k1 = min(rs.ctx, k0 + rs.chunk);
  const int tid = threadIdx.x, slot = tid / kTpk, d0 = (tid % kTpk) * kVec;
  const int bs = p.block_size;
  const int32_t* table = p.tables + static_cast<int64_t>(row) * p.width;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int64_t pos_stride = static_cast<int64_t>(p.kvh) * D;

  // Tile t of the piece into stage t % kStages (zeros past k1).
  const auto issue = [&](int t) {
    T* sk = reinterpret_cast<T*>(smem + (t % kStages) * kTileBytes);
    T* sv = sk + kKeys * D;
    const int base = k0 + t * kKeys;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = tid + i * kThreads, r = c / kTpk, col = (c % kTpk) * kVec;
      const int key = base + r;
      const bool ok = key < k1;
      const int64_t at =
          ok ? (BlockId(table, key / bs, p.num_blocks) * bs + key % bs) * pos_stride + h * D + col
             : 0;
      CpAsync16(sk + r * D + col, kc + at, ok);
      CpAsync16(sv + r * D + col, vc + at, ok);
    }
  };
  const int ntiles = (k1 - k0 + kKeys - 1) / kKeys;
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < ntiles) issue(t);
    CpAsyncCommit();
  }

  // This thread's dims of the G query heads, pre-scaled (while the first tiles load).
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

  for (int t = 0; t < ntiles; ++t) {
    CpAsyncWait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();             // ... and everyone's; stage (t - 1) % kStages is free again
    if (t + kStages - 1 < ntiles) issue(t + kStages - 1);
    CpAsyncCommit();
    const T* sk = reinterpret_cast<const T*>(smem + (t % kStages) * kTileBytes);
    const T* sv = sk + kKeys * D;
    const int base = k0 + t * kKeys;
#pragma unroll
    for (int u0 = 0; u0 < kPasses; u0 += kSub) {
      float s[kSub][G];
#pragma unroll
      for (int u = 0; u < kSub; ++u) {
        const int r = (u0 + u) * kKeysPerPass + slot;
        float kf[kVec];
        Unpack8<T>(*reinterpret_cast<const uint4*>(sk + r * D + d0), kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < kVec; ++i) dot = fmaf(q[g][i], kf[i], dot);
#pragma unroll
          for (int o = kTpk / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          s[u][g] = base + r < k1 ? dot : -INFINITY;
        }
      }
      // Online softmax: new maxima and rescaling first, then each V row converted once and
      // accumulated into every head.
      float m_new[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        m_new[g] = m[g];
#pragma unroll
        for (int u = 0; u < kSub; ++u) m_new[g] = fmaxf(m_new[g], s[u][g]);
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
      for (int u = 0; u < kSub; ++u) {
        float vf[kVec];
        Unpack8<T>(*reinterpret_cast<const uint4*>(sv + ((u0 + u) * kKeysPerPass + slot) * D +
                                                   d0),
                   vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pu = exp2f(s[u][g] - m_new[g]);  // 0 for an invalid key
          l[g] += pu;
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[g][i] = fmaf(pu, vf[i], acc[g][i]);
        }
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the stages are free: the merge of the warps below reuses them

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
  float(&s_acc)[kWarps][G][D] = *reinterpret_cast<float(*)[kWarps][G][D]>(smem);
  float(&s_m)[kWarps][G] = *reinterpret_cast<float(*)[kWarps][G]>(&s_acc[kWarps][0][0]);
  float(&s_l)[kWarps][G] = *reinterpret_cast<float(*)[kWarps][G]>(&s_m[kWarps][0]);
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
  // Element e of head g: the warps' sums (and maxima, totals) rescaled to their common max.
  const auto combine = [&](int g, int i, float& mx, float& total) {
    mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float v = 0.f;
    total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float c = s_m[w][g] == -INFINITY ? 0.f : exp2f(s_m[w][g] - mx);
      v += c * (i < D ? s_acc[w][g][i] : 0.f);
      total += c * s_l[w][g];
    }
    return v;
  };
  if (rs.n == 1) {  // the row's only piece: its normalised output
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
    for (int e = tid; e < G * D; e += kThreads) {
      float mx, total;
      const float v = combine(e / D, e % D, mx, total);
      out[e] = Vec<T>::FromFloat(total > 0.f ? v / total : 0.f);
    }
    return;
  }
  // Thread t writes element t of (G heads x (D sums + max + total)) of this piece.
  float* work = p.work + ((static_cast<int64_t>(row) * p.kvh + h) * p.splits + split) * G * (D + 2);
  for (int e = tid; e < G * (D + 2); e += kThreads) {
    const int g = e / (D + 2), i = e % (D + 2);
    float mx, total;
    const float v = combine(g, i, mx, total);
    work[e] = i < D ? v : (i == D ? mx : total);
  }
}

// Grid (row, kv head), G warps: warp g merges head g of the group over the row's pieces: its
// lanes take the splits' maxima and totals side by side (warp reductions), then dims
// lane, lane + 32, ... summing over the splits, and write the normalised output.
template <typename T, int D, int G>
__global__ void __launch_bounds__(32 * G) DecodeMergeKernel(AttentionParams p) {
  const int row = blockIdx.x, h = blockIdx.y, g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = SplitRow(p, row).n;
  if (n == 1) return;  // the split kernel wrote the row's output
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
