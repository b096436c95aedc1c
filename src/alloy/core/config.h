#pragma once
// The run configuration: YAML sections model/data/train/grad_sync/lora/output, overridable key by key with
// `--set section.key=value`. Every key has a type, a default and a help line in one schema table
// (config.cpp), so unknown, misspelled and ill-typed keys are caught before anything runs.
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace alloy {

struct ModelConfig {
  std::string arch = "gpt2";  // gpt2 | llama
  int64_t layers = 4;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t kv_heads = 0;    // llama grouped-query attention; 0 = heads
  int64_t ffn = 0;         // MLP width; 0 = 4*hidden (gpt2) or the LLaMA 8/3 rule rounded to 32
  int64_t seq_len = 128;
  int64_t vocab_size = 257;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double init_std = 0.02;
  std::string dtype = "float32";  // float32 | float64
  // llama: biases on the query, key and value projections (Qwen2's blocks; Megatron's
  // --add-qkv-bias). Zero at the start, not decayed.
  bool qkv_bias = false;

  int64_t kv_heads_resolved() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t ffn_resolved() const;
  int64_t head_dim() const { return hidden / heads; }
  bool tied_head() const { return arch == "gpt2"; }
};

struct DataConfig {
  std::string prefix;        // PREFIX.{bin,idx}, or PREFIX_train/PREFIX_valid as written by `alloy data prepare`
  std::string valid_prefix;  // optional explicit validation set
  std::string tokenizer = "byte";
  std::string vocab_dir;     // gpt2 vocabulary (encoder.json + vocab.bpe); empty = default
  std::string tokenizer_model;  // sentencepiece: the model file (LLaMA's tokenizer.model)
  bool add_bos = false;         // sentencepiece: every text starts with <s> (Megatron's Llama2Tokenizer)
  // Megatron's --split "969,30,1": train / validation (/ test) weights carving one dataset (a plain
  // PREFIX.bin/.idx) into consecutive token ranges; empty = the whole of it trains.
  std::string split;
  // The train and validation fractions SPLIT gives (the test share is left unused); {1, 0} when empty.
  std::pair<double, double> split_fractions() const;
};

struct TrainConfig {
  int64_t steps = 100;
  int64_t global_batch = 8;
  int64_t micro_batch = 0;  // 0 = the whole global batch at once (no accumulation)
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup = 10;
  int64_t decay_steps = 0;  // the cosine reaches min_lr here and stays (Megatron's --lr-decay-iters); 0 = steps
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0 = no clipping
  int64_t seed = 1234;
  int64_t eval_interval = 50;
  int64_t eval_batches = 4;
  int64_t checkpoint_interval = 0;  // 0 = only at the end
  int64_t keep_checkpoints = 0;     // the newest K step directories are kept; 0 = all
  bool async_checkpoint = true;     // write checkpoint files off the training thread
  int64_t replan_step = 6;  // --plan auto: re-plan from the speeds measured up to this step; 0 = never
  bool rebalance = false;   // data-parallel replicas' shares of the batch follow their measured speeds each step
  int64_t log_interval = 1;
  int64_t threads = 0;  // 0 = all cores (or what `alloy launch` assigns)
  std::string device = "cpu";  // cpu | cuda | cuda:N
  // Mixed precision: the forward's matrix products (and what autocast puts beside them) in bf16
  // or fp16, weights, gradients and AdamW state in fp32.
  std::string precision = "fp32";     // fp32 | bf16 | fp16
  std::string loss_scaling = "auto";  // auto (dynamic with fp16, off otherwise) | dynamic | off
  double loss_scale_init = 65536.0;   // dynamic loss scaling's first scale (a power of two)
  int64_t loss_scale_window = 2000;   // finite steps in a row after which the scale doubles
  int64_t zero_stage = 0;       // sharded data parallelism per holder set (dist/sharding.h): 0 | 1 | 2
  std::string shard_ratio;      // shares of each holder set's shards ("3,1"); empty = even
  bool recompute = false;       // every stage recomputes its blocks' activations in the backward
  bool sequence_parallel = false;  // tensor-parallel groups split norms and the residual stream by position

  int64_t micro_batch_resolved() const { return micro_batch > 0 ? micro_batch : global_batch; }
  // shard_ratio's numbers ("3,1", "3 1" or "3:1"); throws InputError naming train.shard_ratio.
  std::vector<double> shard_shares() const;
};

// Gradient sync: how the gradients of the parameters several ranks hold are summed. The default is
// exact (dense fp32 SUM all-reduce in buckets); everything else is lossy and opt-in. The same
// struct is the `grad_sync` section of a config and of a Plan (the plan's is what runs).
struct GradSyncConfig {
  double bucket_mb = 25.0;              // dense buckets and fixed fusion buffers, MiB of fp32 gradient
  std::string compression = "none";     // see compression_methods()
  double density = 0.01;                // sparsifiers: fraction of elements sent per tensor
  std::string fusion = "saf-adaptive";  // see fusion_strategies()
  bool error_feedback = true;           // keep what was not sent and add it to the next step's gradient
  int64_t warmup_steps = 80;            // density warm-up after dense_steps: exponential from 0.25 down to density
  int64_t dense_steps = 20;             // lossy methods: exact sync for the first steps (Adam's warm-up)
  int64_t powersgd_rank = 4;
  std::string scope = "all";            // all | slow-links (compress only between ranks joined by a slow link)
  double slow_link_gbps = 0;            // a link is slow below this; 0 = below 1/4 of the fastest inter-host link
  double dgc_momentum = 0.9;            // momentum correction's factor (local velocity); 0 = plain accumulation
  std::string momentum_correction = "auto";  // auto (dgc only) | on (every sparsifier) | off
  std::string sidco_fit = "exponential";  // exponential | gamma | gpd
  int64_t sidco_stages = 2;
  bool allow_lossy = false;             // --plan auto may choose lossy compression by itself
  // The precision exact sync moves gradients in: fp32, or bf16 / fp16, which are the casting
  // compressions of the same names (set_key makes compression follow it; validate checks they agree).
  std::string dtype = "fp32";
  // How exact sync sums a holder set: auto = along a tree of its fast links where a ring of three or
  // more members would cross a slow link (core/sync_tree.h), Gloo's ring elsewhere; ring = always.
  std::string allreduce = "auto";
  // A tree sum's stripes: up to this many trees, each summing its own slice of every bucket at once
  // over slow pairs no other stripe takes (core/sync_tree.h, sync_trees), so two regions joined by
  // several slow lines use them side by side. 1 = one tree.
  int64_t tree_stripes = 4;

  bool lossy() const { return compression != "none"; }
  static bool sparse_method(const std::string& m) {
    return m == "topk" || m == "randomk" || m == "dgc" || m == "gaussiank" || m == "redsync" || m == "sidco" || m == "oktopk";
  }
  bool sparse() const { return sparse_method(compression); }
  // A sparsifier below density 1 sends each element's accumulated gradient now and then; Adam
  // must then read it linearly (train/optimizer.h: second moment frozen after dense_steps).
  bool linear_adam() const { return sparse() && density < 1; }
  // Momentum correction (DGC): a local velocity accumulates into the residual and both are cleared
  // where values were sent. MODE auto gives it to dgc only, on to every sparsifier.
  static bool local_velocity(const std::string& method, bool error_feedback, double momentum, const std::string& mode) {
    if (!sparse_method(method) || !error_feedback || !(momentum > 0) || mode == "off") return false;
    return mode == "on" || method == "dgc";
  }
  bool local_velocity() const { return local_velocity(compression, error_feedback, dgc_momentum, momentum_correction); }
  static const std::vector<std::string>& compression_methods();
  static const std::vector<std::string>& fusion_strategies();
  // SAFusion's and GRACE's names for the same methods (gaussian, eftopk, topkef, exp).
  static std::string canonical_method(const std::string& name);
  // Throws InputError(WHERE, "key 'PREFIX.field': ...") naming the allowed values.
  void validate(const std::string& where, const std::string& prefix) const;
};

// LoRA fine-tuning (model/lora.h): low-rank adapters on chosen projections, the rest of the model
// frozen. rank 0 = off (every parameter trains, as before).
struct LoraConfig {
  int64_t rank = 0;
  double alpha = 16.0;          // the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  bool rslora = false;          // rank-stabilized LoRA (PEFT's use_rslora): alpha / sqrt(rank) instead
  double dropout = 0.0;         // on the adapters' input, training only
  std::string targets;          // projection names or patterns, comma-separated ("c_attn,q_proj", "mlp.*");
                                // empty = the attention projections of the arch
  std::string base_dtype = "fp32";  // fp32 | int8 (per-channel absmax) | nf4 (QLoRA: blocks of 64)
  bool double_quant = false;    // nf4: quantize the blocks' scales too (8-bit, blocks of 256)

  bool enabled() const { return rank > 0; }
  // What the adapters' output is multiplied by.
  double scale() const;
  // A frozen base stored quantized (int8 / nf4).
  bool quantized_base() const { return enabled() && base_dtype != "fp32"; }
  // The target patterns, split and trimmed; the arch's attention projections when none are given.
  std::vector<std::string> target_list(const std::string& arch) const;
};

struct OutputConfig {
  std::string dir = "runs/default";
  bool tensorboard = true;
  std::string tensorboard_dir;  // empty: DIR/tensorboard (Megatron: --tensorboard-dir)
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  GradSyncConfig grad_sync;
  LoraConfig lora;
  OutputConfig output;
  std::string source;  // the file it came from, for messages
  std::set<std::string> explicit_keys;  // "section.key" set by the file or an override

  bool is_set(const std::string& key) const { return explicit_keys.count(key) > 0; }

  // Loads FILE (YAML; JSON is YAML too) and applies overrides "section.key=value" in order.
  static Config load(const std::string& file, const std::vector<std::string>& overrides = {});
  static Config from_yaml_string(const std::string& yaml, const std::string& source,
                                 const std::vector<std::string>& overrides = {});
  void apply_override(const std::string& assignment);  // "section.key=value"
  // Cross-field checks (heads divide hidden, batch divisible by micro-batch, ...).
  void validate() const;

  nlohmann::json to_json() const;
  static Config from_json(const nlohmann::json& j, const std::string& source);
  std::string to_yaml() const;
};

nlohmann::json model_to_json(const ModelConfig& m);
// The keys that differ between two model configs, as "model.layers: 4 vs 8"; empty when equal.
std::vector<std::string> model_differences(const ModelConfig& a, const ModelConfig& b);

// One line per key: "section.key  (type, default X)  help"; for --help texts.
std::string config_reference();
// Levenshtein distance, for "did you mean" in messages about unknown names.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace alloy
