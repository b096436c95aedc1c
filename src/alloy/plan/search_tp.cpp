// The search's tensor-parallel phase (plan/search.h, consider_tensor_parallel): groups of devices
// tried as one tensor-parallel stage each, through the whole search on a pool where the group
// stands as one composite device.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/plan/cost_model.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

namespace {

using Clock = std::chrono::steady_clock;

std::string joined(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// A line t = fixed + per_sample * m through (MS, TS) by least squares, and the points themselves.
MicroBatchCost from_points(const std::vector<double>& ms, const std::vector<double>& ts) {
  MicroBatchCost c;
  const double n = static_cast<double>(ms.size());
  double sm = 0, st = 0, smm = 0, smt = 0;
  for (size_t i = 0; i < ms.size(); ++i) sm += ms[i], st += ts[i], smm += ms[i] * ms[i], smt += ms[i] * ts[i];
  const double den = n * smm - sm * sm;
  c.per_sample_s = den > 0 ? (n * smt - sm * st) / den : (sm > 0 ? st / sm : 0);
  c.fixed_s = (st - c.per_sample_s * sm) / n;
  c.set_points(ms, ts);
  return c;
}

// The group G as one device: its heads split in proportion to its members' speeds (the ideal the
// real split is rounded to), so a block takes the members' combined time plus the group's four
// sums (two forward, two backward); embedding and head split their vocabulary rows the same way.
DeviceProfile composite_profile(const Profile& prof, const ClusterSpec& cluster, const CostContext& ctx, const std::vector<int>& g,
                                const std::vector<int64_t>& sizes) {
  std::vector<const DeviceProfile*> dp;
  for (int d : g) dp.push_back(&prof.devices.at(cluster.devices[static_cast<size_t>(d)].type));
  std::vector<double> ms;
  for (int64_t m : sizes)
    if (ms.size() < static_cast<size_t>(MicroBatchCost::kMaxPoints)) ms.push_back(static_cast<double>(m));
  auto combine = [&](MicroBatchCost DeviceProfile::*f, bool split, double sums) {
    std::vector<double> ts;
    for (double m : ms) {
      const double comm = sums * ctx.tp_sum_s(g, m * static_cast<double>(prof.model.seq_len * prof.model.hidden) * ctx.dtype_bytes());
      double rate = 0, slowest = 0;
      for (const auto* p : dp) {
        const double t = (p->*f).at(m);
        rate += t > 0 ? 1.0 / t : 0.0;
        slowest = std::max(slowest, t);
      }
      ts.push_back((split ? (rate > 0 ? 1.0 / rate : 0.0) : slowest) + comm);
    }
    return from_points(ms, ts);
  };
  DeviceProfile out = *dp.front();
  out.block_fwd = combine(&DeviceProfile::block_fwd, true, 2);
  out.block_bwd = combine(&DeviceProfile::block_bwd, true, 2);
  out.embed_fwd = combine(&DeviceProfile::embed_fwd, true, 1);
  out.embed_bwd = combine(&DeviceProfile::embed_bwd, true, 0);
  out.head_fwd = combine(&DeviceProfile::head_fwd, true, 1);  // the loss's three sums are small
  out.head_bwd = combine(&DeviceProfile::head_bwd, true, 1);
  double opt_rate = 0, fwd_share = 0, bwd_share = 0;
  for (const auto* p : dp) {
    opt_rate += p->optimizer_s_per_param > 0 ? 1.0 / p->optimizer_s_per_param : 0.0;
    out.step_noise = std::max(out.step_noise, p->step_noise);
    fwd_share += p->attn_share_fwd / static_cast<double>(dp.size());
    bwd_share += p->attn_share_bwd / static_cast<double>(dp.size());
  }
  out.optimizer_s_per_param = opt_rate > 0 ? 1.0 / opt_rate : 0.0;
  out.attn_share_fwd = fwd_share;
  out.attn_share_bwd = bwd_share;
  return out;
}

// Every split of HEADS over N ranks that divides the model exactly, nearest to RATIO first.
std::vector<std::vector<int64_t>> splits_near(const ModelConfig& model, int n, const std::vector<double>& ratio, size_t keep) {
  std::vector<std::vector<int64_t>> all;
  std::vector<int64_t> cur;
  std::function<void(int64_t)> rec = [&](int64_t left) {
    if (static_cast<int>(cur.size()) == n - 1) {
      if (left < 1) return;
      cur.push_back(left);
      if (tp_split_problem(model, cur).empty()) all.push_back(cur);
      cur.pop_back();
      return;
    }
    for (int64_t h = 1; h <= left - (n - 1 - static_cast<int64_t>(cur.size())); ++h) {
      cur.push_back(h);
      rec(left - h);
      cur.pop_back();
      if (all.size() > 4096) return;
    }
  };
  rec(model.heads);
  double total = 0;
  for (double x : ratio) total += x;
  auto dist = [&](const std::vector<int64_t>& s) {
    double d = 0;
    for (size_t i = 0; i < s.size(); ++i) d += std::abs(static_cast<double>(s[i]) / static_cast<double>(model.heads) - ratio[i] / total);
    return d;
  };
  std::stable_sort(all.begin(), all.end(), [&](const auto& a, const auto& b) { return dist(a) < dist(b); });
  if (all.size() > keep) all.resize(keep);
  return all;
}

struct Tried {
  std::vector<int> group;
  double step_s = std::numeric_limits<double>::infinity();
  Plan plan;
  PlanCost cost;
};

}  // namespace

void consider_tensor_parallel(SearchResult& result, const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const int n = static_cast<int>(cluster.devices.size());
  // A plan that fits only with sharding competes too: a group holds a share of each block, and with
  // sequence parallelism of its activations, without gathering the layers ZeRO-3 gathers.
  if (n < 2 || n > kTensorParallelMaxDevices) return;
  for (const auto& d : cluster.devices)
    if (!profile.devices.count(d.type)) return;
  const auto t0 = Clock::now();
  const CostContext ctx(cluster, profile);
  // Groups of 2 to 4 devices, those joined by the fastest links first (the slowest link inside a
  // group bounds its sums), as many as the time budget allows.
  std::vector<std::pair<double, std::vector<int>>> groups;
  for (unsigned mask = 0; mask < (1u << n); ++mask) {
    const int k = __builtin_popcount(mask);
    if (k < 2 || k > std::min(4, n)) continue;
    std::vector<int> g;
    for (int d = 0; d < n; ++d)
      if (mask & (1u << d)) g.push_back(d);
    if (even_tp_split(profile.model, k).empty() && splits_near(profile.model, k, std::vector<double>(static_cast<size_t>(k), 1.0), 1).empty())
      continue;
    double slowest = std::numeric_limits<double>::infinity();
    for (int a : g)
      for (int b : g)
        if (a < b) slowest = std::min(slowest, ctx.link_bytes_per_s(ctx.host_of(a), ctx.host_of(b)));
    groups.emplace_back(slowest, g);
  }
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  const double budget = std::max(1.0, options.time_budget_s);
  SearchOptions o = options;
  o.time_budget_s = std::min(o.time_budget_s, 0.25);
  o.fit_memory = false;
  // zb-h1 runs no tensor-parallel stage (Plan::validate): the composite pool is searched on the others.
  o.schedules.erase(std::remove_if(o.schedules.begin(), o.schedules.end(), pipeline::splits_backward), o.schedules.end());
  if (o.schedules.empty()) {
    result.notes.push_back("tensor parallelism: not tried (the schedules allowed, " + joined(options.schedules, ", ") +
                           ", run no tensor-parallel stage)");
    return;
  }
  const auto sizes = options.candidate_micro_batches();
  Tried best;
  int tried = 0;
  for (const auto& [bw, g] : groups) {
    if (tried >= kTensorParallelMaxGroups || std::chrono::duration<double>(Clock::now() - t0).count() > budget) break;
    ++tried;
    // The pool with G as one device, at its first member's place and host.
    ClusterSpec reduced = cluster;
    reduced.devices.clear();
    reduced.source_lines.clear();
    std::vector<std::vector<int>> orig;  // reduced device -> original devices
    std::vector<std::string> names;
    for (int d : g) names.push_back(cluster.devices[static_cast<size_t>(d)].name);
    Profile aug = profile;
    for (int d = 0; d < n; ++d) {
      if (std::find(g.begin(), g.end(), d) == g.end()) {
        reduced.devices.push_back(cluster.devices[static_cast<size_t>(d)]);
        orig.push_back({d});
      } else if (d == g.front()) {
        Device c = cluster.devices[static_cast<size_t>(d)];
        c.name = joined(names, "+");
        c.type = "tp:" + c.name;
        c.speed = 0;
        bool known = true;
        double mem = 0;
        for (int x : g) {
          c.speed += cluster.devices[static_cast<size_t>(x)].speed;
          known = known && cluster.devices[static_cast<size_t>(x)].memory_gb > 0;
          mem += cluster.devices[static_cast<size_t>(x)].memory_gb;
        }
        c.memory_gb = known ? mem : 0;
        aug.devices[c.type] = composite_profile(profile, cluster, ctx, g, sizes);
        reduced.devices.push_back(c);
        orig.push_back(g);
      }
    }
    SearchResult sub;
    try {
      sub = search(reduced, aug, o);
    } catch (const std::exception&) {
      continue;  // nothing fits with this group: the others may
    }
    if (!sub.plan.sharding.empty()) continue;
    // Back to the real pool: the composite's stages become tensor-parallel stages, each split
    // tried near the members' speeds and priced by simulate_plan.
    std::vector<double> rate;
    for (int d : g) {
      const DeviceProfile& p = profile.devices.at(cluster.devices[static_cast<size_t>(d)].type);
      const double m = static_cast<double>(sizes.back());
      rate.push_back(1.0 / std::max(1e-12, p.block_fwd.at(m) + p.block_bwd.at(m)));
    }
    for (const auto& split : splits_near(profile.model, static_cast<int>(g.size()), rate, 6)) {
      Plan p = sub.plan;
      for (auto& pl : p.pipelines)
        for (auto& st : pl.stages) {
          const auto& to = orig[static_cast<size_t>(st.ranks[0])];
          st.ranks.assign(to.begin(), to.end());
          if (to.size() > 1) {
            st.devices = names;
            st.device = names.front();
            st.tp_split = split;
          } else {
            st.device = cluster.devices[static_cast<size_t>(to.front())].name;
          }
        }
      p.slow_links.clear();
      auto price = [&](const Plan& plan, PlanCost* out) {
        try {
          *out = simulate_plan(plan, cluster, profile);
          return true;
        } catch (const std::exception&) {
          return false;
        }
      };
      PlanCost c;
      const bool priced = !options.sequence_parallel && price(p, &c);
      if (options.sequence_parallel || (priced && !c.fits)) {
        // Sequence parallelism where asked, or where the groups' activations do not fit whole.
        Plan sp = p;
        sp.set_sequence_parallel();
        PlanCost csp;
        if (!price(sp, &csp)) continue;  // simulate_plan validates: a member without positions is refused
        p = sp, c = csp;
      } else if (!priced) {
        continue;
      }
      if (!c.fits) continue;
      if (c.step_s < best.step_s) best = {g, c.step_s, p, c};
    }
  }
  result.candidates_evaluated += tried;
  if (best.group.empty()) {
    if (tried > 0)
      result.notes.push_back("tensor parallelism: not used; none of the " + std::to_string(tried) +
                             " device groups tried gives a plan that fits (memory without sharding, and positions for "
                             "every member where sequence parallel)");
    return;
  }
  std::vector<std::string> names;
  for (int d : best.group) names.push_back(cluster.devices[static_cast<size_t>(d)].name);
  std::string split;
  bool sequence_parallel = false;
  for (const auto& pl : best.plan.pipelines)
    for (const auto& st : pl.stages)
      if (st.tp() > 1) {
        std::vector<std::string> h;
        for (int64_t x : st.tp_heads(profile.model.heads)) h.push_back(std::to_string(x));
        split = joined(h, ":");
        sequence_parallel = sequence_parallel || st.sequence_parallel;
      }
  if (sequence_parallel)
    split += options.sequence_parallel ? ", sequence parallel (train.sequence_parallel)"
                                       : ", sequence parallel (the group fits memory only with its activations split by position)";
  const double before = result.cost.step_s;
  char buf[200];
  if (best.step_s < before * (1.0 - kTensorParallelMinGain)) {
    if (std::isfinite(before))
      std::snprintf(buf, sizeof buf, "%.1f ms -> %.1f ms", before * 1e3, best.step_s * 1e3);
    else
      std::snprintf(buf, sizeof buf, "%.1f ms; no plan without it fits", best.step_s * 1e3);
    // The refinement phases' notes described the plan this one replaces.
    for (auto& n : result.notes)
      for (const char* phase : {"pipeline boundaries inside blocks", "schedules per pipeline", "gradient buckets", "memory:"})
        if (n.rfind(phase, 0) == 0) n = "(the plan before tensor parallelism) " + n;
    result.plan = best.plan;
    result.plan.predicted = nlohmann::json();
    result.cost = best.cost;
    result.search_step_s = best.cost.step_s;
    result.exact = false;
    result.notes.push_back("tensor parallelism: " + joined(names, "+") + " as one stage, heads " + split + " (" + buf + ", " +
                           std::to_string(tried) + " device groups tried)");
  } else {
    std::snprintf(buf, sizeof buf, "%.1f ms against %.1f ms without", best.step_s * 1e3, before * 1e3);
    result.notes.push_back("tensor parallelism: not used; the best group, " + joined(names, "+") + " (heads " + split + "), predicts " + buf +
                           " (" + std::to_string(tried) + " device groups tried)");
  }
}

}  // namespace alloy::plan
