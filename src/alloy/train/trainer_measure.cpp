// What a Trainer measures about itself and shares: each rank's figures into OUTPUT/ranks.json
// with the predicted-against-measured report, and the medians a re-plan calibrates from.
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/dist/world.h"
#include "alloy/dist/zero3.h"
#include "alloy/pipeline/device_memory.h"
#include "alloy/plan/planner.h"
#include "alloy/train/optimizer.h"
#include "alloy/train/trainer.h"

namespace alloy::train {

namespace {
// VmHWM of /proc/self/status (bytes); 0 where there is none.
int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

}  // namespace

void Trainer::publish_rank_stats(const TrainResult& r) {
  // Per-rank figures (measured time per step in compute and waiting for gradient sync, peak
  // activation memory) go to rank 0 through the store and into OUTPUT/ranks.json, so a user can
  // see each stage's share without collecting logs from every host.
  if (r.steps.empty()) return;
  std::vector<double> step_s, compute_s, sync_s, phase_s, tp_s;
  for (size_t i = r.steps.size() > 3 ? 1 : 0; i < r.steps.size(); ++i) {  // the first step warms up
    step_s.push_back(r.steps[i].step_s);
    tp_s.push_back(r.steps[i].tp_comm_s);
    compute_s.push_back(r.steps[i].compute_s);
    sync_s.push_back(r.steps[i].sync_wait_s);
    phase_s.push_back(r.steps[i].phase_s);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const auto& st = plan_->pipelines[static_cast<size_t>(pos_.pipeline)].stages[static_cast<size_t>(pos_.stage)];
  // As allocated between steps: ZeRO-3 keeps only its shards then.
  int64_t param_bytes = zero3_ ? zero3_->shard_bytes() : 0;
  for (const auto* p : static_cast<const model::Transformer&>(*model_).parameters())
    param_bytes += p->quant ? p->storage_bytes() : static_cast<int64_t>(p->tensor.storage().nbytes());
  nlohmann::json me = {{"rank", rank_},
                       {"device", device_.str()},
                       {"pipeline", pos_.pipeline},
                       {"stage", pos_.stage},
                       {"layers", {st.layer_begin, st.layer_end}},
                       {"units", {st.unit_begin(), st.unit_end()}},
                       {"step_s_median", median(step_s)},
                       {"compute_s_median", median(compute_s)},
                       {"sync_wait_s_median", median(sync_s)},
                       {"phase_s_median", median(phase_s)},
                       {"peak_activation_bytes", r.peak_activation_bytes},
                       // Model state as allocated (ZeRO shrinks the optimizer's share) and the
                       // process's peak resident memory.
                       {"param_bytes", param_bytes},
                       {"grad_bytes", r.peak_grad_bytes},
                       {"optimizer_state_bytes", opt_->state_bytes()},
                       {"peak_gathered_param_bytes", zero3_ ? zero3_->peak_gathered_bytes() : 0},
                       {"peak_rss_bytes", peak_rss_bytes()},
                       {"model_memory_bytes", r.peak_model_memory_bytes},
                       // Where the memory figures were read (pipeline/device_memory.h).
                       {"memory_measured_in", !pipeline::measures_device_memory(device_) ? "the host heap (this build reads no CUDA allocator)"
                                              : device_.is_cuda()                        ? "the CUDA allocator"
                                                                                         : "the host heap"},
                       {"peak_in_flight_micro_batches", r.peak_in_flight}};
  if (plan_->pipelines[static_cast<size_t>(pos_.pipeline)].interleaved()) {
    // Every chunk's units, in layer order ("layers" and "units" above are the first chunk's).
    nlohmann::json chunks = nlohmann::json::array();
    for (int c : plan_->chunks_of(rank_)) {
      const auto& ch = plan_->pipelines[static_cast<size_t>(pos_.pipeline)].stages[static_cast<size_t>(c)];
      chunks.push_back({ch.unit_begin(), ch.unit_end()});
    }
    me["chunk_units"] = chunks;
  }
  // Every step's figures too: the medians hide drift (a rank slow in the first steps only), and
  // re-planning decides from the first steps.
  nlohmann::json per_step = nlohmann::json::array();
  for (const auto& s : r.steps) per_step.push_back({s.step_s, s.compute_s, s.sync_wait_s});
  me["steps_step_compute_syncwait_s"] = per_step;
  if (st.tp() > 1) {
    // The tensor-parallel exchanges inside compute_s (the cost model's tp_comm_s for the stage).
    me["tp_comm_s_median"] = median(tp_s);
    nlohmann::json tp_steps = nlohmann::json::array();
    for (const auto& s : r.steps) tp_steps.push_back(s.tp_comm_s);
    me["steps_tp_comm_s"] = tp_steps;
  }
  nlohmann::json all = nlohmann::json::array();
  if (!world_) {
    all.push_back(me);
  } else {
    std::string s = me.dump();
    const std::string prefix = "alloy/" + opts_.generation + "rankstats/";
    world_->store().set(prefix + std::to_string(rank_), std::vector<uint8_t>(s.begin(), s.end()));
    if (rank_ != 0) return;
    for (int q = 0; q < world_->size(); ++q) {
      std::string key = prefix + std::to_string(q);
      world_->store().wait({key});
      auto b = world_->store().get(key);
      all.push_back(nlohmann::json::parse(std::string(b.begin(), b.end())));
    }
  }
  if (rank_ == 0) {
    write_file_atomic(cfg_.output.dir + "/ranks.json", all.dump(2) + "\n");
    const bool calibrated = opts_.calibrated_prediction && opts_.calibrated_prediction->is_object();
    if (!plan_->predicted.is_null() && !opts_.quiet)
      std::fprintf(stderr, "%s",
                   plan::predicted_vs_measured(calibrated ? *opts_.calibrated_prediction : plan_->predicted, all, median(step_s),
                                               calibrated ? &plan_->predicted : nullptr)
                       .c_str());
  }
}

std::shared_ptr<Plan> Trainer::replan_now(const TrainResult& r, int64_t step) {
  // Medians of the steps after the first (it warms up allocators and caches); the lower middle:
  // a stall only raises times.
  auto lower_median = [&](auto of) {
    std::vector<double> v;
    for (size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i) v.push_back(of(r.steps[i]));
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[(v.size() - 1) / 2];
  };
  // The calibration compares compute with compute: a tensor-parallel member's sums (inside its
  // compute_s) are left out, the cost model prices them apart.
  const double mine = lower_median([](const StepRecord& s) { return s.compute_s - s.tp_comm_s; });
  const double my_phase = lower_median([](const StepRecord& s) { return s.phase_s; });
  const std::string prefix = "alloy/" + opts_.generation + "replan/" + std::to_string(step) + "/";  // a plan may be measured twice
  auto& store = world_->store();
  auto put = [&](const std::string& k, const std::string& s) { store.set(prefix + k, std::vector<uint8_t>(s.begin(), s.end())); };
  auto get = [&](const std::string& k) {
    store.wait({prefix + k});
    auto b = store.get(prefix + k);
    return std::string(b.begin(), b.end());
  };
  put("compute/" + std::to_string(rank_), std::to_string(mine));
  put("phase/" + std::to_string(rank_), std::to_string(my_phase));
  std::string decision;
  if (rank_ == 0) {
    std::map<int, double> measured, phase;
    for (int q = 0; q < world_->size(); ++q) {
      measured[q] = std::stod(get("compute/" + std::to_string(q)));
      phase[q] = std::stod(get("phase/" + std::to_string(q)));
    }
    try {
      auto next = opts_.replan ? opts_.replan(step, measured, phase, lower_median([](const StepRecord& s) { return s.step_s; })) : nullptr;
      if (next) decision = next->to_json().dump();
    } catch (const std::exception& e) {
      log_warn(std::string("re-planning failed, the running plan stays: ") + e.what());
    }
    put("decision", decision.empty() ? "keep" : decision);
  } else {
    decision = get("decision");
    if (decision == "keep") decision.clear();
  }
  if (decision.empty()) return nullptr;
  return std::make_shared<Plan>(Plan::from_json(nlohmann::json::parse(decision), "the re-planned layout from rank 0"));
}

}  // namespace alloy::train
