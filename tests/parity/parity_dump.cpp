// Writes a random model, a token batch and Alloy's loss and gradients for that batch, in
// HuggingFace names and layouts, so tests/parity/reference.py can check them against an
// independent PyTorch implementation. Usage: parity_dump gpt2|llama|qwen2 float32|float64 OUTDIR
// (qwen2: the llama block with biases on q, k and v, written as HF's Qwen2).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "alloy/core/fs.h"
#include "alloy/model/weights.h"

using namespace alloy;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: parity_dump gpt2|llama|qwen2 float32|float64 OUTDIR\n");
    return 2;
  }
  std::string arch = argv[1], dtype = argv[2], out = argv[3];
  std::filesystem::create_directories(out);
  at::set_num_threads(1);

  ModelConfig m;
  m.arch = arch == "qwen2" ? "llama" : arch;
  m.qkv_bias = arch == "qwen2";
  m.layers = 3;
  m.hidden = 64;
  m.heads = 4;
  m.seq_len = 24;
  m.vocab_size = 97;
  m.dtype = dtype;
  if (m.arch == "llama") {
    m.kv_heads = 2;  // exercise grouped-query attention
    m.ffn = 112;
    m.norm_eps = 1e-6;
  }
  auto model = model::Transformer::full(m, 2024);
  {
    // Biases start at 0 and norms at 1; perturb every parameter so each one's gradient path is
    // exercised with generic values.
    at::NoGradGuard ng;
    auto g = at::detail::createCPUGenerator(99);
    for (auto* p : model->parameters())
      p->tensor.add_(at::empty(p->tensor.sizes(), at::kFloat).normal_(0, 0.05, g).to(p->tensor.scalar_type()));
  }
  auto g = at::detail::createCPUGenerator(7);
  const int64_t B = 3, T = m.seq_len;
  at::Tensor tokens = at::randint(m.vocab_size, {B, T + 1}, g, at::kLong);
  at::Tensor logits = model->forward(tokens.narrow(1, 0, T));
  at::Tensor loss = model::Transformer::loss_sum(logits, tokens.narrow(1, 1, T)) / static_cast<double>(B * T);
  loss.backward();

  model::save_weights(*model, out + "/weights.safetensors");
  model::write_safetensors(out + "/tokens.safetensors", {{"tokens", model::to_blob(tokens)}});
  std::vector<std::pair<std::string, model::TensorBlob>> grads;
  for (auto* p : model->parameters()) grads.emplace_back(p->name, model::to_blob(p->tensor.grad()));
  std::ostringstream ls;
  ls.precision(17);
  ls << loss.item<double>();
  model::write_safetensors(out + "/grads.safetensors", grads, {{"loss", ls.str()}});
  write_file_atomic(out + "/config.json", model::hf_config(m).dump(2));
  std::printf("%s %s: loss %s, %lld parameters\n", arch.c_str(), dtype.c_str(), ls.str().c_str(),
              static_cast<long long>(model->num_parameters()));
  return 0;
}
