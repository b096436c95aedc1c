#include "alloy/train/step_figures.h"

#include <cmath>

#include "alloy/dist/world.h"
#include "alloy/train/metrics.h"

namespace alloy::train {

namespace {
// Tags of the posted sums on the world group (two, alternating by step): the world group's other
// point-to-point messages are the profiler's, in runs of their own.
constexpr int kFiguresTag = 0x5f160000;
// The sum's layout: loss, norm, clipping's norm, the five sync figures, then the compute slots.
constexpr int64_t kLoss = 0, kNorm = 1, kClipNorm = 2, kSync = 3, kSyncCount = 5, kFigures = 8;

at::Tensor sync_tensor(const StepFigures::Sync& s) {
  return at::tensor({s.bytes_sent, s.elements, s.selected, s.codec_s, s.residual_sq}, at::kDouble);
}
}  // namespace

StepFigures::StepFigures(dist::Group* world, bool ahead, int64_t compute_slots, Metrics* metrics)
    : world_(world), ahead_(ahead && world != nullptr), compute_slots_(compute_slots), metrics_(metrics) {}

StepFigures::~StepFigures() = default;

void StepFigures::begin(int64_t step) {
  summed_ = at::zeros({kFigures + compute_slots_}, at::kDouble);
  posted_.reset();
  if (world_)
    posted_ = std::make_unique<dist::PostedSum>(
        world_->post_sum_small(kFigures + compute_slots_, at::kDouble, kFiguresTag + static_cast<int>(step % 2)));
}

void StepFigures::after_backward(double loss, int64_t pipeline, double compute_s) {
  summed_[kLoss] = loss;
  if (compute_slots_ > 0) summed_[kFigures + pipeline] = compute_s;
  if (!ahead_) return;
  if (unsent_) summed_.narrow(0, kSync, kSyncCount).copy_(sync_tensor(*unsent_));
  posted_->finish(summed_, "sum of the step's loss and figures (ahead of the gradient sync)");
  posted_.reset();
  if (pending_ && unsent_) {
    complete(*pending_, summed_.narrow(0, kSync, kSyncCount));
    write(*pending_);
  }
  pending_.reset();
  unsent_.reset();
}

StepFigures::Sums StepFigures::after_sync(double norm_sq, double clip_norm_sq, const Sync& sync) {
  sync_ = sync;
  // Ahead, every rank's norm is the whole gradient's, the same bits everywhere: not summed.
  summed_[kNorm] = norm_sq;
  summed_[kClipNorm] = clip_norm_sq;
  if (!ahead_) {
    summed_.narrow(0, kSync, kSyncCount).copy_(sync_tensor(sync));
    if (posted_) posted_->finish(summed_, "sum of the step's loss, gradient norm and sync figures");
    posted_.reset();
  }
  Sums s;
  s.loss = summed_[kLoss].item<double>();
  s.norm_sq = summed_[kNorm].item<double>();
  s.clip_norm_sq = summed_[kClipNorm].item<double>();
  const at::Tensor c = summed_.narrow(0, kFigures, compute_slots_).contiguous();
  s.compute_s.assign(c.data_ptr<double>(), c.data_ptr<double>() + compute_slots_);
  return s;
}

void StepFigures::record(nlohmann::json row, bool flush) {
  if (!ahead_) {
    complete(row, summed_.narrow(0, kSync, kSyncCount));
    write(row);
    return;
  }
  if (!flush) {
    pending_ = std::move(row);
    unsent_ = sync_;
    return;
  }
  at::Tensor t = sync_tensor(sync_);
  world_->sum_small(t, "sum of the step's sync figures");
  complete(row, t);
  write(row);
}

void StepFigures::complete(nlohmann::json& row, const at::Tensor& sync_sums) const {
  const at::Tensor f = sync_sums.contiguous();
  const double* v = f.data_ptr<double>();
  if (world_) row["grad_bytes"] = v[0];  // put on the wire by all ranks for gradient sync
  if (v[1] > 0) {
    row["grad_density"] = v[2] / v[1];  // of the compressed sets' elements
    row["compress_s"] = v[3];           // compressing + decompressing, all ranks
    row["residual_norm"] = std::sqrt(v[4]);  // what error feedback holds back
  }
}

void StepFigures::write(const nlohmann::json& row) const {
  if (metrics_) metrics_->log(row);
}

}  // namespace alloy::train
