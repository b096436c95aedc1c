#include "alloy/model/transformer.h"

#include <algorithm>
#include <stdexcept>

#include "alloy/model/deferred_weights.h"
#include "alloy/model/lora.h"
#include "alloy/model/recompute.h"
#include "alloy/model/tensor_parallel.h"

namespace alloy::model {

at::ScalarType dtype_of(const ModelConfig& m) { return m.dtype == "float64" ? at::kDouble : at::kFloat; }

uint64_t layer_seed(uint64_t seed, int64_t position) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(position + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

LayerRange LayerRange::for_blocks(int64_t block_begin, int64_t block_end, int64_t num_layers) {
  if (block_begin < 0 || block_end > num_layers || block_begin >= block_end)
    throw std::invalid_argument("invalid block range [" + std::to_string(block_begin) + ", " +
                                std::to_string(block_end) + ") of " + std::to_string(num_layers));
  return {block_begin == 0 ? 0 : block_begin + 1, block_end == num_layers ? num_layers + 2 : block_end + 1};
}

LayerRange LayerRange::for_units(int64_t unit_begin, int64_t unit_end, int64_t num_layers) {
  if (unit_begin < 0 || unit_end > 2 * num_layers || unit_begin >= unit_end)
    throw std::invalid_argument("invalid unit range [" + std::to_string(unit_begin) + ", " + std::to_string(unit_end) +
                                ") of " + std::to_string(2 * num_layers) + " half blocks");
  // The embedding joins the stage holding unit 0, the head the one holding the last unit.
  LayerRange r;
  r.begin = unit_begin == 0 ? 0 : unit_begin / 2 + 1;
  r.end = unit_end == 2 * num_layers ? num_layers + 2 : (unit_end + 1) / 2 + 1;
  r.first_block_mlp_only = unit_begin % 2 != 0;
  r.last_block_attn_only = unit_end % 2 != 0;
  return r;
}

at::Tensor& Layer::add(std::string name, at::Tensor t, bool decay) {
  params_.push_back({std::move(name), std::move(t), decay});
  return params_.back().tensor;
}

void Layer::split_vocab(size_t i, const TpLayout* tp, const ModelConfig& c) {
  vocab_idx_ = {i};
  if (!tp || !tp->splits_vocab()) return;
  const int64_t a = tp->vocab_end > 0 ? tp->vocab_begin : 0, b = tp->vocab_end > 0 ? tp->vocab_end : c.vocab_size;
  vocab_v0_ = a;
  vocab_comm_ = tp->vocab_end > 0 ? tp->comm : nullptr;
  const Param whole = params_[i];
  const TpParam k = tp_param(whole.name);
  std::vector<Param> pieces;
  const auto& bounds = tp->vocab_pieces;
  for (size_t j = 0; j + 1 < bounds.size(); ++j)
    if (bounds[j] >= a && bounds[j + 1] <= b)
      pieces.push_back({piece_name(whole.name, bounds[j], bounds[j + 1]), tp_cut(whole.tensor, k, bounds[j], bounds[j + 1], c), whole.decay});
  params_.erase(params_.begin() + static_cast<std::ptrdiff_t>(i));
  params_.insert(params_.begin() + static_cast<std::ptrdiff_t>(i), pieces.begin(), pieces.end());
  vocab_idx_.clear();
  for (size_t j = 0; j < pieces.size(); ++j) vocab_idx_.push_back(i + j);
}

at::Tensor Layer::vocab_logits(const at::Tensor& h, bool as_linear) const {
  const auto product = [&](const at::Tensor& rows) { return as_linear ? at::linear(h, rows) : at::matmul(h, rows.t()); };
  if (vocab_idx_.size() == 1) return product(params_[vocab_idx_[0]].tensor);
  // Piece by piece: the backward keeps the pieces, not a joined copy of the whole matrix.
  std::vector<at::Tensor> outs;
  for (size_t j : vocab_idx_) outs.push_back(product(params_[j].tensor));
  return at::cat(outs, -1);
}

at::Tensor Layer::vocab_rows() const {
  if (vocab_idx_.size() == 1) return params_[vocab_idx_[0]].tensor;
  std::vector<at::Tensor> ps;
  for (size_t j : vocab_idx_) ps.push_back(params_[j].tensor);
  return at::cat(ps, 0);
}

at::Tensor Param::value() const { return quant ? quant->dequantize() : tensor; }
int64_t Param::numel() const { return quant ? quant->numel() : tensor.numel(); }
int64_t Param::storage_bytes() const {
  return quant ? quant->bytes() : static_cast<int64_t>(tensor.numel() * static_cast<int64_t>(tensor.element_size()));
}

at::Tensor Layer::project(size_t w, const at::Tensor& x, const at::Tensor* bias) const {
  const Param& W = params_[w];
  at::Tensor y;
  if (W.quant) {
    y = quantized_matmul(x, W.quant, in_out_);
    if (bias) y = y + *bias;
  } else if (DeferredWeightGrads* d = DeferredWeightGrads::active();
             d && at::GradMode::is_enabled() && W.tensor.requires_grad() && x.requires_grad()) {
    y = d->project(x, W.tensor, bias, in_out_);  // the weight's gradient waits for the zb-h1 weight pass
  } else if (in_out_) {
    y = bias ? at::addmm(*bias, x, W.tensor) : at::mm(x, W.tensor);
  } else {
    y = bias ? at::linear(x, W.tensor, *bias) : at::linear(x, W.tensor);
  }
  auto it = adapters_.find(w);
  if (it == adapters_.end()) return y;
  const Adapter& a = it->second;
  const at::Tensor h = a.dropout > 0 ? lora_dropout(x, a.dropout, training_forward(), a.module, {}, 0) : x;
  return y + at::linear(at::linear(h, params_[a.a].tensor), params_[a.b].tensor) * a.scale;
}

void Transformer::rebuild_uses() {
  uses_.clear();
  for (auto& l : layers_) {
    uses_.emplace_back();
    for (auto& p : l->params()) uses_.back().push_back(&p);
  }
  if (tied_in_slice_)  // the tied head reads wte (its pieces)
    for (size_t j : layers_.front()->vocab_params()) uses_.back().push_back(&layers_.front()->params()[j]);
}

at::Tensor Transformer::forward(const at::Tensor& x) {
  if (chunks_.size() > 1) throw std::logic_error("a slice of several chunks runs each by itself (forward_units)");
  return run(x, range_);
}

at::Tensor Transformer::forward_units(const at::Tensor& x, int64_t unit_begin, int64_t unit_end) {
  std::string held;
  for (const LayerRange& c : chunks_) {
    const int64_t held_begin = c.unit_begin(), held_end = c.unit_end(cfg_.layers);
    if (unit_begin >= held_begin && unit_end <= held_end && unit_begin < unit_end)
      return run(x, LayerRange::for_units(unit_begin, unit_end, cfg_.layers));
    held += (held.empty() ? "[" : ", [") + std::to_string(held_begin) + ", " + std::to_string(held_end) + ")";
  }
  throw std::invalid_argument("units [" + std::to_string(unit_begin) + ", " + std::to_string(unit_end) + ") are not within this slice's " +
                              held);
}

size_t Transformer::index_of(int64_t pos) const {
  const auto it = std::lower_bound(positions_.begin(), positions_.end(), pos);
  if (it == positions_.end() || *it != pos) throw std::logic_error("layer position " + std::to_string(pos) + " is not in this slice");
  return static_cast<size_t>(it - positions_.begin());
}

at::Tensor Transformer::run(const at::Tensor& x, const LayerRange& want) {
  at::Tensor h = x;
  SeqSplit seq;
  if (sp_comm_) {
    seq = {sp_comm_, sequence_bounds(sp_heads_, x.size(1))};
    for (auto& l : layers_) l->set_seq(seq);
    // A stage's input and output are whole on every member (the first one sends for all).
    if (want.begin != 0) h = sp_split(h, seq);
  }
  for (int64_t pos = want.begin; pos < want.end; ++pos) {
    const size_t i = index_of(pos);
    Layer& l = *layers_[i];
    const bool attention = want.holds_attention(pos), mlp = want.holds_mlp(pos);
    if (hooks_) {
      hooks_->before_forward(i);
      h = backward_exit(h, hooks_, i);
    }
    if (recompute_ && l.is_block()) {
      h = forward_recomputed(l, h, attention, mlp);
    } else if (seq && l.is_block() && at::GradMode::is_enabled()) {
      auto g = c10::make_intrusive<SeqGathered>();
      g->seq = seq;
      l.record_gathered(g.get());
      h = l.forward_halves(h, attention, mlp);
      l.record_gathered(nullptr);
      h = regather_on_backward(h, g);
    } else {
      h = l.forward_halves(h, attention, mlp);
    }
    if (hooks_) {
      hooks_->after_forward(i);
      h = backward_entry(h, hooks_, i);
    }
  }
  if (seq && !want.has_head(cfg_)) h = sp_join(h, seq);
  return h;
}

at::Tensor Transformer::loss(const at::Tensor& logits, const at::Tensor& targets) const {
  const Layer* head = range_.has_head(cfg_) ? layers_.back().get() : nullptr;
  const Layer* rows = head && tied_in_slice_ ? layers_.front().get() : head;
  if (rows && rows->vocab_comm()) return vocab_parallel_loss_sum(logits, targets, rows->vocab_first_row(), rows->vocab_comm());
  return loss_sum(logits, targets);
}

at::Tensor Transformer::loss_sum(const at::Tensor& logits, const at::Tensor& targets) {
  int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}), targets.reshape({-1}), {}, at::Reduction::Sum, -100, 0.0);
}

std::vector<Param*> Transformer::parameters() {
  std::vector<Param*> out;
  for (auto& l : layers_)
    for (auto& p : l->params()) out.push_back(&p);
  return out;
}

std::vector<const Param*> Transformer::parameters() const {
  std::vector<const Param*> out;
  for (const auto& l : layers_)
    for (const auto& p : l->params()) out.push_back(&p);
  return out;
}

std::vector<std::string> param_names(const ModelConfig& m, LayerRange range, const TpLayout* tp) {
  std::vector<std::string> out;
  auto push = [&](int64_t block, const std::string& name) {
    if (tp && tp->splits_vocab() && tp_param(name).kind == TpKind::Vocab) {
      const auto& b = tp->vocab_pieces;
      const int64_t v0 = tp->vocab_end > 0 ? tp->vocab_begin : 0, v1 = tp->vocab_end > 0 ? tp->vocab_end : m.vocab_size;
      for (size_t j = 0; j + 1 < b.size(); ++j)
        if (b[j] >= v0 && b[j + 1] <= v1) out.push_back(piece_name(name, b[j], b[j + 1]));
      return;
    }
    const std::vector<int64_t> b = tp && block >= 0 ? tp_piece_bounds(*tp, block, tp_param(name)) : std::vector<int64_t>{};
    if (b.empty()) return out.push_back(name);
    const auto [h0, h1] = tp_held_heads(*tp, block, tp_param(name), m.heads);
    for (size_t j = 0; j + 1 < b.size(); ++j)
      if (b[j] >= h0 && b[j + 1] <= h1) out.push_back(piece_name(name, b[j], b[j + 1]));
  };
  const bool llama = m.arch == "llama";
  for (int64_t pos = range.begin; pos < range.end; ++pos) {
    if (pos == 0) {
      if (llama) {
        push(-1, "model.embed_tokens.weight");
      } else {
        push(-1, "wte.weight");
        out.push_back("wpe.weight");
      }
    } else if (pos == m.layers + 1) {
      if (llama) {
        out.push_back("model.norm.weight");
        push(-1, "lm_head.weight");
      } else {
        out.insert(out.end(), {"ln_f.weight", "ln_f.bias"});
        if (range.begin != 0) push(-1, "wte.weight");
      }
    } else {
      static const std::vector<const char*> llama_names = {
          "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight"};
      // LlamaBlock's order with m.qkv_bias: the biases end the attention half.
      static const std::vector<const char*> llama_bias_names = {
          "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
          "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"};
      static const std::vector<const char*> gpt2_names = {
          "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
          "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
      const auto& names = !llama ? gpt2_names : m.qkv_bias ? llama_bias_names : llama_names;
      const size_t attn_params = !llama ? 6 : m.qkv_bias ? 8 : 5;  // the attention half's names come first
      const std::string p = (llama ? "model.layers." : "h.") + std::to_string(pos - 1) + ".";
      // The sending side of a cut MLP leaves the output bias to the other (GPT-2's last name).
      const bool no_out_bias = !llama && tp && tp->cut_out.block == pos - 1;
      for (size_t k = range.holds_attention(pos) ? 0 : attn_params; k < (range.holds_mlp(pos) ? names.size() : attn_params); ++k)
        if (!(no_out_bias && k + 1 == names.size())) push(pos - 1, p + names[k]);
    }
  }
  return out;
}

Param* Transformer::find(const std::string& name) {
  for (auto* p : parameters())
    if (p->name == name) return p;
  return nullptr;
}

int64_t Transformer::num_parameters() const {
  int64_t n = 0;
  for (const auto* p : parameters()) n += p->numel();
  return n;
}

void Transformer::to(const at::Device& device) {
  // Tensors are replaced in place inside their Param, so the tied head's pointer stays valid.
  for (auto* p : parameters()) {
    if (p->quant) p->quant->to(device);
    if (p->tensor.defined()) p->tensor = p->tensor.detach().to(device).requires_grad_(!p->frozen);
  }
  device_ = device;
}

std::vector<Param*> Transformer::trainable() {
  std::vector<Param*> out;
  for (auto* p : parameters())
    if (!p->frozen) out.push_back(p);
  return out;
}

}  // namespace alloy::model
