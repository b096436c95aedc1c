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
// The model (simulate_fusion()) follows the sync worker of one rank: buffers are exchanged
// (alpha + beta * wire bytes, which covers every collective of a buffer: in the hierarchical case
// the region's all-reduce and broadcast too) and decoded one after the other, each no earlier than
// it is encoded. Where encoding runs decides when that is:
//   on the autograd thread (flat sync, FusionInputs::encode_in_hook): a tensor is encoded when it
//     is ready (its ready time already includes the earlier tensors' encoding), a fused buffer
//     when its last tensor is;
//   on the worker (PowerSGD; hierarchical sync, which first sums the region): on the same
//     timeline as the exchanges, tensor by tensor as they become ready (compress ahead) or the
//     whole buffer once complete.
// Merging a tensor into the open buffer saves an alpha; closing the buffer lets its exchange start
// before the tensor is ready. The adaptive strategies choose greedily, tensor by tensor, what
// finishes earlier (MG-WFBP's rule, on this model).
#include <cstddef>
#include <cstdint>
#include <map>
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
  bool encode_in_hook = false;    // encoding runs on the autograd thread, not the worker
  bool encode_whole = false;      // buffers are encoded whole after they are complete (hierarchical)
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
// saf-adaptive's second opinion: the model counts an exchange that overlaps the backward as free,
// but where the exchange shares the backward's core (a CPU device) it takes its CPU from the
// backward, and one buffer after the backward can be faster than any overlapping cut. So the cuts
// it may run (the model's best and one buffer) are also timed: each STARTS in CANDIDATES not yet
// in MEASURED (seconds from backward start to the last decode, agreed among members) is tried
// first, in order; then the fastest of every cut measured so far (the starting one included), if
// it beats RUNNING's time by MARGIN (a fraction). Returns the cut to run next.
std::vector<size_t> choose_measured(const std::vector<std::vector<size_t>>& candidates,
                                    const std::map<std::vector<size_t>, double>& measured, const std::vector<size_t>& running,
                                    double margin);
// Fixed buffers of at most CAP_BYTES of fp32 gradient (a tensor larger than the cap stands alone).
std::vector<size_t> fixed_buffers(const std::vector<int64_t>& numel, int64_t cap_bytes);

}  // namespace alloy::dist::compress
