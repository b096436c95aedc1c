#pragma once
// `alloy launch`: start N local ranks of a command, each with torchrun-style variables (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and its own share of the cores, prefix their
// output with the rank, and on the first failure stop the others and report which rank failed.
#include <string>
#include <utility>
#include <vector>

namespace alloy::dist {

// Where one rank runs, for the cluster emulator (alloy/emu): applied in the child between fork and
// exec, so the rank and everything it starts inherit it and no wrapper process sits in between.
struct RankPlacement {
  std::string netns_path;  // network namespace to join (setns), e.g. /run/netns/NAME; empty = the launcher's
  std::string cgroup_dir;  // cgroup v1 directory to join (pid written to its cgroup.procs); empty = the launcher's
  std::vector<std::pair<std::string, std::string>> env;  // extra variables, set after (and over) the standard ones
  std::vector<int> cpus;   // CPUs the rank may run on (sched_setaffinity); empty = the launcher's
};

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;        // 0 = pick a free port
  int threads_per_rank = 0;   // 0 = cores / nproc, at least 1
  // Device of each rank (cpu, cuda, cuda:N), passed as ALLOY_DEVICE, which overrides train.device:
  // one entry for all ranks or one per rank. Empty: every rank uses its config's train.device.
  std::vector<std::string> devices;
  double grace_s = 5.0;       // after a failure, time the others get to report before SIGTERM
  std::vector<std::string> command;
  // Per-rank command prefix (e.g. the emulator's `ip netns exec` wrapper); {rank} is substituted.
  std::vector<std::string> rank_prefix;
  bool prefix_output = true;
  // By rank; ranks past its end run unplaced. A rank that cannot be placed exits with code 127
  // after saying why.
  std::vector<RankPlacement> placement;
  // After a failure (every rank stopped), start the whole job again up to this many times. Each
  // attempt's ranks get ALLOY_RESTART=<attempt> (0 the first time), from which `alloy train`
  // resumes its run directory's last complete checkpoint.
  int max_restarts = 0;
};

struct LaunchResult {
  int exit_code = 0;      // 0 when every rank succeeded
  int failed_rank = -1;   // first rank that failed (in the last attempt)
  int restarts = 0;       // attempts after the first
  std::vector<int> rank_exit_codes;
};

LaunchResult launch(const LaunchOptions& o);
int free_tcp_port();

}  // namespace alloy::dist
