// RoPE of a step's queries and keys, and the write of its keys and values into one layer's paged
// cache, in one kernel (rope_cache.cu), per rank:
//   qkv        [rows, hq + 2 kvh, head_dim]   the qkv projection of the step's rows, heads in
//                                             the order q, k, v (this rank's heads)
//   positions  int32 [rows]                   each row's position in its request (for RoPE)
//   slots      int32 [rows]                   cache slot (block * block_size + offset); a slot
//                                             outside [0, num_blocks * block_size) is dropped
//   inv_freq   float32 [head_dim / 2]         RoPE inverse frequencies ("rotate half" layout)
//   q_out      [rows, hq, head_dim]           the queries, rotated
//   k_cache,   [num_blocks, block_size, kvh, head_dim], written in place at the rows' slots
//   v_cache    (keys rotated, values as they are)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tokenweave {

struct RopeCacheParams {
  const void* qkv;
  const int32_t* positions;
  const int32_t* slots;
  const float* inv_freq;
  void* q_out;
  void* k_cache;
  void* v_cache;
  int32_t rows, hq, kvh, head_dim, num_blocks, block_size;
};

// head_dim a multiple of 16 (16-byte vectors of each half).
bool RopeCacheShapeSupported(int head_dim);

// bf16 (else fp16) on `stream`; returns the launch error.
cudaError_t LaunchRopeCache(const RopeCacheParams& p, bool bf16, cudaStream_t stream);

}  // namespace tokenweave
