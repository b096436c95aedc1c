#include <unistd.h>

#include <cstdio>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "alloy/dist/launch.h"

namespace alloy::cli {

namespace {
struct PlanArgs {
  bool from_synerfuse = false;
  std::string shard_plan, config, output;
  std::vector<std::string> sets;
  int64_t global_batch = 0, micro_batch = 0, layers = 0;
};
}  // namespace

void add_dist_commands(CLI::App& app, Action& action) {
  auto lo = std::make_shared<dist::LaunchOptions>();
  auto* launch = app.add_subcommand("launch", "Start N local ranks of a command (usually `alloy train`), torchrun style");
  launch->add_option("-n,--nproc", lo->nproc, "Number of ranks")->required();
  launch->add_option("--master-addr", lo->master_addr, "Rendezvous host")->capture_default_str();
  launch->add_option("--master-port", lo->master_port, "Rendezvous port; 0 = a free one")->capture_default_str();
  launch->add_option("--threads-per-rank", lo->threads_per_rank, "Intra-op threads per rank; 0 = cores / nproc")
      ->capture_default_str();
  launch->add_option("--grace", lo->grace_s, "Seconds the other ranks get to report after one fails")->capture_default_str();
  launch->add_option("command", lo->command, "Command to run, after --")->required();
  launch->footer("Example: alloy launch --nproc 3 -- alloy train --config examples/tiny-gpt2.yaml --plan plan.json");
  launch->callback([lo, &action]() {
    action = [lo]() {
      // `alloy` as the command means this very binary, wherever it is installed.
      if (!lo->command.empty() && lo->command[0] == "alloy") {
        char buf[4096];
        ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
        if (n > 0) lo->command[0] = std::string(buf, static_cast<size_t>(n));
      }
      auto r = dist::launch(*lo);
      if (r.failed_rank >= 0)
        std::fprintf(stderr, "alloy launch: rank %d failed first (exit code %d)\n", r.failed_rank,
                     r.rank_exit_codes[static_cast<size_t>(r.failed_rank)]);
      return r.exit_code;
    };
  });

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
  plan->allow_extras();
  plan->callback([pa, plan, &action]() {
    auto extras = plan->remaining();
    action = [pa, extras]() {
      Config cfg;
      if (!pa->config.empty()) cfg = Config::load(pa->config, pa->sets);
      Plan p;
      std::string where;
      if (pa->from_synerfuse) {
        SynerFuseArgs sf = parse_synerfuse_args(extras);
        if (sf.num_layers <= 0) sf.num_layers = cfg.model.layers;
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
      } else {
        throw InputError("alloy plan", "say what to convert: --from-synerfuse FLAGS... or --from-shard-plan FILE");
      }
      p.validate(cfg.model, where);
      std::printf("%s", p.describe().c_str());
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
