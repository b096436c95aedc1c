#include "alloy/core/process.h"

#include <malloc.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

namespace alloy {

void tune_allocator_for_training() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_TOP_PAD_")) return;
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);  // tensors above 256 MiB still get their own mapping
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  ::mallopt(M_TOP_PAD, 64 << 20);
}

void prefer_passive_openmp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || !argv || !argv[0]) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);
  // Exec failed (no /proc?): carry on with the runtime's default waits.
}

bool command_computes_nothing(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "--version") return true;
    if (a == "--log-level") {
      ++i;
      continue;
    }
    if (a.rfind("-", 0) == 0) continue;
    return a == "launch";  // another subcommand computes (its own --help costs nothing worth a rule)
  }
  return true;  // no subcommand: CLI11 prints what is missing
}

namespace {
char* g_args_begin = nullptr;
size_t g_args_size = 0;
}  // namespace

void remember_arguments(int argc, char** argv) {
  if (argc < 1 || !argv || !argv[0]) return;
  // main()'s arguments lie back to back, each ending in a NUL: the area runs to the last one's end.
  char* end = argv[0];
  for (int i = 0; i < argc; ++i) {
    if (argv[i] != end) return;  // not contiguous (someone moved them): leave the title alone
    end += std::strlen(argv[i]) + 1;
  }
  g_args_begin = argv[0];
  g_args_size = static_cast<size_t>(end - argv[0]);
}

void set_process_title(const std::vector<std::string>& words, const std::string& name) {
  ::prctl(PR_SET_NAME, name.substr(0, 15).c_str(), 0, 0, 0);
  if (!g_args_begin || g_args_size == 0) return;
  std::string title;
  for (const auto& w : words) title.append(w).push_back('\0');
  if (title.size() > g_args_size) title.resize(g_args_size - 1), title.push_back('\0');
  std::memset(g_args_begin, 0, g_args_size);
  std::memcpy(g_args_begin, title.data(), title.size());
}

bool is_this_program(const std::string& command) {
  if (command.empty()) return false;
  std::error_code ec;
  const auto self = std::filesystem::canonical("/proc/self/exe", ec);
  if (ec) return false;
  auto same = [&](const std::filesystem::path& p) {
    std::error_code e;
    const auto c = std::filesystem::canonical(p, e);
    return !e && c == self;
  };
  if (command.find('/') != std::string::npos) return same(command);
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  size_t begin = 0;
  while (begin <= dirs.size()) {
    size_t end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = dirs.substr(begin, end - begin);
    const std::filesystem::path candidate = std::filesystem::path(dir.empty() ? "." : dir) / command;
    if (::access(candidate.c_str(), X_OK) == 0) return same(candidate);  // the one execvp would run
    begin = end + 1;
  }
  return false;
}

}  // namespace alloy
