#pragma once
// Helpers shared by the fuzz targets (fuzz/fuzz_*.cpp). Each target defines
// LLVMFuzzerTestOneInput: built with clang -fsanitize=fuzzer,address,undefined by
// scripts/fuzz.sh, and with the project's compiler plus replay_main.cpp as the fuzz.replay.*
// tests, which run every file of the target's corpus once.
//
// What counts as a finding: a crash, a sanitizer report, a hang, a failed FUZZ_CHECK, or an
// exception other than alloy::InputError leaving the reader (every reader here documents
// InputError as its answer to bad input). Targets catch InputError and nothing else, so anything
// unexpected reaches std::terminate and the fuzzer reports it.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

namespace alloy_fuzz {

// Multi-file inputs (an .idx and its .bin, encoder.json + vocab.bpe + text, ...) are the parts
// of one fuzz input, separated by this line.
inline constexpr std::string_view kPartSeparator = "\n--alloy-fuzz-part--\n";

inline std::string_view as_view(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Splits INPUT at the first N-1 separators into exactly N parts (missing parts are empty).
inline std::vector<std::string> split_parts(std::string_view input, size_t n) {
  std::vector<std::string> parts;
  while (parts.size() + 1 < n) {
    size_t at = input.find(kPartSeparator);
    if (at == std::string_view::npos) break;
    parts.emplace_back(input.substr(0, at));
    input.remove_prefix(at + kPartSeparator.size());
  }
  parts.emplace_back(input);
  parts.resize(n);
  return parts;
}

// A private directory for readers that take a path; removed when the process exits.
class TempDir {
 public:
  static TempDir& get() {
    static TempDir dir;
    return dir;
  }
  const std::string& path() const { return path_; }
  // Writes CONTENTS to DIR/NAME (plainly, not atomically: speed matters here) and returns the path.
  std::string write(const std::string& name, std::string_view contents) const {
    std::string p = path_ + "/" + name;
    FILE* f = std::fopen(p.c_str(), "wb");
    if (!f) {
      std::perror(p.c_str());
      std::abort();
    }
    if (!contents.empty() && std::fwrite(contents.data(), 1, contents.size(), f) != contents.size()) std::abort();
    std::fclose(f);
    return p;
  }

 private:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/alloy-fuzz.XXXXXX";
    if (!::mkdtemp(tmpl.data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    path_ = tmpl;
  }
  ~TempDir() { alloy::remove_tree(path_); }
  std::string path_;
};

// Called for every InputError a target catches: silent, unless ALLOY_FUZZ_VERBOSE is set (to see
// why a corpus input is refused: ALLOY_FUZZ_VERBOSE=1 fuzz_replay_plan corpus/plan).
inline void rejected(const alloy::InputError& e) {
  static const bool verbose = std::getenv("ALLOY_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "rejected: %s\n", e.what());
}

[[noreturn]] inline void check_failed(const char* expr, const char* file, int line, const std::string& detail) {
  std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n%s\n", file, line, expr, detail.c_str());
  std::abort();
}

}  // namespace alloy_fuzz

// An invariant of the reader (a documented round trip, ...); aborts so the fuzzer records it.
#define FUZZ_CHECK(cond, detail) \
  do {                           \
    if (!(cond)) ::alloy_fuzz::check_failed(#cond, __FILE__, __LINE__, (detail)); \
  } while (0)
