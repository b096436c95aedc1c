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
#include "alloy/core/text.h"
#include "alloy/plan/cost_model.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/search.h"

namespace alloy::plan {

namespace {

using Clock = std::chrono::steady_clock;

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
  double max_whole = 0;
  for (const auto* p : dp) max_whole = std::max(max_whole, p->tp_whole_share);
  // SUMS per call; each ends a stretch of compute (CostContext::tp_member_s).
  auto combine = [&](MicroBatchCost DeviceProfile::*f, bool split, double sums) {
    const bool blocks = f == &DeviceProfile::block_fwd || f == &DeviceProfile::block_bwd;
    std::vector<double> ts;
    for (double m : ms) {
      const double bytes = m * static_cast<double>(prof.model.seq_len * prof.model.hidden) * ctx.dtype_bytes();
      // Blocks: what every member computes whole (tp_whole_share) at the slowest member's pace,
      // the rest split by speed.
      double rate = 0, slowest = 0, whole = 0;
      for (const auto* p : dp) {
        const double t = (p->*f).at(m);
        rate += t > 0 ? 1.0 / t : 0.0;
        slowest = std::max(slowest, t);
        if (blocks) whole = std::max(whole, p->tp_whole_share * t);
      }
      const double shared = rate > 0 ? 1.0 / rate : 0.0;
      // Every member computes about as long (the split follows their speeds); each gains its own
      // quota's bursts between the sums, and the group waits for the one that gains least.
      const double compute = split ? whole + shared * (1 - (blocks ? max_whole : 0.0)) : slowest;
      // The sums wait for the members that gain least from their quotas' bursts (CostContext::tp_sum_s).
      const double comm =
          sums * ctx.tp_sum_s(g, bytes, ctx.tp_waited_for(g, std::vector<double>(g.size(), compute), sums * ctx.tp_sum_s(g, bytes), sums));
      double t = 0;
      for (const auto* p : dp) t = std::max(t, CostContext::tp_member_s_at(p->quota_fraction, p->quota_burst_s, compute, comm, sums));
      ts.push_back(t);
    }
    return from_points(ms, ts);
  };
  DeviceProfile out = *dp.front();
  out.quota_fraction = 1, out.quota_burst_s = 0;  // the members' bursts are in the times already
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
  std::vector<std::vector<int>> groups;  // disjoint, each one tensor-parallel stage's devices
  double step_s = std::numeric_limits<double>::infinity();
  Plan plan;
  PlanCost cost;
};

std::string group_names(const ClusterSpec& cluster, const std::vector<int>& g) {
  std::vector<std::string> names;
  for (int d : g) names.push_back(cluster.devices[static_cast<size_t>(d)].name);
  return join(names, "+");
}

std::string groups_names(const ClusterSpec& cluster, const std::vector<std::vector<int>>& gs) {
  std::vector<std::string> out;
  for (const auto& g : gs) out.push_back(group_names(cluster, g));
  return join(out, " and ");
}

// The composite pool's plan (REDUCED: each group of GS one device), back on the real pool: the
// composites' stages become tensor-parallel stages, the valid head splits nearest the members'
// speeds tried in rank (the K-th nearest on every group at once), each priced by simulate_plan.
// The best that fits; UNFIT says whether memory ruled any out.
Tried evaluate_composite_plan(const ClusterSpec& reduced, const Profile& aug, const SearchOptions& o, const SearchOptions& options,
                              const std::vector<std::vector<int>>& gs, const std::vector<int>& orig_group, const std::vector<int>& orig,
                              const ClusterSpec& cluster, const Profile& profile, const std::vector<int64_t>& sizes, bool* unfit) {
  Tried best;
  best.groups = gs;
  SearchResult sub;
  try {
    sub = search(reduced, aug, o);
  } catch (const std::exception&) {
    *unfit = true;
    return best;  // nothing fits with these groups: others may
  }
  if (!sub.plan.sharding.empty()) return best;
  std::vector<std::vector<std::vector<int64_t>>> splits;  // per group, nearest its members' speeds first
  size_t rounds = 0;
  for (const auto& g : gs) {
    std::vector<double> rate;
    for (int d : g) {
      const DeviceProfile& p = profile.devices.at(cluster.devices[static_cast<size_t>(d)].type);
      const double m = static_cast<double>(sizes.back());
      rate.push_back(1.0 / std::max(1e-12, p.block_fwd.at(m) + p.block_bwd.at(m)));
    }
    splits.push_back(splits_near(profile.model, static_cast<int>(g.size()), rate, 6));
    if (splits.back().empty()) return best;
    rounds = std::max(rounds, splits.back().size());
  }
  for (size_t r = 0; r < rounds; ++r) {
    Plan p = sub.plan;
    for (auto& pl : p.pipelines)
      for (auto& st : pl.stages) {
        const size_t i = static_cast<size_t>(st.ranks[0]);
        const int k = orig_group[i];
        if (k >= 0) {
          const auto& g = gs[static_cast<size_t>(k)];
          const auto& sp = splits[static_cast<size_t>(k)];
          st.ranks.assign(g.begin(), g.end());
          st.devices.clear();
          for (int d : g) st.devices.push_back(cluster.devices[static_cast<size_t>(d)].name);
          st.device = st.devices.front();
          st.tp_split = sp[std::min(r, sp.size() - 1)];
        } else {
          st.ranks = {orig[i]};
          st.device = cluster.devices[static_cast<size_t>(orig[i])].name;
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
    if (!c.fits) {
      *unfit = true;
      continue;
    }
    if (c.step_s < best.step_s) best.step_s = c.step_s, best.plan = p, best.cost = c;
  }
  return best;
}

// The whole search on the pool with each group of GS as one composite device (at its first
// member's place and host), then back on the real pool (evaluate_composite_plan).
Tried evaluate_groups(const std::vector<std::vector<int>>& gs, const ClusterSpec& cluster, const Profile& profile,
                      const CostContext& ctx, const SearchOptions& o, const SearchOptions& options,
                      const std::vector<int64_t>& sizes) {
  const int n = static_cast<int>(cluster.devices.size());
  Tried best;
  best.groups = gs;
  std::vector<int> group_of(static_cast<size_t>(n), -1);
  for (size_t k = 0; k < gs.size(); ++k)
    for (int d : gs[k]) group_of[static_cast<size_t>(d)] = static_cast<int>(k);
  ClusterSpec reduced = cluster;
  reduced.devices.clear();
  reduced.source_lines.clear();
  std::vector<int> orig_group;  // reduced device -> its group in GS, or -1
  std::vector<int> orig;        // reduced device -> the original device (a group's first member)
  Profile aug = profile;
  for (int d = 0; d < n; ++d) {
    const int k = group_of[static_cast<size_t>(d)];
    if (k < 0) {
      reduced.devices.push_back(cluster.devices[static_cast<size_t>(d)]);
      orig_group.push_back(-1);
      orig.push_back(d);
    } else if (d == gs[static_cast<size_t>(k)].front()) {
      const auto& g = gs[static_cast<size_t>(k)];
      Device c = cluster.devices[static_cast<size_t>(d)];
      c.name = group_names(cluster, g);
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
      orig_group.push_back(k);
      orig.push_back(d);
    }
  }
  // The composite's memory is its members' sum, but a member keeps more than its share (norms
  // whole, about 0.2 + 0.8 x its share of the activations): when no split of the composite
  // plan fits on the real members, the composite pool is searched again with less memory.
  for (double mem_scale : {1.0, 0.85, 0.7, 0.55}) {
    ClusterSpec shrunk = reduced;
    for (size_t i = 0; i < shrunk.devices.size(); ++i)
      if (orig_group[i] >= 0) shrunk.devices[i].memory_gb *= mem_scale;
    bool unfit = false;
    Tried t = evaluate_composite_plan(shrunk, aug, o, options, gs, orig_group, orig, cluster, profile, sizes, &unfit);
    if (t.step_s < best.step_s) best = std::move(t);
    if (std::isfinite(best.step_s) || !unfit) break;
  }
  return best;
}

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
  // The composite pool is searched on the schedules that do not split the backward (a composite
  // device has no weight pass of its own to price); the best groups' plan then tries zb-h1 on the
  // real pool (split_tensor_parallel_backward), tensor-parallel stages priced member by member.
  o.schedules.erase(std::remove_if(o.schedules.begin(), o.schedules.end(), pipeline::splits_backward), o.schedules.end());
  if (o.schedules.empty()) {
    result.notes.push_back("tensor parallelism: not tried (the schedules allowed, " + join(options.schedules, ", ") +
                           ", run no tensor-parallel stage)");
    return;
  }
  const auto sizes = options.candidate_micro_batches();
  auto out_of_time = [&](int tried) {
    return tried >= kTensorParallelMaxGroups || std::chrono::duration<double>(Clock::now() - t0).count() > budget;
  };
  Tried best;
  int tried = 0;
  std::vector<Tried> singles;  // every group that gave a plan, for the groupings below
  for (const auto& [bw, g] : groups) {
    if (out_of_time(tried)) break;
    ++tried;
    Tried t = evaluate_groups({g}, cluster, profile, ctx, o, options, sizes);
    if (!std::isfinite(t.step_s)) continue;
    if (t.step_s < best.step_s) best = t;
    singles.push_back(std::move(t));
  }
  // Several groups at once (Megatron's layout on a pool of hosts: a group inside each host, a
  // pipeline across the links between them): from the best group, each disjoint group that
  // gave a plan alone is added in turn, best first, and kept where the plan with it is faster.
  std::stable_sort(singles.begin(), singles.end(), [](const Tried& a, const Tried& b) { return a.step_s < b.step_s; });
  if (!singles.empty()) {
    Tried cur = singles.front();
    for (size_t i = 1; i < singles.size() && !out_of_time(tried); ++i) {
      const auto& g = singles[i].groups.front();
      bool disjoint = true;
      for (const auto& h : cur.groups)
        for (int d : g) disjoint = disjoint && std::find(h.begin(), h.end(), d) == h.end();
      if (!disjoint) continue;
      ++tried;
      auto gs = cur.groups;
      gs.push_back(g);
      Tried t = evaluate_groups(gs, cluster, profile, ctx, o, options, sizes);
      if (t.step_s < cur.step_s) cur = std::move(t);
    }
    if (cur.step_s < best.step_s) best = std::move(cur);
  }
  result.candidates_evaluated += tried;
  if (!std::isfinite(best.step_s)) {
    if (tried > 0)
      result.notes.push_back("tensor parallelism: not used; none of the " + std::to_string(tried) +
                             " device groups tried gives a plan that fits (memory without sharding, and positions for "
                             "every member where sequence parallel)");
    return;
  }
  // The groups' plan on zb-h1 where that pays (the composite search priced no weight pass), so
  // it is weighed against the plan without groups on the same schedules.
  SearchResult split_run;
  split_run.strategy = result.strategy;
  split_run.plan = best.plan;
  split_run.cost = best.cost;
  split_tensor_parallel_backward(split_run, cluster, profile, options);
  if (split_run.cost.step_s < best.step_s) best.plan = split_run.plan, best.cost = split_run.cost, best.step_s = split_run.cost.step_s;
  std::sort(best.groups.begin(), best.groups.end());  // named in the pool's order
  std::vector<std::string> splits;
  bool sequence_parallel = false;
  for (const auto& pl : best.plan.pipelines)
    for (const auto& st : pl.stages)
      if (st.tp() > 1) {
        std::vector<std::string> h;
        for (int64_t x : st.tp_heads(profile.model.heads)) h.push_back(std::to_string(x));
        if (std::find(splits.begin(), splits.end(), join(h, ":")) == splits.end()) splits.push_back(join(h, ":"));
        sequence_parallel = sequence_parallel || st.sequence_parallel;
      }
  std::string split = join(splits, " / ");
  if (sequence_parallel)
    split += options.sequence_parallel ? ", sequence parallel (train.sequence_parallel)"
                                       : ", sequence parallel (the group fits memory only with its activations split by position)";
  const std::string who = groups_names(cluster, best.groups);
  const std::string as = best.groups.size() > 1 ? " as one stage each, heads " : " as one stage, heads ";
  const double before = result.cost.step_s;
  char buf[200];
  if (best.step_s < before * (1.0 - kTensorParallelMinGain)) {
    if (std::isfinite(before))
      std::snprintf(buf, sizeof buf, "%.1f ms -> %.1f ms", before * 1e3, best.step_s * 1e3);
    else
      std::snprintf(buf, sizeof buf, "%.1f ms; no plan without it fits", best.step_s * 1e3);
    // The refinement phases' notes described the plan this one replaces.
    for (auto& note : result.notes)
      for (const char* phase : {"pipeline boundaries inside blocks", "schedules per pipeline", "gradient buckets", "memory:"})
        if (note.rfind(phase, 0) == 0) note = "(the plan before tensor parallelism) " + note;
    result.plan = best.plan;
    result.plan.predicted = nlohmann::json();
    result.cost = best.cost;
    result.search_step_s = best.cost.step_s;
    result.exact = false;
    result.notes.push_back("tensor parallelism: " + who + as + split + " (" + buf + ", " + std::to_string(tried) +
                           " device groups tried)");
    result.notes.insert(result.notes.end(), split_run.notes.begin(), split_run.notes.end());
  } else {
    std::snprintf(buf, sizeof buf, "%.1f ms against %.1f ms without", best.step_s * 1e3, before * 1e3);
    result.notes.push_back("tensor parallelism: not used; the best " + std::string(best.groups.size() > 1 ? "groups, " : "group, ") + who +
                           " (heads " + split + "), predict" + (best.groups.size() > 1 ? "" : "s") + " " + buf + " (" +
                           std::to_string(tried) + " device groups tried)");
  }
}

}  // namespace alloy::plan
