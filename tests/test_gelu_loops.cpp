// GELU's hand-written loops (core/gelu_loops.h) against the tanh form computed in double precision,
// and the promise that each element's bits do not depend on where it sits in the array.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "alloy/core/gelu_loops.h"

namespace {

// 0.5 x (1 + tanh(u)) in double, written as x sigmoid(2u): the same function, without 1 + tanh's
// cancellation (in double too, tanh(-41) is -1 and the tanh form gives 0 where the value is 1e-35).
constexpr double kK = 0.7978845608028654;
double two_u(double x) { return 2 * kK * (x + 0.044715 * x * x * x); }
double gelu_ref(double x) { return x / (1.0 + std::exp(-two_u(x))); }
double gelu_grad_ref(double x) {
  const double s = 1.0 / (1.0 + std::exp(-two_u(x)));
  return s + x * s * (1.0 - s) * 2 * kK * (1.0 + 3.0 * 0.044715 * x * x);
}

// Every x from -30 to 30 in steps of 1/1024 (where the exponent's clamp, the sigmoid's tails and
// the polynomial's whole range are all met), plus normal draws of several scales.
std::vector<float> inputs() {
  std::vector<float> x;
  for (int i = -30 * 1024; i <= 30 * 1024; ++i) x.push_back(static_cast<float>(i) / 1024.0f);
  std::mt19937 gen(7);
  for (float scale : {1e-3f, 0.1f, 1.0f, 5.0f, 100.0f}) {
    std::normal_distribution<float> d(0.0f, scale);
    for (int i = 0; i < 4001; ++i) x.push_back(d(gen));
  }
  return x;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

// Within a few float roundings of the double-precision value, as ATen's own float kernels are
// (measured: both at about 4.4e-7 of absolute error on standard normal inputs).
TEST(GeluLoops, ForwardAndGradientFollowTheTanhFormWithinFloatRounding) {
  const std::vector<float> x = inputs();
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> y(x.size()), dy(x.size()), dx(x.size());
  std::mt19937 gen(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& g : dy) g = d(gen);
  alloy::gelu_tanh_forward(x.data(), y.data(), n);
  alloy::gelu_tanh_backward(x.data(), dy.data(), dx.data(), n);
  const double eps = std::numeric_limits<float>::epsilon();
  for (size_t i = 0; i < x.size(); ++i) {
    // For x below 0 the value is x e^-2u / (1 + e^-2u): a float's rounding of the exponent 2u moves
    // it by that rounding relative to the value, whatever the method, so the bound grows with 2u.
    const double xd = x[i], cond = 1.0 + std::min(std::fabs(two_u(xd)), 87.0);
    const double r = gelu_ref(xd);
    // Past the clamp (-2u > 87) the value is x e^-87 instead of smaller still: below 1e-37 |x|.
    const double floor = two_u(xd) < -87 ? 1e-37 * std::fabs(xd) : 0.0;
    ASSERT_NEAR(y[i], r, 4 * eps * std::fabs(r) * cond + floor) << "x = " << x[i];
    const double gr = static_cast<double>(dy[i]) * gelu_grad_ref(xd);
    // The derivative's two terms partly cancel (it dips to -0.17 near x = -0.75): bound by their size.
    ASSERT_NEAR(dx[i], gr, 8 * eps * std::fabs(dy[i]) * (1.0 + std::fabs(xd)) * cond + floor) << "x = " << x[i];
  }
}

TEST(GeluLoops, SaturatesAndPassesNaN) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {1e30f, -1e30f, 200.0f, -200.0f, 0.0f, -0.0f, nan, inf};
  std::vector<float> y(x.size()), dx(x.size());
  const std::vector<float> ones(x.size(), 1.0f);
  alloy::gelu_tanh_forward(x.data(), y.data(), static_cast<int64_t>(x.size()));
  alloy::gelu_tanh_backward(x.data(), ones.data(), dx.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[0], 1e30f);
  EXPECT_LE(std::fabs(y[1]), 1e-6f);  // -1e30 / e^87
  EXPECT_EQ(y[2], 200.0f);
  EXPECT_LE(std::fabs(y[3]), 1e-30f);  // e^-87 of x, not 0: the exponent's clamp keeps floats normal
  EXPECT_EQ(y[4], 0.0f);
  EXPECT_TRUE(std::isnan(y[6]));
  EXPECT_EQ(y[7], inf);
  EXPECT_EQ(dx[2], 1.0f);
  EXPECT_LE(std::fabs(dx[3]), 1e-30f);
  EXPECT_FLOAT_EQ(dx[4], 0.5f);
  EXPECT_TRUE(std::isnan(dx[6]));
}

// An element's value is the same bits in a whole array, in any slice of it (a tensor-parallel
// member's columns, a tail shorter than a vector) and computed in place.
RC_GTEST_PROP(GeluLoops, AnElementsBitsDoNotDependOnItsPlace, ()) {
  const std::vector<float> x = inputs();
  const auto first = *rc::gen::inRange<size_t>(0, x.size() - 1);
  const auto len = *rc::gen::inRange<size_t>(1, std::min<size_t>(40, x.size() - first) + 1);
  const int64_t n = static_cast<int64_t>(x.size());
  static std::vector<float> whole, whole_dx;
  const std::vector<float> dy(x.size(), 0.75f);
  if (whole.empty()) {
    whole.resize(x.size()), whole_dx.resize(x.size());
    alloy::gelu_tanh_forward(x.data(), whole.data(), n);
    alloy::gelu_tanh_backward(x.data(), dy.data(), whole_dx.data(), n);
  }
  std::vector<float> part(x.begin() + static_cast<long>(first), x.begin() + static_cast<long>(first + len));
  std::vector<float> g(len, 0.75f), dx(len);
  alloy::gelu_tanh_backward(part.data(), g.data(), dx.data(), static_cast<int64_t>(len));
  alloy::gelu_tanh_backward(part.data(), g.data(), g.data(), static_cast<int64_t>(len));  // in place over dy
  alloy::gelu_tanh_forward(part.data(), part.data(), static_cast<int64_t>(len));          // in place
  for (size_t i = 0; i < len; ++i) {
    RC_ASSERT(same_bits(part[i], whole[first + i]));
    RC_ASSERT(same_bits(dx[i], whole_dx[first + i]));
    RC_ASSERT(same_bits(g[i], whole_dx[first + i]));
  }
}

// Ranks on different x86-64 CPUs must train the same bits: the AVX2 build of the loops (picked
// where the CPU has it) and the SSE2 baseline agree on every element, forward and backward, with
// gradients of several scales (a saturated, a tiny and a large dy).
TEST(GeluLoops, TheAvx2AndTheBaselineBuildGiveTheSameBits) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2: both calls run the baseline build";
#else
  GTEST_SKIP() << "not x86-64: one build only";
#endif
  const std::vector<float> x = inputs();
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> dy(x.size());
  std::mt19937 gen(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = d(gen) * (i % 3 == 0 ? 1e-6f : i % 3 == 1 ? 1.0f : 1e4f);
  std::vector<float> y(x.size()), y_base(x.size()), dx(x.size()), dx_base(x.size());
  alloy::gelu_tanh_forward(x.data(), y.data(), n);
  alloy::gelu_tanh_forward_baseline(x.data(), y_base.data(), n);
  alloy::gelu_tanh_backward(x.data(), dy.data(), dx.data(), n);
  alloy::gelu_tanh_backward_baseline(x.data(), dy.data(), dx_base.data(), n);
  int64_t differ_y = 0, differ_dx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    differ_y += !same_bits(y[i], y_base[i]);
    differ_dx += !same_bits(dx[i], dx_base[i]);
  }
  EXPECT_EQ(differ_y, 0) << "of " << n << " forward values";
  EXPECT_EQ(differ_dx, 0) << "of " << n << " gradients";
}
