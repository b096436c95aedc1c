// Input checks shared by every strategy and the baselines: uniform (Megatron/DeepSpeed),
// proportional (SynerFuse ITD-like) and PTAFM-style grouping (search.h describes each).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/plan/search_detail.h"

namespace alloy::plan::detail {

std::vector<int64_t> proportional_split(int64_t total, const std::vector<double>& weights) {
  const size_t n = weights.size();
  std::vector<int64_t> v(n, 1);
  const int64_t rest = total - static_cast<int64_t>(n);
  if (rest <= 0) return v;
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<std::pair<double, size_t>> frac;
  int64_t given = 0;
  for (size_t i = 0; i < n; ++i) {
    const double exact = sum > 0 ? rest * weights[i] / sum : static_cast<double>(rest) / static_cast<double>(n);
    const int64_t fl = static_cast<int64_t>(std::floor(exact));
    v[i] += fl;
    given += fl;
    frac.push_back({-(exact - static_cast<double>(fl)), i});
  }
  std::sort(frac.begin(), frac.end());
  for (int64_t k = 0; k < rest - given; ++k) ++v[frac[static_cast<size_t>(k) % n].second];
  return v;
}

namespace {

// ---------------------------------------------------------------------------------------------
// Splits and shares

std::vector<int64_t> equal_split(int64_t total, int64_t parts) {
  std::vector<int64_t> v(static_cast<size_t>(parts), total / parts);
  for (int64_t i = 0; i < total % parts; ++i) ++v[static_cast<size_t>(i)];
  return v;
}

// Samples per replica proportional to WEIGHTS, in whole micro-batches of the smallest size when
// the global batch allows (else sizes that no candidate divides would leave a replica idle).
std::vector<int64_t> batch_split(const Problem& P, const std::vector<double>& weights) {
  const int64_t unit = P.G % P.cands.front() == 0 && P.G / P.cands.front() >= static_cast<int64_t>(weights.size()) ? P.cands.front() : 1;
  bool equal = std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights.front(); });
  auto v = equal ? equal_split(P.G / unit, static_cast<int64_t>(weights.size())) : proportional_split(P.G / unit, weights);
  for (auto& x : v) x *= unit;
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Input checks shared by every strategy

void check_inputs(Problem& P) {
  const std::string where = "planner";
  const int64_t rmin = (P.N + P.L - 1) / P.L;  // pipelines have at most L stages
  // Can G be a sum of rmin positive multiples of candidate sizes? (more pipelines only need more)
  const int64_t mmin = P.cands.front();
  std::string sizes;
  for (int64_t m : P.cands) sizes += (sizes.empty() ? "" : ", ") + std::to_string(m);
  if (P.G < rmin * mmin)
    throw InputError(where, "global batch " + std::to_string(P.G) + " cannot be split: the " + std::to_string(P.N) +
                                " devices need at least " + std::to_string(rmin) + " pipeline(s) (a pipeline has at most " +
                                std::to_string(P.L) + " stages of >= 1 block), each taking at least one micro-batch of a size in {" +
                                sizes + "}; that is " + std::to_string(rmin * mmin) + " samples, " + std::to_string(rmin * mmin - P.G) +
                                " more than the global batch");
  // Multiples of the smallest size are always possible: with rmin pipelines, all but one take
  // one micro-batch of it and the last the rest. Otherwise, a DP over sums of k parts.
  bool ok = P.G % mmin == 0;
  const bool all_multiples = std::all_of(P.cands.begin(), P.cands.end(), [&](int64_t m) { return m % mmin == 0; });
  if (!ok && !all_multiples && static_cast<double>(P.G) * static_cast<double>(P.G) * static_cast<double>(std::min<int64_t>(P.N, P.G)) <= 1e8) {
    // reach[t]: t samples are a sum of exactly k parts, each a positive multiple of a size
    std::vector<char> one(static_cast<size_t>(P.G + 1), 0);
    for (int64_t m : P.cands)
      for (int64_t b = m; b <= P.G; b += m) one[static_cast<size_t>(b)] = 1;
    std::vector<char> reach(static_cast<size_t>(P.G + 1), 0), nxt;
    reach[0] = 1;
    for (int64_t k = 1; k <= std::min<int64_t>(P.N, P.G) && !ok; ++k) {
      nxt.assign(reach.size(), 0);
      for (int64_t t = 0; t <= P.G; ++t)
        if (reach[static_cast<size_t>(t)])
          for (int64_t b = 1; t + b <= P.G; ++b)
            if (one[static_cast<size_t>(b)]) nxt[static_cast<size_t>(t + b)] = 1;
      reach.swap(nxt);
      if (k >= rmin && reach[static_cast<size_t>(P.G)]) ok = true;
    }
  } else if (!ok && !all_multiples) {
    ok = true;  // too large to check here; a plan that cannot split the batch is simply not found
  }
  {
    if (!ok)
      throw InputError(where, "global batch " + std::to_string(P.G) + " cannot be split into " + std::to_string(rmin) + " to " +
                                  std::to_string(P.N) + " pipelines each taking a whole number of micro-batches of a size in {" + sizes +
                                  "}; choose a global batch that is a multiple of " + std::to_string(mmin) + " or allow smaller micro-batches");
  }
  // The model, held at least once with its gradients and AdamW state, against the pool.
  const double params = P.ctx.param_bytes(P.L, true, true);
  const double need = params * P.ctx.state_bytes_per_param_byte() + P.ctx.frozen_bytes(P.L, true, true);
  double have = 0;
  bool unknown = false;
  for (int d = 0; d < P.N; ++d) {
    have += P.ctx.capacity_bytes(d);
    unknown = unknown || P.ctx.capacity_bytes(d) <= 0;
  }
  if (!unknown && need > have)
    throw InputError(where, "the model does not fit the pool: its weights, gradients and AdamW state take " + gb(need) + " (" +
                                std::to_string(static_cast<int64_t>(need)) + " bytes: " + gb(params) + " of trained parameters x " +
                                fmt(P.ctx.state_bytes_per_param_byte()) +
                                (P.ctx.frozen_bytes(P.L, true, true) > 0 ? " + " + gb(P.ctx.frozen_bytes(P.L, true, true)) + " of frozen base" : std::string()) +
                                ") before any activation, but the " + std::to_string(P.N) +
                                " devices have " + gb(have) + " in all: short by " + gb(need - have));
}

[[noreturn]] void no_fit(Problem& P, const std::string& strategy, std::vector<Layout>& tried) {
  std::string why;
  double least = kInf;
  for (auto& l : tried) {
    double over = 0;
    std::string w = P.ev.overflow(l, &over);
    if (!w.empty() && over < least) least = over, why = w;
  }
  throw InputError("planner", strategy + ": no plan fits in memory" + (why.empty() ? std::string() : "; the closest: " + why));
}

// ---------------------------------------------------------------------------------------------
// Baselines

namespace {

// Replicas of D consecutive devices (index order), the last ones as they come.
std::vector<std::vector<int>> consecutive(int N, int d) {
  std::vector<std::vector<int>> reps;
  for (int i = 0; i < N; i += d) {
    reps.emplace_back();
    for (int k = i; k < std::min(N, i + d); ++k) reps.back().push_back(k);
  }
  return reps;
}

Layout uniform_or_proportional(Problem& P, bool proportional, int d) {
  Layout l;
  l.sched = 0;
  auto groups = consecutive(P.N, d);
  std::vector<double> rep_speed;
  for (auto& g : groups) {
    Replica r;
    r.dev = g;
    if (proportional) {
      std::vector<double> w;
      for (int x : g) w.push_back(P.dev_speed(x));
      r.blocks = proportional_split(P.L, w);
      rep_speed.push_back(std::accumulate(w.begin(), w.end(), 0.0));
    } else {
      r.blocks = equal_split(P.L, static_cast<int64_t>(g.size()));
    }
    l.reps.push_back(r);
  }
  const auto samples = batch_split(P, proportional ? rep_speed : std::vector<double>(groups.size(), 1.0));
  for (size_t i = 0; i < l.reps.size(); ++i) l.reps[i].samples = samples[i];
  return l;
}

// PTAFM-style grouping of hosts into K stage groups.
struct PtafmGrouping {
  std::vector<std::vector<int>> groups;  // hosts per group, in chain order
  double cost = kInf;
};

PtafmGrouping ptafm_group(Problem& P, int K) {
  const int H = P.ctx.num_hosts();
  std::vector<double> power(static_cast<size_t>(H), 0);
  for (int d = 0; d < P.N; ++d) power[static_cast<size_t>(P.ctx.host_of(d))] += P.dev_speed(d);
  const int64_t mbig = P.cands.back();
  double cmax = 0;
  auto c = [&](int a, int b) { return P.ctx.p2p_s(a, b, mbig); };
  for (int a = 0; a < H; ++a)
    for (int b = 0; b < H; ++b)
      if (a != b) cmax = std::max(cmax, c(a, b));
  if (cmax <= 0) cmax = 1;
  // PTAFM's cost 1*DP + 2*PP + 5*balance, each term scaled to [0, 1]: DP the slowest link
  // inside a group, PP the slowest hop of the chain (best link between consecutive groups),
  // balance the power spread.
  auto chain_pp = [&](const std::vector<std::vector<int>>& g, const std::vector<int>& order) {
    double pp = 0;
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      double best = kInf;
      for (int a : g[static_cast<size_t>(order[i])])
        for (int b : g[static_cast<size_t>(order[i + 1])]) best = std::min(best, c(a, b));
      pp = std::max(pp, best);
    }
    return pp / cmax;
  };
  auto best_chain = [&](const std::vector<std::vector<int>>& g, double* pp) {
    std::vector<int> order(g.size());
    std::iota(order.begin(), order.end(), 0);
    std::vector<int> best = order;
    double bv = chain_pp(g, order);
    if (g.size() <= 7) {
      while (std::next_permutation(order.begin(), order.end())) {
        const double v = chain_pp(g, order);
        if (v < bv) bv = v, best = order;
      }
    }
    *pp = bv;
    return best;
  };
  auto cost = [&](const std::vector<std::vector<int>>& g, std::vector<int>* order) {
    double dp = 0, pmax = 0, pmin = kInf;
    for (const auto& grp : g) {
      if (grp.empty()) return kInf;
      double pw = 0;
      for (int a : grp) {
        pw += power[static_cast<size_t>(a)];
        for (int b : grp)
          if (a != b) dp = std::max(dp, c(a, b) / cmax);
      }
      pmax = std::max(pmax, pw);
      pmin = std::min(pmin, pw);
    }
    double pp = 0;
    std::vector<int> o = best_chain(g, &pp);
    if (order) *order = o;
    return 1 * dp + 2 * pp + 5 * (pmax > 0 ? (pmax - pmin) / pmax : 0);
  };
  // LPT: hosts by power, each to the weakest group so far.
  std::vector<int> hosts(static_cast<size_t>(H));
  std::iota(hosts.begin(), hosts.end(), 0);
  std::stable_sort(hosts.begin(), hosts.end(), [&](int a, int b) { return power[static_cast<size_t>(a)] > power[static_cast<size_t>(b)]; });
  std::vector<std::vector<int>> g(static_cast<size_t>(K));
  std::vector<double> gp(static_cast<size_t>(K), 0);
  for (int h : hosts) {
    size_t w = 0;
    for (size_t i = 1; i < gp.size(); ++i)
      if (gp[i] < gp[w]) w = i;
    g[w].push_back(h);
    gp[w] += power[static_cast<size_t>(h)];
  }
  double cur = cost(g, nullptr);
  // Steepest descent over single moves and swaps, bounded passes: deterministic, no ants.
  for (int pass = 0; pass < 50; ++pass) {
    double best = cur;
    std::vector<std::vector<int>> bestg;
    for (size_t i = 0; i < g.size(); ++i)
      for (size_t a = 0; a < g[i].size(); ++a)
        for (size_t j = 0; j < g.size(); ++j) {
          if (i == j) continue;
          if (g[i].size() > 1) {  // move
            auto t = g;
            t[j].push_back(t[i][a]);
            t[i].erase(t[i].begin() + static_cast<long>(a));
            const double v = cost(t, nullptr);
            if (v < best - 1e-12) best = v, bestg = t;
          }
          for (size_t b = 0; b < g[j].size(); ++b) {  // swap
            if (j < i) continue;
            auto t = g;
            std::swap(t[i][a], t[j][b]);
            const double v = cost(t, nullptr);
            if (v < best - 1e-12) best = v, bestg = t;
          }
        }
    if (bestg.empty()) break;
    g = bestg;
    cur = best;
  }
  for (auto& grp : g) std::sort(grp.begin(), grp.end());
  std::vector<int> order;
  PtafmGrouping out;
  out.cost = cost(g, &order);
  for (int o : order) out.groups.push_back(g[static_cast<size_t>(o)]);
  return out;
}

}  // namespace

Layout baseline(Problem& P, const std::string& name, double* step) {
  const bool prop = name == "proportional";
  std::vector<Layout> tried;
  for (int d = 1; d <= std::min<int64_t>(P.N, P.L); ++d) {
    if (P.N % d != 0) continue;
    if (P.G < P.N / d) continue;
    Layout l = uniform_or_proportional(P, prop, d);
    const double v = eval(P, l, Batch::FixedSamples);
    if (v < kInf) {
      *step = v;
      if (d > 1) P.notes.push_back(name + ": the model does not fit with pure data parallelism; pipelines of " + std::to_string(d) + " stages");
      return l;
    }
    for (auto& r : l.reps) r.mbs = P.cands.front();
    tried.push_back(l);
  }
  if (tried.empty())
    throw InputError("planner", name + ": no equal pipeline depth fits: the depth must divide the " + std::to_string(P.N) +
                                    " devices, be at most " + std::to_string(P.L) + " (blocks), and leave at least one sample per pipeline of the global batch " +
                                    std::to_string(P.G));
  no_fit(P, name, tried);
}

Layout ptafm_layout(Problem& P, double* step) {
  const int H = P.ctx.num_hosts();
  std::vector<int> Ks;
  if (P.opt.ptafm_stages > 0) {
    if (P.opt.ptafm_stages > H)
      throw InputError("planner", "ptafm: " + std::to_string(P.opt.ptafm_stages) + " stages asked for but the cluster has only " +
                                      std::to_string(H) + " hosts (PTAFM groups whole hosts, data centres, into stages)");
    Ks.push_back(P.opt.ptafm_stages);
  } else {
    for (int k = 1; k <= std::min<int64_t>(H, P.L); ++k) Ks.push_back(k);
  }
  std::vector<Layout> tried;
  for (int K : Ks) {
    PtafmGrouping grp = ptafm_group(P, K);
    // Devices of each stage group, by host in chain order, faster first.
    std::vector<std::vector<int>> gdev;
    size_t R = static_cast<size_t>(P.N);
    for (const auto& hosts : grp.groups) {
      gdev.emplace_back();
      for (int h : hosts)
        for (int d = 0; d < P.N; ++d)
          if (P.ctx.host_of(d) == h) gdev.back().push_back(d);
      R = std::min(R, gdev.back().size());
    }
    // PTAFM data-parallelises inside a stage; with single-rank stages that means R replicas each
    // taking a share of every group. More replicas than the smallest group are needed when a
    // replica would otherwise get more devices than the model has blocks (it then skips the
    // small groups: a shorter chain).
    R = std::max<size_t>(R, static_cast<size_t>((P.N + P.L - 1) / P.L));
    if (R == 0 || static_cast<int64_t>(R) > P.G) continue;
    // Each replica takes a near-equal share of every group, in chain order.
    Layout l;
    l.sched = 0;
    l.reps.resize(R);
    // Round robin that carries on from group to group, so the remainders of uneven groups land on
    // different replicas and every replica ends with floor or ceil of N / R devices.
    size_t next = 0;
    for (const auto& devs : gdev)
      for (int d : devs) l.reps[next++ % R].dev.push_back(d);
    bool ok = true;
    std::vector<double> rep_power;
    for (auto& r : l.reps) {
      if (r.dev.empty() || static_cast<int64_t>(r.dev.size()) > P.L) ok = false;
      std::vector<double> w;
      for (int d : r.dev) w.push_back(P.dev_speed(d));
      r.blocks = proportional_split(P.L, w);
      rep_power.push_back(std::accumulate(w.begin(), w.end(), 0.0));
    }
    if (!ok) continue;
    const auto samples = batch_split(P, rep_power);
    for (size_t r = 0; r < R; ++r) l.reps[r].samples = samples[r];
    const double v = eval(P, l, Batch::FixedSamples);
    if (v < kInf) {
      *step = v;
      size_t deepest = 0;
      for (const auto& r : l.reps) deepest = std::max(deepest, r.dev.size());
      P.notes.push_back("ptafm: " + std::to_string(K) + " stage group(s) of hosts, PTAFM cost " + fmt(grp.cost) + ", " +
                        std::to_string(R) + " replica(s)" +
                        (deepest > static_cast<size_t>(K)
                             ? "; PTAFM runs a group's devices data-parallel inside one stage, while an Alloy stage is one "
                               "rank (or a tensor-parallel group), so a replica's several devices of one group take "
                               "consecutive stages: pipelines of up to " + std::to_string(deepest) + " stages"
                             : std::string()));
      return l;
    }
    for (auto& r : l.reps) r.mbs = P.cands.front();
    tried.push_back(l);
  }
  if (tried.empty())
    throw InputError("planner", "ptafm: no grouping of the " + std::to_string(H) + " host(s) into stages gives pipelines of at most " +
                                    std::to_string(P.L) + " stages with at least one sample each");
  no_fit(P, "ptafm", tried);
}

}  // namespace alloy::plan::detail
