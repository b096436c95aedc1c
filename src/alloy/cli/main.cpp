// `alloy`: thin command-line front end; all logic lives in the library.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "alloy/cli/commands.h"
#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/process.h"

int main(int argc, char** argv) {
  alloy::prefer_passive_openmp_waits(argv);
  alloy::tune_allocator_for_training();
  CLI::App app{"Alloy: train transformer language models across unlike devices and links"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "alloy 0.1.0");
  if (!alloy::apply_log_level_from_env())
    std::fprintf(stderr, "alloy: warning: ALLOY_LOG_LEVEL=%s is not a log level (debug, info, warning, error); using info\n",
                 std::getenv("ALLOY_LOG_LEVEL"));
  std::string log_level;
  app.add_option("--log-level", log_level,
                 "Least severe messages to print: debug, info (default), warning or error (also ALLOY_LOG_LEVEL; "
                 "HeteroShard's training.log_level when neither is given). Ranks that `alloy launch` starts inherit it")
      ->check([](const std::string& v) {
        try {
          alloy::parse_log_level(v);
          return std::string();
        } catch (const std::invalid_argument& e) {
          return std::string(e.what());
        }
      });
  alloy::cli::Action action;
  alloy::cli::add_train_commands(app, action);
  alloy::cli::add_data_commands(app, action);
  alloy::cli::add_model_commands(app, action);
  alloy::cli::add_dist_commands(app, action);
  alloy::cli::add_planner_commands(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!log_level.empty()) {
    alloy::set_log_level(alloy::parse_log_level(log_level));
    ::setenv("ALLOY_LOG_LEVEL", log_level.c_str(), 1);
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
