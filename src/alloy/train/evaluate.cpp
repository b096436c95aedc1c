#include "alloy/train/evaluate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <filesystem>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/model/weights.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/finetune.h"

namespace alloy::train {

EvalResult evaluate_tokens(model::Transformer& m, const std::vector<int32_t>& tokens, int64_t batch) {
  at::NoGradGuard ng;
  const int64_t T = m.config().seq_len;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t windows = n >= T + 1 ? (n - 1) / T : 0;
  EvalResult r;
  double sum = 0;
  for (int64_t first = 0; first < windows; first += batch) {
    int64_t b = std::min(batch, windows - first);
    at::Tensor x = at::empty({b, T + 1}, at::kLong);
    auto* p = x.data_ptr<int64_t>();
    for (int64_t w = 0; w < b; ++w)
      for (int64_t j = 0; j <= T; ++j) p[w * (T + 1) + j] = tokens[static_cast<size_t>((first + w) * T + j)];
    x = x.to(m.device());
    auto logits = m.forward(x.narrow(1, 0, T));
    sum += model::Transformer::loss_sum(logits, x.narrow(1, 1, T)).item<double>();
    r.tokens += static_cast<uint64_t>(b * T);
  }
  r.loss = r.tokens ? sum / static_cast<double>(r.tokens) : std::nan("");
  return r;
}

std::unique_ptr<model::Transformer> load_model(const ModelConfig& cfg, const std::string& src) {
  if (std::filesystem::is_directory(src)) {
    std::string dir = resolve_checkpoint(src);
    check_same_model(dir, read_checkpoint_state(dir), cfg);
    return load_checkpoint_model(dir);  // by name, from however many shards wrote it; LoRA's base too
  }
  auto m = model::Transformer::full(cfg, 0);
  {
    auto f = model::SafetensorsFile::open(src);
    model::load_weights(*m, f);
  }
  return m;
}

std::vector<int32_t> generate(model::Transformer& m, std::vector<int32_t> ids, const SampleOptions& o) {
  at::NoGradGuard ng;
  const int64_t T = m.config().seq_len;
  auto gen = at::detail::createCPUGenerator(o.seed);
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - T);
    std::vector<int64_t> ctx(ids.begin() + start, ids.end());
    at::Tensor x = at::tensor(ctx, at::kLong).unsqueeze(0).to(m.device());
    at::Tensor logits = m.forward(x).select(1, x.size(1) - 1).squeeze(0).to(at::kCPU, at::kDouble);
    int64_t next;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / o.temperature;
      if (o.top_k > 0 && o.top_k < logits.size(0)) {
        auto kth = std::get<0>(logits.topk(o.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
      }
      next = at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    ids.push_back(static_cast<int32_t>(next));
  }
  return ids;
}

}  // namespace alloy::train
