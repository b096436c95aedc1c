#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloy/pipeline/schedule.h"

using namespace alloy::pipeline;

namespace {

using K = ActionKind;

std::vector<std::vector<Action>> all_stages(const std::string& name, int64_t S, int64_t M) {
  std::vector<std::vector<Action>> v;
  for (int64_t s = 0; s < S; ++s) v.push_back(make_schedule(name, s, S, M));
  return v;
}

SimCosts uniform(int64_t S, double f, double b, double p2p = 0) {
  return SimCosts{std::vector<double>(static_cast<size_t>(S), f), std::vector<double>(static_cast<size_t>(S), b), p2p};
}

std::vector<int64_t> mbs_of(const std::vector<Action>& a, K kind) {
  std::vector<int64_t> out;
  for (const auto& x : a)
    if (x.kind == kind) out.push_back(x.micro_batch);
  return out;
}

// Each event's [start, end] by "STAGE:ACTION", e.g. "1:sendG0".
std::map<std::string, std::pair<double, double>> timeline(const SimResult& r) {
  std::map<std::string, std::pair<double, double>> t;
  for (const auto& e : r.events) t[std::to_string(e.stage) + ":" + to_string(e.action)] = {e.start, e.end};
  return t;
}

std::string where(const std::string& name, int64_t s, int64_t S, int64_t M) {
  return name + " stage " + std::to_string(s) + "/" + std::to_string(S) + " M=" + std::to_string(M);
}

// Independent of simulate(): the structural rules of the brief, checked on the lists themselves.
// Returns an empty string when they hold, otherwise what broke.
std::string check_structure(const std::string& name, int64_t S, int64_t M) {
  const auto st = all_stages(name, S, M);
  for (int64_t s = 0; s < S; ++s) {
    const auto& a = st[static_cast<size_t>(s)];
    const bool first = s == 0, last = s == S - 1;
    const std::string w = where(name, s, S, M) + " [" + to_string(a) + "]: ";
    const bool split = splits_backward(name) && s > 0;  // zb-h1's stage 0 runs whole backwards
    const size_t expect_len = static_cast<size_t>(M * ((split ? 3 : 2) + (first ? 0 : 2) + (last ? 0 : 2)));
    if (a.size() != expect_len) return w + "length " + std::to_string(a.size()) + ", expected " + std::to_string(expect_len);
    std::map<int64_t, int> nf, nb, nw;
    std::map<int64_t, size_t> at_f, at_b, at_w;
    int64_t last_w = -1;
    for (size_t i = 0; i < a.size(); ++i) {
      const Action& x = a[i];
      if (x.micro_batch < 0 || x.micro_batch >= M) return w + "micro-batch out of range at " + std::to_string(i);
      switch (x.kind) {
        case K::Forward:
          ++nf[x.micro_batch];
          at_f[x.micro_batch] = i;
          break;
        case K::Backward:
          ++nb[x.micro_batch];
          at_b[x.micro_batch] = i;
          break;
        case K::RecvActivation:
          if (first) return w + "first stage receives an activation";
          if (i + 1 >= a.size() || a[i + 1] != Action{K::Forward, x.micro_batch}) return w + "recvA not right before its F";
          break;
        case K::SendActivation:
          if (last) return w + "last stage sends an activation";
          if (i == 0 || a[i - 1] != Action{K::Forward, x.micro_batch}) return w + "sendA not right after its F";
          break;
        case K::RecvGrad:
          if (last) return w + "last stage receives a gradient";
          if (i + 1 >= a.size() || a[i + 1] != Action{K::Backward, x.micro_batch}) return w + "recvG not right before its B";
          break;
        case K::SendGrad:
          if (first) return w + "first stage sends a gradient";
          if (i == 0 || a[i - 1] != Action{K::Backward, x.micro_batch}) return w + "sendG not right after its B";
          break;
        case K::BackwardWeight:
          if (!split) return w + "a weight pass where backwards are whole";
          // In micro-batch order: the executor's last weight pass must be the step's last.
          if (x.micro_batch != last_w + 1) return w + "weight passes out of micro-batch order";
          last_w = x.micro_batch;
          ++nw[x.micro_batch];
          at_w[x.micro_batch] = i;
          break;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      if (nf[m] != 1 || nb[m] != 1) return w + "micro-batch " + std::to_string(m) + " not forwarded and backwarded exactly once";
      if (at_b[m] < at_f[m]) return w + "B" + std::to_string(m) + " before F" + std::to_string(m);
      if (split && (nw[m] != 1 || at_w[m] < at_b[m])) return w + "W" + std::to_string(m) + " missing, repeated or before its B";
    }
    // With the placement rules above and the exact length, every F/B on an inner side has its
    // receive and send; counting them again makes that explicit.
    if (!first && (mbs_of(a, K::RecvActivation).size() != static_cast<size_t>(M) || mbs_of(a, K::SendGrad).size() != static_cast<size_t>(M)))
      return w + "missing receive/send towards the previous stage";
    if (!last && (mbs_of(a, K::SendActivation).size() != static_cast<size_t>(M) || mbs_of(a, K::RecvGrad).size() != static_cast<size_t>(M)))
      return w + "missing receive/send towards the next stage";
  }
  for (int64_t s = 0; s + 1 < S; ++s) {
    const auto& lo = st[static_cast<size_t>(s)];
    const auto& hi = st[static_cast<size_t>(s + 1)];
    if (mbs_of(lo, K::SendActivation) != mbs_of(hi, K::RecvActivation))
      return where(name, s, S, M) + ": activation sends and next stage's receives differ in order";
    if (mbs_of(hi, K::SendGrad) != mbs_of(lo, K::RecvGrad))
      return where(name, s, S, M) + ": gradient receives and next stage's sends differ in order";
  }
  return "";
}

}  // namespace

// Exhaustive over the whole range the brief names rather than sampled: it is only 256 cases.
TEST(Schedule, StructureHoldsForAllSmallPipelines) {
  for (const std::string name : {"gpipe", "1f1b", "eager-1f1b", "eager-1f1b-3", "zb-h1"})
    for (int64_t S = 1; S <= 8; ++S)
      for (int64_t M = 1; M <= 16; ++M) {
        const std::string err = check_structure(name, S, M);
        ASSERT_TRUE(err.empty()) << err;
      }
}

TEST(Schedule, NoDeadlockAndActivationMemoryBoundsForAllSmallPipelines) {
  for (int64_t S = 1; S <= 8; ++S)
    for (int64_t M = 1; M <= 16; ++M) {
      const auto costs = uniform(S, 1, 2, 0.25);
      SimResult g, o, e;
      ASSERT_NO_THROW(g = simulate(all_stages("gpipe", S, M), costs)) << "gpipe S=" << S << " M=" << M;
      ASSERT_NO_THROW(o = simulate(all_stages("1f1b", S, M), costs)) << "1f1b S=" << S << " M=" << M;
      ASSERT_NO_THROW(e = simulate(all_stages("eager-1f1b", S, M), costs)) << "eager-1f1b S=" << S << " M=" << M;
      SimResult e3;
      ASSERT_NO_THROW(e3 = simulate(all_stages("eager-1f1b-3", S, M), costs)) << "eager-1f1b-3 S=" << S << " M=" << M;
      ASSERT_EQ(g.peak_in_flight.size(), static_cast<size_t>(S));
      ASSERT_EQ(o.peak_in_flight.size(), static_cast<size_t>(S));
      for (int64_t s = 0; s < S; ++s) {
        EXPECT_EQ(g.peak_in_flight[static_cast<size_t>(s)], M) << "gpipe S=" << S << " M=" << M << " stage " << s;
        // The 1F1B promise: stage i never holds more than (S - i), and it does reach that
        // (otherwise warm-up is too short and the stage idles).
        EXPECT_EQ(o.peak_in_flight[static_cast<size_t>(s)], std::min(S - s, M)) << "1f1b S=" << S << " M=" << M << " stage " << s;
        // Eager: one more on every stage but the last.
        EXPECT_EQ(e.peak_in_flight[static_cast<size_t>(s)], std::min(S - s + (s + 1 < S ? 1 : 0), M))
            << "eager-1f1b S=" << S << " M=" << M << " stage " << s;
        // eager-1f1b-3: three more.
        EXPECT_EQ(e3.peak_in_flight[static_cast<size_t>(s)], std::min(S - s + (s + 1 < S ? 3 : 0), M))
            << "eager-1f1b-3 S=" << S << " M=" << M << " stage " << s;
      }
    }
}

// Equal per-stage costs, free transfers: both schedules take exactly (M + S - 1)(f + b), i.e. a
// bubble fraction of (S - 1)/(M + S - 1). Costs are small integers so the sums are exact in double.
TEST(Schedule, MakespanMatchesBubbleFormulaExactly) {
  for (double f : {1.0, 2.0, 3.0})
    for (double b : {1.0, 2.0, 5.0})
      for (int64_t S = 1; S <= 8; ++S)
        for (int64_t M = 1; M <= 16; ++M)
          for (const std::string name : {"gpipe", "1f1b", "eager-1f1b", "eager-1f1b-2"}) {
            const SimResult r = simulate(all_stages(name, S, M), uniform(S, f, b));
            const double expect = static_cast<double>(M + S - 1) * (f + b);
            ASSERT_EQ(r.makespan, expect) << name << " S=" << S << " M=" << M << " f=" << f << " b=" << b;
            // Same statement as a bubble fraction: idle share of the S * makespan device-time.
            const double busy = static_cast<double>(S * M) * (f + b);
            const double bubble = 1.0 - busy / (static_cast<double>(S) * r.makespan);
            EXPECT_NEAR(bubble, static_cast<double>(S - 1) / static_cast<double>(M + S - 1), 1e-12);
          }
}

// Random per-stage costs and transfer times: never a deadlock, and the timelines are consistent
// (compute never overlaps on a stage, F before B, a receive ends no earlier than its message
// arrives, and nothing finishes before the busiest stage's own work).
RC_GTEST_PROP(Schedule, SimulationIsConsistentUnderAnyCosts, ()) {
  const std::string name = *rc::gen::element<std::string>("gpipe", "1f1b", "eager-1f1b");
  const int64_t S = *rc::gen::inRange<int64_t>(1, 9);
  const int64_t M = *rc::gen::inRange<int64_t>(1, 17);
  SimCosts c;
  for (int64_t s = 0; s < S; ++s) {
    c.forward.push_back(*rc::gen::inRange(1, 100) / 8.0);
    c.backward.push_back(*rc::gen::inRange(1, 200) / 8.0);
  }
  c.p2p = *rc::gen::inRange(0, 40) / 8.0;
  const auto st = all_stages(name, S, M);
  const SimResult r = simulate(st, c);

  size_t total = 0;
  for (const auto& a : st) total += a.size();
  RC_ASSERT(r.events.size() == total);

  std::map<std::tuple<int64_t, int, int64_t>, const SimEvent*> by;  // (stage, kind, mb)
  for (const auto& e : r.events) by[{e.stage, static_cast<int>(e.action.kind), e.action.micro_batch}] = &e;
  double lower = 0;
  for (int64_t s = 0; s < S; ++s) {
    lower = std::max(lower, static_cast<double>(M) * (c.forward[static_cast<size_t>(s)] + c.backward[static_cast<size_t>(s)]));
    double prev_end = 0;
    // A link direction carries one message at a time: each arrives p2p after it was sent or after
    // the one before it arrived, whichever is later.
    double last_act = 0, last_grad = 0;
    for (const auto& e : r.events) {
      if (e.stage != s) continue;
      RC_ASSERT(e.start <= e.end);
      if (e.action.kind == K::SendActivation || e.action.kind == K::SendGrad) {
        double& last = e.action.kind == K::SendActivation ? last_act : last_grad;
        RC_ASSERT(e.end == std::max(e.start, last) + c.p2p);
        last = e.end;
        continue;
      }
      RC_ASSERT(e.start >= prev_end);  // a stage does one thing at a time, in list order
      prev_end = e.end;
    }
    for (int64_t m = 0; m < M; ++m) {
      const SimEvent* f = by.at({s, static_cast<int>(K::Forward), m});
      const SimEvent* b = by.at({s, static_cast<int>(K::Backward), m});
      RC_ASSERT(b->start >= f->end);
      if (s > 0) {
        RC_ASSERT(by.at({s, static_cast<int>(K::RecvActivation), m})->end >= by.at({s - 1, static_cast<int>(K::SendActivation), m})->end);
        RC_ASSERT(f->start >= by.at({s - 1, static_cast<int>(K::Forward), m})->end + c.p2p);
        // ... and the fast path the planner uses agrees with it under queueing too.
      }
      if (s + 1 < S) {
        RC_ASSERT(by.at({s, static_cast<int>(K::RecvGrad), m})->end >= by.at({s + 1, static_cast<int>(K::SendGrad), m})->end);
        RC_ASSERT(b->start >= by.at({s + 1, static_cast<int>(K::Backward), m})->end + c.p2p);
      }
    }
  }
  RC_ASSERT(r.makespan >= lower);
}

TEST(Schedule, SingleStageIsPlainGradientAccumulation) {
  const std::vector<Action> ofob = one_f_one_b(0, 1, 3);
  EXPECT_EQ(to_string(ofob), "F0 B0 F1 B1 F2 B2");
  const std::vector<Action> gp = gpipe(0, 1, 3);
  EXPECT_EQ(to_string(gp), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(to_string(one_f_one_b(0, 1, 1)), "F0 B0");
  EXPECT_EQ(to_string(gpipe(0, 1, 1)), "F0 B0");
}

// The Megatron 1F1B shape, spelled out for a 4-stage, 6-micro-batch pipeline.
TEST(Schedule, OneFOneBShapeMatchesMegatron) {
  EXPECT_EQ(to_string(one_f_one_b(0, 4, 6)),
            "F0 sendA0 F1 sendA1 F2 sendA2 F3 sendA3 recvG0 B0 F4 sendA4 recvG1 B1 F5 sendA5 recvG2 B2 recvG3 B3 recvG4 B4 "
            "recvG5 B5");
  EXPECT_EQ(to_string(one_f_one_b(2, 4, 6)),
            "recvA0 F0 sendA0 recvA1 F1 sendA1 recvG0 B0 sendG0 recvA2 F2 sendA2 recvG1 B1 sendG1 recvA3 F3 sendA3 recvG2 B2 "
            "sendG2 recvA4 F4 sendA4 recvG3 B3 sendG3 recvA5 F5 sendA5 recvG4 B4 sendG4 recvG5 B5 sendG5");
  // Last stage: no warm-up, strictly alternating.
  EXPECT_EQ(to_string(one_f_one_b(3, 4, 2)), "recvA0 F0 B0 sendG0 recvA1 F1 B1 sendG1");
  // Fewer micro-batches than stages: warm-up is capped at M, stage 0 forwards everything first.
  EXPECT_EQ(to_string(one_f_one_b(0, 4, 2)), "F0 sendA0 F1 sendA1 recvG0 B0 recvG1 B1");
}

// 1F1B's shape with one more warm-up forward on every stage but the last.
TEST(Schedule, EagerOneFOneBShape) {
  // 1F1B's stage 0 of 2 forwards F0 F1 before B0; eager F0 F1 F2.
  EXPECT_EQ(to_string(eager_one_f_one_b(0, 2, 4)), "F0 sendA0 F1 sendA1 F2 sendA2 recvG0 B0 F3 sendA3 recvG1 B1 recvG2 B2 recvG3 B3");
  EXPECT_EQ(to_string(eager_one_f_one_b(1, 2, 4)), to_string(one_f_one_b(1, 2, 4)));
  EXPECT_EQ(to_string(eager_one_f_one_b(1, 3, 3)),
            "recvA0 F0 sendA0 recvA1 F1 sendA1 recvA2 F2 sendA2 recvG0 B0 sendG0 recvG1 B1 sendG1 recvG2 B2 sendG2");
  // Capped at M like 1F1B's.
  EXPECT_EQ(to_string(eager_one_f_one_b(0, 3, 2)), "F0 sendA0 F1 sendA1 recvG0 B0 recvG1 B1");
  EXPECT_THROW(eager_one_f_one_b(2, 2, 4), std::invalid_argument);
  // Three more: F0..F3 before the steady phase's first F4 B0 on stage 0 of 2; capped at M.
  EXPECT_EQ(to_string(eager_one_f_one_b(0, 2, 6, 3)),
            "F0 sendA0 F1 sendA1 F2 sendA2 F3 sendA3 F4 sendA4 recvG0 B0 F5 sendA5 recvG1 B1 recvG2 B2 recvG3 B3 recvG4 B4 recvG5 B5");
  EXPECT_EQ(to_string(eager_one_f_one_b(0, 2, 2, 4)), "F0 sendA0 F1 sendA1 recvG0 B0 recvG1 B1");
  EXPECT_EQ(to_string(eager_one_f_one_b(1, 2, 4, 4)), to_string(one_f_one_b(1, 2, 4)));
  EXPECT_THROW(eager_one_f_one_b(0, 2, 4, 0), std::invalid_argument);
  EXPECT_THROW(eager_one_f_one_b(0, 2, 4, kMaxEagerExtra + 1), std::invalid_argument);
}

// A distant link (f = 1, b = 2 on both stages, messages of 0.5 s of bytes behind 3 s of latency):
// a micro-batch's round trip from stage 0 (its activation out, stage 1's 3 s, its gradient back)
// is 10 s, during which eager 1F1B's stage 0 has only one more forward to run. Each extra forward
// in flight fills one more second of it, until stage 0 never idles in its steady phase.
TEST(Schedule, MoreForwardsInFlightHideALongRoundTrip) {
  SimCosts c = uniform(2, 1, 2, 3.5);
  c.p2p_latency = {3};
  double before = simulate(all_stages("1f1b", 2, 12), c).makespan;
  for (const std::string name : {"eager-1f1b", "eager-1f1b-2", "eager-1f1b-3"}) {
    const double t = simulate(all_stages(name, 2, 12), c).makespan;
    EXPECT_LT(t, before) << name;
    EXPECT_EQ(simulate_times(name, 2, 12, c).makespan, t) << name;
    before = t;
  }
  // With 3 more (46 s against 81 under 1F1B) stage 0 waits only for the first gradient and the last
  // ones, which no schedule can hide: one more gains nothing.
  EXPECT_EQ(simulate(all_stages("eager-1f1b-4", 2, 12), c).makespan, before);
  EXPECT_EQ(eager_extra("1f1b"), 0);
  EXPECT_EQ(eager_extra("eager-1f1b"), 1);
  EXPECT_EQ(eager_extra("eager-1f1b-4"), 4);
  EXPECT_EQ(eager_extra("eager-1f1b-1"), -1);
  EXPECT_EQ(eager_extra("eager-1f1b-5"), -1);
  EXPECT_EQ(eager_extra("gpipe"), -1);
}

// Two stages of equal forward + backward (f = 1, b = 2), messages of p = 0.5, 8 micro-batches.
// Eager: F0 on stage 0 [0,1] arrives at 1.5; stage 1 then always has its next activation waiting
// and runs its 8 (F + B) back to back until 25.5; G7 arrives at 26 and stage 0's B7 ends at 28.
// 1F1B (hand-traced): stage 0 sends A(m+2) only after B(m), i.e. after G(m)'s way back, so stage 1
// gets its activations in pairs: after micro-batches 1, 3 and 5 it waits 2p (the gradient's way
// back and the next activation's way on) for the next one: 28 + 3 * 1.
TEST(Schedule, EagerOneFOneBHidesTheMessagesOfBalancedStages) {
  const SimCosts c = uniform(2, 1, 2, 0.5);
  const SimResult eager = simulate(all_stages("eager-1f1b", 2, 8), c);
  EXPECT_DOUBLE_EQ(eager.makespan, 28.0);
  EXPECT_DOUBLE_EQ(simulate(all_stages("1f1b", 2, 8), c).makespan, 31.0);
  EXPECT_EQ(simulate_times("eager-1f1b", 2, 8, c).makespan, eager.makespan);
  // A slower first stage (f = 2, b = 4) is the bottleneck under both, but 1F1B's stage 0 waits
  // for G0 from 4 (F0 F1 done) to 6 (stage 1's F0 B0 and both messages): eager runs F2 there, and
  // stage 0 never idles: 8 x 6.
  SimCosts slow_first = c;
  slow_first.forward[0] = 2, slow_first.backward[0] = 4;
  EXPECT_DOUBLE_EQ(simulate(all_stages("1f1b", 2, 8), slow_first).makespan, 50.0);
  EXPECT_DOUBLE_EQ(simulate(all_stages("eager-1f1b", 2, 8), slow_first).makespan, 48.0);
}

TEST(Schedule, GPipeShape) {
  EXPECT_EQ(to_string(gpipe(1, 3, 2)), "recvA0 F0 sendA0 recvA1 F1 sendA1 recvG0 B0 sendG0 recvG1 B1 sendG1");
}

TEST(Schedule, MakeScheduleDispatchesAndRejectsUnknownNames) {
  EXPECT_EQ(make_schedule("1f1b", 1, 3, 5), one_f_one_b(1, 3, 5));
  EXPECT_EQ(make_schedule("gpipe", 1, 3, 5), gpipe(1, 3, 5));
  EXPECT_EQ(make_schedule("zb-h1", 1, 3, 5), zb_h1(1, 3, 5));
  EXPECT_EQ(make_schedule("eager-1f1b", 1, 3, 5), eager_one_f_one_b(1, 3, 5));
  EXPECT_EQ(make_schedule("eager-1f1b-3", 0, 3, 9), eager_one_f_one_b(0, 3, 9, 3));
  EXPECT_EQ(make_schedule("interleaved-1f1b", 1, 2, 4, 2), interleaved_one_f_one_b(1, 2, 4, 2));
  // Chunks need the interleaved schedule; the others run one a stage, and say so.
  for (const std::string one : {"1f1b", "gpipe", "zb-h1", "eager-1f1b-2"}) {
    try {
      make_schedule(one, 0, 2, 4, 2);
      FAIL() << "'" << one << "' accepted 2 virtual stages";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + one + "' runs one chunk a stage, not 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("interleaved-1f1b"), std::string::npos) << msg;
    }
  }
  for (const std::string bad : {"", "1F1B", "interleaved", "gpipe ", "eager-1f1b-1", "eager-1f1b-5", "eager-1f1b-22"}) {
    try {
      make_schedule(bad, 0, 2, 4);
      FAIL() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("gpipe"), std::string::npos) << msg;
      EXPECT_NE(msg.find("1f1b"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'" + bad + "'"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(schedule_names(), (std::vector<std::string>{"1f1b", "eager-1f1b", "eager-1f1b-2", "eager-1f1b-3", "eager-1f1b-4", "gpipe", "zb-h1"}));
  EXPECT_TRUE(splits_backward("zb-h1"));
  EXPECT_FALSE(splits_backward("1f1b"));
  EXPECT_FALSE(splits_backward("gpipe"));
  EXPECT_FALSE(splits_backward("eager-1f1b"));
}

TEST(Schedule, RejectsBadShapes) {
  EXPECT_THROW(one_f_one_b(0, 0, 4), std::invalid_argument);
  EXPECT_THROW(one_f_one_b(2, 2, 4), std::invalid_argument);
  EXPECT_THROW(one_f_one_b(-1, 2, 4), std::invalid_argument);
  EXPECT_THROW(gpipe(0, 2, 0), std::invalid_argument);
  EXPECT_THROW(make_schedule("gpipe", 0, 1, -3), std::invalid_argument);
}

TEST(Schedule, ToStringNamesEveryKind) {
  EXPECT_EQ(to_string(Action{K::Forward, 3}), "F3");
  EXPECT_EQ(to_string(Action{K::Backward, 0}), "B0");
  EXPECT_EQ(to_string(Action{K::SendActivation, 3}), "sendA3");
  EXPECT_EQ(to_string(Action{K::RecvActivation, 12}), "recvA12");
  EXPECT_EQ(to_string(Action{K::SendGrad, 2}), "sendG2");
  EXPECT_EQ(to_string(Action{K::RecvGrad, 1}), "recvG1");
  EXPECT_EQ(to_string(Action{K::BackwardWeight, 4}), "W4");
}

TEST(Schedule, LastBackwardIndex) {
  for (const std::string name : {"gpipe", "1f1b", "zb-h1"})
    for (int64_t S = 1; S <= 4; ++S)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t M = 1; M <= 6; ++M) {
          const auto a = make_schedule(name, s, S, M);
          const size_t i = last_backward_index(a);
          ASSERT_LT(i, a.size());
          EXPECT_EQ(a[i], (Action{K::Backward, M - 1})) << where(name, s, S, M);
          for (size_t j = i + 1; j < a.size(); ++j) EXPECT_NE(a[j].kind, K::Backward);
        }
  const std::vector<Action> fwd_only = {{K::Forward, 0}, {K::SendActivation, 0}};
  EXPECT_EQ(last_backward_index(fwd_only), fwd_only.size());
  EXPECT_EQ(last_backward_index({}), 0u);
}

// A hand-worked timeline with transfer costs, so the simulator is checked against numbers not
// derived from itself. 2 stages, 2 micro-batches, 1F1B, f = 1, b = 2, p2p = 0.5:
//   stage 1: recvA0 waits until 1.5, F0 [1.5,2.5], B0 [2.5,4.5], sendG0 arrives 5, recvA1 (there
//            since 2.5), F1 [4.5,5.5], B1 [5.5,7.5], sendG1 arrives 8
//   stage 0: F0 [0,1], F1 [1,2], recvG0 waits until 5, B0 [5,7], recvG1 waits until 8, B1 [8,10]
// Makespan 10.
TEST(Schedule, SimulationWithTransfersMatchesHandComputation) {
  const SimResult r = simulate(all_stages("1f1b", 2, 2), uniform(2, 1, 2, 0.5));
  const auto t = timeline(r);
  using P = std::pair<double, double>;
  EXPECT_EQ(t.at("0:F0"), P(0, 1));
  EXPECT_EQ(t.at("0:sendA0"), P(1, 1.5));
  EXPECT_EQ(t.at("0:F1"), P(1, 2));
  EXPECT_EQ(t.at("0:recvG0"), P(2, 5));
  EXPECT_EQ(t.at("0:B0"), P(5, 7));
  EXPECT_EQ(t.at("0:recvG1"), P(7, 8));
  EXPECT_EQ(t.at("0:B1"), P(8, 10));
  EXPECT_EQ(t.at("1:recvA0"), P(0, 1.5));
  EXPECT_EQ(t.at("1:F0"), P(1.5, 2.5));
  EXPECT_EQ(t.at("1:B0"), P(2.5, 4.5));
  EXPECT_EQ(t.at("1:sendG0"), P(4.5, 5));
  EXPECT_EQ(t.at("1:recvA1"), P(4.5, 4.5));
  EXPECT_EQ(t.at("1:F1"), P(4.5, 5.5));
  EXPECT_EQ(t.at("1:B1"), P(5.5, 7.5));
  EXPECT_EQ(t.at("1:sendG1"), P(7.5, 8));
  EXPECT_EQ(r.makespan, 10);
  EXPECT_EQ(r.peak_in_flight, (std::vector<int64_t>{2, 1}));
}

TEST(Schedule, PerMicroBatchCostsReplaceAStagesFlatCost) {
  // One stage: the makespan is the sum of what each micro-batch costs.
  SimCosts one = uniform(1, 1, 2, 0);
  one.forward_mb = {{1, 2, 3}};
  one.backward_mb = {{2, 4, 6}};
  EXPECT_DOUBLE_EQ(simulate(all_stages("gpipe", 1, 3), one).makespan, 18);
  // Two stages whose per-micro-batch costs mirror each other (a floating boundary): the event
  // simulation and the fast path agree, on both schedules, and differ from the flat average.
  for (const std::string sched : {"1f1b", "gpipe"}) {
    SimCosts c = uniform(2, 1, 2, 0.25);
    c.forward_mb = {{1.5, 0.5, 1.5, 0.5}, {0.5, 1.5, 0.5, 1.5}};
    c.backward_mb = {{3, 1, 3, 1}, {1, 3, 1, 3}};
    const SimResult r = simulate(all_stages(sched, 2, 4), c);
    EXPECT_DOUBLE_EQ(simulate_times(sched, 2, 4, c).makespan, r.makespan) << sched;
    double f1 = 0;
    for (const auto& e : r.events)
      if (e.stage == 0 && e.action.kind == ActionKind::Forward && e.action.micro_batch == 1) f1 = e.end - e.start;
    EXPECT_DOUBLE_EQ(f1, 0.5);
    EXPECT_NE(r.makespan, simulate(all_stages(sched, 2, 4), uniform(2, 1, 2, 0.25)).makespan) << sched;
  }
  SimCosts short_ = uniform(1, 1, 2, 0);
  short_.forward_mb = {{1, 2}};
  EXPECT_THROW(simulate(all_stages("gpipe", 1, 3), short_), std::invalid_argument);
  EXPECT_THROW(simulate_times("gpipe", 1, 3, short_), std::invalid_argument);
  short_.forward_mb = {{1, -2, 1}};
  EXPECT_THROW(simulate(all_stages("gpipe", 1, 3), short_), std::invalid_argument);
}

TEST(Schedule, SimulationDetectsDeadlockAndNamesStuckStages) {
  // Stage 0 waits for a gradient before sending the activation that would produce it.
  const std::vector<std::vector<Action>> st = {
      {{K::Forward, 0}, {K::RecvGrad, 0}, {K::SendActivation, 0}, {K::Backward, 0}},
      {{K::RecvActivation, 0}, {K::Forward, 0}, {K::Backward, 0}, {K::SendGrad, 0}},
  };
  try {
    simulate(st, uniform(2, 1, 1));
    FAIL() << "deadlock not detected";
  } catch (const std::logic_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("deadlock"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stage 0 waits at action 1 (recvG0)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stage 1 waits at action 0 (recvA0)"), std::string::npos) << msg;
  }
}

TEST(Schedule, SimulationRejectsSchedulesTheExecutorCouldNotRun) {
  auto throws_with = [](const std::vector<std::vector<Action>>& st, const std::string& needle) {
    try {
      simulate(st, uniform(static_cast<int64_t>(st.size()), 1, 1));
    } catch (const std::logic_error& e) {
      return std::string(e.what()).find(needle) != std::string::npos ? std::string() : std::string(e.what());
    }
    return std::string("no error");
  };
  // Micro-batch order differs across the link.
  EXPECT_EQ(throws_with({{{K::Forward, 0}, {K::Forward, 1}, {K::SendActivation, 1}, {K::SendActivation, 0}},
                         {{K::RecvActivation, 0}, {K::Forward, 0}, {K::RecvActivation, 1}, {K::Forward, 1}}},
                        "micro-batch 1"),
            "");
  // A message nobody receives.
  EXPECT_EQ(throws_with({{{K::Forward, 0}, {K::SendActivation, 0}}, {}}, "never received"), "");
  // Forward on a non-first stage without its activation.
  EXPECT_EQ(throws_with({{}, {{K::Forward, 0}}}, "before its activation"), "");
  // Backward before forward; backward on a non-last stage without its gradient.
  EXPECT_EQ(throws_with({{{K::Backward, 0}}}, "backward before forward"), "");
  EXPECT_EQ(throws_with({{{K::Forward, 0}, {K::Backward, 0}}, {}}, "before its gradient"), "");
  // Sends of things not computed; receives past the ends of the pipeline.
  EXPECT_EQ(throws_with({{{K::SendActivation, 0}}, {}}, "not been computed"), "");
  EXPECT_EQ(throws_with({{{K::RecvActivation, 0}}}, "first stage"), "");
  EXPECT_EQ(throws_with({{{K::RecvGrad, 0}}}, "last stage"), "");
  // Repeats.
  EXPECT_EQ(throws_with({{{K::Forward, 0}, {K::Forward, 0}}}, "repeated"), "");
  EXPECT_THROW(simulate({{{K::Forward, 0}}, {}}, uniform(1, 1, 1)), std::invalid_argument);
}

// ZB-H1 for 2 stages and 4 micro-batches, spelled out: the last stage holds back one weight pass,
// the first splits nothing.
TEST(Schedule, ZeroBubbleH1Shape) {
  EXPECT_EQ(to_string(zb_h1(0, 2, 4)), to_string(one_f_one_b(0, 2, 4)));  // stage 0: whole backwards
  EXPECT_EQ(to_string(zb_h1(1, 2, 4)),
            "recvA0 F0 B0 sendG0 recvA1 F1 B1 sendG1 W0 recvA2 F2 B2 sendG2 W1 recvA3 F3 B3 sendG3 W2 W3");
  // One stage: nothing to hold back, nothing to split.
  EXPECT_EQ(to_string(zb_h1(0, 1, 2)), "F0 B0 F1 B1");
  // More stages than micro-batches: every weight pass of the last stage waits for the end.
  EXPECT_EQ(to_string(zb_h1(2, 3, 2)), "recvA0 F0 B0 sendG0 recvA1 F1 B1 sendG1 W0 W1");
}

// Equal stages, free transfers, forward f, input backward b, weight pass w: ZB-H1 takes
// M(f+b+w) + (S-1)(f+b-w) where 1F1B takes M(f+b+w) + (S-1)(f+b+w) (Qi et al. 2023, ZB-H1), as
// long as a weight pass is no longer than a forward or an input backward (w <= min(f, b)); a
// longer one leaves part of the drain, and ZB-H1 is still never slower than 1F1B. Each stage holds
// at most min(S, M) micro-batches, 1F1B's stage 0 bound. Integer costs keep the sums exact.
TEST(Schedule, ZeroBubbleH1MakespanMatchesItsFormula) {
  for (double f : {1.0, 2.0})
    for (double b : {1.0, 2.0})
      for (double w : {0.0, 1.0, 2.0})
        for (int64_t S = 1; S <= 6; ++S)
          for (int64_t M = S; M <= 12; ++M) {
            SimCosts c = uniform(S, f, b + w);
            c.weight.assign(static_cast<size_t>(S), w);
            const SimResult r = simulate(all_stages("zb-h1", S, M), c);
            const double expect = static_cast<double>(M) * (f + b + w) + static_cast<double>(S - 1) * (f + b - w);
            const std::string at = "S=" + std::to_string(S) + " M=" + std::to_string(M) + " f=" + std::to_string(f) +
                                   " b=" + std::to_string(b) + " w=" + std::to_string(w);
            if (w <= std::min(f, b)) ASSERT_EQ(r.makespan, expect) << at;
            EXPECT_EQ(simulate_times("zb-h1", S, M, c).makespan, r.makespan) << at;
            const SimResult o = simulate(all_stages("1f1b", S, M), c);
            EXPECT_EQ(o.makespan, static_cast<double>(M + S - 1) * (f + b + w));
            EXPECT_LE(r.makespan, o.makespan) << at;
            if (S > 1 && w > 0) EXPECT_LT(r.makespan, o.makespan) << at;
            for (int64_t s = 0; s < S; ++s) EXPECT_EQ(r.peak_in_flight[static_cast<size_t>(s)], std::min(S, M)) << "stage " << s;
          }
}

// The fast path (the planner's) and the event simulation agree on zb-h1 under any costs, per
// micro-batch ones included, and the window where gradients turn final ends with the last weight
// pass and spans the last micro-batch's whole backward.
RC_GTEST_PROP(Schedule, ZeroBubbleFastPathMatchesSimulation, ()) {
  const int64_t S = *rc::gen::inRange<int64_t>(1, 7);
  const int64_t M = *rc::gen::inRange<int64_t>(1, 13);
  SimCosts c;
  for (int64_t s = 0; s < S; ++s) {
    c.forward.push_back(*rc::gen::inRange(1, 100) / 8.0);
    c.backward.push_back(*rc::gen::inRange(2, 200) / 8.0);
    c.weight.push_back(c.backward.back() * *rc::gen::inRange(0, 9) / 10.0);
  }
  c.p2p = *rc::gen::inRange(0, 40) / 8.0;
  if (*rc::gen::arbitrary<bool>()) {  // a floating boundary's alternating costs on stage 0
    c.forward_mb.assign(1, {});
    c.backward_mb.assign(1, {});
    c.weight_mb.assign(1, {});
    for (int64_t m = 0; m < M; ++m) {
      c.forward_mb[0].push_back(c.forward[0] * (m % 2 ? 0.5 : 1.5));
      c.backward_mb[0].push_back(c.backward[0] * (m % 2 ? 0.5 : 1.5));
      c.weight_mb[0].push_back(c.weight[0] * (m % 2 ? 0.5 : 1.5));
    }
  }
  const SimResult r = simulate(all_stages("zb-h1", S, M), c);
  const StageTimes t = simulate_times("zb-h1", S, M, c);
  RC_ASSERT(t.makespan == r.makespan);
  for (int64_t s = 0; s < S; ++s) {
    const size_t su = static_cast<size_t>(s);
    RC_ASSERT(t.last_backward_end[su] == r.last_backward_end[su]);
    RC_ASSERT(t.last_backward_start[su] == r.last_backward_start[su]);
    RC_ASSERT(t.peak_in_flight[su] == r.peak_in_flight[su]);
    double last_end = 0;
    for (const auto& e : r.events)  // sends run beside the stage's work
      if (e.stage == s && e.action.kind != K::SendActivation && e.action.kind != K::SendGrad) last_end = std::max(last_end, e.end);
    RC_ASSERT(r.last_backward_end[su] == last_end);
    RC_ASSERT(std::abs(r.last_backward_end[su] - r.last_backward_start[su] - c.backward_of(su, M - 1)) < 1e-9);
  }
}

TEST(Schedule, WeightPassesAreChecked) {
  SimCosts c = uniform(2, 1, 2);
  c.weight = {1, 3};  // stage 1's weight pass exceeds its whole backward
  EXPECT_THROW(simulate(all_stages("zb-h1", 2, 3), c), std::invalid_argument);
  EXPECT_THROW(simulate_times("zb-h1", 2, 3, c), std::invalid_argument);
  c.weight = {1, -1};
  EXPECT_THROW(simulate_times("zb-h1", 2, 3, c), std::invalid_argument);
  // A weight pass before its backward, or twice.
  EXPECT_THROW(simulate({{{K::Forward, 0}, {K::BackwardWeight, 0}, {K::Backward, 0}}}, uniform(1, 1, 2)), std::logic_error);
  EXPECT_THROW(simulate({{{K::Forward, 0}, {K::Backward, 0}, {K::BackwardWeight, 0}, {K::BackwardWeight, 0}}}, uniform(1, 1, 2)),
               std::logic_error);
  // 1F1B ignores weight figures: its Backward is the whole backward.
  c.weight = {1, 1};
  EXPECT_EQ(simulate(all_stages("1f1b", 2, 3), c).makespan, simulate(all_stages("1f1b", 2, 3), uniform(2, 1, 2)).makespan);
}

// A thin link: each message takes longer than the forward that produces it, so on 1F1B's warm-up
// the activations queue. 2 stages, 3 micro-batches, f = 1, b = 1, p2p = 2 (hand-computed):
//   stage 0: F0 [0,1] sendA0 arrives 3; F1 [1,2] sendA1 waits for the link until 3, arrives 5;
//            (1F1B warm-up is 1) recvG0 ...
//   stage 1: recvA0 until 3, F0 [3,4], B0 [4,5], sendG0 arrives 7; recvA1 (5) F1 [5,6] B1 [6,7]
//            sendG1 leaves at 7 (after G0 arrives), arrives 9
// Without queueing sendA1 would arrive at 4 and sendG1 at 8.
TEST(Schedule, MessagesQueueOnAThinLink) {
  const SimResult r = simulate(all_stages("1f1b", 2, 3), uniform(2, 1, 1, 2));
  const auto t = timeline(r);
  using P = std::pair<double, double>;
  EXPECT_EQ(t.at("0:sendA0"), P(1, 3));
  EXPECT_EQ(t.at("0:sendA1"), P(2, 5));
  EXPECT_EQ(t.at("1:F0"), P(3, 4));
  EXPECT_EQ(t.at("1:sendG0"), P(5, 7));
  EXPECT_EQ(t.at("1:F1"), P(5, 6));
  EXPECT_EQ(t.at("1:sendG1"), P(7, 9));
  for (const std::string sched : {"1f1b", "eager-1f1b", "gpipe", "zb-h1"}) {
    SimCosts c = uniform(3, 1, 1, 2);
    c.weight = {0, 0.5, 0.5};
    EXPECT_EQ(simulate_times(sched, 3, 5, c).makespan, simulate(all_stages(sched, 3, 5), c).makespan) << sched;
  }
}
