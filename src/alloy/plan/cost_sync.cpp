// The cost model's gradient sync, kept apart from compute, memory and pipeline messages because
// it is a model of its own: how a holder set's gradients travel (ring, tree around slow links,
// compressed or hierarchical), what that puts on shared links, and how the reducer's buckets
// and the step's world sum are priced (cost_model.h).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "alloy/core/components.h"
#include "alloy/core/sync_tree.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/sync_scope.h"

namespace alloy::plan {

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
    return posted_gather_s(ring(devs), kWorldSumBytes);  // PostedSum: sent straight to posted receives, summed locally
  }
  // Every member's figures climb to the root (or both ends of its root edge, and across) and the
  // total comes back down each edge: a path's latencies both ways. (A few bytes go out at once:
  // measured over an emulated 20 ms link, a ping-pong took 40.9 ms whether the receive was posted
  // before the send or after.)
  return sync_tree_round_trip(t, [&](size_t from, size_t to) {  // latency and the figures' bytes
    const size_t k = idx(host_of(d[from]), host_of(d[to]));
    return lat_[k] + kWorldSumBytes / bw_[k];
  });
}

void CostContext::set_grad_sync(const GradSyncConfig& g) {
  gs_ = g;
  trees_of_.clear();
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

double CostContext::LinkLoads::ratio(size_t i, double own) const {
  if (!(own > 0) || i >= hop.size()) return 1.0;
  double sum = 0;
  for (double b : hop[i]) sum += std::min(b, own);
  return sum / own;
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
      auto cached = trees_of_.find(d);
      if (cached == trees_of_.end())
        cached = trees_of_.emplace(d, sync_trees(d.size(), [&](size_t a, size_t b) { return slow_pair(d[a], d[b]); },
                                                 static_cast<int>(gs_.tree_stripes))).first;
      const std::vector<SyncTree>& trees = cached->second;
      if (!trees.empty()) {
        s.tree = true;
        Tree& tr = s.sum_tree;
        const double S = static_cast<double>(trees.size());
        tr.stripes = static_cast<int>(trees.size());
        tr.depth = trees[0].depth;
        tr.devices = d;
        tr.parent = trees[0].parent;
        tr.trees = trees;
        tr.degree.assign(d.size(), 0);
        // How many stripes cross each link, either way (a shared line counts once per stripe).
        std::map<size_t, int> crossing;
        for (const SyncTree& t : trees)
          for (size_t m = 0; m < d.size(); ++m) {
            if (t.parent[m] < 0) continue;
            const int hm = host_of(d[m]), hp = host_of(d[static_cast<size_t>(t.parent[m])]);
            for (const size_t k : {idx(hm, hp), idx(hp, hm)}) ++crossing[hop_link_[k]];
          }
        tr.slowest_bytes_per_s = std::numeric_limits<double>::infinity();
        for (const SyncTree& t : trees) {
          std::vector<Tree::Hop>& hops = tr.hops.emplace_back(d.size());
          for (size_t m = 0; m < d.size(); ++m) {
            tr.degree[m] += t.degree(static_cast<int>(m)) / S;
            if (t.parent[m] < 0) continue;
            const int hm = host_of(d[m]), hp = host_of(d[static_cast<size_t>(t.parent[m])]);
            // The partial sum up, the total down (one way each; the same link where both share a host).
            for (const bool up : {true, false}) {
              const size_t k = up ? idx(hm, hp) : idx(hp, hm);
              const double share = loads ? loads->factor(hop_link_[k], set_bytes) : 1.0;
              const double load = static_cast<double>(crossing[hop_link_[k]]) / S;  // of the set's bytes
              // The set puts LOAD x SET_BYTES on this link; LOADS holds those crossings too (add_load,
              // as both callers do), so its ratio against that amount is the link's sharing: 1 alone,
              // more with others' bytes (each counted up to the set's own, as for rings). Scaling a
              // ratio against the whole set by LOAD counted the set's own edges twice (a host
              // chaining 32 members priced its line 62 x 62 times over) and, for a stripe's half of
              // the bytes, hid smaller loads beside it (pipeline messages) under its floor of 1.
              const double sharing = loads ? load * loads->ratio(hop_link_[k], load * set_bytes) : load;
              tr.slowest_bytes_per_s = std::min(tr.slowest_bytes_per_s, bw_[k] / sharing);
              (up ? hops[m].up_s_per_byte : hops[m].down_s_per_byte) = share / bw_[k];
              (up ? hops[m].up_latency_s : hops[m].down_latency_s) = lat_[k];
            }
          }
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
  if (s.tree) {  // every stripe's tree edges, both ways, each with its slice
    const auto& stripes = s.sum_tree.trees;
    const double slice = set_bytes / static_cast<double>(stripes.size());
    for (const SyncTree& t : stripes)
      for (size_t m = 0; m < d.size(); ++m) {
        const std::vector<int>& parent = t.parent;
        if (parent[m] < 0) continue;
        const int hm = host_of(d[m]), hp = host_of(d[static_cast<size_t>(parent[m])]);
        loads->hop[hop_link_[idx(hm, hp)]].push_back(slice);
        loads->hop[hop_link_[idx(hp, hm)]].push_back(slice);
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

double CostContext::Tree::degree_of(int device) const {
  for (size_t m = 0; m < devices.size(); ++m)
    if (devices[m] == device) return degree[m];
  return degree.empty() ? 0 : *std::max_element(degree.begin(), degree.end());
}

double CostContext::tree_latency_s(const Tree& t, double bytes) const {
  if (!(bytes > 0) || t.devices.size() < 2) return 0;
  // The first chunk climbs to its stripe's root (or the ends of its root edge, and across) and the
  // total comes back down to every member; the chunks behind it follow one per chunk time on the
  // slowest link (up and down are different ways of a link, so they overlap).
  const double chunk = std::min(bytes / t.stripes, static_cast<double>(kSyncTreeChunkBytes));
  double first = 0;
  for (size_t s = 0; s < t.trees.size() && s < t.hops.size(); ++s) {
    const SyncTree& tree = t.trees[s];
    const std::vector<Tree::Hop>& hops = t.hops[s];
    first = std::max(first, sync_tree_round_trip(tree, [&](size_t a, size_t b) {
      if (tree.parent[a] == static_cast<int>(b)) return chunk * hops[a].up_s_per_byte + hops[a].up_latency_s;
      return chunk * hops[b].down_s_per_byte + hops[b].down_latency_s;  // B's parent is A
    }));
  }
  return std::max(0.0, first - chunk * t.stripes / t.slowest_bytes_per_s);
}

double CostContext::tree_allreduce_s(const Tree& t, double bytes) const {
  if (!(bytes > 0) || t.devices.size() < 2) return 0;
  return bytes / t.slowest_bytes_per_s + tree_latency_s(t, bytes);
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

double CostContext::posted_gather_s(const Ring& r, double per_member) const {
  if (r.n < 2) return 0;
  return r.max_latency_s + (r.n - 1) * per_member / r.slowest_bytes_per_s;
}

double CostContext::bucket_s(const SyncShape& s, double bytes, int64_t* collectives) const {
  if (s.tree) {  // the buckets pipeline: the tree's round trip once
    const double nb = std::max(1.0, std::ceil(bytes / bucket_bytes()));
    if (collectives) *collectives = static_cast<int64_t>(nb);
    return tree_allreduce_s(s.sum_tree, bytes);
  }
  if (!s.compressed) return allreduce_s(s.ring, bytes, bucket_bytes(), collectives);
  if (collectives) *collectives = 1;
  const double elems = bytes / dtype_bytes_, wire = wire_ratio() * bytes;
  const std::string& m = gs_.compression;
  auto exchange = [&](const Ring& r) {
    if (gathers(m)) {
      // Aligned fusion gathers into receives posted at the step's start (compress/comm.h);
      // without it the members first exchange their sizes: one more round of latency.
      const bool aligned = gs_.fusion == "saf-inter" || gs_.fusion == "saf-adaptive";
      if (aligned && m != "bf16") return posted_gather_s(r, wire);
      const bool sizes = m != "bf16";
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
    r.max_latency_s = std::max(r.max_latency_s, lat_[k]);
  }
  return r;
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
      // A tree's buckets pipeline (dist/tree_allreduce.h): each its bytes, the chain its latency once
      // (chain_latency_s).
      b.time_s = s.ring.n < 2 ? 0 : s.tree ? b.bytes / s.sum_tree.slowest_bytes_per_s : allreduce_s(s.ring, b.bytes, cap);
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
