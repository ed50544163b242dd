// Device helpers of the fused kernels: typed 16-byte vectors, system-scope flags, the
// all-blocks-of-all-ranks barrier with a bounded wait, and a block sum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

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
template <typename T> __device__ __forceinline__ T FromF(float x);
template <> __device__ __forceinline__ float FromF<float>(float x) { return x; }
template <> __device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
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
// peers write during the kernel, so a stale L1 line can never be read.
__device__ __forceinline__ uint4 Ldg(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 Ldcg(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ void St(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

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

__device__ __forceinline__ int FlagIndex(int barrier, int src, int block) {
  return (barrier * kMaxRanks + src) * kMaxCtas + block;
}

// Index of sender `src`'s area inside receiver `dst`'s receive buffers ([N-1] entries; a rank
// never sends to itself).
__device__ __forceinline__ int PeerIndex(int src, int dst, int n) { return (src - dst + n) % n - 1; }

// Grid-wide, cross-rank barrier: every block of every rank arrives before any block leaves.
// Thread 0 of each block publishes (fence, then a release store of the epoch into every rank's
// flag for this block); threads of the block poll all N*G flags of this rank in parallel.
// A wait longer than p.timeout_ns records who was missing, prints it and traps.
__device__ __noinline__ void Barrier(const KernelParams& p, int barrier) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int k = 0; k < p.nranks; ++k) {
      int dst = (p.rank + k) % p.nranks;
      StoreRelease(p.flags[dst] + FlagIndex(barrier, p.rank, blockIdx.x), p.epoch);
    }
  }
  const int grid = gridDim.x;
  for (int t = threadIdx.x; t < p.nranks * grid; t += blockDim.x) {
    const int src = t / grid, blk = t % grid;
    const uint32_t* flag = p.flags[p.rank] + FlagIndex(barrier, src, blk);
    uint32_t seen = LoadAcquire(flag);
    if (static_cast<int32_t>(seen - p.epoch) < 0) {
      const uint64_t start = GlobalTimer();
      while (static_cast<int32_t>((seen = LoadAcquire(flag)) - p.epoch) < 0) {
        if (GlobalTimer() - start > p.timeout_ns) {
          if (atomicCAS_system(const_cast<int32_t*>(&p.err->failed), 0, 1) == 0) {
            ErrorRecord* e = p.err;
            e->device = p.device; e->rank = p.rank; e->slot = p.slot; e->barrier = barrier;
            e->peer = src; e->block = blk; e->epoch = p.epoch; e->seen = seen;
            e->peer_issued = *p.issued[src];
            __threadfence_system();
            printf("jax-tokenweave: barrier timeout on device %d (rank %d, slot %d, barrier %d): "
                   "block %d of rank %d never arrived (epoch %u, flag %u; rank %d's host issued "
                   "epoch %u on this slot)\n",
                   p.device, p.rank, p.slot, barrier, blk, src, p.epoch, seen, src,
                   e->peer_issued);
          }
          __trap();
        }
      }
    }
  }
  __syncthreads();
}

// Sum of v over the block (all threads get it). `red` is 32 floats of shared memory.
__device__ __forceinline__ float BlockSum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `red` may still be read from the previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? red[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Copies `total_rows` rows of `vpr` 16-byte vectors across the grid: each block takes 8 rows
// at a time (index math once per row, 8 loads in flight per thread: 64 KiB per block, since a
// handful of CTAs is bound by the bytes it keeps in flight, not by NVLink). addr(i, src, dst)
// sets the addresses of row i; src = nullptr skips it. kNc: the source is an input nobody writes during
// the kernel (read through the non-coherent path); else it is read from L2 (peer-written).
template <bool kNc, typename Addr>
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
        if (s[u] != nullptr) St(d[u] + v * 16, x[u]);
    }
  }
}

}  // namespace tokenweave
