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
  at::Tensor tensor;                          // Tensor (on the CPU, in the file's dtype)

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
