// Transformer and Layer: what LoRA adds (adapters beside the projections, a frozen and maybe
// quantized base, merged weights for export, the parameter names a LoRA slice holds).
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>

#include "alloy/model/lora.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/model/transformer.h"

namespace alloy::model {

void Layer::add_adapter(size_t w, int64_t rank, double scale, double dropout, const at::Tensor& init_a) {
  const at::Tensor W = params_[w].tensor;  // a handle: add() below may move params_
  const int64_t out = in_out_ ? W.size(1) : W.size(0);
  std::string stem = params_[w].name.substr(0, params_[w].name.size() - std::string(".weight").size());
  const size_t a = params_.size();
  // No weight decay: PEFT's trainers decay LoRA matrices only when asked, and decay towards zero
  // would pull the fine-tuned model back to the base.
  add(stem + ".lora_A.weight", init_a.to(W.dtype()).requires_grad_(true), false);
  add(stem + ".lora_B.weight", at::zeros({out, rank}, W.options().requires_grad(false)).requires_grad_(true), false);
  adapters_[w] = {a, a + 1, scale, dropout, stem};
}

void Layer::add_adapters(const std::map<std::string, at::Tensor>& init_a, int64_t rank, double scale, double dropout) {
  const size_t n = params_.size();
  for (size_t w = 0; w < n; ++w) {
    auto a = init_a.find(weight_module(params_[w].name));
    if (a != init_a.end()) add_adapter(w, rank, scale, dropout, a->second.to(params_[w].tensor.device()));
  }
}

at::Tensor Layer::adapter_delta(size_t w) const {
  auto it = adapters_.find(w);
  if (it == adapters_.end()) return {};
  at::NoGradGuard ng;
  at::Tensor d = at::mm(params_[it->second.b].tensor, params_[it->second.a].tensor) * it->second.scale;  // [out, in]
  return in_out_ ? d.t().contiguous() : d;
}

// A split projection's pieces quantized as the whole weight is on one device, so every layout
// fine-tunes the same base: the whole weight is put together (the group's pieces summed into it
// where a tensor-parallel group holds them between its members, who all reach this in the same
// order), quantized once, and each piece keeps its part of that (quantized_part).
void Transformer::quantize_pieces(Layer& layer, const std::string& base, const std::vector<Param*>& held, const LoraConfig& l) {
  at::NoGradGuard ng;
  const TpParam k = tp_param(base);
  const at::Tensor first = held.front()->tensor;
  std::vector<int64_t> shape(first.sizes().begin(), first.sizes().end());
  shape[static_cast<size_t>(k.dim)] = tp_extent(k, cfg_);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  // Each element's flat index in the whole weight, cut like the weights (int32 where it fits: this
  // lives beside the whole fp32 weight while the pieces are made).
  const bool narrow = numel <= std::numeric_limits<int32_t>::max();
  const at::Tensor index = at::arange(numel, first.options().dtype(narrow ? at::kInt : at::kLong)).view(shape);
  // One element past the weight flags a member that cannot cut its pieces (nf4 needs runs of 2
  // within the whole's blocks): the sum tells every member, so all fail here together instead of
  // one failing while the others wait in the next projection's sum.
  at::Tensor buffer = at::zeros({numel + 1}, first.options().dtype(at::kFloat));
  at::Tensor whole = buffer.narrow(0, 0, numel).view(shape);
  std::vector<at::Tensor> where;
  int64_t covered = 0;
  bool cuttable = true;
  for (Param* p : held) {
    std::string b;
    int64_t h0 = 0, h1 = 0;
    parse_piece(p->name, &b, &h0, &h1);
    where.push_back(tp_cut(index, k, h0, h1, cfg_));
    whole.view({-1}).index_copy_(0, where.back().reshape({-1}).to(at::kLong), p->tensor.to(at::kFloat).reshape({-1}));
    covered += p->tensor.numel();
    if (l.base_dtype == "nf4" && nf4_run(where.back(), kNf4Block) == 0) cuttable = false;
  }
  if (!cuttable) buffer.narrow(0, numel, 1).fill_(1.0);
  if (TpComm* comm = layer.tp_comm())
    comm->allreduce_sum(buffer);  // the members' pieces are disjoint and cover the weight
  else if (covered != numel)
    throw std::logic_error(base + ": a holder outside a tensor-parallel group holds only part of it");
  if (buffer[numel].item<double>() > 0)
    throw std::invalid_argument(base + ": " + (cuttable ? "another member of this tensor-parallel group" : "this rank") +
                                " cannot cut its piece from the nf4 quantization (a piece starting at an odd column, or an odd "
                                "number of columns wide): use a tp_split whose pieces start at even columns of every split "
                                "weight, or lora.base_dtype int8");
  const auto q = quantize(whole, l.base_dtype, layer.projection_in_out() ? 1 : 0, l.double_quant);
  for (size_t i = 0; i < held.size(); ++i) {
    held[i]->quant = quantized_part(*q, where[i]);
    held[i]->tensor = at::Tensor();
  }
}

void Transformer::apply_lora(const LoraConfig& l, uint64_t seed) {
  if (!l.enabled() || lora_) return;
  const auto modules = lora_modules(cfg_, l);  // validates the targets
  const double scale = l.scale();
  const auto& projs = adaptable_projections(cfg_.arch);
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& layer = *layers_[i];
    if (!layer.is_block()) continue;
    const int64_t pos = positions_[i];
    // Adapters draw from their own generator per layer position (the base's weights stay those of
    // the same seed without LoRA), every adapted projection of the whole block in the block's
    // order, whichever half this slice holds: a half gets exactly the whole block's adapters.
    at::Generator gen = at::detail::createCPUGenerator(layer_seed(seed ^ 0x4C6F5241ULL, pos));
    std::map<std::string, at::Tensor> init_a;
    for (const auto& module : modules) {
      const int64_t in = lora_in_features(cfg_, module, pos - 1);
      if (in <= 0) continue;  // another block's
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));  // kaiming_uniform_(a=sqrt(5)), as PEFT
      init_a[module] = at::empty({l.rank, in}, at::kFloat).uniform_(-bound, bound, gen).to(dtype_);
    }
    layer.add_adapters(init_a, l.rank, scale, l.dropout);
    std::map<std::string, std::vector<Param*>> pieces;  // a split projection's pieces by its whole name
    std::vector<std::string> split_order;
    for (auto& p : layer.params()) {
      if (is_adapter_name(p.name)) continue;
      p.frozen = true;
      p.tensor = p.tensor.detach().requires_grad_(false);
      std::string base = p.name;
      int64_t h0 = 0, h1 = 0;
      const bool piece = parse_piece(p.name, &base, &h0, &h1);
      bool projection = false;
      for (const auto& pr : projs) projection |= base.size() > pr.size() + 7 && base.find("." + pr + ".weight") != std::string::npos;
      if (!projection || l.base_dtype == "fp32") continue;
      if (piece) {
        if (!pieces.count(base)) split_order.push_back(base);
        pieces[base].push_back(&p);
        continue;
      }
      p.quant = quantize(p.tensor, l.base_dtype, layer.projection_in_out() ? 1 : 0, l.double_quant);
      p.tensor = at::Tensor();
    }
    for (const auto& base : split_order) quantize_pieces(layer, base, pieces[base], l);
  }
  for (auto& layer : layers_)
    if (!layer->is_block())
      for (auto& p : layer->params()) {
        p.frozen = true;
        p.tensor = p.tensor.detach().requires_grad_(false);
      }
  rebuild_uses();  // the blocks' Params grew
  lora_ = true;
}

std::vector<std::pair<std::string, at::Tensor>> Transformer::merged_weights() const {
  if (pieces_) throw std::invalid_argument("merged weights are made from a model without tensor-parallel pieces (load the checkpoint whole)");
  at::NoGradGuard ng;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& layer : layers_)
    for (size_t w = 0; w < layer->params().size(); ++w) {
      const Param& p = layer->params()[w];
      if (is_adapter_name(p.name)) continue;
      at::Tensor v = p.value().detach();
      at::Tensor d = layer->adapter_delta(w);
      out.emplace_back(p.name, d.defined() ? (v.to(at::kFloat) + d.to(at::kFloat)).to(dtype_) : v);
    }
  return out;
}

std::vector<std::string> param_names(const ModelConfig& m, const LoraConfig& l, LayerRange range, const TpLayout* tp) {
  auto names = param_names(m, range, tp);
  if (!l.enabled()) return names;
  const auto modules = lora_modules(m, l);
  const std::set<std::string> wanted(modules.begin(), modules.end());
  // Only who holds what matters to the callers, so each adapter simply follows its weight (after
  // its last piece), in the weight's pieces where tp_param splits the factor.
  std::vector<std::string> out;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // the current weight's pieces
  for (size_t i = 0; i < names.size(); ++i) {
    out.push_back(names[i]);
    std::string base = names[i], next;
    int64_t h0 = 0, h1 = 0;
    if (parse_piece(names[i], &base, &h0, &h1)) ranges.push_back({h0, h1});
    if (i + 1 < names.size()) {
      next = names[i + 1];
      parse_piece(names[i + 1], &next, &h0, &h1);
      if (next == base) continue;
    }
    const std::string module = weight_module(base);
    if (wanted.count(module))
      for (const char* f : {".lora_A.weight", ".lora_B.weight"}) {
        const std::string name = module + f;
        if (ranges.empty() || tp_param(name).kind == TpKind::None) {
          out.push_back(name);
        } else {
          for (const auto& [a, b] : ranges) out.push_back(piece_name(name, a, b));
        }
      }
    ranges.clear();
  }
  return out;
}

bool trains(const LoraConfig& l, const std::string& param_name) { return !l.enabled() || is_adapter_name(param_name); }

}  // namespace alloy::model
