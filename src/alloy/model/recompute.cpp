#include "alloy/model/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <mutex>

#include "alloy/model/lora.h"
#include "alloy/model/precision.h"
#include "alloy/model/transformer.h"

namespace alloy::model {

namespace {

thread_local bool t_recomputed_first_forward = false;

// The random stream of X's device, for forwards without dropout keys: the forward's state is kept
// so the recomputation draws the same masks, and the stream is put back after it, so a run with
// recomputation draws what one without does (torch.utils.checkpoint's preserve_rng_state).
at::Generator generator_of(const at::Tensor& x) { return at::globalContext().defaultGenerator(x.device()); }
at::Tensor rng_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
void set_rng_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

struct RecomputedBlock : torch::autograd::Function<RecomputedBlock> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, Layer* layer, bool attention, bool mlp) {
    ctx->saved_data["layer"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(layer));
    ctx->saved_data["attention"] = attention;
    ctx->saved_data["mlp"] = mlp;
    // The recomputation runs in the forward's precision (the backward runs outside autocast).
    ctx->saved_data["precision"] = autocast_precision(x.device());
    // And draws the forward's dropout masks: from the micro-batch's keys when it has them (every
    // training forward the executor runs), else from the generator's state as the forward found it.
    if (const DropoutKeys* k = DropoutScope::current()) {
      ctx->saved_data["keys_seed"] = static_cast<int64_t>(k->seed);
      ctx->saved_data["keys_step"] = k->step;
      ctx->saved_data["keys_samples"] = at::tensor(k->samples, at::kLong);
    } else {
      at::Generator g = generator_of(x);
      ctx->saved_data["rng"] = rng_state(g);
    }
    ctx->save_for_backward({x});
    at::NoGradGuard no_graph;  // the block's intermediates are freed as soon as they are used
    // Still training: its dropout draws the masks the recomputation will draw again.
    struct Training {
      bool before = t_recomputed_first_forward;
      Training() { t_recomputed_first_forward = true; }
      ~Training() { t_recomputed_first_forward = before; }
    } training;
    return layer->forward_halves(x, attention, mlp);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* layer = reinterpret_cast<Layer*>(static_cast<intptr_t>(ctx->saved_data["layer"].toInt()));
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor out;
    {
      DropoutKeys keys;
      const bool keyed = ctx->saved_data.count("keys_seed") != 0;
      if (keyed) {
        keys.seed = static_cast<uint64_t>(ctx->saved_data["keys_seed"].toInt());
        keys.step = ctx->saved_data["keys_step"].toInt();
        const at::Tensor s = ctx->saved_data["keys_samples"].toTensor();
        keys.samples.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
      }
      DropoutScope scope(keyed ? &keys : nullptr);  // as the forward: keyed or the generator's
      // Unkeyed: the forward's generator state for the recomputation, the stream put back after it.
      at::Generator g = generator_of(x);
      at::Tensor now;
      if (!keyed) {
        now = rng_state(g);
        set_rng_state(g, ctx->saved_data["rng"].toTensor());
      }
      struct PutBack {
        at::Generator& g;
        const at::Tensor& state;
        ~PutBack() {
          if (state.defined()) set_rng_state(g, state);
        }
      } put_back{g, now};
      at::AutoGradMode with_graph(true);
      AutocastScope amp(x.device(), ctx->saved_data["precision"].toStringRef());
      out = layer->forward_halves(x, ctx->saved_data["attention"].toBool(), ctx->saved_data["mlp"].toBool());
    }
    // Accumulates into the block's parameters' .grad (their hooks fire as in a plain backward) and
    // into x.grad, which goes on to the layer before.
    torch::autograd::backward({out}, {grads[0]});
    return {x.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The identity, with HOOKS->before_backward (ENTRY) or after_backward called in its backward.
struct HookedIdentity : torch::autograd::Function<HookedIdentity> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, LayerHooks* hooks, int64_t i,
                            bool entry) {
    ctx->saved_data["hooks"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(hooks));
    ctx->saved_data["i"] = i;
    ctx->saved_data["entry"] = entry;
    return x;  // returned unmodified: autograd makes it a view carrying this node
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* hooks = reinterpret_cast<LayerHooks*>(static_cast<intptr_t>(ctx->saved_data["hooks"].toInt()));
    const auto i = static_cast<size_t>(ctx->saved_data["i"].toInt());
    if (ctx->saved_data["entry"].toBool())
      hooks->before_backward(i);
    else
      hooks->after_backward(i);
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor hooked(const at::Tensor& x, LayerHooks* hooks, size_t i, bool entry) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return x;
  return HookedIdentity::apply(x, hooks, static_cast<int64_t>(i), entry);
}

}  // namespace

at::Tensor backward_entry(const at::Tensor& x, LayerHooks* hooks, size_t i) { return hooked(x, hooks, i, true); }
at::Tensor backward_exit(const at::Tensor& x, LayerHooks* hooks, size_t i) { return hooked(x, hooks, i, false); }

bool training_forward() { return at::GradMode::is_enabled() || t_recomputed_first_forward; }

at::Tensor forward_recomputed(Layer& layer, const at::Tensor& x, bool attention, bool mlp) {
  if (!at::GradMode::is_enabled()) return layer.forward_halves(x, attention, mlp);
  // The node exists only if an input needs a gradient; the parameters always do.
  return RecomputedBlock::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), &layer, attention, mlp);
}

namespace {
int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }
}  // namespace

int64_t release_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const auto n = static_cast<int64_t>(s->nbytes());
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
  return n;
}

int64_t restore_storage(const at::Tensor& t, const at::Tensor& values) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t n = static_cast<size_t>(bytes_of(t));
  if (s->nbytes() == 0) {
    c10::Allocator* a = s->allocator() ? s->allocator() : c10::GetAllocator(t.device().type());
    s->set_data_ptr_noswap(a->allocate(n));
    s->set_nbytes(n);
  }
  at::NoGradGuard ng;
  // variable_data(): the same storage under a version counter of its own.
  t.variable_data().reshape({-1}).copy_(values.reshape({-1}));
  return static_cast<int64_t>(n);
}

}  // namespace alloy::model
