#pragma once
// ZeRO-3 (FSDP): parameters sharded too. Each member of a holder set keeps, between uses, only its
// range of the set's flat buffer (the same uneven ranges as ZeRO-1/2, dist/sharding.h) as a flat
// shard of values and one of reduced gradients; AdamW updates the shard in place (ParamSlice's
// value/grad). A layer's parameters are all-gathered into their own tensors just before the
// layer's forward and again before its backward, and freed right after each (the storage is
// released in place, so the autograd graph's saved references see the gathered values again in
// the backward); the next layer's gather is started before the current layer computes (prefetch,
// forward and backward order). Gradients are reduced onto the owners by the Reducer (as ZeRO-2),
// which copies each owner's range into its gradient shard and drops the full gradients.
//
// Every member of a set issues the same gathers in the same order, so the members must run the
// same schedule: the same layers at the same pipeline position with the same number of
// micro-batches (micro-batch sizes may differ: heterogeneous replicas). The trainer checks that.
// Work where only some members run a forward (validation through pipeline 0) or where every
// parameter is needed at once (checkpoints) brackets itself with pin_all() / unpin_all().
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "alloy/model/recompute.h"
#include "alloy/model/transformer.h"

namespace c10d {
class Work;
}

namespace alloy::dist {

class Group;

using model::release_storage;  // model/recompute.h
using model::restore_storage;

class Zero3 : public model::LayerHooks {
 public:
  struct Set {
    std::shared_ptr<Group> group;
    std::vector<model::Param*> params;  // backward order: the set's flat order
    std::vector<int64_t> bounds;        // group rank i owns [bounds[i], bounds[i + 1])
    at::Tensor values, grads;           // this rank's range: its shard of values and of reduced gradients
  };
  // Takes each set's shard from MODEL's (full, resident) parameters, then frees them. MODEL must
  // outlive this object; call model.set_layer_hooks(this) after.
  Zero3(model::Transformer& model, std::vector<Set> sets);
  ~Zero3() override;

  void before_forward(size_t i) override;
  void after_forward(size_t i) override;
  void before_backward(size_t i) override;
  void after_backward(size_t i) override;

  // WHEN returns true during the backward whose gradients the Reducer takes (the last
  // micro-batch's): a layer's own gradients are dropped after its backward, the Reducer's bucket
  // holding their sum by then, so the full gradients exist about once, not twice.
  void drop_grads_when(std::function<bool()> when) { drop_grads_ = std::move(when); }
  // After the step's backward: frees whatever is still gathered (the embedding, whose input needs
  // no gradient, has no after_backward).
  void end_step();
  // Collective (every member of every set): gathers every sharded parameter and keeps it until
  // unpin_all(); the layer hooks do nothing meanwhile.
  void pin_all();
  void unpin_all();

  int64_t shard_bytes() const;             // this rank's value shards
  int64_t grad_shard_bytes() const;        // and gradient shards
  // Most parameter bytes resident at once in the training steps (pin_all's are not counted).
  int64_t peak_gathered_bytes() const { return peak_gathered_bytes_; }
  // What this rank's gathers put on the wire since the last call, counted as ring all-gathers:
  // (n - 1) / n of each gathered range.
  int64_t take_bytes_sent();

 private:
  enum class State { Free, Gathering, Ready };
  struct Range {  // one set's part of a layer: its parameters are contiguous in the set's flat order
    size_t set;
    int64_t lo, hi;
  };
  struct Unit {
    std::vector<model::Param*> params;  // the layer's sharded parameters
    std::vector<Range> ranges;
    State state = State::Free;
    std::vector<at::Tensor> staging;  // per range, while gathering
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };
  void start_gather(size_t u);
  void finish_gather(size_t u);
  void ensure_ready(size_t u);
  void release(size_t u);
  void free_param(model::Param* p);

  model::Transformer& model_;
  std::vector<Set> sets_;
  std::vector<Unit> units_;  // per layer of the slice
  std::map<model::Param*, std::pair<size_t, int64_t>> where_;  // parameter -> (set, offset in its flat order)
  std::map<model::Param*, int> refs_;  // gathered layers holding each parameter
  bool pinned_ = false;
  std::function<bool()> drop_grads_;
  int64_t resident_bytes_ = 0, peak_gathered_bytes_ = 0, bytes_sent_ = 0;
};

}  // namespace alloy::dist
