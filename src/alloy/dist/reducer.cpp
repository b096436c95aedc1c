#include "alloy/dist/reducer.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>

#include "alloy/core/error.h"
#include "alloy/dist/world.h"

namespace alloy::dist {

struct Reducer::Bucket {
  std::shared_ptr<Group> group;
  std::vector<model::Param*> params;
  std::vector<int64_t> offsets;
  std::vector<bool> ready;
  size_t pending = 0;
  at::Tensor flat;
  int64_t begin = 0;             // the bucket's first element in the group's flat order
  std::vector<int64_t> reduce_to;  // ZeRO-2 owners' bounds (empty: all-reduce)
  at::Tensor grad_shard;           // ZeRO-3: this rank's reduced range lands here
  int64_t numel = 0;
  at::TensorOptions options;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  bool launched = false;
  Bucket* next_in_group = nullptr;  // the group's buckets launch in this order (below)
  bool waits_for_previous = false;  // set while the bucket before it in the group has not launched
};

Reducer::Reducer(std::vector<ParamGroup> groups, double bucket_mb) {
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  for (auto& pg : groups) {
    if (pg.compressed) {
      compressed_.push_back(pg.compressed);
      CompressedSync* cs = pg.compressed.get();
      for (size_t s = 0; s < pg.params.size(); ++s)
        pg.params[s]->tensor.register_hook([cs, s](const at::Tensor& g) { cs->on_grad_ready(s, g); });
      continue;
    }
    if (!pg.group || pg.params.empty()) continue;
    const size_t group_first = buckets_.size();
    std::unique_ptr<Bucket> cur;
    int64_t cur_bytes = 0, group_offset = 0;
    auto close = [&]() {
      if (!cur) return;
      int64_t n = 0;
      for (auto* p : cur->params) {
        cur->offsets.push_back(n);
        n += p->tensor.numel();
      }
      cur->begin = group_offset;
      cur->reduce_to = pg.reduce_to;
      cur->grad_shard = pg.grad_shard;
      group_offset += n;
      // Gloo reduces host memory: the bucket lives on the CPU whatever the parameters' device,
      // and CUDA gradients are copied in and out of it. A group of CUDA ranks all-reduces through
      // NCCL (dist/nccl.h): its buckets stay on the device.
      cur->numel = n;
      const at::Device& dev = cur->params[0]->tensor.device();
      const bool on_device = dev.is_cuda() && pg.group->device_collectives() && pg.reduce_to.empty();
      cur->options = cur->params[0]->tensor.options().device(on_device ? dev : at::Device(at::kCPU)).requires_grad(false);
      if (!cur->grad_shard.defined()) cur->flat = at::zeros({n}, cur->options);
      cur->ready.assign(cur->params.size(), false);
      buckets_.push_back(std::move(cur));
      cur_bytes = 0;
    };
    for (auto* p : pg.params) {
      int64_t bytes = p->tensor.numel() * static_cast<int64_t>(p->tensor.element_size());
      if (cur && (cur_bytes + bytes > cap || cur->params[0]->tensor.scalar_type() != p->tensor.scalar_type())) close();
      if (!cur) {
        cur = std::make_unique<Bucket>();
        cur->group = pg.group;
      }
      cur->params.push_back(p);
      cur_bytes += bytes;
    }
    close();
    for (size_t b = group_first; b + 1 < buckets_.size(); ++b) buckets_[b]->next_in_group = buckets_[b + 1].get();
  }
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t s = 0; s < buckets_[b]->params.size(); ++s)
      buckets_[b]->params[s]->tensor.register_hook([this, b, s](const at::Tensor& g) { on_grad_ready(b, s, g); });
}

Reducer::~Reducer() = default;

void Reducer::begin_step(int64_t step, std::chrono::steady_clock::time_point origin) {
  step_ = step;
  origin_ = origin;
}

void Reducer::arm() {
  armed_ = true;
  for (auto& c : compressed_) c->arm(step_, origin_);
  for (auto& b : buckets_) {
    b->pending = b->params.size();
    b->ready.assign(b->params.size(), false);
    b->launched = false;
    b->works.clear();
  }
  // Every holder launches a group's buckets in the same order, whatever order its gradients come
  // ready in: two stages sharing a floating unit and the tied embedding have them ready in
  // opposite orders, and collectives on one group pair up in the order they are issued.
  for (auto& b : buckets_)
    if (b->next_in_group) b->next_in_group->waits_for_previous = true;
}

void Reducer::on_grad_ready(size_t bi, size_t slot, const at::Tensor& incoming) {
  if (!armed_) return;
  Bucket& b = *buckets_[bi];
  if (b.ready[slot]) return;
  at::NoGradGuard ng;
  model::Param* p = b.params[slot];
  // The hook sees this micro-batch's gradient before it is accumulated; earlier micro-batches'
  // share is already in .grad.
  at::Tensor slice = flat_of(b).narrow(0, b.offsets[slot], p->tensor.numel());
  const at::Tensor& prev = p->tensor.grad();
  if (!incoming.is_cpu())
    slice.copy_(prev.defined() ? (prev + incoming).reshape({-1}) : incoming.reshape({-1}));
  else if (prev.defined())
    at::add_out(slice, prev.reshape({-1}), incoming.reshape({-1}));
  else
    slice.copy_(incoming.reshape({-1}));
  b.ready[slot] = true;
  if (--b.pending == 0 && !b.waits_for_previous) launch(b);
}

at::Tensor& Reducer::flat_of(Bucket& b) {
  if (!b.flat.defined()) b.flat = at::empty({b.numel}, b.options);  // every slot is written before the launch
  return b.flat;
}

void Reducer::launch(Bucket& b) {
  launch_one(b);
  // The group's next buckets that were complete and waited for this one.
  for (Bucket* n = b.next_in_group; n; n = n->next_in_group) {
    n->waits_for_previous = false;
    if (n->pending != 0) break;
    launch_one(*n);
  }
}

void Reducer::launch_one(Bucket& b) {
  b.launched = true;
  b.works.clear();
  if (b.reduce_to.empty()) {
    b.works.push_back(b.group->allreduce_sum(b.flat));
    return;
  }
  // A reduce-scatter in one reduce per owner whose range the bucket touches, in member order on
  // every rank (the collectives must match).
  const int64_t end = b.begin + b.flat.numel();
  for (int i = 0; i + 1 < static_cast<int>(b.reduce_to.size()); ++i) {
    const int64_t lo = std::max(b.begin, b.reduce_to[static_cast<size_t>(i)]);
    const int64_t hi = std::min(end, b.reduce_to[static_cast<size_t>(i) + 1]);
    if (lo >= hi) continue;
    at::Tensor part = b.flat.narrow(0, lo - b.begin, hi - lo);
    b.works.push_back(b.group->reduce_sum(part, i));
  }
}

void Reducer::reduce_all_now() {
  at::NoGradGuard ng;
  for (auto& c : compressed_) c->arm(step_, origin_);  // finish() takes their gradients from .grad
  for (auto& b : buckets_) {
    for (size_t s = 0; s < b->params.size(); ++s) {
      const at::Tensor& g = b->params[s]->tensor.grad();
      at::Tensor slice = flat_of(*b).narrow(0, b->offsets[s], b->params[s]->tensor.numel());
      if (g.defined()) slice.copy_(g.reshape({-1}));
      else slice.zero_();
    }
    launch_one(*b);
  }
  armed_ = true;
}

ReducerStats Reducer::finish() {
  ReducerStats st;
  if (!armed_) return st;
  at::NoGradGuard ng;
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_) {
    if (!b->launched) {
      // A parameter that took no part in this step's graph: its gradient is whatever .grad holds
      // (or zero), so every holder still contributes and the collective stays matched.
      for (size_t s = 0; s < b->params.size(); ++s) {
        if (b->ready[s]) continue;
        at::Tensor slice = flat_of(*b).narrow(0, b->offsets[s], b->params[s]->tensor.numel());
        const at::Tensor& g = b->params[s]->tensor.grad();
        if (g.defined()) slice.copy_(g.reshape({-1}));
        else slice.zero_();
      }
      launch_one(*b);
    }
  }
  for (auto& b : buckets_) {
    for (auto& w : b->works)
      wait_work(w, std::string(b->reduce_to.empty() ? "gradient all-reduce" : "gradient reduce-scatter") + " in group " +
                       b->group->name());
    // NCCL's wait only orders the stream; reading one element makes the host wait for the sum, so
    // the sync's wait is measured here (ranks.json, the trace) and not in the next host read.
    if (b->flat.defined() && b->flat.is_cuda()) (void)b->flat[0].item<double>();
    const int64_t bytes = b->flat.numel() * static_cast<int64_t>(b->flat.element_size());
    if (b->grad_shard.defined()) {
      // ZeRO-3: keep this rank's range of the sum; the full gradients and the buffer go.
      const int me = b->group->rank();
      const int64_t lo = b->reduce_to[static_cast<size_t>(me)], hi = b->reduce_to[static_cast<size_t>(me) + 1];
      const int64_t a = std::max(lo, b->begin), e = std::min(hi, b->begin + b->numel);
      if (a < e) b->grad_shard.narrow(0, a - lo, e - a).copy_(b->flat.narrow(0, a - b->begin, e - a));
      for (auto* p : b->params) p->tensor.mutable_grad().reset();
      b->flat = at::Tensor();
    } else {
      for (size_t s = 0; s < b->params.size(); ++s) {
        at::Tensor& p = b->params[s]->tensor;
        at::Tensor slice = b->flat.narrow(0, b->offsets[s], p.numel()).view(p.sizes());
        if (p.grad().defined()) p.mutable_grad().copy_(slice);
        else p.mutable_grad() = slice.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
    const int64_t n = b->group->size();
    st.bytes += bytes;
    // A ring all-reduce sends 2(n-1)/n of the bucket; its reduce-scatter half, (n-1)/n; a tree's
    // member its stripe's slice once over each of that stripe's tree edges.
    if (const auto* trees = b->group->sum_trees(); trees && b->reduce_to.empty()) {
      for (const SyncTree& t : *trees) st.bytes_sent += t.degree(b->group->rank()) * bytes / static_cast<int64_t>(trees->size());
    } else
      st.bytes_sent += (b->reduce_to.empty() ? 2 : 1) * (n - 1) * bytes / n;
  }
  for (auto& c : compressed_) {
    CompressedSyncStats cs = c->finish();
    auto& t = st.compressed;
    t.bytes_sent += cs.bytes_sent;
    t.elements += cs.elements;
    t.selected += cs.selected;
    t.encode_s += cs.encode_s;
    t.exchange_s += cs.exchange_s;
    t.decode_s += cs.decode_s;
    t.residual_sq += cs.residual_sq;
    t.buffers += cs.buffers;
    t.spans.insert(t.spans.end(), cs.spans.begin(), cs.spans.end());
  }
  st.buckets = static_cast<int64_t>(buckets_.size());
  st.wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  armed_ = false;
  return st;
}

}  // namespace alloy::dist
