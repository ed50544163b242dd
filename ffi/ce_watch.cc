#include "ce_watch.h"

#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "ce_plan.h"
#include "comm.h"
#include "driver.h"

namespace tokenweave {
namespace {

constexpr double kPollSeconds = 0.0005;
constexpr double kRetrySeconds = 0.01;  // between releases of a failed group's waits

double Now() {
  using Clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

WriteValueFn WriteValue() {
  static const WriteValueFn fn = DriverEntry<WriteValueFn>("cuStreamWriteValue32");
  return fn;
}

// Every watchdog, stopped before the CUDA runtime's own exit handlers run (registered after
// them, so run before them): a thread still reading host-mapped records then would crash.
std::mutex g_mu;
std::vector<CeWatchdog*>& Registry() {
  static auto& r = *new std::vector<CeWatchdog*>();
  return r;
}
void StopAll() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (CeWatchdog* w : Registry()) w->Stop();
}

class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&prev_); }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

}  // namespace

bool StuckWait(WaitTracker& t, uint32_t phase, uint32_t calls, double now, double bound,
               bool failed, double retry) {
  const uint32_t kind = phase & 0xffu;
  if (kind != kCeWaitScatter && kind != kCeWaitGather) {
    t.waiting = false;
    return false;
  }
  if (!t.waiting || t.phase != phase || t.calls != calls) {
    t = WaitTracker{phase, calls, now, true};
    return false;
  }
  return now - t.since > (failed ? retry : bound);
}

CeWatchdog::CeWatchdog(Comm& comm) : comm_(comm) {
  const char* debug = std::getenv("JAX_TOKENWEAVE_CE_DEBUG");
  debug_ = debug != nullptr && debug[0] == '1';
  const int devices = comm_.num_devices();
  trackers_.assign(devices, std::vector<WaitTracker>(comm_.options().num_slots));
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (Registry().empty()) std::atexit(StopAll);
    Registry().push_back(this);
  }
  thread_ = std::thread([this] { Run(); });
}

void CeWatchdog::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

bool CeWatchdog::GroupFailed() const {
  // Host-visible state only: a copy from the device could queue behind the very wait it is
  // meant to judge (seen on 2 x H200: the watchdog stalled in such a read).
  return comm_.error_record()->failed || comm_.retired();
}

void CeWatchdog::Run() {
  const double bound = comm_.options().timeout_s;
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::duration<double>(kPollSeconds));
    for (int i = 0; i < comm_.num_devices(); ++i) {
      DeviceState& d = *comm_.At(i);
      if (d.ordinal < 0 || d.watch == nullptr) continue;
      for (int slot = 0; slot < comm_.options().num_slots; ++slot) {
        const uint32_t phase = d.watch[slot].phase, calls = d.watch[slot].calls;
        WaitTracker& t = trackers_[i][slot];
        const double now = Now();
        const bool failed = GroupFailed();
        if (StuckWait(t, phase, calls, now, bound, failed, kRetrySeconds)) {
          Release(d, slot, phase, calls, !failed);  // reported unless known already
          t.since = Now();
        }
      }
    }
  }
}

// Marks the group failed and writes the awaited flag, on the device's watchdog stream; with
// `report`, first describes the wait in the comm's error record (the first report wins). A
// group failed by another process is released here only when this wait's own bound expires.
void CeWatchdog::Release(DeviceState& d, int slot, uint32_t phase, uint32_t calls, bool report) {
  DeviceGuard guard;
  if (cudaSetDevice(d.ordinal) != cudaSuccess) return;
  if (debug_)
    std::fprintf(stderr, "jax-tokenweave ce watchdog: device %d slot %d phase 0x%x calls %u: %s\n",
                 d.ordinal, slot, phase, calls, report ? "reported, released" : "released");
  KernelParams p{};
  comm_.Fill(d, slot, p);
  const int peer = static_cast<int>(phase >> 8);
  const bool scatter = (phase & 0xffu) == kCeWaitScatter;
  ErrorRecord* e = comm_.error_record();
  bool claimed = false;
  if (report && peer >= 0 && peer < p.nranks) {
    // Where the missing rank's reduce kernels got to: its watch record where it is this
    // process's device; unknown (kCeUnknownCalls) for another process's.
    const DeviceState& missing = *comm_.At(d.group * comm_.group_size() + peer);
    const uint32_t peer_calls =
        missing.watch != nullptr ? missing.watch[slot].calls : kCeUnknownCalls;
    claimed = __sync_bool_compare_and_swap(&e->claimed, 0, 1);
    if (claimed) {
      e->device = d.ordinal;
      e->rank = d.rank;
      e->slot = slot;
      e->stage = scatter ? kStageCeScatter : kStageCeGather;
      e->peer = peer;
      e->block = -1;
      e->epoch = scatter ? calls + 1 : calls;  // the reduce kernel counts at its start
      e->seen = 0;
      e->peer_entered = peer_calls;
    }
  }
  WriteValueFn write = nullptr;
  try {
    write = WriteValue();
  } catch (const std::exception&) {
    return;  // no stream memory operations: no copy-engine call could have been issued
  }
  CUstream s = reinterpret_cast<CUstream>(d.watch_stream);
  for (int j = 0; j < p.nranks; ++j)
    write(s, reinterpret_cast<CUdeviceptr>(&p.rank_ctl[j]->failed), 1,
          CU_STREAM_WRITE_VALUE_DEFAULT);
  if (peer >= 0 && peer < p.nranks)
    write(s, reinterpret_cast<CUdeviceptr>(p.ce_flags[d.rank] + CeFlagIndex(scatter ? 0 : 1, peer)),
          1, CU_STREAM_WRITE_VALUE_DEFAULT);
  cudaStreamSynchronize(d.watch_stream);
  (void)cudaGetLastError();
  if (claimed) {
    __sync_synchronize();
    e->failed = 1;  // published last: a host that sees it sees the fields
  }
}

}  // namespace tokenweave
