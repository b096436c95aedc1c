#include "alloy/model/tensor_parallel.h"

#include "alloy/core/plan.h"
#include "alloy/model/recompute.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>

namespace alloy::model {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Elements of the split dimension per head of K, for the whole parameter.
int64_t per_head(TpParam k, const ModelConfig& c) {
  switch (k.kind) {
    case TpKind::Qkv:
    case TpKind::Heads:
      return c.head_dim();
    case TpKind::KvHeads:
      return c.head_dim() * c.kv_heads_resolved() / c.heads;  // whole only at key/value group edges
    case TpKind::Ffn:
      return c.ffn_resolved() / c.heads;
    case TpKind::None:
    case TpKind::Vocab:
      break;
  }
  return 0;
}

int64_t offset_of(TpParam k, int64_t h, const ModelConfig& c) {
  if (k.kind == TpKind::Vocab) return h;  // rows
  if (k.kind == TpKind::KvHeads) return h * c.kv_heads_resolved() / c.heads * c.head_dim();
  return h * per_head(k, c);
}

// T with dimension DIM of size 3n seen as (3, n): GPT-2's c_attn keeps Q, K and V side by side.
at::Tensor as_qkv(const at::Tensor& t, int dim) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  const int64_t n = s[static_cast<size_t>(dim)] / 3;
  s[static_cast<size_t>(dim)] = n;
  s.insert(s.begin() + dim, 3);
  return t.reshape(s);
}

at::Tensor merge_qkv(const at::Tensor& t, int dim) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  s[static_cast<size_t>(dim)] *= s[static_cast<size_t>(dim) + 1];
  s.erase(s.begin() + dim + 1);
  return t.reshape(s);
}

struct TpEnter : torch::autograd::Function<TpEnter> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, TpComm* comm) {
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto* comm = reinterpret_cast<TpComm*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    at::Tensor g = grads[0].contiguous().clone();
    comm->allreduce_sum(g);
    return {g, at::Tensor()};
  }
};

struct TpExit : torch::autograd::Function<TpExit> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& y, TpComm* comm) {
    at::Tensor s = y.contiguous().clone();
    comm->allreduce_sum(s);
    return s;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// Sequence parallelism's four edges, over dimension 0 of [T, ...] views.
at::Tensor rows_first(const at::Tensor& x) { return x.transpose(0, 1).contiguous(); }
std::vector<int64_t> shares(const std::vector<int64_t>& b) {
  std::vector<int64_t> r;
  for (size_t i = 0; i + 1 < b.size(); ++i) r.push_back(b[i + 1] - b[i]);
  return r;
}
at::Tensor gather_seq(const at::Tensor& shard, const SeqSplit& s) {
  // Contiguous: the products' saved input is then a view of this tensor's storage (which
  // regather_on_backward releases), never a reshaped copy.
  return s.comm->gather_rows(rows_first(shard), shares(s.bounds)).transpose(0, 1).contiguous();
}
at::Tensor scatter_seq(const at::Tensor& full, const SeqSplit& s) {
  return s.comm->scatter_sum_rows(rows_first(full), shares(s.bounds)).transpose(0, 1);
}
// A copy, never a view: with one sample per micro-batch the cut is contiguous, and a view of an
// autograd function's input must not leave it.
at::Tensor cut_seq(const at::Tensor& full, const SeqSplit& s) {
  const auto i = static_cast<size_t>(s.comm->rank());
  return full.narrow(1, s.bounds[i], s.bounds[i + 1] - s.bounds[i]).clone(at::MemoryFormat::Contiguous);
}

SeqSplit unpack(torch::autograd::AutogradContext* ctx) {
  SeqSplit s;
  s.comm = reinterpret_cast<TpComm*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
  s.bounds = ctx->saved_data["bounds"].toIntVector();
  return s;
}
void pack(torch::autograd::AutogradContext* ctx, const SeqSplit& s) {
  ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(s.comm));
  ctx->saved_data["bounds"] = s.bounds;
}

// KIND: 0 gather (backward reduce-scatter), 1 reduce-scatter (backward gather), 2 split (backward
// gather), 3 join (backward cut).
struct SeqEdge : torch::autograd::Function<SeqEdge> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t kind, TpComm* comm,
                            std::vector<int64_t> bounds) {
    SeqSplit s{comm, std::move(bounds)};
    pack(ctx, s);
    ctx->saved_data["kind"] = kind;
    return apply_edge(x, kind, s);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const SeqSplit s = unpack(ctx);
    // A gather's gradient is reduce-scattered; a reduce-scatter's and a split's gathered; a join's
    // cut to this member's positions.
    const int64_t kind = ctx->saved_data["kind"].toInt();
    const at::Tensor& g = grads[0];
    at::Tensor out = kind == 0 ? scatter_seq(g, s) : kind == 3 ? cut_seq(g, s) : gather_seq(g, s);
    return {out, at::Tensor(), at::Tensor(), at::Tensor()};
  }
  static at::Tensor apply_edge(const at::Tensor& x, int64_t kind, const SeqSplit& s) {
    switch (kind) {
      case 0:
      case 3:
        return gather_seq(x, s);
      case 1:
        return scatter_seq(x, s);
      default:
        return cut_seq(x, s);
    }
  }
};

at::Tensor seq_edge(const at::Tensor& x, int64_t kind, const SeqSplit& s) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return SeqEdge::apply_edge(x, kind, s);
  return SeqEdge::apply(x, kind, s.comm, s.bounds);
}

struct Regather : torch::autograd::Function<Regather> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<SeqGathered> g) {
    ctx->saved_data["g"] = c10::IValue::make_capsule(std::move(g));
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto g = c10::static_intrusive_pointer_cast<SeqGathered>(ctx->saved_data["g"].toCapsule());
    at::NoGradGuard ng;
    for (auto& [full, shard] : g->full_and_shard) restore_storage(full, gather_seq(shard, g->seq));
    g->full_and_shard.clear();  // the block's nodes hold the tensors from here on
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor regather_on_backward(const at::Tensor& block_output, const c10::intrusive_ptr<SeqGathered>& g) {
  if (g->full_and_shard.empty()) return block_output;
  for (auto& [full, shard] : g->full_and_shard) release_storage(full);
  return Regather::apply(block_output, g);
}

at::Tensor TpComm::gather_rows(const at::Tensor& mine, const std::vector<int64_t>& rows) {
  // By a sum of zero-padded copies: exact (x + 0 is x), twice a gather's bytes; GroupTpComm does better.
  int64_t total = 0, first = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (static_cast<int>(i) < rank()) first += rows[i];
    total += rows[i];
  }
  std::vector<int64_t> shape(mine.sizes().begin(), mine.sizes().end());
  shape[0] = total;
  at::Tensor full = at::zeros(shape, mine.options());
  full.narrow(0, first, mine.size(0)).copy_(mine);
  allreduce_sum(full);
  return full;
}

at::Tensor TpComm::scatter_sum_rows(const at::Tensor& full, const std::vector<int64_t>& rows) {
  int64_t first = 0;
  for (int i = 0; i < rank(); ++i) first += rows[static_cast<size_t>(i)];
  at::Tensor s = full.contiguous().clone();
  allreduce_sum(s);
  return s.narrow(0, first, rows[static_cast<size_t>(rank())]).contiguous();
}

std::vector<int64_t> sequence_bounds(const std::vector<int64_t>& heads, int64_t T) {
  const std::vector<int64_t> b = StagePlan::positions_by_heads(heads, T);
  if (const int k = StagePlan::member_without_positions(b); k >= 0) {
    const auto i = static_cast<size_t>(k);
    throw std::invalid_argument("sequence parallelism over heads " + std::to_string(heads[i]) + "-" + std::to_string(heads[i + 1]) +
                                " of " + std::to_string(heads.back()) + " leaves a member none of the " + std::to_string(T) +
                                " positions: use a longer sequence or a more even tp_split");
  }
  return b;
}

at::Tensor sp_gather(const at::Tensor& shard, const SeqSplit& s) { return seq_edge(shard, 0, s); }
at::Tensor sp_scatter(const at::Tensor& full, const SeqSplit& s) { return seq_edge(full, 1, s); }
at::Tensor sp_split(const at::Tensor& full, const SeqSplit& s) { return seq_edge(full, 2, s); }
at::Tensor sp_join(const at::Tensor& shard, const SeqSplit& s) { return seq_edge(shard, 3, s); }

TpParam tp_param(const std::string& name) {
  if (name.find('#') != std::string::npos) return {};
  static const std::vector<std::pair<std::string, TpParam>> table = {
      // GPT-2 (Conv1D weights [in, out])
      {".attn.c_attn.weight", {TpKind::Qkv, 1}},
      {".attn.c_attn.bias", {TpKind::Qkv, 0}},
      {".attn.c_proj.weight", {TpKind::Heads, 0}},
      {".mlp.c_fc.weight", {TpKind::Ffn, 1}},
      {".mlp.c_fc.bias", {TpKind::Ffn, 0}},
      {".mlp.c_proj.weight", {TpKind::Ffn, 0}},
      // LLaMA (nn.Linear weights [out, in])
      {".self_attn.q_proj.weight", {TpKind::Heads, 0}},
      {".self_attn.k_proj.weight", {TpKind::KvHeads, 0}},
      {".self_attn.v_proj.weight", {TpKind::KvHeads, 0}},
      {".self_attn.q_proj.bias", {TpKind::Heads, 0}},
      {".self_attn.k_proj.bias", {TpKind::KvHeads, 0}},
      {".self_attn.v_proj.bias", {TpKind::KvHeads, 0}},
      {".self_attn.o_proj.weight", {TpKind::Heads, 1}},
      {".mlp.gate_proj.weight", {TpKind::Ffn, 0}},
      {".mlp.up_proj.weight", {TpKind::Ffn, 0}},
      {".mlp.down_proj.weight", {TpKind::Ffn, 1}},
      // LoRA's adapters (A [r, in], B [out, r]) split where their projection's split dimension
      // meets them: B's rows beside a column-parallel weight, A's columns beside a row-parallel
      // one. The other factor is whole on every rank.
      {".attn.c_attn.lora_B.weight", {TpKind::Qkv, 0}},
      {".attn.c_proj.lora_A.weight", {TpKind::Heads, 1}},
      {".mlp.c_fc.lora_B.weight", {TpKind::Ffn, 0}},
      {".mlp.c_proj.lora_A.weight", {TpKind::Ffn, 1}},
      {".self_attn.q_proj.lora_B.weight", {TpKind::Heads, 0}},
      {".self_attn.k_proj.lora_B.weight", {TpKind::KvHeads, 0}},
      {".self_attn.v_proj.lora_B.weight", {TpKind::KvHeads, 0}},
      {".self_attn.o_proj.lora_A.weight", {TpKind::Heads, 1}},
      {".mlp.gate_proj.lora_B.weight", {TpKind::Ffn, 0}},
      {".mlp.up_proj.lora_B.weight", {TpKind::Ffn, 0}},
      {".mlp.down_proj.lora_A.weight", {TpKind::Ffn, 1}},
      // the vocabulary's rows: GPT-2's (tied) wte, LLaMA's embedding and head
      {"wte.weight", {TpKind::Vocab, 0}},
      {"model.embed_tokens.weight", {TpKind::Vocab, 0}},
      {"lm_head.weight", {TpKind::Vocab, 0}},
  };
  for (const auto& [suffix, k] : table)
    if (ends_with(name, suffix)) return k;
  return {};
}

std::vector<int64_t> tp_piece_bounds(const TpLayout& l, int64_t block, TpParam k) {
  if (k.kind == TpKind::None || k.kind == TpKind::Vocab) return {};
  if (k.kind == TpKind::Ffn)
    if (auto it = l.mlp_pieces.find(block); it != l.mlp_pieces.end()) return it->second;
  auto it = l.pieces.find(block);
  return it == l.pieces.end() ? std::vector<int64_t>{} : it->second;
}

std::pair<int64_t, int64_t> tp_held_heads(const TpLayout& l, int64_t block, TpParam k, int64_t heads) {
  if (k.kind == TpKind::Ffn) {
    if (l.cut_out.block == block) return {l.cut_out.head_begin, l.cut_out.head_end};
    if (l.cut_in.block == block) return {l.cut_in.head_begin, l.cut_in.head_end};
  }
  return l.head_end > 0 ? std::pair<int64_t, int64_t>{l.head_begin, l.head_end} : std::pair<int64_t, int64_t>{0, heads};
}

std::string piece_name(const std::string& name, int64_t h0, int64_t h1) {
  return name + (tp_param(name).kind == TpKind::Vocab ? "#v" : "#h") + std::to_string(h0) + "-" + std::to_string(h1);
}

bool parse_piece(const std::string& name, std::string* base, int64_t* h0, int64_t* h1) {
  const size_t at = name.rfind('#');
  if (at == std::string::npos || at + 1 >= name.size() || (name[at + 1] != 'h' && name[at + 1] != 'v')) return false;
  const bool vocab = name[at + 1] == 'v';
  const std::string range = name.substr(at + 2);
  const size_t dash = range.find('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 >= range.size() ||
      range.find_first_not_of("0123456789-") != std::string::npos || range.size() > 12)
    return false;
  *base = name.substr(0, at);
  *h0 = std::stoll(range.substr(0, dash));
  *h1 = std::stoll(range.substr(dash + 1));
  const TpKind k = tp_param(*base).kind;
  return *h0 < *h1 && k != TpKind::None && (k == TpKind::Vocab) == vocab;
}

int64_t tp_extent(TpParam k, const ModelConfig& c) {
  const int64_t n = offset_of(k, k.kind == TpKind::Vocab ? c.vocab_size : c.heads, c);
  return k.kind == TpKind::Qkv ? 3 * n : n;
}

at::Tensor tp_cut(const at::Tensor& full, TpParam k, int64_t h0, int64_t h1, const ModelConfig& c) {
  const int64_t lo = offset_of(k, h0, c), len = offset_of(k, h1, c) - lo;
  // A copy, never a view: a piece must not keep the whole parameter's storage alive.
  if (k.kind == TpKind::Qkv) return merge_qkv(as_qkv(full, k.dim).narrow(k.dim + 1, lo, len).clone(at::MemoryFormat::Contiguous), k.dim);
  return full.narrow(k.dim, lo, len).clone(at::MemoryFormat::Contiguous);
}

at::Tensor tp_join(const std::vector<at::Tensor>& pieces, const std::vector<int64_t>&, TpParam k, const ModelConfig&) {
  if (pieces.size() == 1) return pieces.front();
  if (k.kind != TpKind::Qkv) return at::cat(pieces, k.dim);
  std::vector<at::Tensor> parts;
  for (const auto& p : pieces) parts.push_back(as_qkv(p, k.dim));
  return merge_qkv(at::cat(parts, k.dim + 1), k.dim);
}

at::Tensor tp_resolve(const std::string& name, const std::function<at::Tensor(const std::string&)>& lookup,
                      const std::vector<std::string>& names, const ModelConfig& c) {
  if (at::Tensor t = lookup(name); t.defined()) return t;
  std::string base = name;
  int64_t h0 = 0, h1 = 0;
  const bool want_piece = parse_piece(name, &base, &h0, &h1);
  const TpParam k = tp_param(base);
  if (k.kind == TpKind::None) return {};
  at::Tensor whole = lookup(base);
  if (!whole.defined()) {
    // Pieces of BASE as stored: they may come from several layouts (a checkpoint holds one), so
    // take the boundaries that chain from head 0 to the last.
    std::map<int64_t, std::pair<int64_t, std::string>> from;  // h0 -> (h1, name)
    for (const auto& n : names) {
      std::string b;
      int64_t a = 0, e = 0;
      if (parse_piece(n, &b, &a, &e) && b == base) from.emplace(a, std::make_pair(e, n));
    }
    std::vector<at::Tensor> parts;
    std::vector<int64_t> bounds{0};
    const int64_t end = k.kind == TpKind::Vocab ? c.vocab_size : c.heads;
    while (bounds.back() < end) {
      auto it = from.find(bounds.back());
      if (it == from.end()) return {};
      parts.push_back(lookup(it->second.second));
      if (!parts.back().defined()) return {};
      bounds.push_back(it->second.first);
    }
    whole = tp_join(parts, bounds, k, c);
  }
  return want_piece ? tp_cut(whole, k, h0, h1, c) : whole;
}

namespace {

struct VocabParallelLoss : torch::autograd::Function<VocabParallelLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t v0,
                            TpComm* comm) {
    at::NoGradGuard ng;
    const int64_t Vl = logits.size(-1);
    const at::Tensor lf = logits.reshape({-1, Vl}).to(at::kFloat);
    const at::Tensor t = targets.reshape({-1}).to(lf.device());
    const int64_t N = lf.size(0), n = comm->size();
    // The rows' maxima over the whole vocabulary: each member's in its own row, summed.
    at::Tensor maxima = at::zeros({n, N}, lf.options());
    maxima[comm->rank()].copy_(std::get<0>(lf.max(1)));
    comm->allreduce_sum(maxima);
    const at::Tensor M = std::get<0>(maxima.max(0));
    at::Tensor e = at::exp(lf - M.unsqueeze(1));
    at::Tensor S = e.sum(1);
    comm->allreduce_sum(S);
    const at::Tensor local = t - v0;
    const at::Tensor mine = (local >= 0) & (local < Vl);
    const at::Tensor idx = local.clamp(0, Vl - 1);
    at::Tensor target_logit = lf.gather(1, idx.unsqueeze(1)).squeeze(1) * mine.to(at::kFloat);
    comm->allreduce_sum(target_logit);
    const at::Tensor valid = (t >= 0).to(at::kFloat);
    const at::Tensor loss = ((at::log(S) + M - target_logit) * valid).sum();
    ctx->save_for_backward({e / S.unsqueeze(1), idx, mine, valid});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.to(logits.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor g = saved[0].clone();
    g.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(at::kFloat).unsqueeze(1));
    g.mul_(saved[3].unsqueeze(1) * grads[0].to(at::kFloat));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype).reshape(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_embedding(const at::Tensor& w, const at::Tensor& ids, int64_t v0, TpComm* comm, const SeqSplit& seq) {
  const at::Tensor local = ids - v0;
  const at::Tensor mine = (local >= 0) & (local < w.size(0));
  at::Tensor e = at::embedding(w, local.clamp(0, w.size(0) - 1)) * mine.unsqueeze(-1).to(w.scalar_type());
  return seq ? sp_scatter(e, seq) : tp_exit(e, comm);
}

at::Tensor vocab_parallel_loss_sum(const at::Tensor& logits, const at::Tensor& targets, int64_t v0, TpComm* comm) {
  return VocabParallelLoss::apply(logits, targets, v0, comm);
}

at::Tensor tp_enter(const at::Tensor& x, TpComm* comm) {
  if (!comm || !at::GradMode::is_enabled() || !x.requires_grad()) return x;
  return TpEnter::apply(x, comm);
}

at::Tensor tp_exit(const at::Tensor& y, TpComm* comm) {
  if (!comm) return y;
  if (!at::GradMode::is_enabled()) {
    at::Tensor s = y.contiguous().clone();
    comm->allreduce_sum(s);
    return s;
  }
  return TpExit::apply(y, comm);
}

}  // namespace alloy::model
