#include "alloy/model/weights.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"

namespace alloy::model {
namespace {
std::string st_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: throw Error(std::string("no safetensors dtype for ") + c10::toString(t));
  }
}
at::ScalarType torch_dtype(const std::string& d, const std::string& where) {
  if (d == "F32") return at::kFloat;
  if (d == "F64") return at::kDouble;
  if (d == "F16") return at::kHalf;
  if (d == "BF16") return at::kBFloat16;
  if (d == "I64") return at::kLong;
  if (d == "I32") return at::kInt;
  if (d == "I16") return at::kShort;
  if (d == "I8") return at::kChar;
  if (d == "U8") return at::kByte;
  if (d == "BOOL") return at::kBool;
  throw InputError(where, "dtype " + d + " is not supported by LibTorch here");
}
std::string shape_str(at::IntArrayRef s) { return std::string(c10::str(s)); }
}  // namespace

TensorBlob to_blob(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  TensorBlob b;
  b.dtype = st_dtype(c.scalar_type());
  b.shape.assign(c.sizes().begin(), c.sizes().end());
  b.data.assign(static_cast<const char*>(c.data_ptr()), c.nbytes());
  return b;
}

at::Tensor from_blob(const TensorBlob& b, const std::string& where) {
  at::Tensor t = at::empty(b.shape, at::TensorOptions().dtype(torch_dtype(b.dtype, where)));
  if (t.nbytes() != b.data.size()) throw InputError(where, "tensor data size disagrees with its shape");
  std::memcpy(t.data_ptr(), b.data.data(), b.data.size());
  return t;
}

at::Tensor read_tensor(const SafetensorsFile& f, const std::string& name) {
  const TensorInfo& info = f.info(name);
  std::string where = f.path() + ": tensor '" + name + "'";
  at::Tensor t = at::empty(info.shape, at::TensorOptions().dtype(torch_dtype(info.dtype, where)));
  auto bytes = f.bytes(name);
  if (t.nbytes() != bytes.size()) throw InputError(where, "data size disagrees with its shape");
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::map<std::string, at::Tensor> read_all(const SafetensorsFile& f) {
  std::map<std::string, at::Tensor> out;
  for (const auto& n : f.names()) out[n] = read_tensor(f, n);
  return out;
}

void save_weights(const Transformer& m, const std::string& path, const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, TensorBlob>> blobs;
  for (const auto* p : m.parameters()) blobs.emplace_back(p->name, to_blob(p->tensor));
  write_safetensors(path, blobs, metadata);
}

namespace {
// HuggingFace files sometimes prefix GPT-2 names with "transformer." and carry buffers (causal
// masks) or a duplicate tied lm_head; those are not weights of ours.
std::string file_name_for(const SafetensorsFile& f, const std::string& name) {
  if (f.has(name)) return name;
  if (f.has("transformer." + name)) return "transformer." + name;
  return "";
}
bool ends_with(const std::string& n, const std::string& s) { return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0; }
bool ignorable_extra(const std::string& arch, const std::string& n) {
  if (arch == "gpt2") return ends_with(n, ".attn.bias") || ends_with(n, ".attn.masked_bias") || n == "lm_head.weight";
  return ends_with(n, "rotary_emb.inv_freq");
}
}  // namespace

void load_weights(Transformer& m, const std::vector<const SafetensorsFile*>& files, bool allow_extra) {
  at::NoGradGuard ng;
  if (files.empty()) throw Error("load_weights: no file");
  const std::string where = files.size() == 1 ? files.front()->path()
                                              : files.front()->path() + " and " + std::to_string(files.size() - 1) + " more shard(s)";
  std::vector<std::set<std::string>> used(files.size());
  // A projection's bias is a weight the model would compute without, not an extra to pass over:
  // q, k and v's are Qwen2's (model.qkv_bias); o_proj's and the MLP's (HF's attention_bias,
  // mlp_bias) Alloy's llama does not compute.
  if (m.config().arch == "llama")
    for (const auto* f : files)
      for (const auto& n : f->names()) {
        if (!ends_with(n, "_proj.bias")) continue;
        const bool qkv = ends_with(n, "self_attn.q_proj.bias") || ends_with(n, "self_attn.k_proj.bias") || ends_with(n, "self_attn.v_proj.bias");
        if (qkv && !m.config().qkv_bias)
          throw InputError(f->path(), "tensor '" + n + "' is a q/k/v bias (a Qwen2 checkpoint): set model.qkv_bias: true, or import it "
                                      "with `alloy import --weights` beside its config.json");
        if (!qkv)
          throw InputError(f->path(), "tensor '" + n + "' is a bias Alloy's llama does not compute (HF's attention_bias or mlp_bias; "
                                      "only q, k and v may have biases, model.qkv_bias)");
      }
  for (auto* p : m.parameters()) {
    size_t k = 0;
    std::string fname;
    for (; k < files.size() && fname.empty(); ++k) fname = file_name_for(*files[k], p->name);
    if (fname.empty() && p->name == "lm_head.weight" && m.config().arch == "llama") {
      // A tied checkpoint (tie_word_embeddings: Llama 3.2 1B and 3B) stores the embedding once;
      // Alloy's llama has a head of its own, which starts as that copy and trains apart from it.
      bool tied = false;
      for (const auto* f : files)
        if (!tied && f->has("model.embed_tokens.weight") && at::IntArrayRef(f->info("model.embed_tokens.weight").shape) == p->tensor.sizes()) {
          p->tensor.copy_(read_tensor(*f, "model.embed_tokens.weight"));
          log_info(where + " ties lm_head to the embedding (no lm_head.weight): lm_head starts as its copy and trains apart from it");
          tied = true;
        }
      if (tied) continue;
    }
    if (fname.empty())
      throw InputError(where, "tensor '" + p->name + "' is missing (is this a checkpoint of another model?)");
    const SafetensorsFile& f = *files[k - 1];
    const TensorInfo& info = f.info(fname);
    if (at::IntArrayRef(info.shape) != p->tensor.sizes())
      throw InputError(f.path(), "tensor '" + fname + "' has shape " + shape_str(info.shape) + ", the model needs " +
                                     shape_str(p->tensor.sizes()) + " (is this a checkpoint of another model?)");
    p->tensor.copy_(read_tensor(f, fname));
    used[k - 1].insert(fname);
  }
  if (!allow_extra) {
    for (size_t k = 0; k < files.size(); ++k)
      for (const auto& n : files[k]->names())
        if (!used[k].count(n) && !ignorable_extra(m.config().arch, n))
          throw InputError(files[k]->path(), "tensor '" + n + "' does not belong to a " + m.config().arch + " model of this shape");
  }
}

void load_weights(Transformer& m, const SafetensorsFile& f, bool allow_extra) { load_weights(m, {&f}, allow_extra); }

std::vector<std::string> hf_weight_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::string index = path;
  if (fs::is_directory(path)) {
    index = path + "/model.safetensors.index.json";
    if (!fs::exists(index)) {
      if (fs::exists(path + "/model.safetensors")) return {path + "/model.safetensors"};
      throw InputError(path, "holds neither model.safetensors nor model.safetensors.index.json (nor an Alloy checkpoint)");
    }
  }
  const std::string name = fs::path(index).filename().string();
  if (name.size() < 5 || name.compare(name.size() - 5, 5, ".json") != 0) return {path};
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(index));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(index, std::string("is not JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() || j["weight_map"].empty())
    throw InputError(index, "weight_map: must be an object naming each tensor's shard file");
  const fs::path dir = fs::path(index).parent_path();
  std::vector<std::string> files;
  for (const auto& [tensor, shard] : j["weight_map"].items()) {
    if (!shard.is_string()) throw InputError(index, "weight_map." + tensor + ": must be a file name, got " + shard.dump());
    const std::string f = (dir / shard.get<std::string>()).string();
    if (std::find(files.begin(), files.end(), f) != files.end()) continue;
    if (!fs::exists(f)) throw InputError(index, "weight_map." + tensor + ": its shard " + f + " does not exist");
    files.push_back(f);
  }
  return files;
}

nlohmann::json hf_config(const ModelConfig& m) {
  nlohmann::json j;
  if (m.arch == "gpt2") {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"n_layer", m.layers},
         {"n_head", m.heads},
         {"n_embd", m.hidden},
         {"n_positions", m.seq_len},
         {"n_ctx", m.seq_len},
         {"n_inner", m.ffn_resolved()},
         {"vocab_size", m.vocab_size},
         {"layer_norm_epsilon", m.norm_eps},
         {"activation_function", "gelu_new"},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"initializer_range", m.init_std},
         {"tie_word_embeddings", true}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"hidden_size", m.hidden},
         {"intermediate_size", m.ffn_resolved()},
         {"num_hidden_layers", m.layers},
         {"num_attention_heads", m.heads},
         {"num_key_value_heads", m.kv_heads_resolved()},
         {"rms_norm_eps", m.norm_eps},
         {"rope_theta", m.rope_theta},
         {"max_position_embeddings", m.seq_len},
         {"vocab_size", m.vocab_size},
         {"hidden_act", "silu"},
         {"initializer_range", m.init_std},
         {"tie_word_embeddings", false}};
    if (m.qkv_bias) {  // HF's class for this block is Qwen2's
      j["architectures"] = {"Qwen2ForCausalLM"};
      j["model_type"] = "qwen2";
      j["use_sliding_window"] = false;
    }
  }
  j["torch_dtype"] = m.dtype;
  return j;
}

ModelConfig model_config_from_hf(const nlohmann::json& j, const std::string& where) {
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) throw InputError(where, std::string("key '") + key + "' is missing");
    return j.at(key);
  };
  ModelConfig m;
  std::string type = j.value("model_type", "");
  try {
    if (type == "gpt2") {
      m.arch = "gpt2";
      m.layers = need("n_layer").get<int64_t>();
      m.heads = need("n_head").get<int64_t>();
      m.hidden = need("n_embd").get<int64_t>();
      m.seq_len = need("n_positions").get<int64_t>();
      m.vocab_size = need("vocab_size").get<int64_t>();
      m.norm_eps = j.value("layer_norm_epsilon", 1e-5);
      if (j.contains("n_inner") && !j["n_inner"].is_null()) m.ffn = j["n_inner"].get<int64_t>();
    } else if (type == "llama" || type == "qwen2") {
      // Qwen2 is LLaMA's block with biases on q, k and v (and no other key Alloy computes
      // differently unless it turns on the sliding window, refused below).
      m.arch = "llama";
      m.qkv_bias = type == "qwen2";
      if (m.qkv_bias && j.value("use_sliding_window", false))
        throw InputError(where, "use_sliding_window: true is not supported (Alloy's attention sees the whole sequence)");
      m.hidden = need("hidden_size").get<int64_t>();
      m.ffn = need("intermediate_size").get<int64_t>();
      m.layers = need("num_hidden_layers").get<int64_t>();
      m.heads = need("num_attention_heads").get<int64_t>();
      m.kv_heads = j.value("num_key_value_heads", m.heads);
      m.norm_eps = j.value("rms_norm_eps", 1e-6);
      m.rope_theta = j.value("rope_theta", 10000.0);
      m.seq_len = need("max_position_embeddings").get<int64_t>();
      m.vocab_size = need("vocab_size").get<int64_t>();
      // What Alloy's llama block does not compute is refused by its key rather than loaded into a
      // model that would run other math (Llama 3.1's rope_scaling, Qwen-style biases, ...).
      if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
        throw InputError(where, "rope_scaling: " + j["rope_scaling"].dump() +
                                    " is not supported (Alloy's RoPE uses rope_theta alone); a model trained with it would run "
                                    "with other positions");
      for (const char* key : {"attention_bias", "mlp_bias"})
        if (j.value(key, false))
          throw InputError(where, std::string(key) + ": true is not supported (Alloy's llama blocks have biases only on q, k and v: "
                                                      "Qwen2's, model.qkv_bias)");
      if (j.value("hidden_act", std::string("silu")) != "silu")
        throw InputError(where, "hidden_act: '" + j["hidden_act"].get<std::string>() + "' is not supported (Alloy's llama MLP is SwiGLU, silu)");
      if (j.contains("head_dim") && !j["head_dim"].is_null() && m.heads > 0 && j["head_dim"].get<int64_t>() * m.heads != m.hidden)
        throw InputError(where, "head_dim: " + j["head_dim"].dump() + " x " + std::to_string(m.heads) +
                                    " heads is not hidden_size " + std::to_string(m.hidden) + " (Alloy's heads split the hidden size)");
    } else {
      throw InputError(where, "model_type '" + type + "' is not supported (gpt2, llama or qwen2)");
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where, std::string("ill-typed value: ") + e.what());
  }
  m.init_std = j.value("initializer_range", 0.02);
  if (j.value("torch_dtype", "float32") == "float64") m.dtype = "float64";
  return m;
}

}  // namespace alloy::model
