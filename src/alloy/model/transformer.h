#pragma once
// The decoder-only transformer as an ordered list of layers
//   position 0: embedding, positions 1..L: blocks 0..L-1, position L+1: head (final norm + logits)
// so a pipeline stage is a contiguous slice of positions. Every layer draws its initial weights
// from its own generator seeded by (seed, position), so a slice gets exactly the weights the full
// model has, whichever process builds it.
//
// Parameters are plain tensors named with HuggingFace's names for the variant (gpt2: "h.3.attn.c_attn.weight",
// stored [in, out] like HF's Conv1D; llama: "model.layers.3.self_attn.q_proj.weight", stored
// [out, in]), so export/import and checkpoints need no renaming tables.
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/model/tensor_parallel.h"

namespace alloy::model {

struct QuantizedWeight;
struct TpLayout;
class TpComm;

struct Param {
  std::string name;  // HuggingFace name
  at::Tensor tensor;  // undefined while the weight lives quantized (QUANT)
  bool decay;        // AdamW weight decay applies (matrices, not biases or norms)
  bool frozen = false;  // LoRA's base: no gradient, no optimizer state, not synced
  // Held whole by every rank of a tensor-parallel group, but each rank's gradient is only its
  // heads' part (a LoRA factor beside a split projection): the sum over holders adds the parts,
  // where a norm's gradient, the same on every rank, counts once.
  bool tp_partial = false;
  std::shared_ptr<QuantizedWeight> quant;  // a frozen weight in int8 / nf4 storage (model/lora.h)

  // The weight's values: TENSOR, or QUANT dequantized.
  at::Tensor value() const;
  int64_t numel() const;
  int64_t storage_bytes() const;  // as held: quantized bytes for a quantized weight
};

// Elements [begin, begin + numel) of a parameter's flattened tensor; numel < 0: all of it. What a
// rank updates of a parameter whose optimizer state is sharded (dist/sharding.h).
struct ParamSlice {
  Param* p = nullptr;
  int64_t begin = 0, numel = -1;
  // ZeRO-3: the parameter is not resident between uses; the slice's elements and its reduced
  // gradient live in this rank's shard (flat views), not in P's tensor and .grad.
  at::Tensor value, grad;
  // T's elements of this slice: T itself without numel, else a flat view of the range.
  at::Tensor of(const at::Tensor& t) const { return numel < 0 ? t : t.reshape({-1}).narrow(0, begin, numel); }
  at::Tensor values() const { return value.defined() ? value : of(p->tensor); }  // updated in place
  at::Tensor grads() const {  // undefined when there is none
    if (grad.defined()) return grad;
    const at::Tensor& g = p->tensor.grad();
    return g.defined() ? of(g) : at::Tensor();
  }
};

// Called around each layer's forward and backward (ZeRO-3 gathers a layer's parameters before it
// runs and frees them after, dist/zero3.h). I is the layer's index in the slice. before_backward
// runs before any of the layer's backward, after_backward once its input's gradient is complete
// (never for a layer whose input needs none: the embedding).
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void before_forward(size_t i) = 0;
  virtual void after_forward(size_t i) = 0;
  virtual void before_backward(size_t i) = 0;
  virtual void after_backward(size_t i) = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;
  // Input: token ids [B, T] (embedding) or hidden states [B, T, H]; output: hidden states or
  // logits [B, T, V] (head).
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  // A block's attention and/or MLP half only (of those it holds); other layers ignore the flags.
  virtual at::Tensor forward_halves(const at::Tensor& x, bool attention, bool mlp) { return forward(x); }
  virtual bool is_block() const { return false; }  // a transformer block (recomputable), not embedding or head
  virtual TpComm* tp_comm() const { return nullptr; }  // a block's tensor-parallel group (null: none)
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  // LoRA: trainable A [R, in] and B [out, R] beside each projection weight whose module name
  // (the weight's name less ".weight") has an A in INIT_A (drawn for the whole block, whichever
  // half this layer holds), B zero. A tensor-parallel block's adapters follow its pieces.
  virtual void add_adapters(const std::map<std::string, at::Tensor>& init_a, int64_t rank, double scale, double dropout);
  // The adapter's update folded into W's values: (B A) or its transpose, times the scale; nullopt-like
  // undefined tensor when W has no adapter.
  at::Tensor adapter_delta(size_t w) const;
  bool projection_in_out() const { return in_out_; }
  // The vocabulary rows this layer holds of its embedding / output matrix (its pieces joined under
  // vocabulary parallelism), their first row, and the group that holds the others (null: none).
  at::Tensor vocab_rows() const;
  // H times those rows transposed (the logits of this layer's rows), piece by piece; AS_LINEAR:
  // through at::linear (LLaMA's head) rather than matmul (GPT-2's tied one).
  at::Tensor vocab_logits(const at::Tensor& h, bool as_linear) const;
  int64_t vocab_first_row() const { return vocab_v0_; }
  TpComm* vocab_comm() const { return vocab_comm_; }
  const std::vector<size_t>& vocab_params() const { return vocab_idx_; }
  // Sequence parallelism: how the group splits the positions of the batch now running (set by
  // the Transformer before each run; empty without it).
  void set_seq(const SeqSplit& s) { seq_ = s; }
  // Where a block records its gathered inputs during one forward (null: it does not).
  void record_gathered(SeqGathered* g) { gathered_ = g; }

 protected:
  at::Tensor& add(std::string name, at::Tensor t, bool decay);
  // X times projection weight params_[W] (+ BIAS): through its quantized storage and its LoRA
  // adapter where it has them, else exactly the plain product. W is [in, out] when the layer's
  // projections are stored so (GPT-2's Conv1D; X then 2-D), else [out, in] (nn.Linear).
  at::Tensor project(size_t w, const at::Tensor& x, const at::Tensor* bias = nullptr) const;
  std::vector<Param> params_;
  bool in_out_ = false;
  // Makes params_[I] (a vocabulary-row matrix) this layer's vocab_rows: in place, or replaced by
  // TP's pieces within this rank's rows (model/tensor_parallel.h).
  void split_vocab(size_t i, const TpLayout* tp, const ModelConfig& c);
  std::vector<size_t> vocab_idx_;
  int64_t vocab_v0_ = 0;
  TpComm* vocab_comm_ = nullptr;
  SeqSplit seq_;
  SeqGathered* gathered_ = nullptr;

 private:
  void add_adapter(size_t w, int64_t rank, double scale, double dropout, const at::Tensor& init_a);
  struct Adapter {
    size_t a, b;
    double scale, dropout;
    std::string module;  // "h.0.attn.c_attn": its dropout masks' key
  };
  std::map<size_t, Adapter> adapters_;
};

// A contiguous slice [begin, end) of layer positions, whose first and last blocks may be halves:
// a block splits between its attention half (norm, attention, residual add) and its MLP half
// (norm, MLP, residual add), the residual stream being the one tensor that crosses.
struct LayerRange {
  int64_t begin = 0, end = 0;
  bool first_block_mlp_only = false;   // the block at position BEGIN holds its MLP half only
  bool last_block_attn_only = false;   // the block at position END - 1 holds its attention half only
  static LayerRange full(const ModelConfig& m) { return {0, m.layers + 2}; }
  // Blocks [block_begin, block_end) as a pipeline stage counts them: the embedding joins the stage
  // that holds block 0 and the head the stage that holds the last block.
  static LayerRange for_blocks(int64_t block_begin, int64_t block_end, int64_t num_layers);
  // Half-block units [unit_begin, unit_end) of 2 * num_layers (unit 2b: block b's attention half,
  // 2b + 1: its MLP half), the embedding and head joining as above.
  static LayerRange for_units(int64_t unit_begin, int64_t unit_end, int64_t num_layers);
  // The half-block units this range holds (for_units' inverse).
  int64_t unit_begin() const { return begin == 0 ? 0 : 2 * (begin - 1) + (first_block_mlp_only ? 1 : 0); }
  int64_t unit_end(int64_t num_layers) const {
    return end == num_layers + 2 ? 2 * num_layers : 2 * (end - 1) - (last_block_attn_only ? 1 : 0);
  }
  // Which halves the block at position POS holds (both for an inner block).
  bool holds_attention(int64_t pos) const { return !(first_block_mlp_only && pos == begin); }
  bool holds_mlp(int64_t pos) const { return !(last_block_attn_only && pos == end - 1); }
  bool has_embedding() const { return begin == 0; }
  bool has_head(const ModelConfig& m) const { return end == m.layers + 2; }
};

struct SharedHolder;

class Transformer {
 public:
  // TP (not owned, read during construction; null: no tensor parallelism) splits the blocks it
  // names into pieces, of which this slice keeps its heads' (model/tensor_parallel.h).
  Transformer(const ModelConfig& cfg, LayerRange range, uint64_t seed, const TpLayout* tp = nullptr);
  // Several chunks of the model (an interleaved pipeline's rank: Plan's virtual stages), in layer
  // order, with gaps between them; each runs by itself through forward_units. Parameter names
  // are the whole model's, as for one range. No tensor parallelism.
  Transformer(const ModelConfig& cfg, const std::vector<LayerRange>& chunks, uint64_t seed);
  static std::unique_ptr<Transformer> full(const ModelConfig& cfg, uint64_t seed) {
    return std::make_unique<Transformer>(cfg, LayerRange::full(cfg), seed);
  }

  // The whole slice (one chunk; a slice of several throws std::logic_error).
  at::Tensor forward(const at::Tensor& x);
  // Units [UNIT_BEGIN, UNIT_END) of those this slice holds (within one of its chunks) (a floating pipeline boundary runs a
  // shared unit in some micro-batches only): the embedding when the range starts at unit 0, the
  // head when it reaches the model's end. Throws std::invalid_argument outside the slice.
  at::Tensor forward_units(const at::Tensor& x, int64_t unit_begin, int64_t unit_end);
  // LoRA (model/lora.h): adapters on the projections L targets (seeded per layer position from
  // SEED, so every slice gets the full model's adapters), every other parameter frozen, and the
  // blocks' projection weights stored as L.base_dtype. Call after the base weights are loaded.
  void apply_lora(const LoraConfig& l, uint64_t seed);
  bool has_lora() const { return lora_; }
  bool has_tp_pieces() const { return pieces_; }
  // Parameters that train (all of them without LoRA, the adapters with it).
  std::vector<Param*> trainable();
  // The base weights with every adapter folded in (name -> values), adapters left out: what
  // `alloy export --merge` writes.
  std::vector<std::pair<std::string, at::Tensor>> merged_weights() const;
  // Blocks recompute their activations in the backward instead of keeping them (model/recompute.h).
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }
  // HOOKS (not owned; null = none) see every layer's forward and backward from now on.
  void set_layer_hooks(LayerHooks* hooks) { hooks_ = hooks; }
  // Sum (not mean) of the token cross-entropies: callers divide by the tokens of the global batch
  // so micro-batches and replicas of any size add up to the one-device loss.
  static at::Tensor loss_sum(const at::Tensor& logits, const at::Tensor& targets);
  // The same for this slice's logits, which under vocabulary parallelism are its member's columns.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;

  // Unique parameters in layer order (a tied head contributes nothing when the embedding is in
  // the same slice).
  std::vector<Param*> parameters();
  std::vector<const Param*> parameters() const;
  Param* find(const std::string& name);
  int64_t num_parameters() const;

  void to(const at::Device& device);
  const ModelConfig& config() const { return cfg_; }
  // From the first chunk's start to the last one's end (the only chunk's range for most slices).
  LayerRange range() const { return range_; }
  const std::vector<LayerRange>& chunks() const { return chunks_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  size_t num_layers() const { return layers_.size(); }
  Layer& layer(size_t i) { return *layers_[i]; }
  // The parameters layer I reads: its own, and for a GPT-2 head tied to the embedding of the same
  // slice, the embedding's wte.
  const std::vector<Param*>& layer_params(size_t i) const { return uses_[i]; }

 private:
  void quantize_pieces(Layer& layer, const std::string& base, const std::vector<Param*>& held, const LoraConfig& l);
  ModelConfig cfg_;
  LayerRange range_;
  std::vector<LayerRange> chunks_;  // {range_} unless several
  std::vector<int64_t> positions_;  // layers_[i]'s layer position
  size_t index_of(int64_t pos) const;  // layers_' index of position POS (it must be held)
  void build(const TpLayout* tp, uint64_t seed);
  at::Device device_{at::kCPU};
  at::ScalarType dtype_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::shared_ptr<SharedHolder> shared_;  // causal mask and RoPE tables, cached per length
  bool recompute_ = false;
  bool lora_ = false;
  bool pieces_ = false;  // some parameters are tensor-parallel pieces
  bool tied_in_slice_ = false;  // a GPT-2 head reading the embedding's wte of the same slice
  // Sequence parallelism's group and head boundaries (model/tensor_parallel.h); null: off.
  TpComm* sp_comm_ = nullptr;
  std::vector<int64_t> sp_heads_;
  LayerHooks* hooks_ = nullptr;
  std::vector<std::vector<Param*>> uses_;
  void rebuild_uses();
  // The layers at WANT's positions (within this slice), each with WANT's halves.
  at::Tensor run(const at::Tensor& x, const LayerRange& want);
};

at::ScalarType dtype_of(const ModelConfig& m);
// The parameter names a slice holds, without building it (every rank needs every stage's names
// to know which ranks share which parameters).
std::vector<std::string> param_names(const ModelConfig& m, LayerRange range, const TpLayout* tp = nullptr);
// The same with LoRA's adapter parameters (each block's after its own), and those that train:
// every name without LoRA, the adapters with it.
std::vector<std::string> param_names(const ModelConfig& m, const LoraConfig& l, LayerRange range, const TpLayout* tp = nullptr);
bool trains(const LoraConfig& l, const std::string& param_name);
uint64_t layer_seed(uint64_t seed, int64_t position);

}  // namespace alloy::model
