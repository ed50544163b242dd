// Paged attention, prompt tiles (tile > 1): flash attention on tensor cores.
// Grid (row block, kv head, group), 128 threads = 4 warps of 32 rows (two 16-row mma tiles
// each, so every K/V fragment read from shared memory feeds two mmas). A block's 128 rows are
// (query, head) pairs of one tile, the G heads of the kv head side by side
// (row = query * G + head), so each key tile in shared memory serves all of them. K/V tiles of
// 64 positions stream through shared memory (cp.async, two stages, 16-byte chunks XOR-swizzled
// by row so ldmatrix is conflict-free); S = Q K^T and O += P V run on mma.sync m16n8k16 with
// float32 accumulators; the block stops at its last row's position (causal).
#include "attention_common.cuh"
#include "attention_mma.cuh"

namespace tokenweave {
namespace attn {
namespace {

constexpr int kMTiles = 2;                               // 16-row mma tiles per warp
constexpr int kTileRows = kThreads / 32 * 16 * kMTiles;  // (query, head) rows per block: 128
constexpr int kTileKeys = 64;                            // key positions per shared-memory tile
constexpr int kSubKeys = 32;                             // keys per softmax step (S in registers)

template <int D>
constexpr int TileSmemBytes() {
  return (kTileRows + 2 /*stages*/ * 2 /*K, V*/ * kTileKeys) * D * 2 /*bytes*/;
}

template <typename T, int D>
__device__ __forceinline__ void LoadKvTile(T* sk, T* sv, const AttentionParams& p, int group, int h,
                                           int kt, int kend) {
  constexpr int kChunks = D / 8;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.tables + static_cast<int64_t>(group) * p.width;
  for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks, key = kt * kTileKeys + r;
    const bool full = key < kend;
    int64_t at = 0;
    if (full)
      at = ((BlockId(table, key / p.block_size, p.num_blocks) * p.block_size + key % p.block_size) *
                p.kvh +
            h) *
               D +
           c * 8;
    CpAsync16(sk + Swizzled<D>(r, c), kc + at, full);
    CpAsync16(sv + Swizzled<D>(r, c), vc + at, full);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) PrefillTileKernel(AttentionParams p) {
  constexpr int kChunks = D / 8;
  constexpr int kStage = kTileKeys * D;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [Q: kTileRows x D][stage 0: K, V][stage 1: K, V], each [rows, D] swizzled.
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* skv = sq + kTileRows * D;
  __shared__ int s_kend[kThreads / 32];
  const int G = p.hq / p.kvh;
  const int block_rows = blockIdx.x * kTileRows, h = blockIdx.y;
  const int group = gridDim.z - 1 - blockIdx.z;  // the longest groups (last tiles) first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;

  // Q tile into shared memory (zeros for rows past the tile).
  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kTileRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks, t = (block_rows + r) / G;
    const bool valid = t < p.tile;
    const int64_t at =
        valid ? ((static_cast<int64_t>(group) * p.tile + t) * p.hq + h * G + (block_rows + r) % G) *
                        D +
                    c * 8
              : 0;
    CpAsync16(sq + Swizzled<D>(r, c), q + at, valid);
  }
  asm volatile("cp.async.commit_group;\n" ::);

  // This thread's rows: m-tile mt, half i -> block row RowOf(mt, i); pos -1: no row.
  const auto row_of = [&](int mt, int i) {
    return block_rows + warp * 16 * kMTiles + mt * 16 + gid + 8 * i;
  };
  int pos[kMTiles][2];
  int mx = -1;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int t = row_of(mt, i) / G;
      pos[mt][i] = t < p.tile ? Context(p, group * p.tile + t) - 1 : -1;
      mx = max(mx, pos[mt][i]);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) s_kend[warp] = mx + 1;
  __syncthreads();
  int kend = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) kend = max(kend, s_kend[w]);
  // kend == 0 (no row with a position): no tile; the rows are written as zeros below.
  const int tiles = (kend + kTileKeys - 1) / kTileKeys;
  if (tiles > 0) LoadKvTile<T, D>(skv, skv + kStage, p, group, h, 0, kend);

  float o[kMTiles][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  float m[kMTiles][2], l[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;
  const float sscale = p.scale * kLog2e;
  const T* sqw = sq + warp * 16 * kMTiles * D;  // this warp's Q rows

  for (int kt = 0; kt < tiles; ++kt) {
    const int st = kt & 1;
    const T* sk = skv + 2 * st * kStage;
    const T* sv = sk + kStage;
    if (kt + 1 < tiles) {
      T* next = skv + 2 * (st ^ 1) * kStage;
      LoadKvTile<T, D>(next, next + kStage, p, group, h, kt + 1, kend);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();

#pragma unroll 1
    for (int sub = 0; sub < kTileKeys / kSubKeys; ++sub) {
      // S = Q K^T for kSubKeys keys: per m-tile, kSubKeys / 8 n-tiles.
      float s[kMTiles][kSubKeys / 8][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int n = 0; n < kSubKeys / 8; ++n)
          s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int mi = lane / 8;
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
          Ldmatrix4(a[mt], sqw + Swizzled<D>(mt * 16 + (lane % 8) + (mi % 2) * 8, kk * 2 + mi / 2));
#pragma unroll
        for (int np = 0; np < kSubKeys / 16; ++np) {
          const int r = sub * kSubKeys + np * 16 + (lane % 8) + (mi / 2) * 8, c = kk * 2 + mi % 2;
          uint32_t b[4];
          Ldmatrix4(b, sk + Swizzled<D>(r, c));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma<T>::Run(s[mt][2 * np], a[mt], b[0], b[1]);
            Mma<T>::Run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
      // Scale, causal mask, online softmax (a row's scores sit in the 4 lanes of a quad).
      uint32_t pa[kMTiles][kSubKeys / 16][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < kSubKeys / 8; ++n) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int key = kt * kTileKeys + sub * kSubKeys + n * 8 + tig * 2 + j % 2;
            const float v = key <= pos[mt][j / 2] ? s[mt][n][j] * sscale : -INFINITY;
            s[mt][n][j] = v;
            rmax[j / 2] = fmaxf(rmax[j / 2], v);
          }
        }
        float corr[2], msafe[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          rmax[i] = fmaxf(rmax[i], __shfl_xor_sync(0xffffffffu, rmax[i], 1));
          rmax[i] = fmaxf(rmax[i], __shfl_xor_sync(0xffffffffu, rmax[i], 2));
          const float mn = fmaxf(m[mt][i], rmax[i]);
          msafe[i] = mn == -INFINITY ? 0.f : mn;
          corr[i] = exp2f(m[mt][i] - msafe[i]);  // 0 while m is -inf
          m[mt][i] = mn;
          l[mt][i] *= corr[i];
        }
        // Rescale O only where a row's max moved (late in a long row it rarely does).
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o[mt][n][0] *= corr[0], o[mt][n][1] *= corr[0];
            o[mt][n][2] *= corr[1], o[mt][n][3] *= corr[1];
          }
        }
#pragma unroll
        for (int n = 0; n < kSubKeys / 8; ++n) {
          const float p0 = exp2f(s[mt][n][0] - msafe[0]), p1 = exp2f(s[mt][n][1] - msafe[0]);
          const float p2 = exp2f(s[mt][n][2] - msafe[1]), p3 = exp2f(s[mt][n][3] - msafe[1]);
          l[mt][0] += p0 + p1;
          l[mt][1] += p2 + p3;
          pa[mt][n / 2][(n % 2) * 2] = Vec<T>::FromFloat2(p0, p1);
          pa[mt][n / 2][(n % 2) * 2 + 1] = Vec<T>::FromFloat2(p2, p3);
        }
      }
      // O += P V over the kSubKeys keys.
#pragma unroll
      for (int kk = 0; kk < kSubKeys / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          const int mi = lane / 8;
          const int r = sub * kSubKeys + kk * 16 + (lane % 8) + (mi % 2) * 8, c = dp * 2 + mi / 2;
          uint32_t b[4];
          Ldmatrix4Trans(b, sv + Swizzled<D>(r, c));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma<T>::Run(o[mt][2 * dp], pa[mt][kk], b[0], b[1]);
            Mma<T>::Run(o[mt][2 * dp + 1], pa[mt][kk], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // the next iteration's load overwrites the other stage
  }

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float total = l[mt][i];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      const int r = row_of(mt, i), t = r / G;
      if (t >= p.tile) continue;
      T* dst = out + ((static_cast<int64_t>(group) * p.tile + t) * p.hq + h * G + r % G) * D;
      const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(dst + n * 8 + tig * 2) =
            Vec<T>::FromFloat2(o[mt][n][2 * i] * inv, o[mt][n][2 * i + 1] * inv);
    }
  }
}

template <typename T, int D>
cudaError_t LaunchPrefill(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kSmem = TileSmemBytes<D>();
  // The attribute is per function and device; setting it each launch is cheap and thread-safe.
  if (cudaError_t e = cudaFuncSetAttribute(PrefillTileKernel<T, D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      e != cudaSuccess)
    return e;
  const int g = p.hq / p.kvh;
  const dim3 grid((p.tile * g + kTileRows - 1) / kTileRows, p.kvh, p.groups);
  PrefillTileKernel<T, D><<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchForType(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return LaunchPrefill<T, 64>(p, stream);
    case 128: return LaunchPrefill<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchPrefillAttention(const AttentionParams& p, AttnDType dtype, cudaStream_t stream) {
  return dtype == AttnDType::kBF16 ? LaunchForType<__nv_bfloat16>(p, stream)
                                   : LaunchForType<__half>(p, stream);
}

}  // namespace attn
}  // namespace tokenweave
