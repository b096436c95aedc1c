#include "alloy/core/sync_tree.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>
#include <tuple>

namespace alloy {

namespace {
// Kruskal over every pair, fast ones first, then slow ones by AVOID(a, b) (lower first), each kind
// by the members' distance in the order and then by the first member; rooted where a sum's first
// chunk finishes soonest (sync_tree.h).
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
  // The tree rooted at member R (TWIN: a neighbour of R, the root edge's other end, or -1).
  auto rooted = [&](size_t r, int twin) {
    SyncTree x;
    x.root = static_cast<int>(r);
    x.twin = twin;
    x.parent.assign(n, -1);
    std::vector<int> dist(n, -1);
    std::vector<size_t> queue{r};
    dist[r] = 0;
    for (size_t q = 0; q < queue.size(); ++q)
      for (size_t b : adj[queue[q]])
        if (dist[b] < 0) {
          dist[b] = dist[queue[q]] + 1;
          x.parent[b] = static_cast<int>(queue[q]);
          queue.push_back(b);
        }
    x.depth = *std::max_element(dist.begin(), dist.end());
    x.children.assign(n, {});
    for (size_t m = 0; m < n; ++m)
      if (x.parent[m] >= 0) x.children[static_cast<size_t>(x.parent[m])].push_back(static_cast<int>(m));
    return x;
  };
  const auto weight = [&](size_t a, size_t b) { return slow(std::min(a, b), std::max(a, b)) ? kSlowEdgeWeight : 1.0; };
  // A member first (the shortest round trip, then the shortest longest path, then the lowest
  // index), then an edge only where its round trip is strictly shorter.
  double best_s = 0;
  for (size_t r = 0; r < n; ++r) {
    SyncTree x = rooted(r, -1);
    const double s = sync_tree_round_trip(x, weight);
    if (t.empty() || s < best_s || (s == best_s && x.depth < t.depth)) t = std::move(x), best_s = s;
  }
  for (size_t a = 0; a < n; ++a) {
    std::sort(adj[a].begin(), adj[a].end());  // the lowest pair among equals
    for (size_t b : adj[a]) {
      if (b < a) continue;
      SyncTree x = rooted(a, static_cast<int>(b));
      const double s = sync_tree_round_trip(x, weight);
      if (s < best_s) t = std::move(x), best_s = s;
    }
  }
  return t;
}
}  // namespace

double sync_tree_round_trip(const SyncTree& t, const std::function<double(size_t, size_t)>& hop) {
  if (t.empty()) return 0;
  const auto kids = [&](int x) {  // the root's children leave the twin out: it is the other end
    std::vector<int> out;
    for (int c : t.children[static_cast<size_t>(x)])
      if (!(x == t.root && c == t.twin)) out.push_back(c);
    return out;
  };
  const auto h = [&](int a, int b) { return hop(static_cast<size_t>(a), static_cast<size_t>(b)); };
  std::function<double(int)> complete = [&](int x) {  // X's partial sum is complete
    double at = 0;
    for (int c : kids(x)) at = std::max(at, complete(c) + h(c, x));
    return at;
  };
  std::function<double(int, double)> down = [&](int x, double at) {  // the total is at X at AT
    double last = at;
    for (int c : kids(x)) last = std::max(last, down(c, at + h(x, c)));
    return last;
  };
  const double root = complete(t.root);
  if (t.twin < 0) return down(t.root, root);
  const double twin = complete(t.twin);
  return std::max(down(t.root, std::max(root, twin + h(t.twin, t.root))), down(t.twin, std::max(twin, root + h(t.root, t.twin))));
}

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
