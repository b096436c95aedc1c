#pragma once
// Which elements of a gradient to send: the selection rules of the sparsifiers, as pure functions
// of a flat float tensor (the gradient plus its residual), so each can be tested alone.
//
//  - topk:      the exact k largest magnitudes (at::topk).
//  - randomk:   k indices drawn from a seed every member shares, so nobody sends indices.
//  - dgc:       DGC's sampled threshold: the k/n quantile of |x| over a random sample (1%, at least
//               2000 elements), then hierarchical top-k when it overshoots.
//  - gaussiank: a normal fit, threshold |mean| + std * Phi^-1(1 - density/2).
//  - redsync:   RedSync's search for a threshold between mean(|x|) and max(|x|), by bisection.
//  - sidco:     SIDCo's fit of a sparsity-inducing distribution to |x| (exponential, gamma or
//               generalized Pareto) in stages: each stage fits the exceedances over the previous
//               stage's threshold (peaks over threshold) and keeps density^(1/stages) of them.
// A threshold estimate is then refined against the real count (at most a few passes, bracketing
// the target): Alloy's addition, so every estimator selects within [0.8k, 1.2k] on the
// distributions the tests use (normal, Laplace, real gradients) instead of wherever its model of
// the distribution lands. With EXACT (aligned fusion) the result has exactly k entries: the
// largest of the candidates when over, padded with (index 0, value 0) entries when short.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace alloy::dist::compress {

// k for a tensor of N elements at DENSITY: at least 1, at most N.
int64_t target_count(int64_t n, double density);

struct Selection {
  at::Tensor indices;  // int64, into the input
  at::Tensor values;   // the input's values there (zeros for padding)
  int64_t selected = 0;  // real entries (indices.numel() minus padding)
  double threshold = 0;  // magnitude threshold used (0 for topk/randomk)
  int passes = 0;        // full passes over the tensor spent estimating and counting
};

// The methods that select by a magnitude threshold.
enum class ThresholdMethod { Dgc, GaussianK, RedSync, Sidco };
enum class SidcoFit { Exponential, Gamma, Gpd };
SidcoFit parse_sidco_fit(const std::string& name);  // exponential | gamma | gpd

Selection select_topk(const at::Tensor& x, int64_t k);
Selection select_randomk(const at::Tensor& x, int64_t k, uint64_t seed);
// randomk's indices alone (sorted, distinct, about K of them): a function of N, K and SEED only.
at::Tensor randomk_indices(int64_t n, int64_t k, uint64_t seed);
// SEED drives DGC's sample; the others are deterministic.
Selection select_threshold(ThresholdMethod m, const at::Tensor& x, int64_t k, bool exact, uint64_t seed,
                           SidcoFit fit = SidcoFit::Exponential, int stages = 2);

// DGC from the second step of a piece on: HINT holds the k-th largest magnitude the piece sent last
// step (0: none yet). One pass collects every |x| >= kDgcHintFloor * hint and the k largest of
// those are sent, in ascending index order, exactly k whether or not EXACT; the residual's
// distribution moves little from one step to the next, so the candidates hold about 2k. Without a
// hint, or when fewer than k reach it (the gradient shrank), the sampled estimate of
// select_threshold. Either way HINT becomes this step's k-th largest magnitude sent. The sampled
// path costs the sample's gather and top-k plus 2-4 counting and collecting passes over the
// piece; this one pass. Selection::passes says which ran (1: the hint's).
constexpr double kDgcHintFloor = 0.85;
Selection select_dgc(const at::Tensor& x, int64_t k, bool exact, uint64_t seed, double* hint);
// Its two halves, for a caller that scans for candidates in its own pass (codec.cpp fuses the scan
// with the accumulation): whether HINT can start the selection of k of N, and the k largest of X
// at CAND (every index with |x| >= kDgcHintFloor * hint, ascending), into S with HINT updated;
// false (S and HINT untouched) when fewer than k reached the floor.
bool dgc_hint_usable(int64_t n, int64_t k, double hint);
bool select_dgc_candidates(const at::Tensor& x, int64_t k, std::vector<int64_t>& cand, double* hint, Selection& s);

// The first estimate of each method before refinement (for tests and the profiler's notes).
// X: a contiguous float tensor; the thresholds apply to |x|.
double dgc_threshold(const at::Tensor& x, int64_t k, uint64_t seed);
double gaussiank_threshold(const at::Tensor& x, int64_t k);
double redsync_threshold(const at::Tensor& x, int64_t k, int* passes);
double sidco_threshold(const at::Tensor& x, int64_t k, SidcoFit fit, int stages);

// Special functions the fits need (exposed for tests).
double normal_quantile(double p);                          // Phi^-1(p), p in (0, 1)
double gamma_upper_regularized(double a, double x);        // Q(a, x)
double gamma_tail_quantile(double shape, double scale, double p);  // x with P(X > x) = p

}  // namespace alloy::dist::compress
