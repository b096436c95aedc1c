#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/data/mmidx.h"
#include "alloy/data/prepare.h"
#include "alloy/data/tokenizer.h"

using namespace alloy::data;

TEST(Prepare, SplitsFortuneFiles) {
  auto docs = split_documents("one\nline\n%\ntwo\n%\n\n%\nthree\n", "auto");
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "one\nline\n");
  EXPECT_EQ(docs[2], "three\n");
  auto blank = split_documents("a\nb\n\n\nc\n", "auto");
  ASSERT_EQ(blank.size(), 2u);
  EXPECT_EQ(split_documents("a\nb\n", "line").size(), 2u);
  EXPECT_EQ(split_documents("a\n\nb\n", "file").size(), 1u);
  EXPECT_THROW(split_documents("a", "paragraph"), alloy::InputError);
}

TEST(Prepare, WritesTrainAndValidDatasetsThatReadBackAsTheText) {
  auto dir = std::filesystem::temp_directory_path() / "alloy_prepare_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string text;
  for (int i = 0; i < 40; ++i) text += "fortune number " + std::to_string(i) + "\n%\n";
  alloy::write_file_atomic((dir / "f.txt").string(), text);
  PrepareOptions o;
  o.inputs = {(dir / "f.txt").string()};
  o.output = (dir / "out").string();
  o.valid_fraction = 0.1;
  o.progress = false;
  auto r = prepare_dataset(o);
  EXPECT_EQ(r.train_docs, 36u);
  EXPECT_EQ(r.valid_docs, 4u);
  auto train = IndexedDataset::open(r.train_prefix);
  auto valid = IndexedDataset::open(r.valid_prefix);
  EXPECT_EQ(train.num_documents(), 36u);
  EXPECT_EQ(valid.num_documents(), 4u);
  EXPECT_EQ(train.dtype(), DType::U16);
  auto tok = make_tokenizer("byte");
  auto first = train.get_sequence(0);
  ASSERT_EQ(first.back(), tok->eot_id());
  first.pop_back();
  EXPECT_EQ(tok->decode(first), "fortune number 0\n");
  auto v0 = valid.get_sequence(0);
  v0.pop_back();
  EXPECT_EQ(tok->decode(v0), "fortune number 9\n");  // every 10th document is held out
  std::filesystem::remove_all(dir);
}

// alloy::remove_tree replaces std::filesystem::remove_all (see core/fs.h): it must remove nested
// directories, remove a link without touching its target, and accept a missing path.
TEST(RemoveTree, RemovesNestedDirectoriesButNotWhatLinksPointTo) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("alloy_remove_tree_" + std::to_string(::getpid()));
  const fs::path keep = root.string() + "_kept";
  fs::create_directories(root / "a" / "b");
  fs::create_directories(keep);
  alloy::write_file_atomic((root / "a" / "b" / "f.txt").string(), "x");
  alloy::write_file_atomic((keep / "target.txt").string(), "y");
  fs::create_directory_symlink(keep, root / "a" / "link");
  EXPECT_TRUE(alloy::remove_tree(root.string()));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_EQ(alloy::read_file((keep / "target.txt").string()), "y");
  EXPECT_TRUE(alloy::remove_tree(root.string()));  // already gone: no error
  EXPECT_TRUE(alloy::remove_tree(keep.string()));
  EXPECT_FALSE(fs::exists(keep));
}
