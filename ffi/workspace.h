// The symmetric workspace ("comm"): per device one data allocation split into slots x 2 epoch
// parities, a flag area per slot, peer access between all devices of a group, and the host
// bookkeeping (epoch counters, side stream, events) the handlers use.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace tokenweave {

// State of one device of a comm. Only the handler thread of that device touches the mutable
// parts (epochs, stream, events); `mu` guards them anyway.
struct DeviceState {
  int ordinal = -1, group = -1, rank = -1;
  char* data = nullptr;       // slots * 2 parities * area_bytes
  uint32_t* flags = nullptr;  // slots * kNumBarriers * kMaxRanks * kMaxCtas
  char* mc_data = nullptr;    // multicast mapping of `data` (multimem comms only)
  std::mutex mu;
  std::vector<uint32_t> epoch;            // per slot, last epoch used
  cudaStream_t side = nullptr;            // high-priority stream of the start/done pair
  std::vector<cudaEvent_t> ready, done;   // per slot: inputs ready / kernel done
};

class Comm {
 public:
  Comm(std::vector<int> ordinals, int group_size, int64_t workspace_bytes, int num_slots,
       bool multimem);
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  DeviceState* Find(int ordinal);  // nullptr when the device is not in this comm
  // Fills data/flags/issued/mc_data/err of `p` for device `d`, `slot`, and the parity of
  // `epoch`, and records `epoch` as the last one `d`'s host issued on `slot`.
  void Fill(const DeviceState& d, int slot, uint32_t epoch, KernelParams& p) const;

  int group_size() const { return group_size_; }
  int num_slots() const { return num_slots_; }
  int64_t area_bytes() const { return area_bytes_; }
  bool multimem() const { return multimem_; }
  ErrorRecord* error_record() const { return err_; }

 private:
  void SetupMulticast();

  std::vector<int> ordinals_;
  int group_size_, num_slots_;
  int64_t area_bytes_;  // one (slot, parity) data area
  bool multimem_;
  std::vector<std::unique_ptr<DeviceState>> devs_;  // in `ordinals_` order
  ErrorRecord* err_ = nullptr;
  volatile uint32_t* issued_ = nullptr;  // host-mapped [device index][slot]: last issued epoch
};

// Registers (or finds) the comm for these CUDA ordinals, in group order, `group_size` devices
// per group. Throws std::runtime_error with a readable message on failure.
int64_t RegisterComm(const std::vector<int>& ordinals, int group_size, int64_t workspace_bytes,
                     int num_slots, bool multimem);
Comm* LookupComm(int64_t id);  // nullptr if unknown

// "" when the multimem path may be set up; otherwise why not. Reads the environment only.
std::string MultimemRefusal();

// Bytes of one (slot, parity) area for a workspace of `workspace_bytes` and `num_slots` slots.
int64_t AreaBytes(int64_t workspace_bytes, int num_slots);

// A description of the last error record of any comm (for tests and diagnostics).
std::string DescribeError(const ErrorRecord& e);

}  // namespace tokenweave
