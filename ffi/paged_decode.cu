// Paged attention, decode rows (tile == 1): the split-K kernel and the merge of the pieces.
// Grid (split, kv head, row), 4 warps. A row's keys 0..p are cut into pieces of a multiple of
// 32 keys (at least 64): while the step's live (row, kv head) pairs (`live`: rows with a
// position >= 0) are fewer than the blocks the GPU holds at once (`capacity`), as many pieces
// as fit them all in that one wave (SplitRow: past a wave, pieces only against a short last
// wave); at most `splits` (the grid's x). A block streams its piece's
// K and V through shared memory in tiles of 16 KiB (32 keys at head_dim 128; cp.async, three
// stages, so two tiles are in flight while one is used; 16-byte chunks XOR-swizzled for
// ldmatrix). The G query heads of the block's kv head are the rows of one 16-row mma tile
// (grouped-query attention: one read of K/V serves them all): every warp computes
// S = Q K^T for the whole tile on tensor cores (mma.sync m16n8k16, float32 accumulators) and
// keeps the same online softmax (base-2, float32), then adds P V for its quarter of head_dim.
// A row cut in one piece is normalised and written here; otherwise the block writes
// unnormalised partial sums with their max and total, and the merge kernel combines them.
// Both kernels are launched as programmatic dependents (sm_90): each may start while the
// kernel before it drains, and waits for it (griddepcontrol.wait) before reading anything.
#include "attention_common.cuh"
#include "attention_mma.cuh"
#include "device_facts.h"

namespace tokenweave {
namespace attn {
namespace {

constexpr int kStages = 3;         // key tiles in shared memory
constexpr int kTileBytes = 16384;  // K and V of one tile
constexpr int kBlocksPerSm = 4;    // the split kernel's occupancy (launch bounds, shared memory)
constexpr int kWarps = kThreads / 32;
constexpr int kMergeBatch = 16;      // pieces whose partial sums the merge loads at once
constexpr int kTailPieceKeys = 256;  // piece length where the last wave is under half full

// Waits for the kernel this one depends on (programmatic launch); a no-op before sm_90.
__device__ __forceinline__ void WaitForPrerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the dependent kernel's blocks launch (they wait for this grid's end before reading).
__device__ __forceinline__ void AllowDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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
  // whole block's latency (16 rows x 1024 keys: 5 pieces made 640 blocks for 528 places, 34%
  // of the copy bandwidth on an H200). Past one wave, a row is one piece, unless the last
  // wave is under half full: then pieces of kTailPieceKeys, so the blocks left alone at the
  // end are short (67 rows x 1024 keys as one piece each: 65%).
  int pieces = 1;
  if (waves == 0)
    pieces = p.capacity / pairs;
  else if (last > 0 && 2 * last < p.capacity)
    pieces = (ctx + kTailPieceKeys - 1) / kTailPieceKeys;
  pieces = max(1, min(p.splits, pieces));
  const int chunk = SplitKeys(ctx, pieces);
  return {ctx, chunk, ctx > 0 ? (ctx + chunk - 1) / chunk : 0};
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) DecodeSplitKernel(AttentionParams p) {
  constexpr int kKeys = kTileBytes / (4 * D);          // keys per tile (K and V, 2 bytes each)
  constexpr int kChunks = D / 8;                       // 16-byte chunks per key row
  constexpr int kCopies = kKeys * kChunks / kThreads;  // cp.async of K (and of V) per thread
  constexpr int kKeyTiles = kKeys / 8;                 // n-tiles of S
  constexpr int kKSteps = D / 16;                      // k-steps of S = Q K^T
  constexpr int kDimTiles = D / kWarps / 8;            // n-tiles of O per warp
  static_assert(kCopies * kThreads == kKeys * kChunks && kDimTiles % 2 == 0 && kKSteps % 2 == 0);
  static_assert(G <= 8, "the heads of a kv head are the rows 0..7 of one mma tile");
  __shared__ __align__(128) unsigned char smem[kStages * kTileBytes];

  const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
  WaitForPrerequisite();
  const RowSplit rs = SplitRow(p, row);
  const int k0 = split * rs.chunk;
  if (k0 >= rs.ctx) {                 // the merge reads only the pieces under ctx
    if (rs.ctx == 0 && split == 0) {  // a padding row (no key): zeros, written once
      T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
      for (int e = threadIdx.x; e < G * D; e += kThreads) out[e] = Vec<T>::FromFloat(0.f);
    }
    return;
  }
  const int k1 = min(rs.ctx, k0 + rs.chunk);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bs = p.block_size;
  const int32_t* table = p.tables + static_cast<int64_t>(row) * p.width;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int64_t pos_stride = static_cast<int64_t>(p.kvh) * D;

  // Tile t of the piece into stage t % kStages (zeros past k1).
  const auto issue = [&](int t) {
    T* sk = reinterpret_cast<T*>(smem + (t % kStages) * kTileBytes);
    T* sv = sk + kKeys * D;
    const int base = k0 + t * kKeys;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = tid + i * kThreads, r = c / kChunks, chunk = c % kChunks;
      const int key = base + r;
      const bool ok = key < k1;
      const int64_t at =
          ok ? (BlockId(table, key / bs, p.num_blocks) * bs + key % bs) * pos_stride + h * D +
                   chunk * 8
             : 0;
      CpAsync16(sk + Swizzled<D>(r, chunk), kc + at, ok);
      CpAsync16(sv + Swizzled<D>(r, chunk), vc + at, ok);
    }
  };
  const int ntiles = (k1 - k0 + kKeys - 1) / kKeys;
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < ntiles) issue(t);
    CpAsyncCommit();
  }

  // Q as the A operand (row = head of the group; rows >= G and 8..15 are zero), while the
  // first tiles load: qa[ks] = {a0, a2} of k-step ks (a1 = a3 = 0).
  const int g = lane / 4, quad = lane % 4;
  uint32_t qa[kKSteps][2];
  const T* qrow = static_cast<const T*>(p.q) + (static_cast<int64_t>(row) * p.hq + h * G) * D;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      qa[ks][j] =
          g < G ? *reinterpret_cast<const uint32_t*>(qrow + g * D + ks * 16 + j * 8 + quad * 2)
                : 0u;
  }
  const float qscale = p.scale * kLog2e;
  float m = -INFINITY, l = 0.f;  // row g's running max (base 2) and this thread's partial total
  float o[kDimTiles][4];         // O[g][dims of this warp]: c0, c1 (c2, c3: rows 8..15)
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    CpAsyncWait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();             // ... and everyone's; stage (t - 1) % kStages is free again
    if (t + kStages - 1 < ntiles) issue(t + kStages - 1);
    CpAsyncCommit();
    const T* sk = reinterpret_cast<const T*>(smem + (t % kStages) * kTileBytes);
    const T* sv = sk + kKeys * D;
    const int base = k0 + t * kKeys;

    // S = Q K^T over the tile's keys: s[nt] = keys nt * 8 .. + 7 (c0, c1: keys quad * 2 + 0, 1).
    float s[kKeyTiles][4];
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kp = 0; kp < kKSteps / 2; ++kp) {  // two k-steps per ldmatrix.x4
        uint32_t b[4];
        Ldmatrix4(b, sk + Swizzled<D>(nt * 8 + lane % 8, kp * 4 + lane / 8));
        const uint32_t a0[4] = {qa[2 * kp][0], 0u, qa[2 * kp][1], 0u};
        const uint32_t a1[4] = {qa[2 * kp + 1][0], 0u, qa[2 * kp + 1][1], 0u};
        Mma<T>::Run(s[nt], a0, b[0], b[1]);
        Mma<T>::Run(s[nt], a1, b[2], b[3]);
      }
    }
    // Online softmax of row g over the tile (the quad's four lanes hold its keys).
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool valid = base + nt * 8 + quad * 2 + j < k1;
        s[nt][j] = valid ? s[nt][j] * qscale : -INFINITY;
        tile_max = fmaxf(tile_max, s[nt][j]);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);  // finite: a tile has a valid key
    const float corr = exp2f(m - m_new);     // 0 on the first tile (m = -inf)
    m = m_new;
    l *= corr;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] *= corr, o[dt][1] *= corr;
    uint32_t pa[kKeyTiles];  // P of row g, two keys per register (bf16/fp16)
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
      const float p0 = exp2f(s[nt][0] - m), p1 = exp2f(s[nt][1] - m);
      l += p0 + p1;
      pa[nt] = Vec<T>::FromFloat2(p0, p1);
    }
    // O[:, this warp's dims] += P V: k16 steps of 16 keys; ldmatrix.trans gives V's B operand
    // for two dim tiles (rows: keys, lanes / 8: which 8 keys and which dim tile).
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t a[4] = {pa[2 * kk], 0u, pa[2 * kk + 1], 0u};
#pragma unroll
      for (int dp = 0; dp < kDimTiles / 2; ++dp) {
        uint32_t b[4];
        Ldmatrix4Trans(b, sv + Swizzled<D>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                           (warp * kDimTiles + 2 * dp + lane / 16)));
        Mma<T>::Run(o[2 * dp], a, b[0], b[1]);
        Mma<T>::Run(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }
  CpAsyncWait<0>();
  AllowDependents();

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g >= G) return;
  // This thread's outputs: head g, dims warp * D / 4 + dt * 8 + quad * 2 + {0, 1}.
  if (rs.n == 1) {  // the row's only piece: its normalised output
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(row) * p.hq + h * G + g) * D;
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt)
      *reinterpret_cast<uint32_t*>(out + (warp * kDimTiles + dt) * 8 + quad * 2) =
          Vec<T>::FromFloat2(o[dt][0] * inv, o[dt][1] * inv);
    return;
  }
  // Head g's entry of this piece: D unnormalised sums, then the max and the total.
  float* work =
      p.work + (((static_cast<int64_t>(row) * p.kvh + h) * p.splits + split) * G + g) * (D + 2);
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt)
    *reinterpret_cast<float2*>(work + (warp * kDimTiles + dt) * 8 + quad * 2) =
        make_float2(o[dt][0], o[dt][1]);
  if (warp == 0 && quad == 0) work[D] = m, work[D + 1] = l;
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

// Launches `kernel` on `stream` as a programmatic dependent of the work before it (sm_90 on).
template <typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Args...), dim3 grid, dim3 block, bool programmatic,
                            cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// The split kernel, then (where a row may take more than one piece) the merge.
template <typename T, int D, int G>
cudaError_t LaunchDecode(const AttentionParams& params, cudaStream_t stream) {
  DeviceFacts facts{};
  if (cudaError_t e = CurrentDeviceFacts(&facts); e != cudaSuccess) return e;
  AttentionParams p = params;
  p.capacity = kBlocksPerSm * facts.sms;
  const bool programmatic = facts.major >= 9;
  if (cudaError_t e = LaunchDependent(DecodeSplitKernel<T, D, G>, dim3(p.splits, p.kvh, p.groups),
                                      dim3(kThreads), programmatic, stream, p);
      e != cudaSuccess)
    return e;
  if (p.splits == 1) return cudaSuccess;
  return LaunchDependent(DecodeMergeKernel<T, D, G>, dim3(p.groups, p.kvh), dim3(32 * G),
                         programmatic, stream, p);
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
