// The exact search: branch and bound over the search space modulo interchangeable devices (see
// the comment on class Exact in search_detail.h).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "alloy/plan/search_detail.h"

namespace alloy::plan::detail {

namespace {
// Every replica of the partition is one device: the step's figures sum is hidden (cost_model.h).
bool one_stage(const std::vector<std::vector<int>>& blocks) {
  for (const auto& b : blocks)
    if (b.size() != 1) return false;
  return true;
}
}  // namespace

Exact::Exact(Problem& P, bool symmetric, bool bounded) : P_(P), symmetric_(symmetric), bounded_(bounded) {
  std::map<std::tuple<int, int, double>, int> ids;
  for (int d = 0; d < P.N; ++d) {
    auto key = std::make_tuple(P.ctx.type_of(d), P.ctx.host_of(d), P.ctx.capacity_bytes(d));
    auto it = ids.emplace(key, static_cast<int>(ids.size())).first;
    cls_.push_back(symmetric ? it->second : d);
  }
}

void Exact::offer(Layout l) {
  Layout own = l;
  const double v = eval(P_, l, Batch::Optimize);
  if (v < best_step) best_step = v, best = l;
  // A seed's own batch split, in case the allocator does not improve on it.
  if (own.reps.front().samples > 0) {
    const double w = eval(P_, own, Batch::FixedSamples);
    if (w < best_step) best_step = w, best = own;
  }
}

void Exact::run() {
  for (int sched = 0; sched < static_cast<int>(P_.opt.schedules.size()); ++sched) {
    sched_ = sched;
    std::vector<std::vector<std::vector<int>>> parts;
    std::set<std::vector<std::vector<int>>> seen;
    std::vector<int> a(static_cast<size_t>(P_.N), 0);
    std::function<void(int, int)> rgs = [&](int i, int mx) {
      if (i == P_.N) {
        std::vector<std::vector<int>> blocks(static_cast<size_t>(mx + 1));
        for (int d = 0; d < P_.N; ++d) blocks[static_cast<size_t>(a[static_cast<size_t>(d)])].push_back(d);
        for (auto& b : blocks)
          if (static_cast<int64_t>(b.size()) > P_.L) return;
        if (static_cast<int64_t>(blocks.size()) > P_.G) return;
        if (symmetric_) {
          std::vector<std::vector<int>> sig;
          for (auto& b : blocks) sig.push_back(signature(b));
          std::sort(sig.begin(), sig.end());
          if (!seen.insert(sig).second) return;
          // identical replicas next to each other, for the non-decreasing config rule
          std::sort(blocks.begin(), blocks.end(), [&](const std::vector<int>& x, const std::vector<int>& y) {
            return signature(x) < signature(y);
          });
        }
        parts.push_back(blocks);
        return;
      }
      for (int v = 0; v <= mx + 1; ++v) {
        a[static_cast<size_t>(i)] = v;
        rgs(i + 1, std::max(mx, v));
      }
    };
    a[0] = 0;
    rgs(1, 0);
    if (P_.N == 0) continue;
    // Partitions by lower bound, most promising first, so the incumbent tightens early.
    std::vector<std::pair<double, size_t>> order;
    for (size_t i = 0; i < parts.size(); ++i) order.push_back({bounded_ ? partition_bound(parts[i]) : 0.0, i});
    std::stable_sort(order.begin(), order.end());
    for (const auto& [lb, i] : order) {
      if (bounded_ && lb >= best_step) break;
      walk(parts[i]);
    }
  }
}

std::vector<int> Exact::signature(const std::vector<int>& devs) const {
  std::vector<int> s;
  for (int d : devs) s.push_back(cls_[static_cast<size_t>(d)]);
  std::sort(s.begin(), s.end());
  return s;
}

Exact::BlockInfo& Exact::info(const std::vector<int>& devs) {
  std::vector<int> key = signature(devs);
  key.push_back(-1 - sched_);
  if (!symmetric_) key = devs, key.push_back(-1 - sched_);
  auto it = infos_.find(key);
  if (it != infos_.end()) return it->second;
  BlockInfo bi;
  const int k = static_cast<int>(devs.size());
  std::vector<std::vector<int64_t>> splits;
  std::vector<int64_t> cur;
  std::function<void(int64_t)> comp = [&](int64_t left) {
    if (static_cast<int>(cur.size()) == k - 1) {
      cur.push_back(left);
      splits.push_back(cur);
      cur.pop_back();
      return;
    }
    for (int64_t n = 1; n <= left - (k - 1 - static_cast<int64_t>(cur.size())); ++n) {
      cur.push_back(n);
      comp(left - n);
      cur.pop_back();
    }
  };
  comp(P_.L);
  // positions sorted by class: permutations of the class sequence are next_permutation over it
  std::vector<int> cls_seq(static_cast<size_t>(k));
  std::vector<int> sorted = sorted_by_class(devs);
  for (int i = 0; i < k; ++i) cls_seq[static_cast<size_t>(i)] = cls_[static_cast<size_t>(sorted[static_cast<size_t>(i)])];
  do {
    // map the class sequence to positions: the j-th occurrence of a class takes its j-th device
    std::vector<int> pos(static_cast<size_t>(k));
    std::vector<int> used(static_cast<size_t>(k), 0);
    for (int s = 0; s < k; ++s)
      for (int i = 0; i < k; ++i)
        if (!used[static_cast<size_t>(i)] && cls_[static_cast<size_t>(sorted[static_cast<size_t>(i)])] == cls_seq[static_cast<size_t>(s)]) {
          used[static_cast<size_t>(i)] = 1;
          pos[static_cast<size_t>(s)] = i;
          break;
        }
    for (const auto& sp : splits) bi.configs.push_back({pos, sp});
  } while (std::next_permutation(cls_seq.begin(), cls_seq.end()));
  return infos_.emplace(key, std::move(bi)).first->second;
}

std::vector<int> Exact::sorted_by_class(const std::vector<int>& devs) const {
  std::vector<int> s = devs;
  std::sort(s.begin(), s.end(), [&](int a, int b) {
    return cls_[static_cast<size_t>(a)] != cls_[static_cast<size_t>(b)] ? cls_[static_cast<size_t>(a)] < cls_[static_cast<size_t>(b)] : a < b;
  });
  return s;
}

ConfigTable* Exact::table(const std::vector<int>& sorted, const Config& c, Replica* out) {
  out->dev.resize(c.order.size());
  for (size_t s = 0; s < c.order.size(); ++s) out->dev[s] = sorted[static_cast<size_t>(c.order[s])];
  out->blocks = c.split;
  return P_.tables.get(sched_, out->dev.data(), out->blocks.data(), static_cast<int>(c.order.size()));
}

void Exact::ensure_bounds(const std::vector<int>& devs, BlockInfo& bi) {
  if (bi.bounds) return;
  std::vector<int> sorted = sorted_by_class(devs);
  const int64_t G = P_.G;
  bi.H.assign(static_cast<size_t>(G + 1), kInf);
  const int64_t share = std::max<int64_t>(1, G * static_cast<int64_t>(devs.size()) / P_.N);
  std::vector<std::pair<double, size_t>> key;
  Replica tmp;
  for (size_t i = 0; i < bi.configs.size(); ++i) {
    ConfigTable* t = table(sorted, bi.configs[i], &tmp);
    for (int64_t b = 1; b <= G; ++b) bi.H[static_cast<size_t>(b)] = std::min(bi.H[static_cast<size_t>(b)], P_.tables.cheap_h(*t, b));
    key.push_back({P_.tables.cheap_h(*t, share), i});
  }
  std::stable_sort(key.begin(), key.end());
  std::vector<Config> sorted_configs;
  for (auto& k : key) sorted_configs.push_back(bi.configs[k.second]);
  bi.configs = std::move(sorted_configs);
  bi.bounds = true;
}

double Exact::partition_bound(const std::vector<std::vector<int>>& blocks) {
  std::vector<const double*> rows;
  for (const auto& b : blocks) {
    BlockInfo& bi = info(b);
    ensure_bounds(b, bi);
    rows.push_back(bi.H.data());
  }
  return minmax_allocate(rows, P_.G, nullptr) + P_.ctx.world_sum_exposed_s(one_stage(blocks));
}

void Exact::walk(const std::vector<std::vector<int>>& blocks) {
  const size_t R = blocks.size();
  std::vector<BlockInfo*> bis;
  std::vector<std::vector<int>> sorted;
  for (const auto& b : blocks) {
    bis.push_back(&info(b));
    if (bounded_) ensure_bounds(b, *bis.back());
    sorted.push_back(sorted_by_class(b));
  }
  Layout l;
  l.sched = sched_;
  l.reps.resize(R);
  std::vector<ConfigTable*> tabs(R);
  std::vector<size_t> idx(R, 0);
  std::vector<const double*> rows(R);
  std::vector<std::vector<double>> hrow(R, std::vector<double>(static_cast<size_t>(P_.G + 1), kInf));
  // Rows 0..i-1 from the chosen configurations, the rest from their blocks' bounds.
  auto bound_ok = [&](size_t i) {
    for (size_t j = 0; j < R; ++j) rows[j] = j < i ? hrow[j].data() : bis[j]->H.data();
    return minmax_allocate(rows, P_.G, nullptr) + P_.ctx.world_sum_exposed_s(one_stage(blocks)) < best_step;
  };
  std::function<void(size_t)> rec = [&](size_t i) {
    if (bounded_ && i > 0 && !bound_ok(i)) return;
    if (i == R) {
      leaf(l);
      return;
    }
    const size_t start = (symmetric_ && i > 0 && bis[i] == bis[i - 1]) ? idx[i - 1] : 0;
    for (size_t c = start; c < bis[i]->configs.size(); ++c) {
      idx[i] = c;
      tabs[i] = table(sorted[i], bis[i]->configs[c], &l.reps[i]);
      if (bounded_) {
        // First the cheap bound (no simulation), then the simulated makespans.
        for (int64_t b = 1; b <= P_.G; ++b) hrow[i][static_cast<size_t>(b)] = P_.tables.cheap_h(*tabs[i], b);
        if (!bound_ok(i + 1)) continue;
        for (int64_t b = 1; b <= P_.G; ++b) hrow[i][static_cast<size_t>(b)] = P_.tables.h(*tabs[i], b);
      }
      rec(i + 1);
    }
  };
  rec(0);
}

void Exact::leaf(Layout& l) {
  ++leaves;
  Evaluator& ev = P_.ev;
  ev.prepare(l);
  const size_t R = l.reps.size();
  const int64_t G = P_.G, hi = G - static_cast<int64_t>(R) + 1;
  gtab_.assign(R * static_cast<size_t>(G + 1), kInf);
  std::vector<const double*> rows(R);
  double maxopt = 0;
  for (size_t r = 0; r < R; ++r) {
    double* row = gtab_.data() + r * static_cast<size_t>(G + 1);
    for (int64_t b = 1; b <= hi; ++b) row[b] = ev.g(r, l.reps[r], b, nullptr);
    rows[r] = row;
    for (double o : ev.table(r)->opt) maxopt = std::max(maxopt, o);
  }
  const double v = minmax_allocate(rows, G, nullptr);
  if (!(v < kInf)) return;
  const double step = (v + P_.ctx.world_sum_exposed_s(l.one_device_replicas())) + maxopt;
  if (step < best_step) {
    Layout copy = l;
    best_step = eval(P_, copy, Batch::Optimize);  // fills the batch split; same value
    best = copy;
  }
}

}  // namespace alloy::plan::detail
