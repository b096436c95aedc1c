#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "alloy/core/fs.h"
#include "alloy/core/tensorboard.h"

TEST(TensorBoard, Crc32cCheckValue) {
  EXPECT_EQ(alloy::crc32c("123456789", 9), 0xE3069283u);
}

TEST(TensorBoard, RecordFramingAndScalarEncoding) {
  std::string ev = alloy::TensorBoardWriter::encode_scalar_event(1.5, 300, "train/loss", 2.25f);
  // wall_time: field 1, fixed64
  ASSERT_EQ(static_cast<unsigned char>(ev[0]), 0x09);
  double wt;
  std::memcpy(&wt, ev.data() + 1, 8);
  EXPECT_EQ(wt, 1.5);
  // step: field 2 varint 300 = 0xAC 0x02
  EXPECT_EQ(static_cast<unsigned char>(ev[9]), 0x10);
  EXPECT_EQ(static_cast<unsigned char>(ev[10]), 0xAC);
  EXPECT_EQ(static_cast<unsigned char>(ev[11]), 0x02);
  // summary: field 5, length-delimited, holding value{tag, simple_value}
  EXPECT_EQ(static_cast<unsigned char>(ev[12]), 0x2A);
  EXPECT_NE(ev.find("train/loss"), std::string::npos);
  float v;
  std::memcpy(&v, ev.data() + ev.size() - 4, 4);
  EXPECT_EQ(v, 2.25f);

  std::string rec = alloy::TensorBoardWriter::frame_record(ev);
  uint64_t len;
  std::memcpy(&len, rec.data(), 8);
  EXPECT_EQ(len, ev.size());
  uint32_t c1, c2;
  std::memcpy(&c1, rec.data() + 8, 4);
  std::memcpy(&c2, rec.data() + rec.size() - 4, 4);
  EXPECT_EQ(c1, alloy::masked_crc32c(rec.data(), 8));
  EXPECT_EQ(c2, alloy::masked_crc32c(ev.data(), ev.size()));
}

TEST(TensorBoard, WriterCreatesNamedFileStartingWithVersion) {
  auto dir = std::filesystem::temp_directory_path() / "alloy_tb_test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string path;
  {
    alloy::TensorBoardWriter w(dir.string());
    w.scalar("train/loss", 1.0f, 1);
    path = w.path();
  }
  EXPECT_NE(path.find("events.out.tfevents."), std::string::npos);
  std::string bytes = alloy::read_file(path);
  EXPECT_NE(bytes.find("brain.Event:2"), std::string::npos);
  EXPECT_NE(bytes.find("train/loss"), std::string::npos);
  std::filesystem::remove_all(dir);
}
