#include "alloy/plan/planner.h"

#include <cmath>
#include <limits>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

namespace alloy::plan {
namespace {
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string ms(double s) { return fmt("%.1f ms", s * 1e3); }
std::string gib(double bytes) { return fmt("%.2f GiB", bytes / (1024.0 * 1024 * 1024)); }
std::string mib(double bytes) { return fmt("%.1f MiB", bytes / (1024.0 * 1024)); }
std::string mem(double bytes) { return bytes >= 1024.0 * 1024 * 1024 ? gib(bytes) : mib(bytes); }
std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (int x : ranks) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}
}  // namespace

ClusterSpec load_cluster(const std::string& path, int* ptafm_stages) {
  std::string text = read_file(path);
  if (text.find("NUM_STAGE") != std::string::npos) {
    PtafmCluster c = import_ptafm(path);
    if (ptafm_stages) *ptafm_stages = c.num_stages;
    return c.spec;
  }
  auto first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{' && text.find("\"workers\"") != std::string::npos)
    return import_hetero_config(path);
  return ClusterSpec::load(path);
}

std::string describe_profile(const Profile& p) {
  std::ostringstream o;
  o << "profile of " << p.model.arch << " (" << p.model.layers << " blocks, hidden " << p.model.hidden << ", seq "
    << p.model.seq_len << ")\n";
  for (const auto& [type, d] : p.devices) {
    o << "  " << type << ": block fwd " << ms(d.block_fwd.fixed_s) << " + " << ms(d.block_fwd.per_sample_s)
      << "/sample, bwd " << ms(d.block_bwd.fixed_s) << " + " << ms(d.block_bwd.per_sample_s) << "/sample; head fwd+bwd "
      << ms(d.head_fwd.per_sample_s + d.head_bwd.per_sample_s) << "/sample";
    if (d.comm_cpu_s_per_byte > 0) o << "; messages take " << fmt("%.2f", d.comm_cpu_s_per_byte * 1e9) << " ns of compute per byte";
    o << "\n";
  }
  for (const auto& l : p.links)
    o << "  link " << l.host_a << " <-> " << l.host_b << ": " << fmt("%.1f", l.bytes_per_s * 8 / 1e6) << " Mbit/s, latency "
      << fmt("%.2f", l.latency_s * 1e3) << " ms\n";
  for (const auto& t : p.tp_sums)
    o << "  tensor-parallel sum " << t.device_a << " + " << t.device_b << ": " << fmt("%.2f", t.seconds * 1e3) << " ms per sum of "
      << fmt("%.0f", t.bytes / 1024) << " KiB under compute\n";
  o << "  memory: " << mib(p.memory.param_bytes_per_block) << " parameters and "
    << mib(p.memory.act_bytes_per_sample_block) << " activations per sample per block\n";
  return o.str();
}

GradSyncConfig lossy_candidate(const GradSyncConfig& g) {
  GradSyncConfig c = g;
  c.compression = "dgc";
  c.scope = "slow-links";
  c.fusion = "saf-adaptive";
  return c;
}

namespace {
// Alloy trains on every device of the cluster (the search space, search.h). A device can still
// slow the step: a slow one behind a thin link that every layout must route through, or whose
// share costs more in messages and sync than it computes. The planner cannot leave it out of a
// run (the job has a rank per device), so it says which one and by how much, once, for the one
// whose absence gains most.
template <typename Run>
void note_device_left_out(SearchResult& chosen, const ClusterSpec& cluster, const SearchOptions& options, Run&& run) {
  const size_t n = cluster.devices.size();
  if (n < 2 || n > static_cast<size_t>(kLeaveOutMaxDevices) || !std::isfinite(chosen.cost.step_s)) return;
  double best = chosen.cost.step_s;
  std::string who;
  for (size_t d = 0; d < n; ++d) {
    ClusterSpec sub = cluster;
    sub.devices.erase(sub.devices.begin() + static_cast<long>(d));
    sub.source_lines.clear();
    SearchOptions o = options;
    o.suggest_leaving_out = false;
    try {
      const SearchResult x = run(sub, o);
      if (x.cost.step_s < best) best = x.cost.step_s, who = cluster.devices[d].name;
    } catch (const std::exception&) {
      // Nothing fits without it: it is needed.
    }
  }
  if (who.empty() || !(best < chosen.cost.step_s * (1 - kLeaveOutMinGain))) return;
  chosen.notes.push_back("device '" + who + "' slows the step: without it the plan is predicted " + ms(best) + " per step against " +
                         ms(chosen.cost.step_s) + " with it (" + fmt("%.0f", 100 * (1 - best / chosen.cost.step_s)) +
                         "% less), for the same global batch. Every device of the cluster gets a rank, so leave it out of the "
                         "cluster file to train without it");
}

// Each step pays for its pipelines' fill and drain, its gradient sums and its optimizer whatever
// its batch: on thin links or deep pipelines they are a large share of it, and a larger global
// batch spreads them over more samples. Whether to take it is the user's (it changes the
// optimisation: learning rate, steps), so the planner says what it would gain, once.
template <typename Run>
void note_larger_batch(SearchResult& chosen, const SearchOptions& options, Run&& run) {
  if (!std::isfinite(chosen.cost.step_s) || options.global_batch < 1) return;
  SearchOptions o = options;
  o.global_batch = 2 * options.global_batch;
  o.suggest_leaving_out = false;
  o.suggest_larger_batch = false;
  double step = 0;
  try {
    step = run(o).cost.step_s;
  } catch (const std::exception&) {
    return;  // it does not fit
  }
  // Samples per second at 2B over those at B.
  const double gain = 2 * chosen.cost.step_s / step - 1;
  if (!std::isfinite(step) || !(gain >= kLargerBatchMinGain)) return;
  chosen.notes.push_back("a global batch of " + std::to_string(o.global_batch) + " (train.global_batch) is predicted " + ms(step) +
                         " per step: " + fmt("%.0f", 100 * gain) + "% more samples per second than " +
                         std::to_string(options.global_batch) + " at " + ms(chosen.cost.step_s) +
                         " (pipeline fill and drain, gradient sums and the optimizer cost the same per step whatever the "
                         "batch); the plan keeps the batch given, since the batch changes the optimisation");
}
}  // namespace

PlanReport make_plan(const ClusterSpec& cluster, const Profile& profile, const SearchOptions& in_options, bool compare) {
  PlanReport r;
  SearchOptions options = in_options;
  auto run_on = [&](const ClusterSpec& cluster, const SearchOptions& o) {
    SearchResult x;
    try {
      x = search(cluster, profile, o);  // errors here are the user's: nothing fits
    } catch (const InputError&) {
      // Nothing fits one rank per stage: a tensor-parallel group holds a share of each block.
      if (o.strategy != "alloy" || !o.tensor_parallel) throw;
      x.strategy = "alloy";
      x.cost.step_s = std::numeric_limits<double>::infinity();
      consider_tensor_parallel(x, cluster, profile, o);
      if (x.plan.pipelines.empty()) throw;
      return x;
    }
    if (x.strategy == "alloy" && o.split_blocks) refine_units(x, cluster, profile, o);
    if (x.strategy == "alloy") refine_schedules(x, cluster, profile, o);
    if (x.strategy == "alloy") consider_short_micro_batches(x, cluster, profile, o);
    if (x.strategy == "alloy") tune_buckets(x, cluster, profile);
    if (x.strategy == "alloy" && o.tensor_parallel) consider_tensor_parallel(x, cluster, profile, o);
    // After the layout is settled (tensor-parallel stages are not interleaved): a schedule for it.
    if (x.strategy == "alloy" && o.interleave) consider_interleaving(x, cluster, profile, o);
    if (x.strategy == "alloy") note_eager_schedule(x, cluster, profile);
    return x;
  };
  auto run = [&](const SearchOptions& o) { return run_on(cluster, o); };
  r.chosen = run(options);
  const GradSyncConfig& g = options.grad_sync;
  if (g.lossy() || g.allow_lossy) {
    SearchOptions other = options;
    if (g.lossy()) other.grad_sync.compression = "none";
    else other.grad_sync = lossy_candidate(g);
    try {
      r.other_sync = run(other);
    } catch (const std::exception&) {
    }
    // allow_lossy: lossy compression only where it pays, by more than the model's noise.
    if (!g.lossy() && r.other_sync && r.other_sync->cost.step_s < r.chosen.cost.step_s * 0.95) {
      std::swap(r.chosen, *r.other_sync);
      options = other;
      r.chosen.notes.push_back("grad_sync.allow_lossy: chose " + options.grad_sync.compression + " across slow links");
    }
  }
  if (options.strategy == "alloy" && options.suggest_leaving_out) note_device_left_out(r.chosen, cluster, options, run_on);
  if (options.strategy == "alloy" && options.suggest_larger_batch) note_larger_batch(r.chosen, options, run);
  if (compare) {
    for (const std::string s : {"alloy", "uniform", "proportional", "ptafm"}) {
      if (s == options.strategy) continue;
      SearchOptions o = options;
      o.strategy = s;
      try {
        r.baselines.push_back(run(o));  // the alloy strategy with its refinement phases, as chosen above
      } catch (const std::exception& e) {
        r.failed.push_back(s + ": " + e.what());
      }
    }
  }
  return r;
}

PlanReport evaluate_plan(const Plan& plan, const std::string& where, const ModelConfig& model, const ClusterSpec& cluster,
                         const Profile& profile, const PlanReport& searched) {
  plan.validate(model, where);
  PlanReport r;
  r.chosen.plan = plan;
  r.chosen.cost = simulate_plan(plan, cluster, profile);
  r.chosen.search_step_s = r.chosen.cost.step_s;
  r.chosen.strategy = "given";
  r.chosen.notes.push_back("the plan of " + where + ", predicted, not searched");
  r.baselines.push_back(searched.chosen);
  r.baselines.insert(r.baselines.end(), searched.baselines.begin(), searched.baselines.end());
  r.failed = searched.failed;
  return r;
}

std::string PlanReport::text() const {
  std::ostringstream o;
  const PlanCost& c = chosen.cost;
  if (chosen.candidates_evaluated > 0)
    o << "plan (" << chosen.strategy << (chosen.exact ? ", optimal in its search space" : "") << ", "
      << chosen.candidates_evaluated << " candidates in " << fmt("%.2f", chosen.search_s) << " s):\n";
  else
    o << "plan (" << chosen.strategy << "):\n";
  o << chosen.plan.describe();
  o << "predicted step time " << ms(c.step_s) << ": pipeline phase " << ms(c.phase_s) << ", gradients synced at "
    << ms(c.sync_done_s);
  if (c.straggler_s > 0) o << " + " << ms(c.straggler_s) << " waiting for the slowest replica's draw";
  o << ", optimizer " << ms(c.optimizer_s);
  if (c.param_gather_s > 0) o << ", ZeRO parameter all-gather " << ms(c.param_gather_s);
  o << "\n";
  o << "  rank  device            blocks    fwd+bwd      p2p   bubble  sync(exposed)  memory / capacity\n";
  for (const auto& s : c.stages) {
    char line[512];
    // An interleaved rank: its chunks, "[0,1.5)+[2,3.5)".
    std::string blocks = s.chunk_units.empty() ? blocks_text(s.unit_begin, s.unit_end) : std::string();
    for (const auto& [b, e] : s.chunk_units) blocks += (blocks.empty() ? "" : "+") + blocks_text(b, e);
    std::snprintf(line, sizeof line, "  %4d  %-16s  %-8s  %9s %8s %8s  %13s  %s / %s%s\n", s.rank, s.device.c_str(),
                  blocks.c_str(), ms(s.forward_s + s.backward_s).c_str(),
                  ms(s.p2p_s).c_str(), ms(s.bubble_s).c_str(), ms(s.sync_exposed_s).c_str(), mem(s.memory_bytes).c_str(),
                  s.memory_capacity_bytes > 0 ? mem(s.memory_capacity_bytes).c_str() : "unknown", s.fits ? "" : "  DOES NOT FIT");
    o << line;
    if (s.tp > 1)
      o << "        tensor parallel x" << s.tp << ": compute of the slowest member, memory of the member likeliest not to fit; "
        << "the group's sums take " << ms(s.tp_comm_s) << " of the compute\n";
    if (s.zero_stage > 0 || s.recompute)
      o << "        " << (s.zero_stage > 0 ? fmt("ZeRO-%.0f", static_cast<double>(s.zero_stage)) + fmt(" share %.3g", s.shard) : std::string())
        << (s.zero_stage > 0 && s.recompute ? ", " : "") << (s.recompute ? "recomputes" : "") << ": weights " << mem(s.weight_bytes)
        << ", gradients " << mem(s.grad_bytes) << ", AdamW " << mem(s.optimizer_bytes) << ", buffers " << mem(s.bucket_bytes)
        << (s.gathered_bytes > 0 ? ", gathered " + mem(s.gathered_bytes) : std::string()) << ", activations " << mem(s.activation_bytes)
        << "\n";
  }
  for (const auto& n : chosen.notes) o << "  note: " << n << "\n";
  for (const auto& g : c.sync_groups)
    if (g.tree)
      o << "  note: ranks " << ranks_text(g.ranks) << " sum their gradients along "
        << (g.stripes > 1 ? std::to_string(g.stripes) + " trees, each a slice over slow links of its own," : std::string("a tree"))
        << " of their fast links (a ring would cross a slow one): " << fmt("%.0f Mbit/s", g.slowest_bytes_per_s * 8 / 1e6)
        << " at the most loaded link, " << mib(g.bytes) << " in " << ms(g.time_s) << "\n";
  auto sync_name = [](const GradSyncConfig& g) {
    if (!g.lossy()) return std::string("exact sync");
    std::string s = g.compression;
    if (g.compression != "fp16" && g.compression != "bf16" && g.compression != "powersgd") s += fmt(" %g", g.density);
    if (g.compression == "powersgd") s += " rank " + std::to_string(g.powersgd_rank);
    return s + (g.scope == "slow-links" ? " across slow links" : " everywhere");
  };
  if (chosen.plan.grad_sync.lossy() || other_sync) {
    o << "gradient sync: " << sync_name(chosen.plan.grad_sync) << ", predicted " << ms(c.step_s);
    if (other_sync)
      o << "; with " << sync_name(other_sync->plan.grad_sync) << ": " << ms(other_sync->cost.step_s) << " ("
        << fmt("%.2fx", other_sync->cost.step_s / c.step_s) << ")";
    o << "\n";
    for (const auto& g : c.sync_groups)
      if (g.compressed)
        o << "  ranks " << ranks_text(g.ranks) << ": " << (g.hierarchical ? fmt("hierarchical over %.0f regions", g.regions) : std::string("flat")) << ", "
          << mib(g.bytes) << " of gradients -> " << mib(g.wire_bytes) << " per member on the wire, sync " << ms(g.time_s)
          << " (codec " << ms(g.encode_s) << ")\n";
  }
  if (!baselines.empty() || !failed.empty()) {
    o << "compared with the other strategies on the same profile:\n";
    o << "  strategy       predicted step   vs " << chosen.strategy << "\n";
    auto row = [&](const SearchResult& s) {
      char line[160];
      std::snprintf(line, sizeof line, "  %-13s  %14s   %6.2fx\n", s.strategy.c_str(), ms(s.cost.step_s).c_str(),
                    s.cost.step_s / c.step_s);
      o << line;
    };
    row(chosen);
    for (const auto& b : baselines) row(b);
    for (const auto& f : failed) o << "  " << f << "\n";
  }
  return o.str();
}

std::string predicted_vs_measured(const nlohmann::json& pred, const nlohmann::json& ranks, double measured_step_s,
                                  const nlohmann::json* earlier) {
  if (!pred.is_object() || !pred.contains("per_stage")) return "";
  std::map<int, nlohmann::json> by_rank;
  for (const auto& r : ranks) by_rank[r.value("rank", -1)] = r;
  std::ostringstream o;
  const double ps = pred.value("step_s", 0.0);
  auto off = [&](double p) { return fmt("%+.1f%%", p > 0 ? 100.0 * (measured_step_s - p) / p : 0.0); };
  o << "predicted vs measured (median over steps";
  if (pred.contains("calibrated_after_step"))
    o << "; predicted with the speeds measured up to step " << pred["calibrated_after_step"].get<int64_t>() << ", the last calibration";
  o << "):\n";
  o << "  step time: predicted " << ms(ps) << ", measured " << ms(measured_step_s) << " (" << off(ps) << ")";
  if (earlier && earlier->is_object() && earlier->contains("step_s"))
    o << "; the plan's prediction before calibrating " << ms(earlier->value("step_s", 0.0)) << " (" << off(earlier->value("step_s", 0.0)) << ")";
  o << "\n";
  // Memory: the planner's figure for the rank against the peak the rank measured above what it held
  // before building its model (the CUDA allocator on a GPU, the heap on a CPU), so a user sees
  // whether the fits/does-not-fit verdicts can be trusted on their devices.
  o << "  rank  device            compute pred   compute meas   sync wait pred  sync wait meas     memory pred          memory meas\n";
  for (const auto& s : pred["per_stage"]) {
    int rank = s.value("rank", -1);
    const nlohmann::json none = nlohmann::json::object();
    const nlohmann::json& r = by_rank.count(rank) ? by_rank[rank] : none;
    double pc = s.value("forward_s", 0.0) + s.value("backward_s", 0.0);
    const double pm = s.value("memory_bytes", 0.0), mm = r.value("model_memory_bytes", 0.0);
    std::string meas_mem = mm > 0 ? mem(mm) : std::string("-");
    if (pm > 0 && mm > 0) meas_mem += fmt(" (%+.0f%%)", 100.0 * (mm - pm) / pm);
    char line[260];
    std::snprintf(line, sizeof line, "  %4d  %-16s  %13s  %13s  %14s  %14s  %14s  %19s\n", rank, s.value("device", std::string()).c_str(),
                  ms(pc).c_str(), ms(r.value("compute_s_median", 0.0)).c_str(), ms(s.value("sync_exposed_s", 0.0)).c_str(),
                  ms(r.value("sync_wait_s_median", 0.0)).c_str(), pm > 0 ? mem(pm).c_str() : "-", meas_mem.c_str());
    o << line;
  }
  return o.str();
}

}  // namespace alloy::plan
