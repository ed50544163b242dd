// The communicator ("comm"): per device a symmetric workspace (data areas, one-shot receive
// buffers, device-resident sync state), peer access between the devices of each group, and the
// start/done pair's side stream and events. No per-call host state: kernels advance the sync
// state themselves, so a call can be captured in an XLA command buffer and replayed.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "launch_gate.h"
#include "shared_alloc.h"

namespace tokenweave {

struct CommOptions {
  int64_t area_bytes = 0;     // one parity of a slot's two-shot/direct data area
  int64_t oneshot_bytes = 0;  // one of a slot's kLamportBuffers one-shot receive buffers
  int64_t ce_bytes = 0;       // a slot's copy-engine staging area (0: no copy-engine calls)
  int num_slots = 0;
  double timeout_s = 0;     // bound on every cross-rank wait
  bool multimem = false;    // opt-in; refused where NCCL_NVLS_ENABLE=0
  bool loopback = false;    // every rank on one device (the test harness only; no handlers)
  bool launch_gate = true;  // calls wait for this process's other devices (launch_gate.h)
};

// One device (rank) of a comm. In a cross-process comm, devices of other processes have
// ordinal -1 and hold this process's mappings of their workspace (after Import).
struct DeviceState {
  int ordinal = -1, group = -1, rank = -1;
  SharedAlloc shared;          // cross-process comms: the workspace, [sync | data | oneshot]
  char* data = nullptr;        // num_slots * 2 parities * area_bytes
  char* oneshot = nullptr;     // num_slots * kLamportBuffers * oneshot_bytes
  char* ce = nullptr;          // num_slots * ce_bytes: copy-engine staging (kept at Retire)
  char* sync = nullptr;        // SlotControl[num_slots], RankControl, flags
  SlotControl* ctl = nullptr;  // [num_slots]
  RankControl* rank_ctl = nullptr;
  uint32_t* flags = nullptr;             // num_slots * kNumBarriers * kMaxRanks * kMaxCtas
  uint32_t* ce_flags = nullptr;          // num_slots * 2 phases * kMaxRanks (copy engine)
  char* mc_data = nullptr;               // multicast mapping of `data` (multimem comms only)
  std::mutex mu;                         // guards the lazily created stream and events
  cudaStream_t side = nullptr;           // high-priority stream of the start/done pair
  std::vector<cudaEvent_t> ready, done;  // per slot: inputs ready / kernel done
  std::unique_ptr<std::atomic<uint32_t>[]> issued;  // per slot: launches the handlers issued
};

class Comm {
 public:
  // `ordinals`: CUDA ordinals in group order; -1 marks a device of another process. Groups
  // with none of this process's devices are left alone; a group with some (then exactly one)
  // makes a cross-process comm, whose workspaces are exchanged with ExportFd/Import before the
  // first launch.
  Comm(std::vector<int> ordinals, int group_size, const CommOptions& options);
  ~Comm() = default;  // comms are retired (Retire), never destroyed: see comm.cc
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // The device state of `ordinal` (nullptr when not in this comm, or for a loopback comm,
  // where one ordinal holds every rank).
  DeviceState* Find(int ordinal);
  DeviceState* At(int index) { return devs_[index].get(); }
  // Fills the workspace pointers, rank, sizes and bound of `p` for device `d` and `slot`.
  void Fill(const DeviceState& d, int slot, KernelParams& p) const;
  // The side stream and per-slot events of `d`, created on first use.
  cudaError_t EnsureSideStream(DeviceState& d);
  // Where every call waits for this process's other devices of the comm (launch_gate.h).
  LaunchGate& gate() { return *gate_; }

  bool cross_process() const { return cross_process_; }
  // Cross-process comms: a new file descriptor of local device `index`'s workspace and its
  // size in bytes; Import maps the workspace of another process's device `index` (a peer of
  // a local device) from such a descriptor (closed here). Ready: every peer is mapped.
  int ExportFd(int index, int64_t* bytes);
  void Import(int index, int fd, int64_t bytes);
  bool Ready() const;
  // Marks the comm failed on its devices (a command-buffer replay of one of its calls then
  // aborts at once and writes NaN) and frees what no kernel reads any more: the data and
  // one-shot areas of a single-process comm. The small sync area stays, as do a cross-process
  // comm's shared workspaces (peers may still push into them); the process exit frees them.
  void Retire();

  int group_size() const { return group_size_; }
  int num_devices() const { return static_cast<int>(devs_.size()); }
  const CommOptions& options() const { return options_; }
  ErrorRecord* error_record() const { return err_; }
  // Host-side launches issued so far by the handlers (an XLA command buffer replay issues none).
  int64_t launches() const;  // the sum of every device's `issued`
  // What the host issued on the failed wait's slot to the missing rank and to the waiting
  // one, where both are this process's devices ("" otherwise; command buffers issue none).
  std::string IssuedNote(const ErrorRecord& e) const;

 private:
  void EnablePeerAccess();
  void Allocate(DeviceState& d);
  int64_t SyncBytes() const;                           // SlotControl[slots] | RankControl | flags
  int64_t DataBytes() const;                           // slots x 2 parities x area_bytes
  int64_t OneShotTotal() const;                        // slots x kLamportBuffers x oneshot_bytes
  int64_t CeTotal() const;                             // slots x ce_bytes
  void CarveSync(DeviceState& d, char* base) const;    // the sync pointers from `base`
  void CarveShared(DeviceState& d, char* base) const;  // [sync | data | oneshot] from `base`
  bool HasRemote(int group) const;                     // the group holds devices of other processes

  std::vector<int> ordinals_;
  int group_size_;
  bool cross_process_ = false;
  CommOptions options_;
  std::vector<std::unique_ptr<DeviceState>> devs_;  // in `ordinals_` order
  ErrorRecord* err_ = nullptr;
  std::unique_ptr<LaunchGate> gate_;
};

// Registers (or finds) the comm for these CUDA ordinals, in group order, `group_size` devices
// per group. Throws std::runtime_error with a readable message on failure.
int64_t RegisterComm(const std::vector<int>& ordinals, int group_size, const CommOptions& options);
Comm* LookupComm(int64_t id);  // nullptr if unknown
// Waits for the comm's devices, retires it (Comm::Retire) and forgets it (false if unknown):
// later launches with its id are refused as unknown.
bool ReleaseComm(int64_t id);

// Why the comm cannot launch any more, or "" (its error record is clear).
std::string FailureMessage(const Comm& comm);

}  // namespace tokenweave
