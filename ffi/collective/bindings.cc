// The collective's bindings in the extension module (ffi/module.h), used from
// jax_tokenweave.kernel: the fused kernel's FFI handler capsules, communicator registration and
// state, the limits and byte formulas the Python side sizes calls with, and the loopback test
// harness. None of them calls CUDA on import.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "ce_plan.h"
#include "comm.h"
#include "common.h"
#include "handlers.h"
#include "launch_gate.h"
#include "loopback.h"
#include "module.h"
#include "multicast.h"

namespace nb = nanobind;
using namespace tokenweave;

namespace {

Comm& GetComm(int64_t id) {
  Comm* c = LookupComm(id);
  if (c == nullptr)
    throw std::invalid_argument("jax-tokenweave: unknown comm id " + std::to_string(id));
  return *c;
}

Algo ParseAlgo(const std::string& algo) {
  if (algo == "two_shot") return Algo::kTwoShot;
  if (algo == "one_shot") return Algo::kOneShot;
  if (algo == "direct") return Algo::kDirect;
  if (algo == "ce") return Algo::kCopyEngine;
  throw std::invalid_argument("jax-tokenweave: unknown algo '" + algo + "'");
}

DType ParseDType(const std::string& dtype) {
  if (dtype == "float32") return DType::kF32;
  if (dtype == "float16") return DType::kF16;
  if (dtype == "bfloat16") return DType::kBF16;
  throw std::invalid_argument("jax-tokenweave: unsupported dtype '" + dtype + "'");
}

std::vector<uint8_t> Bytes(const nb::bytes& b) {
  const auto* p = static_cast<const uint8_t*>(b.data());
  return std::vector<uint8_t>(p, p + b.size());
}

nb::bytes ToBytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

}  // namespace

void tokenweave::BindCollective(nb::module_& m) {
  m.def("handlers", [] {
    nb::dict d;
    d["allreduce_rmsnorm"] = nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnorm));
    d["allreduce_rmsnorm_uncaptured"] =
        nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnormUncaptured));
    d["allreduce_rmsnorm_start"] =
        nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnormStart));
    d["allreduce_rmsnorm_done"] =
        nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnormDone));
    return d;
  });
  m.def(
      "register_comm",
      [](const std::vector<int>& ordinals, int group_size, int64_t area_bytes,
         int64_t oneshot_bytes, int num_slots, double timeout_s, bool multimem, bool loopback,
         int64_t ce_bytes, bool launch_gate) {
        nb::gil_scoped_release release;
        CommOptions o;
        o.area_bytes = area_bytes;
        o.oneshot_bytes = oneshot_bytes;
        o.ce_bytes = ce_bytes;
        o.num_slots = num_slots;
        o.timeout_s = timeout_s;
        o.multimem = multimem;
        o.loopback = loopback;
        o.launch_gate = launch_gate;
        return RegisterComm(ordinals, group_size, o);
      },
      nb::arg("ordinals"), nb::arg("group_size"), nb::arg("area_bytes"), nb::arg("oneshot_bytes"),
      nb::arg("num_slots"), nb::arg("timeout_s"), nb::arg("multimem") = false,
      nb::arg("loopback") = false, nb::arg("ce_bytes") = 0, nb::arg("launch_gate") = true,
      "Allocates a new communicator on the devices (CUDA ordinals in group order; -1 for a "
      "device of another process; with loopback, one ordinal repeated group_size times) and "
      "enables peer access within each group; returns its id. ce_bytes: each slot's "
      "copy-engine staging area (0: no copy-engine calls). launch_gate: each call first waits "
      "for this process's other devices of the comm (launch_gate.h).");
  m.def(
      "export_workspace",
      [](int64_t id, int index) {
        int64_t bytes = 0;
        const int fd = GetComm(id).ExportFd(index, &bytes);
        return nb::make_tuple(fd, bytes);
      },
      nb::arg("comm_id"), nb::arg("index"),
      "(fd, bytes): a new file descriptor of local device `index`'s workspace in a "
      "cross-process comm (the caller sends and closes it).");
  m.def(
      "import_workspace",
      [](int64_t id, int index, int fd, int64_t bytes) {
        nb::gil_scoped_release release;
        GetComm(id).Import(index, fd, bytes);
      },
      nb::arg("comm_id"), nb::arg("index"), nb::arg("fd"), nb::arg("bytes"),
      "Maps another process's device `index` workspace from a descriptor it exported (the "
      "descriptor is closed).");
  m.def(
      "comm_ready", [](int64_t id) { return GetComm(id).Ready(); },
      "Whether every peer of a local device is mapped.");
  m.def("release_comm", [](int64_t id) {
    nb::gil_scoped_release release;
    return ReleaseComm(id);
  });
  m.def("failure_message", [](int64_t id) -> nb::object {
    std::string why = FailureMessage(GetComm(id));
    if (why.empty()) return nb::none();
    return nb::str(why.c_str());
  });
  m.def(
      "launches", [](int64_t id) { return GetComm(id).launches(); },
      "Kernel launches the handlers issued for this comm (command-buffer replays issue none).");
  m.def("device_count", [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.def("can_access_peer", [](int a, int b) {
    int can = 0;
    TW_THROW_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
    return can != 0;
  });
  m.def("multimem_refusal", &MultimemRefusal,
        "'' when the multimem path may be set up, else why not (environment only).");
  m.def(
      "needed_bytes",
      [](const std::string& algo, int64_t n, int64_t tokens, int64_t hidden, int64_t itemsize,
         bool multimem, bool residual_replicated) {
        const int64_t rows = (tokens + n - 1) / n;
        if (multimem) return MultimemBytes(n, tokens, hidden, itemsize);
        switch (ParseAlgo(algo)) {
          case Algo::kOneShot:
            return OneShotBytes(n, tokens, residual_replicated ? 0 : rows, hidden, itemsize);
          case Algo::kDirect: return kDirectBytes;
          case Algo::kCopyEngine: return CopyEngineBytes(n, rows, hidden, itemsize);
          default: return TwoShotBytes(n, rows, hidden, itemsize);
        }
      },
      nb::arg("algo"), nb::arg("n"), nb::arg("tokens"), nb::arg("hidden"), nb::arg("itemsize"),
      nb::arg("multimem") = false, nb::arg("residual_replicated") = false,
      "Bytes of the per-slot working memory a call needs: the one-shot buffer for 'one_shot', "
      "the copy-engine staging area for 'ce', the data area otherwise.");
  m.def(
      "residual_replicated_fits",
      [](int n, int tokens, int hidden, const std::string& dtype, const std::string& algo,
         bool multimem, int num_ctas) {
        return ResidualReplicatedFits(n, tokens, hidden, ParseDType(dtype), ParseAlgo(algo),
                                      multimem, num_ctas);
      },
      nb::arg("n"), nb::arg("tokens"), nb::arg("hidden"), nb::arg("dtype"), nb::arg("algo"),
      nb::arg("multimem"), nb::arg("num_ctas"),
      "Whether a call may keep its residual replicated ([T, H] on every rank): one rank, or the "
      "decode one-shot kernel (algo 'one_shot', T <= num_ctas, rows of at most 16 KiB).");
  m.def("limits", [] {
    nb::dict d;
    d["max_ranks"] = kMaxRanks;
    d["min_ctas"] = kMinCtas;
    d["max_ctas"] = kMaxCtas;
    d["max_oneshot_ctas"] = kMaxOneShotCtas;
    d["max_ce_ctas"] = kMaxCeCtas;
    d["max_loopback_ctas"] = kMaxLoopbackCtas;
    d["max_hidden"] = kMaxHidden;
    d["threads"] = kThreads;
    d["oneshot_buffers"] = kLamportBuffers;
    d["hidden_multiple"] = kHiddenMultiple;
    nb::dict algos;  // the ids the handlers take as `algo` (common.h's Algo)
    algos["two_shot"] = static_cast<int>(Algo::kTwoShot);
    algos["one_shot"] = static_cast<int>(Algo::kOneShot);
    algos["direct"] = static_cast<int>(Algo::kDirect);
    algos["ce"] = static_cast<int>(Algo::kCopyEngine);
    d["algos"] = algos;
    return d;
  });
  m.def(
      "ce_plan",
      [](int rank, int n, int64_t tokens, int64_t row_bytes) {
        static const char* kKinds[] = {"scatter_copy", "signal",      "wait",
                                       "reduce",       "gather_copy", "finish"};
        if (n < 1 || n > kMaxRanks || rank < 0 || rank >= n || tokens < 1 || row_bytes < 1)
          throw std::invalid_argument("jax-tokenweave: ce_plan needs 0 <= rank < n <= 8, T, rb");
        nb::list ops;
        for (const CeOp& op : CePlan(rank, n, tokens, row_bytes))
          ops.append(nb::make_tuple(kKinds[op.kind], op.peer, op.phase, op.src, op.dst, op.bytes));
        return ops;
      },
      nb::arg("rank"), nb::arg("n"), nb::arg("tokens"), nb::arg("row_bytes"),
      "The copy-engine call of `rank` as (kind, peer, phase, src, dst, bytes) tuples, in "
      "stream order (ffi/collective/ce_plan.h).");
  m.def(
      "copy_bandwidth",
      [](const std::vector<int>& ordinals, int64_t bytes, int reps) {
        nb::gil_scoped_release release;
        return MeasureCopyBandwidth(ordinals, bytes, reps);
      },
      nb::arg("ordinals"), nb::arg("bytes"), nb::arg("reps") = 10,
      "GB/s of each device's copy-engine copy of `bytes` into the next device, all at once.");
  m.def(
      "loopback_run",
      [](int64_t comm_id, const std::string& dtype, const std::string& algo, int num_ctas,
         int tokens, int hidden, float eps, nb::bytes partial, nb::bytes residual, nb::bytes weight,
         int calls, int slots, int skip_call, int skip_rank, int graph_calls, int graph_replays,
         bool free_running, bool residual_replicated) {
        LoopbackRequest req;
        req.comm_id = comm_id;
        req.dtype = ParseDType(dtype);
        req.algo = ParseAlgo(algo);
        req.num_ctas = num_ctas;
        req.tokens = tokens;
        req.hidden = hidden;
        req.eps = eps;
        req.partial = Bytes(partial);
        req.residual = Bytes(residual);
        req.weight = Bytes(weight);
        req.calls = calls;
        req.slots = slots;
        req.skip_call = skip_call;
        req.skip_rank = skip_rank;
        req.graph_calls = graph_calls;
        req.graph_replays = graph_replays;
        req.free_running = free_running;
        req.residual_replicated = residual_replicated;
        LoopbackResult res;
        {
          nb::gil_scoped_release release;
          res = RunLoopback(req);
        }
        nb::dict d;
        d["normed"] = ToBytes(res.normed);
        d["residual_out"] = ToBytes(res.residual_out);
        d["mismatches"] = res.mismatches;
        d["call_us"] = res.call_us;
        d["error"] = res.error.empty() ? nb::none() : nb::object(nb::str(res.error.c_str()));
        return d;
      },
      nb::arg("comm_id"), nb::arg("dtype"), nb::arg("algo"), nb::arg("num_ctas"), nb::arg("tokens"),
      nb::arg("hidden"), nb::arg("eps"), nb::arg("partial"), nb::arg("residual"), nb::arg("weight"),
      nb::arg("calls") = 1, nb::arg("slots") = 1, nb::arg("skip_call") = -1,
      nb::arg("skip_rank") = 0, nb::arg("graph_calls") = 0, nb::arg("graph_replays") = 0,
      nb::arg("free_running") = false, nb::arg("residual_replicated") = false,
      "Runs every rank of a loopback comm on its one device (see ffi/collective/loopback.h).");
  m.def(
      "oneshot_encode",
      [](nb::bytes data, int itemsize) {
        std::vector<uint8_t> pending;
        std::vector<uint8_t> out = OneShotEncode(Bytes(data), itemsize, &pending);
        return nb::make_tuple(ToBytes(out), ToBytes(pending));
      },
      nb::arg("data"), nb::arg("itemsize"),
      "(encoded bytes, per-16-byte-vector 'still the sentinel' flags) of the one-shot wire "
      "encoding, computed on the host by the kernels' own functions.");
  m.def(
      "launch_gate_trial",
      [](const std::vector<int>& ordinals, const std::vector<std::pair<int, double>>& arrivals,
         double timeout_s) {
        LaunchGate gate(ordinals);
        std::vector<GateWait> waits(arrivals.size());
        std::vector<double> waited(arrivals.size());
        {
          nb::gil_scoped_release release;
          std::vector<std::thread> threads;
          const auto t0 = std::chrono::steady_clock::now();
          for (size_t i = 0; i < arrivals.size(); ++i)
            threads.emplace_back([&, i] {
              std::this_thread::sleep_until(t0 + std::chrono::duration<double>(arrivals[i].second));
              const auto a = std::chrono::steady_clock::now();
              waits[i] = gate.Arrive(arrivals[i].first, timeout_s);
              waited[i] =
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
            });
          for (auto& t : threads) t.join();
        }
        nb::list out;
        for (size_t i = 0; i < arrivals.size(); ++i)
          out.append(
              nb::make_tuple(waits[i].call, waits[i].late_ordinal, waits[i].late_calls, waited[i]));
        return out;
      },
      nb::arg("ordinals"), nb::arg("arrivals"), nb::arg("timeout_s"),
      "The launch gate's host logic alone (no CUDA): each (ordinal, delay_s) of `arrivals` "
      "arrives on its own thread after its delay; per arrival (call, late ordinal or -1, the "
      "late one's calls, seconds waited).");
  m.def(
      "lazy_load_probe",
      [](int64_t comm_id, bool preload) {
        nb::gil_scoped_release release;
        return LazyLoadProbe(comm_id, preload);
      },
      nb::arg("comm_id"), nb::arg("preload"),
      "Seconds a never-loaded kernel's launch, completion, and a spinning fused kernel's end "
      "take (see ffi/collective/loopback.h).");
}
