#pragma once
// Logging and progress display. On a terminal a progress line redraws in place; otherwise (CI,
// files, `alloy launch` prefixes) plain log lines are printed at intervals so logs stay readable.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace alloy {

// Levels as Python's logging names them (HeteroShard's training.log_level): messages below the
// process's level are dropped; progress lines count as info.
enum class LogLevel { Debug = 10, Info = 20, Warning = 30, Error = 40 };
void log_info(const std::string& msg);
void log_warn(const std::string& msg);
void log_error(const std::string& msg);
void set_log_level(LogLevel level);
LogLevel log_level();
// debug | info | warning (warn) | error | critical (as error), any case; anything else throws
// std::invalid_argument naming the valid names.
LogLevel parse_log_level(const std::string& name);
// The level ALLOY_LOG_LEVEL names when it names one (main sets it for --log-level), else none.
std::optional<LogLevel> log_level_from_env();
// The level ALLOY_LOG_LEVEL names, applied once at start (so ranks a launcher starts inherit the
// launcher's); unset or empty leaves info. Returns false if it names no level (left at info).
bool apply_log_level_from_env();
// Takes "--log-level X" or "--log-level=X" out of ARGS (a whole command line, ARGS[0] the
// program) wherever it stands before a "--" (what follows is another command's: alloy launch --
// alloy train ...); returns X, "" when absent (the last one given wins).
std::string take_log_level_option(std::vector<char*>* args);
// Prefix every log line (e.g. "[rank 2] "); set once per process.
void set_log_prefix(const std::string& prefix);
bool stderr_is_tty();

class Progress {
 public:
  // TOTAL units of work (steps, bytes); LABEL precedes the bar.
  Progress(std::string label, uint64_t total, bool force_plain = false);
  // DONE units so far; EXTRA is appended (e.g. "loss 2.31 | 1.2k tok/s").
  void update(uint64_t done, const std::string& extra = "");
  void finish(const std::string& extra = "");

 private:
  std::string label_;
  uint64_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_print_;
  bool printed_ = false;
  bool finished_ = false;
};

std::string format_duration(double seconds);
std::string format_count(double v);  // 1234 -> 1.23k

}  // namespace alloy
