// Shared definitions of the jax-tokenweave CUDA extension: limits, the device-resident sync
// state, kernel parameters, the host-mapped error record and the CUDA error-checking macros.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tokenweave {

constexpr int kMaxRanks = 8;  // largest group (tensor-parallel axis) size
constexpr int kMaxCtas = 64;  // largest grid of the barrier kernels (per-block flags)
// Largest grid of a barrier kernel in the loopback harness, where every rank's blocks share one
// GPU and must all be resident at once (8 ranks x 32 blocks of 512 threads fill an H100).
constexpr int kMaxLoopbackCtas = 32;
constexpr int kMaxOneShotCtas = 128;  // largest grid of the one-shot kernel (no flags)
constexpr int kMaxCeCtas = 132;       // largest grid of the copy-engine call's reduce kernel
constexpr int kMinCtas = 1;
constexpr int kThreads = 512;  // threads per block
constexpr int kMaxHidden = 16384;
constexpr int kHiddenMultiple = 8;  // rows move as 16-byte vectors (8 x 16-bit)
constexpr int kNumBarriers = 2;     // barrier ids per call (two-shot, direct)
constexpr int kLamportBuffers = 3;  // one-shot receive buffers per slot, rotated

// "Not written yet" in a one-shot receive buffer (kernels.cuh): buffers are cleared to this
// word: two bf16/fp16 negative zeros, or an fp32 negative denormal. Senders send +0 for a
// 16-bit -0, and -0.0f (kSentinelReplacement) for the fp32 value -4.6e-41 with these bits.
constexpr uint32_t kSentinel = 0x80008000u;
constexpr uint32_t kSentinelReplacement = 0x80000000u;

enum class Algo : int32_t { kTwoShot = 1, kOneShot = 2, kDirect = 3, kCopyEngine = 4 };
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Per (rank, slot), in device memory. Advanced only by the kernels (the last block of a call
// to arrive), so no per-call host state exists and XLA command buffers can replay a call.
// `word` packs what a block needs to start, so that one atomic both reads it and arrives:
// bits 32-63 the calls completed on the slot (the epoch), 16-31 the one-shot receive buffer
// the next one-shot call uses (0..kLamportBuffers-1), 0-15 the blocks of the running call that
// have arrived.
struct SlotControl {
  unsigned long long word;
  uint32_t entered;  // epoch of the last call whose kernel began here (read by peers)
  uint32_t oneshot_used[kLamportBuffers];  // bytes the last call through each buffer used
  uint32_t ce_calls;  // copy-engine calls whose reduce kernel began here (timeout reports)
  uint32_t pad;
};
static_assert(sizeof(SlotControl) == 32, "SlotControl layout");

// Per rank, device memory: sticky abort word. A kernel whose bounded wait expires sets it on
// every rank of its group; every later kernel of the group poisons its outputs (NaN) and
// returns at once, and the handlers refuse to launch.
struct RankControl {
  uint32_t failed;
  uint32_t one;  // always 1: the source word of the copy-engine call's signals (copied to peers)
  uint32_t pad[6];
};

// Host-mapped (cudaHostAlloc): the first wait that expired describes itself here; the host
// reads it before every launch and turns it into an FFI error.
struct ErrorRecord {
  int32_t claimed;          // set (atomically) by the first wait that expired
  volatile int32_t failed;  // 0 until that wait's report below is complete
  int32_t device, rank, slot, stage, peer, block;
  uint32_t epoch, seen;
  uint32_t peer_entered;  // the last epoch the missing rank's kernel began on this slot
};

// Everything one launch needs; passed by value. Pointers by rank index.
struct KernelParams {
  const void* partial;         // [T, H], local
  const void* residual;        // [q, H], local ([T, H] where residual_replicated)
  const void* weight;          // [H], local: float32, or the rows' dtype (weight_in_dtype)
  void* normed;                // [T, H], local output
  void* residual_out;          // [q, H], local output ([T, H] where residual_replicated)
  char* data[kMaxRanks];       // this slot's two-shot/direct area (2 parities) on every rank
  char* oneshot[kMaxRanks];    // this slot's kLamportBuffers one-shot buffers on every rank
  uint32_t* flags[kMaxRanks];  // this slot's barrier flags on every rank
  SlotControl* ctl[kMaxRanks];
  RankControl* rank_ctl[kMaxRanks];
  char* ce[kMaxRanks];            // this slot's copy-engine staging area on every rank
  uint32_t* ce_flags[kMaxRanks];  // this slot's copy-engine flags [2 phases][kMaxRanks] per rank
  char* mc_data;                  // multicast mapping of this slot's area (multimem only)
  ErrorRecord* err;
  int64_t area_bytes;                          // one parity of `data`
  int64_t oneshot_bytes;                       // one one-shot buffer
  int64_t ce_bytes;                            // one slot's copy-engine staging area
  int32_t rank, nranks, tokens, hidden, rows;  // rows = q = ceil(T / N)
  int32_t device, slot;
  int32_t weight_in_dtype;  // 1: weight has the rows' dtype (bf16/f16); 0: float32
  // 1: every rank holds the whole residual (rows = T) and writes all of residual_out, so no
  // residual rows are exchanged; only the decode one-shot kernel (ResidualReplicatedFits).
  int32_t residual_replicated;
  float eps;
  uint64_t timeout_ns;
};

// Wait stages named in timeout reports.
enum Stage : int32_t {
  kStageBarrier0 = 0,
  kStageBarrier1 = 1,
  kStageOneShotData = 2,
  kStageCeScatter = 3,   // a copy-engine call's wait for its peers' reduce-scatter rows
  kStageCeGather = 4,    // its wait for the peers' normed rows
  kStageLaunchGate = 5,  // the host's wait for this process's other devices (launch_gate.h)
};

// Bytes of the per-call working memory each algorithm needs, for N ranks, T tokens,
// q = ceil(T/N) rows, H hidden, itemsize es. The Python side asks the extension for these.
inline int64_t TwoShotBytes(int64_t n, int64_t rows, int64_t hidden, int64_t es) {
  return 2 * (n - 1) * rows * hidden * es;  // one parity of the data area
}
// One one-shot receive buffer: N-1 segments of (T partial rows + q residual rows).
inline int64_t OneShotBytes(int64_t n, int64_t tokens, int64_t rows, int64_t hidden, int64_t es) {
  return (n - 1) * (tokens + rows) * hidden * es;
}
constexpr int64_t kDirectBytes = 16;  // the mailbox with this rank's two buffer addresses
// A copy-engine call's staging area on each rank: the (N-1) peers' slices of its q rows, then its
// own q normed rows, which the peers pull.
inline int64_t CopyEngineBytes(int64_t n, int64_t rows, int64_t hidden, int64_t es) {
  return n * rows * hidden * es;
}
inline int64_t MultimemBytes(int64_t n, int64_t tokens, int64_t hidden, int64_t es) {
  return 2 * n * ((tokens + n - 1) / n) * hidden * es;
}

// Launches the fused kernel (allreduce_rmsnorm.cu / oneshot.cu). Returns the launch error.
cudaError_t LaunchAllreduceRmsnorm(const KernelParams& p, DType dtype, Algo algo, bool multimem,
                                   int num_ctas, cudaStream_t stream);
cudaError_t LaunchOneShot(const KernelParams& p, DType dtype, int num_ctas, cudaStream_t stream);
// The decode-size one-shot kernel (oneshot_rows.cu): whether a call fits it (one row per block,
// the row in registers), its launcher and its preloading.
bool OneShotRowsFits(int tokens, int hidden, DType dtype, int num_ctas);
cudaError_t LaunchOneShotRows(const KernelParams& p, DType dtype, int num_ctas,
                              cudaStream_t stream);
cudaError_t PreloadOneShotRowsKernels();
// Whether a call may keep its residual replicated (KernelParams::residual_replicated), on a P2P
// comm: one rank (nothing is exchanged), or the decode one-shot kernel.
inline bool ResidualReplicatedFits(int nranks, int tokens, int hidden, DType dtype, Algo algo,
                                   bool multimem, int num_ctas) {
  return !multimem && (nranks == 1 || (algo == Algo::kOneShot &&
                                       OneShotRowsFits(tokens, hidden, dtype, num_ctas)));
}
// The call of a one-rank group (local_rows.cu): add + RMSNorm, no sync state. Every call of a
// comm of one rank takes it, whatever the algo and CTA count asked for.
cudaError_t LaunchLocalRows(const KernelParams& p, DType dtype, cudaStream_t stream);
cudaError_t PreloadLocalRowsKernels();
// The copy-engine call (ce.cu, ce_call.cc): reduce-scatter and all-gather by copy engine around
// one local reduce + norm kernel. IssueCopyEngineCall returns "" or why it failed.
std::string IssueCopyEngineCall(const KernelParams& p, DType dtype, int num_ctas,
                                cudaStream_t stream);
cudaError_t LaunchCeReduce(const KernelParams& p, DType dtype, int num_ctas, cudaStream_t stream);
cudaError_t LaunchCeFinish(const KernelParams& p, DType dtype, cudaStream_t stream);
cudaError_t LaunchCeWait(const KernelParams& p, int phase, cudaStream_t stream);
cudaError_t PreloadCeKernels();
// A call whose launch gate expired (launch_gate.h): reports it as an expired wait of stage
// kStageLaunchGate (the group fails; `peer` the late rank, `call` the call it had not reached,
// `peer_calls` the calls it had) and leaves NaN in both outputs.
cudaError_t LaunchGateTimeout(const KernelParams& p, DType dtype, int peer, uint32_t call,
                              uint32_t peer_calls, cudaStream_t stream);
// GB/s one device's copy engine moves into the next device's memory, all devices at once.
double MeasureCopyBandwidth(const std::vector<int>& ordinals, int64_t bytes, int reps);
// Loads every kernel of the extension into the current device's context (see
// allreduce_rmsnorm.cu: a lazy load behind a spinning kernel can stall a launch).
cudaError_t PreloadKernels();
cudaError_t PreloadOneShotKernels();
// Fills the one-shot buffers at `ptr` (`bytes`, a multiple of 16) with the sentinel.
cudaError_t LaunchFillSentinel(void* ptr, int64_t bytes, cudaStream_t stream);

}  // namespace tokenweave

#define TW_STR2(x) #x
#define TW_STR(x) TW_STR2(x)
#define TW_WHERE __FILE__ ":" TW_STR(__LINE__)

// Inside a function returning xla::ffi::Error.
#define TW_FFI_CHECK(expr)                                                       \
  do {                                                                           \
    cudaError_t tw_err_ = (expr);                                                \
    if (tw_err_ != cudaSuccess)                                                  \
      return ::xla::ffi::Error::Internal(std::string(TW_WHERE ": " #expr ": ") + \
                                         cudaGetErrorString(tw_err_));           \
  } while (0)

// Inside host code that reports failures by exception (registration, module functions).
#define TW_THROW_CHECK(expr)                                           \
  do {                                                                 \
    cudaError_t tw_err_ = (expr);                                      \
    if (tw_err_ != cudaSuccess)                                        \
      throw std::runtime_error(std::string(TW_WHERE ": " #expr ": ") + \
                               cudaGetErrorString(tw_err_));           \
  } while (0)
