#pragma once
// The training loop. One loop serves one device and any Plan over many ranks: every rank runs
// Trainer::run, which reads top to bottom as
//   sample the global batch -> take this pipeline's slice -> run this stage's schedule
//   (forward/backward/send/recv) -> reduce gradients among the ranks holding each parameter ->
//   clip by the global norm -> AdamW step -> log -> evaluate -> checkpoint.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"
#include "alloy/data/sampler.h"
#include "alloy/data/windows.h"
#include "alloy/model/precision.h"
#include "alloy/model/transformer.h"
#include "alloy/pipeline/executor.h"
#include "alloy/train/checkpoint_writer.h"
#include "alloy/train/optimizer.h"
#include "alloy/train/rank_device.h"
#include "alloy/train/share_balancer.h"

namespace alloy::dist {
class World;
class Group;
class PipeChannels;
class Reducer;
class Sharding;
class Zero3;
class SyncLayout;
class GroupTpComm;
}  // namespace alloy::dist

namespace alloy::train {

struct TrainOptions {
  std::string resume;         // "" = fresh run; a checkpoint or run directory otherwise
  std::string init_weights;   // --init-from: safetensors file or checkpoint to start from (fresh optimizer);
                              // with LoRA, the frozen base
  bool quiet = false;         // no progress display (tests)
  std::shared_ptr<Plan> plan; // null = one device, the whole model
  std::shared_ptr<dist::World> world;  // null = single process
  std::string trace;          // write a Chrome trace of the schedule of the first traced steps here
  int64_t trace_step = 0;     // the step traced, from 1 (0: the run's second step)
  // Re-planning from measured speeds (with a world): after step REPLAN_AT (1-based) every rank
  // reports its median compute per step over the steps after its first, and rank 0 calls REPLAN
  // with them (rank -> seconds). When it returns a plan, every rank checkpoints and run() returns
  // early with TrainResult::next_plan, for the caller to resume under that plan.
  int64_t replan_at = 0;
  // When REPLAN keeps the plan at REPLAN_AT, the ranks measure once more REMEASURE_AFTER steps
  // later, over the longer window since the plan started (0: never): a first window that caught
  // the machine slow or fast then does not set the prediction and the batch split for the rest of
  // the run (on the 3-device demo a window of steps 2-6 read every type 4-11% slower than the
  // steps after it, and the kept plan's prediction stayed 11% off).
  int64_t remeasure_after = 0;
  // Called on rank 0 after step STEP with each rank's median compute and median phase (step start
  // to its last schedule action) over the steps since the last plan started, and the median step
  // itself; returns the plan to switch to.
  std::function<std::shared_ptr<Plan>(int64_t step, const std::map<int, double>& compute, const std::map<int, double>& phase,
                                      double step_s)>
      replan;
  // Rank 0: the running plan's step as the last calibration predicted it (PlanCost::to_json with
  // "calibrated_after_step"), filled by REPLAN's caller; the final report compares the measured
  // step with it (and with the plan's own prediction beside it). Shared across re-plans.
  std::shared_ptr<nlohmann::json> calibrated_prediction;
  // Tags this trainer's store keys and process groups: a later Trainer in the same World (after a
  // re-plan) must not meet the keys the earlier one left behind.
  std::string generation;
};

struct StepRecord {
  int64_t step;  // 1-based: the number of optimizer steps completed
  double loss, lr, grad_norm, step_s, tokens_per_s;
  double compute_s = 0, sync_wait_s = 0;  // this rank's share
  double phase_s = 0;  // from the step's start to this rank's last schedule action
  double tp_comm_s = 0;  // inside compute_s: the tensor-parallel group's exchanges (0 without TP)
};

struct TrainResult {
  std::vector<StepRecord> steps;                      // the steps this invocation ran
  std::vector<std::pair<int64_t, double>> val_loss;   // (step, loss)
  std::string checkpoint;                             // last checkpoint written
  int64_t peak_activation_bytes = 0;                  // this rank, over the run
  int64_t peak_in_flight = 0;
  int64_t peak_grad_bytes = 0;                        // this rank's gradients after the sync, largest step
  // The heap's peak in the steps over what it held before the model was built: weights,
  // gradients, optimizer state, sync buffers, gathered layers and activations together (what
  // the cost model's per-rank memory predicts).
  int64_t peak_model_memory_bytes = 0;
  std::shared_ptr<Plan> next_plan;                    // set when run() stopped early to switch plans
  // Set when run() stopped at a checkpoint because an elastic launcher has a device to take back
  // (ALLOY_REJOIN_FILE): `alloy train` exits with dist::kExitRejoin and is started again with it.
  bool stopped_for_rejoin = false;
  int64_t checkpoints = 0;          // saved by this invocation
  double checkpoint_pause_s = 0;    // the training thread's time in them (the rest was written in the background)
};


class Trainer {
 public:
  explicit Trainer(Config cfg, TrainOptions opts = {});
  ~Trainer();
  TrainResult run();

  // Mean token loss of the validation set's first eval_batches global batches (every rank calls).
  double validation_loss();
  model::Transformer& model() { return *model_; }
  const Plan& plan() const { return *plan_; }

 private:
  // SAMPLES (dataset indices) cut into micro-batches of MBS rows; FIRST_PLACE: the first's place in
  // the global batch (MicroBatch::samples, the dropout masks' keys).
  std::vector<pipeline::MicroBatch> micro_batches(const data::TokenWindows& src, const std::vector<uint64_t>& samples,
                                                  int64_t mbs, int64_t first_place = 0) const;
  double all_sum(double v);
  bool rejoin_requested();  // collective: an elastic launcher asks the job to stop at this checkpoint
  void save(int64_t step);   // the snapshot now; the files in the background (train.async_checkpoint)
  void finish_saves();       // every rank: the save in flight is published before this returns
  void load(const std::string& dir, bool with_optimizer);
  void build_groups();
  void plan_shards();
  void load_sync_state(const std::string& ckpt_dir);
  void publish_rank_stats(const TrainResult& r);
  std::shared_ptr<Plan> replan_now(const TrainResult& r, int64_t step);

  Config cfg_;
  TrainOptions opts_;
  std::shared_ptr<Plan> plan_;
  std::shared_ptr<dist::World> world_;
  int rank_ = 0;
  Plan::Position pos_;
  at::Device device_{at::kCPU};
  std::unique_ptr<data::TokenWindows> train_, valid_;
  std::unique_ptr<data::GlobalBatchSampler> sampler_;
  // Tensor parallelism (model/tensor_parallel.h): this rank's pieces and heads, and its stage's
  // group (null when the stage has one rank). Declared before the model, which points into them.
  std::unique_ptr<model::TpLayout> tp_;
  std::unique_ptr<dist::GroupTpComm> tp_comm_;
  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<dist::SyncLayout> sync_;  // parameter -> holders, holder sets (from the plan)
  std::vector<std::shared_ptr<dist::Group>> groups_;
  std::unique_ptr<dist::Reducer> reducer_;
  // ZeRO (train.zero_stage > 0): every exactly synced holder set of this rank, its parameters in
  // backward order and its members' bounds; this rank's AdamW covers only its own ranges.
  struct ShardSpec {
    std::vector<int> ranks;
    int64_t stage = 0;
    std::vector<model::Param*> params;
    std::vector<int64_t> bounds;
    at::Tensor values, grads;  // stage 3: this rank's shard of the values and of the reduced gradients
  };
  std::vector<ShardSpec> shard_specs_;
  // This rank's parameters by the set of ranks holding them (two or more), in backward order.
  std::map<std::vector<int>, std::vector<model::Param*>> set_params_;
  std::unique_ptr<dist::Sharding> sharding_;  // stages 1 and 2
  std::unique_ptr<dist::Zero3> zero3_;        // stage 3: the model's layer hooks
  std::vector<model::ParamSlice> counted_;  // each element of the model once over all ranks: the norm
  std::set<std::string> sparse_params_;  // synced by a sparsifier: AdamW reads them linearly
  bool any_sparse_set_ = false;          // some holder set of the plan is (on any rank)
  std::unique_ptr<dist::PipeChannels> channels_;  // before exec_, which sends on them
  std::unique_ptr<pipeline::StageExecutor> exec_;
  int64_t start_step_ = 0;
  int64_t replan_at_ = 0;  // the next step after which the ranks measure (TrainOptions::replan_at, remeasure_after)
  // train.rebalance: the replicas' shares of the global batch, moved as their speeds drift; null
  // when off or when the plan is not replicas of one stage each.
  std::unique_ptr<ShareBalancer> balancer_;
  // Every rank holds the whole model and its whole summed gradient (replicas of one stage, neither
  // sharded nor split): the step's figures are summed ahead of the sync (train/step_figures.h).
  bool figures_ahead_ = false;
  std::string base_;  // where the frozen base came from (LoRA checkpoints name it)
  int64_t memory_before_model_ = 0;  // the device's memory in use before this rank built its slice (model memory is measured above it)
  model::LossScaler scaler_{false, 1.0, 1};  // train.loss_scaling (set in the constructor)
  double checkpoint_pause_s_ = 0;  // the training thread's time in save(), all saves
  int64_t checkpoints_saved_ = 0;
  // Last: destroyed first, so a save in flight finishes while everything it was copied from exists.
  std::unique_ptr<CheckpointWriter> writer_;
};

}  // namespace alloy::train
