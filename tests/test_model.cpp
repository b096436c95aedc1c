#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <set>

#include "alloy/core/plan.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/dist/zero3.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/model/deferred_weights.h"
#include "alloy/model/gelu.h"
#include "alloy/model/precision.h"
#include "alloy/model/transformer.h"
#include "tiny_model.h"

using alloy::ModelConfig;
using alloy::model::LayerRange;
using alloy::model::Transformer;

namespace {
ModelConfig tiny(const std::string& arch) {
  ModelConfig m = alloy::testing::tiny_model(arch);
  m.layers = 4;
  return m;
}
at::Tensor tokens(const ModelConfig& m, int64_t B, int64_t seed) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  return at::randint(m.vocab_size, {B, m.seq_len}, g, at::kLong);
}
class ModelTest : public ::testing::TestWithParam<std::string> {};
}  // namespace

TEST_P(ModelTest, SlicesHoldTheFullModelsWeightsAndChainToTheSameOutput) {
  ModelConfig m = tiny(GetParam());
  auto full = Transformer::full(m, 42);
  Transformer a(m, LayerRange::for_blocks(0, 1, m.layers), 42);
  Transformer b(m, LayerRange::for_blocks(1, 3, m.layers), 42);
  Transformer c(m, LayerRange::for_blocks(3, 4, m.layers), 42);
  for (auto* s : {&a, &b, &c})
    for (auto* p : s->parameters()) {
      auto* q = full->find(p->name);
      ASSERT_NE(q, nullptr) << p->name;
      EXPECT_TRUE(at::equal(p->tensor, q->tensor)) << p->name;
    }
  EXPECT_TRUE(a.range().has_embedding());
  EXPECT_FALSE(b.range().has_embedding());
  EXPECT_TRUE(c.range().has_head(m));
  at::Tensor x = tokens(m, 2, 1);
  at::Tensor y_full = full->forward(x);
  at::Tensor y_chain = c.forward(b.forward(a.forward(x)));
  EXPECT_EQ(y_full.sizes(), (std::vector<int64_t>{2, m.seq_len, m.vocab_size}));
  EXPECT_TRUE(at::equal(y_full, y_chain));
}

TEST_P(ModelTest, HalfBlockSlicesHoldTheFullModelsWeightsAndChainToTheSameOutputAndGradients) {
  // Units (half blocks) [0,5) -> [5,6) -> [6,8): 2.5 blocks, block 2's MLP half alone, block 3.
  ModelConfig m = tiny(GetParam());
  auto full = Transformer::full(m, 42);
  Transformer a(m, LayerRange::for_units(0, 5, m.layers), 42);
  Transformer b(m, LayerRange::for_units(5, 6, m.layers), 42);
  Transformer c(m, LayerRange::for_units(6, 8, m.layers), 42);
  std::map<std::string, int> holders;
  for (auto* s : {&a, &b, &c})
    for (auto* p : s->parameters()) {
      auto* q = full->find(p->name);
      ASSERT_NE(q, nullptr) << p->name;
      EXPECT_TRUE(at::equal(p->tensor, q->tensor)) << p->name;
      ++holders[p->name];
    }
  for (auto* q : full->parameters())  // GPT-2's head keeps its own copy of the tied wte when split
    EXPECT_EQ(holders[q->name], q->name == "wte.weight" ? 2 : 1) << q->name << ": every parameter in exactly one slice";
  const std::string mlp_w = GetParam() != "gpt2" ? "model.layers.2.mlp.down_proj.weight" : "h.2.mlp.c_proj.weight";
  const std::string attn_w = GetParam() != "gpt2" ? "model.layers.2.self_attn.o_proj.weight" : "h.2.attn.c_proj.weight";
  EXPECT_NE(a.find(attn_w), nullptr);
  EXPECT_EQ(a.find(mlp_w), nullptr);
  EXPECT_NE(b.find(mlp_w), nullptr);
  EXPECT_EQ(b.find(attn_w), nullptr);
  at::Tensor x = tokens(m, 2, 1);
  at::Tensor y_full = full->forward(x);
  at::Tensor y_chain = c.forward(b.forward(a.forward(x)));
  EXPECT_TRUE(at::equal(y_full, y_chain));
  // The same gradients, bit for bit: the halves run exactly the whole block's operations.
  y_full.pow(2).sum().backward();
  y_chain.pow(2).sum().backward();
  for (auto* s : {&a, &b, &c})
    for (auto* p : s->parameters()) {
      if (p->name == "wte.weight") continue;  // tied: the runtime sums the two copies' gradients
      EXPECT_TRUE(at::equal(p->tensor.grad(), full->find(p->name)->tensor.grad())) << p->name;
    }
  EXPECT_THROW(LayerRange::for_units(3, 3, m.layers), std::invalid_argument);
  EXPECT_THROW(LayerRange::for_units(0, 9, m.layers), std::invalid_argument);
}

TEST_P(ModelTest, ForwardUnitsRunsAnyRangeOfAnOverlappingSlice) {
  // A floating boundary: slices [0,6) and [5,8) share unit 5; a micro-batch runs [0,5) then [5,8)
  // or [0,6) then [6,8), both exactly the full model's output. Recomputation takes the same halves.
  ModelConfig m = tiny(GetParam());
  auto full = Transformer::full(m, 42);
  Transformer a(m, LayerRange::for_units(0, 6, m.layers), 42);
  Transformer b(m, LayerRange::for_units(5, 8, m.layers), 42);
  at::Tensor x = tokens(m, 2, 1);
  at::Tensor y_full = full->forward(x);
  EXPECT_TRUE(at::equal(y_full, b.forward_units(a.forward_units(x, 0, 5), 5, 8)));
  EXPECT_TRUE(at::equal(y_full, b.forward_units(a.forward_units(x, 0, 6), 6, 8)));
  EXPECT_TRUE(at::equal(a.forward_units(x, 0, 6), a.forward(x)));
  b.set_recompute(true);
  at::Tensor h = a.forward_units(x, 0, 5).detach().requires_grad_(true);
  at::Tensor y = b.forward_units(h, 5, 8);
  EXPECT_TRUE(at::equal(y_full, y));
  y.pow(2).sum().backward();
  y_full.pow(2).sum().backward();
  const std::string mlp_w = GetParam() != "gpt2" ? "model.layers.2.mlp.down_proj.weight" : "h.2.mlp.c_proj.weight";
  EXPECT_TRUE(at::equal(b.find(mlp_w)->tensor.grad(), full->find(mlp_w)->tensor.grad()));
  EXPECT_THROW(a.forward_units(x, 0, 7), std::invalid_argument);  // unit 6 is not in [0,6)
  EXPECT_THROW(b.forward_units(h, 4, 8), std::invalid_argument);
}

TEST_P(ModelTest, ASliceOfSeveralChunksRunsEachAndHoldsNothingBetween) {
  // An interleaved pipeline's rank: units [0,3) and [5,7) on one rank, [3,5) and [7,8) on another.
  ModelConfig m = tiny(GetParam());
  auto full = Transformer::full(m, 42);
  Transformer a(m, {LayerRange::for_units(0, 3, m.layers), LayerRange::for_units(5, 7, m.layers)}, 42);
  Transformer b(m, {LayerRange::for_units(3, 5, m.layers), LayerRange::for_units(7, 8, m.layers)}, 42);
  std::map<std::string, int> holders;
  for (auto* s : {&a, &b})
    for (auto* p : s->parameters()) {
      auto* q = full->find(p->name);
      ASSERT_NE(q, nullptr) << p->name;
      EXPECT_TRUE(at::equal(p->tensor, q->tensor)) << p->name;
      ++holders[p->name];
    }
  for (auto* q : full->parameters())  // the tied wte: the embedding's and the head's copies
    EXPECT_EQ(holders[q->name], q->name == "wte.weight" ? 2 : 1) << q->name << ": every parameter in exactly one rank's chunks";
  // Block 1's MLP half (unit 3) and block 2's attention half (unit 4) are the other rank's.
  const std::string mlp1 = GetParam() != "gpt2" ? "model.layers.1.mlp.down_proj.weight" : "h.1.mlp.c_proj.weight";
  EXPECT_EQ(a.find(mlp1), nullptr);
  EXPECT_NE(b.find(mlp1), nullptr);
  at::Tensor x = tokens(m, 2, 1);
  at::Tensor y_full = full->forward(x);
  at::Tensor y = b.forward_units(a.forward_units(b.forward_units(a.forward_units(x, 0, 3), 3, 5), 5, 7), 7, 8);
  EXPECT_TRUE(at::equal(y_full, y));
  y_full.pow(2).sum().backward();
  y.pow(2).sum().backward();
  for (auto* s : {&a, &b})
    for (auto* p : s->parameters()) {
      if (p->name == "wte.weight") continue;  // tied: the runtime sums the two copies' gradients
      EXPECT_TRUE(at::equal(p->tensor.grad(), full->find(p->name)->tensor.grad())) << p->name;
    }
  EXPECT_THROW(a.forward(x), std::logic_error);                     // which chunk?
  EXPECT_THROW(a.forward_units(x, 0, 5), std::invalid_argument);    // across the gap
  EXPECT_THROW(b.forward_units(x, 4, 6), std::invalid_argument);
  EXPECT_THROW(Transformer(m, std::vector<LayerRange>{LayerRange::for_units(5, 7, m.layers), LayerRange::for_units(0, 3, m.layers)}, 42),
               std::invalid_argument);  // out of order
}

TEST_P(ModelTest, ACutMlpSplitsItsColumnsAndChainsToTheFullModelsOutputAndGradients) {
  // Pipeline 1 cuts block 2's MLP: rank 1 holds units [0,6) and computes the columns of heads
  // [0,1), rank 2 units [5,8) and the columns of heads [1,4); rank 0 is a whole replica beside
  // them, holding block 2's MLP as the same two pieces.
  ModelConfig m = tiny(GetParam());
  alloy::Plan plan;
  plan.global_batch = 4;
  alloy::PipelinePlan rep, cut;
  rep.micro_batch_size = cut.micro_batch_size = 2;
  rep.stages.push_back({{0}, 0, m.layers, ""});
  alloy::StagePlan sa{{1}, 0, 0, ""}, sb{{2}, 0, 0, ""};
  sa.set_units(0, 6);
  sa.mlp_cut = 1;
  sb.set_units(5, 8);
  cut.stages = {sa, sb};
  plan.pipelines = {rep, cut};
  plan.validate(m);
  EXPECT_TRUE(plan.has_pieces());
  EXPECT_EQ(plan.pipelines[1].message_width(0, m.hidden), 2 * m.hidden);
  const auto l0 = alloy::dist::tp_layout(plan, m, 0), la = alloy::dist::tp_layout(plan, m, 1), lb = alloy::dist::tp_layout(plan, m, 2);
  auto full = Transformer::full(m, 42);
  Transformer r(m, LayerRange::full(m), 42, &l0);
  Transformer a(m, LayerRange::for_units(0, 6, m.layers), 42, &la);
  Transformer b(m, LayerRange::for_units(5, 8, m.layers), 42, &lb);
  const bool llama = GetParam() != "gpt2";
  const std::string up = llama ? "model.layers.2.mlp.up_proj.weight" : "h.2.mlp.c_fc.weight";
  const std::string norm = llama ? "model.layers.2.post_attention_layernorm.weight" : "h.2.ln_2.weight";
  EXPECT_NE(a.find(up + "#h0-1"), nullptr);
  EXPECT_EQ(a.find(up + "#h1-4"), nullptr);
  EXPECT_NE(b.find(up + "#h1-4"), nullptr);
  EXPECT_NE(r.find(up + "#h0-1"), nullptr);
  EXPECT_NE(r.find(up + "#h1-4"), nullptr);
  EXPECT_NE(a.find(norm), nullptr);
  EXPECT_NE(b.find(norm), nullptr);
  if (!llama) {  // the output bias is added once, on the receiving side
    EXPECT_EQ(a.find("h.2.mlp.c_proj.bias"), nullptr);
    EXPECT_NE(b.find("h.2.mlp.c_proj.bias"), nullptr);
  }
  // What every rank derives from the plan without building the slice agrees with the slice.
  for (auto [t, l, u0, u1] : {std::tuple{&a, &la, 0, 6}, std::tuple{&b, &lb, 5, 8}}) {
    std::vector<std::string> built;
    for (auto* p : t->parameters()) built.push_back(p->name);
    EXPECT_EQ(built, alloy::model::param_names(m, LayerRange::for_units(u0, u1, m.layers), l));
  }
  at::Tensor x = tokens(m, 2, 1);
  at::Tensor y_full = full->forward(x);
  at::Tensor h = a.forward(x);
  EXPECT_EQ(h.size(-1), 2 * m.hidden);
  at::Tensor y = b.forward(h);
  EXPECT_TRUE(at::allclose(y, y_full, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(r.forward(x), y_full, 1e-5, 1e-6));
  // Gradients: each piece's is the whole parameter's cut to it; the norm both sides hold sums to
  // the whole one's (the holder-set sync adds them).
  y_full.pow(2).sum().backward();
  y.pow(2).sum().backward();
  std::map<std::string, at::Tensor> summed;
  for (auto* s : {&a, &b})
    for (auto* p : s->parameters()) {
      if (p->name == "wte.weight") continue;  // tied: the runtime sums the two copies' gradients
      at::Tensor& g = summed[p->name];
      g = g.defined() ? g + p->tensor.grad() : p->tensor.grad();
    }
  int pieces = 0;
  for (const auto& [name, g] : summed) {
    std::string base;
    int64_t h0 = 0, h1 = 0;
    at::Tensor want;
    if (alloy::model::parse_piece(name, &base, &h0, &h1)) {
      ++pieces;
      want = alloy::model::tp_cut(full->find(base)->tensor.grad(), alloy::model::tp_param(base), h0, h1, m);
    } else {
      want = full->find(name)->tensor.grad();
    }
    // Against the tensor's own scale: an entry near zero (a bias's gradient sums a whole batch of
    // terms that cancel) carries the rounding of its larger neighbours (7.6e-6 beside 26 on an
    // AMD EPYC's BLAS), which an elementwise relative tolerance reads as a mismatch.
    const double diff = (g - want).abs().max().item<double>(), scale = want.abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * scale + 1e-6) << name << ": max |diff| " << diff << ", max |want| " << scale;
  }
  EXPECT_EQ(pieces, 6);  // three split parameters (GPT-2: c_fc weight and bias, c_proj weight), two pieces each
}

TEST_P(ModelTest, SeedDeterminesWeights) {
  ModelConfig m = tiny(GetParam());
  auto a = Transformer::full(m, 7), b = Transformer::full(m, 7), c = Transformer::full(m, 8);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  bool any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i]->tensor, pb[i]->tensor));
    any_diff |= !at::equal(pa[i]->tensor, pc[i]->tensor);
  }
  EXPECT_TRUE(any_diff);
}

TEST_P(ModelTest, CausalityFutureTokensDoNotChangePastLogits) {
  ModelConfig m = tiny(GetParam());
  auto model = Transformer::full(m, 3);
  at::Tensor x = tokens(m, 1, 5);
  at::Tensor x2 = x.clone();
  x2.index_put_({0, m.seq_len - 1}, (x[0][m.seq_len - 1].item<int64_t>() + 1) % m.vocab_size);
  at::Tensor y1 = model->forward(x), y2 = model->forward(x2);
  EXPECT_TRUE(at::allclose(y1.narrow(1, 0, m.seq_len - 1), y2.narrow(1, 0, m.seq_len - 1), 0, 1e-6));
  EXPECT_FALSE(at::allclose(y1.narrow(1, m.seq_len - 1, 1), y2.narrow(1, m.seq_len - 1, 1)));
}

// Recomputed blocks give the plain backward's gradients (the same arithmetic, run twice), for
// every parameter, a pipeline slice's input included; parameter hooks fire in the recomputation.
TEST_P(ModelTest, RecomputedBlocksGiveThePlainGradients) {
  ModelConfig m = tiny(GetParam());
  at::Tensor x = tokens(m, 2, 21), t = tokens(m, 2, 22);
  auto plain = Transformer::full(m, 5), rec = Transformer::full(m, 5);
  rec->set_recompute(true);
  int hooked = 0;
  for (auto* p : rec->parameters()) p->tensor.register_hook([&hooked](const at::Tensor&) { ++hooked; });
  Transformer::loss_sum(plain->forward(x), t).backward();
  Transformer::loss_sum(rec->forward(x), t).backward();
  EXPECT_EQ(hooked, static_cast<int>(rec->parameters().size()));
  auto pp = plain->parameters(), rp = rec->parameters();
  for (size_t i = 0; i < pp.size(); ++i)
    EXPECT_TRUE(at::allclose(pp[i]->tensor.grad(), rp[i]->tensor.grad(), 1e-6, 1e-9)) << pp[i]->name;
  // The second stage of a pipeline: its input comes from the stage before and needs a gradient.
  Transformer first(m, LayerRange::for_blocks(0, 2, m.layers), 5), second(m, LayerRange::for_blocks(2, 4, m.layers), 5);
  second.set_recompute(true);
  at::Tensor h = first.forward(x).detach().requires_grad_(true);
  Transformer::loss_sum(second.forward(h), t).backward();
  at::Tensor h2 = first.forward(x).detach().requires_grad_(true);
  Transformer again(m, LayerRange::for_blocks(2, 4, m.layers), 5);
  Transformer::loss_sum(again.forward(h2), t).backward();
  EXPECT_TRUE(at::allclose(h.grad(), h2.grad(), 1e-6, 1e-9));
}

// Under autocast (bf16 on the CPU) the recomputation runs in the forward's precision, though the
// backward runs outside the forward's autocast scope: gradients as without recomputation.
TEST_P(ModelTest, RecomputedBlocksRunInTheForwardsPrecision) {
  ModelConfig m = tiny(GetParam());
  at::Tensor x = tokens(m, 2, 21), t = tokens(m, 2, 22);
  auto plain = Transformer::full(m, 5), rec = Transformer::full(m, 5);
  rec->set_recompute(true);
  for (Transformer* model : {plain.get(), rec.get()}) {
    at::Tensor logits;
    {
      alloy::model::AutocastScope amp(at::kCPU, "bf16");
      logits = model->forward(x);
    }
    Transformer::loss_sum(logits.to(at::kFloat), t).backward();
  }
  auto pp = plain->parameters(), rp = rec->parameters();
  for (size_t i = 0; i < pp.size(); ++i)
    EXPECT_TRUE(at::allclose(pp[i]->tensor.grad(), rp[i]->tensor.grad(), 1e-5, 1e-7))
        << pp[i]->name << ": max diff " << (pp[i]->tensor.grad() - rp[i]->tensor.grad()).abs().max().item<double>();
}

// zb-h1's split backward (model/deferred_weights.h): two micro-batches through a pipeline's second
// slice with every projection's weight gradient held for the weight pass give the plain
// backward's gradients, parameter and input alike, with and without recomputation; the input
// gradient is complete before any weight pass; the first micro-batch's pass adds to .grad without
// hooks and the last one's goes through them, once per parameter, after all else is in .grad.
TEST_P(ModelTest, DeferredWeightPassesGiveThePlainGradients) {
  using alloy::model::DeferredWeightGrads;
  for (bool recompute : {false, true}) {
    ModelConfig m = tiny(GetParam());
    Transformer first(m, LayerRange::for_blocks(0, 2, m.layers), 5);
    Transformer plain(m, LayerRange::for_blocks(2, 4, m.layers), 5), split(m, LayerRange::for_blocks(2, 4, m.layers), 5);
    split.set_recompute(recompute);
    std::vector<at::Tensor> xs, ts;
    for (int64_t mb = 0; mb < 2; ++mb) xs.push_back(tokens(m, 2, 31 + mb)), ts.push_back(tokens(m, 2, 41 + mb));
    std::vector<at::Tensor> plain_in, split_in;
    for (int64_t mb = 0; mb < 2; ++mb) {
      at::Tensor h = first.forward(xs[static_cast<size_t>(mb)]).detach().requires_grad_(true);
      Transformer::loss_sum(plain.forward(h), ts[static_cast<size_t>(mb)]).backward();
      plain_in.push_back(h.grad());
    }
    std::map<const at::Tensor*, int> hooked;
    std::map<const at::Tensor*, bool> saw_earlier;  // the hook found micro-batch 0's share in .grad
    for (auto* p : split.parameters()) {
      const at::Tensor* key = &p->tensor;
      p->tensor.register_hook([&, key](const at::Tensor&) {
        ++hooked[key];
        saw_earlier[key] = key->grad().defined();
      });
    }
    DeferredWeightGrads d;
    for (int64_t mb = 0; mb < 2; ++mb) {
      at::Tensor h = first.forward(xs[static_cast<size_t>(mb)]).detach().requires_grad_(true);
      at::Tensor loss;
      {
        DeferredWeightGrads::Scope s(&d, mb);
        loss = Transformer::loss_sum(split.forward(h), ts[static_cast<size_t>(mb)]);
      }
      {
        DeferredWeightGrads::Scope s(&d, mb);
        loss.backward();
      }
      split_in.push_back(h.grad());
    }
    EXPECT_FALSE(d.empty());
    for (int64_t mb = 0; mb < 2; ++mb)
      EXPECT_TRUE(at::allclose(plain_in[static_cast<size_t>(mb)], split_in[static_cast<size_t>(mb)], 1e-6, 1e-9)) << mb;
    // Before the weight passes the blocks' projection weights have no gradient, the norms do.
    std::set<const at::Tensor*> waiting;
    for (auto* p : split.parameters())
      if (!p->tensor.grad().defined()) waiting.insert(&p->tensor);
    EXPECT_GT(waiting.size(), 0u);
    const int hooks_before = static_cast<int>(hooked.size());
    d.run(0, false);
    EXPECT_EQ(static_cast<int>(hooked.size()), hooks_before) << "a non-final pass fired hooks";
    d.run(1, true);
    EXPECT_TRUE(d.empty());
    auto pp = plain.parameters(), sp = split.parameters();
    for (size_t i = 0; i < pp.size(); ++i) {
      ASSERT_TRUE(sp[i]->tensor.grad().defined()) << sp[i]->name;
      EXPECT_TRUE(at::allclose(pp[i]->tensor.grad(), sp[i]->tensor.grad(), 1e-5, 1e-8)) << sp[i]->name << " recompute " << recompute;
      // Hooks fire per micro-batch in the backward; a held weight's once, in its final pass, with
      // micro-batch 0's share already in .grad.
      EXPECT_EQ(hooked[&sp[i]->tensor], waiting.count(&sp[i]->tensor) ? 1 : 2) << sp[i]->name;
      EXPECT_TRUE(saw_earlier[&sp[i]->tensor]) << sp[i]->name;
    }
  }
}

// Under bf16 autocast (train.precision bf16) the held products run in the gradient's precision and
// land in fp32 parameters: the same gradients as the plain autocast backward, to bf16's precision.
TEST_P(ModelTest, DeferredWeightPassesUnderAutocastMatchThePlainBackward) {
  using alloy::model::DeferredWeightGrads;
  ModelConfig m = tiny(GetParam());
  auto plain = Transformer::full(m, 5), split = Transformer::full(m, 5);
  const at::Tensor x = tokens(m, 2, 51), t = tokens(m, 2, 52);
  {
    alloy::model::AutocastScope amp(at::Device(at::kCPU), "bf16");
    at::Tensor loss = Transformer::loss_sum(plain->forward(x), t);
    loss.backward();
  }
  DeferredWeightGrads d;
  {
    alloy::model::AutocastScope amp(at::Device(at::kCPU), "bf16");
    DeferredWeightGrads::Scope s(&d, 0);
    at::Tensor loss = Transformer::loss_sum(split->forward(x), t);
    loss.backward();
  }
  ASSERT_FALSE(d.empty());
  d.run(0, true);
  auto pp = plain->parameters(), sp = split->parameters();
  for (size_t i = 0; i < pp.size(); ++i) {
    ASSERT_TRUE(sp[i]->tensor.grad().defined()) << sp[i]->name;
    EXPECT_EQ(sp[i]->tensor.grad().scalar_type(), pp[i]->tensor.scalar_type()) << sp[i]->name;
    const double scale = pp[i]->tensor.grad().abs().max().item<double>() + 1e-12;
    EXPECT_LT((pp[i]->tensor.grad() - sp[i]->tensor.grad()).abs().max().item<double>() / scale, 2e-2) << sp[i]->name;
  }
}

// What ZeRO-3 relies on, without a second process: hooks that free every parameter of a layer
// after its forward and its backward and restore it just before each give the plain gradients
// (with and without recomputation, in a pipeline's first and last slices with GPT-2's tied head),
// fire in order, and after_backward(i) comes once every parameter of layer i has its gradient.
namespace {
struct FreeingHooks : alloy::model::LayerHooks {
  Transformer& m;
  std::map<const at::Tensor*, at::Tensor> saved;  // each parameter's values while released
  std::vector<std::string> log;
  bool grads_complete = true;
  explicit FreeingHooks(Transformer& model) : m(model) {
    for (auto* p : m.parameters()) saved[&p->tensor] = p->tensor.detach().clone();
    for (auto* p : m.parameters()) alloy::dist::release_storage(p->tensor);
  }
  void restore(size_t i) {
    for (auto* p : m.layer_params(i)) alloy::dist::restore_storage(p->tensor, saved.at(&p->tensor));
  }
  void release(size_t i) {
    for (auto* p : m.layer_params(i)) alloy::dist::release_storage(p->tensor);
  }
  void before_forward(size_t i) override { log.push_back("F" + std::to_string(i)), restore(i); }
  void after_forward(size_t i) override { log.push_back("f" + std::to_string(i)), release(i); }
  void before_backward(size_t i) override { log.push_back("B" + std::to_string(i)), restore(i); }
  void after_backward(size_t i) override {
    log.push_back("b" + std::to_string(i));
    // Its own: a tied wte also waits for the embedding's share before it accumulates.
    for (auto& p : m.layer(i).params()) grads_complete = grads_complete && p.tensor.grad().defined();
    release(i);
  }
};
}  // namespace

TEST_P(ModelTest, LayersWhoseParametersAreFreedBetweenUsesGiveThePlainGradients) {
  ModelConfig m = tiny(GetParam());
  at::Tensor x = tokens(m, 2, 31), t = tokens(m, 2, 32);
  for (bool recompute : {false, true}) {
    auto plain = Transformer::full(m, 7), sharded = Transformer::full(m, 7);
    sharded->set_recompute(recompute);
    FreeingHooks hooks(*sharded);
    sharded->set_layer_hooks(&hooks);
    Transformer::loss_sum(plain->forward(x), t).backward();
    Transformer::loss_sum(sharded->forward(x), t).backward();
    hooks.release(0);  // the embedding has no after_backward: ZeRO-3 frees it at the step's end
    auto pp = plain->parameters(), sp = sharded->parameters();
    for (size_t i = 0; i < pp.size(); ++i) {
      EXPECT_EQ(sp[i]->tensor.storage().nbytes(), 0u) << sp[i]->name << ": not released after its backward";
      EXPECT_TRUE(at::allclose(pp[i]->tensor.grad(), sp[i]->tensor.grad(), 1e-6, 1e-9)) << sp[i]->name << " recompute " << recompute;
    }
    EXPECT_TRUE(hooks.grads_complete);
    // Forward 0..5, then backward 5..1; the embedding's input (token ids) needs no gradient: no b0.
    std::vector<std::string> want;
    for (int i = 0; i < 6; ++i) want.insert(want.end(), {"F" + std::to_string(i), "f" + std::to_string(i)});
    for (int i = 5; i >= 0; --i) {
      want.push_back("B" + std::to_string(i));
      if (i > 0) want.push_back("b" + std::to_string(i));
    }
    EXPECT_EQ(hooks.log, want) << "recompute " << recompute;
  }
  // The last slice of a pipeline: its input needs a gradient, so its first layer gets after_backward.
  Transformer last(m, LayerRange::for_blocks(2, 4, m.layers), 7), ref(m, LayerRange::for_blocks(2, 4, m.layers), 7);
  FreeingHooks hooks(last);
  last.set_layer_hooks(&hooks);
  at::Tensor h = at::randn({2, m.seq_len, m.hidden}).requires_grad_(true), h2 = h.detach().clone().requires_grad_(true);
  Transformer::loss_sum(last.forward(h), t).backward();
  Transformer::loss_sum(ref.forward(h2), t).backward();
  EXPECT_TRUE(at::allclose(h.grad(), h2.grad(), 1e-6, 1e-9));
  EXPECT_EQ(hooks.log.back(), "b0");
  EXPECT_TRUE(hooks.grads_complete);
}

INSTANTIATE_TEST_SUITE_P(Arch, ModelTest, ::testing::Values("gpt2", "llama", "qwen2"));

// GPT-2's activation on CPU float tensors runs Alloy's loops (core/gelu_loops.h); it must be ATen's
// gelu(x, "tanh"), value and gradient, within float rounding, through autograd and without it, and
// leave every other dtype to ATen unchanged.
TEST(Model, GeluTanhIsAtensWithinFloatRoundingForwardAndBackward) {
  at::manual_seed(5);
  const at::Tensor base = at::randn({37, 129}) * 3.0;  // not a multiple of the vector width
  const at::Tensor x = base.clone().requires_grad_(true), xr = base.clone().requires_grad_(true);
  const at::Tensor dy = at::randn({37, 129});
  const at::Tensor y = alloy::model::gelu_tanh(x);
  const at::Tensor yr = at::gelu(xr, "tanh");
  EXPECT_TRUE(y.requires_grad());
  y.backward(dy);
  yr.backward(dy);
  const at::Tensor x64 = base.to(at::kDouble), y64 = at::gelu(x64, "tanh"), g64 = at::gelu_backward(dy.to(at::kDouble), x64, "tanh");
  // Both float results within a few roundings of the double-precision truth, and Alloy's no worse.
  const double err = (y.to(at::kDouble) - y64).abs().max().item<double>(), err_aten = (yr.to(at::kDouble) - y64).abs().max().item<double>();
  const double gerr = (x.grad().to(at::kDouble) - g64).abs().max().item<double>();
  const double gerr_aten = (xr.grad().to(at::kDouble) - g64).abs().max().item<double>();
  EXPECT_LT(err, 4e-6);
  EXPECT_LT(gerr, 4e-6);
  EXPECT_LE(err, 4 * err_aten + 1e-7);
  EXPECT_LE(gerr, 4 * gerr_aten + 1e-7);
  EXPECT_GT((y - yr).abs().max().item<double>(), 0.0) << "Alloy's loops did not run";
  {
    at::NoGradGuard ng;
    EXPECT_TRUE(at::equal(alloy::model::gelu_tanh(base), y.detach())) << "with and without autograd alike";
    // A strided input: the same values as its contiguous copy.
    const at::Tensor t = base.t();
    EXPECT_TRUE(at::equal(alloy::model::gelu_tanh(t), alloy::model::gelu_tanh(t.contiguous())));
    // Other dtypes are ATen's own.
    const at::Tensor b = base.to(at::kBFloat16);
    EXPECT_TRUE(at::equal(alloy::model::gelu_tanh(b), at::gelu(b, "tanh")));
    EXPECT_TRUE(at::equal(alloy::model::gelu_tanh(x64), y64));
  }
}

TEST(Model, TiedEmbeddingGradientIsTheSumOfBothStagesCopies) {
  ModelConfig m = tiny("gpt2");
  auto full = Transformer::full(m, 11);
  Transformer first(m, LayerRange::for_blocks(0, 2, m.layers), 11);
  Transformer last(m, LayerRange::for_blocks(2, 4, m.layers), 11);
  ASSERT_NE(last.find("wte.weight"), nullptr);  // the head keeps its own copy when split
  EXPECT_EQ(full->parameters().size() + 1, first.parameters().size() + last.parameters().size());
  at::Tensor x = tokens(m, 2, 9), t = tokens(m, 2, 10);
  Transformer::loss_sum(full->forward(x), t).backward();
  at::Tensor h = first.forward(x);
  Transformer::loss_sum(last.forward(h), t).backward();
  at::Tensor summed = first.find("wte.weight")->tensor.grad() + last.find("wte.weight")->tensor.grad();
  EXPECT_TRUE(at::allclose(summed, full->find("wte.weight")->tensor.grad(), 1e-5, 1e-7));
}

TEST(Model, Float64ModelComputesInDouble) {
  ModelConfig m = tiny("llama");
  m.dtype = "float64";
  auto model = Transformer::full(m, 1);
  EXPECT_EQ(model->forward(tokens(m, 1, 2)).scalar_type(), at::kDouble);
}

TEST(Model, ParamNamesMatchWhatSlicesHold) {
  for (std::string arch : {"gpt2", "llama", "qwen2"}) {
    ModelConfig m = tiny(arch);
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {0, 2}, {2, 6}, {6, 8}, {0, 3}, {3, 4}, {3, 6}, {5, 8}, {1, 2}}) {
      auto range = LayerRange::for_units(b, e, m.layers);
      Transformer t(m, range, 1);
      std::vector<std::string> held;
      for (auto* p : t.parameters()) held.push_back(p->name);
      EXPECT_EQ(held, alloy::model::param_names(m, range)) << arch << " units [" << b << "," << e << ")";
    }
  }
}

#include <filesystem>
#include <fstream>

#include "alloy/core/error.h"
#include "alloy/model/weights.h"
#include "alloy/train/finetune.h"

// A HuggingFace model too large for one file comes as shards and model.safetensors.index.json:
// --init-from takes the directory (or the index) and loads every weight from the shard that has it.
TEST(HfWeights, AModelSplitIntoShardsLoadsAsFromOneFile) {
  for (const std::string arch : {"gpt2", "llama"}) {
    const ModelConfig m = tiny(arch);
    auto src = Transformer::full(m, 11);
    const std::string dir = ::testing::TempDir() + "/alloy-hf-shards-" + arch;
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::vector<std::pair<std::string, alloy::model::TensorBlob>> shard[2];
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
    const auto params = src->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const int k = i < params.size() / 2 ? 0 : 1;
      // HuggingFace's GPT-2 files may prefix the names with "transformer."; the second shard does.
      const std::string name = (arch == "gpt2" && k == 1 ? "transformer." : "") + params[i]->name;
      shard[k].emplace_back(name, alloy::model::to_blob(params[i]->tensor));
      index["weight_map"][name] = "model-0000" + std::to_string(k + 1) + "-of-00002.safetensors";
    }
    for (int k = 0; k < 2; ++k)
      alloy::model::write_safetensors(dir + "/model-0000" + std::to_string(k + 1) + "-of-00002.safetensors", shard[k]);
    std::ofstream(dir + "/model.safetensors.index.json") << index.dump(1);

    for (const std::string& from : {dir, dir + "/model.safetensors.index.json"}) {
      auto dst = Transformer::full(m, 12);
      alloy::train::load_base_weights(*dst, from);
      const auto got = dst->parameters();
      ASSERT_EQ(got.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(at::equal(got[i]->tensor, params[i]->tensor)) << arch << " " << from << ": " << params[i]->name;
    }
    // A shard the index names but that is not there is named with a tensor it should hold.
    std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
    auto dst = Transformer::full(m, 12);
    try {
      alloy::train::load_base_weights(*dst, dir);
      ADD_FAILURE() << arch << ": a missing shard went unnoticed";
    } catch (const alloy::InputError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("model.safetensors.index.json: weight_map."), std::string::npos) << w;
      EXPECT_NE(w.find("model-00002-of-00002.safetensors does not exist"), std::string::npos) << w;
    }
  }
}

// A tied LLaMA checkpoint (tie_word_embeddings: no lm_head.weight in the file) loads with the head
// as a copy of the embedding; an untied file's own head is kept as it is.
TEST(HfWeights, ATiedLlamaStartsItsHeadAsTheEmbedding) {
  const ModelConfig m = tiny("llama");
  auto src = Transformer::full(m, 11);
  std::vector<std::pair<std::string, alloy::model::TensorBlob>> blobs;
  for (auto* p : src->parameters())
    if (p->name != "lm_head.weight") blobs.emplace_back(p->name, alloy::model::to_blob(p->tensor));
  const std::string path = ::testing::TempDir() + "/alloy-hf-tied.safetensors";
  alloy::model::write_safetensors(path, blobs);
  auto dst = Transformer::full(m, 12);
  alloy::train::load_base_weights(*dst, path);
  EXPECT_TRUE(at::equal(dst->find("lm_head.weight")->tensor, src->find("model.embed_tokens.weight")->tensor));
  EXPECT_FALSE(at::equal(dst->find("lm_head.weight")->tensor, src->find("lm_head.weight")->tensor));
  for (auto* p : src->parameters())
    if (p->name != "lm_head.weight") EXPECT_TRUE(at::equal(dst->find(p->name)->tensor, p->tensor)) << p->name;
}

// config.json keys that would make Alloy's llama compute another model are refused by name.
TEST(HfWeights, ConfigKeysAlloysLlamaDoesNotComputeAreRefused) {
  const nlohmann::json base = {{"model_type", "llama"}, {"hidden_size", 64}, {"intermediate_size", 128}, {"num_hidden_layers", 2},
                               {"num_attention_heads", 4}, {"max_position_embeddings", 32}, {"vocab_size", 50}};
  EXPECT_EQ(alloy::model::model_config_from_hf(base, "c.json").hidden, 64);
  auto error_of = [&](const char* key, const nlohmann::json& v) {
    nlohmann::json j = base;
    j[key] = v;
    try {
      alloy::model::model_config_from_hf(j, "c.json");
    } catch (const alloy::InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of("rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}).find("rope_scaling:"), std::string::npos);
  EXPECT_EQ(error_of("rope_scaling", nullptr), "");
  EXPECT_NE(error_of("attention_bias", true).find("attention_bias: true is not supported"), std::string::npos);
  EXPECT_EQ(error_of("attention_bias", false), "");
  EXPECT_NE(error_of("mlp_bias", true).find("mlp_bias"), std::string::npos);
  EXPECT_NE(error_of("hidden_act", "gelu").find("hidden_act: 'gelu'"), std::string::npos);
  EXPECT_NE(error_of("head_dim", 32).find("head_dim: 32 x 4 heads is not hidden_size 64"), std::string::npos);
  EXPECT_EQ(error_of("head_dim", 16), "");
  EXPECT_NE(error_of("rope_scaling", {{"rope_type", "llama3"}}).find("c.json"), std::string::npos);
}

// Qwen2's config.json is LLaMA's with biases on q, k and v: it imports as llama with
// model.qkv_bias, writes back as qwen2, and refuses the sliding window. Its weights loaded into a
// llama without the biases are refused rather than computed without them.
TEST(HfWeights, Qwen2IsTheLlamaWithQkvBiases) {
  const nlohmann::json qwen = {{"model_type", "qwen2"}, {"hidden_size", 32}, {"intermediate_size", 64}, {"num_hidden_layers", 3},
                               {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"max_position_embeddings", 16},
                               {"vocab_size", 61}, {"rope_theta", 1000000.0}, {"use_sliding_window", false}};
  const ModelConfig m = alloy::model::model_config_from_hf(qwen, "c.json");
  EXPECT_EQ(m.arch, "llama");
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_FALSE(alloy::model::model_config_from_hf({{"model_type", "llama"}, {"hidden_size", 32}, {"intermediate_size", 64},
                                                   {"num_hidden_layers", 3}, {"num_attention_heads", 4},
                                                   {"max_position_embeddings", 16}, {"vocab_size", 61}},
                                                  "c.json")
                   .qkv_bias);
  const nlohmann::json back = alloy::model::hf_config(m);
  EXPECT_EQ(back["model_type"], "qwen2");
  EXPECT_EQ(alloy::model::model_config_from_hf(back, "back.json").qkv_bias, true);
  nlohmann::json sliding = qwen;
  sliding["use_sliding_window"] = true;
  EXPECT_THROW(alloy::model::model_config_from_hf(sliding, "c.json"), alloy::InputError);

  auto src = Transformer::full(m, 5);
  {
    at::NoGradGuard ng;  // biases start at zero in every model: give the file values of its own
    for (auto* p : src->parameters())
      if (p->name.find("_proj.bias") != std::string::npos) p->tensor.normal_(0, 0.1);
  }
  EXPECT_NE(src->find("model.layers.1.self_attn.k_proj.bias"), nullptr);
  EXPECT_EQ(src->find("model.layers.1.self_attn.k_proj.bias")->tensor.numel(), 2 * m.head_dim());
  const std::string path = ::testing::TempDir() + "/alloy-qwen2.safetensors";
  alloy::model::save_weights(*src, path);
  auto same = Transformer::full(m, 6);
  alloy::train::load_base_weights(*same, path);
  for (auto* p : src->parameters()) EXPECT_TRUE(at::equal(same->find(p->name)->tensor, p->tensor)) << p->name;
  EXPECT_GT(same->find("model.layers.2.self_attn.v_proj.bias")->tensor.abs().sum().item<double>(), 0.0);
  // HF's attention_bias also puts one on o_proj, which Alloy's llama does not compute.
  std::vector<std::pair<std::string, alloy::model::TensorBlob>> blobs;
  for (auto* p : src->parameters()) blobs.emplace_back(p->name, alloy::model::to_blob(p->tensor));
  blobs.emplace_back("model.layers.0.self_attn.o_proj.bias", alloy::model::to_blob(at::ones({m.hidden})));
  const std::string with_o = ::testing::TempDir() + "/alloy-qwen2-o-bias.safetensors";
  alloy::model::write_safetensors(with_o, blobs);
  try {
    alloy::train::load_base_weights(*same, with_o);
    FAIL() << "expected the output projection's bias to be refused";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.self_attn.o_proj.bias' is a bias Alloy's llama does not compute"), std::string::npos)
        << e.what();
  }
  ModelConfig plain = m;
  plain.qkv_bias = false;
  auto without = Transformer::full(plain, 6);
  try {
    alloy::train::load_base_weights(*without, path);
    FAIL() << "expected the biases to be refused";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("_proj.bias' is a q/k/v bias (a Qwen2 checkpoint): set model.qkv_bias: true"),
              std::string::npos)
        << e.what();
  }
}
