#pragma once
// Element-wise loops over float arrays fused by hand for the CPU: one pass over memory where the
// same math as ATen operators takes several. On the CPU these updates are bound by memory traffic,
// not arithmetic: AdamW as eight ATen operators reads and writes about 21 arrays of the model's
// size, the fused loop 7; DGC's accumulation and candidate scan 7, fused 5. Torch-free, so they are
// tested in test_base; the callers split the work across threads.
#include <cstdint>
#include <vector>

namespace alloy {

// AdamW's constants for one step, as torch.optim.AdamW derives them (float on float tensors).
struct AdamWStep {
  float decay_mul = 1;   // 1 - lr * weight_decay (1: no decay)
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.95f, one_minus_beta2 = 0.05f;
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float neg_step_size = 0;  // -lr / (1 - beta1^t)
};

// One AdamW update of N elements in place, each computed as ATen's sequence of operators does
// (torch.optim.AdamW, foreach=False): w *= decay; m = m*b1 + (1-b1)*g; v = v*b2 + (1-b2)*g*g;
// w = w + (-step) * m / (sqrt(v) / bc2 + eps). W, M and V may not alias G.
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s);

// Momentum correction and error feedback (DGC's accumulation) in one pass over N elements:
// v = g + momentum * v, rounded before r += v (never contracted to a fused multiply-add, so the
// bits are the same on every CPU and equal ATen's add(g, mul(v, momentum))).
void dgc_accumulate(const float* g, float* v, float* r, int64_t n, float momentum);
// The same with the candidate scan of DGC's hinted selection: then appends BASE + i to CANDIDATES
// for every i with |r[i]| >= FLOOR, in increasing order.
void dgc_accumulate_scan(const float* g, float* v, float* r, int64_t n, float momentum, float floor, int64_t base,
                         std::vector<int64_t>& candidates);

}  // namespace alloy
