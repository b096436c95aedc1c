// The planner. How it stays exact where it can and fast where it cannot:
//  - Every candidate is scored by the Evaluator with the cost model's own decomposition
//    (cost_model.h): step = max over replicas of max(makespan, max_s(last backward start_s +
//    longest sync of that rank)) + world all-reduce + slowest optimizer. Only the max over
//    replicas depends on the batch split, and each replica's term depends only on its own
//    samples and micro-batch size once the layout (which fixes the holder sets) is chosen, so the
//    best batch split of a layout is a min-max allocation: exact by DP when small, greedy beyond.
//  - Pipeline timings are simulated once per (types, split, link classes, schedule, m, M) and
//    shared by every replica and candidate with the same key.
//  - Exact mode enumerates the search space of search.h with devices of one class (type, host,
//    memory) taken as interchangeable, which the cost model cannot tell apart, and prunes with
//    lower bounds that need no simulation first and simulated makespans second.
//  - Heuristic mode builds layouts from groupings that follow where the costs are: sync rings
//    want holders of a layer inside a host or region (stage-major), pipelines want fast links
//    between consecutive stages (local), a tied embedding wants first and last stages close
//    (folded), and compute wants work in proportion to speed (balanced splits, proportional
//    batches). Local search then moves layer boundaries while the time budget lasts.
#include "alloy/plan/search.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <queue>
#include <set>
#include <sstream>
#include <unordered_map>

#include "alloy/core/error.h"
#include "alloy/pipeline/schedule.h"

namespace alloy::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fmt(double v, int precision = 4) {
  std::ostringstream o;
  o.precision(precision);
  o << v;
  return o.str();
}

std::string gb(double bytes) { return fmt(bytes / 1e9) + " GB"; }

// ---------------------------------------------------------------------------------------------
// Layouts: a point of the search space in index form.

struct Replica {
  std::vector<int> dev;         // devices in stage order
  std::vector<int64_t> blocks;  // blocks per stage
  int64_t samples = 0, mbs = 0;
};

struct Layout {
  int sched = 0;  // index into SearchOptions::schedules
  std::vector<Replica> reps;
};

// ---------------------------------------------------------------------------------------------
// Timing tables: one replica configuration (device types and hosts in stage order, split) under
// one schedule, for every (samples, micro-batch size) asked for, computed once.

struct PipeTiming {
  double makespan = 0;
  std::vector<double> lbs;     // per stage: start of the last backward
  std::vector<int64_t> peak;   // per stage: micro-batches in flight at most
};

struct ConfigTable {
  int sched = 0;
  int S = 0;
  std::vector<int> types, hosts;
  std::vector<int64_t> blocks;
  std::vector<double> act, param, opt;  // per stage: activation bytes per sample, parameter bytes, optimizer seconds
  std::vector<const PipeTiming*> at;    // (b * nc + candidate); null until asked
  std::vector<double> h;                // h[b]: best makespan over candidates (no memory), filled on demand
  std::vector<char> h_done;
  std::vector<double> cheap;            // cheap[b]: a lower bound of h[b] without simulating
  std::vector<char> cheap_done;
  std::vector<std::vector<double>> fbp;  // per candidate: forward[S], backward[S], p2p[S-1] per micro-batch
};

class Tables {
 public:
  Tables(const CostContext& ctx, std::vector<std::string> schedules, std::vector<int64_t> cands, int64_t G)
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

  const std::vector<int64_t>& cands() const { return cands_; }
  int64_t global_batch() const { return G_; }
  const CostContext& ctx() const { return ctx_; }

  // The table of devices DEV (stage order) with split BLOCKS under schedule SCHED.
  ConfigTable* get(int sched, const int* dev, const int64_t* blocks, int S) {
    key_.clear();
    key_.push_back(sched);
    const int H = ctx_.num_hosts();
    for (int s = 0; s < S; ++s) {
      key_.push_back(ctx_.type_of(dev[s]));
      key_.push_back(blocks[s]);
      if (s + 1 < S) key_.push_back(link_class_[static_cast<size_t>(ctx_.host_of(dev[s]) * H + ctx_.host_of(dev[s + 1]))]);
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
      t->blocks.push_back(blocks[s]);
      t->act.push_back(ctx_.act_bytes_per_sample(blocks[s], first, last));
      t->param.push_back(ctx_.param_bytes(blocks[s], first, last));
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

  // Timing of B samples in micro-batches of cands[ci] (which must divide B).
  const PipeTiming& timing(ConfigTable& t, int64_t b, size_t ci) {
    const PipeTiming*& slot = t.at[static_cast<size_t>(b) * cands_.size() + ci];
    if (slot) return *slot;
    const int64_t m = cands_[ci], M = b / m;
    const std::vector<double>& x = costs(t, ci);
    const size_t S = static_cast<size_t>(t.S);
    sim_.forward.assign(x.begin(), x.begin() + static_cast<long>(S));
    sim_.backward.assign(x.begin() + static_cast<long>(S), x.begin() + static_cast<long>(2 * S));
    sim_.p2p_link.assign(x.begin() + static_cast<long>(2 * S), x.end());
    pipeline::StageTimes st = pipeline::simulate_times(schedules_[static_cast<size_t>(t.sched)], t.S, M, sim_);
    timings_.push_back({st.makespan, std::move(st.last_backward_start), std::move(st.peak_in_flight)});
    ++simulations_;
    slot = &timings_.back();
    return *slot;
  }

  // Per micro-batch costs of a configuration at candidate CI: forward[S], backward[S], p2p[S-1].
  const std::vector<double>& costs(ConfigTable& t, size_t ci) {
    if (t.fbp.empty()) t.fbp.resize(cands_.size());
    std::vector<double>& x = t.fbp[ci];
    if (!x.empty()) return x;
    const int64_t m = cands_[ci];
    const size_t S = static_cast<size_t>(t.S);
    x.resize(3 * S - 1);
    for (size_t s = 0; s < S; ++s) {
      const bool first = s == 0, last = s + 1 == S;
      x[s] = ctx_.forward_s(t.types[s], t.blocks[s], first, last, m);
      x[S + s] = ctx_.backward_s(t.types[s], t.blocks[s], first, last, m);
      if (!last) x[2 * S + s] = ctx_.p2p_s(t.hosts[s], t.hosts[s + 1], m);
    }
    return x;
  }

  // A lower bound of h without simulating: stage s cannot start before the first micro-batch
  // has crossed the stages before it, then does all its M forwards and backwards, and its last
  // gradient must still cross back: max_s sum_{s'<s}(f + p + b + p) + M (f_s + b_s). Scaled
  // down by 1e-12 so rounding in either computation never lifts it above the simulated value.
  double cheap_h(ConfigTable& t, int64_t b) {
    if (t.cheap_done[static_cast<size_t>(b)]) return t.cheap[static_cast<size_t>(b)];
    double best = kInf;
    const size_t S = static_cast<size_t>(t.S);
    for (size_t ci = 0; ci < cands_.size(); ++ci) {
      if (b % cands_[ci] != 0) continue;
      const std::vector<double>& x = costs(t, ci);
      const double M = static_cast<double>(b / cands_[ci]);
      double pre = 0, v = 0;
      for (size_t s = 0; s < S; ++s) {
        v = std::max(v, pre + M * (x[s] + x[S + s]));
        if (s + 1 < S) pre += x[s] + x[S + s] + 2 * x[2 * S + s];
      }
      best = std::min(best, v);
    }
    t.cheap_done[static_cast<size_t>(b)] = 1;
    t.cheap[static_cast<size_t>(b)] = best * (1 - 1e-12);
    return t.cheap[static_cast<size_t>(b)];
  }

  // Lower bound of the replica's phase for B samples: best makespan over the candidate sizes.
  double h(ConfigTable& t, int64_t b) {
    if (t.h_done[static_cast<size_t>(b)]) return t.h[static_cast<size_t>(b)];
    double best = kInf;
    for (size_t ci = 0; ci < cands_.size(); ++ci)
      if (b % cands_[ci] == 0) best = std::min(best, timing(t, b, ci).makespan);
    t.h_done[static_cast<size_t>(b)] = 1;
    t.h[static_cast<size_t>(b)] = best;
    return best;
  }

  int64_t simulations() const { return simulations_; }

 private:
  const CostContext& ctx_;
  std::vector<std::string> schedules_;
  std::vector<int64_t> cands_;
  int64_t G_;
  std::map<std::vector<int64_t>, std::unique_ptr<ConfigTable>> configs_;
  std::deque<PipeTiming> timings_;
  std::vector<int64_t> key_;
  std::vector<int> link_class_;  // host x host
  pipeline::SimCosts sim_;
  int64_t simulations_ = 0;
};

// Min-max allocation of G samples over replicas: minimise max_r g_r(b_r) with b_r >= 1 and
// sum b_r = G, by DP over replicas (exact). g[r][b] for b in [0, G]; entries may be +inf.
// Returns the optimum (inf when infeasible) and, if CHOICE is given, the b_r.
double minmax_allocate(const std::vector<const double*>& g, int64_t G, std::vector<int64_t>* choice) {
  const size_t R = g.size();
  if (R == 0 || G < static_cast<int64_t>(R)) return kInf;
  const size_t W = static_cast<size_t>(G + 1);
  thread_local std::vector<double> cur, nxt;
  thread_local std::vector<int32_t> arg;
  cur.assign(W, kInf);
  if (choice) arg.assign(R * W, 0);
  // cur[t]: best max over the replicas so far taking t samples in all.
  const int64_t hi0 = G - static_cast<int64_t>(R - 1);
  for (int64_t t = 1; t <= hi0; ++t) {
    cur[static_cast<size_t>(t)] = g[0][t];
    if (choice) arg[static_cast<size_t>(t)] = static_cast<int32_t>(t);
  }
  for (size_t r = 1; r < R; ++r) {
    nxt.assign(W, kInf);
    const int64_t lo = static_cast<int64_t>(r + 1), hi = G - static_cast<int64_t>(R - 1 - r);
    for (int64_t t = lo; t <= hi; ++t) {
      double best = kInf;
      int32_t bb = 0;
      for (int64_t b = 1; b <= t - static_cast<int64_t>(r); ++b) {
        const double v = std::max(cur[static_cast<size_t>(t - b)], g[r][b]);
        if (v < best) best = v, bb = static_cast<int32_t>(b);
      }
      nxt[static_cast<size_t>(t)] = best;
      if (choice) arg[r * W + static_cast<size_t>(t)] = bb;
    }
    std::swap(cur, nxt);
  }
  const double v = cur[static_cast<size_t>(G)];
  if (choice && v < kInf) {
    choice->assign(R, 0);
    int64_t t = G;
    for (size_t r = R; r-- > 0;) {
      const int64_t b = arg[r * W + static_cast<size_t>(t)];
      (*choice)[r] = b;
      t -= b;
    }
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// The evaluator: step time of a layout, the same numbers simulate_plan computes (the decomposition
// is in cost_model.h: step = max over replicas of max(makespan, max_s(lbs_s + sync_s(m))) +
// world all-reduce + slowest optimizer), with the batch split optimised or given. A set's
// buckets run back to back from ready times max_r(lbs_r + off_r,b(m)), so its last one ends at
// max over buckets b and holders r of lbs_r + off_r,b(m) + (time of buckets b..end): the end
// decomposes per rank into lbs + sync_s(m), sync_s(m) = max over its (set, bucket) pairs of
// (off.fixed + tail) + off.per_sample * m, which depends on nothing but the replica's own m.

enum class Batch { Fixed, FixedSamples, Optimize };

class Evaluator {
 public:
  Evaluator(const CostContext& ctx, Tables& tables, double bucket_bytes) : ctx_(ctx), tables_(tables), bucket_bytes_(bucket_bytes) {
    const int N = ctx.num_devices();
    syncp_.assign(static_cast<size_t>(N), {});
    bucket_.assign(static_cast<size_t>(N), 0);
    encode_.assign(static_cast<size_t>(N), 0);
    stage_.assign(static_cast<size_t>(N), {});
  }

  int64_t evaluated = 0;
  bool force_dp = false;  // the exact search needs the exact batch split at any size

  // Step time of L (inf when nothing fits); with Optimize/FixedSamples it writes the chosen
  // samples and micro-batch sizes into L.
  double evaluate(Layout& L, Batch mode) {
    ++evaluated;
    const size_t R = L.reps.size();
    tabs_.resize(R);
    for (size_t r = 0; r < R; ++r)
      tabs_[r] = tables_.get(L.sched, L.reps[r].dev.data(), L.reps[r].blocks.data(), static_cast<int>(L.reps[r].dev.size()));
    compute_sync(L);
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
    return (best + ctx_.world_allreduce_s()) + maxopt;
  }

  // For the exact search: sync and memory of L's replicas without the batch split.
  void prepare(Layout& L) {
    const size_t R = L.reps.size();
    tabs_.resize(R);
    for (size_t r = 0; r < R; ++r)
      tabs_[r] = tables_.get(L.sched, L.reps[r].dev.data(), L.reps[r].blocks.data(), static_cast<int>(L.reps[r].dev.size()));
    compute_sync(L);
  }
  ConfigTable* table(size_t r) { return tabs_[r]; }
  // Replica R's phase including exposed sync for B samples, best over candidate sizes that fit
  // memory (inf if none); *M in: required size (0 = any), out: the chosen size.
  double g(size_t r, const Replica& rep, int64_t b, int64_t* m_io) {
    ConfigTable& t = *tabs_[r];
    const auto& cands = tables_.cands();
    double best = kInf;
    int64_t best_m = 0;
    const int64_t want = m_io ? *m_io : 0;
    for (size_t ci = 0; ci < cands.size(); ++ci) {
      const int64_t m = cands[ci];
      if (b % m != 0 || (want && m != want)) continue;
      const PipeTiming& pt = tables_.timing(t, b, ci);
      double v = pt.makespan;
      bool fits = true;
      for (int s = 0; s < t.S && fits; ++s) {
        const int d = rep.dev[static_cast<size_t>(s)];
        const double cap = ctx_.capacity_bytes(d);
        if (cap > 0 && !(ctx_.memory_bytes(t.param[static_cast<size_t>(s)], bucket_[static_cast<size_t>(d)], pt.peak[static_cast<size_t>(s)], m,
                                           t.act[static_cast<size_t>(s)]) <= cap))
          fits = false;
        v = std::max(v, pt.lbs[static_cast<size_t>(s)] + sync_at(d, m));
      }
      if (fits && v < best) best = v, best_m = m;
    }
    if (m_io) *m_io = best_m;
    return best;
  }

  // Memory overflow of a layout at its batch split: bytes over capacity summed over ranks and a
  // sentence on the worst rank; for error messages.
  std::string overflow(Layout& L, double* total_over) {
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
        const double need = ctx_.memory_bytes(t.param[static_cast<size_t>(s)], bucket_[static_cast<size_t>(d)], pt.peak[static_cast<size_t>(s)], m,
                                              t.act[static_cast<size_t>(s)]);
        if (cap > 0 && need > cap) {
          total += need - cap;
          if (need - cap > worst) {
            worst = need - cap;
            why = "device '" + ctx_.cluster().devices[static_cast<size_t>(d)].name + "' would need " + gb(need) + " (" +
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

 private:
  // Exposed-sync term of device D at micro-batch size M (see the class comment).
  double sync_at(int d, int64_t m) const {
    double v = 0;
    for (const auto& [tail, off] : syncp_[static_cast<size_t>(d)]) v = std::max(v, tail + off.at(static_cast<double>(m)));
    return v;
  }

  void compute_sync(const Layout& L) {
    const int N = ctx_.num_devices();
    for (const auto& rep : L.reps) {
      int64_t begin = 0;
      for (size_t s = 0; s < rep.dev.size(); ++s) {
        const size_t d = static_cast<size_t>(rep.dev[s]);
        syncp_[d].clear(), bucket_[d] = 0, encode_[d] = 0;
        stage_[d] = {rep.dev[s], begin, begin + rep.blocks[s], s == 0, s + 1 == rep.dev.size()};
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
    for (const auto& st : sets_) add_set(ctx_.sync_shape(st.devs, &loads_, st.bytes), st.devs.data(), st.devs.size(), st.units, st.bytes);
    // Flat compressed sets encode on the autograd thread: each member's backward ends that later.
    for (const auto& rep : L.reps)
      for (int d : rep.dev) {
        const auto du = static_cast<size_t>(d);
        if (encode_[du] > 0) {
          const CostContext::Holder& h = stage_[du];
          syncp_[du].emplace_back(encode_[du], ctx_.backward_end(ctx_.type_of(d), h.begin, h.end, h.first, h.last));
        }
      }
  }

  // Buckets of one set and their tails; every member gets its (set, bucket) pairs.
  void add_set(const CostContext::SyncShape& shape, const int* members, size_t n, const std::vector<std::pair<int, double>>& units,
               double bytes) {
    ctx_.buckets(shape, units, bucket_bytes_, &bks_);
    tail_.assign(bks_.size() + 1, 0);
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
      encode_[x] += enc;
    }
  }

  // Same sets, same unit order and sums as CostContext::sync_sets, with device bit masks.
  void collect_sets_masks(const Layout& L) {
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
      add(mask, ctx_.block_unit(l));
    }
    add(first, Lb + 1);
    add(first | last, Lb + 2);
    for (size_t i = 0; i < nsets_; ++i) {
      SetInfo st;
      for (uint64_t m = masks_[i]; m; m &= m - 1) st.devs.push_back(__builtin_ctzll(m));
      st.units = units_[i];
      st.bytes = bytes_[i];
      sets_.push_back(std::move(st));
    }
  }

  // Large batches over many replicas (the DP would take R * G^2): start from shares proportional
  // to each replica's measured throughput (samples per second of phase at an even share), add the
  // remaining samples one feasible step at a time to the replica whose phase grows least (a
  // min-heap), then move k samples (k = 1 or a candidate size) off the slowest replica while that
  // lowers the maximum. Not exact when g is not monotone in b (micro-batch sizes must divide b),
  // which is why small instances use the DP.
  double greedy_allocate(Layout& L) {
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

  const CostContext& ctx_;
  Tables& tables_;
  double bucket_bytes_;
  std::vector<ConfigTable*> tabs_;
  std::vector<std::vector<std::pair<double, MicroBatchCost>>> syncp_;  // per device: (tail, ready offset) of each (set, bucket)
  std::vector<double> bucket_, encode_;
  struct SetInfo {
    std::vector<int> devs;  // ring order once sorted
    std::vector<std::pair<int, double>> units;
    double bytes = 0;
  };
  std::vector<SetInfo> sets_;
  CostContext::LinkLoads loads_;
  std::vector<CostContext::Holder> stage_;  // per device of the layout: its stage (id = device)
  std::vector<std::vector<CostContext::Holder>> holders_;
  std::vector<uint64_t> masks_;
  std::vector<double> bytes_;
  std::vector<std::vector<std::pair<int, double>>> units_;
  std::vector<CostContext::Bucket> bks_;
  std::vector<double> tail_;
  size_t nsets_ = 0;
  std::vector<size_t> at_;
  std::vector<int64_t> left_;
  std::vector<double> gtab_;
  std::vector<const double*> gptr_;
};

// ---------------------------------------------------------------------------------------------
// Problem: the inputs resolved once.

struct Problem {
  const ClusterSpec& cluster;
  const Profile& profile;
  const SearchOptions& opt;
  CostContext ctx;
  std::vector<int64_t> cands;
  int64_t G;
  int N;
  int64_t L;
  Tables tables;
  Evaluator ev;
  std::vector<double> speed;  // per type: samples per second through the whole model
  std::vector<std::string> notes;

  Problem(const ClusterSpec& c, const Profile& p, const SearchOptions& o)
      : cluster(c),
        profile(p),
        opt(o),
        ctx(c, p),
        cands(o.candidate_micro_batches()),
        G(o.global_batch),
        N(ctx.num_devices()),
        L(ctx.layers()),
        tables(ctx, o.schedules, cands, o.global_batch),
        ev(ctx, tables, o.grad_sync.bucket_mb * 1024 * 1024) {
    ctx.set_grad_sync(o.grad_sync);
    const int64_t mref = cands[cands.size() / 2];
    for (int t = 0; t < ctx.num_types(); ++t) speed.push_back(1.0 / ctx.full_model_s_per_sample(t, mref));
  }
  double dev_speed(int d) const { return speed[static_cast<size_t>(ctx.type_of(d))]; }
};

Plan to_plan(const Problem& P, const Layout& l) {
  Plan plan;
  plan.global_batch = P.G;
  plan.schedule = P.opt.schedules[static_cast<size_t>(l.sched)];
  plan.grad_sync = P.opt.grad_sync;
  std::vector<const Replica*> reps;
  for (const auto& r : l.reps) reps.push_back(&r);
  // Pipelines in order of their first device, so equal layouts print the same.
  std::sort(reps.begin(), reps.end(), [](const Replica* a, const Replica* b) { return a->dev.front() < b->dev.front(); });
  for (const Replica* r : reps) {
    PipelinePlan pl;
    pl.micro_batch_size = r->mbs;
    pl.num_micro_batches = r->samples / r->mbs;
    int64_t begin = 0;
    for (size_t s = 0; s < r->dev.size(); ++s) {
      const int d = r->dev[s];
      pl.stages.push_back({{d}, begin, begin + r->blocks[s], P.cluster.devices[static_cast<size_t>(d)].name});
      begin += r->blocks[s];
    }
    plan.pipelines.push_back(pl);
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Splits and shares

std::vector<int64_t> equal_split(int64_t total, int64_t parts) {
  std::vector<int64_t> v(static_cast<size_t>(parts), total / parts);
  for (int64_t i = 0; i < total % parts; ++i) ++v[static_cast<size_t>(i)];
  return v;
}

// TOTAL into parts proportional to WEIGHTS, each >= 1 (largest remainder on what is left).
std::vector<int64_t> proportional_split(int64_t total, const std::vector<double>& weights) {
  const size_t n = weights.size();
  std::vector<int64_t> v(n, 1);
  const int64_t rest = total - static_cast<int64_t>(n);
  if (rest <= 0) return v;
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<std::pair<double, size_t>> frac;
  int64_t given = 0;
  for (size_t i = 0; i < n; ++i) {
    const double exact = sum > 0 ? rest * weights[i] / sum : static_cast<double>(rest) / static_cast<double>(n);
    const int64_t fl = static_cast<int64_t>(std::floor(exact));
    v[i] += fl;
    given += fl;
    frac.push_back({-(exact - static_cast<double>(fl)), i});
  }
  std::sort(frac.begin(), frac.end());
  for (int64_t k = 0; k < rest - given; ++k) ++v[frac[static_cast<size_t>(k) % n].second];
  return v;
}

// Contiguous split of the blocks minimising the slowest stage's compute per sample (forward +
// backward at micro-batch M, embedding on the first stage, head on the last): the classic
// min-max linear partition, by DP over (stages, blocks), O(S L^2). Per-stage costs are given by
// type so a "stage" may also stand for a group of devices (harmonic speeds).
std::vector<int64_t> balanced_split(int64_t L, const std::vector<double>& block, const std::vector<double>& embed,
                                    const std::vector<double>& head) {
  const size_t S = block.size();
  if (static_cast<int64_t>(S) > L) return {};
  auto cost = [&](size_t s, int64_t n) {
    return static_cast<double>(n) * block[s] + (s == 0 ? embed[s] : 0.0) + (s + 1 == S ? head[s] : 0.0);
  };
  const size_t W = static_cast<size_t>(L + 1);
  std::vector<double> dp(S * W, kInf);
  std::vector<int64_t> arg(S * W, 0);
  for (int64_t n = 1; n <= L; ++n) dp[static_cast<size_t>(n)] = cost(0, n), arg[static_cast<size_t>(n)] = n;
  for (size_t s = 1; s < S; ++s)
    for (int64_t t = static_cast<int64_t>(s + 1); t <= L; ++t)
      for (int64_t n = 1; n <= t - static_cast<int64_t>(s); ++n) {
        const double v = std::max(dp[(s - 1) * W + static_cast<size_t>(t - n)], cost(s, n));
        if (v < dp[s * W + static_cast<size_t>(t)]) dp[s * W + static_cast<size_t>(t)] = v, arg[s * W + static_cast<size_t>(t)] = n;
      }
  std::vector<int64_t> out(S);
  int64_t t = L;
  for (size_t s = S; s-- > 0;) {
    out[s] = arg[s * W + static_cast<size_t>(t)];
    t -= out[s];
  }
  return out;
}

struct StageRates {
  std::vector<double> block, embed, head;
};
StageRates rates_of(const Problem& P, const std::vector<int>& devs, int64_t m) {
  StageRates r;
  const double x = static_cast<double>(m);
  for (int d : devs) {
    const int t = P.ctx.type_of(d);
    r.block.push_back((P.ctx.forward_s(t, 1, false, false, m) + P.ctx.backward_s(t, 1, false, false, m)) / x);
    r.embed.push_back((P.ctx.forward_s(t, 0, true, false, m) + P.ctx.backward_s(t, 0, true, false, m)) / x);
    r.head.push_back((P.ctx.forward_s(t, 0, false, true, m) + P.ctx.backward_s(t, 0, false, true, m)) / x);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Input checks shared by every strategy

void check_inputs(Problem& P) {
  const std::string where = "planner";
  const int64_t rmin = (P.N + P.L - 1) / P.L;  // pipelines have at most L stages
  // Can G be a sum of rmin positive multiples of candidate sizes? (more pipelines only need more)
  const int64_t mmin = P.cands.front();
  std::string sizes;
  for (int64_t m : P.cands) sizes += (sizes.empty() ? "" : ", ") + std::to_string(m);
  if (P.G < rmin * mmin)
    throw InputError(where, "global batch " + std::to_string(P.G) + " cannot be split: the " + std::to_string(P.N) +
                                " devices need at least " + std::to_string(rmin) + " pipeline(s) (a pipeline has at most " +
                                std::to_string(P.L) + " stages of >= 1 block), each taking at least one micro-batch of a size in {" +
                                sizes + "}; that is " + std::to_string(rmin * mmin) + " samples, " + std::to_string(rmin * mmin - P.G) +
                                " more than the global batch");
  // Multiples of the smallest size are always possible: with rmin pipelines, all but one take
  // one micro-batch of it and the last the rest. Otherwise, a DP over sums of k parts.
  bool ok = P.G % mmin == 0;
  const bool all_multiples = std::all_of(P.cands.begin(), P.cands.end(), [&](int64_t m) { return m % mmin == 0; });
  if (!ok && !all_multiples && static_cast<double>(P.G) * static_cast<double>(P.G) * static_cast<double>(std::min<int64_t>(P.N, P.G)) <= 1e8) {
    // reach[t]: t samples are a sum of exactly k parts, each a positive multiple of a size
    std::vector<char> one(static_cast<size_t>(P.G + 1), 0);
    for (int64_t m : P.cands)
      for (int64_t b = m; b <= P.G; b += m) one[static_cast<size_t>(b)] = 1;
    std::vector<char> reach(static_cast<size_t>(P.G + 1), 0), nxt;
    reach[0] = 1;
    for (int64_t k = 1; k <= std::min<int64_t>(P.N, P.G) && !ok; ++k) {
      nxt.assign(reach.size(), 0);
      for (int64_t t = 0; t <= P.G; ++t)
        if (reach[static_cast<size_t>(t)])
          for (int64_t b = 1; t + b <= P.G; ++b)
            if (one[static_cast<size_t>(b)]) nxt[static_cast<size_t>(t + b)] = 1;
      reach.swap(nxt);
      if (k >= rmin && reach[static_cast<size_t>(P.G)]) ok = true;
    }
  } else if (!ok && !all_multiples) {
    ok = true;  // too large to check here; a plan that cannot split the batch is simply not found
  }
  {
    if (!ok)
      throw InputError(where, "global batch " + std::to_string(P.G) + " cannot be split into " + std::to_string(rmin) + " to " +
                                  std::to_string(P.N) + " pipelines each taking a whole number of micro-batches of a size in {" + sizes +
                                  "}; choose a global batch that is a multiple of " + std::to_string(mmin) + " or allow smaller micro-batches");
  }
  // The model, held at least once with its gradients and AdamW state, against the pool.
  const double params = P.ctx.param_bytes(P.L, true, true);
  const double need = params * P.ctx.state_bytes_per_param_byte();
  double have = 0;
  bool unknown = false;
  for (int d = 0; d < P.N; ++d) {
    have += P.ctx.capacity_bytes(d);
    unknown = unknown || P.ctx.capacity_bytes(d) <= 0;
  }
  if (!unknown && need > have)
    throw InputError(where, "the model does not fit the pool: its weights, gradients and AdamW state take " + gb(need) + " (" +
                                std::to_string(static_cast<int64_t>(need)) + " bytes: " + gb(params) + " of parameters x " +
                                fmt(P.ctx.state_bytes_per_param_byte()) + ") before any activation, but the " + std::to_string(P.N) +
                                " devices have " + gb(have) + " in all: short by " + gb(need - have));
}

// Samples per replica proportional to WEIGHTS, in whole micro-batches of the smallest size when
// the global batch allows (else sizes that no candidate divides would leave a replica idle).
std::vector<int64_t> batch_split(const Problem& P, const std::vector<double>& weights) {
  const int64_t unit = P.G % P.cands.front() == 0 && P.G / P.cands.front() >= static_cast<int64_t>(weights.size()) ? P.cands.front() : 1;
  bool equal = std::all_of(weights.begin(), weights.end(), [&](double w) { return w == weights.front(); });
  auto v = equal ? equal_split(P.G / unit, static_cast<int64_t>(weights.size())) : proportional_split(P.G / unit, weights);
  for (auto& x : v) x *= unit;
  return v;
}

// Evaluates with the given batch mode; returns the step time (inf when it does not fit).
double eval(Problem& P, Layout& l, Batch mode) { return P.ev.evaluate(l, mode); }

[[noreturn]] void no_fit(Problem& P, const std::string& strategy, std::vector<Layout>& tried) {
  std::string why;
  double least = kInf;
  for (auto& l : tried) {
    double over = 0;
    std::string w = P.ev.overflow(l, &over);
    if (!w.empty() && over < least) least = over, why = w;
  }
  throw InputError("planner", strategy + ": no plan fits in memory" + (why.empty() ? std::string() : "; the closest: " + why));
}

// ---------------------------------------------------------------------------------------------
// Baselines

// Replicas of D consecutive devices (index order), the last ones as they come.
std::vector<std::vector<int>> consecutive(int N, int d) {
  std::vector<std::vector<int>> reps;
  for (int i = 0; i < N; i += d) {
    reps.emplace_back();
    for (int k = i; k < std::min(N, i + d); ++k) reps.back().push_back(k);
  }
  return reps;
}

Layout uniform_or_proportional(Problem& P, bool proportional, int d) {
  Layout l;
  l.sched = 0;
  auto groups = consecutive(P.N, d);
  std::vector<double> rep_speed;
  for (auto& g : groups) {
    Replica r;
    r.dev = g;
    if (proportional) {
      std::vector<double> w;
      for (int x : g) w.push_back(P.dev_speed(x));
      r.blocks = proportional_split(P.L, w);
      rep_speed.push_back(std::accumulate(w.begin(), w.end(), 0.0));
    } else {
      r.blocks = equal_split(P.L, static_cast<int64_t>(g.size()));
    }
    l.reps.push_back(r);
  }
  const auto samples = batch_split(P, proportional ? rep_speed : std::vector<double>(groups.size(), 1.0));
  for (size_t i = 0; i < l.reps.size(); ++i) l.reps[i].samples = samples[i];
  return l;
}

// Uniform / proportional: pure DP if it fits, else the smallest depth dividing N that fits.
Layout baseline(Problem& P, const std::string& name, double* step) {
  const bool prop = name == "proportional";
  std::vector<Layout> tried;
  for (int d = 1; d <= std::min<int64_t>(P.N, P.L); ++d) {
    if (P.N % d != 0) continue;
    if (P.G < P.N / d) continue;
    Layout l = uniform_or_proportional(P, prop, d);
    const double v = eval(P, l, Batch::FixedSamples);
    if (v < kInf) {
      *step = v;
      if (d > 1) P.notes.push_back(name + ": the model does not fit with pure data parallelism; pipelines of " + std::to_string(d) + " stages");
      return l;
    }
    for (auto& r : l.reps) r.mbs = P.cands.front();
    tried.push_back(l);
  }
  if (tried.empty())
    throw InputError("planner", name + ": no equal pipeline depth fits: the depth must divide the " + std::to_string(P.N) +
                                    " devices, be at most " + std::to_string(P.L) + " (blocks), and leave at least one sample per pipeline of the global batch " +
                                    std::to_string(P.G));
  no_fit(P, name, tried);
}

// PTAFM-style grouping of hosts into K stage groups.
struct PtafmGrouping {
  std::vector<std::vector<int>> groups;  // hosts per group, in chain order
  double cost = kInf;
};

PtafmGrouping ptafm_group(Problem& P, int K) {
  const int H = P.ctx.num_hosts();
  std::vector<double> power(static_cast<size_t>(H), 0);
  for (int d = 0; d < P.N; ++d) power[static_cast<size_t>(P.ctx.host_of(d))] += P.dev_speed(d);
  const int64_t mbig = P.cands.back();
  double cmax = 0;
  auto c = [&](int a, int b) { return P.ctx.p2p_s(a, b, mbig); };
  for (int a = 0; a < H; ++a)
    for (int b = 0; b < H; ++b)
      if (a != b) cmax = std::max(cmax, c(a, b));
  if (cmax <= 0) cmax = 1;
  // PTAFM's cost 1*DP + 2*PP + 5*balance, each term scaled to [0, 1]: DP the slowest link
  // inside a group, PP the slowest hop of the chain (best link between consecutive groups),
  // balance the power spread.
  auto chain_pp = [&](const std::vector<std::vector<int>>& g, const std::vector<int>& order) {
    double pp = 0;
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      double best = kInf;
      for (int a : g[static_cast<size_t>(order[i])])
        for (int b : g[static_cast<size_t>(order[i + 1])]) best = std::min(best, c(a, b));
      pp = std::max(pp, best);
    }
    return pp / cmax;
  };
  auto best_chain = [&](const std::vector<std::vector<int>>& g, double* pp) {
    std::vector<int> order(g.size());
    std::iota(order.begin(), order.end(), 0);
    std::vector<int> best = order;
    double bv = chain_pp(g, order);
    if (g.size() <= 7) {
      while (std::next_permutation(order.begin(), order.end())) {
        const double v = chain_pp(g, order);
        if (v < bv) bv = v, best = order;
      }
    }
    *pp = bv;
    return best;
  };
  auto cost = [&](const std::vector<std::vector<int>>& g, std::vector<int>* order) {
    double dp = 0, pmax = 0, pmin = kInf;
    for (const auto& grp : g) {
      if (grp.empty()) return kInf;
      double pw = 0;
      for (int a : grp) {
        pw += power[static_cast<size_t>(a)];
        for (int b : grp)
          if (a != b) dp = std::max(dp, c(a, b) / cmax);
      }
      pmax = std::max(pmax, pw);
      pmin = std::min(pmin, pw);
    }
    double pp = 0;
    std::vector<int> o = best_chain(g, &pp);
    if (order) *order = o;
    return 1 * dp + 2 * pp + 5 * (pmax > 0 ? (pmax - pmin) / pmax : 0);
  };
  // LPT: hosts by power, each to the weakest group so far.
  std::vector<int> hosts(static_cast<size_t>(H));
  std::iota(hosts.begin(), hosts.end(), 0);
  std::stable_sort(hosts.begin(), hosts.end(), [&](int a, int b) { return power[static_cast<size_t>(a)] > power[static_cast<size_t>(b)]; });
  std::vector<std::vector<int>> g(static_cast<size_t>(K));
  std::vector<double> gp(static_cast<size_t>(K), 0);
  for (int h : hosts) {
    size_t w = 0;
    for (size_t i = 1; i < gp.size(); ++i)
      if (gp[i] < gp[w]) w = i;
    g[w].push_back(h);
    gp[w] += power[static_cast<size_t>(h)];
  }
  double cur = cost(g, nullptr);
  // Steepest descent over single moves and swaps, bounded passes: deterministic, no ants.
  for (int pass = 0; pass < 50; ++pass) {
    double best = cur;
    std::vector<std::vector<int>> bestg;
    for (size_t i = 0; i < g.size(); ++i)
      for (size_t a = 0; a < g[i].size(); ++a)
        for (size_t j = 0; j < g.size(); ++j) {
          if (i == j) continue;
          if (g[i].size() > 1) {  // move
            auto t = g;
            t[j].push_back(t[i][a]);
            t[i].erase(t[i].begin() + static_cast<long>(a));
            const double v = cost(t, nullptr);
            if (v < best - 1e-12) best = v, bestg = t;
          }
          for (size_t b = 0; b < g[j].size(); ++b) {  // swap
            if (j < i) continue;
            auto t = g;
            std::swap(t[i][a], t[j][b]);
            const double v = cost(t, nullptr);
            if (v < best - 1e-12) best = v, bestg = t;
          }
        }
    if (bestg.empty()) break;
    g = bestg;
    cur = best;
  }
  for (auto& grp : g) std::sort(grp.begin(), grp.end());
  std::vector<int> order;
  PtafmGrouping out;
  out.cost = cost(g, &order);
  for (int o : order) out.groups.push_back(g[static_cast<size_t>(o)]);
  return out;
}

Layout ptafm_layout(Problem& P, double* step) {
  const int H = P.ctx.num_hosts();
  std::vector<int> Ks;
  if (P.opt.ptafm_stages > 0) {
    if (P.opt.ptafm_stages > H)
      throw InputError("planner", "ptafm: " + std::to_string(P.opt.ptafm_stages) + " stages asked for but the cluster has only " +
                                      std::to_string(H) + " hosts (PTAFM groups whole hosts, data centres, into stages)");
    Ks.push_back(P.opt.ptafm_stages);
  } else {
    for (int k = 1; k <= std::min<int64_t>(H, P.L); ++k) Ks.push_back(k);
  }
  std::vector<Layout> tried;
  for (int K : Ks) {
    PtafmGrouping grp = ptafm_group(P, K);
    // Devices of each stage group, by host in chain order, faster first.
    std::vector<std::vector<int>> gdev;
    size_t R = static_cast<size_t>(P.N);
    for (const auto& hosts : grp.groups) {
      gdev.emplace_back();
      for (int h : hosts)
        for (int d = 0; d < P.N; ++d)
          if (P.ctx.host_of(d) == h) gdev.back().push_back(d);
      R = std::min(R, gdev.back().size());
    }
    // PTAFM data-parallelises inside a stage; with single-rank stages that means R replicas each
    // taking a share of every group. More replicas than the smallest group are needed when a
    // replica would otherwise get more devices than the model has blocks (it then skips the
    // small groups: a shorter chain).
    R = std::max<size_t>(R, static_cast<size_t>((P.N + P.L - 1) / P.L));
    if (R == 0 || static_cast<int64_t>(R) > P.G) continue;
    // Each replica takes a near-equal share of every group, in chain order.
    Layout l;
    l.sched = 0;
    l.reps.resize(R);
    // Round robin that carries on from group to group, so the remainders of uneven groups land on
    // different replicas and every replica ends with floor or ceil of N / R devices.
    size_t next = 0;
    for (const auto& devs : gdev)
      for (int d : devs) l.reps[next++ % R].dev.push_back(d);
    bool ok = true;
    std::vector<double> rep_power;
    for (auto& r : l.reps) {
      if (r.dev.empty() || static_cast<int64_t>(r.dev.size()) > P.L) ok = false;
      std::vector<double> w;
      for (int d : r.dev) w.push_back(P.dev_speed(d));
      r.blocks = proportional_split(P.L, w);
      rep_power.push_back(std::accumulate(w.begin(), w.end(), 0.0));
    }
    if (!ok) continue;
    const auto samples = batch_split(P, rep_power);
    for (size_t r = 0; r < R; ++r) l.reps[r].samples = samples[r];
    const double v = eval(P, l, Batch::FixedSamples);
    if (v < kInf) {
      *step = v;
      P.notes.push_back("ptafm: " + std::to_string(K) + " stage group(s) of hosts, PTAFM cost " + fmt(grp.cost) + ", " +
                        std::to_string(R) + " replica(s)");
      return l;
    }
    for (auto& r : l.reps) r.mbs = P.cands.front();
    tried.push_back(l);
  }
  if (tried.empty())
    throw InputError("planner", "ptafm: no grouping of the " + std::to_string(H) + " host(s) into stages gives pipelines of at most " +
                                    std::to_string(P.L) + " stages with at least one sample each");
  no_fit(P, "ptafm", tried);
}

// ---------------------------------------------------------------------------------------------
// Exact search: enumerate partitions x orders x splits x schedules; per configuration the best
// batch split by the min-max DP. With SYMMETRIC, devices of one class (type, host, memory) are
// interchangeable: partitions, orders and identical replicas are enumerated once per class
// pattern. With BOUNDED, branch and bound: a partition (and a partial assignment) is skipped when
// the min-max DP over phase-only lower bounds plus the world all-reduce already reaches the
// incumbent. The bounds ignore sync and memory; for a chosen configuration the simulation-free
// bound (Tables::cheap_h) is tried first and its simulated makespans only if that does not prune.

class Exact {
 public:
  Exact(Problem& P, bool symmetric, bool bounded) : P_(P), symmetric_(symmetric), bounded_(bounded) {
    std::map<std::tuple<int, int, double>, int> ids;
    for (int d = 0; d < P.N; ++d) {
      auto key = std::make_tuple(P.ctx.type_of(d), P.ctx.host_of(d), P.ctx.capacity_bytes(d));
      auto it = ids.emplace(key, static_cast<int>(ids.size())).first;
      cls_.push_back(symmetric ? it->second : d);
    }
  }

  Layout best;
  double best_step = kInf;
  int64_t leaves = 0;

  void offer(Layout l) {
    Layout own = l;
    const double v = eval(P_, l, Batch::Optimize);
    if (v < best_step) best_step = v, best = l;
    // A seed's own batch split, in case the allocator does not improve on it.
    if (own.reps.front().samples > 0) {
      const double w = eval(P_, own, Batch::FixedSamples);
      if (w < best_step) best_step = w, best = own;
    }
  }

  void run() {
    for (int sched = 0; sched < static_cast<int>(P_.opt.schedules.size()); ++sched) {
      sched_ = sched;
      std::vector<std::vector<std::vector<int>>> parts;
      std::set<std::vector<std::vector<int>>> seen;
      std::vector<int> a(static_cast<size_t>(P_.N), 0);
      std::function<void(int, int)> rgs = [&](int i, int mx) {
        if (i == P_.N) {
          std::vector<std::vector<int>> blocks(static_cast<size_t>(mx + 1));
          for (int d = 0; d < P_.N; ++d) blocks[static_cast<size_t>(a[static_cast<size_t>(d)])].push_back(d);
          for (auto& b : blocks)
            if (static_cast<int64_t>(b.size()) > P_.L) return;
          if (static_cast<int64_t>(blocks.size()) > P_.G) return;
          if (symmetric_) {
            std::vector<std::vector<int>> sig;
            for (auto& b : blocks) sig.push_back(signature(b));
            std::sort(sig.begin(), sig.end());
            if (!seen.insert(sig).second) return;
            // identical replicas next to each other, for the non-decreasing config rule
            std::sort(blocks.begin(), blocks.end(), [&](const std::vector<int>& x, const std::vector<int>& y) {
              return signature(x) < signature(y);
            });
          }
          parts.push_back(blocks);
          return;
        }
        for (int v = 0; v <= mx + 1; ++v) {
          a[static_cast<size_t>(i)] = v;
          rgs(i + 1, std::max(mx, v));
        }
      };
      a[0] = 0;
      rgs(1, 0);
      if (P_.N == 0) continue;
      // Partitions by lower bound, most promising first, so the incumbent tightens early.
      std::vector<std::pair<double, size_t>> order;
      for (size_t i = 0; i < parts.size(); ++i) order.push_back({bounded_ ? partition_bound(parts[i]) : 0.0, i});
      std::stable_sort(order.begin(), order.end());
      for (const auto& [lb, i] : order) {
        if (bounded_ && lb >= best_step) break;
        walk(parts[i]);
      }
    }
  }

 private:
  struct Config {
    std::vector<int> order;  // positions into the block's sorted device list
    std::vector<int64_t> split;
  };
  struct BlockInfo {
    std::vector<Config> configs;
    std::vector<double> H;  // best h over configs, per b
    bool bounds = false;
  };

  std::vector<int> signature(const std::vector<int>& devs) const {
    std::vector<int> s;
    for (int d : devs) s.push_back(cls_[static_cast<size_t>(d)]);
    std::sort(s.begin(), s.end());
    return s;
  }

  // Orders (distinct class sequences when symmetric) x splits of a block; shared by every block
  // with the same class multiset, as positions into its devices sorted by (class, index).
  BlockInfo& info(const std::vector<int>& devs) {
    std::vector<int> key = signature(devs);
    key.push_back(-1 - sched_);
    if (!symmetric_) key = devs, key.push_back(-1 - sched_);
    auto it = infos_.find(key);
    if (it != infos_.end()) return it->second;
    BlockInfo bi;
    const int k = static_cast<int>(devs.size());
    std::vector<std::vector<int64_t>> splits;
    std::vector<int64_t> cur;
    std::function<void(int64_t)> comp = [&](int64_t left) {
      if (static_cast<int>(cur.size()) == k - 1) {
        cur.push_back(left);
        splits.push_back(cur);
        cur.pop_back();
        return;
      }
      for (int64_t n = 1; n <= left - (k - 1 - static_cast<int64_t>(cur.size())); ++n) {
        cur.push_back(n);
        comp(left - n);
        cur.pop_back();
      }
    };
    comp(P_.L);
    // positions sorted by class: permutations of the class sequence are next_permutation over it
    std::vector<int> cls_seq(static_cast<size_t>(k));
    std::vector<int> sorted = sorted_by_class(devs);
    for (int i = 0; i < k; ++i) cls_seq[static_cast<size_t>(i)] = cls_[static_cast<size_t>(sorted[static_cast<size_t>(i)])];
    do {
      // map the class sequence to positions: the j-th occurrence of a class takes its j-th device
      std::vector<int> pos(static_cast<size_t>(k));
      std::vector<int> used(static_cast<size_t>(k), 0);
      for (int s = 0; s < k; ++s)
        for (int i = 0; i < k; ++i)
          if (!used[static_cast<size_t>(i)] && cls_[static_cast<size_t>(sorted[static_cast<size_t>(i)])] == cls_seq[static_cast<size_t>(s)]) {
            used[static_cast<size_t>(i)] = 1;
            pos[static_cast<size_t>(s)] = i;
            break;
          }
      for (const auto& sp : splits) bi.configs.push_back({pos, sp});
    } while (std::next_permutation(cls_seq.begin(), cls_seq.end()));
    return infos_.emplace(key, std::move(bi)).first->second;
  }

  std::vector<int> sorted_by_class(const std::vector<int>& devs) const {
    std::vector<int> s = devs;
    std::sort(s.begin(), s.end(), [&](int a, int b) {
      return cls_[static_cast<size_t>(a)] != cls_[static_cast<size_t>(b)] ? cls_[static_cast<size_t>(a)] < cls_[static_cast<size_t>(b)] : a < b;
    });
    return s;
  }

  ConfigTable* table(const std::vector<int>& sorted, const Config& c, Replica* out) {
    out->dev.resize(c.order.size());
    for (size_t s = 0; s < c.order.size(); ++s) out->dev[s] = sorted[static_cast<size_t>(c.order[s])];
    out->blocks = c.split;
    return P_.tables.get(sched_, out->dev.data(), out->blocks.data(), static_cast<int>(c.order.size()));
  }

  // Bounds of a block: per config its h row, and H = the min over configs; configs sorted by
  // their h at the block's proportional share of the batch, best first.
  void ensure_bounds(const std::vector<int>& devs, BlockInfo& bi) {
    if (bi.bounds) return;
    std::vector<int> sorted = sorted_by_class(devs);
    const int64_t G = P_.G;
    bi.H.assign(static_cast<size_t>(G + 1), kInf);
    const int64_t share = std::max<int64_t>(1, G * static_cast<int64_t>(devs.size()) / P_.N);
    std::vector<std::pair<double, size_t>> key;
    Replica tmp;
    for (size_t i = 0; i < bi.configs.size(); ++i) {
      ConfigTable* t = table(sorted, bi.configs[i], &tmp);
      for (int64_t b = 1; b <= G; ++b) bi.H[static_cast<size_t>(b)] = std::min(bi.H[static_cast<size_t>(b)], P_.tables.cheap_h(*t, b));
      key.push_back({P_.tables.cheap_h(*t, share), i});
    }
    std::stable_sort(key.begin(), key.end());
    std::vector<Config> sorted_configs;
    for (auto& k : key) sorted_configs.push_back(bi.configs[k.second]);
    bi.configs = std::move(sorted_configs);
    bi.bounds = true;
  }

  double partition_bound(const std::vector<std::vector<int>>& blocks) {
    std::vector<const double*> rows;
    for (const auto& b : blocks) {
      BlockInfo& bi = info(b);
      ensure_bounds(b, bi);
      rows.push_back(bi.H.data());
    }
    return minmax_allocate(rows, P_.G, nullptr) + P_.ctx.world_allreduce_s();
  }

  void walk(const std::vector<std::vector<int>>& blocks) {
    const size_t R = blocks.size();
    std::vector<BlockInfo*> bis;
    std::vector<std::vector<int>> sorted;
    for (const auto& b : blocks) {
      bis.push_back(&info(b));
      if (bounded_) ensure_bounds(b, *bis.back());
      sorted.push_back(sorted_by_class(b));
    }
    Layout l;
    l.sched = sched_;
    l.reps.resize(R);
    std::vector<ConfigTable*> tabs(R);
    std::vector<size_t> idx(R, 0);
    std::vector<const double*> rows(R);
    std::vector<std::vector<double>> hrow(R, std::vector<double>(static_cast<size_t>(P_.G + 1), kInf));
    // Rows 0..i-1 from the chosen configurations, the rest from their blocks' bounds.
    auto bound_ok = [&](size_t i) {
      for (size_t j = 0; j < R; ++j) rows[j] = j < i ? hrow[j].data() : bis[j]->H.data();
      return minmax_allocate(rows, P_.G, nullptr) + P_.ctx.world_allreduce_s() < best_step;
    };
    std::function<void(size_t)> rec = [&](size_t i) {
      if (bounded_ && i > 0 && !bound_ok(i)) return;
      if (i == R) {
        leaf(l);
        return;
      }
      const size_t start = (symmetric_ && i > 0 && bis[i] == bis[i - 1]) ? idx[i - 1] : 0;
      for (size_t c = start; c < bis[i]->configs.size(); ++c) {
        idx[i] = c;
        tabs[i] = table(sorted[i], bis[i]->configs[c], &l.reps[i]);
        if (bounded_) {
          // First the cheap bound (no simulation), then the simulated makespans.
          for (int64_t b = 1; b <= P_.G; ++b) hrow[i][static_cast<size_t>(b)] = P_.tables.cheap_h(*tabs[i], b);
          if (!bound_ok(i + 1)) continue;
          for (int64_t b = 1; b <= P_.G; ++b) hrow[i][static_cast<size_t>(b)] = P_.tables.h(*tabs[i], b);
        }
        rec(i + 1);
      }
    };
    rec(0);
  }

  void leaf(Layout& l) {
    ++leaves;
    Evaluator& ev = P_.ev;
    ev.prepare(l);
    const size_t R = l.reps.size();
    const int64_t G = P_.G, hi = G - static_cast<int64_t>(R) + 1;
    gtab_.assign(R * static_cast<size_t>(G + 1), kInf);
    std::vector<const double*> rows(R);
    double maxopt = 0;
    for (size_t r = 0; r < R; ++r) {
      double* row = gtab_.data() + r * static_cast<size_t>(G + 1);
      for (int64_t b = 1; b <= hi; ++b) row[b] = ev.g(r, l.reps[r], b, nullptr);
      rows[r] = row;
      for (double o : ev.table(r)->opt) maxopt = std::max(maxopt, o);
    }
    const double v = minmax_allocate(rows, G, nullptr);
    if (!(v < kInf)) return;
    const double step = (v + P_.ctx.world_allreduce_s()) + maxopt;
    if (step < best_step) {
      Layout copy = l;
      best_step = eval(P_, copy, Batch::Optimize);  // fills the batch split; same value
      best = copy;
    }
  }

  Problem& P_;
  bool symmetric_, bounded_;
  int sched_ = 0;
  std::vector<int> cls_;
  std::map<std::vector<int>, BlockInfo> infos_;
  std::vector<double> gtab_;
};

// ---------------------------------------------------------------------------------------------
// Heuristics for pools too large to enumerate.

class Heuristic {
 public:
  Heuristic(Problem& P, Clock::time_point t0) : P_(P), t0_(t0) {
    // Hosts in a nearest-neighbour chain by link time, so hosts of one region sit together and
    // contiguous slices of the device order are local.
    const int H = P.ctx.num_hosts();
    std::vector<int> chain{0};
    std::vector<char> used(static_cast<size_t>(H), 0);
    used[0] = 1;
    while (static_cast<int>(chain.size()) < H) {
      int next = -1;
      double bv = kInf;
      for (int h = 0; h < H; ++h)
        if (!used[static_cast<size_t>(h)]) {
          const double v = P.ctx.p2p_s(chain.back(), h, P.cands.back());
          if (v < bv) bv = v, next = h;
        }
      used[static_cast<size_t>(next)] = 1;
      chain.push_back(next);
    }
    host_rank_.assign(static_cast<size_t>(H), 0);
    for (int i = 0; i < H; ++i) host_rank_[static_cast<size_t>(chain[static_cast<size_t>(i)])] = i;
  }

  Layout best;
  double best_step = kInf;

  bool out_of_time() const { return seconds_since(t0_) > P_.opt.time_budget_s; }

  void offer(Layout l) {
    Layout own = l;
    const double v = eval(P_, l, Batch::Optimize);
    if (v < best_step) best_step = v, best = std::move(l);
    // A seed's own batch split, in case the greedy allocator does worse on it.
    if (!own.reps.empty() && own.reps.front().samples > 0) {
      const double w = eval(P_, own, Batch::FixedSamples);
      if (w < best_step) best_step = w, best = std::move(own);
    }
  }

  void run() {
    std::vector<int> depths;
    const int dmax = static_cast<int>(std::min<int64_t>(P_.N, P_.L));
    for (int d = 1; d <= dmax; ++d)
      if (d <= 8 || d == dmax || d % 4 == 0) depths.push_back(d);
    for (int d : depths)
      for (int sched = 0; sched < static_cast<int>(P_.opt.schedules.size()); ++sched)
        for (int policy = 0; policy < 5; ++policy) {
          if (out_of_time() && best_step < kInf) return;
          auto reps = form(policy, d);
          if (reps.empty()) continue;
          Layout l;
          l.sched = sched;
          for (auto& devs : reps) {
            Replica r;
            r.dev = devs;
            r.blocks = split_for(devs);
            l.reps.push_back(r);
          }
          offer(l);
          if ((policy == 1 || policy == 4) && d > 1) {  // stage-major: one split for all replicas, sync sets stay within stage groups
            Layout a = l;
            if (align(a)) offer(a);
          }
        }
  }

  // Local search on layer boundaries: move one block across a boundary in every replica with the
  // same types and split (a template), keep what lowers the step time, until nothing does or the
  // time budget is spent.
  void improve() {
    if (!(best_step < kInf)) return;
    for (bool improved = true; improved && !out_of_time();) {
      improved = false;
      std::map<std::pair<std::vector<int>, std::vector<int64_t>>, std::vector<size_t>> templates;
      for (size_t r = 0; r < best.reps.size(); ++r) {
        std::vector<int> types;
        for (int d : best.reps[r].dev) types.push_back(P_.ctx.type_of(d));
        templates[{types, best.reps[r].blocks}].push_back(r);
      }
      for (const auto& [key, members] : templates) {
        const auto& blocks = key.second;
        for (size_t i = 0; i + 1 < blocks.size() && !improved && !out_of_time(); ++i)
          for (int dir : {+1, -1}) {
            auto nb = blocks;
            nb[i] += dir;
            nb[i + 1] -= dir;
            if (nb[i] < 1 || nb[i + 1] < 1) continue;
            Layout l = best;
            for (size_t r : members) l.reps[r].blocks = nb;
            const double v = eval(P_, l, Batch::Optimize);
            if (v < best_step * (1 - 1e-12)) {
              best_step = v, best = std::move(l);
              improved = true;
              break;
            }
          }
        if (improved) break;
      }
    }
  }

 private:
  // Devices by host chain, then fastest first: contiguous slices are local.
  std::vector<int> locality_order() const {
    std::vector<int> o(static_cast<size_t>(P_.N));
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) {
      const int ha = host_rank_[static_cast<size_t>(P_.ctx.host_of(a))], hb = host_rank_[static_cast<size_t>(P_.ctx.host_of(b))];
      if (ha != hb) return ha < hb;
      return P_.dev_speed(a) > P_.dev_speed(b);
    });
    return o;
  }

  // Replica sizes for depth D: N / D replicas, the remainder one stage deeper each.
  std::vector<size_t> sizes(int d) const {
    const int R = P_.N / d, rem = P_.N % d;
    if (R == 0 || (rem > 0 && d + 1 > P_.L) || R > P_.G) return {};
    std::vector<size_t> s(static_cast<size_t>(R), static_cast<size_t>(d));
    for (int i = 0; i < rem; ++i) ++s[static_cast<size_t>(i % R)];
    for (size_t x : s)
      if (static_cast<int64_t>(x) > P_.L) return {};
    return s;
  }

  // 0 local: consecutive slices of the locality order (pipelines inside a host or region);
  // 1 stage-major: stage s of every replica from the s-th slice (each stage group, and so each
  //   sync ring, inside a host or region; pipelines cross regions, as PTAFM does);
  // 2 typed: slices of the devices ordered by speed then locality (one type per pipeline);
  // 3 balanced: fastest devices dealt in snake order so replicas have equal total speed;
  // 4 folded stage-major: stage-major with the slices visited 0, 2, 4, ..., 5, 3, 1, so the
  //   first and last stages (which share a tied embedding) sit in neighbouring slices, and in one
  //   region when the pipeline crosses two.
  std::vector<std::vector<int>> form(int policy, int d) const {
    auto sz = sizes(d);
    if (sz.empty()) return {};
    const size_t R = sz.size();
    std::vector<std::vector<int>> reps(R);
    std::vector<int> o = locality_order();
    if (policy == 2)
      std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return P_.dev_speed(a) > P_.dev_speed(b); });
    if (policy == 0 || policy == 2) {
      size_t k = 0;
      for (size_t r = 0; r < R; ++r)
        for (size_t i = 0; i < sz[r]; ++i) reps[r].push_back(o[k++]);
    } else if (policy == 1 || policy == 4) {
      if (policy == 4 && d < 3) return {};  // nothing to fold
      size_t k = 0;
      for (size_t s = 0; s < static_cast<size_t>(d) + 1; ++s)
        for (size_t r = 0; r < R; ++r)
          if (sz[r] > s) reps[r].push_back(o[k++]);
      if (policy == 4)
        for (auto& rep : reps) {
          std::vector<int> folded;
          for (size_t i = 0; i < rep.size(); i += 2) folded.push_back(rep[i]);
          for (size_t i = rep.size() - 1 - (rep.size() % 2 == 0 ? 0 : 1); i < rep.size(); i -= 2) folded.push_back(rep[i]);
          rep = folded;
        }
    } else {
      if (d == 1) return {};  // same as local for pure data parallelism
      std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return P_.dev_speed(a) > P_.dev_speed(b); });
      size_t r = 0;
      int dir = 1;
      for (int dev : o) {
        while (reps[r].size() >= sz[r]) r = (r + 1) % R;
        reps[r].push_back(dev);
        // snake: 0..R-1 then R-1..0
        if ((dir > 0 && r + 1 == R) || (dir < 0 && r == 0)) dir = -dir;
        else r = static_cast<size_t>(static_cast<int>(r) + dir);
      }
      for (auto& rep : reps)
        std::stable_sort(rep.begin(), rep.end(), [&](int a, int b) {
          return host_rank_[static_cast<size_t>(P_.ctx.host_of(a))] < host_rank_[static_cast<size_t>(P_.ctx.host_of(b))];
        });
    }
    return reps;
  }

  std::vector<int64_t> split_for(const std::vector<int>& devs) {
    std::vector<int> types;
    for (int d : devs) types.push_back(P_.ctx.type_of(d));
    auto it = split_cache_.find(types);
    if (it != split_cache_.end()) return it->second;
    StageRates r = rates_of(P_, devs, P_.cands[P_.cands.size() / 2]);
    auto s = balanced_split(P_.L, r.block, r.embed, r.head);
    split_cache_[types] = s;
    return s;
  }

  // One split for all replicas of equal depth, balanced on the stage groups' combined speed.
  bool align(Layout& l) {
    std::map<size_t, std::vector<size_t>> by_depth;
    for (size_t r = 0; r < l.reps.size(); ++r) by_depth[l.reps[r].dev.size()].push_back(r);
    for (const auto& [S, members] : by_depth) {
      StageRates agg{std::vector<double>(S, 0), std::vector<double>(S, 0), std::vector<double>(S, 0)};
      for (size_t r : members) {
        StageRates x = rates_of(P_, l.reps[r].dev, P_.cands[P_.cands.size() / 2]);
        for (size_t s = 0; s < S; ++s) agg.block[s] += 1 / x.block[s], agg.embed[s] += 1 / x.embed[s], agg.head[s] += 1 / x.head[s];
      }
      for (size_t s = 0; s < S; ++s) agg.block[s] = 1 / agg.block[s], agg.embed[s] = 1 / agg.embed[s], agg.head[s] = 1 / agg.head[s];
      auto sp = balanced_split(P_.L, agg.block, agg.embed, agg.head);
      if (sp.empty()) return false;
      for (size_t r : members) l.reps[r].blocks = sp;
    }
    return true;
  }

  Problem& P_;
  Clock::time_point t0_;
  std::vector<int> host_rank_;
  std::map<std::vector<int>, std::vector<int64_t>> split_cache_;
};

SearchResult finish(Problem& P, const Layout& l, const std::string& strategy, Clock::time_point t0, bool exact) {
  SearchResult res;
  {
    Layout copy = l;
    res.search_step_s = P.ev.evaluate(copy, Batch::Fixed);
  }
  res.strategy = strategy;
  res.plan = to_plan(P, l);
  res.plan.validate(P.profile.model, "planner");
  res.cost = simulate_plan(res.plan, P.cluster, P.profile);
  res.plan.predicted = res.cost.to_json();
  res.plan.predicted["strategy"] = strategy;
  res.candidates_evaluated = P.ev.evaluated;
  res.exact = exact;
  res.notes = P.notes;
  res.search_s = seconds_since(t0);
  return res;
}

}  // namespace

void tune_buckets(SearchResult& result, const ClusterSpec& cluster, const Profile& profile) {
  const double start = result.plan.grad_sync.bucket_mb, before = result.cost.step_s;
  Plan best = result.plan;
  PlanCost best_cost = result.cost;
  for (double mb : {16.0, 8.0, 4.0, 2.0, 1.0}) {
    if (!(mb < start)) continue;
    Plan p = result.plan;
    p.grad_sync.bucket_mb = mb;
    PlanCost c = simulate_plan(p, cluster, profile);
    if (c.fits && c.step_s < best_cost.step_s * (1 - 2e-3)) best = p, best_cost = c;  // worth a change of plan
  }
  if (best.grad_sync.bucket_mb == start) return;
  std::ostringstream o;
  o.precision(4);
  o << "gradient buckets of " << best.grad_sync.bucket_mb << " MiB instead of " << start << ": predicted " << best_cost.step_s * 1e3
    << " ms instead of " << before * 1e3 << " ms (late layers' all-reduces start during the backward)";
  result.notes.push_back(o.str());
  result.plan = best;
  result.cost = best_cost;
  const std::string strategy = result.plan.predicted.is_object() ? result.plan.predicted.value("strategy", result.strategy) : result.strategy;
  result.plan.predicted = best_cost.to_json();
  result.plan.predicted["strategy"] = strategy;
  result.search_step_s = best_cost.step_s;
}

std::vector<int64_t> SearchOptions::candidate_micro_batches() const {
  std::vector<int64_t> c = micro_batch_sizes;
  if (c.empty()) {
    if (max_micro_batch < 1)
      throw InputError("planner", "max_micro_batch must be >= 1, got " + std::to_string(max_micro_batch));
    for (int64_t m = 1; m <= max_micro_batch; m *= 2) c.push_back(m);
  }
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  if (c.front() < 1) throw InputError("planner", "micro-batch sizes must be >= 1, got " + std::to_string(c.front()));
  return c;
}

double minmax_split(const std::vector<std::vector<double>>& g, int64_t total, std::vector<int64_t>* choice) {
  std::vector<const double*> rows;
  for (const auto& r : g) {
    if (static_cast<int64_t>(r.size()) < total + 1)
      throw std::invalid_argument("minmax_split: a row has " + std::to_string(r.size()) + " entries, need " + std::to_string(total + 1));
    rows.push_back(r.data());
  }
  return minmax_allocate(rows, total, choice);
}

double search_space_configurations(int n, int64_t layers) {
  // c[k] = sum over set partitions of k devices of prod a(|block|), a(j) = j! C(L-1, j-1):
  // c[k] = sum_j C(k-1, j-1) a(j) c[k-j] (the block holding the first device has j devices).
  std::vector<double> a(static_cast<size_t>(n + 1), 0), c(static_cast<size_t>(n + 1), 0);
  auto binom = [](double nn, double kk) {
    if (kk < 0 || kk > nn) return 0.0;
    double r = 1;
    for (double i = 1; i <= kk; ++i) r = r * (nn - kk + i) / i;
    return r;
  };
  double fact = 1;
  for (int j = 1; j <= n; ++j) {
    fact *= j;
    a[static_cast<size_t>(j)] = fact * binom(static_cast<double>(layers - 1), j - 1);
  }
  c[0] = 1;
  for (int k = 1; k <= n; ++k)
    for (int j = 1; j <= k; ++j) c[static_cast<size_t>(k)] += binom(k - 1, j - 1) * a[static_cast<size_t>(j)] * c[static_cast<size_t>(k - j)];
  return std::isfinite(c[static_cast<size_t>(n)]) ? c[static_cast<size_t>(n)] : std::numeric_limits<double>::infinity();
}

namespace {

void check_options(const SearchOptions& o) {
  if (o.global_batch < 1) throw InputError("planner", "global_batch must be >= 1, got " + std::to_string(o.global_batch));
  if (o.schedules.empty()) throw InputError("planner", "schedules: allow at least one of 1f1b, gpipe");
  for (const auto& s : o.schedules)
    if (s != "1f1b" && s != "gpipe") throw InputError("planner", "schedules: unknown schedule '" + s + "' (valid: 1f1b, gpipe)");
  o.grad_sync.validate("planner", "grad_sync");
  if (o.strategy != "alloy" && o.strategy != "uniform" && o.strategy != "proportional" && o.strategy != "ptafm")
    throw InputError("planner", "unknown strategy '" + o.strategy + "' (valid: alloy, uniform, proportional, ptafm)");
}

bool exact_tractable(const Problem& P) {
  const double configs = search_space_configurations(P.N, P.L);
  const double g = static_cast<double>(P.G + 1);
  return P.N <= 64 && configs <= P.opt.exact_limit && configs * g * g <= 256.0 * P.opt.exact_limit;
}

}  // namespace

SearchResult search(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const auto t0 = Clock::now();
  check_options(options);
  Problem P(cluster, profile, options);
  check_inputs(P);
  if (options.strategy != "alloy") {
    double step = kInf;
    Layout l = options.strategy == "ptafm" ? ptafm_layout(P, &step) : baseline(P, options.strategy, &step);
    return finish(P, l, options.strategy, t0, false);
  }
  // Seeds: the baselines' layouts, with the batch split re-optimised.
  std::vector<Layout> seeds;
  std::string baseline_error;
  for (const std::string name : {"uniform", "proportional", "ptafm"}) {
    try {
      double step = kInf;
      seeds.push_back(name == "ptafm" ? ptafm_layout(P, &step) : baseline(P, name, &step));
    } catch (const InputError& e) {
      // A baseline that finds no plan is no seed; the search below may still find one. Its
      // message names a rank that overflows, which explains an overall failure best.
      if (baseline_error.empty()) baseline_error = e.what();
    }
  }
  auto fail = [&]() {
    throw InputError("planner", "alloy: no plan in the search space fits in memory" +
                                    (baseline_error.empty() ? std::string() : " (" + baseline_error + ")"));
  };
  P.notes.clear();
  if (exact_tractable(P)) {
    P.ev.force_dp = true;
    Exact ex(P, true, true);
    for (auto& s : seeds)
      for (int sched = 0; sched < static_cast<int>(options.schedules.size()); ++sched) {
        Layout l = s;
        l.sched = sched;
        ex.offer(l);
      }
    ex.run();
    if (!(ex.best_step < kInf)) fail();
    P.notes.push_back("exact: branch and bound over " + fmt(search_space_configurations(P.N, P.L)) +
                      " configurations per schedule; " + std::to_string(ex.leaves) + " evaluated in full, " +
                      std::to_string(P.tables.simulations()) + " pipeline simulations");
    return finish(P, ex.best, "alloy", t0, true);
  }
  Heuristic h(P, t0);
  for (auto& s : seeds)
    for (int sched = 0; sched < static_cast<int>(options.schedules.size()); ++sched) {
      Layout l = s;
      l.sched = sched;
      h.offer(l);
    }
  h.run();
  h.improve();
  if (!(h.best_step < kInf)) fail();
  const double configs = search_space_configurations(P.N, P.L);
  P.notes.push_back("heuristic: the space has " + (std::isfinite(configs) ? fmt(configs) : std::string("over 1e308")) +
                    " configurations per schedule, beyond exact_limit " + fmt(options.exact_limit) + "; " +
                    std::to_string(P.ev.evaluated) + " layouts evaluated, " + std::to_string(P.tables.simulations()) +
                    " pipeline simulations");
  return finish(P, h.best, "alloy", t0, false);
}

SearchResult exhaustive(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& options) {
  const auto t0 = Clock::now();
  check_options(options);
  Problem P(cluster, profile, options);
  check_inputs(P);
  const double configs = search_space_configurations(P.N, P.L);
  if (configs > options.exact_limit)
    throw InputError("planner", "exhaustive: the space has " + fmt(configs) + " configurations per schedule, more than exact_limit " +
                                    fmt(options.exact_limit));
  P.ev.force_dp = true;
  Exact ex(P, false, false);
  ex.run();
  if (!(ex.best_step < kInf)) {
    std::vector<Layout> none;
    no_fit(P, "exhaustive", none);
  }
  P.notes.push_back("exhaustive: " + std::to_string(ex.leaves) + " configurations evaluated");
  return finish(P, ex.best, "exhaustive", t0, true);
}

nlohmann::json SearchResult::to_json() const {
  return {{"strategy", strategy}, {"candidates_evaluated", candidates_evaluated}, {"search_s", search_s}, {"exact", exact},
          {"notes", notes},       {"plan", plan.to_json()},                       {"cost", cost.to_json()}};
}

}  // namespace alloy::plan
