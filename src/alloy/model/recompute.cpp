#include "alloy/model/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

#include "alloy/model/transformer.h"

namespace alloy::model {

namespace {

struct RecomputedBlock : torch::autograd::Function<RecomputedBlock> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, Layer* layer) {
    ctx->saved_data["layer"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(layer));
    ctx->save_for_backward({x});
    at::NoGradGuard no_graph;  // the block's intermediates are freed as soon as they are used
    return layer->forward(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* layer = reinterpret_cast<Layer*>(static_cast<intptr_t>(ctx->saved_data["layer"].toInt()));
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor out;
    {
      at::AutoGradMode with_graph(true);
      out = layer->forward(x);
    }
    // Accumulates into the block's parameters' .grad (their hooks fire as in a plain backward) and
    // into x.grad, which goes on to the layer before.
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor forward_recomputed(Layer& layer, const at::Tensor& x) {
  if (!at::GradMode::is_enabled()) return layer.forward(x);
  // The node exists only if an input needs a gradient; the parameters always do.
  return RecomputedBlock::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), &layer);
}

}  // namespace alloy::model
