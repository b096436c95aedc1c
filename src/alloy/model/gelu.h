#pragma once
// GPT-2's activation, GELU in its tanh form (HF's gelu_new), with the CPU's float32 tensors going
// through hand-written loops (core/gelu_loops.h: about 4x faster than ATen's kernels, with the same
// accuracy) and everything else (CUDA, bf16/fp16, other LibTorch builds' devices) through
// at::gelu(x, "tanh").
#include <ATen/core/Tensor.h>

namespace alloy::model {

at::Tensor gelu_tanh(const at::Tensor& x);

}  // namespace alloy::model
