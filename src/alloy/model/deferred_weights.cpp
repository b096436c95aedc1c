#include "alloy/model/deferred_weights.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <unordered_map>

namespace alloy::model {

namespace {

std::atomic<DeferredWeightGrads*> g_active{nullptr};
std::atomic<int64_t> g_mb{0};

// y = x W^T + b (IN_OUT: x W + b). The weight and bias come in as pointers, not tensor arguments,
// so the graph has no edge to them: their gradients come from the weight pass, not from this
// node's backward (an edge would reach their accumulators, and hooks, with nothing).
struct DeferredProjection : torch::autograd::Function<DeferredProjection> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor* Wp, const at::Tensor* bp,
                            DeferredWeightGrads* d, int64_t mb, bool in_out) {
    ctx->save_for_backward({x});
    ctx->saved_data["W"] = *Wp;
    if (bp) ctx->saved_data["b"] = *bp;
    const at::Tensor W_detached = Wp->detach(), b_detached = bp ? bp->detach() : at::Tensor();
    ctx->saved_data["d"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(d));
    ctx->saved_data["mb"] = mb;
    ctx->saved_data["in_out"] = in_out;
    const bool has_b = b_detached.defined();
    // A tensor-parallel piece's product may read [B, T, in] (transformer.cpp's pieces).
    if (in_out && x.dim() != 2) return has_b ? at::matmul(x, W_detached) + b_detached : at::matmul(x, W_detached);
    if (in_out) return has_b ? at::addmm(b_detached, x, W_detached) : at::mm(x, W_detached);
    return has_b ? at::linear(x, W_detached, b_detached) : at::linear(x, W_detached);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor W = ctx->saved_data["W"].toTensor();
    const at::Tensor& g = grads[0];
    const bool in_out = ctx->saved_data["in_out"].toBool();
    // Under autocast the product ran in g's precision; its input gradient does too (autograd
    // casts it back to x's type).
    const at::Tensor Wg = W.detach().to(g.scalar_type());
    at::Tensor dx;
    if (x.requires_grad()) dx = in_out ? at::matmul(g, Wg.t()) : at::matmul(g, Wg);
    auto* d = reinterpret_cast<DeferredWeightGrads*>(static_cast<intptr_t>(ctx->saved_data["d"].toInt()));
    auto bi = ctx->saved_data.find("b");
    at::Tensor b = bi != ctx->saved_data.end() ? bi->second.toTensor() : at::Tensor();
    d->add(ctx->saved_data["mb"].toInt(), {x.detach(), g.detach(), W, b, in_out});
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

DeferredWeightGrads::Scope::Scope(DeferredWeightGrads* d, int64_t mb) : prev_d_(g_active.load()), prev_mb_(g_mb.load()) {
  g_active.store(d);
  g_mb.store(mb);
}

DeferredWeightGrads::Scope::~Scope() {
  g_active.store(prev_d_);
  g_mb.store(prev_mb_);
}

DeferredWeightGrads* DeferredWeightGrads::active() { return g_active.load(); }

at::Tensor DeferredWeightGrads::project(const at::Tensor& x, const at::Tensor& W, const at::Tensor* bias, bool in_out) {
  return DeferredProjection::apply(x, &W, bias, this, g_mb.load(), in_out);
}

void DeferredWeightGrads::run(int64_t mb, bool final) {
  auto it = pending_.find(mb);
  if (it == pending_.end()) return;
  std::vector<Record> records = std::move(it->second);
  pending_.erase(it);
  // One gradient per parameter, summed over its records (a block run twice in a micro-batch).
  // Records come in backward order (the last layer's first), so a final pass hands each
  // parameter's gradient on as soon as its last record is done: the reducer's buckets of the late
  // layers can start while the early layers' products run, as in a plain backward.
  std::unordered_map<at::TensorImpl*, int> left;
  for (const Record& r : records) {
    ++left[r.W.unsafeGetTensorImpl()];
    if (r.b.defined()) ++left[r.b.unsafeGetTensorImpl()];
  }
  std::unordered_map<at::TensorImpl*, at::Tensor> sum;
  std::vector<at::Tensor> ready_params, ready_grads;
  auto put = [&](const at::Tensor& p, at::Tensor grad) {
    if (grad.scalar_type() != p.scalar_type()) grad = grad.to(p.scalar_type());
    at::TensorImpl* key = p.unsafeGetTensorImpl();
    auto s_it = sum.find(key);
    if (s_it != sum.end()) grad = s_it->second + grad;
    if (--left[key] > 0) {
      sum[key] = std::move(grad);
      return;
    }
    sum.erase(key);
    ready_params.push_back(p);
    ready_grads.push_back(std::move(grad));
  };
  auto hand_on = [&]() {
    if (ready_params.empty()) return;
    if (!final) {
      at::NoGradGuard ng;
      for (size_t i = 0; i < ready_params.size(); ++i) {
        at::Tensor& acc = ready_params[i].mutable_grad();
        if (acc.defined()) acc.add_(ready_grads[i]);
        else acc = std::move(ready_grads[i]);
      }
    } else {
      // Through autograd: a view's backward hands each gradient to the parameter's accumulator,
      // whose hooks see it before it is added to .grad, as in a plain backward.
      std::vector<at::Tensor> views;
      views.reserve(ready_params.size());
      for (const at::Tensor& p : ready_params) views.push_back(p.view_as(p));
      torch::autograd::backward(views, ready_grads);
    }
    ready_params.clear();
    ready_grads.clear();
  };
  for (Record& r : records) {
    {
      at::NoGradGuard ng;
      const at::Tensor g2 = r.g.reshape({-1, r.g.size(-1)});
      const at::Tensor x2 = r.x.to(r.g.scalar_type()).reshape({-1, r.x.size(-1)});
      put(r.W, r.in_out ? at::mm(x2.t(), g2) : at::mm(g2.t(), x2));
      if (r.b.defined()) put(r.b, g2.sum(0));
    }
    r = Record{};  // frees the record's tensors as it goes
    hand_on();
  }
}

}  // namespace alloy::model
