#include "alloy/pipeline/executor.h"

#include "alloy/model/lora.h"

#include "alloy/model/precision.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <deque>

#include "alloy/core/error.h"
#include "alloy/dist/pipe_channels.h"
#include "alloy/dist/reducer.h"
#include "alloy/dist/world.h"

namespace alloy::pipeline {

namespace {
using Clock = std::chrono::steady_clock;
enum Kind : int { kActHeader = 0, kActData = 1, kGradHeader = 2, kGradData = 3 };
// KEY (a virtual stage, interleaved pipelines only) above the micro-batch: 2^20 micro-batches a step.
int tag_of(int64_t mb, int kind, int64_t key) {
  if (mb >= (int64_t{1} << 20) || key >= 256) throw Error("pipeline executor: micro-batch " + std::to_string(mb) + " or virtual stage " +
                                                           std::to_string(key) + " is beyond what a message tag carries");
  return static_cast<int>((key << 22) + mb * 4 + kind);
}
const char* kind_text(int kind) { return kind <= kActData ? "activation" : "gradient"; }
}  // namespace

StageExecutor::StageExecutor(model::Transformer& slice, StageLinks links) : slice_(slice), links_(links) {}

void StageExecutor::record(const std::string& name, const char* stream, Clock::time_point t0) {
  if (!tracing) return;
  auto now = Clock::now();
  trace_.push_back({name, stream, std::chrono::duration<double, std::micro>(t0 - origin_).count(),
                    std::chrono::duration<double, std::micro>(now - t0).count()});
}

void StageExecutor::sample_memory() {
  peak_bytes_ = std::max(peak_bytes_, memory_in_use(slice_.device()) - base_bytes_);
  peak_in_flight_ = std::max(peak_in_flight_, in_flight_);
}

dist::PipeChannel* StageExecutor::channel(bool sending, int peer, int kind, int64_t key) const {
  if (!links_.channels) return nullptr;
  const int64_t stream = dist::stream_of(kind >= kGradHeader, key);
  return sending ? links_.channels->to(peer, stream) : links_.channels->from(peer, stream);
}

void StageExecutor::send_tensor(int dst, int64_t mb, int kind, const at::Tensor& t, int64_t key) {
  dist::PipeChannel* ch = channel(true, dst, kind, key);
  // Gloo moves host memory: over the world's group, activations of a CUDA stage travel through a
  // CPU copy; a channel carries them on its own device (NCCL: the GPU's, no copy).
  const at::Device where = ch ? links_.channels->message_device() : at::Device(at::kCPU);
  at::Tensor data = t.detach().to(where).contiguous();
  at::Tensor header = at::tensor({static_cast<int64_t>(data.dim()), data.size(0), data.size(1), data.size(2),
                                  static_cast<int64_t>(data.scalar_type()), mb},
                                 at::kLong);
  // To a GPU from pinned memory without waiting: a pageable copy would hold the host until the
  // stream's queued compute ran.
  if (where.is_cuda()) header = header.pin_memory().to(where, /*non_blocking=*/true);
  if (ch) {  // the header first: the receiver checks the step's headers before the optimizer runs
    sends_.emplace_back(ch->send(header), header);
    sends_.emplace_back(ch->send(data), data);
    return;
  }
  sends_.emplace_back(links_.group->send(header, dst, tag_of(mb, kind, key)), header);
  sends_.emplace_back(links_.group->send(data, dst, tag_of(mb, kind + 1, key)), data);
}

void StageExecutor::send_to(const std::vector<int>& targets, int fallback, int64_t mb, int kind, const at::Tensor& t, int64_t key) {
  if (targets.empty()) return send_tensor(fallback, mb, kind, t, key);
  for (int dst : targets)
    if (dst >= 0) send_tensor(dst, mb, kind, t, key);
}

StageExecutor::PostedRecv StageExecutor::post_recv(int src, int64_t mb, int kind, at::IntArrayRef shape, at::ScalarType dtype, int64_t key) {
  PostedRecv r;
  r.src = src, r.mb = mb, r.kind = kind, r.key = key;
  r.channel = channel(false, src, kind, key);
  const at::Device where = r.channel ? links_.channels->message_device() : at::Device(at::kCPU);
  r.header = at::empty({6}, at::TensorOptions().dtype(at::kLong).device(where));
  r.data = at::empty(shape, at::TensorOptions().dtype(dtype).device(where));
  // Both receives are posted together: one round trip, and the header is checked after. The
  // group matches them by tag. A channel's are posted when the message is needed (finish_recv):
  // NCCL needs no ready notice, and receives waiting on the GPU ahead of time would stall
  // anything that synchronizes the device (an allocator retry, a communicator's set-up).
  if (!r.channel) {
    r.wh = links_.group->recv(r.header, src, tag_of(mb, kind, key));
    r.wd = links_.group->recv(r.data, src, tag_of(mb, kind + 1, key));
  }
  return r;
}

namespace {
// Why header H does not describe the message expected ("" when it does).
std::string header_mismatch(const int64_t* h, at::IntArrayRef shape, at::ScalarType dtype, int64_t mb) {
  if (h[0] == 3 && h[1] == shape[0] && h[2] == shape[1] && h[3] == shape[2] && h[4] == static_cast<int64_t>(dtype) && h[5] == mb)
    return "";
  return "got shape [" + std::to_string(h[1]) + ", " + std::to_string(h[2]) + ", " + std::to_string(h[3]) + "] dtype " +
         c10::toString(static_cast<at::ScalarType>(h[4])) + " for micro-batch " + std::to_string(h[5]) + ", expected [" +
         std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " + std::to_string(shape[2]) + "] " + c10::toString(dtype);
}
}  // namespace

at::Tensor StageExecutor::finish_recv(PostedRecv& r, at::IntArrayRef shape, at::ScalarType dtype) {
  std::string what = std::string("receiving the ") + kind_text(r.kind) + " of micro-batch " + std::to_string(r.mb) +
                     " from rank " + std::to_string(r.src);
  if (r.channel) {
    r.wh = r.channel->recv(r.header);
    r.wd = r.channel->recv(r.data);
    dist::wait_work(r.wh, what);
    dist::wait_work(r.wd, what);
    // Read on the host once per step (check_channel_headers): reading it now would hold the
    // host until the stream's queued compute ran.
    unchecked_.push_back({r.header, std::vector<int64_t>(shape.begin(), shape.end()), dtype, r.mb, what});
  } else {
    dist::wait_work(r.wh, what);
    if (const std::string bad = header_mismatch(r.header.data_ptr<int64_t>(), shape, dtype, r.mb); !bad.empty())
      throw Error(what + ": " + bad + ": the two stages disagree on the plan");
    dist::wait_work(r.wd, what);
  }
  for (int dst : links_.relay) send_tensor(dst, r.mb, r.kind, r.data, r.key);
  return r.data.to(slice_.device());  // the first parameter may live quantized (LoRA base)
}

void StageExecutor::check_channel_headers() {
  if (unchecked_.empty()) return;
  std::vector<at::Tensor> headers;
  for (const auto& u : unchecked_) headers.push_back(u.header);
  const at::Tensor all = at::stack(headers).to(at::kCPU);  // one wait for the step's messages
  auto pending = std::move(unchecked_);
  unchecked_.clear();
  for (size_t i = 0; i < pending.size(); ++i)
    if (const std::string bad = header_mismatch(all[static_cast<int64_t>(i)].data_ptr<int64_t>(), pending[i].shape, pending[i].dtype,
                                                pending[i].mb);
        !bad.empty())
      throw Error(pending[i].what + ": " + bad +
                  ": a device-to-device channel delivers in the order sent, and the two ranks' schedules disagree on it");
}

at::Tensor StageExecutor::recv_tensor(int src, int64_t mb, int kind, at::IntArrayRef shape, at::ScalarType dtype, int64_t key) {
  PostedRecv r = post_recv(src, mb, kind, shape, dtype, key);
  return finish_recv(r, shape, dtype);
}

void StageExecutor::wait_sends() {
  for (auto& [w, t] : sends_) dist::wait_work(w, "sending to a neighbouring stage");
  sends_.clear();
}

double StageExecutor::run(const std::vector<Action>& actions, const std::vector<MicroBatch>& mbs, double loss_divisor,
                          dist::Reducer* reducer) {
  const auto& cfg = slice_.config();
  const int64_t T = cfg.seq_len, H = cfg.hidden;
  const at::ScalarType dt = slice_.dtype();
  const size_t last_bwd = last_backward_index(actions);
  size_t last_weight = actions.size();
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].kind == ActionKind::BackwardWeight) last_weight = i;
  const bool split = last_weight < actions.size();
  // Records a micro-batch's projections for its weight pass, around its forward (a recomputed
  // block's projections are made again in the backward) and its backward.
  auto defer = [&](int64_t m) { return std::make_unique<model::DeferredWeightGrads::Scope>(split ? &deferred_ : nullptr, m); };
  deferred_.clear();
  // By (chunk, micro-batch): chunk V's micro-batch M at V x M_all + M.
  const int64_t num_mbs = static_cast<int64_t>(mbs.size());
  state_.assign(mbs.size() * static_cast<size_t>(num_chunks()), InFlight{});
  trace_.clear();
  base_bytes_ = memory_in_use(slice_.device());
  peak_bytes_ = peak_in_flight_ = in_flight_ = 0;
  compute_s_ = 0;
  double loss_sum = 0;

  // Receives in the order the actions consume them; a sliding window of them stays posted. Every
  // message a stage receives is [rows, T, width]: activations from the previous stage (in_width),
  // and gradients of this (non-last) stage's output from the next (out_width).
  std::vector<size_t> recv_actions;
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].kind == ActionKind::RecvActivation || actions[i].kind == ActionKind::RecvGrad) recv_actions.push_back(i);
  std::deque<PostedRecv> posted;
  size_t next_post = 0;
  auto shape_of = [&](int64_t m, bool act) {
    const int64_t w = act ? in_width : out_width;
    return std::vector<int64_t>{mbs[static_cast<size_t>(m)].rows, T, w > 0 ? w : H};
  };
  auto top_up = [&]() {
    while (posted.size() < kRecvsAhead && next_post < recv_actions.size()) {
      const Action& r = actions[recv_actions[next_post++]];
      const bool act = r.kind == ActionKind::RecvActivation;
      posted.push_back(post_recv(act ? prev_of(r.chunk) : next_of(r.chunk), r.micro_batch, act ? kActHeader : kGradHeader,
                                 shape_of(r.micro_batch, act), dt, key_in(r.chunk)));
      posted.back().chunk = r.chunk;
    }
  };
  auto take = [&](int64_t m, int kind, int64_t v) {
    PostedRecv r = std::move(posted.front());
    posted.pop_front();
    if (r.mb != m || r.kind != kind || r.chunk != v) throw Error("pipeline executor: receives out of order (internal error)");
    at::Tensor t = finish_recv(r, shape_of(m, kind == kActHeader), dt);
    top_up();
    return t;
  };
  top_up();

  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    const int64_t m = a.micro_batch, v = a.chunk;
    if (v < 0 || v >= num_chunks()) throw Error("pipeline executor: action " + to_string(a) + " names a chunk this rank does not hold");
    InFlight& st = state_[static_cast<size_t>(v * num_mbs + m)];
    // "F3", "F3.1" (chunk 1) as in the schedule's own text.
    const std::string mtext = std::to_string(m) + (v ? "." + std::to_string(v) : std::string());
    auto t0 = Clock::now();
    switch (a.kind) {
      case ActionKind::RecvActivation:
        st.input = take(m, kActHeader, v).requires_grad_(true);
        record("recv A" + mtext, "recv", t0);
        break;
      case ActionKind::Forward: {
        {
          const auto recording = defer(m);
          model::AutocastScope amp(slice_.device(), precision);
          const model::DropoutKeys keys{dropout_seed, step, mbs[static_cast<size_t>(m)].samples};
          model::DropoutScope scope(keys.samples.empty() ? nullptr : &keys);
          at::Tensor out = forward_slice(first(v) ? mbs[static_cast<size_t>(m)].inputs : st.input, m, v);
          if (last(v)) {
            at::Tensor ls = slice_.loss(out, mbs[static_cast<size_t>(m)].targets);
            if (ls.scalar_type() != dt) ls = ls.to(dt);
            if (counts_loss) loss_sum += ls.item<double>();
            st.output = ls / loss_divisor;
          } else {
            st.output = out.scalar_type() == dt ? out : out.to(dt);
          }
        }
        ++in_flight_;
        compute_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
        record("F" + mtext, "compute", t0);
        sample_memory();
        break;
      }
      case ActionKind::SendActivation:
        send_to(links_.send_next, next_of(v), m, kActHeader, st.output, key_out(v, true));
        record("send A" + mtext, "send", t0);
        break;
      case ActionKind::RecvGrad:
        st.grad_in = take(m, kGradHeader, v);
        record("recv G" + mtext, "recv", t0);
        break;
      case ActionKind::Backward: {
        if (reducer && i == last_bwd) reducer->arm();
        {
          const auto recording = defer(m);
          if (last(v)) st.output.backward();
          else st.output.backward(st.grad_in);
        }
        st.output = at::Tensor();
        st.grad_in = at::Tensor();
        if (!split) --in_flight_;
        compute_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
        record("B" + mtext, "compute", t0);
        break;
      }
      case ActionKind::SendGrad:
        send_to(links_.send_prev, prev_of(v), m, kGradHeader, st.input.grad(), key_out(v, false));
        st.input = at::Tensor();
        record("send G" + mtext, "send", t0);
        break;
      case ActionKind::BackwardWeight:
        // Every other weight pass comes before the last one (zb_h1 runs them in micro-batch order).
        deferred_.run(m, i == last_weight);
        --in_flight_;
        compute_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
        record("W" + std::to_string(m), "compute", t0);
        break;
    }
  }
  auto t0 = Clock::now();
  wait_sends();
  record("wait sends", "send", t0);
  check_channel_headers();  // before the optimizer uses what this step received
  state_.clear();
  if (!deferred_.empty()) throw Error("pipeline executor: a weight pass was scheduled for no micro-batch it recorded (internal error)");
  return loss_sum;
}

at::Tensor StageExecutor::forward_slice(const at::Tensor& x, int64_t mb, int64_t chunk) {
  if (!chunk_units.empty()) {
    const auto& [begin, end] = chunk_units.at(static_cast<size_t>(chunk));
    return slice_.forward_units(x, begin, end);
  }
  if (mb_units.empty()) return slice_.forward(x);
  const auto& [begin, end] = mb_units[static_cast<size_t>(mb) % mb_units.size()];
  return slice_.forward_units(x, begin, end);
}

double StageExecutor::forward_only(const std::vector<MicroBatch>& mbs) {
  at::NoGradGuard ng;
  const auto& cfg = slice_.config();
  double loss_sum = 0;
  // Each micro-batch through this rank's chunks in turn: a chunk's input comes from a chunk
  // earlier in the model (on this rank, from earlier in this order), so no rank waits on a later one.
  for (size_t m = 0; m < mbs.size(); ++m)
    for (int64_t v = 0; v < num_chunks(); ++v) {
      const int64_t rows = mbs[m].rows, mb = static_cast<int64_t>(m);
      at::Tensor x = first(v) ? mbs[m].inputs
                              : recv_tensor(prev_of(v), mb, kActHeader, {rows, cfg.seq_len, in_width > 0 ? in_width : cfg.hidden},
                                            slice_.dtype(), key_in(v));
      model::AutocastScope amp(slice_.device(), precision);
      at::Tensor out = forward_slice(x, mb, v);
      if (last(v)) {
        // Every member computes it: under vocabulary parallelism the loss is a collective.
        const double l = slice_.loss(out, mbs[m].targets).item<double>();
        if (counts_loss) loss_sum += l;
      } else {
        send_to(links_.send_next, next_of(v), mb, kActHeader, out.scalar_type() == slice_.dtype() ? out : out.to(slice_.dtype()),
                key_out(v, true));
      }
    }
  wait_sends();
  check_channel_headers();
  return loss_sum;
}

}  // namespace alloy::pipeline
