// The copy-engine call of one rank as a list of stream operations (pure host logic, no CUDA):
// what ce_call.cc issues and what the CPU tests check (ffi/README.md, "Copy-engine variant").
//
// Per call, with q = ceil(T / N) rows per owner and row bytes rb, rank r:
//   1. reduce-scatter by push: for each peer j (rotated, r+1 first) copy j's rows of `partial`
//      into j's staging area, slot PeerIndex(r, j) ([N-1] slices of q rows);
//   2. signal every peer (phase 0: a 4-byte copy into its flag), then wait for every peer's
//      phase-0 flag and clear it (one warp, bounded: ce.cu);
//   3. the reduce kernel: the N slices in rank order + residual, RMSNorm; normed rows go to
//      `normed` and to this rank's own staging slice N-1 (which the peers pull);
//   4. signal every peer (phase 1), then wait for their phase-1 flags and clear them;
//   5. all-gather by pull: copy each peer's own slice into its rows of `normed`;
//   6. the finish kernel (NaN outputs if the group failed meanwhile).
// A flag is set by its one writer and cleared by its one reader, once per call: the writer's
// next set comes only after it has passed the other phase's wait, which needs the reader's
// signal of that phase, issued after the clear. The same argument orders the staging areas:
// a peer pushes call k+1's rows only after it saw our phase-1 signal of call k (our reduce
// kernel had read call k's), and our kernel overwrites our own slice in call k+1 only after
// the peers' phase-0 signals of call k+1 (they had pulled call k's).
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace tokenweave {

struct CeOp {
  enum Kind : int32_t { kScatterCopy, kSignal, kWait, kReduce, kGatherCopy, kFinish };
  Kind kind;
  int32_t peer = -1;  // the other rank (copies, signals); -1: every peer (waits)
  int32_t phase = 0;  // signals, waits: 0 reduce-scatter, 1 all-gather
  int64_t src = 0;    // kScatterCopy: offset in `partial`; kGatherCopy: in the peer's staging
  int64_t dst = 0;    // kScatterCopy: offset in the peer's staging; kGatherCopy: in `normed`
  int64_t bytes = 0;  // copies
};

// Index of sender `src`'s flag of `phase` in a rank's flags.
inline __host__ __device__ int CeFlagIndex(int phase, int src) { return phase * kMaxRanks + src; }

// Rows of owner j's shard that exist (the last owners' shards may end early or be empty).
inline int64_t CeOwnerRows(int64_t tokens, int64_t rows, int j) {
  const int64_t left = tokens - j * rows;
  return left <= 0 ? 0 : (left < rows ? left : rows);
}

inline std::vector<CeOp> CePlan(int rank, int n, int64_t tokens, int64_t row_bytes) {
  const int64_t rows = (tokens + n - 1) / n, slice = rows * row_bytes;
  std::vector<CeOp> ops;
  auto peer = [&](int k) { return (rank + k) % n; };
  auto copy = [&](CeOp::Kind kind, int j, int64_t src, int64_t dst) {
    const int64_t bytes = CeOwnerRows(tokens, rows, j) * row_bytes;  // owner j's rows
    if (bytes > 0) ops.push_back({kind, j, 0, src, dst, bytes});
  };
  auto handshake = [&](int phase) {
    for (int k = 1; k < n; ++k) ops.push_back({CeOp::kSignal, peer(k), phase, 0, 0, 0});
    ops.push_back({CeOp::kWait, -1, phase, 0, 0, 0});
  };
  for (int k = 1; k < n; ++k) {
    const int j = peer(k);
    copy(CeOp::kScatterCopy, j, j * slice, ((rank - j + n) % n - 1) * slice);  // PeerIndex(r, j)
  }
  handshake(0);
  ops.push_back({CeOp::kReduce});
  handshake(1);
  for (int k = 1; k < n; ++k) {
    const int j = peer(k);
    copy(CeOp::kGatherCopy, j, (n - 1) * slice, j * slice);
  }
  ops.push_back({CeOp::kFinish});
  return ops;
}

}  // namespace tokenweave
