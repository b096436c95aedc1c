#include "alloy/train/run_plan.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/dist/world.h"
#include "alloy/plan/replanner.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/profiler.h"
#include "alloy/plan/sync_scope.h"
#include "alloy/train/checkpoint.h"

namespace alloy::train {

namespace {

std::string cluster_path(const PlanSources& src) {
  if (!src.cluster.empty()) return src.cluster;
  const char* env = std::getenv("ALLOY_CLUSTER");
  return env ? env : "";
}

// --plan auto: profile the ranks (or reuse a profile), then rank 0 searches and hands the plan to
// the others through the store, so every rank runs the same plan even if the search's time
// budget would cut differently on different machines.
AutoPlan auto_plan(const Config& cfg, const PlanSources& src, dist::World* world) {
  const std::string path = cluster_path(src);
  if (path.empty()) throw InputError("--plan auto", "needs the cluster: --cluster FILE (or run under `alloy launch --emulate FILE`)");
  int ptafm_stages = 0;
  plan::ClusterSpec spec = plan::load_cluster(path, &ptafm_stages);
  const int rank = world ? world->rank() : 0;
  if (const auto members = elastic_members(); !members.empty()) {
    const char* pool = std::getenv("ALLOY_POOL_SIZE");
    const int pool_size = pool ? std::atoi(pool) : static_cast<int>(spec.devices.size());
    if (static_cast<int>(members.size()) < pool_size) {
      spec = spec_of_members(spec, members, pool_size);
      std::string names;
      for (const auto& d : spec.devices) names += (names.empty() ? "" : ", ") + d.name;
      if (rank == 0)
        log_warn("elastic: " + std::to_string(members.size()) + " of " + std::to_string(pool_size) + " devices of " + path +
                 " are here (" + names + "): planning onto them");
    }
  }
  std::string reuse = !src.profile.empty() ? src.profile : cfg.output.dir + "/profile.json";
  plan::Profile prof;
  bool have = false;
  if (file_exists(reuse)) {
    prof = plan::Profile::load(reuse);
    const std::string why = prof.mismatch(cfg);
    have = why.empty();
    if (!have && !src.profile.empty()) throw InputError(src.profile, why);
    if (have && rank == 0) log_info("reusing the profile " + reuse);
  }
  if (!have) {
    if (rank == 0) log_info("profiling " + std::to_string(spec.devices.size()) + " devices of " + path);
    plan::ProfileOptions po;
    po.device = rank_device(cfg);
    po.lora = cfg.lora;
    prof = plan::run_profile(cfg.model, spec, world, po);
    if (rank == 0) {
      ensure_writable_dir(cfg.output.dir);
      prof.save(cfg.output.dir + "/profile.json");
      std::printf("%s", plan::describe_profile(prof).c_str());
    }
  }
  std::string plan_json;
  plan::SearchOptions so;
  so.global_batch = cfg.train.global_batch;
  so.ptafm_stages = ptafm_stages;
  so.grad_sync = cfg.grad_sync;
  so.sequence_parallel = cfg.train.sequence_parallel;
  if (rank == 0) {
    try {
      auto report = plan::make_plan(spec, prof, so, true);
      std::printf("%s", report.text().c_str());
      std::fflush(stdout);
      so.grad_sync = report.chosen.plan.grad_sync;  // re-planning searches under the sync chosen here
      Plan p = report.chosen.plan;
      p.predicted = report.chosen.cost.to_json();
      plan_json = p.to_json().dump();
    } catch (const std::exception&) {
      if (world) world->store().set("alloy/autoplan", std::vector<uint8_t>{'!'});
      throw;
    }
    if (world) world->store().set("alloy/autoplan", std::vector<uint8_t>(plan_json.begin(), plan_json.end()));
  } else {
    world->store().wait({"alloy/autoplan"});
    auto b = world->store().get("alloy/autoplan");
    plan_json.assign(b.begin(), b.end());
    if (plan_json == "!") throw Error("rank 0 found no plan that fits (see its error)");
  }
  Plan p = Plan::from_json(nlohmann::json::parse(plan_json), "the automatic plan");
  so.grad_sync = p.grad_sync;
  return {p, spec, prof, so};
}

Plan equal_data_parallel(const Config& cfg, int n) {
  const int64_t gb = cfg.train.global_batch;
  if (gb % n != 0)
    throw InputError("train.global_batch", std::to_string(gb) + " does not split evenly over " + std::to_string(n) +
                                               " ranks; give a --plan or SynerFuse flags for an uneven split");
  int64_t per = gb / n, mbs = std::min<int64_t>(per, cfg.train.micro_batch_resolved());
  if (per % mbs != 0) mbs = per;
  return Plan::data_parallel(cfg.model.layers, std::vector<std::pair<int64_t, int64_t>>(static_cast<size_t>(n), {mbs, per / mbs}));
}

// Rank 0's side of train.replan_step: plan::Replanner decides, and every decision is recorded in
// OUTPUT/replan.json with the speeds measured (profile-calibrated.json, for `alloy plan
// --profile`: a later job on the same pool, or predicting other plans with them).
struct Replanning {
  std::unique_ptr<plan::Replanner> replanner;
  std::shared_ptr<nlohmann::json> calibrated = std::make_shared<nlohmann::json>();  // TrainOptions::calibrated_prediction
};

std::shared_ptr<Plan> replan_from_measured(Replanning& st, const Config& cfg, int64_t from, int64_t to,
                                           const std::map<int, double>& measured, const std::map<int, double>& phase,
                                           double step_s) {
  std::shared_ptr<Plan> next = st.replanner->measured(from, to, measured, phase, step_s);
  *st.calibrated = st.replanner->calibrated_prediction();
  st.replanner->calibrated_profile().save(cfg.output.dir + "/profile-calibrated.json");
  nlohmann::json doc = {{"format", "alloy-replan"}, {"version", 1}, {"replans", st.replanner->events()}};
  write_file_atomic(cfg.output.dir + "/replan.json", doc.dump(2) + "\n");
  return next;
}

// OUTPUT/membership.json: one entry per start of an elastic job (which devices, which plan), so
// a user can see when the pool shrank or grew without collecting the launcher's log.
void record_membership(const Config& cfg, const ResolvedPlan& rp, int world_size) {
  const std::string path = cfg.output.dir + "/membership.json";
  nlohmann::json doc = {{"format", "alloy-membership"}, {"version", 1}, {"starts", nlohmann::json::array()}};
  if (file_exists(path)) {
    try {
      auto old = nlohmann::json::parse(read_file(path));
      if (old.value("format", "") == "alloy-membership" && old.contains("starts") && old["starts"].is_array()) doc = old;
    } catch (const std::exception&) {
      log_warn(path + " is not readable JSON: starting it afresh");
    }
  }
  const std::time_t now = std::time(nullptr);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const char* pool = std::getenv("ALLOY_POOL_SIZE");
  nlohmann::json e = {{"time", ts}, {"launch", restart_count()}, {"members", elastic_members()}, {"world_size", world_size},
                      {"pool_size", pool ? std::atoi(pool) : world_size}};
  if (rp.autoplan) {
    std::vector<std::string> names;
    for (const auto& d : rp.autoplan->spec.devices) names.push_back(d.name);
    e["devices"] = names;
    e["predicted_step_s"] = rp.autoplan->plan.predicted.value("step_s", 0.0);
  }
  if (rp.plan) e["plan"] = rp.plan->describe();
  doc["starts"].push_back(e);
  ensure_writable_dir(cfg.output.dir);
  write_file_atomic(path, doc.dump(2) + "\n");
}

}  // namespace

bool synerfuse_given(const SynerFuseArgs& a) {
  return !a.hetero_pipeline_stages.empty() || !a.micro_batch_size_per_dp.empty() || !a.num_micro_batches_per_dp.empty() ||
         a.pipeline_model_parallel_size > 1 || a.tensor_model_parallel_size > 1 || !a.tp_split.empty() ||
         a.layers_per_virtual_stage != 0;
}

std::vector<int> elastic_members() {
  std::vector<int> out;
  const char* env = std::getenv("ALLOY_MEMBERS");
  if (!env || !*env) return out;
  std::string s = env;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    const std::string item = s.substr(pos, comma - pos);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 6)
      throw InputError("ALLOY_MEMBERS", "'" + s + "' is not a comma-separated list of slot numbers");
    out.push_back(std::stoi(item));
    pos = comma + 1;
  }
  return out;
}

plan::ClusterSpec spec_of_members(const plan::ClusterSpec& spec, const std::vector<int>& members, int pool_size) {
  if (static_cast<int>(spec.devices.size()) != pool_size)
    throw InputError(spec.source.empty() ? "cluster" : spec.source,
                     "has " + std::to_string(spec.devices.size()) + " devices but the elastic launch has " + std::to_string(pool_size) +
                         " slots: launch one rank per device of the cluster");
  plan::ClusterSpec out = spec;
  out.devices.clear();
  for (int m : members) {
    if (m < 0 || m >= pool_size)
      throw InputError("ALLOY_MEMBERS", "slot " + std::to_string(m) + " is outside the pool of " + std::to_string(pool_size));
    out.devices.push_back(spec.devices[static_cast<size_t>(m)]);
  }
  out.source_lines.clear();  // lines of the file no longer match device indices
  return out;
}

// Linux restarts a TCP connection's window after it idled for a retransmission timeout, and a
// gradient sum crosses its link once a step: over an emulated 40 ms, 0.1 Gbit/s link a 2 MB message
// after 3 s idle took 657 ms against 245 ms without the restart. Said once, by the first rank, where
// the cluster has distant links and this host restarts (the emulator turns it off in its hosts).
static void advise_tcp_for_distant_links(const std::string& cluster_file) {
  constexpr double kDistantMs = 5;
  plan::ClusterSpec spec;
  try {
    spec = plan::load_cluster(cluster_file);
  } catch (const std::exception&) {
    return;  // planning reports a bad cluster file, with its reasons
  }
  const auto hosts = spec.hosts();
  double worst = 0;
  for (const auto& a : hosts)
    for (const auto& b : hosts)
      if (a != b) worst = std::max(worst, spec.link(a, b).latency_ms);
  if (worst < kDistantMs) return;
  std::ifstream f("/proc/sys/net/ipv4/tcp_slow_start_after_idle");
  int restart = 0;
  if (!(f >> restart) || restart == 0) return;
  log_warn(cluster_file + " has links of up to " + std::to_string(static_cast<int>(worst)) +
           " ms: this host restarts TCP's window after every idle period (net.ipv4.tcp_slow_start_after_idle = 1), so "
           "each step's gradient sums across them start slowly (a 2 MB sum over 40 ms: 2.7x the time); on every host: "
           "sysctl -w net.ipv4.tcp_slow_start_after_idle=0");
}

ResolvedPlan resolve_plan(const Config& cfg, const PlanSources& src, int world_size, dist::World* world) {
  if (const std::string path = cluster_path(src); !path.empty() && world_size > 1 && (!world || world->rank() == 0))
    advise_tcp_for_distant_links(path);
  if (const auto members = elastic_members(); !members.empty()) {
    const char* pool = std::getenv("ALLOY_POOL_SIZE");
    const int pool_size = pool ? std::atoi(pool) : world_size;
    if (pool_size > world_size && src.plan_file != "auto" && (!src.plan_file.empty() || !src.hetero_config.empty() || synerfuse_given(src.synerfuse)))
      throw InputError(src.plan_file.empty() ? (src.hetero_config.empty() ? "SynerFuse flags" : src.hetero_config) : src.plan_file,
                       "lays out " + std::to_string(pool_size) + " ranks, but only " + std::to_string(world_size) +
                           " devices are left after a failure (slots " + std::getenv("ALLOY_MEMBERS") +
                           "): going on without the others needs --plan auto, which re-plans onto the devices that are there");
  }
  ResolvedPlan out;
  bool from_file = false;
  std::string where = "plan";
  if (src.plan_file == "auto") {
    out.autoplan = std::make_shared<AutoPlan>(auto_plan(cfg, src, world));
    out.plan = std::make_shared<Plan>(out.autoplan->plan);
  } else if (!src.plan_file.empty()) {
    out.plan = std::make_shared<Plan>(Plan::load(src.plan_file));
    from_file = true;
    where = src.plan_file;
  } else if (!src.hetero_config.empty()) {
    out.plan = std::make_shared<Plan>(plan_from_hetero_config_file(src.hetero_config, cfg.model.layers, cfg.train.global_batch,
                                                                   cfg.train.micro_batch_resolved()));
  } else if (synerfuse_given(src.synerfuse)) {
    SynerFuseArgs sf = src.synerfuse;
    sf.num_layers = cfg.model.layers;
    sf.num_attention_heads = cfg.model.heads;
    if (sf.tensor_model_parallel_size == 1 && !sf.tp_split.empty())
      sf.tensor_model_parallel_size = static_cast<int64_t>(sf.tp_split.size());  // --tp-split alone says how many
    sf.global_batch_size = cfg.train.global_batch;
    if (sf.micro_batch_size <= 0) sf.micro_batch_size = default_micro_batch(cfg, sf, world_size);
    sf.world_size = world_size;
    out.plan = std::make_shared<Plan>(plan_from_synerfuse(sf));
  } else if (world_size > 1) {
    out.plan = std::make_shared<Plan>(equal_data_parallel(cfg, world_size));
  }
  if (!out.plan) {
    if (cfg.grad_sync.lossy() && world_size <= 1)
      log_warn("grad_sync.compression " + cfg.grad_sync.compression + " has nothing to do: one rank holds every parameter");
    return out;
  }
  out.plan->validate(cfg.model, where);
  // The planner chose the automatic plan's sync from the config (allow_lossy may have made it
  // compress): keep it, like a plan file's, but for the keys the config sets explicitly.
  plan::apply_grad_sync(*out.plan, cfg, from_file || out.autoplan, where);
  if (plan::needs_slow_links(out.plan->grad_sync)) {
    const std::string path = cluster_path(src);
    if (!path.empty()) {
      plan::ClusterSpec spec = out.autoplan ? out.autoplan->spec : plan::load_cluster(path);
      out.plan->slow_links = plan::slow_rank_pairs(*out.plan, spec, out.plan->grad_sync);
    } else if (out.plan->slow_links.empty() && out.plan->grad_sync.lossy()) {
      throw InputError("grad_sync.scope", "slow-links needs to know which links are slow: --cluster FILE (or `alloy launch "
                                          "--emulate FILE`), or slow_links in the plan's grad_sync");
    }
  }
  if (out.autoplan) out.autoplan->plan = *out.plan;
  if (!elastic_members().empty() && (!world || world->rank() == 0)) record_membership(cfg, out, world_size);
  return out;
}

TrainResult train_with_replanning(const Config& cfg, TrainOptions o, const ResolvedPlan& rp) {
  o.plan = rp.plan;
  // Up to kMaxReplans switches, each replan_step steps after the previous one. The first plan is
  // measured again replan_step steps later when its first measurement keeps it
  // (TrainOptions::remeasure_after); after that, the first calibration that finds nothing better
  // ends it.
  constexpr int kMaxReplans = 2;
  auto replanning = std::make_shared<Replanning>();
  int64_t measured_from = 2;
  if (rp.autoplan && o.world && cfg.train.replan_step > 0) {
    replanning->replanner = std::make_unique<plan::Replanner>(rp.autoplan->plan, rp.autoplan->spec, rp.autoplan->profile,
                                                              rp.autoplan->options);
    o.calibrated_prediction = replanning->calibrated;
    o.replan_at = cfg.train.replan_step;
    o.remeasure_after = cfg.train.replan_step;  // the first plan only (below)
    o.replan = [replanning, &cfg, &measured_from](int64_t step, const std::map<int, double>& measured,
                                                  const std::map<int, double>& phase, double step_s) {
      return replan_from_measured(*replanning, cfg, measured_from, step, measured, phase, step_s);
    };
  }
  // A re-plan ends a run early at a checkpoint; the next one resumes from it under the new plan,
  // with its own process groups.
  TrainResult all;
  for (int generation = 1;; ++generation) {
    TrainResult r;
    {
      Trainer trainer(cfg, o);
      r = trainer.run();
    }
    all.steps.insert(all.steps.end(), r.steps.begin(), r.steps.end());
    all.val_loss.insert(all.val_loss.end(), r.val_loss.begin(), r.val_loss.end());
    all.checkpoint = r.checkpoint;
    all.peak_activation_bytes = std::max(all.peak_activation_bytes, r.peak_activation_bytes);
    all.peak_in_flight = std::max(all.peak_in_flight, r.peak_in_flight);
    all.peak_grad_bytes = std::max(all.peak_grad_bytes, r.peak_grad_bytes);
    all.peak_model_memory_bytes = std::max(all.peak_model_memory_bytes, r.peak_model_memory_bytes);
    all.stopped_for_rejoin = r.stopped_for_rejoin;
    all.checkpoints += r.checkpoints;
    all.checkpoint_pause_s += r.checkpoint_pause_s;
    if (!r.next_plan) break;
    o.plan = r.next_plan;
    o.resume = r.checkpoint;
    o.init_weights.clear();
    const int64_t switched_at = r.steps.empty() ? o.replan_at : r.steps.back().step;  // at the first measurement or the second
    measured_from = switched_at + 2;  // a new layout's first step warms up too
    o.replan_at = generation < kMaxReplans ? switched_at + cfg.train.replan_step : 0;
    o.remeasure_after = 0;
    o.generation = "plan" + std::to_string(generation + 1) + "/";
  }
  return all;
}

// How many times the job has been restarted: by `alloy launch --max-restarts`, torchrun or SLURM.
int restart_count() {
  for (const char* v : {"ALLOY_RESTART", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"})
    if (const char* s = std::getenv(v); s && *s) {
      try {
        if (std::stoi(s) > 0) return std::stoi(s);
      } catch (const std::exception&) {
      }
    }
  return 0;
}

// The run directory's last complete checkpoint ("" when it has none yet): rank 0 looks, every rank
// takes its word through the store, so all resume from the same step (or all start afresh).
std::string last_checkpoint_agreed(const Config& cfg, dist::World* world) {
  const int rank = world ? world->rank() : 0;
  std::string dir;
  if (rank == 0 && file_exists(cfg.output.dir + "/checkpoints/latest")) dir = resolve_checkpoint(cfg.output.dir);
  if (world) {
    const std::string key = "alloy/auto-resume";
    if (rank == 0) world->store().set(key, std::vector<uint8_t>(dir.begin(), dir.end()));
    world->store().wait({key});
    const auto b = world->store().get(key);
    dir.assign(b.begin(), b.end());
  }
  if (rank == 0)
    log_info(dir.empty() ? "restarted with no checkpoint in " + cfg.output.dir + " yet: starting from step 0"
                         : "restarted: resuming from " + dir);
  return dir;
}

}  // namespace alloy::train
