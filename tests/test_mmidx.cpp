#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/data/mmidx.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using alloy::InputError;
using alloy::data::choose_dtype;
using alloy::data::DType;
using alloy::data::IndexedDataset;
using alloy::data::IndexedDatasetWriter;
using alloy::testing::TempDir;

namespace {

// Bytes are assembled by shifting, independently of the implementation's memcpy-based encoding,
// so the expected files below follow FORMATS.md rather than the code under test.
using Bytes = std::string;
void put_le(Bytes& b, uint64_t v, int nbytes) {
  for (int i = 0; i < nbytes; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void u8(Bytes& b, uint64_t v) { put_le(b, v, 1); }
void u16(Bytes& b, uint64_t v) { put_le(b, v, 2); }
void i32(Bytes& b, int64_t v) { put_le(b, static_cast<uint64_t>(v), 4); }
void u64(Bytes& b, uint64_t v) { put_le(b, v, 8); }
void i64(Bytes& b, int64_t v) { put_le(b, static_cast<uint64_t>(v), 8); }

Bytes magic() { return Bytes("MMIDIDX\0\0", 9); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void spit(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// The tiny case from the brief: document 0 = sequences {1,2,3} and {40000}, document 1 = {65535,
// 7}.
const std::vector<std::vector<std::vector<int32_t>>> kTiny = {{{1, 2, 3}, {40000}}, {{65535, 7}}};

// Expected .idx per FORMATS.md for kTiny with the given itemsize and dtype code.
Bytes tiny_idx(int isz, uint8_t code) {
  Bytes b = magic();
  u64(b, 1);    // version
  u8(b, code);  // dtype
  u64(b, 3);    // S
  u64(b, 3);    // D = documents + 1
  i32(b, 3);    // lengths
  i32(b, 1);
  i32(b, 2);
  i64(b, 0);  // pointers: running byte offsets
  i64(b, 3 * isz);
  i64(b, 4 * isz);
  i64(b, 0);  // document index: 0, then the sequence count after each end_document
  i64(b, 2);
  i64(b, 3);
  return b;
}

Bytes tiny_bin_u16() {
  Bytes b;
  for (uint64_t v : {1, 2, 3, 40000, 65535, 7}) u16(b, v);
  return b;
}
Bytes tiny_bin_i32() {
  Bytes b;
  for (int64_t v : {1, 2, 3, 40000, 65535, 7}) i32(b, v);
  return b;
}

void write_docs(const std::string& prefix, DType dtype,
                const std::vector<std::vector<std::vector<int32_t>>>& docs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& doc : docs) {
    for (const auto& seq : doc) w.add_item(seq.data(), seq.size());
    w.end_document();
  }
  w.finalize();
}

// Runs FN and checks it throws InputError whose where() is exactly PATH and whose message
// contains each of NEEDLES.
void expect_input_error(const std::function<void()>& fn, const std::string& path,
                        std::vector<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected InputError for " << path;
  } catch (const InputError& e) {
    EXPECT_EQ(e.where(), path) << e.what();
    std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    for (const auto& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
  }
}

}  // namespace

TEST(MmidxDtype, ItemsizesAndChoice) {
  EXPECT_EQ(alloy::data::itemsize(DType::U8), 1u);
  EXPECT_EQ(alloy::data::itemsize(DType::I8), 1u);
  EXPECT_EQ(alloy::data::itemsize(DType::I16), 2u);
  EXPECT_EQ(alloy::data::itemsize(DType::U16), 2u);
  EXPECT_EQ(alloy::data::itemsize(DType::I32), 4u);
  EXPECT_EQ(alloy::data::itemsize(DType::F32), 4u);
  EXPECT_EQ(alloy::data::itemsize(DType::I64), 8u);
  EXPECT_EQ(alloy::data::itemsize(DType::F64), 8u);
  EXPECT_EQ(choose_dtype(50257), DType::U16);
  EXPECT_EQ(choose_dtype(65499), DType::U16);
  EXPECT_EQ(choose_dtype(65500), DType::I32);
  EXPECT_EQ(choose_dtype(128256), DType::I32);
}

TEST(MmidxWriter, BytesMatchSpecU16) {
  TempDir t;
  std::string prefix = t.file("tiny");
  write_docs(prefix, DType::U16, kTiny);
  EXPECT_EQ(slurp(prefix + ".bin"), tiny_bin_u16());
  EXPECT_EQ(slurp(prefix + ".idx"), tiny_idx(2, 8));
}

TEST(MmidxWriter, BytesMatchSpecI32) {
  TempDir t;
  std::string prefix = t.file("tiny");
  write_docs(prefix, DType::I32, kTiny);
  EXPECT_EQ(slurp(prefix + ".bin"), tiny_bin_i32());
  EXPECT_EQ(slurp(prefix + ".idx"), tiny_idx(4, 4));
}

TEST(MmidxWriter, EmptyDocumentRepeatsIndexLikeMegatron) {
  TempDir t;
  std::string prefix = t.file("e");
  IndexedDatasetWriter w(prefix, DType::U16);
  std::vector<int32_t> a{5};
  w.add_item(a);
  w.end_document();
  w.end_document();  // Megatron appends len(sequence_lengths) again: an empty document
  w.add_item(a);
  w.end_document();
  w.finalize();
  auto ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.document_index(), (std::vector<int64_t>{0, 1, 1, 2}));
  EXPECT_EQ(ds.num_documents(), 3u);
}

TEST(MmidxWriter, NothingVisibleBeforeFinalizeAndNoLeftoversWhenAbandoned) {
  TempDir t;
  std::string prefix = t.file("atomic");
  {
    IndexedDatasetWriter w(prefix, DType::I32);
    std::vector<int32_t> a{1, 2, 3};
    w.add_item(a);
    w.end_document();
    EXPECT_FALSE(fs::exists(prefix + ".bin"));
    EXPECT_FALSE(fs::exists(prefix + ".idx"));
  }
  EXPECT_TRUE(fs::is_empty(t.path())) << "temporary files left behind";
  {
    IndexedDatasetWriter w(prefix, DType::I32);
    std::vector<int32_t> a{1, 2, 3};
    w.add_item(a);
    w.end_document();
    w.finalize();
  }
  EXPECT_TRUE(fs::exists(prefix + ".bin"));
  EXPECT_TRUE(fs::exists(prefix + ".idx"));
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path()), fs::directory_iterator()), 2);
}

TEST(MmidxWriter, RejectsTokensThatDoNotFit) {
  TempDir t;
  std::string prefix = t.file("r");
  IndexedDatasetWriter w(prefix, DType::U16);
  std::vector<int32_t> too_big{1, 65536};
  expect_input_error([&] { w.add_item(too_big); }, prefix + ".bin",
                     {"65536", "uint16", "position 1"});
  std::vector<int32_t> negative{-1};
  expect_input_error([&] { w.add_item(negative); }, prefix + ".bin", {"-1", "uint16"});
  // A rejected sequence leaves no trace: the file holds only what was accepted.
  std::vector<int32_t> ok{65535};
  w.add_item(ok);
  w.end_document();
  w.finalize();
  auto ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.num_sequences(), 1u);
  EXPECT_EQ(ds.get_sequence(0), ok);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 2u);
}

TEST(MmidxWriter, RejectsNonTokenDtypeAndUnterminatedDocument) {
  TempDir t;
  std::string prefix = t.file("x");
  expect_input_error([&] { IndexedDatasetWriter w(prefix, DType::F32); }, prefix + ".bin",
                     {"float32"});
  IndexedDatasetWriter w(prefix, DType::I32);
  std::vector<int32_t> a{1};
  w.add_item(a);
  expect_input_error([&] { w.finalize(); }, prefix + ".idx", {"end_document"});
  EXPECT_FALSE(fs::exists(prefix + ".idx"));
}

TEST(MmidxWriter, EmptyDataset) {
  TempDir t;
  std::string prefix = t.file("empty");
  IndexedDatasetWriter w(prefix, DType::U16);
  w.finalize();
  Bytes idx = magic();
  u64(idx, 1);
  u8(idx, 8);
  u64(idx, 0);
  u64(idx, 1);
  i64(idx, 0);
  EXPECT_EQ(slurp(prefix + ".idx"), idx);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 0u);
  auto ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.num_sequences(), 0u);
  EXPECT_EQ(ds.num_documents(), 0u);
  EXPECT_EQ(ds.total_tokens(), 0u);
  ds.read_tokens(0, 0, nullptr);
}

TEST(MmidxReader, ReadsHandMadeBytes) {
  TempDir t;
  for (bool is_u16 : {true, false}) {
    std::string prefix = t.file(is_u16 ? "hand16" : "hand32");
    spit(prefix + ".idx", is_u16 ? tiny_idx(2, 8) : tiny_idx(4, 4));
    spit(prefix + ".bin", is_u16 ? tiny_bin_u16() : tiny_bin_i32());
    auto ds = IndexedDataset::open(prefix);
    EXPECT_EQ(ds.dtype(), is_u16 ? DType::U16 : DType::I32);
    EXPECT_EQ(ds.num_sequences(), 3u);
    EXPECT_EQ(ds.num_documents(), 2u);
    EXPECT_EQ(ds.total_tokens(), 6u);
    EXPECT_EQ(ds.document_index(), (std::vector<int64_t>{0, 2, 3}));
    EXPECT_EQ(ds.sequence_length(0), 3u);
    EXPECT_EQ(ds.sequence_length(1), 1u);
    EXPECT_EQ(ds.sequence_length(2), 2u);
    EXPECT_EQ(ds.sequence_offset(2), 4u);
    EXPECT_FALSE(ds.has_sequence_modes());
    EXPECT_EQ(ds.get_sequence(0), (std::vector<int32_t>{1, 2, 3}));
    EXPECT_EQ(ds.get_sequence(1), (std::vector<int32_t>{40000}));
    EXPECT_EQ(ds.get_sequence(2), (std::vector<int32_t>{65535, 7}));
    // Across sequence boundaries, as a sampler reads a packed sample.
    std::vector<int32_t> out(4);
    ds.read_tokens(2, 4, out.data());
    EXPECT_EQ(out, (std::vector<int32_t>{3, 40000, 65535, 7}));
    EXPECT_THROW(ds.read_tokens(5, 2, out.data()), std::out_of_range);
    EXPECT_THROW(ds.sequence_length(3), std::out_of_range);
  }
}

TEST(MmidxReader, U16HighValuesArePositive) {
  TempDir t;
  std::string prefix = t.file("hi");
  std::vector<int32_t> seq{32767, 32768, 40000, 65534, 65535, 0};
  write_docs(prefix, DType::U16, {{seq}});
  auto ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.get_sequence(0), seq);
  std::vector<int32_t> out(seq.size());
  ds.read_tokens(0, seq.size(), out.data());
  EXPECT_EQ(out, seq);
}

TEST(MmidxReader, AcceptsMultimodalModeBytes) {
  TempDir t;
  std::string prefix = t.file("mm");
  Bytes idx = tiny_idx(2, 8);
  for (int i = 0; i < 3; ++i) u8(idx, 0);
  spit(prefix + ".idx", idx);
  spit(prefix + ".bin", tiny_bin_u16());
  auto ds = IndexedDataset::open(prefix);
  EXPECT_TRUE(ds.has_sequence_modes());
  EXPECT_EQ(ds.get_sequence(2), (std::vector<int32_t>{65535, 7}));
}

TEST(MmidxReader, MoveKeepsMappingValid) {
  TempDir t;
  std::string prefix = t.file("mv");
  write_docs(prefix, DType::I32, kTiny);
  auto a = IndexedDataset::open(prefix);
  IndexedDataset b(std::move(a));
  EXPECT_EQ(b.get_sequence(1), (std::vector<int32_t>{40000}));
  IndexedDataset c;
  c = std::move(b);
  EXPECT_EQ(c.get_sequence(2), (std::vector<int32_t>{65535, 7}));
  EXPECT_EQ(a.num_sequences(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
}

// --- corrupt inputs: every error names the file at fault -----------------------------------

class MmidxCorrupt : public ::testing::Test {
 protected:
  void SetUp() override { prefix_ = t_.file("bad"); }
  void write(const Bytes& idx, const Bytes& bin) {
    spit(prefix_ + ".idx", idx);
    spit(prefix_ + ".bin", bin);
  }
  void expect_idx_error(std::vector<std::string> needles) {
    expect_input_error([&] { IndexedDataset::open(prefix_); }, prefix_ + ".idx",
                       std::move(needles));
  }
  void expect_bin_error(std::vector<std::string> needles) {
    expect_input_error([&] { IndexedDataset::open(prefix_); }, prefix_ + ".bin",
                       std::move(needles));
  }
  TempDir t_;
  std::string prefix_;
};

TEST_F(MmidxCorrupt, MissingFiles) {
  expect_idx_error({"cannot open"});
  spit(prefix_ + ".idx", tiny_idx(2, 8));
  expect_bin_error({"cannot open"});
}

TEST_F(MmidxCorrupt, TruncatedIdx) {
  Bytes idx = tiny_idx(2, 8);
  write(idx.substr(0, idx.size() - 1), tiny_bin_u16());
  // 34 + 12*3 + 8*3 = 94 bytes needed.
  expect_idx_error({"truncated", "3 sequences", "needs 94 bytes", "file has 93"});
  write(idx.substr(0, 20), tiny_bin_u16());
  expect_idx_error({"truncated", "34 bytes", "file has 20"});
  write(Bytes(), tiny_bin_u16());
  expect_idx_error({"truncated"});
}

TEST_F(MmidxCorrupt, AbsurdCountsDoNotWrap) {
  Bytes idx = magic();
  u64(idx, 1);
  u8(idx, 8);
  u64(idx, ~uint64_t{0});
  u64(idx, ~uint64_t{0});
  write(idx, Bytes());
  expect_idx_error({"truncated", "18446744073709551615 sequences"});
}

TEST_F(MmidxCorrupt, TrailingBytesInIdx) {
  Bytes idx = tiny_idx(2, 8);
  idx += "xxxxx";
  write(idx, tiny_bin_u16());
  expect_idx_error({"size mismatch", "file has 99"});
}

TEST_F(MmidxCorrupt, BadMagic) {
  Bytes idx = tiny_idx(2, 8);
  idx[0] = 'X';
  write(idx, tiny_bin_u16());
  expect_idx_error({"bad magic"});
}

TEST_F(MmidxCorrupt, BadVersion) {
  Bytes idx = tiny_idx(2, 8);
  idx[9] = 2;
  write(idx, tiny_bin_u16());
  expect_idx_error({"version 2"});
}

TEST_F(MmidxCorrupt, WrongDtypeCode) {
  for (uint8_t code : {0, 9, 255}) {
    Bytes idx = tiny_idx(2, 8);
    idx[17] = static_cast<char>(code);
    write(idx, tiny_bin_u16());
    expect_idx_error({"dtype code " + std::to_string(code)});
  }
}

TEST_F(MmidxCorrupt, DtypeCodeThatDisagreesWithBinSize) {
  // Code 4 (int32) over a uint16 .bin: the pointers no longer match the lengths.
  Bytes idx = tiny_idx(2, 4);
  write(idx, tiny_bin_u16());
  expect_idx_error({"pointer"});
}

TEST_F(MmidxCorrupt, BinShorterThanPointersSay) {
  Bytes bin = tiny_bin_u16();
  write(tiny_idx(2, 8), bin.substr(0, bin.size() - 2));
  expect_bin_error({"truncated", "sequence 2", "12 bytes", "file has 10"});
}

TEST_F(MmidxCorrupt, BinLongerThanIndex) {
  write(tiny_idx(2, 8), tiny_bin_u16() + "zz");
  expect_bin_error({"14 bytes", "describes only 12"});
}

TEST_F(MmidxCorrupt, InconsistentPointer) {
  Bytes idx = tiny_idx(2, 8);
  idx[34 + 12 + 8] = 7;  // pointer[1] = 7 instead of 6
  write(idx, tiny_bin_u16());
  expect_idx_error({"sequence 1 pointer is 7", "at 6"});
}

TEST_F(MmidxCorrupt, NegativeLength) {
  Bytes idx = tiny_idx(2, 8);
  for (int i = 0; i < 4; ++i) idx[34 + 4 + i] = static_cast<char>(0xFF);
  write(idx, tiny_bin_u16());
  expect_idx_error({"sequence 1 has negative length -1"});
}

TEST_F(MmidxCorrupt, DocumentIndexProblems) {
  const size_t doc_at = 34 + 12 * 3;
  Bytes idx = tiny_idx(2, 8);
  idx[doc_at] = 1;  // starts at 1
  write(idx, tiny_bin_u16());
  expect_idx_error({"starts with 1"});

  idx = tiny_idx(2, 8);
  idx[doc_at + 16] = 2;  // ends at 2, not S = 3
  write(idx, tiny_bin_u16());
  expect_idx_error({"ends with 2", "sequence count 3"});

  idx = tiny_idx(2, 8);
  idx[doc_at + 8] = 3;
  idx[doc_at + 16] = 2;  // 0, 3, 2
  write(idx, tiny_bin_u16());
  expect_idx_error({"decreases at entry 2"});

  idx = tiny_idx(2, 8);
  idx[doc_at + 8] = 9;  // past S
  write(idx, tiny_bin_u16());
  expect_idx_error({"entry 1 is 9"});
}

TEST_F(MmidxCorrupt, EmptyDocumentIndex) {
  Bytes idx = magic();
  u64(idx, 1);
  u8(idx, 8);
  u64(idx, 0);
  u64(idx, 0);
  write(idx, Bytes());
  expect_idx_error({"document index is empty"});
}

// --- property: whatever the writer accepts, the reader returns unchanged --------------------

namespace {
void check_round_trip(DType dtype, int32_t lo, int32_t hi) {
  using Docs = std::vector<std::vector<std::vector<int32_t>>>;
  const auto docs = *rc::gen::container<Docs>(rc::gen::container<std::vector<std::vector<int32_t>>>(
      rc::gen::container<std::vector<int32_t>>(rc::gen::inRange(lo, hi))));
  TempDir t;
  const std::string prefix = t.file("prop");
  write_docs(prefix, dtype, docs);
  auto ds = IndexedDataset::open(prefix);

  std::vector<int32_t> flat;
  std::vector<int64_t> doc_idx{0};
  uint64_t seq = 0;
  for (const auto& doc : docs) {
    for (const auto& s : doc) {
      RC_ASSERT(ds.get_sequence(seq) == s);
      RC_ASSERT(ds.sequence_offset(seq) == flat.size());
      flat.insert(flat.end(), s.begin(), s.end());
      ++seq;
    }
    doc_idx.push_back(static_cast<int64_t>(seq));
  }
  RC_ASSERT(ds.num_sequences() == seq);
  RC_ASSERT(ds.num_documents() == docs.size());
  RC_ASSERT(ds.document_index() == doc_idx);
  RC_ASSERT(ds.total_tokens() == flat.size());
  std::vector<int32_t> all(flat.size());
  ds.read_tokens(0, all.size(), all.data());
  RC_ASSERT(all == flat);
  if (!flat.empty()) {
    const auto off = *rc::gen::inRange<size_t>(0, flat.size());
    const auto n = *rc::gen::inRange<size_t>(0, flat.size() - off + 1);
    std::vector<int32_t> part(n);
    ds.read_tokens(off, n, part.data());
    RC_ASSERT(std::equal(part.begin(), part.end(), flat.begin() + static_cast<ptrdiff_t>(off)));
  }
}
}  // namespace

RC_GTEST_PROP(MmidxProperty, RoundTripU16, ()) { check_round_trip(DType::U16, 0, 65536); }

RC_GTEST_PROP(MmidxProperty, RoundTripI32, ()) {
  check_round_trip(DType::I32, std::numeric_limits<int32_t>::min(),
                   std::numeric_limits<int32_t>::max());
}

#include <memory>

#include "alloy/core/config.h"
#include "alloy/data/windows.h"

// Megatron's --split (data.split) carves one dataset into consecutive token ranges: the training
// windows read only their range, the validation windows the next.
TEST(TokenWindows, ASplitReadsOnlyItsShareOfTheTokens) {
  TempDir t;
  std::string prefix = t.file("s");
  IndexedDatasetWriter w(prefix, DType::U16);
  std::vector<int32_t> tokens(1000);
  for (int i = 0; i < 1000; ++i) tokens[static_cast<size_t>(i)] = i % 500;
  w.add_item(tokens);
  w.end_document();
  w.finalize();
  auto ds = std::make_shared<IndexedDataset>(IndexedDataset::open(prefix));
  alloy::DataConfig d;
  d.split = "90,10,0";
  const auto [train, valid] = d.split_fractions();
  EXPECT_DOUBLE_EQ(train, 0.9);
  EXPECT_DOUBLE_EQ(valid, 0.1);
  alloy::data::TokenWindows tr(ds, 10, "train", 0, 900), va(ds, 10, "valid", 900, 1000);
  EXPECT_EQ(tr.num_samples(), 89u);  // (900 - 1) / 10
  EXPECT_EQ(va.num_samples(), 9u);
  std::vector<int64_t> out(11);
  va.gather({0}, out.data());
  EXPECT_EQ(out.front(), 900 % 500);  // the validation share starts at token 900
  tr.gather({88}, out.data());
  EXPECT_EQ(out.back(), 890 % 500);   // the last training window ends inside the share
  EXPECT_EQ(va.max_token(), 499);
  alloy::data::TokenWindows whole(ds, 10, "whole");
  EXPECT_EQ(whole.num_samples(), 99u);
  for (const char* bad : {"0,1", "a,1", "1,2,3,4", "-1,2"}) {
    d.split = bad;
    EXPECT_THROW(d.split_fractions(), InputError) << bad;
  }
  d.split = "1";
  EXPECT_EQ(d.split_fractions(), (std::pair<double, double>{1.0, 0.0}));
}
