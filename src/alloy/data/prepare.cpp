#include "alloy/data/prepare.h"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/data/mmidx.h"
#include "alloy/data/sampler.h"
#include "alloy/data/tokenizer.h"

namespace alloy::data {
namespace {
bool only_spaces(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

bool looks_binary(const std::string& path) {
  std::string head = read_file(path).substr(0, 4096);
  return head.find('\0') != std::string::npos;
}
}  // namespace

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    if (!std::filesystem::is_directory(in)) {
      if (looks_binary(in)) throw InputError(in, "is not a text file (it contains NUL bytes)");
      files.push_back(in);
      continue;
    }
    std::vector<std::string> found;
    for (const auto& e : std::filesystem::directory_iterator(in))
      if (e.is_regular_file() && !looks_binary(e.path().string())) found.push_back(e.path().string());
    std::sort(found.begin(), found.end());  // directory order is arbitrary; datasets must not be
    if (found.empty()) throw InputError(in, "holds no text files");
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

std::vector<std::string> split_documents(const std::string& text, const std::string& mode_in) {
  std::string mode = mode_in;
  if (mode == "auto") mode = (text.rfind("%\n", 0) == 0 || text.find("\n%\n") != std::string::npos) ? "fortune" : "blank";
  std::vector<std::string> docs;
  if (mode == "file") {
    if (!only_spaces(text)) docs.push_back(text);
    return docs;
  }
  if (mode != "fortune" && mode != "blank" && mode != "line")
    throw InputError("--doc-sep", "must be auto, fortune, blank, line or file; got '" + mode_in + "'");
  std::istringstream in(text);
  std::string line, cur;
  auto flush = [&]() {
    if (!only_spaces(cur)) docs.push_back(cur);
    cur.clear();
  };
  while (std::getline(in, line)) {
    bool sep = (mode == "fortune" && line == "%") || (mode == "blank" && only_spaces(line));
    if (sep) {
      flush();
      continue;
    }
    cur += line;
    cur += '\n';
    if (mode == "line") flush();
  }
  flush();
  return docs;
}

PrepareResult prepare_dataset(const PrepareOptions& o) {
  if (o.inputs.empty()) throw InputError("--input", "no input files given");
  if (o.output.empty()) throw InputError("--output", "no output prefix given");
  if (o.valid_fraction < 0 || o.valid_fraction >= 1) throw InputError("--valid-fraction", "must be in [0, 1)");
  auto tok = make_tokenizer(o.tokenizer, o.vocab_dir, o.tokenizer_model, o.add_bos);

  std::vector<std::string> files = expand_inputs(o.inputs);
  std::string out_dir = std::filesystem::path(o.output).parent_path().string();
  if (!out_dir.empty()) ensure_writable_dir(out_dir);
  uint64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += read_file(f).size();  // also fails early on unreadable files

  PrepareResult r;
  r.vocab_size = tok->vocab_size();
  r.train_prefix = o.output + "_train";
  r.valid_prefix = o.output + "_valid";
  DType dt = choose_dtype(static_cast<uint64_t>(tok->vocab_size()));
  IndexedDatasetWriter train(r.train_prefix, dt), valid(r.valid_prefix, dt);
  // Every k-th document goes to validation: deterministic, spread over all inputs, no RNG needed.
  const uint64_t every = o.valid_fraction > 0 ? static_cast<uint64_t>(1.0 / o.valid_fraction + 0.5) : 0;

  Progress progress("prepare", total_bytes, !o.progress);
  uint64_t done_bytes = 0, doc_no = 0;
  for (const auto& f : files) {
    std::string text = read_file(f);
    for (const auto& d : split_documents(text, o.doc_sep)) {
      std::vector<int32_t> ids = tok->encode(d);
      ids.push_back(tok->eot_id());
      bool is_valid = every > 0 && doc_no % every == every - 1;
      auto& w = is_valid ? valid : train;
      w.add_item(ids);
      w.end_document();
      (is_valid ? r.valid_docs : r.train_docs)++;
      (is_valid ? r.valid_tokens : r.train_tokens) += ids.size();
      ++doc_no;
    }
    done_bytes += text.size();
    if (o.progress) progress.update(done_bytes, f);
  }
  if (r.train_docs == 0) throw InputError(o.inputs.front(), "no documents found in the input files");
  train.finalize();
  valid.finalize();
  if (o.progress) progress.finish();
  return r;
}

}  // namespace alloy::data
