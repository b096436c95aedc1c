#pragma once
// The route of an exact gradient sum around slow links. A ring all-reduce of three or more members
// crosses every hop of its ring, so one slow pair among them bounds the whole sum: on the 3-device
// pool (fast - half - quarter joined at 1 Gbit/s, fast - quarter at 0.2) a ring of all three runs
// at the slow pair's speed although the half device joins the other two by fast links. A tree
// over the members' fast links (slow ones only where the fast ones leave regions apart) sends each
// member's partial sum up and the total back down, chunk by chunk: every tree edge carries the
// buffer once each way, and the slow pair carries nothing.
//
// One pure function, used by the runtime (ranks, dist/tree_allreduce) and the cost model (devices,
// plan/cost_model) alike, so the tree priced is the tree run.
#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

namespace alloy {

// The runtime's chunk (dist/tree_allreduce): large enough that a chunk's fixed costs are small
// against its bytes, small enough that a 1 MiB bucket pipelines through a two-level tree.
constexpr long long kSyncTreeChunkBytes = 256 * 1024;

struct SyncTree {
  int root = -1;                           // member index; -1: no tree, the set syncs by ring
  // A child of the root, or -1. The tree is then rooted at the edge root - twin rather than at a
  // member: both ends complete their own side's partial sum, swap them over that edge (each way at
  // once) and add the two, so the totals start down from both ends. Where the root edge is the slow
  // pair between two regions, the sum crosses it once each way at the same time and pays its
  // latency once, not on the way up and again on the way down. Both ends hold the same bits: the
  // root adds P_root + P_twin, the twin P_root + P_twin, the same operands in the same order.
  int twin = -1;
  std::vector<int> parent;                 // per member; -1 for the root (the twin's parent is the root)
  std::vector<std::vector<int>> children;  // per member, ascending
  int depth = 0;                           // edges on the longest path from the root
  bool empty() const { return root < 0; }
  // Tree edges a member's sum crosses: its children and its parent.
  int degree(int member) const {
    return static_cast<int>(children[static_cast<size_t>(member)].size()) + (parent[static_cast<size_t>(member)] >= 0 ? 1 : 0);
  }
};

// The tree for N members (in an order every member agrees on) when SLOW(a, b) (a < b) holds for
// at least one pair and N >= 3; empty otherwise (the ring: two members exchange both ways at once
// whatever the link, and a set without a slow pair keeps Gloo's ring, whose per-member traffic is
// the least). Edges are taken fast ones first, then slow ones (Kruskal), each kind by the distance
// of the members in the order and then by the first member, so members next to each other (a
// host's or a region's, in host order) chain. The root is where a sum's first chunk finishes
// soonest (sync_tree_round_trip, a slow edge weighing kSlowEdgeWeight fast ones): a member (the
// one with the shortest longest path, the lowest index among equals), or an edge where that is
// strictly sooner (the lowest pair among equals; its lower member is the root, the other the twin).
SyncTree sync_tree(size_t n, const std::function<bool(size_t, size_t)>& slow);

// How much longer a slow edge's hop is taken to be than a fast one's when placing the root: about
// a distant link's 40 ms against a region's 0.1 ms. Any weight well above the fast hops a tree
// holds gives the same roots.
constexpr double kSlowEdgeWeight = 1000;

// When the first chunk of a sum along T is everywhere, if each member's own partial is ready at 0
// and a hop from A to B takes HOP(A, B): up to the root (and the twin), across the root edge, and
// down. The cost the root placement minimises; the cost model prices a tree the same way with
// each hop's own latency and bytes.
double sync_tree_round_trip(const SyncTree& t, const std::function<double(size_t, size_t)>& hop);

// The slow edges of T as (lower, higher) member pairs, ascending (SLOW asked with a < b).
std::vector<std::pair<size_t, size_t>> slow_edges(const SyncTree& t, const std::function<bool(size_t, size_t)>& slow);

// Stripes of one sum: up to MAX_TREES trees, each summing its own slice of every buffer at once.
// Where the fast links leave regions apart, sync_tree's tree crosses one slow pair per region
// boundary and every byte of the sum crosses those pairs; regions joined by several slow pairs can
// carry the sum side by side. The first stripe is sync_tree's; each next one is built the same way
// but prefers slow pairs whose members no earlier stripe's slow pairs touch, and the list ends at
// the first tree that cannot avoid them: a host sends each stripe over a line of its own, never
// two stripes over one host's line (a host's own uplink is what a distant link usually is). A tree
// that crosses no slow pair is the only stripe. Empty where sync_tree is. Whether the pairs are
// separate lines is for the caller to know (the planner's links): on one shared line stripes
// gain nothing.
std::vector<SyncTree> sync_trees(size_t n, const std::function<bool(size_t, size_t)>& slow, int max_trees);

}  // namespace alloy
