#include <cmath>
#include <cstdio>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/log.h"
#include "alloy/train/trainer.h"

namespace alloy::cli {

namespace {
struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool resume = false;
  std::string resume_from;
  std::string init_weights;
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
}  // namespace

void add_train_commands(CLI::App& app, Action& action) {
  auto args = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a model from a config file");
  cmd->add_option("-c,--config", args->config, "YAML config with sections model, data, train, output")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", args->sets, "Override a config key: --set section.key=value (repeatable)");
  cmd->add_flag("--resume", args->resume, "Resume from the latest checkpoint in output.dir");
  cmd->add_option("--resume-from", args->resume_from, "Resume from this checkpoint or run directory");
  cmd->add_option("--init-weights", args->init_weights,
                  "Start from these weights (safetensors or checkpoint) with a fresh optimizer");
  cmd->footer("Config keys (section.key, help, type and default):\n" + config_reference());
  cmd->callback([args, &action]() {
    action = [args]() {
      Config cfg = Config::load(args->config, args->sets);
      train::TrainOptions o;
      if (!args->resume_from.empty()) o.resume = args->resume_from;
      else if (args->resume) o.resume = cfg.output.dir;
      o.init_weights = args->init_weights;
      train::Trainer trainer(cfg, o);
      auto result = trainer.run();
      print_summary(result);
      return 0;
    };
  });
}

}  // namespace alloy::cli
