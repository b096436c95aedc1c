// What a CUDA LibTorch adds: the CUDA allocator's memory figures, the fused AdamW kernel and NCCL
// groups (at world size 1: one GPU cannot host two NCCL ranks). The CUDA cases skip, saying so, on
// a machine or LibTorch without CUDA; scripts/gpu-check.sh runs them on a GPU. The CPU halves run
// everywhere.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include "alloy/dist/launch.h"
#include "alloy/dist/nccl.h"
#include "alloy/dist/world.h"
#include "alloy/model/transformer.h"
#include "alloy/pipeline/device_memory.h"
#include "alloy/plan/profiler.h"
#include "alloy/train/optimizer.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

using alloy::model::Param;
using alloy::train::AdamW;
namespace pipeline = alloy::pipeline;
namespace dist = alloy::dist;

namespace {
std::shared_ptr<dist::World> world_of_one() {
  dist::Rendezvous rv;
  rv.master_port = dist::free_tcp_port();
  rv.source = "test";
  return dist::World::create(rv, std::chrono::milliseconds(30000));
}

bool cuda() { return at::hasCUDA() && at::getNumGPUs() > 0; }
}  // namespace

TEST(DeviceMemory, ACpuDeviceReadsTheHeap) {
  const at::Device cpu(at::kCPU);
  EXPECT_TRUE(pipeline::measures_device_memory(cpu));
  EXPECT_EQ(pipeline::memory_peak(cpu), -1);  // sampled by the callers instead
  const int64_t before = pipeline::memory_in_use(cpu);
  at::Tensor t = at::ones({16 << 20}, at::kFloat);  // 64 MiB
  const int64_t during = pipeline::memory_in_use(cpu);
  t.reset();
  EXPECT_GE(during - before, int64_t{64} << 20);
  EXPECT_LT(pipeline::memory_in_use(cpu) - before, int64_t{8} << 20);
}

TEST(DeviceMemory, ACudaDeviceReadsTheAllocatorNotTheHeap) {
  if (!cuda()) GTEST_SKIP() << "no CUDA device";
  const at::Device gpu(at::kCUDA, 0);
  ASSERT_TRUE(pipeline::measures_device_memory(gpu)) << "a CUDA LibTorch built without ALLOY_CUDA_MEMORY (CMakeLists.txt)";
  (void)at::empty({1}, at::TensorOptions().device(gpu));  // CUDA's initialisation takes ~30 MB of host heap once
  const int64_t heap_before = pipeline::heap_bytes_in_use(), before = pipeline::memory_in_use(gpu);
  pipeline::reset_memory_peak(gpu);
  at::Tensor t = at::ones({16 << 20}, at::TensorOptions().dtype(at::kFloat).device(gpu));
  at::Tensor u = at::ones({8 << 20}, at::TensorOptions().dtype(at::kFloat).device(gpu));
  u.reset();
  EXPECT_GE(pipeline::memory_in_use(gpu) - before, int64_t{64} << 20);
  EXPECT_LT(pipeline::memory_in_use(gpu) - before, int64_t{66} << 20);
  EXPECT_GE(pipeline::memory_peak(gpu) - before, int64_t{96} << 20);  // the freed 32 MiB counted at its peak
  EXPECT_LT(pipeline::heap_bytes_in_use() - heap_before, int64_t{16} << 20);  // not on the host
}

TEST(FusedAdamW, MatchesTheCpuUpdateOnCuda) {
  if (!cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  std::vector<Param> cpu{Param{"w", at::randn({64, 33}), true}, Param{"b", at::randn({33}), false}, Param{"n", at::randn({7}), false}};
  std::vector<Param> gpu;
  for (const auto& p : cpu) gpu.push_back(Param{p.name, p.tensor.to(at::kCUDA), p.decay});
  std::vector<Param*> pc, pg;
  for (auto& p : cpu) pc.push_back(&p);
  for (auto& p : gpu) pg.push_back(&p);
  AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  AdamW a(pc, o), b(pg, o);
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < cpu.size(); ++i) {
      at::Tensor g = at::randn(cpu[i].tensor.sizes());
      cpu[i].tensor.mutable_grad() = g;
      gpu[i].tensor.mutable_grad() = g.to(at::kCUDA);
    }
    a.step(1e-2), b.step(1e-2);
    a.zero_grad(), b.zero_grad();
  }
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_TRUE(at::allclose(gpu[i].tensor.cpu(), cpu[i].tensor, 1e-5, 1e-6)) << cpu[i].name;
  const auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(at::allclose(sb[i].second.cpu(), sa[i].second, 1e-5, 1e-7)) << sa[i].first;
  EXPECT_EQ(a.fused_tensors(), 0);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  EXPECT_EQ(b.fused_tensors(), 3);  // the kernel ran, not the per-tensor path
#endif
}

TEST(FusedAdamW, AResumedRunUpdatesAsTheUninterruptedOne) {
  if (!cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  auto make = [] { return std::vector<Param>{Param{"w", at::randn({32, 16}).to(at::kCUDA), true}, Param{"b", at::randn({16}).to(at::kCUDA), false}}; };
  std::vector<Param> whole = make(), first = whole, second;
  for (auto& p : first) p.tensor = p.tensor.clone();
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 6; ++i) grads.push_back(at::randn({32 * 16 + 16}).to(at::kCUDA));
  auto set = [&](std::vector<Param>& ps, int step) {
    ps[0].tensor.mutable_grad() = grads[static_cast<size_t>(step)].narrow(0, 0, 32 * 16).view({32, 16}).clone();
    ps[1].tensor.mutable_grad() = grads[static_cast<size_t>(step)].narrow(0, 32 * 16, 16).clone();
  };
  AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  const std::vector<Param*> pw{&whole[0], &whole[1]}, pf{&first[0], &first[1]};
  AdamW straight(pw, o), before(pf, o);
  for (int step = 0; step < 6; ++step) set(whole, step), straight.step(1e-2), straight.zero_grad();
  for (int step = 0; step < 3; ++step) set(first, step), before.step(1e-2), before.zero_grad();
  // Resume: fresh parameters and optimizer from what a checkpoint keeps (values, moments, steps).
  for (auto& p : first) second.push_back(Param{p.name, p.tensor.cpu().to(at::kCUDA), p.decay});
  std::map<std::string, at::Tensor> saved;
  for (const auto& [k, t] : before.state()) saved[k] = t.cpu();
  const std::vector<Param*> ps{&second[0], &second[1]};
  AdamW after(ps, o);
  after.load_state(saved, before.steps_taken(), "test");
  for (int step = 3; step < 6; ++step) set(second, step), after.step(1e-2), after.zero_grad();
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(at::equal(second[i].tensor.cpu(), whole[i].tensor.cpu())) << whole[i].name;
}

TEST(NcclEligible, EveryMemberOnAGpuOfItsOwnAndAbleToUseNccl) {
  EXPECT_TRUE(dist::nccl_eligible({"cuda:0@a", "cuda:1@a", "cuda:0@b"}));
  EXPECT_TRUE(dist::nccl_eligible({"cuda:0@a"}));
  EXPECT_FALSE(dist::nccl_eligible({"cuda:0@a", "cuda:0@a"}));           // two ranks on one GPU
  EXPECT_FALSE(dist::nccl_eligible({"cuda:0@a", "cpu"}));                // a CPU member
  EXPECT_FALSE(dist::nccl_eligible({"cuda:0@a", "cuda-gloo:1@a"}));      // a member without NCCL or with ALLOY_NCCL=0
  EXPECT_FALSE(dist::nccl_eligible({}));
  // With UUIDs: each rank seeing its own GPU as cuda:0 on one machine, and one GPU under two indices.
  EXPECT_TRUE(dist::nccl_eligible({"cuda:0@a#0123", "cuda:0@a#4567"}));
  EXPECT_FALSE(dist::nccl_eligible({"cuda:0@a#0123", "cuda:1@a#0123"}));
}

TEST(NcclEligible, ARankPublishesWhetherItUsesNccl) {
  EXPECT_EQ(dist::device_label(at::Device(at::kCPU), true), "cpu");
  EXPECT_EQ(dist::device_label(at::Device(at::kCUDA, 1), true).rfind("cuda:1@", 0), 0u);
  EXPECT_EQ(dist::device_label(at::Device(at::kCUDA, 1), false).rfind("cuda-gloo:1@", 0), 0u);
  // ALLOY_NCCL=0 turns it off in any build; the variable as it was is put back.
  const char* was = std::getenv("ALLOY_NCCL");
  const std::string saved = was ? was : "";
  ::setenv("ALLOY_NCCL", "0", 1);
  const bool off = dist::nccl_wanted();
  ::unsetenv("ALLOY_NCCL");
  const bool default_on = dist::nccl_wanted();
  if (was) ::setenv("ALLOY_NCCL", saved.c_str(), 1);
  EXPECT_FALSE(off);
  EXPECT_EQ(default_on, dist::nccl_built());
  // The variable's reading, in every build (on a CPU LibTorch nccl_wanted() is false whatever it says).
  EXPECT_TRUE(dist::nccl_allowed_by(nullptr));
  EXPECT_TRUE(dist::nccl_allowed_by("1"));
  for (const char* no : {"0", "off", "false"}) EXPECT_FALSE(dist::nccl_allowed_by(no)) << no;
}

TEST(Nccl, ACudaRankPublishesItsGpusUuid) {
  if (!cuda()) GTEST_SKIP() << "no CUDA device";
  if (!dist::nccl_built()) GTEST_SKIP() << "this LibTorch has no NCCL";
  const std::string uuid = dist::gpu_uuid(0);
  ASSERT_EQ(uuid.size(), 32u);
  EXPECT_EQ(uuid.find_first_not_of("0123456789abcdef"), std::string::npos) << uuid;
  EXPECT_NE(uuid, std::string(32, '0'));
  const std::string label = dist::device_label(at::Device(at::kCUDA, 0), true);
  EXPECT_EQ(label.substr(label.size() - 33), "#" + uuid) << label;
  EXPECT_EQ(dist::gpu_uuid(static_cast<int>(at::getNumGPUs())), "");  // no such GPU
}

TEST(Nccl, ACudaRankWithoutNcclKeepsItsGroupsOnGloo) {
  auto w = world_of_one();
  const char* was = std::getenv("ALLOY_NCCL");
  const std::string saved = was ? was : "";
  ::setenv("ALLOY_NCCL", "0", 1);
  w->set_device(at::Device(at::kCUDA, 0));
  if (was) ::setenv("ALLOY_NCCL", saved.c_str(), 1);
  else ::unsetenv("ALLOY_NCCL");
  const auto b = w->store().get("alloy/device/0");
  EXPECT_EQ(std::string(b.begin(), b.end()).rfind("cuda-gloo:0@", 0), 0u);
  EXPECT_FALSE(w->new_group("opted-out", {0})->device_collectives());
}

TEST(Nccl, AGroupOfCpuRanksStaysOnGloo) {
  auto w = world_of_one();
  w->set_device(at::Device(at::kCPU));
  auto g = w->new_group("cpu-only", {0});
  EXPECT_FALSE(g->device_collectives());
  at::Tensor t = at::full({4}, 2.0);
  dist::wait_work(g->allreduce_sum(t), "all-reduce");
  EXPECT_TRUE(at::equal(t, at::full({4}, 2.0)));
}

TEST(Nccl, AGroupOfCudaRanksReducesOnTheDevice) {
  if (!cuda()) GTEST_SKIP() << "no CUDA device";
  if (!dist::nccl_built()) GTEST_SKIP() << "this LibTorch has no NCCL";
  auto w = world_of_one();
  w->set_device(at::Device(at::kCUDA, 0));
  auto g = w->new_group("cuda-only", {0});
  ASSERT_TRUE(g->device_collectives());
  const auto on_gpu = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  at::Tensor t = at::arange(8, on_gpu);
  dist::wait_work(g->allreduce_sum(t), "NCCL all-reduce");
  EXPECT_TRUE(at::equal(t.cpu(), at::arange(8, at::kFloat)));
  EXPECT_TRUE(t.is_cuda());
  at::Tensor b = at::full({3}, 5.0, on_gpu);
  dist::wait_work(g->broadcast(b, 0), "NCCL broadcast");
  EXPECT_TRUE(at::equal(b.cpu(), at::full({3}, 5.0)));
  at::Tensor in = at::full({2}, 7.0, on_gpu);
  std::vector<at::Tensor> out{at::zeros({2}, on_gpu)};
  dist::wait_work(g->allgather(out, in), "NCCL all-gather");
  EXPECT_TRUE(at::equal(out[0].cpu(), at::full({2}, 7.0)));
  // Host tensors of the same group still go through Gloo.
  at::Tensor h = at::full({2}, 3.0);
  dist::wait_work(g->allreduce_sum(h), "Gloo all-reduce");
  EXPECT_TRUE(at::equal(h, at::full({2}, 3.0)));
}

// A CPU quota as the profile reads it (DeviceProfile::quota_fraction, quota_burst_s).
TEST(CpuQuota, ReadFromTheTimesOfEqualPieces) {
  using alloy::plan::quota_from_times;
  // Pieces of 10 us; 4 ms of them, then 16 ms throttled, over and over: a fifth of a core, 4 ms
  // bursts (what a 0.2-core quota of 5 ms periods does on a 4 ms timer tick).
  auto throttled = [](double run_s, double stop_s, double length_s) {
    std::vector<double> t{0.0};
    double in_run = 0;
    while (t.back() < length_s) {
      if (in_run + 1e-5 > run_s + 1e-12) t.back() += stop_s, in_run = 0;
      t.push_back(t.back() + 1e-5);
      in_run += 1e-5;
    }
    return t;
  };
  const std::vector<double> steady = throttled(4e-3, 16e-3, 0.3);
  const std::vector<std::vector<double>> after(6, throttled(4e-3, 16e-3, 0.03));
  const auto q = quota_from_times(steady, after, 4e-4);
  EXPECT_NEAR(q.fraction, 0.2, 0.01);
  EXPECT_NEAR(q.burst_s, 4e-3, 2e-5);
  // Without throttling: none.
  const std::vector<double> free_run = throttled(1.0, 0, 0.3);
  const auto none = quota_from_times(free_run, {free_run, free_run}, 4e-4);
  EXPECT_EQ(none.fraction, 1.0);
  EXPECT_EQ(none.burst_s, 0.0);
  // Another process's turn now and then in the steady run, but never a gap after the waits: none.
  const auto busy = quota_from_times(throttled(4e-3, 4e-3, 0.3), {free_run, free_run, free_run}, 4e-4);
  EXPECT_EQ(busy.burst_s, 0.0);
  // The burst is the median run to the first gap: one odd wait does not move it.
  std::vector<std::vector<double>> mixed = after;
  mixed[0] = throttled(1e-3, 16e-3, 0.03);
  EXPECT_NEAR(quota_from_times(steady, mixed, 4e-4).burst_s, 4e-3, 2e-5);
}

// The same measured on this thread inside a cgroup v1 CPU quota of 0.2 core in 5 ms periods (the
// emulator's devices; root). The fraction's upper bound is firm; other work on the machine can
// lower it. The burst shows (3.6-4.7 ms alone; another process's turn on a busy machine can end a
// run early, hence the loose floor) and stays under a few timer ticks.
TEST(CpuQuota, MeasuredInsideACgroupQuota) {
  const std::string root = "/sys/fs/cgroup/cpu";
  if (!std::filesystem::exists(root + "/cgroup.procs")) GTEST_SKIP() << "no cgroup v1 cpu controller at " << root;
  const std::string g = root + "/alloy-test-quota-" + std::to_string(::getpid());
  ASSERT_TRUE(std::filesystem::create_directory(g)) << g;
  auto put = [](const std::string& f, const std::string& v) {
    std::ofstream o(f);
    o << v << std::flush;
    return o.good();
  };
  const std::string tid = std::to_string(::syscall(SYS_gettid));
  // Where this thread is now (cgroup v1: "N:cpu,cpuacct:/path"), to put it back afterwards.
  std::string home = "/";
  std::ifstream self("/proc/thread-self/cgroup");
  for (std::string line; std::getline(self, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    if (controllers.find(",cpu,") != std::string::npos) home = line.substr(b + 1);
  }
  ASSERT_TRUE(put(g + "/cpu.cfs_period_us", "5000"));
  ASSERT_TRUE(put(g + "/cpu.cfs_quota_us", "1000"));
  ASSERT_TRUE(put(g + "/tasks", tid));  // this thread only
  const alloy::plan::QuotaFigures q = alloy::plan::measure_quota("cpu");
  EXPECT_TRUE(put(root + (home == "/" ? "" : home) + "/tasks", tid)) << home;
  std::filesystem::remove(g);
  std::printf("quota 0.2 core: fraction %.3f, burst %.2f ms\n", q.fraction, q.burst_s * 1e3);
  EXPECT_LT(q.fraction, 0.3);
  EXPECT_GT(q.fraction, 0.02);
  EXPECT_GE(q.burst_s, 0.3e-3);
  EXPECT_LT(q.burst_s, 20e-3);
  // A GPU has none.
  EXPECT_EQ(alloy::plan::measure_quota("cuda").burst_s, 0.0);
}
