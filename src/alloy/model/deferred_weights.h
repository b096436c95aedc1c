#pragma once
// Deferred weight gradients: what the zb-h1 schedule's BackwardWeight actions run
// (pipeline/schedule.h). While a Scope is active, a block's projection (Layer::project) of a
// weight that needs a gradient records, in its backward, the projection's input and output
// gradient instead of computing the weight's (and bias's) gradient; the input gradient is computed
// as usual, so the stage can send it on at once. run(MB) later turns micro-batch MB's records into
// the gradients, the same products a plain backward computes.
//
// How the gradients land: those of every micro-batch but the step's last are added to .grad
// directly (no hooks), and the last's (FINAL) go through autograd into the parameters, each as soon
// as its product is done (in backward order), so their hooks (the Reducer's) fire once, after
// every other contribution is in .grad, exactly as they fire in a plain backward's last
// micro-batch. The caller runs the final pass after every other.
//
// The active recorder is process-wide, not per thread: a recomputed block's forward runs on the
// autograd engine's thread. One executor per process runs forwards with grad mode on.
//
// Not for tensor-parallel pieces or ZeRO-3's gathered weights (Plan validation refuses zb-h1 with
// them): the records hold the weights' tensors until the pass.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <vector>

namespace alloy::model {

class DeferredWeightGrads {
 public:
  // Makes D the active recorder for micro-batch MB (process-wide: a recomputed block's forward runs
  // on the autograd engine's thread, which may not be the caller's). Nests; restores on exit.
  class Scope {
   public:
    Scope(DeferredWeightGrads* d, int64_t mb);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    DeferredWeightGrads* prev_d_;
    int64_t prev_mb_;
  };
  // The active recorder, or null; and the micro-batch it records for.
  static DeferredWeightGrads* active();

  // X times W (W [out, in]; IN_OUT: W [in, out]) plus BIAS (may be null), recording for the
  // active micro-batch. Call only when active() and grad mode is on and W needs a gradient.
  at::Tensor project(const at::Tensor& x, const at::Tensor& W, const at::Tensor* bias, bool in_out);

  // The weight pass of micro-batch MB (no-op when nothing was recorded for it).
  void run(int64_t mb, bool final);
  bool empty() const { return pending_.empty(); }
  void clear() { pending_.clear(); }

  struct Record {
    at::Tensor x, g;  // the projection's input and its output's gradient
    at::Tensor W, b;  // the parameters (b undefined without a bias)
    bool in_out = false;
  };
  void add(int64_t mb, Record r) { pending_[mb].push_back(std::move(r)); }

 private:
  std::map<int64_t, std::vector<Record>> pending_;
};

}  // namespace alloy::model
