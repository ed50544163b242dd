// Decode attention's pieces (paged_decode.cu): how a row's context is cut (SplitRow, which the
// split and merge kernels call alike) and the merge of a row's pieces (a programmatic launch on
// sm_90, launch.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include "attention_common.cuh"
#include "common/launch.cuh"

namespace tokenweave {
namespace attn {
namespace {

constexpr int kMergeBatch = 16;      // pieces whose partial sums the merge loads at once
constexpr int kTailPieceKeys = 256;  // piece length where the last wave is under half full

// A row's context and how it is cut: `n` pieces of `chunk` keys (the last may be shorter).
// The split and merge kernels call this alike, so they agree on the pieces.
struct RowSplit {
  int ctx, chunk, n;
};
__device__ __forceinline__ RowSplit SplitRow(const AttentionParams& p, int row) {
  const int ctx = Context(p, row);
  const int pairs = max(*p.live, 1) * p.kvh, waves = pairs / p.capacity;
  const int last = pairs - waves * p.capacity;  // blocks of the last, partial wave
  // Under one wave, as many pieces as keep every block in it: a second, partial wave costs a
  // whole block's latency. Past one wave, a row is one piece, unless the last wave is under
  // half full: then pieces of kTailPieceKeys, so the blocks left alone at the end are short.
  int pieces = 1;
  if (waves == 0)
    pieces = p.capacity / pairs;
  else if (last > 0 && 2 * last < p.capacity)
    pieces = (ctx + kTailPieceKeys - 1) / kTailPieceKeys;
  pieces = max(1, min(p.splits, pieces));
  const int chunk = SplitKeys(ctx, pieces);
  return {ctx, chunk, ctx > 0 ? (ctx + chunk - 1) / chunk : 0};
}

// Grid (row, kv head), G warps: warp g merges head g of the group over the row's pieces. Lane
// i holds the max and total of pieces i, i + 32, ... (warp reductions give the overall max and
// total); then dims lane, lane + 32, ... sum over the pieces, kMergeBatch pieces' loads in
// flight at once, and the normalised output is written. The first batch's sums and every
// lane's max and total load before the row's piece count is known (entries of pieces < splits
// exist in the workspace; those past the count are stale and never used), so they share one
// round trip with the row's position instead of following it: 16 x 1024 keys took 24.4-24.5
// us instead of 25.1 on an H200, 1 x 1024 8.9 instead of 9.4.
template <typename T, int D, int G>
__global__ void __launch_bounds__(32 * G) DecodeMergeKernel(AttentionParams p) {
  const int row = blockIdx.x, h = blockIdx.y, g = threadIdx.x / 32, lane = threadIdx.x % 32;
  WaitForPrerequisite();
  const float* work =
      p.work + (static_cast<int64_t>(row) * p.kvh + h) * p.splits * G * (D + 2) + g * (D + 2);
  constexpr int kStride = G * (D + 2);  // from one split's entry to the next one's
  float part[kMergeBatch][D / 32];
  float2 lane_ml = make_float2(-INFINITY, 0.f);  // piece `lane`'s max and total
  if (lane < p.splits) lane_ml = *reinterpret_cast<const float2*>(work + lane * kStride + D);
#pragma unroll
  for (int j = 0; j < kMergeBatch; ++j)
#pragma unroll
    for (int i = 0; i < D / 32; ++i)
      part[j][i] = j < p.splits ? work[j * kStride + lane + 32 * i] : 0.f;
  const int n = SplitRow(p, row).n;
  if (n <= 1) return;  // the split kernel wrote the row's output (zeros for a padding row)
  const auto weight = [&](float m, float mx) { return m == -INFINITY ? 0.f : exp2f(m - mx); };
  float mx = lane < n ? lane_ml.x : -INFINITY;
  for (int s = lane + 32; s < n; s += 32) mx = fmaxf(mx, work[s * kStride + D]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  // Lane i's weight of piece i (pieces 0..31: the common case, shuffled to the sums below).
  const float w_lane = lane < n ? weight(lane_ml.x, mx) : 0.f;
  float total = lane < n ? w_lane * lane_ml.y : 0.f;
  for (int s = lane + 32; s < n; s += 32)
    total += weight(work[s * kStride + D], mx) * work[s * kStride + D + 1];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  float sum[D / 32] = {};
  for (int s0 = 0; s0 < n; s0 += kMergeBatch) {
    if (s0 > 0) {
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j)
#pragma unroll
        for (int i = 0; i < D / 32; ++i)
          part[j][i] = s0 + j < n ? work[(s0 + j) * kStride + lane + 32 * i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const int s = s0 + j;
      const float shuffled = __shfl_sync(0xffffffffu, w_lane, s % 32);
      if (s >= n) continue;  // past the row's pieces: stale entries or zeros
      const float c = s < 32 ? shuffled : weight(work[s * kStride + D], mx);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) sum[i] = fmaf(c, part[j][i], sum[i]);
    }
  }
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G + g) * D;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) out[lane + 32 * i] = Vec<T>::FromFloat(sum[i] * inv);
}

}  // namespace
}  // namespace attn
}  // namespace tokenweave
