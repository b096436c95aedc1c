#include "alloy/emu/emulator.h"

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
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"

namespace alloy::emu {
namespace {

constexpr const char* kPrefix = "alloy-emu-";
constexpr const char* kStateDir = "/run/alloy-emu";
constexpr const char* kNetnsDir = "/run/netns";
constexpr const char* kCgroupRoot = "/sys/fs/cgroup/cpu";
constexpr const char* kSubnet = "10.213.0.";  // private; exists only inside our namespaces
// A short CFS period makes a throttled rank slow evenly instead of in bursts: with the kernel's
// default 100 ms a quarter-core rank runs 25 ms at full speed and then stalls 75 ms, so a rank that
// idles part of each period (a pipeline stage waiting for activations) is faster than its quota,
// and a profile of short calls sees bursts. Measured on the 2-core VM with the 3-device demo pool,
// a 0.4-core pipeline stage doing 15-30 ms calls between waits ran them 28-30% slower than the
// same calls back to back in the profile with 10 ms periods, and as fast (813 vs 815 ms per step
// predicted) with 5 ms periods. 5 ms still leaves a 0.2-core device the kernel's 1 ms minimum.
constexpr long kPeriodUs = 5000;
constexpr long kMaxPeriodUs = 1000000;  // the kernel's upper bound
constexpr long kMinQuotaUs = 1000;      // the kernel refuses smaller quotas
constexpr size_t kMaxHosts = 254;   // .1 .. .254 of the /24

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

std::string find_tool(const std::string& name) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream ss(path);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty()) dirs.push_back(d);
  }
  // sbin is often missing from PATH (sudo, cron, IDEs) although the tools are installed there.
  for (const char* d : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) dirs.push_back(d);
  for (const auto& d : dirs) {
    std::string p = d + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

struct ToolResult {
  int rc = -1;
  std::string out;  // stdout and stderr together
};

ToolResult run_tool(const std::vector<std::string>& args) {
  std::vector<std::string> a = args;
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw Error("emulator: pipe failed: " + std::string(std::strerror(errno)));
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error("emulator: fork failed: " + std::string(std::strerror(errno)));
  }
  if (pid == 0) {
    // Own process group: a Ctrl-C on the terminal must not kill the `ip`/`tc` that a teardown runs.
    ::setpgid(0, 0);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  ToolResult r;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) r.out.append(buf, static_cast<size_t>(n));
    else if (n == 0 || errno != EINTR) break;
  }
  ::close(fds[0]);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  r.out = trim(r.out);
  return r;
}

// Runs a tool and throws naming WHAT the emulator needed when it fails.
void must(const std::vector<std::string>& args, const std::string& what) {
  ToolResult r = run_tool(args);
  if (r.rc != 0) throw Error("emulator: " + what + ": `" + join(args) + "` failed: " + (r.out.empty() ? "exit code " + std::to_string(r.rc) : r.out));
}

std::string read_small(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool write_small(const std::string& path, const std::string& value) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
  ::close(fd);
  return ok;
}

// Writes VALUE to FILE as seen from inside network namespace NETNS_PATH (/proc/sys/net is per
// namespace), from a short-lived child so this process's threads keep their namespace.
bool write_in_netns(const std::string& netns_path, const std::string& file, const std::string& value) {
  const char* ns = netns_path.c_str();
  const char* f = file.c_str();
  pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    int nfd = ::open(ns, O_RDONLY | O_CLOEXEC);
    if (nfd < 0 || ::setns(nfd, CLONE_NEWNET) != 0) ::_exit(1);
    int fd = ::open(f, O_WRONLY | O_CLOEXEC);
    if (fd < 0) ::_exit(2);
    ::_exit(::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size()) ? 0 : 3);
  }
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

// No IPv6 inside the emulated network: the shaping filters match IPv4, and a rank that picked its
// interface's IPv6 link-local address (Gloo takes the first address of GLOO_SOCKET_IFNAME) would
// bypass them. Also silences router solicitations and DAD. Kernels without IPv6 lack the files,
// which is the same outcome.
void disable_ipv6(const std::string& netns_name) {
  const std::string ns = std::string(kNetnsDir) + "/" + netns_name;
  for (const char* f : {"/proc/sys/net/ipv6/conf/all/disable_ipv6", "/proc/sys/net/ipv6/conf/default/disable_ipv6"})
    if (::access(f, F_OK) == 0 && !write_in_netns(ns, f, "1"))
      throw Error("emulator: cannot disable IPv6 in network namespace " + netns_name + " (" + f + ")");
}

// Start time of PID in clock ticks since boot (field 22 of /proc/PID/stat); nullopt when the
// process is gone or a zombie. Together with the pid it names a process even after pid reuse.
std::optional<unsigned long long> start_time_of(pid_t pid) {
  std::string s = read_small("/proc/" + std::to_string(pid) + "/stat");
  auto close = s.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  std::istringstream ss(s.substr(close + 1));
  std::vector<std::string> f;
  std::string t;
  while (ss >> t) f.push_back(t);
  // f[0] is field 3 (state), so field 22 is f[19].
  if (f.size() < 20 || f[0] == "Z" || f[0] == "X") return std::nullopt;
  return std::strtoull(f[19].c_str(), nullptr, 10);
}

bool owner_alive(pid_t pid, unsigned long long start) {
  if (pid <= 0) return false;
  auto st = start_time_of(pid);
  return st && *st == start;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// "alloy-emu-<id>-<suffix>" -> id; "" if NAME is not one of ours.
std::string id_of_resource(const std::string& name) {
  const std::string prefix = kPrefix;
  if (name.rfind(prefix, 0) != 0) return "";
  auto dash = name.rfind('-');
  if (dash == std::string::npos || dash < prefix.size() + 1) return "";
  return name.substr(prefix.size(), dash - prefix.size());
}

// Exclusive lock on the state directory, held while ids are claimed or judged dead.
class StateLock {
 public:
  StateLock() {
    const std::string p = std::string(kStateDir) + "/.lock";
    fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw Error("emulator: cannot open " + p + ": " + std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
    }
  }
  ~StateLock() { ::close(fd_); }
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

 private:
  int fd_ = -1;
};

std::string state_path(const std::string& id) { return std::string(kStateDir) + "/" + id + ".json"; }

// Kills everything in cgroup DIR and removes it; false if it could not be removed.
bool remove_cgroup(const std::string& dir) {
  struct stat sb {};
  if (::stat(dir.c_str(), &sb) != 0) return true;
  const pid_t self = ::getpid();
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::istringstream procs(read_small(dir + "/cgroup.procs"));
    pid_t p;
    while (procs >> p)
      if (p != self) ::kill(p, SIGKILL);
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return true;
    if (errno != EBUSY) break;
    // Killed tasks leave the group asynchronously.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  log_warn("emulator: cannot remove cgroup " + dir + ": " + std::strerror(errno));
  return false;
}

// SIGKILLs every process (but this one) whose network namespace is NS (a stat of /run/netns/NAME).
int kill_netns_processes(const struct stat& ns) {
  const pid_t self = ::getpid();
  int killed = 0;
  for (const auto& e : list_dir("/proc")) {
    if (e.find_first_not_of("0123456789") != std::string::npos) continue;
    pid_t p = static_cast<pid_t>(std::atoi(e.c_str()));
    struct stat ps {};
    if (p == self || ::stat(("/proc/" + e + "/ns/net").c_str(), &ps) != 0) continue;
    if (ps.st_dev == ns.st_dev && ps.st_ino == ns.st_ino && ::kill(p, SIGKILL) == 0) ++killed;
  }
  return killed;
}

// Kills the processes inside network namespace NAME (their rank launcher is gone, or they outlived
// their rank) and removes its /run/netns entry the way `ip netns del` does; the kernel frees the
// namespace, and the veths and bridge in it, once nothing holds it.
bool remove_netns(const std::string& name) {
  const std::string path = std::string(kNetnsDir) + "/" + name;
  struct stat ns {};
  if (::stat(path.c_str(), &ns) != 0) return true;
  kill_netns_processes(ns);
  ::umount2(path.c_str(), MNT_DETACH);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    log_warn("emulator: cannot remove network namespace " + name + ": " + std::strerror(errno));
    return false;
  }
  return true;
}

// Removes all resources of ID (those listed plus any found under our prefix); returns how many
// were removed and whether everything is gone.
std::pair<int, bool> remove_resources(const std::string& id, std::vector<std::string> netns, std::vector<std::string> cgroups) {
  const std::string mine = kPrefix + id + "-";
  for (const auto& n : list_dir(kNetnsDir))
    if (n.rfind(mine, 0) == 0 && id_of_resource(n) == id) netns.push_back(n);
  for (const auto& n : list_dir(kCgroupRoot))
    if (n.rfind(mine, 0) == 0 && id_of_resource(n) == id) cgroups.push_back(std::string(kCgroupRoot) + "/" + n);
  std::sort(netns.begin(), netns.end());
  netns.erase(std::unique(netns.begin(), netns.end()), netns.end());
  std::sort(cgroups.begin(), cgroups.end());
  cgroups.erase(std::unique(cgroups.begin(), cgroups.end()), cgroups.end());
  // The switch last: while hosts exist their veth peers still sit on its bridge.
  std::stable_partition(netns.begin(), netns.end(), [](const std::string& n) { return n.size() < 3 || n.compare(n.size() - 3, 3, "-sw") != 0; });

  int removed = 0;
  bool all = true;
  for (const auto& c : cgroups) {
    struct stat sb {};
    bool existed = ::stat(c.c_str(), &sb) == 0;
    if (remove_cgroup(c)) removed += existed ? 1 : 0;
    else all = false;
  }
  for (const auto& n : netns) {
    struct stat sb {};
    bool existed = ::stat((std::string(kNetnsDir) + "/" + n).c_str(), &sb) == 0;
    if (remove_netns(n)) removed += existed ? 1 : 0;
    else all = false;
  }
  return {removed, all};
}

std::string rate_str(double gbps) {
  long long bits = std::llround(gbps * 1e9);
  return std::to_string(std::max(bits, 8LL)) + "bit";
}

std::atomic<int> g_launch_signal{0};
void on_launch_signal(int sig) { g_launch_signal = sig; }

int g_clusters_in_process = 0;

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
        // Bursts of ~2 ms of traffic keep the long-run rate at 95-96% of the limit (TCP goodput
        // over 1514-byte frames is at most 95.6%) without letting small messages jump the link;
        // htb lets a GSO super-packet through a smaller bucket by going into debt, so low rates
        // need no 64 KiB bucket. An explicit quantum keeps the kernel from warning about it.
        const double bytes_per_s = l.bandwidth_gbps * 1e9 / 8;
        const long long burst = std::max(3200LL, std::llround(bytes_per_s * 0.002));
        const long long quantum = std::clamp(burst, 1600LL, 200000LL);
        char classid[24];
        std::snprintf(classid, sizeof classid, "1:%zx", j + 1);  // tc reads class minors as hex
        must({tc_tool_, "-n", ns, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, "htb", "rate", rate_str(l.bandwidth_gbps),
              "ceil", rate_str(l.bandwidth_gbps), "burst", std::to_string(burst), "cburst", std::to_string(burst), "quantum", std::to_string(quantum)},
             "cannot shape the link " + hosts_[k] + " -> " + hosts_[j]);
        shaping[std::to_string(k) + ">" + std::to_string(j)] = {
            {"netns", ns},       {"classid", classid},    {"rate", rate_str(l.bandwidth_gbps)},
            {"burst", std::to_string(burst)}, {"quantum", std::to_string(quantum)}};
        must({tc_tool_, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst",
              std::string(kSubnet) + std::to_string(j + 1) + "/32", "flowid", classid},
             "cannot shape the link " + hosts_[k] + " -> " + hosts_[j]);
        if (k < j) {
          char b[64];
          std::snprintf(b, sizeof b, "%g", l.bandwidth_gbps);
          links += (links.empty() ? "" : ", ") + hosts_[k] + "-" + hosts_[j] + " " + b + " Gbit/s";
        }
      }
    }
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
  if (latency_asked)
    log_info("emulator: link latency is not emulated (no netem here); links have the veth's own latency");
}

EmulatedCluster::~EmulatedCluster() { teardown(); }

void EmulatedCluster::teardown() {
  if (torn_down_) return;
  torn_down_ = true;
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

namespace {
// The live emulated cluster: the one named, or the only one running. Returns its id.
std::string live_cluster(const std::string& id_in) {
  std::vector<std::string> live;
  for (const auto& f : list_dir(kStateDir)) {
    if (f.size() < 6 || f.compare(f.size() - 5, 5, ".json") != 0) continue;
    const std::string id = f.substr(0, f.size() - 5);
    if (!id_in.empty() && id != id_in) continue;
    try {
      auto j = nlohmann::json::parse(read_small(state_path(id)));
      if (owner_alive(j.value("pid", 0), j.value("start_time", 0ULL))) live.push_back(id);
    } catch (const std::exception&) {
    }
  }
  if (live.empty()) throw InputError(id_in.empty() ? "emu" : "--id", "no emulated cluster is running" + (id_in.empty() ? std::string() : " with id " + id_in));
  if (live.size() > 1) {
    std::string ids;
    for (const auto& i : live) ids += (ids.empty() ? "" : ", ") + i;
    throw InputError("--id", "several emulated clusters are running (" + ids + "): say which");
  }
  return live[0];
}
}  // namespace

std::string set_link(const std::string& host_a, const std::string& host_b, bool cut, const std::string& id_in) {
  if (::geteuid() != 0) throw Error("emu " + std::string(cut ? "cut" : "restore") + " needs root (it changes tc classes in the cluster's namespaces)");
  const std::vector<std::string> live{live_cluster(id_in)};
  const auto st = nlohmann::json::parse(read_small(state_path(live[0])));
  if (!st.contains("hosts") || !st.contains("shaping") || st["shaping"].empty())
    throw InputError("emu", "cluster " + live[0] + " has no shaped links to cut (launched with --no-net-limit, or one host)");
  const auto hosts = st["hosts"].get<std::vector<std::string>>();
  auto index = [&](const std::string& h) {
    auto it = std::find(hosts.begin(), hosts.end(), h);
    if (it == hosts.end()) {
      std::string known;
      for (const auto& x : hosts) known += (known.empty() ? "" : ", ") + x;
      throw InputError("emu", "no host '" + h + "' in cluster " + live[0] + " (hosts: " + known + ")");
    }
    return static_cast<size_t>(it - hosts.begin());
  };
  const size_t a = index(host_a), b = index(host_b);
  if (a == b) throw InputError("emu", "a link joins two different hosts");
  const std::string tc = st.value("tc", std::string("tc"));
  // A cut moves the pair's traffic to a class whose queue drops every packet (nothing gets
  // through; TCP retransmits as over a dead link); a restore points it back at its own class, which never ran
  // into the debt a rate change would leave. Filters are rebuilt per namespace from the recorded
  // classes and the set of cut pairs.
  std::set<std::string> cuts;
  if (st.contains("cut"))
    for (const auto& c : st["cut"]) cuts.insert(c.get<std::string>());
  for (const auto& key : {std::to_string(a) + ">" + std::to_string(b), std::to_string(b) + ">" + std::to_string(a)}) {
    if (cut) cuts.insert(key);
    else cuts.erase(key);
  }
  const char* kCutClass = "1:fff";
  for (const size_t k : {a, b}) {
    const std::string ns = st["shaping"].at(std::to_string(k) + ">" + std::to_string(k == a ? b : a))["netns"].get<std::string>();
    must({tc, "-n", ns, "class", "replace", "dev", "eth0", "parent", "1:", "classid", kCutClass, "htb", "rate", "8bit", "ceil", "8bit"},
         "cannot make the cut class in host " + hosts[k]);
    // Its queue holds nothing: every packet is dropped (htb's burst would let small ones through).
    must({tc, "-n", ns, "qdisc", "replace", "dev", "eth0", "parent", kCutClass, "handle", "fff:", "pfifo", "limit", "0"},
         "cannot make the cut class in host " + hosts[k]);
    must({tc, "-n", ns, "filter", "del", "dev", "eth0", "parent", "1:"}, "cannot change the links of host " + hosts[k]);
    for (const auto& [key, c] : st["shaping"].items()) {
      if (c["netns"].get<std::string>() != ns) continue;
      const size_t j = std::stoul(key.substr(key.find('>') + 1));
      must({tc, "-n", ns, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst",
            std::string(kSubnet) + std::to_string(j + 1) + "/32", "flowid", cuts.count(key) ? kCutClass : c["classid"].get<std::string>()},
           std::string("cannot ") + (cut ? "cut" : "restore") + " the link " + hosts[k] + " -> " + hosts[j]);
    }
  }
  nlohmann::json updated = st;
  updated["cut"] = std::vector<std::string>(cuts.begin(), cuts.end());
  write_file_atomic(state_path(live[0]), updated.dump(2) + "\n");
  return live[0];
}

std::string set_host(const std::string& host, bool down, const std::string& id_in) {
  if (::geteuid() != 0) throw Error("emu " + std::string(down ? "down" : "up") + " needs root (it changes the cluster's namespaces)");
  const std::string id = live_cluster(id_in);
  auto st = nlohmann::json::parse(read_small(state_path(id)));
  if (!st.contains("hosts")) throw InputError("emu", "cluster " + id + " records no hosts");
  const auto hosts = st["hosts"].get<std::vector<std::string>>();
  auto it = std::find(hosts.begin(), hosts.end(), host);
  if (it == hosts.end()) {
    std::string known;
    for (const auto& x : hosts) known += (known.empty() ? "" : ", ") + x;
    throw InputError("emu", "no host '" + host + "' in cluster " + id + " (hosts: " + known + ")");
  }
  // Down: unreachable first, so the ranks elsewhere see a dead peer rather than a goodbye.
  for (const auto& other : hosts)
    if (other != host) set_link(host, other, down, id);
  st = nlohmann::json::parse(read_small(state_path(id)));
  std::set<std::string> downs;
  if (st.contains("down"))
    for (const auto& d : st["down"]) downs.insert(d.get<std::string>());
  if (down) downs.insert(host);
  else downs.erase(host);
  st["down"] = std::vector<std::string>(downs.begin(), downs.end());
  write_file_atomic(state_path(id), st.dump(2) + "\n");
  if (down) {
    const std::string ns = std::string(kNetnsDir) + "/" + kPrefix + id + "-h" + std::to_string(it - hosts.begin());
    struct stat sb {};
    if (::stat(ns.c_str(), &sb) == 0) {
      const int n = kill_netns_processes(sb);
      log_info("emulator " + id + ": host " + host + " is down (" + std::to_string(n) + " processes on it killed)");
    }
  }
  return id;
}

bool host_down(const std::string& id, const std::string& host) {
  try {
    const auto st = nlohmann::json::parse(read_small(state_path(id)));
    if (!st.contains("down")) return false;
    for (const auto& d : st["down"])
      if (d.get<std::string>() == host) return true;
  } catch (const std::exception&) {
  }
  return false;
}

int clean_leftovers() {
  if (::geteuid() != 0) throw Error("emulator: cleaning needs root (namespaces and cgroups are root's); running as uid " + std::to_string(::geteuid()));
  ::mkdir(kStateDir, 0755);
  StateLock lock;
  int removed = 0;
  std::set<std::string> claimed;  // ids whose state file we read, live or just cleaned
  for (const auto& f : list_dir(kStateDir)) {
    const std::string path = std::string(kStateDir) + "/" + f;
    auto tmp = f.find(".tmp.");
    if (tmp != std::string::npos) {
      // A state file's write that never finished; its writer's pid ends the name.
      pid_t p = static_cast<pid_t>(std::atoi(f.c_str() + tmp + 5));
      if (!start_time_of(p)) ::unlink(path.c_str());
      continue;
    }
    if (f.size() < 6 || f.compare(f.size() - 5, 5, ".json") != 0) continue;
    const std::string id = f.substr(0, f.size() - 5);
    claimed.insert(id);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_small(path));
    } catch (const nlohmann::json::exception&) {
      j = nlohmann::json::object();  // unreadable: nobody can prove ownership, so it counts as dead
    }
    if (owner_alive(j.value("pid", 0), j.value("start_time", 0ULL))) continue;
    std::vector<std::string> netns, cgroups;
    if (j.contains("netns") && j["netns"].is_array())
      for (const auto& n : j["netns"]) netns.push_back(n.get<std::string>());
    if (j.contains("cgroups") && j["cgroups"].is_array())
      for (const auto& g : j["cgroups"]) cgroups.push_back(g.get<std::string>());
    auto [n, all] = remove_resources(id, netns, cgroups);
    removed += n;
    if (all) ::unlink(path.c_str());
    log_info("emulator: removed " + std::to_string(n) + " leftovers of " + id + " (owner pid " + std::to_string(j.value("pid", 0)) + " is gone)");
  }

  // Resources no state file claims: a crash between creating them and recording them cannot
  // happen (create() records first), so these come from a lost /run/alloy-emu. The lock keeps
  // launches from claiming ids meanwhile; the file is checked again all the same.
  std::set<std::string> orphan_ids;
  for (const auto& n : list_dir(kNetnsDir))
    if (auto id = id_of_resource(n); !id.empty() && !claimed.count(id)) orphan_ids.insert(id);
  for (const auto& n : list_dir(kCgroupRoot))
    if (auto id = id_of_resource(n); !id.empty() && !claimed.count(id)) orphan_ids.insert(id);
  for (const auto& id : orphan_ids) {
    if (file_exists(state_path(id))) continue;
    auto [n, all] = remove_resources(id, {}, {});
    (void)all;
    removed += n;
    log_info("emulator: removed " + std::to_string(n) + " leftovers of " + id + " (no owner recorded)");
  }
  return removed;
}

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
