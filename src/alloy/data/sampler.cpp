#include "alloy/data/sampler.h"

#include <numeric>
#include <stdexcept>

namespace alloy::data {

uint64_t SplitMix64::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t SplitMix64::below(uint64_t bound) {
  // Rejection sampling removes the modulo bias.
  uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t r;
  do r = next();
  while (r >= limit);
  return r % bound;
}

GlobalBatchSampler::GlobalBatchSampler(uint64_t num_samples, uint64_t seed, bool shuffle)
    : n_(num_samples), seed_(seed), shuffle_(shuffle) {
  if (n_ == 0) throw std::invalid_argument("GlobalBatchSampler: the dataset has no samples");
}

const std::vector<uint64_t>& GlobalBatchSampler::epoch_order(uint64_t epoch) {
  if (epoch == cached_epoch_) return order_;
  order_.resize(n_);
  std::iota(order_.begin(), order_.end(), 0);
  if (shuffle_) {
    SplitMix64 rng(seed_ * 0x100000001B3ULL ^ (epoch + 1) * 0xD1B54A32D192ED03ULL);
    for (uint64_t i = n_ - 1; i > 0; --i) std::swap(order_[i], order_[rng.below(i + 1)]);
  }
  cached_epoch_ = epoch;
  return order_;
}

std::vector<uint64_t> GlobalBatchSampler::take(uint64_t first, uint64_t count) {
  std::vector<uint64_t> out;
  out.reserve(count);
  for (uint64_t p = first; p < first + count; ++p) out.push_back(epoch_order(p / n_)[p % n_]);
  return out;
}

}  // namespace alloy::data
