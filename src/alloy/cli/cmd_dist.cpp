#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "alloy/core/process.h"
#include "alloy/dist/launch.h"
#include "alloy/emu/emulator.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/profiler.h"
#include "alloy/plan/sync_scope.h"
#include "alloy/train/rank_device.h"
#include "alloy/train/trainer.h"
#include "alloy/viz/diagram.h"

namespace alloy::cli {

namespace {
struct PlanArgs {
  bool from_synerfuse = false;
  std::string shard_plan, config, output, cluster, profile, strategy = "alloy", diagram, evaluate;
  double time_budget_s = 2.0;
  bool no_compare = false;
  std::string tensor_parallel = "on";
  std::string float_boundaries = "on";
  std::string mlp_cuts = "on";
  std::string short_micro_batches = "on";
  std::string interleave = "on";
  std::vector<std::string> schedules = pipeline::schedule_names();
  std::vector<std::string> sets;
  int64_t global_batch = 0, micro_batch = 0, layers = 0;
};

// A rank command that is this very program runs in a forked copy of the launcher: no second load
// of LibTorch per rank (about 0.75 s of CPU each, 3 s under a quarter-core emulated device). The
// libraries took their thread settings from the environment when the launcher started, so a
// launcher that did not start with the ranks' settings starts again with them, once, first.
// ALLOY_LAUNCH_EXEC=1 execs the command for every rank instead.
void fork_ranks_when_possible(dist::LaunchOptions& lo) {
  const char* exec_only = std::getenv("ALLOY_LAUNCH_EXEC");
  if ((exec_only && std::string(exec_only) == "1") || lo.command.empty() || !is_this_program(lo.command[0])) return;
  const int threads = dist::rank_threads(lo);
  if (!dist::environment_serves_ranks(threads) && !command_line().empty()) {
    dist::set_environment_for_ranks(threads);
    std::vector<std::string> words = command_line();
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    std::fflush(nullptr);
    ::execv("/proc/self/exe", argv.data());
    return;  // exec failed: the ranks exec the command, as they would have anyway
  }
  lo.run_in_process = [threads](const std::vector<std::string>& command) {
    // ps and top show the rank's command and number, not the launcher's (the environment that
    // /proc/PID/environ shows stays the launcher's: the rank's variables were set in-process)
    const char* rank = std::getenv("RANK");
    set_process_title(command, std::string("alloy-rank") + (rank ? rank : "?"));
    train::configure_threads(threads);
    std::vector<std::string> words = command;
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    return run(static_cast<int>(words.size()), argv.data());
  };
}
}  // namespace

void add_dist_commands(CLI::App& app, Action& action) {
  auto lo = std::make_shared<dist::LaunchOptions>();
  auto* launch = app.add_subcommand("launch", "Start N local ranks of a command (usually `alloy train`), torchrun style");
  auto emu_path = std::make_shared<std::string>();
  auto emu_opts = std::make_shared<emu::EmulatorOptions>();
  auto no_cpu = std::make_shared<bool>(false), no_net = std::make_shared<bool>(false), no_pin = std::make_shared<bool>(false),
       no_latency = std::make_shared<bool>(false);
  launch->add_option("-n,--nproc", lo->nproc, "Number of ranks (default with --emulate: one per device)");
  launch->add_option("--emulate", *emu_path,
                     "Run rank i as device i of this ClusterSpec: each host in its own network namespace with tc-limited "
                     "links (latency too, from 1 ms), each rank under a CPU quota from its device's speed (root)")
      ->check(CLI::ExistingFile);
  launch->add_flag("--no-cpu-limit", *no_cpu, "With --emulate: no CPU quotas");
  launch->add_flag("--no-net-limit", *no_net, "With --emulate: no bandwidth limits");
  launch->add_flag("--no-pin", *no_pin, "With --emulate: do not pin each device to its own CPUs");
  launch->add_flag("--no-latency", *no_latency,
                   "With --emulate: links keep the veth's own latency instead of their latency_ms (which a delay line in "
                   "user space adds to links of 1 ms or more, at a few microseconds of CPU per frame)");
  launch->add_option("--master-addr", lo->master_addr, "Rendezvous host (with --nnodes: node 0's address)")->capture_default_str();
  launch->add_option("--master-port", lo->master_port, "Rendezvous port; 0 = a free one (with --nnodes: required, the same on every node)")
      ->capture_default_str();
  launch->add_option("--nnodes", lo->nnodes,
                     "Machines in the job (torchrun's --nnodes): run the same command on each with its --node-rank; node K's "
                     "ranks are K x nproc .. (K + 1) x nproc - 1")
      ->capture_default_str();
  launch->add_option("--node-rank,--node_rank", lo->node_rank, "This machine's number among --nnodes, 0 = the one at --master-addr")
      ->capture_default_str();
  launch->add_option("--threads-per-rank", lo->threads_per_rank, "Intra-op threads per rank; 0 = cores / nproc")
      ->capture_default_str();
  // One comma-separated value: a multi-value option would swallow the `--` before the command.
  launch->add_option_function<std::string>(
      "--devices",
      [lo](const std::string& list) {
        lo->devices.clear();
        std::stringstream in(list);
        for (std::string d; std::getline(in, d, ',');) lo->devices.push_back(d);
      },
      "Device of each rank, e.g. cuda:0,cpu,cpu (one for all ranks or one per rank); sets ALLOY_DEVICE, "
      "which overrides train.device, so one GPU and spare CPU cores can train together");
  launch->add_option("--grace", lo->grace_s, "Seconds the other ranks get to report after one fails")->capture_default_str();
  launch->add_option("--max-restarts", lo->max_restarts,
                     "After a failure, start the whole job again up to N times; `alloy train` then resumes from its last "
                     "complete checkpoint (ALLOY_RESTART)")
      ->capture_default_str();
  launch->add_option("--rejoin-timeout", lo->rejoin_timeout_s,
                     "Elastic: a device that is gone after a failure is waited for this many seconds; then the job goes on "
                     "without it (`alloy train --plan auto` re-plans onto the rest: same global batch, same math) and takes it "
                     "back at a checkpoint once it is there again. 0 = restart with every rank or not at all")
      ->capture_default_str();
  launch->add_option("--device-check", lo->device_check,
                     "With --rejoin-timeout: shell command telling whether a rank's device is there (exit 0); {rank} = the "
                     "rank as first launched, {device} = its --devices entry. Under --emulate a host taken down by "
                     "`alloy emu down` counts as gone too");
  launch->add_option("command", lo->command, "Command to run, after --")->required();
  launch->footer(
      "Example: alloy launch --nproc 3 -- alloy train --config examples/tiny-gpt2.yaml --plan plan.json\n"
      "Ranks of alloy itself start as forked copies of the launcher, named alloy-rankN (no second LibTorch load);\n"
      "ALLOY_LAUNCH_EXEC=1 starts every rank by exec instead.");
  launch->callback([lo, emu_path, emu_opts, no_cpu, no_net, no_pin, no_latency, launch, &action]() {
    bool nproc_given = launch->count("--nproc") > 0;
    action = [lo, emu_path, emu_opts, no_cpu, no_net, no_pin, no_latency, nproc_given]() {
      // `alloy` as the command means this very binary, wherever it is installed.
      if (!lo->command.empty() && lo->command[0] == "alloy" && !executable_path().empty()) lo->command[0] = executable_path();
      dist::LaunchResult r;
      if (!emu_path->empty()) {
        if (lo->nnodes > 1) throw InputError("--nnodes", "is not for --emulate, which runs every device's rank on this machine");
        auto spec = plan::load_cluster(*emu_path);
        if (!nproc_given) lo->nproc = static_cast<int>(spec.devices.size());
        if (lo->nproc != static_cast<int>(spec.devices.size()))
          throw InputError("--nproc", std::to_string(lo->nproc) + " ranks, but " + *emu_path + " has " +
                                          std::to_string(spec.devices.size()) + " devices: under emulation rank i is device i");
        // The ranks learn the cluster (for --plan auto) from the environment.
        ::setenv("ALLOY_CLUSTER", std::filesystem::absolute(*emu_path).c_str(), 1);
        emu_opts->limit_cpu = !*no_cpu;
        emu_opts->limit_network = !*no_net;
        emu_opts->pin_cpus = !*no_pin;
        emu_opts->emulate_latency = !*no_latency;
        fork_ranks_when_possible(*lo);
        r = emu::launch_emulated(spec, *lo, *emu_opts);
      } else {
        if (!nproc_given) throw InputError("--nproc", "is required (or --emulate CLUSTER for one rank per device)");
        fork_ranks_when_possible(*lo);
        r = dist::launch(*lo);
      }
      if (r.failed_rank >= 0 && r.exit_code != 0)
        std::fprintf(stderr, "alloy launch: rank %d failed first (exit code %d)%s\n", r.failed_rank, r.exit_code,
                     r.restarts > 0 ? (" after " + std::to_string(r.restarts) + " restart(s)").c_str() : "");
      else if (r.restarts > 0 || r.rejoins > 0)
        std::fprintf(stderr, "alloy launch: the job finished after %d restart(s)%s\n", r.restarts,
                     r.rejoins > 0 ? (" and " + std::to_string(r.rejoins) + " rejoin(s)").c_str() : "");
      if (lo->rejoin_timeout_s > 0 && r.members.size() < static_cast<size_t>(lo->nproc) && r.exit_code == 0)
        std::fprintf(stderr, "alloy launch: finished on %zu of %d devices\n", r.members.size(), lo->nproc);
      return r.exit_code;
    };
  });

  auto* emu_cmd = app.add_subcommand("emu", "Emulated clusters");
  emu_cmd->require_subcommand(1);
  auto* clean = emu_cmd->add_subcommand("clean", "Remove namespaces, links and cgroups left by emulated launches that died");
  clean->callback([&action]() {
    action = []() {
      int n = emu::clean_leftovers();
      std::printf("removed %d leftover namespaces and cgroups\n", n);
      return 0;
    };
  });

  auto link = std::make_shared<std::vector<std::string>>();
  auto link_id = std::make_shared<std::string>();
  for (const bool cut : {true, false}) {
    auto* c = emu_cmd->add_subcommand(cut ? "cut" : "restore",
                                      cut ? "Cut the link between two hosts of a running emulated cluster (nothing gets through)"
                                          : "Restore a cut link to its bandwidth");
    c->add_option("hosts", *link, "HOST_A HOST_B (host names of the ClusterSpec)")->required()->expected(2);
    c->add_option("--id", *link_id, "The cluster's id when several run");
    c->callback([cut, link, link_id, &action]() {
      action = [cut, link, link_id]() {
        const std::string id = emu::set_link((*link)[0], (*link)[1], cut, *link_id);
        std::printf("%s the link %s - %s of emulated cluster %s\n", cut ? "cut" : "restored", (*link)[0].c_str(), (*link)[1].c_str(),
                    id.c_str());
        return 0;
      };
    });
  }

  auto down_host = std::make_shared<std::string>();
  for (const bool down : {true, false}) {
    auto* c = emu_cmd->add_subcommand(down ? "down" : "up",
                                      down ? "Take a host of a running emulated cluster down: every link to it cut, every process "
                                             "on it killed (an elastic launch then goes on without its devices)"
                                           : "Bring a host that was taken down back up (an elastic launch takes its devices back)");
    c->add_option("host", *down_host, "HOST (a host name of the ClusterSpec)")->required();
    c->add_option("--id", *link_id, "The cluster's id when several run");
    c->callback([down, down_host, link_id, &action]() {
      action = [down, down_host, link_id]() {
        const std::string id = emu::set_host(*down_host, down, *link_id);
        std::printf("host %s of emulated cluster %s is %s\n", down_host->c_str(), id.c_str(), down ? "down" : "up");
        return 0;
      };
    });
  }

  auto pa = std::make_shared<PlanArgs>();
  auto* plan = app.add_subcommand("plan", "Write a parallel plan: converted from SynerFuse flags or a HeteroShard shard_plan");
  plan->add_flag("--from-synerfuse", pa->from_synerfuse,
                 "Convert the SynerFuse/Megatron flags that follow (--num-layers, --pipeline-model-parallel-size, "
                 "--hetero-pipeline-stages, --global-batch-size, --micro-batch-size-per-dp, --num-micro-batches-per-dp, ...)");
  plan->add_option("--from-shard-plan", pa->shard_plan, "Convert a HeteroShard hetero_config.json")->check(CLI::ExistingFile);
  plan->add_option("-c,--config", pa->config, "Config supplying model.layers / train.global_batch / train.micro_batch");
  plan->add_option("--set", pa->sets, "Override a config key (repeatable)");
  plan->add_option("--global-batch", pa->global_batch, "Global batch (shard plan; default train.global_batch)");
  plan->add_option("--micro-batch", pa->micro_batch, "Micro-batch size (shard plan; default train.micro_batch)");
  plan->add_option("-o,--output", pa->output, "Plan JSON to write");
  auto* g = "Planning for a cluster";
  plan->add_option("--cluster", pa->cluster, "ClusterSpec YAML, PTAFM data-centre file, or HeteroShard hetero_config.json")
      ->group(g)->check(CLI::ExistingFile);
  plan->add_option("--profile", pa->profile, "Profile from `alloy profile` (default: measure this machine, scale by speed hints)")
      ->group(g)->check(CLI::ExistingFile);
  plan->add_option("--strategy", pa->strategy, "alloy | uniform | proportional | ptafm")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"alloy", "uniform", "proportional", "ptafm"}));
  plan->add_option("--time-budget", pa->time_budget_s, "Seconds the heuristic search may take beyond the exact part")
      ->group(g)->capture_default_str();
  plan->add_option("--diagram", pa->diagram, "Draw the plan: FILE.svg | .png | .pdf (Graphviz) | .mmd (Mermaid) | .dot")->group(g);
  plan->add_flag("--no-compare", pa->no_compare, "Do not plan the other strategies for comparison")->group(g);
  plan->add_option("--tensor-parallel", pa->tensor_parallel,
                   "on: the alloy strategy also tries groups of devices as tensor-parallel stages (kept where predicted "
                   "faster); off: one rank per stage")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  plan->add_option("--float-boundaries", pa->float_boundaries,
                   "on: the alloy strategy also tries floating pipeline boundaries (two stages share a half block, each "
                   "running it for part of the micro-batches; kept where predicted at least 5% faster); off: fixed boundaries")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  plan->add_option("--mlp-cuts", pa->mlp_cuts,
                   "on: the alloy strategy also tries pipeline boundaries inside an MLP, split by columns (the first "
                   "stage computes the columns of some heads, the next the rest; kept where predicted at least 5% faster); off: none")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  plan->add_option("--interleave", pa->interleave,
                   "on: the alloy strategy also tries interleaving a pipeline's ranks into 2 to 4 chunks each "
                   "(interleaved-1f1b: a V times smaller bubble for V times the messages; kept where predicted at least "
                   "5% faster); off: one chunk a rank")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  plan->add_option("--short-micro-batches", pa->short_micro_batches,
                   "on: a pipeline's samples need not be a multiple of its micro-batch size (its last micro-batch is "
                   "short), so unlike replicas split the batch as their speeds ask; off: whole micro-batches")
      ->group(g)->capture_default_str()->check(CLI::IsMember({"on", "off"}));
  plan->add_option("--schedules", pa->schedules,
                   "Pipeline schedules the search may choose from: 1f1b, eager-1f1b (one more forward in flight per "
                   "stage, hiding the messages between balanced stages; one more micro-batch of activations), "
                   "eager-1f1b-2 to eager-1f1b-4 (2 to 4 more: a distant link's round trips), gpipe, "
                   "zb-h1 (zero-bubble: weight gradients held back to fill the drain; more activation memory), for the "
                   "whole plan and then per pipeline (each pipeline may keep its own; zb-h1 only where predicted at "
                   "least 5% faster)")
      ->group(g)->delimiter(',')->capture_default_str()->check(CLI::IsMember(pipeline::schedule_names()));
  plan->add_option("--evaluate", pa->evaluate,
                   "Predict a given plan (hand-written or converted) on the cluster instead of searching one; "
                   "the strategies' plans are shown beside it")
      ->group(g)->check(CLI::ExistingFile);
  plan->allow_extras();
  plan->callback([pa, plan, &action]() {
    auto extras = plan->remaining();
    action = [pa, extras]() {
      Config cfg;
      if (!pa->config.empty()) cfg = Config::load(pa->config, pa->sets);
      Plan p;
      std::string where;
      // An option that cannot apply is an error, never silently ignored.
      if (pa->cluster.empty()) {
        const std::pair<bool, const char*> cluster_only[] = {{!pa->profile.empty(), "--profile"},
                                                             {pa->strategy != "alloy", "--strategy"},
                                                             {!pa->evaluate.empty(), "--evaluate"},
                                                             {pa->no_compare, "--no-compare"}};
        for (const auto& [given, flag] : cluster_only)
          if (given) throw InputError(flag, "applies only to planning for a cluster (--cluster FILE)");
      }
      if (pa->from_synerfuse && !pa->shard_plan.empty())
        throw InputError("--from-shard-plan", "and --from-synerfuse both given: convert one plan at a time");
      if (pa->from_synerfuse || !pa->shard_plan.empty()) {
        if (!pa->cluster.empty())
          throw InputError("--cluster", "plans from scratch; a converted plan (--from-synerfuse / --from-shard-plan) is "
                                        "predicted on a cluster with --cluster FILE --evaluate PLAN.json");
        if (pa->global_batch > 0 && pa->from_synerfuse)
          throw InputError("--global-batch", "is for --from-shard-plan; SynerFuse says --global-batch-size");
      }
      if (pa->from_synerfuse) {
        std::vector<std::string> ignored;
        SynerFuseArgs sf = parse_synerfuse_args(extras, &ignored);
        if (!ignored.empty()) {
          std::string names;
          for (const auto& n : ignored) names += " " + n;
          std::printf("note: the plan does not depend on%s (alloy train reads them)\n", names.c_str());
        }
        if (sf.num_layers <= 0) sf.num_layers = cfg.model.layers;
        if (!pa->config.empty() && sf.num_attention_heads <= 0) sf.num_attention_heads = cfg.model.heads;
        if (sf.global_batch_size <= 0) sf.global_batch_size = cfg.train.global_batch;
        if (sf.micro_batch_size <= 0) sf.micro_batch_size = default_micro_batch(cfg, sf, 0);
        p = plan_from_synerfuse(sf);
        cfg.model.layers = sf.num_layers;
        where = "SynerFuse flags";
      } else if (!pa->shard_plan.empty()) {
        if (!extras.empty()) throw InputError("alloy plan", "unexpected arguments: " + extras.front());
        int64_t gb = pa->global_batch > 0 ? pa->global_batch : cfg.train.global_batch;
        int64_t mb = pa->micro_batch > 0 ? pa->micro_batch : (cfg.train.micro_batch > 0 ? cfg.train.micro_batch : gb);
        int64_t layers = pa->config.empty() ? 0 : cfg.model.layers;
        p = plan_from_hetero_config_file(pa->shard_plan, layers, gb, mb);
        cfg.model.layers = p.pipelines[0].stages.back().layer_end;
        where = pa->shard_plan;
      } else if (!pa->cluster.empty()) {
        if (pa->config.empty()) throw InputError("--config", "is required with --cluster (it says which model to plan)");
        int ptafm_stages = 0;
        auto spec = plan::load_cluster(pa->cluster, &ptafm_stages);
        plan::Profile prof;
        if (!pa->profile.empty()) {
          prof = plan::Profile::load(pa->profile);
          if (const std::string why = prof.mismatch(cfg); !why.empty()) throw InputError(pa->profile, why + " (" + pa->config + ")");
          for (const auto& n : plan::complete_profile(prof, spec)) std::printf("note: %s\n", n.c_str());
        } else {
          std::printf("no --profile: measuring this machine once and scaling by the cluster's speed hints\n");
          plan::ProfileOptions po;
          po.device = train::rank_device(cfg);
          po.lora = cfg.lora;
          prof = plan::run_profile(cfg.model, spec, nullptr, po);
        }
        plan::SearchOptions so;
        so.strategy = pa->strategy;
        so.global_batch = cfg.train.global_batch;
        so.time_budget_s = pa->time_budget_s;
        so.ptafm_stages = ptafm_stages;
        so.grad_sync = cfg.grad_sync;
        so.tensor_parallel = pa->tensor_parallel == "on";
        so.sequence_parallel = cfg.train.sequence_parallel;
        so.float_boundaries = pa->float_boundaries == "on";
        so.mlp_cuts = pa->mlp_cuts == "on";
        so.short_micro_batches = pa->short_micro_batches == "on";
        so.interleave = pa->interleave == "on";
        so.schedules = pa->schedules;
        auto report = plan::make_plan(spec, prof, so, !pa->no_compare);
        if (!pa->evaluate.empty()) {
          Plan given = Plan::load(pa->evaluate);
          plan::apply_grad_sync(given, cfg, /*plan_from_file=*/true, pa->evaluate);  // --set grad_sync.* applies to it too
          if (cfg.train.sequence_parallel) given.set_sequence_parallel();  // priced as the trainer will run it
          if (const std::string why = given.training_problem(cfg); !why.empty()) throw InputError(pa->evaluate, why);
          report = plan::evaluate_plan(given, pa->evaluate, cfg.model, spec, prof, report);
        }
        std::printf("%s", report.text().c_str());
        p = report.chosen.plan;
        p.predicted = report.chosen.cost.to_json();
        if (plan::needs_slow_links(p.grad_sync)) p.slow_links = plan::slow_rank_pairs(p, spec, p.grad_sync);
        if (!pa->diagram.empty()) {
          // The diagram shows the few figures a reader needs per stage, not the whole breakdown.
          nlohmann::json brief = {{"step_s", p.predicted.value("step_s", 0.0)}, {"per_stage", nlohmann::json::array()}};
          for (const auto& st : p.predicted["per_stage"])
            brief["per_stage"].push_back({{"compute_s", st.value("forward_s", 0.0) + st.value("backward_s", 0.0)},
                                          {"bubble_s", st.value("bubble_s", 0.0)},
                                          {"memory_bytes", st.value("memory_bytes", 0.0)}});
          viz::DiagramInput in{&p, &spec, cfg.model.layers, brief};
          viz::write_diagram(in, pa->diagram);
          std::printf("wrote %s\n", pa->diagram.c_str());
        }
        if (!pa->output.empty()) {
          p.save(pa->output);
          std::printf("wrote %s\n", pa->output.c_str());
        }
        return 0;
      } else {
        throw InputError("alloy plan", "say what to plan: --cluster FILE --config MODEL.yaml, --from-synerfuse FLAGS... or --from-shard-plan FILE");
      }
      p.validate(cfg.model, where);
      std::printf("%s", p.describe().c_str());
      if (!pa->diagram.empty()) {
        // No predictions. A hetero_config.json names its machines and their devices: the stages
        // are drawn in their hosts' boxes, as HeteroShard's own diagram shows devices and network
        // (its links assumed, and said so); SynerFuse flags name no machine (a box per pipeline).
        std::optional<plan::ClusterSpec> hosts;
        if (!pa->shard_plan.empty()) hosts = plan::load_cluster(pa->shard_plan);
        viz::write_diagram({&p, hosts ? &*hosts : nullptr, cfg.model.layers, {}}, pa->diagram);
        std::printf("wrote %s\n", pa->diagram.c_str());
      }
      if (!pa->output.empty()) {
        p.save(pa->output);
        std::printf("wrote %s\n", pa->output.c_str());
      } else {
        std::printf("%s\n", p.to_json().dump(2).c_str());
      }
      return 0;
    };
  });
}

}  // namespace alloy::cli
