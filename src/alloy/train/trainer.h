#pragma once
// The training loop, one device. Read Trainer::run top to bottom: sample the global batch, run
// forward/backward per micro-batch, clip, step, log, evaluate, checkpoint.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/data/sampler.h"
#include "alloy/data/windows.h"
#include "alloy/model/transformer.h"
#include "alloy/train/optimizer.h"

namespace alloy::train {

struct TrainOptions {
  std::string resume;         // "" = fresh run; a checkpoint or run directory otherwise
  std::string init_weights;   // safetensors file or checkpoint to start from (fresh optimizer)
  bool quiet = false;         // no progress display (tests)
};

struct StepRecord {
  int64_t step;  // 1-based: the number of optimizer steps completed
  double loss, lr, grad_norm, step_s, tokens_per_s;
};

struct TrainResult {
  std::vector<StepRecord> steps;                      // the steps this invocation ran
  std::vector<std::pair<int64_t, double>> val_loss;   // (step, loss)
  std::string checkpoint;                             // last checkpoint written
};

// Intra-op threads for LibTorch and OpenBLAS; 0 = leave the defaults.
void configure_threads(int64_t threads);
at::Device parse_device(const std::string& spec);

class Trainer {
 public:
  explicit Trainer(Config cfg, TrainOptions opts = {});
  TrainResult run();

  // Mean token loss of the validation set's first eval_batches global batches.
  double validation_loss();
  model::Transformer& model() { return *model_; }

 private:
  at::Tensor batch_tensor(const std::vector<uint64_t>& samples) const;

  Config cfg_;
  TrainOptions opts_;
  at::Device device_{at::kCPU};
  std::unique_ptr<data::TokenWindows> train_, valid_;
  std::unique_ptr<data::GlobalBatchSampler> sampler_;
  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<AdamW> opt_;
  int64_t start_step_ = 0;
};

}  // namespace alloy::train
