#include "alloy/model/gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "alloy/core/gelu_loops.h"

namespace alloy::model {

namespace {

bool cpu_float(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

// Elements per task when the work is split across threads: every element's value is the same
// however it is split (gelu_loops.h), so this is about overhead only.
constexpr int64_t kGrain = int64_t(1) << 15;

at::Tensor forward_cpu(const at::Tensor& in) {
  const at::Tensor x = in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t lo, int64_t hi) { gelu_tanh_forward(xp + lo, yp + lo, hi - lo); });
  return y;
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& x) {
  const at::Tensor g = grad.contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  const float *xp = x.data_ptr<float>(), *gp = g.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t lo, int64_t hi) { gelu_tanh_backward(xp + lo, gp + lo, dp + lo, hi - lo); });
  return dx;
}

// Saves its input, as at::gelu's own backward does: the same activation memory.
struct GeluTanh : torch::autograd::Function<GeluTanh> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    const at::Tensor xc = x.contiguous();  // forward_cpu's own contiguous() is then a no-op
    ctx->save_for_backward({xc});
    return forward_cpu(xc);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    if (!cpu_float(grads[0])) return {at::gelu_backward(grads[0], x, "tanh")};
    return {backward_cpu(grads[0], x)};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!cpu_float(x) || x.is_sparse() || x.is_quantized()) return at::gelu(x, "tanh");
  if (x.requires_grad() && at::GradMode::is_enabled()) return GeluTanh::apply(x);
  return forward_cpu(x);
}

}  // namespace alloy::model
