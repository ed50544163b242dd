// RoPE and the paged-cache write of one step's K/V in one kernel (rope_cache.h): what XLA ran as
// a slice, two RoPE fusions (angles, cos/sin, rotate) and two scatters per layer and half.
// One thread per 8 (first half, second half) pairs of one head of one row: two 16-byte loads,
// eight sincosf, two 16-byte stores. Math as jax_tokenweave.attention.apply_rope: angle =
// float32(position) * inv_freq, the rotation in float32, rounded to the cache dtype.
#include "rope_cache.h"

#include "attention_common.cuh"

namespace tokenweave {
namespace {

constexpr int kRopeThreads = 256;
constexpr int kPairs = 8;  // pairs per thread: one 16-byte vector of each half

template <typename T>
__global__ void __launch_bounds__(kRopeThreads) RopeCacheKernel(const RopeCacheParams p) {
  const int chunks = p.head_dim / (2 * kPairs);  // threads per (row, head)
  const int heads = p.hq + 2 * p.kvh;
  const int64_t units = static_cast<int64_t>(p.rows) * heads * chunks;
  const int half = p.head_dim / 2;
  const int64_t cache_slots = static_cast<int64_t>(p.num_blocks) * p.block_size;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(kRopeThreads) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * kRopeThreads) {
    const int c = static_cast<int>(u % chunks);
    const int h = static_cast<int>((u / chunks) % heads);
    const int row = static_cast<int>(u / (static_cast<int64_t>(chunks) * heads));
    const T* src =
        static_cast<const T*>(p.qkv) + (static_cast<int64_t>(row) * heads + h) * p.head_dim;
    const int d0 = c * kPairs;
    uint4 a = *reinterpret_cast<const uint4*>(src + d0);
    uint4 b = *reinterpret_cast<const uint4*>(src + half + d0);
    T* dst;
    if (h < p.hq) {
      dst = static_cast<T*>(p.q_out) + (static_cast<int64_t>(row) * p.hq + h) * p.head_dim;
    } else {
      const int32_t slot = p.slots[row];
      if (slot < 0 || slot >= cache_slots) continue;  // padding: dropped, as XLA's scatter
      const bool is_k = h < p.hq + p.kvh;
      const int kh = h - p.hq - (is_k ? 0 : p.kvh);
      dst = static_cast<T*>(is_k ? p.k_cache : p.v_cache) +
            (static_cast<int64_t>(slot) * p.kvh + kh) * p.head_dim;
      if (!is_k) {  // values: copied as they are
        *reinterpret_cast<uint4*>(dst + d0) = a;
        *reinterpret_cast<uint4*>(dst + half + d0) = b;
        continue;
      }
    }
    const float pos = static_cast<float>(p.positions[row]);
    float x1[kPairs], x2[kPairs], y1[kPairs], y2[kPairs];
    attn::Unpack8<T>(a, x1);
    attn::Unpack8<T>(b, x2);
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      float s, co;
      sincosf(pos * p.inv_freq[d0 + i], &s, &co);
      y1[i] = x1[i] * co - x2[i] * s;
      y2[i] = x2[i] * co + x1[i] * s;
    }
    uint4 oa, ob;
    uint32_t* wa = reinterpret_cast<uint32_t*>(&oa);
    uint32_t* wb = reinterpret_cast<uint32_t*>(&ob);
#pragma unroll
    for (int i = 0; i < kPairs / 2; ++i) {
      wa[i] = attn::Vec<T>::FromFloat2(y1[2 * i], y1[2 * i + 1]);
      wb[i] = attn::Vec<T>::FromFloat2(y2[2 * i], y2[2 * i + 1]);
    }
    *reinterpret_cast<uint4*>(dst + d0) = oa;
    *reinterpret_cast<uint4*>(dst + half + d0) = ob;
  }
}

template <typename T>
cudaError_t LaunchFor(const RopeCacheParams& p, cudaStream_t stream) {
  const int64_t units = static_cast<int64_t>(p.rows) * (p.hq + 2 * p.kvh) * (p.head_dim / 16);
  const int64_t want = (units + kRopeThreads - 1) / kRopeThreads;
  const int grid = static_cast<int>(want < 65535 ? want : 65535);
  RopeCacheKernel<T><<<grid, kRopeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool RopeCacheShapeSupported(int head_dim) { return head_dim > 0 && head_dim % 16 == 0; }

cudaError_t LaunchRopeCache(const RopeCacheParams& p, bool bf16, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (!RopeCacheShapeSupported(p.head_dim)) return cudaErrorInvalidValue;
  return bf16 ? LaunchFor<__nv_bfloat16>(p, stream) : LaunchFor<__half>(p, stream);
}

}  // namespace tokenweave
