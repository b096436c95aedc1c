#include "alloy/dist/launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "alloy/core/error.h"
#include "alloy/core/log.h"

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
LaunchResult launch_once(const LaunchOptions& o, int attempt) {
  if (o.command.empty()) throw InputError("launch", "no command given (put it after --)");
  if (o.devices.size() > 1 && o.devices.size() != static_cast<size_t>(o.nproc))
    throw InputError("--devices", std::to_string(o.devices.size()) + " devices for " + std::to_string(o.nproc) +
                                      " ranks: give one for all ranks or one per rank");
  const int port = o.master_port > 0 ? o.master_port : free_tcp_port();
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, cores / o.nproc);

  struct Child {
    pid_t pid = -1;
    int out = -1;
    std::string buf;
    bool running = true;
    int status = 0;
  };
  std::vector<Child> kids(static_cast<size_t>(o.nproc));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  for (int r = 0; r < o.nproc; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) throw Error("launch: pipe failed");
    pid_t pid = ::fork();
    if (pid < 0) throw Error("launch: fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(fds[1], STDOUT_FILENO);
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      std::string t = std::to_string(threads);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", t.c_str(), 1);
      ::setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
      ::setenv("MKL_NUM_THREADS", t.c_str(), 1);
      ::setenv("ALLOY_RESTART", std::to_string(attempt).c_str(), 1);
      if (!o.devices.empty()) ::setenv("ALLOY_DEVICE", o.devices[o.devices.size() == 1 ? 0 : static_cast<size_t>(r)].c_str(), 1);
      if (o.prefix_output) ::setenv("ALLOY_OUTPUT_PREFIXED", "1", 1);  // the rank needs no prefix of its own
      if (static_cast<size_t>(r) < o.placement.size()) place_self(r, o.placement[static_cast<size_t>(r)]);
      std::vector<std::string> argv_s;
      for (const auto& p : o.rank_prefix) {
        std::string s = p;
        auto k = s.find("{rank}");
        if (k != std::string::npos) s.replace(k, 6, std::to_string(r));
        argv_s.push_back(s);
      }
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
    if (o.prefix_output) std::fprintf(stderr, "[rank %d] %s\n", r, line.c_str());
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
  res.rank_exit_codes.assign(static_cast<size_t>(o.nproc), -1);
  std::chrono::steady_clock::time_point failed_at{};
  bool terminated = false;
  int running = o.nproc;
  while (running > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 0; r < o.nproc; ++r)
      if (kids[static_cast<size_t>(r)].out >= 0) pfds.push_back({kids[static_cast<size_t>(r)].out, POLLIN, 0}), who.push_back(r);
    if (!pfds.empty() && ::poll(pfds.data(), pfds.size(), 100) > 0)
      for (size_t i = 0; i < pfds.size(); ++i)
        if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(who[i], false);
    if (pfds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));

    for (int r = 0; r < o.nproc; ++r) {
      Child& c = kids[static_cast<size_t>(r)];
      if (!c.running) continue;
      int st;
      if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
        c.running = false;
        c.status = st;
        --running;
        drain(r, false);
        bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        res.rank_exit_codes[static_cast<size_t>(r)] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (!ok && res.failed_rank < 0) {
          res.failed_rank = r;
          failed_at = std::chrono::steady_clock::now();
          log_error("launch: rank " + std::to_string(r) + " failed (" + describe_status(st) + "); stopping the other ranks");
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
  for (int r = 0; r < o.nproc; ++r)
    while (kids[static_cast<size_t>(r)].out >= 0) drain(r, false);
  if (res.failed_rank >= 0) res.exit_code = res.rank_exit_codes[static_cast<size_t>(res.failed_rank)] ? res.rank_exit_codes[static_cast<size_t>(res.failed_rank)] : 1;
  return res;
}
}  // namespace

LaunchResult launch(const LaunchOptions& o) {
  if (o.nproc < 1) throw InputError("--nproc", "must be >= 1");
  if (o.max_restarts < 0) throw InputError("--max-restarts", "must be >= 0");
  for (int attempt = 0;; ++attempt) {
    const auto t0 = std::chrono::steady_clock::now();
    LaunchResult r = launch_once(o, attempt);
    r.restarts = attempt;
    if (r.exit_code == 0 || attempt >= o.max_restarts || g_signal) return r;
    const double ran = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log_warn("launch: the job failed after " + std::to_string(static_cast<int>(ran)) + " s (rank " + std::to_string(r.failed_rank) +
             ", exit code " + std::to_string(r.exit_code) + "); restart " + std::to_string(attempt + 1) + " of " +
             std::to_string(o.max_restarts) + ": every rank starts again from the last complete checkpoint");
  }
}

}  // namespace alloy::dist
