// Device helpers shared by the paged attention kernels (paged_decode.cu, paged_prefill.cu):
// 16-bit vector conversions, a row's context, the decode split, clamped block ids.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "paged_attention.h"

namespace tokenweave {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;

template <typename T>
struct Vec;
template <>
struct Vec<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ float2 ToFloat2(uint32_t w) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  }
  static __device__ __nv_bfloat16 FromFloat(float a) { return __float2bfloat16_rn(a); }
  static __device__ uint32_t FromFloat2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Vec<__half> {
  using T2 = __half2;
  static __device__ float2 ToFloat2(uint32_t w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
  static __device__ __half FromFloat(float a) { return __float2half_rn(a); }
  static __device__ uint32_t FromFloat2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// The 8 elements of a 16-byte word as floats.
template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& w, float (&out)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Vec<T>::ToFloat2(words[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// A row's keys: positions 0..p, within the block table (none for a position < 0: padding).
__device__ __forceinline__ int Context(const AttentionParams& p, int row) {
  return max(0, min(p.positions[row] + 1, p.width * p.block_size));
}

// Keys per split of a row: its context cut into at most `splits` pieces of a multiple of 64
// keys (the decode kernel's tile at head_dim 128), at least kMinSplitKeys (a shorter piece
// costs more in partial sums than it saves).
constexpr int kMinSplitKeys = 64;
__device__ __forceinline__ int SplitKeys(int ctx, int splits) {
  return max(kMinSplitKeys, ((ctx + splits - 1) / splits + 63) / 64 * 64);
}

// A block id clamped to [0, num_blocks), as XLA's gather clamps (bad data cannot fault).
__device__ __forceinline__ int64_t ClampBlock(int32_t id, int num_blocks) {
  return min(max(id, 0), num_blocks - 1);
}
__device__ __forceinline__ int64_t BlockId(const int32_t* table, int index, int num_blocks) {
  return ClampBlock(table[index], num_blocks);
}

}  // namespace attn
}  // namespace tokenweave
