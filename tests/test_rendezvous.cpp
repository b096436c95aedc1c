#include <gtest/gtest.h>

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
