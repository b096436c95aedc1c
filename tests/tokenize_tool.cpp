// Prints the token ids of text files, one document per line, so that tests/tokenizer_vs_js.sh can
// diff them against the reference JavaScript encoder. Every document is also decoded again and
// compared with its text, so a run checks the round trip too.
//
//   tokenize_tool [--kind gpt2|byte] [--vocab-dir DIR] [--split-line DELIM] [--time] FILE...
//
// --split-line DELIM: a line consisting of exactly DELIM ends a document (fortune files use "%");
// the delimiter line itself belongs to no document. Without it each file is one document.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/data/tokenizer.h"

namespace {

// Must split exactly as tests/gpt2_encode.js does, or the comparison is meaningless.
std::vector<std::string> split_documents(const std::string& text, const std::string* delim) {
  if (!delim) return {text};
  std::vector<std::string> docs;
  std::string cur;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    size_t line_end = nl == std::string::npos ? text.size() : nl;
    size_t next = nl == std::string::npos ? text.size() : nl + 1;
    if (text.compare(start, line_end - start, *delim) == 0 && line_end - start == delim->size()) {
      docs.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.append(text, start, next - start);
    }
    start = next;
  }
  if (!cur.empty()) docs.push_back(std::move(cur));
  return docs;
}

int usage() {
  std::fprintf(stderr,
               "usage: tokenize_tool [--kind gpt2|byte] [--vocab-dir DIR] [--split-line DELIM] "
               "[--time] FILE...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind = "gpt2", vocab_dir, delim;
  bool have_delim = false, timing = false;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--kind") kind = value();
      else if (a == "--vocab-dir") vocab_dir = value();
      else if (a == "--split-line") delim = value(), have_delim = true;
      else if (a == "--time") timing = true;
      else if (a.rfind("--", 0) == 0) return usage();
      else files.push_back(a);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tokenize_tool: %s\n", e.what());
      return usage();
    }
  }
  if (files.empty()) return usage();

  try {
    auto t0 = std::chrono::steady_clock::now();
    auto tok = alloy::data::make_tokenizer(kind, vocab_dir);
    auto t1 = std::chrono::steady_clock::now();
    double encode_s = 0;
    size_t bytes = 0, tokens = 0;
    std::string line;
    for (const auto& f : files) {
      const std::string text = alloy::read_file(f);
      const auto docs = split_documents(text, have_delim ? &delim : nullptr);
      for (size_t d = 0; d < docs.size(); ++d) {
        auto e0 = std::chrono::steady_clock::now();
        const auto ids = tok->encode(docs[d]);
        encode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
        bytes += docs[d].size();
        tokens += ids.size();
        if (tok->decode(ids) != docs[d]) {
          std::fprintf(stderr, "tokenize_tool: %s document %zu does not round-trip\n", f.c_str(), d);
          return 1;
        }
        line.clear();
        for (size_t k = 0; k < ids.size(); ++k) {
          if (k) line.push_back(' ');
          line += std::to_string(ids[k]);
        }
        line.push_back('\n');
        std::fwrite(line.data(), 1, line.size(), stdout);
      }
    }
    if (timing)
      std::fprintf(stderr, "tokenize_tool: load %.3f s, encoded %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n",
                   std::chrono::duration<double>(t1 - t0).count(), bytes, tokens, encode_s,
                   encode_s > 0 ? bytes / encode_s / 1e6 : 0.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenize_tool: %s\n", e.what());
    return 1;
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}
