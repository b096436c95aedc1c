#include "alloy/emu/emulator.h"
#include "alloy/emu/system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"

namespace alloy::emu {
using namespace sys;
namespace {

std::atomic<int> g_launch_signal{0};
void on_launch_signal(int sig) { g_launch_signal = sig; }

int g_clusters_in_process = 0;

// An htb class's arguments for a link of GBPS. Bursts of ~2 ms of traffic keep the long-run rate
// at 95-96% of the limit (TCP goodput over 1514-byte frames is at most 95.6%) without letting
// small messages jump the link; htb lets a GSO super-packet through a smaller bucket by going into
// debt, so low rates need no 64 KiB bucket. An explicit quantum keeps the kernel from warning.
struct HtbArgs {
  std::string rate, burst, quantum;
};
HtbArgs htb_args(double gbps) {
  const double bytes_per_s = gbps * 1e9 / 8;
  const long long burst = std::max(3200LL, std::llround(bytes_per_s * 0.002));
  const long long quantum = std::clamp(burst, 1600LL, 200000LL);
  return {rate_str(gbps), std::to_string(burst), std::to_string(quantum)};
}

// One way of a link as htb classes under DEV's root: PARENT at the link's rate, and two leaves
// borrowing all of it, SMALL (packets under 128 bytes, first) and BULK. In one FIFO the ACKs of a
// transfer coming the other way would wait behind this way's data (up to the queue's 1000
// packets, 60 ms at 0.2 Gbit/s) and slow that transfer by a fifth, or by half on a shared link;
// a full-duplex link's two ways do not slow each other. Packets are sorted into the leaves by
// the caller's filters (small_filter's match goes before the destination's).
void add_link_classes(const std::string& tc, const std::string& ns, const std::string& dev, const std::string& parent,
                      const std::string& small, const std::string& bulk, double gbps, const std::string& what) {
  const HtbArgs a = htb_args(gbps);
  must({tc, "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", parent, "htb", "rate", a.rate, "ceil", a.rate, "burst", a.burst,
        "cburst", a.burst, "quantum", a.quantum},
       "cannot shape " + what);
  const std::string small_rate = rate_str(gbps / 20), bulk_rate = rate_str(gbps * 19 / 20);
  for (const auto& [cls, rate, prio] : {std::tuple{small, small_rate, "0"}, std::tuple{bulk, bulk_rate, "1"}})
    must({tc, "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", cls, "htb", "rate", rate, "ceil", a.rate, "burst", a.burst,
          "cburst", a.burst, "quantum", a.quantum, "prio", prio},
         "cannot shape " + what);
}

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%g ms", ms);
  return b;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

std::vector<std::vector<int>> assign_cpus(const std::vector<double>& speeds, const std::vector<int>& cpus) {
  const size_t n = speeds.size();
  std::vector<std::vector<int>> out(n);
  std::vector<double> left(cpus.size(), 1.0);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return speeds[a] > speeds[b]; });
  constexpr double kSlack = 1e-9;
  for (size_t i : order) {
    const double s = speeds[i];
    if (!(s > 0) || !std::isfinite(s)) return std::vector<std::vector<int>>(n);
    if (s >= 1 - kSlack) {
      size_t need = static_cast<size_t>(std::ceil(s - kSlack));
      for (size_t c = 0; c < cpus.size() && need > 0; ++c)
        if (left[c] >= 1 - kSlack) out[i].push_back(cpus[c]), left[c] = 0, --need;
      if (need > 0) return std::vector<std::vector<int>>(n);
      continue;
    }
    size_t best = cpus.size();
    for (size_t c = 0; c < cpus.size(); ++c)
      if (left[c] >= s - kSlack && (best == cpus.size() || left[c] > left[best] + kSlack)) best = c;
    if (best == cpus.size()) return std::vector<std::vector<int>>(n);
    left[best] -= s;
    out[i].push_back(cpus[best]);
  }
  return out;
}

std::unique_ptr<EmulatedCluster> EmulatedCluster::create(const plan::ClusterSpec& spec, EmulatorOptions o) {
  // Prerequisites first, each named, so a machine that cannot emulate says exactly why.
  if (::geteuid() != 0)
    throw Error("emulator: needs root (to create network namespaces and cgroups); running as uid " + std::to_string(::geteuid()));
  std::unique_ptr<EmulatedCluster> c(new EmulatedCluster());
  c->ip_tool_ = find_tool("ip");
  if (c->ip_tool_.empty()) throw Error("emulator: needs the `ip` tool (iproute2); not found in PATH, /usr/sbin or /sbin");
  if (o.limit_network) {
    c->tc_tool_ = find_tool("tc");
    if (c->tc_tool_.empty()) throw Error("emulator: needs the `tc` tool (iproute2) to limit bandwidth; not found in PATH, /usr/sbin or /sbin");
  }
  if (::access("/proc/self/ns/net", F_OK) != 0)
    throw Error("emulator: needs network namespaces; /proc/self/ns/net is missing (kernel without CONFIG_NET_NS?)");
  if (o.limit_cpu && ::access((std::string(kCgroupRoot) + "/cpu.cfs_quota_us").c_str(), W_OK) != 0)
    throw Error(std::string("emulator: needs the cgroup v1 cpu controller at ") + kCgroupRoot +
                " (cpu.cfs_quota_us missing or not writable); mount it or run with CPU limits off");

  if (o.id.empty()) {
    o.id = std::to_string(::getpid());
    if (g_clusters_in_process > 0) o.id += "_" + std::to_string(g_clusters_in_process);
  }
  ++g_clusters_in_process;
  if (o.id.size() > 32 || o.id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != std::string::npos)
    throw InputError("emulator id", "'" + o.id + "' must be 1-32 letters, digits or '_'");

  const auto hosts = spec.hosts();
  if (spec.devices.empty() || hosts.empty()) throw InputError(spec.source, "cluster has no devices to emulate");
  if (hosts.size() > kMaxHosts)
    throw InputError(spec.source, "the emulator handles at most " + std::to_string(kMaxHosts) + " hosts, got " + std::to_string(hosts.size()));
  for (const auto& d : spec.devices)
    if (o.limit_cpu && !(d.speed > 0 && std::isfinite(d.speed)))
      throw InputError(spec.source, "device " + d.name + ": speed must be > 0 to become a CPU quota");

  c->id_ = o.id;
  c->opts_ = o;
  c->hosts_ = hosts;
  c->switch_ns_ = kPrefix + o.id + "-sw";
  for (size_t k = 0; k < hosts.size(); ++k) c->host_ns_.push_back(kPrefix + o.id + "-h" + std::to_string(k));
  for (size_t d = 0; d < spec.devices.size(); ++d) {
    c->device_host_.push_back(c->host_index(spec.devices[d].host));
    c->device_names_.push_back(spec.devices[d].name);
    c->cgroups_.push_back(o.limit_cpu ? std::string(kCgroupRoot) + "/" + kPrefix + o.id + "-d" + std::to_string(d) : "");
  }
  c->cpus_.assign(spec.devices.size(), {});
  if (o.limit_cpu && o.pin_cpus) {
    std::vector<int> mine;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0)
      for (int k = 0; k < CPU_SETSIZE; ++k)
        if (CPU_ISSET(k, &set)) mine.push_back(k);
    std::vector<double> speeds;
    for (const auto& d : spec.devices) speeds.push_back(d.speed);
    c->cpus_ = assign_cpus(speeds, mine);
    if (c->cpus_[0].empty())
      log_warn("emulator: the devices' speeds do not fit on the " + std::to_string(mine.size()) +
               " CPUs this process may use, one core at most per core's worth; ranks are not pinned to CPUs");
  }

  // Claiming an id (and clean_leftovers() judging claims) happens under one lock, so two launches
  // cannot both take an id and a cleaner cannot act on a claim that is being made.
  ::mkdir(kStateDir, 0755);
  StateLock lock;
  // An earlier launch with this id: refuse if it lives, clean it if not.
  if (file_exists(state_path(o.id))) {
    try {
      auto j = nlohmann::json::parse(read_small(state_path(o.id)));
      if (owner_alive(j.value("pid", 0), j.value("start_time", 0ULL)))
        throw Error("emulator: id " + o.id + " is in use by the live process " + std::to_string(j.value("pid", 0)));
    } catch (const nlohmann::json::exception&) {
    }
    remove_resources(o.id, {}, {});
    ::unlink(state_path(o.id).c_str());
  }

  // Ownership is recorded before anything exists, so a crash at any later point leaves resources
  // that clean_leftovers() can attribute to a dead owner.
  nlohmann::json st;
  st["id"] = o.id;
  st["pid"] = ::getpid();
  st["start_time"] = start_time_of(::getpid()).value_or(0);
  st["netns"] = c->host_ns_;
  st["netns"].push_back(c->switch_ns_);
  st["cgroups"] = nlohmann::json::array();
  for (const auto& g : c->cgroups_)
    if (!g.empty()) st["cgroups"].push_back(g);
  // Written aside and hard-linked into place: the file appears complete (clean_leftovers() never
  // sees half of it), and link() fails if another launch claimed the id meanwhile.
  const std::string path = state_path(o.id), tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << st.dump(2) << "\n";
    f.flush();
    if (!f) throw Error("emulator: cannot write " + tmp);
  }
  const bool claimed = ::link(tmp.c_str(), path.c_str()) == 0;
  const int link_errno = errno;
  ::unlink(tmp.c_str());
  if (!claimed)
    throw Error("emulator: cannot claim id " + o.id + " (" + path + "): " + (link_errno == EEXIST ? "in use by another launch" : std::strerror(link_errno)));
  c->torn_down_ = false;

  try {
    c->build(spec);
  } catch (...) {
    c->teardown();
    throw;
  }
  return c;
}

void EmulatedCluster::add_ingress(size_t host) {
  if (ingress_ports_.insert(host).second)
    must({tc_tool_, "-n", switch_ns_, "qdisc", "add", "dev", "h" + std::to_string(host), "ingress"},
         "needs the ingress qdisc (sch_ingress) to emulate a shared link or a link's latency");
}

std::map<std::pair<size_t, size_t>, std::string> EmulatedCluster::shape_shared_links(const plan::ClusterSpec& spec, std::string* links) {
  std::map<std::pair<size_t, size_t>, std::string> dev_of_pair;
  // A shared rule is one link for every host pair it covers, so no host's own egress can shape
  // it: the switch does. Each host's packets for a peer across it are redirected, as they enter
  // the switch, through one IFB device per rule and way, whose htb class is the link's rate; the
  // IFB hands them back to the bridge. The pairs keep their own classes at the same rate on the
  // hosts (emu cut/restore works on those).
  const std::string& sw = switch_ns_;
  std::map<int, std::string> ifb_of;  // ClusterSpec::shared_link -> IFB device
  for (size_t k = 0; k < hosts_.size(); ++k)
    for (size_t j = 0; j < hosts_.size(); ++j) {
      if (j == k) continue;
      const int way = spec.shared_link(hosts_[k], hosts_[j]);
      if (way < 0) continue;
      auto it = ifb_of.find(way);
      if (it == ifb_of.end()) {
        const plan::LinkRule& r = spec.rules[static_cast<size_t>(way / 2)];
        const std::string dev = "ifb" + std::to_string(way);
        const std::string what = "the shared link between " + r.a + " and " + r.b;
        must({ip_tool_, "-n", sw, "link", "add", dev, "type", "ifb"}, "needs the ifb device (CONFIG_IFB) to emulate " + what);
        must({ip_tool_, "-n", sw, "link", "set", dev, "up"}, "cannot bring up the device of " + what);
        must({tc_tool_, "-n", sw, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"}, "cannot shape " + what);
        add_link_classes(tc_tool_, sw, dev, "1:1", "1:10", "1:20", r.link.bandwidth_gbps, what);
        must({tc_tool_, "-n", sw, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "u16", "0x0000",
              "0xff80", "at", "2", "flowid", "1:10"},
             "cannot shape " + what);
        it = ifb_of.emplace(way, dev).first;
        char b[64];
        std::snprintf(b, sizeof b, "%g", r.link.bandwidth_gbps);
        if (way % 2 == 0) *links += (links->empty() ? "" : ", ") + r.a + "-" + r.b + " " + b + " Gbit/s shared";
      }
      // Priority 2: a delayed pair's frames go to the delay line first (add_latency, priority 1),
      // which sends them here after their delay.
      add_ingress(k);
      must({tc_tool_, "-n", sw, "filter", "add", "dev", "h" + std::to_string(k), "parent", "ffff:", "protocol", "ip", "prio", "2", "u32", "match",
            "ip", "dst", std::string(kSubnet) + std::to_string(j + 1) + "/32", "action", "mirred", "egress", "redirect", "dev", it->second},
           "needs the mirred action (act_mirred) to emulate a shared link (" + hosts_[k] + " -> " + hosts_[j] + ")");
      dev_of_pair[{k, j}] = it->second;
    }
  return dev_of_pair;
}

void EmulatedCluster::add_latency(const plan::ClusterSpec& spec, const std::map<std::pair<size_t, size_t>, std::string>& shared_dev,
                                  std::string* links) {
  const std::string& sw = switch_ns_;
  const size_t n = hosts_.size();
  std::vector<std::vector<double>> delay_s(n, std::vector<double>(n, 0.0));
  std::vector<std::pair<size_t, size_t>> delayed;
  std::string fast;  // links that ask for latency below the threshold
  for (size_t k = 0; k < n; ++k)
    for (size_t j = 0; j < n; ++j) {
      if (j == k) continue;
      const double ms = spec.link(hosts_[k], hosts_[j]).latency_ms;
      if (ms >= kMinEmulatedLatencyMs) {
        delay_s[k][j] = ms / 1e3;
        delayed.emplace_back(k, j);
      } else if (ms > 0 && k < j) {
        fast += (fast.empty() ? "" : ", ") + hosts_[k] + "-" + hosts_[j];
      }
    }
  if (!fast.empty())
    log_info("emulator: links under " + fmt_ms(kMinEmulatedLatencyMs) + " keep the veth's own latency (tens of microseconds): " + fast);
  if (delayed.empty()) return;

  // Linux restarts a connection's window after it idled for a retransmission timeout, and a
  // gradient sum crosses its link once a step: over the 40 ms link of the two-region example a
  // 2 MB message after 3 s idle took 657 ms against 245 ms without the restart. The hosts run TCP
  // as a cluster tuned for distant links does (and as `alloy launch` advises real hosts to).
  for (size_t k = 0; k < n; ++k)
    if (!write_in_netns(std::string(kNetnsDir) + "/" + host_ns_[k], "/proc/sys/net/ipv4/tcp_slow_start_after_idle", "0"))
      log_warn("emulator: cannot turn off TCP's slow start after idle on host " + hosts_[k] + "; sums across its distant links start slow");
  const std::string dev = "dly0";
  delay_ = DelayLine::start(std::string(kNetnsDir) + "/" + sw, dev, delay_s);
  // A port of the bridge that neither learns (the hosts' addresses stay on their own ports) nor
  // is flooded: only what the filters below redirect reaches it, and what it gives back is
  // forwarded by the bridge as from any port.
  must({ip_tool_, "-n", sw, "link", "set", dev, "txqueuelen", "10000"}, "cannot configure the delay line's tap");
  must({ip_tool_, "-n", sw, "link", "set", dev, "master", "br0"}, "cannot attach the delay line to the bridge");
  must({ip_tool_, "-n", sw, "link", "set", dev, "type", "bridge_slave", "learning", "off", "flood", "off", "mcast_flood", "off"},
       "cannot keep the bridge from learning on or flooding to the delay line");
  must({ip_tool_, "-n", sw, "link", "set", dev, "up"}, "cannot bring the delay line up");
  bool tap_ingress = false;
  for (const auto& [k, j] : delayed) {
    add_ingress(k);
    const std::string dst = std::string(kSubnet) + std::to_string(j + 1) + "/32";
    const std::string what = "to delay " + hosts_[k] + " -> " + hosts_[j];
    must({tc_tool_, "-n", sw, "filter", "add", "dev", "h" + std::to_string(k), "parent", "ffff:", "protocol", "ip", "prio", "1", "u32", "match",
          "ip", "dst", dst, "action", "mirred", "egress", "redirect", "dev", dev},
         "needs the mirred action (act_mirred) " + what);
    // A shared link's frames, back from their delay, go through its IFB, which hands them to the
    // bridge on the tap's port.
    auto s = shared_dev.find({k, j});
    if (s == shared_dev.end()) continue;
    if (!tap_ingress)
      must({tc_tool_, "-n", sw, "qdisc", "add", "dev", dev, "ingress"}, "needs the ingress qdisc (sch_ingress) " + what), tap_ingress = true;
    must({tc_tool_, "-n", sw, "filter", "add", "dev", dev, "parent", "ffff:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "src",
          std::string(kSubnet) + std::to_string(k + 1) + "/32", "match", "ip", "dst", dst, "action", "mirred", "egress", "redirect", "dev",
          s->second},
         "needs the mirred action (act_mirred) " + what);
  }
  std::string list;
  for (const auto& [k, j] : delayed)
    if (k < j || delay_s[j][k] != delay_s[k][j])
      list += (list.empty() ? "" : ", ") + hosts_[k] + (delay_s[j][k] == delay_s[k][j] ? "-" : "->") + hosts_[j] + " " + fmt_ms(delay_s[k][j] * 1e3);
  *links += (links->empty() ? "" : "; ") + std::string("latency ") + list + " (one way, a delay line in the switch)";
}

void EmulatedCluster::build(const plan::ClusterSpec& spec) {
  const std::string& ip = ip_tool_;
  const std::string& sw = switch_ns_;
  must({ip, "netns", "add", sw}, "cannot create a network namespace");
  disable_ipv6(sw);
  must({ip, "-n", sw, "link", "set", "lo", "up"}, "cannot configure the switch namespace");
  must({ip, "-n", sw, "link", "add", "br0", "type", "bridge"}, "needs bridge support in the kernel (CONFIG_BRIDGE)");
  must({ip, "-n", sw, "link", "set", "br0", "up"}, "cannot bring the bridge up");
  if (opts_.limit_network) {
    // Probe on the switch's loopback, so a missing qdisc or classifier is reported by name before
    // any host exists.
    must({tc_tool_, "-n", sw, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0"},
         "needs the htb qdisc (sch_htb) to limit bandwidth");
    must({tc_tool_, "-n", sw, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst",
          std::string(kSubnet) + "254/32", "flowid", "1:1"},
         "needs the u32 tc filter (cls_u32) to limit bandwidth per destination");
    must({tc_tool_, "-n", sw, "qdisc", "del", "dev", "lo", "root"}, "cannot remove the probe qdisc");
  }

  for (size_t k = 0; k < hosts_.size(); ++k) {
    const std::string& ns = host_ns_[k];
    const std::string port = "h" + std::to_string(k);
    must({ip, "netns", "add", ns}, "cannot create a network namespace");
    disable_ipv6(ns);
    must({ip, "-n", ns, "link", "set", "lo", "up"}, "cannot configure host " + hosts_[k]);
    must({ip, "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns}, "needs veth support in the kernel (CONFIG_VETH)");
    must({ip, "-n", sw, "link", "set", port, "master", "br0"}, "cannot attach host " + hosts_[k] + " to the bridge");
    must({ip, "-n", sw, "link", "set", port, "up"}, "cannot configure host " + hosts_[k]);
    must({ip, "-n", ns, "addr", "add", std::string(kSubnet) + std::to_string(k + 1) + "/24", "dev", "eth0"}, "cannot configure host " + hosts_[k]);
    must({ip, "-n", ns, "link", "set", "eth0", "up"}, "cannot configure host " + hosts_[k]);
    if (!use_cubic(ip, ns, std::string(kSubnet) + "0/24", "eth0") && k == 0)
      log_warn("emulator: the kernel refuses TCP congestion control cubic inside a network namespace (as a route's "
               "congctl and as the namespace's default); the emulated hosts use " +
               trim(read_small("/proc/sys/net/ipv4/tcp_congestion_control")) + ", as this machine does");
  }

  bool latency_asked = false;
  std::string links;
  nlohmann::json shaping = nlohmann::json::object();  // "k>j": the htb class's arguments, for emu cut/restore
  if (opts_.limit_network && hosts_.size() > 1) {
    for (size_t k = 0; k < hosts_.size(); ++k) {
      const std::string& ns = host_ns_[k];
      must({tc_tool_, "-n", ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "0"}, "cannot shape host " + hosts_[k]);
      for (size_t j = 0; j < hosts_.size(); ++j) {
        if (j == k) continue;
        const plan::Link l = spec.link(hosts_[k], hosts_[j]);
        if (!(l.bandwidth_gbps > 0))
          throw InputError(spec.source, "link " + hosts_[k] + " -> " + hosts_[j] + ": bandwidth must be > 0");
        latency_asked = latency_asked || l.latency_ms > 0;
        // Class minors (tc reads them as hex): the pair's own, its small packets', its bulk's.
        char classid[24], small[24], bulk[24];
        std::snprintf(classid, sizeof classid, "1:%zx", j + 1);
        std::snprintf(small, sizeof small, "1:%zx", 0x4000 + j + 1);
        std::snprintf(bulk, sizeof bulk, "1:%zx", 0x8000 + j + 1);
        const std::string what = "the link " + hosts_[k] + " -> " + hosts_[j];
        add_link_classes(tc_tool_, ns, "eth0", classid, small, bulk, l.bandwidth_gbps, what);
        const std::string dst = std::string(kSubnet) + std::to_string(j + 1) + "/32";
        must({tc_tool_, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst", dst,
              "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", small},
             "cannot shape " + what);
        must({tc_tool_, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "2", "u32", "match", "ip", "dst", dst,
              "flowid", bulk},
             "cannot shape " + what);
        shaping[std::to_string(k) + ">" + std::to_string(j)] = {{"netns", ns}, {"classid", bulk}, {"small", small}};
        if (k < j) {
          char b[64];
          std::snprintf(b, sizeof b, "%g", l.bandwidth_gbps);
          links += (links.empty() ? "" : ", ") + hosts_[k] + "-" + hosts_[j] + " " + b + " Gbit/s";
        }
      }
    }
    const auto shared_dev = shape_shared_links(spec, &links);
    if (opts_.emulate_latency) add_latency(spec, shared_dev, &links);
  }

  std::string quotas;
  if (opts_.limit_cpu) {
    double total = 0;
    for (size_t d = 0; d < cgroups_.size(); ++d) {
      const std::string& g = cgroups_[d];
      if (::mkdir(g.c_str(), 0755) != 0 && errno != EEXIST)
        throw Error("emulator: cannot create cgroup " + g + ": " + std::strerror(errno));
      const double speed = spec.devices[d].speed;
      // Very slow devices need a longer period for their quota to reach the kernel's minimum.
      const long period = std::min(kMaxPeriodUs, std::max(kPeriodUs, static_cast<long>(std::ceil(kMinQuotaUs / speed))));
      long quota = std::max(kMinQuotaUs, static_cast<long>(std::lround(speed * period)));
      if (!write_small(g + "/cpu.cfs_quota_us", "-1") || !write_small(g + "/cpu.cfs_period_us", std::to_string(period)) ||
          !write_small(g + "/cpu.cfs_quota_us", std::to_string(quota)))
        throw Error("emulator: cannot set the CPU quota of " + g + ": " + std::strerror(errno));
      total += speed;
      char b[64];
      std::snprintf(b, sizeof b, "%s %.2f", device_names_[d].c_str(), quota / double(period));
      quotas += (quotas.empty() ? "" : ", ") + std::string(b);
      for (size_t k = 0; k < cpus_[d].size(); ++k) quotas += (k ? "," : " on cpu ") + std::to_string(cpus_[d][k]);
    }
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores > 0 && total > cores)
      log_warn("emulator: the devices' speeds add up to " + std::to_string(total) + " cores but this machine has " + std::to_string(cores) +
               "; when all ranks are busy they get less than their quota and relative speeds blur");
  }

  // The running cluster's hosts and link classes, for `alloy emu cut` / `restore` from another process.
  try {
    nlohmann::json st = nlohmann::json::parse(read_small(state_path(id_)));
    st["hosts"] = hosts_;
    st["shaping"] = shaping;
    st["tc"] = tc_tool_;
    write_file_atomic(state_path(id_), st.dump(2) + "\n");
  } catch (const std::exception& e) {
    log_warn(std::string("emulator: cannot record the links for emu cut/restore: ") + e.what());
  }

  std::string where;
  for (size_t k = 0; k < hosts_.size(); ++k) where += (where.empty() ? "" : ", ") + hosts_[k] + "=" + kSubnet + std::to_string(k + 1);
  log_info("emulator " + id_ + ": hosts " + where + (links.empty() ? "" : "; links " + links) + (quotas.empty() ? "" : "; CPU " + quotas));
  if (latency_asked && !(opts_.limit_network && opts_.emulate_latency))
    log_info("emulator: link latency is not emulated (asked not to); links have the veth's own latency");
}

EmulatedCluster::~EmulatedCluster() { teardown(); }

void EmulatedCluster::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
  if (delay_) {
    const DelayLine::Stats s = delay_->stats();
    char b[160];
    std::snprintf(b, sizeof b, "emulator %s: the delay line passed %llu frames (%.1f MB) and dropped %llu", id_.c_str(),
                  static_cast<unsigned long long>(s.frames), s.bytes / 1e6, static_cast<unsigned long long>(s.dropped));
    log_info(b);
    delay_.reset();  // its thread stops and its tap goes before the namespace does
  }
  std::vector<std::string> netns = host_ns_;
  if (!switch_ns_.empty()) netns.push_back(switch_ns_);
  std::vector<std::string> cgroups;
  for (const auto& g : cgroups_)
    if (!g.empty()) cgroups.push_back(g);
  try {
    auto [removed, all] = remove_resources(id_, netns, cgroups);
    (void)removed;
    if (all) ::unlink(state_path(id_).c_str());
    else log_warn("emulator " + id_ + ": some resources remain; `alloy emu clean` removes them once this process has exited");
  } catch (const std::exception& e) {
    log_warn("emulator " + id_ + ": teardown failed: " + e.what());
  }
}

int EmulatedCluster::host_index(const std::string& host) const {
  auto it = std::find(hosts_.begin(), hosts_.end(), host);
  if (it == hosts_.end()) throw Error("emulator: unknown host '" + host + "'");
  return static_cast<int>(it - hosts_.begin());
}

void EmulatedCluster::check_device(int device) const {
  if (device < 0 || device >= static_cast<int>(device_host_.size()))
    throw Error("emulator: device index " + std::to_string(device) + " out of range (cluster has " + std::to_string(device_host_.size()) + " devices)");
}

std::string EmulatedCluster::netns_of_device(int device) const {
  check_device(device);
  return host_ns_[static_cast<size_t>(device_host_[static_cast<size_t>(device)])];
}
std::string EmulatedCluster::netns_path_of_device(int device) const { return std::string(kNetnsDir) + "/" + netns_of_device(device); }
std::string EmulatedCluster::ip_of_device(int device) const {
  check_device(device);
  return kSubnet + std::to_string(device_host_[static_cast<size_t>(device)] + 1);
}
std::string EmulatedCluster::cgroup_of_device(int device) const {
  check_device(device);
  return cgroups_[static_cast<size_t>(device)];
}
std::string EmulatedCluster::netns_of_host(const std::string& host) const { return host_ns_[static_cast<size_t>(host_index(host))]; }
std::string EmulatedCluster::host_of_device(int device) const {
  check_device(device);
  return hosts_[static_cast<size_t>(device_host_[static_cast<size_t>(device)])];
}
std::string EmulatedCluster::ip_of_host(const std::string& host) const { return kSubnet + std::to_string(host_index(host) + 1); }
std::string EmulatedCluster::state_file() const { return state_path(id_); }

const std::vector<int>& EmulatedCluster::cpus_of_device(int device) const {
  check_device(device);
  return cpus_[static_cast<size_t>(device)];
}

std::vector<std::string> EmulatedCluster::command_prefix(int device) const {
  const std::string ns = netns_of_device(device);
  const std::string cg = cgroup_of_device(device);
  if (cg.empty()) return {ip_tool_, "netns", "exec", ns};
  // Names are built from validated ids, so they need no quoting beyond the single quotes.
  return {"/bin/sh", "-c", "echo $$ > '" + cg + "/cgroup.procs' && exec '" + ip_tool_ + "' netns exec " + ns + " \"$@\"", "sh"};
}

dist::RankPlacement EmulatedCluster::placement_of_device(int device) const {
  dist::RankPlacement p;
  p.netns_path = netns_path_of_device(device);
  p.cgroup_dir = cgroup_of_device(device);
  p.cpus = cpus_of_device(device);
  p.env = {{"GLOO_SOCKET_IFNAME", "eth0"},
           {"ALLOY_EMU_HOST", hosts_[static_cast<size_t>(device_host_[static_cast<size_t>(device)])]},
           {"ALLOY_EMU_DEVICE", device_names_[static_cast<size_t>(device)]}};
  return p;
}

void EmulatedCluster::place(dist::LaunchOptions& o, const std::vector<int>& rank_device) const {
  std::vector<int> map = rank_device;
  if (map.empty()) {
    if (o.nproc > static_cast<int>(device_host_.size()))
      throw InputError("--nproc", std::to_string(o.nproc) + " ranks but the emulated cluster has " + std::to_string(device_host_.size()) + " devices");
    for (int r = 0; r < o.nproc; ++r) map.push_back(r);
  }
  if (static_cast<int>(map.size()) != o.nproc)
    throw InputError("--nproc", std::to_string(o.nproc) + " ranks but " + std::to_string(map.size()) + " rank-to-device entries");
  o.placement.clear();
  o.slot_addr.clear();
  std::vector<std::string> slot_hosts;
  for (int d : map) {
    o.placement.push_back(placement_of_device(d));
    o.slot_addr.push_back(ip_of_device(d));
    slot_hosts.push_back(host_of_device(d));
    if (o.slot_names.size() < map.size()) o.slot_names.push_back(device_names_[static_cast<size_t>(d)] + " on " + host_of_device(d));
  }
  o.master_addr = ip_of_device(map[0]);
  const auto user_check = o.slot_available;
  o.slot_available = [id = id_, slot_hosts, user_check](int slot) {
    if (host_down(id, slot_hosts[static_cast<size_t>(slot)])) return false;
    return !user_check || user_check(slot);
  };
}

// ---------------------------------------------------------------------------------------------

dist::LaunchResult launch_emulated(const plan::ClusterSpec& spec, dist::LaunchOptions o, EmulatorOptions eo,
                                   const std::vector<int>& rank_device) {
  // Catch SIGINT/SIGTERM from the start: during setup they must not kill us between creating
  // resources and recording them; dist::launch installs its own handler for the run itself.
  struct sigaction sa {}, old_int {}, old_term {};
  sa.sa_handler = on_launch_signal;
  g_launch_signal = 0;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  auto restore = [&] {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  };
  std::unique_ptr<EmulatedCluster> cluster;
  dist::LaunchResult res;
  try {
    clean_leftovers();
    cluster = EmulatedCluster::create(spec, eo);
    cluster->place(o, rank_device);
    if (g_launch_signal) {
      log_warn("emulator: interrupted during setup; removing the emulated cluster");
      res.exit_code = 130;
    } else {
      res = dist::launch(o);
    }
  } catch (...) {
    if (cluster) cluster->teardown();
    restore();
    throw;
  }
  cluster->teardown();
  restore();
  return res;
}

}  // namespace alloy::emu
