// Paged attention, decode rows (tile == 1): the split-K kernel and its launch with the merge of
// the pieces (decode_merge.cuh).
// Grid (split, kv head, row), 4 warps (8 for rows run whole: LaunchDecode). A row's keys 0..p
// are cut into pieces of a multiple of 64 keys (at least 64): while the step's live (row, kv
// head) pairs (`live`: rows with a position >= 0) are fewer than the blocks the GPU holds at
// once (`capacity`), as many pieces as fit them all in that one wave (SplitRow: past a wave,
// pieces only against a short last wave); at most `splits` (the grid's x). A block streams its
// piece's K and V through shared memory in tiles of 8 KiB a warp (16 keys a warp at head_dim
// 128; cp.async, three stages, so two tiles are in flight while one is used; 16-byte chunks
// XOR-swizzled for ldmatrix; L2 evict-first, as nothing reads them again in the step, so the
// tables, queries and weights stay in L2: 16 rows x 1024 keys 19.6-19.7 us against 20.4-20.6
// on an H200). The row's first 32 x warps block-table entries load with its position; later
// ones a tile ahead of their copies.
// Each warp takes its own share of a tile's keys and computes transposed: S^T = K Q^T (keys
// as the mma's 16 rows, the group's G <= 8 query heads as its 8 columns, Q^T held in
// registers) and O^T += V^T P^T (head_dim as rows), with P^T moved into the B operand by
// movmatrix. So every key is multiplied once, not once per warp (the kernel before this one
// had each of its 4 warps compute S for all keys and 16 rows of which G were heads: 8x the
// tensor work and 2.5x the shared-memory reads, which made it issue-bound: 45% of issue slots
// at 62% of DRAM bandwidth on 16 rows x 1024 keys). Online softmax per warp (base-2, float32);
// at the end the warps merge through shared memory. A row cut in one piece is normalised and
// written here; otherwise the block writes unnormalised partial sums with their max and total,
// and the merge kernel combines them. Both kernels are launched as programmatic dependents
// (sm_90): each may start while the kernel before it drains, and waits for it
// (griddepcontrol.wait) before reading anything.
#include "attention_common.cuh"
#include "attention_mma.cuh"
#include "common/device_facts.h"
#include "decode_merge.cuh"

namespace tokenweave {
namespace attn {
namespace {

constexpr int kStages = 3;            // key tiles in shared memory
constexpr int kWarpTileBytes = 8192;  // K and V of a warp's keys of one tile
constexpr int kHeadCols = 8;          // the mma's n: query heads of a group, padded to 8
// Warps of the split kernel's block: 4 (two blocks per SM), or 8 (one) for rows run whole.
constexpr int kWarpsSplit = 4, kWarpsWhole = 8;
template <int W>
__host__ __device__ constexpr int SmemBytes() {  // the split kernel's dynamic shared memory
  return kStages * kWarpTileBytes * W;
}
template <int W>
__host__ __device__ constexpr int BlocksPerSm() {  // what that shared memory lets an SM hold
  return 8 / W;
}
template <int W>  // its static shared memory: the row's first 32 W block-table entries
__host__ __device__ constexpr int TableSmemBytes() {
  return 32 * W * static_cast<int>(sizeof(int32_t));
}

template <typename T, int D, int G, int W>
__global__ void __launch_bounds__(32 * W, BlocksPerSm<W>()) DecodeSplitKernel(AttentionParams p) {
  constexpr int kWarps = W, kThreads = 32 * W;
  constexpr int kTileBytes = kWarpTileBytes * W;  // K and V of one tile
  constexpr int kSmemBytes = SmemBytes<W>();
  constexpr int kKeys = kTileBytes / (4 * D);          // keys per tile (K and V, 2 bytes each)
  constexpr int kWarpKeys = kKeys / kWarps;            // a warp's keys of each tile
  constexpr int kKeyTiles = kWarpKeys / 16;            // its m-tiles of S^T (16 keys each)
  constexpr int kChunks = D / 8;                       // 16-byte chunks per key row
  constexpr int kCopies = kKeys * kChunks / kThreads;  // cp.async of K (and of V) per thread
  constexpr int kRowStep = kThreads / kChunks;         // key rows between a thread's copies
  constexpr int kDimTiles = D / 16;                    // k-steps of S^T, m-tiles of O^T
  constexpr int kOStride = D + 4;                      // floats per head in the final merge
  static_assert(kThreads % kChunks == 0 && kCopies * kRowStep == kKeys);
  static_assert(kWarpKeys % 16 == 0 && kKeyTiles >= 1);
  static_assert(G <= kHeadCols, "the heads of a kv head are the 8 columns of one mma tile");
  static_assert(kWarps * kHeadCols * (kOStride + 2) * 4 <= kSmemBytes);
  extern __shared__ __align__(128) unsigned char smem[];

  const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, quad = lane % 4;
  __shared__ int32_t first_ids[TableSmemBytes<W>() / sizeof(int32_t)];  // entries 0..kThreads-1
  WaitForPrerequisite();
  // One round trip for what needs no position: the row's first kThreads table entries (every
  // page of a context up to kThreads * block_size keys) and Q^T, the B operand of S^T = K Q^T
  // (column = head g; heads >= G are zero): qb[ks] = {b0, b1} of k-step ks. The position and
  // live count that decide the piece load beside them.
  const int32_t* table = p.tables + static_cast<int64_t>(row) * p.width;
  const int32_t first_id = tid < p.width ? __ldg(table + tid) : 0;
  uint32_t qb[kDimTiles][2];
  const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
#pragma unroll
  for (int ks = 0; ks < kDimTiles; ++ks) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      qb[ks][j] =
          g < G ? *reinterpret_cast<const uint32_t*>(qrow + g * D + ks * 16 + j * 8 + quad * 2)
                : 0u;
  }
  T* const out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
  const RowSplit rs = SplitRow(p, row);
  const int k0 = split * rs.chunk;
  if (k0 >= rs.ctx) {                 // the merge reads only the pieces under ctx
    if (rs.ctx == 0 && split == 0) {  // a padding row (no key): zeros, written once
      for (int e = threadIdx.x; e < G * D; e += kThreads) out[e] = Vec<T>::FromFloat(0.f);
    }
    return;
  }
  const int k1 = min(rs.ctx, k0 + rs.chunk);
  const int ntiles = (k1 - k0 + kKeys - 1) / kKeys;
  first_ids[tid] = first_id;
  __syncthreads();

  // This thread's copies: key rows r0 + i * kRowStep of a tile, 16-byte chunk `chunk` of each.
  const int bs = p.block_size, bs_shift = __ffs(bs) - 1;
  const bool bs_pow2 = (bs & (bs - 1)) == 0;
  const int r0 = tid / kChunks, chunk = tid % kChunks;
  const T* kc = static_cast<const T*>(p.k_cache) + h * D + chunk * 8;
  const T* vc = static_cast<const T*>(p.v_cache) + h * D + chunk * 8;
  const int64_t pos_stride = static_cast<int64_t>(p.kvh) * D;
  const auto page_of = [&](int key) { return bs_pow2 ? key >> bs_shift : key / bs; };
  // Block-table entries of tile t's copies (0 past the piece), read a tile before its copies.
  const auto load_ids = [&](int t, int32_t(&ids)[kCopies]) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int key = k0 + t * kKeys + r0 + i * kRowStep, page = page_of(key);
      ids[i] = key >= k1 ? 0 : page < kThreads ? first_ids[page] : __ldg(table + page);
    }
  };
  const uint64_t once = EvictFirstPolicy();  // a step reads each K/V byte once
  // Tile t of the piece into stage t % kStages (zeros past k1).
  const auto issue = [&](int t, const int32_t(&ids)[kCopies]) {
    T* sk = reinterpret_cast<T*>(smem + (t % kStages) * kTileBytes);
    T* sv = sk + kKeys * D;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int r = r0 + i * kRowStep, key = k0 + t * kKeys + r;
      const bool ok = key < k1;
      const int slot = bs_pow2 ? key & (bs - 1) : key % bs;
      const int64_t id = ClampBlock(ids[i], p.num_blocks);
      const int64_t at = ok ? (id * bs + slot) * pos_stride : 0;
      CpAsync16Hinted(sk + Swizzled<D>(r, chunk), kc + at, ok, once);
      CpAsync16Hinted(sv + Swizzled<D>(r, chunk), vc + at, ok, once);
    }
  };
  int32_t ids[kCopies], ids_next[kCopies];
  load_ids(0, ids);
  load_ids(1, ids_next);
  issue(0, ids);
  CpAsyncCommit();
  if (ntiles > 1) issue(1, ids_next);
  CpAsyncCommit();
  static_assert(kStages == 3, "the prologue issues two tiles");
  load_ids(2, ids);  // the next tile to issue: 2

  const float qscale = p.scale * kLog2e;
  // Heads 2 * quad and 2 * quad + 1: running max (base 2) and this thread's partial total.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[kDimTiles][4];  // O^T: c0, c1 = dim dt * 16 + g, heads 2 quad, +1; c2, c3: dim + 8
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  const int wkey = warp * kWarpKeys;  // the warp's first key within a tile

  for (int t = 0; t < ntiles; ++t) {
    CpAsyncWait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();             // ... and everyone's; stage (t - 1) % kStages is free again
    if (t + kStages - 1 < ntiles) {
      issue(t + kStages - 1, ids);
      load_ids(t + kStages, ids);  // read now, used by the next iteration's copies
    }
    CpAsyncCommit();
    const T* sk = reinterpret_cast<const T*>(smem + (t % kStages) * kTileBytes);
    const T* sv = sk + kKeys * D;

    // S^T = K Q^T for the warp's keys: s[mt] = keys mt * 16 + g (c0, c1) and + 8 (c2, c3).
    float s[kKeyTiles][4];
#pragma unroll
    for (int mt = 0; mt < kKeyTiles; ++mt) {
      s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kDimTiles; ++ks) {
        uint32_t a[4];
        Ldmatrix4(a, sk + Swizzled<D>(wkey + mt * 16 + ((lane / 8) % 2) * 8 + lane % 8,
                                      ks * 2 + lane / 16));
        Mma<T>::Run(s[mt], a, qb[ks][0], qb[ks][1]);
      }
    }
    const int key0 = k0 + t * kKeys + wkey + g;  // the key of s[0][0]
    const bool partial = t == ntiles - 1;        // only the last tile has keys past k1
#pragma unroll
    for (int mt = 0; mt < kKeyTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = !partial || key0 + mt * 16 + (i / 2) * 8 < k1;
        s[mt][i] = valid ? s[mt][i] * qscale : -INFINITY;
      }
    }
    // Online softmax per head: the 8 lanes of a quad position hold a head's 16 keys per tile.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < kKeyTiles; ++mt) {
      tile_max[0] = fmaxf(tile_max[0], fmaxf(s[mt][0], s[mt][2]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(s[mt][1], s[mt][3]));
    }
    float base[2], corr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int x = 4; x < 32; x *= 2)
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], x));
      const float m_new = fmaxf(m[j], tile_max[j]);
      base[j] = m_new == -INFINITY ? 0.f : m_new;  // a warp may have seen no key yet
      corr[j] = exp2f(m[j] - base[j]);             // 0 while m is -inf
      m[j] = m_new;
      l[j] *= corr[j];
    }
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      o[dt][0] *= corr[0], o[dt][1] *= corr[1];
      o[dt][2] *= corr[0], o[dt][3] *= corr[1];
    }
    // P^T as the B operand of O^T += V^T P^T: pb[mt] = {b0, b1} (keys 0..7, 8..15 of m-tile mt).
    uint32_t pb[kKeyTiles][2];
#pragma unroll
    for (int mt = 0; mt < kKeyTiles; ++mt) {
      const float p0 = exp2f(s[mt][0] - base[0]), p1 = exp2f(s[mt][1] - base[1]);
      const float p2 = exp2f(s[mt][2] - base[0]), p3 = exp2f(s[mt][3] - base[1]);
      l[0] += p0 + p2;
      l[1] += p1 + p3;
      pb[mt][0] = Transpose8x8(Vec<T>::FromFloat2(p0, p1));
      pb[mt][1] = Transpose8x8(Vec<T>::FromFloat2(p2, p3));
    }
    // V^T as the A operand: ldmatrix.trans of [keys, dims] 8x8 tiles.
#pragma unroll
    for (int mt = 0; mt < kKeyTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        uint32_t a[4];
        Ldmatrix4Trans(a, sv + Swizzled<D>(wkey + mt * 16 + (lane / 16) * 8 + lane % 8,
                                           dt * 2 + (lane / 8) % 2));
        Mma<T>::Run(o[dt], a, pb[mt][0], pb[mt][1]);
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // every warp is done with the tiles: the merge below reuses the memory
  AllowDependents();

  // The warps' (max, total, O^T) per head into shared memory, then one merge per output.
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int x = 4; x < 32; x *= 2) l[j] += __shfl_xor_sync(0xffffffffu, l[j], x);
  float* so = reinterpret_cast<float*>(smem);       // [warp][head][kOStride]
  float* sml = so + kWarps * kHeadCols * kOStride;  // [warp][head]: max, total
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float* head = so + (warp * kHeadCols + 2 * quad + j) * kOStride + g;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt)
      head[dt * 16] = o[dt][j], head[dt * 16 + 8] = o[dt][2 + j];
    if (g == 0) {
      sml[(warp * kHeadCols + 2 * quad + j) * 2] = m[j];
      sml[(warp * kHeadCols + 2 * quad + j) * 2 + 1] = l[j];
    }
  }
  __syncthreads();
  float* work = p.work + ((static_cast<int64_t>(row) * p.kvh + h) * p.splits + split) * G * (D + 2);
  for (int e = tid; e < G * D; e += kThreads) {
    const int head = e / D, d = e % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sml[(w * kHeadCols + head) * 2]);
    float total = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = sml[(w * kHeadCols + head) * 2];
      const float c = mw == -INFINITY ? 0.f : exp2f(mw - mx);
      total = fmaf(c, sml[(w * kHeadCols + head) * 2 + 1], total);
      sum = fmaf(c, so[(w * kHeadCols + head) * kOStride + d], sum);
    }
    if (rs.n == 1) {  // the row's only piece: its normalised output
      out[e] = Vec<T>::FromFloat(total > 0.f ? sum / total : 0.f);
    } else {  // head's entry of this piece: D unnormalised sums, then the max and the total
      work[head * (D + 2) + d] = sum;
      if (d == 0) work[head * (D + 2) + D] = mx, work[head * (D + 2) + D + 1] = total;
    }
  }
}

// Launches the split kernel of W warps on grid (p.splits, kv heads, rows).
template <typename T, int D, int G, int W>
cudaError_t LaunchSplit(const AttentionParams& p, bool programmatic, cudaStream_t stream) {
  // The attribute is per function and device; setting it each launch is cheap and thread-safe.
  if (cudaError_t e =
          cudaFuncSetAttribute(DecodeSplitKernel<T, D, G, W>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, SmemBytes<W>());
      e != cudaSuccess)
    return e;
  return LaunchKernel(DecodeSplitKernel<T, D, G, W>, dim3(p.splits, p.kvh, p.groups), dim3(32 * W),
                      {SmemBytes<W>(), 1, programmatic}, stream, p);
}

// The split kernel, then (where a row may take more than one piece) the merge. A grid of two
// pieces a row whose (row, kv head) pairs fit one block per SM (the engine's decode-only steps
// of 12-16 rows at 8 kv heads) runs each row whole in blocks of 8 warps instead: the same SMs
// stream the same bytes with as many warps, and no partial sums or merge kernel follow (where
// the device lets a block have the 193 KiB of shared memory: sm_90, not sm_80; 16 rows
// x 1024 keys on an H200: 20.5 us against 22.6 for two pieces and the merge; 16 x 8192: 127
// against 133).
template <typename T, int D, int G>
cudaError_t LaunchDecode(const AttentionParams& params, cudaStream_t stream) {
  DeviceFacts facts{};
  if (cudaError_t e = CurrentDeviceFacts(&facts); e != cudaSuccess) return e;
  AttentionParams p = params;
  const bool programmatic = facts.major >= 9;
  constexpr int kWholeSmem = SmemBytes<kWarpsWhole>() + TableSmemBytes<kWarpsWhole>();
  const int whole_capacity = BlocksPerSm<kWarpsWhole>() * facts.sms;
  if (kWholeSmem <= facts.smem_optin && p.splits == 2 &&
      static_cast<int64_t>(p.groups) * p.kvh <= whole_capacity) {
    p.splits = 1;
    p.capacity = whole_capacity;
    return LaunchSplit<T, D, G, kWarpsWhole>(p, programmatic, stream);
  }
  p.capacity = BlocksPerSm<kWarpsSplit>() * facts.sms;
  if (cudaError_t e = LaunchSplit<T, D, G, kWarpsSplit>(p, programmatic, stream); e != cudaSuccess)
    return e;
  if (p.splits == 1) return cudaSuccess;
  return LaunchKernel(DecodeMergeKernel<T, D, G>, dim3(p.groups, p.kvh), dim3(32 * G),
                      {0, 1, programmatic}, stream, p);
}

template <typename T, int D>
cudaError_t LaunchForDim(const AttentionParams& p, cudaStream_t stream) {
  switch (p.hq / p.kvh) {
    case 1: return LaunchDecode<T, D, 1>(p, stream);
    case 2: return LaunchDecode<T, D, 2>(p, stream);
    case 4: return LaunchDecode<T, D, 4>(p, stream);
    case 8: return LaunchDecode<T, D, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchForType(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return LaunchForDim<T, 64>(p, stream);
    case 128: return LaunchForDim<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchDecodeAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  return dtype == AttnDType::kBF16 ? LaunchForType<__nv_bfloat16>(p, stream)
                                   : LaunchForType<__half>(p, stream);
}

}  // namespace attn
}  // namespace tokenweave
