#pragma once
// Who sums which gradients with whom, derived from the Plan alone, so every rank computes the same
// thing without talking: for every parameter the ranks that hold it, and for every distinct set of
// holders whether its gradients go exact or compressed, and through which regions.
//
// A holder set (two or more ranks holding the same parameters) is compressed when
// grad_sync.compression is lossy and either grad_sync.scope is `all`, or the set spans more than
// one region: its ranks split into regions by the plan's slow_links (ranks joined, directly or
// through each other, by links that are not slow). With scope slow-links such a set syncs
// hierarchically (exact inside each region, compressed between regions); a set inside one region
// stays exact. An exact set of three or more ranks with a slow pair among them sums along a tree
// of its fast links instead of Gloo's ring (grad_sync.allreduce auto; core/sync_tree.h).
#include <map>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"
#include "alloy/core/sync_tree.h"

namespace alloy::dist {

struct HolderSet {
  std::vector<int> ranks;                 // sorted
  std::vector<std::vector<int>> regions;  // sorted by first rank; each sorted
  bool compressed = false;
  bool hierarchical = false;              // compressed between regions only (scope slow-links)
  std::vector<SyncTree> trees;            // exact sum along these trees (stripes) over RANKS' order; none: ring
  std::string name;                       // "grad-0-2": also the stem of its process groups
  const std::vector<int>* region_of(int rank) const;
  std::vector<int> leaders() const;       // the lowest rank of every region
};

class SyncLayout {
 public:
  // With LoRA every parameter, adapters included, has holders, but only those that train (the
  // adapters) form holder sets: the frozen base is never synced.
  SyncLayout(const Plan& plan, const ModelConfig& model, const LoraConfig& lora = {});
  // The ranks holding PARAM, sorted; throws Error for an unknown name.
  const std::vector<int>& holders(const std::string& param) const;
  const std::map<std::string, std::vector<int>>& all_holders() const { return holders_; }
  // A parameter's place in one model order that every rank agrees on (the order names first
  // appear in the plan's stages, which hold their parameters in model order). Every holder of a set
  // lays the set's parameters out in it: a rank's own order is not enough once a set mixes
  // parameters that two stages hold in different orders (a floating unit and GPT-2's tied wte,
  // first and last on one stage and the reverse on the other).
  int64_t model_order(const std::string& param) const;
  // Sets of two or more holders, sorted by their ranks: the order every rank creates groups in.
  const std::vector<HolderSet>& sets() const { return sets_; }
  const HolderSet* set_of(const std::vector<int>& ranks) const;
  // What a rank's compression state belongs to: the compressed sets and the settings.
  std::string state_key(int rank, const GradSyncConfig& g) const;

 private:
  std::map<std::string, std::vector<int>> holders_;
  std::map<std::string, int64_t> order_;
  std::vector<HolderSet> sets_;
};

// The tree an exact sum among RANKS takes around the SLOW pairs (a < b) among them, or empty (the ring).
SyncTree sum_tree_of(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow);
// The same sum's stripes (core/sync_tree.h, sync_trees): at most MAX_TREES trees; none: the ring.
std::vector<SyncTree> sum_trees_of(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow, int max_trees);

// Ranks split by slow links: connected components of the graph whose edges are the pairs of RANKS
// not listed in SLOW (pairs a < b).
std::vector<std::vector<int>> split_regions(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow);

}  // namespace alloy::dist
