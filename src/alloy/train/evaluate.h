#pragma once
// Inference-side uses of a trained model: the loss on a text file, and sampling text.
#include <cstdint>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/model/transformer.h"

namespace alloy::train {

struct EvalResult {
  double loss = 0;      // mean next-token cross-entropy
  uint64_t tokens = 0;  // predicted tokens
};

// The text's tokens cut into windows starting at 0, T, 2T, ...; each window of T+1 tokens predicts
// its tokens 1..T from 0..T-1; a last window shorter than T+1 tokens is dropped.
EvalResult evaluate_tokens(model::Transformer& m, const std::vector<int32_t>& tokens, int64_t batch = 8);

// Loads weights from a safetensors file or a checkpoint directory into a new full model.
std::unique_ptr<model::Transformer> load_model(const ModelConfig& cfg, const std::string& weights_or_checkpoint);

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = no cut
  uint64_t seed = 1;
};
std::vector<int32_t> generate(model::Transformer& m, std::vector<int32_t> prompt, const SampleOptions& o);

}  // namespace alloy::train
