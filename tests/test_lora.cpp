#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/model/lora.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/model/transformer.h"
#include "tiny_model.h"
#include "tp_threads.h"

using alloy::Config;
using alloy::LoraConfig;
using alloy::ModelConfig;
using alloy::model::LayerRange;
using alloy::model::Transformer;
namespace m = alloy::model;

namespace {
ModelConfig tiny(const std::string& arch) { return alloy::testing::tiny_model(arch); }
LoraConfig lora(int64_t rank, const std::string& targets = "", const std::string& base = "fp32") {
  LoraConfig l;
  l.rank = rank;
  l.alpha = 8;
  l.targets = targets;
  l.base_dtype = base;
  return l;
}
at::Tensor tokens(const ModelConfig& c, int64_t B, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return at::randint(c.vocab_size, {B, c.seq_len}, g, at::kLong);
}
// Gives every adapter B a nonzero value, as training would.
void perturb_adapters(Transformer& t, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  at::NoGradGuard ng;
  for (auto* p : t.trainable())
    if (p->name.find("lora_B") != std::string::npos) p->tensor.copy_(at::randn(p->tensor.sizes(), g) * 0.05);
}
class LoraArch : public ::testing::TestWithParam<std::string> {};
}  // namespace

TEST(LoraTargets, NamesSuffixesAndGlobs) {
  EXPECT_TRUE(m::lora_matches({"c_attn"}, "h.0.attn.c_attn"));
  EXPECT_TRUE(m::lora_matches({"attn.c_proj"}, "h.2.attn.c_proj"));
  EXPECT_FALSE(m::lora_matches({"attn.c_proj"}, "h.2.mlp.c_proj"));
  EXPECT_TRUE(m::lora_matches({"c_proj"}, "h.2.mlp.c_proj"));  // PEFT's suffix rule: both c_proj
  EXPECT_TRUE(m::lora_matches({"mlp.*"}, "h.1.mlp.c_fc"));
  EXPECT_FALSE(m::lora_matches({"mlp.*"}, "h.1.attn.c_attn"));
  EXPECT_TRUE(m::lora_matches({"*_proj"}, "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(m::lora_matches({"_proj"}, "model.layers.0.self_attn.q_proj"));  // not a dotted suffix
  EXPECT_TRUE(m::lora_matches({"all"}, "model.layers.0.mlp.down_proj"));
}

TEST(LoraTargets, DefaultsAreTheAttentionProjections) {
  auto g = m::lora_modules(tiny("gpt2"), lora(4));
  EXPECT_EQ(g.size(), 6u);
  EXPECT_EQ(g[0], "h.0.attn.c_attn");
  EXPECT_EQ(g[1], "h.0.attn.c_proj");
  auto l = m::lora_modules(tiny("llama"), lora(4));
  EXPECT_EQ(l.size(), 12u);
  EXPECT_EQ(l[3], "model.layers.0.self_attn.o_proj");
  EXPECT_TRUE(m::lora_modules(tiny("gpt2"), lora(0)).empty());
}

TEST(LoraTargets, APatternThatMatchesNothingNamesTheKeyAndTheProjections) {
  try {
    m::lora_modules(tiny("gpt2"), lora(4, "c_attn,q_proj"));
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    std::string w = e.what();
    EXPECT_NE(w.find("lora.targets"), std::string::npos) << w;
    EXPECT_NE(w.find("'q_proj'"), std::string::npos) << w;
    EXPECT_NE(w.find("mlp.c_fc"), std::string::npos) << w;
  }
}

TEST(LoraConfigKeys, ListsValidationAndFlagsOfTheSection) {
  Config c = Config::from_yaml_string("lora: {rank: 8, alpha: 16, targets: [q_proj, v_proj]}\nmodel: {arch: llama}\n", "t.yaml");
  EXPECT_EQ(c.lora.rank, 8);
  EXPECT_EQ(c.lora.targets, "q_proj,v_proj");
  EXPECT_EQ(c.lora.target_list("llama"), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_THROW(Config::from_yaml_string("lora: {base_dtype: nf4}\n", "t.yaml"), alloy::InputError);  // needs adapters
  EXPECT_THROW(Config::from_yaml_string("lora: {rank: 4, base_dtype: int4}\n", "t.yaml"), alloy::InputError);
  EXPECT_THROW(Config::from_yaml_string("lora: {rank: 4, double_quant: true}\n", "t.yaml"), alloy::InputError);
  EXPECT_THROW(Config::from_yaml_string("lora: {rank: -1}\n", "t.yaml"), alloy::InputError);
  EXPECT_THROW(Config::from_yaml_string("lora: {rnak: 4}\n", "t.yaml"), alloy::InputError);
}

TEST(LoraNames, PeftNamesRoundTrip) {
  EXPECT_EQ(m::peft_name("gpt2", "h.0.attn.c_attn.lora_A.weight"), "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight");
  EXPECT_EQ(m::peft_name("llama", "model.layers.1.self_attn.q_proj.lora_B.weight"),
            "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight");
  for (const std::string arch : {"gpt2", "llama"})
    for (const auto& mod : m::lora_modules(tiny(arch), lora(2, "all")))
      for (const char* ab : {".lora_A.weight", ".lora_B.weight"})
        EXPECT_EQ(m::from_peft_name(arch, m::peft_name(arch, mod + ab)), mod + ab);
  EXPECT_EQ(m::from_peft_name("gpt2", "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"),
            "h.0.attn.c_attn.lora_A.weight");
  EXPECT_EQ(m::from_peft_name("gpt2", "transformer.h.0.attn.c_attn.weight"), "");
  auto cfg = m::peft_adapter_config(tiny("gpt2"), lora(4, "c_proj"), "base.safetensors");
  EXPECT_EQ(cfg["target_modules"], nlohmann::json({"attn.c_proj", "mlp.c_proj"}));
  EXPECT_EQ(cfg["fan_in_fan_out"], true);
  EXPECT_EQ(cfg["r"], 4);
}

TEST_P(LoraArch, AdaptersStartAtTheBaseModelsOutputsAndOnlyTheyTrain) {
  ModelConfig c = tiny(GetParam());
  auto base = Transformer::full(c, 5), adapted = Transformer::full(c, 5);
  adapted->apply_lora(lora(4, "all"), 5);
  at::Tensor x = tokens(c, 2, 3);
  EXPECT_TRUE(at::equal(base->forward(x), adapted->forward(x)));  // B = 0

  perturb_adapters(*adapted, 9);
  at::Tensor loss = Transformer::loss_sum(adapted->forward(x), tokens(c, 2, 4));
  torch::autograd::backward({loss});
  size_t adapters = 0;
  for (auto* p : adapted->parameters()) {
    const bool adapter = m::is_adapter_name(p->name);
    EXPECT_EQ(p->frozen, !adapter) << p->name;
    EXPECT_EQ(p->tensor.grad().defined(), adapter) << p->name;
    adapters += adapter;
  }
  EXPECT_EQ(adapters, 2 * m::lora_modules(c, lora(4, "all")).size());
  EXPECT_EQ(adapted->trainable().size(), adapters);
}

// Recomputation re-runs each block's forward in the backward: the adapters' dropout must draw the
// same masks there as in the forward (torch.utils.checkpoint's preserve_rng_state), or the
// gradients are those of another function than the loss; and the random stream after the step is
// the same with and without it.
TEST_P(LoraArch, RecomputedBlocksDrawTheForwardsDropoutMasks) {
 for (bool keyed : {false, true}) {  // the device's generator, and masks keyed by sample
  SCOPED_TRACE(keyed ? "keyed masks" : "the generator's masks");
  ModelConfig c = tiny(GetParam());
  LoraConfig l = lora(4, "all");
  l.dropout = 0.3;
  const m::DropoutKeys keys{5, 2, {3, 8}};
  std::map<std::string, at::Tensor> grads[2];
  at::Tensor after[2];
  for (int recompute : {0, 1}) {
    auto t = Transformer::full(c, 5);
    t->apply_lora(l, 5);
    perturb_adapters(*t, 9);
    t->set_recompute(recompute == 1);
    at::manual_seed(1234);
    at::Tensor logits;
    {
      m::DropoutScope scope(keyed ? &keys : nullptr);
      logits = t->forward(tokens(c, 2, 3));
    }
    at::Tensor loss = Transformer::loss_sum(logits, tokens(c, 2, 4));
    torch::autograd::backward({loss});
    for (auto* p : t->trainable()) grads[recompute][p->name] = p->tensor.grad().clone();
    after[recompute] = at::rand({4});
  }
  ASSERT_FALSE(grads[0].empty());
  for (const auto& [name, g] : grads[0]) {
    ASSERT_TRUE(grads[1].count(name)) << name;
    EXPECT_TRUE(at::allclose(grads[1].at(name), g, 1e-5, 1e-7)) << name << ": max diff "
                                                                 << (grads[1].at(name) - g).abs().max().item<double>();
  }
  EXPECT_TRUE(at::equal(after[0], after[1]));
 }
}

TEST_P(LoraArch, SlicesHoldTheFullModelsAdaptersAndNamesAreKnownWithoutBuilding) {
  ModelConfig c = tiny(GetParam());
  const LoraConfig l = lora(3, "all");
  auto full = Transformer::full(c, 11);
  full->apply_lora(l, 11);
  perturb_adapters(*full, 2);
  std::vector<std::unique_ptr<Transformer>> slices;
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 1}, {1, 2}, {2, 3}}) {
    auto s = std::make_unique<Transformer>(c, LayerRange::for_blocks(b, e, c.layers), 11);
    s->apply_lora(l, 11);
    std::set<std::string> built, listed;
    for (auto* p : s->parameters()) built.insert(p->name);
    for (const auto& n : m::param_names(c, l, s->range())) listed.insert(n);
    EXPECT_EQ(built, listed);
    at::NoGradGuard ng;
    for (auto* p : s->trainable()) {
      auto* q = full->find(p->name);
      ASSERT_NE(q, nullptr) << p->name;
      if (p->name.find("lora_A") != std::string::npos) EXPECT_TRUE(at::equal(p->tensor, q->tensor)) << p->name;
      p->tensor.copy_(q->tensor);  // B as the perturbed full model's
    }
    slices.push_back(std::move(s));
  }
  at::Tensor x = tokens(c, 2, 8);
  at::NoGradGuard ng;
  EXPECT_TRUE(at::equal(full->forward(x), slices[2]->forward(slices[1]->forward(slices[0]->forward(x)))));
}

TEST_P(LoraArch, HalfBlockSlicesHoldTheWholeBlocksAdapters) {
  // A slice starting at block 1's MLP half, one ending at block 1's attention half: each adapter
  // is the whole model's, whichever half draws first.
  ModelConfig c = tiny(GetParam());
  const LoraConfig l = lora(3, "all");
  auto full = Transformer::full(c, 11);
  full->apply_lora(l, 11);
  int64_t compared = 0;
  for (auto [u0, u1] : {std::pair<int64_t, int64_t>{3, 6}, {0, 3}}) {
    Transformer s(c, LayerRange::for_units(u0, u1, c.layers), 11);
    s.apply_lora(l, 11);
    for (auto* p : s.trainable()) {
      ASSERT_NE(full->find(p->name), nullptr) << p->name;
      EXPECT_TRUE(at::equal(p->tensor, full->find(p->name)->tensor)) << p->name;
      compared += p->name.find("lora_A") != std::string::npos;
    }
  }
  EXPECT_GT(compared, 0);
}

TEST_P(LoraArch, MergedWeightsComputeTheAdaptedModel) {
  ModelConfig c = tiny(GetParam());
  auto adapted = Transformer::full(c, 21);
  adapted->apply_lora(lora(4, "all"), 21);
  perturb_adapters(*adapted, 5);
  auto plain = Transformer::full(c, 99);
  {
    at::NoGradGuard ng;
    for (const auto& [n, t] : adapted->merged_weights()) plain->find(n)->tensor.copy_(t);
  }
  at::NoGradGuard ng;
  at::Tensor x = tokens(c, 2, 6);
  at::Tensor a = adapted->forward(x), b = plain->forward(x);
  EXPECT_TRUE(at::allclose(a, b, 1e-5, 1e-5)) << (a - b).abs().max().item<double>();
  EXPECT_FALSE(at::allclose(a, Transformer::full(c, 21)->forward(x), 1e-5, 1e-5));  // the adapters matter
}

TEST_P(LoraArch, QuantizedBaseStaysCloseToFullPrecision) {
  ModelConfig c = tiny(GetParam());
  auto ref = Transformer::full(c, 31);
  at::Tensor x = tokens(c, 2, 1);
  at::NoGradGuard ng;
  at::Tensor y = ref->forward(x);
  for (const std::string kind : {"int8", "nf4"}) {
    auto q = Transformer::full(c, 31);
    q->apply_lora(lora(2, "", kind), 31);
    int64_t quantized = 0;
    for (auto* p : q->parameters()) quantized += p->quant ? 1 : 0;
    EXPECT_EQ(quantized, c.layers * static_cast<int64_t>(m::adaptable_projections(c.arch).size())) << kind;
    at::Tensor yq = q->forward(x);
    const double rel = ((yq - y).norm() / y.norm()).item<double>();
    // Logit error relative to the logits: int8 ~0.3%, NF4 ~5% on these random weights.
    EXPECT_GT(rel, 0.0) << kind;
    EXPECT_LT(rel, kind == "int8" ? 0.01 : 0.1) << kind;
  }
}


// LoRA on a block split by tensor parallelism (heads 3:1 for GPT-2, 2:2 for LLaMA's two key/value
// groups), each member a thread: the adapters are the one-device model's (A drawn whole then
// cut, B in the weight's pieces), the output and the input's gradient are the one-device block's,
// each piece's gradient is its part of the whole one, and the factors held whole beside a split
// projection (tp_partial) sum to the whole gradient over the group. With dropout the keyed masks
// (model::DropoutKeys) make every member draw the one device's: the whole input's mask for a
// column-parallel adapter, its columns of it for a row-parallel one.
TEST_P(LoraArch, TensorParallelAdaptersComputeTheOneDeviceBlock) {
 for (const auto& [dropout, base_dtype] : std::vector<std::pair<double, std::string>>{{0.0, "fp32"}, {0.3, "fp32"}, {0.0, "nf4"}, {0.3, "int8"}}) {
  SCOPED_TRACE((dropout > 0 ? "dropout 0.3, " : "no dropout, ") + base_dtype + " base");
  const ModelConfig c = tiny(GetParam());
  LoraConfig l = lora(3, "all", base_dtype);
  l.dropout = dropout;
  const m::DropoutKeys keys{5, 3, {11, 4}};
  const LayerRange range = LayerRange::for_blocks(1, 2, c.layers);
  const std::vector<int64_t> bounds = c.arch == "llama" ? std::vector<int64_t>{0, 2, 4} : std::vector<int64_t>{0, 3, 4};
  Transformer ref(c, range, 11);
  ref.apply_lora(l, 11);
  perturb_adapters(ref, 4);
  auto g = at::detail::createCPUGenerator(8);
  const at::Tensor x0 = at::randn({2, c.seq_len, c.hidden}, g), w = at::randn({2, c.seq_len, c.hidden}, g);
  at::Tensor xr = x0.clone().requires_grad_(true);
  at::Tensor yr;
  {
    m::DropoutScope scope(&keys);
    yr = ref.forward(xr);
  }
  torch::autograd::backward({(yr * w).sum()});

  alloy::testing::ThreadGroup group(2);
  struct Member {
    m::TpLayout layout;
    std::unique_ptr<alloy::testing::ThreadComm> comm;
    std::unique_ptr<Transformer> t;
    at::Tensor x, y;
    std::string failure;
  };
  std::vector<Member> ms(2);
  for (int k = 0; k < 2; ++k) {
    Member& mb = ms[static_cast<size_t>(k)];
    mb.layout.pieces[1] = bounds;
    mb.layout.head_begin = bounds[static_cast<size_t>(k)], mb.layout.head_end = bounds[static_cast<size_t>(k) + 1];
    mb.comm = std::make_unique<alloy::testing::ThreadComm>(&group, k, 2);
    mb.layout.comm = mb.comm.get();
    mb.t = std::make_unique<Transformer>(c, range, 11, &mb.layout);
  }
  {  // together: a quantized base's pieces are quantized from the whole weight, summed over the group
    std::vector<std::thread> ts;
    for (auto& mb : ms) ts.emplace_back([&mb, &l] { mb.t->apply_lora(l, 11); });
    for (auto& th : ts) th.join();
  }
  for (int k = 0; k < 2; ++k) {
    Member& mb = ms[static_cast<size_t>(k)];
    std::set<std::string> built, listed;
    for (auto* p : mb.t->parameters()) built.insert(p->name);
    for (const auto& n : m::param_names(c, l, range, &mb.layout)) listed.insert(n);
    EXPECT_EQ(built, listed) << "member " << k;
    at::NoGradGuard ng;
    int64_t quantized = 0;
    for (auto* p : mb.t->parameters()) {  // each piece of the base holds exactly its part of the whole's values
      std::string base = p->name;
      int64_t h0 = 0, h1 = 0;
      if (!p->quant || !m::parse_piece(p->name, &base, &h0, &h1)) continue;
      EXPECT_TRUE(at::equal(p->value(), m::tp_cut(ref.find(base)->value(), m::tp_param(base), h0, h1, c))) << p->name;
      ++quantized;
    }
    EXPECT_EQ(quantized > 0, base_dtype != "fp32");
    for (auto* p : mb.t->trainable()) {
      std::string base = p->name;
      int64_t h0 = 0, h1 = 0;
      const bool piece = m::parse_piece(p->name, &base, &h0, &h1);
      const at::Tensor& whole = ref.find(base)->tensor;
      const at::Tensor mine = piece ? m::tp_cut(whole, m::tp_param(base), h0, h1, c) : whole;
      if (base.find("lora_A") != std::string::npos) EXPECT_TRUE(at::equal(p->tensor, mine)) << p->name;  // drawn alike
      p->tensor.copy_(mine);  // B as the perturbed reference's
      // Whole beside a split projection: A of a column-parallel weight, B of a row-parallel one.
      const bool column = base.find("c_attn") != std::string::npos || base.find("c_fc") != std::string::npos ||
                          base.find("q_proj") != std::string::npos || base.find("k_proj") != std::string::npos ||
                          base.find("v_proj") != std::string::npos || base.find("gate_proj") != std::string::npos ||
                          base.find("up_proj") != std::string::npos;
      const bool a = base.find("lora_A") != std::string::npos;
      EXPECT_EQ(piece, column != a) << p->name;
      EXPECT_EQ(p->tp_partial, !piece) << p->name;
    }
  }
  std::vector<std::thread> threads;
  for (auto& mb : ms)
    threads.emplace_back([&mb, &x0, &w, &keys] {
      try {
        mb.x = x0.clone().requires_grad_(true);
        {
          m::DropoutScope scope(&keys);
          mb.y = mb.t->forward(mb.x);
        }
        torch::autograd::backward({(mb.y * w).sum()});
      } catch (const std::exception& e) {
        mb.failure = e.what();
      }
    });
  for (auto& th : threads) th.join();
  std::map<std::string, at::Tensor> partial_sums;
  for (auto& mb : ms) {
    ASSERT_EQ(mb.failure, "");
    EXPECT_TRUE(at::allclose(mb.y, yr, 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(mb.x.grad(), xr.grad(), 1e-5, 1e-6));
    for (auto* p : mb.t->trainable()) {
      std::string base = p->name;
      int64_t h0 = 0, h1 = 0;
      ASSERT_TRUE(p->tensor.grad().defined()) << p->name;
      if (m::parse_piece(p->name, &base, &h0, &h1)) {
        EXPECT_TRUE(at::allclose(p->tensor.grad(), m::tp_cut(ref.find(base)->tensor.grad(), m::tp_param(base), h0, h1, c), 1e-5, 1e-6)) << p->name;
      } else {
        auto& s = partial_sums[base];
        s = s.defined() ? s + p->tensor.grad() : p->tensor.grad().clone();
      }
    }
  }
  EXPECT_FALSE(partial_sums.empty());
  for (const auto& [name, sum] : partial_sums) {
    const at::Tensor& whole = ref.find(name)->tensor.grad();
    EXPECT_TRUE(at::allclose(sum, whole, 1e-5, 1e-6)) << name;
    EXPECT_FALSE(at::allclose(ms[0].t->find(name)->tensor.grad(), whole, 1e-3, 1e-6)) << name << ": one member's part alone";
  }
 }
}

// A sample's masks are its own: the same two samples in one micro-batch or in two, in either
// order, draw the same masks; another step draws others; without keys (no scope) the generator's.
TEST_P(LoraArch, DropoutMasksAreKeyedBySampleNotByMicroBatch) {
  const ModelConfig c = tiny(GetParam());
  LoraConfig l = lora(4, "all");
  l.dropout = 0.3;
  auto t = Transformer::full(c, 5);
  t->apply_lora(l, 5);
  perturb_adapters(*t, 9);
  const at::Tensor x = tokens(c, 2, 3);
  auto run = [&](const at::Tensor& in, std::vector<int64_t> samples, int64_t step) {
    const m::DropoutKeys k{77, step, std::move(samples)};
    m::DropoutScope scope(&k);
    at::AutoGradMode training(true);  // dropout draws while training only
    return t->forward(in).detach();
  };
  const at::Tensor both = run(x, {11, 4}, 1);
  const at::Tensor first = run(x.narrow(0, 0, 1), {11}, 1), second = run(x.narrow(0, 1, 1), {4}, 1);
  EXPECT_TRUE(at::allclose(both.narrow(0, 0, 1), first, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(both.narrow(0, 1, 1), second, 1e-5, 1e-6));
  const at::Tensor swapped = run(at::cat({x.narrow(0, 1, 1), x.narrow(0, 0, 1)}), {4, 11}, 1);
  EXPECT_TRUE(at::allclose(swapped.narrow(0, 0, 1), second, 1e-5, 1e-6));
  EXPECT_FALSE(at::allclose(run(x, {11, 4}, 2), both, 1e-3, 1e-5));  // another step, other masks
  at::NoGradGuard eval;
  EXPECT_TRUE(at::equal(t->forward(x), t->forward(x)));  // validation: no dropout
  // Keys for another number of samples than the input's rows are a bug, not a draw.
  const m::DropoutKeys three{1, 1, {0, 1, 2}};
  m::DropoutScope scope(&three);
  EXPECT_THROW(m::lora_dropout(at::ones({2, 4, 8}), 0.5, true, "m", {}, 0), std::logic_error);
  EXPECT_THROW(m::lora_dropout(at::ones({8, 8}), 0.5, true, "m", {}, 0), std::logic_error);
  EXPECT_EQ(m::lora_dropout(at::ones({6, 8}), 0.5, true, "m", {}, 0).size(0), 6);
}

// A holder of every piece without a group (a replica beside a tensor-parallel stage) quantizes
// the whole weight as one device does: its pieces dequantize to the one device's values.
TEST(LoraTensorParallel, AQuantizedBasesPiecesAreTheOneDeviceWeightsParts) {
  for (const std::string arch : {"gpt2", "llama"})
    for (const std::string kind : {"int8", "nf4"})
      for (bool dq : {false, true}) {
        SCOPED_TRACE(arch + " " + kind + (dq ? " double-quantized" : ""));
        const ModelConfig c = tiny(arch);
        LoraConfig l = lora(2, "all", kind);
        l.double_quant = dq;
        const LayerRange range = LayerRange::for_blocks(1, 2, c.layers);
        Transformer whole(c, range, 11);
        whole.apply_lora(l, 11);
        m::TpLayout tp;
        tp.pieces[1] = arch == "llama" ? std::vector<int64_t>{0, 2, 4} : std::vector<int64_t>{0, 1, 3, 4};
        Transformer t(c, range, 11, &tp);
        t.apply_lora(l, 11);
        int64_t pieces = 0;
        at::NoGradGuard ng;
        for (auto* p : t.parameters()) {
          std::string base = p->name;
          int64_t h0 = 0, h1 = 0;
          if (!m::parse_piece(p->name, &base, &h0, &h1) || !whole.find(base)->quant) continue;
          ASSERT_TRUE(p->quant) << p->name;
          EXPECT_TRUE(at::equal(p->value(), m::tp_cut(whole.find(base)->value(), m::tp_param(base), h0, h1, c))) << p->name;
          EXPECT_LE(p->quant->bytes(), 2 * whole.find(base)->quant->bytes()) << p->name;
          ++pieces;
        }
        EXPECT_GT(pieces, 0);
        const at::Tensor x = at::randn({2, c.seq_len, c.hidden}, at::detail::createCPUGenerator(3));
        EXPECT_TRUE(at::allclose(t.forward(x), whole.forward(x), 1e-5, 1e-6));
      }
}

// A group whose pieces cannot be cut from the nf4 quantization (head_dim 3: pieces of odd width)
// fails on every member, in the same sum, naming what to change: none waits in a later sum for
// a member that has already given up.
TEST(LoraTensorParallel, AnNf4PieceThatCannotBeCutFailsOnEveryMember) {
  ModelConfig c = tiny("gpt2");
  c.hidden = 12;  // 4 heads of 3
  const LayerRange range = LayerRange::for_blocks(1, 2, c.layers);
  alloy::testing::ThreadGroup group(2);
  std::vector<std::unique_ptr<alloy::testing::ThreadComm>> comms;
  std::vector<m::TpLayout> layouts(2);
  std::vector<std::unique_ptr<Transformer>> ts;
  for (int k = 0; k < 2; ++k) {
    layouts[static_cast<size_t>(k)].pieces[1] = {0, 3, 4};
    layouts[static_cast<size_t>(k)].head_begin = k == 0 ? 0 : 3, layouts[static_cast<size_t>(k)].head_end = k == 0 ? 3 : 4;
    comms.push_back(std::make_unique<alloy::testing::ThreadComm>(&group, k, 2));
    layouts[static_cast<size_t>(k)].comm = comms.back().get();
    ts.push_back(std::make_unique<Transformer>(c, range, 11, &layouts[static_cast<size_t>(k)]));
  }
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < 2; ++k)
    threads.emplace_back([&, k] {
      try {
        ts[k]->apply_lora(lora(2, "all", "nf4"), 11);
      } catch (const std::invalid_argument& e) {
        errors[k] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (const auto& e : errors) {
    EXPECT_NE(e.find("cannot cut its piece from the nf4 quantization"), std::string::npos) << e;
    EXPECT_NE(e.find("lora.base_dtype int8"), std::string::npos) << e;
  }
  // int8 keeps a scale per channel: any split cuts.
  for (size_t k = 0; k < 2; ++k) ts[k] = std::make_unique<Transformer>(c, range, 11, &layouts[k]);
  threads.clear();
  for (size_t k = 0; k < 2; ++k) threads.emplace_back([&, k] { ts[k]->apply_lora(lora(2, "all", "int8"), 11); });
  for (auto& th : threads) th.join();
}

TEST(Quantize, APartKeepsTheWholesValuesOrSaysWhyItCannot) {
  auto g = at::detail::createCPUGenerator(5);
  const at::Tensor w = at::randn({12, 40}, g);
  const at::Tensor index = at::arange(w.numel(), at::kLong).view({12, 40});
  for (const std::string kind : {"int8", "nf4"})
    for (int64_t ch : {0, 1}) {
      const auto q = m::quantize(w, kind, ch, kind == "nf4" && ch == 1);
      for (const at::Tensor& part : {index.narrow(1, 8, 16), index.narrow(0, 4, 6), index.narrow(1, 36, 4)}) {
        const auto p = m::quantized_part(*q, part.contiguous());
        EXPECT_TRUE(at::equal(p->dequantize(), q->dequantize().reshape({-1}).index_select(0, part.reshape({-1})).view(part.sizes())))
            << kind << " " << part.sizes();
      }
    }
  // Rows of 3 elements cross the 64-element blocks in no common run of 2.
  const auto q = m::quantize(w, "nf4", 0, false);
  try {
    m::quantized_part(*q, index.narrow(1, 0, 3).narrow(0, 0, 1).contiguous());
    FAIL() << "an odd piece of an nf4 weight";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("even columns"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, LoraArch, ::testing::Values("gpt2", "llama", "qwen2"));

TEST(Quantize, Int8ErrorIsHalfAStepOfEachChannelsScale) {
  auto g = at::detail::createCPUGenerator(3);
  at::Tensor w = at::randn({48, 20}, g) * at::linspace(0.1, 3.0, 20);  // channels (dim 1) of unlike scales
  auto q = m::quantize(w, "int8", 1, false);
  at::Tensor d = q->dequantize();
  at::Tensor step = w.abs().amax({0}) / 127.0;
  EXPECT_TRUE(((d - w).abs() <= step / 2 + 1e-6).all().item<bool>());
  EXPECT_TRUE(at::allclose(d.abs().amax({0}), w.abs().amax({0}), 1e-6, 1e-6));  // each channel's extreme exact
  EXPECT_EQ(q->bytes(), 48 * 20 + 20 * 4);
}

TEST(Quantize, Nf4ValuesAreLevelsTimesTheBlocksAbsmax) {
  auto g = at::detail::createCPUGenerator(4);
  at::Tensor w = at::randn({10, 70}, g);  // 700 elements: 11 blocks, the last one partial
  w.view({-1})[5] = 0;
  auto q = m::quantize(w, "nf4", 0, false);
  at::Tensor d = q->dequantize();
  ASSERT_EQ(d.sizes(), w.sizes());
  EXPECT_EQ(d.view({-1})[5].item<float>(), 0.0f);  // NF4 has an exact zero
  at::Tensor flat = at::zeros({11 * 64});
  flat.narrow(0, 0, 700).copy_(w.view({-1}));
  at::Tensor absmax = flat.view({11, 64}).abs().amax({1});
  at::Tensor levels = at::tensor(m::nf4_levels());
  at::Tensor dflat = at::zeros({11 * 64});
  dflat.narrow(0, 0, 700).copy_(d.view({-1}));
  at::Tensor ratio = dflat.view({11, 64}) / absmax.unsqueeze(1);
  // Every value is one of the 16 levels of its block, and the nearest one.
  at::Tensor dist = (ratio.unsqueeze(-1) - levels).abs().amin(-1);
  EXPECT_LT(dist.max().item<double>(), 1e-6);
  at::Tensor wr = flat.view({11, 64}) / absmax.unsqueeze(1);
  at::Tensor best = (wr.unsqueeze(-1) - levels).abs().amin(-1);
  EXPECT_TRUE(((wr - ratio).abs() <= best + 1e-6).all().item<bool>());
  EXPECT_EQ(q->bytes(), 11 * 32 + 11 * 4);
}

TEST(Quantize, DoubleQuantizedScalesAreCloseAndSmaller) {
  auto g = at::detail::createCPUGenerator(5);
  at::Tensor w = at::randn({256, 300}, g);
  auto plain = m::quantize(w, "nf4", 0, false), dq = m::quantize(w, "nf4", 0, true);
  EXPECT_LT(dq->bytes(), plain->bytes());
  const int64_t blocks = 256 * 300 / 64;
  const int64_t scale_blocks = (blocks + 255) / 256;  // int8 scales padded to whole blocks of 256
  EXPECT_EQ(dq->bytes(), 256 * 300 / 2 + scale_blocks * 256 + scale_blocks * 4);
  const double err_plain = (plain->dequantize() - w).abs().mean().item<double>();
  const double err_dq = (dq->dequantize() - w).abs().mean().item<double>();
  EXPECT_LT(err_dq, err_plain * 1.05);  // the scales' own error adds little
  EXPECT_LT(static_cast<double>(dq->bytes()) / static_cast<double>(w.numel() * 4), 0.133);
}

TEST(Quantize, MatmulGradientFlowsThroughTheDequantizedWeight) {
  auto g = at::detail::createCPUGenerator(6);
  for (bool in_out : {true, false}) {
    at::Tensor w = at::randn(in_out ? std::vector<int64_t>{12, 7} : std::vector<int64_t>{7, 12}, g);
    auto q = m::quantize(w, "nf4", in_out ? 1 : 0, false);
    at::Tensor wd = q->dequantize();
    at::Tensor x = at::randn({5, 12}, g).requires_grad_(true);
    at::Tensor x2 = x.detach().clone().requires_grad_(true);
    at::Tensor y = m::quantized_matmul(x, q, in_out);
    at::Tensor y2 = in_out ? at::matmul(x2, wd) : at::linear(x2, wd);
    EXPECT_TRUE(at::allclose(y, y2, 1e-6, 1e-6));
    at::Tensor up = at::randn(y.sizes(), g);
    torch::autograd::backward({y}, {up});
    torch::autograd::backward({y2}, {up});
    EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-6, 1e-6)) << in_out;
  }
}

// Rank-stabilized LoRA (lora.rslora, PEFT's use_rslora): the adapters' output is scaled by
// alpha / sqrt(rank). At rank 4, rsLoRA with alpha 8 (8 / 2) computes exactly what plain LoRA with
// alpha 16 (16 / 4) does, and not what plain alpha 8 does; PEFT's config says which it was.
TEST(Lora, RsLoraScalesByTheRootOfTheRank) {
  LoraConfig rs = lora(4, "all");
  rs.rslora = true;
  EXPECT_DOUBLE_EQ(rs.scale(), 4.0);
  EXPECT_DOUBLE_EQ(lora(4, "all").scale(), 2.0);
  LoraConfig plain16 = lora(4, "all");
  plain16.alpha = 16;
  const ModelConfig c = tiny("llama");
  auto forward = [&](const LoraConfig& l) {
    auto t = Transformer::full(c, 5);
    t->apply_lora(l, 5);
    perturb_adapters(*t, 9);
    return t->forward(tokens(c, 2, 3));
  };
  EXPECT_TRUE(at::equal(forward(rs), forward(plain16)));
  EXPECT_FALSE(at::allclose(forward(rs), forward(lora(4, "all"))));
  EXPECT_EQ(m::peft_adapter_config(c, rs, "base.safetensors")["use_rslora"], true);
  EXPECT_EQ(m::peft_adapter_config(c, plain16, "base.safetensors")["use_rslora"], false);
  EXPECT_TRUE(Config::from_yaml_string("lora: {rank: 4, rslora: true}\n", "t.yaml").lora.rslora);
}
