// The profile of edge0 nodes (profile.h).
#include "profile.h"

#include <mutex>

namespace edge0 {

std::atomic<bool> profiling{false};
static std::mutex profile_mu;
static std::map<std::string, std::pair<int64_t, double>> profile_;  // key -> (nodes, seconds)

void profile_add(const std::string& key, double seconds) {
  std::lock_guard<std::mutex> lk(profile_mu);
  auto& e = profile_[key];
  e.first += 1;
  e.second += seconds;
}

std::map<std::string, std::pair<int64_t, double>> profile(bool reset) {
  std::lock_guard<std::mutex> lk(profile_mu);
  auto out = profile_;
  if (reset) profile_.clear();
  return out;
}

}  // namespace edge0
