#include "alloy/train/share_balancer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/text.h"

namespace alloy::train {

ShareBalancer::ShareBalancer(std::vector<int64_t> base, ShareBalancerOptions options)
    : base_(std::move(base)), shares_(base_), o_(options), seen_(base_.size()) {
  if (base_.empty()) throw InputError("train.rebalance", "needs at least one replica");
  for (size_t i = 0; i < base_.size(); ++i)
    if (base_[i] < 1)
      throw InputError("train.rebalance", "replica " + std::to_string(i) + " has " + std::to_string(base_[i]) +
                                              " samples in the plan; each needs at least one");
  if (o_.reference_steps < 1 || !(o_.smoothing > 0 && o_.smoothing <= 1) || !(o_.min_gain >= 0 && o_.min_gain < 1))
    throw InputError("train.rebalance", "reference_steps >= 1, smoothing in (0, 1] and min_gain in [0, 1) are needed");
}

int64_t ShareBalancer::offset(size_t i) const {
  return std::accumulate(shares_.begin(), shares_.begin() + static_cast<std::ptrdiff_t>(std::min(i, shares_.size())), int64_t{0});
}

bool ShareBalancer::observe(const std::vector<double>& compute_s) {
  if (compute_s.size() != shares_.size()) throw Error("ShareBalancer: " + std::to_string(compute_s.size()) + " timings for " +
                                                      std::to_string(shares_.size()) + " replicas");
  for (double c : compute_s)
    if (!(c > 0) || !std::isfinite(c)) return false;  // a replica measured nothing: this step says nothing
  if (!armed_) {
    for (size_t i = 0; i < shares_.size(); ++i) seen_[i].push_back(compute_s[i] / static_cast<double>(shares_[i]));
    return false;
  }
  for (size_t i = 0; i < shares_.size(); ++i)
    speed_[i] = o_.smoothing * compute_s[i] / static_cast<double>(shares_[i]) + (1 - o_.smoothing) * speed_[i];
  const std::vector<int64_t> best = best_shares();
  const double now = predicted_s(shares_), then = predicted_s(best);
  if (best == shares_ || !(then < now * (1 - o_.min_gain))) return false;
  std::ostringstream why;
  why.precision(3);
  why << "samples per replica " << join(shares_, "/") << " -> " << join(best, "/") << " (speeds against the reference:";
  for (size_t i = 0; i < speed_.size(); ++i) why << (i ? ", " : " ") << ref_[i] / speed_[i];
  why << "; predicted step " << now * 1e3 << " -> " << then * 1e3 << " ms)";
  last_change_ = why.str();
  shares_ = best;
  return true;
}

bool ShareBalancer::arm() {
  if (armed_) return true;
  // The first step warms allocators and caches: it is left out when there are others.
  const size_t first = seen_[0].size() > 1 ? 1 : 0;
  if (static_cast<int64_t>(seen_[0].size() - first) < o_.reference_steps) return false;
  const size_t n = shares_.size();
  ref_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> v(seen_[i].begin() + static_cast<std::ptrdiff_t>(first), seen_[i].end());
    std::sort(v.begin(), v.end());
    ref_[i] = v[(v.size() - 1) / 2];  // the lower median: a stall only raises times
  }
  // The plan's cut at the reference speeds: what each replica had besides computing.
  double slowest = 0;
  for (size_t i = 0; i < n; ++i) slowest = std::max(slowest, static_cast<double>(base_[i]) * ref_[i]);
  other_.resize(n);
  for (size_t i = 0; i < n; ++i) other_[i] = slowest - static_cast<double>(base_[i]) * ref_[i];
  speed_ = ref_;
  seen_.assign(n, {});
  armed_ = true;
  return true;
}

double ShareBalancer::predicted_s(const std::vector<int64_t>& shares) const {
  if (!armed_) throw Error("ShareBalancer::predicted_s before arm()");
  double worst = 0;
  for (size_t i = 0; i < shares.size(); ++i)
    worst = std::max(worst, static_cast<double>(shares[i]) * speed_[i] + other_[i] * speed_[i] / ref_[i]);
  return worst;
}

std::vector<int64_t> ShareBalancer::best_shares() const {
  // Min-max of increasing linear times: each sample to the replica that would finish it first is
  // optimal. Ties go to the lower index, so every rank builds the same cut.
  const size_t n = shares_.size();
  const int64_t total = std::accumulate(base_.begin(), base_.end(), int64_t{0});
  std::vector<int64_t> s(n, 1);
  auto finish = [&](size_t i, int64_t k) { return static_cast<double>(k) * speed_[i] + other_[i] * speed_[i] / ref_[i]; };
  using Entry = std::pair<double, size_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> next;
  for (size_t i = 0; i < n; ++i) next.push({finish(i, 2), i});
  for (int64_t left = total - static_cast<int64_t>(n); left > 0; --left) {
    const size_t i = next.top().second;
    next.pop();
    ++s[i];
    next.push({finish(i, s[i] + 1), i});
  }
  return s;
}

}  // namespace alloy::train
