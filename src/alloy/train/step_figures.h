#pragma once
// The step's figures summed over the world: the loss, the gradient norm that clipping needs, the
// gradient sync's own figures for the record (bytes, elements selected, codec seconds, residual)
// and, with train.rebalance, each pipeline's compute seconds. One posted sum a step.
//
// Where every rank holds the whole model and the whole summed gradient (replicas of one stage,
// neither sharded nor split by tensor parallelism), the norm is the same on every rank and needs
// no sum, and the sum leaves "ahead": at the end of the backward, before the gradient sync is
// waited for, carrying the loss, the compute seconds and the previous step's sync figures. Its
// latency then hides behind the sync's own, which waits for the slowest rank's backward anyway.
// Sent after the sync (as it is elsewhere), it put one more crossing of the slowest link on every
// step: on two hosts 20 ms apart the slower rank waited 69 ms for it after its sync (measured in
// a trace of a DGC step of 1.23 s). The price: a step's row of metrics is written once its sync
// figures arrive, with the next step's sum, or at once (a sum of its own) at a checkpoint, a
// re-plan and the run's last step, so every row on disk is whole and none is held past a save.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace alloy::dist {
class Group;
class PostedSum;
}  // namespace alloy::dist

namespace alloy::train {

class Metrics;

class StepFigures {
 public:
  // This rank's gradient sync figures of one step (summed over the world for the record).
  struct Sync {
    double bytes_sent = 0, elements = 0, selected = 0, codec_s = 0, residual_sq = 0;
  };
  // What the step needs from the sum.
  struct Sums {
    double loss = 0;          // summed over the world
    double norm_sq = 0;       // the whole gradient's
    double clip_norm_sq = 0;  // what clipping covers
    std::vector<double> compute_s;  // per pipeline (train.rebalance), else empty
  };

  // WORLD: null when training alone. COMPUTE_SLOTS: pipelines whose compute seconds are summed
  // (0 without train.rebalance). METRICS: where rows go (rank 0's; null elsewhere).
  StepFigures(dist::Group* world, bool ahead, int64_t compute_slots, Metrics* metrics);
  ~StepFigures();
  bool ahead() const { return ahead_; }

  // At the step's start: the sum's receives posted, well before its values exist.
  void begin(int64_t step);
  // After the step's backward, before the gradient sync is waited for: ahead, the loss and compute
  // seconds go now (and the previous row is written); otherwise they wait for after_sync.
  void after_backward(double loss, int64_t pipeline, double compute_s);
  // After the sync: NORM_SQ and CLIP_NORM_SQ are this rank's counted parts (ahead: the whole).
  Sums after_sync(double norm_sq, double clip_norm_sq, const Sync& sync);
  // The step's row, without its sync figures: written now, or once they arrive. FLUSH (the same
  // on every rank): the run saves, re-plans or ends after this step, so the row is completed now.
  void record(nlohmann::json row, bool flush);

 private:
  void complete(nlohmann::json& row, const at::Tensor& sync_sums) const;
  void write(const nlohmann::json& row) const;

  dist::Group* world_;
  bool ahead_;
  int64_t compute_slots_;
  Metrics* metrics_;
  std::unique_ptr<dist::PostedSum> posted_;
  at::Tensor summed_;                  // this step's sum once it ran
  Sync sync_;                          // this step's, until summed
  std::optional<Sync> unsent_;         // ahead: the last step's, to go with the next sum
  std::optional<nlohmann::json> pending_;  // ahead: the last step's row, waiting for its sync figures
};

}  // namespace alloy::train
