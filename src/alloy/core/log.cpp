#include "alloy/core/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <stdexcept>

namespace alloy {
namespace {
std::mutex g_mu;
std::string g_prefix;
std::atomic<int> g_level{static_cast<int>(LogLevel::Info)};

bool shown(LogLevel level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }

void emit(const char* level, const std::string& msg) {
  std::lock_guard<std::mutex> lk(g_mu);
  std::time_t t = std::time(nullptr);
  char ts[16];
  std::strftime(ts, sizeof ts, "%H:%M:%S", std::localtime(&t));
  std::fprintf(stderr, "%s[%s] %s%s\n", g_prefix.c_str(), ts, level, msg.c_str());
  std::fflush(stderr);
}
}  // namespace

void log_info(const std::string& msg) {
  if (shown(LogLevel::Info)) emit("", msg);
}
void log_warn(const std::string& msg) {
  if (shown(LogLevel::Warning)) emit("warning: ", msg);
}
void log_error(const std::string& msg) { emit("error: ", msg); }
void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

LogLevel parse_log_level(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (n == "debug") return LogLevel::Debug;
  if (n == "info") return LogLevel::Info;
  if (n == "warning" || n == "warn") return LogLevel::Warning;
  if (n == "error" || n == "critical") return LogLevel::Error;
  throw std::invalid_argument("unknown log level '" + name + "' (valid: debug, info, warning, error, critical)");
}

std::string take_log_level_option(std::vector<char*>* args) {
  std::string level;
  std::vector<char*> kept;
  bool after_dashes = false;
  for (size_t i = 0; i < args->size(); ++i) {
    const char* a = (*args)[i];
    after_dashes = after_dashes || (i > 0 && std::strcmp(a, "--") == 0);
    if (i > 0 && !after_dashes && std::strcmp(a, "--log-level") == 0 && i + 1 < args->size()) {
      level = (*args)[++i];
    } else if (i > 0 && !after_dashes && std::strncmp(a, "--log-level=", 12) == 0) {
      level = a + 12;
    } else {
      kept.push_back((*args)[i]);
    }
  }
  *args = std::move(kept);
  return level;
}

std::optional<LogLevel> log_level_from_env() {
  const char* v = std::getenv("ALLOY_LOG_LEVEL");
  if (!v || !*v) return std::nullopt;
  try {
    return parse_log_level(v);
  } catch (const std::invalid_argument&) {
    return std::nullopt;
  }
}

bool apply_log_level_from_env() {
  const char* v = std::getenv("ALLOY_LOG_LEVEL");
  if (const auto level = log_level_from_env()) set_log_level(*level);
  else if (v && *v) return false;
  return true;
}
void set_log_prefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_prefix = prefix;
}
bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

std::string format_duration(double s) {
  if (s < 0) s = 0;
  long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  return buf;
}

std::string format_count(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.2fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

Progress::Progress(std::string label, uint64_t total, bool force_plain)
    : label_(std::move(label)), total_(total), tty_(!force_plain && stderr_is_tty()) {
  start_ = last_print_ = std::chrono::steady_clock::now();
}

void Progress::update(uint64_t done, const std::string& extra) {
  if (!shown(LogLevel::Info)) return;
  auto now = std::chrono::steady_clock::now();
  double since = std::chrono::duration<double>(now - last_print_).count();
  bool last = done >= total_;
  // Redraw at most 10 times a second on a terminal; every 5 s in plain logs.
  if (printed_ && !last && since < (tty_ ? 0.1 : 5.0)) return;
  last_print_ = now;
  printed_ = true;
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double frac = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
  double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
  std::lock_guard<std::mutex> lk(g_mu);
  if (tty_) {
    const int width = 24;
    int filled = static_cast<int>(frac * width);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r%s%s [%s] %llu/%llu %s | ETA %s\033[K", g_prefix.c_str(), label_.c_str(), bar.c_str(),
                 (unsigned long long)done, (unsigned long long)total_, extra.c_str(), format_duration(eta).c_str());
  } else {
    std::fprintf(stderr, "%s%s %llu/%llu (%.0f%%) %s | elapsed %s ETA %s\n", g_prefix.c_str(), label_.c_str(),
                 (unsigned long long)done, (unsigned long long)total_, frac * 100, extra.c_str(),
                 format_duration(elapsed).c_str(), format_duration(eta).c_str());
  }
  std::fflush(stderr);
}

void Progress::finish(const std::string& extra) {
  if (finished_) return;
  finished_ = true;
  if (!shown(LogLevel::Info)) return;
  auto now = std::chrono::steady_clock::now();
  double elapsed = std::chrono::duration<double>(now - start_).count();
  std::lock_guard<std::mutex> lk(g_mu);
  if (tty_ && printed_) std::fprintf(stderr, "\n");
  std::fprintf(stderr, "%s%s done in %s %s\n", g_prefix.c_str(), label_.c_str(), format_duration(elapsed).c_str(),
               extra.c_str());
  std::fflush(stderr);
}

}  // namespace alloy
