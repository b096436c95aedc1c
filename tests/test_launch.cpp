// The launcher's elastic membership, with `sh` as the ranks: which slots start, how they are
// numbered, and how a device that comes back is taken in at the job's checkpoint.
#include <gtest/gtest.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "alloy/core/process.h"
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

// --help, --version and `launch` skip main()'s re-exec for passive OpenMP waits (the launcher
// re-execs once itself, with the ranks' settings, when it forks them); every other command computes.
TEST(ProcessStart, OnlyHelpVersionAndTheLauncherSkipTheReexec) {
  auto computes_nothing = [](std::vector<std::string> words) {
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    return alloy::command_computes_nothing(static_cast<int>(words.size()), argv.data());
  };
  EXPECT_TRUE(computes_nothing({"alloy", "--help"}));
  EXPECT_TRUE(computes_nothing({"alloy", "--log-level", "debug", "--version"}));
  EXPECT_TRUE(computes_nothing({"alloy"}));
  EXPECT_TRUE(computes_nothing({"alloy", "launch", "--nproc", "2", "--", "alloy", "train", "--help"}));
  EXPECT_TRUE(computes_nothing({"alloy", "--log-level", "debug", "launch", "--nproc", "2"}));
  EXPECT_FALSE(computes_nothing({"alloy", "--log-level", "launch", "train"}));
  EXPECT_FALSE(computes_nothing({"alloy", "train", "--config", "c.yaml"}));
  EXPECT_FALSE(computes_nothing({"alloy", "--log-level", "info", "plan", "--cluster", "c.yaml"}));
}

TEST(ProcessStart, KnowsItsOwnExecutableByPathAndByName) {
  const std::string self = fs::canonical("/proc/self/exe").string();
  EXPECT_TRUE(alloy::is_this_program(self));
  EXPECT_TRUE(alloy::is_this_program("/proc/self/exe"));
  EXPECT_FALSE(alloy::is_this_program("/bin/sh"));
  EXPECT_FALSE(alloy::is_this_program(""));
  EXPECT_FALSE(alloy::is_this_program("no-such-program-here"));
  // By name, found in PATH as execvp would find it.
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", ("/nonexistent:" + fs::path(self).parent_path().string()).c_str(), 1);
  EXPECT_TRUE(alloy::is_this_program(fs::path(self).filename().string()));
  ::setenv("PATH", saved.c_str(), 1);
}

namespace {
// Sets the variables for the test's life and puts the old values back.
struct ScopedEnv {
  std::vector<std::pair<std::string, std::optional<std::string>>> old;
  void set(const std::string& k, const char* v) {
    const char* was = std::getenv(k.c_str());
    old.emplace_back(k, was ? std::optional<std::string>(was) : std::nullopt);
    if (v) ::setenv(k.c_str(), v, 1);
    else ::unsetenv(k.c_str());
  }
  ~ScopedEnv() {
    for (auto it = old.rbegin(); it != old.rend(); ++it)
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
  }
};


// Two ranks of one thread, in an environment that serves such ranks.
LaunchOptions forkable(ScopedEnv& env, std::vector<std::string> command) {
  env.set("OMP_NUM_THREADS", "1");
  env.set("OPENBLAS_NUM_THREADS", "1");
  env.set("OMP_WAIT_POLICY", "PASSIVE");
  LaunchOptions o;
  o.nproc = 2;
  o.threads_per_rank = 1;
  o.prefix_output = false;
  o.command = std::move(command);
  return o;
}
}  // namespace

TEST(Launch, RanksRunInForkedCopiesWhenTheEnvironmentServesThem) {
  const std::string dir = temp_dir("forked");
  ScopedEnv env;
  LaunchOptions o = forkable(env, {"/bin/sh", "-c", "exit 3"});  // the command is what an exec would run
  o.run_in_process = [dir](const std::vector<std::string>& argv) {
    std::ofstream(dir + "/rank-" + std::getenv("RANK")) << argv.size() << " " << std::getenv("WORLD_SIZE") << " "
                                                         << std::getenv("OMP_NUM_THREADS") << "\n";
    return std::string(std::getenv("RANK")) == "1" ? 5 : 0;
  };
  auto r = launch(o);
  EXPECT_EQ(slurp(dir + "/rank-0"), "3 2 1\n");
  EXPECT_EQ(slurp(dir + "/rank-1"), "3 2 1\n");
  EXPECT_EQ(r.exit_code, 5);  // the callee's return is the rank's exit code
  EXPECT_EQ(r.failed_rank, 1);

  // Libraries loaded with other thread settings than the ranks need: the command is exec'd.
  env.set("OPENBLAS_NUM_THREADS", "2");
  auto e = launch(o);
  EXPECT_EQ(e.exit_code, 3);
  fs::remove_all(dir);
}

TEST(Launch, AForkedRankDiesOfSigtermAsAnExecdOneWould) {
  // The launcher's own SIGTERM handler must not survive into the rank: a rank still running when
  // another failed is ended by the launcher's SIGTERM after the grace period.
  ScopedEnv env;
  LaunchOptions o = forkable(env, {"/bin/true"});
  o.grace_s = 0.2;
  o.run_in_process = [](const std::vector<std::string>&) {
    if (std::string(std::getenv("RANK")) == "0") return 1;
    for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return 0;
  };
  auto r = launch(o);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.exit_code, 1);
  ASSERT_EQ(r.rank_exit_codes.size(), 2u);
  EXPECT_EQ(r.rank_exit_codes[1], 128 + SIGTERM) << "the sleeping rank did not die of the launcher's SIGTERM";
}

TEST(ProcessStart, ATitleTakesTheArgumentsPlaceAndNeverOutgrowsIt) {
  char area[] = "alloy\0launch\0--\0alloy\0train";  // as main() gets them: back to back
  char* argv[] = {area, area + 6, area + 13, area + 16, area + 22, nullptr};
  alloy::remember_arguments(5, argv);
  char old_name[16] = {};
  ::prctl(PR_GET_NAME, old_name, 0, 0, 0);
  alloy::set_process_title({"alloy", "train"}, "alloy-rank1");
  EXPECT_EQ(std::string(area, sizeof area), std::string("alloy\0train\0", 12) + std::string(sizeof area - 12, '\0'));
  char name[16] = {};
  ::prctl(PR_GET_NAME, name, 0, 0, 0);
  EXPECT_STREQ(name, "alloy-rank1");
  // Longer than the area: cut, still ending in a NUL.
  alloy::set_process_title({"alloy", "train", "--config", "a-long-path.yaml"}, "alloy-rank1");
  EXPECT_EQ(std::string(area, sizeof area), std::string("alloy\0train\0--config\0a-long\0", sizeof area));
  ::prctl(PR_SET_NAME, old_name, 0, 0, 0);
  alloy::remember_arguments(0, nullptr);
}
