#pragma once
// Runs one stage's schedule (a list of actions, see schedule.h) against its slice of the model:
// forward and backward per micro-batch, activations sent to the next stage and gradients to the
// previous one over c10d point-to-point, asynchronously, with shape and dtype checked on receipt.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "alloy/model/deferred_weights.h"
#include "alloy/model/transformer.h"
#include "alloy/pipeline/device_memory.h"
#include "alloy/pipeline/schedule.h"

namespace c10d {
class Work;
}

namespace alloy::dist {
class Group;
class PipeChannel;
class PipeChannels;
class Reducer;
}  // namespace alloy::dist

namespace alloy::pipeline {

struct MicroBatch {
  at::Tensor inputs;   // [mbs, T] token ids (first stage)
  at::Tensor targets;  // [mbs, T] token ids (last stage)
  int64_t rows = 0;    // samples in this micro-batch (every stage knows it, even without data)
  std::vector<int64_t> samples;  // their places in the global batch (LoRA's dropout masks are keyed by them)
};

struct TraceEvent {
  std::string name;    // "F3", "B0", "send A3", "recv G1", "allreduce"
  std::string stream;  // compute | send | recv | sync
  double start_us, dur_us;
};

struct StageLinks {
  dist::Group* group = nullptr;  // carries the point-to-point messages; null for a 1-stage pipeline
  int prev_rank = -1;            // global ranks of the neighbouring stages; -1 at the ends
  int next_rank = -1;
  // Tensor parallelism: a stage's ranks all compute the same activations and input gradients, so
  // its first rank alone sends, to one rank of the neighbouring stage per machine (its first
  // there), which passes each message on to RELAY, the stage's other ranks on its machine: a
  // message crosses a link between machines once, not once per member. PREV_RANK / NEXT_RANK are
  // whom this rank receives from (the neighbour's first rank, or its own machine's first member
  // of the stage). Empty: send to PREV_RANK / NEXT_RANK (one rank per stage); {-1}: this rank
  // sends nothing.
  std::vector<int> send_prev, send_next;
  std::vector<int> relay;
  // An interleaved pipeline (Plan's virtual stages): the rank each of this rank's chunks receives
  // activations from and sends them to (-1 at the pipeline's two ends); gradients go the other
  // way. Empty: one chunk, PREV_RANK / NEXT_RANK. CHUNK_STAGE: each chunk's place in the
  // pipeline's S x V (its virtual stage), which tags its messages: two chunks' messages of one
  // micro-batch between the same two ranks (two ranks: both ways) must not meet.
  std::vector<int> chunk_prev, chunk_next, chunk_stage;
  // Streams that travel device to device (dist/pipe_channels.h), each a FIFO of its own; null or
  // a stream without a channel: GROUP, through the host, matched by tags.
  dist::PipeChannels* channels = nullptr;
};

class StageExecutor {
 public:
  StageExecutor(model::Transformer& slice, StageLinks links);

  // Runs ACTIONS for one optimizer step. Every micro-batch loss is divided by LOSS_DIVISOR (the
  // tokens of the global batch). Arms REDUCER (if any) before the last backward. Returns the sum
  // of token losses computed here (non-zero on the last stage only). With BackwardWeight actions
  // (zb-h1) the blocks' projection weights get their gradients in those, the last one's through
  // the reducer's hooks (model/deferred_weights.h).
  // train.precision: forwards run under autocast in it; what crosses to the next stage is cast
  // back to the slice's dtype, so messages keep their size and the residual stream its precision.
  std::string precision = "fp32";
  // Whether run() and forward_only() return this stage's loss (false on all but the first rank of a
  // tensor-parallel last stage: the group computes one loss).
  bool counts_loss = true;
  // A floating pipeline boundary (PipelinePlan::units_of): the units this stage runs for micro-batch
  // m are mb_units[m % size] (validation reuses the training pattern); empty: the whole slice.
  std::vector<std::pair<int64_t, int64_t>> mb_units;
  // The last dimension of what this stage receives from the previous one (in_width) and sends to
  // the next (out_width), gradients back alike: 0 is the hidden size; twice it across a cut MLP
  // (PipelinePlan::message_width).
  int64_t in_width = 0, out_width = 0;
  // An interleaved pipeline: the units of each of this rank's chunks (Action::chunk indexes it);
  // empty: one chunk.
  std::vector<std::pair<int64_t, int64_t>> chunk_units;
  // The keys of LoRA's dropout masks (model::DropoutKeys): the run's seed and the step (set per
  // step); each micro-batch adds its samples.
  uint64_t dropout_seed = 0;
  int64_t step = 0;
  double run(const std::vector<Action>& actions, const std::vector<MicroBatch>& mbs, double loss_divisor,
             dist::Reducer* reducer);
  // Forward only (validation): returns the sum of token losses on the last stage.
  double forward_only(const std::vector<MicroBatch>& mbs);

  // Timeline of the last run(), microseconds from TRACE_ORIGIN (set by the caller per step).
  std::vector<TraceEvent>& trace() { return trace_; }
  void set_trace_origin(std::chrono::steady_clock::time_point t) { origin_ = t; }
  bool tracing = false;
  // Bytes in use on the slice's device above the level at the start of the last run(): activations
  // kept for backward (measured: device_memory.h, not estimated).
  int64_t peak_activation_bytes() const { return peak_bytes_; }
  // The device's memory in use at its peak during the last run() (what it held before, plus its growth).
  int64_t peak_memory_bytes() const { return base_bytes_ + peak_bytes_; }
  int64_t peak_in_flight() const { return peak_in_flight_; }
  double compute_s() const { return compute_s_; }

 private:
  // Whether chunk V of this rank starts (ends) the pipeline.
  bool first(int64_t v = 0) const { return prev_of(v) < 0; }
  bool last(int64_t v = 0) const { return next_of(v) < 0; }
  int prev_of(int64_t v) const { return links_.chunk_prev.empty() ? links_.prev_rank : links_.chunk_prev.at(static_cast<size_t>(v)); }
  int next_of(int64_t v) const { return links_.chunk_next.empty() ? links_.next_rank : links_.chunk_next.at(static_cast<size_t>(v)); }
  int64_t num_chunks() const { return chunk_units.empty() ? 1 : static_cast<int64_t>(chunk_units.size()); }
  at::Tensor recv_tensor(int src, int64_t mb, int kind, at::IntArrayRef shape, at::ScalarType dtype, int64_t key = 0);
  // A receive posted ahead of the action that consumes it. Gloo sends the payload of a message only
  // once the receiver has posted its receive, so a receive posted when the data is needed costs a
  // full transfer on the critical path: on a 0.1 Gbit/s link each gradient of a GPipe stage arrived
  // one transfer (16-30 ms) late, 200 ms per step in all. Up to kRecvsAhead receives are posted in
  // the order the actions will consume them.
  struct PostedRecv {
    int src = -1, kind = 0;
    int64_t mb = 0, chunk = 0;  // CHUNK: the receiving chunk's index on this rank
    int64_t key = 0;            // the receiving virtual stage's tag key (relays pass it on)
    dist::PipeChannel* channel = nullptr;  // matched by order on it, posted in finish_recv; null: by tag
    at::Tensor header, data;
    c10::intrusive_ptr<c10d::Work> wh, wd;
  };
  static constexpr size_t kRecvsAhead = 4;
  // KEY: the receiving chunk's virtual stage in an interleaved pipeline (StageLinks::chunk_stage),
  // 0 otherwise; it goes into the messages' tags.
  PostedRecv post_recv(int src, int64_t mb, int kind, at::IntArrayRef shape, at::ScalarType dtype, int64_t key = 0);
  at::Tensor finish_recv(PostedRecv& r, at::IntArrayRef shape, at::ScalarType dtype);
  void send_tensor(int dst, int64_t mb, int kind, const at::Tensor& t, int64_t key = 0);
  // The channel of the stream of KIND into virtual stage KEY to (SENDING) or from PEER, or null.
  dist::PipeChannel* channel(bool sending, int peer, int kind, int64_t key) const;
  void send_to(const std::vector<int>& targets, int fallback, int64_t mb, int kind, const at::Tensor& t, int64_t key = 0);
  // The tag keys of what chunk V receives (its virtual stage) and sends on (ACT: the next
  // virtual stage's; else the previous one's); 0 without chunks.
  int64_t key_in(int64_t v) const { return links_.chunk_stage.empty() ? 0 : links_.chunk_stage.at(static_cast<size_t>(v)); }
  int64_t key_out(int64_t v, bool act) const { return links_.chunk_stage.empty() ? 0 : key_in(v) + (act ? 1 : -1); }
  void wait_sends();
  // The headers of the messages received on channels since the last check, read and compared
  // with what was expected; throws on the first that differs.
  void check_channel_headers();
  struct UncheckedHeader {
    at::Tensor header;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    int64_t mb;
    std::string what;
  };
  std::vector<UncheckedHeader> unchecked_;
  void record(const std::string& name, const char* stream, std::chrono::steady_clock::time_point t0);
  void sample_memory();
  at::Tensor forward_slice(const at::Tensor& x, int64_t mb, int64_t chunk = 0);

  model::Transformer& slice_;
  StageLinks links_;
  struct InFlight {
    at::Tensor input;   // received activation (leaf, requires grad) on non-first stages
    at::Tensor output;  // activation to send / loss on the last stage
    at::Tensor grad_in; // gradient received from the next stage
  };
  std::vector<InFlight> state_;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor>> sends_;
  model::DeferredWeightGrads deferred_;
  std::vector<TraceEvent> trace_;
  std::chrono::steady_clock::time_point origin_;
  int64_t base_bytes_ = 0, peak_bytes_ = 0, peak_in_flight_ = 0, in_flight_ = 0;
  double compute_s_ = 0;
};

}  // namespace alloy::pipeline
