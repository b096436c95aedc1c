#pragma once
// Logging and progress display. On a terminal a progress line redraws in place; otherwise (CI,
// files, `alloy launch` prefixes) plain log lines are printed at intervals so logs stay readable.
#include <chrono>
#include <cstdint>
#include <string>

namespace alloy {

void log_info(const std::string& msg);
void log_warn(const std::string& msg);
void log_error(const std::string& msg);
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
