#pragma once
// Emulates a heterogeneous cluster on one Linux machine so claims about slow links and slow devices
// can be checked without the hardware:
//
//   * every HOST of the ClusterSpec gets its own network namespace (alloy-emu-<id>-h<k>, k = the
//     host's index in spec.hosts()) with one interface, eth0, at 10.213.0.<k+1>/24;
//   * the eth0s are veth pairs whose other ends hang on a bridge, br0, inside a dedicated switch
//     namespace (alloy-emu-<id>-sw). The root namespace gets no interface, address or route, and
//     because every interface lives in a namespace of our own, interface names never collide with
//     another launch's and IFNAMSIZ never limits the id;
//   * each host shapes its egress per destination host: an htb class per destination with rate =
//     ceil = link(host, dst).bandwidth, selected by a u32 filter on the destination address. Every
//     ordered host pair is therefore an independent link of the spec's bandwidth (one slow pair does
//     not slow the others; ranks on one host share their host's link to a destination). A single
//     tbf per host would make all destinations share one rate, which the spec does not say, so htb
//     is used even when all rates are equal. Traffic between ranks of one host stays on that
//     host's loopback and is not shaped (intra_host is far above what emulation can model);
//   * every device gets a cgroup v1 cpu group (/sys/fs/cgroup/cpu/alloy-emu-<id>-d<device>) with
//     cpu.cfs_period_us = 5000 (longer for devices too slow for the kernel's 1 ms minimum quota)
//     and cpu.cfs_quota_us = speed * period: speed 0.5 = half a core.
//   * every device is pinned to its own CPUs (sched_setaffinity, see assign_cpus): the devices'
//     speeds are packed onto the machine's cores, largest first, each onto the core with the most
//     capacity left, so a 0.8-core device keeps a core to itself while 0.4 and 0.2 share the
//     other. Without pinning the scheduler moves ranks between cores and can let two devices meet
//     on one while the other idles, which separate machines never do. What pinning cannot separate
//     is memory bandwidth: on the 2-core VM a device computing while the others compute runs
//     10-15% slower than alone (bench/README.md measures against both).
//
// Measured on a 2-core VM: a 100 Mbit/s link carries 95.7 Mbit/s of TCP payload (the ceiling for
// 1514-byte frames is 95.6%), 20 Mbit/s -> 19.2, 200 -> 192, 1 Gbit/s -> 958 Mbit/s; unshaped veths
// reach about 10 Gbit/s there, so links of several Gbit/s are not reached (create() cannot tell).
//
// Latency: `netem` is not available on the machines this was built for, so a link of at least
// kMinEmulatedLatencyMs gets its latency_ms (one way) from a delay line (delay_line.h): the switch
// redirects the frames of such host pairs, as they enter it, into a tap whose owner holds them for
// the latency and hands them back to the bridge. Faster links keep the veth's own latency (tens of
// microseconds); create() logs both. Speeds are absolute core shares, not normalised: a
// spec whose speeds add up to more than the machine's free cores gets less than it asks for, and
// a quota only slows a rank that would use more than its share of each period.
//
// Ownership: create() writes /run/alloy-emu/<id>.json (owner pid and its start time, names of
// everything it will create) before creating anything, under a lock on /run/alloy-emu/.lock that
// clean_leftovers() takes too, so a crashed launch's resources are told from a live one's and a
// live owner's are never touched.
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "alloy/dist/launch.h"
#include "alloy/emu/delay_line.h"
#include "alloy/plan/cluster.h"

namespace alloy::emu {

struct EmulatorOptions {
  // Unique per launch; letters, digits and '_' only, at most 32 characters. Empty = the process id
  // (plus a counter for the second and later clusters of one process).
  std::string id;
  bool limit_cpu = true;      // cgroup cpu quotas from the devices' speed
  bool limit_network = true;  // tc shaping from the links' bandwidth (namespaces are always created)
  bool pin_cpus = true;       // each device on its own CPUs (with limit_cpu only)
  bool emulate_latency = true;  // with limit_network: links of kMinEmulatedLatencyMs or more delay their frames
};

// Packs devices of the given SPEEDS (cores' worth, > 0) onto CPUS (ids as sched_getaffinity gives
// them): a device of speed >= 1 takes ceil(speed) whole free cores; smaller ones, in decreasing
// speed order (ties by index), go to the core with the most capacity left (worst fit, which
// spreads the load and leaves the largest device alone when it can). Returns each device's CPUs,
// or all empty (no pinning) when the speeds do not fit: pinning then would only add contention.
std::vector<std::vector<int>> assign_cpus(const std::vector<double>& speeds, const std::vector<int>& cpus);

class EmulatedCluster {
 public:
  // Checks prerequisites first and throws alloy::Error naming what is missing (root, `ip`, `tc`,
  // network namespaces, the cgroup v1 cpu controller, bridge/veth support, the htb qdisc or the
  // u32 filter). Anything created before a failure is removed again before the throw.
  static std::unique_ptr<EmulatedCluster> create(const plan::ClusterSpec& spec, EmulatorOptions o);
  ~EmulatedCluster();
  EmulatedCluster(const EmulatedCluster&) = delete;
  EmulatedCluster& operator=(const EmulatedCluster&) = delete;

  const std::string& id() const { return id_; }
  int num_hosts() const { return static_cast<int>(hosts_.size()); }
  std::string netns_of_device(int device) const;  // name, as `ip netns` shows it
  std::string netns_path_of_device(int device) const;  // /run/netns/<name>, for setns()
  std::string ip_of_device(int device) const;          // its host's address
  std::string cgroup_of_device(int device) const;      // "" when CPU limits are off
  const std::vector<int>& cpus_of_device(int device) const;  // empty when not pinned
  std::string netns_of_host(const std::string& host) const;
  std::string host_of_device(int device) const;
  std::string ip_of_host(const std::string& host) const;
  std::string switch_netns() const { return switch_ns_; }
  std::string state_file() const;

  // argv prefix that runs a command as DEVICE: joins its cgroup, then `ip netns exec` into its host.
  // For ad-hoc commands and scripts; launch() uses placement_of_device, which needs no wrapper.
  std::vector<std::string> command_prefix(int device) const;
  // Namespace, cgroup and environment (GLOO_SOCKET_IFNAME=eth0 so Gloo binds the emulated NIC,
  // ALLOY_EMU_HOST, ALLOY_EMU_DEVICE) for a rank running as DEVICE.
  dist::RankPlacement placement_of_device(int device) const;
  // Places rank r on device rank_device[r] (identity when empty; nproc must not exceed the number
  // of devices) and points MASTER_ADDR at rank 0's host, overriding o.master_addr (in an elastic
  // launch, at the host of the first slot still there). Ranks placed on one device share its
  // cgroup, and so its quota. A slot whose host is down (set_host) counts as unavailable.
  void place(dist::LaunchOptions& o, const std::vector<int>& rank_device = {}) const;

  // Kills what is left in the cgroups and namespaces, removes them and the state file. Idempotent;
  // never throws: what cannot be removed is logged and left, with the state file, for
  // clean_leftovers() once this process is gone.
  void teardown();

 private:
  EmulatedCluster() = default;
  void build(const plan::ClusterSpec& spec);
  // The links of the spec's `shared` rules, at the switch; appends them to LINKS (the log line).
  // Returns, per ordered host pair on a shared link, the IFB device that shapes it.
  std::map<std::pair<size_t, size_t>, std::string> shape_shared_links(const plan::ClusterSpec& spec, std::string* links);
  // Delays the frames of host pairs whose link asks for kMinEmulatedLatencyMs or more (delay_line.h);
  // SHARED_DEV: shape_shared_links' devices, which frames of those pairs go through after their delay.
  void add_latency(const plan::ClusterSpec& spec, const std::map<std::pair<size_t, size_t>, std::string>& shared_dev, std::string* links);
  void add_ingress(size_t host);  // the switch port's ingress qdisc, once
  void check_device(int device) const;
  int host_index(const std::string& host) const;

  std::string id_;
  EmulatorOptions opts_;
  std::string ip_tool_, tc_tool_;
  std::string switch_ns_;
  std::vector<std::string> hosts_;      // spec.hosts() order
  std::vector<std::string> host_ns_;    // by host index
  std::vector<int> device_host_;        // device -> host index
  std::vector<std::string> device_names_;
  std::vector<std::string> cgroups_;    // by device; empty when CPU limits are off
  std::vector<std::vector<int>> cpus_;  // by device; empty when not pinned
  std::set<size_t> ingress_ports_;     // switch ports (by host) with an ingress qdisc
  std::unique_ptr<DelayLine> delay_;   // null when no link is delayed
  bool torn_down_ = true;  // until create() has recorded ownership: before that nothing is ours to remove
};

// Removes leftovers of earlier runs whose owner is dead (or that no state file claims): processes
// still inside them, their cgroups, namespaces (with the veths and bridge in them) and state files.
// Returns the number of namespaces and cgroups removed; throws alloy::Error when not root. Called
// at the start of every emulated launch and by `alloy emu clean`.
int clean_leftovers();

// Cuts (CUT) or restores the link between two hosts of a running emulated cluster (ID, or the only
// one running): while cut, both directions' traffic goes to a class that drops every packet;
// restored, to its own class again. Returns the cluster's id. Throws InputError naming an unknown host or cluster.
std::string set_link(const std::string& host_a, const std::string& host_b, bool cut, const std::string& id = "");
// Takes HOST of a running emulated cluster down (DOWN: every link to it cut, every process on it
// killed, as when a machine loses power) or brings it back up (links restored). While a host is
// down, an elastic launch (--rejoin-timeout) counts its devices as gone. Returns the cluster's id.
std::string set_host(const std::string& host, bool down, const std::string& id = "");
// Whether HOST of cluster ID is down (set_host); false when the cluster or host is unknown.
bool host_down(const std::string& id, const std::string& host);

// One emulated launch: clean_leftovers(), create(), place(), dist::launch(), teardown. SIGINT and
// SIGTERM at any point end with everything removed (during setup the launch is abandoned and the
// result has exit_code 130).
dist::LaunchResult launch_emulated(const plan::ClusterSpec& spec, dist::LaunchOptions o, EmulatorOptions eo,
                                   const std::vector<int>& rank_device = {});

}  // namespace alloy::emu
