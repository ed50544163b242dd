// Where the fused kernel's fixed cost goes, on one GPU (N = 1: nothing to communicate).
//
// Times, per launch, kernels that each add one ingredient of the fused one-shot kernel to a
// minimal residual-add + RMSNorm of T rows (H = 8192 bf16, one 512-thread block per row):
// the large by-value parameter block, the device-resident call state (BeginCall: a load and an
// arrival atomic), a dynamically indexed local array (stack), and the real kernels. Each
// variant runs as a CUDA graph of kLaunches back-to-back launches; the figure is the median over
// replays of (graph time / kLaunches), so launch gaps are included and equal for all variants;
// "empty" gives that floor. Build and run (gpu_session.sh's `fixedcost` stage does both):
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I ffi benchmarks/fixed_cost/fixed_cost.cu -o fixed_cost
//   ./fixed_cost            # prints a markdown table
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../ffi/collective/local_rows.cu"
#include "../../ffi/collective/oneshot.cu"
#include "../../ffi/collective/oneshot_rows.cu"

namespace {

using tokenweave::KernelParams;
using tokenweave::kThreads;
using Bf = __nv_bfloat16;

#define CHECK(expr)                                                                              \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr int kH = 8192, kLaunches = 200, kReplays = 21;

struct Small {  // what a compiler-generated fusion passes
  const Bf* partial;
  const Bf* residual;
  const float* weight;
  Bf* normed;
  Bf* residual_out;
  int tokens;
  float eps;
};

// One row per block: sum = partial + residual (rounded to bf16), residual_out = sum,
// normed = sum * rsqrt(mean(sum^2) + eps) * w. Two 16-byte vectors per thread, one pass.
template <bool kStack>
__device__ __forceinline__ void Row(const Bf* partial, const Bf* residual, const float* weight,
                                    Bf* normed, Bf* residual_out, int row, float eps, int pick) {
  __shared__ float red[kThreads / 32];
  const uint4* pa = reinterpret_cast<const uint4*>(partial + static_cast<int64_t>(row) * kH);
  const uint4* re = reinterpret_cast<const uint4*>(residual + static_cast<int64_t>(row) * kH);
  float acc[2][8];
  float4 w[2][2];
  const char* srcs[4] = {reinterpret_cast<const char*>(pa), reinterpret_cast<const char*>(re),
                         reinterpret_cast<const char*>(pa), reinterpret_cast<const char*>(re)};
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int v = threadIdx.x + u * kThreads;
    uint4 a, b;
    if constexpr (kStack) {  // addresses through a dynamically indexed (local) array
      a = __ldg(reinterpret_cast<const uint4*>(srcs[pick & 3]) + v);
      b = __ldg(reinterpret_cast<const uint4*>(srcs[(pick + 1) & 3]) + v);
    } else {
      a = __ldg(pa + v);
      b = __ldg(re + v);
    }
    w[u][0] = __ldg(reinterpret_cast<const float4*>(weight + v * 8));
    w[u][1] = __ldg(reinterpret_cast<const float4*>(weight + v * 8) + 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
    tokenweave::AddVec<Bf>(acc[u], a);
    tokenweave::AddVec<Bf>(acc[u], b);
  }
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint4 r = tokenweave::PackRound<Bf>(acc[u]);
    tokenweave::St(residual_out + static_cast<int64_t>(row) * kH + (threadIdx.x + u * kThreads) * 8,
                   r);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += acc[u][i] * acc[u][i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) s += red[i];
  const float inv = rsqrtf(s / kH + eps);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int v = threadIdx.x + u * kThreads;
    float f[8];
    const float* wf = reinterpret_cast<const float*>(w[u]);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = acc[u][i] * inv * wf[i];
    tokenweave::St(normed + static_cast<int64_t>(row) * kH + v * 8, tokenweave::PackRound<Bf>(f));
  }
}

__global__ void Empty() {}

__global__ void __launch_bounds__(kThreads) Minimal(Small s) {
  if (blockIdx.x < s.tokens)
    Row<false>(s.partial, s.residual, s.weight, s.normed, s.residual_out, blockIdx.x, s.eps, 0);
}

__global__ void __launch_bounds__(kThreads) BigParams(const __grid_constant__ KernelParams p) {
  if (blockIdx.x < p.tokens)
    Row<false>(static_cast<const Bf*>(p.partial), static_cast<const Bf*>(p.residual),
               static_cast<const float*>(p.weight), static_cast<Bf*>(p.normed),
               static_cast<Bf*>(p.residual_out), blockIdx.x, p.eps, 0);
}

__global__ void __launch_bounds__(kThreads) WithCallState(const __grid_constant__ KernelParams p) {
  const tokenweave::CallState c = tokenweave::BeginCall(p);
  if (c.abort) return;
  if (blockIdx.x < p.tokens)
    Row<false>(static_cast<const Bf*>(p.partial), static_cast<const Bf*>(p.residual),
               static_cast<const float*>(p.weight), static_cast<Bf*>(p.normed),
               static_cast<Bf*>(p.residual_out), blockIdx.x, p.eps, 0);
}

__global__ void __launch_bounds__(kThreads) WithStack(const __grid_constant__ KernelParams p) {
  if (blockIdx.x < p.tokens)
    Row<true>(static_cast<const Bf*>(p.partial), static_cast<const Bf*>(p.residual),
              static_cast<const float*>(p.weight), static_cast<Bf*>(p.normed),
              static_cast<Bf*>(p.residual_out), blockIdx.x, p.eps, p.slot);
}

template <typename Launch>
double UsPerLaunch(Launch launch, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunches; ++i) launch(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int r = 0; r < kReplays + 2; ++r) {
    CHECK(cudaEventRecord(a, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) us.push_back(1000.0 * ms / kLaunches);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return us[us.size() / 2];
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, bytes));
  CHECK(cudaMemset(p, 0, bytes));
  return p;
}

}  // namespace

int main() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int kMaxT = 256;
  const size_t row_bytes = kH * sizeof(Bf);
  // Random bf16 inputs (never zeros only), weights near 1.
  std::vector<Bf> host(kMaxT * kH);
  std::srand(1);
  for (auto& x : host) x = __float2bfloat16(static_cast<float>(std::rand()) / RAND_MAX - 0.5f);
  std::vector<float> hw(kH);
  for (auto& x : hw) x = 1.f + 0.1f * (static_cast<float>(std::rand()) / RAND_MAX - 0.5f);
  void* partial = Alloc(kMaxT * row_bytes);
  void* residual = Alloc(kMaxT * row_bytes);
  void* normed = Alloc(kMaxT * row_bytes);
  void* residual_out = Alloc(kMaxT * row_bytes);
  auto* weight = static_cast<float*>(Alloc(kH * sizeof(float)));
  CHECK(cudaMemcpy(partial, host.data(), kMaxT * row_bytes, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(residual, host.data(), kMaxT * row_bytes, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(weight, hw.data(), kH * sizeof(float), cudaMemcpyHostToDevice));

  KernelParams p{};
  p.partial = partial;
  p.residual = residual;
  p.weight = weight;
  p.normed = normed;
  p.residual_out = residual_out;
  p.ctl[0] = static_cast<tokenweave::SlotControl*>(Alloc(sizeof(tokenweave::SlotControl)));
  p.rank_ctl[0] = static_cast<tokenweave::RankControl*>(Alloc(sizeof(tokenweave::RankControl)));
  p.oneshot[0] = static_cast<char*>(Alloc(3 * 256));
  p.flags[0] = static_cast<uint32_t*>(Alloc(256));
  p.data[0] = static_cast<char*>(Alloc(256));
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p.err), sizeof(tokenweave::ErrorRecord),
                      cudaHostAllocMapped));
  p.oneshot_bytes = 256;
  p.rank = 0;
  p.nranks = 1;
  p.hidden = kH;
  p.eps = 1e-5f;
  p.timeout_ns = 1000000000ull;

  std::printf("| variant | T | CTAs | us per launch | minus empty |\n|---|---|---|---|---|\n");
  const double empty = UsPerLaunch([&](cudaStream_t s) { Empty<<<1, 32, 0, s>>>(); }, stream);
  std::printf("| empty kernel | - | 1 | %.2f | 0 |\n", empty);
  for (int t : {1, 16, 64, 256}) {
    p.tokens = t;
    p.rows = t;
    const Small small{static_cast<const Bf*>(partial),
                      static_cast<const Bf*>(residual),
                      weight,
                      static_cast<Bf*>(normed),
                      static_cast<Bf*>(residual_out),
                      t,
                      1e-5f};
    const int ctas = t < 16 ? 16 : t;
    struct V {
      const char* name;
      int ctas;
      double us;
    };
    std::vector<V> rows;
    auto run = [&](const char* name, int grid, auto launch) {
      rows.push_back({name, grid, UsPerLaunch(launch, stream)});
    };
    run("minimal add+norm (small params)", ctas,
        [&](cudaStream_t s) { Minimal<<<ctas, kThreads, 0, s>>>(small); });
    run("+ KernelParams by value", ctas,
        [&](cudaStream_t s) { BigParams<<<ctas, kThreads, 0, s>>>(p); });
    run("+ BeginCall (state load, arrival atomic)", ctas,
        [&](cudaStream_t s) { WithCallState<<<ctas, kThreads, 0, s>>>(p); });
    run("+ local (stack) array", ctas,
        [&](cudaStream_t s) { WithStack<<<ctas, kThreads, 0, s>>>(p); });
    run("N = 1 kernel (local_rows.cu), 512 threads x 2 vectors", t, [&](cudaStream_t s) {
      tokenweave::LocalRowsKernel<Bf, 512, 2, false><<<t, 512, 0, s>>>(p);
    });
    run("N = 1 kernel, 512 x 2, no bounds checks", t, [&](cudaStream_t s) {
      tokenweave::LocalRowsKernel<Bf, 512, 2, true><<<t, 512, 0, s>>>(p);
    });
    run("N = 1 kernel, 256 threads x 4 vectors", t, [&](cudaStream_t s) {
      tokenweave::LocalRowsKernel<Bf, 256, 4, false><<<t, 256, 0, s>>>(p);
    });
    run("decode one-shot kernel (a row per block)", ctas,
        [&](cudaStream_t s) { tokenweave::OneShotRowsKernel<Bf, 2><<<ctas, kThreads, 0, s>>>(p); });
    run("general one-shot kernel, 512-thread rows", ctas, [&](cudaStream_t s) {
      tokenweave::OneShotKernel<Bf, 2, kThreads><<<ctas, kThreads, 0, s>>>(p);
    });
    run("general one-shot kernel, 128-thread rows", ctas, [&](cudaStream_t s) {
      tokenweave::OneShotKernel<Bf, 2, 128><<<ctas, kThreads, 0, s>>>(p);
    });
    CHECK(cudaGetLastError());
    for (const V& v : rows)
      std::printf("| %s | %d | %d | %.2f | %.2f |\n", v.name, t, v.ctas, v.us, v.us - empty);
  }
  CHECK(cudaStreamSynchronize(stream));
  return 0;
}
