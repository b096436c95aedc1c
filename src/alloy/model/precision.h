#pragma once
// Mixed precision (train.precision): autocast for the forward on this thread, and dynamic loss
// scaling for fp16. Weights, gradients and AdamW state stay fp32; autocast runs the matrix
// products (and the ops its policy puts beside them) in bf16 or fp16 and records the casts, so the
// backward runs each op in the precision its forward used.
#include <ATen/ATen.h>

#include <string>

namespace alloy::model {

// Why this LibTorch cannot autocast DEVICE's type to PRECISION ("" when it can, or for fp32).
// LibTorch 1.13 autocasts CPU work to bf16 only; fp16 on the CPU needs LibTorch 2.x.
std::string autocast_problem(const at::Device& device, const std::string& precision);

// The precision autocast runs DEVICE's type in on this thread now: "fp32" (off), "bf16" or "fp16".
std::string autocast_precision(const at::Device& device);
// Autocast on DEVICE's type in PRECISION for this scope and this thread (nothing for fp32).
// Covers forwards only: backward()s run outside, on the casts the forward recorded.
class AutocastScope {
 public:
  AutocastScope(const at::Device& device, const std::string& precision);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  at::DeviceType type_ = at::kCPU;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// Dynamic loss scaling (the recipe of PyTorch's GradScaler): the loss is multiplied by scale()
// before the backward; a step whose gradients overflowed (non-finite norm, the same on every rank
// since the norm is all-reduced) is skipped and the scale halves; WINDOW finite steps in a row
// double it. Scales are powers of two, so scaling and unscaling are exact.
class LossScaler {
 public:
  LossScaler(bool enabled, double init, int64_t window) : enabled_(enabled), scale_(enabled ? init : 1.0), window_(window) {}
  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  // After the step's gradient norm (of the scaled gradients) is known: true = apply the step.
  bool update(double scaled_norm);
  int64_t skipped() const { return skipped_; }
  int64_t good_steps() const { return good_; }
  void restore(double scale, int64_t good_steps) {
    if (enabled_) scale_ = scale, good_ = good_steps;
  }

 private:
  bool enabled_;
  double scale_;
  int64_t window_;
  int64_t good_ = 0, skipped_ = 0;
};

}  // namespace alloy::model
