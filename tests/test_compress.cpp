// Gradient compression: threshold estimators, error feedback, the exchanges against a dense
// reference, and the per-set sync engine over an in-process hub (threads, no sockets).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>

#include "alloy/core/config.h"
#include "alloy/dist/compress/codec.h"
#include "alloy/dist/compress/comm.h"
#include "alloy/dist/compress/sparsify.h"
#include "alloy/dist/compressed_sync.h"
#include "alloy/model/transformer.h"

using namespace alloy::dist::compress;
using alloy::GradSyncConfig;
using alloy::dist::CompressedSync;

namespace {

// The steady state: no exact steps first, no density warm-up (tests of those set them).
GradSyncConfig steady() {
  GradSyncConfig g;
  g.dense_steps = 0;
  g.warmup_steps = 0;
  return g;
}

at::Generator gen(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

at::Tensor normal(int64_t n, uint64_t seed) { return at::randn({n}, gen(seed), at::kFloat) * 1e-3; }

at::Tensor laplace(int64_t n, uint64_t seed) {
  at::Tensor e = at::empty({n}, at::kFloat).exponential_(1.0, gen(seed));
  at::Tensor sign = at::randint(2, {n}, gen(seed + 1), at::kFloat) * 2 - 1;
  return e * sign * 1e-3;
}

// Gradients of a real model after a few training steps on real text: the distribution threshold
// estimators meet in training (heavy-tailed, different per tensor).
std::vector<at::Tensor> real_gradients() {
  static std::vector<at::Tensor> cache;
  if (!cache.empty()) return cache;
  alloy::ModelConfig m;
  m.arch = "gpt2";
  m.layers = 2;
  m.hidden = 128;
  m.heads = 4;
  m.seq_len = 32;
  m.vocab_size = 257;
  auto model = alloy::model::Transformer::full(m, 3);
  std::string text;
  std::ifstream f("/usr/share/games/fortunes/fortunes", std::ios::binary);  // installed by scripts/install-deps.sh
  if (f) text.assign(std::istreambuf_iterator<char>(f), {});
  if (text.size() < 100000) {  // a stand-in with English-like byte statistics
    for (int i = 0; text.size() < 100000; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  }
  auto params = model->parameters();
  for (int step = 0; step < 6; ++step) {
    at::Tensor batch = at::empty({8, m.seq_len + 1}, at::kLong);
    for (int64_t b = 0; b < 8; ++b)
      for (int64_t t = 0; t <= m.seq_len; ++t)
        batch[b][t] = static_cast<unsigned char>(text[static_cast<size_t>(step * 4096 + b * 400 + t)]);
    for (auto* p : params) p->tensor.mutable_grad() = at::Tensor();
    at::Tensor loss = alloy::model::Transformer::loss_sum(model->forward(batch.narrow(1, 0, m.seq_len)), batch.narrow(1, 1, m.seq_len)) /
                      (8.0 * static_cast<double>(m.seq_len));
    loss.backward();
    at::NoGradGuard ng;
    for (auto* p : params) p->tensor.sub_(p->tensor.grad().sign() * 1e-3);  // a few signSGD steps: grads of a trained-ish model
  }
  for (auto* p : params)
    if (p->tensor.numel() >= 20000) cache.push_back(p->tensor.grad().reshape({-1}).clone());
  return cache;
}

struct Dist {
  std::string name;
  at::Tensor x;
};

std::vector<Dist> distributions() {
  std::vector<Dist> d = {{"normal", normal(1 << 20, 1)}, {"laplace", laplace(1 << 20, 2)}};
  auto real = real_gradients();
  for (size_t i = 0; i < real.size(); ++i) d.push_back({"real" + std::to_string(i), real[i]});
  return d;
}

// Runs FN(rank, comm) on N threads over one hub.
void on_members(int n, const std::function<void(int, Comm&)>& fn) {
  LocalHub hub(n);
  std::vector<std::unique_ptr<Comm>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(hub.member(r));
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        errs[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}

at::Tensor scatter(const Encoded& e, int64_t n) {
  at::Tensor d = at::zeros({n}, at::kFloat);
  if (e.selected > 0) d.index_put_({e.indices.narrow(0, 0, e.selected)}, e.values.narrow(0, 0, e.selected));
  return d;
}

// One member's encodings of every piece of L from its gradient G, and what it sent, densely.
std::vector<Encoded> encode_all(Codec& codec, const at::Tensor& g, const BufferLayout& L, CodecState& st, const StepContext& ctx,
                                at::Tensor* sent) {
  std::vector<Encoded> parts;
  for (auto [b, len] : L.pieces) parts.push_back(codec.encode(g, b, len, {}, st, ctx));
  *sent = at::zeros({g.numel()});
  for (auto& e : parts) sent->add_(scatter(e, g.numel()));
  return parts;
}

}  // namespace

TEST(Sparsify, SpecialFunctions) {
  EXPECT_NEAR(normal_quantile(0.975), 1.959963985, 1e-8);
  EXPECT_NEAR(normal_quantile(0.5), 0.0, 1e-12);
  EXPECT_NEAR(normal_quantile(1 - 0.0005), 3.290526731, 1e-7);
  for (double x : {0.1, 1.0, 3.0}) EXPECT_NEAR(gamma_upper_regularized(1.0, x), std::exp(-x), 1e-12);
  // Q(a, x) against a numerical integral of the density for a non-integer shape.
  const double a = 2.5, x = 2.0;
  double integral = 0;
  const int N = 200000;
  for (int i = 0; i < N; ++i) {
    const double t0 = x * i / N, t1 = x * (i + 1) / N, tm = 0.5 * (t0 + t1);
    auto f = [&](double t) { return t <= 0 ? 0.0 : std::exp((a - 1) * std::log(t) - t - std::lgamma(a)); };
    integral += (t1 - t0) * (f(t0) + 4 * f(tm) + f(t1)) / 6;
  }
  EXPECT_NEAR(gamma_upper_regularized(a, x), 1 - integral, 1e-7);
  EXPECT_NEAR(gamma_upper_regularized(a, 30.0), 0.0, 1e-10);
  EXPECT_NEAR(gamma_tail_quantile(1.0, 2.0, 0.01), -2.0 * std::log(0.01), 1e-9);
  EXPECT_NEAR(gamma_upper_regularized(a, gamma_tail_quantile(a, 1.0, 0.003)), 0.003, 1e-10);
}

TEST(Sparsify, TopkAndRandomkCountsAndDeterminism) {
  at::Tensor x = laplace(100000, 5);
  Selection t = select_topk(x, 1000);
  EXPECT_EQ(t.indices.numel(), 1000);
  at::Tensor rest = x.abs().index_fill(0, t.indices, 0);
  EXPECT_GE(t.values.abs().min().item<float>(), rest.max().item<float>());
  at::Tensor a = randomk_indices(100000, 1000, 42), b = randomk_indices(100000, 1000, 42), c = randomk_indices(100000, 1000, 43);
  EXPECT_TRUE(at::equal(a, b));  // every member draws the same indices from the shared seed
  EXPECT_FALSE(at::equal(a, c));
  EXPECT_GE(a.numel(), 990);  // repeats dropped: about k^2 / 2n of them
  EXPECT_EQ(std::get<0>(at::_unique(a)).numel(), a.numel());
}

// Every threshold estimator selects within 20% of k, on normal, Laplace and real gradients, at
// densities 0.01 and 0.001, and what it selects are the largest magnitudes.
TEST(Sparsify, ThresholdEstimatorsSelectWithinTwentyPercentOfK) {
  struct M {
    const char* name;
    ThresholdMethod m;
    SidcoFit fit;
  };
  const M methods[] = {{"dgc", ThresholdMethod::Dgc, SidcoFit::Exponential},
                       {"gaussiank", ThresholdMethod::GaussianK, SidcoFit::Exponential},
                       {"redsync", ThresholdMethod::RedSync, SidcoFit::Exponential},
                       {"sidco-exp", ThresholdMethod::Sidco, SidcoFit::Exponential},
                       {"sidco-gamma", ThresholdMethod::Sidco, SidcoFit::Gamma},
                       {"sidco-gpd", ThresholdMethod::Sidco, SidcoFit::Gpd}};
  auto dists = distributions();
  ASSERT_GE(dists.size(), 4u);
  for (const auto& d : dists)
    for (double density : {0.01, 0.001})
      for (const auto& m : methods)
        for (bool exact : {false, true}) {
          const int64_t k = target_count(d.x.numel(), density);
          Selection s = select_threshold(m.m, d.x, k, exact, 7, m.fit, 2);
          const std::string what = std::string(m.name) + " on " + d.name + " at " + std::to_string(density) + (exact ? " (exact)" : "");
          EXPECT_GE(s.selected, static_cast<int64_t>(std::floor(0.8 * k))) << what << ": " << s.selected << " of k = " << k;
          EXPECT_LE(s.selected, static_cast<int64_t>(std::ceil(1.2 * k))) << what << ": " << s.selected << " of k = " << k;
          if (exact) EXPECT_EQ(s.indices.numel(), k) << what;
          at::Tensor idx = s.indices.narrow(0, 0, s.selected);
          at::Tensor rest = d.x.abs().index_fill(0, idx, 0);
          EXPECT_GE(s.values.narrow(0, 0, s.selected).abs().min().item<float>(), rest.max().item<float>()) << what;
          EXPECT_TRUE(at::equal(s.values.narrow(0, 0, s.selected), d.x.index_select(0, idx))) << what;
        }
}

// DGC after its first step: the last step's k-th magnitude as the hint, one pass, exactly the k
// largest (the set at::topk picks); a hint that no longer reaches k falls back to the sample.
TEST(Sparsify, DgcHintedSelectionSendsTheKLargestInOnePass) {
  const int64_t n = 50000, k = 500;
  at::Tensor x = laplace(n, 3);
  auto topk_set = [&](const at::Tensor& t) { return std::get<0>(std::get<1>(at::topk(t.abs(), k)).sort()); };
  double hint = 0;
  Selection first = select_dgc(x, k, true, 7, &hint);
  EXPECT_GT(first.passes, 1);  // no hint yet: the sampled estimate
  EXPECT_EQ(hint, first.values.narrow(0, 0, first.selected).abs().min().item<double>());
  const double first_hint = hint;
  // The next step's residual moves a little: one pass, the k largest, in ascending order.
  at::Tensor x2 = x * 1.05 + laplace(n, 4) * 0.05;
  for (bool exact : {true, false}) {
    hint = first_hint;
    Selection s = select_dgc(x2, k, exact, 8, &hint);
    EXPECT_EQ(s.passes, 1);
    EXPECT_EQ(s.selected, k);
    EXPECT_TRUE(at::equal(s.indices, topk_set(x2)));
    EXPECT_TRUE(at::equal(s.values, x2.index_select(0, s.indices)));
    EXPECT_EQ(hint, x2.abs().index_select(0, s.indices).min().item<double>());
  }
  // Shrunk to a third: fewer than k reach 0.85 of the hint, so the sample decides again.
  at::Tensor x3 = x2 / 3;
  Selection s = select_dgc(x3, k, true, 9, &hint);
  EXPECT_GT(s.passes, 1);
  EXPECT_EQ(s.indices.numel(), k);
  EXPECT_LT(hint, first_hint / 2);
}

// Momentum correction is DGC's by default; `on` gives every sparsifier its local velocity, which
// then appears on the first encode; `off` takes it from DGC too.
TEST(MomentumCorrection, LocalVelocityFollowsTheMode) {
  const int64_t n = 4000;
  for (const char* method : {"topk", "randomk", "dgc", "gaussiank", "redsync", "sidco", "fp16"})
    for (const char* mode : {"auto", "on", "off"}) {
      GradSyncConfig g = steady();
      g.compression = method;
      g.density = 0.01;
      g.momentum_correction = mode;
      const bool sparse = std::string(method) != "fp16";
      const bool expect = sparse && (std::string(mode) == "on" || (std::string(mode) == "auto" && std::string(method) == "dgc"));
      EXPECT_EQ(g.local_velocity(), expect) << method << " " << mode;
      auto codec = make_codec(Options::from(g, false));
      CodecState st;
      StepContext ctx;
      ctx.seed = 5;
      at::Tensor grad = normal(n, 3);
      Encoded e = codec->encode(grad, 0, n, {TensorSlot{0, n, {n}}}, st, ctx);
      ASSERT_EQ(st.velocity.defined(), expect) << method << " " << mode;
      if (!expect) continue;
      // First step: velocity == gradient, minus what was sent (factor masking).
      at::Tensor idx = e.indices.narrow(0, 0, e.selected);
      at::Tensor v = grad.clone().index_fill_(0, idx, 0.0);
      EXPECT_TRUE(at::equal(st.velocity, v)) << method;
      // Without error feedback there is nothing for a velocity to accumulate into.
      g.error_feedback = false;
      EXPECT_FALSE(g.local_velocity()) << method;
    }
}

// sent + new residual == gradient + old residual, exactly, for every lossy method but PowerSGD
// (whose residual is this member's share of the approximation error, checked below).
TEST(ErrorFeedback, SentPlusResidualEqualsInputPlusOldResidualExactly) {
  const int64_t n = 50000;
  for (const char* method : {"fp16", "bf16", "topk", "randomk", "dgc", "gaussiank", "redsync", "sidco"}) {
    GradSyncConfig g = steady();
    g.compression = method;
    g.density = 0.01;
    auto codec = make_codec(Options::from(g, false));
    Options o = Options::from(g, false);
    CodecState st;
    st.residual = laplace(n, 11);
    if (std::string(method) == "dgc") st.velocity = normal(n, 12);
    for (int step = 0; step < 3; ++step) {
      at::Tensor grad = normal(n, 20 + static_cast<uint64_t>(step));
      at::Tensor expected = st.residual.clone();
      // DGC's input is its velocity g + momentum * v, the product rounded before the sum (as the codec's loop does).
      if (st.velocity.defined()) expected.add_(at::add(grad, at::mul(st.velocity, o.dgc_momentum)));
      else expected.add_(grad);
      StepContext ctx;
      ctx.step = step;
      ctx.seed = 99;
      Encoded e = codec->encode(grad, 0, n, {TensorSlot{0, n, {n}}}, st, ctx);
      at::Tensor sent = e.dense.defined() ? e.dense.to(at::kFloat) : scatter(e, n);
      EXPECT_TRUE(at::equal(sent + st.residual, expected)) << method << " step " << step;
      if (e.indices.defined() && st.velocity.defined())  // factor masking: the velocity is cleared where values went out
        EXPECT_EQ(st.velocity.index_select(0, e.indices.narrow(0, 0, e.selected)).abs().max().item<float>(), 0.0f) << method;
    }
  }
}

// The all-gathered sparse sums equal a dense reference: each member's selection scattered into a
// dense tensor and added, in member order. Aligned (exactly k each, no sizes exchanged) and
// unaligned (threshold counts differ by member).
TEST(SparseExchange, GatheredSumsEqualTheDenseReference) {
  const int n = 3;
  const int64_t numel = 40000;
  for (const char* method : {"topk", "dgc", "redsync", "randomk"})
    for (bool aligned : {true, false}) {
      GradSyncConfig g = steady();
      g.compression = method;
      g.density = 0.02;
      g.error_feedback = false;
      std::vector<at::Tensor> grads, contribution(static_cast<size_t>(n)), decoded(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) grads.push_back(laplace(numel, 100 + static_cast<uint64_t>(r)));
      on_members(n, [&](int r, Comm& comm) {
        auto codec = make_codec(Options::from(g, aligned));
        CodecState st;
        StepContext ctx;
        ctx.seed = 5;
        ctx.contributors = n;
        BufferLayout L;
        L.begin = 0;
        L.numel = numel;
        L.pieces = {{0, numel / 2}, {numel / 2, numel - numel / 2}};  // two pieces: compress ahead
        std::vector<Encoded> parts = encode_all(*codec, grads[static_cast<size_t>(r)], L, st, ctx, &contribution[static_cast<size_t>(r)]);
        at::Tensor wire = codec->exchange(parts, L, comm, ctx);
        at::Tensor out = at::zeros({numel});
        codec->decode(wire, L, out, ctx);
        decoded[static_cast<size_t>(r)] = out;
      });
      at::Tensor ref = at::zeros({numel});
      for (auto& c : contribution) ref.add_(c);
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(at::allclose(decoded[static_cast<size_t>(r)], ref, 0, 1e-12)) << method << (aligned ? " aligned" : " unaligned");
        EXPECT_TRUE(at::equal(decoded[static_cast<size_t>(r)], decoded[0])) << method << ": members decoded different sums";
      }
    }
}

TEST(PowerSgd, ResidualsAddUpToWhatTheApproximationMissed) {
  const int n = 2;
  const int64_t rows = 64, cols = 48;
  GradSyncConfig g = steady();
  g.compression = "powersgd";
  g.powersgd_rank = 2;
  std::vector<at::Tensor> grads, residual(n), out(n);
  for (int r = 0; r < n; ++r) grads.push_back(at::randn({rows * cols}, gen(300 + static_cast<uint64_t>(r))));
  on_members(n, [&](int r, Comm& comm) {
    auto codec = make_codec(Options::from(g, false));
    CodecState st;
    StepContext ctx;
    ctx.seed = 17;
    ctx.contributors = n;
    TensorSlot slot{0, rows * cols, {rows, cols}};
    BufferLayout L{0, rows * cols, {{0, rows * cols}}, {slot}};
    std::vector<Encoded> parts{codec->encode(grads[static_cast<size_t>(r)], 0, rows * cols, {slot}, st, ctx)};
    at::Tensor wire = codec->exchange(parts, L, comm, ctx);
    at::Tensor o = at::zeros({rows * cols});
    codec->decode(wire, L, o, ctx);
    codec->after_decode(parts, o, st, ctx);
    residual[static_cast<size_t>(r)] = st.residual.clone();
    out[static_cast<size_t>(r)] = o;
  });
  EXPECT_TRUE(at::equal(out[0], out[1]));
  at::Tensor total = grads[0] + grads[1];
  EXPECT_TRUE(at::allclose(out[0] + residual[0] + residual[1], total, 1e-5, 1e-5));
  // The rank-2 approximation captures part of the sum, not nothing and not everything.
  const double kept = (total - (residual[0] + residual[1])).norm().item<double>() / total.norm().item<double>();
  EXPECT_GT(kept, 0.05);
  EXPECT_LT(kept, 0.99);
}

namespace {

struct Member {
  std::vector<alloy::model::Param> params;
  std::vector<alloy::model::Param*> ptrs;
};

// Params of one member (backward order): a few matrices and vectors, gradients set per step.
Member make_member(const std::vector<std::vector<int64_t>>& shapes) {
  Member m;
  for (size_t i = 0; i < shapes.size(); ++i) m.params.push_back({"p" + std::to_string(i), at::zeros(shapes[i]).requires_grad_(), true});
  for (auto& p : m.params) m.ptrs.push_back(&p);
  return m;
}

const std::vector<std::vector<int64_t>> kShapes = {{256}, {256, 64}, {64}, {64, 256}, {512}, {128, 96}};

at::Tensor grad_of(int member, int step, size_t param, const std::vector<int64_t>& shape) {
  return at::randn(shape, gen(1000 * static_cast<uint64_t>(member) + 10 * static_cast<uint64_t>(step) + param));
}

// Runs STEPS steps of a set of N members through CompressedSync with TOPOLOGY(r) and returns each
// member's synced gradients of the last step and the exact sums.
struct SyncRun {
  std::vector<std::vector<at::Tensor>> got;   // [member][param]
  std::vector<at::Tensor> exact;              // [param]
};

SyncRun run_sync(int n, const GradSyncConfig& g, int steps, const std::function<CompressedSync::Topology(int)>& topology) {
  SyncRun out;
  out.got.resize(static_cast<size_t>(n));
  std::vector<Member> members;
  for (int r = 0; r < n; ++r) members.push_back(make_member(kShapes));
  std::vector<std::unique_ptr<CompressedSync>> syncs;
  for (int r = 0; r < n; ++r) syncs.push_back(std::make_unique<CompressedSync>(members[static_cast<size_t>(r)].ptrs, topology(r), g, 77, "test"));
  for (int step = 0; step < steps; ++step) {
    std::vector<std::thread> ts;
    std::vector<std::exception_ptr> errs(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        try {
          auto& m = members[static_cast<size_t>(r)];
          for (size_t i = 0; i < m.params.size(); ++i) m.params[i].tensor.mutable_grad() = grad_of(r, step, i, kShapes[i]);
          syncs[static_cast<size_t>(r)]->sync_now(step);
        } catch (...) {
          errs[static_cast<size_t>(r)] = std::current_exception();
        }
      });
    for (auto& t : ts) t.join();
    for (auto& e : errs)
      if (e) std::rethrow_exception(e);
  }
  for (size_t i = 0; i < kShapes.size(); ++i) {
    at::Tensor sum = at::zeros(kShapes[i]);
    for (int r = 0; r < n; ++r) sum.add_(grad_of(r, steps - 1, i, kShapes[i]));
    out.exact.push_back(sum);
    for (int r = 0; r < n; ++r) out.got[static_cast<size_t>(r)].push_back(members[static_cast<size_t>(r)].params[i].tensor.grad().clone());
  }
  return out;
}

}  // namespace

// Every fusion strategy, flat over 3 members: top-k at density 1 reproduces the exact sum, and a
// lossy method gives every member the same gradients (replicas stay identical).
TEST(CompressedSync, FlatEveryFusionExactAtDensityOneAndMembersAgree) {
  for (const auto& fusion : GradSyncConfig::fusion_strategies()) {
    for (const char* method : {"topk", "oktopk", "dgc"}) {
      GradSyncConfig g = steady();
      g.compression = method;
      const bool exact = std::string(method) != "dgc";
      g.density = exact ? 1.0 : 0.05;
      g.fusion = fusion;
      g.dense_steps = 0;
      g.bucket_mb = 0.1;  // several buffers
      auto hubs = std::make_shared<LocalHub>(3);
      SyncRun r = run_sync(3, g, 12, [&](int rank) {
        CompressedSync::Topology t;
        t.flat = hubs->member(rank);
        return t;
      });
      for (size_t i = 0; i < kShapes.size(); ++i) {
        if (exact) EXPECT_TRUE(at::allclose(r.got[0][i], r.exact[i], 1e-6, 1e-6)) << fusion << " " << method << " param " << i;
        for (int m = 1; m < 3; ++m) EXPECT_TRUE(at::equal(r.got[static_cast<size_t>(m)][i], r.got[0][i])) << fusion << " " << method;
      }
    }
  }
}

// Four members in two regions {0,1} {2,3}: exact inside a region, compressed between the leaders
// (0 and 2), the wire broadcast to 1 and 3.
TEST(CompressedSync, HierarchicalRegionsSumExactlyInsideAndAgree) {
  for (const char* method : {"topk", "dgc", "fp16", "powersgd"}) {
    GradSyncConfig g = steady();
    g.compression = method;
    g.scope = "slow-links";
    g.density = std::string(method) == "topk" ? 1.0 : 0.1;
    g.dense_steps = 0;
    g.bucket_mb = 0.1;
    auto region_a = std::make_shared<LocalHub>(2), region_b = std::make_shared<LocalHub>(2), leaders = std::make_shared<LocalHub>(2);
    SyncRun r = run_sync(4, g, 6, [&](int rank) {
      CompressedSync::Topology t;
      t.region = (rank < 2 ? region_a : region_b)->member(rank % 2);
      if (rank % 2 == 0) t.leaders = leaders->member(rank / 2);
      t.regions = 2;
      return t;
    });
    for (size_t i = 0; i < kShapes.size(); ++i) {
      if (std::string(method) == "topk") EXPECT_TRUE(at::allclose(r.got[1][i], r.exact[i], 1e-5, 1e-6)) << method << " param " << i;
      if (std::string(method) == "fp16") EXPECT_TRUE(at::allclose(r.got[3][i], r.exact[i], 1e-2, 1e-2)) << method << " param " << i;
      for (int m = 1; m < 4; ++m) EXPECT_TRUE(at::equal(r.got[static_cast<size_t>(m)][i], r.got[0][i])) << method << " member " << m;
    }
  }
}

TEST(CompressedSync, WarmupRaisesDensityFirstAfterTheExactSteps) {
  GradSyncConfig g = steady();
  g.compression = "dgc";
  g.density = 0.001;
  g.warmup_steps = 4;
  g.dense_steps = 10;
  Options o = Options::from(g, false);
  EXPECT_DOUBLE_EQ(o.density_at(10), 0.25);
  EXPECT_NEAR(o.density_at(12), std::sqrt(0.25 * 0.001), 1e-12);
  EXPECT_DOUBLE_EQ(o.density_at(14), 0.001);
  EXPECT_DOUBLE_EQ(o.density_at(100), 0.001);
}

// The first dense_steps steps sum exactly through the same groups, whatever the method.
TEST(CompressedSync, DenseStepsSumExactly) {
  GradSyncConfig g = steady();
  g.compression = "dgc";
  g.density = 0.01;
  g.dense_steps = 5;
  auto hubs = std::make_shared<LocalHub>(2);
  SyncRun r = run_sync(2, g, 3, [&](int rank) {
    CompressedSync::Topology t;
    t.flat = hubs->member(rank);
    return t;
  });
  for (size_t i = 0; i < kShapes.size(); ++i) EXPECT_TRUE(at::allclose(r.got[1][i], r.exact[i], 1e-6, 1e-7)) << i;
}

#include "alloy/core/plan.h"
#include "alloy/dist/sync_layout.h"

TEST(SyncLayout, RegionsFromSlowLinksDecideWhatIsCompressed) {
  using alloy::dist::split_regions;
  EXPECT_EQ(split_regions({0, 1, 2, 3}, {{0, 2}, {0, 3}, {1, 2}, {1, 3}}), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  // Fast links join 0-1 and 1-2, so {0, 1, 2} is one region although 0-2 is slow.
  EXPECT_EQ(split_regions({0, 1, 2}, {{0, 2}}), (std::vector<std::vector<int>>{{0, 1, 2}}));
  EXPECT_EQ(split_regions({0, 2}, {{0, 2}}), (std::vector<std::vector<int>>{{0}, {2}}));

  alloy::ModelConfig m;
  m.layers = 4;
  // Pipeline 0: rank 0 [0,2) -> rank 1 [2,4); pipeline 1: rank 2 alone.
  alloy::Plan p;
  p.global_batch = 8;
  p.pipelines = {{2, 2, {{{0}, 0, 2, ""}, {{1}, 2, 4, ""}}}, {2, 2, {{{2}, 0, 4, ""}}}};
  p.slow_links = {{1, 2}};
  {
    alloy::dist::SyncLayout exact(p, m);
    for (const auto& s : exact.sets()) EXPECT_FALSE(s.compressed) << s.name;
    EXPECT_EQ(exact.holders("h.3.mlp.c_fc.weight"), (std::vector<int>{1, 2}));
    EXPECT_EQ(exact.holders("wte.weight"), (std::vector<int>{0, 1, 2}));  // tied: first and last stages
  }
  p.grad_sync.compression = "dgc";
  p.grad_sync.scope = "slow-links";
  alloy::dist::SyncLayout slow(p, m);
  const auto* early = slow.set_of({0, 2});  // blocks 0-1: the 0-2 link is fast
  const auto* late = slow.set_of({1, 2});   // blocks 2-3: across the slow link
  ASSERT_TRUE(early && late);
  EXPECT_FALSE(early->compressed);
  EXPECT_TRUE(late->compressed);
  EXPECT_TRUE(late->hierarchical);
  EXPECT_EQ(late->leaders(), (std::vector<int>{1, 2}));
  p.grad_sync.scope = "all";
  alloy::dist::SyncLayout all(p, m);
  for (const auto& s : all.sets()) {
    EXPECT_TRUE(s.compressed) << s.name;
    EXPECT_FALSE(s.hierarchical) << s.name;
    EXPECT_TRUE(s.trees.empty()) << s.name;  // compressed sets have their own routes
  }
}

// Exact sets of three or more ranks with a slow pair among them sum along a tree; pairs, sets
// without a slow pair and `allreduce: ring` keep the ring.
TEST(SyncLayout, ExactSetsAroundASlowLinkSumAlongATree) {
  alloy::ModelConfig m;
  m.layers = 4;
  alloy::Plan p;  // three full replicas, the 3-device pool's slow link between ranks 0 and 2
  p.global_batch = 6;
  p.pipelines = {{2, 1, {{{0}, 0, 4, ""}}}, {2, 1, {{{1}, 0, 4, ""}}}, {2, 1, {{{2}, 0, 4, ""}}}};
  p.slow_links = {{0, 2}};
  {
    alloy::dist::SyncLayout l(p, m);
    ASSERT_EQ(l.sets().size(), 1u);
    ASSERT_EQ(l.sets()[0].trees.size(), 1u);  // its tree crosses no slow pair: nothing to stripe
    const auto& t = l.sets()[0].trees[0];
    EXPECT_EQ(t.root, 1);
    EXPECT_EQ(t.parent, (std::vector<int>{1, -1, 1}));
  }
  p.grad_sync.allreduce = "ring";
  EXPECT_TRUE(alloy::dist::SyncLayout(p, m).sets()[0].trees.empty());
  p.grad_sync.allreduce = "auto";
  p.slow_links.clear();
  EXPECT_TRUE(alloy::dist::SyncLayout(p, m).sets()[0].trees.empty());
  // A pipeline beside a replica: the pair sets {0, 2} and {1, 2} keep the ring; the tied
  // embedding's set {0, 1, 2} has the slow pair 1-2 and goes around it through rank 0.
  p.pipelines = {{2, 2, {{{0}, 0, 2, ""}, {{1}, 2, 4, ""}}}, {2, 1, {{{2}, 0, 4, ""}}}};
  p.slow_links = {{1, 2}};
  alloy::dist::SyncLayout mixed(p, m);
  EXPECT_TRUE(mixed.set_of({0, 2})->trees.empty());
  EXPECT_TRUE(mixed.set_of({1, 2})->trees.empty());
  ASSERT_EQ(mixed.set_of({0, 1, 2})->trees.size(), 1u);
  EXPECT_EQ(mixed.set_of({0, 1, 2})->trees[0].root, 0);
}

// Four replicas in two regions of two, every cross pair slow (examples/cluster-2region.yaml): the
// sum is striped over two trees that cross at different pairs, 1-2 and 0-3, so each of the two
// lines carries half of every bucket; tree_stripes 1 keeps one tree.
TEST(SyncLayout, TwoRegionsStripeTheSumOverSeparateSlowPairs) {
  alloy::ModelConfig m;
  m.layers = 4;
  alloy::Plan p;
  p.global_batch = 8;
  p.pipelines = {{2, 1, {{{0}, 0, 4, ""}}}, {2, 1, {{{1}, 0, 4, ""}}}, {2, 1, {{{2}, 0, 4, ""}}}, {2, 1, {{{3}, 0, 4, ""}}}};
  p.slow_links = {{0, 2}, {0, 3}, {1, 2}, {1, 3}};
  alloy::dist::SyncLayout l(p, m);
  ASSERT_EQ(l.sets().size(), 1u);
  const auto& trees = l.sets()[0].trees;
  ASSERT_EQ(trees.size(), 2u);
  EXPECT_EQ(trees[0].parent, (std::vector<int>{1, -1, 1, 2}));  // crosses at 1-2
  EXPECT_EQ(trees[1].parent, (std::vector<int>{-1, 0, 3, 0}));  // crosses at 0-3
  p.grad_sync.tree_stripes = 1;
  EXPECT_EQ(alloy::dist::SyncLayout(p, m).sets()[0].trees.size(), 1u);
}

#include <rapidcheck/gtest.h>

// Random sizes, densities, methods and old residuals: error feedback never loses or invents a bit.
RC_GTEST_PROP(ErrorFeedbackProperty, ExactForEveryLossyMethodAndSize, ()) {
  const int64_t n = *rc::gen::inRange<int64_t>(1, 5000);
  GradSyncConfig g = steady();
  g.compression = *rc::gen::element<std::string>("fp16", "bf16", "topk", "randomk", "dgc", "gaussiank", "redsync", "sidco", "oktopk");
  g.density = *rc::gen::element(1.0, 0.5, 0.1, 0.01, 0.001);
  g.momentum_correction = *rc::gen::element<std::string>("auto", "on", "off");
  const bool aligned = *rc::gen::arbitrary<bool>();
  const Options o = Options::from(g, aligned);
  auto codec = make_codec(o);
  CodecState st;
  st.residual = laplace(n, *rc::gen::inRange<uint64_t>(0, 1000));
  if (g.local_velocity()) st.velocity = normal(n, 7);
  at::Tensor grad = normal(n, *rc::gen::inRange<uint64_t>(1000, 2000));
  at::Tensor expected = st.residual.clone();
  if (st.velocity.defined()) expected.add_(at::add(grad, at::mul(st.velocity, o.dgc_momentum)));
  else expected.add_(grad);
  StepContext ctx;
  ctx.seed = *rc::gen::inRange<uint64_t>(0, 1u << 30);
  Encoded e = codec->encode(grad, 0, n, {TensorSlot{0, n, {n}}}, st, ctx);
  at::Tensor sent = e.dense.defined() ? e.dense.to(at::kFloat) : scatter(e, n);
  RC_ASSERT(at::equal(sent + st.residual, expected));
  if (aligned && e.indices.defined() && g.compression != "randomk") RC_ASSERT(e.indices.numel() == target_count(n, g.density));
}

// 2-4 members, aligned or not: what every member decodes is the sum of everybody's selection.
RC_GTEST_PROP(SparseExchangeProperty, DecodedSumsEqualTheDenseReference, ()) {
  const int members = *rc::gen::inRange(2, 5);
  const int64_t n = *rc::gen::inRange<int64_t>(1, 4000);
  GradSyncConfig g = steady();
  g.compression = *rc::gen::element<std::string>("topk", "dgc", "gaussiank", "sidco");
  g.density = *rc::gen::element(1.0, 0.2, 0.02);
  g.error_feedback = *rc::gen::arbitrary<bool>();
  const bool aligned = *rc::gen::arbitrary<bool>();
  std::vector<at::Tensor> grads, mine(static_cast<size_t>(members)), got(static_cast<size_t>(members));
  for (int r = 0; r < members; ++r) grads.push_back(laplace(n, 50 + static_cast<uint64_t>(r)));
  on_members(members, [&](int r, Comm& comm) {
    auto codec = make_codec(Options::from(g, aligned));
    CodecState st;
    StepContext ctx;
    ctx.contributors = members;
    BufferLayout L{0, n, {{0, n}}, {}};
    std::vector<Encoded> parts{codec->encode(grads[static_cast<size_t>(r)], 0, n, {}, st, ctx)};
    mine[static_cast<size_t>(r)] = scatter(parts[0], n);
    at::Tensor out = at::zeros({n});
    codec->decode(codec->exchange(parts, L, comm, ctx), L, out, ctx);
    got[static_cast<size_t>(r)] = out;
  });
  at::Tensor ref = at::zeros({n});
  for (auto& m : mine) ref.add_(m);
  for (int r = 0; r < members; ++r) {
    RC_ASSERT(at::allclose(got[static_cast<size_t>(r)], ref, 0, 1e-12));
    RC_ASSERT(at::equal(got[static_cast<size_t>(r)], got[0]));
  }
}

// Ok-Topk: each owner sums its region of the members' local top-k and keeps the largest
// ceil(k / n); every member decodes the same sum; what a member sent that no owner kept returns
// to its residual. At density 1 it is the exact sum.
TEST(OkTopk, OwnersKeepTheLargestSumsOfTheirRegionAndLostValuesReturnToTheResidual) {
  const int n = 3;
  const int64_t numel = 30001;  // regions of unequal size
  for (double density : {0.02, 1.0}) {
    GradSyncConfig g = steady();
    g.compression = "oktopk";
    g.density = density;
    std::vector<at::Tensor> grads, sent(static_cast<size_t>(n)), decoded(static_cast<size_t>(n)), residual(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) grads.push_back(laplace(numel, 300 + static_cast<uint64_t>(r)));
    std::vector<int64_t> wire_bytes(static_cast<size_t>(n));
    on_members(n, [&](int r, Comm& comm) {
      auto codec = make_codec(Options::from(g, false));
      CodecState st;
      StepContext ctx;
      ctx.seed = 9;
      ctx.contributors = n;
      BufferLayout L;
      L.begin = 0;
      L.numel = numel;
      L.pieces = {{0, 10000}, {10000, numel - 10000}};
      std::vector<Encoded> parts = encode_all(*codec, grads[static_cast<size_t>(r)], L, st, ctx, &sent[static_cast<size_t>(r)]);
      at::Tensor wire = codec->exchange(parts, L, comm, ctx);
      at::Tensor out = at::zeros({numel});
      codec->decode(wire, L, out, ctx);
      codec->after_decode(parts, out, st, ctx);
      decoded[static_cast<size_t>(r)] = out;
      residual[static_cast<size_t>(r)] = st.residual.clone();
      wire_bytes[static_cast<size_t>(r)] = comm.bytes_sent();
    });
    at::Tensor reduced = at::zeros({numel});
    for (auto& c : sent) reduced.add_(c);
    const at::Tensor kept = decoded[0].ne(0);
    for (int r = 0; r < n; ++r)
      EXPECT_TRUE(at::equal(decoded[static_cast<size_t>(r)], decoded[0])) << density << ": members decoded different sums";
    // Every kept value is the members' summed contribution there (summed in member order).
    EXPECT_TRUE(at::allclose(decoded[0], reduced * kept, 0, 1e-6)) << density;
    const int64_t k = alloy::dist::compress::target_count(10000, density) + alloy::dist::compress::target_count(numel - 10000, density);
    const int64_t keep = (k + n - 1) / n;
    for (int j = 0; j < n; ++j) {
      const int64_t lo = numel * j / n, hi = numel * (j + 1) / n;
      at::Tensor region = reduced.narrow(0, lo, hi - lo).abs(), region_kept = kept.narrow(0, lo, hi - lo);
      const int64_t nz = region.ne(0).sum().item<int64_t>(), got = region_kept.sum().item<int64_t>();
      EXPECT_EQ(got, std::min(keep, nz)) << density << " region " << j;
      // Nothing left out of a region is larger than what its owner kept.
      if (got > 0 && got < nz)
        EXPECT_LE(region.masked_select(region_kept.logical_not()).max().item<float>(),
                  region.masked_select(region_kept).min().item<float>()) << density << " region " << j;
    }
    // Error feedback: per member, kept contribution + new residual == gradient (old residual 0).
    for (int r = 0; r < n; ++r)
      EXPECT_TRUE(at::allclose(sent[static_cast<size_t>(r)] * kept + residual[static_cast<size_t>(r)], grads[static_cast<size_t>(r)], 0, 1e-6))
          << density << " member " << r;
    if (density == 1.0) {
      at::Tensor exact = grads[0] + grads[1] + grads[2];
      EXPECT_TRUE(at::allclose(decoded[0], exact, 1e-6, 1e-6));
    } else {
      // About 2k (n - 1) / n pairs per member, where an all-gather of top-k sends k (n - 1).
      EXPECT_LT(wire_bytes[0], 0.8 * 8 * k * (n - 1)) << "bytes " << wire_bytes[0] << " for k " << k;
    }
  }
}
