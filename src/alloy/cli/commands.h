#pragma once
// Each file registers its subcommands on the app; main() runs the one the user chose.
#include <CLI/CLI.hpp>

#include <functional>

namespace alloy::cli {
using Action = std::function<int()>;
void add_train_commands(CLI::App& app, Action& action);
void add_data_commands(CLI::App& app, Action& action);
void add_model_commands(CLI::App& app, Action& action);
void add_dist_commands(CLI::App& app, Action& action);
void add_planner_commands(CLI::App& app, Action& action);
}  // namespace alloy::cli
