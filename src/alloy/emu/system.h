#pragma once
// What the emulator asks of the operating system: running ip/tc, network namespaces and cgroup
// CPU quotas, the files of a live cluster's state, and removing what a cluster left. Shared by
// building a cluster (emulator.cpp) and changing or cleaning a running one (control.cpp).
#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace alloy::emu::sys {


inline constexpr const char* kPrefix = "alloy-emu-";
inline constexpr const char* kStateDir = "/run/alloy-emu";
inline constexpr const char* kNetnsDir = "/run/netns";
inline constexpr const char* kCgroupRoot = "/sys/fs/cgroup/cpu";
inline constexpr const char* kSubnet = "10.213.0.";  // private; exists only inside our namespaces
// A short CFS period makes a throttled rank slow evenly instead of in bursts: with the kernel's
// default 100 ms a quarter-core rank runs 25 ms at full speed and then stalls 75 ms, so a rank that
// idles part of each period (a pipeline stage waiting for activations) is faster than its quota,
// and a profile of short calls sees bursts. Measured on the 2-core VM with the 3-device demo pool,
// a 0.4-core pipeline stage doing 15-30 ms calls between waits ran them 28-30% slower than the
// same calls back to back in the profile with 10 ms periods, and as fast (813 vs 815 ms per step
// predicted) with 5 ms periods. 5 ms still leaves a 0.2-core device the kernel's 1 ms minimum.
inline constexpr long kPeriodUs = 5000;
inline constexpr long kMaxPeriodUs = 1000000;  // the kernel's upper bound
inline constexpr long kMinQuotaUs = 1000;      // the kernel refuses smaller quotas
inline constexpr size_t kMaxHosts = 254;   // .1 .. .254 of the /24


struct ToolResult {
  int rc = -1;
  std::string out;  // stdout and stderr together
};

std::string trim(std::string s);
std::string find_tool(const std::string& name);
ToolResult run_tool(const std::vector<std::string>& args);
void must(const std::vector<std::string>& args, const std::string& what);
std::string read_small(const std::string& path);
bool write_small(const std::string& path, const std::string& value);
bool write_in_netns(const std::string& netns_path, const std::string& file, const std::string& value);
void disable_ipv6(const std::string& netns_name);
// TCP between the emulated hosts uses cubic, Linux's default congestion control, whatever the
// machine that runs the emulator uses (its namespaces start with the machine's choice). Measured on
// a VM whose default is BBR: uneven TP over the 3-device pool's 0.2 Gbit/s hop fell from 5.9 to
// 8.0-8.5 s per step part-way through 4 of 9 runs and stayed there (BBR's bandwidth estimate of
// an application-limited flow through the htb shaper); under cubic 0 of 9, every step 5.6-7.5 s.
// Set on the host's route to SUBNET over DEV, so that it holds where the kernel refuses cubic as a
// namespace's default (not in tcp_allowed_congestion_control); the namespace's sysctl otherwise.
// False where neither takes: the hosts keep the machine's choice.
bool use_cubic(const std::string& ip_tool, const std::string& netns_name, const std::string& subnet, const std::string& dev);
std::optional<unsigned long long> start_time_of(pid_t pid);
bool owner_alive(pid_t pid, unsigned long long start);
std::vector<std::string> list_dir(const std::string& dir);
std::string id_of_resource(const std::string& name);
// Holds the emulator's state directory lock (flock) for its lifetime: one process at a time
// creates, changes or removes clusters.
class StateLock {
 public:
  StateLock();
  ~StateLock();
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

 private:
  int fd_ = -1;
};
std::string state_path(const std::string& id);
bool remove_cgroup(const std::string& dir);
int kill_netns_processes(const struct stat& ns);
bool remove_netns(const std::string& name);
std::pair<int, bool> remove_resources(const std::string& id, std::vector<std::string> netns, std::vector<std::string> cgroups);
std::string rate_str(double gbps);

}  // namespace alloy::emu::sys
