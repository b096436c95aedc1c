#include "alloy/dist/sync_layout.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <set>

#include "alloy/core/components.h"
#include "alloy/core/error.h"
#include "alloy/core/text.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/model/transformer.h"

namespace alloy::dist {

std::vector<std::vector<int>> split_regions(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow) {
  std::set<std::pair<int, int>> slow_set(slow.begin(), slow.end());
  std::vector<std::vector<int>> out;
  for (const auto& c : components(ranks.size(), [&](size_t a, size_t b) {
         return !slow_set.count({std::min(ranks[a], ranks[b]), std::max(ranks[a], ranks[b])});
       })) {
    std::vector<int> r;
    for (size_t i : c) r.push_back(ranks[i]);
    std::sort(r.begin(), r.end());
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end());  // by lowest rank, whatever order RANKS came in (as before components())
  return out;
}

const std::vector<int>* HolderSet::region_of(int rank) const {
  for (const auto& r : regions)
    if (std::find(r.begin(), r.end(), rank) != r.end()) return &r;
  return nullptr;
}

std::vector<int> HolderSet::leaders() const {
  std::vector<int> out;
  for (const auto& r : regions) out.push_back(r.front());
  return out;
}

SyncLayout::SyncLayout(const Plan& plan, const ModelConfig& model, const LoraConfig& lora) {
  const bool tp = plan.has_pieces();
  for (const auto& pl : plan.pipelines)
    for (const auto& s : pl.stages)
      for (int r : s.ranks) {
        const model::TpLayout layout = tp ? tp_layout(plan, model, r) : model::TpLayout{};
        for (const auto& n : model::param_names(model, lora, model::LayerRange::for_units(s.unit_begin(), s.unit_end(), model.layers),
                                                tp ? &layout : nullptr)) {
          holders_[n].push_back(r);
          order_.emplace(n, static_cast<int64_t>(order_.size()));
        }
      }
  std::set<std::vector<int>> distinct;
  for (auto& [n, r] : holders_) {
    std::sort(r.begin(), r.end());
    if (r.size() > 1 && model::trains(lora, n)) distinct.insert(r);
  }
  const GradSyncConfig& g = plan.grad_sync;
  for (const auto& ranks : distinct) {
    HolderSet h;
    h.ranks = ranks;
    h.name = "grad-" + join(ranks, "-");
    const bool slow_only = g.scope == "slow-links";
    h.regions = slow_only ? split_regions(ranks, plan.slow_links) : std::vector<std::vector<int>>{ranks};
    h.compressed = g.lossy() && (!slow_only || h.regions.size() > 1);
    h.hierarchical = h.compressed && slow_only;
    if (!h.compressed && g.allreduce == "auto")
      h.trees = sum_trees_of(ranks, plan.slow_links, static_cast<int>(g.tree_stripes));
    sets_.push_back(h);
  }
}

namespace {
std::function<bool(size_t, size_t)> slow_members(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow_links) {
  auto slow = std::make_shared<std::set<std::pair<int, int>>>(slow_links.begin(), slow_links.end());
  return [slow, &ranks](size_t a, size_t b) { return slow->count({std::min(ranks[a], ranks[b]), std::max(ranks[a], ranks[b])}) > 0; };
}
}  // namespace

SyncTree sum_tree_of(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow_links) {
  return sync_tree(ranks.size(), slow_members(ranks, slow_links));
}

std::vector<SyncTree> sum_trees_of(const std::vector<int>& ranks, const std::vector<std::pair<int, int>>& slow_links, int max_trees) {
  return sync_trees(ranks.size(), slow_members(ranks, slow_links), max_trees);
}

int64_t SyncLayout::model_order(const std::string& param) const {
  auto it = order_.find(param);
  if (it == order_.end()) throw Error("no rank holds parameter '" + param + "'");
  return it->second;
}

const std::vector<int>& SyncLayout::holders(const std::string& param) const {
  auto it = holders_.find(param);
  if (it == holders_.end()) throw Error("no rank holds parameter '" + param + "'");
  return it->second;
}

const HolderSet* SyncLayout::set_of(const std::vector<int>& ranks) const {
  for (const auto& s : sets_)
    if (s.ranks == ranks) return &s;
  return nullptr;
}

std::string SyncLayout::state_key(int rank, const GradSyncConfig& g) const {
  std::string key = g.compression + "/" + std::to_string(g.density) + "/" + g.scope + "/" + (g.error_feedback ? "ef" : "noef");
  for (const auto& s : sets_)
    if (s.compressed && std::find(s.ranks.begin(), s.ranks.end(), rank) != s.ranks.end()) {
      key += "|" + s.name;
      for (const auto& r : s.regions) key += ":" + join(r, ".");
    }
  return key;
}

}  // namespace alloy::dist
