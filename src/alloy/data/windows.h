#pragma once
// Training samples cut from an indexed dataset the way Megatron's GPT dataset does: the documents
// are one concatenated token stream (each ends with end-of-text), and sample i is the window of
// seq_len + 1 tokens starting at token i * seq_len; its first seq_len tokens are the input and its
// last seq_len the targets.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "alloy/data/mmidx.h"

namespace alloy::data {

class TokenWindows {
 public:
  // Over the dataset's tokens [BEGIN, END) (END 0: to the end): a share of one dataset (data.split).
  TokenWindows(std::shared_ptr<const IndexedDataset> ds, int64_t seq_len, std::string name, uint64_t begin = 0, uint64_t end = 0);
  uint64_t num_samples() const { return num_samples_; }
  int64_t seq_len() const { return seq_len_; }
  // Fills OUT (count * (seq_len + 1) tokens) with the given samples, row by row.
  void gather(const std::vector<uint64_t>& samples, int64_t* out) const;
  const std::string& name() const { return name_; }
  int32_t max_token() const;  // largest token id in the dataset (scans once, cached)

 private:
  std::shared_ptr<const IndexedDataset> ds_;
  int64_t seq_len_;
  uint64_t begin_ = 0, end_ = 0;
  uint64_t num_samples_;
  std::string name_;
  mutable int32_t max_token_ = -1;
};

// Resolves data.prefix as written by `alloy data prepare` (PREFIX_train / PREFIX_valid) or as a
// plain Megatron prefix (PREFIX.bin/.idx). Empty valid result = no validation set.
struct DatasetPaths {
  std::string train, valid;
};
DatasetPaths resolve_dataset_paths(const std::string& prefix, const std::string& valid_prefix);

}  // namespace alloy::data
