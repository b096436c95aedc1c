#pragma once
// Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, "MMIDIDX" version 1), read and written
// without Python or LibTorch. Layout: ../shared/reference/FORMATS.md (beside the repository). The writer reproduces
// Megatron's IndexedDatasetBuilder/_IndexWriter byte for byte so files move freely between the
// two; the reader validates everything before handing out a single token, because a corrupt
// index otherwise surfaces as garbage batches hours into a run.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace alloy {
class AtomicFile;
}

namespace alloy::data {

// Megatron's numeric dtype codes. 6 and 7 meant other things in some older forks; only 1-5 and
// 8 are stable across versions.
enum class DType : uint8_t { U8 = 1, I8 = 2, I16 = 3, I32 = 4, I64 = 5, F64 = 6, F32 = 7, U16 = 8 };

size_t itemsize(DType dtype);
const char* dtype_name(DType dtype);  // numpy spelling: "uint16", "int32", ...
bool is_valid_dtype_code(uint8_t code);
// Megatron's rule (preprocess_data.py / __best_fitting_dtype): uint16 below 65500, else int32.
DType choose_dtype(uint64_t vocab_size);

// Builds PREFIX.bin and PREFIX.idx. Both are written to temporary files and renamed into place by
// finalize(), so an interrupted preprocessing run never leaves a half-written pair under the final
// names. The produced bytes equal Megatron's for the same add_item/end_document calls.
class IndexedDatasetWriter {
 public:
  // dtype must be an integer type (U8, I8, I16, I32, I64, U16); token files use U16 or I32.
  IndexedDatasetWriter(const std::string& prefix, DType dtype);
  ~IndexedDatasetWriter();  // without finalize(): removes the temporary files
  IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter& operator=(IndexedDatasetWriter&&) noexcept;
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one sequence. Throws InputError naming PREFIX.bin if a token does not fit the dtype
  // (Megatron would silently wrap it); nothing of a rejected sequence is written.
  void add_item(const int32_t* tokens, size_t n);
  void add_item(const std::vector<int32_t>& tokens) { add_item(tokens.data(), tokens.size()); }
  // Closes the current document: everything added since the previous end_document(). Calling it
  // twice in a row records an empty document, exactly as Megatron does.
  void end_document();
  // Writes the index and renames both files into place. Throws if sequences were added after the
  // last end_document(): Megatron would write an index whose document list does not end at the
  // sequence count, which its own samplers then silently truncate.
  void finalize();

  uint64_t num_sequences() const { return lengths_.size(); }
  uint64_t num_tokens() const { return tokens_; }

 private:
  void flush_bin();

  std::string prefix_;
  DType dtype_;
  std::unique_ptr<AtomicFile> bin_;
  std::string buf_;  // batches small add_item calls into large writes
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_idx_{0};
  uint64_t tokens_ = 0;
  bool finalized_ = false;
};

// Read-only view of PREFIX.bin/PREFIX.idx through mmap. Thread-safe for concurrent reads.
class IndexedDataset {
 public:
  IndexedDataset() = default;
  // Throws InputError naming PREFIX.idx or PREFIX.bin and the inconsistency found.
  static IndexedDataset open(const std::string& prefix);

  ~IndexedDataset();
  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  uint64_t num_sequences() const { return num_seqs_; }
  // Documents, i.e. document_index().size() - 1.
  uint64_t num_documents() const { return doc_idx_.empty() ? 0 : doc_idx_.size() - 1; }
  // Document k is sequences [document_index()[k], document_index()[k+1]); starts at 0, ends at S.
  const std::vector<int64_t>& document_index() const { return doc_idx_; }
  uint64_t total_tokens() const { return total_tokens_; }
  // True when the index carries Megatron's per-sequence mode bytes (multimodal datasets).
  bool has_sequence_modes() const { return has_modes_; }

  // Throw std::out_of_range for i >= num_sequences().
  uint32_t sequence_length(uint64_t i) const;
  // Position of sequence i in the concatenated token stream (its byte pointer / itemsize).
  uint64_t sequence_offset(uint64_t i) const;
  std::vector<int32_t> get_sequence(uint64_t i) const;

  // Copies tokens [offset, offset + n) of the whole .bin, seen as one concatenated stream (the
  // reader has checked that sequences are laid out back to back from byte 0), widened to int32:
  // U16 values 32768..65535 come out positive. Throws std::out_of_range past total_tokens(), and
  // InputError for float dtypes or I64 values outside int32.
  void read_tokens(uint64_t offset, size_t n, int32_t* out) const;

 private:
  void release() noexcept;

  std::string prefix_;
  DType dtype_ = DType::I32;
  uint64_t num_seqs_ = 0;
  uint64_t total_tokens_ = 0;
  bool has_modes_ = false;
  std::vector<int64_t> doc_idx_;
  // The length and pointer arrays stay in the mapping: copying them would double the memory of a
  // dataset with hundreds of millions of sequences.
  const unsigned char* idx_map_ = nullptr;
  size_t idx_size_ = 0;
  const unsigned char* bin_map_ = nullptr;
  size_t bin_size_ = 0;
};

}  // namespace alloy::data
