// NVLink multicast (multimem) mappings. Opt-in and refused where NCCL_NVLS_ENABLE=0: no
// multicast object is ever created on the lent machines. Driver entry points are looked up at
// run time (cudaGetDriverEntryPointByVersion), so the module imports without a driver.
#include "multicast.h"

#include <cstdlib>
#include <stdexcept>

#include "common.h"
#include "driver.h"

namespace tokenweave {

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

// One multicast object per group, bound to one physical allocation per device; each device maps
// its own memory (unicast) and the multicast object. Never reached unless MultimemRefusal() == "".
void MapMulticast(const std::vector<int>& ordinals, int64_t bytes, std::vector<char*>* unicast,
                  std::vector<char*>* multicast) {
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

  const int n = static_cast<int>(ordinals.size());
  unicast->assign(n, nullptr);
  multicast->assign(n, nullptr);
  {
    CUmulticastObjectProp prop = {};
    prop.numDevices = n;
    prop.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop.size = bytes;
    size_t gran = 0;
    CheckCu(mc_gran(&gran, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED),
            "cuMulticastGetGranularity");
    prop.size = (prop.size + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle mc;
    CheckCu(mc_create(&mc, &prop), "cuMulticastCreate");
    for (int a = 0; a < n; ++a) {
      CUdevice dev;
      CheckCu(dev_get(&dev, ordinals[a]), "cuDeviceGet");
      CheckCu(mc_add(mc, dev), "cuMulticastAddDevice");
    }
    for (int a = 0; a < n; ++a) {
      TW_THROW_CHECK(cudaSetDevice(ordinals[a]));
      CUmemAllocationProp ap = {};
      ap.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      ap.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      ap.location.id = ordinals[a];
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
      (*unicast)[a] = reinterpret_cast<char*>(uc);
      (*multicast)[a] = reinterpret_cast<char*>(mcva);
    }
  }
}

}  // namespace tokenweave
