#pragma once
// `alloy sweep`: the strategy sweep of the hybrid LoRA parallelism study, on one pool. A grid of
// layouts x micro-batch sizes x sequence lengths (x local rank counts: the study's "# of GPUs"
// axis), each cell trained for a few steps as its own job
// (`alloy launch`, local ranks or an emulated cluster), measured (tokens/s, step latency, model
// memory per rank: max, sum and imbalance) and predicted by the planner's cost model beside it.
// A cell that runs out of memory, or that the cost model says will not fit a device's memory_gb,
// is marked so; a layout Alloy cannot run yet is listed with why.
//
// Layouts (N ranks, L blocks, global batch G, micro-batch size m):
//   dp            N replicas of the whole model, G / N samples each in micro-batches of m
//   pp | pp:C,..  one pipeline of N stages, cut evenly or after blocks C, ... (N - 1 cuts)
//   zero1|2|3     dp with the optimizer state / gradients / parameters sharded evenly (fsdp = zero3)
//   auto          the planner's own plan (its micro-batch size; one cell per sequence length)
//   tp | tp:H,..  one tensor-parallel stage of all N ranks, the heads split evenly or H, ... per
//                 rank (N numbers), G / m micro-batches of m (not with LoRA: skipped, with why)
//   LAYOUT+ac     any of these but auto with activation checkpointing (the study's ac1): every
//                 stage recomputes its blocks' activations in the backward
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/core/plan.h"

namespace alloy::train {

struct SweepOptions {
  std::string config;                     // the config file every cell starts from
  std::vector<std::string> sets;          // --set overrides applied to every cell
  std::vector<std::string> layouts = {"dp", "pp"};
  std::vector<int64_t> micro_batches = {1, 2};
  std::vector<int64_t> seq_lens;          // empty: the config's model.seq_len
  int64_t steps = 6;                      // per cell; the first `warmup` are not timed
  int64_t warmup = 2;
  std::vector<int> nprocs;                // local rank counts (no emulation), a grid per count; empty (or 0) with --emulate: one per device
  std::string emulate;                    // ClusterSpec to run the cells on (alloy launch --emulate)
  std::string cluster;                    // ClusterSpec for the predictions; default: emulate, or N local CPUs
  std::string profile;                    // profile to reuse (if it matches the model at that length)
  std::string out_dir = "runs/sweep";
  std::string alloy;                      // the alloy binary to run cells with (default: this one)
};

struct SweepRow {
  std::string layout;
  int ranks = 0;
  int64_t micro_batch = 0, seq_len = 0;
  std::string status;  // ok | oom | oom-predicted | failed | skipped
  std::string note;    // why, for every status but ok
  double tokens_per_s = 0, step_s = 0;
  double mem_max_bytes = 0, mem_sum_bytes = 0, mem_imbalance = 0;  // model memory per rank (ranks.json)
  double predicted_step_s = 0, predicted_mem_max_bytes = 0;
  std::string run_dir;
};

// The plan of LAYOUT for N ranks of a model of L blocks, global batch G, micro-batch size M;
// `zeroK` adds a sharding entry over all ranks. Throws InputError naming the layout when it cannot
// be built (sizes that do not divide, more stages than blocks, an unknown name, a TP split of the
// wrong length). Heads that do not split as asked are the plan's validation's to name.
// PARAMS: the parameters (trained and frozen, any unit) of the embedding, of one block and of the
// head, for `pp-params` (a pipeline cut so that every stage holds about the same parameters, the
// hybrid_lora_parallel study's uniform parameter split); other layouts ignore it.
struct PartParams {
  double embed = 0, block = 0, head = 0;
};
Plan sweep_plan(const std::string& layout, int n, int64_t layers, int64_t global_batch, int64_t m, const PartParams& params = {});
// Block cuts (stage ends but the last) giving each of N stages about the same parameters.
std::vector<int64_t> cuts_by_params(int n, int64_t layers, const PartParams& p);
// The known layout names, for help texts.
std::string sweep_layouts();

// Runs the grid and writes OUT_DIR/sweep.csv, sweep.json, and the plots (gnuplot, where installed).
std::vector<SweepRow> run_sweep(const SweepOptions& o);

std::string sweep_csv(const std::vector<SweepRow>& rows);
// Relative prediction errors (predicted / measured - 1) of the rows that ran: step and memory,
// with their median, mean absolute and worst.
nlohmann::json prediction_errors(const std::vector<SweepRow>& rows);

}  // namespace alloy::train
