#pragma once
// A codec turns each member's gradient of a buffer into something small, exchanges it, and turns
// what came back into the SUM over members. Three families, one interface:
//
//   cast (fp16, bf16)      every element in 16 bits; fp16 all-reduced in fp16, bf16 all-gathered
//                          and summed in fp32 (Gloo has no bf16 reduction).
//   sparse (topk, randomk, dgc, gaussiank, redsync, sidco)
//                          k = density * n elements per piece as (int32 index, fp32 value),
//                          all-gathered and scatter-added; randomk shares its indices through a
//                          common seed and all-reduces the values alone.
//   low rank (powersgd)    per matrix M (rows x cols): P = M Q, all-reduce P, orthonormalise,
//                          Q = M^T P, all-reduce Q, sum ~ P Q^T; Q is kept as the next step's
//                          start (warm start); vectors and small matrices go dense.
//
// Pieces and buffers: a buffer is a contiguous range of a holder set's flat gradient (backward
// order); it is encoded as one piece (fuse, then compress) or tensor by tensor (compress ahead of
// fusion, SAFusion's way: no tensor's share is crowded out by a bigger neighbour). The exchange
// always moves a whole buffer in one or two collectives.
//
// Error feedback (CodecState::residual, on by default): the encoder adds what it did not send
// before to this step's gradient and keeps what it does not send now, so that
//   sent + new residual == gradient + old residual            (exactly, for cast and sparse).
// DGC adds momentum correction: a local velocity v = momentum * v + g accumulates into the
// residual, and both are cleared where values were sent (factor masking); momentum_correction on
// gives every sparsifier the same.
//
// Wire: exchange() returns one tensor from which decode() writes the sum into the output, without
// any encoder state, so a region's leader can exchange for the region and broadcast the wire to
// the others (hierarchical sync, grad_sync.scope slow-links).
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/dist/compress/sparsify.h"

namespace alloy::dist::compress {

class Comm;

struct Options {
  std::string method = "none";
  double density = 0.01;
  bool error_feedback = true;
  int64_t warmup_steps = 0;
  int64_t dense_steps = 0;  // exact steps before any compression (the warm-up starts after them)
  int64_t powersgd_rank = 4;
  double dgc_momentum = 0.9;
  std::string momentum_correction = "auto";  // GradSyncConfig::local_velocity
  SidcoFit sidco_fit = SidcoFit::Exponential;
  int sidco_stages = 2;
  bool aligned = false;  // every member sends exactly k values per piece: no sizes exchanged

  static Options from(const GradSyncConfig& g, bool aligned);
  // Density at optimizer step STEP (0-based): DGC's warm-up, exponentially from 0.25 down to
  // density over the warmup_steps after the dense_steps, then density.
  double density_at(int64_t step) const;
};

// One parameter of the set: its elements in the set's flat buffer.
struct TensorSlot {
  int64_t offset = 0, numel = 0;
  std::vector<int64_t> shape;
};

// A buffer as every member sees it: its range and how it was cut into pieces for encoding.
struct BufferLayout {
  int64_t begin = 0, numel = 0;
  std::vector<std::pair<int64_t, int64_t>> pieces;  // (begin, numel) in the set's flat buffer
  std::vector<TensorSlot> slots;                     // the tensors inside it (powersgd shapes)
};

// The encoder's memory across steps, over the set's flat elements.
struct CodecState {
  at::Tensor residual;                // error feedback
  at::Tensor velocity;                // DGC momentum correction
  std::map<int64_t, at::Tensor> q;    // PowerSGD warm start, by tensor offset
  std::map<int64_t, double> dgc_hint; // DGC: the k-th magnitude each piece sent last, by offset
};

struct StepContext {
  int64_t step = 0;        // optimizer step, 0-based
  uint64_t seed = 0;       // shared by the members of the set for this step
  int contributors = 1;    // how many encodings are summed (members, or regions' leaders)
};

// One piece's encoding, held until its buffer is exchanged.
struct Encoded {
  int64_t begin = 0, numel = 0;
  int64_t selected = 0;           // elements whose value is sent (density achieved)
  at::Tensor indices, values;     // sparse: int64 indices into the set's flat buffer, fp32 values
  at::Tensor dense;               // cast: 16-bit; powersgd: the vector sent uncompressed
  at::Tensor m, p;                // powersgd: the matrix with its residual; M Q, then (after the
                                  // exchange) the summed Q' that warm-starts the next step
  int rank = 0;                   // powersgd rank used (0: sent dense)
};

class Codec {
 public:
  virtual ~Codec() = default;
  virtual const std::string& name() const = 0;
  // Whether pieces may be single tensors (compress ahead). PowerSGD always encodes per matrix.
  virtual bool per_tensor_only() const { return false; }
  // Whether encode() may run on the autograd thread, beside a worker exchanging other buffers
  // (it touches only its own range of the state). PowerSGD's warm-start map says no.
  virtual bool encodes_in_hook() const { return true; }
  // Encodes [begin, begin + numel) of G (this rank's flat gradient of the set).
  virtual Encoded encode(const at::Tensor& g, int64_t begin, int64_t numel, const std::vector<TensorSlot>& slots, CodecState& st,
                         const StepContext& ctx) = 0;
  virtual at::Tensor exchange(std::vector<Encoded>& parts, const BufferLayout& layout, Comm& comm, const StepContext& ctx) = 0;
  // The elements (int32) exchange() will all-gather for LAYOUT at CTX's step, when known before
  // encoding (aligned sparsifiers: exactly k per piece), so their receives can be posted at the
  // step's start (Comm::post_allgather); -1 when not known or not an all-gather.
  virtual int64_t gather_numel(const BufferLayout& /*layout*/, const StepContext& /*ctx*/) const { return -1; }
  // Writes the sum over contributors of the buffer's elements into OUT (the set's flat output).
  virtual void decode(const at::Tensor& wire, const BufferLayout& layout, at::Tensor& out, const StepContext& ctx) = 0;
  // The encoder, once OUT holds the decoded sum (PowerSGD keeps M - sum / contributors).
  virtual void after_decode(std::vector<Encoded>& /*parts*/, const at::Tensor& /*out*/, CodecState& /*st*/,
                            const StepContext& /*ctx*/) {}

 protected:
  Options opt_;
};

std::unique_ptr<Codec> make_codec(const Options& o);

// Adds the residual (and DGC's velocity) to this step's gradient: the tensor to select from.
// Exposed for the error-feedback tests.
at::Tensor accumulate(const at::Tensor& g, int64_t begin, int64_t numel, CodecState& st, const Options& o);
// After sending VALUES at INDICES (set-flat): clears them from the residual and the velocity.
void forget_sent(const at::Tensor& indices, int64_t selected, CodecState& st, const Options& o);

}  // namespace alloy::dist::compress
