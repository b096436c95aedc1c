// The pickle machine that reads torch.save files (model/torch_pickle.h): Python's own pickles of
// one object at protocols 2 (torch.save's) and 4, made with
//   pickle.dumps({"a": [1, -2, 300, 70000, -(2**40)], "t": (1.5, "x"),
//                 "n": argparse.Namespace(num_layers=12, lr=-1.5e-4, name="gpt", flag=True, none=None,
//                                         big=-(2**40), lst=[1, 2]),
//                 "b": b"\x00\xffz", "od": OrderedDict([("k", 1), ("j", 2)]), "shared": None,
//                 "r1": lst, "r2": lst}, protocol=P)   # lst = ["same"], one list twice
// and torch's own archives (torch::pickle_save writes torch.save's zip format).
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>

#include "alloy/core/error.h"
#include "alloy/model/torch_pickle.h"

using alloy::model::PyValue;
using Kind = alloy::model::PyValue::Kind;

namespace {

const std::string kProtocol2("\x80\x02\x7d\x71\x00\x28\x58\x01\x00\x00\x00\x61\x71\x01\x5d\x71\x02\x28\x4b\x01\x4a\xfe\xff\xff\xff\x4d\x2c\x01\x4a\x70\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x65\x58\x01\x00\x00\x00\x74\x71\x03\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x58\x01\x00\x00\x00\x78\x71\x04\x86\x71\x05\x58\x01\x00\x00\x00\x6e\x71\x06\x63\x61\x72\x67\x70\x61\x72\x73\x65\x0a\x4e\x61\x6d\x65\x73\x70\x61\x63\x65\x0a\x71\x07\x29\x81\x71\x08\x7d\x71\x09\x28\x58\x0a\x00\x00\x00\x6e\x75\x6d\x5f\x6c\x61\x79\x65\x72\x73\x71\x0a\x4b\x0c\x58\x02\x00\x00\x00\x6c\x72\x71\x0b\x47\xbf\x23\xa9\x2a\x30\x55\x32\x61\x58\x04\x00\x00\x00\x6e\x61\x6d\x65\x71\x0c\x58\x03\x00\x00\x00\x67\x70\x74\x71\x0d\x58\x04\x00\x00\x00\x66\x6c\x61\x67\x71\x0e\x88\x58\x04\x00\x00\x00\x6e\x6f\x6e\x65\x71\x0f\x4e\x58\x03\x00\x00\x00\x62\x69\x67\x71\x10\x8a\x06\x00\x00\x00\x00\x00\xff\x58\x03\x00\x00\x00\x6c\x73\x74\x71\x11\x5d\x71\x12\x28\x4b\x01\x4b\x02\x65\x75\x62\x58\x01\x00\x00\x00\x62\x71\x13\x63\x5f\x63\x6f\x64\x65\x63\x73\x0a\x65\x6e\x63\x6f\x64\x65\x0a\x71\x14\x58\x04\x00\x00\x00\x00\xc3\xbf\x7a\x71\x15\x58\x06\x00\x00\x00\x6c\x61\x74\x69\x6e\x31\x71\x16\x86\x71\x17\x52\x71\x18\x58\x02\x00\x00\x00\x6f\x64\x71\x19\x63\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x0a\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x0a\x71\x1a\x29\x52\x71\x1b\x28\x58\x01\x00\x00\x00\x6b\x71\x1c\x4b\x01\x58\x01\x00\x00\x00\x6a\x71\x1d\x4b\x02\x75\x58\x06\x00\x00\x00\x73\x68\x61\x72\x65\x64\x71\x1e\x4e\x58\x02\x00\x00\x00\x72\x31\x71\x1f\x5d\x71\x20\x58\x04\x00\x00\x00\x73\x61\x6d\x65\x71\x21\x61\x58\x02\x00\x00\x00\x72\x32\x71\x22\x68\x20\x75\x2e", 398);
const std::string kProtocol4("\x80\x04\x95\x10\x01\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x61\x94\x5d\x94\x28\x4b\x01\x4a\xfe\xff\xff\xff\x4d\x2c\x01\x4a\x70\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x65\x8c\x01\x74\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x01\x78\x94\x86\x94\x8c\x01\x6e\x94\x8c\x08\x61\x72\x67\x70\x61\x72\x73\x65\x94\x8c\x09\x4e\x61\x6d\x65\x73\x70\x61\x63\x65\x94\x93\x94\x29\x81\x94\x7d\x94\x28\x8c\x0a\x6e\x75\x6d\x5f\x6c\x61\x79\x65\x72\x73\x94\x4b\x0c\x8c\x02\x6c\x72\x94\x47\xbf\x23\xa9\x2a\x30\x55\x32\x61\x8c\x04\x6e\x61\x6d\x65\x94\x8c\x03\x67\x70\x74\x94\x8c\x04\x66\x6c\x61\x67\x94\x88\x8c\x04\x6e\x6f\x6e\x65\x94\x4e\x8c\x03\x62\x69\x67\x94\x8a\x06\x00\x00\x00\x00\x00\xff\x8c\x03\x6c\x73\x74\x94\x5d\x94\x28\x4b\x01\x4b\x02\x65\x75\x62\x8c\x01\x62\x94\x43\x03\x00\xff\x7a\x94\x8c\x02\x6f\x64\x94\x8c\x0b\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x94\x8c\x0b\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x94\x93\x94\x29\x52\x94\x28\x8c\x01\x6b\x94\x4b\x01\x8c\x01\x6a\x94\x4b\x02\x75\x8c\x06\x73\x68\x61\x72\x65\x64\x94\x4e\x8c\x02\x72\x31\x94\x5d\x94\x8c\x04\x73\x61\x6d\x65\x94\x61\x8c\x02\x72\x32\x94\x68\x20\x75\x2e", 283);

void expect_object(const PyValue& v) {
  ASSERT_EQ(v.kind, Kind::Dict);
  const PyValue* a = v.get("a");
  ASSERT_TRUE(a && a->kind == Kind::List);
  ASSERT_EQ(a->items.size(), 5u);
  EXPECT_EQ(a->items[0]->i, 1);
  EXPECT_EQ(a->items[1]->i, -2);
  EXPECT_EQ(a->items[2]->i, 300);
  EXPECT_EQ(a->items[3]->i, 70000);
  EXPECT_EQ(a->items[4]->i, -(int64_t{1} << 40));  // LONG1, sign-extended
  const PyValue* t = v.get("t");
  ASSERT_TRUE(t && t->kind == Kind::Tuple && t->items.size() == 2);
  EXPECT_EQ(t->items[0]->f, 1.5);
  EXPECT_EQ(t->items[1]->s, "x");
  // An unknown class stays an object whose attributes read by name.
  const PyValue* n = v.get("n");
  ASSERT_TRUE(n && n->kind == Kind::Object);
  EXPECT_EQ(n->type_name(), "argparse.Namespace");
  EXPECT_EQ(n->get("num_layers")->i, 12);
  EXPECT_EQ(n->get("lr")->f, -1.5e-4);
  EXPECT_EQ(n->get("name")->s, "gpt");
  EXPECT_TRUE(n->get("flag")->b);
  EXPECT_EQ(n->get("none")->kind, Kind::None);
  EXPECT_EQ(n->get("big")->i, -(int64_t{1} << 40));
  EXPECT_EQ(n->get("lst")->items.size(), 2u);
  EXPECT_EQ(n->get("missing"), nullptr);
  // bytes: protocol 2 spells them as _codecs.encode(latin-1 text), protocol 4 directly.
  const PyValue* b = v.get("b");
  ASSERT_TRUE(b && b->kind == Kind::Bytes);
  EXPECT_EQ(b->s, std::string("\x00\xffz", 3));
  const PyValue* od = v.get("od");
  ASSERT_TRUE(od && od->kind == Kind::Dict && od->dict.size() == 2);
  EXPECT_EQ(od->dict[0].first->s, "k");  // insertion order kept
  EXPECT_EQ(od->get("j")->i, 2);
  EXPECT_EQ(v.get("shared")->kind, Kind::None);
  // The memo hands back the same object.
  EXPECT_EQ(v.get("r1"), v.get("r2"));
  EXPECT_EQ(v.get("r1")->items.at(0)->s, "same");
}

}  // namespace

TEST(TorchPickle, ReadsPythonsPicklesAtProtocolsTwoAndFour) {
  expect_object(*alloy::model::unpickle(kProtocol2, "p2"));
  expect_object(*alloy::model::unpickle(kProtocol4, "p4"));
}

TEST(TorchPickle, DamagedDataIsAnErrorNamingWhere) {
  // Cut anywhere before its STOP, the pickle is refused (never read past its end).
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{100}, kProtocol2.size() - 1}) {
    try {
      alloy::model::unpickle(kProtocol2.substr(0, n), "cut.pkl");
      FAIL() << "a pickle cut at " << n << " bytes was read";
    } catch (const alloy::InputError& e) {
      EXPECT_EQ(e.where(), "cut.pkl");
    }
  }
  EXPECT_THROW(alloy::model::unpickle(std::string("\x80\x02\xff.", 4), "x"), alloy::InputError);  // unknown opcode
  EXPECT_THROW(alloy::model::unpickle(std::string("\x80\x02" "a.", 4), "x"), alloy::InputError);      // APPEND on nothing
  EXPECT_THROW(alloy::model::unpickle(std::string("\x80\x02h\x05.", 5), "x"), alloy::InputError);  // memo never written
  // A persistent id without a loader.
  EXPECT_THROW(alloy::model::unpickle(std::string("\x80\x02N\x51.", 5), "x"), alloy::InputError);
}

TEST(TorchPickle, AnyDamageIsAnInputErrorOrAValueNeverACrash) {
  // Bytes flipped at random in both pickles: each either reads or is refused with InputError.
  std::mt19937 rng(7);
  int refused = 0, read = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    std::string d = trial % 2 ? kProtocol2 : kProtocol4;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) d[rng() % d.size()] = static_cast<char>(rng() & 0xff);
    try {
      alloy::model::unpickle(d, "flipped");
      ++read;
    } catch (const alloy::InputError&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL() << "trial " << trial << ": " << e.what();
    }
  }
  EXPECT_GT(refused, 100);  // the damage was real
  EXPECT_GT(read, 100);     // and a flipped value inside a string still reads
}

namespace {
// A pickle of torch._utils.REBUILD(<persistent id>, OFFSET, SIZE, STRIDE, False, {}[, torch.DTYPE]).
std::string rebuild_pickle(const std::string& rebuild, int64_t offset, const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                           const std::string& dtype = "") {
  auto integer = [](int64_t v) {
    std::string b("\x8a\x08", 2);  // LONG1, 8 bytes little-endian
    for (int k = 0; k < 8; ++k) b.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff));
    return b;
  };
  std::string p = std::string("\x80\x02", 2) + "ctorch._utils\n" + rebuild + "\n(NQ" + integer(offset) + "(";
  for (int64_t x : size) p += integer(x);
  p += "t(";
  for (int64_t x : stride) p += integer(x);
  p += std::string("t\x89}", 3);
  if (!dtype.empty()) p += "ctorch\n" + dtype + "\n";
  return p + "tR.";
}
alloy::model::PyRef storage_of(const at::Tensor& t) {
  auto v = std::make_shared<PyValue>();
  v->kind = Kind::Tensor;
  v->tensor = t;
  return v;
}
}  // namespace

TEST(TorchPickle, TensorViewsAreCheckedAgainstTheirStorage) {
  const at::Tensor six = at::arange(6, at::kFloat);
  auto load = [&](const std::string& p, const at::Tensor& storage) {
    return alloy::model::unpickle(p, "t.pkl", [&](const alloy::model::PyRef&) { return storage_of(storage); })->tensor_value();
  };
  EXPECT_TRUE(at::equal(load(rebuild_pickle("_rebuild_tensor_v2", 0, {2, 3}, {3, 1}), six), six.reshape({2, 3})));
  EXPECT_TRUE(at::equal(load(rebuild_pickle("_rebuild_tensor_v2", 1, {2, 2}, {1, 3}), six), six.as_strided({2, 2}, {1, 3}, 1)));
  EXPECT_EQ(load(rebuild_pickle("_rebuild_tensor_v2", 0, {0, 5}, {5, 1}), six).numel(), 0);
  // Past the storage's end, an extent that overflows int64, a view repeating one element into
  // gigabytes, negative sizes: refused, never read.
  const at::Tensor one = at::zeros({1}, at::kByte);
  for (const auto& bad : {rebuild_pickle("_rebuild_tensor_v2", 0, {2, 3}, {4, 1}), rebuild_pickle("_rebuild_tensor_v2", 0, {3}, {int64_t{1} << 62}),
                          rebuild_pickle("_rebuild_tensor_v2", int64_t{1} << 62, {3}, {int64_t{1} << 62}),
                          rebuild_pickle("_rebuild_tensor_v2", 0, {int64_t{1} << 33}, {0}), rebuild_pickle("_rebuild_tensor_v2", 0, {-1}, {1}),
                          rebuild_pickle("_rebuild_tensor_v2", -1, {1}, {1})})
    EXPECT_THROW(load(bad, bad.find("\x08\x00\x00\x00\x00\x00\x00\x40") == std::string::npos ? six : one), alloy::InputError);
  // _rebuild_tensor_v3 names the dtype of an untyped (byte) storage.
  const at::Tensor values = at::tensor({1.5f, -2.5f});
  const at::Tensor bytes = at::from_blob(values.data_ptr(), {8}, at::kByte).clone();
  EXPECT_TRUE(at::equal(load(rebuild_pickle("_rebuild_tensor_v3", 0, {2}, {1}, "float32"), bytes), values));
  EXPECT_THROW(load(rebuild_pickle("_rebuild_tensor_v3", 0, {2}, {1}, "float8_e4m3fn"), bytes), alloy::InputError);
}

TEST(TorchPickle, DeepNestingNeitherOverflowsTheStackNorHangs) {
  // 200k tuples, each holding the one before: read and freed without recursion.
  const std::string deep = std::string("\x80\x02]", 3) + std::string(200000, '\x85') + ".";
  auto v = alloy::model::unpickle(deep, "deep.pkl");
  EXPECT_EQ(v->kind, Kind::Tuple);
  v.reset();
  SUCCEED();
}

TEST(TorchPickle, TensorsComeBackFromTorchArchives) {
  // Two views of one storage, a non-contiguous view, and several dtypes, in nested containers.
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("whole", base);
  d.insert("rows", base.narrow(0, 1, 2));
  d.insert("cols", base.t());
  d.insert("half", at::ones({3}, at::kHalf) * 0.5);
  d.insert("bf16", at::full({2, 2}, 3.0, at::kBFloat16));
  d.insert("long", at::arange(5, at::kLong));
  d.insert("list", c10::List<at::Tensor>({at::zeros({1}), at::ones({2})}));
  d.insert("iteration", int64_t{100});
  const std::vector<char> bytes = torch::pickle_save(d);
  const std::string path = testing::TempDir() + "torch_pickle_test.pt";
  {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const auto v = alloy::model::load_torch_file(path);
  ASSERT_EQ(v->kind, Kind::Dict) << v->type_name();
  EXPECT_TRUE(at::equal(v->get("whole")->tensor_value(), base));
  EXPECT_TRUE(at::equal(v->get("rows")->tensor_value(), base.narrow(0, 1, 2)));
  EXPECT_TRUE(at::equal(v->get("cols")->tensor_value(), base.t()));
  EXPECT_EQ(v->get("half")->tensor_value().scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(v->get("half")->tensor_value(), at::ones({3}, at::kHalf) * 0.5));
  EXPECT_EQ(v->get("bf16")->tensor_value().scalar_type(), at::kBFloat16);
  EXPECT_EQ(v->get("bf16")->tensor_value().to(at::kFloat).sum().item<float>(), 12.f);
  EXPECT_TRUE(at::equal(v->get("long")->tensor_value(), at::arange(5, at::kLong)));
  EXPECT_EQ(v->get("list")->items.size(), 2u);
  EXPECT_EQ(v->get("iteration")->i, 100);
  // Not a zip: torch.save's legacy format is refused, saying what to do.
  {
    std::ofstream f(path, std::ios::binary);
    f << std::string("\x80\x02\x8a\x0a", 4) << "legacy magic";
  }
  try {
    alloy::model::load_torch_file(path);
    FAIL() << "a legacy-format file was read";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("legacy format"), std::string::npos) << e.what();
  }
  if (!std::getenv("KEEP")) std::remove(path.c_str());
}
