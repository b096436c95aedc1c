#include "alloy/core/sync_tree.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <tuple>

namespace alloy {

namespace {
// Kruskal over every pair, fast ones first, then slow ones by AVOID(a, b) (lower first), each kind
// by the members' distance in the order and then by the first member; rooted at a centre.
SyncTree build_tree(size_t n, const std::function<bool(size_t, size_t)>& slow, const std::function<int(size_t, size_t)>& avoid) {
  SyncTree t;
  if (n < 3) return t;
  struct Edge {
    bool slow;
    int avoid;
    size_t gap, a, b;
  };
  std::vector<Edge> edges;
  bool any_slow = false;
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b) {
      const bool s = slow(a, b);
      any_slow |= s;
      edges.push_back({s, s ? avoid(a, b) : 0, b - a, a, b});
    }
  if (!any_slow) return t;
  std::sort(edges.begin(), edges.end(), [](const Edge& x, const Edge& y) {
    return std::tie(x.slow, x.avoid, x.gap, x.a) < std::tie(y.slow, y.avoid, y.gap, y.a);
  });
  std::vector<size_t> comp(n);
  std::iota(comp.begin(), comp.end(), size_t{0});
  auto find = [&](size_t x) {
    while (comp[x] != x) x = comp[x] = comp[comp[x]];
    return x;
  };
  std::vector<std::vector<size_t>> adj(n);
  for (const Edge& e : edges) {
    const size_t ra = find(e.a), rb = find(e.b);
    if (ra == rb) continue;
    comp[ra] = rb;
    adj[e.a].push_back(e.b);
    adj[e.b].push_back(e.a);
  }
  // Distances from one member along the tree (breadth first); FROM's parent array on the way.
  auto bfs = [&](size_t from, std::vector<int>* parent) {
    std::vector<int> dist(n, -1);
    if (parent) parent->assign(n, -1);
    std::vector<size_t> queue{from};
    dist[from] = 0;
    for (size_t q = 0; q < queue.size(); ++q)
      for (size_t b : adj[queue[q]])
        if (dist[b] < 0) {
          dist[b] = dist[queue[q]] + 1;
          if (parent) (*parent)[b] = static_cast<int>(queue[q]);
          queue.push_back(b);
        }
    return *std::max_element(dist.begin(), dist.end());
  };
  int best = -1;
  for (size_t r = 0; r < n; ++r) {
    const int ecc = bfs(r, nullptr);
    if (best < 0 || ecc < t.depth) best = static_cast<int>(r), t.depth = ecc;
  }
  t.root = best;
  bfs(static_cast<size_t>(best), &t.parent);
  t.children.assign(n, {});
  for (size_t m = 0; m < n; ++m)
    if (t.parent[m] >= 0) t.children[static_cast<size_t>(t.parent[m])].push_back(static_cast<int>(m));
  return t;
}
}  // namespace

SyncTree sync_tree(size_t n, const std::function<bool(size_t, size_t)>& slow) {
  return build_tree(n, slow, [](size_t, size_t) { return 0; });
}

std::vector<std::pair<size_t, size_t>> slow_edges(const SyncTree& t, const std::function<bool(size_t, size_t)>& slow) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t m = 0; m < t.parent.size(); ++m) {
    if (t.parent[m] < 0) continue;
    const size_t p = static_cast<size_t>(t.parent[m]), a = std::min(m, p), b = std::max(m, p);
    if (slow(a, b)) out.emplace_back(a, b);  // SLOW is asked with a < b, as sync_tree asks
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<SyncTree> sync_trees(size_t n, const std::function<bool(size_t, size_t)>& slow, int max_trees) {
  std::vector<SyncTree> out;
  SyncTree first = sync_tree(n, slow);
  if (first.empty()) return out;
  std::set<std::pair<size_t, size_t>> taken;
  std::set<size_t> ends;  // members an earlier stripe's slow edges touch
  auto take = [&](const SyncTree& t) {
    for (const auto& e : slow_edges(t, slow)) taken.insert(e), ends.insert(e.first), ends.insert(e.second);
    out.push_back(t);
  };
  const bool crosses = !slow_edges(first, slow).empty();
  take(first);
  while (crosses && static_cast<int>(out.size()) < max_trees) {
    SyncTree t = build_tree(n, slow, [&](size_t a, size_t b) {
      if (taken.count({a, b})) return 3;
      return static_cast<int>(ends.count(a)) + static_cast<int>(ends.count(b));
    });
    const auto edges = slow_edges(t, slow);
    if (std::any_of(edges.begin(), edges.end(), [&](const auto& e) { return ends.count(e.first) || ends.count(e.second); })) break;
    take(t);
  }
  return out;
}

}  // namespace alloy
