#include "alloy/dist/sharding.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cmath>

#include "alloy/core/error.h"
#include "alloy/dist/world.h"

namespace alloy::dist {

std::vector<int64_t> shard_bounds(int64_t n, const std::vector<double>& shares) {
  if (shares.empty()) throw Error("shard_bounds: no shares");
  double total = 0;
  for (double s : shares) {
    if (!(s > 0) || !std::isfinite(s)) throw Error("shard_bounds: shares must be positive");
    total += s;
  }
  std::vector<int64_t> b{0};
  double cum = 0;
  for (size_t i = 0; i + 1 < shares.size(); ++i) {
    cum += shares[i];
    b.push_back(std::clamp<int64_t>(std::llround(static_cast<double>(n) * cum / total), b.back(), n));
  }
  b.push_back(n);
  return b;
}

std::vector<model::ParamSlice> slices_in(const std::vector<model::Param*>& params, int64_t lo, int64_t hi) {
  std::vector<model::ParamSlice> out;
  int64_t off = 0;
  for (auto* p : params) {
    const int64_t n = p->tensor.numel();
    const int64_t a = std::max(lo, off), b = std::min(hi, off + n);
    if (a < b) out.push_back({p, a - off, b - a});
    off += n;
  }
  return out;
}

std::vector<double> set_shares(const std::vector<int>& ranks, const std::vector<double>& ratio, int world_size,
                               const std::string& field) {
  if (ratio.empty()) return std::vector<double>(ranks.size(), 1.0);
  if (ratio.size() == ranks.size()) return ratio;
  if (static_cast<int>(ratio.size()) == world_size) {
    std::vector<double> s;
    for (int r : ranks) s.push_back(ratio[static_cast<size_t>(r)]);
    return s;
  }
  std::string rs;
  for (size_t i = 0; i < ranks.size(); ++i) rs += (i ? "," : "") + std::to_string(ranks[i]);
  throw InputError(field, "has " + std::to_string(ratio.size()) + " shares, but the ranks " + rs + " that hold the same layers are " +
                              std::to_string(ranks.size()) + " (give one share per member of each group, or one per rank: " +
                              std::to_string(world_size) + ")");
}

Sharding::Sharding(std::vector<Set> sets) : sets_(std::move(sets)) {
  for (const auto& s : sets_) {
    int64_t n = 0;
    for (auto* p : s.params) n += p->tensor.numel();
    if (s.bounds.size() != static_cast<size_t>(s.group->size()) + 1 || s.bounds.back() != n)
      throw Error("Sharding: the bounds of group " + s.group->name() + " do not cover its " + std::to_string(n) + " elements");
    numel_.push_back(n);
  }
}

int64_t Sharding::gather_bytes_sent() const {
  int64_t b = 0;
  for (size_t k = 0; k < sets_.size(); ++k) {
    const int64_t n = sets_[k].group->size();
    b += (n - 1) * numel_[k] * static_cast<int64_t>(sets_[k].params.front()->tensor.element_size()) / n;
  }
  return b;
}

std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, int>> gather_from_owners(Group& group, const std::vector<int64_t>& bounds,
                                                                                 int64_t lo, at::Tensor& staging) {
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, int>> works;
  const int64_t hi = lo + staging.numel();
  for (int i = 0; i < group.size(); ++i) {
    const int64_t a = std::max(lo, bounds[static_cast<size_t>(i)]), b = std::min(hi, bounds[static_cast<size_t>(i) + 1]);
    if (a >= b) continue;
    at::Tensor part = staging.narrow(0, a - lo, b - a);
    works.emplace_back(group.broadcast(part, i), i);
  }
  return works;
}

void Sharding::gather_params() {
  at::NoGradGuard ng;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, std::string>> works;
  std::vector<at::Tensor> flats(sets_.size());
  for (size_t k = 0; k < sets_.size(); ++k) {
    auto& s = sets_[k];
    at::Tensor& flat = flats[k] = at::empty({numel_[k]}, s.params.front()->tensor.options().device(at::kCPU).requires_grad(false));
    const int me = s.group->rank();
    int64_t at = s.bounds[static_cast<size_t>(me)];  // this rank's updated range into the staging buffer
    for (const auto& sl : slices_in(s.params, at, s.bounds[static_cast<size_t>(me) + 1])) {
      flat.narrow(0, at, sl.numel).copy_(sl.of(sl.p->tensor));
      at += sl.numel;
    }
    for (auto& [w, i] : gather_from_owners(*s.group, s.bounds, 0, flat))
      works.emplace_back(w, "parameter all-gather of group " + s.group->name() + " (shard of member " +
                                std::to_string(s.group->ranks()[static_cast<size_t>(i)]) + ")");
  }
  for (auto& [w, what] : works) wait_work(w, what);
  for (size_t k = 0; k < sets_.size(); ++k) {
    int64_t off = 0;
    for (auto* p : sets_[k].params) {
      const int64_t n = p->tensor.numel();
      p->tensor.reshape({-1}).copy_(flats[k].narrow(0, off, n));
      off += n;
    }
  }
}

}  // namespace alloy::dist
