#include "alloy/data/windows.h"

#include <algorithm>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

namespace alloy::data {

TokenWindows::TokenWindows(std::shared_ptr<const IndexedDataset> ds, int64_t seq_len, std::string name, uint64_t begin, uint64_t end)
    : ds_(std::move(ds)), seq_len_(seq_len), begin_(begin), name_(std::move(name)) {
  end_ = end == 0 ? ds_->total_tokens() : std::min<uint64_t>(end, ds_->total_tokens());
  if (begin_ > end_) begin_ = end_;
  const uint64_t total = end_ - begin_;
  num_samples_ = total > 0 ? (total - 1) / static_cast<uint64_t>(seq_len_) : 0;
  if (num_samples_ == 0)
    throw InputError(name_, "has " + std::to_string(total) + " tokens, fewer than one sample of model.seq_len + 1 = " +
                                std::to_string(seq_len_ + 1));
}

void TokenWindows::gather(const std::vector<uint64_t>& samples, int64_t* out) const {
  std::vector<int32_t> buf(static_cast<size_t>(seq_len_ + 1));
  for (uint64_t s : samples) {
    ds_->read_tokens(begin_ + s * static_cast<uint64_t>(seq_len_), buf.size(), buf.data());
    out = std::copy(buf.begin(), buf.end(), out);
  }
}

int32_t TokenWindows::max_token() const {
  if (max_token_ >= 0) return max_token_;
  std::vector<int32_t> buf(1 << 16);
  int32_t mx = 0;
  for (uint64_t off = begin_; off < end_; off += buf.size()) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), end_ - off));
    ds_->read_tokens(off, n, buf.data());
    mx = std::max(mx, *std::max_element(buf.begin(), buf.begin() + static_cast<long>(n)));
  }
  return max_token_ = mx;
}

DatasetPaths resolve_dataset_paths(const std::string& prefix, const std::string& valid_prefix) {
  if (prefix.empty()) throw InputError("data.prefix", "is empty: set it in the config or with --set data.prefix=PATH");
  DatasetPaths p;
  if (file_exists(prefix + ".idx")) {
    p.train = prefix;
  } else if (file_exists(prefix + "_train.idx")) {
    p.train = prefix + "_train";
    if (file_exists(prefix + "_valid.idx")) p.valid = prefix + "_valid";
  } else {
    throw InputError("data.prefix", "no dataset at '" + prefix + "': neither " + prefix + ".idx nor " + prefix +
                                        "_train.idx exists (create one with `alloy data prepare`)");
  }
  if (!valid_prefix.empty()) {
    if (!file_exists(valid_prefix + ".idx"))
      throw InputError("data.valid_prefix", "no dataset at '" + valid_prefix + "' (" + valid_prefix + ".idx missing)");
    p.valid = valid_prefix;
  }
  return p;
}

}  // namespace alloy::data
