// The launcher's elastic membership, with `sh` as the ranks: which slots start, how they are
// numbered, and how a device that comes back is taken in at the job's checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "alloy/dist/launch.h"

namespace fs = std::filesystem;
using alloy::dist::kExitRejoin;
using alloy::dist::launch;
using alloy::dist::LaunchOptions;

namespace {
std::string temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("alloy-test-launch-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}
std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
LaunchOptions elastic(const std::string& dir, int n, const std::string& script) {
  LaunchOptions o;
  o.nproc = n;
  o.rejoin_timeout_s = 0.5;
  o.device_check = "test ! -e " + dir + "/gone-{rank}";
  o.prefix_output = false;
  o.command = {"/bin/sh", "-c", script};
  return o;
}
}  // namespace

TEST(Launch, ElasticStartsTheAvailableSlotsRenumbered) {
  const std::string dir = temp_dir("members");
  std::ofstream(dir + "/gone-1").put('\n');
  auto o = elastic(dir, 3, "echo \"$RANK $WORLD_SIZE $ALLOY_MEMBERS $ALLOY_POOL_SIZE\" > " + dir + "/rank-$RANK");
  auto r = launch(o);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.members, (std::vector<int>{0, 2}));
  EXPECT_EQ(slurp(dir + "/rank-0"), "0 2 0,2 3\n");
  EXPECT_EQ(slurp(dir + "/rank-1"), "1 2 0,2 3\n");
  EXPECT_FALSE(fs::exists(dir + "/rank-2"));
  fs::remove_all(dir);
}

TEST(Launch, ElasticTakesABackDeviceInAtTheJobsStop) {
  // Attempt 0 runs without slot 1; its rank 0 brings the device back and, once the launcher asks
  // (the rejoin file), stops as a training job would at its checkpoint. Attempt 1 has both slots.
  const std::string dir = temp_dir("rejoin");
  std::ofstream(dir + "/gone-1").put('\n');
  const std::string script =
      "echo \"$ALLOY_RESTART $WORLD_SIZE $ALLOY_MEMBERS\" >> " + dir + "/starts-$RANK; "
      "if [ \"$WORLD_SIZE\" = 1 ]; then rm -f " + dir + "/gone-1; "
      "  for i in $(seq 100); do [ -e \"$ALLOY_REJOIN_FILE\" ] && exit " + std::to_string(kExitRejoin) + "; sleep 0.1; done; exit 1; fi";
  auto r = launch(elastic(dir, 2, script));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.rejoins, 1);
  EXPECT_EQ(r.restarts, 0);  // a rejoin is not a failure
  EXPECT_EQ(r.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(slurp(dir + "/starts-0"), "0 1 0\n1 2 0,1\n");
  EXPECT_EQ(slurp(dir + "/starts-1"), "1 2 0,1\n");
  fs::remove_all(dir);
}

TEST(Launch, ARejoinExitThatNobodyAskedForIsAFailure) {
  const std::string dir = temp_dir("unasked");
  auto o = elastic(dir, 2, "exit " + std::to_string(kExitRejoin));
  auto r = launch(o);
  EXPECT_EQ(r.exit_code, kExitRejoin);
  EXPECT_EQ(r.rejoins, 0);
  EXPECT_GE(r.failed_rank, 0);
  fs::remove_all(dir);
}

TEST(Launch, ElasticWithNoDeviceLeftFailsNamingIt) {
  const std::string dir = temp_dir("none");
  std::ofstream(dir + "/gone-0").put('\n');
  auto o = elastic(dir, 1, "true");
  try {
    launch(o);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no device is available"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// torchrun's --nnodes / --node_rank: two launchers (two "machines", here one) run the same command;
// node 1's ranks come after node 0's, WORLD_SIZE counts both, LOCAL_RANK restarts at 0 per node.
TEST(Launch, SeveralNodesNumberTheirRanksInTurn) {
  const std::string dir = temp_dir("nodes");
  std::vector<std::thread> nodes;
  std::vector<int> codes(2, -1);
  for (int k = 0; k < 2; ++k)
    nodes.emplace_back([&, k]() {
      LaunchOptions o;
      o.nproc = 2;
      o.nnodes = 2;
      o.node_rank = k;
      o.master_port = 29999;
      o.prefix_output = false;
      o.command = {"/bin/sh", "-c", "echo $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_PORT > " + dir + "/r$RANK"};
      codes[static_cast<size_t>(k)] = launch(o).exit_code;
    });
  for (auto& t : nodes) t.join();
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  EXPECT_EQ(slurp(dir + "/r0"), "0 0 4 29999\n");
  EXPECT_EQ(slurp(dir + "/r1"), "1 1 4 29999\n");
  EXPECT_EQ(slurp(dir + "/r2"), "2 0 4 29999\n");
  EXPECT_EQ(slurp(dir + "/r3"), "3 1 4 29999\n");
  // A failing rank on node 1 is named by its number in the job.
  LaunchOptions o;
  o.nproc = 2;
  o.nnodes = 2;
  o.node_rank = 1;
  o.master_port = 29999;
  o.prefix_output = false;
  o.grace_s = 0.1;
  o.command = {"/bin/sh", "-c", "test $LOCAL_RANK = 0 || exit 3"};
  const auto r = launch(o);
  EXPECT_EQ(r.failed_rank, 3);
  EXPECT_EQ(r.exit_code, 3);
}

TEST(Launch, SeveralNodesNeedAPortAndAValidNodeRank) {
  auto error_of = [](LaunchOptions o) {
    o.command = {"/bin/true"};
    try {
      launch(o);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  LaunchOptions o;
  o.nnodes = 2;
  EXPECT_NE(error_of(o).find("--master-port"), std::string::npos);
  o.master_port = 29998;
  o.node_rank = 2;
  EXPECT_NE(error_of(o).find("--node-rank: 2 is outside 0..1"), std::string::npos) << error_of(o);
  o.node_rank = 0;
  o.max_restarts = 1;
  EXPECT_NE(error_of(o).find("restarts and elasticity need one launcher"), std::string::npos);
}
