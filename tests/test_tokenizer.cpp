// Tokenizer tests. Expected GPT-2 ids come from the gpt-3-encoder npm package (a port of
// OpenAI's encoder), not from memory; tests/tokenizer_vs_js.sh compares whole corpora.
#include "alloy/data/tokenizer.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "temp_dir.h"

using alloy::testing::TempDir;

namespace {

using alloy::data::make_tokenizer;
using alloy::data::Tokenizer;
using Ids = std::vector<int32_t>;

std::string all_bytes() {
  std::string s;
  for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  return s;
}

// Text chosen to hit each branch of the GPT-2 pre-tokenizer and the byte-level fallback.
std::vector<std::string> tricky_texts() {
  return {
      "",
      "a",
      " ",
      "Hello world",
      "I can't, won't, shouldn't've; they're, we've, I'm, you'll, he'd. IT'S 'S 'quoted'",
      "''''' '' 's 't ' s",
      "0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000 0x1F ½ Ⅻ ٣٤ 𝟘",
      "naïve café résumé Ünïcödé 東京 日本語 한국어 العربية עברית Ελληνικά русский",
      "emoji 😀👍🏽👨‍👩‍👧 flags 🇩🇪 combining e\u0301 zero\u200bwidth soft\u00adhyphen",
      "   leading spaces",
      "trailing spaces   ",
      "a  b   c    d",
      "\n",
      "\n\n\n",
      "line one\nline two\r\nline three\n\n\nafter blank lines\n",
      "\ttab\t\tdouble tab \t mixed \n\t\n",
      "nbsp\u00a0here em\u2003space ideo\u3000space line\u2028sep para\u2029sep",
      "ASCII art: +--------+ |  ()  | ======== ~~~~ ____ ....",
      "def f(x):\n    return x**2  # comment\n\n\nclass A:\n\tpass\n",
      "<|endoftext|> is plain text here",
      "control\x01\x02\x1b[0m\x7f chars",
      std::string("nul\0inside", 10),
  };
}

// Byte strings that are not valid UTF-8: each must still survive encode/decode unchanged.
std::vector<std::string> invalid_utf8_texts() {
  return {
      "\xff",
      "abc\xff\xfe def",
      "\xc0\x80 overlong NUL",
      "\xe0\x80\xaf overlong slash",
      "\xed\xa0\x80 surrogate",
      "\xf4\x90\x80\x80 beyond U+10FFFF",
      "truncated \xe6\x9d",
      "truncated at end \xf0\x9f\x98",
      "\x80\x80 stray continuation bytes",
      "mixed \xce\xb1\xff\xce\xb2 valid and invalid",
      all_bytes(),
  };
}

// ---------------------------------------------------------------------------------------------
// Byte tokenizer

TEST(ByteTokenizer, Properties) {
  auto tok = make_tokenizer("byte");
  EXPECT_EQ(tok->name(), "byte");
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->eot_id(), 256);
}

TEST(ByteTokenizer, IdsAreBytes) {
  auto tok = make_tokenizer("byte");
  EXPECT_EQ(tok->encode("Hi\n"), (Ids{72, 105, 10}));
  EXPECT_EQ(tok->encode("\xc3\xa9"), (Ids{0xC3, 0xA9}));
  const Ids ids = tok->encode(all_bytes());
  ASSERT_EQ(ids.size(), 256u);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(ids[i], i);
}

TEST(ByteTokenizer, RoundTrips) {
  auto tok = make_tokenizer("byte");
  for (const auto& t : tricky_texts()) EXPECT_EQ(tok->decode(tok->encode(t)), t);
  for (const auto& t : invalid_utf8_texts()) EXPECT_EQ(tok->decode(tok->encode(t)), t);
}

TEST(ByteTokenizer, IgnoresVocabDir) {
  EXPECT_NO_THROW(make_tokenizer("byte", "/nonexistent/dir"));
}

TEST(ByteTokenizer, DecodeEotAndOutOfRange) {
  auto tok = make_tokenizer("byte");
  EXPECT_EQ(tok->decode({104, 256, 105}), "h<|endoftext|>i");
  EXPECT_THROW(tok->decode({257}), alloy::Error);
  EXPECT_THROW(tok->decode({-1}), alloy::Error);
}

// ---------------------------------------------------------------------------------------------
// Factory errors

TEST(MakeTokenizer, UnknownKind) {
  try {
    make_tokenizer("wordpiece");
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), "tokenizer");
    EXPECT_NE(std::string(e.what()).find("wordpiece"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sentencepiece"), std::string::npos) << e.what();  // the kinds there are
  }
}

// SentencePiece needs its model file; asked without one, the error names the key to set.
TEST(MakeTokenizer, SentencePieceNeedsItsModel) {
  try {
    make_tokenizer("sentencepiece");
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), "data.tokenizer_model");
  }
}

TEST(MakeTokenizer, MissingVocabDirNamesItAndTheFix) {
  const std::string dir = "/nonexistent/alloy-gpt2-vocab";
  try {
    make_tokenizer("gpt2", dir);
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), dir);
    EXPECT_NE(std::string(e.what()).find("fetch-gpt2-vocab.sh"), std::string::npos) << e.what();
  }
}

// Builds a tiny but complete vocabulary: the 256 byte tokens in GPT-2's byte alphabet (printable
// ASCII bytes stand for themselves, which is all these tests use), then the given merges.
std::string tiny_encoder_json(const std::vector<std::string>& extra) {
  std::string json = "{";
  int id = 0;
  auto add = [&](const std::string& sym) {
    if (id) json += ",";
    json += "\"" + sym + "\": " + std::to_string(id++);
  };
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int cp = printable ? b : next++;
    std::string sym;
    if (cp < 0x80) {
      if (cp == '"' || cp == '\\') sym.push_back('\\');
      sym.push_back(static_cast<char>(cp));
    } else {
      sym.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      sym.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    add(sym);
  }
  for (const auto& s : extra) add(s);
  add("<|endoftext|>");
  return json + "}";
}

TEST(MakeTokenizer, MissingVocabBpeNamesTheFile) {
  TempDir dir;
  alloy::write_file_atomic(dir.file("encoder.json"), tiny_encoder_json({}));
  try {
    make_tokenizer("gpt2", dir.path());
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), dir.file("vocab.bpe"));
    EXPECT_NE(std::string(e.what()).find("fetch-gpt2-vocab.sh"), std::string::npos) << e.what();
  }
}

TEST(MakeTokenizer, CorruptEncoderJsonNamesTheFile) {
  TempDir dir;
  alloy::write_file_atomic(dir.file("encoder.json"), "{\"a\": 0,");
  alloy::write_file_atomic(dir.file("vocab.bpe"), "#version: 0.2\na b\n");
  try {
    make_tokenizer("gpt2", dir.path());
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), dir.file("encoder.json"));
  }
}

TEST(MakeTokenizer, CorruptVocabBpeNamesFileAndLine) {
  TempDir dir;
  alloy::write_file_atomic(dir.file("encoder.json"), tiny_encoder_json({"ab"}));
  alloy::write_file_atomic(dir.file("vocab.bpe"), "#version: 0.2\na b\nb c\n");  // "bc" unknown
  try {
    make_tokenizer("gpt2", dir.path());
    FAIL() << "expected InputError";
  } catch (const alloy::InputError& e) {
    EXPECT_EQ(e.where(), dir.file("vocab.bpe"));
    EXPECT_NE(std::string(e.what()).find("line 3"), std::string::npos) << e.what();
  }
}

TEST(MakeTokenizer, MergesOutOfTrainingOrderAreRejected) {
  TempDir dir;
  alloy::write_file_atomic(dir.file("encoder.json"), tiny_encoder_json({"ab", "abc"}));
  alloy::write_file_atomic(dir.file("vocab.bpe"), "#version: 0.2\nab c\na b\n");
  EXPECT_THROW(make_tokenizer("gpt2", dir.path()), alloy::InputError);
}

TEST(MakeTokenizer, TinyVocabularyMergesByRank) {
  TempDir dir;
  alloy::write_file_atomic(dir.file("encoder.json"), tiny_encoder_json({"ab", "bc", "abc"}));
  // "b c" outranks "a b", so "abc" splits as a|bc, and "ab c" never fires on it.
  alloy::write_file_atomic(dir.file("vocab.bpe"), "#version: 0.2\nb c\na b\nab c\n");
  auto tok = make_tokenizer("gpt2", dir.path());
  EXPECT_EQ(tok->vocab_size(), 260);
  EXPECT_EQ(tok->eot_id(), 259);
  EXPECT_EQ(tok->encode("abc"), (Ids{'a', 257}));
  EXPECT_EQ(tok->encode("abd"), (Ids{256, 'd'}));
  EXPECT_EQ(tok->encode("ababab"), (Ids{256, 256, 256}));
  EXPECT_EQ(tok->decode({'a', 257, 259}), "abc<|endoftext|>");
}

TEST(DefaultVocabDir, EnvironmentWins) {
  const char* old = std::getenv("ALLOY_GPT2_VOCAB_DIR");
  const std::string saved = old ? old : "";
  ::setenv("ALLOY_GPT2_VOCAB_DIR", "/some/where", 1);
  EXPECT_EQ(alloy::data::default_gpt2_vocab_dir(), "/some/where");
  if (old) ::setenv("ALLOY_GPT2_VOCAB_DIR", saved.c_str(), 1);
  else ::unsetenv("ALLOY_GPT2_VOCAB_DIR");
}

// ---------------------------------------------------------------------------------------------
// GPT-2 pre-tokenizer (expected splits from Python's `regex` module with OpenAI's pattern)

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : alloy::data::gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}
using Strs = std::vector<std::string>;

TEST(Gpt2Pretokenize, MatchesOpenAIRegex) {
  EXPECT_EQ(pieces(""), Strs{});
  EXPECT_EQ(pieces("Hello world's  end\n\n"),
            (Strs{"Hello", " world", "'s", " ", " end", "\n\n"}));
  EXPECT_EQ(pieces("a  b\n c"), (Strs{"a", " ", " b", "\n", " c"}));
  EXPECT_EQ(pieces("it'S x'll ?'s"), (Strs{"it", "'", "S", " x", "'ll", " ?'", "s"}));
  EXPECT_EQ(pieces("  "), (Strs{"  "}));
  EXPECT_EQ(pieces(" \n\tx"), (Strs{" \n", "\t", "x"}));
  EXPECT_EQ(pieces("abc123 45!!  ?"), (Strs{"abc", "123", " 45", "!!", " ", " ?"}));
  EXPECT_EQ(pieces("東京 ٣٤ ½"), (Strs{"東京", " ٣٤", " ½"}));
}

TEST(Gpt2Pretokenize, InvalidBytesArePunctuation) {
  EXPECT_EQ(pieces("ab\xff\xfe cd"), (Strs{"ab", "\xff\xfe", " cd"}));
  EXPECT_EQ(pieces(" \x80x"), (Strs{" \x80", "x"}));
}

TEST(Gpt2Pretokenize, PiecesTileTheInput) {
  for (const auto& t : tricky_texts()) {
    std::string joined;
    for (const auto& p : pieces(t)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, t);
  }
}

// ---------------------------------------------------------------------------------------------
// GPT-2 BPE with the real vocabulary. These fail rather than skip without it: a silently skipped
// tokenizer test would hide a broken data pipeline.

class Gpt2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    try {
      tok_ = make_tokenizer("gpt2").release();
    } catch (const std::exception& e) {
      load_error_ = e.what();
    }
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(tok_, nullptr) << "GPT-2 tests need encoder.json and vocab.bpe: " << load_error_
                             << "\nRun scripts/fetch-gpt2-vocab.sh to install them.";
  }
  static const Tokenizer* tok_;
  static std::string load_error_;
};
const Tokenizer* Gpt2Test::tok_ = nullptr;
std::string Gpt2Test::load_error_;

TEST_F(Gpt2Test, Properties) {
  EXPECT_EQ(tok_->name(), "gpt2");
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->eot_id(), 50256);
  EXPECT_EQ(tok_->decode({50256}), "<|endoftext|>");
}

TEST_F(Gpt2Test, KnownIdsFromReferenceEncoder) {
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"Hello world", {15496, 995}},
      {" Hello, world!", {18435, 11, 995, 0}},
      {"I cannot believe it's not butter.", {40, 2314, 1975, 340, 338, 407, 9215, 13}},
      {"They're here, we've seen it, I'm sure she'll say he'd go.",
       {2990, 821, 994, 11, 356, 1053, 1775, 340, 11, 314, 1101, 1654, 673, 1183, 910, 339, 1549,
        467, 13}},
      {"  leading\n\ntrailing  ", {220, 3756, 198, 198, 9535, 4386, 220, 220}},
      {"naïve café 東京 😀", {2616, 38776, 40304, 10545, 251, 109, 12859, 105, 30325, 222}},
      {"1234567 3.14159", {10163, 2231, 3134, 513, 13, 1415, 19707}},
      {"<|endoftext|>", {27, 91, 437, 1659, 5239, 91, 29}},
      {"def f(x):\n    return x**2\n",
       {4299, 277, 7, 87, 2599, 198, 220, 220, 220, 1441, 2124, 1174, 17, 198}},
      {"\t\ttabs\r\nCRLF", {197, 197, 8658, 82, 201, 198, 34, 7836, 37}},
      {"¡Hola! ¿Qué tal? Ünïcödé",
       {126, 94, 39, 5708, 0, 1587, 123, 4507, 2634, 3305, 30, 49363, 77, 26884, 66, 9101, 67,
        2634}},
      {"The year 2024: 100% (or ½) done…",
       {464, 614, 48609, 25, 1802, 4, 357, 273, 25208, 8, 1760, 1399}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok_->encode(text), ids) << "text: " << text;
}

TEST_F(Gpt2Test, RoundTripsTrickyText) {
  for (const auto& t : tricky_texts()) EXPECT_EQ(tok_->decode(tok_->encode(t)), t) << t;
}

TEST_F(Gpt2Test, RoundTripsInvalidUtf8) {
  for (const auto& t : invalid_utf8_texts()) EXPECT_EQ(tok_->decode(tok_->encode(t)), t);
}

TEST_F(Gpt2Test, RoundTripsRandomBytes) {
  std::mt19937 rng(1234);
  for (int n = 0; n < 200; ++n) {
    std::string s(static_cast<size_t>(rng() % 300), '\0');
    for (auto& c : s) c = static_cast<char>(rng() % 256);
    ASSERT_EQ(tok_->decode(tok_->encode(s)), s);
  }
}

TEST_F(Gpt2Test, SameResultWithWarmCache) {
  const std::string text = tricky_texts()[5] + tricky_texts()[7];
  const Ids first = tok_->encode(text);
  EXPECT_EQ(tok_->encode(text), first);
}

TEST_F(Gpt2Test, LongPiecesStayFast) {
  // One 1 MB pre-token (a punctuation run) would be quadratic in a naive BPE loop.
  std::string s;
  const char* punct = "!#$%&()*+,-./:;<=>?@[]^_`{|}~";
  std::mt19937 rng(7);
  for (int i = 0; i < (1 << 20); ++i) s.push_back(punct[rng() % 29]);
  const auto t0 = std::chrono::steady_clock::now();
  const Ids ids = tok_->encode(s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(tok_->decode(ids), s);
  EXPECT_LT(secs, 10.0);
  const std::string spaces(100000, ' ');
  EXPECT_EQ(tok_->decode(tok_->encode(spaces + "x" + spaces)), spaces + "x" + spaces);
}

TEST_F(Gpt2Test, ConcurrentEncodeAgrees) {
  std::string text;
  for (const auto& t : tricky_texts()) text += t + "\n";
  const Ids expected = tok_->encode(text);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k) got[i] = tok_->encode(text);
    });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, expected);
}

TEST_F(Gpt2Test, DecodeRejectsOutOfRange) {
  EXPECT_THROW(tok_->decode({50257}), alloy::Error);
  EXPECT_THROW(tok_->decode({-1}), alloy::Error);
}

}  // namespace
