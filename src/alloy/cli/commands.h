#pragma once
// Each file registers its subcommands on the app; main() runs the one the user chose.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace alloy::cli {
using Action = std::function<int()>;
void add_train_commands(CLI::App& app, Action& action);
void add_data_commands(CLI::App& app, Action& action);
void add_model_commands(CLI::App& app, Action& action);
void add_dist_commands(CLI::App& app, Action& action);
void add_planner_commands(CLI::App& app, Action& action);
// Parses ARGV (argv[0] the program) and runs the chosen command: main() after the process-wide
// settings, and each rank that `alloy launch` runs in its own forked process.
int run(int argc, char** argv);
// The arguments run() was last given.
const std::vector<std::string>& command_line();
}  // namespace alloy::cli
