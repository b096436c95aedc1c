#include "alloy/train/trainer.h"
#include "alloy/train/stage_links.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/dist/compress/comm.h"
#include "alloy/dist/reducer.h"
#include "alloy/dist/sharding.h"
#include "alloy/dist/sync_layout.h"
#include "alloy/dist/world.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/dist/zero3.h"
#include "alloy/model/lora.h"
#include "alloy/model/weights.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/planner.h"
#include "alloy/train/checkpoint.h"
#include "alloy/model/precision.h"
#include "alloy/train/finetune.h"
#include "alloy/train/metrics.h"

namespace alloy::train {

namespace {
std::string join(const std::vector<int>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}
// What every rank must agree on: the model, the data order, the optimisation and the plan. Thread
// counts, devices and output paths may differ per rank.
std::string job_fingerprint(const Config& c, const Plan& p) {
  nlohmann::json j = c.to_json();
  j["train"].erase("threads");
  j["train"].erase("device");
  j.erase("output");
  j["plan"] = p.to_json();
  j["plan"].erase("predicted");
  return j.dump();
}
}  // namespace

Trainer::~Trainer() = default;

Trainer::Trainer(Config cfg, TrainOptions opts) : cfg_(std::move(cfg)), opts_(std::move(opts)), replan_at_(opts_.replan_at) {
  cfg_.validate();
  configure_threads(cfg_.train.threads);
  device_ = at::Device(rank_device(cfg_));
  {
    const auto& t = cfg_.train;
    const bool scaling = t.loss_scaling == "dynamic" || (t.loss_scaling == "auto" && t.precision == "fp16");
    scaler_ = model::LossScaler(scaling, t.loss_scale_init, t.loss_scale_window);
  }
  world_ = opts_.world;
  if (world_) world_->set_device(device_);  // before any group: all-CUDA groups get NCCL
  rank_ = world_ ? world_->rank() : 0;
  plan_ = opts_.plan ? opts_.plan : std::make_shared<Plan>(Plan::single_device(cfg_));
  if (plan_->global_batch != cfg_.train.global_batch)
    throw InputError("plan", "global_batch " + std::to_string(plan_->global_batch) + " differs from train.global_batch " +
                                 std::to_string(cfg_.train.global_batch));
  plan_->validate(cfg_.model, "plan");
  const int job_size = world_ ? world_->size() : 1;
  if (plan_->world_size() != job_size)
    throw InputError("plan", "needs " + std::to_string(plan_->world_size()) + " ranks but the job has " +
                                 std::to_string(job_size) + " (world size)");
  if (world_) world_->check_same("config and plan" + opts_.generation, job_fingerprint(cfg_, *plan_));
  pos_ = plan_->locate(rank_);
  const PipelinePlan& pl = plan_->pipelines[static_cast<size_t>(pos_.pipeline)];
  const StagePlan& st = pl.stages[static_cast<size_t>(pos_.stage)];

  auto paths = data::resolve_dataset_paths(cfg_.data.prefix, cfg_.data.valid_prefix);
  auto train_ds = std::make_shared<data::IndexedDataset>(data::IndexedDataset::open(paths.train));
  // data.split (Megatron's --split) carves one dataset into consecutive token ranges; a dataset with
  // its own validation file keeps it.
  const auto [train_share, valid_share] = cfg_.data.split_fractions();
  const bool carve = paths.valid.empty() && !cfg_.data.split.empty();
  const uint64_t tokens = train_ds->total_tokens();
  const auto cut = [&](double f) { return static_cast<uint64_t>(std::llround(f * static_cast<double>(tokens))); };
  train_ = std::make_unique<data::TokenWindows>(train_ds, cfg_.model.seq_len, paths.train + (carve ? " (data.split's training share)" : ""),
                                                0, carve ? cut(train_share) : 0);
  if (!carve && !cfg_.data.split.empty() && rank_ == 0 && !opts_.quiet)
    log_info("data.split " + cfg_.data.split + ": not applied, " + paths.valid + " is the validation set");
  if (train_->max_token() >= cfg_.model.vocab_size)
    throw InputError(paths.train, "holds token id " + std::to_string(train_->max_token()) +
                                      ", which does not fit model.vocab_size " + std::to_string(cfg_.model.vocab_size));
  if (!paths.valid.empty()) {
    auto valid_ds = std::make_shared<data::IndexedDataset>(data::IndexedDataset::open(paths.valid));
    // `alloy data prepare --valid-fraction 0` leaves an empty validation file: no validation, not a failure.
    if (valid_ds->total_tokens() <= static_cast<uint64_t>(cfg_.model.seq_len)) {
      if (rank_ == 0 && !opts_.quiet)
        log_warn(paths.valid + " holds " + std::to_string(valid_ds->total_tokens()) + " tokens, fewer than one sample of " +
                 std::to_string(cfg_.model.seq_len + 1) + ": training without validation");
    } else {
      valid_ = std::make_unique<data::TokenWindows>(valid_ds, cfg_.model.seq_len, paths.valid);
    }
  } else if (carve && valid_share > 0) {
    valid_ = std::make_unique<data::TokenWindows>(train_ds, cfg_.model.seq_len, paths.train + " (data.split's validation share)",
                                                  cut(train_share), cut(train_share + valid_share));
  }
  sampler_ = std::make_unique<data::GlobalBatchSampler>(train_->num_samples(), static_cast<uint64_t>(cfg_.train.seed));

  // This rank's slice of the model, with exactly the weights the full model would have. What
  // changes the model applies here, in this order: base weights (--init-from; a resumed LoRA run
  // re-reads the base its checkpoint names), LoRA (adapters, frozen and maybe quantized base),
  // the device, recomputation; then sharding (plan_shards, build_groups) over what trains.
  memory_before_model_ = pipeline::memory_in_use(device_);
  if (const std::string why = plan_->training_problem(cfg_); !why.empty()) throw InputError("plan", why);
  if (cfg_.train.sequence_parallel && !plan_->has_tensor_parallel() && rank_ == 0)
    log_warn("train.sequence_parallel has no effect: the plan has no tensor-parallel stage");
  if (plan_->has_pieces()) {
    tp_ = std::make_unique<model::TpLayout>(dist::tp_layout(*plan_, cfg_.model, rank_));
    tp_->sequence_parallel = cfg_.train.sequence_parallel || st.sequence_parallel;
    // Every rank is in at most one stage, so the groups are created in plan order without waiting
    // on each other.
    if (st.tp() > 1) {
      std::string name = opts_.generation + "tp";
      for (int r : st.ranks) name += "-" + std::to_string(r);
      tp_comm_ = std::make_unique<dist::GroupTpComm>(world_->new_group(name, st.ranks));
      tp_->comm = tp_comm_.get();
      if (tp_->sequence_parallel && pos_.tp_rank == 0 && !opts_.quiet) {
        const auto b = st.sequence_bounds(cfg_.model.heads, cfg_.model.seq_len);
        std::string shares;
        for (size_t i = 0; i + 1 < b.size(); ++i) shares += (i ? ":" : "") + std::to_string(b[i + 1] - b[i]);
        log_info("tensor-parallel ranks " + join(st.ranks, "+") + ": sequence parallel, positions " + shares + " of " +
                 std::to_string(cfg_.model.seq_len));
      }
    }
  }
  model_ = std::make_unique<model::Transformer>(
      cfg_.model, model::LayerRange::for_units(st.unit_begin(), st.unit_end(), cfg_.model.layers),
      static_cast<uint64_t>(cfg_.train.seed), tp_.get());
  std::string resume_dir;
  CheckpointState resumed;
  if (!opts_.resume.empty()) {
    resume_dir = resolve_checkpoint(opts_.resume);
    resumed = read_checkpoint_state(resume_dir);
    check_same_model(resume_dir, resumed, cfg_.model);
  }
  // Recorded absolute: a resumed run may start elsewhere. --init-from on a resume replaces it (the
  // base moved).
  base_ = !opts_.init_weights.empty() ? std::filesystem::absolute(opts_.init_weights).lexically_normal().string()
                                      : resume_dir.empty() ? std::string() : resumed.base;
  if (!base_.empty() && (resume_dir.empty() || cfg_.lora.enabled())) {
    std::vector<std::string> notes;
    load_base_weights(*model_, base_, &notes);
    if (rank_ == 0 && !opts_.quiet) {
      log_info((resume_dir.empty() ? "initial weights from " : "base weights from ") + base_);
      for (const auto& n : notes) log_warn(base_ + ": " + n);
    }
  }
  model_->apply_lora(cfg_.lora, static_cast<uint64_t>(cfg_.train.seed));
  if (tp_comm_) tp_comm_->take_busy();  // a quantized base's setup sums belong to no step
  model_->to(device_);
  model_->set_recompute(cfg_.train.recompute || st.recompute);
  if (pos_.tp_rank > 0) {
    // What the group holds whole (norms, row-parallel biases, embedding, head) gets the same
    // gradient on each of its ranks; the first rank's alone joins the sum over holders. LoRA
    // factors beside split projections get each rank's part, and all parts join.
    for (auto* p : model_->trainable())
      if (p->name.find('#') == std::string::npos && !p->tp_partial)
        p->tensor.register_hook([](const at::Tensor& g) { return at::zeros_like(g); });
  }
  sync_ = std::make_unique<dist::SyncLayout>(*plan_, cfg_.model, cfg_.lora);
  plan_shards();

  if (!resume_dir.empty()) {
    const CheckpointState& cs = resumed;
    if (cs.config.lora.enabled() != cfg_.lora.enabled())
      throw InputError(resume_dir + "/state.json", std::string("was written by a run ") + (cs.config.lora.enabled() ? "with" : "without") +
                                                       " LoRA and this one is " + (cfg_.lora.enabled() ? "with" : "without") +
                                                       " it: to fine-tune a pretrained checkpoint start from it with --init-from");
    if (cs.consumed_samples != static_cast<uint64_t>(cs.step * cfg_.train.global_batch))
      throw InputError(resume_dir + "/state.json", "consumed_samples " + std::to_string(cs.consumed_samples) + " does not match step " +
                                                       std::to_string(cs.step) + " x train.global_batch " +
                                                       std::to_string(cfg_.train.global_batch) + ": the global batch changed");
    load_params(resume_dir, model_->trainable());
    load_optimizer(resume_dir, *opt_, cs.optimizer_steps);
    start_step_ = cs.step;
    if (rank_ == 0) log_info("resumed from " + resume_dir + " at step " + std::to_string(start_step_));
  }

  pipeline::StageLinks links;
  if (pl.stages.size() > 1) {
    links = stage_links(pl, pos_.stage, rank_, pos_.tp_rank, plan_->has_tensor_parallel(),
                        plan_->has_tensor_parallel() ? world_->machines() : std::vector<std::string>{});
    links.group = &world_->all();
  }
  exec_ = std::make_unique<pipeline::StageExecutor>(*model_, links);
  if (const std::string why = model::autocast_problem(device_, cfg_.train.precision); !why.empty())
    throw InputError("train.precision", why);
  exec_->precision = cfg_.train.precision;
  exec_->counts_loss = pos_.tp_rank == 0;
  if (pos_.stage > 0) exec_->in_width = pl.message_width(static_cast<size_t>(pos_.stage) - 1, cfg_.model.hidden);
  if (static_cast<size_t>(pos_.stage) + 1 < pl.stages.size()) exec_->out_width = pl.message_width(static_cast<size_t>(pos_.stage), cfg_.model.hidden);
  if (pl.floats())
    for (int64_t m = 0; m < pl.num_micro_batches; ++m) exec_->mb_units.push_back(pl.units_of(static_cast<size_t>(pos_.stage), m));
  if (!resume_dir.empty()) scaler_.restore(resumed.loss_scale, resumed.loss_scale_good_steps);
  if (world_) build_groups();
  if (!resume_dir.empty() && reducer_ && !reducer_->compressed().empty()) load_sync_state(resume_dir);
}

void Trainer::plan_shards() {
  // Which holder sets are sharded, at which stage and with which shares: the plan's `sharding`
  // entry for the set, else train.zero_stage / train.shard_ratio. Each parameter is counted once
  // for the gradient norm: by the lowest rank holding it, or (sharded) by each range's owner.
  // AdamW gets the same slices for sharded sets, whole tensors elsewhere. Only what trains: with
  // LoRA the adapters.
  auto params = model_->trainable();
  for (auto* p : params) {
    const auto& r = sync_->holders(p->name);
    if (r.size() >= 2) set_params_[r].push_back(p);
  }
  // Backward order (the Reducer's buckets fill in it), the same on every holder.
  for (auto& [ranks, ps] : set_params_)
    std::sort(ps.begin(), ps.end(), [&](const model::Param* a, const model::Param* b) {
      return sync_->model_order(a->name) > sync_->model_order(b->name);
    });
  for (size_t i = 0; i < plan_->sharding.size(); ++i) {
    const auto& e = plan_->sharding[i];
    if (!sync_->set_of(e.ranks)) {
      std::string known;
      for (const auto& hs : sync_->sets()) known += (known.empty() ? "" : "; ") + join(hs.ranks, ",");
      throw InputError("plan", "sharding[" + std::to_string(i) + "].ranks " + join(e.ranks, ",") +
                                   " do not hold the same layers (the groups that do: " + (known.empty() ? "none" : known) + ")");
    }
  }
  const auto ratio = cfg_.train.shard_shares();
  std::map<const model::Param*, std::vector<model::ParamSlice>> mine;
  for (auto& [ranks, ps] : set_params_) {
    const ShardingPlan* entry = plan_->sharding_of(ranks);
    int64_t stage = world_ ? (entry ? entry->stage : cfg_.train.zero_stage) : 0;
    if (stage == 0) continue;
    if (sync_->set_of(ranks)->compressed)
      throw InputError(entry ? "plan" : "train.zero_stage", "sharding the group of ranks " + join(ranks, ",") +
                                                              ", which grad_sync compresses (" + plan_->grad_sync.compression +
                                                              "), is not built yet: shard it or compress it");
    std::string split_schedule;  // a member's, when it splits the backward
    for (int r : ranks) {
      const std::string& sc = plan_->schedule_of(static_cast<size_t>(plan_->locate(r).pipeline));
      if (pipeline::splits_backward(sc)) split_schedule = sc;
    }
    if (stage == 3 && !split_schedule.empty())
      throw InputError(entry ? "plan" : "train.zero_stage", "ZeRO-3 with the " + split_schedule +
                                                              " schedule is not built (its weight passes need the layers "
                                                              "ZeRO-3 frees after their backward): use stage 1 or 2 for ranks " +
                                                              join(ranks, ",") + ", or the 1f1b schedule");
    if (stage == 3) {
      const std::string why = plan_->schedule_mismatch(ranks);
      if (!why.empty() && entry)
        throw InputError("plan", "sharding stage 3 for ranks " + join(ranks, ",") + ": " + why +
                                     "; ZeRO-3 gathers each layer in every member's schedule, so the members must run the same one "
                                     "(give them equal micro-batch counts, or stage 2 for this group)");
      if (!why.empty()) {
        if (rank_ == ranks.front() && !opts_.quiet)
          log_warn("ZeRO-3 among ranks " + join(ranks, ",") + " cannot gather per layer (" + why + "): ZeRO-2 there");
        stage = 2;
      }
    }
    ShardSpec spec{ranks, stage, ps, {}};
    int64_t n = 0;
    for (auto* p : ps) n += p->tensor.numel();
    spec.bounds = dist::shard_bounds(
        n, entry && !entry->shares.empty()
               ? entry->shares
               : dist::set_shares(ranks, ratio, plan_->world_size(), "train.shard_ratio (--shard-ratio)"));
    const size_t me = static_cast<size_t>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
    const int64_t lo = spec.bounds[me], hi = spec.bounds[me + 1];
    for (auto* p : ps) mine[p];  // sharded, whether or not this rank owns any of it
    auto slices = dist::slices_in(ps, lo, hi);
    if (stage == 3) {  // the shard is where the parameters' values live between uses
      spec.values = at::zeros({hi - lo}, ps.front()->tensor.options().requires_grad(false));
      spec.grads = at::zeros_like(spec.values);
      int64_t at = 0;
      for (auto& sl : slices) {
        sl.value = spec.values.narrow(0, at, sl.numel);
        sl.grad = spec.grads.narrow(0, at, sl.numel);
        at += sl.numel;
      }
    }
    for (const auto& sl : slices) mine[sl.p].push_back(sl);
    if (rank_ == ranks.front() && !opts_.quiet)
      log_info("ZeRO-" + std::to_string(stage) + " among ranks " + join(ranks, ",") + ": optimizer state" +
               (stage == 3 ? ", gradients and parameters" : stage == 2 ? " and gradients" : "") + " sharded, " +
               std::to_string(hi - lo) + " of " + std::to_string(n) + " elements here");
    shard_specs_.push_back(std::move(spec));
  }
  std::vector<model::ParamSlice> update;
  for (auto* p : params) {
    auto it = mine.find(p);
    if (it == mine.end()) {
      update.push_back({p});
      if (sync_->holders(p->name).front() == rank_) counted_.push_back({p});
    } else {
      update.insert(update.end(), it->second.begin(), it->second.end());
      counted_.insert(counted_.end(), it->second.begin(), it->second.end());
    }
  }
  opt_ = std::make_unique<AdamW>(update, AdamW::from_config(cfg_.train));
}

void Trainer::build_groups() {
  // Process groups per holder set, created in the layout's (sorted) order by every rank that
  // belongs to them, so creation cannot deadlock: the set's group for exact or flat compressed
  // sync; for hierarchical sync one group per region and one for the regions' leaders.
  struct SetGroups {
    std::shared_ptr<dist::Group> all, region, leaders;
  };
  std::map<std::vector<int>, SetGroups> mine;
  const std::string gen = opts_.generation;
  auto in = [&](const std::vector<int>& v) { return std::find(v.begin(), v.end(), rank_) != v.end(); };
  // The step's figures (loss, gradient norm, sync figures) are summed over the whole world: along a
  // tree where its links are slow, as exact gradient sums are. Their cost is latency, and Gloo's
  // ring pays it many times over: among four ranks in two regions 20 ms apart (emulated), its sum
  // of 8 doubles took 203 ms (of 2 doubles, 41); the tree crosses once each way.
  {
    std::vector<int> ranks(static_cast<size_t>(world_->size()));
    for (int r = 0; r < world_->size(); ++r) ranks[static_cast<size_t>(r)] = r;
    const SyncTree tree = dist::sum_tree_of(ranks, plan_->slow_links);
    if (tree.empty()) {
      world_->all().clear_sum_route();
    } else {
      auto p2p = world_->new_group(gen + "world-tree", ranks);
      groups_.push_back(p2p);
      world_->all().route_sums(p2p, tree);
    }
  }
  for (const auto& set : sync_->sets()) {
    if (!in(set.ranks)) continue;
    SetGroups& g = mine[set.ranks];
    if (!set.hierarchical) {
      g.all = world_->new_group(gen + set.name, set.ranks);
      groups_.push_back(g.all);
      if (!set.tree.empty()) {
        // Its sums go along the tree, point to point over a group of their own.
        auto p2p = world_->new_group(gen + set.name + "-tree", set.ranks);
        groups_.push_back(p2p);
        g.all->route_sums(p2p, set.tree);
      }
      continue;
    }
    for (const auto& region : set.regions)
      if (region.size() > 1 && in(region)) {
        g.region = world_->new_group(gen + set.name + "-region-" + std::to_string(region.front()), region);
        groups_.push_back(g.region);
      }
    const auto leaders = set.leaders();
    if (in(leaders)) {
      g.leaders = world_->new_group(gen + set.name + "-leaders", leaders);
      groups_.push_back(g.leaders);
    }
  }
  // Buckets fill in backward order: parameters of the last layers first.
  std::map<std::vector<int>, dist::Reducer::ParamGroup> pgs;
  for (const auto& [r, ps] : set_params_) pgs[r] = {mine.at(r).all, ps, nullptr, {}};
  std::vector<dist::Reducer::ParamGroup> list;
  for (auto& [ranks, pg] : pgs) {
    const dist::HolderSet& set = *sync_->set_of(ranks);
    if (set.compressed) {
      const SetGroups& g = mine.at(ranks);
      dist::CompressedSync::Topology topo;
      if (!set.hierarchical) {
        topo.flat = dist::compress::group_comm(*g.all);
      } else {
        if (g.region) topo.region = dist::compress::group_comm(*g.region);
        if (g.leaders) topo.leaders = dist::compress::group_comm(*g.leaders);
        topo.regions = static_cast<int>(set.regions.size());
      }
      // The same seed on every member: the set and the run's seed, not the rank.
      uint64_t seed = static_cast<uint64_t>(cfg_.train.seed) * 1000003u;
      for (char c : set.name) seed = seed * 131 + static_cast<unsigned char>(c);
      pg.compressed = std::make_shared<dist::CompressedSync>(pg.params, std::move(topo), plan_->grad_sync, seed, set.name);
    }
    list.push_back(pg);
  }
  if (!shard_specs_.empty()) {
    std::vector<dist::Sharding::Set> ssets;
    std::vector<dist::Zero3::Set> zsets;
    for (const auto& spec : shard_specs_) {
      const auto& group = mine.at(spec.ranks).all;
      if (spec.stage == 3)
        zsets.push_back({group, spec.params, spec.bounds, spec.values, spec.grads});
      else
        ssets.push_back({group, spec.params, spec.bounds});
      for (auto& pg : list)
        if (pg.group == group && spec.stage >= 2) {
          pg.reduce_to = spec.bounds;
          pg.grad_shard = spec.grads;  // stage 3 only
        }
    }
    if (!ssets.empty()) sharding_ = std::make_unique<dist::Sharding>(std::move(ssets));
    if (!zsets.empty()) {
      zero3_ = std::make_unique<dist::Zero3>(*model_, std::move(zsets));
      model_->set_layer_hooks(zero3_.get());
    }
  }
  reducer_ = std::make_unique<dist::Reducer>(list, plan_->grad_sync.bucket_mb);
  if (zero3_) zero3_->drop_grads_when([r = reducer_.get()] { return r->armed(); });
  // Parameters that a sparsifier syncs reach AdamW as accumulated gradients now and then: after
  // the exact steps AdamW reads them linearly (optimizer.h), DGC's velocity standing for its
  // first moment.
  const GradSyncConfig& g = plan_->grad_sync;
  for (const auto& set : sync_->sets()) any_sparse_set_ |= g.linear_adam() && set.compressed;
  if (g.linear_adam()) {
    std::vector<std::string> names;
    for (const auto& pg : list)
      if (pg.compressed)
        for (const auto* p : pg.params) names.push_back(p->name);
    opt_->read_linearly(names, g.dense_steps, g.local_velocity() ? g.dgc_momentum : 0.0);
    // Measured: demo-gpt2 with DGC 0.01 after one exact step diverged by step 13 (NaN); 20 trained
    // within 0.5% of exact sync.
    if (rank_ == 0 && g.dense_steps < 10 && !names.empty())
      log_warn("grad_sync.dense_steps=" + std::to_string(g.dense_steps) +
               ": AdamW's frozen second moment then comes from fewer than 10 exact steps and training may diverge "
               "(default 20)");
    sparse_params_.insert(names.begin(), names.end());
  }
  if (rank_ == 0 && !opts_.quiet)
    for (const auto& set : sync_->sets()) {
      if (set.tree.empty()) continue;
      std::string edges;
      for (size_t m = 0; m < set.ranks.size(); ++m)
        if (set.tree.parent[m] >= 0)
          edges += (edges.empty() ? "" : ", ") + std::to_string(set.ranks[static_cast<size_t>(set.tree.parent[m])]) + "-" +
                   std::to_string(set.ranks[m]);
      log_info("gradient sync: holder set " + join(set.ranks, ",") + " sums along a tree around its slow link(s) (rank " +
               std::to_string(set.ranks[static_cast<size_t>(set.tree.root)]) + " at the root; edges " + edges + ")");
    }
  if (rank_ == 0 && plan_->grad_sync.lossy() && !opts_.quiet) {
    int compressed = 0, total = 0;
    for (const auto& set : sync_->sets()) total += 1, compressed += set.compressed ? 1 : 0;
    log_info("gradient sync: " + plan_->grad_sync.compression + " (density " + std::to_string(plan_->grad_sync.density) +
             ", fusion " + plan_->grad_sync.fusion + ", scope " + plan_->grad_sync.scope + ") on " + std::to_string(compressed) +
             " of " + std::to_string(total) + " holder sets; the others exact");
  }
}

void Trainer::load_sync_state(const std::string& dir) {
  auto saved = read_sync_state(dir, rank_, sync_->state_key(rank_, plan_->grad_sync));
  if (saved.empty()) {
    log_warn("rank " + std::to_string(rank_) + ": " + dir +
             " holds no gradient-compression state for this layout and grad_sync; error feedback starts empty");
    return;
  }
  at::NoGradGuard ng;
  for (auto& cs : reducer_->compressed()) {
    auto& st = cs->state();
    auto take = [&](const std::string& key, at::Tensor& dst) {
      auto it = saved.find(key);
      if (it == saved.end()) return;
      if (!dst.defined()) dst = at::zeros({cs->numel()}, at::kFloat);
      if (it->second.numel() != dst.numel())
        throw InputError(dir, "gradient-compression state '" + key + "' has " + std::to_string(it->second.numel()) +
                                  " elements, the set has " + std::to_string(dst.numel()));
      dst.copy_(it->second.reshape({-1}));
    };
    take("residual/" + cs->name(), st.residual);
    take("velocity/" + cs->name(), st.velocity);
    for (const auto& slot : cs->slots()) {
      auto it = saved.find("q/" + cs->name() + "/" + std::to_string(slot.offset));
      if (it != saved.end()) st.q[slot.offset] = it->second.clone();
    }
  }
}

std::vector<pipeline::MicroBatch> Trainer::micro_batches(const data::TokenWindows& src, const std::vector<uint64_t>& samples,
                                                         int64_t mbs, int64_t first_place) const {
  const int64_t T = cfg_.model.seq_len;
  const bool first = pos_.stage == 0;
  const bool last = pos_.stage + 1 == static_cast<int>(plan_->pipelines[static_cast<size_t>(pos_.pipeline)].stages.size());
  std::vector<pipeline::MicroBatch> out;
  // The last micro-batch may be short (validation sets rarely divide evenly).
  for (size_t i = 0; i < samples.size(); i += static_cast<size_t>(mbs)) {
    const int64_t rows = std::min<int64_t>(mbs, static_cast<int64_t>(samples.size() - i));
    pipeline::MicroBatch mb;
    mb.rows = rows;
    for (int64_t r = 0; r < rows; ++r) mb.samples.push_back(first_place + static_cast<int64_t>(i) + r);
    if (first || last) {
      std::vector<uint64_t> idx(samples.begin() + static_cast<long>(i), samples.begin() + static_cast<long>(i) + rows);
      at::Tensor t = at::empty({rows, T + 1}, at::kLong);
      src.gather(idx, t.data_ptr<int64_t>());
      t = t.to(device_);
      if (first) mb.inputs = t.narrow(1, 0, T);
      if (last) mb.targets = t.narrow(1, 1, T);
    }
    out.push_back(mb);
  }
  return out;
}

double Trainer::all_sum(double v) {
  if (!world_) return v;
  at::Tensor t = at::full({1}, v, at::kDouble);
  dist::wait_work(world_->all().allreduce_sum(t), "all-reduce of the step's loss");
  return t.item<double>();
}

double Trainer::validation_loss() {
  if (!valid_ || cfg_.train.eval_batches == 0) return std::nan("");
  // The validation set goes through pipeline 0; the other pipelines wait at the final sum.
  const auto& pl = plan_->pipelines[0];
  const int64_t mbs = pl.micro_batch_size, T = cfg_.model.seq_len;
  const uint64_t n = std::min<uint64_t>(valid_->num_samples(), static_cast<uint64_t>(cfg_.train.eval_batches * cfg_.train.global_batch));
  double sum = 0;
  // ZeRO-3: only pipeline 0 runs forwards here, so its layers cannot gather from the other
  // pipelines on demand: every member gathers everything first.
  if (zero3_) zero3_->pin_all();
  if (pos_.pipeline == 0 && n > 0) {
    std::vector<uint64_t> idx(n);
    for (uint64_t i = 0; i < n; ++i) idx[i] = i;
    sum = exec_->forward_only(micro_batches(*valid_, idx, mbs));
  }
  if (zero3_) {
    zero3_->unpin_all();
    zero3_->take_bytes_sent();  // not gradient sync
  }
  return all_sum(sum) / static_cast<double>(n * static_cast<uint64_t>(T));
}

bool Trainer::rejoin_requested() {
  // The launcher's file is seen by every rank of its machine; the ranks agree through a reduction
  // all the same, since they need not look at the same moment.
  static const char* path = std::getenv("ALLOY_REJOIN_FILE");
  if (!path || !*path) return false;
  double mine = file_exists(path) ? 1.0 : 0.0;
  if (!world_) return mine > 0;
  at::Tensor v = at::tensor({mine}, at::kDouble);
  dist::wait_work(world_->all().allreduce_sum(v), "all-reduce of the ranks' rejoin requests");
  return v.item<double>() > 0;
}

void Trainer::save(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  auto barrier = [&]() {
    if (world_) world_->all().barrier();
  };
  const int ws = world_ ? world_->size() : 1;
  std::vector<const model::Param*> owned;  // LoRA: the adapters alone (the base is CheckpointState::base)
  for (const auto* p : model_->trainable())
    if (sync_->holders(p->name).front() == rank_) owned.push_back(p);
  if (zero3_) zero3_->pin_all();  // whole parameters, written by their first holder
  ShardSnapshot snap = snapshot_shard(rank_, ws, owned, opt_.get());
  if (zero3_) {
    zero3_->unpin_all();
    zero3_->take_bytes_sent();
  }
  if (reducer_ && !reducer_->compressed().empty()) {
    for (const auto& cs : reducer_->compressed()) {
      const auto& st = cs->state();
      if (st.residual.defined()) snap.sync.emplace_back("residual/" + cs->name(), model::to_blob(st.residual));
      if (st.velocity.defined()) snap.sync.emplace_back("velocity/" + cs->name(), model::to_blob(st.velocity));
      for (const auto& [off, q] : st.q) snap.sync.emplace_back("q/" + cs->name() + "/" + std::to_string(off), model::to_blob(q));
    }
    snap.sync_key = sync_->state_key(rank_, plan_->grad_sync);
  }
  const std::string run_dir = cfg_.output.dir;
  const std::string staging = checkpoint_staging_dir(run_dir, step);
  std::function<void()> publish;
  if (rank_ == 0) {
    CheckpointState cs{step, static_cast<uint64_t>(step * cfg_.train.global_batch), opt_->steps_taken(), cfg_, ws, plan_->to_json(),
                       cfg_.lora.enabled() ? base_ : std::string()};
    if (scaler_.enabled()) {
      cs.loss_scale = scaler_.scale();
      cs.loss_scale_good_steps = scaler_.good_steps();
    }
    const int64_t keep = cfg_.train.keep_checkpoints;
    publish = [run_dir, cs, keep]() {
      publish_checkpoint(run_dir, cs);
      prune_checkpoints(run_dir, keep);
    };
  }
  if (cfg_.train.async_checkpoint) {
    if (!writer_) writer_ = std::make_unique<CheckpointWriter>(world_.get(), opts_.generation);
    writer_->start(step, staging, std::move(snap), publish);
  } else {
    if (rank_ == 0) begin_checkpoint(run_dir, step);
    barrier();
    write_shard(staging, snap);
    barrier();
    if (publish) publish();
    barrier();
  }
  checkpoint_pause_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++checkpoints_saved_;
}

void Trainer::finish_saves() {
  if (!writer_) return;
  writer_->wait();
  // Rank 0 returns from its wait only after publishing, so past this barrier every rank may read
  // the checkpoint (a plan switch resumes from it) or leave.
  if (world_) world_->all().barrier();
}

TrainResult Trainer::run() {
  const auto& t = cfg_.train;
  const PipelinePlan& pl = plan_->pipelines[static_cast<size_t>(pos_.pipeline)];
  const int64_t T = cfg_.model.seq_len, gb = t.global_batch, S = static_cast<int64_t>(pl.stages.size());
  const int64_t offset = plan_->sample_offset(pos_.pipeline), mine = pl.samples();
  // Every micro-batch's loss is divided by the tokens of the whole global batch, so the summed
  // gradient is the gradient of the global-batch mean however the batch is cut.
  const double batch_tokens = static_cast<double>(gb * T);
  const bool lead = rank_ == 0;
  const bool quiet = opts_.quiet || !lead;
  const auto actions = pipeline::make_schedule(plan_->schedule_of(static_cast<size_t>(pos_.pipeline)), pos_.stage, S, pl.num_micro_batches);

  ensure_writable_dir(cfg_.output.dir);
  std::unique_ptr<Metrics> metrics;
  if (lead) {
    // Before any rank can save (that needs this rank in the first step's reductions).
    remove_stale_staging(cfg_.output.dir);
    write_file_atomic(cfg_.output.dir + "/config.yaml", cfg_.to_yaml());
    plan_->save(cfg_.output.dir + "/plan.json");
    metrics = std::make_unique<Metrics>(cfg_.output.dir, cfg_.output.tensorboard, opts_.resume.empty() ? -1 : start_step_,
                                        cfg_.output.tensorboard_dir);
  }
  if (lead && !opts_.quiet && start_step_ == 0) {
    auto full = model::Transformer::full(cfg_.model, 0);
    log_info("model " + cfg_.model.arch + ": " + format_count(static_cast<double>(full->num_parameters())) + " parameters; " +
             std::to_string(train_->num_samples()) + " training samples of " + std::to_string(T) + " tokens; device " +
             device_.str());
    if (cfg_.lora.enabled()) {
      LoraConfig counted = cfg_.lora;
      counted.base_dtype = "fp32";  // counting needs no quantization
      full->apply_lora(counted, 0);
      int64_t adapters = 0;
      for (const auto* p : full->trainable()) adapters += p->numel();
      log_info("LoRA rank " + std::to_string(cfg_.lora.rank) + " on " + std::to_string(model::lora_modules(cfg_.model, cfg_.lora).size()) +
               " projections: " + format_count(static_cast<double>(adapters)) + " trainable parameters (" +
               std::to_string(100.0 * static_cast<double>(adapters) / static_cast<double>(full->num_parameters())).substr(0, 5) +
               "% of the model); base frozen" + (cfg_.lora.base_dtype == "fp32" ? "" : ", its projections in " + cfg_.lora.base_dtype));
    }
    if (plan_->world_size() > 1) log_info("plan: " + plan_->describe());
  }

  TrainResult result;
  auto params = model_->trainable();
  // What clipping covers once sparse steps begin (see the gradient norm below).
  std::vector<model::Param*> dense_params;
  std::vector<model::ParamSlice> counted_dense;
  for (auto* p : params)
    if (!sparse_params_.count(p->name)) dense_params.push_back(p);
  for (const auto& sl : counted_)
    if (!sparse_params_.count(sl.p->name)) counted_dense.push_back(sl);
  Progress progress("train", static_cast<uint64_t>(t.steps), opts_.quiet);
  auto run_start = std::chrono::steady_clock::now();
  double last_val = std::nan("");
  const int64_t trace_step = opts_.trace.empty() ? -1 : std::min(start_step_ + 1, t.steps - 1);

  for (int64_t step = start_step_; step < t.steps; ++step) {
    if (world_) world_->set_progress(step);
    const bool tracing = step == trace_step;
    if (tracing && world_) world_->all().barrier();  // aligns the ranks' trace clocks
    auto t0 = std::chrono::steady_clock::now();
    if (tp_comm_) tp_comm_->take_busy();  // an evaluation's sums belong to no step
    exec_->tracing = tracing;
    exec_->set_trace_origin(t0);
    const double lr = lr_at(t, step);

    // This pipeline's consecutive slice of the global batch, cut into its micro-batches.
    std::vector<uint64_t> samples = sampler_->take(static_cast<uint64_t>(step * gb + offset), static_cast<uint64_t>(mine));
    if (reducer_) reducer_->begin_step(step, t0);
    pipeline::reset_memory_peak(device_);  // a CUDA allocator's exact peak over the step
    exec_->dropout_seed = static_cast<uint64_t>(cfg_.train.seed);
    exec_->step = step;
    double loss_local =
        exec_->run(actions, micro_batches(*train_, samples, pl.micro_batch_size, offset), batch_tokens / scaler_.scale(), reducer_.get());
    auto sync_t0 = std::chrono::steady_clock::now();
    const double phase_s = std::chrono::duration<double>(sync_t0 - t0).count();
    const dist::ReducerStats sync = reducer_ ? reducer_->finish() : dist::ReducerStats{};
    int64_t step_peak_bytes = std::max(exec_->peak_memory_bytes(), pipeline::memory_in_use(device_));  // the sync's buffers are still held
    if (zero3_) zero3_->end_step();
    int64_t grad_bytes_held = zero3_ ? zero3_->grad_shard_bytes() : 0;
    for (auto* p : params)
      if (p->tensor.grad().defined()) grad_bytes_held += p->tensor.grad().numel() * static_cast<int64_t>(p->tensor.grad().element_size());
    if (tracing && reducer_) {
      exec_->trace().push_back({"grad sync wait", "sync", std::chrono::duration<double, std::micro>(sync_t0 - t0).count(),
                                sync.wait_s * 1e6});
      for (const auto& sp : sync.compressed.spans) exec_->trace().push_back({sp.name, "compression", sp.start_us, sp.dur_us});
    }

    // Global gradient norm: each element counted once (counted_: by the lowest rank holding it,
    // or by its shard's owner). After the exact steps, sparsely synced parameters hold decoded
    // sums of accumulated gradients whose norm is many times the gradient's (10-50x at density
    // 0.01): clipping by it would shrink every update as much. They are reported in the norm but neither clipped nor counted for clipping.
    // Decided from the plan, the same on every rank (the reduction below must match in size).
    const bool split_clip = any_sparse_set_ && step >= plan_->grad_sync.dense_steps;
    const double norm_sq = global_grad_norm_sq(counted_);
    // One world sum for the step's figures, clipping's and the record's: where links are far
    // apart each sum costs round trips (plan::CostContext::world_sum_s).
    const auto& cs = sync.compressed;
    const int64_t gather_bytes = (sharding_ ? sharding_->gather_bytes_sent() : 0) +  // ZeRO's parameter all-gathers
                                 (zero3_ ? zero3_->take_bytes_sent() : 0);
    at::Tensor figures = at::tensor({loss_local, norm_sq, split_clip ? global_grad_norm_sq(counted_dense) : norm_sq,
                                     static_cast<double>(sync.bytes_sent + cs.bytes_sent + gather_bytes), static_cast<double>(cs.elements),
                                     static_cast<double>(cs.selected), cs.encode_s + cs.decode_s, cs.residual_sq},
                                    at::kDouble);
    if (world_) dist::wait_work(world_->all().allreduce_sum(figures), "all-reduce of the step's loss, gradient norm and sync figures");
    double sums[3] = {figures[0].item<double>(), figures[1].item<double>(), figures[2].item<double>()};
    const at::Tensor sync_fig = figures.narrow(0, 3, 5);
    const std::vector<model::Param*>& clipped = split_clip ? dense_params : params;
    // Dynamic loss scaling: the gradients are SCALE times the true ones. A non-finite norm (the
    // same on every rank: it was all-reduced) skips the step; otherwise they are unscaled
    // exactly (a power of two) before clipping.
    const double scale = scaler_.scale();
    const bool apply_step = scaler_.update(std::sqrt(sums[1]));
    if (scale != 1.0 && apply_step) {
      const double inv = 1.0 / scale;
      for (auto* p : params)
        if (p->tensor.grad().defined()) p->tensor.mutable_grad().mul_(inv);
      for (auto& spec : shard_specs_)
        if (spec.grads.defined()) spec.grads.mul_(inv);
      sums[1] *= inv * inv;
      sums[2] *= inv * inv;
    }
    const double grad_norm = std::sqrt(sums[1]);
    if (apply_step) {
      clip_to(clipped, std::sqrt(sums[2]), t.grad_clip);
      if (const double coef = clip_coef(std::sqrt(sums[2]), t.grad_clip); coef != 1.0)
        for (auto& spec : shard_specs_)
          if (spec.grads.defined()) spec.grads.mul_(coef);  // ZeRO-3's gradients live in the shards
      opt_->step(lr);
    } else {
      for (auto& spec : shard_specs_)
        if (spec.grads.defined()) spec.grads.zero_();
      if (lead)
        log_warn("step " + std::to_string(step + 1) + ": the gradients overflowed at loss scale 2^" +
                 std::to_string(static_cast<int>(std::log2(scale))) + ": step skipped, the scale is now 2^" +
                 std::to_string(static_cast<int>(std::log2(scaler_.scale()))));
    }
    // AdamW's state exists from its first step; on CUDA the allocator saw every transient peak.
    step_peak_bytes = std::max({step_peak_bytes, pipeline::memory_in_use(device_), pipeline::memory_peak(device_)});
    // Every parameter's, not only those AdamW updates here (under ZeRO a rank may own none of one);
    // before the gather, whose staging takes their place.
    for (auto* p : params)
      if (p->tensor.grad().defined()) p->tensor.mutable_grad().reset();
    if (sharding_) sharding_->gather_params();  // ZeRO: each owner's updated range to every holder

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepRecord rec{step + 1, sums[0] / batch_tokens, lr, grad_norm, step_s, batch_tokens / step_s, exec_->compute_s(), sync.wait_s,
                   phase_s};
    if (tp_comm_) rec.tp_comm_s = tp_comm_->take_busy().seconds;
    rec.grad_bytes = sync_fig[0].item<double>();
    rec.grad_elements = sync_fig[1].item<double>();
    rec.grad_selected = sync_fig[2].item<double>();
    rec.compress_s = sync_fig[3].item<double>();
    rec.residual_norm = std::sqrt(sync_fig[4].item<double>());
    result.steps.push_back(rec);
    result.peak_activation_bytes = std::max(result.peak_activation_bytes, exec_->peak_activation_bytes());
    result.peak_in_flight = std::max(result.peak_in_flight, exec_->peak_in_flight());
    result.peak_grad_bytes = std::max(result.peak_grad_bytes, grad_bytes_held);
    result.peak_model_memory_bytes = std::max(result.peak_model_memory_bytes, step_peak_bytes - memory_before_model_);
    if (tracing) {
      std::string path = opts_.trace;
      nlohmann::json events = nlohmann::json::array();
      for (const auto& e : exec_->trace())
        events.push_back({{"name", e.name}, {"ph", "X"}, {"ts", e.start_us}, {"dur", e.dur_us}, {"pid", rank_}, {"tid", e.stream}});
      if (!world_) {
        nlohmann::json doc = {{"traceEvents", events}};
        write_file_atomic(path, doc.dump() + "\n");
      } else {
        // Ranks hand their events to rank 0 through the store: no shared filesystem needed.
        std::string s = events.dump();
        world_->store().set("alloy/trace/" + std::to_string(rank_), std::vector<uint8_t>(s.begin(), s.end()));
        if (lead) {
          nlohmann::json all = nlohmann::json::array();
          for (int r = 0; r < world_->size(); ++r) {
            auto key = "alloy/trace/" + std::to_string(r);
            world_->store().wait({key});
            auto bytes = world_->store().get(key);
            for (auto& e : nlohmann::json::parse(std::string(bytes.begin(), bytes.end()))) all.push_back(e);
            auto pos = plan_->locate(r);
            all.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r},
                           {"args", {{"name", "rank " + std::to_string(r) + " (pipeline " + std::to_string(pos.pipeline) +
                                                 ", stage " + std::to_string(pos.stage) + ")"}}}});
          }
          write_file_atomic(path, nlohmann::json({{"traceEvents", all}}).dump() + "\n");
          log_info("wrote the schedule trace of step " + std::to_string(step + 1) + " to " + path);
        }
      }
    }

    nlohmann::json j = {{"step", rec.step},         {"loss", rec.loss},     {"lr", rec.lr},
                        {"grad_norm", std::isfinite(rec.grad_norm) ? nlohmann::json(rec.grad_norm) : nlohmann::json("inf")},
                        {"step_s", rec.step_s}, {"tokens_per_s", rec.tokens_per_s}};
    if (scaler_.enabled()) {
      j["loss_scale"] = scale;
      if (!apply_step) j["skipped"] = true;
    }
    if (world_) j["grad_bytes"] = rec.grad_bytes;  // put on the wire by all ranks for gradient sync
    if (rec.grad_elements > 0) {
      j["grad_density"] = rec.grad_selected / rec.grad_elements;  // of the compressed sets' elements
      j["compress_s"] = rec.compress_s;                          // compressing + decompressing, all ranks
      j["residual_norm"] = rec.residual_norm;                    // what error feedback holds back
    }
    const bool last = step + 1 == t.steps;
    if (valid_ && ((t.eval_interval > 0 && rec.step % t.eval_interval == 0) || last)) {
      last_val = validation_loss();
      j["val_loss"] = last_val;
      result.val_loss.emplace_back(rec.step, last_val);
    }
    std::shared_ptr<Plan> next_plan;
    if (world_ && replan_at_ > 0 && rec.step == replan_at_ && !last) {
      next_plan = replan_now(result, rec.step);
      if (next_plan) j["replanned"] = true;  // the steps after this one ran another plan
      // Kept: once more, later, over the longer window (every rank decides the same from opts_).
      replan_at_ = !next_plan && replan_at_ == opts_.replan_at && opts_.remeasure_after > 0 ? replan_at_ + opts_.remeasure_after : 0;
    }
    if (metrics) metrics->log(j);

    if (!quiet) {
      std::ostringstream extra;
      extra.precision(4);
      extra << "loss " << rec.loss;
      if (!std::isnan(last_val)) extra << " val " << last_val;
      extra << " | " << format_count(rec.tokens_per_s) << " tok/s";
      if (stderr_is_tty())
        progress.update(static_cast<uint64_t>(rec.step), extra.str());
      else if (rec.step % t.log_interval == 0 || last)
        log_info("step " + std::to_string(rec.step) + "/" + std::to_string(t.steps) + " " + extra.str() + " | lr " +
                 std::to_string(lr));
    }

    if (next_plan) {
      save(rec.step);
      finish_saves();
      result.checkpoints = checkpoints_saved_;
      result.checkpoint_pause_s = checkpoint_pause_s_;
      result.checkpoint = cfg_.output.dir + "/checkpoints/" + step_name(rec.step);
      result.next_plan = next_plan;
      if (!quiet && stderr_is_tty()) progress.finish();
      return result;
    }
    if ((t.checkpoint_interval > 0 && rec.step % t.checkpoint_interval == 0) || last) {
      save(rec.step);
      result.checkpoint = cfg_.output.dir + "/checkpoints/" + step_name(rec.step);
      if (!last && rejoin_requested()) {
        finish_saves();
        if (lead) log_info("a device is back (elastic launch): stopping at the checkpoint of step " + std::to_string(rec.step) +
                           " so the job starts again with it");
        result.stopped_for_rejoin = true;
        result.checkpoints = checkpoints_saved_;
        result.checkpoint_pause_s = checkpoint_pause_s_;
        if (!quiet && stderr_is_tty()) progress.finish();
        return result;
      }
    }
  }
  finish_saves();
  result.checkpoints = checkpoints_saved_;
  result.checkpoint_pause_s = checkpoint_pause_s_;
  publish_rank_stats(result);
  if (lead && cfg_.lora.enabled() && !result.checkpoint.empty()) {
    write_peft_adapter(result.checkpoint, cfg_.output.dir + "/adapter");  // what a PEFT user loads
    if (!opts_.quiet) log_info("LoRA adapters in PEFT's layout: " + cfg_.output.dir + "/adapter/");
  }
  if (!quiet && stderr_is_tty()) progress.finish();
  double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (!quiet && !result.steps.empty())
    log_info("trained " + std::to_string(result.steps.size()) + " steps in " + format_duration(total_s) +
             (result.checkpoint.empty() ? "" : "; checkpoint " + result.checkpoint));
  return result;
}

}  // namespace alloy::train
