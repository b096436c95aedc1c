// alloy-spm: SentencePiece in a process of its own. Debian's SentencePiece carries its own protobuf
// and crashes a process that also loads LibTorch before main(), so `alloy` (which links LibTorch)
// never loads it: data::make_tokenizer("sentencepiece", ...) starts this helper once and talks to it
// over a pipe. It links SentencePiece and nothing of Alloy.
//
//   alloy-spm MODEL        serve MODEL on stdin/stdout (the protocol below); errors on stderr
//   alloy-spm --version
//
// Protocol, little-endian. On start: "ASPM", u32 version (1), i32 vocab size, i32 eos id, i32 bos
// id, i32 unk id (-1: none). Then per request, one byte:
//   'E' u64 n, n bytes of text   ->  u64 k, k x i32 ids
//   'D' u64 k, k x i32 ids       ->  u64 n, n bytes of text
// and an answer of u64 ~0 followed by u64 n and n bytes of message when a request fails. End of
// input ends the helper.
#include <sentencepiece_processor.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool read_all(void* p, size_t n) { return n == 0 || std::fread(p, 1, n, stdin) == n; }
void write_all(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }
void write_u64(uint64_t v) { write_all(&v, 8); }
void write_i32(int32_t v) { write_all(&v, 4); }
void fail_answer(const std::string& why) {
  write_u64(~uint64_t{0});
  write_u64(why.size());
  write_all(why.data(), why.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::printf("alloy-spm 1 (SentencePiece)\n");
    return 0;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: alloy-spm MODEL   (serves SentencePiece MODEL to alloy over stdin/stdout)\n");
    return 2;
  }
  sentencepiece::SentencePieceProcessor sp;
  const auto st = sp.Load(argv[1]);
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[1], st.ToString().c_str());
    return 3;
  }
  write_all("ASPM", 4);
  write_i32(1);
  write_i32(sp.GetPieceSize());
  write_i32(sp.eos_id());
  write_i32(sp.bos_id());
  write_i32(sp.unk_id());
  std::fflush(stdout);
  std::string text;
  std::vector<int> ids;
  while (true) {
    int op = std::fgetc(stdin);
    if (op == EOF) return 0;
    uint64_t n = 0;
    if (!read_all(&n, 8) || n > (uint64_t{1} << 34)) return 4;
    if (op == 'E') {
      text.resize(n);
      if (!read_all(text.data(), n)) return 4;
      ids.clear();
      const auto s = sp.Encode(text, &ids);
      if (!s.ok()) {
        fail_answer(s.ToString());
      } else {
        write_u64(ids.size());
        for (int id : ids) write_i32(id);
      }
    } else if (op == 'D') {
      ids.resize(n);
      for (auto& id : ids) {
        int32_t v = 0;
        if (!read_all(&v, 4)) return 4;
        id = v;
      }
      text.clear();
      const auto s = sp.Decode(ids, &text);
      if (!s.ok()) {
        fail_answer(s.ToString());
      } else {
        write_u64(text.size());
        write_all(text.data(), text.size());
      }
    } else {
      return 4;
    }
    std::fflush(stdout);
  }
}
