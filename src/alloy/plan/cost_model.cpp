#include "alloy/plan/cost_model.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include "alloy/core/components.h"
#include "alloy/core/error.h"
#include "alloy/core/sync_tree.h"
#include "alloy/plan/cost_sharding.h"
#include "alloy/plan/sync_scope.h"

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

double CostContext::world_sum_s(const std::vector<int>& d) const {
  // The trainer routes it along a tree where the plan's slow_links say (plan::needs_slow_links).
  const SyncTree t = d.size() >= 3 && needs_slow_links(gs_)
                         ? sync_tree(d.size(), [&](size_t a, size_t b) { return slow_pair(d[a], d[b]); })
                         : SyncTree{};
  if (t.empty()) {
    std::vector<int> order(d.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return ring_less(d[static_cast<size_t>(a)], a, d[static_cast<size_t>(b)], b); });
    std::vector<int> devs;
    for (int i : order) devs.push_back(d[static_cast<size_t>(i)]);
    return allreduce_s(ring(devs), kWorldSumBytes, 0);
  }
  // Every member's figures climb to the root and the total comes back down each edge: a path's
  // latencies both ways. (A few bytes go out at once: measured over an emulated 20 ms link, a
  // ping-pong took 40.9 ms whether the receive was posted before the send or after.)
  auto hop = [&](int from, int to) {  // member FROM to member TO: latency and the figures' bytes
    const size_t k = idx(host_of(d[static_cast<size_t>(from)]), host_of(d[static_cast<size_t>(to)]));
    return lat_[k] + kWorldSumBytes / bw_[k];
  };
  std::function<double(int)> complete = [&](int x) {  // when member X's partial sum is complete
    double at = 0;
    for (int kid : t.children[static_cast<size_t>(x)])
      at = std::max(at, complete(kid) + hop(kid, x));
    return at;
  };
  std::function<double(int, double)> last_down = [&](int x, double at) {  // the total reaches X at AT
    double worst = at;
    for (int kid : t.children[static_cast<size_t>(x)]) worst = std::max(worst, last_down(kid, at + hop(x, kid)));
    return worst;
  };
  return last_down(t.root, complete(t.root));
}

void CostContext::set_grad_sync(const GradSyncConfig& g) {
  gs_ = g;
  const size_t H = hosts_.size();
  slow_.assign(H * H, 0);
  const double thr = slow_link_threshold_gbps(*cluster_, g);
  for (size_t a = 0; a < H; ++a)
    for (size_t b = 0; b < H; ++b)
      if (a != b && cluster_->link(hosts_[a], hosts_[b]).bandwidth_gbps < thr) slow_[a * H + b] = 1;
  // PowerSGD's wire per gradient byte over a block: r (rows + cols) per matrix, vectors dense.
  const ModelConfig& m = profile_->model;
  const double h = static_cast<double>(m.hidden), f = static_cast<double>(m.ffn_resolved());
  const double kv = static_cast<double>(m.kv_heads_resolved() * m.head_dim());
  std::vector<std::pair<double, double>> mats;
  if (m.arch == "llama") mats = {{h, h}, {kv, h}, {kv, h}, {h, h}, {f, h}, {f, h}, {h, f}};
  else mats = {{h, 3 * h}, {h, h}, {h, f}, {f, h}};
  const double r = static_cast<double>(g.powersgd_rank);
  double sent = 0, total = 0;
  for (auto [a, b] : mats) {
    const double rr = std::min({r, a, b});
    sent += rr * (a + b) < a * b ? rr * (a + b) : a * b;
    total += a * b;
  }
  powersgd_ratio_ = total > 0 ? sent / total : 1.0;
  // Every device as a rank, rank i on device i (what the search assumes); simulate_plan prices a
  // plan's own ranks.
  std::vector<int> all(cluster_->devices.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  world_allreduce_s_ = world_sum_s(all);
}

double CostContext::LinkLoads::factor(size_t i, double own) const {
  if (!(own > 0) || i >= hop.size()) return 1.0;
  double sum = 0;
  for (double b : hop[i]) sum += std::min(b, own);
  return std::max(1.0, sum / own);
}

void CostContext::add_pipeline_tail_load(const std::vector<int>& hosts, int64_t m, LinkLoads* loads) const {
  for (size_t s = 0; s + 1 < hosts.size(); ++s)
    if (hosts[s] != hosts[s + 1])
      loads->hop[hop_link_[idx(hosts[s + 1], hosts[s])]].push_back(static_cast<double>(m) * act_message_bytes_);
}

CostContext::LinkLoads CostContext::empty_loads() const {
  LinkLoads l;
  l.hop.resize(num_links_);
  return l;
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

double CostContext::wire_ratio() const {
  const std::string& m = gs_.compression;
  if (m == "none") return 1.0;
  if (m == "fp16" || m == "bf16") return 0.5;
  if (m == "powersgd") return powersgd_ratio_;
  if (m == "randomk") return gs_.density;
  return 2.0 * gs_.density;  // an int32 index and an fp32 value per element sent
}

namespace {
// How a method's exchange moves its payload: all-gather (every member's own), or all-reduce.
// Ok-Topk's split-and-reduce moves about 2k pairs per member whatever the group size: an all-reduce's pattern.
bool gathers(const std::string& m) { return m != "fp16" && m != "randomk" && m != "powersgd" && m != "oktopk"; }
// Codec costs when the profile predates them (per element, on a ~3 GHz core).
CodecCost default_codec(const std::string& m) {
  if (m == "fp16" || m == "bf16") return {2e-9, 1e-9};
  if (m == "powersgd") return {1.5e-8, 5e-9};
  if (m == "topk" || m == "oktopk") return {1e-8, 1e-9};
  return {4e-9, 1e-9};
}
}  // namespace

std::vector<std::vector<int>> CostContext::regions_of(const std::vector<int>& d) const {
  // Devices joined, directly or through each other, by links that are not slow; in D's order.
  std::vector<std::vector<int>> regions;
  for (const auto& c : components(d.size(), [&](size_t a, size_t b) { return !slow_pair(d[a], d[b]); })) {
    regions.emplace_back();
    for (size_t i : c) regions.back().push_back(d[i]);
  }
  return regions;
}

CostContext::SyncShape CostContext::sync_shape(const std::vector<int>& d, const LinkLoads* loads, double set_bytes) const {
  SyncShape s;
  const int n = static_cast<int>(d.size());
  std::vector<std::vector<int>> regions;
  if (gs_.lossy()) {
    if (gs_.scope == "slow-links") {
      regions = regions_of(d);
      s.compressed = regions.size() > 1;
      s.hierarchical = s.compressed;
    } else {
      s.compressed = n > 1;
    }
  }
  const double f = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  if (!s.compressed) {
    s.ring = ring(d, loads, f * set_bytes);
    if (gs_.allreduce == "auto") {
      // D is in host order, the runtime's members in rank order: the same where rank i runs device
      // i of a cluster listed host by host (the emulator's, the planner's plans).
      const SyncTree t = sync_tree(d.size(), [&](size_t a, size_t b) { return slow_pair(d[a], d[b]); });
      if (!t.empty()) {
        s.tree = true;
        Tree& tr = s.sum_tree;
        tr.depth = t.depth;
        tr.devices = d;
        tr.parent = t.parent;
        tr.slowest_bytes_per_s = std::numeric_limits<double>::infinity();
        std::vector<double> edge_s_per_byte(d.size(), 0), edge_latency(d.size(), 0);  // member -> parent, both ways
        for (size_t m = 0; m < d.size(); ++m) {
          tr.degree.push_back(t.degree(static_cast<int>(m)));
          if (t.parent[m] < 0) continue;
          const int hm = host_of(d[m]), hp = host_of(d[static_cast<size_t>(t.parent[m])]);
          for (const size_t k : {idx(hm, hp), idx(hp, hm)}) {  // the partial sum up, the total down
            const double share = loads ? loads->factor(hop_link_[k], set_bytes) : 1.0;
            tr.slowest_bytes_per_s = std::min(tr.slowest_bytes_per_s, bw_[k] / share);
            edge_s_per_byte[m] += share / bw_[k];
            edge_latency[m] += lat_[k];
          }
        }
        for (size_t m = 0; m < d.size(); ++m) {
          double spb = 0, lat = 0;
          for (int x = static_cast<int>(m); t.parent[static_cast<size_t>(x)] >= 0; x = t.parent[static_cast<size_t>(x)])
            spb += edge_s_per_byte[static_cast<size_t>(x)], lat += edge_latency[static_cast<size_t>(x)];
          tr.path_s_per_byte.push_back(spb);
          tr.path_latency_s.push_back(lat);
        }
      }
    }
    return s;
  }
  auto codec_of = [&](int dev) {
    const auto& c = type_profile_[static_cast<size_t>(type_of(dev))]->codecs;
    auto it = c.find(gs_.compression);
    return it != c.end() ? it->second : default_codec(gs_.compression);
  };
  auto payload_per_hop = [&](int members) {
    const double wire = wire_ratio() * set_bytes;
    return gathers(gs_.compression) ? (members - 1) * wire : (members > 1 ? 2.0 * (members - 1) / members * wire : 0.0);
  };
  std::vector<int> encoders = d;
  if (!s.hierarchical) {
    s.ring = ring(d, loads, payload_per_hop(n));
  } else {
    s.num_regions = static_cast<int>(regions.size());
    std::vector<int> leaders;
    for (const auto& r : regions) {
      leaders.push_back(r.front());
      if (r.size() > 1) {
        const double m = static_cast<double>(r.size());
        s.regions.push_back(ring(r, loads, 2.0 * (m - 1) / m * set_bytes));
      }
    }
    s.leaders = ring(leaders, loads, payload_per_hop(s.num_regions));
    encoders = leaders;
  }
  for (int dev : encoders) {
    const CodecCost c = codec_of(dev);
    s.encode_s_per_elem = std::max(s.encode_s_per_elem, c.encode_s_per_elem);
    s.decode_s_per_elem = std::max(s.decode_s_per_elem, c.decode_s_per_elem);
  }
  return s;
}

void CostContext::add_load(const std::vector<int>& d, double set_bytes, LinkLoads* loads) const {
  const SyncShape s = sync_shape(d, nullptr, set_bytes);
  auto put = [&](const std::vector<int>& ring_devs, double per_hop) {
    if (ring_devs.size() < 2 || !(per_hop > 0)) return;
    for (size_t i = 0; i < ring_devs.size(); ++i)
      loads->hop[hop_link_[idx(host_of(ring_devs[i]), host_of(ring_devs[(i + 1) % ring_devs.size()]))]].push_back(per_hop);
  };
  const int n = static_cast<int>(d.size());
  if (s.tree) {  // every tree edge, both ways
    const Tree& t = s.sum_tree;
    for (size_t m = 0; m < t.devices.size(); ++m) {
      if (t.parent[m] < 0) continue;
      const int hm = host_of(t.devices[m]), hp = host_of(t.devices[static_cast<size_t>(t.parent[m])]);
      loads->hop[hop_link_[idx(hm, hp)]].push_back(set_bytes);
      loads->hop[hop_link_[idx(hp, hm)]].push_back(set_bytes);
    }
    return;
  }
  if (!s.compressed) {
    put(d, n > 1 ? 2.0 * (n - 1) / n * set_bytes : 0);
    return;
  }
  const double wire = wire_ratio() * set_bytes;
  auto exchange = [&](int members) {
    return gathers(gs_.compression) ? (members - 1) * wire : (members > 1 ? 2.0 * (members - 1) / members * wire : 0.0);
  };
  if (!s.hierarchical) {
    put(d, exchange(n));
    return;
  }
  // The same regions sync_shape found: fast rings, then the leaders' ring.
  const auto regions = regions_of(d);
  std::vector<int> leaders;
  for (const auto& r : regions) {
    leaders.push_back(r.front());
    const double m = static_cast<double>(r.size());
    put(r, r.size() > 1 ? 2.0 * (m - 1) / m * set_bytes : 0);
  }
  put(leaders, exchange(static_cast<int>(leaders.size())));
}

int CostContext::Tree::degree_of(int device) const {
  for (size_t m = 0; m < devices.size(); ++m)
    if (devices[m] == device) return degree[m];
  return degree.empty() ? 0 : *std::max_element(degree.begin(), degree.end());
}

double CostContext::tree_allreduce_s(const Tree& t, double bytes) const {
  if (!(bytes > 0) || t.devices.size() < 2) return 0;
  // The first chunk climbs from the farthest member to the root and its total comes back down;
  // the chunks behind it follow one per chunk time on the slowest edge (up and down are different
  // ways of a link, so they overlap).
  const double chunk = std::min(bytes, static_cast<double>(kSyncTreeChunkBytes));
  double first = 0;
  for (size_t m = 0; m < t.path_s_per_byte.size(); ++m)
    first = std::max(first, chunk * t.path_s_per_byte[m] + t.path_latency_s[m]);
  return (bytes - chunk) / t.slowest_bytes_per_s + first;
}

double CostContext::sync_buffer_bytes(const SyncShape& s, double set_bytes) const {
  // The reducer's bucket copy; a tree's member also receives its children's and its parent's copy of
  // the bucket in flight.
  if (s.tree) return set_bytes + s.sum_tree.degree_of(-1) * std::min(set_bytes, bucket_bytes());
  if (!s.compressed) return set_bytes;
  // Staging and output buffers, the residual (error feedback) and DGC's velocity.
  double k = 2;
  if (gs_.error_feedback) k += 1;
  if (gs_.local_velocity()) k += 1;
  return k * set_bytes;
}

double CostContext::allgather_s(const Ring& r, double per_member) const {
  if (r.n < 2) return 0;
  return static_cast<double>(r.n - 1) / r.n * r.latency_sum_s + (r.n - 1) * per_member / r.slowest_bytes_per_s;
}

double CostContext::bucket_s(const SyncShape& s, double bytes, int64_t* collectives) const {
  if (s.tree) {
    const double nb = std::max(1.0, std::ceil(bytes / bucket_bytes()));
    if (collectives) *collectives = static_cast<int64_t>(nb);
    return nb * tree_allreduce_s(s.sum_tree, bytes / nb);
  }
  if (!s.compressed) return allreduce_s(s.ring, bytes, bucket_bytes(), collectives);
  if (collectives) *collectives = 1;
  const double elems = bytes / dtype_bytes_, wire = wire_ratio() * bytes;
  const std::string& m = gs_.compression;
  auto exchange = [&](const Ring& r) {
    if (gathers(m)) {
      // Without aligned fusion the members first exchange their sizes: one more round of latency.
      const bool sizes = !(gs_.fusion == "saf-inter" || gs_.fusion == "saf-adaptive") && m != "bf16";
      return allgather_s(r, wire) + (sizes && r.n > 1 ? static_cast<double>(r.n - 1) / r.n * r.latency_sum_s : 0.0);
    }
    const double t = allreduce_s(r, wire, 0);
    return m == "powersgd" && r.n > 1 ? t + 2.0 * (r.n - 1) / r.n * r.latency_sum_s : t;  // P, then Q
  };
  double t = elems * (s.encode_s_per_elem + s.decode_s_per_elem);
  if (!s.hierarchical) return t + exchange(s.ring);
  double region = 0, bcast = 0;
  for (const auto& r : s.regions) {
    region = std::max(region, allreduce_s(r, bytes, 0));
    bcast = std::max(bcast, r.latency_sum_s / r.n + s.num_regions * wire / r.slowest_bytes_per_s);
  }
  return t + region + exchange(s.leaders) + bcast;
}

double CostContext::sync_cpu_s(int type, const SyncShape& s, double bytes, size_t n, int device) const {
  const double rate = type_profile_[static_cast<size_t>(type)]->comm_cpu_s_per_byte;
  if (!(rate > 0) || n < 2) return 0;
  if (s.tree) return rate * 2.0 * bytes * s.sum_tree.degree_of(device);
  auto moved = [](double payload, int k, bool gather) {
    if (k < 2) return 0.0;
    return 2.0 * (gather ? (k - 1) * payload : 2.0 * (k - 1) / k * payload);
  };
  if (!s.compressed) return rate * moved(bytes, static_cast<int>(n), false);
  const double wire = wire_ratio() * bytes;
  const bool gather = gathers(gs_.compression);
  if (!s.hierarchical) return rate * moved(wire, static_cast<int>(n), gather);
  double region = 0;
  for (const auto& r : s.regions) region = std::max(region, moved(bytes, r.n, false));
  return rate * (region + moved(wire, s.leaders.n, gather));
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

CostContext::Ring CostContext::ring(const std::vector<int>& d, const LinkLoads* loads, double own) const {
  Ring r;
  r.n = static_cast<int>(d.size());
  r.slowest_bytes_per_s = std::numeric_limits<double>::infinity();
  if (r.n < 2) return r;
  for (size_t i = 0; i < d.size(); ++i) {
    const size_t k = idx(host_of(d[i]), host_of(d[(i + 1) % d.size()]));
    const double share = loads ? loads->factor(hop_link_[k], own) : 1.0;
    r.slowest_bytes_per_s = std::min(r.slowest_bytes_per_s, ring_bw_[k] / share);
    r.latency_sum_s += lat_[k];
  }
  return r;
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

double CostContext::allreduce_s(const Ring& r, double bytes, double bucket_bytes, int64_t* buckets) const {
  if (buckets) *buckets = 0;
  if (r.n < 2) return 0;
  const double f = 2.0 * (r.n - 1) / r.n;
  const double nb = bucket_bytes > 0 ? std::max(1.0, std::ceil(bytes / bucket_bytes)) : 1.0;
  if (buckets) *buckets = static_cast<int64_t>(nb);
  return nb * f * r.latency_sum_s + f * bytes / r.slowest_bytes_per_s;
}

double CostContext::unit_bytes(int u) const {
  const int L = static_cast<int>(layers());
  if (u == 0) return head_rest_;
  if (u <= 2 * L) {
    const double block = profile_->memory.param_bytes_per_block, attn = attn_param_share_ * block;
    return (2 * L - u) % 2 == 0 ? attn : block - attn;
  }
  if (u == 2 * L + 1) return embed_rest_;
  return wte_;
}

std::vector<CostContext::SyncSet> CostContext::sync_sets(const std::vector<std::vector<Holder>>& pipelines) const {
  const int64_t L = layers();
  std::vector<SyncSet> out;
  std::map<std::vector<int>, size_t> index;
  std::vector<int> ids;
  auto add = [&](int u, double bytes) {
    if (!(bytes > 0)) return;  // a unit with no parameters has nothing to sync
    std::sort(ids.begin(), ids.end());
    if (ids.size() < 2) return;
    auto [it, fresh] = index.emplace(ids, out.size());
    if (fresh) out.push_back({ids, 0.0, {}});
    out[it->second].bytes += bytes;
    out[it->second].units.emplace_back(u, bytes);
  };
  ids.clear();
  for (const auto& p : pipelines)
    for (const auto& h : p)
      if (h.last) ids.push_back(h.id);
  add(0, unit_bytes(0));
  std::vector<size_t> at(pipelines.size(), 0);  // each pipeline's stage holding the current half block
  for (size_t p = 0; p < pipelines.size(); ++p) at[p] = pipelines[p].empty() ? 0 : pipelines[p].size() - 1;
  // A unit cut by columns in some pipeline (Holder::cut_share) syncs as pieces, as the runtime
  // stores it: its bytes split at every pipeline's cut, each piece among the holders of its columns.
  struct Held {
    int id;
    double from, to;  // the unit's share [from, to) this holder holds
  };
  std::vector<Held> held;
  std::vector<double> bounds;
  for (int64_t h = 2 * L - 1; h >= 0; --h) {
    held.clear();
    bounds = {0.0, 1.0};
    for (size_t p = 0; p < pipelines.size(); ++p) {
      while (at[p] > 0 && pipelines[p][at[p]].begin > h) --at[p];
      if (pipelines[p].empty()) continue;
      const Holder& cur = pipelines[p][at[p]];
      const Holder* prev = at[p] > 0 && pipelines[p][at[p] - 1].end > h ? &pipelines[p][at[p] - 1] : nullptr;
      if (prev && prev->cut_share > 0) {
        held.push_back({prev->id, 0.0, prev->cut_share});
        held.push_back({cur.id, prev->cut_share, 1.0});
        bounds.push_back(prev->cut_share);
        continue;
      }
      held.push_back({cur.id, 0.0, 1.0});
      // A floating boundary: the stage before shares this unit.
      for (size_t k = at[p]; k > 0 && pipelines[p][k - 1].end > h; --k) held.push_back({pipelines[p][k - 1].id, 0.0, 1.0});
    }
    std::sort(bounds.begin(), bounds.end());
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
    const int u = half_unit(h);
    const double whole = unit_bytes(u);
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      ids.clear();
      for (const Held& x : held)
        if (x.from <= bounds[j] && x.to >= bounds[j + 1]) ids.push_back(x.id);
      add(u, whole * (bounds[j + 1] - bounds[j]));
    }
  }
  ids.clear();
  for (const auto& p : pipelines)
    for (const auto& h : p)
      if (h.first) ids.push_back(h.id);
  add(embed_unit(), unit_bytes(embed_unit()));
  ids.clear();
  for (const auto& p : pipelines)
    for (const auto& h : p)
      if (h.first || h.last) ids.push_back(h.id);
  add(wte_unit(), unit_bytes(wte_unit()));
  return out;
}

MicroBatchCost CostContext::unit_ready(int type, int64_t begin, int64_t end, bool first, bool last, int u) const {
  const DeviceProfile& d = *type_profile_[static_cast<size_t>(type)];
  const int L = static_cast<int>(layers());
  MicroBatchCost c;
  auto add = [&](const MicroBatchCost& x, double k) { c.add(x, k); };
  if (last) add(d.head_bwd, 1);
  if (u == 0 || (u == 2 * L + 2 && !first)) return c;  // head rest; tied wte on a stage without the embedding
  if (u <= 2 * L) {  // the backward has run from the stage's end down to this half
    add(d.block_bwd, blocks_in(2 * L - u, end, attention_share(type, false)));
    return c;
  }
  add(d.block_bwd, blocks_in(begin, end, attention_share(type, false)));
  add(d.embed_bwd, 1);
  return c;
}

void CostContext::buckets(const SyncShape& s, const std::vector<std::pair<int, double>>& units, double cap, std::vector<Bucket>* out) const {
  out->clear();
  auto close = [&](Bucket& b) {
    if (!s.compressed) {
      b.collectives = cap > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(b.bytes / cap))) : 1;
      b.time_s = s.ring.n < 2 ? 0 : s.tree ? tree_allreduce_s(s.sum_tree, b.bytes) : allreduce_s(s.ring, b.bytes, cap);
    } else {
      b.time_s = bucket_s(s, b.bytes, &b.collectives);
    }
    out->push_back(b);
  };
  Bucket cur;
  bool open = false;
  for (const auto& [u, bytes] : units) {
    if (open && cap > 0 && cur.bytes + bytes > cap) {
      close(cur);
      open = false;
    }
    if (!open) cur = Bucket{}, open = true;
    cur.last_unit = u;
    cur.bytes += bytes;
  }
  if (open) close(cur);
}

}  // namespace alloy::plan
