// Runs every file of the given corpus directories (or single files) once through the fuzz
// target's LLVMFuzzerTestOneInput, in name order: the fuzz.replay.* tests, built with the
// project's compiler and no libFuzzer. A crash or an unexpected exception fails the test and
// names the input.
//
// The inputs run on a thread with a 256 KiB stack, a 32nd of the main thread's: recursion that
// deepens with the input (nesting) then overflows with inputs of KBs instead of hundreds of KBs,
// so its reproducers stay small. Every reader handles its legitimate inputs in far less.
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <pthread.h>
#include <signal.h>
#include <string>
#include <vector>

#include <unistd.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

char g_current[4096] = "";

void on_signal(int sig) {
  const char* head = "fuzz replay: fatal signal while running ";
  ssize_t ignored = ::write(2, head, std::strlen(head));
  ignored = ::write(2, g_current, std::strlen(g_current));
  ignored = ::write(2, "\n", 1);
  (void)ignored;
  signal(sig, SIG_DFL);
  raise(sig);
}

struct Run {
  std::vector<std::filesystem::path> files;
  int rc = 0;
};

void* run_all(void* arg) {
  Run& run = *static_cast<Run*>(arg);
#ifndef __SANITIZE_ADDRESS__
  // The handler must not run on the stack that overflowed. Under ASan, ASan owns the signal
  // stack and reports overflows itself (it fails to unmap an alternate stack it did not make).
  static char alt[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof alt;
  sigaltstack(&ss, nullptr);
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_ONSTACK;
    sigaction(sig, &sa, nullptr);
  }
#endif
  for (const auto& f : run.files) {
    std::snprintf(g_current, sizeof g_current, "%s", f.c_str());
    std::ifstream in(f, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz replay: %s: uncaught exception: %s\n", f.c_str(), e.what());
      run.rc = 1;
      return nullptr;
    }
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  Run run;
  for (int i = 1; i < argc; ++i) {
    fs::path p = argv[i];
    if (fs::is_directory(p)) {
      for (const auto& e : fs::directory_iterator(p))
        if (e.is_regular_file()) run.files.push_back(e.path());
    } else if (fs::is_regular_file(p)) {
      run.files.push_back(p);
    } else {
      std::fprintf(stderr, "fuzz replay: %s is neither a file nor a directory\n", argv[i]);
      return 2;
    }
  }
  std::sort(run.files.begin(), run.files.end());
  if (run.files.empty()) {
    std::fprintf(stderr, "fuzz replay: no inputs found\n");
    return 2;
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
#ifdef __SANITIZE_ADDRESS__
  // ASan's redzones make frames several times larger.
  pthread_attr_setstacksize(&attr, size_t{1} << 20);
#else
  pthread_attr_setstacksize(&attr, size_t{256} << 10);
#endif
  pthread_t thread;
  if (pthread_create(&thread, &attr, run_all, &run) != 0) {
    std::perror("pthread_create");
    return 2;
  }
  pthread_join(thread, nullptr);
  if (run.rc != 0) return run.rc;
  std::printf("fuzz replay: %zu inputs, no failures\n", run.files.size());
  return 0;
}
