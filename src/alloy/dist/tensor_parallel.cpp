#include "alloy/dist/tensor_parallel.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
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
        if (st.ranks[k] == rank) out.head_begin = b[k], out.head_end = b[k + 1], out.group_heads = b;
    }
  // Cuts inside an MLP: its columns split at the cut (and wherever tensor parallelism splits them).
  std::map<int64_t, std::set<int64_t>> mlp_bounds;
  for (const auto& pl : plan.pipelines)
    for (size_t s = 0; s + 1 < pl.stages.size(); ++s) {
      const StagePlan& st = pl.stages[s];
      if (!st.cuts_mlp()) continue;
      const int64_t blk = st.layer_end - 1;
      mlp_bounds[blk].insert({0, st.mlp_cut, model.heads});
      if (st.ranks[0] == rank) out.cut_out = {blk, 0, st.mlp_cut};
      if (pl.stages[s + 1].ranks[0] == rank) out.cut_in = {blk, st.mlp_cut, model.heads};
    }
  for (auto& [blk, s] : mlp_bounds)
    if (auto it = bounds.find(blk); it != bounds.end()) s.insert(it->second.begin(), it->second.end());
  for (const auto& [blk, s] : bounds) out.pieces[blk] = std::vector<int64_t>(s.begin(), s.end());
  for (const auto& [blk, s] : mlp_bounds) out.mlp_pieces[blk] = std::vector<int64_t>(s.begin(), s.end());
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

namespace {
// Adds the seconds from its construction to its end to BUSY.
class BusyTimer {
 public:
  explicit BusyTimer(GroupTpComm::Busy& busy) : busy_(busy), t0_(std::chrono::steady_clock::now()) {}
  ~BusyTimer() {
    busy_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    ++busy_.exchanges;
  }

 private:
  GroupTpComm::Busy& busy_;
  std::chrono::steady_clock::time_point t0_;
};

// What goes on the wire: on the CPU (Gloo), in fp32 for reduced precisions (sums lose least there).
at::Tensor wire(const at::Tensor& t) {
  const bool narrow = t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble;
  return t.to(at::kCPU, narrow ? at::kFloat : t.scalar_type()).contiguous();
}
}  // namespace

void GroupTpComm::allreduce_sum(at::Tensor& t) {
  BusyTimer timer(busy_);
  if (group_->device_collectives() && t.is_cuda()) {
    // A group of GPUs of their own sums on the device (NCCL, the Group's dispatch the reducer
    // uses too), in fp32 as on the wire below. The timer then sees the enqueue, not the sum: NCCL
    // orders the stream after it and the host does not wait.
    at::Tensor buf = t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ? t.contiguous() : t.to(at::kFloat);
    wait_work(group_->allreduce_sum(buf), "the tensor-parallel sum in group " + group_->name());
    if (!buf.is_same(t)) t.copy_(buf);
    return;
  }
  at::Tensor buf = wire(t);
  wait_work(group_->allreduce_sum(buf), "the tensor-parallel sum in group " + group_->name());
  t.copy_(buf);
}

at::Tensor GroupTpComm::gather_rows(const at::Tensor& mine, const std::vector<int64_t>& rows) {
  BusyTimer timer(busy_);
  const int n = size();
  at::Tensor one = wire(mine);
  std::vector<at::Tensor> copies(static_cast<size_t>(n), one);  // the same rows to every member
  at::Tensor in = at::cat(copies, 0);
  std::vector<int64_t> shape(one.sizes().begin(), one.sizes().end());
  shape[0] = 0;
  for (int64_t r : rows) shape[0] += r;
  at::Tensor out = at::empty(shape, one.options());
  wait_work(group_->alltoall_rows(out, in, rows, std::vector<int64_t>(static_cast<size_t>(n), one.size(0))),
            "the sequence-parallel all-gather in group " + group_->name());
  return out.to(mine.device(), mine.scalar_type());
}

at::Tensor GroupTpComm::scatter_sum_rows(const at::Tensor& full, const std::vector<int64_t>& rows) {
  BusyTimer timer(busy_);
  const int n = size();
  const int64_t r = rows[static_cast<size_t>(rank())];
  at::Tensor in = wire(full);
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] = n * r;
  at::Tensor out = at::empty(shape, in.options());
  wait_work(group_->alltoall_rows(out, in, std::vector<int64_t>(static_cast<size_t>(n), r), rows),
            "the sequence-parallel reduce-scatter in group " + group_->name());
  shape[0] = r;
  shape.insert(shape.begin(), n);
  return out.view(shape).sum(0).to(full.device(), full.scalar_type());
}

}  // namespace alloy::dist
