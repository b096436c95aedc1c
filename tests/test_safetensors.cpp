#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/model/safetensors.h"
#include "temp_dir.h"

using alloy::testing::TempDir;

namespace fs = std::filesystem;
using alloy::InputError;
using alloy::model::SafetensorsFile;
using alloy::model::TensorBlob;
using alloy::model::write_safetensors;
using Tensors = std::vector<std::pair<std::string, TensorBlob>>;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void spit(const std::string& path, const std::string& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

std::string u64le(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

// A file exactly as FORMATS.md describes it: u64 LE header length, JSON, data.
std::string st_file(const std::string& json, const std::string& data) {
  return u64le(json.size()) + json + data;
}

std::string f32_bytes(std::vector<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

TensorBlob blob(std::string dtype, std::vector<int64_t> shape, std::string data) {
  return TensorBlob{std::move(dtype), std::move(shape), std::move(data)};
}

void expect_input_error(const std::function<void()>& fn, const std::string& path,
                        std::vector<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected InputError for " << path;
  } catch (const InputError& e) {
    EXPECT_EQ(e.where(), path) << e.what();
    std::string what = e.what();
    for (const auto& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
  }
}

}  // namespace

TEST(Safetensors, Itemsizes) {
  using alloy::model::safetensors_itemsize;
  for (const char* d : {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3"})
    EXPECT_EQ(safetensors_itemsize(d), 1u) << d;
  for (const char* d : {"I16", "U16", "F16", "BF16"}) EXPECT_EQ(safetensors_itemsize(d), 2u) << d;
  for (const char* d : {"I32", "U32", "F32"}) EXPECT_EQ(safetensors_itemsize(d), 4u) << d;
  for (const char* d : {"F64", "I64", "U64"}) EXPECT_EQ(safetensors_itemsize(d), 8u) << d;
  EXPECT_EQ(safetensors_itemsize("f32"), 0u);
  EXPECT_EQ(safetensors_itemsize("Q4"), 0u);
}

TEST(Safetensors, RoundTrip) {
  TempDir t;
  const std::string path = t.file("m.safetensors");
  Tensors in = {
      {"wte.weight", blob("F32", {2, 3}, f32_bytes({1, 2, 3, 4, 5, -6.5f}))},
      {"step", blob("I64", {}, u64le(123456789012345))},
      {"empty", blob("BF16", {0, 4}, "")},
      {"mask", blob("BOOL", {3}, std::string("\x01\x00\x01", 3))},
      {"h.0.attn.c_attn.bias", blob("F16", {2}, std::string("\x00\x3c\x00\xc0", 4))},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "20"}};
  write_safetensors(path, in, meta);

  auto f = SafetensorsFile::open(path);
  std::vector<std::string> names;
  for (const auto& [n, b] : in) names.push_back(n);
  EXPECT_EQ(f.names(), names);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_FALSE(f.has("nope"));
  for (const auto& [n, b] : in) {
    ASSERT_TRUE(f.has(n)) << n;
    EXPECT_EQ(f.info(n).dtype, b.dtype);
    EXPECT_EQ(f.info(n).shape, b.shape);
    EXPECT_EQ(f.bytes(n), b.data) << n;
    TensorBlob back = f.load(n);
    EXPECT_EQ(back.dtype, b.dtype);
    EXPECT_EQ(back.shape, b.shape);
    EXPECT_EQ(back.data, b.data);
  }
  EXPECT_EQ(f.info("wte.weight").begin, 0u);
  EXPECT_EQ(f.info("wte.weight").end, 24u);
  EXPECT_EQ(f.info("step").begin, 24u);
  EXPECT_EQ(f.info("step").numel(), 1u);
  EXPECT_EQ(f.info("empty").nbytes(), 0u);
  EXPECT_EQ(fs::file_size(path), 8 + f.header_size() + 24 + 8 + 0 + 3 + 4);
}

// The exact bytes we write for one tensor, spelled out so the layout is checked against the spec
// rather than against our own reader (python3 here has no safetensors package to do it for us):
// - 8-byte little-endian header length, which counts the padding;
// - compact JSON, tensor keys in the given order, each entry dtype/shape/data_offsets;
// - spaces up to a multiple of 8;
// - the raw data, offsets relative to the first byte after the header.
TEST(Safetensors, ExactLayoutOfOneTensor) {
  TempDir t;
  const std::string path = t.file("one.safetensors");
  write_safetensors(path, {{"a", blob("F32", {2}, f32_bytes({1.0f, 2.0f}))}});
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(json.size(), 54u);
  const std::string padded = json + std::string(2, ' ');  // 54 -> 56
  const std::string expected = st_file(padded, f32_bytes({1.0f, 2.0f}));
  EXPECT_EQ(slurp(path), expected);
  EXPECT_EQ(slurp(path).substr(0, 8), std::string("\x38\0\0\0\0\0\0\0", 8));
}

TEST(Safetensors, MetadataFirstAndOnlyWhenNonEmpty) {
  TempDir t;
  const std::string path = t.file("m.safetensors");
  write_safetensors(path, {{"x", blob("U8", {1}, "z")}}, {{"format", "pt"}});
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  std::string file = slurp(path);
  EXPECT_EQ(file.substr(8, json.size()), json);

  write_safetensors(path, {{"x", blob("U8", {1}, "z")}}, {});
  file = slurp(path);
  EXPECT_EQ(file.find("__metadata__"), std::string::npos);
  EXPECT_TRUE(SafetensorsFile::open(path).metadata().empty());
}

TEST(Safetensors, HeaderPaddedToMultipleOf8) {
  TempDir t;
  const std::string path = t.file("p.safetensors");
  for (size_t len = 1; len <= 16; ++len) {
    const std::string name(len, 'n');
    write_safetensors(path, {{name, blob("U8", {2}, "ab")}});
    const std::string file = slurp(path);
    uint64_t n = 0;
    std::memcpy(&n, file.data(), 8);
    EXPECT_EQ(n % 8, 0u) << len;
    EXPECT_EQ(file.size(), 8 + n + 2);
    const std::string header = file.substr(8, n);
    const size_t close = header.find_last_of('}');
    ASSERT_NE(close, std::string::npos);
    EXPECT_LT(n - (close + 1), 8u);
    EXPECT_EQ(header.substr(close + 1), std::string(n - (close + 1), ' '));
    EXPECT_EQ(file.substr(8 + n), "ab");
    EXPECT_EQ(SafetensorsFile::open(path).bytes(name), "ab");
  }
}

TEST(Safetensors, ReadsHandBuiltFile) {
  // Keys out of data order, whitespace, an unpadded header, an odd-sized tensor that leaves the
  // next one unaligned, metadata last: all legal, all things other writers do.
  const std::string json =
      "{ \"b\": {\"dtype\": \"U8\", \"shape\": [3], \"data_offsets\": [0, 3]},\n"
      "  \"a\": {\"shape\": [1, 2], \"dtype\": \"F32\", \"data_offsets\": [3, 11]},\n"
      "  \"z\": {\"dtype\": \"I32\", \"shape\": [0], \"data_offsets\": [11, 11]},\n"
      "  \"__metadata__\": {\"format\": \"pt\"} }";
  const std::string data = std::string("\x07\x08\x09", 3) + f32_bytes({0.5f, -2.0f});
  TempDir t;
  const std::string path = t.file("hand.safetensors");
  spit(path, st_file(json, data));
  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"b", "a", "z"}));
  EXPECT_EQ(f.info("a").dtype, "F32");
  EXPECT_EQ(f.info("a").shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(f.info("a").begin, 3u);
  EXPECT_EQ(f.info("a").end, 11u);
  EXPECT_EQ(f.bytes("b"), std::string("\x07\x08\x09", 3));
  float a[2];
  std::memcpy(a, f.bytes("a").data(), 8);
  EXPECT_EQ(a[0], 0.5f);
  EXPECT_EQ(a[1], -2.0f);
  EXPECT_TRUE(f.bytes("z").empty());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  expect_input_error([&] { f.info("missing"); }, path, {"tensor 'missing'", "no such tensor"});
}

TEST(Safetensors, MoveKeepsMappingValid) {
  TempDir t;
  const std::string path = t.file("mv.safetensors");
  write_safetensors(path, {{"x", blob("U8", {2}, "hi")}});
  auto a = SafetensorsFile::open(path);
  SafetensorsFile b(std::move(a));
  SafetensorsFile c;
  c = std::move(b);
  EXPECT_EQ(c.bytes("x"), "hi");
}

// --- writer rejects bad input and leaves the existing file alone ----------------------------

TEST(SafetensorsWriter, RejectsBadTensorsAndKeepsOldFile) {
  TempDir t;
  const std::string path = t.file("w.safetensors");
  write_safetensors(path, {{"keep", blob("U8", {1}, "k")}});
  const std::string before = slurp(path);

  expect_input_error(
      [&] {
        write_safetensors(path, {{"w", blob("F32", {2, 2}, std::string(15, '\0'))}});
      },
      path, {"tensor 'w'", "needs 16 bytes", "data has 15"});
  expect_input_error(
      [&] {
        write_safetensors(path, {{"w", blob("F31", {1}, "abcd")}});
      },
      path, {"tensor 'w'", "unknown dtype 'F31'"});
  expect_input_error(
      [&] {
        write_safetensors(path, {{"w", blob("U8", {-1}, "")}});
      },
      path, {"tensor 'w'", "invalid shape [-1]"});
  expect_input_error(
      [&] {
        write_safetensors(path, {{"w", blob("U8", {1}, "a")}, {"w", blob("U8", {1}, "b")}});
      },
      path, {"tensor 'w'", "duplicate"});
  expect_input_error(
      [&] {
        write_safetensors(path, {{"__metadata__", blob("U8", {1}, "a")}});
      },
      path, {"reserved"});
  expect_input_error(
      [&] {
        write_safetensors(path, {{"bad\xff", blob("U8", {1}, "a")}});
      },
      path, {"UTF-8"});
  EXPECT_EQ(slurp(path), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path()), fs::directory_iterator()), 1);
}

// --- corrupt files: errors name the file and, where one is at fault, the tensor --------------

class SafetensorsCorrupt : public ::testing::Test {
 protected:
  void SetUp() override { path_ = t_.file("bad.safetensors"); }
  void expect_error(const std::string& bytes, std::vector<std::string> needles) {
    spit(path_, bytes);
    expect_input_error([&] { SafetensorsFile::open(path_); }, path_, std::move(needles));
  }
  TempDir t_;
  std::string path_;
};

TEST_F(SafetensorsCorrupt, TooShortForLength) { expect_error("abc", {"truncated", "3 bytes"}); }

TEST_F(SafetensorsCorrupt, MissingFile) {
  expect_input_error([&] { SafetensorsFile::open(path_); }, path_, {"cannot open"});
}

TEST_F(SafetensorsCorrupt, HeaderLengthPastEnd) {
  expect_error(u64le(100) + "{}", {"truncated", "header length is 100", "only 2"});
  expect_error(u64le(~uint64_t{0}) + "{}", {"truncated"});
}

TEST_F(SafetensorsCorrupt, TruncatedData) {
  TempDir t;
  const std::string good = t.file("good.safetensors");
  write_safetensors(good,
                    {{"a", blob("U8", {4}, "abcd")}, {"b", blob("F32", {2}, f32_bytes({1, 2}))}});
  std::string bytes = slurp(good);
  expect_error(bytes.substr(0, bytes.size() - 1),
               {"tensor 'b'", "run past the data section", "11 bytes"});
}

TEST_F(SafetensorsCorrupt, OffsetsOutOfRange) {
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})", "abcd"),
               {"tensor 'w'", "[8, 12]", "4 bytes"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}})", "abcd"),
               {"tensor 'w'", "end before they begin"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "abcd"),
               {"tensor 'w'", "data_offsets"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "abcd"),
               {"tensor 'w'", "data_offsets"});
}

TEST_F(SafetensorsCorrupt, ShapeSizeMismatch) {
  expect_error(
      st_file(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(16, 'x')),
      {"tensor 'w'", "[2, 2]", "needs 16 bytes", "span 12"});
  expect_error(
      st_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
              "abcd"),
      {"tensor 'w'", "over 2^64"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})", "ab"),
               {"tensor 'w'", "shape", "-2"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,2]}})", "ab"),
               {"tensor 'w'", "shape"});
}

TEST_F(SafetensorsCorrupt, BadJson) {
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]})", "a"),
               {"not valid JSON"});
  expect_error(st_file("[1, 2]   ", ""), {"does not start with '{'"});
  expect_error(st_file("{\"a\":1} x", ""), {"not valid JSON"});
  expect_error(st_file("{\"w\":\"\xff\"}", ""), {"not valid JSON"});
}

TEST_F(SafetensorsCorrupt, MissingOrBadFields) {
  expect_error(st_file(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "a"),
               {"tensor 'w'", "missing 'dtype'"});
  expect_error(st_file(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "a"),
               {"tensor 'w'", "missing 'shape'"});
  expect_error(st_file(R"({"w":{"dtype":"U8","shape":[1]}})", "a"),
               {"tensor 'w'", "missing 'data_offsets'"});
  expect_error(st_file(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "a"),
               {"tensor 'w'", "unknown dtype 'Q4'"});
  expect_error(st_file(R"({"w":{"dtype":8,"shape":[1],"data_offsets":[0,1]}})", "a"),
               {"tensor 'w'", "'dtype'"});
  expect_error(st_file(R"({"w":[1]})", "a"), {"tensor 'w'", "not a JSON object"});
  expect_error(st_file(R"({"__metadata__":{"k":1}})", ""), {"__metadata__", "'k'", "not a string"});
  expect_error(st_file(R"({"__metadata__":[]})", ""), {"__metadata__"});
}

TEST_F(SafetensorsCorrupt, Overlap) {
  expect_error(st_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                       R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                       "abcde"),
               {"tensor 'b'", "overlap", "tensor 'a'"});
}

TEST_F(SafetensorsCorrupt, DuplicateName) {
  expect_error(st_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                       "ab"),
               {"tensor 'a'", "twice"});
}

// --- property: what we write, we read back unchanged -----------------------------------------

RC_GTEST_PROP(SafetensorsProperty, RoundTrip, ()) {
  static const char* kDtypes[] = {"BOOL", "U8",  "I8",  "I16", "U16", "F16",     "BF16",   "I32",
                                  "U32",  "F32", "F64", "I64", "U64", "F8_E5M2", "F8_E4M3"};
  const auto count = *rc::gen::inRange<size_t>(0, 6);
  Tensors in;
  for (size_t i = 0; i < count; ++i) {
    const std::string dtype = kDtypes[*rc::gen::inRange<size_t>(0, 15)];
    const auto shape = *rc::gen::container<std::vector<int64_t>>(*rc::gen::inRange<size_t>(0, 4),
                                                                 rc::gen::inRange<int64_t>(0, 5));
    uint64_t numel = 1;
    for (auto d : shape) numel *= static_cast<uint64_t>(d);
    const auto data = *rc::gen::container<std::string>(
        numel * alloy::model::safetensors_itemsize(dtype), rc::gen::arbitrary<char>());
    in.emplace_back(
        "t" + std::to_string(i) + *rc::gen::element<std::string>("", ".weight", "\xc3\xa9"),
        blob(dtype, shape, data));
  }
  const auto meta = *rc::gen::container<std::map<std::string, std::string>>(
      rc::gen::container<std::string>(rc::gen::inRange('a', 'z')),
      rc::gen::container<std::string>(rc::gen::inRange(' ', '~')));
  TempDir t;
  const std::string path = t.file("prop.safetensors");
  write_safetensors(path, in, meta);
  auto f = SafetensorsFile::open(path);
  RC_ASSERT(f.header_size() % 8 == 0);
  RC_ASSERT(f.metadata() == meta);
  std::vector<std::string> names;
  for (const auto& [n, b] : in) {
    names.push_back(n);
    RC_ASSERT(f.info(n).dtype == b.dtype);
    RC_ASSERT(f.info(n).shape == b.shape);
    RC_ASSERT(std::string(f.bytes(n)) == b.data);
  }
  RC_ASSERT(f.names() == names);
}
