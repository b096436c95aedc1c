// Fuzz target: Megatron indexed datasets (PREFIX.idx + PREFIX.bin, data::IndexedDataset::open),
// what `alloy train` reads its tokens from. Input: the .idx bytes, the part separator, the .bin
// bytes. A dataset that opens must hand out every sequence, document and token it claims.
#include "alloy/data/mmidx.h"
#include "fuzz_util.h"

using alloy::InputError;
using alloy::data::IndexedDataset;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = alloy_fuzz::split_parts(alloy_fuzz::as_view(data, size), 2);
  auto& dir = alloy_fuzz::TempDir::get();
  dir.write("ds.idx", parts[0]);
  dir.write("ds.bin", parts[1]);
  IndexedDataset ds;
  try {
    ds = IndexedDataset::open(dir.path() + "/ds");
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  const auto& docs = ds.document_index();
  FUZZ_CHECK(!docs.empty() && docs.front() == 0 && static_cast<uint64_t>(docs.back()) == ds.num_sequences(),
             "document index");
  FUZZ_CHECK(ds.num_documents() + 1 == docs.size(), "num_documents");
  uint64_t tokens = 0;
  for (uint64_t i = 0; i < ds.num_sequences(); ++i) {
    FUZZ_CHECK(ds.sequence_offset(i) == tokens, "sequence " + std::to_string(i) + " is not where the lengths put it");
    tokens += ds.sequence_length(i);
    try {
      auto seq = ds.get_sequence(i);
      FUZZ_CHECK(seq.size() == ds.sequence_length(i), "sequence " + std::to_string(i));
    } catch (const InputError& e) {  // float dtypes, int64 tokens outside int32
      alloy_fuzz::rejected(e);
    }
  }
  FUZZ_CHECK(tokens == ds.total_tokens(), "lengths sum to " + std::to_string(tokens) + ", total_tokens " +
                                              std::to_string(ds.total_tokens()));
  std::vector<int32_t> all(ds.total_tokens());
  try {
    ds.read_tokens(0, all.size(), all.data());
    if (!all.empty()) ds.read_tokens(all.size() - 1, 1, all.data());
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
  }
  try {
    ds.read_tokens(0, all.size() + 1, all.data());
    FUZZ_CHECK(false, "read_tokens past the end did not throw");
  } catch (const std::out_of_range&) {  // documented
  }
  return 0;
}
