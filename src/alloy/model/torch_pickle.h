#pragma once
// Reading files written by Python's torch.save (the zip format, PyTorch >= 1.6) without Python:
// a pickle machine for the opcodes torch.save's protocol 2 and Python's protocols up to 5 emit, whose
// unknown classes (argparse.Namespace, numpy arrays, enums) become opaque objects instead of errors,
// and whose tensors are rebuilt from the archive's storages. It exists for checkpoints other
// programs wrote (Megatron-LM's model_optim_rng.pt): Alloy's own files are safetensors and JSON.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace alloy::model {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

// A tensor of a torch.save archive, read when asked for: a checkpoint's optimizer state (several
// times its weights), never asked for, is never read.
struct LazyTensor {
  std::function<at::Tensor()> storage;  // the storage's elements (1-D), read from the archive
  at::ScalarType dtype = at::kFloat;    // the tensor's (a typed storage's, or _rebuild_tensor_v3's)
  int64_t offset = 0;
  std::vector<int64_t> size, stride;
  std::string where;
};

// One unpickled value. Dicts keep their insertion order (Python's, and OrderedDict's).
struct PyValue {
  enum class Kind { None, Bool, Int, Float, Str, Bytes, List, Tuple, Dict, Set, Tensor, Global, Object };
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                              // Str, Bytes; Global: "module.name"
  std::vector<PyRef> items;                   // List, Tuple, Set; Object: its constructor's arguments
  std::vector<std::pair<PyRef, PyRef>> dict;  // Dict
  PyRef cls, state;                           // Object: the class (a Global) and what BUILD gave it
  at::Tensor tensor;                          // Tensor read at once (a storage, or unpickle without an archive)
  std::shared_ptr<const LazyTensor> lazy;     // Tensor read on demand

  PyValue() = default;
  PyValue(const PyValue&) = delete;
  PyValue& operator=(const PyValue&) = delete;
  ~PyValue();  // iterative: a pickle nested 100k deep must not overflow the stack

  // A Tensor's values (on the CPU, in the file's dtype, contiguous); read from the archive on each call.
  at::Tensor tensor_value() const;
  // Dict entry KEY (a string key), or an Object's attribute KEY (its BUILD state's entry); null if none.
  const PyValue* get(const std::string& key) const;
  bool is_str() const { return kind == Kind::Str; }
  // What the value is, for messages: "dict", "argparse.Namespace", "tensor", ...
  std::string type_name() const;
};

// Unpickles DATA (WHERE names it in errors). Persistent ids (torch's storages) go to PERSISTENT,
// which returns the value standing for them; without it they are an error.
PyRef unpickle(const std::string& data, const std::string& where,
               const std::function<PyRef(const PyRef& pid)>& persistent = nullptr);

// A torch.save file: its data.pkl unpickled, every tensor read from the archive's storages.
// Throws InputError naming PATH for the legacy (pre-1.6, not zip) format and for damage.
PyRef load_torch_file(const std::string& path);

}  // namespace alloy::model
