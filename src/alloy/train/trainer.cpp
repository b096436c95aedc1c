#include "alloy/train/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/model/weights.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/metrics.h"

namespace alloy::train {

void configure_threads(int64_t threads) {
  if (threads <= 0) return;
  at::set_num_threads(static_cast<int>(threads));
  // OpenBLAS keeps its own pool, which at::set_num_threads does not reach.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(static_cast<int>(threads));
}

at::Device parse_device(const std::string& spec) {
  at::Device d(spec);
  if (d.is_cuda() && !at::hasCUDA())
    throw InputError("train.device", "'" + spec + "' asked for, but this LibTorch build has no CUDA or no GPU is visible");
  return d;
}

Trainer::Trainer(Config cfg, TrainOptions opts) : cfg_(std::move(cfg)), opts_(std::move(opts)) {
  cfg_.validate();
  configure_threads(cfg_.train.threads);
  device_ = parse_device(cfg_.train.device);

  auto paths = data::resolve_dataset_paths(cfg_.data.prefix, cfg_.data.valid_prefix);
  auto train_ds = std::make_shared<data::IndexedDataset>(data::IndexedDataset::open(paths.train));
  train_ = std::make_unique<data::TokenWindows>(train_ds, cfg_.model.seq_len, paths.train);
  if (train_->max_token() >= cfg_.model.vocab_size)
    throw InputError(paths.train, "holds token id " + std::to_string(train_->max_token()) +
                                      ", which does not fit model.vocab_size " + std::to_string(cfg_.model.vocab_size));
  if (!paths.valid.empty()) {
    auto valid_ds = std::make_shared<data::IndexedDataset>(data::IndexedDataset::open(paths.valid));
    valid_ = std::make_unique<data::TokenWindows>(valid_ds, cfg_.model.seq_len, paths.valid);
  }
  sampler_ = std::make_unique<data::GlobalBatchSampler>(train_->num_samples(), static_cast<uint64_t>(cfg_.train.seed));

  model_ = model::Transformer::full(cfg_.model, static_cast<uint64_t>(cfg_.train.seed));
  model_->to(device_);
  opt_ = std::make_unique<AdamW>(model_->parameters(), AdamW::from_config(cfg_.train));

  if (!opts_.resume.empty()) {
    std::string dir = resolve_checkpoint(opts_.resume);
    CheckpointState st = read_checkpoint_state(dir);
    load_checkpoint(dir, *model_, opt_.get());
    start_step_ = st.step;
    if (st.consumed_samples != static_cast<uint64_t>(st.step * cfg_.train.global_batch))
      throw InputError(dir + "/state.json", "consumed_samples " + std::to_string(st.consumed_samples) +
                                                " does not match step " + std::to_string(st.step) + " x train.global_batch " +
                                                std::to_string(cfg_.train.global_batch) + ": the global batch changed");
    log_info("resumed from " + dir + " at step " + std::to_string(start_step_));
  } else if (!opts_.init_weights.empty()) {
    std::string file = opts_.init_weights;
    if (!file_exists(file) || std::filesystem::is_directory(file)) file = resolve_checkpoint(file) + "/model.safetensors";
    auto f = model::SafetensorsFile::open(file);
    model::load_weights(*model_, f);
    log_info("initial weights from " + file);
  }
}

at::Tensor Trainer::batch_tensor(const std::vector<uint64_t>& samples) const {
  const auto& src = train_;
  at::Tensor t = at::empty({static_cast<int64_t>(samples.size()), cfg_.model.seq_len + 1}, at::kLong);
  src->gather(samples, t.data_ptr<int64_t>());
  return t.to(device_);
}

double Trainer::validation_loss() {
  if (!valid_ || cfg_.train.eval_batches == 0) return std::nan("");
  at::NoGradGuard ng;
  const int64_t mb = cfg_.train.micro_batch_resolved(), T = cfg_.model.seq_len;
  const uint64_t n = std::min<uint64_t>(valid_->num_samples(), static_cast<uint64_t>(cfg_.train.eval_batches * cfg_.train.global_batch));
  double sum = 0;
  uint64_t tokens = 0;
  for (uint64_t first = 0; first < n; first += static_cast<uint64_t>(mb)) {
    std::vector<uint64_t> idx;
    for (uint64_t i = first; i < std::min<uint64_t>(n, first + static_cast<uint64_t>(mb)); ++i) idx.push_back(i);
    at::Tensor b = at::empty({static_cast<int64_t>(idx.size()), T + 1}, at::kLong);
    valid_->gather(idx, b.data_ptr<int64_t>());
    b = b.to(device_);
    auto logits = model_->forward(b.narrow(1, 0, T));
    sum += model::Transformer::loss_sum(logits, b.narrow(1, 1, T)).item<double>();
    tokens += idx.size() * static_cast<uint64_t>(T);
  }
  return sum / static_cast<double>(tokens);
}

TrainResult Trainer::run() {
  const auto& t = cfg_.train;
  const int64_t T = cfg_.model.seq_len, gb = t.global_batch, mb = t.micro_batch_resolved();
  // Every micro-batch's loss is divided by the tokens of the whole global batch, so the summed
  // gradient is the gradient of the global-batch mean however the batch is cut.
  const double batch_tokens = static_cast<double>(gb * T);

  ensure_writable_dir(cfg_.output.dir);
  write_file_atomic(cfg_.output.dir + "/config.yaml", cfg_.to_yaml());
  Metrics metrics(cfg_.output.dir, cfg_.output.tensorboard, opts_.resume.empty() ? -1 : start_step_);
  if (start_step_ == 0)
    log_info("model " + cfg_.model.arch + ": " + format_count(static_cast<double>(model_->num_parameters())) +
             " parameters; " + std::to_string(train_->num_samples()) + " training samples of " + std::to_string(T) +
             " tokens; device " + device_.str());

  TrainResult result;
  auto params = model_->parameters();
  Progress progress("train", static_cast<uint64_t>(t.steps), opts_.quiet);
  auto run_start = std::chrono::steady_clock::now();
  double last_val = std::nan("");

  for (int64_t step = start_step_; step < t.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    const double lr = lr_at(t, step);
    std::vector<uint64_t> samples = sampler_->global_batch(static_cast<uint64_t>(step), static_cast<uint64_t>(gb));

    double loss_sum = 0;
    for (int64_t first = 0; first < gb; first += mb) {
      std::vector<uint64_t> micro(samples.begin() + first, samples.begin() + first + mb);
      at::Tensor b = batch_tensor(micro);
      at::Tensor logits = model_->forward(b.narrow(1, 0, T));
      at::Tensor ls = model::Transformer::loss_sum(logits, b.narrow(1, 1, T));
      (ls / batch_tokens).backward();
      loss_sum += ls.item<double>();
    }
    const double grad_norm = clip_grad_norm(params, t.grad_clip);
    opt_->step(lr);
    opt_->zero_grad();

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepRecord rec{step + 1, loss_sum / batch_tokens, lr, grad_norm, step_s, batch_tokens / step_s};
    result.steps.push_back(rec);
    nlohmann::json j = {{"step", rec.step},         {"loss", rec.loss},     {"lr", rec.lr},
                        {"grad_norm", rec.grad_norm}, {"step_s", rec.step_s}, {"tokens_per_s", rec.tokens_per_s}};

    const bool last = step + 1 == t.steps;
    if (valid_ && ((t.eval_interval > 0 && rec.step % t.eval_interval == 0) || last)) {
      last_val = validation_loss();
      j["val_loss"] = last_val;
      result.val_loss.emplace_back(rec.step, last_val);
    }
    metrics.log(j);

    std::ostringstream extra;
    extra.precision(4);
    extra << "loss " << rec.loss;
    if (!std::isnan(last_val)) extra << " val " << last_val;
    extra << " | " << format_count(rec.tokens_per_s) << " tok/s";
    if (opts_.quiet) {
    } else if (stderr_is_tty()) {
      progress.update(static_cast<uint64_t>(rec.step), extra.str());
    } else if (rec.step % t.log_interval == 0 || last) {
      log_info("step " + std::to_string(rec.step) + "/" + std::to_string(t.steps) + " " + extra.str() + " | lr " +
               std::to_string(lr));
    }

    if ((t.checkpoint_interval > 0 && rec.step % t.checkpoint_interval == 0) || last) {
      CheckpointState st{rec.step, static_cast<uint64_t>(rec.step * gb), opt_->steps_taken(), cfg_};
      result.checkpoint = save_checkpoint(cfg_.output.dir, st, *model_, opt_.get());
    }
  }
  if (!opts_.quiet && stderr_is_tty()) progress.finish();
  double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (!opts_.quiet && !result.steps.empty())
    log_info("trained " + std::to_string(result.steps.size()) + " steps in " + format_duration(total_s) +
             (result.checkpoint.empty() ? "" : "; checkpoint " + result.checkpoint));
  return result;
}

}  // namespace alloy::train
