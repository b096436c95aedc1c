#pragma once
// Tensor parallelism from the Plan: which pieces every block is stored in, which heads a rank
// computes, and the group's sum over c10d (model/tensor_parallel.h has the layers' side).
#include <cstdint>
#include <memory>
#include <utility>

#include "alloy/core/plan.h"
#include "alloy/model/tensor_parallel.h"

namespace alloy::dist {

class Group;

// RANK's layout under PLAN (comm left null): the pieces of every block a tensor-parallel stage
// touches (the union of the boundaries of all such stages, so every holder stores the same
// pieces), and RANK's heads when its stage is a tensor-parallel group; the MLP pieces of every
// block a pipeline boundary cuts inside (StagePlan::mlp_cut) and RANK's side of its own cuts.
model::TpLayout tp_layout(const Plan& plan, const ModelConfig& model, int rank);

// The group's SUM all-reduce, waited for with the world's timeout. Reduced-precision tensors
// (autocast) are summed in fp32: Gloo has no bf16 sum, and a sum of partial products is the
// place where precision is lost.
class GroupTpComm : public model::TpComm {
 public:
  explicit GroupTpComm(std::shared_ptr<Group> group) : group_(std::move(group)) {}
  void allreduce_sum(at::Tensor& t) override;
  // Sequence parallelism's exchanges, each one all-to-all (Gloo has no reduce-scatter): the bytes
  // of a ring's all-gather or reduce-scatter, with uneven shares.
  at::Tensor gather_rows(const at::Tensor& mine, const std::vector<int64_t>& rows) override;
  at::Tensor scatter_sum_rows(const at::Tensor& full, const std::vector<int64_t>& rows) override;
  int size() const override;
  int rank() const override;
  Group& group() { return *group_; }
  // Seconds spent in the group's exchanges (copies to the wire and the wait) and how many, since
  // the last take_busy(): the trainer records them per step (ranks.json), beside the cost model's
  // price of the same sums.
  struct Busy {
    double seconds = 0;
    int64_t exchanges = 0;
  };
  Busy take_busy() { return std::exchange(busy_, Busy{}); }

 private:
  std::shared_ptr<Group> group_;
  Busy busy_;
};

}  // namespace alloy::dist
