#include "alloy/dist/tensor_parallel.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <set>

#include "alloy/dist/world.h"

namespace alloy::dist {

model::TpLayout tp_layout(const Plan& plan, const ModelConfig& model, int rank) {
  model::TpLayout out;
  std::map<int64_t, std::set<int64_t>> bounds;
  for (const auto& pl : plan.pipelines)
    for (const auto& st : pl.stages) {
      if (st.tp() < 2) continue;
      const auto b = st.tp_bounds(model.heads);
      for (int64_t blk = st.layer_begin; blk < st.layer_end; ++blk) bounds[blk].insert(b.begin(), b.end());
      for (size_t k = 0; k < st.ranks.size(); ++k)
        if (st.ranks[k] == rank) out.head_begin = b[k], out.head_end = b[k + 1];
    }
  for (const auto& [blk, s] : bounds) out.pieces[blk] = std::vector<int64_t>(s.begin(), s.end());
  // The vocabulary's rows, for the stages holding the embedding or the head: in the heads' ratio.
  std::set<int64_t> rows;
  for (const auto& pl : plan.pipelines)
    for (const auto& st : pl.stages) {
      if (st.tp() < 2 || (st.unit_begin() != 0 && st.unit_end() != 2 * model.layers)) continue;
      std::vector<int64_t> b;
      for (int64_t h : st.tp_bounds(model.heads)) b.push_back(model.vocab_size * h / model.heads);
      rows.insert(b.begin(), b.end());
      for (size_t k = 0; k < st.ranks.size(); ++k)
        if (st.ranks[k] == rank) out.vocab_begin = b[k], out.vocab_end = b[k + 1];
    }
  if (!rows.empty()) out.vocab_pieces.assign(rows.begin(), rows.end());
  return out;
}

int GroupTpComm::size() const { return group_->size(); }
int GroupTpComm::rank() const { return group_->rank(); }

void GroupTpComm::allreduce_sum(at::Tensor& t) {
  const bool narrow = t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble;
  at::Tensor buf = t.to(at::kCPU, narrow ? at::kFloat : t.scalar_type()).contiguous();
  wait_work(group_->allreduce_sum(buf), "the tensor-parallel sum in group " + group_->name());
  t.copy_(buf);
}

}  // namespace alloy::dist
