// Planner at scale: 512 devices of 3 types (256 slow, 192 mid, 64 fast) on 16 hosts in 2
// regions, a 24-block GPT-2 medium-sized model, global batch 2048. Prints one JSON object with the
// alloy search's time and predicted step time, and the baselines' predicted step times side by
// side (same cost model), so the ratio is measured in one run.
//
// Built with the project (build/bench/bench_planner).
// Optional argument: the search's time budget in seconds (default 1). At 1 s on a loaded 2-core
// machine the heuristic may stop early and its figures vary from run to run; quote a larger
// budget (e.g. 60) for repeatable step times.
#include <vector>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "alloy/plan/search.h"

using namespace alloy;
using namespace alloy::plan;

namespace {

// Costs of one type; forward of a block at micro-batch m is fixed + per_sample * m.
DeviceProfile type_profile(double block_fwd_per_sample, double fixed) {
  DeviceProfile d;
  d.block_fwd = {fixed, block_fwd_per_sample};
  d.block_bwd = {2 * fixed, 2 * block_fwd_per_sample};
  d.embed_fwd = {fixed, block_fwd_per_sample / 10};
  d.embed_bwd = {fixed, block_fwd_per_sample / 10};
  d.head_fwd = {fixed, 1.5 * block_fwd_per_sample};
  d.head_bwd = {fixed, 3 * block_fwd_per_sample};
  d.optimizer_s_per_param = block_fwd_per_sample * 1e-7;
  // A measured profile also holds the times at the sizes it timed; the cost model then
  // interpolates them, which is the path to time.
  for (MicroBatchCost* c : {&d.block_fwd, &d.block_bwd, &d.embed_fwd, &d.embed_bwd, &d.head_fwd, &d.head_bwd}) {
    std::vector<double> ms{1, 2, 4, 8}, ts;
    for (double m : ms) ts.push_back(c->at(m));
    c->set_points(ms, ts);
  }
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  const double budget = argc > 1 ? std::atof(argv[1]) : 1.0;
  Profile prof;
  prof.model.arch = "gpt2";
  prof.model.layers = 24;
  prof.model.hidden = 1024;
  prof.model.heads = 16;
  prof.model.seq_len = 1024;
  prof.model.vocab_size = 50257;
  prof.devices["fast"] = type_profile(0.002, 0.0002);
  prof.devices["mid"] = type_profile(0.006, 0.0003);
  prof.devices["slow"] = type_profile(0.016, 0.0005);
  // GPT-2 medium in float32: 12.6M parameters a block, wte 51.5M + wpe 1M.
  prof.memory.param_bytes_per_block = 12.6e6 * 4;
  prof.memory.param_bytes_embed = 52.5e6 * 4;
  prof.memory.param_bytes_head = 51.5e6 * 4 + 2048 * 4;
  prof.memory.act_bytes_per_sample_block = 100e6;
  prof.memory.act_bytes_per_sample_embed = 8e6;
  prof.memory.act_bytes_per_sample_head = 210e6;
  prof.memory.state_bytes_per_param_byte = 4;

  ClusterSpec c;
  c.name = "bench-512";
  for (int h = 0; h < 16; ++h) {
    const std::string host = "h" + std::to_string(h);
    c.groups[h < 8 ? "eu" : "us"].push_back(host);
    auto add = [&](const std::string& type, int n, double mem) {
      for (int i = 0; i < n; ++i) {
        Device d;
        d.name = host + "-" + type + std::to_string(i);
        d.host = host;
        d.kind = "cuda";
        d.type = type;
        d.memory_gb = mem;
        c.devices.push_back(d);
      }
    };
    add("fast", 4, 80);
    add("mid", 12, 24);
    add("slow", 16, 16);
  }
  c.rules.push_back({"eu", "eu", Link{25, 0.05}});
  c.rules.push_back({"us", "us", Link{25, 0.05}});
  c.rules.push_back({"eu", "us", Link{5, 30}});

  SearchOptions o;
  o.global_batch = 2048;
  o.time_budget_s = budget;
  nlohmann::json out;
  out["devices"] = c.devices.size();
  out["types"] = c.types();
  out["hosts"] = c.hosts().size();
  out["layers"] = prof.model.layers;
  out["global_batch"] = o.global_batch;
  out["time_budget_s"] = budget;
  SearchResult r = search(c, prof, o);
  out["search_s"] = r.search_s;
  out["step_s"] = r.cost.step_s;
  out["candidates"] = r.candidates_evaluated;
  out["exact"] = r.exact;
  out["pipelines"] = r.plan.pipelines.size();
  size_t max_depth = 0;
  for (const auto& p : r.plan.pipelines) max_depth = std::max(max_depth, p.stages.size());
  out["max_depth"] = max_depth;
  out["schedule"] = r.plan.schedule;
  out["notes"] = r.notes;
  out["breakdown"] = {{"phase_s", r.cost.phase_s},
                      {"sync_done_s", r.cost.sync_done_s},
                      {"world_allreduce_s", r.cost.world_allreduce_s},
                      {"optimizer_s", r.cost.optimizer_s}};
  for (const std::string s : {"uniform", "proportional", "ptafm"}) {
    o.strategy = s;
    try {
      SearchResult b = search(c, prof, o);
      out["baselines"][s] = {{"step_s", b.cost.step_s}, {"search_s", b.search_s}, {"speedup_of_alloy", b.cost.step_s / r.cost.step_s}};
    } catch (const std::exception& e) {
      out["baselines"][s] = {{"error", e.what()}};
    }
  }
  // PTAFM with two stage groups (its NUM_STAGE given, as its users do): one per region.
  o.strategy = "ptafm";
  o.ptafm_stages = 2;
  try {
    SearchResult b = search(c, prof, o);
    out["baselines"]["ptafm_2_stages"] = {{"step_s", b.cost.step_s}, {"search_s", b.search_s}, {"speedup_of_alloy", b.cost.step_s / r.cost.step_s}};
  } catch (const std::exception& e) {
    out["baselines"]["ptafm_2_stages"] = {{"error", e.what()}};
  }
  std::cout << out.dump(2) << std::endl;
  return 0;
}
