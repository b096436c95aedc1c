#include "alloy/dist/zero3.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>

#include "alloy/core/error.h"
#include "alloy/dist/sharding.h"
#include "alloy/dist/world.h"

namespace alloy::dist {

namespace {
int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }
}  // namespace

Zero3::Zero3(model::Transformer& model, std::vector<Set> sets) : model_(model), sets_(std::move(sets)) {
  at::NoGradGuard ng;
  for (size_t k = 0; k < sets_.size(); ++k) {
    Set& s = sets_[k];
    int64_t off = 0;
    for (auto* p : s.params) {
      if (!p->tensor.is_contiguous() || p->tensor.storage_offset() != 0 ||
          p->tensor.storage().nbytes() != static_cast<size_t>(bytes_of(p->tensor)))
        throw Error("ZeRO-3: parameter '" + p->name + "' does not own its storage alone; it cannot be freed between uses");
      where_[p] = {k, off};
      off += p->tensor.numel();
    }
    const size_t me = static_cast<size_t>(s.group->rank());
    if (s.bounds.size() != static_cast<size_t>(s.group->size()) + 1 || s.bounds.back() != off)
      throw Error("ZeRO-3: the bounds of group " + s.group->name() + " do not cover its " + std::to_string(off) + " elements");
    if (s.values.numel() != s.bounds[me + 1] - s.bounds[me] || s.grads.numel() != s.values.numel())
      throw Error("ZeRO-3: the shard of group " + s.group->name() + " does not match this rank's range");
    int64_t at = 0;
    for (const auto& sl : slices_in(s.params, s.bounds[me], s.bounds[me + 1])) {
      s.values.narrow(0, at, sl.numel).copy_(sl.of(sl.p->tensor));
      at += sl.numel;
    }
  }
  // Each layer's sharded parameters and their intervals of the sets' flat orders, merged where
  // adjacent (a block is one interval; a tied GPT-2 head two: ln_f and wte).
  for (size_t i = 0; i < model_.num_layers(); ++i) {
    Unit u;
    std::vector<Range> iv;
    for (auto* p : model_.layer_params(i)) {
      auto it = where_.find(p);
      if (it == where_.end()) continue;
      u.params.push_back(p);
      iv.push_back({it->second.first, it->second.second, it->second.second + p->tensor.numel()});
    }
    std::sort(iv.begin(), iv.end(), [](const Range& a, const Range& b) { return a.set != b.set ? a.set < b.set : a.lo < b.lo; });
    for (const auto& r : iv) {
      if (!u.ranges.empty() && u.ranges.back().set == r.set && u.ranges.back().hi == r.lo)
        u.ranges.back().hi = r.hi;
      else
        u.ranges.push_back(r);
    }
    units_.push_back(std::move(u));
  }
  for (auto& [p, _] : where_) free_param(p);
  resident_bytes_ = 0;
}

Zero3::~Zero3() {
  // Pending gathers write into staging buffers that die with this object.
  for (auto& u : units_)
    for (auto& w : u.works) w->wait();
}

void Zero3::free_param(model::Param* p) { resident_bytes_ -= release_storage(p->tensor); }

void Zero3::start_gather(size_t ui) {
  Unit& u = units_[ui];
  at::NoGradGuard ng;
  for (const auto& r : u.ranges) {
    Set& s = sets_[r.set];
    const int me = s.group->rank(), n = s.group->size();
    // Gloo moves host memory: the gather is staged on the CPU whatever the parameters' device.
    at::Tensor st = at::empty({r.hi - r.lo}, s.values.options().device(at::kCPU));
    const int64_t a = std::max(r.lo, s.bounds[static_cast<size_t>(me)]), b = std::min(r.hi, s.bounds[static_cast<size_t>(me) + 1]);
    if (a < b) st.narrow(0, a - r.lo, b - a).copy_(s.values.narrow(0, a - s.bounds[static_cast<size_t>(me)], b - a));
    for (auto& [w, root] : gather_from_owners(*s.group, s.bounds, r.lo, st)) u.works.push_back(w);
    bytes_sent_ += (n - 1) * bytes_of(st) / n;
    u.staging.push_back(st);
  }
  u.state = State::Gathering;
}

void Zero3::finish_gather(size_t ui) {
  Unit& u = units_[ui];
  for (auto& w : u.works) wait_work(w, "ZeRO-3 parameter all-gather of layer " + std::to_string(ui) + " of this stage");
  u.works.clear();
  at::NoGradGuard ng;
  for (auto* p : u.params) {
    if (refs_[p]++ > 0) continue;  // resident already (a tied weight another gathered layer holds)
    const auto [k, off] = where_.at(p);
    for (size_t r = 0; r < u.ranges.size(); ++r) {
      const Range& rg = u.ranges[r];
      if (rg.set == k && off >= rg.lo && off < rg.hi)
        resident_bytes_ += restore_storage(p->tensor, u.staging[r].narrow(0, off - rg.lo, p->tensor.numel()));
    }
    if (!pinned_) peak_gathered_bytes_ = std::max(peak_gathered_bytes_, resident_bytes_);
  }
  u.staging.clear();
  u.state = State::Ready;
}

void Zero3::ensure_ready(size_t ui) {
  if (units_[ui].state == State::Free) start_gather(ui);
  if (units_[ui].state == State::Gathering) finish_gather(ui);
}

void Zero3::release(size_t ui) {
  Unit& u = units_[ui];
  if (u.state == State::Gathering) finish_gather(ui);
  if (u.state == State::Free) return;
  for (auto* p : u.params)
    if (--refs_[p] == 0) free_param(p);
  u.state = State::Free;
}

void Zero3::before_forward(size_t i) {
  if (pinned_ || units_[i].params.empty()) return;
  ensure_ready(i);
  if (i + 1 < units_.size() && !units_[i + 1].params.empty() && units_[i + 1].state == State::Free) start_gather(i + 1);
}

void Zero3::after_forward(size_t i) {
  if (!pinned_) release(i);
}

void Zero3::before_backward(size_t i) {
  if (pinned_ || units_[i].params.empty()) return;
  ensure_ready(i);
  if (i > 0 && !units_[i - 1].params.empty() && units_[i - 1].state == State::Free) start_gather(i - 1);
}

void Zero3::after_backward(size_t i) {
  if (pinned_) return;
  release(i);
  if (drop_grads_ && drop_grads_())
    for (auto& p : model_.layer(i).params())  // its own: a tied wte's gradient is not complete yet
      if (where_.count(&p) && p.tensor.grad().defined()) p.tensor.mutable_grad().reset();
}

void Zero3::end_step() {
  if (pinned_) return;
  for (size_t i = 0; i < units_.size(); ++i) release(i);
}

void Zero3::pin_all() {
  pinned_ = true;  // the layer hooks idle, and the training steps' peak is not this one's
  for (size_t i = 0; i < units_.size(); ++i)
    if (!units_[i].params.empty() && units_[i].state == State::Free) start_gather(i);
  for (size_t i = 0; i < units_.size(); ++i)
    if (!units_[i].params.empty()) ensure_ready(i);
}

void Zero3::unpin_all() {
  pinned_ = false;
  end_step();
}

int64_t Zero3::shard_bytes() const {
  int64_t b = 0;
  for (const auto& s : sets_) b += bytes_of(s.values);
  return b;
}

int64_t Zero3::grad_shard_bytes() const {
  int64_t b = 0;
  for (const auto& s : sets_) b += bytes_of(s.grads);
  return b;
}

int64_t Zero3::take_bytes_sent() {
  const int64_t b = bytes_sent_;
  bytes_sent_ = 0;
  return b;
}

}  // namespace alloy::dist
