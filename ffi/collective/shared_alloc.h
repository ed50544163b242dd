// Device memory that other processes on the host can map (one process per GPU): a CUDA VMM
// allocation exported as a POSIX file descriptor. An importer holds its own reference to the
// physical memory, so a peer process that dies leaves the mapping valid: a kernel still
// writing there is harmless and ends at its bounded wait, instead of faulting. Mappings live
// until the process exits (a retired comm keeps them: peers may still push into them).
#pragma once

#include <cstdint>

namespace tokenweave {

struct SharedAlloc {
  char* ptr = nullptr;            // mapped for `ordinal`'s device
  int64_t size = 0;               // rounded up to the allocation granularity
  unsigned long long handle = 0;  // CUmemGenericAllocationHandle (owner only; 0 when imported)
  int ordinal = -1;
};

// Allocates `bytes` on device `ordinal`, exportable, mapped read-write for that device.
SharedAlloc AllocShared(int ordinal, int64_t bytes);
// A new file descriptor for `a` (the caller closes it; passing it over a Unix socket shares it).
int ExportShared(const SharedAlloc& a);
// Maps an allocation of `bytes` exported by another process (`fd`, which this call closes) for
// device `ordinal` (its owner's device must be that one or a peer of it).
SharedAlloc ImportShared(int ordinal, int fd, int64_t bytes);

}  // namespace tokenweave
