#pragma once
// Activation recomputation of whole blocks (train.recompute, --recompute, a plan stage's
// `recompute`): the block's forward runs without keeping its intermediate tensors, only its input;
// the backward runs the forward again from that input with autograd on and back-propagates through
// it (the reentrant scheme of torch.utils.checkpoint). The recomputed forward is the same
// arithmetic on the same input, so gradients are those of the plain forward; what it costs is one
// more forward per block per micro-batch, what it saves is every block's activations but its input.
#include <ATen/ATen.h>

namespace alloy::model {

class Layer;
class LayerHooks;

// LAYER's forward of X, recomputed in the backward instead of stored. Without grad mode (or when
// nothing requires a gradient) it is the plain forward.
at::Tensor forward_recomputed(Layer& layer, const at::Tensor& x, bool attention = true, bool mlp = true);

// Whether a forward on this thread trains (LoRA's dropout draws masks): grad mode is on, or a
// recomputed block runs its first forward, without a graph but as training. Validation's forward
// (no grad mode) does not.
bool training_forward();

// Identities whose backward tells HOOKS about layer I (Transformer::set_layer_hooks): on a layer's
// output, before_backward(I) runs when the output's gradient arrives, before any of the layer's
// backward; on its input, after_backward(I) runs when the input's gradient is complete. The
// engine runs a layer's nodes (created after the input's node, so of higher sequence number, and
// its parameters' AccumulateGrad first of all) before the input's node. Without grad mode, or
// when X needs no gradient, X itself.
at::Tensor backward_entry(const at::Tensor& x, LayerHooks* hooks, size_t i);
at::Tensor backward_exit(const at::Tensor& x, LayerHooks* hooks, size_t i);

// T's storage released in place (T keeps its shape; reading it is an error until restored), and
// given back holding VALUES (T's elements, flat). In place, so every view and every reference the
// autograd graph saved sees the restored values, and without bumping T's version counter, so the
// graph does not take the restore for an in-place change. Returns the bytes released / taken.
// (ZeRO-3's parameters between uses; sequence parallelism's gathered block inputs.)
int64_t release_storage(const at::Tensor& t);
int64_t restore_storage(const at::Tensor& t, const at::Tensor& values);

}  // namespace alloy::model
