// Time inside each kind of edge0 node: off unless set_profile(true); a node's key is its name, and for products its
// output and input widths.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace edge0 {

extern std::atomic<bool> profiling;

// One node's time into the profile, under key() (called only while profiling).
void profile_add(const std::string& key, double seconds);

// {key: (nodes, seconds)} since the last reset; reset: start again from nothing.
std::map<std::string, std::pair<int64_t, double>> profile(bool reset);

class ProfileScope {
 public:
  template <typename K>
  explicit ProfileScope(K&& key) {
    if (profiling.load(std::memory_order_relaxed)) {
      key_ = key();
      t0_ = std::chrono::steady_clock::now();
      on_ = true;
    }
  }
  ~ProfileScope() {
    if (on_) profile_add(key_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
  }

 private:
  std::string key_;
  std::chrono::steady_clock::time_point t0_;
  bool on_ = false;
};

}  // namespace edge0
