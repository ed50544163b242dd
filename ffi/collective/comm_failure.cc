// The failure message of a comm whose group failed (ffi/README.md, "Failure: bounded, reported,
// never a trap"): from the host-mapped error record and the handlers' launch counts.
#include <cstdio>
#include <string>

#include "comm.h"

namespace tokenweave {

// Built with std::to_string/snprintf: iostream number formatting crashed inside the extension
// on the GPU image (a locale facet of a second libstdc++ copy), seen on nvidia-h100-x1.
std::string FailureMessage(const Comm& comm) {
  const ErrorRecord& e = *comm.error_record();
  if (!e.failed) return "";
  static const char* kStages[] = {"barrier 0", "barrier 1", "one-shot data",
                                  "copy-engine reduce-scatter", "copy-engine all-gather"};
  static const std::string kUnusable =
      ". The communicator is unusable: outputs of later calls are NaN and every later launch "
      "fails; jax_tokenweave.comm.reset_communicators() (in every process) frees it and starts "
      "over";
  char bound[32];
  std::snprintf(bound, sizeof(bound), "%g", comm.options().timeout_s);
  if (e.stage == kStageLaunchGate)
    return "jax-tokenweave: a fused call's launch gate expired (bound " + std::string(bound) +
           " s) on device " + std::to_string(e.device) + " (rank " + std::to_string(e.rank) +
           ", slot " + std::to_string(e.slot) + "): the host thread of rank " +
           std::to_string(e.peer) + " (this process) never reached its call " +
           std::to_string(e.epoch) + " of the comm (it had reached " +
           std::to_string(e.peer_entered) +
           "; it is blocked or runs another program; see \"One process, several GPUs\" in "
           "jax-tokenweave's ffi/README.md). Nothing of the call was launched and its outputs "
           "are NaN" +
           kUnusable;
  const char* stage = e.stage >= 0 && e.stage < 5 ? kStages[e.stage] : "?";
  const bool ce = e.stage == kStageCeScatter || e.stage == kStageCeGather;
  std::string s = std::string("jax-tokenweave: a fused ") + (ce ? "call" : "kernel") +
                  "'s cross-GPU wait expired (bound " + std::string(bound) + " s) on device " +
                  std::to_string(e.device) + " (rank " + std::to_string(e.rank) + ", slot " +
                  std::to_string(e.slot) + ", " + stage + "): rank " + std::to_string(e.peer);
  if (e.block >= 0) s += " (block " + std::to_string(e.block) + ")";
  s += " was missing at " + std::string(ce ? "copy-engine call " : "epoch ") +
       std::to_string(e.epoch) + "; its " +
       (ce ? "reduce kernel last began call " : "kernel last began epoch ") +
       std::to_string(e.peer_entered);
  s += static_cast<int32_t>(e.peer_entered - e.epoch) < 0
           ? " (it never started this call: its host did not issue it, or its stream was "
             "blocked; with several GPUs in one process, see \"One process, several GPUs\" "
             "in jax-tokenweave's ffi/README.md)"
           : " (it started this call but never arrived)";
  return s + comm.IssuedNote(e) + kUnusable;
}

std::string Comm::IssuedNote(const ErrorRecord& e) const {
  if (options_.loopback || e.slot < 0 || e.slot >= options_.num_slots || e.peer < 0 ||
      e.peer >= group_size_)
    return "";
  for (const auto& d : devs_) {
    if (d->ordinal != e.device) continue;
    const DeviceState& peer = *devs_[d->group * group_size_ + e.peer];
    if (peer.ordinal < 0) return "";
    return "; this process's handlers issued " + std::to_string(peer.issued[e.slot].load()) +
           " launches on slot " + std::to_string(e.slot) + " to the missing rank (device " +
           std::to_string(peer.ordinal) + ") and " + std::to_string(d->issued[e.slot].load()) +
           " to the waiting one";
  }
  return "";
}

}  // namespace tokenweave
