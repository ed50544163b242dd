#include "comm.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

#include "multicast.h"

namespace tokenweave {
namespace {

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&prev_); }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int64_t FlagsPerSlot() { return static_cast<int64_t>(kNumBarriers) * kMaxRanks * kMaxCtas; }
int64_t CeFlagsPerSlot() { return 2 * kMaxRanks; }  // [phase][sender]

// Never destroyed: a Comm's destructor calls CUDA, which must not run from static destructors
// at process exit (the CUDA runtime may be gone by then; seen crashing). The driver frees
// everything at exit; ReleaseComm retires one (and keeps its small remains here).
std::mutex g_mu;
auto& g_comms = *new std::map<int64_t, std::unique_ptr<Comm>>();
auto& g_retired = *new std::vector<std::unique_ptr<Comm>>();
int64_t g_next_id = 1;

}  // namespace

int64_t Comm::launches() const {
  int64_t total = 0;
  for (const auto& d : devs_)
    for (int s = 0; s < options_.num_slots; ++s) total += d->issued[s].load();
  return total;
}

Comm::Comm(std::vector<int> ordinals, int group_size, const CommOptions& options)
    : ordinals_(std::move(ordinals)), group_size_(group_size), options_(options) {
  const int n = static_cast<int>(ordinals_.size());
  if (group_size_ < 1 || group_size_ > kMaxRanks || n % group_size_ != 0)
    throw std::runtime_error("jax-tokenweave: group size must be in [1, " +
                             std::to_string(kMaxRanks) + "] and divide the device count");
  if (options_.num_slots < 1 || options_.area_bytes < 256 || options_.oneshot_bytes < 0 ||
      options_.area_bytes % kAlign != 0 || options_.oneshot_bytes % kAlign != 0 ||
      options_.oneshot_bytes > (int64_t{1} << 31))
    throw std::runtime_error(
        "jax-tokenweave: need num_slots >= 1, a data area of >= 256 bytes and a one-shot buffer "
        "of at most 2 GiB, both multiples of 256");
  if (options_.ce_bytes < 0 || options_.ce_bytes % kAlign != 0)
    throw std::runtime_error(
        "jax-tokenweave: the copy-engine staging area must be >= 0 bytes, a multiple of 256");
  if (options_.ce_bytes > 0 && options_.loopback)
    throw std::runtime_error("jax-tokenweave: a loopback comm has no copy-engine calls");
  if (!(options_.timeout_s > 0))
    throw std::runtime_error("jax-tokenweave: the wait bound (timeout_s) must be > 0");
  if (options_.loopback && (options_.multimem || n != group_size_))
    throw std::runtime_error("jax-tokenweave: a loopback comm is one group without multimem");
  for (int g = 0; g < n / group_size_; ++g) {
    int local = 0;
    for (int a = 0; a < group_size_; ++a) local += ordinals_[g * group_size_ + a] >= 0;
    if (local > 0 && local < group_size_) cross_process_ = true;
    if (local > 1 && local < group_size_)
      throw std::runtime_error(
          "jax-tokenweave: a group mixes devices of this process with devices of others; use "
          "one process per GPU or one process for all of the group's GPUs");
  }
  if (std::all_of(ordinals_.begin(), ordinals_.end(), [](int o) { return o < 0; }))
    throw std::runtime_error("jax-tokenweave: a comm needs a device of this process");
  if (cross_process_ && (options_.multimem || options_.loopback))
    throw std::runtime_error("jax-tokenweave: a cross-process comm has no multimem or loopback");
  std::vector<char*> unicast, multicast;
  if (options_.multimem) {  // refuses (before any CUDA call) where NCCL_NVLS_ENABLE=0
    std::string why = MultimemRefusal();
    if (!why.empty()) throw std::runtime_error("jax-tokenweave: " + why);
  }
  DeviceGuard guard;
  int count = 0;
  TW_THROW_CHECK(cudaGetDeviceCount(&count));
  for (int i = 0; i < n; ++i) {
    if (ordinals_[i] == -1) continue;  // another process's device
    if (ordinals_[i] < 0 || ordinals_[i] >= count)
      throw std::runtime_error("jax-tokenweave: CUDA device " + std::to_string(ordinals_[i]) +
                               " does not exist");
    for (int j = 0; j < i && !options_.loopback; ++j)
      if (ordinals_[i] == ordinals_[j])
        throw std::runtime_error("jax-tokenweave: a device appears twice in the comm");
  }
  if (!options_.loopback) EnablePeerAccess();
  TW_THROW_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&err_), sizeof(ErrorRecord),
                               cudaHostAllocMapped | cudaHostAllocPortable));
  *err_ = ErrorRecord{};
  for (int i = 0; i < n; ++i) {
    auto d = std::make_unique<DeviceState>();
    d->ordinal = ordinals_[i];
    d->group = i / group_size_;
    d->rank = i % group_size_;
    d->issued = std::make_unique<std::atomic<uint32_t>[]>(options_.num_slots);
    devs_.push_back(std::move(d));
  }
  for (int g = 0; options_.multimem && g < n / group_size_; ++g) {
    std::vector<int> group(ordinals_.begin() + g * group_size_,
                           ordinals_.begin() + (g + 1) * group_size_);
    MapMulticast(group, DataBytes(), &unicast, &multicast);
    for (int a = 0; a < group_size_; ++a) {
      devs_[g * group_size_ + a]->data = unicast[a];
      devs_[g * group_size_ + a]->mc_data = multicast[a];
    }
  }
  for (auto& d : devs_)
    if (d->ordinal >= 0) Allocate(*d);
  std::vector<int> local;  // the gate spans this process's devices of groups that communicate
  if (group_size_ > 1 && !options_.loopback && options_.launch_gate)
    for (const auto& d : devs_)
      if (d->ordinal >= 0) local.push_back(d->ordinal);
  gate_ = std::make_unique<LaunchGate>(std::move(local));
}

void Comm::EnablePeerAccess() {
  const int n = static_cast<int>(ordinals_.size());
  for (int g = 0; g < n / group_size_; ++g) {
    for (int a = 0; a < group_size_; ++a) {
      const int da = ordinals_[g * group_size_ + a];
      if (da < 0) continue;  // another process's device (a cross-process comm)
      TW_THROW_CHECK(cudaSetDevice(da));
      for (int b = 0; b < group_size_; ++b) {
        const int db = ordinals_[g * group_size_ + b];
        if (da == db || db < 0) continue;
        int can = 0;
        TW_THROW_CHECK(cudaDeviceCanAccessPeer(&can, da, db));
        if (!can)
          throw std::runtime_error("jax-tokenweave: CUDA device " + std::to_string(da) +
                                   " cannot access device " + std::to_string(db) +
                                   " as a peer (no P2P/NVLink path)");
        cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled)
          (void)cudaGetLastError();  // already enabled (e.g. by XLA): fine, clear it
        else
          TW_THROW_CHECK(e);
      }
    }
  }
}

// sync = [SlotControl x slots | RankControl | flags], zeroed; one-shot buffers filled with the
// sentinel; the data area needs no initial value (barriers order every use of it). A
// cross-process comm puts all three in one exportable allocation: [sync | data | oneshot].
int64_t Comm::SyncBytes() const {
  return AlignUp(options_.num_slots * sizeof(SlotControl)) + AlignUp(sizeof(RankControl)) +
         AlignUp(options_.num_slots * FlagsPerSlot() * sizeof(uint32_t)) +
         AlignUp(options_.num_slots * CeFlagsPerSlot() * sizeof(uint32_t));
}

int64_t Comm::CeTotal() const { return options_.num_slots * options_.ce_bytes; }

int64_t Comm::DataBytes() const { return 2 * options_.num_slots * options_.area_bytes; }

int64_t Comm::OneShotTotal() const {
  return options_.num_slots * kLamportBuffers * options_.oneshot_bytes;
}

void Comm::CarveSync(DeviceState& d, char* base) const {
  const int64_t ctl_bytes = AlignUp(options_.num_slots * sizeof(SlotControl));
  d.sync = base;
  d.ctl = reinterpret_cast<SlotControl*>(base);
  d.rank_ctl = reinterpret_cast<RankControl*>(base + ctl_bytes);
  char* flags = base + ctl_bytes + AlignUp(sizeof(RankControl));
  d.flags = reinterpret_cast<uint32_t*>(flags);
  d.ce_flags = reinterpret_cast<uint32_t*>(
      flags + AlignUp(options_.num_slots * FlagsPerSlot() * sizeof(uint32_t)));
}

void Comm::CarveShared(DeviceState& d, char* base) const {
  CarveSync(d, base);
  d.data = base + SyncBytes();
  d.oneshot = OneShotTotal() > 0 ? d.data + DataBytes() : nullptr;
  d.ce = CeTotal() > 0 ? d.data + DataBytes() + OneShotTotal() : nullptr;
}

void Comm::Allocate(DeviceState& d) {
  TW_THROW_CHECK(cudaSetDevice(d.ordinal));
  TW_THROW_CHECK(PreloadKernels());
  if (HasRemote(d.group)) {  // peers in other processes map it: exportable memory
    d.shared = AllocShared(d.ordinal, SyncBytes() + DataBytes() + OneShotTotal() + CeTotal());
    CarveShared(d, d.shared.ptr);
  } else {
    char* sync = nullptr;
    TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&sync), SyncBytes()));
    CarveSync(d, sync);
    if (d.data == nullptr)  // (a multimem comm mapped it already)
      TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.data), DataBytes()));
    if (OneShotTotal() > 0)
      TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.oneshot), OneShotTotal()));
    if (CeTotal() > 0) TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&d.ce), CeTotal()));
  }
  TW_THROW_CHECK(cudaMemset(d.sync, 0, SyncBytes()));
  const uint32_t one = 1;  // the copy-engine signals' source word
  TW_THROW_CHECK(cudaMemcpy(&d.rank_ctl->one, &one, sizeof(one), cudaMemcpyHostToDevice));
  if (OneShotTotal() > 0) TW_THROW_CHECK(LaunchFillSentinel(d.oneshot, OneShotTotal(), nullptr));
  TW_THROW_CHECK(cudaDeviceSynchronize());
}

int Comm::ExportFd(int index, int64_t* bytes) {
  if (index < 0 || index >= num_devices() || devs_[index]->shared.ptr == nullptr ||
      devs_[index]->ordinal < 0)
    throw std::invalid_argument("jax-tokenweave: device " + std::to_string(index) +
                                " is not a local device that peers in other processes map");
  *bytes = devs_[index]->shared.size;
  DeviceGuard guard;
  TW_THROW_CHECK(cudaSetDevice(devs_[index]->ordinal));
  return ExportShared(devs_[index]->shared);
}

void Comm::Import(int index, int fd, int64_t bytes) {
  const int64_t need = SyncBytes() + DataBytes() + OneShotTotal() + CeTotal();
  DeviceState* local = nullptr;
  if (cross_process_ && index >= 0 && index < num_devices() && devs_[index]->ordinal < 0)
    for (int r = 0; r < group_size_; ++r) {
      DeviceState* d = devs_[devs_[index]->group * group_size_ + r].get();
      if (d->ordinal >= 0) local = d;
    }
  if (local == nullptr || devs_[index]->sync != nullptr || bytes < need) {
    close(fd);
    throw std::invalid_argument("jax-tokenweave: device " + std::to_string(index) +
                                " is not an unmapped peer of a local device, or its workspace (" +
                                std::to_string(bytes) + " bytes) is smaller than this comm's (" +
                                std::to_string(need) + "): are both processes' settings the same?");
  }
  DeviceGuard guard;
  DeviceState& d = *devs_[index];
  d.shared = ImportShared(local->ordinal, fd, bytes);  // mapped for the process's lifetime
  CarveShared(d, d.shared.ptr);
}

bool Comm::HasRemote(int group) const {
  for (int r = 0; r < group_size_; ++r)
    if (devs_[group * group_size_ + r]->ordinal < 0) return true;
  return false;
}

bool Comm::Ready() const {
  for (int g = 0; g < num_devices() / group_size_; ++g) {
    bool has_local = false, mapped = true;
    for (int r = 0; r < group_size_; ++r) {
      has_local |= devs_[g * group_size_ + r]->ordinal >= 0;
      mapped &= devs_[g * group_size_ + r]->sync != nullptr;
    }
    if (has_local && !mapped) return false;
  }
  return true;
}

DeviceState* Comm::Find(int ordinal) {
  if (options_.loopback) return nullptr;
  for (auto& d : devs_)
    if (d->ordinal == ordinal) return d.get();
  return nullptr;
}

void Comm::Fill(const DeviceState& d, int slot, KernelParams& p) const {
  const int64_t data_off = 2 * static_cast<int64_t>(slot) * options_.area_bytes;
  const int64_t oneshot_off = static_cast<int64_t>(slot) * kLamportBuffers * options_.oneshot_bytes;
  for (int r = 0; r < group_size_; ++r) {
    const DeviceState& peer = *devs_[d.group * group_size_ + r];
    p.data[r] = peer.data + data_off;
    p.oneshot[r] = peer.oneshot != nullptr ? peer.oneshot + oneshot_off : nullptr;
    p.flags[r] = peer.flags + slot * FlagsPerSlot();
    p.ctl[r] = peer.ctl + slot;
    p.rank_ctl[r] = peer.rank_ctl;
    p.ce[r] = peer.ce != nullptr ? peer.ce + slot * options_.ce_bytes : nullptr;
    p.ce_flags[r] = peer.ce_flags != nullptr ? peer.ce_flags + slot * CeFlagsPerSlot() : nullptr;
  }
  p.ce_bytes = options_.ce_bytes;
  p.mc_data = d.mc_data != nullptr ? d.mc_data + data_off : nullptr;
  p.err = err_;
  p.area_bytes = options_.area_bytes;
  p.oneshot_bytes = options_.oneshot_bytes;
  p.rank = d.rank;
  p.nranks = group_size_;
  p.device = d.ordinal;
  p.slot = slot;
  p.timeout_ns = static_cast<uint64_t>(options_.timeout_s * 1e9);
}

cudaError_t Comm::EnsureSideStream(DeviceState& d) {
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.side != nullptr) return cudaSuccess;
  int least = 0, greatest = 0;
  cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&d.side, cudaStreamNonBlocking, greatest);
  d.ready.assign(options_.num_slots, nullptr);
  d.done.assign(options_.num_slots, nullptr);
  for (int s = 0; e == cudaSuccess && s < options_.num_slots; ++s) {
    e = cudaEventCreateWithFlags(&d.ready[s], cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d.done[s], cudaEventDisableTiming);
  }
  return e;
}

int64_t RegisterComm(const std::vector<int>& ordinals, int group_size, const CommOptions& options) {
  auto comm = std::make_unique<Comm>(ordinals, group_size, options);
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t id = g_next_id++;
  g_comms[id] = std::move(comm);
  return id;
}

Comm* LookupComm(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(id);
  return it == g_comms.end() ? nullptr : it->second.get();
}

bool ReleaseComm(int64_t id) {
  std::unique_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_comms.find(id);
    if (it == g_comms.end()) return false;
    comm = std::move(it->second);
    g_comms.erase(it);
  }
  comm->Retire();  // outside the lock: it waits for the devices
  std::lock_guard<std::mutex> lock(g_mu);
  g_retired.push_back(std::move(comm));
  return true;
}

// The copy-engine staging areas stay: a command-buffer replay of a copy-engine call copies into
// them whatever the failure word says (its kernels only poison outputs; its waits end at once).
void Comm::Retire() {
  DeviceGuard guard;
  for (auto& d : devs_) {  // best effort: errors here have nowhere to go
    if (d->ordinal < 0 || cudaSetDevice(d->ordinal) != cudaSuccess) continue;
    cudaDeviceSynchronize();
    if (d->rank_ctl != nullptr) cudaMemset(&d->rank_ctl->failed, 1, 1);
    cudaDeviceSynchronize();
    {
      std::lock_guard<std::mutex> lock(d->mu);
      for (cudaEvent_t e : d->ready) cudaEventDestroy(e);
      for (cudaEvent_t e : d->done) cudaEventDestroy(e);
      d->ready.clear();
      d->done.clear();
      if (d->side != nullptr) cudaStreamDestroy(d->side);
      d->side = nullptr;
    }
    if (d->shared.ptr != nullptr) continue;
    if (d->mc_data == nullptr) cudaFree(d->data);  // multicast mappings stay (never run here)
    cudaFree(d->oneshot);
    d->data = d->oneshot = nullptr;
  }
  (void)cudaGetLastError();
}

}  // namespace tokenweave
