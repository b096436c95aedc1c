#include "alloy/train/optimizer.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>

#include "alloy/core/error.h"
#include "alloy/core/fused_loops.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
#define ALLOY_FUSED_ADAMW 1
#endif

namespace alloy::train {

AdamW::AdamW(std::vector<model::Param*> params, Options opts) : o_(opts) {
  for (auto* p : params) slots_.push_back({p, at::zeros_like(p->tensor), at::zeros_like(p->tensor), {p}});
}

AdamW::AdamW(std::vector<model::ParamSlice> slices, Options opts) : o_(opts) {
  for (auto& sl : slices) {
    if (sl.numel < 0) {  // not sharded: the whole tensor, saved under its name
      slots_.push_back({sl.p, at::zeros_like(sl.p->tensor), at::zeros_like(sl.p->tensor), {sl.p}});
      continue;
    }
    if (sl.begin < 0 || sl.begin + sl.numel > sl.p->tensor.numel())
      throw Error("AdamW: slice [" + std::to_string(sl.begin) + ", +" + std::to_string(sl.numel) + ") is outside '" + sl.p->name + "'");
    at::Tensor z = at::zeros({sl.numel}, sl.p->tensor.options().requires_grad(false));
    slots_.push_back({sl.p, z, z.clone(), sl});
  }
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (const auto& s : slots_) b += (s.m.numel() + s.v.numel()) * static_cast<int64_t>(s.m.element_size());
  return b;
}

bool AdamW::fusable(const Slot& s, const at::Tensor& w, const at::Tensor& g) const {
#ifdef ALLOY_FUSED_ADAMW
  // One kernel for every whole fp32 tensor on a CUDA device (PyTorch's fused AdamW, the same math):
  // per tensor, the update below is eight kernels, ~1200 launches for a 12-layer GPT-2.
  return g.is_cuda() && w.device() == g.device() && s.linear_after < 0 && w.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
         !g.is_sparse() && w.is_contiguous() && g.is_contiguous() && s.m.sizes() == w.sizes();
#else
  (void)s, (void)w, (void)g;
  return false;
#endif
}

bool AdamW::cpu_fusable(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  // The fused loop (core/fused_loops.h): plain fp32 arrays of one size on the CPU, none sharing memory.
  auto plain = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_sparse() && t.numel() == w.numel();
  };
  return plain(w) && plain(g) && plain(m) && plain(v) && g.data_ptr() != w.data_ptr() &&
         g.data_ptr() != m.data_ptr() && g.data_ptr() != v.data_ptr();
}

void AdamW::step(double lr) {
  at::NoGradGuard ng;
  ++t_;
  const double bc1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t_));
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  struct Fused {
    Slot* s;
    at::Tensor w, g;
  };
  std::vector<Fused> fused[2];  // without, with weight decay
  fused_last_ = 0;
  for (auto& s : slots_) {
    const at::Tensor g = s.slice.grads();
    if (!g.defined()) continue;
    at::Tensor w = s.slice.values();  // a view: updated in place
    if (fusable(s, w, g)) {
      fused[s.p->decay && o_.weight_decay != 0.0 ? 1 : 0].push_back({&s, w, g});
      continue;
    }
    if (s.linear_after >= 0 && t_ > s.linear_after) {
      if (s.p->decay && o_.weight_decay != 0.0) w.mul_(1.0 - lr * o_.weight_decay);
      // Once, at the first linear step: a checkpoint after it holds the floored v.
      if (t_ == s.linear_after + 1) s.v.clamp_min_(0.01 * s.v.mean().item<double>());
      const double bc2_frozen = 1.0 - std::pow(o_.beta2, static_cast<double>(s.linear_after));
      at::Tensor denom = s.v.div(bc2_frozen).sqrt_().add_(o_.eps);
      if (s.momentum > 0) {
        w.addcdiv_(g, denom, -lr * (1.0 - s.momentum));
      } else {
        s.m.mul_(o_.beta1).add_(g, 1.0 - o_.beta1);
        w.addcdiv_(s.m, denom, -step_size);
      }
      continue;
    }
    if (cpu_fusable(w, g, s.m, s.v)) {
      AdamWStep k;
      k.decay_mul = s.p->decay && o_.weight_decay != 0.0 ? static_cast<float>(1.0 - lr * o_.weight_decay) : 1.0f;
      k.beta1 = static_cast<float>(o_.beta1), k.one_minus_beta1 = static_cast<float>(1.0 - o_.beta1);
      k.beta2 = static_cast<float>(o_.beta2), k.one_minus_beta2 = static_cast<float>(1.0 - o_.beta2);
      k.bias_correction2_sqrt = static_cast<float>(bc2_sqrt), k.eps = static_cast<float>(o_.eps);
      k.neg_step_size = static_cast<float>(-step_size);
      float *pw = w.data_ptr<float>(), *pm = s.m.data_ptr<float>(), *pv = s.v.data_ptr<float>();
      const float* pg = g.data_ptr<float>();
      at::parallel_for(0, w.numel(), 1 << 15, [&](int64_t lo, int64_t hi) { adamw_update(pw + lo, pg + lo, pm + lo, pv + lo, hi - lo, k); });
      continue;
    }
    if (s.p->decay && o_.weight_decay != 0.0) w.mul_(1.0 - lr * o_.weight_decay);
    s.m.mul_(o_.beta1).add_(g, 1.0 - o_.beta1);
    s.v.mul_(o_.beta2).addcmul_(g, g, 1.0 - o_.beta2);
    at::Tensor denom = s.v.sqrt().div_(bc2_sqrt).add_(o_.eps);
    w.addcdiv_(s.m, denom, -step_size);
  }
#ifdef ALLOY_FUSED_ADAMW
  for (int decay = 0; decay < 2; ++decay) {
    // The kernel reads the step count from a tensor per parameter (bias corrections on the device).
    // One tensor per device, shared by the list: every fused slot has taken the same steps.
    std::map<std::string, std::vector<const Fused*>> by_device;
    for (const Fused& f : fused[decay]) by_device[f.w.device().str()].push_back(&f);
    for (auto& [dev, list] : by_device) {
      at::Tensor& step = fused_steps_[dev];
      if (!step.defined()) step = at::zeros({}, list[0]->w.options().dtype(at::kFloat).requires_grad(false));
      step.fill_(static_cast<double>(t_));
      std::vector<at::Tensor> ws, gs, ms, vs, steps;
      for (const Fused* f : list) {
        ws.push_back(f->w), gs.push_back(f->g), ms.push_back(f->s->m), vs.push_back(f->s->v);
        steps.push_back(step);
      }
      fused_last_ += static_cast<int64_t>(ws.size());
      at::_fused_adamw_(ws, gs, ms, vs, /*max_exp_avg_sqs=*/{}, steps, lr, o_.beta1, o_.beta2, decay ? o_.weight_decay : 0.0, o_.eps,
                        /*amsgrad=*/false, /*maximize=*/false);
    }
  }
#endif
}

void AdamW::read_linearly(const std::vector<std::string>& names, int64_t after, double momentum) {
  for (auto& s : slots_)
    if (std::find(names.begin(), names.end(), s.p->name) != names.end()) {
      s.linear_after = after;
      s.momentum = momentum;
    }
}

void AdamW::zero_grad() {
  for (auto& s : slots_)
    if (s.p->tensor.grad().defined()) s.p->tensor.mutable_grad().reset();
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& s : slots_) {
    // A shard's slice keeps its offset even when it spans the tensor: whole tensors are saved by
    // their first holder, slices by their owner.
    const std::string at = s.slice.numel < 0 ? "" : "@" + std::to_string(s.slice.begin);
    out.emplace_back("exp_avg." + s.p->name + at, s.m);
    out.emplace_back("exp_avg_sq." + s.p->name + at, s.v);
  }
  return out;
}

at::Tensor join_state_slices(const std::map<std::string, at::Tensor>& tensors, const std::string& key, int64_t numel,
                             const std::string& where) {
  const std::string prefix = key + "@";
  at::Tensor out;
  int64_t covered = 0;
  for (auto s = tensors.lower_bound(prefix); s != tensors.end() && s->first.compare(0, prefix.size(), prefix) == 0; ++s) {
    int64_t begin = -1;
    try {
      begin = std::stoll(s->first.substr(prefix.size()));
    } catch (const std::exception&) {
    }
    const int64_t len = s->second.numel();
    if (begin < 0 || begin + len > numel)
      throw InputError(where, "optimizer state '" + s->first + "' (" + std::to_string(len) + " elements) lies outside '" + key +
                                  "' (" + std::to_string(numel) + ")");
    if (!out.defined()) out = at::zeros({numel}, s->second.options().device(at::kCPU).requires_grad(false));
    out.narrow(0, begin, len).copy_(s->second.reshape({-1}));
    covered += len;
  }
  if (out.defined() && covered != numel)
    throw InputError(where, "optimizer state '" + key + "' is incomplete: its slices cover " + std::to_string(covered) + " of " +
                                std::to_string(numel) + " elements");
  return out;
}

namespace {
// The whole tensor of state KEY for P: saved whole, or assembled from the slices "KEY@BEGIN" that
// another (sharded) run saved. Throws InputError when missing, misshapen or not fully covered.
at::Tensor whole_state(const std::map<std::string, at::Tensor>& tensors, const std::string& key, const model::Param& p,
                       const std::string& where) {
  auto it = tensors.find(key);
  if (it != tensors.end()) {
    if (it->second.sizes() != p.tensor.sizes())
      throw InputError(where, "optimizer state '" + key + "' has shape " + std::string(c10::str(it->second.sizes())) +
                                  ", the model needs " + std::string(c10::str(p.tensor.sizes())));
    return it->second;
  }
  at::Tensor out = join_state_slices(tensors, key, p.tensor.numel(), where);
  if (!out.defined()) throw InputError(where, "optimizer state '" + key + "' is missing");
  return out.to(p.tensor.scalar_type()).view(p.tensor.sizes());
}
}  // namespace

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, int64_t steps_taken, const std::string& where) {
  at::NoGradGuard ng;
  for (auto& s : slots_) {
    for (auto [key, dst] : {std::pair<std::string, at::Tensor*>{"exp_avg." + s.p->name, &s.m},
                            std::pair<std::string, at::Tensor*>{"exp_avg_sq." + s.p->name, &s.v}}) {
      at::Tensor whole = whole_state(tensors, key, *s.p, where);
      dst->copy_(s.slice.of(whole));
    }
  }
  t_ = steps_taken;
}

namespace {
// The sum of the squared L2 norms of GRADS. A CPU tensor's norm is read as it comes; an
// accelerator's norms are stacked and read once (one device-to-host wait per step, not one per
// tensor: ~150 for a 12-layer GPT-2), each squared in double as on the CPU.
double sum_of_squared_norms(const std::vector<at::Tensor>& grads) {
  double total = 0.0;
  std::map<std::string, std::vector<at::Tensor>> on_device;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    if (g.is_cpu()) {
      double n = g.norm().item<double>();
      total += n * n;
    } else {
      on_device[g.device().str()].push_back(g.norm().reshape({1}));
    }
  }
  for (auto& [dev, norms] : on_device) total += at::cat(norms).to(at::kDouble).pow(2).sum().item<double>();
  return total;
}
}  // namespace

double global_grad_norm_sq(const std::vector<model::Param*>& params) {
  at::NoGradGuard ng;
  std::vector<at::Tensor> grads;
  for (auto* p : params) grads.push_back(p->tensor.grad());
  return sum_of_squared_norms(grads);
}

double global_grad_norm_sq(const std::vector<model::ParamSlice>& slices) {
  at::NoGradGuard ng;
  std::vector<at::Tensor> grads;
  for (const auto& sl : slices) grads.push_back(sl.grads());
  return sum_of_squared_norms(grads);
}

double clip_coef(double norm, double max_norm) { return max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0; }

void clip_to(const std::vector<model::Param*>& params, double norm, double max_norm) {
  const double coef = clip_coef(norm, max_norm);
  if (coef == 1.0) return;
  at::NoGradGuard ng;
  for (auto* p : params)
    if (p->tensor.grad().defined()) p->tensor.mutable_grad().mul_(coef);
}

double clip_grad_norm(const std::vector<model::Param*>& params, double max_norm) {
  const double norm = std::sqrt(global_grad_norm_sq(params));
  clip_to(params, norm, max_norm);
  return norm;
}

double lr_at(const TrainConfig& t, int64_t step) {
  if (t.warmup > 0 && step < t.warmup) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup);
  int64_t decay_steps = (t.decay_steps > 0 ? t.decay_steps : t.steps) - t.warmup;
  if (decay_steps <= 0) return t.lr;
  double progress = static_cast<double>(step - t.warmup) / static_cast<double>(decay_steps);
  if (progress > 1) progress = 1;
  return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace alloy::train
