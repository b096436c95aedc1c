#include "alloy/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "alloy/core/error.h"

namespace alloy::plan {

std::string names_text(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string blocks_text(int64_t unit_begin, int64_t unit_end) {
  auto at = [](int64_t u) { return std::to_string(u / 2) + (u % 2 ? ".5" : ""); };
  return "[" + at(unit_begin) + "," + at(unit_end) + ")";
}

// ---------------------------------------------------------------------------------------------
// CostContext

CostContext::CostContext(const ClusterSpec& cluster, const Profile& profile) : cluster_(&cluster), profile_(&profile) {
  const std::string where = cluster.source.empty() ? "cluster" : cluster.source;
  if (cluster.devices.empty()) throw InputError(where, "devices: the cluster has no devices");
  const ModelConfig& m = profile.model;
  if (m.layers < 1) throw InputError("profile", "model.layers must be >= 1, got " + std::to_string(m.layers));
  if (m.dtype == "float32") dtype_bytes_ = 4;
  else if (m.dtype == "float64") dtype_bytes_ = 8;
  else throw InputError("profile", "model.dtype: unknown dtype '" + m.dtype + "' (expected float32 or float64)");
  act_message_bytes_ = static_cast<double>(m.seq_len) * static_cast<double>(m.hidden) * dtype_bytes_;

  types_ = cluster.types();
  hosts_ = cluster.hosts();
  std::vector<std::string> profiled;
  for (const auto& [t, d] : profile.devices) profiled.push_back(t);
  for (const auto& t : types_) {
    auto it = profile.devices.find(t);
    if (it == profile.devices.end()) {
      std::string dev;
      for (const auto& d : cluster.devices)
        if (d.type == t) dev = d.name;
      throw InputError("profile", "device '" + dev + "' has type '" + t + "', which the profile does not cover (profiled types: " +
                                      (profiled.empty() ? "none" : names_text(profiled)) + "); profile that type or fix the cluster");
    }
    type_profile_.push_back(&it->second);
  }
  for (const auto& d : cluster.devices) {
    dev_type_.push_back(static_cast<int>(std::find(types_.begin(), types_.end(), d.type) - types_.begin()));
    dev_host_.push_back(static_cast<int>(std::find(hosts_.begin(), hosts_.end(), d.host) - hosts_.begin()));
    if (!(d.memory_gb >= 0) || !std::isfinite(d.memory_gb))
      throw InputError(where, "device '" + d.name + "': memory_gb must be >= 0 (0 = unknown), got " + std::to_string(d.memory_gb));
    capacity_.push_back(d.memory_gb * 1e9);
  }

  const size_t H = hosts_.size();
  bw_.assign(H * H, 0);
  lat_.assign(H * H, 0);
  ring_bw_.assign(H * H, 0);
  for (size_t a = 0; a < H; ++a)
    for (size_t b = 0; b < H; ++b) {
      const LinkProfile* measured = nullptr;
      for (const auto& l : profile.links)
        if (l.bytes_per_s > 0 && ((l.host_a == hosts_[a] && l.host_b == hosts_[b]) || (l.host_a == hosts_[b] && l.host_b == hosts_[a])))
          measured = &l;
      double bw, lat, ring_bw;
      if (measured) {
        bw = measured->bytes_per_s;
        lat = measured->latency_s;
        ring_bw = measured->allreduce_bytes_per_s > 0 ? measured->allreduce_bytes_per_s : bw;
      } else {
        Link l = cluster.link(hosts_[a], hosts_[b]);
        bw = l.bytes_per_s();
        lat = l.latency_s();
        ring_bw = bw;
      }
      if (!(bw > 0) || !std::isfinite(bw) || !(lat >= 0) || !std::isfinite(lat))
        throw InputError(where, "no usable link between hosts '" + hosts_[a] + "' and '" + hosts_[b] + "' (bandwidth " +
                                    std::to_string(bw) + " bytes/s, latency " + std::to_string(lat) +
                                    " s): give it a rule under links or a default_link");
      bw_[a * H + b] = bw;
      lat_[a * H + b] = lat;
      ring_bw_[a * H + b] = ring_bw;
    }
  hop_link_.assign(H * H, 0);
  pair_link_.assign(H * H, 0);
  int max_shared = -1;
  for (size_t a = 0; a < H; ++a)
    for (size_t b = 0; b < H; ++b) {
      const int sh = a == b ? -1 : cluster.shared_link(hosts_[a], hosts_[b]);
      max_shared = std::max(max_shared, sh);
      hop_link_[a * H + b] = sh < 0 ? a * H + b : H * H + static_cast<size_t>(sh);
      pair_link_[a * H + b] = sh < 0 ? std::min(a, b) * H + std::max(a, b) : H * H + static_cast<size_t>(sh / 2);
    }
  num_links_ = H * H + static_cast<size_t>(max_shared + 1);
  num_pair_links_ = H * H + (max_shared < 0 ? 0 : static_cast<size_t>(max_shared / 2 + 1));

  // Each measured pair's sums as a line in their bytes, through its two sizes (one size: the
  // link's slope through it).
  const size_t N = cluster.devices.size();
  tp_line_.assign(N * N, {-1.0, 0.0});
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> points;
  for (const auto& t : profile.tp_sums) {
    auto find = [&](const std::string& name) {
      for (size_t d = 0; d < N; ++d)
        if (cluster.devices[d].name == name) return static_cast<int>(d);
      return -1;
    };
    const int a = find(t.device_a), b = find(t.device_b);
    if (a < 0 || b < 0) continue;  // measured on another pool
    points[{std::min(a, b), std::max(a, b)}].emplace_back(t.bytes, t.seconds);
  }
  for (auto& [pair, pts] : points) {
    std::sort(pts.begin(), pts.end());
    double slope = 1.0 / ring({pair.first, pair.second}).slowest_bytes_per_s;
    if (pts.size() >= 2 && pts.back().first > pts.front().first)
      slope = std::max(0.0, (pts.back().second - pts.front().second) / (pts.back().first - pts.front().first));
    const double fixed = std::max(0.0, pts.front().second - slope * pts.front().first);
    for (auto k : {static_cast<size_t>(pair.first) * N + static_cast<size_t>(pair.second),
                   static_cast<size_t>(pair.second) * N + static_cast<size_t>(pair.first)})
      tp_line_[k] = {fixed, slope};
  }

  const MemoryProfile& mem = profile.memory;
  tied_ = m.tied_head();
  if (tied_) {
    // The profiler measures the head slice of a tied model with its own copy of wte; the
    // embedding slice holds wte and wpe. A stage with both holds wte once.
    double wte = static_cast<double>(m.vocab_size) * static_cast<double>(m.hidden) * dtype_bytes_;
    wte_ = std::max(0.0, std::min({wte, mem.param_bytes_embed, mem.param_bytes_head}));
  }
  embed_rest_ = mem.param_bytes_embed - wte_;
  head_rest_ = mem.param_bytes_head - wte_;

  {
    // A block's halves by shape. Compute: multiply-adds per token (the attention's scores and
    // weighted sum over the whole sequence, as the runtime computes them); parameters: counts.
    const double H = static_cast<double>(m.hidden), T = static_cast<double>(m.seq_len), F = static_cast<double>(m.ffn_resolved());
    const double q = static_cast<double>(m.heads * m.head_dim()), kv = static_cast<double>(m.kv_heads_resolved() * m.head_dim());
    double attn_flops, mlp_flops, attn_params, mlp_params;
    if (m.arch == "llama") {
      attn_flops = H * (2 * q + 2 * kv) + 2 * T * q;
      mlp_flops = 3 * H * F;
      attn_params = H + H * (2 * q + 2 * kv) + (m.qkv_bias ? q + 2 * kv : 0);
      mlp_params = H + 3 * H * F;
    } else {
      attn_flops = 4 * H * H + 2 * T * H;
      mlp_flops = 2 * H * F;
      attn_params = 4 * H * H + 6 * H;
      mlp_params = 2 * H * F + F + 3 * H;
    }
    if (attn_flops > 0 && mlp_flops > 0) attn_compute_share_ = attn_flops / (attn_flops + mlp_flops);
    // The backward computes each projection's input and weight gradients (one product each, as
    // large as its forward) and the attention core's two products' gradients (twice its forward):
    // the weight products are this share of it. Norms and activations go uncounted on both sides.
    const double core = m.arch == "llama" ? 2 * T * q : 2 * T * H, projections = attn_flops - core + mlp_flops;
    if (projections > 0) weight_share_ = projections / (2 * projections + 2 * core);
    if (attn_params > 0 && mlp_params > 0) attn_param_share_ = attn_params / (attn_params + mlp_params);
  }

  set_grad_sync(GradSyncConfig{});
}

double CostContext::tp_block_share(int type, double f) const {
  const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
  const auto& pts = d.tp_shard_shares;
  if (pts.empty()) return f + d.tp_whole_share * (1 - f);
  // The points timed, then the whole block at (1, 1).
  auto point = [&](size_t i) { return i < pts.size() ? pts[i] : std::pair<double, double>{1.0, 1.0}; };
  size_t i = 1;  // the segment [point(i - 1), point(i)] holding f, or the first one below it
  while (i < pts.size() && f > point(i).first) ++i;
  const auto [f0, s0] = point(i - 1);
  const auto [f1, s1] = point(i);
  return std::max(0.0, s0 + (s1 - s0) * (f - f0) / (f1 - f0));
}

double CostContext::blocks_in(int64_t ub, int64_t ue, double attn_share) {
  if (ue <= ub) return 0;
  double lone = 0;
  if (ub % 2 != 0) lone += 1 - attn_share, ++ub;          // starts with an MLP half
  if (ue % 2 != 0 && ue > ub) lone += attn_share, --ue;   // ends with an attention half
  return static_cast<double>((ue - ub) / 2) + lone;
}

double CostContext::attention_share(int type, bool forward) const {
  const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
  const double measured = forward ? d.attn_share_fwd : d.attn_share_bwd;
  return measured > 0 ? measured : attn_compute_share_;
}

double CostContext::forward_s(int type, double blocks, bool first, bool last, int64_t m) const {
  const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
  const double x = static_cast<double>(m);
  double t = static_cast<double>(blocks) * d.block_fwd.at(x);
  if (first) t += d.embed_fwd.at(x);
  if (last) t += d.head_fwd.at(x);
  return t;
}

double CostContext::backward_s(int type, double blocks, bool first, bool last, int64_t m) const {
  const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
  const double x = static_cast<double>(m);
  double t = static_cast<double>(blocks) * d.block_bwd.at(x);
  if (first) t += d.embed_bwd.at(x);
  if (last) t += d.head_bwd.at(x);
  return t;
}

double CostContext::full_model_s_per_sample(int type, int64_t m) const {
  return (forward_s(type, layers(), true, true, m) + backward_s(type, layers(), true, true, m)) / static_cast<double>(m);
}

double CostContext::p2p_s(int host_a, int host_b, int64_t m, int share, double width) const {
  const size_t i = idx(host_a, host_b);
  return lat_[i] + static_cast<double>(share) * width * message_bytes(m) / bw_[i];
}

double CostContext::latency_s(int host_a, int host_b) const { return lat_[idx(host_a, host_b)]; }

std::vector<std::vector<int>> CostContext::pipeline_link_shares(const std::vector<std::vector<int>>& pipeline_hosts) const {
  std::vector<std::vector<int>> out;
  pipeline_link_shares(pipeline_hosts, &out);
  return out;
}

void CostContext::pipeline_link_shares(const std::vector<std::vector<int>>& pipeline_hosts, std::vector<std::vector<int>>* out) const {
  auto pair = [&](int a, int b) { return pair_link_[idx(a, b)]; };
  // Per link (either way): the pipelines crossing it (each counted once however often it does).
  thread_local std::vector<int> crossing;
  thread_local std::vector<size_t> seen, touched;
  crossing.resize(num_pair_links_, 0);
  touched.clear();
  for (const auto& hosts : pipeline_hosts) {
    seen.clear();
    for (size_t s = 0; s + 1 < hosts.size(); ++s)
      if (hosts[s] != hosts[s + 1]) seen.push_back(pair(hosts[s], hosts[s + 1]));
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (size_t k : seen) {
      if (crossing[k]++ == 0) touched.push_back(k);
    }
  }
  out->resize(pipeline_hosts.size());
  for (size_t p = 0; p < pipeline_hosts.size(); ++p) {
    const auto& hosts = pipeline_hosts[p];
    auto& row = (*out)[p];
    row.clear();
    for (size_t s = 0; s + 1 < hosts.size(); ++s)
      row.push_back(hosts[s] == hosts[s + 1] ? 1 : std::max(1, crossing[pair(hosts[s], hosts[s + 1])]));
  }
  for (size_t k : touched) crossing[k] = 0;  // clean for the next call (crossing is reused)
}

double CostContext::param_bytes(double blocks, bool first, bool last) const {
  double b = static_cast<double>(blocks) * profile_->memory.param_bytes_per_block;
  if (first) b += embed_rest_;
  if (last) b += head_rest_;
  if (first || last) b += wte_;
  return b;
}

double CostContext::frozen_bytes(double blocks, bool first, bool last) const {
  const MemoryProfile& mem = profile_->memory;
  return static_cast<double>(blocks) * mem.frozen_bytes_per_block + (first ? mem.frozen_bytes_embed : 0.0) +
         (last ? mem.frozen_bytes_head : 0.0);
}

double CostContext::tp_frozen_bytes(double blocks, bool first, bool last) const {
  const LoraConfig& l = profile_->lora;
  const double piece = l.enabled() && l.base_dtype == "nf4" && l.double_quant ? (0.5 + 4.0 / 64) / (0.5 + 1.0 / 64 + 4.0 / (64 * 256)) : 1.0;
  return piece * frozen_bytes(blocks, false, false) + frozen_bytes(0, first, last);
}

double CostContext::act_bytes_per_sample(double blocks, bool first, bool last) const {
  const MemoryProfile& mem = profile_->memory;
  double b = static_cast<double>(blocks) * mem.act_bytes_per_sample_block;
  if (first) b += mem.act_bytes_per_sample_embed;
  if (last) b += mem.act_bytes_per_sample_head;
  return b;
}

namespace {

// Clark's (1961) moments of max(X, Y) for independent normals: exact in the mean.
std::pair<double, double> max_of_two(double mu, double var, double m2, double v2) {
  const double a = std::sqrt(var + v2);
  if (!(a > 1e-12 * std::max({1.0, std::fabs(mu), std::fabs(m2)}))) return m2 >= mu ? std::pair{m2, v2} : std::pair{mu, var};
  constexpr double kInvSqrt2Pi = 0.3989422804014327;
  const double alpha = (mu - m2) / a;
  const double cdf = 0.5 * std::erfc(-alpha / std::sqrt(2.0)), cdf_not = 1 - cdf, pdf = kInvSqrt2Pi * std::exp(-0.5 * alpha * alpha);
  const double e1 = mu * cdf + m2 * cdf_not + a * pdf;
  const double e2 = (mu * mu + var) * cdf + (m2 * m2 + v2) * cdf_not + (mu + m2) * a * pdf;
  return {e1, std::max(0.0, e2 - e1 * e1)};
}

// Adaptive Simpson on [a, b] given f at a, (a+b)/2 and b. The first levels always split, so a
// step narrower than the first samples' spacing cannot pass for converged.
template <class F>
double simpson(const F& f, double a, double b, double fa, double fm, double fb, double whole, double tol, int depth) {
  const double m = 0.5 * (a + b), lm = 0.5 * (a + m), rm = 0.5 * (m + b);
  const double flm = f(lm), frm = f(rm);
  const double left = (m - a) / 6 * (fa + 4 * flm + fm), right = (b - m) / 6 * (fm + 4 * frm + fb);
  if (depth <= 0 || (depth < 36 && std::fabs(left + right - whole) <= 15 * tol)) return left + right + (left + right - whole) / 15;
  return simpson(f, a, m, fa, flm, fm, left, tol / 2, depth - 1) + simpson(f, m, b, fm, frm, fb, right, tol / 2, depth - 1);
}

}  // namespace

double expected_max(std::vector<std::pair<double, double>> mean_sd) {
  if (mean_sd.empty()) return 0;
  for (const auto& [mu, sd] : mean_sd)
    if (!std::isfinite(mu) || !std::isfinite(sd) || sd < 0) return std::numeric_limits<double>::quiet_NaN();
  if (mean_sd.size() <= 2) {
    const auto& x = mean_sd[0];
    if (mean_sd.size() == 1) return x.first;
    return max_of_two(x.first, x.second * x.second, mean_sd[1].first, mean_sd[1].second * mean_sd[1].second).first;
  }
  // Beyond two, moment matching is off by up to several percent of a spread (a random draw beside
  // two steady ones near its mean), so integrate: E[max] = lo + integral over [lo, hi] of
  // 1 - prod_i Phi((t - mu_i) / sd_i), where every draw lies in [lo, hi] but for tails of 1e-19.
  constexpr double kTails = 9.0;
  double floor = -std::numeric_limits<double>::infinity(), lo = floor, hi = floor;
  std::vector<std::pair<double, double>> random;
  for (const auto& [mu, sd] : mean_sd) {
    if (!(sd > 1e-12 * std::max(1.0, std::fabs(mu)))) {
      floor = std::max(floor, mu);
      continue;
    }
    random.push_back({mu, sd});
    lo = std::max(lo, mu - kTails * sd);  // the max is above every draw
    hi = std::max(hi, mu + kTails * sd);
  }
  if (random.empty() || floor >= hi) return std::max(floor, hi);
  lo = std::max(lo, floor);
  const auto above = [&](double t) {  // P(max > t) for t >= the steady floor
    double below = 1;
    for (const auto& [mu, sd] : random) below *= 0.5 * std::erfc(-(t - mu) / (sd * std::sqrt(2.0)));
    return 1 - below;
  };
  const double fa = above(lo), fm = above(0.5 * (lo + hi)), fb = above(hi);
  const double whole = (hi - lo) / 6 * (fa + 4 * fm + fb);
  return lo + simpson(above, lo, hi, fa, fm, fb, whole, 1e-10 * (hi - lo), 40);
}

double CostContext::optimizer_s(int type, double param_bytes) const {
  return param_bytes / dtype_bytes_ * type_profile_[static_cast<size_t>(type)]->optimizer_s_per_param;
}

double CostContext::memory_bytes(double param_bytes, double bucket_bytes, int64_t in_flight, int64_t m, double act_per_sample) const {
  // Every stage the search makes holds a block: its backward's working set is always there.
  return (param_bytes * profile_->memory.state_bytes_per_param_byte + bucket_bytes) +
         (static_cast<double>(in_flight * m) * act_per_sample + working_bytes(1, m, false));
}

std::vector<int> CostContext::tp_last_members(const std::vector<int>& devices, const std::vector<double>& arrival_s) {
  const double latest = arrival_s.empty() ? 0.0 : *std::max_element(arrival_s.begin(), arrival_s.end());
  std::vector<int> out;
  for (size_t k = 0; k < devices.size(); ++k)
    if (arrival_s[k] >= (1 - kTpLastMargin) * latest) out.push_back(devices[k]);
  return out;
}

std::vector<int> CostContext::tp_waited_for(const std::vector<int>& devices, const std::vector<double>& compute_s, double sums_s,
                                            double chunks) const {
  std::vector<double> arrival;
  for (size_t k = 0; k < devices.size(); ++k) arrival.push_back(tp_member_s(type_of(devices[k]), compute_s[k], sums_s, chunks) - sums_s);
  return tp_last_members(devices, arrival);
}

double CostContext::tp_sum_s(std::vector<int> devices, double bytes, const std::vector<int>& last) const {
  const size_t n = devices.size(), N = cluster_->devices.size();
  if (n < 2) return 0;
  auto cpu_at_quota = [&](int d) { return type_profile_[static_cast<size_t>(type_of(d))]->comm_cpu_s_per_byte; };
  double group_cpu = -1;  // s per byte moved by the member the sum waits for longest
  if (!last.empty())
    for (int d : devices) {
      const DeviceProfile& p = *type_profile_[static_cast<size_t>(type_of(d))];
      const bool waited_for = std::find(last.begin(), last.end(), d) != last.end();
      group_cpu = std::max(group_cpu, p.comm_cpu_s_per_byte * (waited_for ? 1.0 : std::clamp(p.quota_fraction, 1e-3, 1.0)));
    }
  // The member of a pair that arrived last when the profile timed its sums: the slower at a block.
  auto slower = [&](int a, int b) {
    auto block = [&](int d) {
      const DeviceProfile& p = *type_profile_[static_cast<size_t>(type_of(d))];
      return p.block_fwd.at(1) + p.block_bwd.at(1);
    };
    return block(a) >= block(b) ? a : b;
  };
  // A ring all-reduce moves 2(n-1)/n of the bytes over every hop (a pair: all of them once). The
  // group takes its slowest pair's line at those bytes: a fast pair's fixed wait overlaps a thin
  // pair's transfer rather than adding to it (adding the worst fixed part to the worst slope put
  // examples/cluster-tp.yaml's trio 15-19% over what it measured).
  const double ring_bytes = bytes * (2.0 * static_cast<double>(n - 1) / static_cast<double>(n));
  double t = 0;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const auto [f, s] = tp_line_[static_cast<size_t>(devices[i]) * N + static_cast<size_t>(devices[j])];
      if (f < 0) {  // unmeasured: the link model's ring, in host order
        std::sort(devices.begin(), devices.end(), [&](int a, int b) { return ring_less(a, a, b, b); });
        return std::max(kTpSumFloorS, allreduce_s(ring(devices), bytes, std::numeric_limits<double>::infinity()));
      }
      double pair = f + s * ring_bytes;
      if (group_cpu >= 0)
        pair = std::max(s * ring_bytes, pair + 2 * ring_bytes * (group_cpu - cpu_at_quota(slower(devices[i], devices[j]))));
      t = std::max(t, pair);
    }
  return t;
}

}  // namespace alloy::plan
