// Fuzz target: GPT-2 vocabulary files (encoder.json + vocab.bpe, data::make_tokenizer("gpt2", DIR),
// data.vocab_dir / ALLOY_GPT2_VOCAB_DIR) and the text a tokenizer then encodes (`alloy data
// prepare` reads any file). Input: encoder.json, the part separator, vocab.bpe, the separator,
// text. Checks the tokenizer's documented promises: any byte string encodes to ids below
// vocab_size and decodes back to itself; the pre-tokenizer's pieces concatenate to the text.
#include "alloy/data/tokenizer.h"
#include "fuzz_util.h"

using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = alloy_fuzz::split_parts(alloy_fuzz::as_view(data, size), 3);
  const std::string& text = parts[2];
  std::string joined;
  for (auto piece : alloy::data::gpt2_pretokenize(text)) joined += piece;
  FUZZ_CHECK(joined == text, "pre-tokenizer pieces do not concatenate to the text");

  auto& dir = alloy_fuzz::TempDir::get();
  dir.write("encoder.json", parts[0]);
  dir.write("vocab.bpe", parts[1]);
  std::unique_ptr<alloy::data::Tokenizer> tok;
  try {
    tok = alloy::data::make_tokenizer("gpt2", dir.path());
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
    return 0;
  }
  FUZZ_CHECK(tok->eot_id() >= 0 && tok->eot_id() < tok->vocab_size(), "eot id");
  const std::vector<int32_t> ids = tok->encode(text);
  for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tok->vocab_size(), "id " + std::to_string(id));
  FUZZ_CHECK(tok->decode(ids) == text, "decode(encode(text)) != text");
  FUZZ_CHECK(tok->encode(text) == ids, "encoding twice differs (cache)");
  FUZZ_CHECK(tok->decode({tok->eot_id()}) == "<|endoftext|>", "eot decodes to something else");
  return 0;
}
