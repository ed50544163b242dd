// The copy-engine call's watchdog. A stream wait (cuStreamWaitValue32) has no bound of its own,
// so a host thread per communicator watches every local (device, slot): the call's stream
// writes where it stands into a host-mapped CeWatch record (common.h), its reduce kernel counts
// the calls. A wait whose record has not moved for the comm's bound is stuck: the watchdog
// describes it in the comm's ErrorRecord (waiting rank, missing peer, stage, call), marks every
// rank of the group failed and writes the awaited flag itself, so the stream moves on; the
// call's kernels then leave NaN, later launches are refused (FailureMessage) and a command-buffer
// replay is released at once. Nothing spins on an SM, nothing traps, nothing hangs.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace tokenweave {

class Comm;
struct DeviceState;

// What the watchdog remembers of one (device, slot) record.
struct WaitTracker {
  uint32_t phase = 0, calls = 0;
  double since = 0;  // seconds: when this phase and count were first seen
  bool waiting = false;
};

// Pure decision (CPU-tested): given the record's `phase` and `calls` seen at `now` (seconds),
// whether its wait must be released: it stood still for more than `bound`, or the group has
// failed (`failed`) and it stood still for more than `retry` (the time a release takes to show).
// A release restarts the clock (the caller sets `since`).
bool StuckWait(WaitTracker& t, uint32_t phase, uint32_t calls, double now, double bound,
               bool failed, double retry);

class CeWatchdog {
 public:
  explicit CeWatchdog(Comm& comm);  // starts the thread
  CeWatchdog(const CeWatchdog&) = delete;
  CeWatchdog& operator=(const CeWatchdog&) = delete;
  void Stop();  // stops and joins the thread (at process exit; comms are never destroyed)

 private:
  void Run();
  bool GroupFailed() const;  // the comm's error record or retirement (host-visible state)
  void Release(DeviceState& d, int slot, uint32_t phase, uint32_t calls, bool report);

  Comm& comm_;
  bool debug_ = false;  // JAX_TOKENWEAVE_CE_DEBUG=1: one stderr line per release
  std::atomic<bool> stop_{false};
  std::vector<std::vector<WaitTracker>> trackers_;  // [device index][slot]
  std::thread thread_;
};

}  // namespace tokenweave
