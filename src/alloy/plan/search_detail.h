#pragma once
// Internals shared by the planner's source files (search.cpp: helpers and the public entry points;
// search_eval.cpp: timing tables and the Evaluator; search_baselines.cpp: input checks and the
// uniform / proportional / PTAFM baselines; search_exact.cpp: the exact search;
// search_heuristic.cpp: the heuristic search). Not API and not installed: include it only from
// those files. The API is search.h; how the search works is at the top of search.cpp.
// What the exact search calls in its innermost loops (Tables::cheap_h and h, Evaluator::g,
// minmax_allocate) is defined here, inline, so that the compiler can still inline and specialise
// it there (for a null CHOICE or M) as it did when the search was one file: out of line it ran
// about 10% more instructions.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/search.h"

namespace alloy::plan::detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fmt(double v, int precision = 4);
std::string gb(double bytes);

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
  // Every replica one device: the step's figures sum is hidden (CostContext::world_sum_exposed_s).
  bool one_device_replicas() const {
    for (const auto& r : reps)
      if (r.dev.size() != 1) return false;
    return true;
  }
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
  std::vector<int> shares;  // per link: the pipelines sending over its host pair (CostContext::pipeline_link_shares)
  std::vector<int64_t> blocks;
  // per stage: activation bytes per sample, (trained) parameter bytes, optimizer seconds, frozen base bytes
  std::vector<double> act, param, opt, frozen;
  std::vector<const PipeTiming*> at;    // (b * nc + candidate); null until asked
  std::vector<double> h;                // h[b]: best makespan over candidates (no memory), filled on demand
  std::vector<char> h_done;
  std::vector<double> cheap;            // cheap[b]: a lower bound of h[b] without simulating
  std::vector<char> cheap_done;
  std::vector<std::vector<double>> fbp;  // per candidate: forward[S], backward[S], p2p[S-1], weight[S], latency[S-1] per micro-batch
};

class Tables {
 public:
  Tables(const CostContext& ctx, std::vector<std::string> schedules, std::vector<int64_t> cands, int64_t G);

  const std::vector<int64_t>& cands() const { return cands_; }
  int64_t global_batch() const { return G_; }
  const CostContext& ctx() const { return ctx_; }

  // The table of devices DEV (stage order) with split BLOCKS under schedule SCHED, its links
  // shared with SHARES[s] - 1 other pipelines (S - 1 entries; null: none shared). Unshared tables
  // are lower bounds of shared ones (a slower link never ends a schedule sooner).
  ConfigTable* get(int sched, const int* dev, const int64_t* blocks, int S, const int* shares = nullptr);

  // Timing of B samples in micro-batches of cands[ci] (which must divide B).
  const PipeTiming& timing(ConfigTable& t, int64_t b, size_t ci);

  // Per micro-batch costs of a configuration at candidate CI: forward[S], backward[S], p2p[S-1],
  // weight[S] (zb-h1's weight passes).
  const std::vector<double>& costs(ConfigTable& t, size_t ci);

  // A lower bound of h without simulating: stage s cannot start before the first micro-batch
  // has crossed the stages before it, then does all its M forwards and backwards, and its last
  // gradient must still cross back: max_s sum_{s'<s}(f + p + b + p) + M (f_s + b_s); under a
  // split backward (zb-h1, weight passes after the last backward) only sum_{s'<s}(f + p). Scaled
  // down by 1e-12 so rounding in either computation never lifts it above the simulated value.
  double cheap_h(ConfigTable& t, int64_t b) {
    if (t.cheap_done[static_cast<size_t>(b)]) return t.cheap[static_cast<size_t>(b)];
    double best = kInf;
    const size_t S = static_cast<size_t>(t.S);
    const bool split = pipeline::splits_backward(schedules_[static_cast<size_t>(t.sched)]);
    for (size_t ci = 0; ci < cands_.size(); ++ci) {
      if (b % cands_[ci] != 0) continue;
      const std::vector<double>& x = costs(t, ci);
      const double M = static_cast<double>(b / cands_[ci]);
      double pre = 0, v = 0;
      for (size_t s = 0; s < S; ++s) {
        v = std::max(v, pre + M * (x[s] + x[S + s]));
        // zb-h1 runs weight passes after a stage's last backward: only the first activation's
        // way in bounds when the stage can start.
        if (s + 1 < S) pre += split ? x[s] + x[2 * S + s] : x[s] + x[S + s] + 2 * x[2 * S + s];
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
inline double minmax_allocate(const std::vector<const double*>& g, int64_t G, std::vector<int64_t>* choice) {
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
  Evaluator(const CostContext& ctx, Tables& tables, double bucket_bytes);

  int64_t evaluated = 0;
  bool force_dp = false;  // the exact search needs the exact batch split at any size

  // Step time of L (inf when nothing fits); with Optimize/FixedSamples it writes the chosen
  // samples and micro-batch sizes into L. The search compares layouts without the stragglers'
  // wait (cost_model.h, 5): that objective is deterministic in the layout, so the exact search
  // finds its optimum whatever order ties come in (the wait depends on how close the other
  // replicas come to the latest, which the min-max split leaves open). STRAGGLERS adds the wait:
  // the figure simulate_plan predicts, for the chosen plan.
  double evaluate(Layout& L, Batch mode, bool stragglers = false);

  // For the exact search: sync and memory of L's replicas without the batch split.
  void prepare(Layout& L);
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
        if (cap > 0 && !(need_bytes(t, s, d, pt, m, b / m) <= cap)) fits = false;
        v = std::max(v, pt.lbs[static_cast<size_t>(s)] + sync_at(d, m));
      }
      if (fits && v < best) best = v, best_m = m;
    }
    if (m_io) *m_io = best_m;
    return best;
  }

  // What rank S of a replica on device D needs at micro-batch size M (MBS of them): the cost
  // model's memory, or in relief mode (CostContext::memory_relief) the least that sharding and
  // recomputation allow.
  double need_bytes(const ConfigTable& t, int s, int d, const PipeTiming& pt, int64_t m, int64_t mbs) const {
    const size_t i = static_cast<size_t>(s);
    const double sends = ctx_.send_buffer_bytes(s == 0, s + 1 == t.S, mbs, m);
    if (ctx_.memory_relief())
      return ctx_.memory_floor_bytes(t.param[i], bucket_[static_cast<size_t>(d)], pt.peak[i], m, t.blocks[i], s == 0, s + 1 == t.S) +
             t.frozen[i] + sends;
    return ctx_.memory_bytes(t.param[i], bucket_[static_cast<size_t>(d)], pt.peak[i], m, t.act[i]) + t.frozen[i] + sends;
  }

  // Memory overflow of a layout at its batch split: bytes over capacity summed over ranks and a
  // sentence on the worst rank; for error messages.
  std::string overflow(Layout& L, double* total_over);

 private:
  // Exposed-sync term of device D at micro-batch size M (see the class comment).
  double sync_at(int d, int64_t m) const {
    double v = 0;
    for (const auto& [tail, off] : syncp_[static_cast<size_t>(d)]) v = std::max(v, tail + off.at(static_cast<double>(m)));
    return v;
  }

  // FIXED_MBS: the replicas' micro-batch sizes are final (Batch::Fixed), so their pipelines'
  // messages meet the sets at those sizes; otherwise at the smallest candidate (a lower bound).
  void compute_sync(const Layout& L, bool fixed_mbs = false);
  // tabs_ for L's replicas, their links shared as L's pipelines share them (CostContext::pipeline_link_shares).
  void fetch_tables(const Layout& L);
  std::vector<std::vector<int>> link_hosts_, link_shares_;

  // Buckets of one set and their tails; every member gets its (set, bucket) pairs.
  void add_set(const CostContext::SyncShape& shape, const int* members, size_t n, const std::vector<std::pair<int, double>>& units,
               double bytes);

  // Same sets, same unit order and sums as CostContext::sync_sets, with device bit masks.
  void collect_sets_masks(const Layout& L);

  // Large batches over many replicas (the DP would take R * G^2): start from shares proportional
  // to each replica's measured throughput (samples per second of phase at an even share), add the
  // remaining samples one feasible step at a time to the replica whose phase grows least (a
  // min-heap), then move k samples (k = 1 or a candidate size) off the slowest replica while that
  // lowers the maximum. Not exact when g is not monotone in b (micro-batch sizes must divide b),
  // which is why small instances use the DP.
  double greedy_allocate(Layout& L);
  // What waiting for the slowest replica's draw adds to LATEST, the latest replica's mean done
  // (cost_model.h, 5), at L's batch split.
  double straggler_s(Layout& L, double latest);
  std::vector<double> noise_;

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
    ctx.set_memory_relief(o.memory_relief);
    const int64_t mref = cands[cands.size() / 2];
    for (int t = 0; t < ctx.num_types(); ++t) speed.push_back(1.0 / ctx.full_model_s_per_sample(t, mref));
  }
  double dev_speed(int d) const { return speed[static_cast<size_t>(ctx.type_of(d))]; }
};

// Evaluates with the given batch mode; returns the step time (inf when it does not fit).
inline double eval(Problem& P, Layout& l, Batch mode) { return P.ev.evaluate(l, mode); }

// TOTAL into parts proportional to WEIGHTS, each >= 1 (largest remainder on what is left).
std::vector<int64_t> proportional_split(int64_t total, const std::vector<double>& weights);

// Input checks shared by every strategy: the global batch can be split, the model fits the pool.
void check_inputs(Problem& P);

// Throws InputError naming the closest of TRIED to fitting (the least bytes over capacity).
[[noreturn]] void no_fit(Problem& P, const std::string& strategy, std::vector<Layout>& tried);

// Uniform / proportional: pure DP if it fits, else the smallest depth dividing N that fits.
Layout baseline(Problem& P, const std::string& name, double* step);

// PTAFM-style: hosts grouped into stages, each replica a share of every stage group.
Layout ptafm_layout(Problem& P, double* step);

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
  Exact(Problem& P, bool symmetric, bool bounded);

  Layout best;
  double best_step = kInf;
  int64_t leaves = 0;

  void offer(Layout l);

  void run();

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

  std::vector<int> signature(const std::vector<int>& devs) const;

  // Orders (distinct class sequences when symmetric) x splits of a block; shared by every block
  // with the same class multiset, as positions into its devices sorted by (class, index).
  BlockInfo& info(const std::vector<int>& devs);

  std::vector<int> sorted_by_class(const std::vector<int>& devs) const;

  ConfigTable* table(const std::vector<int>& sorted, const Config& c, Replica* out);

  // Bounds of a block: per config its h row, and H = the min over configs; configs sorted by
  // their h at the block's proportional share of the batch, best first.
  void ensure_bounds(const std::vector<int>& devs, BlockInfo& bi);

  double partition_bound(const std::vector<std::vector<int>>& blocks);

  void walk(const std::vector<std::vector<int>>& blocks);

  void leaf(Layout& l);

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
  Heuristic(Problem& P, Clock::time_point t0);

  Layout best;
  double best_step = kInf;

  bool out_of_time() const { return seconds_since(t0_) > P_.opt.time_budget_s; }

  void offer(Layout l);

  void run();

  // Local search on layer boundaries: move one block across a boundary in every replica with the
  // same types and split (a template), keep what lowers the step time, until nothing does or the
  // time budget is spent.
  void improve();

 private:
  // Devices by host chain, then fastest first: contiguous slices are local.
  std::vector<int> locality_order() const;

  // Replica sizes for depth D: N / D replicas, the remainder one stage deeper each.
  std::vector<size_t> sizes(int d) const;

  // 0 local: consecutive slices of the locality order (pipelines inside a host or region);
  // 1 stage-major: stage s of every replica from the s-th slice (each stage group, and so each
  //   sync ring, inside a host or region; pipelines cross regions, as PTAFM does);
  // 2 typed: slices of the devices ordered by speed then locality (one type per pipeline);
  // 3 balanced: fastest devices dealt in snake order so replicas have equal total speed;
  // 4 folded stage-major: stage-major with the slices visited 0, 2, 4, ..., 5, 3, 1, so the
  //   first and last stages (which share a tied embedding) sit in neighbouring slices, and in one
  //   region when the pipeline crosses two.
  std::vector<std::vector<int>> form(int policy, int d) const;

  std::vector<int64_t> split_for(const std::vector<int>& devs);

  // One split for all replicas of equal depth, balanced on the stage groups' combined speed.
  bool align(Layout& l);

  Problem& P_;
  Clock::time_point t0_;
  std::vector<int> host_rank_;
  std::map<std::vector<int>, std::vector<int64_t>> split_cache_;
};

}  // namespace alloy::plan::detail
