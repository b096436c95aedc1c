// One-device training step time of Alloy (forward + backward + clip + AdamW + zero_grad) on random
// token batches. Prints one JSON line in the same shape as bench/pytorch_train_step.py so
// bench/train_step_vs_pytorch.sh can put the two side by side.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "alloy/core/process.h"
#include "alloy/model/transformer.h"
#include "alloy/train/optimizer.h"
#include "alloy/train/trainer.h"

int main(int argc, char** argv) {
  alloy::prefer_passive_openmp_waits(argv);  // as the alloy binary does
  alloy::tune_allocator_for_training();
  std::map<std::string, std::string> a = {{"arch", "gpt2"}, {"layers", "4"},  {"hidden", "256"}, {"heads", "4"},
                                          {"kv-heads", "0"}, {"ffn", "0"},    {"seq-len", "128"}, {"vocab", "257"},
                                          {"batch", "8"},    {"steps", "10"}, {"warmup", "3"},    {"threads", "1"},
                                          {"lr", "3e-4"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0 || !a.count(k.substr(2))) {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
    a[k.substr(2)] = argv[i + 1];
  }
  alloy::ModelConfig m;
  m.arch = a["arch"];
  m.layers = std::stoll(a["layers"]);
  m.hidden = std::stoll(a["hidden"]);
  m.heads = std::stoll(a["heads"]);
  m.kv_heads = std::stoll(a["kv-heads"]);
  m.ffn = std::stoll(a["ffn"]);
  m.seq_len = std::stoll(a["seq-len"]);
  m.vocab_size = std::stoll(a["vocab"]);
  const int64_t B = std::stoll(a["batch"]), steps = std::stoll(a["steps"]), warmup = std::stoll(a["warmup"]);
  const double lr = std::stod(a["lr"]);
  alloy::train::configure_threads(std::stoll(a["threads"]));

  auto model = alloy::model::Transformer::full(m, 1);
  auto params = model->parameters();
  alloy::train::AdamW opt(params, {0.9, 0.95, 1e-8, 0.1});
  auto gen = at::detail::createCPUGenerator(0);
  std::vector<double> times, tf, tb, to;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    at::Tensor tok = at::randint(m.vocab_size, {B, m.seq_len + 1}, gen, at::kLong);
    auto t0 = std::chrono::steady_clock::now();
    auto logits = model->forward(tok.narrow(1, 0, m.seq_len));
    auto loss = alloy::model::Transformer::loss_sum(logits, tok.narrow(1, 1, m.seq_len)) / static_cast<double>(B * m.seq_len);
    auto t1 = std::chrono::steady_clock::now();
    loss.backward();
    auto t2 = std::chrono::steady_clock::now();
    alloy::train::clip_grad_norm(params, 1.0);
    opt.step(lr);
    opt.zero_grad();
    auto t3 = std::chrono::steady_clock::now();
    double dt = std::chrono::duration<double>(t3 - t0).count();
    if (s >= warmup) {
      times.push_back(dt);
      tf.push_back(std::chrono::duration<double>(t1 - t0).count());
      tb.push_back(std::chrono::duration<double>(t2 - t1).count());
      to.push_back(std::chrono::duration<double>(t3 - t2).count());
    }
  }
  std::sort(times.begin(), times.end());
  double mean = 0;
  for (double t : times) mean += t;
  mean /= static_cast<double>(times.size());
  double median = times[times.size() / 2];
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("{\"impl\":\"alloy\",\"step_s_median\":%.6f,\"step_s_mean\":%.6f,\"steps\":%lld,\"tokens_per_s\":%.1f,"
              "\"forward_s\":%.6f,\"backward_s\":%.6f,\"optimizer_s\":%.6f}\n",
              median, mean, static_cast<long long>(steps), static_cast<double>(B * m.seq_len) / median, med(tf), med(tb), med(to));
  return 0;
}
