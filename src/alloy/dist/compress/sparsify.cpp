#include "alloy/dist/compress/sparsify.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "alloy/core/error.h"

namespace alloy::dist::compress {

namespace {

at::Generator generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// The hot loops run over raw floats: one pass each, no |x| or mask tensors (a 10M-element
// gradient is 40 MB; every avoided pass is ~10 ms of a training step on one core).
int64_t count_at_least(const at::Tensor& x, double thr) {
  const float* p = x.data_ptr<float>();
  const float t = static_cast<float>(thr);
  const int64_t n = x.numel();
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += std::fabs(p[i]) >= t;
  return c;
}

at::Tensor indices_at_least(const at::Tensor& x, double thr, int64_t expect) {
  const float* p = x.data_ptr<float>();
  const float t = static_cast<float>(thr);
  const int64_t n = x.numel();
  std::vector<int64_t> idx;
  idx.reserve(static_cast<size_t>(expect));
  for (int64_t i = 0; i < n; ++i)
    if (std::fabs(p[i]) >= t) idx.push_back(i);
  at::Tensor out = at::empty({static_cast<int64_t>(idx.size())}, at::kLong);
  std::copy(idx.begin(), idx.end(), out.data_ptr<int64_t>());
  return out;
}

struct Moments {
  double mean = 0, var = 0, max = 0;
};
// Mean and variance of x (ABS: of |x|) and the largest |x|, in one pass (double accumulators).
Moments moments(const at::Tensor& x, bool abs) {
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  double s = 0, ss = 0;
  float mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(p[i]);
    const double v = abs ? a : p[i];
    s += v;
    ss += v * v;
    mx = std::max(mx, a);
  }
  Moments m;
  m.mean = n ? s / static_cast<double>(n) : 0;
  m.var = n > 1 ? std::max(0.0, (ss - s * m.mean) / static_cast<double>(n - 1)) : 0;
  m.max = mx;
  return m;
}

// Moves THR until the count lies in [0.8k, 1.2k] or a few passes are spent: grow or shrink it by
// half until the target is bracketed, then bisect geometrically. Returns the last count.
int64_t refine(const at::Tensor& x, double* thr, int64_t k, int* passes) {
  const double lo = 0.8 * static_cast<double>(k), hi = 1.2 * static_cast<double>(k);
  if (!(*thr > 0) || !std::isfinite(*thr)) *thr = std::numeric_limits<float>::min();
  int64_t c = count_at_least(x, *thr);
  ++*passes;
  double too_many = -1, too_few = -1;  // thresholds known to select more than hi / fewer than lo
  for (int it = 0; it < 8 && (static_cast<double>(c) < lo || static_cast<double>(c) > hi); ++it) {
    if (static_cast<double>(c) > hi) too_many = *thr;
    else too_few = *thr;
    if (too_many > 0 && too_few > 0) *thr = std::sqrt(too_many * too_few);
    else if (static_cast<double>(c) > hi) *thr *= 1.5;
    else *thr /= 1.5;
    if (!(*thr >= std::numeric_limits<float>::min())) break;  // everything non-zero is already in
    c = count_at_least(x, *thr);
    ++*passes;
  }
  return c;
}

// Exactly K entries when EXACT, at most max(K, 1.2K) otherwise, from the candidate indices CAND.
Selection finish(const at::Tensor& x, at::Tensor cand, int64_t k, bool exact) {
  Selection s;
  const int64_t c = cand.numel();
  const int64_t cap = exact ? k : static_cast<int64_t>(std::ceil(1.2 * static_cast<double>(k)));
  if (c > cap) {
    auto top = at::topk(x.index_select(0, cand).abs(), k, 0, true, false);
    cand = cand.index_select(0, std::get<1>(top));
  }
  s.selected = cand.numel();
  s.values = x.index_select(0, cand);
  s.indices = cand;
  if (exact && s.selected < k) {
    s.indices = at::cat({cand, at::zeros({k - s.selected}, cand.options())});
    s.values = at::cat({s.values, at::zeros({k - s.selected}, x.options())});
  }
  return s;
}

double mean_of(const at::Tensor& t) { return t.numel() ? t.mean().item<double>() : 0.0; }

}  // namespace

int64_t target_count(int64_t n, double density) {
  if (n <= 0) return 0;
  const int64_t k = static_cast<int64_t>(std::llround(density * static_cast<double>(n)));
  return std::clamp<int64_t>(k, 1, n);
}

SidcoFit parse_sidco_fit(const std::string& name) {
  if (name == "exponential") return SidcoFit::Exponential;
  if (name == "gamma") return SidcoFit::Gamma;
  if (name == "gpd") return SidcoFit::Gpd;
  throw InputError("grad_sync.sidco_fit", "unknown fit '" + name + "' (exponential, gamma, gpd)");
}

Selection select_topk(const at::Tensor& x, int64_t k) {
  // at::topk on |x|: exact, and the costliest selection (a partial sort of all n).
  Selection s;
  auto top = at::topk(x.abs(), k, 0, true, false);
  s.indices = std::get<1>(top);
  s.values = x.index_select(0, s.indices);
  s.selected = k;
  s.passes = 1;
  return s;
}

at::Tensor randomk_indices(int64_t n, int64_t k, uint64_t seed) {
  if (k >= n) return at::arange(n, at::kLong);
  // Draws with replacement, then drops repeats: O(k log k), not a permutation of all n. Every
  // member computes the same set from the same seed.
  at::Tensor draw = at::randint(n, {k}, generator(seed), at::TensorOptions().dtype(at::kLong));
  return std::get<0>(at::_unique(draw, /*sorted=*/true, /*return_inverse=*/false));
}

Selection select_randomk(const at::Tensor& x, int64_t k, uint64_t seed) {
  Selection s;
  s.indices = randomk_indices(x.numel(), k, seed);
  s.values = x.index_select(0, s.indices);
  s.selected = s.indices.numel();
  return s;
}

double dgc_threshold(const at::Tensor& x, int64_t k, uint64_t seed) {
  const int64_t n = x.numel();
  const double density = static_cast<double>(k) / static_cast<double>(n);
  // DGC samples 0.1-1% of the gradient. Here 1%, and at least 2000 elements (all of a small
  // tensor): at density 0.01 that leaves ~20 samples above the threshold, an estimate within
  // ~25% of k that refine() then settles with one or two counting passes, which cost less than a
  // larger random sample (a gather that misses the cache) would.
  const int64_t s = std::min<int64_t>(n, std::max<int64_t>(static_cast<int64_t>(std::ceil(0.01 * static_cast<double>(n))), 2000));
  at::Tensor sample = (s >= n ? x : x.index_select(0, at::randint(n, {s}, generator(seed), at::TensorOptions().dtype(at::kLong)))).abs();
  const int64_t ks = std::clamp<int64_t>(static_cast<int64_t>(std::llround(density * static_cast<double>(s))), 1, s);
  auto top = at::topk(sample, ks, 0, true, false);
  return std::get<0>(top).min().item<double>();
}

double gaussiank_threshold(const at::Tensor& x, int64_t k) {
  const double n = static_cast<double>(x.numel());
  const Moments m = moments(x, false);
  const double mu = m.mean, sigma = std::sqrt(m.var);
  const double tail = std::min(0.999999, static_cast<double>(k) / n);
  return std::fabs(mu) + sigma * normal_quantile(1.0 - tail / 2.0);
}

double redsync_threshold(const at::Tensor& x, int64_t k, int* passes) {
  const Moments m = moments(x, true);
  const double mean = m.mean, mx = m.max;
  const double lo_ok = 0.8 * static_cast<double>(k), hi_ok = 1.2 * static_cast<double>(k);
  double l = 0, r = 1, thr = mean;
  *passes += 1;
  for (int it = 0; it < 30 && r - l > 1e-7; ++it) {
    const double ratio = l + (r - l) / 2;
    thr = mean + ratio * (mx - mean);
    const double c = static_cast<double>(count_at_least(x, thr));
    ++*passes;
    if (c >= lo_ok && c <= hi_ok) break;
    if (c < lo_ok) r = ratio;
    else l = ratio;
  }
  return thr;
}

double sidco_threshold(const at::Tensor& x, int64_t k, SidcoFit fit, int stages) {
  const double density = static_cast<double>(k) / static_cast<double>(x.numel());
  const double per_stage = std::pow(density, 1.0 / stages);
  double thr = 0;
  at::Tensor data = x;  // stage 0: all of |x|; later stages: the exceedances kept below
  for (int st = 0; st < stages; ++st) {
    if (data.numel() < 2) break;
    // Moments of the exceedances y = |x| - thr over the values at or above thr.
    Moments mo = moments(data, true);
    const double m = mo.mean - (st == 0 ? 0.0 : thr), v = mo.var;
    double q = 0;
    if (fit == SidcoFit::Exponential || !(v > 0) || !(m > 0)) {
      q = -m * std::log(per_stage);
    } else if (fit == SidcoFit::Gamma) {
      q = gamma_tail_quantile(m * m / v, v / m, per_stage);
    } else {  // generalized Pareto by the method of moments (valid for shape < 1/2)
      const double r = m * m / v;
      const double xi = 0.5 * (1.0 - r), sigma = 0.5 * m * (r + 1.0);
      q = std::fabs(xi) < 1e-6 ? -sigma * std::log(per_stage) : sigma / xi * (std::pow(per_stage, -xi) - 1.0);
    }
    thr += q;
    if (st + 1 < stages) data = data.index_select(0, indices_at_least(data, thr, static_cast<int64_t>(per_stage * data.numel()) + 16));
  }
  return thr;
}

Selection select_threshold(ThresholdMethod m, const at::Tensor& xin, int64_t k, bool exact, uint64_t seed, SidcoFit fit, int stages) {
  at::Tensor x = xin.contiguous();
  const int64_t n = x.numel();
  if (k >= n) {
    Selection s;
    s.indices = at::arange(n, at::kLong);
    s.values = x.clone();
    s.selected = n;
    return s;
  }
  int passes = 0;
  double thr = 0;
  switch (m) {
    case ThresholdMethod::Dgc: thr = dgc_threshold(x, k, seed); break;
    case ThresholdMethod::GaussianK: thr = gaussiank_threshold(x, k), passes += 1; break;
    case ThresholdMethod::RedSync: thr = redsync_threshold(x, k, &passes); break;
    case ThresholdMethod::Sidco: thr = sidco_threshold(x, k, fit, stages), passes += 1; break;
  }
  const int64_t c = refine(x, &thr, k, &passes);
  at::Tensor cand = indices_at_least(x, thr, c);
  Selection s = finish(x, cand, k, exact);
  s.threshold = thr;
  s.passes = passes + 1;
  return s;
}

namespace {
// The smallest magnitude sent is the k-th largest (or, short of k, the threshold's neighbour).
void remember_kth(const Selection& s, double* hint) {
  *hint = s.selected > 0 ? s.values.narrow(0, 0, s.selected).abs().min().item<double>() : 0.0;
}
}  // namespace

bool dgc_hint_usable(int64_t n, int64_t k, double hint) { return k < n && hint > 0 && std::isfinite(hint); }

bool select_dgc_candidates(const at::Tensor& x, int64_t k, std::vector<int64_t>& cand, double* hint, Selection& s) {
  if (static_cast<int64_t>(cand.size()) < k) return false;
  const float* p = x.data_ptr<float>();
  // The k largest: ties at the k-th magnitude go to the lower index, so every run picks the same.
  auto larger = [p](int64_t a, int64_t b) {
    const float fa = std::fabs(p[a]), fb = std::fabs(p[b]);
    return fa > fb || (fa == fb && a < b);
  };
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), larger);
  cand.resize(static_cast<size_t>(k));
  std::sort(cand.begin(), cand.end());
  s = Selection{};
  s.indices = at::empty({k}, at::kLong);
  std::copy(cand.begin(), cand.end(), s.indices.data_ptr<int64_t>());
  s.values = x.index_select(0, s.indices);
  s.selected = k;
  s.passes = 1;
  remember_kth(s, hint);
  s.threshold = *hint;
  return true;
}

Selection select_dgc(const at::Tensor& xin, int64_t k, bool exact, uint64_t seed, double* hint) {
  at::Tensor x = xin.contiguous();
  const int64_t n = x.numel();
  if (dgc_hint_usable(n, k, *hint)) {
    const float* p = x.data_ptr<float>();
    const float floor = static_cast<float>(kDgcHintFloor * *hint);
    std::vector<int64_t> cand;
    cand.reserve(static_cast<size_t>(3 * k));
    for (int64_t i = 0; i < n; ++i)
      if (std::fabs(p[i]) >= floor) cand.push_back(i);
    Selection s;
    if (select_dgc_candidates(x, k, cand, hint, s)) return s;
  }
  Selection s = select_threshold(ThresholdMethod::Dgc, x, k, exact, seed);
  remember_kth(s, hint);
  return s;
}

double normal_quantile(double p) {
  if (!(p > 0 && p < 1)) throw Error("normal_quantile: p must be in (0, 1)");
  // Phi(x) = erfc(-x / sqrt 2) / 2 is monotone: bisection to double precision.
  double lo = -40, hi = 40;
  for (int i = 0; i < 200 && hi - lo > 1e-15; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p) lo = mid;
    else hi = mid;
  }
  return 0.5 * (lo + hi);
}

double gamma_upper_regularized(double a, double x) {
  if (!(a > 0)) throw Error("gamma_upper_regularized: shape must be > 0");
  if (x <= 0) return 1.0;
  const double lg = std::lgamma(a);
  if (x < a + 1) {  // series for the lower function P, then Q = 1 - P
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-16) break;
    }
    return std::max(0.0, 1.0 - sum * std::exp(-x + a * std::log(x) - lg));
  }
  // Continued fraction for Q (modified Lentz).
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1) < 1e-16) break;
  }
  return std::exp(-x + a * std::log(x) - lg) * h;
}

double gamma_tail_quantile(double shape, double scale, double p) {
  if (!(p > 0 && p < 1)) throw Error("gamma_tail_quantile: p must be in (0, 1)");
  double hi = std::max(1.0, shape);
  while (gamma_upper_regularized(shape, hi) > p && hi < 1e300) hi *= 2;
  double lo = 0;
  for (int i = 0; i < 200 && hi - lo > 1e-14 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (gamma_upper_regularized(shape, mid) > p) lo = mid;
    else hi = mid;
  }
  return 0.5 * (lo + hi) * scale;
}

}  // namespace alloy::dist::compress
