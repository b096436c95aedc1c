// A Trainer's construction, kept out of trainer.cpp so the step loop reads on its own: what every
// rank checks and builds once before its first step (the plan and data agreed, its slice of the
// model, resumed state, sharding, and the process groups and reducer of gradient sync).
#include "alloy/train/trainer.h"
#include "alloy/train/stage_links.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>

#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/text.h"
#include "alloy/dist/compress/comm.h"
#include "alloy/dist/pipe_channels.h"
#include "alloy/dist/reducer.h"
#include "alloy/dist/sharding.h"
#include "alloy/dist/sync_layout.h"
#include "alloy/dist/world.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/dist/zero3.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/train/checkpoint.h"
#include "alloy/model/precision.h"
#include "alloy/train/finetune.h"

namespace alloy::train {

namespace {
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

Trainer::~Trainer() {
  // Leaving normally (not unwinding an error): no neighbour's last message may be in flight when
  // the channels' communicators go (NCCL aborts their work). Both ends of every channel pass here.
  if (channels_ && std::uncaught_exceptions() == 0) {
    try {
      channels_->close();
    } catch (const std::exception& e) {
      log_warn(std::string("pipeline channels: ") + e.what());
    }
  }
}

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
  if (world_) world_->check_same("config and plan", job_fingerprint(cfg_, *plan_), opts_.generation);
  const dist::ChannelMode channel_mode = dist::channel_mode_from_env();
  if (world_) world_->check_same("ALLOY_PIPE_CHANNELS", dist::to_string(channel_mode), opts_.generation);
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
  if (pl.interleaved()) {
    // Its chunks, spread through the model (Plan's virtual stages).
    std::vector<model::LayerRange> chunks;
    for (int c : plan_->chunks_of(rank_)) {
      const StagePlan& ch = pl.stages[static_cast<size_t>(c)];
      chunks.push_back(model::LayerRange::for_units(ch.unit_begin(), ch.unit_end(), cfg_.model.layers));
    }
    model_ = std::make_unique<model::Transformer>(cfg_.model, chunks, static_cast<uint64_t>(cfg_.train.seed));
  } else {
    model_ = std::make_unique<model::Transformer>(
        cfg_.model, model::LayerRange::for_units(st.unit_begin(), st.unit_end(), cfg_.model.layers),
        static_cast<uint64_t>(cfg_.train.seed), tp_.get());
  }
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
    // After the tensor-parallel groups (every rank's are made before any rank opens channels,
    // which wait for their other ends) and before the gradient-sync groups.
    channels_ = dist::PipeChannels::open(*world_, opts_.generation + "pipe", message_streams(links, rank_), channel_mode, device_);
    links.channels = channels_.get();
    if (channels_) log_info("pipeline messages: " + channels_->describe());
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
  if (pl.interleaved())
    for (int c : plan_->chunks_of(rank_))
      exec_->chunk_units.emplace_back(pl.stages[static_cast<size_t>(c)].unit_begin(), pl.stages[static_cast<size_t>(c)].unit_end());
  if (!resume_dir.empty()) scaler_.restore(resumed.loss_scale, resumed.loss_scale_good_steps);
  if (world_) build_groups();
  // Replicas of the whole model, one stage of one rank each, or why not: samples move among them
  // without state (train.rebalance), and each ends the sync with the whole summed gradient.
  std::string not_replicas;
  for (size_t p = 0; p < plan_->pipelines.size() && not_replicas.empty(); ++p)
    if (plan_->pipelines[p].stages.size() != 1)
      not_replicas = "pipeline " + std::to_string(p) + " has " + std::to_string(plan_->pipelines[p].stages.size()) + " stages";
  if (not_replicas.empty() && plan_->has_tensor_parallel()) not_replicas = "it has tensor-parallel groups";
  if (world_ && world_->size() > 1 && not_replicas.empty() && shard_specs_.empty()) {
    // Unsharded too: the gradient norm is the same on every rank and the step's figures go ahead
    // of the sync (train/step_figures.h). The norm then counts every parameter on every rank, in
    // the order the lowest rank counted them for the sum: the same bits as before.
    figures_ahead_ = true;
    counted_.clear();
    for (auto* p : model_->trainable()) counted_.push_back({p});
  }
  if (cfg_.train.rebalance && world_ && plan_->pipelines.size() > 1) {
    // A pipeline's stages or a tensor-parallel group would each need the schedule's and the cost
    // model's view of a step.
    if (not_replicas.empty()) {
      std::vector<int64_t> base;
      for (const auto& pl : plan_->pipelines) base.push_back(pl.samples());
      balancer_ = std::make_unique<ShareBalancer>(base);
    } else if (rank_ == 0) {
      log_warn("train.rebalance: off under this plan (" + not_replicas + "); it moves samples among data-parallel replicas of one stage each");
    }
  }
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
      world_->all().route_sums(p2p, {tree});
    }
  }
  for (const auto& set : sync_->sets()) {
    if (!in(set.ranks)) continue;
    SetGroups& g = mine[set.ranks];
    if (!set.hierarchical) {
      g.all = world_->new_group(gen + set.name, set.ranks);
      groups_.push_back(g.all);
      if (!set.trees.empty()) {
        // Its sums go along the tree, point to point over a group of their own.
        auto p2p = world_->new_group(gen + set.name + "-tree", set.ranks);
        groups_.push_back(p2p);
        g.all->route_sums(p2p, set.trees);
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
      if (set.trees.empty()) continue;
      std::string trees;
      for (const SyncTree& t : set.trees) {
        std::string edges;
        for (size_t m = 0; m < set.ranks.size(); ++m)
          if (t.parent[m] >= 0)
            edges += (edges.empty() ? "" : ", ") + std::to_string(set.ranks[static_cast<size_t>(t.parent[m])]) + "-" + std::to_string(set.ranks[m]);
        const std::string root = t.twin >= 0 ? "ranks " + std::to_string(set.ranks[static_cast<size_t>(t.root)]) + " and " +
                                                   std::to_string(set.ranks[static_cast<size_t>(t.twin)]) + " at the root edge"
                                             : "rank " + std::to_string(set.ranks[static_cast<size_t>(t.root)]) + " at the root";
        trees += std::string(trees.empty() ? "" : "; ") + root + ", edges " + edges;
      }
      log_info("gradient sync: holder set " + join(set.ranks, ",") + " sums along " +
               (set.trees.size() > 1 ? std::to_string(set.trees.size()) + " trees, each a slice," : std::string("a tree")) +
               " around its slow link(s) (" + trees + ")");
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
    auto hints = saved.find("dgc_hint/" + cs->name());
    if (hints != saved.end()) {
      const at::Tensor h = hints->second.to(at::kDouble).contiguous();
      if (h.numel() % 2 != 0)
        throw InputError(dir, "gradient-compression state 'dgc_hint/" + cs->name() + "' has an odd number of entries (" +
                                  std::to_string(h.numel()) + "); it holds (offset, hint) pairs");
      const double* p = h.data_ptr<double>();
      st.dgc_hint.clear();
      for (int64_t i = 0; i < h.numel(); i += 2) st.dgc_hint[static_cast<int64_t>(p[i])] = p[i + 1];
    }
  }
}

}  // namespace alloy::train
