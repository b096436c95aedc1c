#include "alloy/core/sync_tree.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <set>

namespace alloy {

namespace {
// The tree rooted at member R (TWIN: a neighbour of R, the root edge's other end, or -1).
SyncTree rooted(const std::vector<std::vector<size_t>>& adj, size_t r, int twin) {
  const size_t n = adj.size();
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
}

// Heights of a tree (ADJ) under a symmetric edge weight W, for every member and both sides of
// every edge at once (rerooting: one pass up from the leaves, one down from member 0), so placing
// the root costs O(n) and not a tree walk per candidate (512 members: 1024 walks of 512).
struct Heights {
  std::vector<int> parent;     // rooted at member 0
  std::vector<double> w_up;    // the weight of M's edge to its parent
  std::vector<double> below;   // the farthest member below M (M's own subtree), from M
  std::vector<double> beside;  // the farthest member on the parent's side of M's edge, from the parent
  // From M to the farthest member anywhere.
  double eccentricity(size_t m) const { return parent[m] < 0 ? below[m] : std::max(below[m], beside[m] + w_up[m]); }
};

template <class Weight>
Heights heights(const std::vector<std::vector<size_t>>& adj, const Weight& w) {
  const size_t n = adj.size();
  Heights h;
  h.parent.assign(n, -1);
  h.below.assign(n, 0);
  h.beside.assign(n, 0);
  h.w_up.assign(n, 0);
  std::vector<size_t> order{0};
  std::vector<char> seen(n, 0);
  seen[0] = 1;
  for (size_t q = 0; q < order.size(); ++q)
    for (size_t b : adj[order[q]])
      if (!seen[b]) seen[b] = 1, h.parent[b] = static_cast<int>(order[q]), h.w_up[b] = w(order[q], b), order.push_back(b);
  for (size_t q = order.size(); q-- > 1;) {
    const size_t m = order[q], p = static_cast<size_t>(h.parent[m]);
    h.below[p] = std::max(h.below[p], h.below[m] + h.w_up[m]);
  }
  // A parent's side of a child's edge: the parent's own side, or its farthest other child's branch.
  for (const size_t p : order) {
    double up = h.parent[p] < 0 ? 0 : h.beside[p] + h.w_up[p];  // through P's own parent
    double first = -1, second = -1;  // P's two tallest child branches
    size_t first_child = n;
    for (size_t c : adj[p]) {
      if (h.parent[c] != static_cast<int>(p)) continue;
      const double v = h.below[c] + h.w_up[c];
      if (v > first) second = first, first = v, first_child = c;
      else if (v > second) second = v;
    }
    for (size_t c : adj[p])
      if (h.parent[c] == static_cast<int>(p)) h.beside[c] = std::max({up, c == first_child ? second : first, 0.0});
  }
  return h;
}

// Kruskal over every pair, fast ones first, then slow ones by AVOID(a, b) (lower first, 0 to
// 254), each kind by the members' distance in the order and then by the first member; rooted where
// a sum's first chunk finishes soonest (sync_tree.h).
SyncTree build_tree(size_t n, const std::function<bool(size_t, size_t)>& slow, const std::function<int(size_t, size_t)>& avoid) {
  SyncTree t;
  if (n < 3) return t;
  // Per pair a < b: 0 fast, else 1 + its AVOID level (one byte a pair: 16 MiB at 4096 members).
  std::vector<uint8_t> pair(n * n, 0);
  std::vector<char> level_used(255, 0);
  bool any_slow = false;
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b)
      if (slow(a, b)) {
        const int v = std::clamp(avoid(a, b), 0, 254);
        pair[a * n + b] = static_cast<uint8_t>(1 + v);
        level_used[static_cast<size_t>(v)] = 1;
        any_slow = true;
      }
  if (!any_slow) return t;
  const auto is_slow = [&](size_t i) { return pair[i] != 0; };
  std::vector<size_t> comp(n);
  std::iota(comp.begin(), comp.end(), size_t{0});
  auto find = [&](size_t x) {
    while (comp[x] != x) x = comp[x] = comp[comp[x]];
    return x;
  };
  std::vector<std::vector<size_t>> adj(n);
  size_t joined = 0;
  auto join = [&](size_t a, size_t b) {
    const size_t ra = find(a), rb = find(b);
    if (ra == rb) return;
    comp[ra] = rb;
    adj[a].push_back(b);
    adj[b].push_back(a);
    ++joined;
  };
  // Fast pairs in (distance, first member) order, enumerated rather than sorted; once n - 1 edges
  // are in, every later pair would close a cycle.
  for (size_t gap = 1; gap < n && joined + 1 < n; ++gap)
    for (size_t a = 0; a + gap < n && joined + 1 < n; ++a)
      if (!is_slow(a * n + a + gap)) join(a, a + gap);
  // Slow pairs level by level, each in the same (distance, first member) order.
  for (size_t v = 0; v < level_used.size() && joined + 1 < n; ++v)
    if (level_used[v])
      for (size_t gap = 1; gap < n && joined + 1 < n; ++gap)
        for (size_t a = 0; a + gap < n && joined + 1 < n; ++a)
          if (pair[a * n + a + gap] == v + 1) join(a, a + gap);
  // Where the first chunk's round trip (sync_tree_round_trip under these weights) is shortest. A
  // member root's round is twice its farthest member's distance (up, then down the same way); the
  // ends of an edge a - b whose sides reach A and B deep finish at max(A, B + w) + A and
  // max(B, A + w) + B. A member first (the shortest round trip, then the fewest edges to its
  // farthest member, then the lowest index), then an edge only where its round trip is strictly
  // shorter (the lowest pair among equals). The weights are whole numbers, so the sums are exact.
  const auto weight = [&](size_t a, size_t b) { return is_slow(std::min(a, b) * n + std::max(a, b)) ? kSlowEdgeWeight : 1.0; };
  const Heights hw = heights(adj, weight);
  const Heights hu = heights(adj, [](size_t, size_t) { return 1.0; });
  size_t best_root = 0;
  double best_s = 0, best_depth = 0;
  for (size_t r = 0; r < n; ++r) {
    const double s = 2 * hw.eccentricity(r), depth = hu.eccentricity(r);
    if (r == 0 || s < best_s || (s == best_s && depth < best_depth)) best_root = r, best_s = s, best_depth = depth;
  }
  int twin = -1;
  for (size_t a = 0; a < n; ++a) {
    std::vector<size_t> next = adj[a];
    std::sort(next.begin(), next.end());
    for (size_t b : next) {
      if (b < a) continue;
      // The side of each end, from the tree rooted at member 0: one end is the other's parent.
      const bool a_above = hw.parent[b] == static_cast<int>(a);
      const size_t child = a_above ? b : a;
      const double low = hw.below[child], high = hw.beside[child], w = hw.w_up[child];
      const double A = a_above ? high : low, B = a_above ? low : high;
      const double s = std::max(std::max(A, B + w) + A, std::max(B, A + w) + B);
      if (s < best_s) best_root = a, twin = static_cast<int>(b), best_s = s;
    }
  }
  return rooted(adj, best_root, twin);
}
}  // namespace

double sync_tree_round_trip(const SyncTree& t, const std::function<double(size_t, size_t)>& hop) {
  if (t.empty()) return 0;
  const size_t n = t.parent.size();
  // Members top-down from END, leaving the root edge's other end out (it is the other side).
  std::vector<int> order;
  order.reserve(n);
  auto side = [&](int end, int other) {
    order.clear();
    order.push_back(end);
    for (size_t q = 0; q < order.size(); ++q)
      for (int c : t.children[static_cast<size_t>(order[q])])
        if (c != other) order.push_back(c);
  };
  const auto h = [&](int a, int b) { return hop(static_cast<size_t>(a), static_cast<size_t>(b)); };
  std::vector<double> complete(n, 0), at(n, 0);
  // When END's side has summed into END, children before parents from the bottom up.
  auto complete_side = [&](int end, int other) {
    side(end, other);
    for (size_t q = order.size(); q-- > 1;) {
      const int m = order[q], p = t.parent[static_cast<size_t>(m)];
      complete[static_cast<size_t>(p)] = std::max(complete[static_cast<size_t>(p)], complete[static_cast<size_t>(m)] + h(m, p));
    }
    return complete[static_cast<size_t>(end)];
  };
  // When the total, at END at START, has reached every member of END's side.
  auto down_side = [&](int end, int other, double start) {
    side(end, other);
    at[static_cast<size_t>(end)] = start;
    double last = start;
    for (size_t q = 1; q < order.size(); ++q) {
      const int m = order[q], p = t.parent[static_cast<size_t>(m)];
      at[static_cast<size_t>(m)] = at[static_cast<size_t>(p)] + h(p, m);
      last = std::max(last, at[static_cast<size_t>(m)]);
    }
    return last;
  };
  const double root = complete_side(t.root, t.twin);
  if (t.twin < 0) return down_side(t.root, -1, root);
  const double twin = complete_side(t.twin, -1);
  return std::max(down_side(t.root, t.twin, std::max(root, twin + h(t.twin, t.root))), down_side(t.twin, -1, std::max(twin, root + h(t.root, t.twin))));
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
