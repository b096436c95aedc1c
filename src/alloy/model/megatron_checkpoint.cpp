// Megatron-LM checkpoints into Alloy's weights (see megatron_checkpoint.h). Layouts, as Megatron
// computes with them:
//  - fused QKV (legacy query_key_value, core linear_qkv): rows grouped by query group, each group
//    its q heads, then one k head and one v head, head_dim rows each ([ng, np/ng + 2, hn]); without
//    grouped-query attention every head is its own group ([np, 3, hn]). A tensor-parallel piece
//    holds whole groups, so the pieces join along rows in rank order.
//  - SwiGLU's first projection (dense_h_to_4h / linear_fc1): each piece is [gate rows; up rows] of
//    its columns (the activation chunks the output in two), so gates and ups join separately.
//  - column-parallel weights (and their biases) join along rows, row-parallel ones along columns,
//    the vocabulary-parallel embedding and output layer along rows; norms and the row-parallel
//    biases are whole on every piece.
//  - pipeline stages number their layers from 0 (legacy, and core's torch format); a stage whose
//    first layer number equals the layers before it numbers them globally.
#include "alloy/model/megatron_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/core/parse.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/model/torch_pickle.h"
#include "alloy/model/transformer.h"

namespace alloy::model {

namespace fs = std::filesystem;

namespace {

const std::regex kRankDir(R"(mp_rank_(\d{2})(?:_(\d{3}))?)");

bool has_rank_dirs(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && std::regex_match(e.path().filename().string(), kRankDir)) return true;
  return false;
}

std::string shape_text(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// A scalar argument as text: ints, floats, bools (true/false), strings; None is "".
std::string scalar_text(const PyValue& v) {
  switch (v.kind) {
    case PyValue::Kind::Bool: return v.b ? "true" : "false";
    case PyValue::Kind::Int: return std::to_string(v.i);
    case PyValue::Kind::Float: {
      std::ostringstream o;
      o.precision(17);
      o << v.f;
      return o.str();
    }
    case PyValue::Kind::Str: return v.s;
    case PyValue::Kind::Global: return v.s;  // e.g. torch.bfloat16 for params_dtype
    default: return "";
  }
}

// How a role's tensor-parallel pieces join: whole on every piece, along rows, along columns.
enum class Split { Whole, Rows, Cols };

// Megatron's role for a layer tensor (ln1.w, qkv.w, ...), from its name after "layers.N.".
bool layer_role(const std::string& suffix, std::string* key) {
  static const std::map<std::string, std::string> roles = {
      // legacy
      {"input_layernorm.weight", "ln1.w"},
      {"input_layernorm.bias", "ln1.b"},
      {"self_attention.query_key_value.weight", "qkv.w"},
      {"self_attention.query_key_value.bias", "qkv.b"},
      {"attention.query_key_value.weight", "qkv.w"},
      {"attention.query_key_value.bias", "qkv.b"},
      {"self_attention.dense.weight", "proj.w"},
      {"self_attention.dense.bias", "proj.b"},
      {"attention.dense.weight", "proj.w"},
      {"attention.dense.bias", "proj.b"},
      {"post_attention_layernorm.weight", "ln2.w"},
      {"post_attention_layernorm.bias", "ln2.b"},
      {"mlp.dense_h_to_4h.weight", "fc1.w"},
      {"mlp.dense_h_to_4h.bias", "fc1.b"},
      {"mlp.dense_4h_to_h.weight", "fc2.w"},
      {"mlp.dense_4h_to_h.bias", "fc2.b"},
      // Megatron-Core (local norms, or Transformer Engine's norms fused into the next projection)
      {"self_attention.linear_qkv.layer_norm_weight", "ln1.w"},
      {"self_attention.linear_qkv.layer_norm_bias", "ln1.b"},
      {"self_attention.linear_qkv.weight", "qkv.w"},
      {"self_attention.linear_qkv.bias", "qkv.b"},
      {"self_attention.linear_proj.weight", "proj.w"},
      {"self_attention.linear_proj.bias", "proj.b"},
      {"pre_mlp_layernorm.weight", "ln2.w"},
      {"pre_mlp_layernorm.bias", "ln2.b"},
      {"mlp.linear_fc1.layer_norm_weight", "ln2.w"},
      {"mlp.linear_fc1.layer_norm_bias", "ln2.b"},
      {"mlp.linear_fc1.weight", "fc1.w"},
      {"mlp.linear_fc1.bias", "fc1.b"},
      {"mlp.linear_fc2.weight", "fc2.w"},
      {"mlp.linear_fc2.bias", "fc2.b"},
  };
  auto it = roles.find(suffix);
  if (it == roles.end()) return false;
  *key = it->second;
  return true;
}

// How a layer role's tensor-parallel pieces join.
Split split_of(const std::string& key) {
  if (key == "qkv.w" || key == "qkv.b" || key == "fc1.w" || key == "fc1.b") return Split::Rows;
  if (key == "proj.w" || key == "fc2.w") return Split::Cols;
  return Split::Whole;
}

// The model-wide tensors' roles (each joins as join() is told where it is used).
bool global_role(const std::string& name, std::string* key) {
  static const std::map<std::string, std::string> roles = {
      {"language_model.embedding.word_embeddings.weight", "wte"},
      {"language_model.embedding.position_embeddings.weight", "wpe"},
      {"language_model.encoder.final_layernorm.weight", "lnf.w"},
      {"language_model.encoder.final_layernorm.bias", "lnf.b"},
      {"language_model.transformer.final_layernorm.weight", "lnf.w"},
      {"language_model.transformer.final_layernorm.bias", "lnf.b"},
      {"language_model.output_layer.weight", "out.w"},
      {"embedding.word_embeddings.weight", "wte"},
      {"embedding.position_embeddings.weight", "wpe"},
      {"decoder.final_layernorm.weight", "lnf.w"},
      {"decoder.final_layernorm.bias", "lnf.b"},
      {"output_layer.weight", "out.w"},
  };
  auto it = roles.find(name);
  if (it == roles.end()) return false;
  *key = it->second;
  return true;
}

// The model's tensors by dotted name, read from the archive (only these: the optimizer's state is
// never read). A state dict nests a few levels; deeper (or a dict holding itself) is damage.
void flatten(const PyValue& v, const std::string& prefix, std::vector<std::pair<std::string, at::Tensor>>* out, const std::string& file,
             int depth = 0) {
  if (depth > 32) throw InputError(file, "the model's state nests deeper than 32 levels at '" + prefix + "'");
  if (v.kind == PyValue::Kind::Tensor) {
    if (prefix.size() >= 12 && prefix.compare(prefix.size() - 12, 12, "_extra_state") == 0) return;
    out->emplace_back(prefix, v.tensor_value());
    return;
  }
  if (v.kind != PyValue::Kind::Dict) return;  // _extra_state (BytesIO), None, ...
  for (const auto& [k, x] : v.dict)
    if (k->kind == PyValue::Kind::Str) flatten(*x, prefix.empty() ? k->s : prefix + "." + k->s, out, file, depth + 1);
}

struct Shard {
  std::string file;
  std::map<std::string, std::string> args;
  bool has_args = false;
  int64_t iteration = 0;
  double version = 0;
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // Megatron names
};

Shard read_shard(const std::string& file) {
  Shard s;
  s.file = file;
  PyRef root = load_torch_file(file);
  if (root->kind != PyValue::Kind::Dict) throw InputError(file, "holds a " + root->type_name() + ", not a Megatron checkpoint's dict");
  const PyValue* model = root->get("model");
  if (!model) {
    if (root->get("model0"))
      throw InputError(file, "holds virtual pipeline stages (model0, model1, ...): interleaved schedules' checkpoints are not read; "
                             "convert it to one stage per rank with Megatron's tools/checkpoint first");
    throw InputError(file, "has no 'model' entry: not a Megatron-LM checkpoint");
  }
  flatten(*model, "", &s.tensors, file);
  if (const PyValue* a = root->get("args"); a && a->kind == PyValue::Kind::Object && a->state && a->state->kind == PyValue::Kind::Dict) {
    s.has_args = true;
    for (const auto& [k, v] : a->state->dict)
      if (k->kind == PyValue::Kind::Str) s.args[k->s] = scalar_text(*v);
  }
  if (const PyValue* it = root->get("iteration"); it && it->kind == PyValue::Kind::Int) s.iteration = it->i;
  if (const PyValue* v = root->get("checkpoint_version"))
    s.version = v->kind == PyValue::Kind::Float ? v->f : v->kind == PyValue::Kind::Int ? static_cast<double>(v->i) : 0;
  return s;
}

std::string arg(const std::map<std::string, std::string>& a, const std::string& k, const std::string& fallback = "") {
  auto it = a.find(k);
  return it == a.end() || it->second.empty() ? fallback : it->second;
}

}  // namespace

bool is_megatron_checkpoint(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    const std::string n = fs::path(path).filename().string();
    return n == "model_optim_rng.pt" || n == "model_rng.pt";
  }
  if (!fs::is_directory(path, ec)) return false;
  return fs::exists(fs::path(path) / "latest_checkpointed_iteration.txt", ec) || has_rank_dirs(path);
}

ModelConfig model_config_from_megatron_args(const std::map<std::string, std::string>& a, const std::string& where, int64_t* max_positions,
                                            std::vector<std::string>* notes) {
  auto num = [&](const std::string& k, int64_t fallback) -> int64_t {
    const std::string v = arg(a, k);
    if (v.empty()) return fallback;
    const auto out = parse_int64(v);
    if (!out) throw InputError(where, "args." + k + " is '" + v + "', not an integer");
    return *out;
  };
  auto real = [&](const std::string& k, double fallback) -> double {
    const std::string v = arg(a, k);
    if (v.empty()) return fallback;
    const auto out = parse_double(v);
    if (!out) throw InputError(where, "args." + k + " is '" + v + "', not a number");
    return *out;
  };
  auto flag = [&](const std::string& k) { return arg(a, k) == "true"; };
  ModelConfig m;
  m.layers = num("num_layers", 0);
  m.hidden = num("hidden_size", 0);
  m.heads = num("num_attention_heads", 0);
  if (m.layers <= 0 || m.hidden <= 0 || m.heads <= 0)
    throw InputError(where, "args lack num_layers, hidden_size or num_attention_heads: give the model's config");
  const std::string norm = arg(a, "normalization", "LayerNorm");
  const std::string pos = arg(a, "position_embedding_type", flag("use_rotary_position_embeddings") ? "rope" : "learned_absolute");
  const bool swiglu = flag("swiglu");
  if (norm == "RMSNorm" && pos == "rope" && swiglu) {
    m.arch = "llama";
  } else if (norm == "LayerNorm" && pos == "learned_absolute" && !swiglu) {
    m.arch = "gpt2";
  } else {
    throw InputError(where, "args describe normalization " + norm + ", position_embedding_type " + pos + (swiglu ? ", SwiGLU" : ", GELU") +
                                ": Alloy's models are gpt2 (LayerNorm, learned_absolute, GELU) and llama (RMSNorm, rope, SwiGLU)");
  }
  if (flag("group_query_attention")) m.kv_heads = num("num_query_groups", 1);
  m.qkv_bias = m.arch == "llama" && flag("add_qkv_bias");
  m.ffn = num("ffn_hidden_size", 0);
  m.seq_len = num("seq_length", num("max_position_embeddings", 0));
  m.vocab_size = num("padded_vocab_size", 0);
  m.norm_eps = real("norm_epsilon", real("layernorm_epsilon", 1e-5));
  m.rope_theta = real("rotary_base", 10000.0);
  m.init_std = real("init_method_std", 0.02);
  if (max_positions) *max_positions = num("max_position_embeddings", m.seq_len);
  if (m.arch == "gpt2" && m.kv_heads > 0 && m.kv_heads != m.heads)
    throw InputError(where, "args ask grouped-query attention in a GPT model: Alloy's gpt2 has none (its llama does)");
  if (m.arch == "gpt2" && flag("untie_embeddings_and_output_weights"))
    throw InputError(where, "args.untie_embeddings_and_output_weights is true: Alloy's gpt2 ties its head to the embedding");
  if (m.arch == "llama") {
    if (flag("rotary_interleaved"))
      throw InputError(where, "args.rotary_interleaved is true: Alloy's llama rotates halves (rotate_half), not interleaved pairs");
    if (real("rotary_percent", 1.0) != 1.0)
      throw InputError(where, "args.rotary_percent is " + arg(a, "rotary_percent") + ": Alloy's llama rotates every channel of a head");
    if (flag("use_rope_scaling")) throw InputError(where, "args.use_rope_scaling is true: Alloy's llama has no RoPE scaling");
  }
  if (num("kv_channels", m.hidden / m.heads) != m.hidden / m.heads)
    throw InputError(where, "args.kv_channels is " + arg(a, "kv_channels") + ", not hidden_size / num_attention_heads = " +
                                std::to_string(m.hidden / m.heads) + ": Alloy's heads are hidden / heads wide");
  if (flag("apply_residual_connection_post_layernorm"))
    throw InputError(where, "args.apply_residual_connection_post_layernorm is true: Alloy's blocks add the residual before the norm");
  if (notes) {
    if (m.arch == "gpt2" && !flag("openai_gelu") && arg(a, "bias_gelu_fusion", "true") == "false")
      notes->push_back("the checkpoint's GELU is the erf form (bias_gelu_fusion off), Alloy's gpt2 uses the tanh form: "
                       "activations differ by up to about 1e-3");
    if (!flag("untie_embeddings_and_output_weights") && m.arch == "llama")
      notes->push_back("the checkpoint ties its output layer to the embedding; Alloy's llama starts lm_head as a copy and trains it apart");
  }
  return m;
}

namespace {
MegatronCheckpoint read_checkpoint(const std::string& path, const ModelConfig* want, bool only_without_args, bool progress);
}  // namespace

MegatronCheckpoint read_megatron_checkpoint(const std::string& path, const ModelConfig* want, bool only_without_args, bool progress) {
  try {
    return read_checkpoint(path, want, only_without_args, progress);
  } catch (const c10::Error& e) {
    // A shape no Megatron model has (pieces that do not join, a fused QKV of the wrong height).
    throw InputError(path, std::string("its tensors do not form the model: ") + e.what_without_backtrace());
  }
}

namespace {
MegatronCheckpoint read_checkpoint(const std::string& path, const ModelConfig* want, bool only_without_args, bool progress) {
  MegatronCheckpoint c;
  std::map<std::pair<int, int>, std::string> files;  // (tp, pp) -> file
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    c.dir = path;
    files[{0, 0}] = path;
  } else {
    fs::path dir = path;
    const fs::path tracker = dir / "latest_checkpointed_iteration.txt";
    if (fs::exists(tracker, ec)) {
      std::string t = read_file(tracker.string());
      t.erase(std::remove_if(t.begin(), t.end(), [](char ch) { return std::isspace(static_cast<unsigned char>(ch)); }), t.end());
      const auto it = parse_int64(t);
      if (t == "release") {
        dir /= "release";
        c.iteration = -1;
      } else if (it && *it >= 0) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(*it));
        dir /= buf;
        c.iteration = *it;
      } else {
        throw InputError(tracker.string(), "holds '" + t + "', neither an iteration number nor 'release'");
      }
      if (!fs::is_directory(dir, ec)) throw InputError(tracker.string(), "names " + dir.string() + ", which does not exist");
    }
    c.dir = dir.string();
    if (fs::exists(dir / ".metadata", ec) || fs::exists(dir / "metadata.json", ec))
      throw InputError(c.dir, "is a distributed checkpoint (--ckpt-format torch_dist or zarr); Alloy reads the torch format: convert it "
                              "with Megatron's tools/checkpoint/convert.py or save with --ckpt-format torch");
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      std::smatch mt;
      const std::string n = e.path().filename().string();
      if (!e.is_directory() || !std::regex_match(n, mt, kRankDir)) continue;
      const int t = std::stoi(mt[1].str()), p = mt[2].matched ? std::stoi(mt[2].str()) : 0;
      std::string f = (e.path() / "model_optim_rng.pt").string();
      if (!fs::exists(f, ec)) f = (e.path() / "model_rng.pt").string();
      if (!fs::exists(f, ec)) throw InputError(e.path().string(), "holds neither model_optim_rng.pt nor model_rng.pt");
      files[{t, p}] = f;
    }
    if (files.empty()) throw InputError(c.dir, "holds no mp_rank_* directory: not a Megatron-LM checkpoint");
  }
  for (const auto& [k, f] : files) c.tp = std::max(c.tp, k.first + 1), c.pp = std::max(c.pp, k.second + 1);
  for (int p = 0; p < c.pp; ++p)
    for (int t = 0; t < c.tp; ++t)
      if (!files.count({t, p})) {
        char buf[32];
        c.pp > 1 ? std::snprintf(buf, sizeof buf, "mp_rank_%02d_%03d", t, p) : std::snprintf(buf, sizeof buf, "mp_rank_%02d", t);
        throw InputError(c.dir, std::string("lacks ") + buf + " (tensor-parallel piece " + std::to_string(t) + " of stage " +
                                    std::to_string(p) + "); every piece of the " + std::to_string(c.tp) + " x " + std::to_string(c.pp) +
                                    " layout is needed");
      }

  // Every piece's tensors by role: layers by global number, then the model-wide ones.
  struct Pieces {
    std::vector<at::Tensor> by_tp;
    std::string name, file;
  };
  std::map<int64_t, std::map<std::string, Pieces>> layers;
  std::map<std::string, Pieces> globals;
  const std::regex layer_re(R"((?:language_model\.(?:encoder|transformer)\.|decoder\.)layers\.(\d+)\.(.+))");
  std::optional<Progress> shown;
  uint64_t total_bytes = 0, read_bytes = 0;
  if (progress) {
    for (const auto& [k, f] : files) total_bytes += static_cast<uint64_t>(fs::file_size(f, ec));
    shown.emplace("megatron", std::max<uint64_t>(1, total_bytes));
  }
  int64_t offset = 0;
  for (int p = 0; p < c.pp; ++p) {
    std::map<int64_t, std::map<std::string, std::vector<std::pair<std::string, at::Tensor>>>> stage;  // local -> role -> per tp
    int64_t stage_first = -1;
    for (int t = 0; t < c.tp; ++t) {
      Shard s = read_shard(files[{t, p}]);
      if (shown) {
        read_bytes += static_cast<uint64_t>(fs::file_size(s.file, ec));
        shown->update(read_bytes, fs::path(s.file).parent_path().filename().string());
      }
      if (p == 0 && t == 0) {
        c.version = s.version;
        c.has_args = s.has_args;
        if (c.iteration == 0 && s.iteration > 0) c.iteration = s.iteration;
        if (s.has_args) c.model = model_config_from_megatron_args(s.args, files[{0, 0}] + " (args)", &c.max_positions, &c.notes);
        if (s.has_args && !arg(s.args, "tensor_model_parallel_size").empty() && arg(s.args, "tensor_model_parallel_size") != std::to_string(c.tp))
          throw InputError(c.dir, "holds " + std::to_string(c.tp) + " tensor-parallel pieces but its args say tensor_model_parallel_size " +
                                      arg(s.args, "tensor_model_parallel_size"));
      }
      for (auto& [name, tensor] : s.tensors) {
        std::smatch mt;
        std::string key;
        if (name.size() >= 12 && name.compare(name.size() - 12, 12, "_extra_state") == 0) continue;
        if (name == "word_embeddings_for_head.weight" || name == "language_model.word_embeddings_for_head.weight") continue;  // stage 0's copy
        if (std::regex_match(name, mt, layer_re)) {
          if (!layer_role(mt[2].str(), &key))
            throw InputError(s.file, "tensor '" + name + "' is not part of a GPT block Alloy knows (mixture-of-experts, QK norms and "
                                     "other extensions are not read)");
          const auto parsed = parse_int64(mt[1].str());
          if (!parsed || *parsed > (int64_t{1} << 20)) throw InputError(s.file, "tensor '" + name + "' has layer number " + mt[1].str());
          const int64_t local = *parsed;
          if (stage_first < 0 || local < stage_first) stage_first = local;
          stage[local][key].emplace_back(name, tensor);
        } else if (global_role(name, &key)) {
          Pieces& g = globals[key];
          g.by_tp.push_back(tensor);
          g.name = name;
          g.file = s.file;
        } else {
          throw InputError(s.file, "tensor '" + name + "' is not part of a GPT model Alloy knows");
        }
      }
    }
    // A stage numbering its layers from the global count it starts at keeps them; one numbering
    // from 0 is shifted by the layers before it.
    const int64_t shift = stage_first == offset ? 0 : offset;
    for (auto& [local, roles] : stage) {
      for (auto& [key, pieces] : roles) {
        if (static_cast<int>(pieces.size()) != c.tp)
          throw InputError(c.dir, "layer " + std::to_string(local) + " of stage " + std::to_string(p) + ": '" + pieces.front().first + "' is in " +
                                      std::to_string(pieces.size()) + " of the " + std::to_string(c.tp) + " tensor-parallel pieces");
        Pieces& dst = layers[local + shift][key];
        if (!dst.by_tp.empty())
          throw InputError(c.dir, "layer " + std::to_string(local + shift) + " appears in two pipeline stages ('" + pieces.front().first + "')");
        for (auto& pr : pieces) dst.by_tp.push_back(pr.second);
        dst.name = pieces.front().first;
      }
    }
    offset += static_cast<int64_t>(stage.size());
  }
  if (shown) shown->finish(std::to_string(files.size()) + " file(s)");
  c.code = globals.count("wte") && globals["wte"].name.rfind("language_model.", 0) == 0 ? "legacy" : "core";

  // The model: the files' arguments, checked against the one asked for (or standing for them).
  if (c.has_args && only_without_args) want = nullptr;
  if (!c.has_args && !want)
    throw InputError(c.dir, "carries no Megatron arguments (args): give the model's config (-c) so the layout can be read");
  if (want) {
    if (c.has_args) {
      auto differ = [&](const std::string& what, int64_t a, int64_t b) {
        if (a != b)
          throw InputError(c.dir, "the checkpoint's " + what + " is " + std::to_string(a) + ", the model's config says " + std::to_string(b));
      };
      if (c.model.arch != want->arch) throw InputError(c.dir, "holds a " + c.model.arch + " model, the config asks for " + want->arch);
      differ("num_layers", c.model.layers, want->layers);
      differ("hidden_size", c.model.hidden, want->hidden);
      differ("num_attention_heads", c.model.heads, want->heads);
      differ("number of key/value heads", c.model.kv_heads_resolved(), want->kv_heads_resolved());
      differ("ffn_hidden_size", c.model.ffn_resolved(), want->ffn_resolved());
      if (c.model.qkv_bias != want->qkv_bias)
        throw InputError(c.dir, std::string("the checkpoint's args.add_qkv_bias is ") + (c.model.qkv_bias ? "true" : "false") +
                                    ", the model's config says model.qkv_bias: " + (want->qkv_bias ? "true" : "false"));
      if (c.model.vocab_size > 0 && c.model.vocab_size != want->vocab_size)
        throw InputError(c.dir, "the checkpoint's vocabulary is padded to " + std::to_string(c.model.vocab_size) +
                                    " rows (Megatron pads to a multiple of make-vocab-size-divisible-by x tensor-parallel size); set "
                                    "model.vocab_size=" + std::to_string(c.model.vocab_size) + " (the token ids keep their meaning)");
    }
    const int64_t positions = c.max_positions;
    c.model = *want;
    c.max_positions = positions > 0 ? positions : want->seq_len;
  }
  if (static_cast<int64_t>(layers.size()) != c.model.layers)
    throw InputError(c.dir, "holds " + std::to_string(layers.size()) + " layers over its " + std::to_string(c.pp) + " stage(s), the model has " +
                                std::to_string(c.model.layers));

  const ModelConfig& m = c.model;
  const int64_t H = m.hidden, hd = m.head_dim(), heads = m.heads, groups = m.kv_heads_resolved(), F = m.ffn_resolved();
  if (heads % groups) throw InputError(c.dir, "heads " + std::to_string(heads) + " do not divide into " + std::to_string(groups) + " groups");
  // checkpoint_version 0 and 1 kept each piece's QKV rows as [3, np, hn] and [np, hn, 3]; Megatron
  // reorders them to [np, 3, hn] on load (fix_query_key_value_ordering), and so does this.
  if (c.version < 2.0 && groups != heads)
    throw InputError(c.dir, "checkpoint_version " + std::to_string(c.version) + " predates grouped-query attention, yet the model has it");
  auto qkv_order = [&](at::Tensor t) {
    if (c.version >= 2.0) return t;
    const int64_t rows = t.size(0), cols = t.dim() == 2 ? t.size(1) : 1;
    if (rows % (3 * hd)) throw InputError(c.dir, "a fused QKV piece of " + std::to_string(rows) + " rows is no whole number of heads");
    const int64_t np = rows / (3 * hd);
    const at::Tensor v = c.version < 1.0 ? t.reshape({3, np, hd, cols}).permute({1, 0, 2, 3}) : t.reshape({np, hd, 3, cols}).permute({0, 2, 1, 3});
    return v.reshape(t.sizes()).contiguous();
  };
  auto join = [&](const Pieces& p, Split split, bool swiglu_fc1, bool qkv = false) -> at::Tensor {
    if (qkv) {
      std::vector<at::Tensor> pieces;
      for (const auto& t : p.by_tp) pieces.push_back(qkv_order(t));
      return pieces.size() == 1 ? pieces.front() : at::cat(pieces, 0);
    }
    if (p.by_tp.size() == 1 || split == Split::Whole) return p.by_tp.front();
    if (swiglu_fc1) {
      std::vector<at::Tensor> gates, ups;
      for (const auto& t : p.by_tp) {
        if (t.size(0) % 2) throw InputError(c.dir, "'" + p.name + "': a SwiGLU piece with an odd number of rows");
        auto halves = t.chunk(2, 0);
        gates.push_back(halves[0]), ups.push_back(halves[1]);
      }
      return at::cat({at::cat(gates, 0), at::cat(ups, 0)}, 0);
    }
    return at::cat(p.by_tp, split == Split::Rows ? 0 : 1);
  };
  auto put = [&](const std::string& name, at::Tensor t, const std::string& from) {
    c.weights[name] = t.contiguous();
    c.origin[name] = from + (c.tp > 1 ? " (" + std::to_string(c.tp) + " tensor-parallel pieces)" : "");
  };
  auto need_global = [&](const std::string& key) -> const Pieces& {
    auto it = globals.find(key);
    if (it == globals.end()) {
      static const std::map<std::string, std::string> what = {{"wte", "word embeddings"}, {"wpe", "position embeddings"},
                                                             {"lnf.w", "final norm"}, {"lnf.b", "final norm's bias"},
                                                             {"out.w", "output layer"}};
      throw InputError(c.dir, "has no " + what.at(key) + " tensor");
    }
    return it->second;
  };
  const bool llama = m.arch == "llama";
  if (!llama && c.max_positions > m.seq_len)
    c.notes.push_back("its position embedding has " + std::to_string(c.max_positions) + " rows; the model keeps the first " +
                      std::to_string(m.seq_len) + " (model.seq_len, from seq_length)");
  put(llama ? "model.embed_tokens.weight" : "wte.weight", join(need_global("wte"), Split::Rows, false), need_global("wte").name);
  if (!llama) put("wpe.weight", need_global("wpe").by_tp.front(), need_global("wpe").name);
  put(llama ? "model.norm.weight" : "ln_f.weight", need_global("lnf.w").by_tp.front(), need_global("lnf.w").name);
  if (!llama) put("ln_f.bias", need_global("lnf.b").by_tp.front(), need_global("lnf.b").name);
  if (llama) {
    const auto it = globals.find("out.w");
    if (it != globals.end()) put("lm_head.weight", join(it->second, Split::Rows, false), it->second.name);
    else put("lm_head.weight", c.weights.at("model.embed_tokens.weight").clone(), need_global("wte").name + " (tied)");
  } else if (globals.count("out.w")) {
    // Megatron-Core keeps a copy of the tied embedding as the last stage's output layer.
    const at::Tensor out = join(globals["out.w"], Split::Rows, false);
    if (!out.sizes().equals(c.weights.at("wte.weight").sizes()) || !at::equal(out, c.weights.at("wte.weight")))
      throw InputError(globals["out.w"].file, "has an output layer ('" + globals["out.w"].name +
                                                  "') that differs from the embedding: Alloy's gpt2 ties its head to the embedding");
  }
  const int64_t per_group = heads / groups;
  for (auto& [l, roles] : layers) {
    auto need = [&](const std::string& key) -> const Pieces& {
      auto it = roles.find(key);
      if (it == roles.end()) throw InputError(c.dir, "layer " + std::to_string(l) + " has no " + key + " tensor");
      return it->second;
    };
    auto whole = [&](const std::string& key) {
      return join(need(key), split_of(key), llama && key.rfind("fc1.", 0) == 0, key.rfind("qkv.", 0) == 0);
    };
    auto expect = [&](const std::string& key, const at::Tensor& t, std::vector<int64_t> shape) {
      if (t.sizes() != at::IntArrayRef(shape))
        throw InputError(c.dir, "'" + need(key).name + "' joins to " + shape_text(t.sizes()) + ", a " + m.arch + " block of hidden " +
                                    std::to_string(H) + ", " + std::to_string(heads) + " heads (" + std::to_string(groups) +
                                    " key/value) and MLP width " + std::to_string(F) + " needs " + shape_text(shape));
    };
    // QKV rows [groups, per_group + 2, head_dim] -> q (heads * hd), k and v (groups * hd each).
    const at::Tensor qkv = whole("qkv.w");
    expect("qkv.w", qkv, {(heads + 2 * groups) * hd, H});
    auto split_qkv = [&](const at::Tensor& t) {
      const at::Tensor g = t.reshape({groups, per_group + 2, hd, -1});
      return std::vector<at::Tensor>{g.narrow(1, 0, per_group).reshape({heads * hd, -1}), g.narrow(1, per_group, 1).reshape({groups * hd, -1}),
                                     g.narrow(1, per_group + 1, 1).reshape({groups * hd, -1})};
    };
    const auto q_k_v = split_qkv(qkv);
    const at::Tensor proj = whole("proj.w"), fc1 = whole("fc1.w"), fc2 = whole("fc2.w");
    expect("proj.w", proj, {H, heads * hd});
    expect("fc1.w", fc1, {(llama ? 2 : 1) * F, H});
    expect("fc2.w", fc2, {H, F});
    const std::string origin = need("qkv.w").name;
    if (llama) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const char* bias : {"qkv.b", "proj.b", "fc1.b", "fc2.b", "ln1.b", "ln2.b"})
        if (roles.count(bias) && !(m.qkv_bias && std::string(bias) == "qkv.b"))
          throw InputError(c.dir, "'" + roles[bias].name + "': Alloy's llama has no LayerNorm shifts and no biases but on q, k and v "
                                      "(args.add_qkv_bias, model.qkv_bias)");
      if (m.qkv_bias) {  // --add-qkv-bias: the fused bias's rows are grouped as the weight's
        const at::Tensor qkv_b = whole("qkv.b");
        expect("qkv.b", qkv_b, {(heads + 2 * groups) * hd});
        const auto b = split_qkv(qkv_b.reshape({-1, 1}));
        put(p + "self_attn.q_proj.bias", b[0].reshape({-1}), need("qkv.b").name);
        put(p + "self_attn.k_proj.bias", b[1].reshape({-1}), need("qkv.b").name);
        put(p + "self_attn.v_proj.bias", b[2].reshape({-1}), need("qkv.b").name);
      }
      put(p + "input_layernorm.weight", need("ln1.w").by_tp.front(), need("ln1.w").name);
      put(p + "self_attn.q_proj.weight", q_k_v[0], origin);
      put(p + "self_attn.k_proj.weight", q_k_v[1], origin);
      put(p + "self_attn.v_proj.weight", q_k_v[2], origin);
      put(p + "self_attn.o_proj.weight", proj, need("proj.w").name);
      put(p + "post_attention_layernorm.weight", need("ln2.w").by_tp.front(), need("ln2.w").name);
      put(p + "mlp.gate_proj.weight", fc1.narrow(0, 0, F), need("fc1.w").name);
      put(p + "mlp.up_proj.weight", fc1.narrow(0, F, F), need("fc1.w").name);
      put(p + "mlp.down_proj.weight", fc2, need("fc2.w").name);
    } else {
      // GPT-2 keeps [in, out] weights (Conv1D) with q, k and v side by side in c_attn's columns.
      const std::string p = "h." + std::to_string(l) + ".";
      const at::Tensor qkv_b = whole("qkv.b");
      expect("qkv.b", qkv_b, {(heads + 2 * groups) * hd});
      const auto qkv_b_parts = split_qkv(qkv_b.reshape({-1, 1}));
      put(p + "ln_1.weight", need("ln1.w").by_tp.front(), need("ln1.w").name);
      put(p + "ln_1.bias", need("ln1.b").by_tp.front(), need("ln1.b").name);
      put(p + "attn.c_attn.weight", at::cat(q_k_v, 0).t(), origin);
      put(p + "attn.c_attn.bias", at::cat(qkv_b_parts, 0).reshape({-1}), need("qkv.b").name);
      put(p + "attn.c_proj.weight", proj.t(), need("proj.w").name);
      put(p + "attn.c_proj.bias", need("proj.b").by_tp.front(), need("proj.b").name);
      put(p + "ln_2.weight", need("ln2.w").by_tp.front(), need("ln2.w").name);
      put(p + "ln_2.bias", need("ln2.b").by_tp.front(), need("ln2.b").name);
      put(p + "mlp.c_fc.weight", fc1.t(), need("fc1.w").name);
      put(p + "mlp.c_fc.bias", whole("fc1.b"), need("fc1.b").name);
      put(p + "mlp.c_proj.weight", fc2.t(), need("fc2.w").name);
      put(p + "mlp.c_proj.bias", need("fc2.b").by_tp.front(), need("fc2.b").name);
    }
  }
  return c;
}

}  // namespace

void load_megatron_weights(Transformer& m, const MegatronCheckpoint& c) {
  at::NoGradGuard ng;
  std::vector<std::string> names;
  for (const auto& kv : c.weights) names.push_back(kv.first);
  const auto lookup = [&](const std::string& n) {
    auto it = c.weights.find(n);
    return it == c.weights.end() ? at::Tensor() : it->second;
  };
  for (auto* p : m.parameters()) {
    // A tensor-parallel slice's pieces are cut from the whole tensors.
    at::Tensor t = p->name.find('#') == std::string::npos ? lookup(p->name) : tp_resolve(p->name, lookup, names, m.config());
    if (!t.defined()) throw InputError(c.dir, "has no tensor for '" + p->name + "'");
    std::string base = p->name;
    int64_t h0 = 0, h1 = 0;
    parse_piece(p->name, &base, &h0, &h1);
    if (base == "wpe.weight" && t.dim() == 2 && t.size(0) > p->tensor.size(0)) t = t.narrow(0, 0, p->tensor.size(0));
    if (t.sizes() != p->tensor.sizes()) {
      auto from = c.origin.find(base);
      throw InputError(c.dir, "'" + (from == c.origin.end() ? base : from->second) + "' gives '" + p->name + "' shape " + shape_text(t.sizes()) +
                                  ", the model needs " + shape_text(p->tensor.sizes()));
    }
    p->tensor.copy_(t);
  }
}

}  // namespace alloy::model
