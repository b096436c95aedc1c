// Calibration and re-planning from measured speeds, stragglers, the profiler's statistics and
// the planner's notes.
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
  // Replicas of one micro-batch each stay so when samples move (PipelinePlan::micro_batch_for):
  // their buckets sum during the whole backward only in one micro-batch.
  Plan whole = r.plan;
  for (auto& pl : whole.pipelines) pl.set_samples(pl.samples(), pl.samples());
  Rebalance one = rebalance(whole, c, p, phases(1.0, 1.3), o);
  ASSERT_TRUE(one.change) << one.text;
  EXPECT_LT(one.plan.pipelines[1].samples(), whole.pipelines[1].samples()) << one.text;
  for (const auto& pl : one.plan.pipelines) EXPECT_EQ(pl.num_micro_batches, 1) << one.text;
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
