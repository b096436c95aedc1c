#include "alloy/data/mmidx.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"

// The format is little-endian and the hot paths copy bytes straight into host integers.
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "alloy/data/mmidx.cpp assumes a little-endian host"
#endif

namespace alloy::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderSize = 34;  // magic 9 + version 8 + dtype 1 + S 8 + D 8
constexpr size_t kFlushBytes = size_t{4} << 20;

// The mapped arrays are not aligned for their element type (pointers start at 34 + 4S), so every
// load goes through memcpy, which compiles to a plain unaligned move.
template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void append(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

bool is_integer_dtype(DType d) {
  return d == DType::U8 || d == DType::I8 || d == DType::I16 || d == DType::I32 ||
         d == DType::I64 || d == DType::U16;
}

// Inclusive int64 range of an integer dtype.
std::pair<int64_t, int64_t> dtype_range(DType d) {
  switch (d) {
    case DType::U8: return {0, 255};
    case DType::I8: return {-128, 127};
    case DType::I16: return {-32768, 32767};
    case DType::U16: return {0, 65535};
    case DType::I32:
      return {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    default: return {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
  }
}

template <typename T>
void encode(std::string& buf, const int32_t* tokens, size_t n) {
  size_t at = buf.size();
  buf.resize(at + n * sizeof(T));
  char* p = &buf[at];
  for (size_t i = 0; i < n; ++i) {
    T v = static_cast<T>(tokens[i]);
    std::memcpy(p + i * sizeof(T), &v, sizeof(T));
  }
}

template <typename T>
void decode(const unsigned char* p, size_t n, int32_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(load<T>(p + i * sizeof(T)));
}

std::string errno_text() { return std::strerror(errno); }

// Maps PATH read-only. Empty files are legal (a dataset with no tokens) but mmap rejects length 0,
// so they map to nullptr.
void map_file(const std::string& path, const unsigned char** data, size_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path, "cannot open: " + errno_text());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw InputError(path, "cannot stat: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(path, "not a regular file");
  }
  *size = static_cast<size_t>(st.st_size);
  *data = nullptr;
  if (*size > 0) {
    void* m = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      std::string why = errno_text();
      ::close(fd);
      throw InputError(path, "mmap failed: " + why);
    }
    *data = static_cast<const unsigned char*>(m);
  }
  ::close(fd);  // the mapping keeps the file alive
}

// Bytes an index with S sequences and D document indices occupies, without the optional mode
// bytes; false if that does not fit in 64 bits (the counts come from the file and may be absurd).
bool index_bytes(uint64_t S, uint64_t D, uint64_t* out) {
  uint64_t a = 0, b = 0;
  return !__builtin_mul_overflow(S, uint64_t{12}, &a) &&
         !__builtin_mul_overflow(D, uint64_t{8}, &b) && !__builtin_add_overflow(a, b, out) &&
         !__builtin_add_overflow(*out, kHeaderSize, out);
}

}  // namespace

size_t itemsize(DType dtype) {
  switch (dtype) {
    case DType::U8:
    case DType::I8: return 1;
    case DType::I16:
    case DType::U16: return 2;
    case DType::I32:
    case DType::F32: return 4;
    case DType::I64:
    case DType::F64: return 8;
  }
  throw std::invalid_argument("unknown MMIDIDX dtype code " +
                              std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::U8: return "uint8";
    case DType::I8: return "int8";
    case DType::I16: return "int16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::F64: return "float64";
    case DType::F32: return "float32";
    case DType::U16: return "uint16";
  }
  return "unknown";
}

bool is_valid_dtype_code(uint8_t code) { return code >= 1 && code <= 8; }

DType choose_dtype(uint64_t vocab_size) { return vocab_size < 65500 ? DType::U16 : DType::I32; }

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, DType dtype)
    : prefix_(prefix), dtype_(dtype) {
  if (!is_valid_dtype_code(static_cast<uint8_t>(dtype)))
    throw InputError(prefix_ + ".bin",
                     "unknown dtype code " + std::to_string(static_cast<int>(dtype)));
  if (!is_integer_dtype(dtype))
    throw InputError(prefix_ + ".bin", std::string("dtype ") + dtype_name(dtype) +
                                           " cannot hold token ids; use uint16 or int32");
  bin_ = std::make_unique<AtomicFile>(prefix_ + ".bin");
}

IndexedDatasetWriter::~IndexedDatasetWriter() = default;
IndexedDatasetWriter::IndexedDatasetWriter(IndexedDatasetWriter&&) noexcept = default;
IndexedDatasetWriter& IndexedDatasetWriter::operator=(IndexedDatasetWriter&&) noexcept = default;

void IndexedDatasetWriter::add_item(const int32_t* tokens, size_t n) {
  if (finalized_ || !bin_) throw Error(prefix_ + ".bin: add_item after finalize() or move");
  const std::string where = prefix_ + ".bin";
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw InputError(where, "sequence " + std::to_string(lengths_.size()) + " has " +
                                std::to_string(n) + " tokens; the index stores lengths as int32");
  // Check the whole sequence before writing any of it, so a rejected call leaves no partial item.
  auto [lo, hi] = dtype_range(dtype_);
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < lo || tokens[i] > hi)
      throw InputError(where, "token " + std::to_string(tokens[i]) + " at position " +
                                  std::to_string(i) + " of sequence " +
                                  std::to_string(lengths_.size()) + " does not fit " +
                                  dtype_name(dtype_) + " (" + std::to_string(lo) + ".." +
                                  std::to_string(hi) + ")");
  }
  switch (dtype_) {
    case DType::U8: encode<uint8_t>(buf_, tokens, n); break;
    case DType::I8: encode<int8_t>(buf_, tokens, n); break;
    case DType::I16: encode<int16_t>(buf_, tokens, n); break;
    case DType::U16: encode<uint16_t>(buf_, tokens, n); break;
    case DType::I32: encode<int32_t>(buf_, tokens, n); break;
    case DType::I64: encode<int64_t>(buf_, tokens, n); break;
    default: throw Error(where + ": unreachable dtype");
  }
  lengths_.push_back(static_cast<int32_t>(n));
  tokens_ += n;
  if (buf_.size() >= kFlushBytes) flush_bin();
}

void IndexedDatasetWriter::end_document() {
  if (finalized_ || !bin_) throw Error(prefix_ + ".bin: end_document after finalize() or move");
  doc_idx_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetWriter::flush_bin() {
  if (!buf_.empty()) bin_->write(buf_.data(), buf_.size());
  buf_.clear();
}

void IndexedDatasetWriter::finalize() {
  if (finalized_ || !bin_) throw Error(prefix_ + ".idx: finalize() called twice or after move");
  const std::string idx_path = prefix_ + ".idx";
  if (static_cast<uint64_t>(doc_idx_.back()) != lengths_.size())
    throw InputError(idx_path, std::to_string(lengths_.size() - doc_idx_.back()) +
                                   " sequence(s) added after the last end_document(); call "
                                   "end_document() before finalize()");
  flush_bin();

  const uint64_t S = lengths_.size();
  const uint64_t D = doc_idx_.size();
  std::string idx;
  idx.reserve(kHeaderSize + 12 * S + 8 * D);
  idx.append(kMagic, sizeof(kMagic));
  append<uint64_t>(idx, kVersion);
  append<uint8_t>(idx, static_cast<uint8_t>(dtype_));
  append<uint64_t>(idx, S);
  append<uint64_t>(idx, D);
  idx.append(reinterpret_cast<const char*>(lengths_.data()), S * sizeof(int32_t));
  const int64_t isz = static_cast<int64_t>(itemsize(dtype_));
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    append<int64_t>(idx, ptr);
    ptr += static_cast<int64_t>(len) * isz;
  }
  idx.append(reinterpret_cast<const char*>(doc_idx_.data()), D * sizeof(int64_t));

  AtomicFile idx_file(idx_path);
  idx_file.write(idx.data(), idx.size());
  // .bin first: a reader that finds the .idx can rely on the matching .bin being in place.
  bin_->commit();
  idx_file.commit();
  finalized_ = true;
  bin_.reset();
}

// ---------------------------------------------------------------------------------------------
// Reader

IndexedDataset::~IndexedDataset() { release(); }

void IndexedDataset::release() noexcept {
  if (idx_map_) ::munmap(const_cast<unsigned char*>(idx_map_), idx_size_);
  if (bin_map_) ::munmap(const_cast<unsigned char*>(bin_map_), bin_size_);
  idx_map_ = bin_map_ = nullptr;
  idx_size_ = bin_size_ = 0;
}

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept { *this = std::move(o); }

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& o) noexcept {
  if (this == &o) return *this;
  release();
  prefix_ = std::move(o.prefix_);
  dtype_ = o.dtype_;
  num_seqs_ = o.num_seqs_;
  total_tokens_ = o.total_tokens_;
  has_modes_ = o.has_modes_;
  doc_idx_ = std::move(o.doc_idx_);
  idx_map_ = std::exchange(o.idx_map_, nullptr);
  idx_size_ = std::exchange(o.idx_size_, 0);
  bin_map_ = std::exchange(o.bin_map_, nullptr);
  bin_size_ = std::exchange(o.bin_size_, 0);
  o.num_seqs_ = o.total_tokens_ = 0;
  return *this;
}

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;  // owns each mapping as soon as it exists, so every throw below unmaps
  ds.prefix_ = prefix;
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";

  map_file(idx_path, &ds.idx_map_, &ds.idx_size_);
  const unsigned char* m = ds.idx_map_;
  const size_t size = ds.idx_size_;
  if (size < kHeaderSize)
    throw InputError(idx_path, "truncated: the header needs " + std::to_string(kHeaderSize) +
                                   " bytes, file has " + std::to_string(size));
  if (std::memcmp(m, kMagic, sizeof(kMagic)) != 0)
    throw InputError(idx_path,
                     "bad magic: not a Megatron MMIDIDX index (expected \"MMIDIDX\\0\\0\")");
  const uint64_t version = load<uint64_t>(m + 9);
  if (version != kVersion)
    throw InputError(idx_path, "unsupported version " + std::to_string(version) + " (expected 1)");
  const uint8_t code = m[17];
  if (!is_valid_dtype_code(code))
    throw InputError(idx_path, "unknown dtype code " + std::to_string(code) +
                                   " (expected 1-8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, "
                                   "6 float64, 7 float32, 8 uint16)");
  ds.dtype_ = static_cast<DType>(code);
  const uint64_t S = load<uint64_t>(m + 18);
  const uint64_t D = load<uint64_t>(m + 26);

  uint64_t needed = 0;
  const bool representable = index_bytes(S, D, &needed);
  const std::string counts = "header says " + std::to_string(S) + " sequences and " +
                             std::to_string(D) + " document indices, needs ";
  if (!representable || size < needed)
    throw InputError(idx_path, "truncated: " + counts +
                                   (representable ? std::to_string(needed) : "over 2^64") +
                                   " bytes, file has " + std::to_string(size));
  if (size - needed == S && S > 0) {
    ds.has_modes_ = true;  // multimodal: one int8 mode per sequence follows the document index
  } else if (size != needed) {
    throw InputError(idx_path, "size mismatch: " + counts + std::to_string(needed) + " bytes (or " +
                                   std::to_string(needed + S) + " with sequence modes), file has " +
                                   std::to_string(size));
  }
  if (D == 0)
    throw InputError(idx_path,
                     "document index is empty; it must start with 0 and end with the "
                     "sequence count");
  ds.num_seqs_ = S;

  const unsigned char* lens = m + kHeaderSize;
  const unsigned char* ptrs = lens + 4 * S;
  const unsigned char* docs = ptrs + 8 * S;
  const uint64_t isz = itemsize(ds.dtype_);
  // Pointers must describe sequences packed back to back from byte 0: that is what Megatron
  // writes, and it is what lets read_tokens treat the .bin as one stream.
  uint64_t expect = 0;
  for (uint64_t i = 0; i < S; ++i) {
    const int32_t len = load<int32_t>(lens + 4 * i);
    if (len < 0)
      throw InputError(idx_path, "sequence " + std::to_string(i) + " has negative length " +
                                     std::to_string(len));
    const int64_t ptr = load<int64_t>(ptrs + 8 * i);
    if (ptr < 0 || static_cast<uint64_t>(ptr) != expect)
      throw InputError(idx_path, "sequence " + std::to_string(i) + " pointer is " +
                                     std::to_string(ptr) + " but the lengths before it put it at " +
                                     std::to_string(expect) + " bytes");
    if (__builtin_add_overflow(expect, static_cast<uint64_t>(len) * isz, &expect))
      throw InputError(idx_path, "sequence lengths add up to more than 2^64 bytes");
  }

  ds.doc_idx_.resize(D);
  for (uint64_t k = 0; k < D; ++k) {
    const int64_t d = load<int64_t>(docs + 8 * k);
    if (k == 0 && d != 0)
      throw InputError(idx_path, "document index starts with " + std::to_string(d) + ", not 0");
    if (k > 0 && d < ds.doc_idx_[k - 1])
      throw InputError(idx_path, "document index decreases at entry " + std::to_string(k) + ": " +
                                     std::to_string(ds.doc_idx_[k - 1]) + " then " +
                                     std::to_string(d));
    if (d < 0 || static_cast<uint64_t>(d) > S)
      throw InputError(idx_path, "document index entry " + std::to_string(k) + " is " +
                                     std::to_string(d) + ", outside 0.." + std::to_string(S));
    ds.doc_idx_[k] = d;
  }
  if (static_cast<uint64_t>(ds.doc_idx_.back()) != S)
    throw InputError(idx_path, "document index ends with " + std::to_string(ds.doc_idx_.back()) +
                                   ", not the sequence count " + std::to_string(S));
  ds.total_tokens_ = expect / isz;

  map_file(bin_path, &ds.bin_map_, &ds.bin_size_);
  if (ds.bin_size_ < expect) {
    // Name the first sequence that runs past the end: that is what a reader would trip over.
    uint64_t at = 0, i = 0;
    for (; i < S; ++i) {
      at += static_cast<uint64_t>(load<int32_t>(lens + 4 * i)) * isz;
      if (at > ds.bin_size_) break;
    }
    throw InputError(bin_path, "truncated: the index says sequence " + std::to_string(i) +
                                   " ends at byte " + std::to_string(at) + " and all " +
                                   std::to_string(S) + " sequences need " + std::to_string(expect) +
                                   " bytes, file has " + std::to_string(ds.bin_size_));
  }
  if (ds.bin_size_ > expect)
    throw InputError(bin_path, "has " + std::to_string(ds.bin_size_) + " bytes but the index " +
                                   idx_path + " describes only " + std::to_string(expect) +
                                   "; the two files do not belong together");
  return ds;
}

uint32_t IndexedDataset::sequence_length(uint64_t i) const {
  if (i >= num_seqs_)
    throw std::out_of_range(prefix_ + ": sequence " + std::to_string(i) + " out of range (" +
                            std::to_string(num_seqs_) + " sequences)");
  return static_cast<uint32_t>(load<int32_t>(idx_map_ + kHeaderSize + 4 * i));
}

uint64_t IndexedDataset::sequence_offset(uint64_t i) const {
  if (i >= num_seqs_)
    throw std::out_of_range(prefix_ + ": sequence " + std::to_string(i) + " out of range (" +
                            std::to_string(num_seqs_) + " sequences)");
  const int64_t ptr = load<int64_t>(idx_map_ + kHeaderSize + 4 * num_seqs_ + 8 * i);
  return static_cast<uint64_t>(ptr) / itemsize(dtype_);
}

std::vector<int32_t> IndexedDataset::get_sequence(uint64_t i) const {
  std::vector<int32_t> out(sequence_length(i));
  read_tokens(sequence_offset(i), out.size(), out.data());
  return out;
}

void IndexedDataset::read_tokens(uint64_t offset, size_t n, int32_t* out) const {
  if (offset > total_tokens_ || n > total_tokens_ - offset)
    throw std::out_of_range(prefix_ + ".bin: tokens [" + std::to_string(offset) + ", " +
                            std::to_string(offset) + "+" + std::to_string(n) + ") past the end (" +
                            std::to_string(total_tokens_) + " tokens)");
  if (n == 0) return;
  const unsigned char* p = bin_map_ + offset * itemsize(dtype_);
  switch (dtype_) {
    case DType::U16: decode<uint16_t>(p, n, out); return;
    case DType::I32: std::memcpy(out, p, n * sizeof(int32_t)); return;
    case DType::U8: decode<uint8_t>(p, n, out); return;
    case DType::I8: decode<int8_t>(p, n, out); return;
    case DType::I16: decode<int16_t>(p, n, out); return;
    case DType::I64:
      for (size_t i = 0; i < n; ++i) {
        const int64_t v = load<int64_t>(p + 8 * i);
        if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
          throw InputError(prefix_ + ".bin", "token " + std::to_string(v) + " at position " +
                                                 std::to_string(offset + i) +
                                                 " does not fit int32");
        out[i] = static_cast<int32_t>(v);
      }
      return;
    case DType::F32:
    case DType::F64: break;
  }
  throw InputError(prefix_ + ".idx", std::string("dtype ") + dtype_name(dtype_) +
                                         " does not hold token ids; read_tokens needs an integer "
                                         "dtype");
}

}  // namespace alloy::data
