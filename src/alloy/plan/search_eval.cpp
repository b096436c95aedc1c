// Timing tables and the Evaluator (the step time of a layout): what scores a candidate, but for
// the few hot functions defined inline in search_detail.h (with minmax_allocate). Declarations and
// their comments are in search_detail.h.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "alloy/plan/search_detail.h"

namespace alloy::plan::detail {

// ---------------------------------------------------------------------------------------------
// Timing tables

Tables::Tables(const CostContext& ctx, std::vector<std::string> schedules, std::vector<int64_t> cands, int64_t G)
    : ctx_(ctx), schedules_(std::move(schedules)), cands_(std::move(cands)), G_(G) {
  // Pipelines whose consecutive stages are joined by links of equal bandwidth and latency
  // time the same, so tables are keyed by link class, not by host: in a cluster of many
  // alike hosts most replicas then share a table.
  const int H = ctx.num_hosts();
  std::map<std::pair<double, double>, int> ids;
  link_class_.assign(static_cast<size_t>(H * H), 0);
  for (int a = 0; a < H; ++a)
    for (int b = 0; b < H; ++b) {
      auto key = std::make_pair(ctx.link_bytes_per_s(a, b), ctx.link_latency_s(a, b));
      link_class_[static_cast<size_t>(a * H + b)] = ids.emplace(key, static_cast<int>(ids.size())).first->second;
    }
}

ConfigTable* Tables::get(int sched, const int* dev, const int64_t* blocks, int S, const int* shares) {
  key_.clear();
  key_.push_back(sched);
  const int H = ctx_.num_hosts();
  for (int s = 0; s < S; ++s) {
    key_.push_back(ctx_.type_of(dev[s]));
    key_.push_back(blocks[s]);
    if (s + 1 < S) {
      key_.push_back(link_class_[static_cast<size_t>(ctx_.host_of(dev[s]) * H + ctx_.host_of(dev[s + 1]))]);
      key_.push_back(shares ? shares[s] : 1);
    }
  }
  auto it = configs_.find(key_);
  if (it != configs_.end()) return it->second.get();
  auto t = std::make_unique<ConfigTable>();
  t->sched = sched;
  t->S = S;
  for (int s = 0; s < S; ++s) {
    const bool first = s == 0, last = s + 1 == S;
    t->types.push_back(ctx_.type_of(dev[s]));
    t->hosts.push_back(ctx_.host_of(dev[s]));
    if (s + 1 < S) t->shares.push_back(shares ? shares[s] : 1);
    t->blocks.push_back(blocks[s]);
    t->act.push_back(ctx_.act_bytes_per_sample(blocks[s], first, last));
    t->param.push_back(ctx_.param_bytes(blocks[s], first, last));
    t->frozen.push_back(ctx_.frozen_bytes(blocks[s], first, last));
    t->opt.push_back(ctx_.optimizer_s(t->types.back(), t->param.back()));
  }
  t->at.assign(static_cast<size_t>(G_ + 1) * cands_.size(), nullptr);
  t->h.assign(static_cast<size_t>(G_ + 1), kInf);
  t->h_done.assign(static_cast<size_t>(G_ + 1), 0);
  t->cheap.assign(static_cast<size_t>(G_ + 1), kInf);
  t->cheap_done.assign(static_cast<size_t>(G_ + 1), 0);
  ConfigTable* raw = t.get();
  configs_.emplace(key_, std::move(t));
  return raw;
}

const PipeTiming& Tables::timing(ConfigTable& t, int64_t b, size_t ci) {
  const PipeTiming*& slot = t.at[static_cast<size_t>(b) * cands_.size() + ci];
  if (slot) return *slot;
  const int64_t m = cands_[ci], M = b / m;
  const std::vector<double>& x = costs(t, ci);
  const size_t S = static_cast<size_t>(t.S);
  sim_.forward.assign(x.begin(), x.begin() + static_cast<long>(S));
  sim_.backward.assign(x.begin() + static_cast<long>(S), x.begin() + static_cast<long>(2 * S));
  sim_.p2p_link.assign(x.begin() + static_cast<long>(2 * S), x.begin() + static_cast<long>(3 * S - 1));
  sim_.weight.assign(x.begin() + static_cast<long>(3 * S - 1), x.begin() + static_cast<long>(4 * S - 1));
  sim_.p2p_latency.assign(x.begin() + static_cast<long>(4 * S - 1), x.end());
  pipeline::StageTimes st = pipeline::simulate_times(schedules_[static_cast<size_t>(t.sched)], t.S, M, sim_);
  timings_.push_back({st.makespan, std::move(st.last_backward_start), std::move(st.peak_in_flight)});
  ++simulations_;
  slot = &timings_.back();
  return *slot;
}

const std::vector<double>& Tables::costs(ConfigTable& t, size_t ci) {
  if (t.fbp.empty()) t.fbp.resize(cands_.size());
  std::vector<double>& x = t.fbp[ci];
  if (!x.empty()) return x;
  const int64_t m = cands_[ci];
  const size_t S = static_cast<size_t>(t.S);
  // Forward, backward, links, weight passes (zb-h1 reads them; the others ignore them), the links' latencies.
  x.resize(5 * S - 2);
  for (size_t s = 0; s < S; ++s) {
    const bool first = s == 0, last = s + 1 == S;
    const double p2p_cpu = ctx_.p2p_cpu_s(t.types[s], first, last, m);
    x[s] = ctx_.forward_s(t.types[s], t.blocks[s], first, last, m) + p2p_cpu;
    x[S + s] = ctx_.backward_s(t.types[s], t.blocks[s], first, last, m) + p2p_cpu;
    if (!last) x[2 * S + s] = ctx_.p2p_s(t.hosts[s], t.hosts[s + 1], m, t.shares[s]);
    if (!last) x[4 * S - 1 + s] = ctx_.latency_s(t.hosts[s], t.hosts[s + 1]);
    x[3 * S - 1 + s] = ctx_.weight_s(t.types[s], t.blocks[s], m);
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// The evaluator (see the comment on the class in search_detail.h)

Evaluator::Evaluator(const CostContext& ctx, Tables& tables, double bucket_bytes) : ctx_(ctx), tables_(tables), bucket_bytes_(bucket_bytes) {
  const int N = ctx.num_devices();
  syncp_.assign(static_cast<size_t>(N), {});
  bucket_.assign(static_cast<size_t>(N), 0);
  encode_.assign(static_cast<size_t>(N), 0);
  stage_.assign(static_cast<size_t>(N), {});
}

double Evaluator::evaluate(Layout& L, Batch mode, bool stragglers) {
  ++evaluated;
  const size_t R = L.reps.size();
  fetch_tables(L);
  compute_sync(L, mode == Batch::Fixed);
  double maxopt = 0;
  for (size_t r = 0; r < R; ++r)
    for (double o : tabs_[r]->opt) maxopt = std::max(maxopt, o);
  const int64_t G = tables_.global_batch();
  double best;
  if (mode == Batch::Fixed || mode == Batch::FixedSamples) {
    best = 0;
    for (size_t r = 0; r < R; ++r) {
      Replica& rep = L.reps[r];
      int64_t m = mode == Batch::Fixed ? rep.mbs : 0;
      const double v = g(r, rep, rep.samples, &m);
      if (!(v < kInf)) return kInf;
      rep.mbs = m;
      best = std::max(best, v);
    }
  } else if (force_dp || static_cast<double>(R) * static_cast<double>(G) * static_cast<double>(G) <= 1e6) {
    // Exact: every replica's g for every b, then the min-max DP.
    gtab_.assign(R * static_cast<size_t>(G + 1), kInf);
    gptr_.resize(R);
    const int64_t hi = G - static_cast<int64_t>(R) + 1;
    for (size_t r = 0; r < R; ++r) {
      double* row = gtab_.data() + r * static_cast<size_t>(G + 1);
      for (int64_t b = 1; b <= hi; ++b) row[b] = g(r, L.reps[r], b, nullptr);
      gptr_[r] = row;
    }
    std::vector<int64_t> choice;
    best = minmax_allocate(gptr_, G, &choice);
    if (!(best < kInf)) return kInf;
    for (size_t r = 0; r < R; ++r) {
      int64_t m = 0;
      L.reps[r].samples = choice[r];
      g(r, L.reps[r], choice[r], &m);
      L.reps[r].mbs = m;
    }
  } else {
    best = greedy_allocate(L);
    if (!(best < kInf)) return kInf;
  }
  return ((best + (stragglers ? straggler_s(L, best) : 0.0)) + ctx_.world_sum_exposed_s(L.one_device_replicas())) + maxopt;
}

double Evaluator::straggler_s(Layout& L, double latest) {
  const size_t R = L.reps.size();
  if (R < 2) return 0;
  noise_.assign(R, 0);
  bool any = false;
  for (size_t r = 0; r < R; ++r) {
    for (int type : tabs_[r]->types) noise_[r] = std::max(noise_[r], ctx_.step_noise(type));
    any = any || noise_[r] > 0;
  }
  if (!any) return 0;
  // Once per search (for the plan it returns): each replica's term at its chosen split, from the
  // timing tables the search filled.
  std::vector<std::pair<double, double>> draws;
  for (size_t r = 0; r < R; ++r) {
    int64_t m = L.reps[r].mbs;
    const double done = g(r, L.reps[r], L.reps[r].samples, &m);
    draws.push_back({done, CostContext::done_sd(noise_[r], done)});
  }
  return std::max(0.0, expected_max(draws) - latest);
}

void Evaluator::prepare(Layout& L) {
  fetch_tables(L);
  compute_sync(L);
}

void Evaluator::fetch_tables(const Layout& L) {
  const size_t R = L.reps.size();
  link_hosts_.resize(R);
  for (size_t r = 0; r < R; ++r) {
    link_hosts_[r].clear();
    for (int d : L.reps[r].dev) link_hosts_[r].push_back(ctx_.host_of(d));
  }
  ctx_.pipeline_link_shares(link_hosts_, &link_shares_);
  tabs_.resize(R);
  for (size_t r = 0; r < R; ++r)
    tabs_[r] = tables_.get(L.sched, L.reps[r].dev.data(), L.reps[r].blocks.data(), static_cast<int>(L.reps[r].dev.size()),
                           link_shares_[r].data());
}

std::string Evaluator::overflow(Layout& L, double* total_over) {
  prepare(L);
  double worst = 0, total = 0;
  std::string why;
  for (size_t r = 0; r < L.reps.size(); ++r) {
    ConfigTable& t = *tabs_[r];
    const Replica& rep = L.reps[r];
    const int64_t m = rep.mbs > 0 ? rep.mbs : 1, b = rep.samples > 0 ? rep.samples : m;
    const PipeTiming& pt = tables_.timing(t, std::max(m, b - b % m), static_cast<size_t>(std::find(tables_.cands().begin(), tables_.cands().end(), m) -
                                                                             tables_.cands().begin()));
    for (int s = 0; s < t.S; ++s) {
      const int d = rep.dev[static_cast<size_t>(s)];
      const double cap = ctx_.capacity_bytes(d);
      const double need = need_bytes(t, s, d, pt, m, std::max(m, b - b % m) / m);
      if (cap > 0 && need > cap) {
        total += need - cap;
        if (need - cap > worst) {
          worst = need - cap;
          why = "device '" + ctx_.cluster().devices[static_cast<size_t>(d)].name + "' (rank " + std::to_string(d) + ") would need " +
                (ctx_.memory_relief() ? "at least (sharded and recomputing) " : "") + gb(need) + " (" +
                std::to_string(static_cast<int64_t>(need)) + " bytes) for " + std::to_string(t.blocks[static_cast<size_t>(s)]) +
                " block(s)" + (s == 0 ? " + embedding" : "") + (s + 1 == t.S ? " + head" : "") + " but has " + gb(cap) + ": over by " +
                gb(need - cap);
        }
      }
    }
  }
  if (total_over) *total_over = total;
  return why;
}

void Evaluator::compute_sync(const Layout& L, bool fixed_mbs) {
  const int N = ctx_.num_devices();
  for (const auto& rep : L.reps) {
    int64_t begin = 0;
    for (size_t s = 0; s < rep.dev.size(); ++s) {
      const size_t d = static_cast<size_t>(rep.dev[s]);
      syncp_[d].clear(), bucket_[d] = 0, encode_[d] = 0;
      stage_[d] = {rep.dev[s], 2 * begin, 2 * (begin + rep.blocks[s]), s == 0, s + 1 == rep.dev.size()};
      begin += rep.blocks[s];
    }
  }
  sets_.clear();
  if (N <= 64) {
    collect_sets_masks(L);
  } else {
    holders_.assign(L.reps.size(), {});
    for (size_t r = 0; r < L.reps.size(); ++r)
      for (int d : L.reps[r].dev) holders_[r].push_back(stage_[static_cast<size_t>(d)]);
    for (auto& set : ctx_.sync_sets(holders_)) sets_.push_back({set.ids, set.units, set.bytes});
  }
  // Every set's load on the links first (they share them), then each set on its share.
  for (auto& st : sets_) std::sort(st.devs.begin(), st.devs.end(), [&](int a, int b) { return ctx_.ring_less(a, a, b, b); });
  loads_ = ctx_.empty_loads();
  for (const auto& st : sets_) ctx_.add_load(st.devs, st.bytes, &loads_);
  for (size_t r = 0; r < L.reps.size(); ++r) {
    const int64_t m = fixed_mbs && L.reps[r].mbs > 0 ? L.reps[r].mbs : tables_.cands().front();
    ctx_.add_pipeline_tail_load(link_hosts_[r], m, &loads_);
  }
  for (const auto& st : sets_) add_set(ctx_.sync_shape(st.devs, &loads_, st.bytes), st.devs.data(), st.devs.size(), st.units, st.bytes);
  // Flat compressed sets encode on the autograd thread: each member's backward ends that later;
  // and no member's sync ends before its backward plus the sync's CPU time (sync_cpu_s).
  for (const auto& rep : L.reps)
    for (int d : rep.dev) {
      const auto du = static_cast<size_t>(d);
      if (encode_[du] > 0) {
        const CostContext::Holder& h = stage_[du];
        syncp_[du].emplace_back(encode_[du], ctx_.backward_end(ctx_.type_of(d), h.begin, h.end, h.first, h.last));
      }
    }
}

void Evaluator::add_set(const CostContext::SyncShape& shape, const int* members, size_t n,
                        const std::vector<std::pair<int, double>>& units, double bytes) {
  ctx_.buckets(shape, units, bucket_bytes_, &bks_);
  tail_.assign(bks_.size() + 1, ctx_.chain_latency_s(shape, bytes));  // a tree's round trip, once a chain
  for (size_t k = bks_.size(); k-- > 0;) tail_[k] = tail_[k + 1] + bks_[k].time_s;
  const double buffers = ctx_.sync_buffer_bytes(shape, bytes);
  const double enc = shape.compressed && !shape.hierarchical ? ctx_.encode_s(shape, bytes) : 0.0;
  for (size_t i = 0; i < n; ++i) {
    const size_t x = static_cast<size_t>(members[i]);
    const CostContext::Holder& h = stage_[x];
    for (size_t k = 0; k < bks_.size(); ++k) {
      const MicroBatchCost off = ctx_.unit_ready(ctx_.type_of(members[i]), h.begin, h.end, h.first, h.last, bks_[k].last_unit);
      syncp_[x].emplace_back(tail_[k], off);
    }
    bucket_[x] += buffers;
    encode_[x] += enc + ctx_.sync_cpu_s(ctx_.type_of(members[i]), shape, bytes, n, members[i]);
  }
}

void Evaluator::collect_sets_masks(const Layout& L) {
  const int Lb = static_cast<int>(ctx_.layers());
  nsets_ = 0;
  auto add = [&](uint64_t mask, int u) {
    const double bytes = ctx_.unit_bytes(u);
    if (!(bytes > 0) || __builtin_popcountll(mask) < 2) return;
    for (size_t i = 0; i < nsets_; ++i)
      if (masks_[i] == mask) {
        bytes_[i] += bytes;
        units_[i].emplace_back(u, bytes);
        return;
      }
    if (masks_.size() <= nsets_) masks_.resize(nsets_ + 1), bytes_.resize(nsets_ + 1), units_.resize(nsets_ + 1);
    masks_[nsets_] = mask;
    bytes_[nsets_] = bytes;
    units_[nsets_].assign(1, {u, bytes});
    ++nsets_;
  };
  uint64_t first = 0, last = 0;
  for (const auto& rep : L.reps) {
    first |= 1ULL << rep.dev.front();
    last |= 1ULL << rep.dev.back();
  }
  add(last, 0);
  at_.assign(L.reps.size(), 0);
  left_.assign(L.reps.size(), 0);
  for (size_t r = 0; r < L.reps.size(); ++r) {
    at_[r] = L.reps[r].dev.size() - 1;
    left_[r] = L.reps[r].blocks.back();
  }
  for (int l = Lb - 1; l >= 0; --l) {
    uint64_t mask = 0;
    for (size_t r = 0; r < L.reps.size(); ++r) {
      const auto& rep = L.reps[r];
      while (left_[r] == 0) left_[r] = rep.blocks[--at_[r]];
      mask |= 1ULL << rep.dev[at_[r]];
      --left_[r];
    }
    add(mask, ctx_.half_unit(2 * l + 1));  // the block's MLP half, then its attention half
    add(mask, ctx_.half_unit(2 * l));
  }
  add(first, ctx_.embed_unit());
  add(first | last, ctx_.wte_unit());
  for (size_t i = 0; i < nsets_; ++i) {
    SetInfo st;
    for (uint64_t m = masks_[i]; m; m &= m - 1) st.devs.push_back(__builtin_ctzll(m));
    st.units = units_[i];
    st.bytes = bytes_[i];
    sets_.push_back(std::move(st));
  }
}

double Evaluator::greedy_allocate(Layout& L) {
  const size_t R = L.reps.size();
  const int64_t G = tables_.global_batch();
  if (G < static_cast<int64_t>(R)) return kInf;
  const int64_t max_step = tables_.cands().back();
  auto gv = [&](size_t r, int64_t b) { return b >= 1 && b <= G ? g(r, L.reps[r], b, nullptr) : kInf; };
  std::vector<int64_t> b(R, 0);
  std::vector<double> val(R, kInf), rate(R, 0);
  const int64_t even = std::max<int64_t>(1, G / static_cast<int64_t>(R));
  double rate_sum = 0;
  for (size_t r = 0; r < R; ++r) {
    for (int64_t bb = even; bb >= 1; bb /= 2) {
      const double v = gv(r, bb);
      if (v < kInf) {
        rate[r] = static_cast<double>(bb) / std::max(v, 1e-300);
        break;
      }
    }
    rate_sum += rate[r];
  }
  int64_t used = 0;
  for (size_t r = 0; r < R; ++r) {
    int64_t start = rate_sum > 0 ? static_cast<int64_t>(std::floor(0.97 * static_cast<double>(G) * rate[r] / rate_sum)) : 1;
    start = std::max<int64_t>(1, start);
    while (start >= 1 && !(gv(r, start) < kInf)) --start;
    if (start == 0)  // the smallest feasible share, if any
      for (int64_t bb = 1; bb <= max_step && !start; ++bb)
        if (gv(r, bb) < kInf) start = bb;
    if (start == 0) return kInf;
    b[r] = start;
    val[r] = gv(r, start);
    used += start;
  }
  while (used > G) {  // rare: the floors overshoot when many replicas are at their minimum
    size_t worst = R;
    for (size_t r = 0; r < R; ++r)
      if (b[r] > 1 && (worst == R || val[r] > val[worst])) worst = r;
    if (worst == R) return kInf;
    int64_t nb = b[worst] - 1;
    while (nb >= 1 && !(gv(worst, nb) < kInf)) --nb;
    if (nb < 1) return kInf;
    used -= b[worst] - nb;
    b[worst] = nb;
    val[worst] = gv(worst, nb);
  }
  using Item = std::pair<double, std::pair<size_t, int64_t>>;  // (g at b', (replica, b'))
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pq;
  auto push_next = [&](size_t r, int64_t left) {
    for (int64_t nb = b[r] + 1; nb <= b[r] + std::min(max_step, left); ++nb) {
      const double v = gv(r, nb);
      if (v < kInf) {  // the nearest feasible size: larger jumps are the refinement's job
        pq.push({v, {r, nb}});
        return;
      }
    }
  };
  for (size_t r = 0; r < R; ++r) push_next(r, G - used);
  while (used < G) {
    if (pq.empty()) return kInf;
    const Item it = pq.top();
    pq.pop();
    const size_t r = it.second.first;
    const int64_t nb = it.second.second;
    if (nb - b[r] > G - used) {  // too big a step now
      push_next(r, G - used);
      continue;
    }
    used += nb - b[r];
    b[r] = nb;
    val[r] = it.first;
    push_next(r, G - used);
  }
  // Refinement. up[k][r] caches g_r(b_r + k); only the two replicas a move touches change.
  std::vector<int64_t> ks{1};
  for (int64_t m : tables_.cands())
    if (m > 1) ks.push_back(m);
  std::vector<std::vector<double>> up(ks.size(), std::vector<double>(R));
  auto refresh = [&](size_t r) {
    for (size_t ki = 0; ki < ks.size(); ++ki) up[ki][r] = gv(r, b[r] + ks[ki]);
  };
  for (size_t r = 0; r < R; ++r) refresh(r);
  for (int iter = 0; iter < 256; ++iter) {
    size_t worst = 0;
    for (size_t r = 1; r < R; ++r)
      if (val[r] > val[worst]) worst = r;
    const double cur = val[worst];
    double best_new = cur, best_vw = 0, best_vr = 0;
    size_t best_r = R;
    int64_t best_k = 0;
    for (size_t ki = 0; ki < ks.size(); ++ki) {
      const int64_t k = ks[ki];
      if (k >= b[worst]) continue;
      const double vw = gv(worst, b[worst] - k);
      if (!(vw < cur)) continue;
      for (size_t r = 0; r < R; ++r) {
        if (r == worst) continue;
        const double nm = std::max(vw, up[ki][r]);
        if (nm < best_new) best_new = nm, best_r = r, best_k = k, best_vw = vw, best_vr = up[ki][r];
      }
    }
    if (best_r == R) break;
    b[worst] -= best_k;
    b[best_r] += best_k;
    val[worst] = best_vw;
    val[best_r] = best_vr;
    refresh(worst);
    refresh(best_r);
  }
  double best = 0;
  for (size_t r = 0; r < R; ++r) {
    int64_t m = 0;
    val[r] = g(r, L.reps[r], b[r], &m);
    L.reps[r].samples = b[r];
    L.reps[r].mbs = m;
    best = std::max(best, val[r]);
  }
  return best;
}

}  // namespace alloy::plan::detail
