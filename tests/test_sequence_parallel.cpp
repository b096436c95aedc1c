#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/model/tensor_parallel.h"
#include "alloy/model/transformer.h"
#include "tiny_model.h"
#include "tp_threads.h"

using alloy::ModelConfig;
using alloy::model::LayerRange;
using alloy::model::Transformer;
namespace m = alloy::model;

namespace {

ModelConfig tiny(const std::string& arch) { return alloy::testing::tiny_model(arch); }

struct Member {
  m::TpLayout layout;
  std::unique_ptr<alloy::testing::ThreadComm> comm;
  std::unique_ptr<Transformer> t;
  at::Tensor x, out, loss;
  std::string failure;
};

// A two-member group over RANGE (heads split at BOUNDS), with or without sequence parallelism.
std::vector<Member> group_of(const ModelConfig& c, LayerRange range, const std::vector<int64_t>& bounds, bool sp,
                             alloy::testing::ThreadGroup* g) {
  std::vector<Member> ms(2);
  for (int k = 0; k < 2; ++k) {
    Member& mb = ms[static_cast<size_t>(k)];
    for (int64_t b = range.begin == 0 ? 0 : range.begin - 1; b < std::min<int64_t>(range.end - 1, c.layers); ++b) mb.layout.pieces[b] = bounds;
    mb.layout.head_begin = bounds[static_cast<size_t>(k)], mb.layout.head_end = bounds[static_cast<size_t>(k) + 1];
    mb.layout.group_heads = bounds;
    if (range.has_embedding() || range.has_head(c)) {
      for (int64_t h : bounds) mb.layout.vocab_pieces.push_back(c.vocab_size * h / c.heads);
      mb.layout.vocab_begin = mb.layout.vocab_pieces[static_cast<size_t>(k)], mb.layout.vocab_end = mb.layout.vocab_pieces[static_cast<size_t>(k) + 1];
    }
    mb.layout.sequence_parallel = sp;
    mb.comm = std::make_unique<alloy::testing::ThreadComm>(g, k, 2);
    mb.layout.comm = mb.comm.get();
    mb.t = std::make_unique<Transformer>(c, range, 7, &mb.layout);
  }
  return ms;
}

void run_all(std::vector<Member>& ms, const std::function<void(Member&)>& f) {
  std::vector<std::thread> threads;
  for (auto& mb : ms)
    threads.emplace_back([&mb, &f] {
      try {
        f(mb);
      } catch (const std::exception& e) {
        mb.failure = e.what();
      }
    });
  for (auto& th : threads) th.join();
}

// Qwen2's q/k/v biases start at zero, which would hide a bias cut to the wrong heads: give every
// bias the same nonzero values in the whole model and in each member's pieces of it.
void set_biases(Transformer& t, const ModelConfig& c) {
  at::NoGradGuard ng;
  for (auto* p : t.parameters()) {
    std::string base = p->name;
    int64_t h0 = 0, h1 = 0;
    const bool piece = m::parse_piece(p->name, &base, &h0, &h1);
    if (base.find("self_attn.") == std::string::npos || base.find("_proj.bias") == std::string::npos) continue;
    const int64_t heads = base.find("q_proj") != std::string::npos ? c.heads : c.kv_heads_resolved();
    const at::Tensor whole = at::sin(at::arange(heads * c.head_dim(), at::kFloat) * 0.7 + static_cast<double>(base.size()));
    p->tensor.copy_(piece ? m::tp_cut(whole, m::tp_param(base), h0, h1, c) : whole);
  }
}

class SeqParallel : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(SeqParallel, BoundsFollowTheHeadsAndRefuseAnEmptyShare) {
  EXPECT_EQ(m::sequence_bounds({0, 3, 4}, 32), (std::vector<int64_t>{0, 24, 32}));
  EXPECT_EQ(m::sequence_bounds({0, 2, 3, 4}, 10), (std::vector<int64_t>{0, 5, 7, 10}));
  try {
    m::sequence_bounds({0, 1, 8}, 4);
    FAIL() << "a member with no positions";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("heads 0-1 of 8 leaves a member none of the 4 positions"), std::string::npos) << e.what();
  }
}

// The whole model as one tensor-parallel stage (3:1 for GPT-2, 2:2 for LLaMA's two key/value
// groups) with sequence parallelism, each member a thread: the loss is the one-device loss, each
// piece's gradient its part of the whole one, and what members hold whole (norms, row-parallel
// biases, GPT-2's positions) gets parts that sum to the one-device gradient; a middle stage's
// output and input gradient are the one-device slice's on every member.
TEST_P(SeqParallel, TheGroupComputesTheOneDeviceModel) {
  const ModelConfig c = tiny(GetParam());
  const std::vector<int64_t> bounds = c.arch == "llama" ? std::vector<int64_t>{0, 2, 4} : std::vector<int64_t>{0, 3, 4};
  auto gen = at::detail::createCPUGenerator(3);
  const at::Tensor ids = at::randint(c.vocab_size, {2, c.seq_len}, gen, at::kLong);
  const at::Tensor targets = at::randint(c.vocab_size, {2, c.seq_len}, gen, at::kLong);

  auto ref = Transformer::full(c, 7);
  set_biases(*ref, c);
  const at::Tensor ref_loss = Transformer::loss_sum(ref->forward(ids), targets);
  torch::autograd::backward({ref_loss});

  alloy::testing::ThreadGroup g(2);
  auto ms = group_of(c, LayerRange::full(c), bounds, true, &g);
  for (auto& mb : ms) set_biases(*mb.t, c);
  for (auto& mb : ms)
    for (auto* p : mb.t->parameters()) EXPECT_EQ(p->tp_partial, p->name.find('#') == std::string::npos) << p->name;
  run_all(ms, [&](Member& mb) {
    mb.loss = mb.t->loss(mb.t->forward(ids), targets);
    torch::autograd::backward({mb.loss});
  });
  std::map<std::string, at::Tensor> sums;
  for (auto& mb : ms) {
    ASSERT_EQ(mb.failure, "");
    EXPECT_NEAR(mb.loss.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
    for (auto* p : mb.t->parameters()) {
      ASSERT_TRUE(p->tensor.grad().defined()) << p->name;
      std::string base = p->name;
      int64_t h0 = 0, h1 = 0;
      if (m::parse_piece(p->name, &base, &h0, &h1)) {
        const at::Tensor want = m::tp_cut(ref->find(base)->tensor.grad(), m::tp_param(base), h0, h1, c);
        EXPECT_TRUE(at::allclose(p->tensor.grad(), want, 1e-4, 1e-6)) << p->name;
      } else {
        auto& s = sums[p->name];
        s = s.defined() ? s + p->tensor.grad() : p->tensor.grad().clone();
      }
    }
  }
  ASSERT_FALSE(sums.empty());
  for (const auto& [name, s] : sums) {
    EXPECT_TRUE(at::allclose(s, ref->find(name)->tensor.grad(), 1e-4, 1e-6)) << name;
    // A part, not the whole: each member saw only its positions.
    EXPECT_FALSE(at::allclose(ms[0].t->find(name)->tensor.grad(), ref->find(name)->tensor.grad(), 1e-3, 1e-6)) << name;
  }

  // A middle stage (block 0's MLP half and block 1): whole input and output on every member.
  const LayerRange mid = LayerRange::for_units(1, 4, c.layers);
  Transformer ref_mid(c, mid, 7);
  set_biases(ref_mid, c);
  const at::Tensor x0 = at::randn({2, c.seq_len, c.hidden}, gen), w = at::randn({2, c.seq_len, c.hidden}, gen);
  at::Tensor xr = x0.clone().requires_grad_(true);
  const at::Tensor yr = ref_mid.forward(xr);
  torch::autograd::backward({(yr * w).sum()});
  alloy::testing::ThreadGroup g2(2);
  auto mids = group_of(c, mid, bounds, true, &g2);
  for (auto& mb : mids) set_biases(*mb.t, c);
  run_all(mids, [&](Member& mb) {
    mb.x = x0.clone().requires_grad_(true);
    mb.out = mb.t->forward(mb.x);
    torch::autograd::backward({(mb.out * w).sum()});
  });
  for (auto& mb : mids) {
    ASSERT_EQ(mb.failure, "");
    EXPECT_EQ(mb.out.sizes(), yr.sizes());
    EXPECT_TRUE(at::allclose(mb.out, yr, 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(mb.x.grad(), xr.grad(), 1e-5, 1e-6));
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, SeqParallel, ::testing::Values("gpt2", "llama", "qwen2"));
