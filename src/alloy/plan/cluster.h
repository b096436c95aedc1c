#pragma once
// ClusterSpec: the pool of devices and the links between their hosts. Written as YAML by users,
// imported from PTAFM's data-centre description or HeteroShard's hetero_config.json, consumed by
// the profiler, the planner, the emulator and the diagrams.
//
// YAML:
//   name: three-devices
//   devices:
//     - {name: fast, host: h0, kind: cpu, type: cpu-full, memory_gb: 8, speed: 1.0}
//     - {name: slow, host: h2, kind: cpu, type: cpu-quarter, memory_gb: 8, speed: 0.25}
//   groups:                 # optional named sets of hosts (regions, racks)
//     eu: [h0, h1]
//   links:                  # between two hosts or groups; `within` a host or group
//     - {between: [h0, h2], bandwidth_gbps: 0.1, latency_ms: 0.2}
//     - {within: eu, bandwidth_gbps: 10}
//     - {between: [eu, us], bandwidth_gbps: 1, shared: true}
//   default_link: {bandwidth_gbps: 1, latency_ms: 0.1}
//   intra_host_link: {bandwidth_gbps: 100, latency_ms: 0.01}
// The most specific rule wins: host pair, then host-group pair, then `within`, then the defaults.
// A `between` rule is a bandwidth per pair of hosts it covers (each pair its own path, as hosts
// on the internet have) unless `shared: true`: then it is one link (a leased line or VPN between
// two sites) whose bandwidth, each way, all the pairs it covers share.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace alloy::plan {

struct Device {
  std::string name;       // unique
  std::string host;       // devices on one host share its network interface
  std::string kind = "cpu";  // cpu | cuda | mps | rocm
  std::string type;       // device type: a profile measured on one device of a type serves all of them
  double memory_gb = 0;   // memory available for training
  double speed = 1.0;     // relative compute speed hint (the emulator's CPU share; the planner uses profiles)
  double flops = 0;       // optional peak TFLOP/s, used to extrapolate a type nobody profiled
};

struct Link {
  double bandwidth_gbps = 1.0;  // gigabits per second
  double latency_ms = 0.1;
  double bytes_per_s() const { return bandwidth_gbps * 1e9 / 8; }
  double latency_s() const { return latency_ms / 1e3; }
};

struct LinkRule {
  std::string a, b;  // host or group names; a == b for a `within` rule
  Link link;
  bool shared = false;  // one link for all the host pairs it covers (`between` rules only)
};

struct ClusterSpec {
  std::string name;
  std::vector<Device> devices;
  std::map<std::string, std::vector<std::string>> groups;  // group -> hosts
  std::vector<LinkRule> rules;
  Link default_link{1.0, 0.1};
  Link intra_host{100.0, 0.01};
  // False for a file that names machines but no network (HeteroShard's hetero_config.json): its
  // links are the defaults above, assumed, which a diagram says rather than showing them as given.
  bool links_described = true;
  std::string source;  // file it came from, for messages
  // Line of each field as loaded ("devices[2].kind" -> 7), so validate() can point at it. Only
  // meaningful for the spec as read; a spec built or edited in code leaves it empty or stale.
  std::map<std::string, int> source_lines;

  static ClusterSpec load(const std::string& path);  // YAML (JSON is YAML)
  static ClusterSpec from_yaml_string(const std::string& text, const std::string& source);
  // Checks names unique, every host in groups/rules exists, bandwidth > 0, memory >= 0, ...
  void validate() const;
  std::string to_yaml() const;

  std::vector<std::string> hosts() const;  // in order of first appearance
  // The link between two hosts (same host: intra_host unless a `within` rule for it says more).
  Link link(const std::string& host_a, const std::string& host_b) const;
  // The rule that gives that link (index into rules), -1 for the defaults.
  int link_rule(const std::string& host_a, const std::string& host_b) const;
  // Which physical link traffic from HOST_A to HOST_B crosses, for sharing its bandwidth: -1 when
  // the pair has a path of its own (no shared rule gives its link, or the same host); else
  // 2 x rule + 0 when HOST_A is on the rule's first end (`between[0]`), + 1 when on its second.
  int shared_link(const std::string& host_a, const std::string& host_b) const;
  Link link_between_devices(int a, int b) const { return link(devices[static_cast<size_t>(a)].host, devices[static_cast<size_t>(b)].host); }
  int device_index(const std::string& name) const;  // -1 if absent
  std::vector<std::string> types() const;            // distinct device types
};

// PTAFM's data-centre description (NUM_STAGE / POWER_SECTION [nA100,nT4] / LATENCY_SECTION /
// BANDWIDTH_SECTION, see shared/reference/FORMATS.md): one host per data centre, with its A100s
// (type A100, 40 GB, 312 TFLOP/s) and T4s (type T4, 16 GB, 65 TFLOP/s). Returns the spec and the
// NUM_STAGE value.
struct PtafmCluster {
  ClusterSpec spec;
  int num_stages = 0;
};
PtafmCluster import_ptafm(const std::string& path);
// HeteroShard hetero_config.json: the coordinator and each worker become hosts; device kinds from
// their "device" field (auto -> cuda), num_gpus devices per worker.
ClusterSpec import_hetero_config(const std::string& path);

}  // namespace alloy::plan
