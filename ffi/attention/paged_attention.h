// Paged attention kernels of the serving engine: decode rows (split-K flash decoding) and prompt
// tiles (flash attention on tensor cores), both reading K/V through per-group block tables.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tokenweave {

enum class AttnDType : int32_t { kF16 = 1, kBF16 = 2 };

// One attention segment of a step, one rank (layouts as serving/attention/paged_attention.py):
//   q, out     [rows, hq, head_dim]          rows = groups * tile, query heads of this rank
//   k_cache,   [num_blocks, block_size, kvh, head_dim]
//   v_cache
//   tables     int32 [groups, width]          block table of each group's request
//   positions  int32 [rows]                   a row attends to its request's positions 0..p
//                                             (clamped to the table's width * block_size;
//                                             none where p < 0: padding; block ids are
//                                             clamped to [0, num_blocks), as XLA's gather
//                                             clamps, so bad data cannot fault)
//   live       int32 [1]                      decode: rows with a position >= 0 (how finely
//                                             rows are cut; any value gives the same result)
//   work       float32                        decode only: per (row, kv head, split, head of
//                                             the group) head_dim partial sums, max, total
struct AttentionParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* tables;
  const int32_t* positions;
  const int32_t* live;
  void* out;
  float* work;
  int32_t groups, tile, hq, kvh, head_dim, block_size, width, num_blocks;
  int32_t splits;    // decode: blocks per (row, kv head), the most pieces a row's context is
                     // cut into (pieces of a multiple of 64 keys, as many as `live` rows need)
  float scale;       // logit scale (1 / sqrt(head_dim) by default)
  int32_t capacity;  // decode: split-kernel blocks the GPU holds at once (set at launch)
};

// Grouped-query sizes the kernels are built for.
bool AttentionShapeSupported(int head_dim, int group);

// Launches the kernels of one segment on `stream`: tile == 1 decode (split kernel, then the
// merge of the splits), tile > 1 the tensor-core kernel. Returns the first CUDA error.
cudaError_t LaunchPagedAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream);

}  // namespace tokenweave
