#include "workspace.h"

#include <cuda.h>  // driver API types only; entry points come from cudaGetDriverEntryPointByVersion

#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

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

using CommKey = std::tuple<std::vector<int>, int, int64_t, int, bool>;

std::mutex g_mu;
std::map<int64_t, std::unique_ptr<Comm>> g_comms;
std::map<CommKey, int64_t> g_keys;
int64_t g_next_id = 1;

template <typename Fn>
Fn DriverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12010, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr)
    throw std::runtime_error(std::string("jax-tokenweave: driver entry point ") + name +
                             " is unavailable");
  return reinterpret_cast<Fn>(fn);
}

void CheckCu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("jax-tokenweave: ") + what + " failed with CUresult " +
                             std::to_string(static_cast<int>(r)));
}

}  // namespace

int64_t AreaBytes(int64_t workspace_bytes, int num_slots) {
  return (workspace_bytes / (2 * static_cast<int64_t>(num_slots))) / 256 * 256;
}

std::string MultimemRefusal() {
  const char* opt = std::getenv("JAX_TOKENWEAVE_MULTIMEM");
  if (opt == nullptr || std::string(opt) != "1")
    return "the multimem path is opt-in: set JAX_TOKENWEAVE_MULTIMEM=1";
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  if (nvls != nullptr && std::string(nvls) == "0")
    return "NVLink multicast is disabled on this machine (NCCL_NVLS_ENABLE=0), so the multimem "
           "path refuses to create multicast objects";
  return "";
}

std::string DescribeError(const ErrorRecord& e) {
  std::ostringstream s;
  s << "a previous jax-tokenweave kernel timed out in a barrier on device " << e.device
    << " (rank " << e.rank << ", slot " << e.slot << ", barrier " << e.barrier << "): block "
    << e.block << " of rank " << e.peer << " never arrived (epoch " << e.epoch << ", flag "
    << e.seen << "; rank " << e.peer << "'s host issued epoch " << e.peer_issued
    << (static_cast<int32_t>(e.peer_issued - e.epoch) < 0
            ? ": its host never issued the call" : ": issued, but its stream never ran it")
    << "); the comm is unusable";
  return s.str();
}

Comm::Comm(std::vector<int> ordinals, int group_size, int64_t workspace_bytes, int num_slots,
           bool multimem)
    : ordinals_(std::move(ordinals)),
      group_size_(group_size),
      num_slots_(num_slots),
      area_bytes_(AreaBytes(workspace_bytes, num_slots)),
      multimem_(multimem) {
  const int n = static_cast<int>(ordinals_.size());
  if (group_size_ < 1 || group_size_ > kMaxRanks || n % group_size_ != 0)
    throw std::runtime_error("jax-tokenweave: group size must be in [1, " +
                             std::to_string(kMaxRanks) + "] and divide the device count");
  if (num_slots_ < 1 || area_bytes_ < 4096)
    throw std::runtime_error("jax-tokenweave: workspace too small for its slots");
  if (multimem_) {  // refuse before any CUDA call
    std::string why = MultimemRefusal();
    if (!why.empty()) throw std::runtime_error("jax-tokenweave: " + why);
  }
  DeviceGuard guard;
  int count = 0;
  TW_THROW_CHECK(cudaGetDeviceCount(&count));
  for (int i = 0; i < n; ++i) {
    if (ordinals_[i] < 0 || ordinals_[i] >= count)
      throw std::runtime_error("jax-tokenweave: CUDA device " + std::to_string(ordinals_[i]) +
                               " does not exist");
    for (int j = 0; j < i; ++j)
      if (ordinals_[i] == ordinals_[j])
        throw std::runtime_error("jax-tokenweave: a device appears twice in the comm");
  }
  // Peer access between every pair of each group.
  for (int g = 0; g < n / group_size_; ++g) {
    for (int a = 0; a < group_size_; ++a) {
      const int da = ordinals_[g * group_size_ + a];
      TW_THROW_CHECK(cudaSetDevice(da));
      for (int b = 0; b < group_size_; ++b) {
        const int db = ordinals_[g * group_size_ + b];
        if (da == db) continue;
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
  TW_THROW_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&err_), sizeof(ErrorRecord),
                               cudaHostAllocMapped | cudaHostAllocPortable));
  *err_ = ErrorRecord{};
  uint32_t* issued = nullptr;
  TW_THROW_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&issued),
                               sizeof(uint32_t) * n * num_slots_,
                               cudaHostAllocMapped | cudaHostAllocPortable));
  for (int i = 0; i < n * num_slots_; ++i) issued[i] = 0;
  issued_ = issued;
  const size_t flag_bytes = sizeof(uint32_t) * num_slots_ * kNumBarriers * kMaxRanks * kMaxCtas;
  for (int i = 0; i < n; ++i) {
    auto d = std::make_unique<DeviceState>();
    d->ordinal = ordinals_[i];
    d->group = i / group_size_;
    d->rank = i % group_size_;
    d->epoch.assign(num_slots_, 0);
    TW_THROW_CHECK(cudaSetDevice(d->ordinal));
    if (!multimem_)
      TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&d->data), 2 * num_slots_ * area_bytes_));
    TW_THROW_CHECK(cudaMalloc(reinterpret_cast<void**>(&d->flags), flag_bytes));
    TW_THROW_CHECK(cudaMemset(d->flags, 0, flag_bytes));
    TW_THROW_CHECK(cudaDeviceSynchronize());
    devs_.push_back(std::move(d));
  }
  if (multimem_) SetupMulticast();
}

// One multicast object per group, bound to one physical allocation per device; each device maps
// its own memory (unicast) and the multicast object. Never reached unless MultimemRefusal() == "".
void Comm::SetupMulticast() {
  std::string why = MultimemRefusal();
  if (!why.empty()) throw std::runtime_error("jax-tokenweave: " + why);
  auto mc_create = DriverEntry<decltype(&cuMulticastCreate)>("cuMulticastCreate");
  auto mc_gran = DriverEntry<decltype(&cuMulticastGetGranularity)>("cuMulticastGetGranularity");
  auto mc_add = DriverEntry<decltype(&cuMulticastAddDevice)>("cuMulticastAddDevice");
  auto mc_bind = DriverEntry<decltype(&cuMulticastBindMem)>("cuMulticastBindMem");
  auto mem_create = DriverEntry<decltype(&cuMemCreate)>("cuMemCreate");
  auto reserve = DriverEntry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  auto map = DriverEntry<decltype(&cuMemMap)>("cuMemMap");
  auto set_access = DriverEntry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  auto dev_get = DriverEntry<decltype(&cuDeviceGet)>("cuDeviceGet");

  const int groups = static_cast<int>(devs_.size()) / group_size_;
  for (int g = 0; g < groups; ++g) {
    CUmulticastObjectProp prop = {};
    prop.numDevices = group_size_;
    prop.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.size = 2 * num_slots_ * area_bytes_;
    size_t gran = 0;
    CheckCu(mc_gran(&gran, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED), "cuMulticastGetGranularity");
    prop.size = (prop.size + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle mc;
    CheckCu(mc_create(&mc, &prop), "cuMulticastCreate");
    for (int a = 0; a < group_size_; ++a) {
      CUdevice dev;
      CheckCu(dev_get(&dev, devs_[g * group_size_ + a]->ordinal), "cuDeviceGet");
      CheckCu(mc_add(mc, dev), "cuMulticastAddDevice");
    }
    for (int a = 0; a < group_size_; ++a) {
      DeviceState& d = *devs_[g * group_size_ + a];
      TW_THROW_CHECK(cudaSetDevice(d.ordinal));
      CUmemAllocationProp ap = {};
      ap.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      ap.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      ap.location.id = d.ordinal;
      CUmemGenericAllocationHandle mem;
      CheckCu(mem_create(&mem, prop.size, &ap, 0), "cuMemCreate");
      CheckCu(mc_bind(mc, 0, mem, 0, prop.size, 0), "cuMulticastBindMem");
      CUmemAccessDesc access = {};
      access.location = ap.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      CUdeviceptr uc = 0, mcva = 0;
      CheckCu(reserve(&uc, prop.size, gran, 0, 0), "cuMemAddressReserve");
      CheckCu(map(uc, prop.size, 0, mem, 0), "cuMemMap");
      CheckCu(set_access(uc, prop.size, &access, 1), "cuMemSetAccess");
      CheckCu(reserve(&mcva, prop.size, gran, 0, 0), "cuMemAddressReserve");
      CheckCu(map(mcva, prop.size, 0, mc, 0), "cuMemMap");
      CheckCu(set_access(mcva, prop.size, &access, 1), "cuMemSetAccess");
      d.data = reinterpret_cast<char*>(uc);
      d.mc_data = reinterpret_cast<char*>(mcva);
    }
  }
}

DeviceState* Comm::Find(int ordinal) {
  for (auto& d : devs_)
    if (d->ordinal == ordinal) return d.get();
  return nullptr;
}

void Comm::Fill(const DeviceState& d, int slot, uint32_t epoch, KernelParams& p) const {
  const int64_t offset = (2 * static_cast<int64_t>(slot) + (epoch & 1)) * area_bytes_;
  const int64_t flag_offset = static_cast<int64_t>(slot) * kNumBarriers * kMaxRanks * kMaxCtas;
  for (int r = 0; r < group_size_; ++r) {
    const int index = d.group * group_size_ + r;
    const DeviceState& peer = *devs_[index];
    p.data[r] = peer.data + offset;
    p.flags[r] = peer.flags + flag_offset;
    p.issued[r] = issued_ + index * num_slots_ + slot;
  }
  issued_[(d.group * group_size_ + d.rank) * num_slots_ + slot] = epoch;
  p.mc_data = d.mc_data != nullptr ? d.mc_data + offset : nullptr;
  p.err = err_;
  p.rank = d.rank;
  p.nranks = group_size_;
  p.device = d.ordinal;
  p.slot = slot;
  p.epoch = epoch;
}

int64_t RegisterComm(const std::vector<int>& ordinals, int group_size, int64_t workspace_bytes,
                     int num_slots, bool multimem) {
  std::lock_guard<std::mutex> lock(g_mu);
  CommKey key{ordinals, group_size, workspace_bytes, num_slots, multimem};
  auto it = g_keys.find(key);
  if (it != g_keys.end()) return it->second;
  auto comm = std::make_unique<Comm>(ordinals, group_size, workspace_bytes, num_slots, multimem);
  const int64_t id = g_next_id++;
  g_comms[id] = std::move(comm);
  g_keys[key] = id;
  return id;
}

Comm* LookupComm(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_comms.find(id);
  return it == g_comms.end() ? nullptr : it->second.get();
}

}  // namespace tokenweave
