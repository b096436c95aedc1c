#include "alloy/dist/compressed_sync.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "alloy/core/error.h"
#include "alloy/core/log.h"

namespace alloy::dist {

using Clock = std::chrono::steady_clock;
using compress::BufferLayout;
using compress::Encoded;
using compress::StepContext;

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b * 0x9e3779b97f4a7c15ULL);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Elementwise maximum of V over the members of COMM.
void max_over(compress::Comm& comm, std::vector<double>& v) {
  at::Tensor t = at::tensor(v, at::kDouble);
  auto all = comm.allgather(t);
  at::Tensor m = all[0];
  for (size_t i = 1; i < all.size(); ++i) m = at::maximum(m, all[i]);
  for (size_t i = 0; i < v.size(); ++i) v[i] = m[static_cast<int64_t>(i)].item<double>();
}

}  // namespace

CompressedSync::CompressedSync(std::vector<model::Param*> params, Topology topo, const GradSyncConfig& cfg, uint64_t set_seed,
                               std::string name)
    : name_(std::move(name)), params_(std::move(params)), topo_(std::move(topo)), cfg_(cfg), set_seed_(set_seed) {
  for (auto* p : params_) {
    if (p->tensor.scalar_type() != at::kFloat)
      throw InputError("grad_sync.compression", "compression needs float32 parameters; '" + p->name + "' is " +
                                                    std::string(c10::toString(p->tensor.scalar_type())) + " (model.dtype)");
    compress::TensorSlot s;
    s.offset = total_;
    s.numel = p->tensor.numel();
    s.shape = p->tensor.sizes().vec();
    slots_.push_back(s);
    total_ += s.numel;
  }
  if (total_ >= (int64_t(1) << 31))
    throw Error("gradient sync set " + name_ + " holds " + std::to_string(total_) + " elements; compressed sync indexes them in 32 bits");
  staging_ = at::zeros({total_}, at::kFloat);
  out_ = at::zeros({total_}, at::kFloat);
  compress::FusionInputs in;
  for (auto& s : slots_) in.numel.push_back(s.numel);
  in.cap_bytes = static_cast<int64_t>(cfg_.bucket_mb * 1024 * 1024);
  fusion_ = compress::plan_fusion(cfg_.fusion, in);
  opts_ = compress::Options::from(cfg_, fusion_.aligned);
  codec_ = compress::make_codec(opts_);
  ready_.assign(params_.size(), 0);
  ready_at_.assign(params_.size(), Clock::time_point{});
  encode_in_hook_ = !topo_.hierarchical() && codec_->encodes_in_hook();
  per_tensor_ = fusion_.compress_ahead || codec_->per_tensor_only();
  cut_buffers();
  threads_ = at::get_num_threads();
  worker_ = std::thread([this] { worker_main(); });
}

CompressedSync::~CompressedSync() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

double CompressedSync::since_origin_us(Clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - origin_).count();
}

void CompressedSync::arm(int64_t step, Clock::time_point origin) {
  std::lock_guard<std::mutex> lk(mu_);
  std::fill(ready_.begin(), ready_.end(), 0);
  step_ = step;
  origin_ = origin;
  armed_at_ = Clock::now();
  stats_ = CompressedSyncStats{};
  hook_stats_ = CompressedSyncStats{};
  error_ = nullptr;
  dense_step_ = step < cfg_.dense_steps;
  cut_buffers();
  armed_ = true;
  phase_ = Phase::Armed;
  cv_.notify_all();
}

void CompressedSync::cut_buffers() {
  const size_t n = slots_.size(), nb = fusion_.starts.size();
  per_tensor_ = fusion_.compress_ahead || codec_->per_tensor_only();
  buffer_of_.assign(n, 0);
  pending_.assign(nb, 0);
  for (size_t b = 0; b < nb; ++b)
    for (size_t i = fusion_.starts[b]; i < fusion_.buffer_of_end(b, n); ++i) buffer_of_[i] = b, ++pending_[b];
  buf_ready_.assign(nb, 0);
  encoded_.assign(n, Encoded{});
  encoded_whole_.assign(nb, Encoded{});
}

BufferLayout CompressedSync::layout_of(size_t b) const {
  const size_t lo = fusion_.starts[b], hi = fusion_.buffer_of_end(b, slots_.size());
  BufferLayout L;
  L.begin = slots_[lo].offset;
  L.numel = slots_[hi - 1].offset + slots_[hi - 1].numel - L.begin;
  L.slots.assign(slots_.begin() + static_cast<long>(lo), slots_.begin() + static_cast<long>(hi));
  if (per_tensor_)
    for (size_t i = lo; i < hi; ++i) L.pieces.emplace_back(slots_[i].offset, slots_[i].numel);
  else
    L.pieces.emplace_back(L.begin, L.numel);
  return L;
}

StepContext CompressedSync::context() const {
  StepContext ctx;
  ctx.step = step_;
  ctx.seed = mix(set_seed_, static_cast<uint64_t>(step_));
  ctx.contributors = topo_.hierarchical() ? topo_.regions : topo_.flat->size();
  return ctx;
}

void CompressedSync::encode_ready(size_t slot) {
  const size_t b = buffer_of_[slot];
  const StepContext ctx = context();
  auto encode = [&](int64_t begin, int64_t numel, const std::vector<compress::TensorSlot>& sl, const std::string& what) {
    auto t0 = Clock::now();
    Encoded e = codec_->encode(staging_, begin, numel, sl, state_, ctx);
    auto t1 = Clock::now();
    hook_stats_.encode_s += seconds(t0, t1);
    hook_stats_.selected += e.selected;
    hook_stats_.spans.push_back({"compress " + what, since_origin_us(t0), seconds(t0, t1) * 1e6});
    return e;
  };
  if (per_tensor_) {
    Encoded e = encode(slots_[slot].offset, slots_[slot].numel, {slots_[slot]}, params_[slot]->name);
    std::lock_guard<std::mutex> lk(mu_);
    encoded_[slot] = std::move(e);
    if (--pending_[b] == 0) buf_ready_[b] = 1;
  } else {
    bool complete;
    {
      std::lock_guard<std::mutex> lk(mu_);
      complete = --pending_[b] == 0;
    }
    if (!complete) return;
    const BufferLayout L = layout_of(b);
    Encoded e = encode(L.begin, L.numel, L.slots, "buffer " + std::to_string(b));
    std::lock_guard<std::mutex> lk(mu_);
    encoded_whole_[b] = std::move(e);
    buf_ready_[b] = 1;
  }
}

void CompressedSync::on_grad_ready(size_t slot, const at::Tensor& incoming) {
  if (!armed_) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ready_[slot]) return;
    ready_at_[slot] = Clock::now();
  }
  at::NoGradGuard ng;
  const model::Param* p = params_[slot];
  at::Tensor dst = staging_.narrow(0, slots_[slot].offset, slots_[slot].numel);
  const at::Tensor& prev = p->tensor.grad();
  if (!incoming.is_cpu()) dst.copy_(prev.defined() ? (prev + incoming).reshape({-1}) : incoming.reshape({-1}));
  else if (prev.defined()) at::add_out(dst, prev.reshape({-1}), incoming.reshape({-1}));
  else dst.copy_(incoming.reshape({-1}));
  if (encode_in_hook_ && !dense_step_) encode_ready(slot);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ready_[slot] = 1;
  }
  cv_.notify_all();
}

void CompressedSync::wait_buffer(size_t b) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return buf_ready_[b] != 0 || stop_; });
  if (stop_) throw Error("gradient sync " + name_ + " stopped");
}

void CompressedSync::wait_ready(size_t i) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return ready_[i] != 0 || stop_; });
  if (stop_) throw Error("gradient sync " + name_ + " stopped");
}

void CompressedSync::worker_main() {
  at::set_num_threads(threads_);  // OpenMP thread counts are per thread: match the training thread
  at::NoGradGuard ng;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || phase_ == Phase::Armed; });
      if (stop_) return;
      phase_ = Phase::Running;
    }
    std::exception_ptr err;
    try {
      run_step();
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      error_ = err;
      phase_ = Phase::Done;
    }
    cv_.notify_all();
  }
}

std::vector<Encoded> CompressedSync::encode_pieces(size_t lo, size_t hi, bool per_tensor, const StepContext& ctx, BufferLayout& L,
                                                   bool wait, CompressedSyncStats& st) {
  std::vector<Encoded> parts;
  auto encode = [&](int64_t begin, int64_t numel, std::vector<compress::TensorSlot> slots, const std::string& what) {
    auto t0 = Clock::now();
    parts.push_back(codec_->encode(staging_, begin, numel, slots, state_, ctx));
    auto t1 = Clock::now();
    st.encode_s += seconds(t0, t1);
    st.selected += parts.back().selected;
    st.spans.push_back({"compress " + what, since_origin_us(t0), std::chrono::duration<double, std::micro>(t1 - t0).count()});
  };
  L.pieces.clear();
  if (per_tensor) {
    for (size_t i = lo; i < hi; ++i) {
      if (wait) wait_ready(i);
      L.pieces.emplace_back(slots_[i].offset, slots_[i].numel);
      encode(slots_[i].offset, slots_[i].numel, {slots_[i]}, params_[i]->name);
    }
  } else {
    if (wait)
      for (size_t i = lo; i < hi; ++i) wait_ready(i);
    L.pieces.emplace_back(L.begin, L.numel);
    encode(L.begin, L.numel, L.slots, "buffer");
  }
  return parts;
}

void CompressedSync::broadcast_wire(at::Tensor& wire) {
  // The region's leader (group rank 0: the lowest rank) sends the wire's size and type, then its
  // bytes; the others do not know either beforehand (sparse sizes vary, non-leaders encode nothing).
  compress::Comm& c = *topo_.region;
  const bool root = c.rank() == 0;
  at::Tensor header = at::zeros({2}, at::kLong);
  if (root) {
    wire = wire.contiguous();
    header[0] = wire.numel() * static_cast<int64_t>(wire.element_size());
    header[1] = static_cast<int64_t>(wire.scalar_type());
  }
  c.broadcast(header, 0);
  const auto dtype = static_cast<at::ScalarType>(header[1].item<int64_t>());
  at::Tensor bytes = root ? wire.view(at::kByte) : at::empty({header[0].item<int64_t>()}, at::kByte);
  c.broadcast(bytes, 0);
  if (!root) wire = bytes.view(dtype);
}

int64_t CompressedSync::wire_bytes() const {
  int64_t total = 0;
  for (const auto* c : {topo_.flat.get(), topo_.region.get(), topo_.leaders.get()})
    if (c) total += c->bytes_sent();
  return total;
}

void CompressedSync::run_dense_step() {
  // The first grad_sync.dense_steps steps sum exactly (Adam measures its second moment on them):
  // per buffer, an all-reduce among all holders, or inside each region, then among the leaders,
  // then the leaders' sum broadcast to their regions.
  const size_t n = slots_.size();
  const int64_t bytes_before = wire_bytes();
  for (size_t b = 0; b < fusion_.starts.size(); ++b) {
    const size_t lo = fusion_.starts[b], hi = fusion_.buffer_of_end(b, n);
    const BufferLayout L = layout_of(b);
    for (size_t i = lo; i < hi; ++i) wait_ready(i);
    auto t0 = Clock::now();
    at::Tensor dense = staging_.narrow(0, L.begin, L.numel);
    if (!topo_.hierarchical()) {
      topo_.flat->allreduce_sum(dense);
    } else {
      if (topo_.region) topo_.region->allreduce_sum(dense);
      if (topo_.leaders) topo_.leaders->allreduce_sum(dense);
      if (topo_.region) topo_.region->broadcast(dense, 0);
    }
    out_.narrow(0, L.begin, L.numel).copy_(dense);
    stats_.spans.push_back({"exact all-reduce " + std::to_string(b), since_origin_us(t0), seconds(t0, Clock::now()) * 1e6});
    if (!topo_.hierarchical() || topo_.leaders) stats_.elements += L.numel, stats_.selected += L.numel;
  }
  stats_.bytes_sent = wire_bytes() - bytes_before;
  stats_.buffers = static_cast<int64_t>(fusion_.starts.size());
}

void CompressedSync::run_step() {
  if (dense_step_) {
    run_dense_step();
    return;
  }
  const StepContext ctx = context();
  const size_t n = slots_.size();
  std::vector<std::pair<double, double>> exchanges;
  const int64_t bytes_before = wire_bytes();
  // Every buffer's receives posted now, at the step's start, where their sizes are known: each
  // exchange then crosses the link once instead of a round trip first (compress/comm.h).
  compress::Comm* exchanging = topo_.hierarchical() ? topo_.leaders.get() : topo_.flat.get();
  if (exchanging) {
    exchanging->cancel_posted();  // a step that failed may have left some
    for (size_t b = 0; b < fusion_.starts.size(); ++b)
      if (const int64_t numel = codec_->gather_numel(layout_of(b), ctx); numel >= 0) exchanging->post_allgather(numel, at::kInt);
  }
  for (size_t b = 0; b < fusion_.starts.size(); ++b) {
    const size_t lo = fusion_.starts[b], hi = fusion_.buffer_of_end(b, n);
    BufferLayout L = layout_of(b);
    if (!topo_.hierarchical() || topo_.leaders) stats_.elements += L.numel;  // encoded here
    const std::string tag = std::to_string(b);
    at::Tensor wire;
    std::vector<Encoded> parts;
    Clock::time_point tx;
    double comm_s = 0;  // every collective of this buffer, for the fusion model
    if (topo_.hierarchical()) {
      for (size_t i = lo; i < hi; ++i) wait_ready(i);
      if (topo_.region) {
        auto t0 = Clock::now();
        at::Tensor dense = staging_.narrow(0, L.begin, L.numel);
        topo_.region->allreduce_sum(dense);
        comm_s += seconds(t0, Clock::now());
        stats_.spans.push_back({"region all-reduce " + tag, since_origin_us(t0), seconds(t0, Clock::now()) * 1e6});
      }
      if (topo_.leaders) {
        parts = encode_pieces(lo, hi, per_tensor_, ctx, L, false, stats_);
        tx = Clock::now();
        wire = codec_->exchange(parts, L, *topo_.leaders, ctx);
      } else {
        tx = Clock::now();
      }
      if (topo_.region) broadcast_wire(wire);
    } else if (encode_in_hook_) {
      wait_buffer(b);
      std::lock_guard<std::mutex> lk(mu_);  // the hooks are done with this buffer; take its encodings
      if (per_tensor_)
        for (size_t i = lo; i < hi; ++i) parts.push_back(std::move(encoded_[i]));
      else
        parts.push_back(std::move(encoded_whole_[b]));
    } else {
      parts = encode_pieces(lo, hi, per_tensor_, ctx, L, true, stats_);
    }
    if (!topo_.hierarchical()) {
      tx = Clock::now();
      wire = codec_->exchange(parts, L, *topo_.flat, ctx);
    }
    auto td = Clock::now();
    stats_.exchange_s += seconds(tx, td);
    comm_s += seconds(tx, td);
    exchanges.emplace_back(static_cast<double>(L.numel), comm_s);
    stats_.spans.push_back({"exchange " + tag, since_origin_us(tx), seconds(tx, td) * 1e6});
    codec_->decode(wire, L, out_, ctx);
    if (!parts.empty()) codec_->after_decode(parts, out_, state_, ctx);
    auto te = Clock::now();
    stats_.decode_s += seconds(td, te);
    stats_.spans.push_back({"decompress " + tag, since_origin_us(td), seconds(td, te) * 1e6});
  }
  stats_.bytes_sent = wire_bytes() - bytes_before;
  stats_.buffers = static_cast<int64_t>(fusion_.starts.size());
  if (exchanging && exchanging->cancel_posted() > 0)
    throw Error("gradient sync " + name_ + ": receives posted for this step's exchanges were not all used (their sizes differed)");
  if (state_.residual.defined()) stats_.residual_sq = at::dot(state_.residual, state_.residual).item<double>();
  // What the measuring fusion strategies learn from this step (the hooks are all done: every
  // buffer was waited for).
  {
    std::lock_guard<std::mutex> lk(mu_);
    ready_s_.assign(n, 0);
    for (size_t i = 0; i < n; ++i) ready_s_[i] = std::max(0.0, seconds(armed_at_, ready_at_[i]));
  }
  double synced = 0;
  for (const auto& s : slots_) synced += static_cast<double>(s.numel);
  encode_s_per_elem_ = (stats_.encode_s + hook_stats_.encode_s) / std::max(1.0, synced);
  decode_s_per_elem_ = stats_.decode_s / std::max(1.0, synced);
  exchanges_ = exchanges;
  // The first compressed step warms up (buffers, the codec's first allocations): it times no cut.
  // With it in, the starting cut's median of two was that slow step, and saf-adaptive left a cut
  // that ran 1.23 s per step for one that ran 1.43 s (30 Mbit/s, DGC 0.01).
  if (steps_run_ > 0 && window_.size() < 64) window_.push_back(seconds(armed_at_, Clock::now()));
  history_.insert(history_.end(), exchanges.begin(), exchanges.end());
  if (history_.size() > 256) history_.erase(history_.begin(), history_.begin() + static_cast<long>(history_.size() - 256));
  ++steps_run_;
  // Measuring strategies re-cut their buffers for the next step from this one's times: after the
  // second step (the first warms up); the adaptive one again after step 5 and every 10 steps.
  const bool due = steps_run_ == 2 || (compress::fusion_retunes(cfg_.fusion) && (steps_run_ == 5 || steps_run_ % 10 == 0));
  if (compress::fusion_measures(cfg_.fusion) && due) retune();
}

void CompressedSync::retune() {
  // alpha + beta * elements from every exchange so far (the last 256): a buffer's measured time
  // also holds any wait for the slowest member, which only ever adds, so the fit follows the lower
  // envelope: alpha the fastest small exchange, beta the cheapest per element among the larger.
  double alpha = 1e-3, beta = 0;
  if (!history_.empty()) {
    std::vector<std::pair<double, double>> h = history_;
    std::sort(h.begin(), h.end());
    const size_t third = std::max<size_t>(1, h.size() / 3);
    alpha = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < third; ++i) alpha = std::min(alpha, h[i].second);
    alpha = std::max(1e-4, std::min(alpha, 0.5 * h.front().second + 1e-4));
    beta = std::numeric_limits<double>::infinity();
    for (size_t i = h.size() / 2; i < h.size(); ++i)
      if (h[i].first > 0) beta = std::min(beta, std::max(0.0, h[i].second - alpha) / h[i].first);
    if (!std::isfinite(beta)) beta = 0;
  }
  std::vector<double> v = ready_s_;
  v.resize(slots_.size(), 0);
  v.push_back(encode_s_per_elem_);
  v.push_back(decode_s_per_elem_);
  v.push_back(alpha);
  v.push_back(beta);
  std::vector<double> w = window_;  // the running cut's median step since the last retune
  std::sort(w.begin(), w.end());
  v.push_back(w.empty() ? 0.0 : w[(w.size() - 1) / 2]);  // the lower median: a slow step only ever adds
  window_.clear();
  // Every member must cut the same buffers: share the measurements (the maximum over members).
  if (!topo_.hierarchical()) {
    max_over(*topo_.flat, v);
  } else {
    if (topo_.region) max_over(*topo_.region, v);
    if (topo_.leaders) max_over(*topo_.leaders, v);
    if (topo_.region) {
      at::Tensor t = at::tensor(v, at::kDouble);
      topo_.region->broadcast(t, 0);
      for (size_t i = 0; i < v.size(); ++i) v[i] = t[static_cast<int64_t>(i)].item<double>();
    }
  }
  const size_t n = slots_.size();
  compress::FusionInputs in;
  for (auto& s : slots_) in.numel.push_back(s.numel);
  in.ready_s.assign(v.begin(), v.begin() + static_cast<long>(n));
  in.encode_s_per_elem = v[n];
  in.decode_s_per_elem = v[n + 1];
  in.alpha_s = v[n + 2];
  in.beta_s_per_byte = v[n + 3];
  in.wire_bytes_per_elem = 1;  // beta is per gradient element of a buffer
  in.cap_bytes = static_cast<int64_t>(cfg_.bucket_mb * 1024 * 1024);
  in.encode_in_hook = encode_in_hook_;
  in.encode_whole = topo_.hierarchical();  // the region's sum exists only once the buffer is complete
  const double running_s = v[n + 4];
  const std::vector<size_t> before = fusion_.starts;
  // A new cut only when the model expects it 5% faster than the running one: measurements of a few
  // steps move by more than that, and a cut that follows them flips back and forth.
  compress::FusionPlan next = compress::plan_fusion(cfg_.fusion, in);
  compress::FusionPlan model = compress::simulate_fusion(next, in) < 0.95 * compress::simulate_fusion(fusion_, in) ? next : fusion_;
  if (!compress::fusion_retunes(cfg_.fusion)) {
    fusion_ = model;  // applied at the next arm()
  } else {
    // The model's cut and one buffer, both timed (fusion.h: choose_measured); 3% beats noise.
    if (running_s > 0) measured_[fusion_.starts] = running_s;
    model.starts = compress::choose_measured({model.starts, {0}}, measured_, fusion_.starts, 0.03);
    fusion_ = model;
  }
  // Every member computed the same buffers; the set's first member says so.
  compress::Comm* first = topo_.hierarchical() ? topo_.leaders.get() : topo_.flat.get();
  if (first && first->rank() == 0 && fusion_.starts != before) {
    std::string sizes;
    for (size_t b = 0; b < fusion_.starts.size(); ++b) {
      int64_t e = 0;
      for (size_t i = fusion_.starts[b]; i < fusion_.buffer_of_end(b, n); ++i) e += slots_[i].numel;
      sizes += (b ? ", " : "") + std::to_string((e * 4 + 512 * 1024) >> 20);
    }
    log_info("gradient sync " + name_ + ": " + cfg_.fusion + " after step " + std::to_string(steps_run_) + ": " +
             std::to_string(fusion_.starts.size()) + " buffers (MiB: " + sizes + "), was " + std::to_string(before.size()) + (running_s > 0 ? " (" + std::to_string(running_s * 1e3) + " ms per step)" : std::string()) +
             "; measured per buffer " + std::to_string(in.alpha_s * 1e3) + " ms + " + std::to_string(in.beta_s_per_byte * 1e9) +
             " ns per element, encode " + std::to_string(in.encode_s_per_elem * 1e9) + " ns per element");
  }
}

CompressedSyncStats CompressedSync::finish() {
  if (!armed_) return {};
  at::NoGradGuard ng;
  std::vector<size_t> late;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // A parameter that took no part in this step's graph: whatever .grad holds (or zero), so every
    // member still contributes and the exchanges stay matched.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      at::Tensor dst = staging_.narrow(0, slots_[i].offset, slots_[i].numel);
      const at::Tensor& g = params_[i]->tensor.grad();
      if (g.defined()) dst.copy_(g.reshape({-1}));
      else dst.zero_();
      ready_at_[i] = Clock::now();
      late.push_back(i);
    }
  }
  for (size_t i : late) {
    if (encode_in_hook_ && !dense_step_) encode_ready(i);
    std::lock_guard<std::mutex> lk(mu_);
    ready_[i] = 1;
  }
  cv_.notify_all();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return phase_ == Phase::Done; });
    phase_ = Phase::Idle;
    armed_ = false;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i]->tensor;
    at::Tensor src = out_.narrow(0, slots_[i].offset, slots_[i].numel).view(p.sizes());
    if (p.grad().defined()) p.mutable_grad().copy_(src);
    else p.mutable_grad() = src.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
  }
  CompressedSyncStats st = stats_;
  st.encode_s += hook_stats_.encode_s;
  st.selected += hook_stats_.selected;
  st.spans.insert(st.spans.end(), hook_stats_.spans.begin(), hook_stats_.spans.end());
  return st;
}

CompressedSyncStats CompressedSync::sync_now(int64_t step) {
  arm(step, Clock::now());
  return finish();  // finish() takes every gradient from .grad
}

}  // namespace alloy::dist
