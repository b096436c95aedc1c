// The emulator's operating-system helpers (system.h).
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
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/core/text.h"

namespace alloy::emu::sys {

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
  if (r.rc != 0) throw Error("emulator: " + what + ": `" + join(args, " ") + "` failed: " + (r.out.empty() ? "exit code " + std::to_string(r.rc) : r.out));
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

bool use_cubic(const std::string& ip_tool, const std::string& netns_name, const std::string& subnet, const std::string& dev) {
  // A route's congctl is not limited to net.ipv4.tcp_allowed_congestion_control, as the namespace's
  // sysctl is (a namespace may only choose from that list; this VM's holds reno and bbr), and it
  // covers both ends: each host sends over its own route to the subnet.
  if (run_tool({ip_tool, "-n", netns_name, "route", "replace", subnet, "dev", dev, "congctl", "cubic"}).rc == 0) return true;
  return write_in_netns(std::string(kNetnsDir) + "/" + netns_name, "/proc/sys/net/ipv4/tcp_congestion_control", "cubic");
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
StateLock::StateLock() {
  const std::string p = std::string(kStateDir) + "/.lock";
  fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("emulator: cannot open " + p + ": " + std::strerror(errno));
  while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
  }
}

StateLock::~StateLock() { ::close(fd_); }

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

}  // namespace alloy::emu::sys
