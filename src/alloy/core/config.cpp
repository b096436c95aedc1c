#include "alloy/core/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/parse.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"

namespace alloy {

int64_t ModelConfig::ffn_resolved() const {
  if (ffn > 0) return ffn;
  if (arch == "llama") {
    int64_t f = (8 * hidden) / 3;
    return ((f + 31) / 32) * 32;
  }
  return 4 * hidden;
}

namespace {

enum class Kind { Int, Float, String, Bool };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "integer";
    case Kind::Float: return "number";
    case Kind::String: return "string";
    case Kind::Bool: return "boolean";
  }
  return "?";
}

struct Field {
  std::string key;  // section.name
  Kind kind;
  std::string help;
  std::function<void(Config&, const std::string&)> set;  // from a validated scalar text
  std::function<std::string(const Config&)> get;
};

std::string fmt_double(double v) {
  std::ostringstream ss;
  ss.precision(17);
  ss << v;
  return ss.str();
}

#define ALLOY_INT(sec, name, help)                                                            \
  Field{#sec "." #name, Kind::Int, help,                                                      \
        [](Config& c, const std::string& s) { c.sec.name = std::stoll(s); },                  \
        [](const Config& c) { return std::to_string(c.sec.name); }}
#define ALLOY_FLOAT(sec, name, help)                                                          \
  Field{#sec "." #name, Kind::Float, help,                                                    \
        [](Config& c, const std::string& s) { c.sec.name = std::stod(s); },                   \
        [](const Config& c) { return fmt_double(c.sec.name); }}
#define ALLOY_STR(sec, name, help)                                                            \
  Field{#sec "." #name, Kind::String, help,                                                   \
        [](Config& c, const std::string& s) { c.sec.name = s; },                              \
        [](const Config& c) { return c.sec.name; }}
#define ALLOY_BOOL(sec, name, help)                                                           \
  Field{#sec "." #name, Kind::Bool, help,                                                     \
        [](Config& c, const std::string& s) { c.sec.name = (s == "true"); },                  \
        [](const Config& c) { return std::string(c.sec.name ? "true" : "false"); }}

const std::vector<Field>& schema() {
  static const std::vector<Field> fields = {
      ALLOY_STR(model, arch, "gpt2 | llama"),
      ALLOY_INT(model, layers, "transformer blocks"),
      ALLOY_INT(model, hidden, "model width"),
      ALLOY_INT(model, heads, "attention heads"),
      ALLOY_INT(model, kv_heads, "key/value heads for grouped-query attention (llama); 0 = heads"),
      ALLOY_INT(model, ffn, "MLP width; 0 = 4*hidden (gpt2) or 8/3*hidden rounded to 32 (llama)"),
      ALLOY_INT(model, seq_len, "tokens per sample (context length)"),
      ALLOY_INT(model, vocab_size, "vocabulary size; at least the tokenizer's"),
      ALLOY_FLOAT(model, norm_eps, "LayerNorm / RMSNorm epsilon"),
      ALLOY_FLOAT(model, rope_theta, "RoPE base (llama)"),
      ALLOY_FLOAT(model, init_std, "standard deviation of the initial weights"),
      ALLOY_STR(model, dtype, "float32 | float64"),
      ALLOY_BOOL(model, qkv_bias, "llama: biases on the query, key and value projections (Qwen2; Megatron's --add-qkv-bias)"),
      ALLOY_STR(data, prefix, "indexed dataset prefix (PREFIX.bin/.idx or PREFIX_train/_valid)"),
      ALLOY_STR(data, valid_prefix, "validation dataset prefix; empty = PREFIX_valid if present"),
      ALLOY_STR(data, tokenizer, "byte | gpt2 | sentencepiece (for data prepare, eval and generate)"),
      ALLOY_STR(data, tokenizer_model, "sentencepiece: the model file (Megatron's --tokenizer-model, LLaMA's tokenizer.model)"),
      ALLOY_BOOL(data, add_bos, "sentencepiece: start every text with the model's <s> (Megatron's Llama2Tokenizer does)"),
      ALLOY_STR(data, split, "Megatron's --split: train,validation[,test] weights (\"969,30,1\") cutting one dataset (PREFIX.bin/.idx) into "
                             "consecutive token ranges; empty = all of it trains (PREFIX_valid, when there, validates)"),
      ALLOY_STR(data, vocab_dir, "directory with encoder.json + vocab.bpe; empty = default"),
      ALLOY_INT(train, steps, "optimizer steps"),
      ALLOY_INT(train, global_batch, "samples per optimizer step"),
      ALLOY_INT(train, micro_batch, "samples per forward/backward; 0 = global_batch"),
      ALLOY_FLOAT(train, lr, "peak learning rate"),
      ALLOY_FLOAT(train, min_lr, "learning rate at the end of the cosine decay"),
      ALLOY_INT(train, warmup, "linear warmup steps"),
      ALLOY_INT(train, decay_steps, "the step where the cosine decay reaches min_lr, which then stays (Megatron's --lr-decay-iters); "
                                    "0 = train.steps"),
      ALLOY_FLOAT(train, weight_decay, "AdamW decoupled weight decay (matrices only)"),
      ALLOY_FLOAT(train, beta1, "AdamW beta1"),
      ALLOY_FLOAT(train, beta2, "AdamW beta2"),
      ALLOY_FLOAT(train, eps, "AdamW epsilon"),
      ALLOY_FLOAT(train, grad_clip, "global gradient-norm clip; 0 = off"),
      ALLOY_INT(train, seed, "seed for weights and data order"),
      ALLOY_INT(train, eval_interval, "steps between validation runs; 0 = only at the end"),
      ALLOY_INT(train, eval_batches, "global batches per validation run"),
      ALLOY_INT(train, checkpoint_interval, "steps between checkpoints; 0 = only at the end"),
      ALLOY_INT(train, keep_checkpoints, "keep the newest K checkpoints, delete older ones; 0 = keep all"),
      ALLOY_BOOL(train, async_checkpoint, "write checkpoints off the training thread: the step pays only for copying its "
                                          "tensors; the files, their checksums and the publication follow in the background"),
      ALLOY_INT(train, replan_step, "--plan auto: after this step, scale the profile by each device's measured compute, "
                                    "search again and switch plans if 5% faster (or rebalance the batch if 2%); again after as many "
                                    "steps, once, whether it switched or not; 0 = never"),
      ALLOY_BOOL(train, rebalance, "move samples of the global batch among data-parallel replicas (one stage each) as their "
                                   "measured speeds drift, each step, once the re-plans are done: the plan's cut at the speeds "
                                   "it was measured at, the slowest replica's predicted step 3% shorter or no change. The "
                                   "gradient is the same up to the order of its sums, which then varies from run to run"),
      ALLOY_INT(train, log_interval, "steps between log lines when not on a terminal"),
      ALLOY_INT(train, threads, "intra-op threads; 0 = all cores"),
      ALLOY_STR(train, device, "cpu | cuda | cuda:N"),
      ALLOY_STR(train, precision, "fp32 | bf16 | fp16: mixed precision (autocast) with fp32 weights, gradients and AdamW state "
                                  "(Megatron: --bf16, --fp16)"),
      ALLOY_STR(train, loss_scaling, "auto (dynamic with fp16, off otherwise) | dynamic | off: the loss is multiplied by a "
                                     "scale that halves when gradients overflow (the step is skipped) and doubles after "
                                     "train.loss_scale_window finite steps"),
      ALLOY_FLOAT(train, loss_scale_init, "dynamic loss scaling: the first scale (a power of two)"),
      ALLOY_INT(train, loss_scale_window, "dynamic loss scaling: finite steps in a row before the scale doubles"),
      ALLOY_INT(train, zero_stage, "sharded data parallelism (ZeRO) of every group of ranks holding the same layers: 0 = full "
                                   "replicas, 1 = optimizer state sharded, 2 = gradients too, 3 = parameters too, gathered per "
                                   "layer (DeepSpeed's levels)"),
      ALLOY_BOOL(train, recompute, "recompute every block's activations in the backward instead of keeping them "
                                   "(a plan's stage may ask for it alone: \"recompute\": true)"),
      ALLOY_BOOL(train, sequence_parallel, "tensor-parallel groups keep norms and the residual stream split by sequence "
                                           "position between their products (Megatron's sequence parallelism): each member "
                                           "stores its share of those activations; the sums become reduce-scatters and "
                                           "all-gathers"),
      ALLOY_STR(train, shard_ratio, "shares of each group's shards, in rank order (\"3,1\"; one per group member or one per "
                                    "rank); empty = even"),
      ALLOY_FLOAT(grad_sync, bucket_mb, "gradient buckets (and fixed fusion buffers), MiB of fp32 gradient"),
      ALLOY_STR(grad_sync, compression, "none (exact) | fp16 | bf16 | topk | randomk | dgc | gaussiank | redsync | sidco | oktopk | powersgd"),
      ALLOY_FLOAT(grad_sync, density, "sparsifiers: fraction of each tensor's elements sent, in (0, 1]"),
      ALLOY_STR(grad_sync, fusion, "tensor | bucket (SAFusion: wfbp) | omgs | cupcake | saf | saf-inter | saf-adaptive"),
      ALLOY_BOOL(grad_sync, error_feedback, "add what was not sent to the next step's gradient (SAFusion: --memory residual)"),
      ALLOY_INT(grad_sync, warmup_steps, "density warm-up steps after dense_steps: from 0.25 down to density, exponentially (DGC)"),
      ALLOY_INT(grad_sync, dense_steps, "lossy methods: exact sync for the first steps; sparsifiers then freeze Adam's "
                                        "second moment (1-bit Adam's recipe, see docs/DESIGN.md)"),
      ALLOY_INT(grad_sync, powersgd_rank, "powersgd: rank of the low-rank factors"),
      ALLOY_STR(grad_sync, scope, "all | slow-links: compress only between ranks joined by a slow link, exact elsewhere"),
      ALLOY_FLOAT(grad_sync, slow_link_gbps, "links below this are slow (scope slow-links, allreduce auto); 0 = below 1/4 of the "
                                             "fastest link"),
      ALLOY_STR(grad_sync, allreduce, "auto (exact sums of three or more holders go along a tree of their fast links where a "
                                      "ring would cross a slow one) | ring (Gloo's ring always)"),
      ALLOY_INT(grad_sync, tree_stripes, "tree sums (allreduce auto): at most this many trees, each summing its slice of every "
                                         "bucket over slow pairs of its own, side by side (1..4; 1 = one tree)"),
      ALLOY_FLOAT(grad_sync, dgc_momentum, "momentum correction's factor (local velocity); 0 = plain accumulation"),
      ALLOY_STR(grad_sync, momentum_correction, "auto (dgc only) | on (every sparsifier: a local velocity, as DGC's) | off"),
      ALLOY_STR(grad_sync, sidco_fit, "sidco: exponential | gamma | gpd"),
      ALLOY_INT(grad_sync, sidco_stages, "sidco: fitting stages (peaks over thresholds)"),
      ALLOY_BOOL(grad_sync, allow_lossy, "--plan auto may choose lossy compression (dgc) across slow links by itself"),
      ALLOY_STR(grad_sync, dtype, "fp32 | bf16 | fp16: the precision gradients are summed in on the wire (Megatron's "
                                  "--grad-reduce-in-bf16; the same as compression bf16 / fp16, which it sets)"),
      ALLOY_INT(lora, rank, "LoRA: rank of the adapters; 0 = off (full fine-tuning / pretraining)"),
      ALLOY_FLOAT(lora, alpha, "LoRA: the adapters' output is scaled by alpha / rank"),
      ALLOY_BOOL(lora, rslora, "LoRA: rank-stabilized scaling alpha / sqrt(rank) (PEFT's use_rslora), which keeps high ranks learning"),
      ALLOY_FLOAT(lora, dropout, "LoRA: dropout on the adapters' input while training"),
      ALLOY_STR(lora, targets, "LoRA: projections to adapt, comma-separated names or patterns (c_attn, attn.c_proj, "
                               "q_proj, mlp.*, all); empty = the attention projections"),
      ALLOY_STR(lora, base_dtype, "LoRA: storage of the frozen base's projections: fp32 | int8 (per-channel absmax) | "
                                  "nf4 (4-bit NormalFloat, blocks of 64)"),
      ALLOY_BOOL(lora, double_quant, "LoRA with nf4: quantize the blocks' scales too (QLoRA's double quantization)"),
      ALLOY_STR(output, dir, "run directory (metrics.jsonl, checkpoints/)"),
      ALLOY_BOOL(output, tensorboard, "also write TensorBoard event files"),
      ALLOY_STR(output, tensorboard_dir, "where the TensorBoard event files go; empty = DIR/tensorboard (Megatron: --tensorboard-dir)"),
  };
  return fields;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : schema())
    if (f.key == key) return &f;
  return nullptr;
}


std::string unknown_key_message(const std::string& key) {
  std::string best;
  size_t best_d = 4;
  for (const auto& f : schema()) {
    size_t d = edit_distance(key, f.key);
    if (d < best_d) best_d = d, best = f.key;
  }
  std::string msg = "unknown key '" + key + "'";
  if (!best.empty()) msg += " (did you mean '" + best + "'?)";
  return msg;
}

// Checks that TEXT is a valid scalar of the field's type and returns its canonical form.
std::string check_scalar(const Field& f, const std::string& text, const std::string& where) {
  auto bad = [&]() {
    return InputError(where, "key '" + f.key + "' must be a " + kind_name(f.kind) + ", got '" + text + "'");
  };
  switch (f.kind) {
    case Kind::Int: {
      const auto v = parse_int64(text);
      if (!v) throw bad();
      return std::to_string(*v);
    }
    case Kind::Float: {
      const auto v = parse_double(text);
      if (!v) throw bad();
      // JSON has no nan or inf: a checkpoint's state.json would hold null, and resuming fail.
      if (!std::isfinite(*v)) throw InputError(where, "key '" + f.key + "' must be a finite number, got '" + text + "'");
      return fmt_double(*v);
    }
    case Kind::Bool: {
      std::string t = text;
      std::transform(t.begin(), t.end(), t.begin(), ::tolower);
      if (t == "true" || t == "yes" || t == "on" || t == "1") return "true";
      if (t == "false" || t == "no" || t == "off" || t == "0") return "false";
      throw bad();
    }
    case Kind::String:
      // Strings end up in JSON (a checkpoint's state.json keeps the whole config), which must be
      // UTF-8: writing anything else throws, at the first checkpoint rather than here.
      if (!is_valid_utf8(text)) throw InputError(where, "key '" + f.key + "' must be UTF-8 text");
      return text;
  }
  return text;
}

void set_key(Config& c, const std::string& key, const std::string& text, const std::string& where) {
  const Field* f = find_field(key);
  if (!f) throw InputError(where, unknown_key_message(key));
  f->set(c, check_scalar(*f, text, where));
  if (key == "grad_sync.compression") c.grad_sync.compression = GradSyncConfig::canonical_method(c.grad_sync.compression);
  // Reduced-precision sync is the casting compression of that name (validate checks they agree).
  if (key == "grad_sync.dtype" && (c.grad_sync.dtype == "bf16" || c.grad_sync.dtype == "fp16") && c.grad_sync.compression == "none")
    c.grad_sync.compression = c.grad_sync.dtype;
  // SAFusion's name for its no-merging baseline: wait-free backprop's fixed buckets.
  if (key == "grad_sync.fusion" && c.grad_sync.fusion == "wfbp") c.grad_sync.fusion = "bucket";
  c.explicit_keys.insert(key);
}

void load_node(Config& c, const YAML::Node& root, const std::string& where) {
  if (!root || root.IsNull()) return;
  if (!root.IsMap()) throw InputError(where, "top level must be a mapping of sections (model, data, train, grad_sync, lora, output)");
  if (root["shard_plan"])
    throw InputError(where, "is a HeteroShard hetero_config.json, not an Alloy config: give it as --hetero-config " + where +
                                " beside a YAML config (-c) that names the model and the data");
  for (const auto& sec : root) {
    // A key that is itself a list or mapping ("[a]: 1", "? {a: 1}") has no name: as<std::string>()
    // would throw yaml-cpp's BadConversion.
    if (sec.first.IsSequence() || sec.first.IsMap())
      throw InputError(where + " (line " + std::to_string(sec.first.Mark().line + 1) + ")", "section names must be plain names");
    std::string section = sec.first.as<std::string>();
    if (section != "model" && section != "data" && section != "train" && section != "grad_sync" && section != "lora" &&
        section != "output")
      throw InputError(where, "unknown section '" + section + "' (expected model, data, train, grad_sync, lora, output)");
    if (sec.second.IsNull()) continue;
    if (!sec.second.IsMap()) throw InputError(where, "section '" + section + "' must be a mapping");
    for (const auto& kv : sec.second) {
      if (kv.first.IsSequence() || kv.first.IsMap())
        throw InputError(where + " (line " + std::to_string(kv.first.Mark().line + 1) + ")",
                         "keys in section '" + section + "' must be plain names");
      std::string key = section + "." + kv.first.as<std::string>();
      const std::string at = where + " (line " + std::to_string(kv.second.Mark().line + 1) + ")";
      // A list of names (lora.targets: [q_proj, v_proj], as PEFT's target_modules) is its
      // comma-separated text.
      const Field* f = find_field(key);
      if (f && f->kind == Kind::String && kv.second.IsSequence()) {
        std::string joined;
        for (const auto& item : kv.second) {
          if (!item.IsScalar()) throw InputError(at, "key '" + key + "' must be a list of names");
          joined += (joined.empty() ? "" : ",") + item.Scalar();
        }
        set_key(c, key, joined, at);
        continue;
      }
      if (!kv.second.IsScalar())
        throw InputError(where, "key '" + key + "' must be a single value, not a list or mapping");
      set_key(c, key, kv.second.Scalar(), at);
    }
  }
}

}  // namespace

Config Config::from_yaml_string(const std::string& yaml, const std::string& source,
                                const std::vector<std::string>& overrides) {
  Config c;
  c.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    throw InputError(source, std::string("not valid YAML: ") + e.what());
  }
  load_node(c, root, source);
  for (const auto& o : overrides) c.apply_override(o);
  c.validate();
  return c;
}

Config Config::load(const std::string& file, const std::vector<std::string>& overrides) {
  return from_yaml_string(read_file(file), file, overrides);
}

void Config::apply_override(const std::string& assignment) {
  auto eq = assignment.find('=');
  std::string where = "--set " + assignment;
  if (eq == std::string::npos) throw InputError(where, "expected section.key=value");
  std::string key = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  if (key.find('.') == std::string::npos) throw InputError(where, "expected section.key=value");
  set_key(*this, key, value, where);
}

void Config::validate() const {
  const std::string& w = source;
  auto fail = [&](const std::string& key, const std::string& msg) { throw InputError(w, "key '" + key + "': " + msg); };
  const auto& m = model;
  data.split_fractions();  // throws naming data.split
  if (m.arch != "gpt2" && m.arch != "llama") fail("model.arch", "must be gpt2 or llama, got '" + m.arch + "'");
  if (m.layers < 1) fail("model.layers", "must be >= 1");
  if (m.hidden < 1) fail("model.hidden", "must be >= 1");
  if (m.heads < 1) fail("model.heads", "must be >= 1");
  if (m.hidden % m.heads != 0)
    fail("model.heads", std::to_string(m.heads) + " does not divide model.hidden " + std::to_string(m.hidden));
  if (m.kv_heads < 0 || m.heads % m.kv_heads_resolved() != 0)
    fail("model.kv_heads", "must divide model.heads " + std::to_string(m.heads));
  if (m.arch == "gpt2" && m.kv_heads != 0 && m.kv_heads != m.heads)
    fail("model.kv_heads", "gpt2 has no grouped-query attention; leave it 0");
  if (m.arch == "llama" && m.head_dim() % 2 != 0) fail("model.hidden", "llama needs an even head dimension for RoPE");
  if (m.arch == "gpt2" && m.qkv_bias) fail("model.qkv_bias", "is for llama; gpt2's projections always have biases");
  if (m.ffn < 0) fail("model.ffn", "must be >= 0");
  if (m.seq_len < 1) fail("model.seq_len", "must be >= 1");
  if (m.vocab_size < 2) fail("model.vocab_size", "must be >= 2");
  if (!(m.norm_eps > 0)) fail("model.norm_eps", "must be > 0");
  if (m.dtype != "float32" && m.dtype != "float64") fail("model.dtype", "must be float32 or float64");
  if (data.tokenizer != "byte" && data.tokenizer != "gpt2" && data.tokenizer != "sentencepiece")
    fail("data.tokenizer", "must be byte, gpt2 or sentencepiece");
  if (data.add_bos && data.tokenizer != "sentencepiece") fail("data.add_bos", "applies to the sentencepiece tokenizer only");
  if (data.tokenizer == "sentencepiece" && data.tokenizer_model.empty())
    fail("data.tokenizer_model", "the sentencepiece tokenizer needs its model file (LLaMA's tokenizer.model)");
  const auto& t = train;
  if (t.steps < 0) fail("train.steps", "must be >= 0");
  if (t.global_batch < 1) fail("train.global_batch", "must be >= 1");
  if (t.micro_batch < 0) fail("train.micro_batch", "must be >= 0");
  if (t.global_batch % t.micro_batch_resolved() != 0)
    fail("train.micro_batch", std::to_string(t.micro_batch) + " does not divide train.global_batch " +
                                  std::to_string(t.global_batch));
  if (!(t.lr >= 0)) fail("train.lr", "must be >= 0");
  if (t.min_lr < 0 || t.min_lr > t.lr) fail("train.min_lr", "must be between 0 and train.lr");
  if (t.warmup < 0) fail("train.warmup", "must be >= 0");
  if (t.decay_steps < 0 || (t.decay_steps > 0 && t.decay_steps <= t.warmup))
    fail("train.decay_steps", "must be 0 (train.steps) or more than train.warmup (" + std::to_string(t.warmup) + "), got " +
                                  std::to_string(t.decay_steps));
  if (t.beta1 < 0 || t.beta1 >= 1) fail("train.beta1", "must be in [0, 1)");
  if (t.beta2 < 0 || t.beta2 >= 1) fail("train.beta2", "must be in [0, 1)");
  if (!(t.eps > 0)) fail("train.eps", "must be > 0");
  if (t.grad_clip < 0) fail("train.grad_clip", "must be >= 0");
  if (t.eval_interval < 0) fail("train.eval_interval", "must be >= 0");
  if (t.eval_batches < 0) fail("train.eval_batches", "must be >= 0");
  if (t.checkpoint_interval < 0) fail("train.checkpoint_interval", "must be >= 0");
  if (t.keep_checkpoints < 0) fail("train.keep_checkpoints", "must be >= 0 (0 = keep all)");
  if (t.replan_step < 0) fail("train.replan_step", "must be >= 0");
  if (t.log_interval < 1) fail("train.log_interval", "must be >= 1");
  if (t.threads < 0) fail("train.threads", "must be >= 0");
  if (t.device != "cpu" && t.device.rfind("cuda", 0) != 0) fail("train.device", "must be cpu, cuda or cuda:N");
  if (t.precision != "fp32" && t.precision != "bf16" && t.precision != "fp16")
    fail("train.precision", "unknown value '" + t.precision + "'; allowed: fp32, bf16, fp16");
  if (t.precision != "fp32" && m.dtype != "float32") fail("train.precision", t.precision + " mixed precision needs model.dtype float32");
  if (t.loss_scaling != "auto" && t.loss_scaling != "dynamic" && t.loss_scaling != "off")
    fail("train.loss_scaling", "unknown value '" + t.loss_scaling + "'; allowed: auto, dynamic, off");
  if (!(t.loss_scale_init >= 1) || std::isinf(t.loss_scale_init) || std::exp2(std::round(std::log2(t.loss_scale_init))) != t.loss_scale_init)
    fail("train.loss_scale_init", "must be a power of two >= 1 (scaling by it is then exact)");
  if (t.loss_scale_window < 1) fail("train.loss_scale_window", "must be >= 1");
  if (t.zero_stage < 0 || t.zero_stage > 3) fail("train.zero_stage", "must be 0, 1, 2 or 3, got " + std::to_string(t.zero_stage));
  (void)t.shard_shares();
  grad_sync.validate(w, "grad_sync");
  if (lora.rank < 0) fail("lora.rank", "must be >= 0 (0 = off)");
  if (lora.enabled()) {
    if (!(lora.alpha > 0)) fail("lora.alpha", "must be > 0");
    if (!(lora.dropout >= 0 && lora.dropout < 1)) fail("lora.dropout", "must be in [0, 1)");
    if (m.dtype != "float32") fail("lora.rank", "LoRA is built for model.dtype float32");
  }
  if (lora.base_dtype != "fp32" && lora.base_dtype != "int8" && lora.base_dtype != "nf4")
    fail("lora.base_dtype", "unknown value '" + lora.base_dtype + "'; allowed: fp32, int8, nf4");
  if (lora.base_dtype != "fp32" && !lora.enabled())
    fail("lora.base_dtype", "a quantized base is frozen, so it needs LoRA adapters to train (set lora.rank)");
  if (lora.double_quant && lora.base_dtype != "nf4") fail("lora.double_quant", "applies to lora.base_dtype nf4 only");
  if (output.dir.empty()) fail("output.dir", "must not be empty");
}

double LoraConfig::scale() const {
  if (rank <= 0) return 0;
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

std::vector<std::string> LoraConfig::target_list(const std::string& arch) const {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : targets + ",") {
    if (ch == ',' || ch == ' ') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (out.empty()) {
    if (arch == "llama") return {"q_proj", "k_proj", "v_proj", "o_proj"};
    return {"attn.c_attn", "attn.c_proj"};
  }
  return out;
}

std::vector<double> TrainConfig::shard_shares() const {
  std::string t = shard_ratio;
  for (char& c : t)
    if (c == ',' || c == ':') c = ' ';
  std::istringstream in(t);
  std::vector<double> out;
  std::string tok;
  while (in >> tok) {
    const auto v = parse_double(tok);
    if (!v || !(*v > 0) || !std::isfinite(*v))
      throw InputError("train.shard_ratio", "'" + tok + "' is not a positive number (shares like 3,1 or 3:1)");
    out.push_back(*v);
  }
  return out;
}

const std::vector<std::string>& GradSyncConfig::compression_methods() {
  static const std::vector<std::string> m = {"none", "fp16", "bf16", "topk", "randomk", "dgc",
                                             "gaussiank", "redsync", "sidco", "oktopk", "powersgd"};
  return m;
}

const std::vector<std::string>& GradSyncConfig::fusion_strategies() {
  static const std::vector<std::string> f = {"tensor", "bucket", "omgs", "cupcake", "saf", "saf-inter", "saf-adaptive"};
  return f;
}

std::string GradSyncConfig::canonical_method(const std::string& name) {
  if (name == "gaussian") return "gaussiank";
  if (name == "eftopk" || name == "topkef") return "topk";
  if (name == "exp") return "sidco";
  return name;
}

void GradSyncConfig::validate(const std::string& where, const std::string& prefix) const {
  auto fail = [&](const std::string& key, const std::string& msg) {
    throw InputError(where, "key '" + prefix + "." + key + "': " + msg);
  };
  auto one_of = [&](const std::string& key, const std::string& v, const std::vector<std::string>& allowed) {
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    std::string best;
    size_t best_d = 3;
    for (const auto& a : allowed) {
      size_t d = edit_distance(v, a);
      if (d < best_d) best_d = d, best = a;
    }
    fail(key, "unknown value '" + v + "'" + (best.empty() ? "" : " (did you mean '" + best + "'?)") + "; allowed: " + list);
  };
  if (!(bucket_mb > 0)) fail("bucket_mb", "must be > 0");
  one_of("compression", compression, compression_methods());
  if (!(density > 0 && density <= 1)) fail("density", "must be in (0, 1], got " + fmt_double(density));
  one_of("fusion", fusion, fusion_strategies());
  if (warmup_steps < 0) fail("warmup_steps", "must be >= 0");
  if (dense_steps < 0) fail("dense_steps", "must be >= 0");
  if (linear_adam() && dense_steps < 1)
    fail("dense_steps", "must be >= 1 with a sparsifier below density 1: Adam's second moment is measured on exact steps, then frozen");
  if (powersgd_rank < 1) fail("powersgd_rank", "must be >= 1, got " + std::to_string(powersgd_rank));
  one_of("scope", scope, {"all", "slow-links"});
  one_of("allreduce", allreduce, {"auto", "ring"});
  if (tree_stripes < 1 || tree_stripes > 4) fail("tree_stripes", "must be in 1..4, got " + std::to_string(tree_stripes));
  if (!(slow_link_gbps >= 0)) fail("slow_link_gbps", "must be >= 0");
  if (!(dgc_momentum >= 0 && dgc_momentum < 1)) fail("dgc_momentum", "must be in [0, 1)");
  one_of("momentum_correction", momentum_correction, {"auto", "on", "off"});
  one_of("sidco_fit", sidco_fit, {"exponential", "gamma", "gpd"});
  if (sidco_stages < 1 || sidco_stages > 8) fail("sidco_stages", "must be in 1..8");
  one_of("dtype", dtype, {"fp32", "bf16", "fp16"});
  if (dtype != "fp32" && compression != dtype)
    fail("dtype", dtype + " sums exact sync's gradients in " + dtype + " (compression " + dtype + "), but compression is " +
                      compression + ": set one of the two");
}

nlohmann::json Config::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : schema()) {
    auto dot = f.key.find('.');
    std::string sec = f.key.substr(0, dot), name = f.key.substr(dot + 1);
    std::string v = f.get(*this);
    switch (f.kind) {
      case Kind::Int: j[sec][name] = std::stoll(v); break;
      case Kind::Float: j[sec][name] = std::stod(v); break;
      case Kind::Bool: j[sec][name] = (v == "true"); break;
      case Kind::String: j[sec][name] = v; break;
    }
  }
  return j;
}

Config Config::from_json(const nlohmann::json& j, const std::string& source) {
  // JSON is a subset of YAML, so one loader serves both.
  return from_yaml_string(j.dump(), source);
}

namespace {

// A double-quoted YAML scalar that reads back as S: quotes and backslashes escaped, and control
// characters too (a line break inside quotes would be folded into a space).
std::string yaml_quoted(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

}  // namespace

std::string Config::to_yaml() const {
  std::ostringstream out;
  std::string current;
  for (const auto& f : schema()) {
    auto dot = f.key.find('.');
    std::string sec = f.key.substr(0, dot), name = f.key.substr(dot + 1);
    if (sec != current) out << sec << ":\n", current = sec;
    std::string v = f.get(*this);
    if (f.kind == Kind::String) v = yaml_quoted(v);
    out << "  " << name << ": " << v << "\n";
  }
  return out.str();
}

nlohmann::json model_to_json(const ModelConfig& m) {
  Config c;
  c.model = m;
  return c.to_json()["model"];
}

std::vector<std::string> model_differences(const ModelConfig& a_in, const ModelConfig& b_in) {
  // Compare what the models are, not how they were written: ffn 0 means 4*hidden for gpt2.
  auto resolved = [](ModelConfig m) {
    m.ffn = m.ffn_resolved();
    m.kv_heads = m.kv_heads_resolved();
    return m;
  };
  auto ja = model_to_json(resolved(a_in)), jb = model_to_json(resolved(b_in));
  std::vector<std::string> out;
  for (auto it = ja.begin(); it != ja.end(); ++it)
    if (jb[it.key()] != it.value()) out.push_back("model." + it.key() + ": " + it.value().dump() + " vs " + jb[it.key()].dump());
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::pair<double, double> DataConfig::split_fractions() const {
  if (split.empty()) return {1.0, 0.0};
  std::vector<double> w;
  size_t pos = 0;
  while (pos <= split.size()) {
    size_t end = split.find_first_of(",/", pos);
    if (end == std::string::npos) end = split.size();
    const auto v = parse_double(split.substr(pos, end - pos));
    if (!v || !(*v >= 0) || !std::isfinite(*v))
      throw InputError("data.split", "'" + split + "': weights must be non-negative numbers like 969,30,1");
    w.push_back(*v);
    pos = end + 1;
  }
  if (w.size() > 3) throw InputError("data.split", "'" + split + "': at most three weights (train, validation, test)");
  double total = 0;
  for (double v : w) total += v;
  if (!(total > 0) || !(w[0] > 0)) throw InputError("data.split", "'" + split + "': the training weight must be above 0");
  return {w[0] / total, w.size() > 1 ? w[1] / total : 0.0};
}

std::string config_reference() {
  Config defaults;
  std::ostringstream out;
  for (const auto& f : schema()) {
    std::string d = f.get(defaults);
    out << "  " << f.key;
    for (size_t i = f.key.size(); i < 26; ++i) out << ' ';
    out << ' ' << f.help << "  [" << kind_name(f.kind) << ", default " << (d.empty() ? "\"\"" : d) << "]\n";
  }
  return out.str();
}

}  // namespace alloy
