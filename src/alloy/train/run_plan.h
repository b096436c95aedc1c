#pragma once
// From whatever the user gave to the one Plan every rank runs, and training under it while
// re-planning from measured speeds. `alloy train` is a thin wrapper around these two calls.
//
// Plan sources, first match wins:
//   --plan FILE            a plan written by hand or by `alloy plan`
//   --plan auto            profile the ranks (or reuse a profile), search on rank 0, hand the plan
//                          to the others through the store
//   --hetero-config FILE   HeteroShard's shard_plan
//   SynerFuse flags        --hetero-pipeline-stages, --micro-batch-size-per-dp, ...
//   several ranks          equal data parallelism
//   one rank               null: one device, the whole model
// Then the config's grad_sync settles the plan's gradient sync (plan::apply_grad_sync), and with
// grad_sync.scope slow-links the cluster (--cluster, or $ALLOY_CLUSTER under `alloy launch
// --emulate`) says which ranks a slow link joins.
#include <memory>
#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/search.h"
#include "alloy/train/trainer.h"

namespace alloy::train {

struct PlanSources {
  std::string plan_file;      // JSON path, "auto", or empty
  std::string hetero_config;  // HeteroShard hetero_config.json
  SynerFuseArgs synerfuse;
  std::string cluster;        // ClusterSpec for --plan auto and slow links; empty: $ALLOY_CLUSTER
  std::string profile;        // --plan auto: reuse this profile
};

// What --plan auto decided from, kept for re-planning.
struct AutoPlan {
  Plan plan;
  plan::ClusterSpec spec;
  plan::Profile profile;  // complete on rank 0 only
  plan::SearchOptions options;
};

struct ResolvedPlan {
  std::shared_ptr<Plan> plan;          // null: one device
  std::shared_ptr<AutoPlan> autoplan;  // set with --plan auto
};

bool synerfuse_given(const SynerFuseArgs& a);

// Every rank calls this with the same arguments. Throws InputError naming the flag, file or field.
ResolvedPlan resolve_plan(const Config& cfg, const PlanSources& src, int world_size, dist::World* world);

// Trains under RP. With --plan auto and a world, after train.replan_step steps rank 0 scales the
// profile by the compute each rank measured, searches again and, if a plan is 5% faster (or a
// batch split 2%), every rank checkpoints and a new Trainer resumes under it (at most twice).
// OUTPUT/replan.json records each decision. Returns every generation's steps.
TrainResult train_with_replanning(const Config& cfg, TrainOptions o, const ResolvedPlan& rp);

// Elastic launches (`alloy launch --rejoin-timeout`): the slots (ClusterSpec devices, or ranks as
// first launched) this job's ranks run on, in rank order, from ALLOY_MEMBERS; empty when the
// launcher is not elastic. With --plan auto the search plans onto these devices alone.
std::vector<int> elastic_members();
// POOL_SIZE devices, MEMBERS of them present: SPEC restricted to MEMBERS, in that order. Throws
// InputError when the spec does not have POOL_SIZE devices or a member is out of range.
plan::ClusterSpec spec_of_members(const plan::ClusterSpec& spec, const std::vector<int>& members, int pool_size);

// How many times the job has been restarted (ALLOY_RESTART from `alloy launch --max-restarts`,
// TORCHELASTIC_RESTART_COUNT from torchrun, SLURM_RESTART_COUNT); 0 the first time.
int restart_count();
// The run directory's last complete checkpoint, "" when it has none yet: rank 0 looks (skipping a
// torn or corrupt newest one), every rank takes its word through the store, so all resume from
// the same step or all start afresh.
std::string last_checkpoint_agreed(const Config& cfg, dist::World* world);

}  // namespace alloy::train
