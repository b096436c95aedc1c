#pragma once
// Small pools and profiles for the planner's tests (test_cost_model.cpp, test_search.cpp,
// test_planner.cpp, test_fit_memory.cpp and the others that include it).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

#include "alloy/core/plan.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/profile.h"
#include "alloy/plan/search.h"

namespace alloy::plan::testing {

// Runs a rapidcheck property N times (the default 100 would make the exhaustive comparison slow).
template <typename F>
void check_times(int n, F f) {
  auto params = rc::detail::configuration().testParams;
  params.maxSuccess = n;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata md;
  md.id = std::string(info->test_case_name()) + "/" + info->name();
  md.description = info->name();
  const auto result = rc::detail::checkTestable(f, md, params);
  if (result.template is<rc::detail::SuccessResult>()) {
    if (!result.template get<rc::detail::SuccessResult>().distribution.empty()) {
      rc::detail::printResultMessage(result, std::cout);
      std::cout << std::endl;
    }
  } else {
    std::ostringstream ss;
    rc::detail::printResultMessage(result, ss);
    FAIL() << ss.str();
  }
}

// A device type whose costs are SCALE times the reference's; linear in the micro-batch size.
inline DeviceProfile dev_profile(double scale, double fixed = 0.0005, double per_sample = 0.002) {
  DeviceProfile d;
  d.block_fwd = {fixed * scale, per_sample * scale};
  d.block_bwd = {2 * fixed * scale, 2 * per_sample * scale};
  d.embed_fwd = {fixed * scale / 2, per_sample * scale / 4};
  d.embed_bwd = {fixed * scale / 2, per_sample * scale / 4};
  d.head_fwd = {fixed * scale, per_sample * scale};
  d.head_bwd = {fixed * scale, per_sample * scale};
  d.optimizer_s_per_param = 1e-9 * scale;
  return d;
}

inline Profile base_profile(int64_t layers, const std::string& arch = "llama") {
  Profile p;
  p.model.arch = arch;
  p.model.layers = layers;
  p.model.hidden = 32;
  p.model.heads = 4;
  p.model.seq_len = 16;
  p.model.vocab_size = 64;
  p.memory.param_bytes_per_block = 1e6;
  p.memory.param_bytes_embed = 2e6;
  p.memory.param_bytes_head = 2e6;
  p.memory.act_bytes_per_sample_block = 2e5;
  p.memory.act_bytes_per_sample_embed = 1e5;
  p.memory.act_bytes_per_sample_head = 4e5;
  p.memory.state_bytes_per_param_byte = 4;
  return p;
}

inline Device device(const std::string& name, const std::string& host, const std::string& type, double memory_gb = 0) {
  Device d;
  d.name = name;
  d.host = host;
  d.type = type;
  d.memory_gb = memory_gb;
  return d;
}

inline StagePlan stage(int rank, int64_t b, int64_t e, const std::string& dev) { return {{rank}, b, e, dev}; }

inline bool near_rel(double a, double b, double rel = 1e-9) {
  return std::fabs(a - b) <= rel * std::max({1e-300, std::fabs(a), std::fabs(b)});
}

// Devices a (host h0) and b (host h1), both of type "t", joined by one link.
inline ClusterSpec two_hosts(double bandwidth_gbps, double latency_ms) {
  ClusterSpec c;
  c.devices = {device("a", "h0", "t"), device("b", "h1", "t")};
  c.rules.push_back({"h0", "h1", Link{bandwidth_gbps, latency_ms}});
  return c;
}

inline void expect_uses_every_device(const SearchResult& r, const ClusterSpec& c, const Profile& p) {
  EXPECT_NO_THROW(r.plan.validate(p.model));
  std::set<int> seen;
  for (const auto& pl : r.plan.pipelines)
    for (int64_t k = 0; k < pl.depth(); ++k) {  // an interleaved pipeline's later chunks are the same ranks'
      const StagePlan& st = pl.stages[static_cast<size_t>(k)];
      ASSERT_EQ(st.ranks.size(), 1u);
      const int rank = st.ranks[0];
      EXPECT_TRUE(seen.insert(rank).second) << "rank " << rank << " twice";
      ASSERT_GE(rank, 0);
      ASSERT_LT(rank, static_cast<int>(c.devices.size()));
      EXPECT_EQ(st.device, c.devices[static_cast<size_t>(rank)].name);
    }
  EXPECT_EQ(seen.size(), c.devices.size());
  EXPECT_TRUE(r.cost.fits) << r.cost.explanation;
  EXPECT_TRUE(near_rel(r.search_step_s, r.cost.step_s)) << r.search_step_s << " vs " << r.cost.step_s;
}

// Costs independent of the micro-batch size, so a test's arithmetic is easy to follow.
inline DeviceProfile flat(double block_f, double block_b, double end_f, double end_b) {
  DeviceProfile d;
  d.block_fwd = {block_f, 0};
  d.block_bwd = {block_b, 0};
  d.embed_fwd = d.head_fwd = {end_f, 0};
  d.embed_bwd = d.head_bwd = {end_b, 0};
  d.optimizer_s_per_param = 0;
  return d;
}

}  // namespace alloy::plan::testing
