// `alloy`: thin command-line front end; all logic lives in the library.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "alloy/cli/commands.h"
#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/process.h"

namespace {
std::vector<std::string> g_command_line;
}  // namespace

const std::vector<std::string>& alloy::cli::command_line() { return g_command_line; }

int alloy::cli::run(int argc, char** argv) {
  g_command_line.assign(argv, argv + argc);
  CLI::App app{"Alloy: train transformer language models across unlike devices and links"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "alloy 0.1.0");
  const bool env_level_ok = alloy::apply_log_level_from_env();
  // A subcommand's parser would not pass --log-level up to this one (train keeps unknown flags as
  // Megatron's), so it is taken out of the line first; the option below is for --help.
  std::vector<char*> args(argv, argv + argc);
  const std::string log_level = alloy::take_log_level_option(&args);
  if (!log_level.empty()) {
    try {
      alloy::set_log_level(alloy::parse_log_level(log_level));
    } catch (const std::invalid_argument& e) {
      std::fprintf(stderr, "--log-level: %s\n", e.what());
      return 2;
    }
    ::setenv("ALLOY_LOG_LEVEL", log_level.c_str(), 1);  // ranks alloy launch starts inherit it
  } else if (!env_level_ok) {
    std::fprintf(stderr, "alloy: warning: ALLOY_LOG_LEVEL=%s is not a log level (debug, info, warning, error); using info\n",
                 std::getenv("ALLOY_LOG_LEVEL"));
  }
  std::string unused;
  app.add_option("--log-level", unused,
                 "Least severe messages to print: debug, info (default), warning or error, anywhere on the line (also "
                 "ALLOY_LOG_LEVEL; HeteroShard's training.log_level when neither is given). Ranks that `alloy launch` starts "
                 "inherit it");
  alloy::cli::Action action;
  alloy::cli::add_train_commands(app, action);
  alloy::cli::add_data_commands(app, action);
  alloy::cli::add_model_commands(app, action);
  alloy::cli::add_dist_commands(app, action);
  alloy::cli::add_planner_commands(app, action);
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return action ? action() : 0;
  } catch (const alloy::Error& e) {
    std::fprintf(stderr, "alloy: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "alloy: error: %s\n", e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  // A write to a peer that has gone (a rank that died mid-sum) must fail as an error the caller
  // can name (Gloo throws "Connection reset by peer ... rank N"), not kill this process with
  // SIGPIPE: under load a survivor of dist.tree_allreduce's leave cases died that way (exit 141)
  // before reading its peer's reset. Forked ranks inherit this, and so do programs `alloy launch`
  // execs (an ignored signal stays ignored across exec).
  std::signal(SIGPIPE, SIG_IGN);
  if (!alloy::command_computes_nothing(argc, argv)) alloy::prefer_passive_openmp_waits(argv);
  alloy::tune_allocator_for_training();
  alloy::remember_arguments(argc, argv);
  return alloy::cli::run(argc, argv);
}
