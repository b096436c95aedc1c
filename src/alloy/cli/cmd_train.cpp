#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <thread>
#include <cstdio>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "alloy/dist/rendezvous.h"
#include "alloy/dist/world.h"
#include "alloy/core/fs.h"
#include "alloy/plan/calibrate.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/profiler.h"
#include <torch/csrc/distributed/c10d/Store.hpp>
#include "alloy/train/trainer.h"

namespace alloy::cli {

namespace {
struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool resume = false;
  std::string resume_from, init_weights, plan_file, hetero_config, trace, cluster, profile;
  dist::RendezvousFlags rv;
  double timeout_s = 300;
  SynerFuseArgs sf;
  bool tp_pp_dp_mapping = false;
};

void print_summary(const train::TrainResult& r) {
  if (r.steps.empty()) return;
  std::printf("\nloss curve (step: train loss%s)\n", r.val_loss.empty() ? "" : " | validation loss");
  const size_t n = r.steps.size();
  const size_t points = std::min<size_t>(n, 10);
  for (size_t i = 0; i < points; ++i) {
    size_t k = points == 1 ? n - 1 : i * (n - 1) / (points - 1);
    const auto& s = r.steps[k];
    std::printf("  step %6lld: %.4f", static_cast<long long>(s.step), s.loss);
    for (const auto& [vs, vl] : r.val_loss)
      if (vs == s.step) std::printf(" | %.4f", vl);
    std::printf("\n");
  }
  if (!r.val_loss.empty())
    std::printf("validation loss: %.4f at step %lld -> %.4f at step %lld\n", r.val_loss.front().second,
                static_cast<long long>(r.val_loss.front().first), r.val_loss.back().second,
                static_cast<long long>(r.val_loss.back().first));
  double tps = 0;
  for (const auto& s : r.steps) tps += s.tokens_per_s;
  std::printf("mean throughput: %.0f tokens/s\n", tps / static_cast<double>(n));
}

struct AutoPlan {
  Plan plan;
  plan::ClusterSpec spec;
  plan::Profile profile;  // complete on rank 0 only
  plan::SearchOptions options;
};

// --plan auto: profile the ranks (or reuse a profile), then rank 0 searches and hands the plan to
// the others through the store, so every rank runs the same plan even if the search's time
// budget would cut differently on different machines.
AutoPlan auto_plan(const Config& cfg, const TrainArgs& a, dist::World* world) {
  const char* env = std::getenv("ALLOY_CLUSTER");
  std::string cluster_path = !a.cluster.empty() ? a.cluster : env ? env : "";
  if (cluster_path.empty())
    throw InputError("--plan auto", "needs the cluster: --cluster FILE (or run under `alloy launch --emulate FILE`)");
  int ptafm_stages = 0;
  plan::ClusterSpec spec = plan::load_cluster(cluster_path, &ptafm_stages);
  const int rank = world ? world->rank() : 0;
  std::string reuse = !a.profile.empty() ? a.profile : cfg.output.dir + "/profile.json";
  plan::Profile prof;
  bool have = false;
  if (file_exists(reuse)) {
    prof = plan::Profile::load(reuse);
    have = model_differences(prof.model, cfg.model).empty();
    if (!have && !a.profile.empty()) throw InputError(a.profile, "was measured for another model");
    if (have && rank == 0) log_info("reusing the profile " + reuse);
  }
  if (!have) {
    if (rank == 0) log_info("profiling " + std::to_string(spec.devices.size()) + " devices of " + cluster_path);
    plan::ProfileOptions po;
    po.device = train::rank_device(cfg);
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
  if (rank == 0) {
    try {
      auto report = plan::make_plan(spec, prof, so, true);
      std::printf("%s", report.text().c_str());
      std::fflush(stdout);
      Plan p = report.chosen.plan;
      p.predicted = report.chosen.cost.to_json();
      plan_json = p.to_json().dump();
    } catch (const std::exception& e) {
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
  return {Plan::from_json(nlohmann::json::parse(plan_json), "the automatic plan"), spec, prof, so};
}

// Rank 0's side of train.replan_step: calibrate the profile with the compute each rank measured
// in steps FROM..TO under the running plan, search again, record it in OUTPUT/replan.json, and
// return the plan to switch to, if any. After a switch the calibrated profile and the new plan
// become the running ones, so a later call corrects what the first calibration got wrong (the
// profile's shape across micro-batch sizes, e.g.).
struct Replanning {
  AutoPlan ap;
  nlohmann::json events = nlohmann::json::array();
};
std::shared_ptr<Plan> replan_from_measured(Replanning& st, const Config& cfg, int64_t from, int64_t to,
                                           const std::map<int, double>& measured, const std::map<int, double>& phase) {
  AutoPlan& ap = st.ap;
  plan::Calibration cal = plan::calibrate(ap.plan, ap.spec, ap.profile, measured);
  plan::Replan rp = plan::replan(ap.plan, ap.spec, cal, ap.options, 0.05, &phase);
  log_info("re-planning with the compute measured in steps " + std::to_string(from) + "-" + std::to_string(to) + ":\n" +
           cal.text + rp.text);
  nlohmann::json m = nlohmann::json::object(), f = nlohmann::json::object();
  nlohmann::json ph = nlohmann::json::object();
  for (const auto& [r, v] : measured) m[std::to_string(r)] = v;
  for (const auto& [r, v] : phase) ph[std::to_string(r)] = v;
  for (const auto& [t, v] : cal.factor) f[t] = v;
  nlohmann::json e = {{"step", to},
                      {"measured_compute_s", m},
                      {"measured_phase_s", ph},
                      {"factors", f},
                      {"running_plan_predicted_s", ap.plan.predicted.value("step_s", 0.0)},
                      {"running_plan_calibrated_s", rp.current.step_s},
                      {"best_calibrated_s", rp.best.step_s},
                      {"switched", rp.change}};
  if (rp.split)
    e["rebalance"] = {{"pipeline_factors", rp.split->factor},
                      {"running_split_s", rp.split->current_s},
                      {"best_split_s", rp.split->best_s},
                      {"switched", rp.split->change}};
  if (rp.change) e["plan"] = rp.plan.to_json();
  st.events.push_back(e);
  // The speeds this run measured, for `alloy plan --profile` (a later job on the same pool, or
  // predicting other plans with them).
  cal.profile.save(cfg.output.dir + "/profile-calibrated.json");
  nlohmann::json doc = {{"format", "alloy-replan"}, {"version", 1}, {"replans", st.events}};
  write_file_atomic(cfg.output.dir + "/replan.json", doc.dump(2) + "\n");
  if (!rp.change) return nullptr;
  ap.plan = rp.plan;
  ap.profile = cal.profile;
  return std::make_shared<Plan>(rp.plan);
}

bool synerfuse_given(const SynerFuseArgs& a) {
  return !a.hetero_pipeline_stages.empty() || !a.micro_batch_size_per_dp.empty() || !a.num_micro_batches_per_dp.empty() ||
         a.pipeline_model_parallel_size > 1;
}
}  // namespace

void add_train_commands(CLI::App& app, Action& action) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a model: on one device, or as one rank of a distributed plan");
  cmd->add_option("-c,--config", a->config, "YAML config with sections model, data, train, output")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", a->sets, "Override a config key: --set section.key=value (repeatable)");
  cmd->add_flag("--resume", a->resume, "Resume from the latest checkpoint in output.dir");
  cmd->add_option("--resume-from", a->resume_from, "Resume from this checkpoint or run directory");
  cmd->add_option("--init-weights", a->init_weights, "Start from these weights (safetensors or checkpoint), fresh optimizer");

  auto* g_plan = "Parallel plan (default: one device; with several ranks and no plan, equal data parallelism)";
  cmd->add_option("--plan", a->plan_file, "Plan JSON (see `alloy plan`), or `auto`: profile (or reuse --profile), plan, train")
      ->group(g_plan);
  cmd->add_option("--cluster", a->cluster, "ClusterSpec for --plan auto (default: $ALLOY_CLUSTER, set by `alloy launch --emulate`)")
      ->group(g_plan);
  cmd->add_option("--profile", a->profile, "Profile for --plan auto (default: OUTPUT/profile.json if it matches, else measure)")
      ->group(g_plan);
  cmd->add_option("--hetero-config", a->hetero_config, "HeteroShard hetero_config.json: its shard_plan becomes the plan")
      ->group(g_plan)->check(CLI::ExistingFile);
  cmd->add_option("--trace", a->trace, "Write a Chrome trace (chrome://tracing, Perfetto) of one step's schedule, all ranks")
      ->group(g_plan);

  auto* g_sf = "SynerFuse / Megatron flags (instead of a plan)";
  cmd->add_option("--num-layers", a->sf.num_layers, "Transformer blocks (must match model.layers)")->group(g_sf);
  cmd->add_option("--pipeline-model-parallel-size", a->sf.pipeline_model_parallel_size, "Pipeline stages")->group(g_sf);
  cmd->add_option("--tensor-model-parallel-size", a->sf.tensor_model_parallel_size, "Only 1 is supported")->group(g_sf);
  cmd->add_option("--global-batch-size", a->sf.global_batch_size, "Overrides train.global_batch")->group(g_sf);
  cmd->add_option("--micro-batch-size", a->sf.micro_batch_size, "Uniform micro-batch size")->group(g_sf);
  cmd->add_option("--hetero-pipeline-stages", a->sf.hetero_pipeline_stages, "n0 l00 l01 ... n1 l10 ...: layers per stage")
      ->group(g_sf);
  cmd->add_option("--micro-batch-size-per-dp", a->sf.micro_batch_size_per_dp, "n0 mbs0 n1 mbs1 ...")->group(g_sf);
  cmd->add_option("--num-micro-batches-per-dp", a->sf.num_micro_batches_per_dp, "n0 nmb0 n1 nmb1 ...")->group(g_sf);
  cmd->add_flag("--use-tp-pp-dp-mapping", a->tp_pp_dp_mapping, "Accepted for SynerFuse compatibility (always on)")->group(g_sf);

  auto* g_rv = "Rendezvous (default: torchrun or SLURM variables, else one process)";
  cmd->add_option("--rank", a->rv.rank, "This process's rank")->group(g_rv);
  cmd->add_option("--world-size", a->rv.world_size, "Number of ranks")->group(g_rv);
  cmd->add_option("--master-addr", a->rv.master_addr, "Host of rank 0 (the rendezvous store)")->group(g_rv);
  cmd->add_option("--master-port", a->rv.master_port, "Port of the rendezvous store")->group(g_rv);
  cmd->add_option("--dist-url", a->rv.dist_url, "tcp://HOST:PORT (PTAFM style)")->group(g_rv);
  cmd->add_option("--timeout", a->timeout_s, "Seconds any collective or rendezvous may take before the job fails")
      ->group(g_rv)->capture_default_str();
  cmd->footer("Config keys (section.key, help, type and default):\n" + config_reference());

  cmd->callback([a, &action]() {
    action = [a]() {
      Config cfg = Config::load(a->config, a->sets);
      dist::Rendezvous rv = dist::resolve_rendezvous(a->rv);
      if (a->sf.global_batch_size > 0) cfg.train.global_batch = a->sf.global_batch_size;
      if (a->sf.num_layers > 0 && a->sf.num_layers != cfg.model.layers)
        throw InputError("--num-layers", std::to_string(a->sf.num_layers) + " differs from model.layers " +
                                             std::to_string(cfg.model.layers) + " in " + a->config);
      std::shared_ptr<dist::World> world;
      if (rv.world_size > 1) {
        if (!std::getenv("ALLOY_OUTPUT_PREFIXED")) set_log_prefix("[rank " + std::to_string(rv.rank) + "] ");
        world = dist::World::create(rv, std::chrono::milliseconds(static_cast<int64_t>(a->timeout_s * 1000)));
      }
      try {
        std::shared_ptr<Plan> plan;
        std::shared_ptr<AutoPlan> ap;
        if (a->plan_file == "auto") {
          ap = std::make_shared<AutoPlan>(auto_plan(cfg, *a, world.get()));
          plan = std::make_shared<Plan>(ap->plan);
        } else if (!a->plan_file.empty()) {
          plan = std::make_shared<Plan>(Plan::load(a->plan_file));
        } else if (!a->hetero_config.empty()) {
          plan = std::make_shared<Plan>(plan_from_hetero_config_file(a->hetero_config, cfg.model.layers, cfg.train.global_batch,
                                                                     cfg.train.micro_batch_resolved()));
        } else if (synerfuse_given(a->sf)) {
          SynerFuseArgs sf = a->sf;
          sf.num_layers = cfg.model.layers;
          sf.global_batch_size = cfg.train.global_batch;
          if (sf.micro_batch_size <= 0) sf.micro_batch_size = default_micro_batch(cfg, sf, rv.world_size);
          sf.world_size = rv.world_size;
          plan = std::make_shared<Plan>(plan_from_synerfuse(sf));
        } else if (rv.world_size > 1) {
          int64_t gb = cfg.train.global_batch, n = rv.world_size;
          if (gb % n != 0)
            throw InputError("train.global_batch", std::to_string(gb) + " does not split evenly over " + std::to_string(n) +
                                                       " ranks; give a --plan or SynerFuse flags for an uneven split");
          int64_t per = gb / n, mbs = std::min<int64_t>(per, cfg.train.micro_batch_resolved());
          if (per % mbs != 0) mbs = per;
          plan = std::make_shared<Plan>(Plan::data_parallel(cfg.model.layers, std::vector<std::pair<int64_t, int64_t>>(
                                                                                  static_cast<size_t>(n), {mbs, per / mbs})));
        }
        if (plan) plan->validate(cfg.model, a->plan_file.empty() || a->plan_file == "auto" ? "plan" : a->plan_file);

        train::TrainOptions o;
        if (!a->resume_from.empty()) o.resume = a->resume_from;
        else if (a->resume) o.resume = cfg.output.dir;
        o.init_weights = a->init_weights;
        o.plan = plan;
        o.trace = a->trace;
        o.world = world;
        // Up to kMaxReplans switches, each replan_step steps after the previous one; the first
        // calibration that finds nothing better ends it.
        constexpr int kMaxReplans = 2;
        auto replanning = std::make_shared<Replanning>();
        int64_t measured_from = 2;
        if (ap && world && cfg.train.replan_step > 0) {
          replanning->ap = *ap;
          o.replan_at = cfg.train.replan_step;
          o.replan = [replanning, &cfg, &o, &measured_from](const std::map<int, double>& measured,
                                                            const std::map<int, double>& phase) {
            return replan_from_measured(*replanning, cfg, measured_from, o.replan_at, measured, phase);
          };
        }
        // A re-plan ends a run early at a checkpoint; the next one resumes from it under the new
        // plan, with its own process groups.
        train::TrainResult all;
        for (int generation = 1;; ++generation) {
          train::TrainResult r;
          {
            train::Trainer trainer(cfg, o);
            r = trainer.run();
          }
          all.steps.insert(all.steps.end(), r.steps.begin(), r.steps.end());
          all.val_loss.insert(all.val_loss.end(), r.val_loss.begin(), r.val_loss.end());
          all.checkpoint = r.checkpoint;
          if (!r.next_plan) break;
          o.plan = r.next_plan;
          o.resume = r.checkpoint;
          o.init_weights.clear();
          measured_from = o.replan_at + 2;  // a new layout's first step warms up too
          o.replan_at = generation < kMaxReplans ? o.replan_at + cfg.train.replan_step : 0;
          o.generation = "plan" + std::to_string(generation + 1) + "/";
        }
        if (rv.rank == 0) print_summary(all);
      } catch (const std::exception& e) {
        if (!world) throw;
        // Tell the others why, then leave at once: tearing down process groups whose peers are
        // gone can block, and a stuck rank is what this path exists to prevent.
        world->report_exit(e.what());
        std::fprintf(stderr, "alloy: error: rank %d: %s\n", rv.rank, e.what());
        std::fflush(stderr);
        std::fflush(stdout);
        // Rank 0 hosts the store: linger a moment so the others can still read why before it goes.
        if (rv.rank == 0 && world->size() > 1) std::this_thread::sleep_for(std::chrono::seconds(3));
        ::_exit(1);
      }
      std::fflush(stdout);
      if (world) {
        world->all().barrier();  // nobody tears down a group a peer still uses
      }
      return 0;
    };
  });
}

}  // namespace alloy::cli
