// Device helpers of the fused kernels: typed 16-byte vectors, memory-order primitives, the
// device-resident per-call state (begin/end of a call), bounded waits that report and abort
// instead of trapping, the cross-rank barrier, and row copies.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common.h"

namespace tokenweave {

// Eight bf16/fp16 or four fp32 values: one 16-byte access.
template <typename T>
struct Vec {
  static constexpr int kN = 16 / sizeof(T);
};

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// A quiet NaN in every element of a 16-byte vector of T.
template <typename T>
__device__ __forceinline__ uint4 NanVec();
template <>
__device__ __forceinline__ uint4 NanVec<float>() {
  return make_uint4(0x7fc00000u, 0x7fc00000u, 0x7fc00000u, 0x7fc00000u);
}
template <>
__device__ __forceinline__ uint4 NanVec<__half>() {
  return make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u);
}
template <>
__device__ __forceinline__ uint4 NanVec<__nv_bfloat16>() {
  return make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
}

// acc[i] += v's i-th element.
template <typename T>
__device__ __forceinline__ void AddVec(float* acc, uint4 v) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < Vec<T>::kN; ++i) acc[i] += ToF(e[i]);
}

// Rounds acc to T, returns the packed vector and writes the rounded values back into acc.
template <typename T>
__device__ __forceinline__ uint4 PackRound(float* acc) {
  uint4 out;
  T* e = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < Vec<T>::kN; ++i) {
    e[i] = FromF<T>(acc[i]);
    acc[i] = ToF(e[i]);
  }
  return out;
}

// Loads: `Ldg` for inputs that no one writes during the kernel; `Ldcg` (L2 only) for areas that
// peers write during the kernel behind a barrier; `LdVolatile16` for one-shot receive buffers,
// polled while peers write them.
__device__ __forceinline__ uint4 Ldg(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 Ldcg(const void* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void St(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ uint4 LdVolatile16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t LdVolatile(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StVolatile(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One-shot encoding (common.h). A receive buffer is cleared to kSentinel words. 16-bit types
// are checked per element (0x8000, a negative zero, is "not yet"; senders send +0 instead);
// fp32 per word (senders replace the one float whose bits equal kSentinel, a negative
// denormal, by -0.0f). Element-wise checks stay correct even if a store lands in pieces.
__host__ __device__ __forceinline__ bool HalfIsSentinel(uint32_t w) {
  return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
}
template <typename T>
__host__ __device__ __forceinline__ bool HasSentinel(uint4 v) {
  if constexpr (sizeof(T) == 2)
    return HalfIsSentinel(v.x) | HalfIsSentinel(v.y) | HalfIsSentinel(v.z) | HalfIsSentinel(v.w);
  else
    return (v.x == kSentinel) | (v.y == kSentinel) | (v.z == kSentinel) | (v.w == kSentinel);
}
template <typename T>
__host__ __device__ __forceinline__ uint32_t Canonical(uint32_t w) {
  if constexpr (sizeof(T) == 2) {
    if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
    if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
    return w;
  } else {
    return w == kSentinel ? kSentinelReplacement : w;
  }
}
template <typename T>
__host__ __device__ __forceinline__ uint4 Canonical(uint4 v) {
  return make_uint4(Canonical<T>(v.x), Canonical<T>(v.y), Canonical<T>(v.z), Canonical<T>(v.w));
}

// Fills `bytes` (a multiple of 16) at `dst` with the sentinel, across the grid.
__device__ __forceinline__ void FillSentinel(char* dst, int64_t bytes) {
  const uint4 sentinel = make_uint4(kSentinel, kSentinel, kSentinel, kSentinel);
#pragma unroll 1
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < bytes / 16;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    St(dst + i * 16, sentinel);
}

// The one-shot receive buffer before this call's (its previous call's), by call state.
__device__ __forceinline__ char* PreviousOneShotBuffer(const KernelParams& p, uint32_t buf) {
  return p.oneshot[p.rank] + ((buf + kLamportBuffers - 1) % kLamportBuffers) * p.oneshot_bytes;
}

__device__ __forceinline__ int FlagIndex(int barrier, int src, int block) {
  return (barrier * kMaxRanks + src) * kMaxCtas + block;
}

// Index of sender `src`'s area inside receiver `dst`'s receive buffers ([N-1] entries; a rank
// never sends to itself).
__host__ __device__ __forceinline__ int PeerIndex(int src, int dst, int n) {
  return (src - dst + n) % n - 1;
}

// ---- Per-call state, kept on the device (advanced by the kernels, never by the host) ----

// What every block of a call reads at its start (from this rank's SlotControl).
struct CallState {
  uint32_t epoch;          // this call's epoch on the slot (calls completed + 1)
  uint32_t oneshot_buf;    // the one-shot receive buffer of this call (if it is one-shot)
  uint32_t oneshot_clear;  // bytes of the buffer the previous one-shot call used
  uint32_t ticket;         // this block's place among the call's arrivals (thread 0's copy)
  int abort;               // the group failed earlier: poison the outputs and return
};

__device__ __forceinline__ void StVolatile64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Reads the call state and arrives, in one round trip: thread 0's atomic on the slot's word
// returns the epoch and buffer (and counts the block in), in flight with the loads of the
// other words; all threads get the state. Arriving while reading is safe: the call's state
// changes only when its last block has arrived (AdvanceIfLast), and the next call on the
// slot starts only after this kernel ends (stream order). Block 0 also records `entered` for
// the timeout report.
__device__ __forceinline__ CallState ReadCallState(const KernelParams& p) {
  __shared__ CallState s;
  SlotControl* c = p.ctl[p.rank];
  if (threadIdx.x == 0) {
    const unsigned long long word = atomicAdd(&c->word, 1ull);
    uint32_t used[kLamportBuffers];
#pragma unroll
    for (int b = 0; b < kLamportBuffers; ++b) used[b] = LdVolatile(&c->oneshot_used[b]);
    const uint32_t failed = LdVolatile(&p.rank_ctl[p.rank]->failed);
    s.epoch = static_cast<uint32_t>(word >> 32) + 1;
    s.oneshot_buf = static_cast<uint32_t>(word >> 16) & 0xffffu;
    s.ticket = static_cast<uint32_t>(word) & 0xffffu;
    const uint32_t prev = (s.oneshot_buf + kLamportBuffers - 1) % kLamportBuffers;
    s.oneshot_clear = prev == 0 ? used[0] : (prev == 1 ? used[1] : used[2]);
    s.abort = failed != 0;
    if (blockIdx.x == 0) StVolatile(&c->entered, s.epoch);
  }
  __syncthreads();
  return s;
}

// The last block to arrive advances the slot: the epoch and, for a one-shot call
// (`oneshot_used` >= 0: the bytes it sent into each receiver's buffer, which the next one-shot
// call clears), the buffer rotation; the arrival count restarts at 0. A kernel may call this at
// its end (the store is its last act) or at once (BeginCall).
__device__ __forceinline__ void AdvanceIfLast(const KernelParams& p, const CallState& s,
                                              int64_t oneshot_used) {
  SlotControl* c = p.ctl[p.rank];
  if (threadIdx.x == 0 && s.ticket == gridDim.x - 1) {
    uint32_t buf = s.oneshot_buf;
    if (oneshot_used >= 0) {
      StVolatile(&c->oneshot_used[buf], static_cast<uint32_t>(oneshot_used));
      buf = (buf + 1) % kLamportBuffers;
    }
    StVolatile64(&c->word, (static_cast<unsigned long long>(s.epoch) << 32) |
                               (static_cast<unsigned long long>(buf) << 16));
  }
}

// ReadCallState and the advance at once. `oneshot_used` < 0: not a one-shot call.
__device__ __forceinline__ CallState BeginCall(const KernelParams& p, int64_t oneshot_used = -1) {
  const CallState s = ReadCallState(p);
  AdvanceIfLast(p, s, oneshot_used);
  return s;
}

__device__ __forceinline__ bool GroupFailed(const KernelParams& p) {
  return LdVolatile(&p.rank_ctl[p.rank]->failed) != 0;
}

// Marks the whole group failed and, first time only, describes the expired wait in the
// host-mapped record, which the host turns into the error message. Never traps: the CUDA
// context stays usable. No device printf: flushing it crashed the host process on the GPU
// image (seen twice on nvidia-h200/h100, inside the statically linked CUDA runtime).
// `progress`: the missing rank's counter of calls begun (default: its SlotControl::entered).
// ReportFailure takes the missing rank's progress as a value (the launch gate's host count).
static __device__ __noinline__ void ReportFailure(const KernelParams& p, int stage, int peer,
                                                  int block, uint32_t epoch, uint32_t seen,
                                                  uint32_t peer_progress) {
  for (int j = 0; j < p.nranks; ++j) StVolatile(&p.rank_ctl[j]->failed, 1);
  __threadfence_system();
  if (atomicCAS_system(&p.err->claimed, 0, 1) == 0) {  // the first report fills the record
    ErrorRecord* e = p.err;
    e->device = p.device;
    e->rank = p.rank;
    e->slot = p.slot;
    e->stage = stage;
    e->peer = peer;
    e->block = block;
    e->epoch = epoch;
    e->seen = seen;
    e->peer_entered = peer_progress;
    __threadfence_system();
    e->failed = 1;  // published last: a host that sees it sees the fields
    __threadfence_system();
  }
}

static __device__ __noinline__ void ReportTimeout(const KernelParams& p, int stage, int peer,
                                                  int block, uint32_t epoch, uint32_t seen,
                                                  const uint32_t* progress = nullptr) {
  ReportFailure(p, stage, peer, block, epoch, seen,
                LdVolatile(progress != nullptr ? progress : &p.ctl[peer]->entered));
}

// A bounded spin. Tick() returns kWait while waiting may go on; it looks at the clock and at
// the group's abort word every 64 spins.
struct Deadline {
  enum Result { kWait, kAborted, kExpired };
  uint64_t start = 0;
  uint32_t spins = 0;
  __device__ __forceinline__ Result Tick(const KernelParams& p) {
    if ((++spins & 63u) != 0) return kWait;
    if (GroupFailed(p)) return kAborted;
    const uint64_t now = GlobalTimer();
    if (start == 0) start = now;
    return now - start > p.timeout_ns ? kExpired : kWait;
  }
};

// Grid-wide, cross-rank barrier: every block of every rank arrives before any block leaves.
// Thread 0 of each block publishes (fence, then a release store of the epoch into every rank's
// flag for this block); threads of the block poll all N*G flags of this rank in parallel.
// Returns false (in every thread of the block) when a wait expired or the group failed.
static __device__ __noinline__ bool Barrier(const KernelParams& p, int barrier, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int k = 0; k < p.nranks; ++k) {
      const int dst = (p.rank + k) % p.nranks;
      StoreRelease(p.flags[dst] + FlagIndex(barrier, p.rank, blockIdx.x), epoch);
    }
  }
  bool ok = true;
  const int grid = gridDim.x;
  for (int t = threadIdx.x; ok && t < p.nranks * grid; t += blockDim.x) {
    const int src = t / grid, blk = t % grid;
    const uint32_t* flag = p.flags[p.rank] + FlagIndex(barrier, src, blk);
    uint32_t seen;
    Deadline d;
    while (static_cast<int32_t>((seen = LoadAcquire(flag)) - epoch) < 0) {
      const Deadline::Result r = d.Tick(p);
      if (r == Deadline::kWait) continue;
      if (r == Deadline::kExpired) ReportTimeout(p, barrier, src, blk, epoch, seen);
      ok = false;
      break;
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Fills normed [T, H] and residual_out [q, H] with NaN (grid-stride): what a call of a failed
// group leaves, so that a command-buffer replay, which no host check sees, is never mistaken
// for a result. For the barrier kernels, whose blocks write rows of other blocks' partitions
// (and, in `direct`, peers write ours): the fence makes this block's earlier writes land first,
// so the last block to poison leaves NaN (best effort; the one-shot kernel poisons by owner).
template <typename T>
__device__ __forceinline__ void PoisonOutputs(const KernelParams& p) {
  __threadfence();
  const int64_t vpr = p.hidden / Vec<T>::kN;
  const int64_t n_normed = p.tokens * vpr, total = n_normed + p.rows * vpr;
  const uint4 nan = NanVec<T>();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n_normed)
      St(static_cast<char*>(p.normed) + i * 16, nan);
    else
      St(static_cast<char*>(p.residual_out) + (i - n_normed) * 16, nan);
  }
}

// Copies `total_rows` rows of `vpr` 16-byte vectors across the grid: each block takes 8 rows
// at a time (index math once per row, 8 loads in flight per thread: 64 KiB per block, since a
// handful of CTAs is bound by the bytes it keeps in flight, not by NVLink). addr(i, src, dst)
// sets the addresses of row i; src = nullptr skips it. kNc: the source is an input nobody
// writes during the kernel (read through the non-coherent path); else it is read from L2.
// TCanon (not void): store the one-shot encoding of elements of that type (no sentinel).
template <bool kNc, typename TCanon = void, typename Addr>
__device__ __forceinline__ void RowCopy(int total_rows, int vpr, Addr addr) {
  constexpr int kU = 8;
  for (int base = blockIdx.x * kU; base < total_rows; base += gridDim.x * kU) {
    const char* s[kU];
    char* d[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      s[u] = nullptr;
      d[u] = nullptr;
      if (base + u < total_rows) addr(base + u, s[u], d[u]);
    }
    for (int v = threadIdx.x; v < vpr; v += blockDim.x) {
      uint4 x[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (s[u] != nullptr) x[u] = kNc ? Ldg(s[u] + v * 16) : Ldcg(s[u] + v * 16);
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (s[u] != nullptr) {
          if constexpr (std::is_void_v<TCanon>)
            St(d[u] + v * 16, x[u]);
          else
            St(d[u] + v * 16, Canonical<TCanon>(x[u]));
        }
    }
  }
}

}  // namespace tokenweave
