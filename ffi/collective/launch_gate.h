// The launch gate of a comm with several devices in one process (ffi/README.md, "One process,
// several GPUs"). XLA issues each GPU's share of a program from its own host thread and loads
// the program's module on a GPU at that GPU's first run of it (cuModuleLoadData). A module load
// waits inside the driver while a peer GPU runs a kernel that spins for this GPU's call, and it
// holds the driver's lock meanwhile: the call is never issued and the spin ends only at its
// bound (2 x H200, 2026-11-28, native stacks of a stalled copy-engine forward). The gate makes
// a device's n-th call of the comm wait, on the host and before it launches anything, until
// every device of the comm in this process has reached its n-th call: each of them is then past
// the program's module load, and no kernel of the call can spin for a peer stuck behind one.
// Only the calls XLA runs through the handler on every run pass it (the start of the start/done
// pair and the uncaptured sync call): a command buffer records a call, and may record it again
// on one device alone, which would set the counts apart for good.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace tokenweave {

// How a device's wait at the gate ended.
struct GateWait {
  int64_t call = 0;        // this device's call count, this call included
  int late_ordinal = -1;   // -1: every device arrived; else one that had not within the bound
  int64_t late_calls = 0;  // the calls that device had reached
};

class LaunchGate {
 public:
  // `ordinals`: this process's devices of the comm (the gate is open with fewer than two).
  explicit LaunchGate(std::vector<int> ordinals);
  // Counts a call of `ordinal` and waits until every device has counted as many, at most
  // `timeout_s`.
  GateWait Arrive(int ordinal, double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable arrived_cv_;
  std::vector<int> ordinals_;
  std::vector<int64_t> arrived_;  // calls counted per device, in `ordinals_` order
};

}  // namespace tokenweave
