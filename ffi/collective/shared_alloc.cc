#include "shared_alloc.h"

#include <unistd.h>

#include <cstdint>

#include "common.h"
#include "driver.h"

namespace tokenweave {
namespace {

CUmemAllocationProp Prop(int ordinal) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = ordinal;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

int64_t Rounded(int ordinal, int64_t bytes) {
  auto gran =
      DriverEntry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
  const CUmemAllocationProp p = Prop(ordinal);
  size_t g = 0;
  CheckCu(gran(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
  return (bytes + static_cast<int64_t>(g) - 1) / static_cast<int64_t>(g) * static_cast<int64_t>(g);
}

// Reserves an address range for `h`, maps it and grants `ordinal`'s device read-write access.
char* Map(CUmemGenericAllocationHandle h, int ordinal, int64_t size) {
  auto reserve = DriverEntry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  auto map = DriverEntry<decltype(&cuMemMap)>("cuMemMap");
  auto set_access = DriverEntry<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  CUdeviceptr va = 0;
  CheckCu(reserve(&va, size, 0, 0, 0), "cuMemAddressReserve");
  CheckCu(map(va, size, 0, h, 0), "cuMemMap");
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CheckCu(set_access(va, size, &access, 1), "cuMemSetAccess");
  return reinterpret_cast<char*>(va);
}

}  // namespace

SharedAlloc AllocShared(int ordinal, int64_t bytes) {
  auto create = DriverEntry<decltype(&cuMemCreate)>("cuMemCreate");
  TW_THROW_CHECK(cudaSetDevice(ordinal));
  TW_THROW_CHECK(cudaFree(nullptr));  // the device's primary context exists
  SharedAlloc a;
  a.ordinal = ordinal;
  a.size = Rounded(ordinal, bytes);
  const CUmemAllocationProp p = Prop(ordinal);
  CUmemGenericAllocationHandle h = 0;
  CheckCu(create(&h, a.size, &p, 0), "cuMemCreate (exportable device memory)");
  a.handle = h;
  a.ptr = Map(h, ordinal, a.size);
  return a;
}

int ExportShared(const SharedAlloc& a) {
  auto exp = DriverEntry<decltype(&cuMemExportToShareableHandle)>("cuMemExportToShareableHandle");
  int fd = -1;
  CheckCu(exp(&fd, a.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
  return fd;
}

SharedAlloc ImportShared(int ordinal, int fd, int64_t bytes) {
  auto imp =
      DriverEntry<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle");
  auto release = DriverEntry<decltype(&cuMemRelease)>("cuMemRelease");
  TW_THROW_CHECK(cudaSetDevice(ordinal));
  TW_THROW_CHECK(cudaFree(nullptr));
  SharedAlloc a;
  a.ordinal = ordinal;
  a.size = bytes;
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = imp(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);
  CheckCu(r, "cuMemImportFromShareableHandle");
  a.ptr = Map(h, ordinal, bytes);
  CheckCu(release(h), "cuMemRelease");  // the mapping keeps the memory alive
  return a;
}

}  // namespace tokenweave
