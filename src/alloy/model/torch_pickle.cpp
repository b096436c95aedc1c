// A pickle machine for torch.save files (see torch_pickle.h). Opcodes follow Python's
// Lib/pickletools.py; torch's tensors follow torch/_utils.py's _rebuild_tensor_v2 and the
// persistent ids torch/serialization.py writes: ('storage', StorageClass, key, location, numel),
// the storage's bytes in the archive's data/KEY record.
#include "alloy/model/torch_pickle.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <fstream>
#include <map>

#include "alloy/core/error.h"
#include "alloy/core/parse.h"

namespace alloy::model {

namespace {

// Multiply-add without overflow: false when A * B + C leaves int64.
bool mul_add(int64_t a, int64_t b, int64_t c, int64_t* out) {
  int64_t m = 0;
  return !__builtin_mul_overflow(a, b, &m) && !__builtin_add_overflow(m, c, out);
}

// Checks that the view OFFSET/SIZE/STRIDE lies within STORAGE_NUMEL elements and does not repeat
// them beyond reason (a stride-0 view of one element cloned into gigabytes); WHERE names it.
void check_view(int64_t storage_numel, int64_t offset, const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                const std::string& where) {
  if (size.size() != stride.size()) throw InputError(where, "a tensor's size and stride differ in length");
  int64_t last = offset, numel = 1;
  bool empty = false;
  for (size_t k = 0; k < size.size(); ++k) {
    if (size[k] < 0 || stride[k] < 0) throw InputError(where, "a tensor has a negative size or stride");
    if (size[k] == 0) empty = true;
    if (!mul_add(numel, size[k], 0, &numel)) throw InputError(where, "a tensor's element count overflows");
  }
  if (offset < 0) throw InputError(where, "a tensor starts at a negative offset");
  if (empty) return;
  for (size_t k = 0; k < size.size(); ++k)
    if (!mul_add(size[k] - 1, stride[k], last, &last)) throw InputError(where, "a tensor's extent overflows");
  if (last >= storage_numel)
    throw InputError(where, "a tensor reaches element " + std::to_string(last) + " of a storage of " + std::to_string(storage_numel));
  if (numel > 16 * storage_numel + (int64_t{1} << 20))
    throw InputError(where, "a tensor of " + std::to_string(numel) + " elements repeats a storage of " + std::to_string(storage_numel));
}

at::ScalarType torch_dtype_named(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> kinds = {
      {"torch.float32", at::kFloat}, {"torch.float", at::kFloat},     {"torch.float64", at::kDouble}, {"torch.double", at::kDouble},
      {"torch.float16", at::kHalf},  {"torch.half", at::kHalf},       {"torch.bfloat16", at::kBFloat16}, {"torch.int64", at::kLong},
      {"torch.long", at::kLong},     {"torch.int32", at::kInt},       {"torch.int", at::kInt},        {"torch.int16", at::kShort},
      {"torch.short", at::kShort},   {"torch.int8", at::kChar},       {"torch.uint8", at::kByte},     {"torch.bool", at::kBool}};
  auto it = kinds.find(name);
  if (it == kinds.end()) throw InputError(where, "a tensor of dtype " + name + ", which Alloy does not read");
  return it->second;
}

}  // namespace

const PyValue* PyValue::get(const std::string& key) const {
  const std::vector<std::pair<PyRef, PyRef>>* d = &dict;
  if (kind == Kind::Object && state && state->kind == Kind::Dict) d = &state->dict;
  for (const auto& [k, v] : *d)
    if (k && k->kind == Kind::Str && k->s == key) return v.get();
  if (kind == Kind::Object && d != &dict)
    for (const auto& [k, v] : dict)
      if (k && k->kind == Kind::Str && k->s == key) return v.get();
  return nullptr;
}

at::Tensor PyValue::tensor_value() const {
  if (kind != Kind::Tensor) throw InputError("", "a " + type_name() + " is not a tensor");
  if (!lazy) return tensor;
  const LazyTensor& l = *lazy;
  at::Tensor st = l.storage();
  if (st.scalar_type() != l.dtype) {  // an untyped storage (bytes) seen as _rebuild_tensor_v3's dtype
    const int64_t item = static_cast<int64_t>(at::elementSize(l.dtype));
    if (st.numel() % item) throw InputError(l.where, "a storage of " + std::to_string(st.numel()) + " bytes holds no whole " +
                                                         std::string(c10::toString(l.dtype)) + " elements");
    st = st.view(l.dtype);
  }
  check_view(st.numel(), l.offset, l.size, l.stride, l.where);
  for (int64_t x : l.size)
    if (x == 0) return at::empty(l.size, st.options());
  return st.as_strided(l.size, l.stride, l.offset).clone();
}

std::string PyValue::type_name() const {
  switch (kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Dict: return "dict";
    case Kind::Set: return "set";
    case Kind::Tensor: return "tensor";
    case Kind::Global: return "class " + s;
    case Kind::Object: return cls ? cls->s : "object";
  }
  return "?";
}

PyValue::~PyValue() {
  // Children whose last owner this is are emptied one at a time, not destroyed recursively.
  std::vector<PyRef> pending;
  auto take = [&pending](PyValue& v) {
    for (auto& x : v.items) pending.push_back(std::move(x));
    v.items.clear();
    for (auto& [k, x] : v.dict) pending.push_back(std::move(k)), pending.push_back(std::move(x));
    v.dict.clear();
    if (v.cls) pending.push_back(std::move(v.cls));
    if (v.state) pending.push_back(std::move(v.state));
  };
  take(*this);
  while (!pending.empty()) {
    PyRef p = std::move(pending.back());
    pending.pop_back();
    if (p && p.use_count() == 1) take(*p);
  }
}

namespace {

PyRef make(PyValue::Kind k) {
  auto v = std::make_shared<PyValue>();
  v->kind = k;
  return v;
}
PyRef make_int(int64_t i) {
  auto v = make(PyValue::Kind::Int);
  v->i = i;
  return v;
}
PyRef make_str(std::string s, PyValue::Kind k = PyValue::Kind::Str) {
  auto v = make(k);
  v->s = std::move(s);
  return v;
}

// UTF-8 to code points, each below 256 (what `_codecs.encode(s, "latin1")` needs: protocol 2
// pickles Python 3 bytes that way).
std::string latin1_of_utf8(const std::string& s, const std::string& where) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      i += 1;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
      const unsigned cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
      if (cp > 0xFF) throw InputError(where, "a latin-1 byte string holds a character above U+00FF");
      out.push_back(static_cast<char>(cp));
      i += 2;
    } else {
      throw InputError(where, "a latin-1 byte string holds a character above U+00FF");
    }
  }
  return out;
}

at::ScalarType storage_dtype(const std::string& cls, const std::string& where) {
  static const std::map<std::string, at::ScalarType> kinds = {
      {"torch.FloatStorage", at::kFloat},    {"torch.DoubleStorage", at::kDouble}, {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16}, {"torch.LongStorage", at::kLong}, {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},    {"torch.CharStorage", at::kChar},     {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool},      {"torch.UntypedStorage", at::kByte}};
  auto it = kinds.find(cls);
  if (it == kinds.end()) throw InputError(where, "a tensor's storage is " + cls + ", which Alloy does not read");
  return it->second;
}

class Machine {
 public:
  Machine(const std::string& data, const std::string& where, const std::function<PyRef(const PyRef&)>& persistent)
      : d_(data), where_(where), persistent_(persistent) {}

  PyRef run() {
    while (true) {
      const auto op = static_cast<unsigned char>(byte());
      switch (op) {
        case 0x80: byte(); break;              // PROTO
        case 0x95: bytes(8); break;            // FRAME
        case '.': return pop();                // STOP
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;                // POP
        case '1': pop_mark(); break;           // POP_MARK
        case '2': push(top()); break;          // DUP
        case 'N': push(make(PyValue::Kind::None)); break;
        case 0x88: case 0x89: {                // NEWTRUE, NEWFALSE
          auto v = make(PyValue::Kind::Bool);
          v->b = op == 0x88;
          push(v);
          break;
        }
        case 'I': {                            // INT (text; 00/01 are booleans)
          const std::string l = line();
          if (l == "00" || l == "01") {
            auto v = make(PyValue::Kind::Bool);
            v->b = l == "01";
            push(v);
          } else {
            push(make_int(parse_int(l)));
          }
          break;
        }
        case 'L': {                            // LONG (text, trailing L)
          std::string l = line();
          if (!l.empty() && l.back() == 'L') l.pop_back();
          push(make_int(parse_int(l)));
          break;
        }
        case 'J': push(make_int(static_cast<int32_t>(le(4)))); break;  // BININT
        case 'K': push(make_int(static_cast<int64_t>(le(1)))); break;  // BININT1
        case 'M': push(make_int(static_cast<int64_t>(le(2)))); break;  // BININT2
        case 0x8a: push(make_int(long_bytes(le(1)))); break;           // LONG1
        case 0x8b: push(make_int(long_bytes(le(4)))); break;           // LONG4
        case 'F': {                            // FLOAT (text)
          const std::string l = line();
          const auto f = parse_double(l);
          if (!f) fail("'" + l + "' is not a float");
          auto v = make(PyValue::Kind::Float);
          v->f = *f;
          push(v);
          break;
        }
        case 'G': {                            // BINFLOAT (big-endian)
          const std::string b = bytes(8);
          uint64_t u = 0;
          for (char c : b) u = (u << 8) | static_cast<unsigned char>(c);
          auto v = make(PyValue::Kind::Float);
          std::memcpy(&v->f, &u, 8);
          push(v);
          break;
        }
        case 'X': push(make_str(bytes(le(4)))); break;                       // BINUNICODE
        case 0x8c: push(make_str(bytes(le(1)))); break;                      // SHORT_BINUNICODE
        case 0x8d: push(make_str(bytes(le(8)))); break;                      // BINUNICODE8
        case 'V': push(make_str(line())); break;                             // UNICODE (ASCII in practice)
        case 'T': push(make_str(bytes(le(4)))); break;                       // BINSTRING
        case 'U': push(make_str(bytes(le(1)))); break;                       // SHORT_BINSTRING
        case 'B': push(make_str(bytes(le(4)), PyValue::Kind::Bytes)); break; // BINBYTES
        case 'C': push(make_str(bytes(le(1)), PyValue::Kind::Bytes)); break; // SHORT_BINBYTES
        case 0x8e: case 0x96: push(make_str(bytes(le(8)), PyValue::Kind::Bytes)); break;  // BINBYTES8, BYTEARRAY8
        case ']': push(make(PyValue::Kind::List)); break;
        case ')': push(make(PyValue::Kind::Tuple)); break;
        case '}': push(make(PyValue::Kind::Dict)); break;
        case 0x8f: push(make(PyValue::Kind::Set)); break;                    // EMPTY_SET
        case 'l': case 't': case 0x91: {       // LIST, TUPLE, FROZENSET
          auto v = make(op == 'l' ? PyValue::Kind::List : op == 't' ? PyValue::Kind::Tuple : PyValue::Kind::Set);
          v->items = pop_mark();
          push(v);
          break;
        }
        case 0x85: case 0x86: case 0x87: {     // TUPLE1..3
          auto v = make(PyValue::Kind::Tuple);
          const size_t n = op - 0x84u;
          need(n);
          v->items.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(v);
          break;
        }
        case 'd': {                            // DICT
          auto v = make(PyValue::Kind::Dict);
          auto xs = pop_mark();
          for (size_t k = 0; k + 1 < xs.size(); k += 2) v->dict.emplace_back(xs[k], xs[k + 1]);
          push(v);
          break;
        }
        case 'a': {                            // APPEND
          auto x = pop();
          append(top(), {x});
          break;
        }
        case 'e': case 0x90: {                 // APPENDS, ADDITEMS
          auto xs = pop_mark();
          append(top(), xs);
          break;
        }
        case 's': {                            // SETITEM
          auto v = pop();
          auto k = pop();
          set_items(top(), {k, v});
          break;
        }
        case 'u': {                            // SETITEMS
          auto xs = pop_mark();
          set_items(top(), xs);
          break;
        }
        case 'c': {                            // GLOBAL
          std::string module = line();
          std::string name = line();
          push(make_str(module + "." + name, PyValue::Kind::Global));
          break;
        }
        case 0x93: {                           // STACK_GLOBAL
          auto name = pop();
          auto module = pop();
          push(make_str(module->s + "." + name->s, PyValue::Kind::Global));
          break;
        }
        case 'R': {                            // REDUCE
          auto args = pop();
          auto fn = pop();
          push(reduce(fn, args));
          break;
        }
        case 0x81: {                           // NEWOBJ
          auto args = pop();
          auto cls = pop();
          push(reduce(cls, args));
          break;
        }
        case 0x92: {                           // NEWOBJ_EX (keyword arguments dropped)
          pop();
          auto args = pop();
          auto cls = pop();
          push(reduce(cls, args));
          break;
        }
        case 'o': {                            // OBJ
          auto xs = pop_mark();
          if (xs.empty()) fail("OBJ without a class");
          auto args = make(PyValue::Kind::Tuple);
          args->items.assign(xs.begin() + 1, xs.end());
          push(reduce(xs.front(), args));
          break;
        }
        case 'i': {                            // INST
          std::string module = line();
          std::string name = line();
          auto args = make(PyValue::Kind::Tuple);
          args->items = pop_mark();
          push(reduce(make_str(module + "." + name, PyValue::Kind::Global), args));
          break;
        }
        case 'b': {                            // BUILD
          auto state = pop();
          build(top(), state);
          break;
        }
        case 'p': memo_[parse_int(line())] = top(); break;                        // PUT
        case 'q': memo_[static_cast<int64_t>(le(1))] = top(); break;             // BINPUT
        case 'r': memo_[static_cast<int64_t>(le(4))] = top(); break;             // LONG_BINPUT
        case 0x94: memo_[static_cast<int64_t>(memo_.size())] = top(); break;     // MEMOIZE
        case 'g': push(memo(parse_int(line()))); break;                           // GET
        case 'h': push(memo(static_cast<int64_t>(le(1)))); break;                // BINGET
        case 'j': push(memo(static_cast<int64_t>(le(4)))); break;                // LONG_BINGET
        case 'P': push(persistent(make_str(line()))); break;                      // PERSID
        case 'Q': push(persistent(pop())); break;                                 // BINPERSID
        default: {
          char buf[64];
          std::snprintf(buf, sizeof buf, "pickle opcode 0x%02x at byte %zu is not supported", op, pos_ - 1);
          fail(buf);
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw InputError(where_, why); }
  char byte() {
    if (pos_ >= d_.size()) fail("the pickle ends before its STOP opcode");
    return d_[pos_++];
  }
  std::string bytes(uint64_t n) {
    if (n > d_.size() - pos_) fail("a pickle item runs past the end of the data (" + std::to_string(n) + " bytes)");
    std::string s = d_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  uint64_t le(int n) {
    const std::string b = bytes(static_cast<uint64_t>(n));
    uint64_t u = 0;
    for (int k = n; k-- > 0;) u = (u << 8) | static_cast<unsigned char>(b[static_cast<size_t>(k)]);
    return u;
  }
  int64_t long_bytes(uint64_t n) {
    if (n > 8) fail("an integer of " + std::to_string(n) + " bytes does not fit 64 bits");
    const std::string b = bytes(n);
    uint64_t u = 0;
    for (size_t k = b.size(); k-- > 0;) u = (u << 8) | static_cast<unsigned char>(b[k]);
    if (n > 0 && n < 8 && (static_cast<unsigned char>(b.back()) & 0x80)) u |= ~uint64_t{0} << (8 * n);  // sign-extend
    return static_cast<int64_t>(u);
  }
  std::string line() {
    const size_t e = d_.find('\n', pos_);
    if (e == std::string::npos) fail("a text opcode's line has no end");
    std::string s = d_.substr(pos_, e - pos_);
    pos_ = e + 1;
    return s;
  }
  int64_t parse_int(const std::string& s) {
    try {
      size_t used = 0;
      const int64_t v = std::stoll(s, &used);
      if (used != s.size()) fail("'" + s + "' is not an integer");
      return v;
    } catch (const std::logic_error&) {
      fail("'" + s + "' is not a 64-bit integer");
    }
  }
  void push(PyRef v) { stack_.push_back(std::move(v)); }
  void need(size_t n) const {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() < floor + n) fail("the pickle's stack underflows");
  }
  PyRef pop() {
    need(1);
    PyRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PyRef& top() {
    need(1);
    return stack_.back();
  }
  std::vector<PyRef> pop_mark() {
    if (marks_.empty()) fail("a pickle opcode needs a MARK that is not there");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> xs(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return xs;
  }
  PyRef memo(int64_t k) {
    auto it = memo_.find(k);
    if (it == memo_.end()) fail("the pickle reads memo entry " + std::to_string(k) + ", which it never wrote");
    return it->second;
  }
  PyRef persistent(const PyRef& pid) {
    if (!persistent_) fail("the pickle refers to outside data (a persistent id) and none is given");
    return persistent_(pid);
  }
  void append(const PyRef& to, const std::vector<PyRef>& xs) {
    if (to->kind != PyValue::Kind::List && to->kind != PyValue::Kind::Set && to->kind != PyValue::Kind::Object)
      fail("APPEND to a " + to->type_name());
    to->items.insert(to->items.end(), xs.begin(), xs.end());
  }
  void set_items(const PyRef& to, const std::vector<PyRef>& xs) {
    if (to->kind != PyValue::Kind::Dict && to->kind != PyValue::Kind::Object) fail("SETITEM on a " + to->type_name());
    if (xs.size() % 2) fail("SETITEMS with an odd number of values");
    for (size_t k = 0; k < xs.size(); k += 2) {
      bool replaced = false;
      if (xs[k]->kind == PyValue::Kind::Str)
        for (auto& [key, v] : to->dict)
          if (key->kind == PyValue::Kind::Str && key->s == xs[k]->s) v = xs[k + 1], replaced = true;
      if (!replaced) to->dict.emplace_back(xs[k], xs[k + 1]);
    }
  }
  void build(const PyRef& obj, const PyRef& state) {
    if (state->kind == PyValue::Kind::None) return;
    if (obj->kind == PyValue::Kind::Object) {
      // (dict, slots) pairs from __reduce_ex__ keep the dict.
      PyRef s = state;
      if (s->kind == PyValue::Kind::Tuple && s->items.size() == 2 && s->items[0]->kind == PyValue::Kind::Dict) s = s->items[0];
      if (obj->state && obj->state->kind == PyValue::Kind::Dict && s->kind == PyValue::Kind::Dict)
        obj->state->dict.insert(obj->state->dict.end(), s->dict.begin(), s->dict.end());
      else
        obj->state = s;
    } else if (obj->kind == PyValue::Kind::Dict && state->kind == PyValue::Kind::Dict) {
      obj->dict.insert(obj->dict.end(), state->dict.begin(), state->dict.end());
    }
    // A tensor's or parameter's extra state (hooks, Python attributes) is left out.
  }
  const PyValue& arg(const PyRef& args, size_t k, const std::string& fn) const {
    if (args->kind != PyValue::Kind::Tuple || args->items.size() <= k) fail(fn + " is called with too few arguments");
    return *args->items[k];
  }
  std::vector<int64_t> ints(const PyValue& v, const std::string& what) const {
    if (v.kind != PyValue::Kind::Tuple && v.kind != PyValue::Kind::List) fail(what + " is not a tuple of integers");
    std::vector<int64_t> out;
    for (const auto& x : v.items) {
      if (x->kind != PyValue::Kind::Int) fail(what + " is not a tuple of integers");
      out.push_back(x->i);
    }
    return out;
  }
  PyRef reduce(const PyRef& fn, const PyRef& args) {
    const std::string name = fn->kind == PyValue::Kind::Global ? fn->s : std::string();
    if (name == "collections.OrderedDict" || name == "builtins.dict" || name == "__builtin__.dict") {
      auto d = make(PyValue::Kind::Dict);
      if (args->kind == PyValue::Kind::Tuple && !args->items.empty()) {
        const PyValue& pairs = *args->items[0];
        for (const auto& p : pairs.items)
          if (p->items.size() == 2) d->dict.emplace_back(p->items[0], p->items[1]);
        d->dict.insert(d->dict.end(), pairs.dict.begin(), pairs.dict.end());
      }
      return d;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor" || name == "torch._utils._rebuild_tensor_v3") {
      const PyValue& storage = arg(args, 0, name);
      if (storage.kind != PyValue::Kind::Tensor) fail(name + ": its first argument is not a storage");
      const PyValue& off = arg(args, 1, name);
      if (off.kind != PyValue::Kind::Int) fail(name + ": its storage offset is not an integer");
      auto l = std::make_shared<LazyTensor>();
      l->offset = off.i;
      l->size = ints(arg(args, 2, name), name + "'s size");
      l->stride = ints(arg(args, 3, name), name + "'s stride");
      l->where = where_;
      l->dtype = storage.lazy ? storage.lazy->dtype : storage.tensor.scalar_type();
      if (name == "torch._utils._rebuild_tensor_v3") {
        const PyValue& dt = arg(args, 6, name);
        if (dt.kind != PyValue::Kind::Global) fail(name + ": its dtype is not a torch dtype");
        l->dtype = torch_dtype_named(dt.s, where_);
      }
      auto t = make(PyValue::Kind::Tensor);
      if (storage.lazy) {
        l->storage = storage.lazy->storage;
      } else {  // a storage given whole (unpickle's own callers): checked here
        const at::Tensor st = storage.tensor;
        l->storage = [st]() { return st; };
        if (st.scalar_type() == l->dtype) check_view(st.numel(), l->offset, l->size, l->stride, where_);
      }
      t->lazy = std::move(l);
      return t;
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      if (arg(args, 0, name).kind != PyValue::Kind::Tensor) fail(name + ": its data is not a tensor");
      return args->items[0];
    }
    // TorchScript's pickler (torch::pickle_save, torch.jit) tags containers with their types.
    if (name == "torch.jit._pickle.restore_type_tag" || name.rfind("torch.jit._pickle.build_", 0) == 0) {
      if (args->kind != PyValue::Kind::Tuple || args->items.empty()) fail(name + " is called without its value");
      return args->items[0];
    }
    if (name == "_codecs.encode") {
      const PyValue& s = arg(args, 0, name);
      return make_str(latin1_of_utf8(s.s, where_), PyValue::Kind::Bytes);
    }
    if (name == "builtins.set" || name == "builtins.frozenset" || name == "__builtin__.set") {
      auto v = make(PyValue::Kind::Set);
      if (args->kind == PyValue::Kind::Tuple && !args->items.empty()) v->items = args->items[0]->items;
      return v;
    }
    if (name == "copyreg._reconstructor" || name == "copy_reg._reconstructor") {
      auto o = make(PyValue::Kind::Object);
      o->cls = args->kind == PyValue::Kind::Tuple && !args->items.empty() ? args->items[0] : fn;
      return o;
    }
    // Anything else (argparse.Namespace, numpy arrays, enums, torch.device, ...) stays opaque: its
    // class, its arguments, and what BUILD later gives it.
    auto o = make(PyValue::Kind::Object);
    o->cls = fn;
    if (args->kind == PyValue::Kind::Tuple) o->items = args->items;
    return o;
  }

  const std::string& d_;
  const std::string where_;
  const std::function<PyRef(const PyRef&)>& persistent_;
  size_t pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::map<int64_t, PyRef> memo_;
};

}  // namespace

PyRef unpickle(const std::string& data, const std::string& where, const std::function<PyRef(const PyRef&)>& persistent) {
  return Machine(data, where, persistent).run();
}

PyRef load_torch_file(const std::string& path) {
  std::string head(4, '\0');
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw InputError(path, "cannot be opened");
    f.read(head.data(), 4);
    head.resize(static_cast<size_t>(f.gcount()));
  }
  if (head.size() < 4 || head.compare(0, 4, "PK\x03\x04") != 0)
    throw InputError(path, "is not a zip archive: torch.save's legacy format (PyTorch before 1.6, or "
                           "_use_new_zipfile_serialization=False) is not read; load and save it again with a newer PyTorch");
  std::shared_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_shared<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const std::exception& e) {
    throw InputError(path, std::string("cannot be read as a torch.save archive: ") + e.what());
  }
  auto record = [reader, path](const std::string& name) {
    if (!reader->hasRecord(name)) throw InputError(path, "the archive has no " + name + " record");
    try {
      auto [ptr, n] = reader->getRecord(name);
      return std::make_pair(std::make_shared<at::DataPtr>(std::move(ptr)), n);
    } catch (const c10::Error& e) {
      throw InputError(path, "record " + name + " cannot be read: " + e.what_without_backtrace());
    }
  };
  if (reader->hasRecord("byteorder")) {
    auto [p, n] = record("byteorder");
    if (std::string(static_cast<const char*>(p->get()), n) != "little")
      throw InputError(path, "was written on a big-endian machine; Alloy reads little-endian archives only");
  }
  auto [pkl, pkl_n] = record("data.pkl");
  const std::string data(static_cast<const char*>(pkl->get()), pkl_n);
  std::map<std::string, PyRef> storages;  // one per key: views of one storage share it
  const std::string where = path + " (data.pkl)";
  auto persistent = [&](const PyRef& pid) -> PyRef {
    if (pid->kind != PyValue::Kind::Tuple || pid->items.size() < 5 || pid->items[0]->s != "storage" ||
        pid->items[1]->kind != PyValue::Kind::Global || pid->items[4]->kind != PyValue::Kind::Int)
      throw InputError(where, "a persistent id is not a tensor storage ('storage', class, key, location, numel)");
    const std::string key = pid->items[2]->kind == PyValue::Kind::Int ? std::to_string(pid->items[2]->i) : pid->items[2]->s;
    auto it = storages.find(key);
    if (it != storages.end()) return it->second;
    const at::ScalarType dt = storage_dtype(pid->items[1]->s, where);
    const int64_t numel = pid->items[4]->i;
    if (numel < 0) throw InputError(where, "storage data/" + key + " has a negative size");
    if (!reader->hasRecord("data/" + key)) throw InputError(path, "the archive has no data/" + key + " record");
    auto v = make(PyValue::Kind::Tensor);
    auto l = std::make_shared<LazyTensor>();
    l->dtype = dt;
    l->where = path;
    l->size = {numel};
    l->stride = {1};
    // Read when a tensor over it is asked for; the record's memory lives as long as the tensor
    // viewing it (the deleter holds it), and the reader as long as any tensor could ask.
    l->storage = [reader, record, key, dt, numel, path]() {
      auto [ptr, n] = record("data/" + key);
      const auto item = static_cast<int64_t>(at::elementSize(dt));
      if (numel > static_cast<int64_t>(n) / item)
        throw InputError(path, "storage data/" + key + " holds " + std::to_string(n) + " bytes where " + std::to_string(numel) + " " +
                                   std::string(c10::toString(dt)) + " elements need more");
      return at::from_blob(ptr->get(), {numel}, [keep = ptr](void*) {}, at::TensorOptions().dtype(dt));
    };
    v->lazy = std::move(l);
    storages.emplace(key, v);
    return v;
  };
  return unpickle(data, where, persistent);
}

}  // namespace alloy::model
