#pragma once
// AdamW with decoupled weight decay, the math of torch.optim.AdamW, over Alloy's named parameters.
// Kept in-house (not torch::optim) so its state is keyed by parameter name: checkpoints stay
// readable by name and reshardable when a later run splits the layers differently.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/model/transformer.h"

namespace alloy::train {

// State KEY saved as slices of the flattened tensor ("KEY@BEGIN", each by its owner under ZeRO),
// joined into NUMEL elements (flat). Undefined when TENSORS holds no slice of KEY; throws
// InputError naming WHERE when a slice lies outside or the slices do not cover the tensor exactly.
at::Tensor join_state_slices(const std::map<std::string, at::Tensor>& tensors, const std::string& key, int64_t numel,
                             const std::string& where);

class AdamW {
 public:
  struct Options {
    double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  };
  AdamW(std::vector<model::Param*> params, Options opts);
  // Over slices (ZeRO, dist/sharding.h): the moments cover each slice only and step() updates it
  // alone; a slice without numel (< 0) is an unsharded parameter, as in the constructor above.
  AdamW(std::vector<model::ParamSlice> slices, Options opts);
  static Options from_config(const TrainConfig& t) { return {t.beta1, t.beta2, t.eps, t.weight_decay}; }

  void step(double lr);  // parameters without a gradient are left untouched

  // Parameters whose gradients arrive through a sparsifier with error feedback (dist/compress):
  // each element gets its gradient accumulated over T steps now and then, not a little every step,
  // and Adam's m / sqrt(v) would move it by one step's worth per arrival (at density 0.01 a weight
  // then moved ~17x less than under exact sync; the validation loss of a 6x384 GPT-2 was 30% worse
  // after 150 steps). From optimizer step AFTER on (the exact steps before it measure v), v no longer
  // follows the arriving values and the update is linear in them, so what error feedback delays
  // still arrives whole (1-bit Adam's recipe). Elements the exact steps never touched (embedding
  // rows of tokens not seen yet) get a floor of 1% of their tensor's mean v instead of dividing
  // their first arrival by epsilon. (Scaling the frozen v by the gradient's measured energy since
  // the freeze was tried and made the loss worse: 2.69 vs 2.55 after 300 steps, bench/README.)
  // With DGC's momentum correction (MOMENTUM > 0) the arriving value already carries the momentum
  // (a local velocity, about T steps of g / (1 - MOMENTUM)): m is (1 - MOMENTUM) times it.
  // Measured (bench/README): without momentum correction the selection follows the noise of the
  // raw accumulated gradients and training diverged after the switch.
  void read_linearly(const std::vector<std::string>& names, int64_t after, double momentum);

  void zero_grad();      // drops gradients (undefined), so the next backward assigns, not adds
  // Tensors the last step() updated with the fused kernel (CUDA, LibTorch >= 2.2; 0 elsewhere).
  int64_t fused_tensors() const { return fused_last_; }
  int64_t steps_taken() const { return t_; }

  // Named state for checkpoints: "exp_avg.NAME", "exp_avg_sq.NAME" (unsharded), or for a shard's
  // slice "exp_avg.NAME@BEGIN" (its elements from BEGIN of the flattened tensor, maybe all).
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Bytes of the moments this optimizer keeps.
  int64_t state_bytes() const;
  // Loads what state() wrote, whole or in slices (from any other split: each slot takes its range of
  // the whole tensor, or assembles it from the slices that cover it). WHERE names the file.
  void load_state(const std::map<std::string, at::Tensor>& tensors, int64_t steps_taken, const std::string& where);

 private:
  struct Slot {
    model::Param* p;
    at::Tensor m, v;
    model::ParamSlice slice;  // what of p this slot updates
    int64_t linear_after = -1;  // -1: plain AdamW throughout
    double momentum = 0;
  };
  bool fusable(const Slot& s, const at::Tensor& w, const at::Tensor& g) const;
  static bool cpu_fusable(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v);
  std::vector<Slot> slots_;
  std::map<std::string, at::Tensor> fused_steps_;  // the fused kernel's step count, per device
  int64_t fused_last_ = 0;
  Options o_;
  int64_t t_ = 0;
};

// Scales all gradients so their global L2 norm is at most MAX_NORM (when MAX_NORM > 0); returns the
// norm before clipping. Same rule as torch.nn.utils.clip_grad_norm_.
double clip_grad_norm(const std::vector<model::Param*>& params, double max_norm);
double global_grad_norm_sq(const std::vector<model::Param*>& params);
double global_grad_norm_sq(const std::vector<model::ParamSlice>& slices);  // of the slices' elements
// The clipping step alone, for callers that computed NORM themselves (across ranks): scales the
// gradients by max_norm / norm when NORM exceeds MAX_NORM > 0.
void clip_to(const std::vector<model::Param*>& params, double norm, double max_norm);
// What clip_to scales by: max_norm / (norm + 1e-6) when NORM exceeds MAX_NORM > 0, else 1.
double clip_coef(double norm, double max_norm);

// Linear warmup to train.lr over train.warmup steps, then cosine decay to train.min_lr at train.steps.
double lr_at(const TrainConfig& t, int64_t step);

}  // namespace alloy::train
