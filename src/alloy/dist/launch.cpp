#include "alloy/dist/launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/core/text.h"

namespace alloy::dist {
namespace {
std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// Runs in the forked child: failures end the child with 127, like an exec failure, so the
// launcher reports the rank as failed with the reason on its output.
void place_self(int rank, const RankPlacement& p) {
  auto fail = [rank](const std::string& what, const std::string& path) {
    std::fprintf(stderr, "launch: rank %d cannot join %s %s: %s\n", rank, what.c_str(), path.c_str(), std::strerror(errno));
    ::_exit(127);
  };
  if (!p.cgroup_dir.empty()) {
    const std::string procs = p.cgroup_dir + "/cgroup.procs";
    int fd = ::open(procs.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail("cgroup", p.cgroup_dir);
    const std::string pid = std::to_string(::getpid());
    if (::write(fd, pid.data(), pid.size()) != static_cast<ssize_t>(pid.size())) fail("cgroup", p.cgroup_dir);
    ::close(fd);
  }
  if (!p.netns_path.empty()) {
    int fd = ::open(p.netns_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) fail("network namespace", p.netns_path);
    ::close(fd);
  }
  if (!p.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : p.cpus) CPU_SET(c, &set);
    if (::sched_setaffinity(0, sizeof set, &set) != 0) fail("CPUs", std::to_string(p.cpus.size()) + " pinned");
  }
  for (const auto& [k, v] : p.env) ::setenv(k.c_str(), v.c_str(), 1);
}
}  // namespace

int rank_threads(const LaunchOptions& o) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, cores / std::max(1, o.nproc));
}

bool environment_serves_ranks(int threads) {
  auto is = [](const char* name, const std::string& want) {
    const char* v = std::getenv(name);
    return v && want == v;
  };
  const std::string t = std::to_string(threads);
  return is("OMP_NUM_THREADS", t) && is("OPENBLAS_NUM_THREADS", t) && std::getenv("OMP_WAIT_POLICY");
}

void set_environment_for_ranks(int threads) {
  const std::string t = std::to_string(threads);
  ::setenv("OMP_NUM_THREADS", t.c_str(), 1);
  ::setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
  ::setenv("MKL_NUM_THREADS", t.c_str(), 1);
  if (!std::getenv("OMP_WAIT_POLICY")) ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
}

int free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

namespace {
std::string slot_label(const LaunchOptions& o, int slot) {
  std::string s = "slot " + std::to_string(slot);
  if (static_cast<size_t>(slot) < o.slot_names.size()) s += " (" + o.slot_names[static_cast<size_t>(slot)] + ")";
  return s;
}

std::string substitute(std::string s, const std::string& key, const std::string& value) {
  for (size_t k = s.find(key); k != std::string::npos; k = s.find(key, k + value.size())) s.replace(k, key.size(), value);
  return s;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

std::string device_of_slot(const LaunchOptions& o, int slot) {
  if (o.devices.empty()) return "";
  return o.devices[o.devices.size() == 1 ? 0 : static_cast<size_t>(slot)];
}

// Whether SLOT's device can run a rank now: the emulator's word, then the user's --device-check.
bool slot_up(const LaunchOptions& o, int slot) {
  if (o.slot_available && !o.slot_available(slot)) return false;
  if (o.device_check.empty()) return true;
  std::string cmd = substitute(substitute(o.device_check, "{rank}", std::to_string(slot)), "{device}", device_of_slot(o, slot));
  cmd += " >/dev/null 2>&1 </dev/null";
  const int st = std::system(cmd.c_str());
  return st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

// The slots that start the next attempt: every available one, after waiting up to the rejoin
// timeout for the missing ones. Throws when none is left.
std::vector<int> gather_members(const LaunchOptions& o, const std::vector<int>& before) {
  std::vector<int> all(static_cast<size_t>(o.nproc));
  for (int s = 0; s < o.nproc; ++s) all[static_cast<size_t>(s)] = s;
  if (o.rejoin_timeout_s <= 0) return all;
  auto missing_now = [&] {
    std::vector<int> m;
    for (int s : all)
      if (!slot_up(o, s)) m.push_back(s);
    return m;
  };
  std::vector<int> missing = missing_now();
  if (!missing.empty()) {
    std::string who;
    for (int s : missing) who += (who.empty() ? "" : ", ") + slot_label(o, s);
    log_warn("launch: " + who + (missing.size() == 1 ? " is" : " are") + " not available; waiting up to " +
             seconds(o.rejoin_timeout_s) + " (--rejoin-timeout) for " +
             (missing.size() == 1 ? "it" : "them") + " to come back");
    const auto t0 = std::chrono::steady_clock::now();
    while (!missing.empty() && !g_signal &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < o.rejoin_timeout_s) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      missing = missing_now();
    }
  }
  std::vector<int> members;
  for (int s : all)
    if (std::find(missing.begin(), missing.end(), s) == missing.end()) members.push_back(s);
  if (members.empty()) throw Error("launch: no device is available (every slot failed its check for " +
                                   seconds(o.rejoin_timeout_s) + "): nothing to continue on");
  if (members != before) {
    std::string who;
    for (int s : missing) who += (who.empty() ? "" : ", ") + slot_label(o, s);
    if (missing.empty())
      log_info("launch: every device is available: starting on all " + std::to_string(o.nproc) + " slots");
    else
      log_warn("launch: " + who + " did not come back within " + seconds(o.rejoin_timeout_s) +
               ": continuing on " + std::to_string(members.size()) + " of " + std::to_string(o.nproc) + " devices (slots " +
               join(members) + " as ranks 0-" + std::to_string(members.size() - 1) +
               "), re-planned; from the last complete checkpoint, if any");
  }
  return members;
}

LaunchResult launch_once(const LaunchOptions& o, int attempt, const std::vector<int>& members, const std::string& rejoin_file) {
  if (o.command.empty()) throw InputError("launch", "no command given (put it after --)");
  if (o.devices.size() > 1 && o.devices.size() != static_cast<size_t>(o.nproc))
    throw InputError("--devices", std::to_string(o.devices.size()) + " devices for " + std::to_string(o.nproc) +
                                      " ranks: give one for all ranks or one per rank");
  const int port = o.master_port > 0 ? o.master_port : free_tcp_port();
  const int threads = rank_threads(o);
  // Forked ranks keep what the libraries read from the launcher's environment when it started.
  const bool in_process = o.run_in_process && o.rank_prefix.empty() && environment_serves_ranks(threads);
  const bool elastic = o.rejoin_timeout_s > 0;
  const int n = static_cast<int>(members.size());
  const int first_rank = o.node_rank * o.nproc;  // this node's ranks in the job (torchrun's numbering)
  const int world = (o.nnodes - 1) * o.nproc + n;
  const std::string master_addr =
      o.slot_addr.empty() ? o.master_addr : o.slot_addr[static_cast<size_t>(members.front())];
  std::vector<int> missing;
  for (int s = 0; s < o.nproc; ++s)
    if (std::find(members.begin(), members.end(), s) == members.end()) missing.push_back(s);
  if (!rejoin_file.empty()) ::unlink(rejoin_file.c_str());

  struct Child {
    pid_t pid = -1;
    int out = -1;
    std::string buf;
    bool running = true;
    int status = 0;
  };
  std::vector<Child> kids(static_cast<size_t>(n));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  for (int r = 0; r < n; ++r) {
    const int slot = members[static_cast<size_t>(r)];
    int fds[2];
    if (::pipe(fds) != 0) throw Error("launch: pipe failed");
    std::fflush(nullptr);  // a forked rank would print the launcher's buffered output again
    pid_t pid = ::fork();
    if (pid < 0) throw Error("launch: fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      std::string t = std::to_string(threads);
      ::setenv("RANK", std::to_string(first_rank + r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", t.c_str(), 1);
      ::setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
      ::setenv("MKL_NUM_THREADS", t.c_str(), 1);
      ::setenv("ALLOY_RESTART", std::to_string(attempt).c_str(), 1);
      if (!o.devices.empty()) ::setenv("ALLOY_DEVICE", device_of_slot(o, slot).c_str(), 1);
      if (elastic) {
        ::setenv("ALLOY_MEMBERS", join(members).c_str(), 1);
        ::setenv("ALLOY_POOL_SIZE", std::to_string(o.nproc).c_str(), 1);
        ::setenv("ALLOY_REJOIN_FILE", rejoin_file.c_str(), 1);
      }
      if (o.prefix_output) ::setenv("ALLOY_OUTPUT_PREFIXED", "1", 1);  // the rank needs no prefix of its own
      if (static_cast<size_t>(slot) < o.placement.size()) place_self(r, o.placement[static_cast<size_t>(slot)]);
      if (in_process) {
        // exec would have reset the launcher's handlers: a rank must die of SIGTERM, not record it
        ::signal(SIGINT, SIG_DFL);
        ::signal(SIGTERM, SIG_DFL);
        int code = 1;
        try {
          code = o.run_in_process(o.command);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "launch: rank %d: %s\n", first_rank + r, e.what());
        }
        // The callee has closed what it opened (its objects live inside the call). Static
        // destructors are skipped: LibTorch's undo thousands of operator registrations in pages
        // shared with the launcher, copying each (0.9 s of CPU measured per rank).
        std::fflush(nullptr);
        ::_exit(code);
      }
      std::vector<std::string> argv_s;
      for (const auto& p : o.rank_prefix) argv_s.push_back(substitute(p, "{rank}", std::to_string(slot)));
      argv_s.insert(argv_s.end(), o.command.begin(), o.command.end());
      std::vector<char*> argv;
      for (auto& s : argv_s) argv.push_back(s.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(fds[1]);
    kids[static_cast<size_t>(r)].pid = pid;
    kids[static_cast<size_t>(r)].out = fds[0];
  }

  auto emit = [&](int r, const std::string& line) {
    if (o.prefix_output) std::fprintf(stderr, "[rank %d] %s\n", first_rank + r, line.c_str());
    else std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  };
  auto drain = [&](int r, bool final) {
    Child& c = kids[static_cast<size_t>(r)];
    if (c.out < 0) return;
    char tmp[4096];
    ssize_t n = ::read(c.out, tmp, sizeof tmp);
    if (n > 0) c.buf.append(tmp, static_cast<size_t>(n));
    if (n == 0 || final) {
      ::close(c.out);
      c.out = -1;
    }
    size_t nl;
    while ((nl = c.buf.find_first_of("\n\r")) != std::string::npos) {
      std::string line = c.buf.substr(0, nl);
      c.buf.erase(0, nl + 1);
      if (!line.empty()) emit(r, line);
    }
    if (c.out < 0 && !c.buf.empty()) emit(r, c.buf), c.buf.clear();
  };

  LaunchResult res;
  res.members = members;
  res.rank_exit_codes.assign(static_cast<size_t>(n), -1);
  std::chrono::steady_clock::time_point failed_at{};
  bool terminated = false;
  bool rejoin_asked = false;
  auto last_check = std::chrono::steady_clock::now();
  int running = n;
  while (running > 0) {
    // A missing device that is back is taken in at the job's next checkpoint.
    if (elastic && !missing.empty() && !rejoin_asked && res.failed_rank < 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_check).count() >= 1.0) {
      last_check = std::chrono::steady_clock::now();
      for (int s : missing)
        if (slot_up(o, s)) {
          log_info("launch: " + slot_label(o, s) + " is available again: the ranks stop at their next checkpoint and the job "
                   "starts again with it, re-planned");
          write_file_atomic(rejoin_file, std::to_string(s) + "\n");
          rejoin_asked = true;
          break;
        }
    }
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 0; r < n; ++r)
      if (kids[static_cast<size_t>(r)].out >= 0) pfds.push_back({kids[static_cast<size_t>(r)].out, POLLIN, 0}), who.push_back(r);
    if (!pfds.empty() && ::poll(pfds.data(), pfds.size(), 100) > 0)
      for (size_t i = 0; i < pfds.size(); ++i)
        if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(who[i], false);
    if (pfds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));

    for (int r = 0; r < n; ++r) {
      Child& c = kids[static_cast<size_t>(r)];
      if (!c.running) continue;
      int st;
      if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
        c.running = false;
        c.status = st;
        --running;
        drain(r, false);
        // A rank that stopped for the rejoin the launcher asked for has not failed.
        bool ok = WIFEXITED(st) && (WEXITSTATUS(st) == 0 || (rejoin_asked && WEXITSTATUS(st) == kExitRejoin));
        res.rank_exit_codes[static_cast<size_t>(r)] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (!ok && res.failed_rank < 0) {
          res.failed_rank = first_rank + r;
          failed_at = std::chrono::steady_clock::now();
          log_error("launch: rank " + std::to_string(first_rank + r) + " failed (" + describe_status(st) + "); stopping the other ranks" +
                    (o.nnodes > 1 ? " of this node" : ""));
        }
      }
    }
    if (g_signal && !terminated) {
      log_warn("launch: interrupted; stopping all ranks");
      for (auto& c : kids)
        if (c.running) ::kill(-c.pid, SIGTERM);
      terminated = true;
      failed_at = std::chrono::steady_clock::now();
      if (res.failed_rank < 0) res.exit_code = 130;
    }
    if (res.failed_rank >= 0 && !terminated &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count() > o.grace_s) {
      for (auto& c : kids)
        if (c.running) ::kill(-c.pid, SIGTERM);
      terminated = true;
      failed_at = std::chrono::steady_clock::now();
    }
    if (terminated && std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count() > 5.0)
      for (auto& c : kids)
        if (c.running) ::kill(-c.pid, SIGKILL);
  }
  for (int r = 0; r < n; ++r)
    while (kids[static_cast<size_t>(r)].out >= 0) drain(r, false);
  res.stopped_for_rejoin = rejoin_asked && res.failed_rank < 0 &&
                           std::all_of(res.rank_exit_codes.begin(), res.rank_exit_codes.end(), [](int c) { return c == kExitRejoin; });
  if (res.failed_rank >= 0) {
    const int code = res.rank_exit_codes[static_cast<size_t>(res.failed_rank - first_rank)];
    res.exit_code = code ? code : 1;
  }
  return res;
}
}  // namespace

LaunchResult launch(const LaunchOptions& o) {
  if (o.nproc < 1) throw InputError("--nproc", "must be >= 1");
  if (o.nnodes < 1) throw InputError("--nnodes", "must be >= 1, got " + std::to_string(o.nnodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw InputError("--node-rank", std::to_string(o.node_rank) + " is outside 0.." + std::to_string(o.nnodes - 1) + " (--nnodes " +
                                        std::to_string(o.nnodes) + ")");
  if (o.nnodes > 1) {
    if (o.master_port <= 0) throw InputError("--master-port", "must be given, the same on every node, with --nnodes " + std::to_string(o.nnodes));
    if (o.max_restarts > 0 || o.rejoin_timeout_s > 0)
      throw InputError("--nnodes", "restarts and elasticity need one launcher that sees every rank; with several nodes use the "
                                   "scheduler's restarts (ranks resume through ALLOY_RESTART, TORCHELASTIC_RESTART_COUNT or "
                                   "SLURM_RESTART_COUNT)");
    if (!o.slot_addr.empty()) throw InputError("--nnodes", "is not for an emulated cluster (--emulate runs every rank here)");
  }
  if (o.max_restarts < 0) throw InputError("--max-restarts", "must be >= 0");
  if (o.rejoin_timeout_s < 0) throw InputError("--rejoin-timeout", "must be >= 0 seconds");
  if (!o.slot_addr.empty() && o.slot_addr.size() != static_cast<size_t>(o.nproc))
    throw Error("launch: " + std::to_string(o.slot_addr.size()) + " slot addresses for " + std::to_string(o.nproc) + " ranks");
  // The rejoin request travels as a file: every rank of this machine sees it, and a command that
  // is not `alloy train` is not disturbed (a signal would kill it).
  std::string rejoin_dir, rejoin_file;
  if (o.rejoin_timeout_s > 0) {
    char tmpl[] = "/tmp/alloy-launch-XXXXXX";
    if (!::mkdtemp(tmpl)) throw Error(std::string("launch: cannot make a directory under /tmp: ") + std::strerror(errno));
    rejoin_dir = tmpl;
    rejoin_file = rejoin_dir + "/rejoin";
  }
  struct Cleanup {
    std::string dir, file;
    ~Cleanup() {
      if (dir.empty()) return;
      ::unlink(file.c_str());
      ::rmdir(dir.c_str());
    }
  } cleanup{rejoin_dir, rejoin_file};
  std::vector<int> members;
  for (int s = 0; s < o.nproc; ++s) members.push_back(s);
  int failures = 0, rejoins = 0;
  for (int attempt = 0;; ++attempt) {
    members = gather_members(o, members);
    if (g_signal) {
      LaunchResult r;
      r.exit_code = 130;
      return r;
    }
    const auto t0 = std::chrono::steady_clock::now();
    LaunchResult r = launch_once(o, attempt, members, rejoin_file);
    r.restarts = failures;
    r.rejoins = rejoins;
    if (r.stopped_for_rejoin && !g_signal) {
      ++rejoins;
      log_info("launch: every rank stopped at its checkpoint; starting again with the device that came back");
      continue;
    }
    if (r.exit_code == 0 || failures >= o.max_restarts || g_signal) return r;
    ++failures;
    const double ran = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log_warn("launch: the job failed after " + std::to_string(static_cast<int>(ran)) + " s (rank " + std::to_string(r.failed_rank) +
             ", exit code " + std::to_string(r.exit_code) + "); restart " + std::to_string(failures) + " of " +
             std::to_string(o.max_restarts) + ": every rank starts again from the last complete checkpoint");
  }
}

}  // namespace alloy::dist
