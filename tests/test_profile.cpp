// Device profiles: the JSON format (versions, validation), measured micro-batch costs, and the
// statistics the profiler derives.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/profiler.h"
#include "expect_error.h"
#include "temp_dir.h"

using alloy::plan::ClusterSpec;
using alloy::plan::Device;
using alloy::plan::Profile;
using alloy::testing::error_of;
using alloy::testing::TempDir;

namespace {

Profile sample_profile() {
  Profile p;
  p.model.layers = 6;
  p.model.hidden = 96;
  p.model.heads = 4;
  p.model.seq_len = 64;
  alloy::plan::DeviceProfile a;
  a.block_fwd = {1e-4, 2.5e-5};
  a.block_bwd = {2e-4, 5.1e-5};
  a.embed_fwd = {1e-5, 1e-6};
  a.embed_bwd = {2e-5, 2e-6};
  a.head_fwd = {3e-4, 7e-5};
  a.head_bwd = {6e-4, 1.4e-4};
  a.block_bwd.set_points({1, 2, 4}, {3e-4, 3.2e-4, 4.1e-4});
  a.optimizer_s_per_param = 1.0 / 3.0 * 1e-9;
  p.devices["cpu-full"] = a;
  alloy::plan::DeviceProfile b = a;
  b.block_fwd.per_sample_s *= 4;
  b.block_fwd.fixed_s = -1e-6;  // a fitted intercept slightly below zero is allowed
  p.devices["cpu-quarter"] = b;
  p.links.push_back({"h0", "h1", 1.2e8, 2e-4, 0});
  p.links.push_back({"h0", "h2", 1.25e7, 3e-3, 1.1e7});
  p.memory.param_bytes_per_block = 12345;
  p.memory.param_bytes_embed = 678;
  p.memory.param_bytes_head = 910;
  p.memory.act_bytes_per_sample_block = 1111;
  p.memory.act_bytes_per_sample_embed = 222;
  p.memory.act_bytes_per_sample_head = 333;
  p.memory.state_bytes_per_param_byte = 4;
  return p;
}

std::string profile_error(const nlohmann::json& j) {
  return error_of([&] { Profile::from_json(j, "p.json"); });
}

}  // namespace

TEST(Profile, JsonRoundTrip) {
  Profile p = sample_profile();
  TempDir dir;
  const std::string path = dir.file("profile.json");
  p.save(path);
  Profile q = Profile::load(path);
  EXPECT_EQ(alloy::model_to_json(q.model), alloy::model_to_json(p.model));
  ASSERT_EQ(q.devices.size(), 2u);
  for (const auto& [type, d] : p.devices) {
    const auto& e = q.devices.at(type);
    EXPECT_EQ(e.block_fwd.fixed_s, d.block_fwd.fixed_s);
    EXPECT_EQ(e.block_fwd.per_sample_s, d.block_fwd.per_sample_s);
    EXPECT_EQ(e.block_bwd.per_sample_s, d.block_bwd.per_sample_s);
    EXPECT_EQ(e.embed_fwd.fixed_s, d.embed_fwd.fixed_s);
    EXPECT_EQ(e.embed_bwd.per_sample_s, d.embed_bwd.per_sample_s);
    EXPECT_EQ(e.head_fwd.per_sample_s, d.head_fwd.per_sample_s);
    EXPECT_EQ(e.head_bwd.fixed_s, d.head_bwd.fixed_s);
    ASSERT_EQ(e.block_bwd.n, 3);
    EXPECT_EQ(e.block_bwd.m, d.block_bwd.m);
    EXPECT_EQ(e.block_bwd.t, d.block_bwd.t);
    EXPECT_EQ(e.block_fwd.n, 0);
    EXPECT_EQ(e.optimizer_s_per_param, d.optimizer_s_per_param);
  }
  ASSERT_EQ(q.links.size(), 2u);
  EXPECT_EQ(q.links[1].host_a, "h0");
  EXPECT_EQ(q.links[1].host_b, "h2");
  EXPECT_EQ(q.links[1].bytes_per_s, 1.25e7);
  EXPECT_EQ(q.links[1].latency_s, 3e-3);
  EXPECT_EQ(q.links[1].allreduce_bytes_per_s, 1.1e7);
  EXPECT_EQ(q.memory.param_bytes_per_block, 12345);
  EXPECT_EQ(q.memory.act_bytes_per_sample_head, 333);
  EXPECT_EQ(q.memory.state_bytes_per_param_byte, 4);
  EXPECT_EQ(q.to_json(), p.to_json());
  nlohmann::json j = p.to_json();
  EXPECT_EQ(j["format"], "alloy-profile");
  EXPECT_EQ(j["version"], 13);
  // Tensor-parallel sums per device pair round-trip and are optional.
  {
    EXPECT_FALSE(j.contains("tp_sums"));
    Profile c = p;
    c.tp_sums = {{"a0", "a1", 98304, 1.2e-3}};
    Profile d = Profile::from_json(c.to_json(), "p.json");
    ASSERT_EQ(d.tp_sums.size(), 1u);
    EXPECT_EQ(d.tp_sums[0].device_b, "a1");
    EXPECT_EQ(d.tp_sums[0].bytes, 98304);
    EXPECT_EQ(d.tp_sums[0].seconds, 1.2e-3);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // The halves' shares round-trip and are optional (0: unknown).
  {
    Profile c = p;
    c.devices.at("cpu-full").attn_share_fwd = 0.55;
    c.devices.at("cpu-full").attn_share_bwd = 0.6;
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").attn_share_fwd, 0.55);
    EXPECT_EQ(d.devices.at("cpu-full").attn_share_bwd, 0.6);
    EXPECT_EQ(d.devices.at("cpu-quarter").attn_share_fwd, 0.0);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // An optional figure per device type: set on type ON it round-trips, type OFF reads UNSET and
  // writes no key, and each of BAD is refused naming the field (with WHY after it, where given).
  auto optional_figure = [&](double alloy::plan::DeviceProfile::*field, const std::string& key, const std::string& on, const std::string& off,
                             double value, double unset, const std::vector<double>& bad, const std::string& why) {
    Profile c = p;
    c.devices.at(on).*field = value;
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at(on).*field, value) << key;
    EXPECT_EQ(d.devices.at(off).*field, unset) << key;
    EXPECT_FALSE(c.to_json()["devices"][off].contains(key)) << key;
    EXPECT_EQ(d.to_json(), c.to_json()) << key;
    for (double v : bad) {
      nlohmann::json j = c.to_json();
      j["devices"][on][key] = v;
      EXPECT_HAS(profile_error(j), "devices." + on + "." + key + why) << key << " " << v;
    }
  };
  // zb-h1's weight share: a share.
  optional_figure(&alloy::plan::DeviceProfile::weight_share, "weight_share", "cpu-full", "cpu-quarter", 0.38, 0.0, {1.5}, "");
  // Communication's CPU time per byte: a plausible figure.
  optional_figure(&alloy::plan::DeviceProfile::comm_cpu_s_per_byte, "comm_cpu_s_per_byte", "cpu-quarter", "cpu-full", 1.8e-9, 0.0, {-1e-9, 2e-4},
                  ": must be in [0, 1e-4)");
  // What a tensor-parallel member computes whole: a share.
  optional_figure(&alloy::plan::DeviceProfile::tp_whole_share, "tp_whole_share", "cpu-full", "cpu-quarter", 0.17, 0.0, {1.0}, "");
  // A member's share per shard size: [fraction, share] pairs in order, each bounded.
  {
    Profile c = p;
    c.devices.at("cpu-full").tp_shard_shares = {{0.25, 0.41}, {0.5, 0.6}};
    const nlohmann::json cj = c.to_json();
    EXPECT_FALSE(cj["devices"]["cpu-quarter"].contains("tp_shard_shares"));
    Profile d = Profile::from_json(cj, "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").tp_shard_shares, c.devices.at("cpu-full").tp_shard_shares);
    EXPECT_TRUE(d.devices.at("cpu-quarter").tp_shard_shares.empty());
    EXPECT_EQ(d.to_json(), cj);
    auto refused = [&](const nlohmann::json& pts, const std::string& what) {
      nlohmann::json j = cj;
      j["devices"]["cpu-full"]["tp_shard_shares"] = pts;
      EXPECT_HAS(profile_error(j), "devices.cpu-full.tp_shard_shares" + what) << pts.dump();
    };
    refused(0.5, ": must be an array of [fraction, share] pairs");
    refused({{0.5}}, "[0]: must be [fraction, share] (two numbers)");
    refused({{1.0, 1.0}}, "[0]: fraction must be in (0, 1)");
    refused({{0.5, 0.0}}, "[0]: share must be in (0, 1]");
    refused({{0.5, 0.6}, {0.25, 0.41}}, "[1]: must come after devices.cpu-full.tp_shard_shares[0]");
    refused({{0.25, 0.7}, {0.5, 0.6}}, "[1]: must come after");
  }
  // A CPU quota: its fraction of a core and its burst, written and read together, each bounded.
  {
    Profile c = p;
    c.devices.at("cpu-quarter").quota_fraction = 0.19;
    c.devices.at("cpu-quarter").quota_burst_s = 3.7e-3;
    const nlohmann::json cj = c.to_json();
    EXPECT_FALSE(cj["devices"]["cpu-full"].contains("quota_fraction"));
    EXPECT_FALSE(cj["devices"]["cpu-full"].contains("quota_burst_s"));
    Profile d = Profile::from_json(cj, "p.json");
    EXPECT_EQ(d.devices.at("cpu-quarter").quota_fraction, 0.19);
    EXPECT_EQ(d.devices.at("cpu-quarter").quota_burst_s, 3.7e-3);
    EXPECT_EQ(d.devices.at("cpu-full").quota_fraction, 1.0);
    EXPECT_EQ(d.devices.at("cpu-full").quota_burst_s, 0.0);
    EXPECT_EQ(d.to_json(), cj);
    for (double v : {0.0, 1.0, -0.5}) {
      nlohmann::json j = cj;
      j["devices"]["cpu-quarter"]["quota_fraction"] = v;
      EXPECT_HAS(profile_error(j), "devices.cpu-quarter.quota_fraction: must be in [0.001, 1)") << v;
    }
    for (double v : {0.0, 1.5}) {
      nlohmann::json j = cj;
      j["devices"]["cpu-quarter"]["quota_burst_s"] = v;
      EXPECT_HAS(profile_error(j), "devices.cpu-quarter.quota_burst_s: must be in (0, 1]") << v;
    }
    nlohmann::json half = cj;
    half["devices"]["cpu-quarter"].erase("quota_burst_s");
    EXPECT_HAS(profile_error(half), "devices.cpu-quarter.quota_burst_s: is missing");
  }
  // Version 11's burst_speedup: still read (checked, then dropped).
  {
    nlohmann::json v11 = p.to_json();
    v11["version"] = 11;
    v11["devices"]["cpu-quarter"]["burst_speedup"] = 2.1;
    EXPECT_EQ(Profile::from_json(v11, "p.json").to_json(), p.to_json());
    v11["devices"]["cpu-quarter"]["burst_speedup"] = 0.5;
    EXPECT_HAS(profile_error(v11), "devices.cpu-quarter.burst_speedup: must be in [1, 50]");
  }
  // Version 1 (lines without points) still reads.
  {
    nlohmann::json v1 = j;
    v1["version"] = 1;
    for (auto& [type, d] : v1["devices"].items())
      for (auto& [key, c] : d.items())
        if (c.is_object()) c.erase("points");
    EXPECT_EQ(Profile::from_json(v1, "p.json").devices.at("cpu-full").block_bwd.n, 0);
  }
  // Version 2 (no codec costs) still reads; codec costs round-trip.
  {
    nlohmann::json v2 = j;
    v2["version"] = 2;
    EXPECT_TRUE(Profile::from_json(v2, "p.json").devices.at("cpu-full").codecs.empty());
    Profile c = p;
    c.devices.at("cpu-full").codecs["dgc"] = {3e-9, 1e-9};
    Profile d = Profile::from_json(c.to_json(), "p.json");
    EXPECT_EQ(d.devices.at("cpu-full").codecs.at("dgc").encode_s_per_elem, 3e-9);
    EXPECT_EQ(d.to_json(), c.to_json());
  }
  // Version 3 (no step noise) reads as steady; the noise round-trips.
  {
    nlohmann::json v3 = j;
    v3["version"] = 3;
    for (auto& [type, d] : v3["devices"].items()) d.erase("step_noise");
    EXPECT_EQ(Profile::from_json(v3, "p.json").devices.at("cpu-full").step_noise, 0);
    Profile c = p;
    c.devices.at("cpu-full").step_noise = 0.05;
    EXPECT_EQ(Profile::from_json(c.to_json(), "p.json").devices.at("cpu-full").step_noise, 0.05);
  }
  // Free-form provenance is accepted.
  j["meta"] = {{"measured_on", "2024-01-01"}};
  EXPECT_EQ(profile_error(j), "");
  // allreduce_bytes_per_s is optional (0 = not measured).
  j["links"][0].erase("allreduce_bytes_per_s");
  EXPECT_EQ(Profile::from_json(j, "p.json").links[0].allreduce_bytes_per_s, 0);
}

TEST(Profile, LoraProfilesRoundTripAndMustMatchTheRun) {
  Profile p = sample_profile();
  EXPECT_FALSE(p.to_json().contains("lora"));  // a profile of full training writes no LoRA fields
  EXPECT_FALSE(p.to_json()["memory"].contains("frozen_bytes_per_block"));
  p.lora.rank = 8;
  p.lora.targets = "all";
  p.lora.base_dtype = "nf4";
  p.memory.frozen_bytes_per_block = 4567;
  p.memory.frozen_bytes_head = 89;
  Profile q = Profile::from_json(p.to_json(), "p.json");
  EXPECT_EQ(q.lora.rank, 8);
  EXPECT_EQ(q.lora.base_dtype, "nf4");
  EXPECT_EQ(q.memory.frozen_bytes_per_block, 4567);
  EXPECT_EQ(q.memory.frozen_bytes_head, 89);
  EXPECT_EQ(q.to_json(), p.to_json());
  alloy::Config run;
  run.model = p.model;
  EXPECT_NE(q.mismatch(run).find("this run is training every parameter"), std::string::npos) << q.mismatch(run);
  run.lora = p.lora;
  EXPECT_EQ(q.mismatch(run), "");
  run.lora.base_dtype = "int8";  // another storage: other dequantization times and memory
  EXPECT_NE(q.mismatch(run).find("int8"), std::string::npos);
  run.lora = p.lora;
  run.lora.alpha = 99;  // the scale changes no cost
  EXPECT_EQ(q.mismatch(run), "");
  run.model.layers += 1;
  EXPECT_NE(q.mismatch(run).find("another model"), std::string::npos);
  nlohmann::json bad = p.to_json();
  bad["lora"]["base_dtype"] = "int3";
  EXPECT_NE(profile_error(bad).find("lora.base_dtype"), std::string::npos) << profile_error(bad);
}

TEST(MicroBatchCost, InterpolatesMeasuredPointsAndExtendsWithTheFittedSlope) {
  alloy::plan::MicroBatchCost c{1e-3, 1e-3};  // the line says 2 ms at m = 1
  EXPECT_DOUBLE_EQ(c.at(3), 4e-3);
  c.set_points({1, 2, 4}, {3e-3, 3.5e-3, 5.5e-3});  // measured: m = 1 costs 3 ms
  EXPECT_DOUBLE_EQ(c.at(1), 3e-3);
  EXPECT_DOUBLE_EQ(c.at(2), 3.5e-3);
  EXPECT_DOUBLE_EQ(c.at(3), 4.5e-3);          // halfway between 2 and 4
  EXPECT_DOUBLE_EQ(c.at(8), 5.5e-3 + 4e-3);   // past the last point: the line's slope
  EXPECT_DOUBLE_EQ(c.at(0.5), 2.5e-3);        // below the first point: same slope, not below proportional
  // Sums keep the points: 2 * c + d, on the union of both grids.
  alloy::plan::MicroBatchCost d{0, 1e-3};
  d.set_points({1, 8}, {1e-3, 8e-3});
  alloy::plan::MicroBatchCost s;
  s.add(c, 2);
  s.add(d, 1);
  for (double m : {1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0}) EXPECT_NEAR(s.at(m), 2 * c.at(m) + d.at(m), 1e-15) << "m = " << m;
  EXPECT_DOUBLE_EQ(s.per_sample_s, 3e-3);
}

// The demo's half device (a 0.4-core quota) as `alloy profile` read its block forward: the point
// at 4 samples 30% over its neighbours per sample, where training measured 4 cheaper per sample
// than 1 (bench/README). Shaped, no size costs more per sample than a smaller one.
TEST(MicroBatchCost, MeasuredPointsNeverCostMorePerSampleAtALargerSize) {
  const std::vector<double> m{1, 2, 4, 8}, t{6.53e-3, 11.79e-3, 29.08e-3, 45.58e-3};
  const auto c = alloy::plan::MicroBatchCost::measured(m, t);
  ASSERT_EQ(c.n, 4);
  const double pooled = (6.53e-3 + 11.79e-3 / 2 + 29.08e-3 / 4) / 3;  // the first three per sample, averaged
  EXPECT_NEAR(c.at(1), pooled, 1e-12);
  EXPECT_NEAR(c.at(2), 2 * pooled, 1e-12);
  EXPECT_NEAR(c.at(4), 4 * pooled, 1e-12);
  EXPECT_DOUBLE_EQ(c.at(8), 45.58e-3);  // cheaper per sample already: kept
  // Readings that already have both shapes are kept as measured (the fast device's).
  const std::vector<double> clean{3.19e-3, 5.23e-3, 10.1e-3, 19.35e-3};
  const auto f = alloy::plan::MicroBatchCost::measured(m, clean);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_DOUBLE_EQ(f.at(m[i]), clean[i]);
  // A time that falls with size is pooled as before (a larger micro-batch never takes less).
  const auto g = alloy::plan::MicroBatchCost::measured({1, 2}, {4e-3, 3e-3});
  EXPECT_DOUBLE_EQ(g.at(1), 3.5e-3);  // per sample, 4 and 1.5 ms stay; then 4 > 3 ms pooled
  EXPECT_DOUBLE_EQ(g.at(2), 3.5e-3);
}

RC_GTEST_PROP(MicroBatchCost, MeasuredPointsRiseWithSizeButNotPerSample, ()) {
  const int n = *rc::gen::inRange(1, 9);
  std::vector<double> m, t;
  double x = 0;
  for (int i = 0; i < n; ++i) {
    x += *rc::gen::inRange(1, 9);
    m.push_back(x);
    t.push_back(*rc::gen::inRange(1, 100000) * 1e-6);
  }
  const auto c = alloy::plan::MicroBatchCost::measured(m, t);
  RC_ASSERT(c.n == n);
  for (int i = 0; i < n; ++i) {
    RC_ASSERT(c.t[static_cast<size_t>(i)] > 0);
    if (i > 0) {
      const size_t k = static_cast<size_t>(i);
      RC_ASSERT(c.t[k] >= c.t[k - 1] * (1 - 1e-12));
      RC_ASSERT(c.t[k] / c.m[k] <= c.t[k - 1] / c.m[k - 1] * (1 + 1e-12));
    }
  }
  RC_ASSERT(c.per_sample_s >= 0);
  RC_ASSERT(c.fixed_s >= 0);
}

TEST(Profile, UnmeasuredTypesScaleMeasuredPointsBySpeed) {
  Profile p = sample_profile();
  p.devices.erase("cpu-quarter");
  const ClusterSpec spec = ClusterSpec::from_yaml_string(R"(
devices:
  - {name: a, host: h0, kind: cpu, type: cpu-full, memory_gb: 1, speed: 1.0}
  - {name: b, host: h1, kind: cpu, type: cpu-half, memory_gb: 1, speed: 0.5}
default_link: {bandwidth_gbps: 1, latency_ms: 0.1}
)", "c.yaml");
  alloy::plan::complete_profile(p, spec);
  ASSERT_EQ(p.devices.count("cpu-half"), 1u);
  const auto& full = p.devices.at("cpu-full").block_bwd;
  const auto& half = p.devices.at("cpu-half").block_bwd;
  ASSERT_EQ(half.n, full.n);
  for (double m : {1.0, 2.0, 3.0, 4.0, 16.0}) EXPECT_NEAR(half.at(m), 2 * full.at(m), 1e-15) << "m = " << m;
}

TEST(Profile, ActivationBytesPerSample) {
  Profile p = sample_profile();
  EXPECT_EQ(p.activation_bytes_per_sample(), 64.0 * 96 * 4);
  p.model.dtype = "float64";
  EXPECT_EQ(p.activation_bytes_per_sample(), 64.0 * 96 * 8);
  p.model.dtype = "bfloat16";
  EXPECT_HAS(error_of([&] { p.activation_bytes_per_sample(); }), "model.dtype");
}

TEST(Profile, ValidationErrorsNameFileAndField) {
  const nlohmann::json good = sample_profile().to_json();
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return profile_error(j);
  };
  EXPECT_HAS(with([](auto& j) { j["format"] = "alloy-plan"; }), "p.json: format: \"alloy-plan\", not \"alloy-profile\"");
  EXPECT_HAS(with([](auto& j) { j.erase("format"); }), "p.json: format: is missing");
  EXPECT_HAS(with([](auto& j) { j["version"] = 14; }), "p.json: version: 14; this Alloy reads versions 1 to 13");
  EXPECT_HAS(with([](auto& j) { j["version"] = "5"; }), "p.json: version: \"5\"; this Alloy reads versions 1 to 13");
  const nlohmann::json sum = {{"device_a", "a0"}, {"device_b", "a1"}, {"bytes", 4096}, {"seconds", 1e-3}};
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["seconds"] = -1; }), "p.json: tp_sums[0].seconds: must be in [0, 60)");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["bytes"] = 0; }), "p.json: tp_sums[0].bytes: must be > 0");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["device_b"] = "a0"; }), "p.json: tp_sums[0]: must name two different devices");
  EXPECT_HAS(with([&](auto& j) { j["tp_sums"] = {sum}; j["tp_sums"][0]["rank"] = 1; }), "p.json: tp_sums[0].rank: unknown key");
  EXPECT_HAS(with([](auto& j) { j["tp_sums"] = 3; }), "p.json: tp_sums: must be an array");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["attn_share_fwd"] = 1.5; }), "p.json: devices.cpu-full.attn_share_fwd: must be in (0, 1)");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["step_noise"] = -0.1; }), "p.json: devices.cpu-full.step_noise: must be in [0, 1)");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["codecs"] = {{"dcg", {{"encode_s_per_elem", 1e-9}, {"decode_s_per_elem", 1e-9}}}}; }),
             "p.json: devices.cpu-full.codecs.dcg: is not a compression method");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["codecs"] = {{"dgc", {{"encode_s_per_elem", -1}, {"decode_s_per_elem", 0}}}}; }),
             "p.json: devices.cpu-full.codecs.dgc: costs must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][1][0] = 1; }),
             "p.json: devices.cpu-full.block_bwd.points[1]: micro-batch sizes must increase, got 1 after 1");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][2] = {4, -1}; }),
             "p.json: devices.cpu-full.block_bwd.points[2]: seconds must be finite and >= 0, got -1");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][0] = 7; }),
             "p.json: devices.cpu-full.block_bwd.points[0]: must be [micro-batch size, seconds], got 7");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_bwd"]["points"][0][0] = 0; }),
             "points[0]: micro-batch size must be >= 1, got 0");
  EXPECT_HAS(with([](auto& j) { j.erase("devices"); }), "p.json: devices: is missing");
  EXPECT_HAS(with([](auto& j) { j["devices"] = nlohmann::json::object(); }), "p.json: devices: the profile has no device types");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_fwd"]["per_sample_s"] = -1; }),
             "p.json: devices.cpu-full.block_fwd.per_sample_s: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["head_bwd"]["fixed_s"] = -1; }),
             "p.json: devices.cpu-full.head_bwd: fixed_s + per_sample_s");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["embed_fwd"].erase("fixed_s"); }),
             "p.json: devices.cpu-full.embed_fwd.fixed_s: is missing");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["block_fwd"]["fixed_s"] = "fast"; }),
             "devices.cpu-full.block_fwd.fixed_s: must be a number, got \"fast\"");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["blok_fwd"] = j["devices"]["cpu-full"]["block_fwd"]; }),
             "p.json: devices.cpu-full.blok_fwd: unknown key");
  EXPECT_HAS(with([](auto& j) { j["devices"]["cpu-full"]["optimizer_s_per_param"] = -1; }),
             "devices.cpu-full.optimizer_s_per_param: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["links"][1]["bytes_per_s"] = 0; }), "p.json: links[1].bytes_per_s: must be > 0");
  EXPECT_HAS(with([](auto& j) { j["links"][0]["latency_s"] = -1; }), "p.json: links[0].latency_s: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["links"][0].erase("host_b"); }), "p.json: links[0].host_b: is missing");
  EXPECT_HAS(with([](auto& j) { j["links"] = 3; }), "p.json: links: must be an array");
  EXPECT_HAS(with([](auto& j) { j["memory"]["param_bytes_head"] = -5; }), "p.json: memory.param_bytes_head: must be >= 0");
  EXPECT_HAS(with([](auto& j) { j["memory"]["state_bytes_per_param_byte"] = 0; }),
             "p.json: memory.state_bytes_per_param_byte: must be > 0");
  EXPECT_HAS(with([](auto& j) { j.erase("memory"); }), "p.json: memory: is missing");
  EXPECT_HAS(with([](auto& j) { j["extra"] = 1; }), "p.json: extra: unknown key");
  // The model section is checked like a config's model section.
  EXPECT_HAS(with([](auto& j) { j["model"]["heads"] = 5; }), "p.json: key 'model.heads'");
  EXPECT_HAS(with([](auto& j) { j["model"]["layerz"] = 5; }), "unknown key 'model.layerz'");
  EXPECT_HAS(with([](auto& j) { j.erase("model"); }), "p.json: model: is missing");
  EXPECT_HAS(profile_error(nlohmann::json::array()), "p.json: expected a JSON object");

  TempDir dir;
  std::string bad = dir.write("bad.json", "{\"format\": ");
  EXPECT_HAS(error_of([&] { Profile::load(bad); }), "bad.json: not valid JSON");
  EXPECT_HAS(error_of([&] { Profile::load(dir.file("missing.json")); }), "missing.json");
}
