// nanobind module jax_tokenweave._tokenweave_ffi: FFI handler capsules, comm registration and
// the constants the Python side checks shapes against. Importing it calls no CUDA function.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include "common.h"
#include "handlers.h"
#include "workspace.h"

namespace nb = nanobind;
using namespace tokenweave;

NB_MODULE(_tokenweave_ffi, m) {
  m.doc() = "jax-tokenweave fused AllReduce + residual + RMSNorm (XLA FFI, CUDA)";
  m.def("handlers", [] {
    nb::dict d;
    d["allreduce_rmsnorm"] = nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnorm));
    d["allreduce_rmsnorm_start"] =
        nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnormStart));
    d["allreduce_rmsnorm_done"] =
        nb::capsule(reinterpret_cast<void*>(TokenweaveAllreduceRmsnormDone));
    return d;
  });
  m.def(
      "register_comm",
      [](const std::vector<int>& ordinals, int group_size, int64_t workspace_bytes, int num_slots,
         bool multimem) {
        nb::gil_scoped_release release;
        return RegisterComm(ordinals, group_size, workspace_bytes, num_slots, multimem);
      },
      nb::arg("ordinals"), nb::arg("group_size"), nb::arg("workspace_bytes"),
      nb::arg("num_slots"), nb::arg("multimem") = false,
      "Allocates the symmetric workspace on the devices (CUDA ordinals in group order) and "
      "enables peer access within each group; returns the comm id. Cached per arguments.");
  m.def("error_message", [](int64_t comm_id) -> nb::object {
    Comm* c = LookupComm(comm_id);
    if (c == nullptr) throw std::invalid_argument("unknown comm id");
    if (!c->error_record()->failed) return nb::none();
    return nb::str(DescribeError(*c->error_record()).c_str());
  });
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
  m.def("area_bytes", &AreaBytes, nb::arg("workspace_bytes"), nb::arg("num_slots"));
  m.def("two_shot_bytes", &TwoShotBytes);
  m.def("one_shot_bytes", &OneShotBytes);
  m.def("multimem_bytes", &MultimemBytes);
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MIN_CTAS") = kMinCtas;
  m.attr("MAX_CTAS") = kMaxCtas;
  m.attr("MAX_HIDDEN") = 16384;
  m.attr("DEFAULT_SLOTS") = kDefaultSlots;
  m.attr("DEFAULT_WORKSPACE_MIB") = kDefaultWorkspaceMiB;
  m.attr("DEFAULT_ONESHOT_BYTES") = kDefaultOneShotBytes;
  m.attr("DEFAULT_TIMEOUT_S") = kDefaultTimeoutS;
}
