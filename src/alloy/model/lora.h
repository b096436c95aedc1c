#pragma once
// LoRA fine-tuning (config section `lora`): a projection W of the base model becomes
//   y = x W (+ b) + (alpha / r) * dropout(x) A^T B^T,   A [r, in], B [out, r]
// with W frozen and only A and B trained (Hu et al., 2021; PEFT's layout and initialisation: A
// Kaiming-uniform, B zero, so training starts from the base model's outputs exactly). The frozen
// W may be stored quantized and dequantized block by block on the fly in the forward and again in
// the backward (QLoRA, Dettmers et al., 2023): int8 with one absmax scale per output channel, or
// 4-bit NormalFloat with one absmax per block of 64 (optionally double-quantized scales).
//
// Adapters are parameters like any other: named "<projection>.lora_A.weight" beside the
// projection's "<projection>.weight", seeded per layer position, so every slice of a pipeline
// holds exactly the adapters the full model has, and every layout trains the same numbers. On
// disk they take PEFT's names ("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" for
// GPT-2, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" for LLaMA) in
// adapter_model.safetensors beside an adapter_config.json.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"

namespace alloy::model {

// The projections of one block that LoRA may adapt, as module names relative to the block
// ("attn.c_attn", "self_attn.q_proj", ...), in the block's parameter order.
const std::vector<std::string>& adaptable_projections(const std::string& arch);
// Whether MODULE (a projection's full module name, e.g. "h.3.attn.c_attn") matches one of
// PATTERNS: "all"; the module name itself or any dotted suffix of it ("c_attn", "attn.c_attn"); or
// a glob over those ("mlp.*", "*_proj").
bool lora_matches(const std::vector<std::string>& patterns, const std::string& module);
// The module names of the weights LoRA adapts in a model of M's shape under L. Throws InputError
// naming lora.targets when a pattern matches no projection (lists the projections there are).
std::vector<std::string> lora_modules(const ModelConfig& m, const LoraConfig& l);
bool is_adapter_name(const std::string& param_name);
// "a.b" for a weight "a.b.weight", else "": the module an adapter of that weight is keyed by.
std::string weight_module(const std::string& name);
// The input features of projection MODULE (a full module name, "h.3.mlp.c_proj") when it belongs
// to block BLOCK, else 0: A's width.
int64_t lora_in_features(const ModelConfig& m, const std::string& module, int64_t block);

// PEFT's tensor name for an adapter parameter of ours, and back ("" when NAME is not one).
std::string peft_name(const std::string& arch, const std::string& adapter_param);
std::string from_peft_name(const std::string& arch, const std::string& peft);
// adapter_config.json as PEFT writes it for these settings.
nlohmann::json peft_adapter_config(const ModelConfig& m, const LoraConfig& l, const std::string& base_model);

// A frozen weight in quantized storage.
struct QuantizedWeight {
  std::string kind;        // "int8" | "nf4"
  std::vector<int64_t> shape;
  int64_t channel_dim = 0;  // int8: the output channels' dimension (1 for GPT-2's [in, out] Conv1D)
  at::Tensor codes;        // int8: int8 [shape]; nf4: uint8, two codes per byte, flat
  at::Tensor scales;       // fp32 absmax per channel (int8) or per block of 64 (nf4, unless double quantized)
  // nf4 with double quantization: the block absmaxes as int8 in blocks of 256, each block's scale
  // (fp32) and the mean subtracted before quantizing.
  at::Tensor qscales, scale2;
  double scale_mean = 0;
  // nf4: elements per scale. A tensor-parallel piece cut from a whole weight's quantization
  // (quantized_part) may need fewer than kNf4Block where its rows cut across the whole's blocks.
  int64_t block = 64;

  int64_t numel() const;
  int64_t bytes() const;  // storage actually held
  at::Tensor dequantize(at::ScalarType dtype = at::kFloat) const;
  void to(const at::Device& d);
};

inline constexpr int64_t kNf4Block = 64;
inline constexpr int64_t kNf4ScaleBlock = 256;
// The 16 NormalFloat-4 levels (QLoRA): quantiles of N(0, 1) scaled to [-1, 1], with an exact 0.
const std::vector<float>& nf4_levels();
// W (fp32) quantized as KIND ("int8" | "nf4"); CHANNEL_DIM is the output-channel dimension (int8).
std::shared_ptr<QuantizedWeight> quantize(const at::Tensor& w, const std::string& kind, int64_t channel_dim, bool double_quant);
// The part of WHOLE at INDEX (int64, the part's shape: each element's flat index in WHOLE, e.g.
// tp_cut of an arange), in storage that dequantizes to exactly WHOLE's values there. So a
// tensor-parallel piece fine-tunes the same base whatever the layout: the whole weight is
// quantized once, as on one device, and each piece keeps its codes and its blocks' scales (nf4:
// as plain fp32 scales per run of elements that share a block of WHOLE, the longest run length
// that divides them all). Throws std::invalid_argument when no run length of 2 or more does.
std::shared_ptr<QuantizedWeight> quantized_part(const QuantizedWeight& whole, const at::Tensor& index);
// The run length quantized_part gives an nf4 part at INDEX of a whole quantized in blocks of BLOCK
// (the longest power of two, at most BLOCK, whose aligned runs of the part each lie in one block);
// 0 when there is none of 2 or more. It depends on the layout only, not on the values.
int64_t nf4_run(const at::Tensor& index, int64_t block);

// x W for a weight in quantized storage, with W dequantized in the forward and again in the
// backward (only the gradient of X flows). W_IN_OUT: W is [in, out] (GPT-2's Conv1D) rather than
// [out, in] (nn.Linear).
at::Tensor quantized_matmul(const at::Tensor& x, const std::shared_ptr<QuantizedWeight>& q, bool w_in_out);

// LoRA's dropout masks, keyed: a sample's mask over an adapter's input depends only on (seed,
// step, the sample's place in the global batch, the adapter's module name), never on which rank draws
// it or in what order. So a replica, a pipeline stage, a tensor-parallel member holding some of
// the input's columns, a recomputed block and a resumed run all draw the masks one device running
// the whole batch draws (a process-wide generator gave every replica the same stream, every
// tensor-parallel member a different one, and a resumed run the start's).
struct DropoutKeys {
  uint64_t seed = 0;
  int64_t step = 0;
  // The micro-batch's rows' places in the global batch (0 .. global batch - 1), in row order: the
  // same sample has the same place in every layout, and a sample drawn twice in one step (an
  // epoch boundary inside the batch) two places.
  std::vector<int64_t> samples;
};
// The keys of the micro-batch whose forward runs on this thread, for the scope's life (nests).
class DropoutScope {
 public:
  explicit DropoutScope(const DropoutKeys* keys);
  ~DropoutScope();
  DropoutScope(const DropoutScope&) = delete;
  DropoutScope& operator=(const DropoutScope&) = delete;
  static const DropoutKeys* current();

 private:
  const DropoutKeys* prev_;
};
// X [rows, ..., C] (rows: the scope's samples) with dropout P applied while training: row r's mask
// is the keyed mask of sample r over MODULE's whole input ([positions, C_FULL]) at the columns
// COLS (undefined: all C_FULL = C of them). Without a scope, at::dropout from the device's
// generator. TRAINING false: X itself.
at::Tensor lora_dropout(const at::Tensor& x, double p, bool training, const std::string& module, const at::Tensor& cols, int64_t c_full);

}  // namespace alloy::model
