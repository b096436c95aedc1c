#include "alloy/model/precision.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <cmath>

namespace alloy::model {
namespace {
// LibTorch 2.4 made autocast's switches per device type; the older per-backend functions are
// what 1.13 has.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool enabled(at::DeviceType t) { return at::autocast::is_autocast_enabled(t); }
void set_enabled(at::DeviceType t, bool on) { at::autocast::set_autocast_enabled(t, on); }
at::ScalarType dtype(at::DeviceType t) { return at::autocast::get_autocast_dtype(t); }
void set_dtype(at::DeviceType t, at::ScalarType d) { at::autocast::set_autocast_dtype(t, d); }
#else
bool enabled(at::DeviceType t) { return t == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled(); }
void set_enabled(at::DeviceType t, bool on) {
  if (t == at::kCUDA) at::autocast::set_enabled(on);
  else at::autocast::set_cpu_enabled(on);
}
at::ScalarType dtype(at::DeviceType t) {
  return t == at::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
void set_dtype(at::DeviceType t, at::ScalarType d) {
  if (t == at::kCUDA) at::autocast::set_autocast_gpu_dtype(d);
  else at::autocast::set_autocast_cpu_dtype(d);
}
#endif
}  // namespace

std::string autocast_precision(const at::Device& device) {
  const at::DeviceType t = device.is_cuda() ? at::kCUDA : at::kCPU;
  if (!enabled(t)) return "fp32";
  return dtype(t) == at::kHalf ? "fp16" : "bf16";
}

std::string autocast_problem(const at::Device& device, const std::string& precision) {
  if (precision == "fp32") return "";
  if (device.is_cuda() || device.is_cpu()) {
#if TORCH_VERSION_MAJOR < 2
    if (device.is_cpu() && precision == "fp16")
      return "LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
             " autocasts CPU work to bf16 only (fp16 on the CPU needs LibTorch 2.x): use train.precision bf16 (--bf16) on CPU ranks";
#endif
    return "";
  }
  return "no autocast for device " + device.str();
}

AutocastScope::AutocastScope(const at::Device& device, const std::string& precision) {
  if (precision == "fp32") return;
  active_ = true;
  type_ = device.is_cuda() ? at::kCUDA : at::kCPU;
  prev_enabled_ = enabled(type_);
  prev_dtype_ = dtype(type_);
  set_enabled(type_, true);
  set_dtype(type_, precision == "bf16" ? at::kBFloat16 : at::kHalf);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // The casts of the weights are cached for the outermost scope only.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_enabled(type_, prev_enabled_);
  set_dtype(type_, prev_dtype_);
}

bool LossScaler::update(double scaled_norm) {
  if (!enabled_) return true;
  if (!std::isfinite(scaled_norm)) {
    scale_ = std::max(1.0, scale_ / 2);
    good_ = 0;
    ++skipped_;
    return false;
  }
  if (++good_ >= window_) {
    scale_ *= 2;
    good_ = 0;
  }
  return true;
}

}  // namespace alloy::model
