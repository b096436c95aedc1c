#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <map>

#include "alloy/core/error.h"
#include "alloy/dist/rendezvous.h"

using namespace alloy::dist;

namespace {
EnvGetter env_of(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
std::string error_of(const RendezvousFlags& f, std::map<std::string, std::string> env) {
  try {
    resolve_rendezvous(f, env_of(env));
  } catch (const alloy::InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Rendezvous, SingleProcessByDefault) {
  auto r = resolve_rendezvous({}, env_of({}));
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.source, "single process");
}

TEST(Rendezvous, FlagsWinOverEnvironment) {
  RendezvousFlags f;
  f.rank = 2;
  f.world_size = 4;
  f.master_addr = "10.1.2.3";
  f.master_port = 1234;
  auto r = resolve_rendezvous(f, env_of({{"RANK", "0"}, {"WORLD_SIZE", "9"}}));
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.master_addr, "10.1.2.3");
  EXPECT_EQ(r.master_port, 1234);
  EXPECT_EQ(r.source, "flags");
}

TEST(Rendezvous, PtafmDistUrl) {
  RendezvousFlags f;
  f.rank = 1;
  f.world_size = 2;
  f.dist_url = "tcp://192.168.0.7:23456";
  auto r = resolve_rendezvous(f, env_of({}));
  EXPECT_EQ(r.master_addr, "192.168.0.7");
  EXPECT_EQ(r.master_port, 23456);
  f.dist_url = "http://x:1";
  EXPECT_NE(error_of(f, {}).find("--dist-url"), std::string::npos);
}

TEST(Rendezvous, TorchrunVariables) {
  auto r = resolve_rendezvous({}, env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h0"},
                                          {"MASTER_PORT", "29511"}, {"LOCAL_RANK", "1"}}));
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.master_addr, "h0");
  EXPECT_EQ(r.master_port, 29511);
  EXPECT_EQ(r.source, "torchrun");
  EXPECT_NE(error_of({}, {{"RANK", "1"}}).find("WORLD_SIZE"), std::string::npos);
  EXPECT_NE(error_of({}, {{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK"), std::string::npos);
  EXPECT_NE(error_of({}, {{"RANK", "5"}, {"WORLD_SIZE", "2"}}).find("outside 0..1"), std::string::npos);
}

TEST(Rendezvous, SlurmVariables) {
  auto r = resolve_rendezvous({}, env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                                          {"SLURM_JOB_NODELIST", "gpu[03-04,07],cpu1"}}));
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.master_addr, "gpu03");
  EXPECT_EQ(r.source, "slurm");
  EXPECT_EQ(first_slurm_host("node7"), "node7");
  EXPECT_EQ(first_slurm_host("a[1-2],b"), "a1");
}

TEST(Rendezvous, MissingRankWithFlagsIsAnError) {
  RendezvousFlags f;
  f.world_size = 2;
  EXPECT_NE(error_of(f, {}).find("--rank"), std::string::npos);
}

TEST(Rendezvous, IdenticalProcessesClaimTheStagesTheirMachineHoldsInTurn) {
  // hetero_config.json's stages: the coordinator and the second worker on 10.0.0.1, one on host "b"
  // (no ip: its hostname is its address).
  const std::vector<std::vector<std::string>> addresses = {{"10.0.0.1", "a"}, {"b"}, {"10.0.0.1", "a"}};
  const std::string dir = ::testing::TempDir();
  const std::string key = "test" + std::to_string(::getpid());
  // Each claim holds its lock for the life of the process (here: of this test), so the same
  // machine's next process gets the next of its stages, then none is left.
  EXPECT_EQ(alloy::dist::claim_rank_by_address(addresses, {"localhost", "a", "10.0.0.1"}, key, "hc.json", dir), 0);
  EXPECT_EQ(alloy::dist::claim_rank_by_address(addresses, {"localhost", "10.0.0.1"}, key, "hc.json", dir), 2);
  try {
    alloy::dist::claim_rank_by_address(addresses, {"10.0.0.1"}, key, "hc.json", dir);
    ADD_FAILURE() << "a third process got a stage";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("hc.json: every stage it places on this machine (ranks 0, 2) is already taken"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(alloy::dist::claim_rank_by_address(addresses, {"b"}, key, "hc.json", dir), 1);
  try {
    alloy::dist::claim_rank_by_address(addresses, {"localhost", "c", "10.9.9.9"}, key, "hc.json", dir);
    ADD_FAILURE() << "a machine the file does not name got a stage";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("names no stage on this machine (localhost, c, 10.9.9.9)"), std::string::npos) << e.what();
  }
  // A stage is known by its ip when it has one: a coordinator at 10.0.0.1 called "localhost" is
  // not every machine; and a loopback address means this machine only in an all-loopback file.
  const std::vector<std::vector<std::string>> mixed = {{"10.0.0.1", "localhost"}, {"10.0.0.2", "b"}};
  EXPECT_EQ(alloy::dist::claim_rank_by_address(mixed, {"localhost", "127.0.0.1", "10.0.0.2"}, key + "m", "hc.json", dir), 1);
  EXPECT_THROW(alloy::dist::claim_rank_by_address(mixed, {"localhost", "127.0.0.1", "10.0.0.9"}, key + "m", "hc.json", dir),
               alloy::InputError);
  const std::vector<std::vector<std::string>> half_loop = {{"127.0.0.1", "mac"}, {"10.0.0.2", "b"}};
  EXPECT_THROW(alloy::dist::claim_rank_by_address(half_loop, {"localhost", "127.0.0.1", "mac"}, key + "h", "hc.json", dir),
               alloy::InputError);
  const auto local = alloy::dist::local_addresses();
  EXPECT_NE(std::find(local.begin(), local.end(), "127.0.0.1"), local.end());
}

TEST(Rendezvous, ByAddressNamesTheFileWhenAStageHasNoMachine) {
  const std::string dir = ::testing::TempDir();
  auto error_of = [](const std::vector<std::vector<std::string>>& a, const std::string& coordinator) -> std::string {
    try {
      alloy::dist::rendezvous_by_address(a, coordinator, "hc.json", 0);
    } catch (const alloy::InputError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({{"127.0.0.1"}, {"127.0.0.1"}}, "").find("hc.json: coordinator.ip"), std::string::npos);
  EXPECT_NE(error_of({{"127.0.0.1"}, {}}, "127.0.0.1").find("hc.json: shard_plan[1]: its worker names no ip or hostname"),
            std::string::npos);
  // All on this machine: the first free stage, the coordinator's address and the default port.
  const auto rv = alloy::dist::rendezvous_by_address({{"127.0.0.1"}, {"127.0.0.1"}}, "127.0.0.1", dir + "/hc-" + std::to_string(::getpid()) + ".json", 0);
  EXPECT_EQ(rv.rank, 0);
  EXPECT_EQ(rv.world_size, 2);
  EXPECT_EQ(rv.master_addr, "127.0.0.1");
  EXPECT_EQ(rv.master_port, 29500);
}

// mpirun / horovodrun (SAFusion's launchers): Open MPI's and MPICH's variables number the ranks;
// the store's address must be given unless every rank runs on this machine.
TEST(Rendezvous, MpiLaunchers) {
  auto r = resolve_rendezvous({}, env_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                          {"MASTER_ADDR", "10.0.0.5"}, {"MASTER_PORT", "4321"}}));
  EXPECT_EQ(r.source, "mpi");
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.master_addr, "10.0.0.5");
  EXPECT_EQ(r.master_port, 4321);
  // Every rank on this machine: the default store address holds.
  r = resolve_rendezvous({}, env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}}));
  EXPECT_EQ(r.rank, 1);
  EXPECT_EQ(r.world_size, 2);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.master_addr, "127.0.0.1");
  // Ranks on two machines and no MASTER_ADDR: the error says what to set and how.
  const std::string e = error_of({}, {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_NE(e.find("MASTER_ADDR"), std::string::npos) << e;
  EXPECT_NE(e.find("mpirun -x MASTER_ADDR"), std::string::npos) << e;
  EXPECT_NE(error_of({}, {{"OMPI_COMM_WORLD_RANK", "0"}}).find("OMPI_COMM_WORLD_SIZE"), std::string::npos);
  // torchrun's variables come first where both are set (torchrun under mpirun).
  EXPECT_EQ(resolve_rendezvous({}, env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}})).source,
            "torchrun");
}

TEST(Rendezvous, LocalRankFromEachLauncher) {
  EXPECT_EQ(local_rank_from_env(env_of({})), -1);
  EXPECT_EQ(local_rank_from_env(env_of({{"LOCAL_RANK", "2"}, {"SLURM_LOCALID", "5"}})), 2);
  EXPECT_EQ(local_rank_from_env(env_of({{"SLURM_LOCALID", "5"}})), 5);
  EXPECT_EQ(local_rank_from_env(env_of({{"OMPI_COMM_WORLD_LOCAL_RANK", "7"}})), 7);
  EXPECT_EQ(local_rank_from_env(env_of({{"MPI_LOCALRANKID", "3"}})), 3);
}
