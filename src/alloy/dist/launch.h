#pragma once
// `alloy launch`: start N local ranks of a command, each with torchrun-style variables (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and its own share of the cores, prefix their
// output with the rank, and on the first failure stop the others and report which rank failed.
#include <functional>
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

// Exit code with which every rank of an elastic job stops at a checkpoint when the launcher asks
// (a device came back): the launcher starts the job again with it, without counting a failure.
constexpr int kExitRejoin = 75;

struct LaunchOptions {
  int nproc = 1;              // ranks on this machine
  // Several machines, torchrun's --nnodes / --node_rank: the same command on each, node K's ranks
  // numbered K x nproc .. (K + 1) x nproc - 1 of nnodes x nproc, meeting at master_addr:master_port
  // (the same explicit port on every node). Each node's launcher watches its own ranks only: a rank
  // that fails on another node reaches these through the collectives' timeouts. Not with restarts
  // or elasticity, which need one launcher to see every rank.
  int nnodes = 1;
  int node_rank = 0;
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

  // Elasticity (rejoin_timeout_s > 0). The job's N "slots" (rank numbers as first launched; under
  // emulation, the cluster's devices) may come and go. Before every start the launcher asks which
  // slots are available (slot_available and device_check must both say yes) and waits up to
  // rejoin_timeout_s for missing ones; then it starts the available slots as ranks 0..n-1 (in slot
  // order) with ALLOY_MEMBERS=<their slots, comma-separated>, ALLOY_POOL_SIZE=N and
  // ALLOY_REJOIN_FILE. While a slot is missing, the launcher keeps checking it; once it is back the
  // launcher creates the rejoin file, the ranks stop together at their next checkpoint with
  // kExitRejoin, and the job starts again with the slot. `alloy train` re-plans (--plan auto) onto
  // the members and resumes the last complete checkpoint, so the global batch and the math stay.
  double rejoin_timeout_s = 0;
  // Shell command run per slot ({rank} = the slot, {device} = its --devices entry); exit 0 = the
  // slot's device is there. Empty = only slot_available decides.
  std::string device_check;
  std::function<bool(int slot)> slot_available;  // e.g. the emulator: the slot's host is not down
  std::vector<std::string> slot_names;           // for messages: the cluster's device names by slot
  // MASTER_ADDR by slot (the emulator: each device's host address), so the store follows rank 0
  // when the first slot is gone. Empty = master_addr for every membership.
  std::vector<std::string> slot_addr;
  // When set (and there is no rank_prefix), each rank runs by calling this in the launcher's forked
  // child with the command's arguments, once its output, environment and placement are set, and
  // exits with what it returns, instead of exec'ing the command. For a command that is this very
  // program: the rank starts with the libraries as the launcher loaded and initialized them
  // (LibTorch alone: about 0.75 s of CPU per rank). What the environment set at load time (thread
  // counts) the callee must apply itself.
  std::function<int(const std::vector<std::string>& argv)> run_in_process;
};

struct LaunchResult {
  int exit_code = 0;      // 0 when every rank succeeded
  int failed_rank = -1;   // first rank that failed (in the last attempt), numbered in the job
  // By this node's ranks (local rank order).
  int restarts = 0;       // attempts after the first that followed a failure
  int rejoins = 0;        // starts that took a device back (not failures)
  std::vector<int> members;  // slots of the last attempt's ranks
  std::vector<int> rank_exit_codes;
  bool stopped_for_rejoin = false;  // every rank stopped at a checkpoint to take a device back
};

LaunchResult launch(const LaunchOptions& o);
// Intra-op threads each rank gets: threads_per_rank, or the cores shared among nproc (at least 1).
int rank_threads(const LaunchOptions& o);
// Whether this process's environment gives the thread settings a rank with THREADS threads starts
// with (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, OMP_WAIT_POLICY set), as the libraries read them
// when they were loaded: only then may ranks run in forked copies of it (run_in_process).
bool environment_serves_ranks(int threads);
// Sets that environment (for a re-exec of the launcher).
void set_environment_for_ranks(int threads);
int free_tcp_port();

}  // namespace alloy::dist
