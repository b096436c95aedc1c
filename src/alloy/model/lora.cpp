#include "alloy/model/lora.h"

#include <fnmatch.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <set>
#include <stdexcept>

#include "alloy/core/error.h"

namespace alloy::model {

const std::vector<std::string>& adaptable_projections(const std::string& arch) {
  static const std::vector<std::string> gpt2 = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
  static const std::vector<std::string> llama = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                 "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                 "mlp.down_proj"};
  return arch == "llama" ? llama : gpt2;
}

namespace {
std::string block_prefix(const std::string& arch, int64_t i) {
  return (arch == "llama" ? "model.layers." : "h.") + std::to_string(i) + ".";
}
bool glob(const std::string& pattern, const std::string& s) { return ::fnmatch(pattern.c_str(), s.c_str(), 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
const char* kPeftPrefix = "base_model.model.";
}  // namespace

bool lora_matches(const std::vector<std::string>& patterns, const std::string& module) {
  for (const auto& p : patterns) {
    if (p == "all" || p == module || ends_with(module, "." + p)) return true;
    if (p.find_first_of("*?[") != std::string::npos && (glob(p, module) || glob("*." + p, module))) return true;
  }
  return false;
}

std::vector<std::string> lora_modules(const ModelConfig& m, const LoraConfig& l) {
  std::vector<std::string> out;
  if (!l.enabled()) return out;
  const auto patterns = l.target_list(m.arch);
  std::set<std::string> used;
  for (int64_t i = 0; i < m.layers; ++i)
    for (const auto& proj : adaptable_projections(m.arch)) {
      const std::string module = block_prefix(m.arch, i) + proj;
      for (const auto& p : patterns)
        if (lora_matches({p}, module)) used.insert(p);
      if (lora_matches(patterns, module)) out.push_back(module);
    }
  for (const auto& p : patterns)
    if (!used.count(p)) {
      std::string known;
      for (const auto& proj : adaptable_projections(m.arch)) known += (known.empty() ? "" : ", ") + proj;
      throw InputError("lora.targets", "'" + p + "' matches no projection of this " + m.arch + " model (its blocks have " +
                                           known + "; names, dotted suffixes, globs like mlp.* or 'all')");
    }
  return out;
}

bool is_adapter_name(const std::string& name) {
  const std::string n = name.substr(0, name.rfind('#'));  // a tensor-parallel piece: its whole parameter's name
  return ends_with(n, ".lora_A.weight") || ends_with(n, ".lora_B.weight");
}

std::string weight_module(const std::string& name) {
  const std::string suffix = ".weight";
  return name.size() > suffix.size() && ends_with(name, suffix) ? name.substr(0, name.size() - suffix.size()) : std::string();
}

int64_t lora_in_features(const ModelConfig& m, const std::string& module, int64_t block) {
  const std::string prefix = block_prefix(m.arch, block);
  if (module.rfind(prefix, 0) != 0) return 0;
  const std::string proj = module.substr(prefix.size());
  if (proj == "mlp.c_proj" || proj == "mlp.down_proj") return m.ffn_resolved();
  if (proj == "self_attn.o_proj") return m.heads * m.head_dim();
  return m.hidden;
}

std::string peft_name(const std::string& arch, const std::string& adapter_param) {
  return kPeftPrefix + std::string(arch == "gpt2" ? "transformer." : "") + adapter_param;
}

std::string from_peft_name(const std::string& arch, const std::string& peft) {
  const std::string prefix = kPeftPrefix + std::string(arch == "gpt2" ? "transformer." : "");
  if (peft.rfind(prefix, 0) != 0) return "";
  std::string n = peft.substr(prefix.size());
  // PEFT before 0.7 kept the adapter's name inside ("lora_A.default.weight") in some paths.
  for (const char* ab : {".lora_A.default.weight", ".lora_B.default.weight"}) {
    const std::string s = ab;
    if (ends_with(n, s)) n = n.substr(0, n.size() - s.size()) + s.substr(0, 7) + ".weight";
  }
  return is_adapter_name(n) && n.find('#') == std::string::npos ? n : "";
}

nlohmann::json peft_adapter_config(const ModelConfig& m, const LoraConfig& l, const std::string& base_model) {
  // target_modules as block-relative names: PEFT matches each as a dotted suffix of the module name,
  // which selects exactly the projections adapted here, whatever patterns chose them.
  std::set<std::string> rel;
  const auto& projs = adaptable_projections(m.arch);
  for (const auto& module : lora_modules(m, l))
    for (const auto& p : projs)
      if (ends_with(module, "." + p)) rel.insert(p);
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base_model},
          {"r", l.rank},
          {"lora_alpha", l.alpha},
          {"lora_dropout", l.dropout},
          {"target_modules", std::vector<std::string>(rel.begin(), rel.end())},
          {"fan_in_fan_out", m.arch == "gpt2"},  // GPT-2's Conv1D stores W as [in, out]
          {"bias", "none"},
          {"modules_to_save", nullptr},
          {"init_lora_weights", true},
          {"inference_mode", true},
          {"use_rslora", l.rslora},
          {"use_dora", false},
          {"layers_to_transform", nullptr},
          {"layers_pattern", nullptr},
          {"rank_pattern", nlohmann::json::object()},
          {"alpha_pattern", nlohmann::json::object()},
          {"revision", nullptr}};
}

const std::vector<float>& nf4_levels() {
  static const std::vector<float> v = {-1.0f,
                                       -0.6961928009986877f,
                                       -0.5250730514526367f,
                                       -0.39491748809814453f,
                                       -0.28444138169288635f,
                                       -0.18477343022823334f,
                                       -0.09105003625154495f,
                                       0.0f,
                                       0.07958029955625534f,
                                       0.16093020141124725f,
                                       0.24611230194568634f,
                                       0.33791524171829224f,
                                       0.44070982933044434f,
                                       0.5626170039176941f,
                                       0.7229568362236023f,
                                       1.0f};
  return v;
}

int64_t QuantizedWeight::numel() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

int64_t QuantizedWeight::bytes() const {
  int64_t b = 0;
  for (const at::Tensor* t : {&codes, &scales, &qscales, &scale2})
    if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  return b;
}

namespace {
at::Tensor block_absmax(const QuantizedWeight& q) {
  if (!q.qscales.defined()) return q.scales;
  const int64_t nb = (q.numel() + q.block - 1) / q.block;
  auto deq = q.qscales.to(at::kFloat).view({-1, kNf4ScaleBlock}) * (q.scale2.unsqueeze(1) / 127.0);
  return deq.reshape({-1}).narrow(0, 0, nb) + q.scale_mean;
}
}  // namespace

at::Tensor QuantizedWeight::dequantize(at::ScalarType dtype) const {
  at::NoGradGuard ng;
  if (kind == "int8") {
    std::vector<int64_t> view(shape.size(), 1);
    view[static_cast<size_t>(channel_dim)] = shape[static_cast<size_t>(channel_dim)];
    return (codes.to(at::kFloat) * (scales / 127.0).view(view)).to(dtype);
  }
  const int64_t n = numel();
  // One lookup per byte: a table of the 256 code pairs (high nibble first) gives both values.
  static const at::Tensor pairs = [] {
    const auto& lv = nf4_levels();
    std::vector<float> t(512);
    for (int b = 0; b < 256; ++b) t[2 * b] = lv[b >> 4], t[2 * b + 1] = lv[b & 15];
    return at::tensor(t).view({256, 2});
  }();
  const at::Tensor& table = codes.device() == pairs.device() ? pairs : pairs.to(codes.device());
  auto vals = table.index_select(0, codes.to(at::kLong)).view({-1, block}) * block_absmax(*this).unsqueeze(1);
  return vals.reshape({-1}).narrow(0, 0, n).view(shape).to(dtype);
}

void QuantizedWeight::to(const at::Device& d) {
  for (at::Tensor* t : {&codes, &scales, &qscales, &scale2})
    if (t->defined()) *t = t->to(d);
}

std::shared_ptr<QuantizedWeight> quantize(const at::Tensor& w_in, const std::string& kind, int64_t channel_dim,
                                          bool double_quant) {
  at::NoGradGuard ng;
  auto q = std::make_shared<QuantizedWeight>();
  at::Tensor w = w_in.detach().to(at::kFloat);
  q->kind = kind;
  q->shape.assign(w.sizes().begin(), w.sizes().end());
  q->channel_dim = channel_dim;
  if (kind == "int8") {
    std::vector<int64_t> other;
    for (int64_t d = 0; d < w.dim(); ++d)
      if (d != channel_dim) other.push_back(d);
    auto amax = w.abs().amax(other, true).clamp_min(1e-12);
    q->codes = at::round(w / amax * 127.0).clamp(-127, 127).to(at::kChar);
    q->scales = amax.reshape({-1}).contiguous();
    return q;
  }
  if (kind != "nf4") throw InputError("lora.base_dtype", "unknown quantization '" + kind + "' (int8 or nf4)");
  const int64_t n = w.numel(), nb = (n + kNf4Block - 1) / kNf4Block;
  auto flat = at::zeros({nb * kNf4Block}, w.options());
  flat.narrow(0, 0, n).copy_(w.reshape({-1}));
  auto blocks = flat.view({nb, kNf4Block});
  auto absmax = blocks.abs().amax({1}).clamp_min(1e-12);
  auto normed = blocks / absmax.unsqueeze(1);
  // Nearest level: bucketize by the midpoints between neighbouring levels.
  const auto& lv = nf4_levels();
  std::vector<float> mids;
  for (size_t i = 0; i + 1 < lv.size(); ++i) mids.push_back(0.5f * (lv[i] + lv[i + 1]));
  auto idx = at::bucketize(normed, at::tensor(mids, w.options())).to(at::kByte).reshape({-1, 2});
  q->codes = at::bitwise_or(at::bitwise_left_shift(idx.select(1, 0), 4), idx.select(1, 1)).contiguous();
  if (!double_quant) {
    q->scales = absmax.contiguous();
    return q;
  }
  q->scale_mean = absmax.mean().item<double>();
  const int64_t ns = (nb + kNf4ScaleBlock - 1) / kNf4ScaleBlock;
  auto centred = at::zeros({ns * kNf4ScaleBlock}, w.options());
  centred.narrow(0, 0, nb).copy_(absmax - q->scale_mean);
  auto sb = centred.view({ns, kNf4ScaleBlock});
  q->scale2 = sb.abs().amax({1}).clamp_min(1e-12).contiguous();
  q->qscales = at::round(sb / q->scale2.unsqueeze(1) * 127.0).clamp(-127, 127).to(at::kChar).reshape({-1}).contiguous();
  return q;
}

namespace {
// The run length of nf4_run for BLK, each element's block in the whole.
int64_t run_of_blocks(const at::Tensor& blk, int64_t block) {
  const int64_t n = blk.numel();
  for (int64_t g = block; g >= 2; g /= 2) {
    if (n % g != 0 || block % g != 0) continue;
    const at::Tensor rows = blk.view({-1, g});
    if (rows.eq(rows.select(1, 0).unsqueeze(1)).all().item<bool>()) return g;
  }
  return 0;
}
}  // namespace

int64_t nf4_run(const at::Tensor& index, int64_t block) {
  return run_of_blocks(index.reshape({-1}).to(at::kLong).div(block, "floor"), block);
}

std::shared_ptr<QuantizedWeight> quantized_part(const QuantizedWeight& whole, const at::Tensor& index) {
  at::NoGradGuard ng;
  auto q = std::make_shared<QuantizedWeight>();
  q->kind = whole.kind;
  q->shape.assign(index.sizes().begin(), index.sizes().end());
  q->channel_dim = whole.channel_dim;
  const at::Tensor flat = index.reshape({-1}).to(whole.codes.device(), at::kLong);
  if (whole.kind == "int8") {
    if (whole.shape.size() != 2 || index.dim() != 2)
      throw std::invalid_argument("quantized_part: int8 parts are cut from matrices");
    q->codes = whole.codes.reshape({-1}).index_select(0, flat).view(index.sizes()).contiguous();
    // Each element's output channel in WHOLE; along the part's channel dimension they are the
    // part's channels (a rectangular cut), so one row of them is its scale vector.
    const int64_t cols = whole.shape[1];
    const at::Tensor channel = (whole.channel_dim == 1 ? flat.remainder(cols) : flat.div(cols, "floor")).view(index.sizes());
    q->scales = whole.scales.index_select(0, channel.select(1 - whole.channel_dim, 0).contiguous()).contiguous();
    return q;
  }
  // nf4: each element's code (high nibble first in a byte), and its block in WHOLE.
  const at::Tensor bytes = whole.codes.reshape({-1}).index_select(0, flat.div(2, "floor"));
  const at::Tensor high = flat.remainder(2).eq(0);
  const at::Tensor codes = at::where(high, at::bitwise_right_shift(bytes, 4), at::bitwise_and(bytes, 15)).to(at::kByte);
  const at::Tensor blk = flat.div(whole.block, "floor");
  const int64_t run = run_of_blocks(blk, whole.block);
  if (run == 0)
    throw std::invalid_argument("a piece of an nf4 weight of shape [" + std::to_string(whole.shape.front()) + ", " +
                                std::to_string(whole.shape.back()) + "] whose elements share no run of 2 or more of one " +
                                std::to_string(whole.block) +
                                "-element block (it starts at an odd column, or is an odd number of columns wide): use a "
                                "tp_split whose pieces start at even columns of every split weight, or lora.base_dtype int8");
  q->block = run;
  const at::Tensor pairs = codes.view({-1, 2});
  q->codes = at::bitwise_or(at::bitwise_left_shift(pairs.select(1, 0), 4), pairs.select(1, 1)).contiguous();
  q->scales = block_absmax(whole).index_select(0, blk.view({-1, run}).select(1, 0).contiguous()).contiguous();
  return q;
}

namespace {
struct QuantizedMatmul : torch::autograd::Function<QuantizedMatmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t q_ptr, bool w_in_out) {
    ctx->saved_data["q"] = q_ptr;
    ctx->saved_data["in_out"] = w_in_out;
    const auto* q = reinterpret_cast<const QuantizedWeight*>(static_cast<intptr_t>(q_ptr));
    at::Tensor w = q->dequantize(x.scalar_type());  // freed when the forward returns
    return w_in_out ? at::matmul(x, w) : at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto* q = reinterpret_cast<const QuantizedWeight*>(static_cast<intptr_t>(ctx->saved_data["q"].toInt()));
    const bool in_out = ctx->saved_data["in_out"].toBool();
    at::Tensor w = q->dequantize(grads[0].scalar_type());
    at::Tensor gx = in_out ? at::matmul(grads[0], w.t()) : at::matmul(grads[0], w);
    return {gx, at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor quantized_matmul(const at::Tensor& x, const std::shared_ptr<QuantizedWeight>& q, bool w_in_out) {
  // The model owns Q and outlives every graph built through it.
  return QuantizedMatmul::apply(x, static_cast<int64_t>(reinterpret_cast<intptr_t>(q.get())), w_in_out);
}

namespace {
thread_local const DropoutKeys* t_dropout_keys = nullptr;

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
// FNV-1a: the same on every platform, unlike std::hash.
uint64_t name_hash(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ULL;
  return h;
}
}  // namespace

DropoutScope::DropoutScope(const DropoutKeys* keys) : prev_(t_dropout_keys) { t_dropout_keys = keys; }
DropoutScope::~DropoutScope() { t_dropout_keys = prev_; }
const DropoutKeys* DropoutScope::current() { return t_dropout_keys; }

at::Tensor lora_dropout(const at::Tensor& x, double p, bool training, const std::string& module, const at::Tensor& cols, int64_t c_full) {
  if (!training || !(p > 0)) return x;
  const DropoutKeys* k = t_dropout_keys;
  if (!k) return at::dropout(x, p, true);
  const int64_t rows = static_cast<int64_t>(k->samples.size()), C = x.size(-1);
  // [rows, T, C] or flattened [rows * T, C]: sample-major either way.
  const bool batched = x.dim() >= 3;
  if (rows == 0 || (batched ? x.size(0) != rows : x.dim() != 2 || x.size(0) % rows != 0))
    throw std::logic_error("lora_dropout: an input of shape " + c10::str(x.sizes()) + " is not the micro-batch's " + std::to_string(rows) +
                           " samples");
  const int64_t positions = x.numel() / (rows * C);
  const int64_t full = cols.defined() ? c_full : C;
  const uint64_t base = splitmix(splitmix(k->seed ^ 0x4C6F526144726F70ULL) ^ static_cast<uint64_t>(k->step)) ^ name_hash(module);
  // On the CPU a fresh mt19937 per sample; on an accelerator its own generator, cloned and
  // reseeded per sample, so masks are drawn where X lives (a CPU draw copied over would cost a
  // host-to-device copy of every mask). Keys give the same masks on every device of one kind; a
  // CPU rank and a GPU rank draw different (equally keyed) ones.
  const bool cpu = x.device().is_cpu();
  const at::TensorOptions opts = x.options().dtype(at::kFloat);
  const at::Tensor where = cols.defined() ? cols.to(x.device()) : at::Tensor();
  std::vector<at::Tensor> masks;
  masks.reserve(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t key = splitmix(base ^ splitmix(static_cast<uint64_t>(k->samples[static_cast<size_t>(r)])));
    at::Generator g;
    if (cpu) {
      g = at::detail::createCPUGenerator(key);
    } else {
      at::Generator device_default = at::globalContext().defaultGenerator(x.device());
      {
        std::lock_guard<std::mutex> lock(device_default.mutex());  // other threads may draw from it meanwhile
        g = device_default.clone();
      }
      g.set_current_seed(key);  // the clone is this call's alone
    }
    at::Tensor m = at::empty({positions, full}, opts).bernoulli_(1.0 - p, g);
    masks.push_back(where.defined() ? m.index_select(1, where) : m);
  }
  const at::Tensor mask = at::stack(masks).view(x.sizes()).to(x.scalar_type()) * (1.0 / (1.0 - p));
  return x * mask;
}

}  // namespace alloy::model
