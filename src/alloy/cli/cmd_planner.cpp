#include <cstdio>
#include <cstdlib>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/dist/rendezvous.h"
#include "alloy/dist/world.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/profiler.h"
#include "alloy/train/sweep.h"
#include "alloy/train/trainer.h"

namespace alloy::cli {

namespace {
struct ProfileArgs {
  std::string cluster, config, output = "profile.json";
  std::vector<std::string> sets;
  dist::RendezvousFlags rv;
  double timeout_s = 300;
  int repeats = 5;
  std::vector<int64_t> micro_batches = plan::ProfileOptions{}.micro_batch_sizes;
  double window_s = plan::ProfileOptions{}.window_s;
  bool one_at_a_time = false;
  bool no_tp_sums = false;
};
}  // namespace

void add_planner_commands(CLI::App& app, Action& action) {
  auto a = std::make_shared<ProfileArgs>();
  auto* prof = app.add_subcommand("profile", "Measure devices and links for the planner (one rank per device of the cluster)");
  prof->add_option("--cluster", a->cluster, "ClusterSpec YAML (rank i runs on device i)")->required();
  prof->add_option("-c,--config", a->config, "Config whose model is profiled")->required()->check(CLI::ExistingFile);
  prof->add_option("--set", a->sets, "Override a config key (repeatable)");
  prof->add_option("-o,--output", a->output, "Profile JSON to write (rank 0)")->capture_default_str();
  prof->add_option("--repeats", a->repeats, "Ping-pongs per message size when timing links")->capture_default_str();
  prof->add_option("--micro-batches", a->micro_batches, "Micro-batch sizes timed per device type (the planner interpolates between them and extends the fitted line past the largest)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prof->add_option("--window", a->window_s, "Seconds each compute figure averages over (spans CPU-quota periods)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prof->add_flag("--one-at-a-time", a->one_at_a_time,
                 "Time device types in turns on an otherwise idle machine (default: all devices at once, as in training)");
  prof->add_flag("--no-tp-sums", a->no_tp_sums,
                 "Skip timing tensor-parallel sums per device pair (about a second per pair; the planner then prices a sum "
                 "from the links, at least 1.5 ms)");
  prof->add_option("--rank", a->rv.rank, "This process's rank")->group("Rendezvous");
  prof->add_option("--world-size", a->rv.world_size, "Number of ranks")->group("Rendezvous");
  prof->add_option("--master-addr", a->rv.master_addr, "Host of rank 0")->group("Rendezvous");
  prof->add_option("--master-port", a->rv.master_port, "Port of the rendezvous store")->group("Rendezvous");
  prof->add_option("--timeout", a->timeout_s, "Seconds any collective may take")->group("Rendezvous");
  prof->footer("Example: alloy launch --emulate examples/cluster-3dev.yaml -- alloy profile --cluster examples/cluster-3dev.yaml "
               "--config examples/tiny-gpt2.yaml -o profile.json");
  prof->callback([a, &action]() {
    action = [a]() {
      Config cfg = Config::load(a->config, a->sets);
      auto spec = plan::load_cluster(a->cluster);
      auto rv = dist::resolve_rendezvous(a->rv);
      train::configure_threads(cfg.train.threads > 0 ? cfg.train.threads : 1);
      std::shared_ptr<dist::World> world;
      if (rv.world_size > 1) world = dist::World::create(rv, std::chrono::milliseconds(static_cast<int64_t>(a->timeout_s * 1000)));
      plan::ProfileOptions po;
      po.repeats = a->repeats;
      po.micro_batch_sizes = a->micro_batches;
      po.window_s = a->window_s;
      po.concurrent = !a->one_at_a_time;
      po.measure_tp_sums = !a->no_tp_sums;
      po.device = train::rank_device(cfg);
      po.lora = cfg.lora;  // a fine-tuning run's costs: adapters, frozen (quantized) base
      auto p = plan::run_profile(cfg.model, spec, world.get(), po);
      if (rv.rank == 0) {
        p.save(a->output);
        std::printf("%s", plan::describe_profile(p).c_str());
        std::printf("wrote %s\n", a->output.c_str());
      }
      if (world) world->all().barrier();
      return 0;
    };
  });

  auto sw = std::make_shared<train::SweepOptions>();
  auto* sweep = app.add_subcommand(
      "sweep", "Train a grid of layouts x micro-batch sizes x sequence lengths for a few steps each on one pool; write a CSV, "
               "JSON and plots of tokens/s, step latency and memory per rank, each beside the planner's prediction");
  sweep->add_option("-c,--config", sw->config, "Config every cell starts from")->required()->check(CLI::ExistingFile);
  sweep->add_option("--set", sw->sets, "Override a config key for every cell (repeatable)");
  sweep->add_option("--layouts", sw->layouts, "Layouts: " + train::sweep_layouts())->capture_default_str();
  sweep->add_option("--micro-batch", sw->micro_batches, "Micro-batch sizes")->capture_default_str();
  sweep->add_option("--seq-len", sw->seq_lens, "Sequence lengths (default: the config's model.seq_len)");
  sweep->add_option("--steps", sw->steps, "Steps per cell")->capture_default_str();
  sweep->add_option("--warmup", sw->warmup, "Steps per cell not timed")->capture_default_str();
  sweep->add_option("-n,--nproc", sw->nprocs, "Local ranks (without --emulate); several counts (-n 1 2 4) sweep the rank count too");
  sweep->add_option("--emulate", sw->emulate, "Run every cell on this emulated ClusterSpec (root)")->check(CLI::ExistingFile);
  sweep->add_option("--cluster", sw->cluster, "ClusterSpec for the predictions (default: --emulate's, or N CPUs here)")
      ->check(CLI::ExistingFile);
  sweep->add_option("--profile", sw->profile, "Profile to predict with (default: measured once per sequence length)")
      ->check(CLI::ExistingFile);
  sweep->add_option("-o,--output", sw->out_dir, "Directory for sweep.csv, sweep.json, the plots and each cell's run")
      ->capture_default_str();
  sweep->callback([sw, &action]() {
    action = [sw]() {
      if (sw->steps <= sw->warmup) throw InputError("--steps", "must exceed --warmup (" + std::to_string(sw->warmup) + ")");
      auto rows = train::run_sweep(*sw);
      const auto errs = train::prediction_errors(rows);
      std::printf("\n%s", train::sweep_csv(rows).c_str());
      for (const char* what : {"step", "memory"}) {
        const auto& e = errs[what];
        if (e.value("rows", 0) > 0)
          std::printf("prediction error (%s): median %+.1f%%, mean |error| %.1f%%, worst %.1f%%, %d of %d rows within 10%%\n", what,
                      100 * e.value("median", 0.0), 100 * e.value("mean_abs", 0.0), 100 * e.value("worst_abs", 0.0),
                      e.value("within_10_percent", 0), e.value("rows", 0));
      }
      std::printf("wrote %s/sweep.csv, sweep.json and sweep-{tokens,latency,memory}.png\n", sw->out_dir.c_str());
      return 0;
    };
  });
}

}  // namespace alloy::cli
