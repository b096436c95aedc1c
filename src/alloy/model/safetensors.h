#pragma once
// safetensors read/write on raw bytes, without LibTorch: checkpoints and HuggingFace weights are
// validated and sliced here, and only turned into tensors by the caller. Layout: u64 LE header
// length N, N bytes of JSON, then the data; see ../shared/reference/FORMATS.md (beside the repository).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace alloy::model {

// Bytes per element of a safetensors dtype name ("F32", "BF16", ...); 0 if the name is unknown.
size_t safetensors_itemsize(std::string_view dtype);

struct TensorBlob {
  std::string dtype;           // safetensors name: BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 ...
  std::vector<int64_t> shape;  // empty for a scalar
  std::string data;            // raw little-endian bytes, C-contiguous
};

// Writes PATH atomically. Tensors are laid out back to back in the given order (the header lists
// them in that order too) and the header is padded with spaces to a multiple of 8 bytes, so the
// data section starts 8-byte aligned in the file. __metadata__ is written only when non-empty.
// Throws InputError naming PATH and the tensor for an unknown dtype, a negative dimension, data
// whose size differs from shape * itemsize, a duplicate or reserved name.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, TensorBlob>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

struct TensorInfo {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the first byte after the header
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// A validated, memory-mapped safetensors file. Movable; views returned by bytes() live as long as
// the SafetensorsFile they came from.
class SafetensorsFile {
 public:
  // Throws InputError naming PATH (and the tensor, where one is at fault) for a truncated file, a
  // header that is not a JSON object, a missing or malformed dtype/shape/data_offsets, an unknown
  // dtype, offsets outside the data or disagreeing with shape * itemsize, overlapping tensors, or
  // __metadata__ that is not a string-to-string object.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile() = default;
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In the order of their data in the file (which is the header order for files we write).
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return info_.count(name) != 0; }
  // Throws InputError naming the file and the tensor if there is no such tensor.
  const TensorInfo& info(const std::string& name) const;
  // The tensor's bytes inside the mapping. Not necessarily aligned to the element size (other
  // writers may pack tensors tightly), so copy out rather than casting the pointer.
  std::string_view bytes(const std::string& name) const;
  // A copy of one tensor, e.g. to re-save a subset.
  TensorBlob load(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Bytes of the JSON header, excluding the 8-byte length prefix.
  uint64_t header_size() const { return header_size_; }

 private:
  void release() noexcept;

  std::string path_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, TensorInfo> info_;
  std::map<std::string, std::string> metadata_;
  uint64_t header_size_ = 0;
  const unsigned char* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace alloy::model
