#include "alloy/dist/compress/fusion.h"

#include <algorithm>
#include <limits>

#include "alloy/core/error.h"

namespace alloy::dist::compress {

bool fusion_measures(const std::string& s) { return s == "omgs" || s == "cupcake" || s == "saf-adaptive"; }
bool fusion_retunes(const std::string& s) { return s == "saf-adaptive"; }

std::vector<size_t> fixed_buffers(const std::vector<int64_t>& numel, int64_t cap_bytes) {
  std::vector<size_t> starts;
  int64_t cur = 0;
  for (size_t i = 0; i < numel.size(); ++i) {
    const int64_t b = numel[i] * 4;
    if (starts.empty() || (cur > 0 && cur + b > cap_bytes)) {
      starts.push_back(i);
      cur = 0;
    }
    cur += b;
  }
  return starts;
}

double simulate_fusion(const FusionPlan& plan, const FusionInputs& in) {
  const size_t n = in.numel.size();
  const bool ahead = plan.compress_ahead && !in.encode_whole;
  double t = 0;  // the worker's clock
  for (size_t b = 0; b < plan.starts.size(); ++b) {
    const size_t lo = plan.starts[b], hi = plan.buffer_of_end(b, n);
    int64_t elems = 0;
    double avail = 0;  // when the autograd thread has encoded the buffer (hook encoding)
    for (size_t i = lo; i < hi; ++i) {
      const double ready = in.ready_s.empty() ? 0.0 : in.ready_s[i];
      const double enc = in.encode_s_per_elem * static_cast<double>(in.numel[i]);
      if (in.encode_in_hook) avail = std::max(avail, ready + (ahead ? enc : 0.0));
      else if (ahead) t = std::max(t, ready) + enc;
      else t = std::max(t, ready);
      elems += in.numel[i];
    }
    const double e = static_cast<double>(elems);
    if (in.encode_in_hook) t = std::max(t, avail + (ahead ? 0.0 : in.encode_s_per_elem * e));
    else if (!ahead) t += in.encode_s_per_elem * e;
    t += in.alpha_s + in.beta_s_per_byte * in.wire_bytes_per_elem * e + in.decode_s_per_elem * e;
  }
  return t;
}

namespace {

// MG-WFBP's greedy on the model: each tensor joins the open buffer unless opening a new one
// finishes the tensors so far earlier.
std::vector<size_t> merge_greedy(FusionPlan base, const FusionInputs& in) {
  const size_t n = in.numel.size();
  FusionInputs prefix = in;
  base.starts = {0};
  for (size_t i = 1; i < n; ++i) {
    prefix.numel.assign(in.numel.begin(), in.numel.begin() + static_cast<long>(i + 1));
    if (!in.ready_s.empty()) prefix.ready_s.assign(in.ready_s.begin(), in.ready_s.begin() + static_cast<long>(i + 1));
    FusionPlan join = base, split = base;
    split.starts.push_back(i);
    if (simulate_fusion(split, prefix) < simulate_fusion(join, prefix) * (1 - 1e-9)) base = split;
  }
  return base.starts;
}

}  // namespace

std::vector<size_t> choose_measured(const std::vector<std::vector<size_t>>& candidates,
                                    const std::map<std::vector<size_t>, double>& measured, const std::vector<size_t>& running,
                                    double margin) {
  for (const auto& c : candidates)
    if (!measured.count(c)) return c;
  auto it = measured.find(running);
  std::vector<size_t> best = running;
  double best_s = it == measured.end() ? std::numeric_limits<double>::infinity() : it->second * (1 - margin);
  // Every cut timed so far competes, not only today's candidates: the starting cut, once left for
  // an untried one, must be able to come back when it was the fastest.
  for (const auto& [c, t] : measured)
    if (t < best_s) best_s = t, best = c;
  return best;
}

FusionPlan plan_fusion(const std::string& s, const FusionInputs& in) {
  FusionPlan p;
  p.strategy = s;
  const size_t n = in.numel.size();
  if (n == 0) return p;
  p.compress_ahead = s == "tensor" || s == "saf" || s == "saf-inter" || s == "saf-adaptive";
  p.aligned = s == "saf-inter" || s == "saf-adaptive";
  if (s == "tensor") {
    for (size_t i = 0; i < n; ++i) p.starts.push_back(i);
    return p;
  }
  if (s == "bucket" || s == "saf" || s == "saf-inter" || (fusion_measures(s) && in.ready_s.empty())) {
    p.starts = fixed_buffers(in.numel, in.cap_bytes);
    return p;
  }
  if (s == "omgs" || s == "saf-adaptive") {
    p.starts = merge_greedy(p, in);
    return p;
  }
  if (s == "cupcake") {
    double best = std::numeric_limits<double>::infinity();
    int64_t total = 0;
    for (auto x : in.numel) total += 4 * x;
    for (int64_t cap : {int64_t(256) << 10, int64_t(1) << 20, int64_t(2) << 20, int64_t(4) << 20, int64_t(8) << 20,
                        int64_t(16) << 20, int64_t(32) << 20, int64_t(64) << 20, total}) {
      FusionPlan q = p;
      q.starts = fixed_buffers(in.numel, cap);
      const double t = simulate_fusion(q, in);
      if (t < best * (1 - 1e-9)) best = t, p.starts = q.starts;
    }
    return p;
  }
  throw InputError("grad_sync.fusion", "unknown strategy '" + s + "'");
}

}  // namespace alloy::dist::compress
