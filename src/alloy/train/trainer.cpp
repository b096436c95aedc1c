#include "alloy/train/trainer.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/dist/reducer.h"
#include "alloy/dist/sharding.h"
#include "alloy/dist/sync_layout.h"
#include "alloy/dist/world.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/dist/zero3.h"
#include "alloy/model/lora.h"
#include "alloy/model/weights.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/finetune.h"
#include "alloy/train/metrics.h"
#include "alloy/train/step_figures.h"

namespace alloy::train {

std::vector<pipeline::MicroBatch> Trainer::micro_batches(const data::TokenWindows& src, const std::vector<uint64_t>& samples,
                                                         int64_t mbs, int64_t first_place) const {
  const int64_t T = cfg_.model.seq_len;
  const bool first = pos_.stage == 0;
  // The pipeline's last position holds its last stage (an interleaved pipeline's last chunk too).
  const bool last = pos_.stage + 1 == plan_->pipelines[static_cast<size_t>(pos_.pipeline)].depth();
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
  world_->all().sum_small(t, "sum of the step's loss");
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
      if (!st.dgc_hint.empty()) {
        // (offset, hint) pairs: a resumed run selects from the same hints, so the same elements
        at::Tensor hints = at::empty({static_cast<int64_t>(2 * st.dgc_hint.size())}, at::kDouble);
        double* h = hints.data_ptr<double>();
        for (const auto& [off, hint] : st.dgc_hint) *h++ = static_cast<double>(off), *h++ = hint;
        snap.sync.emplace_back("dgc_hint/" + cs->name(), model::to_blob(hints));
      }
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
  const int64_t T = cfg_.model.seq_len, gb = t.global_batch, S = pl.depth();
  // This pipeline's slice of each global batch; train.rebalance moves it between steps.
  int64_t offset = plan_->sample_offset(pos_.pipeline), mine = pl.samples();
  // Every micro-batch's loss is divided by the tokens of the whole global batch, so the summed
  // gradient is the gradient of the global-batch mean however the batch is cut.
  const double batch_tokens = static_cast<double>(gb * T);
  const bool lead = rank_ == 0;
  const bool quiet = opts_.quiet || !lead;
  auto schedule_of = [&](int64_t samples) {
    const int64_t m = pl.micro_batch_for(samples);
    const int64_t count = (samples + m - 1) / m;  // the last may be short
    return pipeline::make_schedule(plan_->schedule_of(static_cast<size_t>(pos_.pipeline)), pos_.stage, S, count, pl.virtual_stages);
  };
  auto actions = schedule_of(mine);
  const int64_t num_pipelines = static_cast<int64_t>(plan_->pipelines.size());

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
  StepFigures figures(world_ ? &world_->all() : nullptr, figures_ahead_, balancer_ ? num_pipelines : 0, metrics.get());
  Progress progress("train", static_cast<uint64_t>(t.steps), opts_.quiet);
  auto run_start = std::chrono::steady_clock::now();
  double last_val = std::nan("");
  if (!opts_.trace.empty() && opts_.trace_step > 0 && (opts_.trace_step <= start_step_ || opts_.trace_step > t.steps))
    throw InputError("--trace-step", "step " + std::to_string(opts_.trace_step) + " is not among this run's steps (" +
                                         std::to_string(start_step_ + 1) + " to " + std::to_string(t.steps) + ")");
  const int64_t trace_step = opts_.trace.empty() ? -1
                             : opts_.trace_step > 0 ? opts_.trace_step - 1
                                                    : std::min(start_step_ + 1, t.steps - 1);

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
    figures.begin(step);  // its receives posted now: the sum then crosses each link once
    pipeline::reset_memory_peak(device_);  // a CUDA allocator's exact peak over the step
    exec_->dropout_seed = static_cast<uint64_t>(cfg_.train.seed);
    exec_->step = step;
    double loss_local =
        exec_->run(actions, micro_batches(*train_, samples, pl.micro_batch_for(mine), offset), batch_tokens / scaler_.scale(), reducer_.get());
    const auto sum_t0 = std::chrono::steady_clock::now();
    figures.after_backward(loss_local, pos_.pipeline, exec_->compute_s());
    auto sync_t0 = std::chrono::steady_clock::now();
    if (tracing && figures.ahead())
      exec_->trace().push_back({"sum of the step's figures", "sync", std::chrono::duration<double, std::micro>(sum_t0 - t0).count(),
                                std::chrono::duration<double, std::micro>(sync_t0 - sum_t0).count()});
    const double phase_s = std::chrono::duration<double>(sum_t0 - t0).count();
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
    // The world's sums of the step's figures: clipping's norm, the loss, the record's.
    const auto& cs = sync.compressed;
    const int64_t gather_bytes = (sharding_ ? sharding_->gather_bytes_sent() : 0) +  // ZeRO's parameter all-gathers
                                 (zero3_ ? zero3_->take_bytes_sent() : 0);
    const auto late_t0 = std::chrono::steady_clock::now();
    StepFigures::Sums sums = figures.after_sync(
        norm_sq, split_clip ? global_grad_norm_sq(counted_dense) : norm_sq,
        {static_cast<double>(sync.bytes_sent + cs.bytes_sent + gather_bytes), static_cast<double>(cs.elements),
         static_cast<double>(cs.selected), cs.encode_s + cs.decode_s, cs.residual_sq});
    const auto opt_t0 = std::chrono::steady_clock::now();
    // The next step's cut of the global batch, the same on every rank (they all hold these sums).
    bool reshared = false;
    if (balancer_) {
      reshared = balancer_->observe(sums.compute_s);
      if (reshared) {
        offset = balancer_->offset(static_cast<size_t>(pos_.pipeline));
        mine = balancer_->shares()[static_cast<size_t>(pos_.pipeline)];
        actions = schedule_of(mine);
        if (lead) log_info("step " + std::to_string(step + 1) + ": " + balancer_->last_change());
      }
    }
    const std::vector<model::Param*>& clipped = split_clip ? dense_params : params;
    // Dynamic loss scaling: the gradients are SCALE times the true ones. A non-finite norm (the
    // same on every rank: summed, or of the same whole gradient) skips the step; otherwise they are unscaled
    // exactly (a power of two) before clipping.
    const double scale = scaler_.scale();
    const bool apply_step = scaler_.update(std::sqrt(sums.norm_sq));
    if (scale != 1.0 && apply_step) {
      const double inv = 1.0 / scale;
      for (auto* p : params)
        if (p->tensor.grad().defined()) p->tensor.mutable_grad().mul_(inv);
      for (auto& spec : shard_specs_)
        if (spec.grads.defined()) spec.grads.mul_(inv);
      sums.norm_sq *= inv * inv;
      sums.clip_norm_sq *= inv * inv;
    }
    const double grad_norm = std::sqrt(sums.norm_sq);
    if (apply_step) {
      clip_to(clipped, std::sqrt(sums.clip_norm_sq), t.grad_clip);
      if (const double coef = clip_coef(std::sqrt(sums.clip_norm_sq), t.grad_clip); coef != 1.0)
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
    if (tracing) {
      auto us = [&](std::chrono::steady_clock::time_point a) { return std::chrono::duration<double, std::micro>(a - t0).count(); };
      if (!figures.ahead()) exec_->trace().push_back({"sum of the step's figures", "sync", us(late_t0), us(opt_t0) - us(late_t0)});
      exec_->trace().push_back({"clip and optimizer", "compute", us(opt_t0), us(std::chrono::steady_clock::now()) - us(opt_t0)});
    }
    // AdamW's state exists from its first step; on CUDA the allocator saw every transient peak.
    step_peak_bytes = std::max({step_peak_bytes, pipeline::memory_in_use(device_), pipeline::memory_peak(device_)});
    // Every parameter's, not only those AdamW updates here (under ZeRO a rank may own none of one);
    // before the gather, whose staging takes their place.
    for (auto* p : params)
      if (p->tensor.grad().defined()) p->tensor.mutable_grad().reset();
    if (sharding_) sharding_->gather_params();  // ZeRO: each owner's updated range to every holder

    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Waiting for the other ranks after the backward: in the sync, and where the figures go ahead
    // of it, in their sum (which waits for the slowest backward as the sync did).
    const double wait_s = sync.wait_s + (figures.ahead() ? std::chrono::duration<double>(sync_t0 - sum_t0).count() : 0.0);
    StepRecord rec{step + 1, sums.loss / batch_tokens, lr, grad_norm, step_s, batch_tokens / step_s, exec_->compute_s(), wait_s,
                   phase_s};
    if (tp_comm_) rec.tp_comm_s = tp_comm_->take_busy().seconds;
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
    if (reshared) j["samples_per_replica"] = balancer_->shares();  // from the next step on
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
    // The re-plans' measurements assume the plan's cut: samples move only once none is pending.
    if (balancer_ && !next_plan && replan_at_ == 0 && !balancer_->armed() && balancer_->arm() && lead)
      log_info("step " + std::to_string(rec.step) + ": train.rebalance follows the replicas' speeds from here");
    // The row, its sync figures once summed (StepFigures): every row is on disk before a save.
    const bool saves = (t.checkpoint_interval > 0 && rec.step % t.checkpoint_interval == 0) || last;
    figures.record(std::move(j), saves || next_plan != nullptr);

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
