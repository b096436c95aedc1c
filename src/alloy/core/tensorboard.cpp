#include "alloy/core/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>

#include "alloy/core/error.h"

namespace alloy {
namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, uint32_t field, uint32_t wire) { put_varint(out, (field << 3) | wire); }
void put_bytes(std::string& out, uint32_t field, const std::string& s) {
  put_tag(out, field, 2);
  put_varint(out, s.size());
  out += s;
}
template <typename T>
void put_fixed(std::string& out, uint32_t field, uint32_t wire, T v) {
  put_tag(out, field, wire);
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));  // x86/ARM little-endian, as protobuf wants
  out.append(buf, sizeof(T));
}
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const auto& t = crc_table();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }

uint32_t masked_crc32c(const void* data, size_t n) {
  uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string TensorBoardWriter::frame_record(const std::string& data) {
  std::string out;
  uint64_t len = data.size();
  char lenbuf[8];
  std::memcpy(lenbuf, &len, 8);
  out.append(lenbuf, 8);
  uint32_t c1 = masked_crc32c(lenbuf, 8);
  out.append(reinterpret_cast<const char*>(&c1), 4);
  out += data;
  uint32_t c2 = masked_crc32c(data.data(), data.size());
  out.append(reinterpret_cast<const char*>(&c2), 4);
  return out;
}

std::string TensorBoardWriter::encode_version_event(double wall_time) {
  std::string e;
  put_fixed<double>(e, 1, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string TensorBoardWriter::encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string value_msg;
  put_bytes(value_msg, 1, tag);
  put_fixed<float>(value_msg, 2, 5, value);
  std::string summary;
  put_bytes(summary, 1, value_msg);
  std::string e;
  put_fixed<double>(e, 1, 1, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  put_bytes(e, 5, summary);
  return e;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(now_seconds())) + "." + host;
  f_ = std::fopen(path_.c_str(), "ab");
  if (!f_) throw InputError(path_, "cannot create TensorBoard event file");
  write_record(encode_version_event(now_seconds()));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string rec = frame_record(data);
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size()) throw InputError(path_, "write failed");
}

void TensorBoardWriter::scalar(const std::string& tag, float value, int64_t step) {
  write_record(encode_scalar_event(now_seconds(), step, tag, value));
}

void TensorBoardWriter::flush() { std::fflush(f_); }

}  // namespace alloy
