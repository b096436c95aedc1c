#include "alloy/core/text.h"
#include "alloy/plan/fit_memory.h"

#include "alloy/pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "alloy/plan/cost_sharding.h"

namespace alloy::plan {

namespace {

struct SetChoice {
  std::vector<int> ranks;  // ascending
  int64_t max_stage = 0;   // 0: cannot shard (compressed); 1; 3: ZeRO-3 can run
  int64_t stage = 0;
  bool by_memory = false;  // shares by the members' memory instead of even
};

struct Choice {
  std::vector<SetChoice> sets;
  std::vector<char> recompute;  // per rank
};

double overflow_of(const PlanCost& c) {
  double over = 0;
  for (const auto& s : c.stages)
    if (s.memory_capacity_bytes > 0) over += std::max(0.0, s.memory_bytes - s.memory_capacity_bytes);
  return over;
}

class Fitter {
 public:
  Fitter(Plan& plan, const ClusterSpec& cluster, const Profile& profile) : plan_(plan), cluster_(cluster), profile_(profile) {
    const int W = plan.world_size();
    dev_of_.assign(static_cast<size_t>(W), -1);
    for (const auto& pl : plan.pipelines)
      for (const auto& st : pl.stages) dev_of_[static_cast<size_t>(st.ranks[0])] = cluster.device_index(st.device);
    CostContext ctx(cluster, profile);
    ctx.set_grad_sync(plan.grad_sync);
    for (const auto& set : ctx.sync_sets(detail::plan_holders(plan, profile.model.heads))) {
      std::vector<int> devs;
      for (int r : set.ids) devs.push_back(dev_of_[static_cast<size_t>(r)]);
      std::sort(devs.begin(), devs.end(), [&](int a, int b) { return ctx.ring_less(a, a, b, b); });
      SetChoice c;
      c.ranks = set.ids;
      // ZeRO-3 needs the members on one schedule, and not zb-h1 (its weight passes need the layers
      // ZeRO-3 frees after their backward).
      const bool zero3 = plan.schedule_mismatch(set.ids).empty() &&
                         !pipeline::splits_backward(plan.schedule_of(static_cast<size_t>(plan.locate(set.ids.front()).pipeline)));
      c.max_stage = ctx.sync_shape(devs).compressed ? 0 : zero3 ? 3 : 1;
      if (c.max_stage > 0) base_.sets.push_back(c);
    }
    base_.recompute.assign(static_cast<size_t>(W), 0);
  }

  FitResult run() {
    Choice cur = base_;
    PlanCost cost = price(cur);
    for (int round = 0; round < 64 && !cost.fits; ++round) {
      Choice best_choice;
      PlanCost best;
      bool have = false;
      auto consider = [&](const Choice& c) {
        PlanCost pc = price(c);
        const double o = overflow_of(pc), bo = have ? overflow_of(best) : 0;
        if (!have || (pc.fits && (!best.fits || pc.step_s < best.step_s)) || (!pc.fits && !best.fits && o < bo)) {
          best_choice = c, best = pc, have = true;
        }
      };
      for (const auto& sc : cost.stages) {
        if (sc.memory_capacity_bytes <= 0 || sc.memory_bytes <= sc.memory_capacity_bytes) continue;
        const size_t r = static_cast<size_t>(sc.rank);
        if (!cur.recompute[r] && sc.layer_end > sc.layer_begin) {
          Choice c = cur;
          c.recompute[r] = 1;
          consider(c);
        }
        for (size_t i = 0; i < cur.sets.size(); ++i) {
          const SetChoice& s = cur.sets[i];
          if (!std::binary_search(s.ranks.begin(), s.ranks.end(), sc.rank)) continue;
          for (int64_t stage : {int64_t{1}, int64_t{3}})
            for (bool by_memory : {false, true}) {
              if (stage > s.max_stage || stage < s.stage || (stage == s.stage && by_memory == s.by_memory)) continue;
              Choice c = cur;
              c.sets[i].stage = stage, c.sets[i].by_memory = by_memory;
              consider(c);
            }
        }
      }
      if (!have || !(overflow_of(best) < overflow_of(cost) || best.fits)) break;  // nothing helps any more
      cur = best_choice, cost = best;
    }
    if (cost.fits) {
      // Undo what is not needed: each change back, kept back where the plan still fits no slower.
      for (size_t r = 0; r < cur.recompute.size(); ++r)
        if (cur.recompute[r]) {
          Choice c = cur;
          c.recompute[r] = 0;
          keep_if_better(c, &cur, &cost);
        }
      for (size_t i = 0; i < cur.sets.size(); ++i)
        for (int64_t stage = cur.sets[i].stage; stage-- > 0;) {
          if (stage == 2) continue;
          for (bool by_memory : {false, true}) {
            Choice c = cur;
            c.sets[i].stage = stage, c.sets[i].by_memory = stage > 0 && by_memory;
            keep_if_better(c, &cur, &cost);
          }
        }
    }
    price(cur);  // leaves the plan as chosen
    FitResult res;
    res.fits = cost.fits;
    res.cost = cost;
    describe(cur, cost, &res.changes);
    return res;
  }

 private:
  std::vector<double> shares_by_memory(const std::vector<int>& ranks) const {
    double known = 0;
    for (int r : ranks) known = std::max(known, cluster_.devices[static_cast<size_t>(dev_of_[static_cast<size_t>(r)])].memory_gb);
    std::vector<double> w;
    double sum = 0;
    for (int r : ranks) {
      const double g = cluster_.devices[static_cast<size_t>(dev_of_[static_cast<size_t>(r)])].memory_gb;
      w.push_back(g > 0 ? g : known);  // unknown memory: as much as the largest known
      sum += w.back();
    }
    for (auto& v : w) v = std::max(1e-4, std::round(v / sum * 1e4) / 1e4);  // readable in the plan
    return w;
  }

  PlanCost price(const Choice& c) {
    plan_.sharding.clear();
    for (const auto& s : c.sets)
      if (s.stage > 0) plan_.sharding.push_back({s.ranks, s.stage, s.by_memory ? shares_by_memory(s.ranks) : std::vector<double>{}});
    for (auto& pl : plan_.pipelines)
      for (auto& st : pl.stages) st.recompute = c.recompute[static_cast<size_t>(st.ranks[0])] != 0;
    return simulate_plan(plan_, cluster_, profile_);
  }

  void keep_if_better(const Choice& c, Choice* cur, PlanCost* cost) {
    PlanCost pc = price(c);
    if (pc.fits && pc.step_s <= cost->step_s) *cur = c, *cost = pc;
  }

  void describe(const Choice& c, const PlanCost& cost, std::vector<std::string>* out) const {
    auto device = [&](int r) { return cluster_.devices[static_cast<size_t>(dev_of_[static_cast<size_t>(r)])].name; };
    for (const auto& s : c.sets) {
      if (s.stage == 0) continue;
      std::ostringstream o;
      o << "memory: ZeRO-" << s.stage << " among ranks " << join(s.ranks) << " (";
      for (size_t j = 0; j < s.ranks.size(); ++j) o << (j ? ", " : "") << device(s.ranks[j]);
      o << "), shares " << (s.by_memory ? "by memory" : "even");
      out->push_back(o.str());
    }
    for (size_t r = 0; r < c.recompute.size(); ++r)
      if (c.recompute[r]) out->push_back("memory: rank " + std::to_string(r) + " (" + device(static_cast<int>(r)) + ") recomputes its blocks' activations");
    for (const auto& sc : cost.stages)
      if ((sc.zero_stage > 0 || sc.recompute) && sc.memory_capacity_bytes > 0) {
        std::ostringstream o;
        o << std::fixed;
        o.precision(1);
        o << "memory: rank " << sc.rank << " (" << sc.device << ") needs " << sc.memory_bytes / 1e6 << " MB of its "
          << sc.memory_capacity_bytes / 1e6 << " MB";
        out->push_back(o.str());
      }
  }

  Plan& plan_;
  const ClusterSpec& cluster_;
  const Profile& profile_;
  std::vector<int> dev_of_;
  Choice base_;
};

}  // namespace

FitResult fit_memory(Plan& plan, const ClusterSpec& cluster, const Profile& profile) {
  Fitter f(plan, cluster, profile);
  return f.run();
}

}  // namespace alloy::plan
