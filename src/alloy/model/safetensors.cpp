#include "alloy/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"

// The 8-byte header length is read and written by copying host bytes.
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "alloy/model/safetensors.cpp assumes a little-endian host"
#endif

namespace alloy::model {
namespace {

using ojson = nlohmann::ordered_json;

// The reference implementation refuses headers above 100 MB; a larger length field is corruption,
// and honouring it would mean parsing gigabytes of tensor data as JSON.
constexpr uint64_t kMaxHeader = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

std::string tensor_label(const std::string& name) { return "tensor '" + name + "'"; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Element count of SHAPE; false on a negative dimension or overflow.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  *out = n;
  return true;
}

bool is_valid_utf8_json_string(const std::string& s) {
  try {
    (void)ojson(s).dump(-1, ' ', false, ojson::error_handler_t::strict);
    return true;
  } catch (const ojson::type_error&) {
    return false;
  }
}

}  // namespace

size_t safetensors_itemsize(std::string_view dtype) {
  static const std::pair<std::string_view, size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return 0;
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 0;
  return checked_numel(shape, &n) ? n : 0;
}

// ---------------------------------------------------------------------------------------------
// Writer

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, TensorBlob>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  ojson header = ojson::object();
  if (!metadata.empty()) {
    // First, as the reference writer does, so a human reading the header sees it immediately.
    ojson meta = ojson::object();
    for (const auto& [k, v] : metadata) {
      if (!is_valid_utf8_json_string(k) || !is_valid_utf8_json_string(v))
        throw InputError(path, "__metadata__ key '" + k + "': key or value is not valid UTF-8");
      meta[k] = v;
    }
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name == kMetadataKey) throw InputError(path, "tensor name '__metadata__' is reserved");
    if (!seen.insert(name).second) throw InputError(path, tensor_label(name) + ": duplicate name");
    if (!is_valid_utf8_json_string(name))
      throw InputError(path, tensor_label(name) + ": name is not valid UTF-8");
    const size_t isz = safetensors_itemsize(t.dtype);
    if (isz == 0) throw InputError(path, tensor_label(name) + ": unknown dtype '" + t.dtype + "'");
    uint64_t numel = 0;
    if (!checked_numel(t.shape, &numel) || __builtin_mul_overflow(numel, isz, &numel))
      throw InputError(path, tensor_label(name) + ": invalid shape " + shape_str(t.shape));
    if (numel != t.data.size())
      throw InputError(path, tensor_label(name) + ": shape " + shape_str(t.shape) + " of " +
                                 t.dtype + " needs " + std::to_string(numel) + " bytes, data has " +
                                 std::to_string(t.data.size()));
    ojson entry = ojson::object();
    entry["dtype"] = t.dtype;
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + numel};
    header[name] = std::move(entry);
    offset += numel;
  }
  std::string json = header.dump();
  // Pad to a multiple of 8 so the data section, and every tensor of an 8-byte-multiple size
  // before it, starts aligned when the file is mapped.
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t n = json.size();

  AtomicFile f(path);
  f.write(&n, sizeof(n));
  f.write(json);
  for (const auto& [name, t] : tensors) f.write(t.data);
  f.commit();
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsFile::~SafetensorsFile() { release(); }

void SafetensorsFile::release() noexcept {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), size_);
  map_ = nullptr;
  size_ = 0;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this == &o) return *this;
  release();
  path_ = std::move(o.path_);
  names_ = std::move(o.names_);
  info_ = std::move(o.info_);
  metadata_ = std::move(o.metadata_);
  header_size_ = std::exchange(o.header_size_, 0);
  map_ = std::exchange(o.map_, nullptr);
  size_ = std::exchange(o.size_, 0);
  return *this;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;  // owns the mapping from the moment it exists, so every throw unmaps
  f.path_ = path;
  {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw InputError(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw InputError(path, "not a readable regular file");
    }
    const size_t size = static_cast<size_t>(st.st_size);
    if (size < 8) {
      ::close(fd);
      throw InputError(path, "truncated: " + std::to_string(size) +
                                 " bytes, too short for the 8-byte header length");
    }
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (m == MAP_FAILED) throw InputError(path, std::string("mmap failed: ") + std::strerror(err));
    f.map_ = static_cast<const unsigned char*>(m);
    f.size_ = size;
  }

  uint64_t n = 0;
  std::memcpy(&n, f.map_, sizeof(n));
  if (n > f.size_ - 8)
    throw InputError(path, "truncated: header length is " + std::to_string(n) + " bytes but only " +
                               std::to_string(f.size_ - 8) + " follow it");
  if (n > kMaxHeader)
    throw InputError(path, "header length " + std::to_string(n) + " is implausibly large");
  if (n < 2) throw InputError(path, "header length " + std::to_string(n) + " is too small");
  f.header_size_ = n;
  const char* hbegin = reinterpret_cast<const char*>(f.map_ + 8);
  if (hbegin[0] != '{')
    throw InputError(path, "header does not start with '{': not a safetensors file");
  const uint64_t data_size = f.size_ - 8 - n;

  // JSON objects may legally repeat a key and parsers keep the last; for tensor names that
  // would silently drop a tensor, so repeats are errors here.
  std::set<std::string> top_keys;
  std::string duplicate;
  ojson::parser_callback_t cb = [&](int depth, ojson::parse_event_t ev, ojson& parsed) {
    // Deep nesting would overflow the stack when a message quotes a value (dump() recurses).
    if (depth > kMaxJsonDepth)
      throw InputError(path, "header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    if (depth == 1 && ev == ojson::parse_event_t::key && parsed.is_string() &&
        !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  ojson header;
  try {
    header = ojson::parse(hbegin, hbegin + n, cb);
  } catch (const ojson::exception& e) {  // parse_error, or out_of_range for a number past double's range
    throw InputError(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) throw InputError(path, "header is not a JSON object");
  if (!duplicate.empty())
    throw InputError(
        path, (duplicate == kMetadataKey ? std::string("__metadata__") : tensor_label(duplicate)) +
                  ": appears twice in the header");

  std::vector<std::pair<std::string, const TensorInfo*>> order;
  for (const auto& [name, v] : header.items()) {
    if (name == kMetadataKey) {
      if (!v.is_object()) throw InputError(path, "__metadata__ is not a JSON object");
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string())
          throw InputError(path, "__metadata__ key '" + k + "': value is not a string");
        f.metadata_[k] = mv.get<std::string>();
      }
      continue;
    }
    const std::string who = tensor_label(name);
    if (!v.is_object()) throw InputError(path, who + ": entry is not a JSON object");
    TensorInfo info;

    auto dt = v.find("dtype");
    if (dt == v.end()) throw InputError(path, who + ": missing 'dtype'");
    if (!dt->is_string()) throw InputError(path, who + ": 'dtype' is not a string");
    info.dtype = dt->get<std::string>();
    const size_t isz = safetensors_itemsize(info.dtype);
    if (isz == 0) throw InputError(path, who + ": unknown dtype '" + info.dtype + "'");

    auto sh = v.find("shape");
    if (sh == v.end()) throw InputError(path, who + ": missing 'shape'");
    if (!sh->is_array()) throw InputError(path, who + ": 'shape' is not an array");
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        throw InputError(path,
                         who + ": 'shape' entry " + d.dump() + " is not a non-negative integer");
      info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }

    auto off = v.find("data_offsets");
    if (off == v.end()) throw InputError(path, who + ": missing 'data_offsets'");
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      throw InputError(
          path, who + ": 'data_offsets' must be two non-negative integers, got " + off->dump());
    info.begin = (*off)[0].get<uint64_t>();
    info.end = (*off)[1].get<uint64_t>();
    if (info.end < info.begin)
      throw InputError(path, who + ": data_offsets [" + std::to_string(info.begin) + ", " +
                                 std::to_string(info.end) + "] end before they begin");
    if (info.end > data_size)
      throw InputError(path, who + ": data_offsets [" + std::to_string(info.begin) + ", " +
                                 std::to_string(info.end) + "] run past the data section (" +
                                 std::to_string(data_size) + " bytes): file truncated?");
    uint64_t nbytes = 0;
    const bool fits =
        checked_numel(info.shape, &nbytes) && !__builtin_mul_overflow(nbytes, isz, &nbytes);
    if (!fits || nbytes != info.end - info.begin)
      throw InputError(path, who + ": shape " + shape_str(info.shape) + " of " + info.dtype +
                                 " needs " + (fits ? std::to_string(nbytes) : "over 2^64") +
                                 " bytes, data_offsets span " +
                                 std::to_string(info.end - info.begin));
    auto [it, inserted] = f.info_.emplace(name, std::move(info));
    order.emplace_back(name, &it->second);
  }

  // File order: by position in the data; zero-size tensors keep their header position.
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  const std::pair<std::string, const TensorInfo*>* prev = nullptr;
  for (const auto& e : order) {
    if (e.second->nbytes() == 0) continue;
    if (prev && e.second->begin < prev->second->end)
      throw InputError(
          path, tensor_label(e.first) + ": data_offsets [" + std::to_string(e.second->begin) +
                    ", " + std::to_string(e.second->end) + "] overlap " +
                    tensor_label(prev->first) + " at [" + std::to_string(prev->second->begin) +
                    ", " + std::to_string(prev->second->end) + "]");
    prev = &e;
  }
  for (const auto& e : order) f.names_.push_back(e.first);
  return f;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = info_.find(name);
  if (it == info_.end())
    throw InputError(path_, tensor_label(name) + ": no such tensor in the file");
  return it->second;
}

std::string_view SafetensorsFile::bytes(const std::string& name) const {
  const TensorInfo& i = info(name);
  return {reinterpret_cast<const char*>(map_ + 8 + header_size_ + i.begin), i.nbytes()};
}

TensorBlob SafetensorsFile::load(const std::string& name) const {
  const TensorInfo& i = info(name);
  return TensorBlob{i.dtype, i.shape, std::string(bytes(name))};
}

}  // namespace alloy::model
