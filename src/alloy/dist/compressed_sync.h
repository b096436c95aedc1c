#pragma once
// Compressed gradient sync of one holder set (the ranks that hold the same parameters), on one
// rank: gradients -> fuse -> compress -> exchange -> decompress, overlapped with backward.
//
// The parameter hooks (autograd thread) copy each final gradient into the set's flat staging
// buffer and, in the flat topology, encode it there and then: each tensor as soon as it is ready
// (compress ahead) or the whole buffer once its last tensor is (fuse then compress). A worker
// thread of this set walks the buffers in order, exchanges each with the other members as soon as
// it is encoded and decodes the sum; finish() (training thread) waits for it and writes the sums
// into the parameters' .grad. Encoding on the autograd thread costs the backward its own CPU time
// and no more; on a thread of its own, sharing the device's core, the same work slowed a backward
// by about twice its time (cache and time-slice interference: +63 ms for 33 ms of encoding, on a
// 6-block GPT-2 pinned to one core). The worker mostly waits on the network. PowerSGD encodes on
// the worker. One worker per set, walking its buffers in one order on every member, keeps every
// member's collectives in the same order per group, so sets never wait on each other.
//
// The first grad_sync.dense_steps steps sum exactly through the same groups (train/optimizer.h
// says why sparsifiers need them). Two topologies (grad_sync.scope):
//  - flat: every holder compresses its own gradient; the codec exchanges among all holders.
//  - hierarchical (slow-links): the holders joined by fast links (a region) first sum a buffer
//    exactly (all-reduce), then each region's leader (its lowest rank) compresses the region's
//    sum and exchanges it with the other leaders across the slow links, and broadcasts the wire
//    to its region, where every member decodes the same sum. Error feedback lives on leaders.
//
// Fusion (compress/fusion.h): the measuring strategies time each tensor's readiness (from the
// start of the last backward), the compression per element and each exchange; at re-tune steps
// the members share these (the maximum over members) and every member computes the same buffers.
#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/dist/compress/codec.h"
#include "alloy/dist/compress/comm.h"
#include "alloy/dist/compress/fusion.h"
#include "alloy/model/transformer.h"

namespace alloy::dist {

struct SyncSpan {
  std::string name;  // "compress 12", "exchange 3", "decompress 3", "region all-reduce 3"
  double start_us = 0, dur_us = 0;
};

struct CompressedSyncStats {
  int64_t bytes_sent = 0;  // this rank's wire bytes in this step's exchanges
  int64_t elements = 0;    // gradient elements this rank encoded (a region's leader encodes for it)
  int64_t selected = 0;    // of those, elements whose values were sent (density = selected / elements)
  double encode_s = 0, exchange_s = 0, decode_s = 0;
  double residual_sq = 0;  // squared norm of what this rank still holds back (error feedback)
  int64_t buffers = 0;
  std::vector<SyncSpan> spans;
};

class CompressedSync {
 public:
  struct Topology {
    std::unique_ptr<compress::Comm> flat;     // scope all: every holder
    std::unique_ptr<compress::Comm> region;   // hierarchical: this rank's region (null when alone in it)
    std::unique_ptr<compress::Comm> leaders;  // hierarchical: one per region (null unless this rank leads)
    int regions = 1;                          // hierarchical: how many regions the set spans
    bool hierarchical() const { return !flat; }
  };
  // PARAMS in backward order (the same names on every member); SET_SEED the same on every member.
  CompressedSync(std::vector<model::Param*> params, Topology topo, const GradSyncConfig& cfg, uint64_t set_seed, std::string name);
  ~CompressedSync();
  CompressedSync(const CompressedSync&) = delete;
  CompressedSync& operator=(const CompressedSync&) = delete;

  // Before the last micro-batch's backward; STEP is the optimizer step (0-based), ORIGIN the
  // trace clock.
  void arm(int64_t step, std::chrono::steady_clock::time_point origin);
  // From the parameter hook: this micro-batch's gradient of slot SLOT (earlier ones are in .grad).
  void on_grad_ready(size_t slot, const at::Tensor& incoming);
  // Marks parameters without a gradient this step ready (their .grad or zero), waits for the
  // worker, writes the sums into .grad. Throws what the worker threw (a timed-out peer, ...).
  CompressedSyncStats finish();
  // Runs one step with every gradient already in .grad (tests, benchmarks).
  CompressedSyncStats sync_now(int64_t step);

  bool armed() const { return armed_; }
  const compress::FusionPlan& fusion() const { return fusion_; }
  const std::string& name() const { return name_; }
  // The encoder's state (error feedback), for checkpoints and tests.
  compress::CodecState& state() { return state_; }
  int64_t numel() const { return total_; }
  const std::vector<compress::TensorSlot>& slots() const { return slots_; }

 private:
  void worker_main();
  void run_step();
  void run_dense_step();
  int64_t wire_bytes() const;  // sent so far through this set's groups
  void wait_ready(size_t i);
  void wait_buffer(size_t b);
  void retune();
  void cut_buffers();  // per-step bookkeeping of the current fusion plan
  // The hook side of encoding (flat topology): after slot SLOT's gradient is in staging.
  void encode_ready(size_t slot);
  compress::BufferLayout layout_of(size_t b) const;
  void broadcast_wire(at::Tensor& wire);
  double since_origin_us(std::chrono::steady_clock::time_point t) const;
  std::vector<compress::Encoded> encode_pieces(size_t lo, size_t hi, bool per_tensor, const compress::StepContext& ctx,
                                               compress::BufferLayout& layout, bool wait, CompressedSyncStats& st);
  compress::StepContext context() const;

  std::string name_;
  std::vector<model::Param*> params_;
  std::vector<compress::TensorSlot> slots_;
  int64_t total_ = 0;
  Topology topo_;
  GradSyncConfig cfg_;
  uint64_t set_seed_;
  compress::Options opts_;
  std::unique_ptr<compress::Codec> codec_;
  compress::CodecState state_;
  compress::FusionPlan fusion_;
  at::Tensor staging_, out_;
  int threads_ = 1;

  // Measurements of the last step, for the measuring fusion strategies.
  std::vector<double> ready_s_;
  double encode_s_per_elem_ = 0, decode_s_per_elem_ = 0;
  std::vector<std::pair<double, double>> exchanges_;  // (elements, seconds) per buffer, last step
  std::vector<std::pair<double, double>> history_;    // the same over the last steps (at most 256)
  int64_t steps_run_ = 0;
  std::vector<double> window_;  // this rank's steps since the last retune: backward start -> last decode
  std::map<std::vector<size_t>, double> measured_;  // saf-adaptive: per cut tried, its agreed time

  std::mutex mu_;
  std::condition_variable cv_;
  enum class Phase { Idle, Armed, Running, Done } phase_ = Phase::Idle;
  std::vector<char> ready_;
  std::vector<std::chrono::steady_clock::time_point> ready_at_;
  bool stop_ = false;
  bool armed_ = false;
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point origin_, armed_at_;
  std::exception_ptr error_;
  CompressedSyncStats stats_;       // the worker's share of this step
  CompressedSyncStats hook_stats_;  // encoding on the autograd thread
  bool encode_in_hook_ = false;
  bool dense_step_ = false;         // this step syncs exactly (grad_sync.dense_steps)
  bool per_tensor_ = false;
  std::vector<size_t> buffer_of_;   // slot -> buffer under the current fusion plan
  std::vector<int64_t> pending_;    // per buffer: tensors not yet encoded (hook encoding)
  std::vector<char> buf_ready_;     // per buffer: encoded, ready to exchange
  std::vector<compress::Encoded> encoded_;        // per slot (compress ahead)
  std::vector<compress::Encoded> encoded_whole_;  // per buffer (fuse then compress)
  std::thread worker_;
};

}  // namespace alloy::dist
