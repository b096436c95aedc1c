#pragma once
// GPT-2's GELU (the tanh form, HF's gelu_new) and its derivative as hand-written CPU loops.
// ATen's CPU kernels for gelu(approximate="tanh") evaluate tanh through a general-purpose vector
// math library and spend about 3 ns per element forward and 5.5 backward on one core, 9% of a
// small GPT-2's training step; these loops take a fraction of that (bench: tests/ measure only
// accuracy, bench/README.md the time).
//
// The same function rewritten without tanh:
//   0.5 x (1 + tanh(u)) = x * sigmoid(2u) = x / (1 + exp(-2u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
// which also avoids the cancellation of 1 + tanh(u) for negative u. exp is a Cody-Waite range
// reduction and a degree-7 polynomial (Cephes' expf, about 1 ulp), its argument clamped to
// [-87, 87] so that every intermediate stays a normal float.
//
// Only IEEE additions, multiplications and divisions, never contracted into fused multiply-adds
// (-ffp-contract=off on this file): each element's bits are the same on every x86-64 CPU, in the
// AVX2 and the SSE2 build of the loop, and whatever the array's length or alignment (a tensor split
// by columns across tensor-parallel members gets the same values as the whole).
#include <cstdint>

namespace alloy {

// y[i] = gelu_tanh(x[i]). Y may be X (in place), not otherwise overlap it.
void gelu_tanh_forward(const float* x, float* y, int64_t n);
// dx[i] = dy[i] * gelu_tanh'(x[i]). DX may be DY or X, not otherwise overlap them.
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n);

// The same loops built for the compiler's baseline (SSE2 on x86-64), never the AVX2 build the two
// above pick where the CPU has it: for the test that both builds give the same bits.
void gelu_tanh_forward_baseline(const float* x, float* y, int64_t n);
void gelu_tanh_backward_baseline(const float* x, const float* dy, float* dx, int64_t n);

}  // namespace alloy
