#pragma once
// Fusion: which consecutive gradients (backward order) travel in one exchange, and whether each
// is compressed on its own before joining its buffer (compress ahead) or the fused buffer is
// compressed as one tensor. The strategies SAFusion compares, as Alloy runs them:
//
//   tensor        no fusion: every tensor compressed and exchanged alone (many small messages)
//   bucket        WFBP / DDP: fixed buffers of grad_sync.bucket_mb of gradient, fused then
//                 compressed as one tensor (what a DDP communication hook sees)
//   omgs          OMGS / MG-WFBP: buffers merged by a link model (alpha + beta * bytes) against the
//                 measured ready times, fused then compressed; chosen once, after the first steps
//   cupcake       fuse then compress, with the one buffer size (of a ladder of sizes) that the same
//                 model predicts fastest; chosen once
//   saf           sparsification ahead of fusion: each tensor compressed as soon as it is ready,
//                 the results fused in fixed buffers; sizes exchanged (threshold methods vary)
//   saf-inter     saf with aligned fusion: every member sends exactly k per tensor, no sizes
//   saf-adaptive  saf-inter with buffers adapted to the measured backward, compression and
//                 exchange times, re-tuned during training (SAF-(Inter+Intra))
//
// The model (simulate()) follows the sync worker of one rank: one timeline on which tensors are
// encoded (no earlier than they are ready) and buffers exchanged (alpha + beta * wire bytes) and
// decoded, one after the other. Merging a tensor into the open buffer saves an alpha; closing the
// buffer lets its exchange start before the tensor is ready. The adaptive strategies choose
// greedily, tensor by tensor, what finishes earlier (MG-WFBP's rule, on this model).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace alloy::dist::compress {

struct FusionInputs {
  std::vector<int64_t> numel;     // per tensor, in backward order
  std::vector<double> ready_s;    // per tensor: seconds after the last backward starts (empty: unknown)
  double encode_s_per_elem = 0;   // compression cost on this device
  double decode_s_per_elem = 0;
  double alpha_s = 1e-3;          // per exchange
  double beta_s_per_byte = 0;     // per wire byte
  double wire_bytes_per_elem = 4; // what one gradient element costs on the wire after compression
  int64_t cap_bytes = 25 << 20;   // fixed buffers: fp32 gradient bytes per buffer
};

struct FusionPlan {
  std::vector<size_t> starts;  // first tensor of each buffer, ascending, starts[0] == 0
  bool compress_ahead = false;
  bool aligned = false;
  std::string strategy;
  size_t buffer_of_end(size_t b, size_t n) const { return b + 1 < starts.size() ? starts[b + 1] : n; }
};

// Whether a strategy adapts its buffers to measurements (then: once, or again and again).
bool fusion_measures(const std::string& strategy);
bool fusion_retunes(const std::string& strategy);

// Buffers for STRATEGY. Without ready times the measuring strategies start from fixed buffers.
FusionPlan plan_fusion(const std::string& strategy, const FusionInputs& in);
// Finish time of the last exchange under the model above.
double simulate_fusion(const FusionPlan& plan, const FusionInputs& in);
// Fixed buffers of at most CAP_BYTES of fp32 gradient (a tensor larger than the cap stands alone).
std::vector<size_t> fixed_buffers(const std::vector<int64_t>& numel, int64_t cap_bytes);

}  // namespace alloy::dist::compress
