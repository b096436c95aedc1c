#pragma once
// Shares of the global batch that follow the devices' speeds during a run (train.rebalance).
//
// The planner cuts the global batch among data-parallel replicas from the profile, and a re-plan
// corrects it once from the speeds the first steps measured. Between those, a device's speed still
// drifts: on a shared or virtual machine one device computes 10-25% slower for tens of seconds and
// then recovers (measured here: spells of 5-10 steps on either of two emulated devices), and every
// replica waits for the slowest each step. Replicas hold the same weights, so moving samples among
// them moves no state: only which slice of the global batch each computes. The loss of every
// micro-batch is divided by the global batch's tokens, so the summed gradient is the same whatever
// the cut (up to the order of the floating-point sums).
//
// The model: the plan's cut gave replica i, with B_i samples at its reference speed t_i seconds per
// sample, a step of B_i t_i + o_i, where o_i is what the plan left it besides computing (its part of
// the gradient sum, the slack the cost model kept for it): o_i = max_j B_j t_j - B_i t_i. A replica
// now at speed u_i takes s u_i + o_i u_i / t_i for s samples: its other work slows with it (it runs
// on the same CPU). The shares that minimize the slowest replica's time come from handing out the
// batch one sample at a time to the replica that would finish first. They change only when that
// shortens the predicted step by min_gain: a cut that moves with every step's noise would make the
// run's sums differ from run to run for nothing.
//
// Every rank holds one balancer fed the same summed figures, so all decide the same shares.
// Torch-free (tests/test_share_balancer.cpp).
#include <cstdint>
#include <string>
#include <vector>

namespace alloy::train {

struct ShareBalancerOptions {
  int64_t reference_steps = 4;  // steps measured (after the first) before the reference speeds are set
  double smoothing = 0.5;       // weight of the newest step in each replica's running speed
  double min_gain = 0.03;       // a new cut must shorten the predicted step by this fraction
};

class ShareBalancer {
 public:
  // BASE: the plan's samples per replica (their sum is the global batch). Throws InputError
  // naming train.rebalance when a share is not positive.
  ShareBalancer(std::vector<int64_t> base, ShareBalancerOptions options = {});

  // The samples each replica computes in the next step.
  const std::vector<int64_t>& shares() const { return shares_; }
  // The first sample of replica I's slice within the global batch.
  int64_t offset(size_t i) const;

  // One step's compute seconds per replica, measured with shares(). Steps before arm() only
  // gather the reference. Returns true when the shares changed for the next step.
  bool observe(const std::vector<double>& compute_s);
  // From now on observe() may move samples: the reference speeds are the lower medians of what was
  // observed so far (false when fewer than reference_steps were; it is then called again later).
  bool arm();
  bool armed() const { return armed_; }

  // The predicted step (seconds, the slowest replica) of SHARES at the current speeds; armed only.
  double predicted_s(const std::vector<int64_t>& shares) const;
  // One line on the last change: the shares before and after, and why.
  const std::string& last_change() const { return last_change_; }

 private:
  std::vector<int64_t> base_, shares_;
  ShareBalancerOptions o_;
  std::vector<std::vector<double>> seen_;  // per replica, seconds per sample of each step before arming
  std::vector<double> ref_, speed_, other_;  // reference and running seconds per sample; o_i (seconds at ref)
  bool armed_ = false;
  std::string last_change_;

  std::vector<int64_t> best_shares() const;
};

}  // namespace alloy::train
