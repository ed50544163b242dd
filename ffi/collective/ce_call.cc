// Issues the copy-engine call (ce_plan.h) on a stream: cudaMemcpyAsync for the reduce-scatter,
// the all-gather and the signals (a 4-byte copy of the `one` word into the peer's flag, ordered
// after the data copies before it on the same stream, as NCCL's copy-engine collectives do),
// and the kernels of ce.cu: the one-warp bounded waits, the reduce and the finish. Why the
// waits are a kernel and not stream memory operations: ffi/README.md, "Copy-engine variant".
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "ce_plan.h"
#include "common.h"

namespace tokenweave {
namespace {

std::string Failed(const char* what, cudaError_t e) {
  return std::string("jax-tokenweave: copy-engine call: ") + what + ": " + cudaGetErrorString(e);
}

}  // namespace

std::string IssueCopyEngineCall(const KernelParams& p, DType dtype, int num_ctas,
                                cudaStream_t stream) {
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * (dtype == DType::kF32 ? 4 : 2);
  const char* partial = static_cast<const char*>(p.partial);
  char* normed = static_cast<char*>(p.normed);
  for (const CeOp& op : CePlan(p.rank, p.nranks, p.tokens, row_bytes)) {
    cudaError_t e = cudaSuccess;
    switch (op.kind) {
      case CeOp::kScatterCopy:
        e = cudaMemcpyAsync(p.ce[op.peer] + op.dst, partial + op.src, op.bytes, cudaMemcpyDefault,
                            stream);
        if (e != cudaSuccess) return Failed("reduce-scatter copy", e);
        break;
      case CeOp::kGatherCopy:
        e = cudaMemcpyAsync(normed + op.dst, p.ce[op.peer] + op.src, op.bytes, cudaMemcpyDefault,
                            stream);
        if (e != cudaSuccess) return Failed("all-gather copy", e);
        break;
      case CeOp::kSignal:
        e = cudaMemcpyAsync(p.ce_flags[op.peer] + CeFlagIndex(op.phase, p.rank),
                            &p.rank_ctl[p.rank]->one, sizeof(uint32_t), cudaMemcpyDefault, stream);
        if (e != cudaSuccess) return Failed("signal copy", e);
        break;
      case CeOp::kWait:
        if ((e = LaunchCeWait(p, op.phase, stream)) != cudaSuccess)
          return Failed("wait kernel launch", e);
        break;
      case CeOp::kReduce:
        if ((e = LaunchCeReduce(p, dtype, num_ctas, stream)) != cudaSuccess)
          return Failed("reduce kernel launch", e);
        break;
      case CeOp::kFinish:
        if ((e = LaunchCeFinish(p, dtype, stream)) != cudaSuccess)
          return Failed("finish kernel launch", e);
        break;
    }
  }
  return "";
}

// GB/s of copy-engine copies of `bytes` from each of `ordinals`' devices into the next one's
// (a ring; with two devices, both directions at once), each device's copy on its own stream,
// timed with events on the first device over `reps` rounds after one warm-up round; the median
// round. What the copy-engine call's transfers can reach at that size.
double MeasureCopyBandwidth(const std::vector<int>& ordinals, int64_t bytes, int reps) {
  const int n = static_cast<int>(ordinals.size());
  if (n < 2 || bytes <= 0 || reps < 1)
    throw std::invalid_argument("jax-tokenweave: copy bandwidth needs >= 2 devices, bytes, reps");
  int prev = 0;
  TW_THROW_CHECK(cudaGetDevice(&prev));
  std::vector<char*> src(n), dst(n);
  std::vector<cudaStream_t> streams(n);
  std::vector<cudaEvent_t> done(n);
  cudaEvent_t start, stop;
  for (int i = 0; i < n; ++i) {
    TW_THROW_CHECK(cudaSetDevice(ordinals[i]));
    TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&src[i]), bytes));
    TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&dst[i]), bytes));
    TW_THROW_CHECK(cudaMemset(src[i], 1, bytes));
    TW_THROW_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    TW_THROW_CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
  }
  TW_THROW_CHECK(cudaSetDevice(ordinals[0]));
  TW_THROW_CHECK(cudaEventCreate(&start));
  TW_THROW_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int round = 0; round <= reps; ++round) {
    TW_THROW_CHECK(cudaSetDevice(ordinals[0]));
    TW_THROW_CHECK(cudaEventRecord(start, streams[0]));
    for (int i = 0; i < n; ++i) {
      TW_THROW_CHECK(cudaSetDevice(ordinals[i]));
      if (i > 0) TW_THROW_CHECK(cudaStreamWaitEvent(streams[i], start, 0));
      TW_THROW_CHECK(
          cudaMemcpyAsync(dst[(i + 1) % n], src[i], bytes, cudaMemcpyDefault, streams[i]));
      TW_THROW_CHECK(cudaEventRecord(done[i], streams[i]));
    }
    TW_THROW_CHECK(cudaSetDevice(ordinals[0]));
    for (int i = 1; i < n; ++i) TW_THROW_CHECK(cudaStreamWaitEvent(streams[0], done[i], 0));
    TW_THROW_CHECK(cudaEventRecord(stop, streams[0]));
    TW_THROW_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    TW_THROW_CHECK(cudaEventElapsedTime(&t, start, stop));
    if (round > 0) ms.push_back(t);
  }
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(ordinals[i]);
    cudaFree(src[i]);
    cudaFree(dst[i]);
    cudaStreamDestroy(streams[i]);
    cudaEventDestroy(done[i]);
  }
  cudaSetDevice(ordinals[0]);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaSetDevice(prev);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e-3) / 1e9;
}

}  // namespace tokenweave
