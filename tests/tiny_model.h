#pragma once
// The small model the LibTorch unit tests build: 3 blocks of 32, 4 heads (LLaMA: 2 key/value
// heads), sequence 16, a 61-token vocabulary. "qwen2" is the llama with biases on q, k and v.
#include <string>

#include "alloy/core/config.h"

namespace alloy::testing {

inline ModelConfig tiny_model(const std::string& arch) {
  ModelConfig c;
  c.arch = arch == "qwen2" ? "llama" : arch;
  c.qkv_bias = arch == "qwen2";
  c.layers = 3;
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = c.arch == "llama" ? 2 : 0;
  c.seq_len = 16;
  c.vocab_size = 61;
  return c;
}

}  // namespace alloy::testing
