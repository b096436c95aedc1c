#pragma once
// TensorBoard event files without TensorFlow: TFRecord framing (length, masked CRC32C, data,
// masked CRC32C) around hand-encoded Event / Summary protobuf messages (see FORMATS.md).
#include <cstdint>
#include <cstdio>
#include <string>

namespace alloy {

uint32_t crc32c(const void* data, size_t n);
// CRC of data that continues the data CRC was computed over (crc32c(a + b) = crc32c_extend(crc32c(a), b)).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates DIR/events.out.tfevents.<unix seconds>.<hostname> and writes the file_version record.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  void scalar(const std::string& tag, float value, int64_t step);
  void flush();
  const std::string& path() const { return path_; }

  // Encoders, public for tests.
  static std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
  static std::string encode_version_event(double wall_time);
  static std::string frame_record(const std::string& data);

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace alloy
