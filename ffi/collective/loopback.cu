#include "loopback.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "comm.h"
#include "kernels.cuh"

namespace tokenweave {
namespace {

// Counts 16-byte vectors where a and b differ.
__global__ void CountMismatches(const uint4* a, const uint4* b, int64_t count,
                                unsigned long long* out) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    local += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
  }
  if (local) atomicAdd(out, local);
}

// Launched for the first time by LazyLoadProbe, while another kernel spins.
__global__ void LazyProbeKernel(int* out) {
  if (out != nullptr) *out = 1;
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax-tokenweave loopback: ") + what + ": " +
                             cudaGetErrorString(e));
}

// Device buffers of the harness, freed on scope exit.
struct Buffers {
  std::vector<void*> ptrs;
  ~Buffers() {
    for (void* p : ptrs) cudaFree(p);
  }
  char* Alloc(int64_t bytes) {
    void* p = nullptr;
    Check(cudaMalloc(&p, bytes > 0 ? bytes : 16), "cudaMalloc");
    ptrs.push_back(p);
    return static_cast<char*>(p);
  }
};

struct Streams {
  std::vector<cudaStream_t> s;
  std::vector<cudaEvent_t> e;
  ~Streams() {
    for (cudaStream_t x : s) cudaStreamDestroy(x);
    for (cudaEvent_t x : e) cudaEventDestroy(x);
  }
};

}  // namespace

LoopbackResult RunLoopback(const LoopbackRequest& req) {
  Comm* comm = LookupComm(req.comm_id);
  if (comm == nullptr || !comm->options().loopback)
    throw std::runtime_error("jax-tokenweave loopback: not a loopback comm");
  const int n = comm->group_size(), t = req.tokens, h = req.hidden;
  const int q = req.residual_replicated ? t : (t + n - 1) / n;  // residual rows per rank
  const int64_t es = req.dtype == DType::kF32 ? 4 : 2, rb = h * es;
  const int top = req.algo == Algo::kOneShot ? kMaxOneShotCtas : kMaxLoopbackCtas;
  if (req.num_ctas < kMinCtas || req.num_ctas > top)
    throw std::runtime_error("jax-tokenweave loopback: num_ctas=" + std::to_string(req.num_ctas) +
                             " is outside [" + std::to_string(kMinCtas) + ", " +
                             std::to_string(top) +
                             "] (every rank's blocks share one GPU and must be resident at once)");
  if (t < 1 || h < 8 || h % 8 != 0 || h > kMaxHidden || req.slots < 1 ||
      req.slots > comm->options().num_slots || req.calls < 1)
    throw std::runtime_error("jax-tokenweave loopback: bad request");
  if (static_cast<int64_t>(req.partial.size()) != n * t * rb ||
      static_cast<int64_t>(req.residual.size()) != n * q * rb ||
      static_cast<int64_t>(req.weight.size()) != h * 4)
    throw std::runtime_error("jax-tokenweave loopback: input sizes do not match [N, T, H]");
  if (req.residual_replicated &&
      !ResidualReplicatedFits(n, t, h, req.dtype, req.algo, false, req.num_ctas))
    throw std::runtime_error(
        "jax-tokenweave loopback: a replicated residual needs the decode one-shot kernel "
        "(one_shot, T <= num_ctas, rows of at most 16 KiB)");
  const int64_t need = req.algo == Algo::kOneShot
                           ? OneShotBytes(n, t, req.residual_replicated ? 0 : q, h, es)
                       : req.algo == Algo::kDirect ? kDirectBytes
                                                   : TwoShotBytes(n, q, h, es);
  const int64_t have =
      req.algo == Algo::kOneShot ? comm->options().oneshot_bytes : comm->options().area_bytes;
  if (need > have) throw std::runtime_error("jax-tokenweave loopback: workspace too small");
  Check(cudaSetDevice(comm->At(0)->ordinal), "cudaSetDevice");

  Buffers buf;
  std::vector<char*> partial(n), residual(n), normed(n), res_out(n), ref_n(n), ref_r(n);
  char* weight = buf.Alloc(h * 4);
  Check(cudaMemcpy(weight, req.weight.data(), h * 4, cudaMemcpyHostToDevice), "copy weight");
  for (int r = 0; r < n; ++r) {
    partial[r] = buf.Alloc(t * rb);
    residual[r] = buf.Alloc(q * rb);
    normed[r] = buf.Alloc(t * rb);
    res_out[r] = buf.Alloc(q * rb);
    ref_n[r] = buf.Alloc(t * rb);
    ref_r[r] = buf.Alloc(q * rb);
    Check(cudaMemcpy(partial[r], req.partial.data() + r * t * rb, t * rb, cudaMemcpyHostToDevice),
          "copy partial");
    Check(cudaMemcpy(residual[r], req.residual.data() + r * q * rb, q * rb, cudaMemcpyHostToDevice),
          "copy residual");
    // All-ones bytes are NaN in every dtype: an element the kernels never write shows.
    Check(cudaMemset(normed[r], 0xff, t * rb), "poison");
    Check(cudaMemset(res_out[r], 0xff, q * rb), "poison");
  }
  auto* mismatches = reinterpret_cast<unsigned long long*>(buf.Alloc(8));
  Check(cudaMemset(mismatches, 0, 8), "cudaMemset");

  Streams st;
  st.s.resize(n);
  st.e.resize(n + 3);
  for (auto& s : st.s) Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  for (auto& e : st.e) Check(cudaEventCreate(&e), "event");
  cudaEvent_t fork = st.e[n], t0 = st.e[n + 1], t1 = st.e[n + 2];

  // Rank r's fused call on its stream.
  auto launch = [&](int call, int r) {
    KernelParams p{};
    comm->Fill(*comm->At(r), call % req.slots, p);
    p.partial = partial[r];
    p.residual = residual[r];
    p.weight = reinterpret_cast<const float*>(weight);
    p.normed = normed[r];
    p.residual_out = res_out[r];
    p.tokens = t;
    p.hidden = h;
    p.rows = q;
    p.eps = req.eps;
    p.residual_replicated = req.residual_replicated ? 1 : 0;
    Check(LaunchAllreduceRmsnorm(p, req.dtype, req.algo, false, req.num_ctas, st.s[r]), "launch");
  };
  // The ranks' streams fork from stream 0 (join: back into it).
  auto fork_ranks = [&]() {
    Check(cudaEventRecord(fork, st.s[0]), "record fork");
    for (int r = 1; r < n; ++r) Check(cudaStreamWaitEvent(st.s[r], fork, 0), "wait fork");
  };
  auto join_ranks = [&]() {
    for (int r = 1; r < n; ++r) {
      Check(cudaEventRecord(st.e[r], st.s[r]), "record join");
      Check(cudaStreamWaitEvent(st.s[0], st.e[r], 0), "wait join");
    }
  };
  // One call of every rank, forked and joined.
  auto issue = [&](int call, bool skip) {
    fork_ranks();
    for (int r = 0; r < n; ++r)
      if (!skip || r != req.skip_rank) launch(call, r);
    join_ranks();
  };
  auto compare = [&](cudaStream_t s) {
    for (int r = 0; r < n; ++r) {
      CountMismatches<<<32, 256, 0, s>>>(reinterpret_cast<uint4*>(normed[r]),
                                         reinterpret_cast<uint4*>(ref_n[r]), t * rb / 16,
                                         mismatches);
      CountMismatches<<<32, 256, 0, s>>>(reinterpret_cast<uint4*>(res_out[r]),
                                         reinterpret_cast<uint4*>(ref_r[r]), q * rb / 16,
                                         mismatches);
    }
    Check(cudaGetLastError(), "compare");
  };

  LoopbackResult res;
  for (int call = 0; call < req.calls; ++call) {
    if (std::string why = FailureMessage(*comm); !why.empty()) {
      res.error = why;
      break;
    }
    issue(call, call == req.skip_call);
    if (call == 0 || call == req.skip_call) Check(cudaStreamSynchronize(st.s[0]), "sync");
    if (call == 0) {
      for (int r = 0; r < n; ++r) {
        Check(cudaMemcpy(ref_n[r], normed[r], t * rb, cudaMemcpyDeviceToDevice), "ref");
        Check(cudaMemcpy(ref_r[r], res_out[r], q * rb, cudaMemcpyDeviceToDevice), "ref");
      }
    } else {
      compare(st.s[0]);
    }
  }
  Check(cudaStreamSynchronize(st.s[0]), "sync");
  if (res.error.empty()) res.error = FailureMessage(*comm);

  if (res.error.empty() && req.graph_calls > 0 && req.graph_replays > 0) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    Check(cudaStreamBeginCapture(st.s[0], cudaStreamCaptureModeThreadLocal), "begin capture");
    if (req.free_running) {  // each rank's calls back to back, as on GPUs of their own
      fork_ranks();
      for (int call = 0; call < req.graph_calls; ++call)
        for (int r = 0; r < n; ++r) launch(call, r);
      join_ranks();
    } else {
      for (int call = 0; call < req.graph_calls; ++call) issue(call, false);
    }
    Check(cudaStreamEndCapture(st.s[0], &graph), "end capture");
    Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    Check(cudaGraphLaunch(exec, st.s[0]), "warm-up replay");
    for (int i = 0; i < req.graph_replays; ++i) {
      Check(cudaEventRecord(t0, st.s[0]), "record");
      Check(cudaGraphLaunch(exec, st.s[0]), "replay");
      Check(cudaEventRecord(t1, st.s[0]), "record");
      Check(cudaEventSynchronize(t1), "sync");
      float ms = 0;
      Check(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
      res.call_us.push_back(ms * 1000.f / req.graph_calls);
    }
    compare(st.s[0]);
    Check(cudaStreamSynchronize(st.s[0]), "sync");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    res.error = FailureMessage(*comm);
  }

  unsigned long long count = 0;
  Check(cudaMemcpy(&count, mismatches, 8, cudaMemcpyDeviceToHost), "copy count");
  res.mismatches = static_cast<int64_t>(count);
  res.normed.resize(n * t * rb);
  res.residual_out.resize(n * q * rb);
  for (int r = 0; r < n; ++r) {
    Check(cudaMemcpy(res.normed.data() + r * t * rb, normed[r], t * rb, cudaMemcpyDeviceToHost),
          "copy normed");
    Check(cudaMemcpy(res.residual_out.data() + r * q * rb, res_out[r], q * rb,
                     cudaMemcpyDeviceToHost),
          "copy residual_out");
  }
  return res;
}

std::vector<uint8_t> OneShotEncode(const std::vector<uint8_t>& data, int itemsize,
                                   std::vector<uint8_t>* pending) {
  if (data.size() % 16 != 0 || (itemsize != 2 && itemsize != 4))
    throw std::invalid_argument("jax-tokenweave: whole 16-byte vectors of 2- or 4-byte items");
  std::vector<uint8_t> out(data.size());
  pending->assign(data.size() / 16, 0);
  for (size_t i = 0; i < data.size(); i += 16) {
    uint4 v, e;
    std::memcpy(&v, data.data() + i, 16);
    e = itemsize == 2 ? Canonical<__nv_bfloat16>(v) : Canonical<float>(v);
    std::memcpy(out.data() + i, &e, 16);
    (*pending)[i / 16] = itemsize == 2 ? HasSentinel<__nv_bfloat16>(v) : HasSentinel<float>(v);
  }
  return out;
}

std::vector<double> LazyLoadProbe(int64_t comm_id, bool preload) {
  Comm* comm = LookupComm(comm_id);
  if (comm == nullptr || !comm->options().loopback || comm->group_size() < 2)
    throw std::runtime_error("jax-tokenweave loopback: the probe needs a loopback comm of >= 2");
  Check(cudaSetDevice(comm->At(0)->ordinal), "cudaSetDevice");
  cudaFuncAttributes attr;
  if (preload) Check(cudaFuncGetAttributes(&attr, LazyProbeKernel), "preload");
  Buffers buf;
  const int n = comm->group_size(), h = 1024, q = 1;
  char* in = buf.Alloc(n * h * 2);
  char* out = buf.Alloc(n * h * 2);
  char* weight = buf.Alloc(h * 4);
  Check(cudaMemset(in, 0, n * h * 2), "memset");
  Check(cudaMemset(weight, 0, h * 4), "memset");
  Streams st;
  st.s.resize(2);
  for (auto& s : st.s) Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  // Rank 0 alone: its one-shot kernel waits for rank 1 until the comm's bound expires.
  KernelParams p{};
  comm->Fill(*comm->At(0), 0, p);
  p.partial = in;
  p.residual = in;
  p.weight = reinterpret_cast<const float*>(weight);
  p.normed = out;
  p.residual_out = out + h * 2;
  p.tokens = 1;
  p.hidden = h;
  p.rows = q;
  p.eps = 1e-6f;
  Check(LaunchAllreduceRmsnorm(p, DType::kBF16, Algo::kOneShot, false, 1, st.s[0]), "spinner");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  LazyProbeKernel<<<1, 1, 0, st.s[1]>>>(nullptr);
  Check(cudaGetLastError(), "probe launch");
  const auto t1 = Clock::now();
  Check(cudaStreamSynchronize(st.s[1]), "probe sync");
  const auto t2 = Clock::now();
  Check(cudaStreamSynchronize(st.s[0]), "spinner sync");
  const auto t3 = Clock::now();
  auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  return {sec(t0, t1), sec(t0, t2), sec(t0, t3)};
}

}  // namespace tokenweave
