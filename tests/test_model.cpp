#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "alloy/model/transformer.h"

using alloy::ModelConfig;
using alloy::model::LayerRange;
using alloy::model::Transformer;

namespace {
ModelConfig tiny(const std::string& arch) {
  ModelConfig m;
  m.arch = arch;
  m.layers = 4;
  m.hidden = 32;
  m.heads = 4;
  m.kv_heads = arch == "llama" ? 2 : 0;
  m.seq_len = 16;
  m.vocab_size = 61;
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

INSTANTIATE_TEST_SUITE_P(Arch, ModelTest, ::testing::Values("gpt2", "llama"));

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
  for (std::string arch : {"gpt2", "llama"}) {
    ModelConfig m = tiny(arch);
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {0, 1}, {1, 3}, {3, 4}}) {
      auto range = LayerRange::for_blocks(b, e, m.layers);
      Transformer t(m, range, 1);
      std::vector<std::string> held;
      for (auto* p : t.parameters()) held.push_back(p->name);
      EXPECT_EQ(held, alloy::model::param_names(m, range)) << arch << " [" << b << "," << e << ")";
    }
  }
}
