// The tree all-reduce (dist/tree_allreduce.h) across real processes. Run as N ranks:
//   alloy launch --nproc N -- tree_allreduce_check --slow 0:2[,A:B...] [--stripes K] [--die R]
// Every rank sums inputs it can regenerate for every other rank (seeded by rank and round), so
// each checks its result bit for bit against the tree's own order of additions computed locally:
// every member must end with the root's total. Sizes straddle the chunk (one element less, equal,
// one more, several chunks and a remainder, none at all), in float and double, several sums in
// flight at once (the reducer launches a group's buckets back to back). With --die R, rank R exits
// after the first round without a word and every other rank must fail its next sum with an error
// naming the tree and a rank, not hang. With --stripes K the sums go along up to K trees
// (core/sync_tree.h, sync_trees), each summing its slice, and slice s is checked against tree s's
// order. Without --die, Group::sum_small is checked too, with and
// without the tree. Prints "tree-allreduce ok" (or "tree-allreduce failed
// as expected: ...") per rank.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "alloy/core/sync_tree.h"
#include "alloy/dist/rendezvous.h"
#include "alloy/dist/tree_allreduce.h"
#include "alloy/dist/world.h"

namespace dist = alloy::dist;

namespace {
at::Tensor input(int rank, int round, int64_t n, at::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * round + rank + 1));
  return at::randn({n}, gen, at::TensorOptions().dtype(dtype));
}

// What member M's subtree sums to, added in the tree's order: its own, then each child's in turn;
// at a root paired with a twin, the twin's subtree last (P_root + P_twin).
at::Tensor subtree(const alloy::SyncTree& t, int m, int round, int64_t n, at::ScalarType dtype) {
  at::Tensor s = input(m, round, n, dtype);
  const bool paired = m == t.root && t.twin >= 0;
  for (int c : t.children[static_cast<size_t>(m)])
    if (!(paired && c == t.twin)) s.add_(subtree(t, c, round, n, dtype));
  if (paired) s.add_(subtree(t, t.twin, round, n, dtype));
  return s;
}

// The striped total: slice s (of as many near-equal contiguous slices as there are trees, fewer
// when N has fewer elements) added in tree s's order.
at::Tensor total(const std::vector<alloy::SyncTree>& trees, int round, int64_t n, at::ScalarType dtype) {
  const int64_t S = std::min<int64_t>(static_cast<int64_t>(trees.size()), n);
  if (S <= 1) return subtree(trees[0], trees[0].root, round, n, dtype);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(dtype));
  for (int64_t s = 0; s < S; ++s) {
    const alloy::SyncTree& t = trees[static_cast<size_t>(s)];
    const int64_t begin = s * n / S, end = (s + 1) * n / S;
    out.narrow(0, begin, end - begin).copy_(subtree(t, t.root, round, n, dtype).narrow(0, begin, end - begin));
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  std::set<std::pair<int, int>> slow;
  int die = -1, stripes = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--die") die = std::atoi(v.c_str());
    if (flag == "--stripes") stripes = std::atoi(v.c_str());
    if (flag == "--slow")
      for (size_t p = 0; p < v.size();) {
        const size_t comma = v.find(',', p), colon = v.find(':', p);
        const int a = std::atoi(v.substr(p, colon - p).c_str());
        const int b = std::atoi(v.substr(colon + 1, (comma == std::string::npos ? v.size() : comma) - colon - 1).c_str());
        slow.insert({std::min(a, b), std::max(a, b)});
        p = comma == std::string::npos ? v.size() : comma + 1;
      }
  }
  const auto rv = dist::resolve_rendezvous({});
  auto world = dist::World::create(rv, std::chrono::milliseconds(die >= 0 ? 20000 : 60000));
  const int W = world->size(), me = world->rank();
  const std::vector<alloy::SyncTree> trees = alloy::sync_trees(
      static_cast<size_t>(W), [&](size_t a, size_t b) { return slow.count({static_cast<int>(a), static_cast<int>(b)}) > 0; }, stripes);
  if (trees.empty() || static_cast<int>(trees.size()) != stripes) {
    std::fprintf(stderr, "rank %d: %zu trees for %d ranks with these slow pairs, not %d\n", me, trees.size(), W, stripes);
    return 2;
  }
  std::vector<int> all;
  for (int r = 0; r < W; ++r) all.push_back(r);
  auto group = world->new_group("check", all);
  group->route_sums(world->new_group("check-tree", all), trees);

  const int64_t chunk = dist::TreeAllreduce::kChunkBytes / 4;
  const std::vector<int64_t> sizes = {1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 0, (1 << 20) + 3};
  int round = 0, bad = 0;
  try {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble})
      for (int rep = 0; rep < 2; ++rep, ++round) {
        if (round == 1 && me == die) {
          std::printf("rank %d leaves without a word\n", me);
          std::fflush(stdout);
          _exit(0);
        }
        std::vector<at::Tensor> bufs;
        std::vector<c10::intrusive_ptr<c10d::Work>> works;
        for (int64_t n : sizes) {
          bufs.push_back(input(me, round, n, dtype));
          works.push_back(group->allreduce_sum(bufs.back()));  // all in flight before any wait
        }
        for (size_t k = 0; k < sizes.size(); ++k) {
          dist::wait_work(works[k], "check sum " + std::to_string(k));
          const at::Tensor want = total(trees, round, sizes[k], dtype);
          if (!at::equal(bufs[k], want)) {
            ++bad;
            std::fprintf(stderr, "rank %d round %d size %lld: differs from the tree's total by up to %g\n", me, round,
                         static_cast<long long>(sizes[k]), sizes[k] ? (bufs[k] - want).abs().max().item<double>() : 0.0);
          }
        }
      }
    if (die < 0) {
      // Group::sum_small (a step's figures): without a tree, all-gathered and added in rank order
      // on every rank; on the tree-routed group, the tree's total. Bit for bit either way.
      auto plain = world->new_group("check-small", all);
      for (int64_t n : {int64_t{1}, int64_t{8}, int64_t{1000}}) {
        at::Tensor t = input(me, 100, n, at::kDouble);
        plain->sum_small(t, "check small sum");
        at::Tensor want = input(0, 100, n, at::kDouble);
        for (int r = 1; r < W; ++r) want.add_(input(r, 100, n, at::kDouble));
        at::Tensor u = input(me, 101, n, at::kDouble);
        group->sum_small(u, "check small sum along the tree");
        for (const auto& [got, exp, what] : {std::tuple{t, want, "in rank order"}, std::tuple{u, total(trees, 101, n, at::kDouble), "along the tree"}})
          if (!at::equal(got, exp)) {
            ++bad;
            std::fprintf(stderr, "rank %d: a small sum of %lld %s differs by up to %g\n", me, static_cast<long long>(n), what,
                         (got - exp).abs().max().item<double>());
          }
      }
    }
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    if (die >= 0 && msg.find("(tree)") != std::string::npos && msg.find("rank") != std::string::npos) {
      std::printf("tree-allreduce failed as expected: %s\n", msg.substr(0, msg.find('\n')).c_str());
      std::fflush(stdout);
      _exit(0);  // peers are gone: skip the groups' teardown
    }
    std::fprintf(stderr, "rank %d: %s\n", me, msg.c_str());
    _exit(1);
  }
  if (die >= 0) {
    std::fprintf(stderr, "rank %d: rank %d left, but every sum still completed\n", me, die);
    _exit(1);
  }
  if (bad) return 1;
  std::string roots;
  for (const alloy::SyncTree& t : trees)
    roots += (roots.empty() ? "" : ", ") + std::to_string(t.root) + (t.twin >= 0 ? "-" + std::to_string(t.twin) : "");
  std::printf("tree-allreduce ok: rank %d of %d, roots %s, %zu tree(s), %d rounds of %zu sums\n", me, W, roots.c_str(), trees.size(),
              round, sizes.size());
  return 0;
}
