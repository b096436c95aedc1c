#pragma once
// Where a rank learns who it is and where the rendezvous store lives. Sources, first match wins:
//   1. flags: --rank --world-size --master-addr --master-port, or PTAFM's --dist-url tcp://HOST:PORT
//   2. torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK)
//   3. SLURM's: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the first host of SLURM_JOB_NODELIST
//   4. MPI launchers' (mpirun, horovodrun, as SAFusion's scripts start their ranks): Open MPI's
//      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK (_LOCAL_SIZE), or MPICH/Hydra's PMI_RANK, PMI_SIZE,
//      MPI_LOCALRANKID; the store at MASTER_ADDR:MASTER_PORT (pass them with mpirun -x), which may
//      default to this machine only when the launcher says every rank is on it
//   5. none: a single process (rank 0 of 1)
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace alloy::dist {

struct RendezvousFlags {
  int rank = -1;
  int world_size = -1;
  std::string master_addr;
  int master_port = -1;
  std::string dist_url;  // tcp://HOST:PORT
};

struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // "flags", "torchrun", "slurm", "mpi", "single process": for messages
};

using EnvGetter = std::function<std::optional<std::string>(const std::string&)>;
EnvGetter process_env();

// Throws InputError naming the flag or variable that is missing or malformed.
Rendezvous resolve_rendezvous(const RendezvousFlags& flags, const EnvGetter& env = process_env());

// Every name this machine answers to: its hostname, "localhost", and each interface's address.
std::vector<std::string> local_addresses();

// HeteroShard's "same command on every machine" (hetero_config.json names each stage's machine):
// the rank whose machine (ADDRESSES per rank: its ip, else its hostname, first) is one of LOCAL. Where several are (a
// multi-GPU worker host, or a whole job on one machine), identical processes take them in rank
// order, each holding LOCK_DIR/alloy-rank-KEY-R.lock (flock) for its life. Loopback names
// (localhost, 127.x, ::1) count only in a file that names nothing else. Throws InputError naming
// WHERE when no rank names this machine, or when every rank it names is taken.
int claim_rank_by_address(const std::vector<std::vector<std::string>>& addresses, const std::vector<std::string>& local,
                          const std::string& key, const std::string& where, const std::string& lock_dir = "/tmp");

// HeteroShard's "same command on every machine" as a whole: with no rank given, FILE's stages
// (ADDRESSES per shard_plan entry) and its coordinator's address (COORDINATOR, which hosts the
// store; PORT_FLAG > 0 overrides the default port) say which rank this process is
// (claim_rank_by_address, keyed by FILE and the port). Throws InputError naming FILE when the
// coordinator or a stage has no address.
Rendezvous rendezvous_by_address(const std::vector<std::vector<std::string>>& addresses, const std::string& coordinator,
                                 const std::string& file, int port_flag);

// This process's rank on its machine as its launcher says it (LOCAL_RANK, SLURM_LOCALID,
// OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, first match), or -1 when none does.
int local_rank_from_env(const EnvGetter& env = process_env());

// First host of a SLURM node list: "node[01-04,07],gpu5" -> "node01".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace alloy::dist
