// The heuristic search for pools too large to enumerate: layouts from device groupings at each
// pipeline depth, layer splits balanced on compute, then local search on layer boundaries (see the
// top of search.cpp).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "alloy/plan/search_detail.h"

namespace alloy::plan::detail {

namespace {

// Contiguous split of the blocks minimising the slowest stage's compute per sample (forward +
// backward at micro-batch M, embedding on the first stage, head on the last): the classic
// min-max linear partition, by DP over (stages, blocks), O(S L^2). Per-stage costs are given by
// type so a "stage" may also stand for a group of devices (harmonic speeds).
std::vector<int64_t> balanced_split(int64_t L, const std::vector<double>& block, const std::vector<double>& embed,
                                    const std::vector<double>& head) {
  const size_t S = block.size();
  if (static_cast<int64_t>(S) > L) return {};
  auto cost = [&](size_t s, int64_t n) {
    return static_cast<double>(n) * block[s] + (s == 0 ? embed[s] : 0.0) + (s + 1 == S ? head[s] : 0.0);
  };
  const size_t W = static_cast<size_t>(L + 1);
  std::vector<double> dp(S * W, kInf);
  std::vector<int64_t> arg(S * W, 0);
  for (int64_t n = 1; n <= L; ++n) dp[static_cast<size_t>(n)] = cost(0, n), arg[static_cast<size_t>(n)] = n;
  for (size_t s = 1; s < S; ++s)
    for (int64_t t = static_cast<int64_t>(s + 1); t <= L; ++t)
      for (int64_t n = 1; n <= t - static_cast<int64_t>(s); ++n) {
        const double v = std::max(dp[(s - 1) * W + static_cast<size_t>(t - n)], cost(s, n));
        if (v < dp[s * W + static_cast<size_t>(t)]) dp[s * W + static_cast<size_t>(t)] = v, arg[s * W + static_cast<size_t>(t)] = n;
      }
  std::vector<int64_t> out(S);
  int64_t t = L;
  for (size_t s = S; s-- > 0;) {
    out[s] = arg[s * W + static_cast<size_t>(t)];
    t -= out[s];
  }
  return out;
}

struct StageRates {
  std::vector<double> block, embed, head;
};
StageRates rates_of(const Problem& P, const std::vector<int>& devs, int64_t m) {
  StageRates r;
  const double x = static_cast<double>(m);
  for (int d : devs) {
    const int t = P.ctx.type_of(d);
    r.block.push_back((P.ctx.forward_s(t, 1, false, false, m) + P.ctx.backward_s(t, 1, false, false, m)) / x);
    r.embed.push_back((P.ctx.forward_s(t, 0, true, false, m) + P.ctx.backward_s(t, 0, true, false, m)) / x);
    r.head.push_back((P.ctx.forward_s(t, 0, false, true, m) + P.ctx.backward_s(t, 0, false, true, m)) / x);
  }
  return r;
}

}  // namespace

Heuristic::Heuristic(Problem& P, Clock::time_point t0) : P_(P), t0_(t0) {
  // Hosts in a nearest-neighbour chain by link time, so hosts of one region sit together and
  // contiguous slices of the device order are local.
  const int H = P.ctx.num_hosts();
  std::vector<int> chain{0};
  std::vector<char> used(static_cast<size_t>(H), 0);
  used[0] = 1;
  while (static_cast<int>(chain.size()) < H) {
    int next = -1;
    double bv = kInf;
    for (int h = 0; h < H; ++h)
      if (!used[static_cast<size_t>(h)]) {
        const double v = P.ctx.p2p_s(chain.back(), h, P.cands.back());
        if (v < bv) bv = v, next = h;
      }
    used[static_cast<size_t>(next)] = 1;
    chain.push_back(next);
  }
  host_rank_.assign(static_cast<size_t>(H), 0);
  for (int i = 0; i < H; ++i) host_rank_[static_cast<size_t>(chain[static_cast<size_t>(i)])] = i;
}

void Heuristic::offer(Layout l) {
  Layout own = l;
  const double v = eval(P_, l, Batch::Optimize);
  if (v < best_step) best_step = v, best = std::move(l);
  // A seed's own batch split, in case the greedy allocator does worse on it.
  if (!own.reps.empty() && own.reps.front().samples > 0) {
    const double w = eval(P_, own, Batch::FixedSamples);
    if (w < best_step) best_step = w, best = std::move(own);
  }
}

void Heuristic::run() {
  // Coarse to fine, so a short budget still sees every scale of pipeline: the depths that double
  // from 1 (and the deepest) first, the ones between after, and each depth under the first
  // schedule before the others (refine_schedules re-chooses the schedule per pipeline anyway). In
  // depth order, 512 devices of a 24-block model used their 1 s on depths 1 and 2, where 16 stages
  // were predicted 47% faster (bench/README, "Planner").
  std::vector<int> all_depths;
  const int dmax = static_cast<int>(std::min<int64_t>(P_.N, P_.L));
  for (int d = 1; d <= dmax; ++d)
    if (d <= 8 || d == dmax || d % 4 == 0) all_depths.push_back(d);
  std::vector<int> depths;
  for (int d = 1; d <= dmax; d *= 2) depths.push_back(d);
  if (depths.back() != dmax) depths.push_back(dmax);
  for (int d : all_depths)
    if (std::find(depths.begin(), depths.end(), d) == depths.end()) depths.push_back(d);
  std::vector<std::pair<int, int>> order;  // (depth, schedule)
  for (int d : depths) order.emplace_back(d, 0);
  for (int sched = 1; sched < static_cast<int>(P_.opt.schedules.size()); ++sched)
    for (int d : depths) order.emplace_back(d, sched);
  for (const auto& [d, sched] : order)
    for (int policy = 0; policy < 5; ++policy) {
      if (out_of_time() && best_step < kInf) return;
      auto reps = form(policy, d);
      if (reps.empty()) continue;
      Layout l;
      l.sched = sched;
      for (auto& devs : reps) {
        Replica r;
        r.dev = devs;
        r.blocks = split_for(devs);
        l.reps.push_back(r);
      }
      offer(l);
      if ((policy == 1 || policy == 4) && d > 1) {  // stage-major: one split for all replicas, sync sets stay within stage groups
        Layout a = l;
        if (align(a)) offer(a);
      }
    }
}

void Heuristic::improve() {
  if (!(best_step < kInf)) return;
  for (bool improved = true; improved && !out_of_time();) {
    improved = false;
    std::map<std::pair<std::vector<int>, std::vector<int64_t>>, std::vector<size_t>> templates;
    for (size_t r = 0; r < best.reps.size(); ++r) {
      std::vector<int> types;
      for (int d : best.reps[r].dev) types.push_back(P_.ctx.type_of(d));
      templates[{types, best.reps[r].blocks}].push_back(r);
    }
    for (const auto& [key, members] : templates) {
      const auto& blocks = key.second;
      for (size_t i = 0; i + 1 < blocks.size() && !improved && !out_of_time(); ++i)
        for (int dir : {+1, -1}) {
          auto nb = blocks;
          nb[i] += dir;
          nb[i + 1] -= dir;
          if (nb[i] < 1 || nb[i + 1] < 1) continue;
          Layout l = best;
          for (size_t r : members) l.reps[r].blocks = nb;
          const double v = eval(P_, l, Batch::Optimize);
          if (v < best_step * (1 - 1e-12)) {
            best_step = v, best = std::move(l);
            improved = true;
            break;
          }
        }
      if (improved) break;
    }
  }
}

std::vector<int> Heuristic::locality_order() const {
  std::vector<int> o(static_cast<size_t>(P_.N));
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(), [&](int a, int b) {
    const int ha = host_rank_[static_cast<size_t>(P_.ctx.host_of(a))], hb = host_rank_[static_cast<size_t>(P_.ctx.host_of(b))];
    if (ha != hb) return ha < hb;
    return P_.dev_speed(a) > P_.dev_speed(b);
  });
  return o;
}

std::vector<size_t> Heuristic::sizes(int d) const {
  const int R = P_.N / d, rem = P_.N % d;
  if (R == 0 || (rem > 0 && d + 1 > P_.L) || R > P_.G) return {};
  std::vector<size_t> s(static_cast<size_t>(R), static_cast<size_t>(d));
  for (int i = 0; i < rem; ++i) ++s[static_cast<size_t>(i % R)];
  for (size_t x : s)
    if (static_cast<int64_t>(x) > P_.L) return {};
  return s;
}

std::vector<std::vector<int>> Heuristic::form(int policy, int d) const {
  auto sz = sizes(d);
  if (sz.empty()) return {};
  const size_t R = sz.size();
  std::vector<std::vector<int>> reps(R);
  std::vector<int> o = locality_order();
  if (policy == 2)
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return P_.dev_speed(a) > P_.dev_speed(b); });
  if (policy == 0 || policy == 2) {
    size_t k = 0;
    for (size_t r = 0; r < R; ++r)
      for (size_t i = 0; i < sz[r]; ++i) reps[r].push_back(o[k++]);
  } else if (policy == 1 || policy == 4) {
    if (policy == 4 && d < 3) return {};  // nothing to fold
    size_t k = 0;
    for (size_t s = 0; s < static_cast<size_t>(d) + 1; ++s)
      for (size_t r = 0; r < R; ++r)
        if (sz[r] > s) reps[r].push_back(o[k++]);
    if (policy == 4)
      for (auto& rep : reps) {
        std::vector<int> folded;
        for (size_t i = 0; i < rep.size(); i += 2) folded.push_back(rep[i]);
        for (size_t i = rep.size() - 1 - (rep.size() % 2 == 0 ? 0 : 1); i < rep.size(); i -= 2) folded.push_back(rep[i]);
        rep = folded;
      }
  } else {
    if (d == 1) return {};  // same as local for pure data parallelism
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return P_.dev_speed(a) > P_.dev_speed(b); });
    size_t r = 0;
    int dir = 1;
    for (int dev : o) {
      while (reps[r].size() >= sz[r]) r = (r + 1) % R;
      reps[r].push_back(dev);
      // snake: 0..R-1 then R-1..0
      if ((dir > 0 && r + 1 == R) || (dir < 0 && r == 0)) dir = -dir;
      else r = static_cast<size_t>(static_cast<int>(r) + dir);
    }
    for (auto& rep : reps)
      std::stable_sort(rep.begin(), rep.end(), [&](int a, int b) {
        return host_rank_[static_cast<size_t>(P_.ctx.host_of(a))] < host_rank_[static_cast<size_t>(P_.ctx.host_of(b))];
      });
  }
  return reps;
}

std::vector<int64_t> Heuristic::split_for(const std::vector<int>& devs) {
  std::vector<int> types;
  for (int d : devs) types.push_back(P_.ctx.type_of(d));
  auto it = split_cache_.find(types);
  if (it != split_cache_.end()) return it->second;
  StageRates r = rates_of(P_, devs, P_.cands[P_.cands.size() / 2]);
  auto s = balanced_split(P_.L, r.block, r.embed, r.head);
  split_cache_[types] = s;
  return s;
}

bool Heuristic::align(Layout& l) {
  std::map<size_t, std::vector<size_t>> by_depth;
  for (size_t r = 0; r < l.reps.size(); ++r) by_depth[l.reps[r].dev.size()].push_back(r);
  for (const auto& [S, members] : by_depth) {
    StageRates agg{std::vector<double>(S, 0), std::vector<double>(S, 0), std::vector<double>(S, 0)};
    for (size_t r : members) {
      StageRates x = rates_of(P_, l.reps[r].dev, P_.cands[P_.cands.size() / 2]);
      for (size_t s = 0; s < S; ++s) agg.block[s] += 1 / x.block[s], agg.embed[s] += 1 / x.embed[s], agg.head[s] += 1 / x.head[s];
    }
    for (size_t s = 0; s < S; ++s) agg.block[s] = 1 / agg.block[s], agg.embed[s] = 1 / agg.embed[s], agg.head[s] = 1 / agg.head[s];
    auto sp = balanced_split(P_.L, agg.block, agg.embed, agg.head);
    if (sp.empty()) return false;
    for (size_t r : members) l.reps[r].blocks = sp;
  }
  return true;
}

}  // namespace alloy::plan::detail
