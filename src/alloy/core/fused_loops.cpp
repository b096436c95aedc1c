#include "alloy/core/fused_loops.h"

#include <cmath>

namespace alloy {

// Built with -fno-math-errno (CMakeLists.txt): without it std::sqrt keeps a branch for errno on
// negative input and the loop is not vectorized (v is never negative here); and with
// -ffp-contract=off, so no compiler fuses a multiply and an add into one rounding.
void adamw_update(float* __restrict w, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
                  const AdamWStep& s) {
  const float dm = s.decay_mul, b1 = s.beta1, a1 = s.one_minus_beta1, b2 = s.beta2, a2 = s.one_minus_beta2;
  const float bc2 = s.bias_correction2_sqrt, eps = s.eps, step = s.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] * b1 + a1 * gi;
    const float vi = v[i] * b2 + a2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2 + eps;
    w[i] = w[i] * dm + step * mi / denom;
  }
}

namespace {
inline void accumulate_block(const float* __restrict g, float* __restrict v, float* __restrict r, int64_t lo, int64_t hi,
                             float momentum) {
  for (int64_t i = lo; i < hi; ++i) {
    const float vi = g[i] + momentum * v[i];
    v[i] = vi;
    r[i] += vi;
  }
}
}  // namespace

void dgc_accumulate(const float* g, float* v, float* r, int64_t n, float momentum) { accumulate_block(g, v, r, 0, n, momentum); }

void dgc_accumulate_scan(const float* g, float* v, float* r, int64_t n, float momentum, float floor, int64_t base,
                         std::vector<int64_t>& candidates) {
  // In blocks: the arithmetic vectorizes, and the scan that follows reads its block from cache.
  constexpr int64_t kBlock = 4096;
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t hi = lo + kBlock < n ? lo + kBlock : n;
    accumulate_block(g, v, r, lo, hi, momentum);
    for (int64_t i = lo; i < hi; ++i)
      if (std::fabs(r[i]) >= floor) candidates.push_back(base + i);
  }
}

}  // namespace alloy
