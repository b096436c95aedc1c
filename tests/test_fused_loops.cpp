// The hand-fused CPU loops (core/fused_loops.h) against the same math written out in double
// precision, and the candidate scan against a brute-force one.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "alloy/core/fused_loops.h"

using alloy::AdamWStep;

namespace {
std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = d(gen);
  return x;
}
}  // namespace

// Five AdamW steps of torch.optim.AdamW's math, with and without weight decay: every element within
// a few float roundings of the double-precision update.
TEST(FusedLoops, AdamWFollowsTorchsUpdateWithinFloatRounding) {
  const size_t n = 1037;
  for (const double wd : {0.0, 0.1}) {
    std::vector<float> w = randn(n, 1), m(n, 0.0f), v(n, 0.0f);
    std::vector<double> wr(w.begin(), w.end()), mr(n, 0.0), vr(n, 0.0);
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, lr = 1e-2;
    for (int t = 1; t <= 5; ++t) {
      const std::vector<float> g = randn(n, 10 + static_cast<uint32_t>(t), 0.5f);
      const double bc1 = 1 - std::pow(b1, t), bc2s = std::sqrt(1 - std::pow(b2, t));
      AdamWStep s;
      s.decay_mul = static_cast<float>(1 - lr * wd);
      s.beta1 = static_cast<float>(b1), s.one_minus_beta1 = static_cast<float>(1 - b1);
      s.beta2 = static_cast<float>(b2), s.one_minus_beta2 = static_cast<float>(1 - b2);
      s.bias_correction2_sqrt = static_cast<float>(bc2s), s.eps = static_cast<float>(eps);
      s.neg_step_size = static_cast<float>(-lr / bc1);
      alloy::adamw_update(w.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(n), s);
      for (size_t i = 0; i < n; ++i) {
        wr[i] *= 1 - lr * wd;
        mr[i] = b1 * mr[i] + (1 - b1) * g[i];
        vr[i] = b2 * vr[i] + (1 - b2) * static_cast<double>(g[i]) * g[i];
        wr[i] -= lr / bc1 * mr[i] / (std::sqrt(vr[i]) / bc2s + eps);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      // m sums terms of both signs: its rounding is relative to the gradients (about 0.5), not to m.
      ASSERT_NEAR(m[i], mr[i], 1e-6 * std::fabs(mr[i]) + 1e-7) << "m " << i << " wd " << wd;
      ASSERT_NEAR(v[i], vr[i], 1e-6 * std::fabs(vr[i]) + 1e-9) << "v " << i << " wd " << wd;
      // Each step moves w by about lr: the update's rounding is relative to that, not to w.
      ASSERT_NEAR(w[i], wr[i], 1e-6 * std::fabs(wr[i]) + 1e-7) << "w " << i << " wd " << wd;
    }
  }
}

// The scan finds exactly the indices a brute-force pass over the accumulated residual finds, in
// order and offset by BASE, and accumulates as the loop without a scan does, bit for bit.
RC_GTEST_PROP(FusedLoops, DgcScanFindsEveryCandidateAndAccumulatesAsThePlainLoop, ()) {
  const auto n = static_cast<size_t>(*rc::gen::inRange(1, 20000));
  const auto seed = *rc::gen::inRange<uint32_t>(0, 1000);
  const float floor = static_cast<float>(*rc::gen::inRange(0, 400)) / 100.0f;
  const int64_t base = *rc::gen::inRange<int64_t>(0, 1 << 20);
  const std::vector<float> g = randn(n, seed);
  std::vector<float> v = randn(n, seed + 1), r = randn(n, seed + 2);
  std::vector<float> v2 = v, r2 = r;
  std::vector<int64_t> cand;
  alloy::dgc_accumulate_scan(g.data(), v.data(), r.data(), static_cast<int64_t>(n), 0.9f, floor, base, cand);
  alloy::dgc_accumulate(g.data(), v2.data(), r2.data(), static_cast<int64_t>(n), 0.9f);
  RC_ASSERT(v == v2);
  RC_ASSERT(r == r2);
  std::vector<int64_t> want;
  for (size_t i = 0; i < n; ++i)
    if (std::fabs(r[i]) >= floor) want.push_back(base + static_cast<int64_t>(i));
  RC_ASSERT(cand == want);
  // The accumulation itself: within one rounding of each step of the formula.
  const std::vector<float> v0 = randn(n, seed + 1), r0 = randn(n, seed + 2);
  for (size_t i = 0; i < n; i += 97) {
    const double vi = static_cast<double>(g[i]) + 0.9 * static_cast<double>(v0[i]);
    RC_ASSERT(std::fabs(v[i] - vi) <= 1e-6 * (std::fabs(vi) + 1.0));
    RC_ASSERT(std::fabs(r[i] - (r0[i] + vi)) <= 1e-6 * (std::fabs(r0[i] + vi) + 1.0));
  }
}
