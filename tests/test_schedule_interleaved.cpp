// Interleaved 1F1B (virtual stages): the lists' structure, the simulator's reading of chunks, and
// the bubble the schedule exists to shrink.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "alloy/pipeline/schedule.h"

using namespace alloy::pipeline;

namespace {

using K = ActionKind;

std::vector<std::vector<Action>> ranks_of(int64_t S, int64_t M, int64_t V) {
  std::vector<std::vector<Action>> v;
  for (int64_t s = 0; s < S; ++s) v.push_back(interleaved_one_f_one_b(s, S, M, V));
  return v;
}

// Costs per virtual stage (S x V of them), all alike.
SimCosts uniform(int64_t C, double f, double b, double p2p = 0) {
  return SimCosts{std::vector<double>(static_cast<size_t>(C), f), std::vector<double>(static_cast<size_t>(C), b), p2p};
}

// The lists' own rules, without simulate(): every (chunk, micro-batch) forwarded and backwarded
// once, backward after forward, receives right before and sends right after their compute, none
// on the pipeline's two ends, and both sides of every virtual link in the same order.
std::string check_structure(int64_t S, int64_t M, int64_t V) {
  const auto st = ranks_of(S, M, V);
  const std::string w0 = "S=" + std::to_string(S) + " M=" + std::to_string(M) + " V=" + std::to_string(V) + " ";
  // What each virtual stage sends and receives, in order: by (virtual stage, kind).
  std::map<std::pair<int64_t, K>, std::vector<int64_t>> seq;
  for (int64_t s = 0; s < S; ++s) {
    const auto& a = st[static_cast<size_t>(s)];
    const std::string w = w0 + "rank " + std::to_string(s) + " [" + to_string(a) + "]: ";
    std::map<std::pair<int64_t, int64_t>, size_t> at_f, at_b;
    for (size_t i = 0; i < a.size(); ++i) {
      const Action& x = a[i];
      if (x.chunk < 0 || x.chunk >= V || x.micro_batch < 0 || x.micro_batch >= M) return w + "out of range at " + std::to_string(i);
      const int64_t c = x.chunk * S + s;
      const bool first = c == 0, last = c == S * V - 1;
      const std::pair<int64_t, int64_t> key{x.chunk, x.micro_batch};
      switch (x.kind) {
        case K::Forward:
          if (at_f.count(key)) return w + "F repeated";
          at_f[key] = i;
          break;
        case K::Backward:
          if (at_b.count(key)) return w + "B repeated";
          at_b[key] = i;
          break;
        case K::RecvActivation:
          if (first) return w + "the first virtual stage receives";
          if (i + 1 >= a.size() || a[i + 1] != Action{K::Forward, x.micro_batch, x.chunk}) return w + "recvA not right before its F";
          break;
        case K::SendActivation:
          if (last) return w + "the last virtual stage sends";
          if (i == 0 || a[i - 1] != Action{K::Forward, x.micro_batch, x.chunk}) return w + "sendA not right after its F";
          break;
        case K::RecvGrad:
          if (last) return w + "the last virtual stage receives a gradient";
          if (i + 1 >= a.size() || a[i + 1] != Action{K::Backward, x.micro_batch, x.chunk}) return w + "recvG not right before its B";
          break;
        case K::SendGrad:
          if (first) return w + "the first virtual stage sends a gradient";
          if (i == 0 || a[i - 1] != Action{K::Backward, x.micro_batch, x.chunk}) return w + "sendG not right after its B";
          break;
        case K::BackwardWeight:
          return w + "a weight pass";
      }
      if (x.kind != K::Forward && x.kind != K::Backward) seq[{c, x.kind}].push_back(x.micro_batch);
    }
    for (int64_t v = 0; v < V; ++v)
      for (int64_t m = 0; m < M; ++m) {
        if (!at_f.count({v, m}) || !at_b.count({v, m})) return w + "chunk " + std::to_string(v) + " micro-batch " + std::to_string(m) + " missing";
        if (at_b[{v, m}] < at_f[{v, m}]) return w + "B before F";
      }
  }
  for (int64_t c = 0; c + 1 < S * V; ++c) {
    if (seq[{c, K::SendActivation}] != seq[{c + 1, K::RecvActivation}]) return w0 + "virtual link " + std::to_string(c) + ": activation orders differ";
    if (seq[{c + 1, K::SendGrad}] != seq[{c, K::RecvGrad}]) return w0 + "virtual link " + std::to_string(c) + ": gradient orders differ";
    if (seq[{c, K::SendActivation}].size() != static_cast<size_t>(M)) return w0 + "virtual link " + std::to_string(c) + ": not every micro-batch crosses";
    if (seq[{c + 1, K::SendGrad}].size() != static_cast<size_t>(M))
      return w0 + "virtual link " + std::to_string(c) + ": not every micro-batch's gradient crosses back";
  }
  return "";
}

}  // namespace

TEST(Interleaved, StructureHoldsForAllSmallPipelines) {
  for (int64_t S = 2; S <= 6; ++S)
    for (int64_t V = 2; V <= 4; ++V)
      for (int64_t M = 1; M <= 4 * S; ++M) {
        if (M > S && M % S != 0) continue;
        const std::string err = check_structure(S, M, V);
        ASSERT_TRUE(err.empty()) << err;
      }
}

// Megatron's shape: on 2 stages with 2 chunks and 4 micro-batches rank 0 forwards micro-batches 0
// and 1 through chunk 0, then through chunk 1 (from rank 1's chunk 0, over the wrap), before its
// first backward, which is the last chunk's.
TEST(Interleaved, ShapeMatchesMegatron) {
  const auto r0 = interleaved_one_f_one_b(0, 2, 4, 2);
  std::vector<std::string> compute;
  for (const auto& a : r0)
    if (a.kind == K::Forward || a.kind == K::Backward) compute.push_back(to_string(a));
  const std::vector<std::string> expect = {"F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1", "F2.1", "B0", "F3.1", "B1",
                                           "B2.1", "B3.1", "B2", "B3"};
  EXPECT_EQ(compute, expect) << to_string(r0);
  EXPECT_EQ(interleaved_warmup(0, 2, 4, 2), 4);
  EXPECT_EQ(interleaved_warmup(1, 2, 4, 2), 2);
  EXPECT_EQ(interleaved_warmup(0, 4, 2, 2), 4);  // capped at the V M forwards there are
}

// Megatron-LM's warm-up for the interleaved schedule (schedules.py,
// forward_backward_pipelining_with_interleaving), written out here rather than taken from the
// code under test: 2 (S - s - 1) + (V - 1) S forwards, never more than M V. (Where M equals S,
// Megatron runs all M V forwards first; Alloy keeps the formula there, holding fewer activations,
// and the structure and simulation tests above and below cover that case too.)
TEST(Interleaved, WarmUpIsMegatrons) {
  for (int64_t S = 2; S <= 6; ++S)
    for (int64_t V = 2; V <= 4; ++V)
      for (int64_t M = 1; M <= 4 * S; ++M) {
        if (M > S && M % S != 0) continue;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t megatron = std::min(2 * (S - s - 1) + (V - 1) * S, M * V);
          EXPECT_EQ(interleaved_warmup(s, S, M, V), megatron) << "S=" << S << " M=" << M << " V=" << V << " rank " << s;
        }
      }
}

TEST(Interleaved, RejectsWhatIsNotInterleaving) {
  EXPECT_THROW(interleaved_one_f_one_b(0, 1, 4, 2), std::invalid_argument);
  EXPECT_THROW(interleaved_one_f_one_b(0, 2, 4, 1), std::invalid_argument);
  EXPECT_THROW(interleaved_one_f_one_b(2, 2, 4, 2), std::invalid_argument);
  EXPECT_THROW(interleaved_one_f_one_b(0, 2, 0, 2), std::invalid_argument);
  // A short last group: the one shape that would deadlock.
  EXPECT_THROW(interleaved_one_f_one_b(0, 4, 5, 2), std::invalid_argument);
  EXPECT_NO_THROW(interleaved_one_f_one_b(0, 4, 3, 2));
}

// Equal chunks of f and b, free transfers, S dividing M: (M V + S - 1)(f + b), where 1F1B over
// the same stages (each chunk V times bigger) takes (M + S - 1) V (f + b). The bubble is V times
// smaller. Small integers: the sums are exact.
TEST(Interleaved, MakespanShrinksTheBubbleVTimes) {
  for (int64_t S = 2; S <= 6; ++S)
    for (int64_t V = 2; V <= 4; ++V)
      for (int64_t M = S; M <= 4 * S; M += S)
        for (double f : {1.0, 2.0})
          for (double b : {1.0, 3.0}) {
            const SimResult r = simulate(ranks_of(S, M, V), uniform(S * V, f, b));
            const double expect = static_cast<double>(M * V + S - 1) * (f + b);
            ASSERT_EQ(r.makespan, expect) << "S=" << S << " M=" << M << " V=" << V << " f=" << f << " b=" << b;
            std::vector<std::vector<Action>> plain;
            for (int64_t s = 0; s < S; ++s) plain.push_back(one_f_one_b(s, S, M));
            const double v = static_cast<double>(V);
            EXPECT_EQ(simulate(plain, uniform(S, f * v, b * v)).makespan, static_cast<double>(M + S - 1) * v * (f + b));
          }
}

// With free transfers no rank ever waits in its steady phase, and rank s holds at most its warm-up
// plus one chunk-micro-batches; rank 0, the longest warm-up, reaches it.
TEST(Interleaved, ActivationsHeldAreTheWarmUpPlusOne) {
  for (int64_t S = 2; S <= 6; ++S)
    for (int64_t V = 2; V <= 4; ++V)
      for (int64_t M = 1; M <= 4 * S; ++M) {
        if (M > S && M % S != 0) continue;
        SimResult r;
        ASSERT_NO_THROW(r = simulate(ranks_of(S, M, V), uniform(S * V, 1, 2, 0.25))) << "S=" << S << " M=" << M << " V=" << V;
        for (int64_t s = 0; s < S; ++s)
          EXPECT_LE(r.peak_in_flight[static_cast<size_t>(s)], std::min(interleaved_warmup(s, S, M, V) + 1, M * V))
              << "S=" << S << " M=" << M << " V=" << V << " rank " << s;
        EXPECT_EQ(r.peak_in_flight[0], std::min(interleaved_warmup(0, S, M, V) + 1, M * V)) << "S=" << S << " M=" << M << " V=" << V;
      }
}

// Any costs per virtual stage, any link times (the wrap link its own): no deadlock, a rank's
// compute never overlaps, each receive ends no earlier than its message lands, and the step is no
// shorter than the busiest rank's own work.
RC_GTEST_PROP(Interleaved, SimulationIsConsistentUnderAnyCosts, ()) {
  const int64_t S = *rc::gen::inRange<int64_t>(2, 7);
  const int64_t V = *rc::gen::inRange<int64_t>(2, 5);
  const int64_t M = *rc::gen::element<int64_t>(1, S - 1, S, 2 * S, 3 * S);
  SimCosts c;
  for (int64_t k = 0; k < S * V; ++k) {
    c.forward.push_back(*rc::gen::inRange(1, 100) / 8.0);
    c.backward.push_back(*rc::gen::inRange(1, 200) / 8.0);
  }
  const size_t links = S > 2 ? static_cast<size_t>(S) : 1;
  for (size_t l = 0; l < links; ++l) c.p2p_link.push_back(*rc::gen::inRange(0, 40) / 8.0);
  const auto st = ranks_of(S, M, V);
  const SimResult r = simulate(st, c);

  size_t total = 0;
  for (const auto& a : st) total += a.size();
  RC_ASSERT(r.events.size() == total);
  std::vector<double> busy(static_cast<size_t>(S), 0.0), free_at(static_cast<size_t>(S), 0.0);
  // Sends by (sending virtual stage, kind, micro-batch) -> arrival.
  std::map<std::tuple<int64_t, int, int64_t>, double> landed;
  for (const auto& e : r.events) {
    const int64_t vs = e.action.chunk * S + e.stage;
    if (e.action.kind == K::SendActivation) landed[{vs, 0, e.action.micro_batch}] = e.end;
    if (e.action.kind == K::SendGrad) landed[{vs, 1, e.action.micro_batch}] = e.end;
  }
  for (const auto& e : r.events) {
    const size_t s = static_cast<size_t>(e.stage);
    const int64_t vs = e.action.chunk * S + e.stage;
    if (e.action.kind == K::Forward || e.action.kind == K::Backward) {
      RC_ASSERT(e.start >= free_at[s] - 1e-9);
      free_at[s] = e.end;
      busy[s] += e.end - e.start;
    }
    if (e.action.kind == K::RecvActivation) RC_ASSERT(e.end >= landed.at({vs - 1, 0, e.action.micro_batch}) - 1e-9);
    if (e.action.kind == K::RecvGrad) RC_ASSERT(e.end >= landed.at({vs + 1, 1, e.action.micro_batch}) - 1e-9);
  }
  for (double b : busy) RC_ASSERT(r.makespan >= b - 1e-9);
}

// On three ranks or more the wrap from the last rank to the first is a link of its own: costs that
// do not give it are refused, and its time shows in the step.
TEST(Interleaved, TheWrapIsALinkOfItsOwn) {
  const int64_t S = 3, M = 6, V = 2;
  SimCosts c = uniform(S * V, 1, 2);
  c.p2p_link = {0.0, 0.0};
  EXPECT_THROW(simulate(ranks_of(S, M, V), c), std::invalid_argument);
  c.p2p_link = {0.0, 0.0, 0.0};
  const double free_wrap = simulate(ranks_of(S, M, V), c).makespan;
  c.p2p_link = {0.0, 0.0, 5.0};
  const double slow_wrap = simulate(ranks_of(S, M, V), c).makespan;
  EXPECT_EQ(free_wrap, static_cast<double>(M * V + S - 1) * 3.0);
  EXPECT_GT(slow_wrap, free_wrap + 5.0);  // at least one forward and one backward wait on it
}

TEST(Interleaved, ToStringNamesTheChunk) {
  EXPECT_EQ(to_string(Action{K::Forward, 3, 1}), "F3.1");
  EXPECT_EQ(to_string(Action{K::SendGrad, 0, 2}), "sendG0.2");
  EXPECT_EQ(to_string(Action{K::Backward, 2}), "B2");
}
