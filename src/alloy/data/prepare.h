#pragma once
// `alloy data prepare`: text files -> Megatron indexed datasets PREFIX_train and PREFIX_valid.
#include <cstdint>
#include <string>
#include <vector>

namespace alloy::data {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string tokenizer = "byte";
  std::string vocab_dir;
  std::string tokenizer_model;        // sentencepiece: the model file
  bool add_bos = false;               // sentencepiece: each document starts with <s>
  std::string output;                 // PREFIX
  double valid_fraction = 0.05;       // share of documents held out, chosen deterministically
  std::string doc_sep = "auto";       // auto | fortune | blank | line | file
  bool progress = true;
};

struct PrepareResult {
  std::string train_prefix, valid_prefix;
  uint64_t train_docs = 0, valid_docs = 0, train_tokens = 0, valid_tokens = 0;
  int32_t vocab_size = 0;
};

// Splits one file's text into documents. fortune: lines holding only "%"; blank: empty lines;
// line: every line; file: the whole text; auto: fortune if such separator lines occur, else blank.
std::vector<std::string> split_documents(const std::string& text, const std::string& mode);

// Files as given; a directory stands for its text files (binary files such as fortune's .dat
// indexes are skipped), sorted by name.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs);

PrepareResult prepare_dataset(const PrepareOptions& o);

}  // namespace alloy::data
