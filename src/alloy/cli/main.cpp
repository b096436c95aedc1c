// `alloy`: thin command-line front end; all logic lives in the library.
#include <cstdio>

#include "alloy/cli/commands.h"
#include "alloy/core/error.h"
#include "alloy/core/process.h"

int main(int argc, char** argv) {
  alloy::prefer_passive_openmp_waits(argv);
  alloy::tune_allocator_for_training();
  CLI::App app{"Alloy: train transformer language models across unlike devices and links"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "alloy 0.1.0");
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
