#include "alloy/core/gelu_loops.h"

#include <cstring>

namespace alloy {

namespace {

// sqrt(2/pi) and the cubic's coefficient, folded into a = -2u = x (kA + kB x^2) and its
// derivative z' = 2u' = kC + kD x^2.
constexpr float kA = static_cast<float>(-2.0 * 0.7978845608028654);
constexpr float kB = static_cast<float>(-2.0 * 0.7978845608028654 * 0.044715);
constexpr float kC = static_cast<float>(2.0 * 0.7978845608028654);
constexpr float kD = static_cast<float>(6.0 * 0.7978845608028654 * 0.044715);

// Eight floats as one GCC/Clang vector: an AVX2 register in the avx2 build, two SSE2 registers in
// the other. Written as vectors (not left to the auto-vectorizer, which keeps the clamps as
// branches) so both builds run the same operations; a tail shorter than eight goes through the
// same code, padded, so its elements round exactly as they would inside the array.
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

__attribute__((always_inline)) inline vf splat(float f) { return vf{f, f, f, f, f, f, f, f}; }
__attribute__((always_inline)) inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) inline vf select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

// exp(a) for a in [-87, 87] (the callers clamp): a = n ln2 + r with |r| <= ln2 / 2 (n rounded to
// nearest by adding and subtracting 1.5 * 2^23, whose bits then hold n), ln2 split in two (the
// first part's 9 bits times n's 8 are exact), e^r by Cephes' polynomial, times 2^n written into
// the exponent bits.
__attribute__((always_inline)) inline vf exp_clamped(vf a) {
  const vf magic = splat(12582912.0f);
  const vf t = a * splat(1.44269504088896341f) + magic;
  const vf fn = t - magic;
  const vi n = (vi)t - (vi)magic;
  const vf r = (a - fn * splat(0.693359375f)) - fn * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const vf er = (p * (r * r) + r) + splat(1.0f);
  return er * (vf)((n + 127) << 23);
}

// exp(-2u) of gelu's argument, the exponent clamped to [-87, 87] (NaN passes to the caller's x).
__attribute__((always_inline)) inline vf exp_minus_2u(vf x, vf x2) {
  vf a = x * (splat(kA) + splat(kB) * x2);
  a = select(a < splat(-87.0f), splat(-87.0f), a);
  a = select(a > splat(87.0f), splat(87.0f), a);
  return exp_clamped(a);
}

__attribute__((always_inline)) inline vf forward_lanes(vf x) { return x / (splat(1.0f) + exp_minus_2u(x, x * x)); }

__attribute__((always_inline)) inline vf backward_lanes(vf x, vf dy) {
  const vf x2 = x * x;
  const vf e = exp_minus_2u(x, x2);
  const vf s = splat(1.0f) / (splat(1.0f) + e);  // sigmoid(2u)
  const vf t = e * s;                             // 1 - s, without the cancellation when s is near 1
  return dy * (s + x * ((t * s) * (splat(kC) + splat(kD) * x2)));
}

__attribute__((always_inline)) inline void forward_loop(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, forward_lanes(load(x + i)));
  if (i == n) return;
  float in[kLanes] = {}, out[kLanes];
  std::memcpy(in, x + i, static_cast<size_t>(n - i) * sizeof(float));
  store(out, forward_lanes(load(in)));
  std::memcpy(y + i, out, static_cast<size_t>(n - i) * sizeof(float));
}

__attribute__((always_inline)) inline void backward_loop(const float* x, const float* dy, float* dx, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dx + i, backward_lanes(load(x + i), load(dy + i)));
  if (i == n) return;
  float in[kLanes] = {}, g[kLanes] = {}, out[kLanes];
  std::memcpy(in, x + i, static_cast<size_t>(n - i) * sizeof(float));
  std::memcpy(g, dy + i, static_cast<size_t>(n - i) * sizeof(float));
  store(out, backward_lanes(load(in), load(g)));
  std::memcpy(dx + i, out, static_cast<size_t>(n - i) * sizeof(float));
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) void forward_avx2(const float* x, float* y, int64_t n) { forward_loop(x, y, n); }
__attribute__((target("avx2"))) void backward_avx2(const float* x, const float* dy, float* dx, int64_t n) { backward_loop(x, dy, dx, n); }
bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

}  // namespace

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (have_avx2()) return forward_avx2(x, y, n);
#endif
  forward_loop(x, y, n);
}

void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (have_avx2()) return backward_avx2(x, dy, dx, n);
#endif
  backward_loop(x, dy, dx, n);
}

void gelu_tanh_forward_baseline(const float* x, float* y, int64_t n) { forward_loop(x, y, n); }
void gelu_tanh_backward_baseline(const float* x, const float* dy, float* dx, int64_t n) { backward_loop(x, dy, dx, n); }

}  // namespace alloy
