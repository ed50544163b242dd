// NVLink multicast mappings for the opt-in multimem path (never created on the lent machines).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tokenweave {

// "" when the multimem path may be set up; otherwise why not. Reads the environment only.
std::string MultimemRefusal();

// One multicast object over `ordinals` (one group), bound to `bytes` of physical memory on each
// device; returns each device's unicast and multicast mapping. Calls MultimemRefusal() first
// and throws std::runtime_error with its reason (before any driver call) when it refuses.
void MapMulticast(const std::vector<int>& ordinals, int64_t bytes, std::vector<char*>* unicast,
                  std::vector<char*>* multicast);

}  // namespace tokenweave
