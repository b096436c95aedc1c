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

namespace {

bool near_rel(double a, double b, double rel = 1e-9) { return std::fabs(a - b) <= rel * std::max({1e-300, std::fabs(a), std::fabs(b)}); }

// Devices a (host h0) and b (host h1), both of type "t", joined by one link.
ClusterSpec two_hosts(double bandwidth_gbps, double latency_ms) {
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h1", "t")};
  c.rules.push_back({"h0", "h1", Link{bandwidth_gbps, latency_ms}});
  return c;
}

void expect_uses_every_device(const SearchResult& r, const ClusterSpec& c, const Profile& p) {
  EXPECT_NO_THROW(r.plan.validate(p.model));
  std::set<int> seen;
  for (const auto& pl : r.plan.pipelines)
    for (const auto& st : pl.stages) {
      ASSERT_EQ(st.ranks.size(), 1u);
      const int rank = st.ranks[0];
      EXPECT_TRUE(seen.insert(rank).second) << "rank " << rank << " twice";
      ASSERT_GE(rank, 0);
      ASSERT_LT(rank, static_cast<int>(c.devices.size()));
      EXPECT_EQ(st.device, c.devices[static_cast<size_t>(rank)].name);
    }
  EXPECT_EQ(seen.size(), c.devices.size());
  EXPECT_TRUE(r.cost.fits) << r.cost.explanation;
  EXPECT_TRUE(near_rel(r.search_step_s, r.cost.step_s)) << r.search_step_s << " vs " << r.cost.step_s;
}

}  // namespace

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

namespace {

// Costs independent of the micro-batch size, so the arithmetic below is easy to follow.
DeviceProfile flat(double block_f, double block_b, double end_f, double end_b) {
  DeviceProfile d;
  d.block_fwd = {block_f, 0};
  d.block_bwd = {block_b, 0};
  d.embed_fwd = d.head_fwd = {end_f, 0};
  d.embed_bwd = d.head_bwd = {end_b, 0};
  d.optimizer_s_per_param = 0;
  return d;
}

}  // namespace

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
    // World all-reduce over 2 ranks: 2(n-1)/n = 1 times the ring's latencies (0.25 each way) + the figures' bytes.
    const double figures = CostContext::kWorldSumBytes / 512;
    EXPECT_NEAR(pc.world_allreduce_s, 0.5 + figures, 1e-9);
    EXPECT_NEAR(pc.step_s, 10.0 + 0.5 + figures, 1e-9) << sched;
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

TEST(Search, RefineUnitsMovesABoundaryInsideABlockWhenThatBalancesAPipeline) {
  // Three blocks on two equal devices: whole blocks split 2:1; halves split 1.5:1.5.
  Profile p = base_profile(3);
  p.devices["t"] = flat(1.0, 2.0, 0, 0);
  p.devices["t"].attn_share_fwd = p.devices["t"].attn_share_bwd = 0.5;
  ClusterSpec c = two_hosts(100, 0);
  SearchResult r;
  r.strategy = "alloy";
  r.plan.global_batch = 4;
  r.plan.pipelines.push_back({1, 4, {stage(0, 0, 2, "a"), stage(1, 2, 3, "b")}});
  r.cost = simulate_plan(r.plan, c, p);
  const double before = r.cost.step_s;
  SearchOptions o;
  o.global_batch = 4;
  refine_units(r, c, p, o);
  ASSERT_EQ(r.plan.pipelines[0].stages.size(), 2u);
  EXPECT_EQ(r.plan.pipelines[0].stages[0].unit_end(), 3);
  EXPECT_EQ(r.plan.pipelines[0].stages[1].unit_begin(), 3);
  EXPECT_LT(r.cost.step_s, before * 0.95);  // 25 s -> 22.5 s
  EXPECT_EQ(r.cost.step_s, simulate_plan(r.plan, c, p).step_s);
  EXPECT_EQ(r.plan.predicted["step_s"], r.cost.step_s);
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.back().find("inside blocks"), std::string::npos) << r.notes.back();
  // Already balanced: nothing moves, no note.
  SearchResult again = r;
  again.notes.clear();
  refine_units(again, c, p, o);
  EXPECT_EQ(again.plan.to_json(), r.plan.to_json());
  EXPECT_TRUE(again.notes.empty());
}

namespace {
// Four blocks on a device twice as fast as the other, 3 : 1 in 24 micro-batches of 1: the pool the
// floating and cut boundaries' tests refine.
struct TwoSpeedPipeline {
  Profile p = base_profile(4);
  ClusterSpec c;
  SearchResult r;
  TwoSpeedPipeline() {
    p.devices["fast"] = flat(1.0, 2.0, 0, 0);
    p.devices["slow"] = flat(2.0, 4.0, 0, 0);
    p.devices["fast"].attn_share_fwd = p.devices["fast"].attn_share_bwd = 0.5;
    p.devices["slow"].attn_share_fwd = p.devices["slow"].attn_share_bwd = 0.5;
    p.memory.param_bytes_per_block = p.memory.param_bytes_embed = p.memory.param_bytes_head = 1;  // no sync to speak of
    c.devices = {device("a", "h0", "fast"), device("b", "h1", "slow")};
    c.rules.push_back({"h0", "h1", Link{100, 0}});
    r.strategy = "alloy";
    r.plan.global_batch = 24;
    r.plan.pipelines.push_back({1, 24, {stage(0, 0, 3, "a"), stage(1, 3, 4, "b")}});
    r.cost = simulate_plan(r.plan, c, p);
  }
  // Neither cuts nor floats: half blocks only.
  SearchOptions options() const {
    SearchOptions o;
    o.global_batch = 24;
    o.float_boundaries = false;
    o.mlp_cuts = false;
    return o;
  }
  SearchResult halves() const {
    SearchResult h = r;
    refine_units(h, c, p, options());
    return h;
  }
};
}  // namespace

TEST(Search, ACutMlpBalancesAPipelineThatHalfBlocksCannot) {
  // As below: four blocks on a device twice as fast as the other want 2.67 : 1.33 blocks. A cut
  // inside block 2's MLP (the fast device computing the columns of k of the 4 heads, in every
  // micro-batch) gives 2.5 + k/8 blocks: the search takes k = 1 or 2, and the slow stage idles less.
  TwoSpeedPipeline pool;
  const Profile& p = pool.p;
  const ClusterSpec& c = pool.c;
  SearchResult& r = pool.r;
  SearchOptions o = pool.options();
  const SearchResult halves = pool.halves();
  EXPECT_FALSE(halves.plan.cuts_mlp());
  o.mlp_cuts = true;
  refine_units(r, c, p, o);
  const PipelinePlan& pl = r.plan.pipelines[0];
  ASSERT_TRUE(pl.stages[0].cuts_mlp()) << r.plan.describe();
  EXPECT_EQ(pl.stages[0].unit_end() % 2, 0);  // inside an MLP half
  EXPECT_EQ(pl.stages[0].unit_end() - pl.stages[1].unit_begin(), 1);
  const double fast_blocks = (pl.stages[1].unit_begin() + static_cast<double>(pl.stages[0].mlp_cut) / 4) / 2;
  EXPECT_GT(fast_blocks, 2.5) << r.plan.describe();
  EXPECT_LT(fast_blocks, 3.0) << r.plan.describe();
  EXPECT_LT(r.cost.step_s, halves.cost.step_s * 0.97);
  EXPECT_EQ(r.cost.step_s, simulate_plan(r.plan, c, p).step_s);
  auto idle = [](const PlanCost& pc) { return pc.stages[1].bubble_s / pc.pipelines[0].phase_s; };
  EXPECT_LT(idle(r.cost), idle(halves.cost) * 0.75) << r.plan.describe();
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.back().find("its last MLP's columns of"), std::string::npos) << r.notes.back();
  // The message across is the residual and the partial output: twice a hidden state each way.
  Plan whole = r.plan;
  whole.pipelines[0].stages[0].mlp_cut = 0;
  whole.pipelines[0].stages[1].set_units(pl.stages[0].unit_end(), 8);
  const PlanCost wc = simulate_plan(whole, c, p);
  EXPECT_GT(r.cost.stages[0].p2p_s, wc.stages[0].p2p_s * 1.5);
}

TEST(Search, EagerOneFOneBIsNotedAgainstTheSamePlanOnOneFOneB) {
  // Two equal devices in a pipeline of two blocks each, messages of 1 ms: 1F1B waits for them,
  // eager 1F1B hides them, and the plan says what 1F1B would have taken.
  Profile p = base_profile(4);
  p.devices["fast"] = flat(1.0, 2.0, 0, 0);
  p.memory.param_bytes_per_block = p.memory.param_bytes_embed = p.memory.param_bytes_head = 1;
  ClusterSpec c;
  c.devices = {device("a", "h0", "fast"), device("b", "h1", "fast")};
  c.rules.push_back({"h0", "h1", Link{100, 1}});
  SearchResult r;
  r.strategy = "alloy";
  r.plan.global_batch = 24;
  r.plan.pipelines.push_back({1, 24, {stage(0, 0, 2, "a"), stage(1, 2, 4, "b")}});
  r.plan.schedule = "eager-1f1b";
  r.cost = simulate_plan(r.plan, c, p);
  Plan one = r.plan;
  one.schedule = "1f1b";
  const PlanCost oc = simulate_plan(one, c, p);
  EXPECT_LT(r.cost.step_s, oc.step_s);
  note_eager_schedule(r, c, p);
  ASSERT_EQ(r.notes.size(), 1u);
  char want[80];
  std::snprintf(want, sizeof want, "against %.1f ms for the same plan on 1f1b", oc.step_s * 1e3);
  EXPECT_NE(r.notes[0].find("schedule: eager-1f1b"), std::string::npos) << r.notes[0];
  EXPECT_NE(r.notes[0].find(want), std::string::npos) << r.notes[0] << " / " << want;
  // A pipeline of its own on eager under a 1F1B plan is noted alike; a plan without eager is not.
  SearchResult own = r;
  own.notes.clear();
  own.plan.schedule = "1f1b";
  own.plan.pipelines[0].schedule = "eager-1f1b";
  note_eager_schedule(own, c, p);
  ASSERT_EQ(own.notes.size(), 1u);
  EXPECT_NE(own.notes[0].find(want), std::string::npos) << own.notes[0];
  SearchResult plain = r;
  plain.notes.clear();
  plain.plan = one;
  note_eager_schedule(plain, c, p);
  EXPECT_TRUE(plain.notes.empty());
}

TEST(Search, ACutOrFloatPredictedFasterByLessThanItsBarIsNotedNotKept) {
  // The slow device 1.8x slower: 4 blocks want 2.57 : 1.43, which half blocks nearly give (2.5 :
  // 1.5), so a cut or a float gains under its 5%: the plan keeps half blocks and says what each
  // would have predicted.
  TwoSpeedPipeline pool;
  pool.p.devices["slow"] = flat(1.8, 3.6, 0, 0);
  pool.p.devices["slow"].attn_share_fwd = pool.p.devices["slow"].attn_share_bwd = 0.5;
  pool.r.cost = simulate_plan(pool.r.plan, pool.c, pool.p);
  SearchOptions o = pool.options();
  o.mlp_cuts = o.float_boundaries = true;
  const SearchResult halves = pool.halves();
  SearchResult r = pool.r;
  refine_units(r, pool.c, pool.p, o);
  EXPECT_FALSE(r.plan.cuts_mlp()) << r.plan.describe();
  EXPECT_FALSE(r.plan.pipelines[0].floats()) << r.plan.describe();
  EXPECT_EQ(r.plan.to_json(), halves.plan.to_json());
  int noted = 0;
  for (const auto& n : r.notes)
    if (n.rfind("a boundary inside an MLP: not used", 0) == 0 || n.rfind("a floating boundary: not used", 0) == 0) {
      ++noted;
      EXPECT_NE(n.find("kept only for a predicted gain of 5%"), std::string::npos) << n;
    }
  EXPECT_GE(noted, 1);
}

TEST(Search, FloatingBoundaryBalancesAPipelineThatHalfBlocksCannot) {
  // Four blocks on a device twice as fast as the other want 2.67 : 1.33 blocks; half blocks give
  // 3 : 1 or 2.5 : 1.5. A floating boundary (unit 5 shared, the fast device running it in about
  // a share of the micro-batches) splits in between. (The model picks 2.75 : 1.25 over the
  // 2.67 : 1.33 of the totals: 1F1B pairs one micro-batch's forward with another's backward, and
  // the fill and drain favour the slow stage's lighter micro-batches.)
  TwoSpeedPipeline pool;
  const Profile& p = pool.p;
  const ClusterSpec& c = pool.c;
  SearchResult& r = pool.r;
  SearchOptions o = pool.options();  // (a cut would balance it too: ACutMlpBalancesAPipelineThatHalfBlocksCannot)
  const SearchResult halves = pool.halves();  // 3 : 1 and 2.5 : 1.5 tie: 3 blocks of time on one device
  EXPECT_FALSE(halves.plan.pipelines[0].floats());
  o.float_boundaries = true;
  refine_units(r, c, p, o);
  const PipelinePlan& pl = r.plan.pipelines[0];
  ASSERT_TRUE(pl.floats()) << r.plan.describe();
  EXPECT_EQ(pl.stages[0].unit_end() - pl.stages[1].unit_begin(), 1);
  // Work per micro-batch in blocks: fast 2.5 + its share of the shared half, slow the rest.
  const double fast_blocks = (pl.stages[1].unit_begin() + static_cast<double>(pl.float_count(0)) / pl.num_micro_batches) / 2;
  EXPECT_GT(fast_blocks, 2.5) << r.plan.describe();  // between what half blocks allow
  EXPECT_LT(fast_blocks, 3.0) << r.plan.describe();
  EXPECT_LT(r.cost.step_s, halves.cost.step_s * 0.97);
  EXPECT_EQ(r.cost.step_s, simulate_plan(r.plan, c, p).step_s);
  // The slow stage idles less: 25 of 205 s (a sixth of 219 s on half blocks).
  auto idle = [](const PlanCost& pc) { return pc.stages[1].bubble_s / pc.pipelines[0].phase_s; };
  EXPECT_GT(idle(halves.cost), 0.1);
  EXPECT_LT(idle(r.cost), idle(halves.cost) * 0.75) << r.plan.describe();
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.back().find("micro-batches)"), std::string::npos) << r.notes.back();
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
  EXPECT_NEAR(pc.world_allreduce_s, 2 * 0.010 + CostContext::kWorldSumBytes / 1e6, 1e-12);
  EXPECT_NEAR(pc.step_s, 6.5 + sync + pc.world_allreduce_s, 1e-9);
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

// --- Stragglers: a synchronous step waits for the slowest draw ------------------------------

TEST(ExpectedMax, KnownValues) {
  EXPECT_EQ(expected_max({}), 0);
  EXPECT_EQ(expected_max({{2.5, 0.3}}), 2.5);
  EXPECT_EQ(expected_max({{1.0, 0}, {3.0, 0}, {2.0, 0}}), 3.0);
  // Two independent N(mu, s): mu + s / sqrt(pi), whatever the order.
  EXPECT_NEAR(expected_max({{2, 0.1}, {2, 0.1}}), 2 + 0.1 / std::sqrt(M_PI), 1e-12);
  // Unequal spreads: mu + sqrt(s1^2 + s2^2) / sqrt(2 pi).
  EXPECT_NEAR(expected_max({{1, 0.3}, {1, 0.4}}), 1 + 0.5 / std::sqrt(2 * M_PI), 1e-12);
  // One far behind: its mean.
  EXPECT_NEAR(expected_max({{1, 0.1}, {5, 0.1}}), 5, 1e-12);
  // Equal draws: E[max of W standard normals] (tabulated: 0.8462843753 for 3, 1.0293753730 for 4,
  // 1.4236003060 for 8).
  EXPECT_NEAR(expected_max(std::vector<std::pair<double, double>>(3, {0, 1})), 0.8462843753, 1e-9);
  EXPECT_NEAR(expected_max(std::vector<std::pair<double, double>>(4, {0, 1})), 1.0293753730, 1e-9);
  EXPECT_NEAR(expected_max(std::vector<std::pair<double, double>>(8, {5, 2})), 5 + 2 * 1.4236003060, 2e-9);
  // A steady floor beside draws: max(0, Z) has mean 1/sqrt(2 pi); two steady values, the larger.
  EXPECT_NEAR(expected_max({{0, 0}, {-3, 0}, {0, 1}}), 1 / std::sqrt(2 * M_PI), 1e-9);
  EXPECT_EQ(expected_max({{0, 0}, {-3, 0}, {4, 0}}), 4);
  // What cannot be a timing gives NaN at once (never an integration that does not converge).
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(expected_max({{0, 1}, {1, 1}, {nan, 1}})));
  EXPECT_TRUE(std::isnan(expected_max({{0, 1}, {1, 1}, {2, inf}})));
  EXPECT_TRUE(std::isnan(expected_max({{0, 1}, {1, 1}, {nan, 0}})));
  // Unequal spreads beyond two, against the integral done here by the midpoint rule on a fine grid.
  {
    const std::vector<std::pair<double, double>> x = {{1.0, 0.2}, {1.1, 0.05}, {0.9, 0.4}, {1.05, 0}};
    double e = 1.05, dt = 1e-5;
    for (double t = 1.05; t < 4; t += dt) {
      double below = 1;
      for (const auto& [mu, sd] : x)
        if (sd > 0) below *= 0.5 * std::erfc(-(t + dt / 2 - mu) / (sd * std::sqrt(2.0)));
      e += (1 - below) * dt;
    }
    EXPECT_NEAR(expected_max(x), e, 1e-7);
  }
  // The case moment matching missed by 6% of the spread (found by the property below):
  // 0.33 + integral over t > 0.33 of P(0.17 + 0.21 Z > t) = 0.33 + 0.21 * (phi(c) - c (1 - Phi(c))),
  // c = 0.16 / 0.21.
  const double c = 0.16 / 0.21, tail = std::exp(-c * c / 2) / std::sqrt(2 * M_PI) - c * 0.5 * std::erfc(c / std::sqrt(2.0));
  EXPECT_NEAR(expected_max({{0.33, 0}, {0.32, 0}, {0.17, 0.21}}), 0.33 + 0.21 * tail, 1e-9);
}

namespace {
// E[max] by the midpoint rule on a fine grid: the reference the properties compare with.
double expected_max_midpoint(const std::vector<std::pair<double, double>>& x, double dt) {
  double floor = -1e300, lo = -1e300, hi = -1e300;
  for (const auto& [mu, sd] : x) {
    if (sd == 0) floor = std::max(floor, mu);
    else lo = std::max(lo, mu - 10 * sd), hi = std::max(hi, mu + 10 * sd);
  }
  if (hi <= floor) return std::max(floor, hi);
  lo = std::max(lo, floor);
  double e = lo;
  for (double t = lo + dt / 2; t < hi; t += dt) {
    double below = 1;
    for (const auto& [mu, sd] : x)
      if (sd > 0) below *= 0.5 * std::erfc(-(t - mu) / (sd * std::sqrt(2.0)));
    e += (1 - below) * dt;
  }
  return e;
}
}  // namespace

// Sampling checks what the integral means (the mean of the largest draw) on inputs whose tails the
// samples see, with fixed seeds: nothing here depends on the run.
TEST(ExpectedMax, AgreesWithSamplingOnFixedInputs) {
  const std::vector<std::vector<std::pair<double, double>>> cases = {
      {{1.0, 0.2}, {1.1, 0.05}, {0.9, 0.4}},
      {{0.33, 0}, {0.32, 0}, {0.17, 0.21}},
      {{2.0, 0.5}, {2.0, 0.5}, {2.0, 0.5}, {2.0, 0.5}, {1.0, 1.0}},
      {{0.5, 0.1}, {0.6, 0.3}, {0.55, 0}, {0.7, 0.02}, {0.4, 0.6}, {0.65, 0.15}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::mt19937_64 rng(1234 + i);
    std::normal_distribution<double> z;
    const int N = 200000;
    double sum = 0, sum2 = 0;
    for (int k = 0; k < N; ++k) {
      double m = -1e300;
      for (const auto& [mu, sd] : cases[i]) m = std::max(m, mu + sd * z(rng));
      sum += m, sum2 += m * m;
    }
    const double mean = sum / N, se = std::sqrt((sum2 / N - mean * mean) / N);
    EXPECT_NEAR(expected_max(cases[i]), mean, 5 * se) << "case " << i;
  }
}

// Any draws: the integration agrees with a plain midpoint integral and is never below the largest
// mean. (Against sampling, a tail rarer than one in the samples would fail by chance.)
RC_GTEST_PROP(ExpectedMax, AgreesWithAMidpointIntegral, ()) {
  const int n = *rc::gen::inRange(2, 7);
  std::vector<std::pair<double, double>> x;
  double smax = 0;
  for (int i = 0; i < n; ++i) {
    x.push_back({*rc::gen::inRange(0, 200) / 100.0, *rc::gen::inRange(0, 100) / 100.0});
    smax = std::max(smax, x.back().second);
  }
  const double e = expected_max(x);
  RC_ASSERT(e >= std::max_element(x.begin(), x.end())->first - 1e-12);
  // The midpoint rule's error is at most dt^2 / 24 times the integrand's total curvature, about
  // 0.8 / sd: with the smallest spread 0.01 and dt 2e-4, 1.3e-7.
  RC_ASSERT(std::fabs(e - expected_max_midpoint(x, 2e-4)) <= 1e-6 * (1 + smax));
}

TEST(Profiler, StepNoisePoolsTheRoundsScaledToOneSecond) {
  EXPECT_EQ(pooled_step_noise({}), 0);
  EXPECT_EQ(pooled_step_noise({{{1.0, 0.25}}}), 0);  // one round: nothing to compare
  // Rounds 1.0 and 1.2 s per call over 0.25 s windows: +-1/11 of the mean, times sqrt(0.25),
  // one degree of freedom.
  const double dev = (1.0 / 1.1 - 1) * 0.5;
  EXPECT_NEAR(pooled_step_noise({{{1.0, 0.25}, {1.2, 0.25}}}), std::sqrt(2 * dev * dev), 1e-12);
  // The same relative spread over windows 4x as long is twice the noise per second.
  EXPECT_NEAR(pooled_step_noise({{{1.0, 1.0}, {1.2, 1.0}}}), 2 * std::sqrt(2 * dev * dev), 1e-12);
  // Figures pool: a steady one halves the variance per degree of freedom.
  EXPECT_NEAR(pooled_step_noise({{{1.0, 0.25}, {1.2, 0.25}}, {{3.0, 0.25}, {3.0, 0.25}}}), std::sqrt(dev * dev), 1e-12);
  EXPECT_EQ(pooled_step_noise({{{1.0, 1.0}, {9.0, 1.0}}}), 0.5);  // a stall, not noise: capped
}

TEST(Profiler, LinkFromPingsTakesBandwidthFromTheLargestAndLatencyFromTheBestSize) {
  // A clean link: 1e8 bytes/s, 0.5 ms.
  auto t = [](double bytes) { return 5e-4 + bytes / 1e8; };
  const std::vector<double> sizes{4096, 262144, 1048576, 2097152};
  LinkProfile l = link_from_pings(sizes, {t(4096), t(262144), t(1048576), t(2097152)});
  EXPECT_NEAR(l.bytes_per_s, 1e8, 1);
  EXPECT_NEAR(l.latency_s, 5e-4, 1e-12);
  // Every ping of the first size slow (as read after the compute figures on the emulated pool):
  // neither the bandwidth nor the latency follows it.
  l = link_from_pings(sizes, {t(4096) + 3e-3, t(262144), t(1048576), t(2097152)});
  EXPECT_NEAR(l.bytes_per_s, 1e8, 1);
  EXPECT_NEAR(l.latency_s, 5e-4, 1e-12);
  // A burst lets a mid-sized message through faster than the rate: latency 0, not negative.
  l = link_from_pings(sizes, {t(4096), 1e-4, t(1048576), t(2097152)});
  EXPECT_EQ(l.latency_s, 0);
  // The largest two not rising: a line through all sizes, else the largest message's own rate.
  l = link_from_pings(sizes, {t(4096), t(262144), t(2097152), t(2097152)});
  EXPECT_GT(l.bytes_per_s, 0);
  l = link_from_pings({4096, 8192}, {2e-3, 1e-3});
  EXPECT_NEAR(l.bytes_per_s, 8192 / 1e-3, 1e-6);
  EXPECT_EQ(link_from_pings({}, {}).bytes_per_s, 0);
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
  EXPECT_NEAR(pc.step_s, D + pc.straggler_s + pc.world_allreduce_s + pc.optimizer_s, 1e-12);
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

// Two regions joined by a slow link: scope slow-links sums exactly inside each region and
// compresses only between the regions' leaders.
TEST(CostModel, HierarchicalSyncCompressesOnlyBetweenRegions) {
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c;
  c.devices = {device("a0", "h0", "t"), device("a1", "h1", "t"), device("b0", "h2", "t"), device("b1", "h3", "t")};
  c.groups = {{"A", {"h0", "h1"}}, {"B", {"h2", "h3"}}};
  c.rules.push_back({"A", "A", Link{10, 0.1}});
  c.rules.push_back({"B", "B", Link{10, 0.1}});
  c.rules.push_back({"A", "B", Link{0.1, 10}});
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
  // Dense: along a tree that crosses the slow links once, 6 MB each way over a 12.5 MB/s hop (a
  // ring would cross two hops with 2 * 3/4 of it). Compressed: 6 MB inside each region at 1.25
  // GB/s, then 2% of it between the two leaders.
  EXPECT_TRUE(dense.sync_groups[0].tree);
  // The tree a0 - a1 - b0 - b1 (one slow edge), rooted at a1: the bytes behind the first chunk at
  // 12.5 MB/s, and the first chunk from b1 up to a1 and back (two fast hops, two slow, with their
  // latencies).
  const double chunk = 256.0 * 1024;
  EXPECT_NEAR(dense.sync_groups[0].time_s, (6e6 - chunk) / 1.25e7 + chunk * (2 / 1.25e9 + 2 / 1.25e7) + 2 * 0.0001 + 2 * 0.010,
              1e-9);
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
  // Tree: e0 - e1 - u0 - u1 with e1 at the root (sync_tree). u1's figures go to u0, across to e1,
  // and the total back across and on to u1.
  const double fast = 0.1e-3 + CostContext::kWorldSumBytes / (1e9 / 8), slow = 40e-3 + CostContext::kWorldSumBytes / (0.1e9 / 8);
  EXPECT_NEAR(ctx.world_allreduce_s(), 2 * slow + 2 * fast, 1e-12);
  Plan dp;
  dp.global_batch = 4;
  for (int r = 0; r < 4; ++r) dp.pipelines.push_back({1, 1, {stage(r, 0, 4, c.devices[static_cast<size_t>(r)].name)}});
  EXPECT_NEAR(simulate_plan(dp, c, p).world_allreduce_s, ctx.world_allreduce_s(), 1e-12);
  // Told to sum along rings, the trainer sends the figures around Gloo's ring too.
  dp.grad_sync.allreduce = "ring";
  const double f = 2.0 * 3 / 4;  // a ring's share of its latencies and bytes
  EXPECT_NEAR(simulate_plan(dp, c, p).world_allreduce_s, f * (2 * 40e-3 + 2 * 0.1e-3) + f * CostContext::kWorldSumBytes / (0.1e9 / 8), 1e-9);
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

// --- Search ------------------------------------------------------------------------------------

namespace {

struct Pool {
  ClusterSpec cluster;
  Profile profile;
};

// Speeds 1, 0.5, 0.25 on three hosts; one slow link, between the fastest and the slowest.
Pool three_device_pool() {
  Pool pl;
  pl.profile = base_profile(8);
  pl.profile.devices["fast"] = dev_profile(1);
  pl.profile.devices["mid"] = dev_profile(2);
  pl.profile.devices["slow"] = dev_profile(4);
  pl.cluster.devices = {device("f", "h0", "fast", 0.2), device("m", "h1", "mid", 0.2), device("s", "h2", "slow", 0.2)};
  pl.cluster.default_link = Link{10, 0.1};
  pl.cluster.rules.push_back({"h0", "h2", Link{0.1, 5}});
  return pl;
}

}  // namespace

TEST(Search, EveryStrategyUsesEveryDeviceOnce) {
  Pool pl;
  pl.profile = base_profile(6);
  pl.profile.devices["a"] = dev_profile(1);
  pl.profile.devices["b"] = dev_profile(3);
  for (int i = 0; i < 6; ++i)
    pl.cluster.devices.push_back(device("d" + std::to_string(i), "h" + std::to_string(i / 2), i % 3 == 0 ? "a" : "b", 0.1));
  pl.cluster.rules.push_back({"h0", "h2", Link{0.5, 2}});
  for (const std::string s : {"alloy", "uniform", "proportional", "ptafm"}) {
    SearchOptions o;
    o.strategy = s;
    o.global_batch = 24;
    SearchResult r = search(pl.cluster, pl.profile, o);
    SCOPED_TRACE(s + ": " + r.plan.describe());
    expect_uses_every_device(r, pl.cluster, pl.profile);
    EXPECT_EQ(r.strategy, s);
    EXPECT_GT(r.candidates_evaluated, 0);
    EXPECT_EQ(r.plan.predicted["step_s"], r.cost.step_s);
  }
  // PTAFM with its NUM_STAGE given: 2 stage groups of hosts, every replica crossing both.
  SearchOptions o;
  o.strategy = "ptafm";
  o.global_batch = 24;
  o.ptafm_stages = 2;
  SearchResult r = search(pl.cluster, pl.profile, o);
  SCOPED_TRACE(r.plan.describe());
  expect_uses_every_device(r, pl.cluster, pl.profile);
  for (const auto& p : r.plan.pipelines) {
    std::set<std::string> hosts;
    for (const auto& st : p.stages) hosts.insert(pl.cluster.devices[static_cast<size_t>(st.ranks[0])].host);
    EXPECT_GE(hosts.size(), 2u);
  }
  o.ptafm_stages = 4;  // more stages than hosts
  EXPECT_THROW(search(pl.cluster, pl.profile, o), InputError);
  // A dead link is named before any search.
  pl.cluster.rules.push_back({"h0", "h1", Link{0, 1}});
  o.strategy = "alloy";
  try {
    search(pl.cluster, pl.profile, o);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("no usable link"), std::string::npos) << e.what();
  }
}

TEST(Search, UniformFallsBackToPipelinesWhenTheModelDoesNotFitOneDevice) {
  Pool pl;
  pl.profile = base_profile(8);
  pl.profile.devices["a"] = dev_profile(1);
  // The model: 8 + 2 + 2 = 12 MB of parameters, 48 MB with state: 4 devices of 40 MB need pipelines.
  for (int i = 0; i < 4; ++i) pl.cluster.devices.push_back(device("d" + std::to_string(i), "h0", "a", 0.04));
  SearchOptions o;
  o.strategy = "uniform";
  o.global_batch = 8;
  SearchResult r = search(pl.cluster, pl.profile, o);
  expect_uses_every_device(r, pl.cluster, pl.profile);
  ASSERT_EQ(r.plan.pipelines.size(), 2u);
  for (const auto& p : r.plan.pipelines) {
    ASSERT_EQ(p.stages.size(), 2u);
    EXPECT_EQ(p.stages[0].layer_end - p.stages[0].layer_begin, 4);
    EXPECT_EQ(p.samples(), 4);
  }
}

TEST(Search, AlloyIsNeverPredictedSlowerThanTheBaselines) {
  Pool pl = three_device_pool();
  SearchOptions o;
  o.global_batch = 16;
  SearchResult best = search(pl.cluster, pl.profile, o);
  expect_uses_every_device(best, pl.cluster, pl.profile);
  EXPECT_TRUE(best.exact);
  for (const std::string s : {"uniform", "proportional", "ptafm"}) {
    o.strategy = s;
    SearchResult r = search(pl.cluster, pl.profile, o);
    expect_uses_every_device(r, pl.cluster, pl.profile);
    EXPECT_LE(best.cost.step_s, r.cost.step_s * (1 + 1e-12)) << s << "\nalloy: " << best.plan.describe() << s << ": " << r.plan.describe();
  }
  o.strategy = "uniform";
  const double uniform = search(pl.cluster, pl.profile, o).cost.step_s;
  EXPECT_LT(best.cost.step_s, uniform * 0.95) << "on a 4x spread of speeds the planner should clearly beat equal shares";
}

TEST(Search, SmallerBucketsWhenTheyHideSync) {
  // Two replicas over a 10 MB/s link: one bucket of everything (6e6 bytes, 0.6 s) is ready only
  // when the backward ends and is exposed whole; with per-unit buckets only the embedding's is.
  Profile p = base_profile(2);
  p.devices["t"] = flat(0.5, 1.0, 0.25, 0.5);
  ClusterSpec c = two_hosts(8e7 / 1e9, 0.001);
  SearchResult r;
  r.strategy = "alloy";
  r.plan.global_batch = 2;
  r.plan.pipelines.push_back({1, 1, {stage(0, 0, 2, "a")}});
  r.plan.pipelines.push_back({1, 1, {stage(1, 0, 2, "b")}});
  r.cost = simulate_plan(r.plan, c, p);
  r.search_step_s = r.cost.step_s;
  ASSERT_EQ(r.plan.grad_sync.bucket_mb, 25.0);
  const double before = r.cost.step_s;
  EXPECT_NEAR(before, 4.5 + 0.6, 1e-3);
  tune_buckets(r, c, p);
  EXPECT_LT(r.plan.grad_sync.bucket_mb, 25.0);
  EXPECT_NEAR(r.cost.step_s, 4.5 + 0.2, 1e-3);  // the embedding's 2e6 bytes after the backward
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.back().find("gradient buckets of"), std::string::npos);
  // The result is the plan's own simulation, and the plan carries it.
  EXPECT_DOUBLE_EQ(r.cost.step_s, simulate_plan(r.plan, c, p).step_s);
  EXPECT_DOUBLE_EQ(r.plan.predicted["step_s"].get<double>(), r.cost.step_s);
  EXPECT_DOUBLE_EQ(r.search_step_s, r.cost.step_s);

  // On one host (100 Gbit/s) the sync is too short to matter: the cap stays.
  c.devices[1].host = "h0";
  SearchResult same = r;
  same.plan.grad_sync.bucket_mb = 25;
  same.cost = simulate_plan(same.plan, c, p);
  tune_buckets(same, c, p);
  EXPECT_EQ(same.plan.grad_sync.bucket_mb, 25.0);
}

TEST(Search, HeuristicModeBeatsTheBaselinesToo) {
  // 10 devices and 24 blocks: far beyond the exact limit.
  Pool pl;
  pl.profile = base_profile(24);
  pl.profile.devices["fast"] = dev_profile(1);
  pl.profile.devices["slow"] = dev_profile(3);
  for (int i = 0; i < 10; ++i)
    pl.cluster.devices.push_back(device("d" + std::to_string(i), "h" + std::to_string(i / 5), i % 2 ? "slow" : "fast", 0.2));
  pl.cluster.rules.push_back({"h0", "h1", Link{1, 5}});
  SearchOptions o;
  o.global_batch = 64;
  o.time_budget_s = 0.5;
  SearchResult best = search(pl.cluster, pl.profile, o);
  EXPECT_FALSE(best.exact);
  expect_uses_every_device(best, pl.cluster, pl.profile);
  for (const std::string s : {"uniform", "proportional", "ptafm"}) {
    o.strategy = s;
    SearchResult r = search(pl.cluster, pl.profile, o);
    EXPECT_LE(best.cost.step_s, r.cost.step_s * (1 + 1e-12)) << s;
  }
}

TEST(Search, ExplainsWhatDoesNotFit) {
  Pool pl = three_device_pool();
  SearchOptions o;
  o.global_batch = 2;  // three devices, 8 blocks: one pipeline of three is possible, so this is fine
  EXPECT_NO_THROW(search(pl.cluster, pl.profile, o));
  o.micro_batch_sizes = {4};
  o.global_batch = 6;  // not a multiple of 4
  try {
    search(pl.cluster, pl.profile, o);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be split"), std::string::npos) << e.what();
  }
  // 3 x 10 MB against a 48 MB model
  o = SearchOptions();
  o.global_batch = 8;
  for (auto& d : pl.cluster.devices) d.memory_gb = 0.01;
  try {
    search(pl.cluster, pl.profile, o);
    FAIL();
  } catch (const InputError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("does not fit the pool"), std::string::npos) << w;
    EXPECT_NE(w.find("short by"), std::string::npos) << w;
  }
  // Fits the pool in total but no rank layout fits (activations of the head stage).
  for (auto& d : pl.cluster.devices) d.memory_gb = 0.0185;
  pl.profile.memory.act_bytes_per_sample_head = 5e7;
  try {
    search(pl.cluster, pl.profile, o);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("over by"), std::string::npos) << e.what();
  }
  // More pipelines needed than samples: 20 devices, 2 blocks -> at least 10 pipelines.
  Pool many;
  many.profile = base_profile(2);
  many.profile.devices["a"] = dev_profile(1);
  for (int i = 0; i < 20; ++i) many.cluster.devices.push_back(device("d" + std::to_string(i), "h0", "a"));
  o.global_batch = 5;
  try {
    search(many.cluster, many.profile, o);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("at least 10 pipeline"), std::string::npos) << e.what();
  }
}

TEST(Search, MinmaxSplitMatchesBruteForce) {
  check_times(200, [] {
    const int R = *rc::gen::inRange(1, 4);
    const int64_t T = *rc::gen::inRange<int64_t>(R, 10);
    std::vector<std::vector<double>> g(static_cast<size_t>(R), std::vector<double>(static_cast<size_t>(T + 1)));
    for (auto& row : g)
      for (auto& v : row) v = *rc::gen::inRange(0, 12) == 0 ? INFINITY : *rc::gen::inRange(0, 100) / 7.0;
    std::vector<int64_t> choice;
    const double dp = minmax_split(g, T, &choice);
    double brute = INFINITY;
    std::vector<int64_t> b(static_cast<size_t>(R), 1);
    std::function<void(int, int64_t)> rec = [&](int r, int64_t left) {
      if (r == R - 1) {
        if (left < 1) return;
        b[static_cast<size_t>(r)] = left;
        double v = 0;
        for (int i = 0; i < R; ++i) v = std::max(v, g[static_cast<size_t>(i)][static_cast<size_t>(b[static_cast<size_t>(i)])]);
        brute = std::min(brute, v);
        return;
      }
      for (int64_t x = 1; x <= left - (R - 1 - r); ++x) {
        b[static_cast<size_t>(r)] = x;
        rec(r + 1, left - x);
      }
    };
    rec(0, T);
    RC_ASSERT(dp == brute);
    if (std::isfinite(dp)) {
      int64_t sum = 0;
      double v = 0;
      for (int i = 0; i < R; ++i) {
        sum += choice[static_cast<size_t>(i)];
        v = std::max(v, g[static_cast<size_t>(i)][static_cast<size_t>(choice[static_cast<size_t>(i)])]);
      }
      RC_ASSERT(sum == T);
      RC_ASSERT(v == dp);
    }
  });
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

// Two pipelines that must both cross one thin link (the first stages' devices on one host hold
// only the embedding's half, the other host's only the head's): each message there takes twice as
// long as alone, in simulate_plan and in the search's own figures, and the exact search still finds
// exhaustive()'s optimum.
TEST(Search, PipelinesCrossingOneLinkShareIt) {
  ClusterSpec c;
  c.devices = {device("a0", "h0", "A", 0.05), device("a1", "h0", "A", 0.05), device("b0", "h1", "B", 0.06),
               device("b1", "h1", "B", 0.06)};
  c.rules.push_back({"h0", "h1", Link{0.05, 0.1}});
  Profile p = base_profile(2);
  p.memory.param_bytes_embed = 8e6;   // a block and the embedding: 45 MB with AdamW and the sync buckets
  p.memory.param_bytes_head = 10e6;   // a block and the head: 55 MB
  p.memory.act_bytes_per_sample_block = p.memory.act_bytes_per_sample_embed = p.memory.act_bytes_per_sample_head = 1e3;
  p.model.hidden = 256;  // messages of 16 KB per sample over 6.25 MB/s: the link matters
  p.devices["A"] = dev_profile(1);
  p.devices["B"] = dev_profile(1);
  SearchOptions o;
  o.global_batch = 8;
  o.max_micro_batch = 2;
  o.fit_memory = false;
  o.split_schedule_min_gain = 0;
  const SearchResult s = search(c, p, o), e = exhaustive(c, p, o);
  ASSERT_EQ(s.plan.pipelines.size(), 2u) << s.plan.describe();
  EXPECT_TRUE(near_rel(s.search_step_s, s.cost.step_s)) << s.search_step_s << " vs " << s.cost.step_s;
  EXPECT_TRUE(near_rel(s.cost.step_s - s.cost.straggler_s, e.cost.step_s - e.cost.straggler_s));
  const CostContext ctx(c, p);
  for (const auto& st : s.cost.stages) {
    if (st.stage != 0) continue;
    const auto& pl = s.plan.pipelines[static_cast<size_t>(st.pipeline)];
    ASSERT_EQ(pl.stages.size(), 2u);
    const double one = ctx.p2p_s(0, 1, pl.micro_batch_size), two = ctx.p2p_s(0, 1, pl.micro_batch_size, 2);
    EXPECT_GT(two, 1.9 * one);
    // Every activation it sends crosses the shared link (the sends may also wait for the link).
    EXPECT_GE(st.p2p_s, static_cast<double>(pl.num_micro_batches) * two * (1 - 1e-9)) << st.p2p_s;
  }
  // Its first pipeline alone on the pool has the link to itself.
  Plan alone = s.plan;
  alone.pipelines.resize(1);
  alone.global_batch = alone.pipelines[0].micro_batch_size * alone.pipelines[0].num_micro_batches;
  alone.pipelines[0].stages[0].ranks = {0};
  alone.pipelines[0].stages[1].ranks = {1};
  const PlanCost a = simulate_plan(alone, c, p);
  EXPECT_NEAR(a.stages[0].p2p_s, static_cast<double>(alone.pipelines[0].num_micro_batches) * ctx.p2p_s(0, 1, alone.pipelines[0].micro_batch_size),
              1e-9);
  EXPECT_LT(a.stages[0].p2p_s, s.cost.stages[0].p2p_s);
}

TEST(Search, SpaceSizeFormula) {
  EXPECT_EQ(search_space_configurations(1, 8), 1);
  EXPECT_EQ(search_space_configurations(2, 8), 15);    // {a}{b} + 2 orders x 7 splits
  EXPECT_EQ(search_space_configurations(3, 8), 169);
  EXPECT_EQ(search_space_configurations(6, 8), 546631);
}

// The exact search (symmetry + branch and bound + DP batch split) finds exhaustive()'s optimum on
// random small pools; both plans are re-simulated by simulate_plan.
TEST(Search, ExactSearchMatchesExhaustiveEnumeration) {
  const auto t0 = std::chrono::steady_clock::now();
  check_times(60, [] {
    const int n_types = *rc::gen::inRange(1, 4), n_hosts = *rc::gen::inRange(1, 4);
    // Mostly 2-5 devices; 6 (half a million configurations per schedule) now and then.
    const int n = *rc::gen::weightedElement<int>({{1, 1}, {3, 2}, {4, 3}, {4, 4}, {3, 5}, {1, 6}});
    Pool pl;
    pl.profile = base_profile(8);
    std::vector<std::string> types;
    for (int t = 0; t < n_types; ++t) {
      types.push_back("t" + std::to_string(t));
      pl.profile.devices[types.back()] =
          dev_profile(*rc::gen::inRange(1, 9) / 2.0, *rc::gen::inRange(0, 20) / 10000.0, *rc::gen::inRange(5, 40) / 10000.0);
      // Noisy devices make the step wait for the slowest replica's draw: the search must price it as simulate_plan does.
      pl.profile.devices[types.back()].step_noise = *rc::gen::element(0.0, 0.0, 0.02, 0.1);
      // Pipeline messages' CPU time: in the search's stage tables as in simulate_plan.
      pl.profile.devices[types.back()].comm_cpu_s_per_byte = *rc::gen::element(0.0, 0.0, 2e-9, 2e-7);
    }
    for (int i = 0; i < n; ++i) {
      const int t = *rc::gen::inRange(0, n_types), h = *rc::gen::inRange(0, n_hosts);
      const double mem = *rc::gen::element(0.0, 0.0, 0.02, 0.03, 0.06);
      pl.cluster.devices.push_back(device("d" + std::to_string(i), "h" + std::to_string(h), types[static_cast<size_t>(t)], mem));
    }
    for (int a = 0; a < n_hosts; ++a)
      for (int b = a + 1; b < n_hosts; ++b)
        pl.cluster.rules.push_back({"h" + std::to_string(a), "h" + std::to_string(b),
                                    Link{*rc::gen::element(0.05, 0.5, 5.0), *rc::gen::element(0.05, 1.0, 5.0)}});
    SearchOptions o;
    o.global_batch = *rc::gen::inRange<int64_t>(8, 17);
    o.max_micro_batch = 4;
    o.grad_sync.bucket_mb = *rc::gen::element(0.5, 25.0);
    o.fit_memory = false;  // exhaustive() walks layouts of full replicas; sharding is fit_memory's, tested on its own
    o.split_schedule_min_gain = 0;  // the optimum, not the margin's choice (tested on its own)
    // Compression changes what sets cost (and, across slow links, which sync hierarchically); the
    // search must still find exhaustive()'s optimum, in the same numbers simulate_plan computes.
    o.grad_sync.compression = *rc::gen::element<std::string>("none", "none", "dgc", "powersgd", "fp16");
    o.grad_sync.scope = *rc::gen::element<std::string>("all", "slow-links");
    o.grad_sync.density = *rc::gen::element(0.01, 0.1);
    RC_CLASSIFY(o.grad_sync.lossy(), "compressed");
    std::string err_s, err_e;
    SearchResult s, e;
    try {
      s = search(pl.cluster, pl.profile, o);
    } catch (const InputError& x) {
      err_s = x.what();
    }
    try {
      e = exhaustive(pl.cluster, pl.profile, o);
    } catch (const InputError& x) {
      err_e = x.what();
    }
    RC_ASSERT(err_s.empty() == err_e.empty());
    if (!err_s.empty()) {
      RC_TAG("infeasible");
      return;
    }
    RC_CLASSIFY(n >= 5, "5-6 devices");
    {
      // Pipelines crossing one host pair share it (CostContext::pipeline_link_shares): the search
      // must price that as simulate_plan does.
      std::vector<std::vector<int>> hosts;
      const CostContext ctx(pl.cluster, pl.profile);
      for (const auto& pipe : s.plan.pipelines) {
        hosts.emplace_back();
        for (const auto& st : pipe.stages) hosts.back().push_back(ctx.host_of(pl.cluster.device_index(st.device)));
      }
      bool shared = false;
      for (const auto& v : ctx.pipeline_link_shares(hosts))
        for (int k : v) shared = shared || k > 1;
      RC_CLASSIFY(shared, "pipelines sharing a link");
    }
    RC_ASSERT(s.exact);
    RC_ASSERT(s.cost.fits);
    RC_ASSERT(e.cost.fits);
    RC_ASSERT(s.plan.world_size() == n);
    RC_ASSERT(near_rel(s.search_step_s, s.cost.step_s));
    RC_ASSERT(near_rel(e.search_step_s, e.cost.step_s));
    // The search's objective leaves out the stragglers' wait (search_detail.h: it depends on how
    // the min-max split breaks ties); that objective's optimum is what must agree.
    if (!near_rel(s.cost.step_s - s.cost.straggler_s, e.cost.step_s - e.cost.straggler_s))
      RC_FAIL("search " + std::to_string(s.cost.step_s) + " (" + s.plan.describe() + ") vs exhaustive " + std::to_string(e.cost.step_s) +
              " (" + e.plan.describe() + ")");
  });
  std::cout << "exact vs exhaustive: " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s\n";
}

// --- Calibration from measured compute ---------------------------------------------------------

namespace {
// Two devices on two hosts, of types "fast" and "slow".
ClusterSpec two_types() {
  ClusterSpec c;
  c.devices = {device("a", "h0", "fast"), device("b", "h1", "slow")};
  c.rules.push_back({"h0", "h1", Link{10, 0.01}});
  return c;
}
// base_profile(4) with the "fast" type at 1 and the "slow" one SLOW times as slow.
Profile two_type_profile(double slow) {
  Profile p = base_profile(4);
  p.devices["fast"] = dev_profile(1.0);
  p.devices["slow"] = dev_profile(slow);
  return p;
}

// Each rank's compute per step (forward and backward) as PROF predicts it for PLAN: what a
// calibration would measure if PROF were the truth.
std::map<int, double> predicted_compute(const Plan& plan, const ClusterSpec& c, const Profile& prof) {
  std::map<int, double> m;
  for (const auto& s : simulate_plan(plan, c, prof).stages) m[s.rank] = s.forward_s + s.backward_s;
  return m;
}

// The samples per step PLAN gives device "b".
int64_t samples_on_b(const Plan& plan) {
  int64_t n = 0;
  for (const auto& pl : plan.pipelines)
    for (const auto& st : pl.stages)
      if (st.device == "b") n += pl.micro_batch_size * pl.num_micro_batches;
  return n;
}
}  // namespace

TEST(Calibrate, ScalesEachTypeByMeasuredOverPredicted) {
  Profile p = two_type_profile(2.0);
  p.devices["slow"].block_fwd.set_points({1, 2, 4}, {0.01, 0.02, 0.04});
  ClusterSpec c = two_types();
  SearchOptions o;
  o.global_batch = 12;
  SearchResult r = search(c, p, o);
  PlanCost before = simulate_plan(r.plan, c, p);
  std::map<int, double> measured;
  for (const auto& s : before.stages) measured[s.rank] = (s.forward_s + s.backward_s) * (s.type == "slow" ? 1.5 : 1.0);
  Calibration cal = calibrate(r.plan, c, p, measured);
  EXPECT_NEAR(cal.factor.at("fast"), 1.0, 1e-12);
  EXPECT_NEAR(cal.factor.at("slow"), 1.5, 1e-12);
  // Every figure of the type scales, measured points included; the other type is untouched.
  const DeviceProfile& s = cal.profile.devices.at("slow");
  EXPECT_NEAR(s.block_fwd.at(2), 0.03, 1e-12);
  EXPECT_NEAR(s.block_bwd.per_sample_s, 1.5 * p.devices["slow"].block_bwd.per_sample_s, 1e-15);
  EXPECT_NEAR(s.optimizer_s_per_param, 1.5 * p.devices["slow"].optimizer_s_per_param, 1e-20);
  EXPECT_EQ(cal.profile.devices.at("fast").block_fwd.per_sample_s, p.devices["fast"].block_fwd.per_sample_s);
  // The running plan's stages now predict what was measured.
  PlanCost after = simulate_plan(r.plan, c, cal.profile);
  for (const auto& st : after.stages) EXPECT_NEAR(st.forward_s + st.backward_s, measured.at(st.rank), 1e-9 * measured.at(st.rank));
  // A rank stalled for seconds says nothing about its speed beyond the clamp.
  measured[1] = 1e6;
  EXPECT_EQ(calibrate(r.plan, c, p, measured).factor.at("slow"), 4.0);
}

// A tensor-parallel stage's members calibrate their own types: each measured its own compute (the
// sums left out), against its heads' share on its type. Before, only the first member's type learned,
// so a profile wrong about the second stayed wrong for as long as the plan ran.
TEST(Calibrate, EveryTensorParallelMemberCalibratesItsType) {
  Profile p = two_type_profile(8.0);  // the profile says "slow" is 8x slower; it is 2x
  ClusterSpec c = two_types();
  Plan plan;
  plan.global_batch = 8;
  StagePlan st{{0, 1}, 0, 4, "a", false};
  st.devices = {"a", "b"};
  st.tp_split = {3, 1};
  plan.pipelines.push_back({4, 2, {st}});
  const PlanCost before = simulate_plan(plan, c, p);
  ASSERT_EQ(before.stages.size(), 1u);
  ASSERT_EQ(before.stages[0].tp_members.size(), 2u);
  std::map<int, double> measured;
  for (const auto& m : before.stages[0].tp_members) measured[m.rank] = m.compute_s * (m.type == "slow" ? 0.25 : 1.0);
  Calibration cal = calibrate(plan, c, p, measured);
  EXPECT_NEAR(cal.factor.at("fast"), 1.0, 1e-12);
  EXPECT_NEAR(cal.factor.at("slow"), 0.25, 1e-12);
  // The members' shares: the slow member computes a quarter of the heads on its own speed.
  const auto& mem = before.stages[0].tp_members;
  EXPECT_NEAR(mem[1].compute_s / mem[0].compute_s, 8.0 / 3.0, 0.05);
}

// A tensor-parallel member of a double-quantized nf4 base holds its piece's scales in fp32 (the
// pieces are cut from the whole's quantization, its scales' second quantization is not): the cost
// model charges those bytes, and only there.
TEST(CostModel, TensorParallelPiecesOfADoubleQuantizedBaseHoldFp32Scales) {
  Profile p = two_type_profile(1.0);
  p.lora.rank = 4;
  p.lora.base_dtype = "nf4";
  p.memory.frozen_bytes_per_block = 4e5;
  p.memory.frozen_bytes_embed = 1e6;
  p.memory.frozen_bytes_head = 2e6;
  ClusterSpec c = two_types();
  Plan tp;
  tp.global_batch = 8;
  StagePlan st{{0, 1}, 0, 4, "a", false};
  st.devices = {"a", "b"};
  st.tp_split = {2, 2};
  tp.pipelines.push_back({4, 2, {st}});
  Plan whole;
  whole.global_batch = 8;
  whole.pipelines.push_back({4, 2, {stage(0, 0, 4, "a")}});
  auto frozen = [&](const Plan& plan, bool double_quant) {
    p.lora.double_quant = double_quant;
    const StageCost s = simulate_plan(plan, c, p).stages.at(0);
    return s.weight_bytes - s.param_bytes;  // what the frozen base holds
  };
  // Without double quantization pieces and the whole hold the same bytes per element.
  const double halves = 2 * 4e5 + 1e6 + 2e6;  // half of every block's heads, the embedding, the head
  EXPECT_NEAR(frozen(tp, false), halves, 1e-6 * halves);
  const double dq = (0.5 + 4.0 / 64) / (0.5 + 1.0 / 64 + 4.0 / (64 * 256));
  EXPECT_NEAR(frozen(tp, true), dq * 2 * 4e5 + 1e6 + 2e6, 1e-6 * halves);
  EXPECT_GT(dq, 1.09);
  // A whole-model stage holds the whole's second quantization: as measured.
  EXPECT_DOUBLE_EQ(frozen(whole, true), frozen(whole, false));
  EXPECT_DOUBLE_EQ(frozen(whole, true), 4 * 4e5 + 1e6 + 2e6);
}

TEST(Calibrate, ReplanSwitchesOnlyWhenTheSpeedsWereWrong) {
  Profile p = two_type_profile(4.0);  // the profile says 4x slower
  ClusterSpec c = two_types();
  SearchOptions o;
  o.global_batch = 16;
  SearchResult r = make_plan(c, p, o, false).chosen;  // what a run starts with
  auto compute = [&](const Profile& prof) { return predicted_compute(r.plan, c, prof); };
  // Measured as predicted: the same plan, no switch.
  Replan same = replan(r.plan, c, calibrate(r.plan, c, p, compute(p)), o);
  EXPECT_FALSE(same.change) << same.text;
  EXPECT_NEAR(same.current.step_s, r.cost.step_s, 1e-12);
  // Both devices really run at the same speed: the slow one was given too little.
  Profile truth = p;
  truth.devices["slow"] = dev_profile(1.0);
  Replan fix = replan(r.plan, c, calibrate(r.plan, c, p, compute(truth)), o);
  ASSERT_TRUE(fix.change) << fix.text;
  EXPECT_LT(fix.best.step_s, 0.95 * fix.current.step_s);
  // The new plan is what the planner finds on the true speeds, and gives the slow device more.
  PlanReport on_truth = make_plan(c, truth, o, false);
  EXPECT_NEAR(simulate_plan(fix.plan, c, truth).step_s, on_truth.chosen.cost.step_s, 1e-9);
  EXPECT_GT(samples_on_b(fix.plan), samples_on_b(r.plan));
  EXPECT_TRUE(fix.plan.predicted.contains("step_s"));
}

// Try and revert (plan::Replanner): a calibration that misleads (a device read faster than it
// trains) makes a plan that measures slower than the one before; the job goes back to that one,
// with the prediction of the calibration that measured it, and switches no more.
TEST(Calibrate, GoesBackToAPlanThatMeasuredFasterAndStaysThere) {
  Profile p = two_type_profile(4.0);
  ClusterSpec c = two_types();
  SearchOptions o;
  o.global_batch = 16;
  SearchResult r = search(c, p, o);
  r.plan.predicted = r.cost.to_json();
  auto compute = [&](const Plan& plan, const Profile& prof) { return predicted_compute(plan, c, prof); };
  Profile fast_b = p;  // what the first steps seem to say (b computes in bursts): b as fast as a
  fast_b.devices["slow"] = dev_profile(1.0);
  const std::map<int, double> no_phase;
  const double first_step = simulate_plan(r.plan, c, p).step_s;  // b really is 4x slower

  Replanner rp(r.plan, c, p, o);
  std::shared_ptr<Plan> next = rp.measured(2, 6, compute(r.plan, fast_b), no_phase, first_step);
  ASSERT_TRUE(next) << rp.events().dump(2);
  ASSERT_GT(samples_on_b(*next), samples_on_b(r.plan));
  EXPECT_FALSE(rp.events()[0].contains("reverted_to"));
  const double first_calibrated = rp.events()[0]["running_plan_calibrated_s"].get<double>();

  // Given the work, b shows its real speed, and the new plan measures slower: back to the first,
  // predicted as the calibration that measured it did.
  const double second_step = simulate_plan(*next, c, p).step_s;
  ASSERT_GT(second_step, 1.05 * first_step);
  std::shared_ptr<Plan> back = rp.measured(8, 12, compute(*next, p), no_phase, second_step);
  ASSERT_TRUE(back) << rp.events().dump(2);
  EXPECT_TRUE(rp.reverted());
  EXPECT_EQ(samples_on_b(*back), samples_on_b(r.plan));
  EXPECT_EQ(back->describe(), r.plan.describe());
  const nlohmann::json& e = rp.events()[1];
  EXPECT_TRUE(e["switched"].get<bool>());
  EXPECT_EQ(e["reverted_to"]["calibrated_after_step"].get<int64_t>(), 6);
  EXPECT_DOUBLE_EQ(e["reverted_to"]["measured_step_s"].get<double>(), first_step);
  EXPECT_NEAR(e["reverted_to"]["now_predicted_s"].get<double>(), first_step, 1e-9 * first_step);
  EXPECT_EQ(rp.calibrated_prediction()["calibrated_after_step"].get<int64_t>(), 6);
  EXPECT_DOUBLE_EQ(rp.calibrated_prediction()["step_s"].get<double>(), first_calibrated);

  // The next calibration again reads b as fast as a (it idles again), and the search again prefers
  // the plan that measured slower: the plan gone back to stays.
  EXPECT_FALSE(rp.measured(14, 18, compute(*back, fast_b), no_phase, first_step));
  EXPECT_LT(rp.events()[2]["best_calibrated_s"].get<double>(), 0.95 * rp.events()[2]["running_plan_calibrated_s"].get<double>());
  EXPECT_FALSE(rp.events()[2]["switched"].get<bool>());
  EXPECT_EQ(rp.running().describe(), r.plan.describe());

  // A slower step that the devices explain: b really was as fast as a, the switch was right, and
  // then both became 2.5x slower (another job on the machine). The speeds just measured predict
  // the first plan no faster, so the job does not go back.
  {
    Replanner env(r.plan, c, p, o);
    ASSERT_TRUE(env.measured(2, 6, compute(r.plan, fast_b), no_phase, simulate_plan(r.plan, c, fast_b).step_s));
    Profile slower = p;
    slower.devices["fast"] = dev_profile(2.5);
    slower.devices["slow"] = dev_profile(2.5);
    const double slow_step = simulate_plan(env.running(), c, slower).step_s;
    ASSERT_GT(slow_step, 1.05 * simulate_plan(r.plan, c, fast_b).step_s);
    env.measured(8, 12, compute(env.running(), slower), no_phase, slow_step);
    EXPECT_FALSE(env.reverted());
    EXPECT_FALSE(env.events()[1].contains("reverted_to")) << env.events()[1].dump(2);
    ASSERT_TRUE(env.events()[1].contains("not_reverted_to")) << env.events()[1].dump(2);
    EXPECT_GT(env.events()[1]["not_reverted_to"]["now_predicted_s"].get<double>(), env.events()[1]["running_plan_calibrated_s"].get<double>());
  }
  // Within the margin of the first plan's step: no going back.
  {
    Replanner close(r.plan, c, p, o);
    ASSERT_TRUE(close.measured(2, 6, compute(r.plan, fast_b), no_phase, first_step));
    close.measured(8, 12, compute(close.running(), p), no_phase, 1.04 * first_step);
    EXPECT_FALSE(close.reverted());
  }

  // The rule itself: the fastest earlier plan, only beyond the margin; unmeasured ones never.
  auto tried = [](std::vector<double> steps) {
    std::vector<TriedPlan> t;
    for (double s : steps) t.push_back({Plan{}, 0, s, PlanCost{}});
    return t;
  };
  EXPECT_EQ(revert_target(tried({2.09})), std::nullopt);
  EXPECT_EQ(revert_target(tried({2.09, 4.41})), std::optional<size_t>(0));
  EXPECT_EQ(revert_target(tried({2.09, 2.15})), std::nullopt);
  EXPECT_EQ(revert_target(tried({2.0, 1.8, 2.3})), std::optional<size_t>(1));
  EXPECT_EQ(revert_target(tried({0.0, 2.5})), std::nullopt);
  EXPECT_EQ(revert_target(tried({2.0, 1.5})), std::nullopt);
}

TEST(Calibrate, RebalanceMovesSamplesFromAPipelineSlowerThanPredicted) {
  Profile p = two_type_profile(1.0);
  ClusterSpec c = two_types();
  SearchOptions o;
  o.global_batch = 32;
  SearchResult r = search(c, p, o);
  ASSERT_EQ(r.plan.pipelines.size(), 2u) << r.plan.describe();  // equal devices: data parallelism
  const PlanCost pred = simulate_plan(r.plan, c, p);
  auto phases = [&](double k0, double k1) {
    std::map<int, double> m;
    m[r.plan.pipelines[0].stages[0].ranks[0]] = k0 * pred.pipelines[0].phase_s;
    m[r.plan.pipelines[1].stages[0].ranks[0]] = k1 * pred.pipelines[1].phase_s;
    return m;
  };
  // Each pipeline took what was predicted: the split stays.
  Rebalance same = rebalance(r.plan, c, p, phases(1.0, 1.0), o);
  EXPECT_FALSE(same.change) << same.text;
  EXPECT_NEAR(same.current_s, pred.step_s, 1e-9 * pred.step_s);
  // Pipeline 1 took 30% longer than predicted (its schedule waits more than the model says):
  // samples move from it to pipeline 0, the total stays the global batch, and the predicted step
  // with the measured factors falls.
  Rebalance fix = rebalance(r.plan, c, p, phases(1.0, 1.3), o);
  ASSERT_TRUE(fix.change) << fix.text;
  EXPECT_NEAR(fix.factor[1], 1.3, 1e-9);
  EXPECT_LT(fix.plan.pipelines[1].samples(), r.plan.pipelines[1].samples()) << fix.text;
  EXPECT_EQ(fix.plan.pipelines[0].samples() + fix.plan.pipelines[1].samples(), 32);
  EXPECT_LT(fix.best_s, 0.97 * fix.current_s) << fix.text;
  EXPECT_EQ(fix.plan.pipelines[0].stages[0].device, r.plan.pipelines[0].stages[0].device);  // same layout
  EXPECT_TRUE(fix.plan.predicted.contains("step_s"));
  // A pipeline with no measurement gives no basis for moving anything.
  std::map<int, double> partial = phases(1.0, 1.3);
  partial.erase(r.plan.pipelines[1].stages[0].ranks[0]);
  EXPECT_FALSE(rebalance(r.plan, c, p, partial, o).change);
  // Through replan: the calibrated search keeps the layout, and the split is rebalanced.
  std::map<int, double> compute;
  for (const auto& s : pred.stages) compute[s.rank] = s.forward_s + s.backward_s;
  const auto measured_phase = phases(1.0, 1.3);
  Replan rp = replan(r.plan, c, calibrate(r.plan, c, p, compute), o, 0.05, &measured_phase);
  ASSERT_TRUE(rp.change) << rp.text;
  ASSERT_TRUE(rp.split.has_value());
  EXPECT_TRUE(rp.split->change);
  ASSERT_EQ(rp.split->factor.size(), 2u);
  EXPECT_NEAR(rp.split->factor[1], 1.3, 1e-9);
  EXPECT_LT(rp.split->best_s, rp.split->current_s);
  EXPECT_LT(rp.plan.pipelines[1].samples(), r.plan.pipelines[1].samples()) << rp.text;
  // Without phases the split is not checked, and the running plan stays.
  Replan plain = replan(r.plan, c, calibrate(r.plan, c, p, compute), o, 0.05);
  EXPECT_FALSE(plain.split.has_value() || plain.change) << plain.text;
}

TEST(Report, PredictedVsMeasuredSaysWhichCalibrationItComparesWith) {
  nlohmann::json plan_pred = {{"step_s", 1.9}, {"per_stage", nlohmann::json::array({{{"rank", 0}, {"device", "fast"}, {"forward_s", 0.5},
                                                                                      {"backward_s", 1.0}, {"sync_exposed_s", 0.1},
                                                                                      {"memory_bytes", 200.0 * 1024 * 1024}}})}};
  nlohmann::json calibrated = plan_pred;
  calibrated["step_s"] = 2.0;
  calibrated["calibrated_after_step"] = 6;
  nlohmann::json ranks = nlohmann::json::array(
      {{{"rank", 0}, {"compute_s_median", 1.6}, {"sync_wait_s_median", 0.05}, {"model_memory_bytes", 230.0 * 1024 * 1024}}});
  const std::string plain = predicted_vs_measured(plan_pred, ranks, 2.1);
  EXPECT_NE(plain.find("predicted 1900.0 ms, measured 2100.0 ms (+10.5%)"), std::string::npos) << plain;
  // The rank's memory: the planner's figure, then the measured peak and how far off the plan was.
  EXPECT_NE(plain.find("200.0 MiB     230.0 MiB (+15%)"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("calibration"), std::string::npos) << plain;
  const std::string cal = predicted_vs_measured(calibrated, ranks, 2.1, &plan_pred);
  EXPECT_NE(cal.find("measured up to step 6, the last calibration"), std::string::npos) << cal;
  EXPECT_NE(cal.find("predicted 2000.0 ms, measured 2100.0 ms (+5.0%)"), std::string::npos) << cal;
  EXPECT_NE(cal.find("before calibrating 1900.0 ms (+10.5%)"), std::string::npos) << cal;
}

// A device that only slows the step: every device gets a rank, so the planner notes which one the
// pool would be faster without, and by how much; none where every device helps.
TEST(Planner, NotesADeviceThatOnlySlowsTheStep) {
  Profile p = base_profile(4);
  p.devices["t"] = dev_profile(1);
  p.devices["slow"] = dev_profile(20);
  ClusterSpec c = two_hosts(0.001, 5);  // 1 Mbit/s: any message or sync over it costs seconds
  c.devices[1].type = "slow";
  SearchOptions o;
  o.global_batch = 8;
  o.max_micro_batch = 4;
  const PlanReport r = make_plan(c, p, o, false);
  std::string note;
  for (const auto& n : r.chosen.notes)
    if (n.rfind("device '", 0) == 0) note = n;
  EXPECT_NE(note.find("device 'b' slows the step: without it the plan is predicted"), std::string::npos) << r.text();
  EXPECT_NE(note.find("leave it out of the cluster file"), std::string::npos);
  // Without it: the fast device alone, as the note says.
  ClusterSpec alone = c;
  alone.devices.pop_back();
  o.suggest_leaving_out = false;
  const double without = make_plan(alone, p, o, false).chosen.cost.step_s;
  EXPECT_LT(without, 0.95 * r.chosen.cost.step_s);
  char ms[32];
  std::snprintf(ms, sizeof ms, "%.1f ms per step", without * 1e3);
  EXPECT_NE(note.find(ms), std::string::npos) << note;
  // Two equal devices on a fast link: both help, no note.
  ClusterSpec fair = two_hosts(10, 0.1);
  o.suggest_leaving_out = true;
  for (const auto& n : make_plan(fair, p, o, false).chosen.notes) EXPECT_EQ(n.rfind("device '", 0), std::string::npos) << n;
}

// A larger batch: a step's fixed costs (the gradient sum over a thin link here) are paid once per
// step, so twice the batch trains more samples per second. The planner says by how much, from the
// plan it would make for that batch, and keeps the batch it was given; nothing where the step is
// all compute.
TEST(Planner, NotesALargerBatchWhereTheStepsFixedCostsDominate) {
  Profile p = base_profile(4);
  p.devices["t"] = dev_profile(1);
  SearchOptions o;
  o.global_batch = 8;
  o.max_micro_batch = 4;
  o.suggest_leaving_out = false;
  const ClusterSpec thin = two_hosts(0.05, 1);
  const PlanReport r = make_plan(thin, p, o, false);
  EXPECT_EQ(r.chosen.plan.global_batch, 8);
  std::string note;
  for (const auto& n : r.chosen.notes)
    if (n.rfind("a global batch of", 0) == 0) note = n;
  ASSERT_FALSE(note.empty()) << r.text();
  SearchOptions twice = o;
  twice.global_batch = 16;
  twice.suggest_larger_batch = false;
  const double step16 = make_plan(thin, p, twice, false).chosen.cost.step_s;
  const double gain = 2 * r.chosen.cost.step_s / step16 - 1;
  EXPECT_GE(gain, kLargerBatchMinGain);
  char want[96];
  std::snprintf(want, sizeof want, "a global batch of 16 (train.global_batch) is predicted %.1f ms per step: %.0f%% more", step16 * 1e3,
                100 * gain);
  EXPECT_EQ(note.rfind(want, 0), 0u) << note;
  // Off: no note, no second search.
  o.suggest_larger_batch = false;
  for (const auto& n : make_plan(thin, p, o, false).chosen.notes) EXPECT_EQ(n.rfind("a global batch of", 0), std::string::npos) << n;
  // One device, a large batch: the step is its compute, and twice the batch takes twice as long.
  ClusterSpec one;
  one.devices = {device("a", "h0", "t")};
  o.suggest_larger_batch = true;
  o.global_batch = 64;
  for (const auto& n : make_plan(one, p, o, false).chosen.notes) EXPECT_EQ(n.rfind("a global batch of", 0), std::string::npos) << n;
}
