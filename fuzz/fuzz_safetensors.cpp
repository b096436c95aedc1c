// Fuzz target: safetensors files (model::SafetensorsFile::open), read for checkpoints,
// `alloy model import` and --init-from. A file that opens must hand out every tensor it lists,
// with as many bytes as its shape and dtype need, and write back to an equal file.
#include "alloy/model/safetensors.h"
#include "fuzz_util.h"

using alloy::InputError;
using alloy::model::SafetensorsFile;
using alloy::model::TensorBlob;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& dir = alloy_fuzz::TempDir::get();
  const std::string path = dir.write("in.safetensors", alloy_fuzz::as_view(data, size));
  SafetensorsFile f;
  try {
    f = SafetensorsFile::open(path);
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  std::vector<std::pair<std::string, TensorBlob>> tensors;
  for (const auto& name : f.names()) {
    const auto& info = f.info(name);
    FUZZ_CHECK(info.nbytes() == info.numel() * alloy::model::safetensors_itemsize(info.dtype), name);
    TensorBlob b = f.load(name);
    FUZZ_CHECK(b.data.size() == info.nbytes(), name);
    tensors.emplace_back(name, std::move(b));
  }
  FUZZ_CHECK(f.names().size() == tensors.size(), "names");
  // Re-saving what was read (what `alloy model export` and LoRA merges do) must work and read back equal.
  const std::string out = dir.path() + "/out.safetensors";
  try {
    alloy::model::write_safetensors(out, tensors, f.metadata());
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("write_safetensors(what open() read)", __FILE__, __LINE__, e.what());
  }
  try {
    SafetensorsFile g = SafetensorsFile::open(out);
    FUZZ_CHECK(g.names().size() == tensors.size() && g.metadata() == f.metadata(), "re-read");
    for (const auto& [name, blob] : tensors) FUZZ_CHECK(g.bytes(name) == blob.data && g.info(name).shape == blob.shape, name);
  } catch (const InputError& e) {
    alloy_fuzz::check_failed("SafetensorsFile::open(rewritten)", __FILE__, __LINE__, e.what());
  }
  return 0;
}
