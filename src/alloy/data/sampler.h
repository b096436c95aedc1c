#pragma once
// Deterministic, resumable sample order. The sample stream is a sequence of epochs, each a seeded
// permutation of [0, num_samples); a training run consumes it global batch by global batch, so
// the position is just "samples consumed" and resuming needs nothing else. Replicas later take
// disjoint slices of each global batch.
#include <cstdint>
#include <vector>

namespace alloy::data {

// A small, fully specified PRNG (splitmix64): the same sequence on every platform and compiler,
// which std::uniform_int_distribution does not promise.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  uint64_t below(uint64_t bound);  // uniform in [0, bound), unbiased

 private:
  uint64_t state_;
};

class GlobalBatchSampler {
 public:
  GlobalBatchSampler(uint64_t num_samples, uint64_t seed, bool shuffle = true);
  uint64_t num_samples() const { return n_; }
  // Sample indices for positions [first, first+count) of the stream (epochs concatenated).
  std::vector<uint64_t> take(uint64_t first, uint64_t count);
  // The global batch of STEP (0-based): positions [step*gb, (step+1)*gb).
  std::vector<uint64_t> global_batch(uint64_t step, uint64_t global_batch) {
    return take(step * global_batch, global_batch);
  }

 private:
  const std::vector<uint64_t>& epoch_order(uint64_t epoch);
  uint64_t n_, seed_;
  bool shuffle_;
  uint64_t cached_epoch_ = UINT64_MAX;
  std::vector<uint64_t> order_;
};

}  // namespace alloy::data
