#include "launch_gate.h"

#include <algorithm>
#include <chrono>

namespace tokenweave {

LaunchGate::LaunchGate(std::vector<int> ordinals)
    : ordinals_(std::move(ordinals)), arrived_(ordinals_.size(), 0) {}

GateWait LaunchGate::Arrive(int ordinal, double timeout_s) {
  GateWait out;
  const auto it = std::find(ordinals_.begin(), ordinals_.end(), ordinal);
  if (ordinals_.size() < 2 || it == ordinals_.end()) return out;  // open
  const size_t me = static_cast<size_t>(it - ordinals_.begin());
  std::unique_lock<std::mutex> lock(mu_);
  const int64_t n = out.call = ++arrived_[me];
  auto all_here = [&] {
    return std::all_of(arrived_.begin(), arrived_.end(), [&](int64_t a) { return a >= n; });
  };
  if (all_here()) {
    arrived_cv_.notify_all();
    return out;
  }
  if (arrived_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), all_here)) return out;
  for (size_t i = 0; i < ordinals_.size(); ++i)
    if (arrived_[i] < n) {
      out.late_ordinal = ordinals_[i];
      out.late_calls = arrived_[i];
      break;
    }
  return out;
}

}  // namespace tokenweave
