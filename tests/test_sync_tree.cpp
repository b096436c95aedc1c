// The route of exact sums around slow links (core/sync_tree.h): which sets get a tree, and that
// every tree spans its members, crosses as few slow links as the fast ones allow and is rooted at
// a centre.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <set>
#include <functional>
#include <utility>
#include <vector>

#include "alloy/core/components.h"
#include "alloy/core/sync_tree.h"

using alloy::sync_tree;
using alloy::SyncTree;

namespace {
std::function<bool(size_t, size_t)> slow_pairs(std::set<std::pair<size_t, size_t>> pairs) {
  return [pairs](size_t a, size_t b) { return pairs.count({std::min(a, b), std::max(a, b)}) > 0; };
}
}  // namespace

// rapidcheck: each pair (a < b) of N members slow with probability 1 / ONE_IN.
static std::set<std::pair<size_t, size_t>> random_slow_pairs(size_t n, int one_in) {
  std::set<std::pair<size_t, size_t>> slow;
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b)
      if (*rc::gen::inRange(0, one_in) == 0) slow.insert({a, b});
  return slow;
}

// The 3-device pool: fast (0) and quarter (2) joined by the slow link, the half device (1) joined
// to both by fast ones. The sum goes through the half device and nothing crosses 0-2.
TEST(SyncTree, TheThreeDevicePoolSumsThroughTheHalfDevice) {
  const SyncTree t = sync_tree(3, slow_pairs({{0, 2}}));
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.root, 1);
  EXPECT_EQ(t.parent, (std::vector<int>{1, -1, 1}));
  EXPECT_EQ(t.children[1], (std::vector<int>{0, 2}));
  EXPECT_EQ(t.depth, 1);
  EXPECT_EQ(t.degree(1), 2);
  EXPECT_EQ(t.degree(0), 1);
}

TEST(SyncTree, RingsStayWhereNoSlowPairIsAmongTheMembersOrOnlyTwoSum) {
  EXPECT_TRUE(sync_tree(4, slow_pairs({})).empty());
  EXPECT_TRUE(sync_tree(2, slow_pairs({{0, 1}})).empty());  // two members exchange both ways at once
  EXPECT_TRUE(sync_tree(1, slow_pairs({})).empty());
}

// Two regions of two joined only by slow links: one slow edge, between neighbours in the order,
// the two fast pairs kept, and the tree rooted at the slow edge (1 - 2): each region's partial sum
// crosses it once, both ways at once, instead of up to a root and back.
TEST(SyncTree, TwoRegionsCrossTheSlowLinksOnce) {
  const SyncTree t = sync_tree(4, slow_pairs({{0, 2}, {0, 3}, {1, 2}, {1, 3}}));
  ASSERT_FALSE(t.empty());
  EXPECT_EQ(t.depth, 2);
  EXPECT_EQ(t.root, 1);
  EXPECT_EQ(t.twin, 2);
  EXPECT_EQ(t.parent, (std::vector<int>{1, -1, 1, 2}));
  EXPECT_EQ(sync_tree(3, slow_pairs({{0, 2}})).twin, -1);  // the 3-device pool's chain keeps its middle
}

// The first chunk's round: hops of 1 inside the regions and 10 across. Rooted at member 1, region
// us's partial crosses to it (11) and the total back (21) and on to 3 (22); rooted at the edge
// 1 - 2, both partials are complete at 1, cross at once (11) and go down one hop (12).
TEST(SyncTree, ARootEdgeCrossesOnceInsteadOfThereAndBack) {
  SyncTree t;
  t.root = 1;
  t.parent = {1, -1, 1, 2};
  t.children = {{}, {0, 2}, {3}, {}};
  const auto hop = [](size_t a, size_t b) { return (a < 2) != (b < 2) ? 10.0 : 1.0; };
  EXPECT_DOUBLE_EQ(alloy::sync_tree_round_trip(t, hop), 22.0);
  t.twin = 2;
  EXPECT_DOUBLE_EQ(alloy::sync_tree_round_trip(t, hop), 12.0);
  // One way slower than the other: the totals start when the slower crossing lands (1 + 15).
  const auto uneven = [](size_t a, size_t b) { return a == 2 && b == 1 ? 15.0 : (a < 2) != (b < 2) ? 10.0 : 1.0; };
  EXPECT_DOUBLE_EQ(alloy::sync_tree_round_trip(t, uneven), 17.0);
}

// A chain of four fast hops (the slow pair 0 - 3 left out) is rooted at its middle edge: three
// hops from any partial to every total, against four from a middle member.
TEST(SyncTree, AnEvenChainIsRootedAtItsMiddleEdge) {
  const SyncTree t = sync_tree(4, slow_pairs({{0, 3}}));
  EXPECT_EQ(t.parent, (std::vector<int>{1, -1, 1, 2}));
  EXPECT_EQ(t.root, 1);
  EXPECT_EQ(t.twin, 2);
}

// The same edges rooted at member R, paired with TWIN (a neighbour) or not.
static SyncTree reroot(const SyncTree& t, size_t r, int twin) {
  const size_t n = t.parent.size();
  std::vector<std::vector<size_t>> adj(n);
  for (size_t m = 0; m < n; ++m)
    if (t.parent[m] >= 0) adj[m].push_back(static_cast<size_t>(t.parent[m])), adj[static_cast<size_t>(t.parent[m])].push_back(m);
  SyncTree x;
  x.root = static_cast<int>(r);
  x.twin = twin;
  x.parent.assign(n, -1);
  x.children.assign(n, {});
  std::vector<size_t> q{r};
  std::vector<bool> seen(n, false);
  seen[r] = true;
  for (size_t i = 0; i < q.size(); ++i)
    for (size_t y : adj[q[i]])
      if (!seen[y]) seen[y] = true, x.parent[y] = static_cast<int>(q[i]), q.push_back(y);
  for (size_t m = 0; m < n; ++m)
    if (x.parent[m] >= 0) x.children[static_cast<size_t>(x.parent[m])].push_back(static_cast<int>(m));
  return x;
}

// Any members and slow pairs: a spanning tree whose edges are N - 1, of which exactly (regions of
// the fast links - 1) are slow, whose children lists match the parents, whose depth is its root's
// height, and whose root (a member, or an edge to its twin) gives a first chunk's round no longer
// than any other member or edge of the same tree would.
RC_GTEST_PROP(SyncTree, EveryTreeSpansWithTheFewestSlowEdgesFromItsQuickestRoot, ()) {
  const size_t n = *rc::gen::inRange<size_t>(1, 10);
  const auto slow = random_slow_pairs(n, 3);
  const auto is_slow = slow_pairs(slow);
  const SyncTree t = sync_tree(n, is_slow);
  RC_ASSERT(t.empty() == (n < 3 || slow.empty()));
  if (t.empty()) return;
  RC_ASSERT(t.parent.size() == n && t.children.size() == n);
  RC_ASSERT(t.parent[static_cast<size_t>(t.root)] == -1);
  size_t slow_edges = 0, edges = 0;
  auto height_from = [&](size_t r) {
    // Tree distances from R over the parent links (both ways).
    std::vector<int> d(n, -1);
    std::vector<size_t> q{r};
    d[r] = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      const size_t x = q[i];
      std::vector<size_t> nb;
      if (t.parent[x] >= 0) nb.push_back(static_cast<size_t>(t.parent[x]));
      for (int c : t.children[x]) nb.push_back(static_cast<size_t>(c));
      for (size_t y : nb)
        if (d[y] < 0) d[y] = d[x] + 1, q.push_back(y);
    }
    RC_ASSERT(std::all_of(d.begin(), d.end(), [](int v) { return v >= 0; }));  // spans
    return *std::max_element(d.begin(), d.end());
  };
  for (size_t m = 0; m < n; ++m) {
    const auto& kids = t.children[m];
    RC_ASSERT(std::is_sorted(kids.begin(), kids.end()));
    for (int c : kids) RC_ASSERT(t.parent[static_cast<size_t>(c)] == static_cast<int>(m));
    if (t.parent[m] < 0) continue;
    ++edges;
    slow_edges += is_slow(m, static_cast<size_t>(t.parent[m])) ? 1 : 0;
  }
  RC_ASSERT(edges == n - 1);
  const size_t regions = alloy::components(n, [&](size_t a, size_t b) { return a != b && !is_slow(a, b); }).size();
  RC_ASSERT(slow_edges == regions - 1);
  RC_ASSERT(height_from(static_cast<size_t>(t.root)) == t.depth);
  if (t.twin >= 0) RC_ASSERT(t.parent[static_cast<size_t>(t.twin)] == t.root);
  const auto hop = [&](size_t a, size_t b) { return is_slow(std::min(a, b), std::max(a, b)) ? alloy::kSlowEdgeWeight : 1.0; };
  const double mine = alloy::sync_tree_round_trip(t, hop);
  for (size_t m = 0; m < n; ++m) {
    const SyncTree at_m = reroot(t, m, -1);
    RC_ASSERT(mine <= alloy::sync_tree_round_trip(at_m, hop));
    for (int c : at_m.children[m]) RC_ASSERT(mine <= alloy::sync_tree_round_trip(reroot(t, m, c), hop));
  }
  // And the rule's ties (sync_tree.h), walked tree by tree: members by round trip, then the fewest
  // edges to the farthest member, then the lowest index; an edge only where strictly shorter, the
  // lowest pair among equals. (sync_tree places the root from every member's heights at once.)
  size_t want_root = 0;
  int want_twin = -1;
  double want_s = alloy::sync_tree_round_trip(reroot(t, 0, -1), hop);
  int want_depth = height_from(0);
  for (size_t m = 1; m < n; ++m) {
    const double s = alloy::sync_tree_round_trip(reroot(t, m, -1), hop);
    const int depth = height_from(m);
    if (s < want_s || (s == want_s && depth < want_depth)) want_root = m, want_s = s, want_depth = depth;
  }
  for (size_t a = 0; a < n; ++a) {
    const SyncTree at_a = reroot(t, a, -1);
    for (int b : at_a.children[a]) {
      if (b < static_cast<int>(a)) continue;
      const double s = alloy::sync_tree_round_trip(reroot(t, a, b), hop);
      if (s < want_s) want_root = a, want_twin = b, want_s = s;
    }
  }
  RC_ASSERT(static_cast<size_t>(t.root) == want_root);
  RC_ASSERT(t.twin == want_twin);
  RC_ASSERT(mine == want_s);
}

// Stripes (sync_trees): two regions of two joined by four slow pairs stripe over two trees that
// cross at pairs with no member in common (1-2, then 0-3); the 3-device pool's tree crosses no
// slow pair and stays alone; a cap of one keeps sync_tree's tree.
TEST(SyncTree, TwoRegionsStripeOverSlowPairsOfTheirOwn) {
  const auto slow = slow_pairs({{0, 2}, {0, 3}, {1, 2}, {1, 3}});
  const auto trees = alloy::sync_trees(4, slow, 4);
  ASSERT_EQ(trees.size(), 2u);  // a third would cross where a member already sends a stripe
  EXPECT_EQ(trees[0].parent, sync_tree(4, slow).parent);
  EXPECT_EQ(alloy::slow_edges(trees[0], slow), (std::vector<std::pair<size_t, size_t>>{{1, 2}}));
  EXPECT_EQ(alloy::slow_edges(trees[1], slow), (std::vector<std::pair<size_t, size_t>>{{0, 3}}));
  EXPECT_EQ(trees[1].root, 0);
  EXPECT_EQ(alloy::sync_trees(4, slow, 1).size(), 1u);
  EXPECT_EQ(alloy::sync_trees(3, slow_pairs({{0, 2}}), 4).size(), 1u);
  EXPECT_TRUE(alloy::sync_trees(4, slow_pairs({}), 4).empty());
}

// Any members and slow pairs: every stripe is a tree as sync_tree's are (spanning, N - 1 edges, the
// fewest slow ones), no member is an end of two stripes' slow pairs, and the first stripe is
// sync_tree's.
RC_GTEST_PROP(SyncTree, StripesSpanAndNeverShareASlowPair, ()) {
  const size_t n = *rc::gen::inRange<size_t>(3, 10);
  const auto slow = random_slow_pairs(n, 2);
  const auto is_slow = slow_pairs(slow);
  const int cap = *rc::gen::inRange(1, 5);
  const auto trees = alloy::sync_trees(n, is_slow, cap);
  RC_ASSERT(trees.empty() == slow.empty());
  if (trees.empty()) return;
  RC_ASSERT(static_cast<int>(trees.size()) <= cap);
  RC_ASSERT(trees[0].parent == sync_tree(n, is_slow).parent);
  const size_t regions = alloy::components(n, [&](size_t a, size_t b) { return a != b && !is_slow(a, b); }).size();
  std::set<size_t> ends;
  for (const SyncTree& t : trees) {
    RC_ASSERT(t.parent.size() == n);
    size_t edges = 0;
    for (size_t m = 0; m < n; ++m) {
      if (t.parent[m] < 0) continue;
      ++edges;
      // Every member reaches the root.
      size_t x = m, hops = 0;
      while (t.parent[x] >= 0 && hops <= n) x = static_cast<size_t>(t.parent[x]), ++hops;
      RC_ASSERT(static_cast<int>(x) == t.root);
    }
    RC_ASSERT(edges == n - 1);
    const auto se = alloy::slow_edges(t, is_slow);
    RC_ASSERT(se.size() == regions - 1);
    std::set<size_t> mine;
    for (const auto& e : se) mine.insert(e.first), mine.insert(e.second);
    for (size_t x : mine) RC_ASSERT(ends.insert(x).second);
  }
  if (trees.size() > 1) RC_ASSERT(regions > 1);
}
