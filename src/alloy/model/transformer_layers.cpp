// The layers a Transformer is built of (GPT-2's and LLaMA's embedding, blocks and head, with
// attention, norms and tensor-parallel pieces) and the constructor that builds a slice from them:
// the architectures' own code, apart from transformer.cpp's model-level code (layer ranges,
// running a slice, the loss, parameters and their names), which is the same for every one.
#include "alloy/model/transformer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <torch/version.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "alloy/model/deferred_weights.h"
#include "alloy/model/gelu.h"
#include "alloy/model/lora.h"
#include "alloy/model/recompute.h"
#include "alloy/model/tensor_parallel.h"

namespace alloy::model {

namespace {

// Weights are drawn on the CPU in float32 from a per-layer generator in a fixed order, then cast,
// so the same seed gives the same model on any device and in either dtype.
class Init {
 public:
  Init(uint64_t seed, at::ScalarType dtype) : gen_(at::detail::createCPUGenerator(seed)), dtype_(dtype) {}
  at::Tensor normal(at::IntArrayRef shape, double std) {
    return at::empty(shape, at::kFloat).normal_(0.0, std, gen_).to(dtype_);
  }
  at::Tensor fill(at::IntArrayRef shape, double v) { return at::full(shape, v, at::TensorOptions().dtype(dtype_)); }

 private:
  at::Generator gen_;
  at::ScalarType dtype_;
};

// Cached per (sequence length, device): the causal mask and the RoPE tables.
struct Shared {
  const ModelConfig* cfg;
  at::ScalarType dtype;
  int64_t mask_len = -1;
  at::Tensor mask;  // [T, T] additive: 0 on and below the diagonal, -inf above (future positions)
  int64_t rope_len = -1;
  at::Tensor cos, sin;        // [T, head_dim]
  at::Tensor cos_as, sin_as;  // the same in another dtype (rope_as)

  const at::Tensor& causal_mask(int64_t T, const at::Device& dev) {
    if (T != mask_len || mask.device() != dev) {
      mask = at::full({T, T}, -std::numeric_limits<double>::infinity(), at::TensorOptions().dtype(dtype).device(dev)).triu(1);
      mask_len = T;
    }
    return mask;
  }
  void rope(int64_t T, const at::Device& dev) {
    if (T == rope_len && cos.device() == dev) return;
    int64_t hd = cfg->head_dim();
    auto opts = at::TensorOptions().dtype(dtype).device(dev);
    auto inv_freq = 1.0 / at::pow(cfg->rope_theta, at::arange(0, hd, 2, at::TensorOptions().dtype(at::kLong).device(dev)).to(dtype) / hd);
    auto t = at::arange(T, opts);
    auto freqs = at::outer(t, inv_freq);
    auto emb = at::cat({freqs, freqs}, -1);
    cos = emb.cos();
    sin = emb.sin();
    cos_as = sin_as = at::Tensor();
    rope_len = T;
  }
  // The tables in the projections' dtype, as HF's LLaMA applies them: under autocast q and k are
  // bf16/fp16, and an fp32 table would promote the rotation to fp32 (twice the bytes each way).
  std::pair<at::Tensor, at::Tensor> rope_as(at::ScalarType t) {
    if (t == cos.scalar_type()) return {cos, sin};
    if (!cos_as.defined() || cos_as.scalar_type() != t) {
      cos_as = cos.to(t);
      sin_as = sin.to(t);
    }
    return {cos_as, sin_as};
  }
};

// LibTorch 2.x's fused kernels: attention (flash / memory-efficient on CUDA, a flash kernel on the
// CPU: the [T, T] scores never exist in memory) and RMSNorm. ALLOY_ATTENTION=math keeps the
// written-out paths: for comparisons (bench/gpu_bench.py measures both), and for CUDA runs that
// must replay bit for bit (the fused attention's backward accumulates with atomics on CUDA).
bool use_fused_kernels() {
#if TORCH_VERSION_MAJOR >= 2
  static const bool fused = [] {
    const char* e = std::getenv("ALLOY_ATTENTION");
    return !(e && std::string(e) == "math");
  }();
  return fused;
#else
  return false;
#endif
}

// LibTorch 2.5's scaled_dot_product_attention takes grouped key/value heads as they are (enable_gqa).
#define ALLOY_SDPA_GQA (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5))

// Whether the fused attention shares grouped key/value heads itself (attention() below).
bool fused_gqa() {
#if ALLOY_SDPA_GQA
  return use_fused_kernels();
#else
  return false;
#endif
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Shared& sh) {
  // q, k, v [B, nh, T, hd] -> [B, nh, T, hd], causal, scaled by 1/sqrt(hd).
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
#if TORCH_VERSION_MAJOR >= 2
#if ALLOY_SDPA_GQA
  // Fewer key/value heads than query heads reach here only when the kernel shares them itself
  // (fused_gqa): no [B, nh, T, hd] copies of k and v.
  if (k.size(1) != nh)
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
                                            /*enable_gqa=*/true);
#endif
  if (use_fused_kernels()) return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#endif
  // One baddbmm applies the scale and the additive causal mask inside the product: the separate
  // scale and masked_fill passes over the [T, T] scores (and their two backward passes) go away.
  const at::Tensor& mask = sh.causal_mask(T, q.device());
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  auto q3 = q.reshape({B * nh, T, hd}), k3 = k.reshape({B * nh, T, hd}), v3 = v.reshape({B * nh, T, hd});
  auto att = at::softmax(at::baddbmm(mask, q3, k3.transpose(1, 2), 1.0, scale), -1);
  return at::bmm(att, v3).view({B, nh, T, hd});
}

// Token ids through the embedding rows a layer holds: the group's sum under vocabulary parallelism.
at::Tensor embed(const Layer& l, const at::Tensor& ids, const SeqSplit& seq) {
  if (l.vocab_comm()) return vocab_parallel_embedding(l.vocab_rows(), ids, l.vocab_first_row(), l.vocab_comm(), seq);
  return at::embedding(l.vocab_rows(), ids);
}

class Gpt2Embedding : public Layer {
 public:
  Gpt2Embedding(const ModelConfig& c, Init& init, const TpLayout* tp) {
    add("wte.weight", init.normal({c.vocab_size, c.hidden}, c.init_std), true);
    add("wpe.weight", init.normal({c.seq_len, c.hidden}, c.init_std), true);
    split_vocab(0, tp, c);
  }
  at::Tensor forward(const at::Tensor& ids) override {
    // wpe stays last; under sequence parallelism this member's positions of it.
    const int64_t p0 = seq_ ? seq_.bounds[static_cast<size_t>(seq_.comm->rank())] : 0;
    const at::Tensor e = embed(*this, ids, seq_);
    return e + params_.back().tensor.narrow(0, p0, e.size(1));
  }
};

// A block, or one of its halves: every block draws all its weights in the same order whichever
// halves a slice keeps, so a half gets exactly the whole block's values; the other half's are
// dropped before anything sees them.
class BlockLayer : public Layer {
 public:
  bool is_block() const override { return true; }
  TpComm* tp_comm() const override { return comm_; }
  at::Tensor forward(const at::Tensor& x) override { return forward_halves(x, true, true); }
  at::Tensor forward_halves(const at::Tensor& x, bool attention, bool mlp) override {
    at::Tensor h = attn_ && attention ? attention_half(x) : x;
    return mlp_ && mlp ? mlp_half(h) : h;
  }

 protected:
  // The block's first ATTN_PARAMS parameters are its attention half's.
  void keep_halves(bool attn, bool mlp, size_t attn_params) {
    attn_ = attn;
    mlp_ = mlp;
    if (!attn) params_.erase(params_.begin(), params_.begin() + static_cast<std::ptrdiff_t>(attn_params));
    if (!mlp) params_.resize(attn_params);
    mlp0_ = attn ? attn_params : 0;
  }
  virtual at::Tensor attention_half(const at::Tensor& x) = 0;
  virtual at::Tensor mlp_half(const at::Tensor& x) = 0;
  size_t mlp0_ = 0;  // index of the MLP half's first parameter

  // Tensor parallelism (tensor_parallel.h): after keep_halves, stores the split parameters of
  // BLOCK as the pieces TP gives for it (those within this rank's heads) and makes w() / proj()
  // see logical parameters: what the code indexes as parameter I may be several pieces.
  void split_for_tp(const TpLayout* tp, int64_t block, const ModelConfig& c) {
    h0_ = 0, h1_ = c.heads, cfg_ = &c;
    if (!tp || !tp->splits(block)) return;
    if (tp->head_end > 0) h0_ = tp->head_begin, h1_ = tp->head_end, comm_ = tp->comm;
    cut_out_ = tp->cut_out.block == block && mlp_;
    cut_in_ = tp->cut_in.block == block && mlp_;
    std::vector<Param> out;
    for (auto& p : params_) {
      Logical L;
      L.kind = tp_param(p.name);
      const std::vector<int64_t> bounds = tp_piece_bounds(*tp, block, L.kind);
      const auto [held0, held1] = tp_held_heads(*tp, block, L.kind, c.heads);
      if (bounds.empty()) {
        L.idx = {out.size()};
        out.push_back(std::move(p));
      } else {
        for (size_t j = 0; j + 1 < bounds.size(); ++j) {
          if (bounds[j] < held0 || bounds[j + 1] > held1) continue;
          if (L.bounds.empty()) L.bounds.push_back(bounds[j]);
          L.bounds.push_back(bounds[j + 1]);
          L.idx.push_back(out.size());
          out.push_back({piece_name(p.name, bounds[j], bounds[j + 1]), tp_cut(p.tensor, L.kind, bounds[j], bounds[j + 1], c), p.decay});
        }
      }
      logical_.push_back(std::move(L));
    }
    params_ = std::move(out);
  }
  // Logical parameter I's values (its pieces joined when it has several).
  at::Tensor w(size_t i) const {
    if (logical_.empty()) return params_[i].tensor;
    const Logical& L = logical_[i];
    if (L.idx.size() == 1) return params_[L.idx[0]].tensor;
    std::vector<at::Tensor> ps;
    for (size_t j : L.idx) ps.push_back(params_[j].tensor);
    return tp_join(ps, L.bounds, L.kind, *cfg_);
  }
  at::Tensor proj(size_t i, const at::Tensor& x, const at::Tensor* bias) const {
    if (logical_.empty()) return project(i, x, bias);
    const Logical& L = logical_[i];
    at::Tensor y;
    if (L.idx.size() == 1) {
      y = project(L.idx[0], x, bias);
    } else {
      // Piece by piece, never through the joined weight: the backward would keep that copy of the
      // whole weight alive from the forward on (and a ZeRO-3 holder's freed pieces with it).
      const int out_dim = in_out_ ? 1 : 0;
      const auto product = [&](const at::Tensor& in, size_t j) {
        const Param& W = params_[j];
        if (W.quant) return quantized_matmul(in, W.quant, in_out_);
        // Each piece's gradient waits for the zb-h1 weight pass, as a whole weight's does (project).
        if (DeferredWeightGrads* d = DeferredWeightGrads::active();
            d && at::GradMode::is_enabled() && W.tensor.requires_grad() && in.requires_grad())
          return d->project(in, W.tensor, nullptr, in_out_);
        return in_out_ ? at::matmul(in, W.tensor) : at::linear(in, W.tensor);
      };
      if (L.kind.dim == out_dim) {  // column-parallel: each piece gives its heads' outputs
        std::vector<at::Tensor> outs;
        for (size_t j : L.idx) outs.push_back(product(x, j));
        y = tp_join(outs, L.bounds, TpParam{L.kind.kind, static_cast<int>(x.dim()) - 1}, *cfg_);
      } else {  // row-parallel: each piece reads its heads' inputs
        int64_t first = 0;
        for (size_t j : L.idx) {
          const Param& W = params_[j];
          const int64_t n = W.quant ? W.quant->shape[static_cast<size_t>(1 - out_dim)] : W.tensor.size(1 - out_dim);
          const at::Tensor part = product(x.narrow(-1, first, n), j);
          y = y.defined() ? y + part : part;
          first += n;
        }
      }
      if (bias) y = y + *bias;
    }
    if (L.lora_a < 0) return y;
    // Row-parallel: this rank's heads' part of the update, summed with the product's (tp_exit).
    const at::Tensor h = L.lora_dropout > 0 ? lora_dropout(x, L.lora_dropout, training_forward(), L.lora_module, L.lora_cols, L.lora_in) : x;
    return y + at::linear(at::linear(h, w(static_cast<size_t>(L.lora_a))), w(static_cast<size_t>(L.lora_b))) * L.lora_scale;
  }

 public:
  void add_adapters(const std::map<std::string, at::Tensor>& init_a, int64_t rank, double scale, double dropout) override {
    if (logical_.empty()) return Layer::add_adapters(init_a, rank, scale, dropout);
    // Pieces: a column-parallel weight (split along its outputs) gets B in the same pieces and A
    // whole; a row-parallel one (split along its inputs) A in pieces and B whole. A is drawn whole,
    // exactly as without tensor parallelism, then cut.
    const int out_dim = in_out_ ? 1 : 0;
    const size_t n = logical_.size();
    for (size_t i = 0; i < n; ++i) {
      std::string base = params_[logical_[i].idx[0]].name;
      int64_t h0 = 0, h1 = 0;
      parse_piece(base, &base, &h0, &h1);
      const std::string stem = weight_module(base);
      auto drawn = init_a.find(stem);
      if (drawn == init_a.end()) continue;
      const at::Tensor like = params_[logical_[i].idx[0]].tensor;  // a handle: add() below moves params_
      const at::Tensor a = drawn->second.to(like.device(), like.scalar_type());
      const TpParam k = logical_[i].kind;
      const bool row = k.kind != TpKind::None && k.dim != out_dim, column = k.kind != TpKind::None && !row;
      const auto add_factor = [&](const std::string& name, bool split, const auto& make) {  // make(piece)
        Logical F;
        F.kind = split ? tp_param(name) : TpParam{};
        const std::vector<size_t> idx = logical_[i].idx;
        for (size_t j = 0; j < (split ? idx.size() : 1); ++j) {
          F.idx.push_back(params_.size());
          const std::string pname = split ? piece_name(name, logical_[i].bounds[j], logical_[i].bounds[j + 1]) : name;
          add(pname, make(j).requires_grad_(true), false);  // no decay: see add_adapter
          params_.back().tp_partial = !split && comm_ != nullptr && k.kind != TpKind::None;
        }
        if (split) F.bounds = logical_[i].bounds;
        logical_.push_back(std::move(F));
        return static_cast<int64_t>(logical_.size() - 1);
      };
      const int64_t la = add_factor(stem + ".lora_A.weight", row, [&](size_t j) {
        return row ? tp_cut(a, {k.kind, 1}, logical_[i].bounds[j], logical_[i].bounds[j + 1], *cfg_) : a.clone();
      });
      const int64_t lb = add_factor(stem + ".lora_B.weight", column, [&](size_t j) {
        const at::Tensor& wj = params_[logical_[i].idx[column ? j : 0]].tensor;
        return at::zeros({wj.size(out_dim), rank}, wj.options().requires_grad(false));
      });
      Logical& L = logical_[i];
      L.lora_a = la, L.lora_b = lb, L.lora_scale = scale, L.lora_dropout = dropout;
      L.lora_module = stem;
      if (row) {  // this member reads these columns of the whole input: its dropout masks' columns
        L.lora_in = a.size(1);
        const at::Tensor all = at::arange(L.lora_in, at::kLong).view({1, L.lora_in});
        std::vector<at::Tensor> cols;
        for (size_t j = 0; j + 1 < L.bounds.size(); ++j) cols.push_back(tp_cut(all, {k.kind, 1}, L.bounds[j], L.bounds[j + 1], *cfg_).reshape({-1}));
        L.lora_cols = at::cat(cols);
      }
    }
  }

 protected:
  // The row-parallel product of I ([B, T, out]), summed over the group (under sequence
  // parallelism, this member's positions of the sum), plus BIAS (added once, after the sum).
  at::Tensor proj_summed(size_t i, const at::Tensor& x, const at::Tensor* bias, int64_t B, int64_t T) const {
    if (!comm_) return proj(i, x, bias).view({B, T, -1});
    at::Tensor y = proj(i, x, nullptr).view({B, T, -1});
    y = seq_ ? sp_scatter(y, seq_) : tp_exit(y, comm_);
    return bias ? y + *bias : y;
  }
  // A normed input [B, T (this member's positions under sequence parallelism), H] as the
  // column-parallel products read it: every position, the group's input gradients summed.
  at::Tensor enter(const at::Tensor& h) const {
    if (!seq_) return tp_enter(h, comm_);
    at::Tensor full = sp_gather(h, seq_);
    if (gathered_ && at::GradMode::is_enabled()) gathered_->full_and_shard.emplace_back(full, h.detach());
    return full;
  }
  int64_t h0_ = 0, h1_ = 0;  // the heads this slice computes
  TpComm* comm_ = nullptr;   // its tensor-parallel group, if any
  // A pipeline boundary inside this block's MLP (TpLayout::cut_out / cut_in): this slice computes
  // its columns' partial output and sends it beside the residual [x, partial] (cut_out_), or reads
  // that pair and adds its own columns' output, the bias and the residual (cut_in_).
  bool cut_out_ = false, cut_in_ = false;

 private:
  struct Logical {
    std::vector<size_t> idx;      // into params_
    std::vector<int64_t> bounds;  // head boundaries of the pieces
    TpParam kind;
    int64_t lora_a = -1, lora_b = -1;  // its LoRA factors' logical parameters (-1: no adapter)
    double lora_scale = 0, lora_dropout = 0;
    std::string lora_module;  // the adapter's module ("h.0.attn.c_proj"): its dropout masks' key
    at::Tensor lora_cols;     // row-parallel: the whole input's columns this member reads (of lora_in)
    int64_t lora_in = 0;
  };
  std::vector<Logical> logical_;  // empty: no pieces, parameter I is params_[I]
  const ModelConfig* cfg_ = nullptr;
  bool attn_ = true, mlp_ = true;
};

class Gpt2Block : public BlockLayer {
 public:
  Gpt2Block(const ModelConfig& c, int64_t i, Init& init, Shared* sh, bool attn, bool mlp, const TpLayout* tp) : c_(c), sh_(sh) {
    in_out_ = true;
    std::string p = "h." + std::to_string(i) + ".";
    int64_t H = c.hidden, F = c.ffn_resolved();
    double proj_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.layers));
    add(p + "ln_1.weight", init.fill({H}, 1.0), false);
    add(p + "ln_1.bias", init.fill({H}, 0.0), false);
    add(p + "attn.c_attn.weight", init.normal({H, 3 * H}, c.init_std), true);
    add(p + "attn.c_attn.bias", init.fill({3 * H}, 0.0), false);
    add(p + "attn.c_proj.weight", init.normal({H, H}, proj_std), true);
    add(p + "attn.c_proj.bias", init.fill({H}, 0.0), false);
    add(p + "ln_2.weight", init.fill({H}, 1.0), false);
    add(p + "ln_2.bias", init.fill({H}, 0.0), false);
    add(p + "mlp.c_fc.weight", init.normal({H, F}, c.init_std), true);
    add(p + "mlp.c_fc.bias", init.fill({F}, 0.0), false);
    add(p + "mlp.c_proj.weight", init.normal({F, H}, proj_std), true);
    add(p + "mlp.c_proj.bias", init.fill({H}, 0.0), false);
    keep_halves(attn, mlp, 6);
    // The side of a cut MLP that sends its partial output leaves the bias to the other side.
    if (mlp && tp && tp->cut_out.block == i) params_.pop_back();
    split_for_tp(tp, i, c);
  }

 protected:
  at::Tensor attention_half(const at::Tensor& x) override {
    const int64_t H = c_.hidden, nh = h1_ - h0_, hd = c_.head_dim();
    auto h = enter(at::layer_norm(x, {H}, w(0), w(1), c_.norm_eps));
    const int64_t B = h.size(0), T = h.size(1);
    // HF's Conv1D: y = x @ W + b with W stored [in, out].
    // unbind, not qkv[i]: select's backward writes each gradient into a zeroed full-size tensor
    // and adds the three; unbind's backward is one stack.
    const at::Tensor b_qkv = w(3), b_out = w(5);
    auto qkv = proj(2, h.reshape({B * T, H}), &b_qkv).view({B, T, 3, nh, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    auto y = attention(qkv[0], qkv[1], qkv[2], *sh_);
    y = y.transpose(1, 2).reshape({B * T, nh * hd});
    return x + proj_summed(4, y, &b_out, B, T);
  }
  at::Tensor mlp_half(const at::Tensor& in) override {
    const size_t m = mlp0_;
    const int64_t H = c_.hidden;
    const at::Tensor x = cut_in_ ? in.narrow(-1, 0, H) : in;
    auto h2 = enter(at::layer_norm(x, {H}, w(m), w(m + 1), c_.norm_eps));
    const int64_t B = h2.size(0), T = h2.size(1);
    const at::Tensor b_fc = w(m + 3);
    auto f = gelu_tanh(proj(m + 2, h2.reshape({B * T, H}), &b_fc));
    if (cut_out_) return at::cat({x, proj(m + 4, f, nullptr).view({B, T, H})}, -1);
    const at::Tensor b_out = w(m + 5);
    const at::Tensor y = proj_summed(m + 4, f, &b_out, B, T);
    return cut_in_ ? x + in.narrow(-1, H, H) + y : x + y;
  }

 private:
  const ModelConfig& c_;
  Shared* sh_;
};

class Gpt2Head : public Layer {
 public:
  // When the embedding is in the same slice the head reads its wte (tied); otherwise it keeps its
  // own copy, drawn from the embedding's generator so it starts identical, and the runtime keeps
  // the two copies' gradients summed.
  Gpt2Head(const ModelConfig& c, Init& init, const Layer* tied, uint64_t embedding_seed, const TpLayout* tp) : c_(c), tied_(tied) {
    add("ln_f.weight", init.fill({c.hidden}, 1.0), false);
    add("ln_f.bias", init.fill({c.hidden}, 0.0), false);
    if (!tied_) {
      Init emb(embedding_seed, init_dtype(c));
      add("wte.weight", emb.normal({c.vocab_size, c.hidden}, c.init_std), true);
      split_vocab(2, tp, c);
    }
  }
  at::Tensor forward(const at::Tensor& x) override {
    const Layer& rows = tied_ ? *tied_ : *this;
    const at::Tensor n = at::layer_norm(x, {c_.hidden}, params_[0].tensor, params_[1].tensor, c_.norm_eps);
    auto h = seq_ ? sp_gather(n, seq_) : tp_enter(n, rows.vocab_comm());
    return rows.vocab_logits(h, false);
  }
  static at::ScalarType init_dtype(const ModelConfig& c) { return dtype_of(c); }
  const Layer& vocab_layer() const { return tied_ ? *tied_ : *this; }

 private:
  const ModelConfig& c_;
  const Layer* tied_;
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // LibTorch's own (one fused kernel on CUDA) where it has one: written out, the norm is five
  // elementwise passes over the residual stream each way (a 12-layer LLaMA's H100 step: 105.6 ms
  // written out, 93.6 ms fused).
  if (use_fused_kernels()) return at::rms_norm(x, {x.size(-1)}, w, eps);
#endif
  return x * at::rsqrt(x.pow(2).mean(-1, true) + eps) * w;
}

at::Tensor rotate_half(const at::Tensor& x) {
  int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

class LlamaEmbedding : public Layer {
 public:
  LlamaEmbedding(const ModelConfig& c, Init& init, const TpLayout* tp) {
    add("model.embed_tokens.weight", init.normal({c.vocab_size, c.hidden}, c.init_std), true);
    split_vocab(0, tp, c);
  }
  at::Tensor forward(const at::Tensor& ids) override { return embed(*this, ids, seq_); }
};

class LlamaBlock : public BlockLayer {
 public:
  LlamaBlock(const ModelConfig& c, int64_t i, Init& init, Shared* sh, bool attn, bool mlp, const TpLayout* tp) : c_(c), sh_(sh) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    int64_t H = c.hidden, hd = c.head_dim(), nh = c.heads, nkv = c.kv_heads_resolved(), F = c.ffn_resolved();
    add(p + "input_layernorm.weight", init.fill({H}, 1.0), false);
    add(p + "self_attn.q_proj.weight", init.normal({nh * hd, H}, c.init_std), true);
    add(p + "self_attn.k_proj.weight", init.normal({nkv * hd, H}, c.init_std), true);
    add(p + "self_attn.v_proj.weight", init.normal({nkv * hd, H}, c.init_std), true);
    add(p + "self_attn.o_proj.weight", init.normal({H, nh * hd}, c.init_std), true);
    if (c.qkv_bias) {  // the attention half's last three (5, 6, 7): its MLP indices stay relative
      add(p + "self_attn.q_proj.bias", init.fill({nh * hd}, 0.0), false);
      add(p + "self_attn.k_proj.bias", init.fill({nkv * hd}, 0.0), false);
      add(p + "self_attn.v_proj.bias", init.fill({nkv * hd}, 0.0), false);
    }
    add(p + "post_attention_layernorm.weight", init.fill({H}, 1.0), false);
    add(p + "mlp.gate_proj.weight", init.normal({F, H}, c.init_std), true);
    add(p + "mlp.up_proj.weight", init.normal({F, H}, c.init_std), true);
    add(p + "mlp.down_proj.weight", init.normal({H, F}, c.init_std), true);
    keep_halves(attn, mlp, c.qkv_bias ? 8 : 5);
    split_for_tp(tp, i, c);
  }

 protected:
  at::Tensor attention_half(const at::Tensor& x) override {
    // This slice's heads (all without tensor parallelism); whole key/value groups (plan.h).
    const int64_t nh = h1_ - h0_, nkv = nh * c_.kv_heads_resolved() / c_.heads, hd = c_.head_dim();
    auto h = enter(rms_norm(x, w(0), c_.norm_eps));
    const int64_t B = h.size(0), T = h.size(1);
    sh_->rope(T, x.device());
    at::Tensor bq, bk, bv;
    if (c_.qkv_bias) bq = w(5), bk = w(6), bv = w(7);
    auto q = proj(1, h, c_.qkv_bias ? &bq : nullptr).view({B, T, nh, hd}).transpose(1, 2);
    auto k = proj(2, h, c_.qkv_bias ? &bk : nullptr).view({B, T, nkv, hd}).transpose(1, 2);
    auto v = proj(3, h, c_.qkv_bias ? &bv : nullptr).view({B, T, nkv, hd}).transpose(1, 2);
    const auto [cos, sin] = sh_->rope_as(q.scalar_type());
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (nkv != nh && !fused_gqa()) {
      // Query head j reads key/value head j / rep (HF's repeat_kv); expand+reshape copies once,
      // where repeat_interleave builds an index first.
      const int64_t rep = nh / nkv;
      k = k.unsqueeze(2).expand({B, nkv, rep, T, hd}).reshape({B, nh, T, hd});
      v = v.unsqueeze(2).expand({B, nkv, rep, T, hd}).reshape({B, nh, T, hd});
    }
    auto y = attention(q, k, v, *sh_).transpose(1, 2).reshape({B, T, nh * hd});
    return x + proj_summed(4, y, nullptr, B, T);
  }
  at::Tensor mlp_half(const at::Tensor& in) override {
    const size_t m = mlp0_;
    const int64_t H = c_.hidden;
    const at::Tensor x = cut_in_ ? in.narrow(-1, 0, H) : in;
    auto h2 = enter(rms_norm(x, w(m), c_.norm_eps));
    auto g = at::silu(proj(m + 1, h2, nullptr)) * proj(m + 2, h2, nullptr);
    if (cut_out_) return at::cat({x, proj(m + 3, g, nullptr).view({h2.size(0), h2.size(1), H})}, -1);
    const at::Tensor y = proj_summed(m + 3, g, nullptr, h2.size(0), h2.size(1));
    return cut_in_ ? x + in.narrow(-1, H, H) + y : x + y;
  }

 private:
  const ModelConfig& c_;
  Shared* sh_;
};

class LlamaHead : public Layer {
 public:
  LlamaHead(const ModelConfig& c, Init& init, const TpLayout* tp) : c_(c) {
    add("model.norm.weight", init.fill({c.hidden}, 1.0), false);
    add("lm_head.weight", init.normal({c.vocab_size, c.hidden}, c.init_std), true);
    split_vocab(1, tp, c);
  }
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor n = rms_norm(x, params_[0].tensor, c_.norm_eps);
    return vocab_logits(seq_ ? sp_gather(n, seq_) : tp_enter(n, vocab_comm()), true);
  }

 private:
  const ModelConfig& c_;
};

}  // namespace

// Shared state lives with the model; layers hold a raw pointer to it.
struct SharedHolder {
  Shared s;
};

namespace {
void check_range(const ModelConfig& cfg, const LayerRange& range) {
  if (range.begin < 0 || range.end > cfg.layers + 2 || range.begin >= range.end ||
      (range.first_block_mlp_only && (range.begin == 0 || range.begin > cfg.layers)) ||
      (range.last_block_attn_only && (range.end == cfg.layers + 2 || range.end <= 1)) ||
      (range.first_block_mlp_only && range.last_block_attn_only && range.end - range.begin == 1))
    throw std::invalid_argument("invalid layer range");
}
}  // namespace

Transformer::Transformer(const ModelConfig& cfg, LayerRange range, uint64_t seed, const TpLayout* tp)
    : cfg_(cfg), range_(range), chunks_{range}, dtype_(dtype_of(cfg)) {
  check_range(cfg, range);
  build(tp, seed);
}

Transformer::Transformer(const ModelConfig& cfg, const std::vector<LayerRange>& chunks, uint64_t seed)
    : cfg_(cfg), chunks_(chunks), dtype_(dtype_of(cfg)) {
  if (chunks.empty()) throw std::invalid_argument("a slice needs a chunk");
  for (size_t k = 0; k < chunks.size(); ++k) {
    check_range(cfg, chunks[k]);
    // A block whose halves two chunks hold would be two layers of one position.
    if (k > 0 && chunks[k].begin < chunks[k - 1].end) throw std::invalid_argument("chunks overlap or are out of layer order");
  }
  range_ = {chunks.front().begin, chunks.back().end, chunks.front().first_block_mlp_only, chunks.back().last_block_attn_only};
  build(nullptr, seed);
}

void Transformer::build(const TpLayout* tp, uint64_t seed) {
  shared_ = std::make_shared<SharedHolder>();
  shared_->s.cfg = &cfg_;
  shared_->s.dtype = dtype_;
  Shared* sh = &shared_->s;
  const Layer* wte = nullptr;  // the embedding layer, whose rows a tied GPT-2 head in the slice reads
  for (const LayerRange& range : chunks_)
   for (int64_t pos = range.begin; pos < range.end; ++pos) {
    positions_.push_back(pos);
    Init init(layer_seed(seed, pos), dtype_);
    bool llama = cfg_.arch == "llama";
    if (pos == 0) {
      if (llama) {
        layers_.push_back(std::make_unique<LlamaEmbedding>(cfg_, init, tp));
      } else {
        layers_.push_back(std::make_unique<Gpt2Embedding>(cfg_, init, tp));
        wte = layers_.back().get();
      }
    } else if (pos == cfg_.layers + 1) {
      if (llama)
        layers_.push_back(std::make_unique<LlamaHead>(cfg_, init, tp));
      else
        layers_.push_back(std::make_unique<Gpt2Head>(cfg_, init, wte, layer_seed(seed, 0), tp));
    } else if (llama) {
      layers_.push_back(std::make_unique<LlamaBlock>(cfg_, pos - 1, init, sh, range.holds_attention(pos), range.holds_mlp(pos), tp));
    } else {
      layers_.push_back(std::make_unique<Gpt2Block>(cfg_, pos - 1, init, sh, range.holds_attention(pos), range.holds_mlp(pos), tp));
    }
  }
  for (auto* p : parameters()) {
    p->tensor.requires_grad_(true);
    pieces_ = pieces_ || p->name.find('#') != std::string::npos;
  }
  if (tp && tp->sequence_parallel && tp->comm) {
    // Every member computes norms, row-parallel biases and positions on its own positions only:
    // what it holds whole gets a part of the gradient.
    sp_comm_ = tp->comm, sp_heads_ = tp->group_heads;
    for (auto* p : parameters()) p->tp_partial = p->tp_partial || p->name.find('#') == std::string::npos;
  }
  tied_in_slice_ = wte && range_.has_head(cfg_);
  rebuild_uses();
}

}  // namespace alloy::model
