#include "alloy/core/megatron_args.h"

#include <cmath>
#include <functional>
#include <map>
#include <sstream>

#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/parse.h"

namespace alloy {

namespace {

enum class Arity { Switch, Value };

struct Flag {
  Arity arity;
  std::string help;
  // Applies the flag (V is empty for a switch). Throws InputError naming the flag.
  std::function<void(const std::string& name, const std::string& v, MegatronTranslation& t)> apply;
};

[[noreturn]] void fail(const std::string& flag, const std::string& msg) { throw InputError(flag, msg); }

int64_t as_int(const std::string& flag, const std::string& v) {
  const auto x = parse_int64(v);
  if (!x) fail(flag, "needs a whole number, got '" + v + "'");
  return *x;
}

double as_number(const std::string& flag, const std::string& v) {
  const auto x = parse_double(v);
  if (!x || !std::isfinite(*x)) fail(flag, "needs a number, got '" + v + "'");
  return *x;
}

// A flag that becomes config KEY; the config's own validation judges the value (with the key's name).
Flag to_key(const std::string& key, bool integer) {
  return {Arity::Value, key, [key, integer](const std::string& name, const std::string& v, MegatronTranslation& t) {
            if (integer) as_int(name, v);
            else as_number(name, v);
            t.sets.push_back(key + "=" + v);
          }};
}

Flag note_switch(const std::string& why) {
  return {Arity::Switch, "accepted: " + why, [why](const std::string& name, const std::string&, MegatronTranslation& t) {
            t.notes.push_back(name + ": " + why);
          }};
}

Flag note_value(const std::string& why) {
  return {Arity::Value, "accepted: " + why, [why](const std::string& name, const std::string& v, MegatronTranslation& t) {
            t.notes.push_back(name + " " + v + ": " + why);
          }};
}

const char* const kLlama =
    "model.arch=llama (Alloy's LLaMA: RMSNorm, SwiGLU, rotary positions, no biases, a head untied from the embedding)";

// The architecture switches name LLaMA's parts; Alloy has the two whole architectures, so any of
// them selects llama (once).
Flag llama_part(const std::string& part) {
  return {Arity::Switch, std::string(kLlama), [part](const std::string& name, const std::string&, MegatronTranslation& t) {
            const std::string set = "model.arch=llama";
            bool already = false;
            for (const auto& s : t.sets) already = already || s == set;
            if (!already) {
              t.sets.push_back(set);
              t.notes.push_back(name + " (" + part + "): " + kLlama);
            }
          }};
}

const std::map<std::string, Flag>& flags() {
  static const std::map<std::string, Flag> table = [] {
    std::map<std::string, Flag> f;
    // The model.
    f["--num-layers"] = to_key("model.layers", true);
    f["--hidden-size"] = to_key("model.hidden", true);
    f["--ffn-hidden-size"] = to_key("model.ffn", true);
    f["--num-attention-heads"] = to_key("model.heads", true);
    // As Megatron: the groups count only under --group-query-attention (alone: one group).
    f["--num-query-groups"] = {Arity::Value, "model.kv_heads, with --group-query-attention (as Megatron)",
                               [](const std::string& name, const std::string& v, MegatronTranslation& t) {
                                 t.num_query_groups = as_int(name, v);
                                 if (t.num_query_groups < 1) fail(name, "must be >= 1, got " + v);
                               }};
    f["--seq-length"] = {Arity::Value, "model.seq_len", [](const std::string& name, const std::string& v, MegatronTranslation& t) {
                           t.seq_length = as_int(name, v);
                           t.sets.push_back("model.seq_len=" + v);
                         }};
    f["--init-method-std"] = to_key("model.init_std", false);
    f["--norm-epsilon"] = to_key("model.norm_eps", false);
    f["--layernorm-epsilon"] = to_key("model.norm_eps", false);
    f["--rotary-base"] = to_key("model.rope_theta", false);
    f["--max-position-embeddings"] = {
        Arity::Value, "checked: at least --seq-length (GPT-2's position table has model.seq_len rows)",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          t.max_position_embeddings = as_int(name, v);
          if (t.max_position_embeddings < 1) fail(name, "must be >= 1, got " + v);
          t.notes.push_back(name + " " + v + ": GPT-2's learned position table has model.seq_len rows (LLaMA has none)");
        }};
    f["--swiglu"] = llama_part("SwiGLU");
    f["--use-rotary-position-embeddings"] = llama_part("rotary positions");
    f["--no-position-embedding"] = llama_part("no learned positions");
    f["--disable-bias-linear"] = llama_part("no biases");
    f["--add-qkv-bias"] = {Arity::Switch, "model.qkv_bias=true (llama: biases on q, k and v, as Qwen2)",
                           [](const std::string&, const std::string&, MegatronTranslation& t) { t.sets.push_back("model.qkv_bias=true"); }};
    f["--untie-embeddings-and-output-weights"] = llama_part("an untied head");
    f["--position-embedding-type"] = {
        Arity::Value, "rope: " + std::string(kLlama) + "; learned_absolute: GPT-2's",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          if (v == "rope") flags().at("--use-rotary-position-embeddings").apply(name + " rope", "", t);
          else if (v != "learned_absolute") fail(name, "Alloy has rope (model.arch=llama) and learned_absolute (gpt2), got '" + v + "'");
        }};
    f["--normalization"] = {
        Arity::Value, "RMSNorm: " + std::string(kLlama) + "; LayerNorm: GPT-2's",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          if (v == "RMSNorm") flags().at("--swiglu").apply(name + " RMSNorm", "", t);
          else if (v != "LayerNorm") fail(name, "Alloy has RMSNorm (model.arch=llama) and LayerNorm (gpt2), got '" + v + "'");
        }};
    f["--group-query-attention"] = {Arity::Switch, "grouped-query attention: model.kv_heads = --num-query-groups (default 1)",
                                    [](const std::string&, const std::string&, MegatronTranslation& t) { t.group_query_attention = true; }};
    f["--attention-dropout"] = f["--hidden-dropout"] = {
        Arity::Value, "checked: 0 (Alloy's pretraining has no dropout)",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          if (as_number(name, v) != 0) fail(name, "Alloy's pretraining has no dropout; only 0 is accepted (LoRA's is lora.dropout)");
          t.notes.push_back(name + " 0: Alloy's pretraining has no dropout");
        }};

    // The optimizer and its schedule.
    f["--train-iters"] = to_key("train.steps", true);
    f["--lr"] = to_key("train.lr", false);
    f["--min-lr"] = to_key("train.min_lr", false);
    f["--lr-warmup-iters"] = {Arity::Value, "train.warmup", [](const std::string& name, const std::string& v, MegatronTranslation& t) {
                                as_int(name, v);
                                t.warmup_iters = true;
                                t.sets.push_back("train.warmup=" + v);
                              }};
    f["--lr-warmup-fraction"] = {Arity::Value, "train.warmup = round(fraction x train.steps)",
                                 [](const std::string& name, const std::string& v, MegatronTranslation& t) {
                                   const double x = as_number(name, v);
                                   if (x < 0 || x > 1) fail(name, "must be in [0, 1], got " + v);
                                   t.warmup_fraction = x;
                                 }};
    f["--lr-decay-style"] = {Arity::Value, "checked: cosine (Alloy decays from train.lr to train.min_lr by cosine)",
                             [](const std::string& name, const std::string& v, MegatronTranslation&) {
                               if (v != "cosine")
                                 fail(name, "Alloy decays the learning rate by cosine from train.lr to train.min_lr over "
                                            "train.decay_steps (--lr-decay-iters, else train.steps); got '" + v + "'");
                             }};
    f["--lr-decay-iters"] = to_key("train.decay_steps", true);
    f["--weight-decay"] = to_key("train.weight_decay", false);
    f["--clip-grad"] = to_key("train.grad_clip", false);
    f["--adam-beta1"] = to_key("train.beta1", false);
    f["--adam-beta2"] = to_key("train.beta2", false);
    f["--adam-eps"] = to_key("train.eps", false);
    f["--optimizer"] = {Arity::Value, "checked: adam (Alloy's optimizer is AdamW)",
                        [](const std::string& name, const std::string& v, MegatronTranslation&) {
                          if (v != "adam") fail(name, "Alloy trains with AdamW (Megatron's adam); got '" + v + "'");
                        }};
    f["--seed"] = to_key("train.seed", true);
    f["--initial-loss-scale"] = to_key("train.loss_scale_init", false);
    f["--loss-scale-window"] = to_key("train.loss_scale_window", true);
    f["--min-loss-scale"] = note_value("Alloy's dynamic loss scale has no lower bound (a step whose gradients overflow is skipped)");
    f["--attention-softmax-in-fp32"] = note_switch("the attention's softmax already runs in fp32 under autocast");

    // Data.
    f["--data-path"] = {Arity::Value, "data.prefix (one dataset prefix)",
                        [](const std::string&, const std::string& v, MegatronTranslation& t) { t.sets.push_back("data.prefix=" + v); }};
    f["--split"] = {Arity::Value, "data.split (train, validation and test weights of one dataset)",
                    [](const std::string&, const std::string& v, MegatronTranslation& t) { t.sets.push_back("data.split=" + v); }};
    f["--tokenizer-type"] = {
        Arity::Value,
        "GPT2BPETokenizer: data.tokenizer=gpt2; SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: "
        "data.tokenizer=sentencepiece (with --tokenizer-model; Llama2Tokenizer also data.add_bos=true); others: the token ids are read as they are",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          if (v == "GPT2BPETokenizer") {
            t.sets.push_back("data.tokenizer=gpt2");
          } else if (v == "SentencePieceTokenizer" || v == "GPTSentencePieceTokenizer" || v == "Llama2Tokenizer") {
            t.sets.push_back("data.tokenizer=sentencepiece");
            if (v == "Llama2Tokenizer") t.sets.push_back("data.add_bos=true");  // it starts every text with <s>
          } else {
            t.notes.push_back(name + " " + v + ": training reads the tokenized .bin/.idx as they are; Alloy decodes (eval, generate) "
                                              "byte, gpt2 and SentencePiece ids");
          }
        }};
    f["--tokenizer-model"] = {Arity::Value, "data.tokenizer_model (the SentencePiece model file)",
                              [](const std::string&, const std::string& v, MegatronTranslation& t) {
                                t.sets.push_back("data.tokenizer_model=" + v);
                              }};
    f["--vocab-file"] = note_value("the GPT-2 vocabulary comes from data.vocab_dir (encoder.json and vocab.bpe)");
    f["--merge-file"] = note_value("the GPT-2 merges come from data.vocab_dir (encoder.json and vocab.bpe)");

    // Checkpoints and logs.
    f["--save"] = {Arity::Value, "output.dir (checkpoints under DIR/checkpoints, metrics beside them)",
                   [](const std::string&, const std::string& v, MegatronTranslation& t) { t.sets.push_back("output.dir=" + v); }};
    f["--load"] = {Arity::Value,
                   "resume from DIR's latest complete checkpoint if it has one, else start afresh; a Megatron-LM checkpoint "
                   "there (latest_checkpointed_iteration.txt, mp_rank_*) gives the initial weights, as with --finetune",
                   [](const std::string&, const std::string& v, MegatronTranslation& t) { t.load = v; }};
    f["--finetune"] = {Arity::Switch, "with --load: its weights only, from step 0 (fresh AdamW moments and schedule)",
                       [](const std::string&, const std::string&, MegatronTranslation& t) { t.finetune = true; }};
    f["--save-interval"] = to_key("train.checkpoint_interval", true);
    f["--eval-interval"] = to_key("train.eval_interval", true);
    f["--eval-iters"] = to_key("train.eval_batches", true);
    f["--log-interval"] = to_key("train.log_interval", true);
    f["--tensorboard-dir"] = {Arity::Value, "output.tensorboard_dir (and output.tensorboard=true)",
                              [](const std::string&, const std::string& v, MegatronTranslation& t) {
                                t.sets.push_back("output.tensorboard=true");
                                t.sets.push_back("output.tensorboard_dir=" + v);
                              }};
    f["--distributed-backend"] = {
        Arity::Value, "checked: nccl or gloo (Alloy uses NCCL inside all-CUDA groups of a CUDA build, Gloo elsewhere)",
        [](const std::string& name, const std::string& v, MegatronTranslation& t) {
          if (v != "nccl" && v != "gloo") fail(name, "must be nccl or gloo, got '" + v + "'");
          t.notes.push_back(name + " " + v + ": Alloy uses NCCL inside groups whose ranks are all CUDA devices (CUDA builds) and Gloo elsewhere");
        }};

    // Implementation choices Alloy makes itself.
    f["--use-flash-attn"] = note_switch("Alloy uses scaled_dot_product_attention (flash kernels on CUDA) where its LibTorch has it");
    f["--transformer-impl"] = note_value("Alloy has one transformer implementation");
    f["--use-mcore-models"] = note_switch("Alloy has one transformer implementation");
    f["--use-legacy-models"] = note_switch("Alloy has one transformer implementation");
    f["--timing-log-level"] = note_value("Alloy writes per-step times to metrics.jsonl and per-rank times to ranks.json");
    f["--log-throughput"] = note_switch("throughput is in every log line and in metrics.jsonl");
    f["--no-masked-softmax-fusion"] = note_switch("Alloy chooses its kernels itself");
    f["--no-bias-gelu-fusion"] = note_switch("Alloy chooses its kernels itself");
    f["--no-bias-dropout-fusion"] = note_switch("Alloy chooses its kernels itself");
    f["--no-gradient-accumulation-fusion"] = note_switch("Alloy chooses its kernels itself");
    f["--overlap-grad-reduce"] = note_switch("gradient buckets are always reduced during the backward");
    return f;
  }();
  return table;
}

bool is_flag(const std::string& s) { return s.size() > 2 && s[0] == '-' && s[1] == '-'; }

}  // namespace

MegatronTranslation translate_megatron_args(const std::vector<std::string>& argv, const std::vector<std::string>& also_known) {
  MegatronTranslation t;
  size_t i = 0;
  while (i < argv.size()) {
    const std::string& tok = argv[i++];
    if (!is_flag(tok)) fail("Megatron flags", "unexpected value '" + tok + "': values must follow a --flag");
    std::string name = tok, value;
    bool inline_value = false;
    if (auto eq = tok.find('='); eq != std::string::npos) {
      name = tok.substr(0, eq);
      value = tok.substr(eq + 1);
      inline_value = true;
    }
    auto it = flags().find(name);
    if (it == flags().end()) {
      std::string best;
      size_t best_d = 4;
      for (const auto& [k, _] : flags()) {
        const size_t d = edit_distance(name, k);
        if (d < best_d) best_d = d, best = k;
      }
      for (const auto& k : also_known) {
        const size_t d = edit_distance(name, k);
        if (d < best_d) best_d = d, best = k;
      }
      fail(name, "unknown flag" + (best.empty() ? std::string() : " (did you mean " + best + "?)") +
                     "; `alloy train --help` lists the Megatron flags Alloy reads");
    }
    if (it->second.arity == Arity::Switch) {
      if (inline_value) fail(name, "takes no value, got '" + value + "'");
    } else if (!inline_value) {
      if (i >= argv.size() || is_flag(argv[i])) fail(name, "needs a value");
      value = argv[i++];
    }
    it->second.apply(name, value, t);
  }
  if (t.group_query_attention) {
    t.sets.push_back("model.kv_heads=" + std::to_string(t.num_query_groups > 0 ? t.num_query_groups : 1));
  } else if (t.num_query_groups > 0) {
    t.notes.push_back("--num-query-groups " + std::to_string(t.num_query_groups) +
                      ": without --group-query-attention every head keeps its own keys and values, as in Megatron");
  }
  if (t.max_position_embeddings > 0 && t.seq_length > 0 && t.max_position_embeddings < t.seq_length)
    fail("--max-position-embeddings", std::to_string(t.max_position_embeddings) + " is less than --seq-length " +
                                          std::to_string(t.seq_length));
  if (t.warmup_iters && t.warmup_fraction)
    fail("--lr-warmup-fraction", "and --lr-warmup-iters both given: say the warm-up one way (Megatron refuses both too)");
  return t;
}

int megatron_flag_arity(const std::string& name) {
  auto it = flags().find(name);
  if (it == flags().end()) return -1;
  return it->second.arity == Arity::Switch ? 0 : 1;
}

std::string megatron_flags_reference() {
  std::ostringstream out;
  for (const auto& [name, f] : flags()) {
    out << "  " << name << (f.arity == Arity::Value ? " V" : "");
    for (size_t i = name.size() + (f.arity == Arity::Value ? 2 : 0); i < 38; ++i) out << ' ';
    out << ' ' << f.help << "\n";
  }
  return out.str();
}

}  // namespace alloy
