// The cost model: hand-computed steps, the fast timing path against the event simulator, links,
// gradient sync (exact, compressed, along trees) and memory.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/calibrate.h"
#include "alloy/plan/replanner.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/search.h"
#include "planner_fixtures.h"

using namespace alloy;
using namespace alloy::plan;
using namespace alloy::plan::testing;

// --- The fast timing path agrees with the event simulator -------------------------------------

RC_GTEST_PROP(SimulateTimes, MatchesTheEventSimulator, ()) {
  const int64_t S = *rc::gen::inRange<int64_t>(1, 7);
  const int64_t M = *rc::gen::inRange<int64_t>(1, 12);
  const std::string name = *rc::gen::element(std::string("1f1b"), std::string("gpipe"), std::string("eager-1f1b"),
                                              std::string("eager-1f1b-2"), std::string("eager-1f1b-4"));
  pipeline::SimCosts c;
  for (int64_t s = 0; s < S; ++s) {
    c.forward.push_back(*rc::gen::inRange(0, 1000) / 100.0);
    c.backward.push_back(*rc::gen::inRange(0, 1000) / 100.0);
    if (s + 1 < S) c.p2p_link.push_back(*rc::gen::inRange(0, 500) / 100.0);
    // Some links distant: part of their message time is latency, in which messages overlap.
    if (s + 1 < S) c.p2p_latency.push_back(c.p2p_link.back() * *rc::gen::inRange(0, 5) / 4.0);
  }
  std::vector<std::vector<pipeline::Action>> lists;
  for (int64_t s = 0; s < S; ++s) lists.push_back(pipeline::make_schedule(name, s, S, M));
  const auto sim = pipeline::simulate(lists, c);
  const auto fast = pipeline::simulate_times(name, S, M, c);
  RC_ASSERT(fast.makespan == sim.makespan);
  for (int64_t s = 0; s < S; ++s) {
    double start = -1, end = -1;
    for (const auto& e : sim.events)
      if (e.stage == s && e.action.kind == pipeline::ActionKind::Backward) start = e.start, end = e.end;
    RC_ASSERT(fast.last_backward_start[static_cast<size_t>(s)] == start);
    RC_ASSERT(fast.last_backward_end[static_cast<size_t>(s)] == end);
    RC_ASSERT(fast.peak_in_flight[static_cast<size_t>(s)] == sim.peak_in_flight[static_cast<size_t>(s)]);
    const int64_t expect_peak = name == "gpipe" ? M : std::min(S - s + (s + 1 < S ? pipeline::eager_extra(name) : 0), M);
    RC_ASSERT(fast.peak_in_flight[static_cast<size_t>(s)] == expect_peak);
  }
}

TEST(SimulateTimes, PerLinkP2pDelaysOnlyThatLink) {
  // Two links: the second is slow. Stage 2's first forward waits for both transfers.
  pipeline::SimCosts c{{1, 1, 1}, {1, 1, 1}, 0, {0.5, 3}};
  std::vector<std::vector<pipeline::Action>> lists;
  for (int s = 0; s < 3; ++s) lists.push_back(pipeline::make_schedule("gpipe", s, 3, 1));
  const auto sim = pipeline::simulate(lists, c);
  // F0 on stage 0 [0,1], arrives at 1.5; stage 1 [1.5,2.5], arrives 5.5; stage 2 F [5.5,6.5], B [6.5,7.5];
  // gradient to stage 1 at 10.5, B [10.5,11.5]; to stage 0 at 12, B [12,13].
  EXPECT_DOUBLE_EQ(sim.makespan, 13.0);
  EXPECT_DOUBLE_EQ(pipeline::simulate_times("gpipe", 3, 1, c).makespan, 13.0);
  c.p2p_link = {0.5};
  EXPECT_THROW(pipeline::simulate(lists, c), std::invalid_argument);
}

// A distant link: messages of 1 s of bytes behind 4 s of latency (p2p 5). Messages overlap in the
// latency (the link holds only their bytes), so stage 0's forwards (1 s each) reach stage 1 one
// second apart, each 5 s after it was sent; a link that held each message for all 5 s would let
// only one through every 5 s.
TEST(SimulateTimes, MessagesOverlapInALinksLatency) {
  pipeline::SimCosts c{{1, 1}, {1, 1}, 0, {5}};
  c.p2p_latency = {4};
  std::vector<std::vector<pipeline::Action>> lists;
  for (int s = 0; s < 2; ++s) lists.push_back(pipeline::make_schedule("gpipe", s, 2, 3));
  // F0..F2 on stage 0 end at 1, 2, 3 and land at 6, 7, 8; stage 1 forwards [6,7] [7,8] [8,9], then
  // backwards [9,10] [10,11] [11,12], each gradient landing 5 s later: 15, 16, 17; stage 0's
  // backwards [15,16] [16,17] [17,18].
  const auto sim = pipeline::simulate(lists, c);
  EXPECT_DOUBLE_EQ(sim.makespan, 18.0);
  EXPECT_DOUBLE_EQ(pipeline::simulate_times("gpipe", 2, 3, c).makespan, 18.0);
  // Without the latency split each message holds the link 5 s: activations land at 6, 11, 16, so
  // stage 1 forwards [6,7] [11,12] [16,17] and backwards [17,18] [18,19] [19,20]; the gradients
  // queue behind each other and land at 23, 28, 33; stage 0's last backward is [33,34].
  c.p2p_latency.clear();
  EXPECT_DOUBLE_EQ(pipeline::simulate(lists, c).makespan, 34.0);
  EXPECT_DOUBLE_EQ(pipeline::simulate_times("gpipe", 2, 3, c).makespan, 34.0);
  c.p2p_latency = {6};  // longer than the link's whole message time
  EXPECT_THROW(pipeline::simulate(lists, c), std::invalid_argument);
  EXPECT_THROW(pipeline::simulate_times("gpipe", 2, 3, c), std::invalid_argument);
}

// --- Cost model on hand-computed cases ----------------------------------------------------------


TEST(CostModel, OneDevice) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  p.devices["t"].optimizer_s_per_param = 1e-6;
  ClusterSpec c;
  c.devices = {device("d0", "h0", "t", 1.0)};
  Plan plan;
  plan.global_batch = 6;
  plan.pipelines.push_back({2, 3, {stage(0, 0, 2, "d0")}});
  PlanCost pc = simulate_plan(plan, c, p);
  // 3 micro-batches of forward (2*0.5 + 0.25 + 0.25 = 1.5) and backward (2*1 + 0.5 + 0.5 = 3).
  EXPECT_DOUBLE_EQ(pc.phase_s, 3 * 4.5);
  EXPECT_TRUE(pc.sync_groups.empty());
  EXPECT_EQ(pc.world_allreduce_s, 0.0);
  // Parameters: 2 blocks (2 MB) + embedding (2 MB) + head (2 MB) = 6e6 bytes = 1.5e6 float32.
  EXPECT_NEAR(pc.optimizer_s, 1.5e6 * 1e-6, 1e-12);
  EXPECT_NEAR(pc.step_s, 13.5 + 1.5, 1e-12);
  ASSERT_EQ(pc.stages.size(), 1u);
  // Memory: 6e6 * 4 + no buckets + 1 micro-batch of 2 in flight * (2*2e5 + 1e5 + 4e5) bytes + the
  // backward's working set, one block's activations at 2 samples.
  EXPECT_DOUBLE_EQ(pc.stages[0].memory_bytes, 24e6 + 1 * 2 * 9e5 + 2 * 2e5);
  EXPECT_EQ(pc.stages[0].peak_in_flight, 1);
  EXPECT_TRUE(pc.fits);
  EXPECT_DOUBLE_EQ(pc.stages[0].bubble_s, 0.0);
}

TEST(CostModel, LoraTrainsItsAdaptersAndHoldsTheFrozenBase) {
  // The same pool and plan as OneDevice, but the profile of a LoRA run: of each 2 MB unit only
  // 0.1 MB (the adapters) trains, the frozen rest is held in 0.3 MB (quantized).
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  p.devices["t"].optimizer_s_per_param = 1e-6;
  p.lora.rank = 4;
  p.memory.param_bytes_per_block = 1e5;
  p.memory.param_bytes_embed = p.memory.param_bytes_head = 0;
  p.memory.frozen_bytes_per_block = 3e5;
  p.memory.frozen_bytes_embed = p.memory.frozen_bytes_head = 2e6;
  ClusterSpec c;
  c.devices = {device("d0", "h0", "t", 1.0), device("d1", "h1", "t", 1.0)};
  Plan plan;
  plan.global_batch = 12;
  plan.pipelines.push_back({2, 3, {stage(0, 0, 2, "d0")}});
  plan.pipelines.push_back({2, 3, {stage(1, 0, 2, "d1")}});
  PlanCost pc = simulate_plan(plan, c, p);
  // AdamW over the adapters alone: 2 blocks x 1e5 bytes = 5e4 float32.
  EXPECT_NEAR(pc.optimizer_s, 5e4 * 1e-6, 1e-12);
  // Only the adapters are synced between the replicas.
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  EXPECT_DOUBLE_EQ(pc.sync_groups[0].bytes, 2e5);
  // Memory: trained bytes with gradients and AdamW (x4), plus the frozen base once.
  const auto& st = pc.stages[0];
  EXPECT_DOUBLE_EQ(st.weight_bytes, 2e5 + 2 * 3e5 + 2 * 2e6);
  EXPECT_DOUBLE_EQ(st.grad_bytes, 2e5);
  EXPECT_DOUBLE_EQ(st.optimizer_bytes, 2 * 2e5);
}

namespace {
// Two blocks on two hosts, one sample per message: 4 x 8 x 4 = 128 bytes.
Profile two_block_profile() {
  Profile p = base_profile(2);
  p.model.seq_len = 4;
  p.model.hidden = 8;
  p.devices["t"] = flat(0.5, 1.0, 0.5, 1.0);
  return p;
}

// A block on each host, two micro-batches of one sample, on SCHED.
Plan two_stage_plan(const std::string& sched) {
  Plan plan;
  plan.global_batch = 2;
  plan.schedule = sched;
  plan.pipelines.push_back({1, 2, {stage(0, 0, 1, "a"), stage(1, 1, 2, "b")}});
  return plan;
}

// Two full replicas, 2 x 1 samples on device a and 1 x 2 on device b.
Plan two_replicas() {
  Plan plan;
  plan.global_batch = 4;
  plan.pipelines.push_back({2, 1, {stage(0, 0, 2, "a")}});
  plan.pipelines.push_back({1, 2, {stage(1, 0, 2, "b")}});
  return plan;
}
}  // namespace

TEST(CostModel, TwoStagePipelineExactStepTime) {
  Profile p = two_block_profile();
  // 128 bytes at 512 bytes/s = 0.25 s, plus 0.25 s latency: 0.5 s per message.
  ClusterSpec c = two_hosts(512 * 8 / 1e9, 250);
  for (const std::string sched : {"gpipe", "1f1b"}) {
    PlanCost pc = simulate_plan(two_stage_plan(sched), c, p);
    // Stage costs: forward 0.5 + 0.5 = 1, backward 1 + 1 = 2 on both stages; p2p 0.5.
    // GPipe: stage 1 F0 [1.5,2.5] F1 [2.5,3.5] B0 [3.5,5.5] B1 [5.5,7.5]; stage 0 B0 [6,8] B1 [8,10].
    // 1F1B: stage 1 F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]; stage 0 B0 [5,7] B1 [8,10].
    EXPECT_NEAR(pc.phase_s, 10.0, 1e-9) << sched;
    EXPECT_TRUE(pc.sync_groups.empty()) << sched;  // LLaMA: nothing is shared inside one pipeline
    // The world's figures over 2 ranks, all-gathered: (n-1)/n = 1/2 of the ring's latencies (0.25
    // each way) + (n-1) members' figures.
    const double figures = CostContext::kWorldSumBytes / 512;
    EXPECT_NEAR(pc.world_allreduce_s, 0.25 + figures, 1e-9);
    EXPECT_NEAR(pc.step_s, 10.0 + 0.25 + figures, 1e-9) << sched;  // a pipeline sums its norm after the backward
    EXPECT_EQ(pc.world_allreduce_exposed_s, pc.world_allreduce_s) << sched;
    ASSERT_EQ(pc.stages.size(), 2u);
    EXPECT_NEAR(pc.stages[0].p2p_s, 2 * 0.5, 1e-9);  // two activations
    EXPECT_NEAR(pc.stages[1].p2p_s, 2 * 0.5, 1e-9);  // two gradients
    EXPECT_NEAR(pc.stages[1].bubble_s, 10.0 - 6.0, 1e-9);
    EXPECT_EQ(pc.stages[0].peak_in_flight, sched == "gpipe" ? 2 : 2);
    EXPECT_EQ(pc.stages[1].peak_in_flight, sched == "gpipe" ? 2 : 1);
  }
}

// Messages take CPU time from the stages that send and receive them (the profile's
// comm_cpu_s_per_byte): with 0.25 s per 128-byte message, each stage's forward and backward
// (one message each here) grow by 0.25 s: 1.25 and 2.25. GPipe: stage 1 F0 [1.75, 3] F1 [3, 4.25]
// B0 [4.25, 6.5] B1 [6.5, 8.75]; stage 0 B0 [7, 9.25] B1 [9.25, 11.5]. 1F1B: stage 1 F0 [1.75, 3]
// B0 [3, 5.25] F1 [5.25, 6.5] B1 [6.5, 8.75]; stage 0 B0 [5.75, 8] B1 [9.25, 11.5].
TEST(CostModel, MessagesTakeCpuTimeFromTheirStages) {
  Profile p = two_block_profile();
  p.devices["t"].comm_cpu_s_per_byte = 0.25 / 128;
  ClusterSpec c = two_hosts(512 * 8 / 1e9, 250);
  for (const std::string sched : {"gpipe", "1f1b"}) {
    PlanCost pc = simulate_plan(two_stage_plan(sched), c, p);
    EXPECT_NEAR(pc.phase_s, 11.5, 1e-9) << sched;
    ASSERT_EQ(pc.stages.size(), 2u);
    for (const auto& st : pc.stages) {
      EXPECT_NEAR(st.forward_s, 2 * 1.25, 1e-9) << sched;
      EXPECT_NEAR(st.backward_s, 2 * 2.25, 1e-9) << sched;
    }
  }
  // One device sends nothing: its figures are the compute alone (two blocks, embedding and head).
  Plan one = Plan::data_parallel(2, {{2, 1}});
  one.pipelines[0].stages[0].device = "a";
  EXPECT_NEAR(simulate_plan(one, c, p).stages[0].forward_s, 2 * 0.5 + 0.5 + 0.5, 1e-9);
}

TEST(CostModel, HalfBlockStagesPriceEachHalfByItsMeasuredShare) {
  Profile p = base_profile(2);
  p.model.seq_len = 4;
  p.model.hidden = 8;
  p.devices["t"] = flat(1.0, 2.0, 0, 0);
  p.devices["t"].attn_share_fwd = 0.25;  // the attention half's share of a block's forward
  p.devices["t"].attn_share_bwd = 0.75;
  ClusterSpec c = two_hosts(100, 0);
  Plan plan;
  plan.global_batch = 1;
  plan.pipelines.push_back({1, 1, {stage(0, 0, 0, "a"), stage(1, 0, 0, "b")}});
  plan.pipelines[0].stages[0].set_units(0, 3);  // block 0 and block 1's attention half
  plan.pipelines[0].stages[1].set_units(3, 4);  // block 1's MLP half
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.stages.size(), 2u);
  EXPECT_NEAR(pc.stages[0].forward_s, 1.25, 1e-12);
  EXPECT_NEAR(pc.stages[0].backward_s, 2 * 1.75, 1e-12);
  EXPECT_NEAR(pc.stages[1].forward_s, 0.75, 1e-12);
  EXPECT_NEAR(pc.stages[1].backward_s, 2 * 0.25, 1e-12);
  EXPECT_EQ(pc.stages[0].unit_end, 3);
  EXPECT_EQ(pc.stages[1].layer_begin, 1);
  // Every parameter byte is held once: the two halves of block 1 add up to a block.
  EXPECT_NEAR(pc.stages[0].param_bytes + pc.stages[1].param_bytes,
              2 * p.memory.param_bytes_per_block + p.memory.param_bytes_embed + p.memory.param_bytes_head, 1e-3);
  EXPECT_GT(pc.stages[1].param_bytes, p.memory.param_bytes_head);
  // Without measured shares the model's shapes decide; a whole-block plan is priced as before.
  p.devices["t"].attn_share_fwd = p.devices["t"].attn_share_bwd = 0;
  PlanCost shapes = simulate_plan(plan, c, p);
  EXPECT_GT(shapes.stages[1].forward_s, 0.0);
  EXPECT_LT(shapes.stages[1].forward_s, 1.0);
  EXPECT_NEAR(shapes.stages[0].forward_s + shapes.stages[1].forward_s, 2.0, 1e-12);
  plan.pipelines[0].stages[0].set_units(0, 2);
  plan.pipelines[0].stages[1].set_units(2, 4);
  PlanCost whole = simulate_plan(plan, c, p);
  EXPECT_EQ(whole.stages[0].forward_s, 1.0);
  EXPECT_EQ(whole.stages[1].forward_s, 1.0);
}

TEST(CostModel, DataParallelOverASlowLinkExposesSync) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  // 1 MB/s between the hosts, 10 ms latency.
  ClusterSpec c = two_hosts(8e6 / 1e9, 10);
  Plan plan = two_replicas();
  plan.grad_sync.bucket_mb = 1;  // 1 MiB buckets
  PlanCost pc = simulate_plan(plan, c, p);
  // One holder set {0, 1} with everything: 2 blocks + embedding + head = 6e6 bytes.
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  const auto& g = pc.sync_groups[0];
  EXPECT_EQ(g.ranks, (std::vector<int>{0, 1}));
  EXPECT_DOUBLE_EQ(g.bytes, 6e6);
  const int64_t buckets = static_cast<int64_t>(std::ceil(6e6 / (1024.0 * 1024.0)));
  EXPECT_EQ(g.buckets, buckets);
  const double sync = buckets * 1.0 * (2 * 0.010) + 1.0 * 6e6 / 1e6;
  EXPECT_NEAR(g.time_s, sync, 1e-9);
  // Pipeline 0: one micro-batch: forward 1.5, backward 3 -> last backward [1.5, 4.5].
  // Pipeline 1: F0 B0 F1 B1 -> last backward [6, 9]. Buckets in backward order, each ready when
  // the later holder (pipeline 1) has its gradients: head (2e6 bytes, two collectives) at 6.5,
  // block 1 at 7.5, block 0 at 8.5, embedding (two collectives) at 9. The link is the bottleneck,
  // so after the first they run back to back.
  EXPECT_NEAR(g.ready_s, 6.5, 1e-12);
  EXPECT_NEAR(g.done_s, 6.5 + sync, 1e-9);
  EXPECT_NEAR(pc.stages[0].sync_exposed_s, 6.5 + sync - 4.5, 1e-9);
  EXPECT_NEAR(pc.stages[1].sync_exposed_s, 6.5 + sync - 9, 1e-9);
  EXPECT_GT(pc.stages[1].sync_exposed_s, 0);
  EXPECT_NEAR(pc.sync_done_s, 6.5 + sync, 1e-9);
  EXPECT_NEAR(pc.world_allreduce_s, 0.010 + CostContext::kWorldSumBytes / 1e6, 1e-12);  // one hop: all-gathered
  // Replicas of one stage sum the step's figures ahead of the sync (train/step_figures.h): hidden.
  EXPECT_EQ(pc.world_allreduce_exposed_s, 0.0);
  EXPECT_NEAR(pc.step_s, 6.5 + sync, 1e-9);
  // Each rank keeps a bucket copy of the gradients it syncs.
  EXPECT_DOUBLE_EQ(pc.stages[0].bucket_bytes, 6e6);
}

// The sync's own CPU time: the same pair over a fast link (1 GB/s, 6 ms on the wire), with each
// byte sent or received costing 1 us of the device's compute. Each member sends and receives
// 2 (n - 1) / n = 1 times the 6e6 bytes, 12 s of CPU: neither member is done before its last
// backward's end plus 12 s, and the search prices it alike.
TEST(CostModel, SyncCpuTimeDelaysTheMembersItRunsOn) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  p.devices["t"].comm_cpu_s_per_byte = 1e-6;
  ClusterSpec c = two_hosts(8.0, 0);
  Plan plan = two_replicas();
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.stages.size(), 2u);
  // Last backwards end at 4.5 (pipeline 0) and 9 (pipeline 1), as in the test above.
  EXPECT_NEAR(pc.stages[0].sync_exposed_s, 12.0, 1e-9);
  EXPECT_NEAR(pc.stages[1].sync_exposed_s, 12.0, 1e-9);
  EXPECT_NEAR(pc.sync_done_s, 9 + 12.0, 1e-9);
  p.devices["t"].comm_cpu_s_per_byte = 0;
  EXPECT_LT(simulate_plan(plan, c, p).sync_done_s, 9 + 0.1);
  // Compressed (DGC at density 0.01: an int32 index and an fp32 value per kept element, 1.2e5 bytes
  // on the wire), gathered: each member sends its own and receives the other's, 2.4e5 bytes: 0.24 s
  // at 1 us per byte, 0.12 s at half that (the floor binds at both; encoding adds the same to each).
  Plan dgc = plan;
  dgc.grad_sync.compression = "dgc";
  dgc.grad_sync.density = 0.01;
  auto exposed_at = [&](double rate) {
    p.devices["t"].comm_cpu_s_per_byte = rate;
    return simulate_plan(dgc, c, p).stages[1].sync_exposed_s;  // the later member
  };
  EXPECT_NEAR(exposed_at(1e-6) - exposed_at(5e-7), 0.12, 1e-9);
  p.devices["t"].comm_cpu_s_per_byte = 1e-6;
  // The search sees the same figure for the plan it returns.
  SearchOptions o;
  o.global_batch = 4;
  o.fit_memory = false;
  const SearchResult r = search(c, p, o);
  EXPECT_NEAR(r.search_step_s, simulate_plan(r.plan, c, p).step_s, 1e-9 * r.search_step_s);
}

TEST(CostModel, StragglersAtTheStepBarrier) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  p.devices["t"].step_noise = 0.05;
  ClusterSpec c = two_hosts(100, 0.01);
  // Two equal replicas, each done at D: the step waits sigma / sqrt(pi) longer, sigma = 0.05 sqrt(D).
  Plan dp;
  dp.global_batch = 4;
  dp.pipelines.push_back({2, 1, {stage(0, 0, 2, "a")}});
  dp.pipelines.push_back({2, 1, {stage(1, 0, 2, "b")}});
  PlanCost pc = simulate_plan(dp, c, p);
  const double D = pc.sync_done_s, sd = 0.05 * std::sqrt(D);
  ASSERT_EQ(pc.pipelines.size(), 2u);
  EXPECT_NEAR(pc.pipelines[0].noise_s, sd, 1e-12);
  EXPECT_NEAR(pc.straggler_s, sd / std::sqrt(M_PI), 1e-12);
  EXPECT_NEAR(pc.step_s, D + pc.straggler_s + pc.optimizer_s, 1e-12);  // the figures' sum hidden: replicas
  EXPECT_NEAR(pc.to_json()["straggler_s"].get<double>(), pc.straggler_s, 1e-15);
  // A steady profile: no wait.
  Profile steady = p;
  steady.devices["t"].step_noise = 0;
  EXPECT_EQ(simulate_plan(dp, c, steady).straggler_s, 0);
  EXPECT_NEAR(simulate_plan(dp, c, steady).step_s, pc.step_s - pc.straggler_s, 1e-12);
  // One replica far behind the other (3 samples against 1): the barrier waits for it alone.
  Plan uneven = dp;
  uneven.global_batch = 8;
  uneven.pipelines[0].num_micro_batches = 3;
  uneven.pipelines[1].num_micro_batches = 1;
  EXPECT_LT(simulate_plan(uneven, c, p).straggler_s, 1e-9);
  // A single pipeline meets nobody: its own noise does not move its mean.
  Plan pipe;
  pipe.global_batch = 4;
  pipe.pipelines.push_back({2, 2, {stage(0, 0, 1, "a"), stage(1, 1, 2, "b")}});
  EXPECT_EQ(simulate_plan(pipe, c, p).straggler_s, 0);
  // The search prices the same wait (it equals simulate_plan to the last bits).
  SearchOptions o;
  o.global_batch = 4;
  SearchResult r = search(c, p, o);
  expect_uses_every_device(r, c, p);
  if (r.plan.pipelines.size() == 2) EXPECT_GT(r.cost.straggler_s, 0);
}

// The same pool with DGC at density 0.01: each bucket is encoded, all-gathered (index + value per
// element sent: 2 * 0.01 of the bytes) and decoded, at the profiled codec costs.
TEST(CostModel, CompressedSyncIsPricedByWireBytesAndCodecCosts) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  p.devices["t"].codecs["dgc"] = {1e-8, 2e-9};
  ClusterSpec c = two_hosts(8e6 / 1e9, 10);
  Plan plan;
  plan.global_batch = 4;
  plan.grad_sync.bucket_mb = 1;
  plan.pipelines.push_back({2, 1, {stage(0, 0, 2, "a")}});
  plan.pipelines.push_back({1, 2, {stage(1, 0, 2, "b")}});
  const double dense = simulate_plan(plan, c, p).step_s;
  plan.grad_sync.compression = "dgc";
  plan.grad_sync.density = 0.01;
  plan.grad_sync.fusion = "saf-adaptive";  // aligned: no sizes exchanged
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  const auto& g = pc.sync_groups[0];
  EXPECT_TRUE(g.compressed);
  EXPECT_FALSE(g.hierarchical);
  EXPECT_DOUBLE_EQ(g.wire_bytes, 0.02 * 6e6);
  // Buckets of 1 MiB cut the units as the dense path does: head 2e6 alone (over the cap), block 1,
  // block 0, embedding 2e6. Each: elements * (1e-8 + 2e-9) + latency / 2 + wire / 1 MB/s.
  double expect = 0;
  for (double b : {2e6, 1e6, 1e6, 2e6}) expect += b / 4 * 1.2e-8 + 0.5 * 0.020 + 0.02 * b / 1e6;
  EXPECT_NEAR(g.time_s, expect, 1e-9);
  // Dense, sync (6 s over 1 MB/s) dominated; compressed, the slower replica's phase (9 s) does.
  EXPECT_GT(dense, 12);
  EXPECT_LT(pc.step_s, 9.0 + expect);
  // Staging, output, residual and velocity buffers.
  EXPECT_DOUBLE_EQ(pc.stages[0].bucket_bytes, 4 * 6e6);
  // The flat set encodes on the autograd thread: rank 1's backward ends 6e6/4 * 1e-8 s later.
  EXPECT_GE(pc.stages[1].sync_exposed_s, 6e6 / 4 * 1e-8 - 1e-12);
}

namespace {
// Two regions of two hosts (10 Gbit/s and 0.1 ms inside), every pair across them 0.1 Gbit/s and
// 10 ms; one device of type "t" a host.
ClusterSpec two_regions() {
  ClusterSpec c;
  c.devices = {device("a0", "h0", "t"), device("a1", "h1", "t"), device("b0", "h2", "t"), device("b1", "h3", "t")};
  c.groups = {{"A", {"h0", "h1"}}, {"B", {"h2", "h3"}}};
  c.rules.push_back({"A", "A", Link{10, 0.1}});
  c.rules.push_back({"B", "B", Link{10, 0.1}});
  c.rules.push_back({"A", "B", Link{0.1, 10}});
  return c;
}
}  // namespace

// Two regions joined by a slow link: scope slow-links sums exactly inside each region and
// compresses only between the regions' leaders.
TEST(CostModel, HierarchicalSyncCompressesOnlyBetweenRegions) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  const ClusterSpec c = two_regions();
  Plan plan;
  plan.global_batch = 4;
  for (int r = 0; r < 4; ++r) plan.pipelines.push_back({1, 1, {stage(r, 0, 2, c.devices[static_cast<size_t>(r)].name)}});
  const PlanCost dense = simulate_plan(plan, c, p);
  plan.grad_sync.compression = "dgc";
  plan.grad_sync.scope = "slow-links";
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  EXPECT_TRUE(pc.sync_groups[0].hierarchical);
  EXPECT_EQ(pc.sync_groups[0].regions, 2);
  // Dense: along two trees (stripes), each crossing the slow links once at a pair of its own, so
  // each of the two 12.5 MB/s hops carries 3 MB each way (a ring would cross two hops with 2 * 3/4
  // of 6 MB). Compressed: 6 MB inside each region at 1.25 GB/s, then 2% of it between the two
  // leaders.
  EXPECT_TRUE(dense.sync_groups[0].tree);
  EXPECT_EQ(dense.sync_groups[0].stripes, 2);
  // The trees a0 - a1 - b0 - b1 rooted at the edge a1 - b0 and a1 - a0 - b1 - b0 at a0 - b1: a
  // slice's bytes behind its first chunk at 12.5 MB/s, and the first chunk up a fast hop to an end
  // of the root edge, across it once (the two ends swap their partials) and down a fast hop: two
  // fast hops and one slow, with their latencies (a root member's would cross twice).
  const double chunk = 256.0 * 1024;
  EXPECT_NEAR(dense.sync_groups[0].time_s, (6e6 / 2 - chunk) / 1.25e7 + chunk * (2 / 1.25e9 + 1 / 1.25e7) + 2 * 0.0001 + 0.010,
              1e-9);
  Plan one = plan;
  one.grad_sync = GradSyncConfig{};
  one.grad_sync.tree_stripes = 1;  // one tree: all 6 MB over one slow hop
  EXPECT_NEAR(simulate_plan(one, c, p).sync_groups[0].time_s,
              (6e6 - chunk) / 1.25e7 + chunk * (2 / 1.25e9 + 1 / 1.25e7) + 2 * 0.0001 + 0.010, 1e-9);
  EXPECT_LT(pc.sync_groups[0].time_s, 0.1);
  EXPECT_LT(pc.step_s, dense.step_s);
  // A set inside one region stays exact: a pipeline whose both stages sit in region A.
  Plan inside;
  inside.global_batch = 2;
  inside.grad_sync = plan.grad_sync;
  inside.pipelines.push_back({1, 1, {stage(0, 0, 1, "a0"), stage(1, 1, 2, "a1")}});
  inside.pipelines.push_back({1, 1, {stage(2, 0, 1, "b0"), stage(3, 1, 2, "b1")}});
  for (const auto& g : simulate_plan(inside, c, p).sync_groups) {
    const bool crosses = g.ranks != std::vector<int>{0, 1} && g.ranks != std::vector<int>{2, 3};
    EXPECT_EQ(g.compressed, crosses);
  }
}

// Four replicas in two regions joined by slow links (10 ms, 12.5 MB/s a pair): the exact sum goes
// along two striped trees, and its buckets pipeline, so it can hide behind the backward that
// produces them. A replica's gradient is final only after its last micro-batch: in 4 micro-batches
// of 2 the sum hides behind the last quarter of the backward, in one micro-batch of 8 behind all of
// it. Same compute (per-sample costs), a shorter step.
TEST(CostModel, AReplicaOfOneMicroBatchHidesItsTreeSumBehindTheWholeBackward) {
  Profile p = base_profile(2);
  DeviceProfile d;
  d.block_fwd = {0, 0.01};
  d.block_bwd = {0, 0.02};
  d.embed_fwd = d.head_fwd = {0, 0.005};
  d.embed_bwd = d.head_bwd = {0, 0.005};
  d.optimizer_s_per_param = 0;
  p.devices["t"] = d;
  const ClusterSpec c = two_regions();
  auto replicas = [&](int64_t m, int64_t count) {
    Plan plan;
    plan.global_batch = 32;
    plan.grad_sync.bucket_mb = 1;
    for (int r = 0; r < 4; ++r) plan.pipelines.push_back({m, count, {stage(r, 0, 2, c.devices[static_cast<size_t>(r)].name)}});
    return simulate_plan(plan, c, p);
  };
  const PlanCost four = replicas(2, 4), one = replicas(8, 1);
  ASSERT_EQ(four.sync_groups.size(), 1u);
  EXPECT_EQ(one.sync_groups[0].stripes, 2);
  EXPECT_NEAR(four.phase_s, one.phase_s, 1e-12);  // 8 samples of 0.07 s, 0.56 s
  EXPECT_NEAR(four.sync_groups[0].time_s, one.sync_groups[0].time_s, 1e-12);
  // The sum takes about 0.26 s: in one micro-batch all but its last buckets overlap the 0.4 s
  // backward; in four, only the last 0.1 s of it.
  EXPECT_GT(one.sync_groups[0].time_s, 0.2);
  EXPECT_LT(one.step_s + 0.05, four.step_s);
  EXPECT_LT(one.sync_done_s - one.phase_s + 0.05, four.sync_done_s - four.phase_s);
}

// The 3-device pool's shape: a - b and b - c fast (1 GB/s), a - c slow (10 MB/s). A ring of all three
// replicas crosses a - c; the tree through b carries the 6 MB each way over the fast links only:
// one bucket takes its bytes plus one chunk (depth 1: a chunk up, then down) over 1 GB/s. The
// root moves the set over both its edges, so its sync's CPU time is twice a leaf's. The search
// prices the plan it returns the same way, and `allreduce: ring` prices the ring.
TEST(CostModel, AnExactSetAroundASlowLinkSumsAlongATree) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h1", "t"), device("c", "h2", "t")};
  c.rules.push_back({"h0", "h1", Link{8, 0}});
  c.rules.push_back({"h1", "h2", Link{8, 0}});
  c.rules.push_back({"h0", "h2", Link{0.08, 0}});
  Plan plan;
  plan.global_batch = 3;
  for (int r = 0; r < 3; ++r) plan.pipelines.push_back({1, 1, {stage(r, 0, 2, c.devices[static_cast<size_t>(r)].name)}});
  const PlanCost tree = simulate_plan(plan, c, p);
  ASSERT_EQ(tree.sync_groups.size(), 1u);
  const auto& g = tree.sync_groups[0];
  EXPECT_TRUE(g.tree);
  EXPECT_DOUBLE_EQ(g.bytes, 6e6);
  EXPECT_NEAR(g.slowest_bytes_per_s, 1e9, 1e-3);
  EXPECT_NEAR(g.time_s, (6e6 + 256.0 * 1024) / 1e9, 1e-12);
  // Smaller buckets pipeline along the tree (dist/tree_allreduce.h): the chain pays the round trip
  // once, each bucket its bytes.
  Plan small = plan;
  small.grad_sync.bucket_mb = 1;
  const SyncGroupCost gs = simulate_plan(small, c, p).sync_groups[0];
  EXPECT_GT(gs.buckets, 2);
  EXPECT_NEAR(gs.time_s, g.time_s, 1e-12);
  Plan ring = plan;
  ring.grad_sync.allreduce = "ring";
  const PlanCost r = simulate_plan(ring, c, p);
  EXPECT_FALSE(r.sync_groups[0].tree);
  EXPECT_NEAR(r.sync_groups[0].time_s, 2.0 * 2 / 3 * 6e6 / 1e7, 1e-9);
  EXPECT_LT(tree.step_s + 0.7, r.step_s);

  CostContext ctx(c, p);
  const CostContext::SyncShape s = ctx.sync_shape({0, 1, 2}, nullptr, 6e6);
  ASSERT_TRUE(s.tree);
  EXPECT_EQ(s.sum_tree.parent, (std::vector<int>{1, -1, 1}));
  p.devices["t"].comm_cpu_s_per_byte = 1e-9;
  CostContext cpu(c, p);
  EXPECT_NEAR(cpu.sync_cpu_s(0, s, 6e6, 3, 1), 2 * cpu.sync_cpu_s(0, s, 6e6, 3, 0), 1e-15);
  EXPECT_NEAR(cpu.sync_cpu_s(0, s, 6e6, 3, 0), 2 * 6e6 * 1e-9, 1e-15);
  // The slow link carries nothing of it: a ring of a and c beside it gets that link whole, while a
  // ring of a and b shares its link with the tree's edge.
  CostContext::LinkLoads loads = ctx.empty_loads();
  ctx.add_load({0, 1, 2}, 6e6, &loads);
  ctx.add_load({0, 2}, 6e6, &loads);
  EXPECT_NEAR(ctx.ring({0, 2}, &loads, 6e6).slowest_bytes_per_s, 1e7, 1e-3);
  CostContext::LinkLoads beside = ctx.empty_loads();
  ctx.add_load({0, 1, 2}, 6e6, &beside);
  ctx.add_load({0, 1}, 6e6, &beside);
  EXPECT_NEAR(ctx.ring({0, 1}, &beside, 6e6).slowest_bytes_per_s, 0.5e9, 1e-3);

  SearchOptions o;
  o.global_batch = 3;
  o.fit_memory = false;
  const SearchResult best = search(c, p, o);
  EXPECT_NEAR(best.search_step_s, simulate_plan(best.plan, c, p).step_s, 1e-9 * best.search_step_s);
}

// A link that carries several edges of one tree (a host chaining its members over its own line)
// shares its bandwidth among them once: the set's own crossings are in the link loads it is priced
// with, so they must not be counted again on top (they were: 512 devices on 16 hosts priced their
// sum 62 x 62 times too slow on every host's line, 438 s a step where 9 s is the model's figure).
// a, b, c on h0 (their line 0.8 Gbit/s), d on h1, e on h2; h0 - h1 is slow, so the sum runs along
// a tree: a - b - c on h0's line (two edges, each crossing it both ways: 4 crossings), c - e, e - d.
TEST(CostModel, ATreesOwnEdgesOnOneLinkShareItOnce) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h0", "t"), device("c", "h0", "t"), device("d", "h1", "t"),
               device("e", "h2", "t")};
  c.intra_host = Link{0.8, 0};
  c.rules.push_back({"h0", "h2", Link{8, 0}});
  c.rules.push_back({"h1", "h2", Link{8, 0}});
  c.rules.push_back({"h0", "h1", Link{0.08, 0}});
  CostContext ctx(c, p);
  const std::vector<int> all{0, 1, 2, 3, 4};
  const double B = 6e6;
  const CostContext::SyncShape alone = ctx.sync_shape(all, nullptr, B);
  ASSERT_TRUE(alone.tree);
  ASSERT_EQ(alone.sum_tree.stripes, 1);  // no slow pair crossed: one stripe
  EXPECT_EQ(alone.sum_tree.parent[0], 1);
  EXPECT_EQ(alone.sum_tree.parent[3], 4);
  EXPECT_NEAR(alone.sum_tree.slowest_bytes_per_s, 1e8 / 4, 1e-3);
  // Priced among the loads of every set, itself included (as the search and simulate_plan do):
  // the same four crossings, not sixteen.
  CostContext::LinkLoads own = ctx.empty_loads();
  ctx.add_load(all, B, &own);
  EXPECT_NEAR(ctx.sync_shape(all, &own, B).sum_tree.slowest_bytes_per_s, 1e8 / 4, 1e-3);
  // A ring of a and b beside it puts its 6 MB on that line both ways: six set-sized loads.
  CostContext::LinkLoads beside = ctx.empty_loads();
  ctx.add_load(all, B, &beside);
  ctx.add_load({0, 1}, B, &beside);
  EXPECT_NEAR(ctx.sync_shape(all, &beside, B).sum_tree.slowest_bytes_per_s, 1e8 / 6, 1e-3);
  // simulate_plan prices five replicas the same way.
  Plan plan;
  plan.global_batch = 5;
  for (int r = 0; r < 5; ++r) plan.pipelines.push_back({1, 1, {stage(r, 0, 2, c.devices[static_cast<size_t>(r)].name)}});
  const PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  EXPECT_TRUE(pc.sync_groups[0].tree);
  EXPECT_NEAR(pc.sync_groups[0].slowest_bytes_per_s, 1e8 / 4, 1e-3);
}

// The step's world sum (loss, norm, sync figures) goes along the tree of the fast links, as the
// trainer routes it: the longest path's latencies up and down.
TEST(CostModel, TheStepsWorldSumFollowsTheTree) {
  Profile p = base_profile(4);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("e0", "eu0", "t"), device("e1", "eu1", "t"), device("u0", "us0", "t"), device("u1", "us1", "t")};
  c.default_link = Link{1, 0.1};
  for (const char* e : {"eu0", "eu1"})
    for (const char* u : {"us0", "us1"}) c.rules.push_back({e, u, Link{0.1, 40}});
  const CostContext ctx(c, p);
  // Tree: e0 - e1 - u0 - u1 rooted at the edge e1 - u0 (sync_tree). e0's figures go to e1 and
  // u1's to u0, the two ends swap their sums across the slow pair at once, and each sends the total
  // on: the slow link's latency once, not up and back.
  const double fast = 0.1e-3 + CostContext::kWorldSumBytes / (1e9 / 8), slow = 40e-3 + CostContext::kWorldSumBytes / (0.1e9 / 8);
  EXPECT_NEAR(ctx.world_allreduce_s(), slow + 2 * fast, 1e-12);
  Plan dp;
  dp.global_batch = 4;
  for (int r = 0; r < 4; ++r) dp.pipelines.push_back({1, 1, {stage(r, 0, 4, c.devices[static_cast<size_t>(r)].name)}});
  EXPECT_NEAR(simulate_plan(dp, c, p).world_allreduce_s, ctx.world_allreduce_s(), 1e-12);
  // Told to sum along rings, the trainer sends every member's figures straight to the others'
  // receives posted at the step's start: the longest latency once (the ring's hop between the
  // regions), and each member's uplink carries its figures 3 times.
  dp.grad_sync.allreduce = "ring";
  EXPECT_NEAR(simulate_plan(dp, c, p).world_allreduce_s, 40e-3 + 3 * CostContext::kWorldSumBytes / (0.1e9 / 8), 1e-9);
}

// Sets whose rings cross the same link share it: a link carrying two equal sets gives each half.
TEST(CostModel, SetsCrossingOneLinkShareItsBandwidth) {
  Profile p = base_profile(4);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a0", "h0", "t"), device("a1", "h0", "t"), device("b0", "h1", "t"), device("b1", "h1", "t")};
  c.rules.push_back({"h0", "h1", Link{8e6 / 1e9, 0}});
  c.intra_host = Link{1000, 0};
  CostContext ctx(c, p);
  CostContext::LinkLoads loads = ctx.empty_loads();
  ctx.add_load({0, 2}, 4e6, &loads);
  ctx.add_load({1, 3}, 4e6, &loads);
  EXPECT_NEAR(ctx.ring({0, 2}).slowest_bytes_per_s, 1e6, 1e-6);
  EXPECT_NEAR(ctx.ring({0, 2}, &loads, 4e6).slowest_bytes_per_s, 0.5e6, 1e-6);
  // Unequal: the small set finishes first, so it gets half only for its own bytes.
  CostContext::LinkLoads uneven = ctx.empty_loads();
  ctx.add_load({0, 2}, 1e6, &uneven);
  ctx.add_load({1, 3}, 3e6, &uneven);
  EXPECT_NEAR(ctx.ring({0, 2}, &uneven, 1e6).slowest_bytes_per_s, 0.5e6, 1e-6);
  EXPECT_NEAR(ctx.ring({1, 3}, &uneven, 3e6).slowest_bytes_per_s, 1e6 * 3 / 4, 1e-6);
  // In a plan: two pipelines across the link, each pipeline's blocks held by a device on each
  // host, so both block sets cross the same host pair at once.
  Plan plan;
  plan.global_batch = 2;
  plan.pipelines.push_back({1, 1, {stage(0, 0, 2, "a0"), stage(2, 2, 4, "b0")}});
  plan.pipelines.push_back({1, 1, {stage(3, 0, 2, "b1"), stage(1, 2, 4, "a1")}});
  PlanCost pc = simulate_plan(plan, c, p);
  // Sets {0, 3} (blocks 0-1 + embedding) and {1, 2} (blocks 2-3 + head), 4 MB each, both across;
  // each way of the link also carries one pipeline's last gradient message (1 sample: 16 x 32 x 4 bytes).
  ASSERT_EQ(pc.sync_groups.size(), 2u);
  const double msg = 16 * 32 * 4;
  for (const auto& g : pc.sync_groups) {
    EXPECT_DOUBLE_EQ(g.bytes, 4e6);
    EXPECT_NEAR(g.slowest_bytes_per_s, 1e6 * 4e6 / (4e6 + 4e6 + msg), 1e-6);
  }
}

// A pipeline's last micro-batch sends its gradients back while the sets of its stages sync: that
// message shares the hop with a set crossing it at the same time, the way sets share among
// themselves. The search prices the plan it returns the same way.
TEST(CostModel, APipelinesLastGradientMessageSharesTheLinkWithTheSyncingSets) {
  Profile p = base_profile(4);
  p.model.seq_len = 1024, p.model.hidden = 256;  // 1 MB of activations per sample and message
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("c", "h0", "t"), device("b", "h1", "t")};
  c.rules.push_back({"h0", "h1", Link{8e6 / 1e9, 0}});  // 1 MB/s each way
  c.intra_host = Link{1000, 0};
  Plan plan;
  plan.global_batch = 8;
  plan.pipelines.push_back({2, 2, {stage(0, 0, 2, "a"), stage(2, 2, 4, "b")}});
  plan.pipelines.push_back({2, 2, {stage(1, 0, 4, "c")}});
  const PlanCost pc = simulate_plan(plan, c, p);
  // Blocks 2-3 + head (4 MB) are held by b (h1) and c (h0): their ring crosses the link both ways,
  // and the way back (h1 -> h0) also carries b's last gradient message to a: 2 samples of 1 MiB.
  const SyncGroupCost* across = nullptr;
  for (const auto& g : pc.sync_groups)
    if (g.ranks == std::vector<int>{1, 2}) across = &g;
  ASSERT_NE(across, nullptr);
  EXPECT_DOUBLE_EQ(across->bytes, 4e6);
  const double msg = 2.0 * 1024 * 256 * 4;
  EXPECT_NEAR(across->slowest_bytes_per_s, 1e6 * 4e6 / (4e6 + msg), 1e-6);
  // A pipeline inside one host sends nothing across: the two sets that cross (blocks 0-1 and
  // embedding {a, b}, blocks 2-3 and head {c, b}) share the link between themselves only.
  Plan inside = plan;
  inside.pipelines[0].stages = {stage(0, 0, 2, "a"), stage(1, 2, 4, "c")};
  inside.pipelines[1].stages = {stage(2, 0, 4, "b")};
  const PlanCost in = simulate_plan(inside, c, p);
  ASSERT_EQ(in.sync_groups.size(), 2u);
  for (const auto& g : in.sync_groups) EXPECT_NEAR(g.slowest_bytes_per_s, 0.5e6, 1e-6);
  // The search's figure for its own plan is simulate_plan's.
  SearchOptions o;
  o.global_batch = 8;
  o.fit_memory = false;
  const SearchResult r = search(c, p, o);
  EXPECT_NEAR(r.search_step_s, simulate_plan(r.plan, c, p).step_s, 1e-9 * r.search_step_s);
}

TEST(CostModel, OnlyTheLastBucketIsExposedOnAFastLink) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h0", "t")};  // same host: 100 Gbps
  Plan plan;
  plan.global_batch = 2;
  plan.grad_sync.bucket_mb = 1;
  plan.pipelines.push_back({1, 1, {stage(0, 0, 2, "a")}});
  plan.pipelines.push_back({1, 1, {stage(1, 0, 2, "b")}});
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  const auto& g = pc.sync_groups[0];
  // Last backward [1.5, 4.5] on both: head ready at 2, block 1 at 3, block 0 at 4, embedding at
  // 4.5. Every bucket but the embedding's is reduced while the backward still runs.
  EXPECT_NEAR(g.ready_s, 2.0, 1e-12);
  EXPECT_LT(g.time_s, 0.5);
  // Six collectives of 1e6 bytes each; the embedding's two are a third of the set's time.
  EXPECT_EQ(g.buckets, 6);
  EXPECT_NEAR(pc.stages[0].sync_exposed_s, g.time_s / 3, 1e-12);
  EXPECT_GT(pc.stages[0].sync_exposed_s, 0);
  EXPECT_NEAR(pc.sync_done_s, 4.5 + g.time_s / 3, 1e-12);

  // One bucket for everything: it waits for the embedding and is exposed whole.
  plan.grad_sync.bucket_mb = 25;
  PlanCost one = simulate_plan(plan, c, p);
  EXPECT_EQ(one.sync_groups[0].buckets, 1);
  EXPECT_NEAR(one.sync_groups[0].ready_s, 4.5, 1e-12);
  EXPECT_NEAR(one.stages[0].sync_exposed_s, one.sync_groups[0].time_s, 1e-12);
}

TEST(CostModel, TiedEmbeddingIsSyncedBetweenFirstAndLastStage) {
  Profile p = base_profile(4, "gpt2");
  p.model.vocab_size = 1000;
  p.model.hidden = 250;  // wte = 1000 * 250 * 4 = 1e6 bytes, inside embed (2e6) and head (2e6)
  p.devices["t"] = flat(0.1, 0.2, 0.1, 0.2);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h0", "t")};
  Plan plan;
  plan.global_batch = 2;
  plan.pipelines.push_back({1, 2, {stage(0, 0, 2, "a"), stage(1, 2, 4, "b")}});
  PlanCost pc = simulate_plan(plan, c, p);
  ASSERT_EQ(pc.sync_groups.size(), 1u);
  EXPECT_EQ(pc.sync_groups[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_DOUBLE_EQ(pc.sync_groups[0].bytes, 1e6);
  // Stage 0 holds 2 blocks + wte + wpe; stage 1 holds 2 blocks + ln_f + its wte copy.
  EXPECT_DOUBLE_EQ(pc.stages[0].param_bytes, 2e6 + 2e6);
  EXPECT_DOUBLE_EQ(pc.stages[1].param_bytes, 2e6 + 2e6);
  // A one-stage pipeline holds wte once.
  Plan one;
  one.global_batch = 1;
  one.pipelines.push_back({1, 1, {stage(0, 0, 4, "a")}});
  Plan two = one;
  two.global_batch = 2;
  two.pipelines.push_back({1, 1, {stage(1, 0, 4, "b")}});
  EXPECT_DOUBLE_EQ(simulate_plan(two, c, p).stages[0].param_bytes, 4e6 + 2e6 + 2e6 - 1e6);
}

TEST(CostModel, MemoryOverflowNamesTheDeviceAndBytes) {
  Profile p = base_profile(4);
  p.devices["t"] = flat(0.1, 0.2, 0.1, 0.2);
  ClusterSpec c;
  c.devices = {device("big", "h0", "t", 1.0), device("tiny", "h0", "t", 0.015625)};
  Plan plan;
  plan.global_batch = 2;
  plan.pipelines.push_back({1, 2, {stage(0, 0, 1, "big"), stage(1, 1, 4, "tiny")}});
  PlanCost pc = simulate_plan(plan, c, p);
  EXPECT_FALSE(pc.fits);
  EXPECT_TRUE(pc.stages[0].fits);
  EXPECT_FALSE(pc.stages[1].fits);
  // tiny: 3 blocks + head = 5e6 bytes * 4 = 2e7 + activations 1 * 1 * (3*2e5 + 4e5) + the
  // backward's working set 1 * 2e5 + the 2 gradient messages it sends back (1 x 16 x 32 floats
  // each) = 21204096 > 1.5625e7.
  EXPECT_DOUBLE_EQ(pc.stages[1].memory_bytes, 2.12e7 + 2 * 2048);
  EXPECT_NE(pc.explanation.find("'tiny'"), std::string::npos) << pc.explanation;
  EXPECT_NE(pc.explanation.find("21204096 bytes"), std::string::npos) << pc.explanation;
  EXPECT_NE(pc.explanation.find("over by"), std::string::npos) << pc.explanation;
  EXPECT_NE(pc.explanation.find("5579096 bytes"), std::string::npos) << pc.explanation;
  EXPECT_EQ(pc.to_json()["fits"], false);
}

TEST(CostModel, RejectsUnknownDevicesTypesAndDeadLinks) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.1, 0.2, 0.1, 0.2);
  ClusterSpec c;
  c.devices = {device("a", "h0", "t")};
  Plan plan;
  plan.global_batch = 1;
  plan.pipelines.push_back({1, 1, {stage(0, 0, 2, "nope")}});
  EXPECT_THROW(simulate_plan(plan, c, p), InputError);
  plan.pipelines[0].stages[0].device = "";
  EXPECT_THROW(simulate_plan(plan, c, p), InputError);
  plan.pipelines[0].stages[0].device = "a";
  c.devices[0].type = "unprofiled";
  try {
    simulate_plan(plan, c, p);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("unprofiled"), std::string::npos);
  }
  c.devices[0].type = "t";
  c.devices.push_back(device("b", "h1", "t"));
  c.rules.push_back({"h0", "h1", Link{0, 1}});
  EXPECT_THROW(simulate_plan(plan, c, p), InputError);
}

TEST(CostModel, PipelineLinkSharesCountPipelinesPerHostPair) {
  ClusterSpec c;
  for (int h = 0; h < 4; ++h) c.devices.push_back(device("d" + std::to_string(h), "h" + std::to_string(h), "t"));
  Profile p = base_profile(4);
  p.devices["t"] = dev_profile(1);
  const CostContext ctx(c, p);
  // Three pipelines cross h0-h1 (one of them backwards: its gradients go h0 -> h1), one stays in
  // h0, one crosses h2-h3 alone, one crosses h0-h1 twice and counts once.
  const auto k = ctx.pipeline_link_shares({{0, 1}, {0, 1}, {1, 0}, {0, 0}, {2, 3}, {0, 1, 0}});
  const std::vector<std::vector<int>> want = {{4}, {4}, {4}, {1}, {1}, {4, 4}};
  EXPECT_EQ(k, want);
  EXPECT_DOUBLE_EQ(ctx.p2p_s(0, 1, 2, 3) - ctx.link_latency_s(0, 1), 3 * (ctx.p2p_s(0, 1, 2) - ctx.link_latency_s(0, 1)));
}

// A `shared` rule is one line between two sites: pipelines and sets crossing it between
// different host pairs share it as those crossing one pair do; without the flag each pair has
// its own path.
TEST(CostModel, ASharedRuleIsOneLinkForEveryPairItCovers) {
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "per pair");
    ClusterSpec c;
    c.devices = {device("e1", "e1", "t"), device("e2", "e2", "t"), device("u1", "u1", "t"), device("u2", "u2", "t")};
    c.groups = {{"eu", {"e1", "e2"}}, {"us", {"u1", "u2"}}};
    c.rules.push_back({"eu", "us", Link{8e6 / 1e9, 0}, shared});
    c.rules.push_back({"eu", "eu", Link{8, 0}});
    Profile p = base_profile(4);
    p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
    const CostContext ctx(c, p);
    const int k = shared ? 2 : 1;
    // Hosts e1, e2, u1, u2 are 0..3. Two pipelines crossing from different pairs, one the other
    // way (its gradients meet the others' activations), one inside eu.
    const auto got = ctx.pipeline_link_shares({{0, 2}, {1, 3}, {0, 1}});
    EXPECT_EQ(got, (std::vector<std::vector<int>>{{k}, {k}, {1}}));
    EXPECT_EQ(ctx.pipeline_link_shares({{0, 2}, {3, 1}}), (std::vector<std::vector<int>>{{k}, {k}}));
    // Two sets, e1-u1 and e2-u2: each ring crosses both ways once.
    CostContext::LinkLoads loads = ctx.empty_loads();
    ctx.add_load({0, 2}, 4e6, &loads);
    ctx.add_load({1, 3}, 4e6, &loads);
    EXPECT_NEAR(ctx.ring({0, 2}, &loads, 4e6).slowest_bytes_per_s, 1e6 / k, 1e-6);
    // A set inside eu is not slowed by them.
    CostContext::LinkLoads mixed = ctx.empty_loads();
    ctx.add_load({0, 2}, 4e6, &mixed);
    ctx.add_load({0, 1}, 4e6, &mixed);
    EXPECT_NEAR(ctx.ring({0, 2}, &mixed, 4e6).slowest_bytes_per_s, 1e6, 1e-6);
    EXPECT_NEAR(ctx.ring({0, 1}, &mixed, 4e6).slowest_bytes_per_s, 1e9, 1e-3);
    // In a plan: two pipelines across the regions from different pairs; on the shared line each
    // message takes twice as long.
    Plan plan;
    plan.global_batch = 4;
    plan.pipelines.push_back({1, 2, {stage(0, 0, 2, "e1"), stage(2, 2, 4, "u1")}});
    plan.pipelines.push_back({1, 2, {stage(1, 0, 2, "e2"), stage(3, 2, 4, "u2")}});
    const PlanCost pc = simulate_plan(plan, c, p);
    for (const auto& st : pc.stages)
      if (st.stage == 0) EXPECT_NEAR(st.p2p_s, 2 * ctx.p2p_s(0, 2, 1, k), 1e-9);
  }
}
