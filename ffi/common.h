// Shared definitions of the jax-tokenweave CUDA extension: limits, kernel parameters, the
// host-mapped error record, and the CUDA error-checking macros.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace tokenweave {

constexpr int kMaxRanks = 8;        // largest group (tensor-parallel axis) size
constexpr int kMaxCtas = 32;        // largest grid of the fused kernel
constexpr int kMinCtas = 2;
constexpr int kThreads = 512;       // threads per block
constexpr int kNumBarriers = 2;     // barrier ids per call
constexpr int kDefaultSlots = 4;
constexpr int64_t kDefaultWorkspaceMiB = 2048;
constexpr int64_t kDefaultOneShotBytes = 64 * 1024;  // auto: one-shot when T*H*bytes <= this
constexpr double kDefaultTimeoutS = 10.0;

enum class Algo : int32_t { kAuto = 0, kTwoShot = 1, kOneShot = 2, kDirect = 3 };
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Written by a kernel that timed out in a barrier (cudaHostAlloc, mapped): the next handler
// call reads it and returns an error instead of running on a broken comm.
struct ErrorRecord {
  volatile int32_t failed;  // 0 until a kernel timed out
  int32_t device, rank, slot, barrier, peer, block;
  uint32_t epoch, seen;
  uint32_t peer_issued;  // the last epoch the missing rank's handler issued on this slot
};

// Everything one launch needs; passed by value.
struct KernelParams {
  const void* partial;       // [T, H], local
  const void* residual;      // [q, H], local
  const float* weight;       // [H], local (float32)
  void* normed;              // [T, H], local output
  void* residual_out;        // [q, H], local output
  char* data[kMaxRanks];     // this (slot, parity) data area on every rank, by rank
  uint32_t* flags[kMaxRanks];  // this slot's flags on every rank, by rank
  char* mc_data;             // multicast mapping of this (slot, parity) area (multimem only)
  ErrorRecord* err;
  // Per rank, host-mapped: the last epoch its handler issued on this slot. Read only by a
  // barrier that timed out, to say whether the missing rank's host never issued the call
  // (a host-side stall) or issued it and its stream never ran it (a device-side stall).
  const volatile uint32_t* issued[kMaxRanks];
  int32_t rank, nranks, tokens, hidden, rows;  // rows = q = ceil(T / N)
  int32_t device, slot;
  float eps;
  uint32_t epoch;
  uint64_t timeout_ns;
};

// Bytes one (slot, parity) area must hold for a call.
inline int64_t TwoShotBytes(int64_t n, int64_t rows, int64_t hidden, int64_t es) {
  return 2 * (n - 1) * rows * hidden * es;
}
inline int64_t OneShotBytes(int64_t n, int64_t tokens, int64_t rows, int64_t hidden, int64_t es) {
  return (n - 1) * (tokens + rows) * hidden * es;
}
// direct: only the mailbox (this rank's `partial` and `normed` addresses).
constexpr int64_t kDirectBytes = 16;
inline int64_t MultimemBytes(int64_t n, int64_t tokens, int64_t hidden, int64_t es) {
  return 2 * n * ((tokens + n - 1) / n) * hidden * es;
}

// Launches the fused kernel (defined in allreduce_rmsnorm.cu). Returns cudaSuccess or the
// launch error.
cudaError_t LaunchAllreduceRmsnorm(const KernelParams& p, DType dtype, Algo algo, bool multimem,
                                   int num_ctas, cudaStream_t stream);

}  // namespace tokenweave

#define TW_STR2(x) #x
#define TW_STR(x) TW_STR2(x)
#define TW_WHERE __FILE__ ":" TW_STR(__LINE__)

// Inside a function returning xla::ffi::Error.
#define TW_FFI_CHECK(expr)                                                                 \
  do {                                                                                     \
    cudaError_t tw_err_ = (expr);                                                          \
    if (tw_err_ != cudaSuccess)                                                            \
      return ::xla::ffi::Error::Internal(std::string(TW_WHERE ": " #expr ": ") +           \
                                         cudaGetErrorString(tw_err_));                     \
  } while (0)

// Inside host code that reports failures by exception (registration, module functions).
#define TW_THROW_CHECK(expr)                                                               \
  do {                                                                                     \
    cudaError_t tw_err_ = (expr);                                                          \
    if (tw_err_ != cudaSuccess)                                                            \
      throw std::runtime_error(std::string(TW_WHERE ": " #expr ": ") +                     \
                               cudaGetErrorString(tw_err_));                               \
  } while (0)
