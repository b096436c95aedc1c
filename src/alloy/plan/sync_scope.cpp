#include "alloy/plan/sync_scope.h"

#include <algorithm>

#include "alloy/core/error.h"

namespace alloy::plan {

double slow_link_threshold_gbps(const ClusterSpec& cluster, const GradSyncConfig& g) {
  if (g.slow_link_gbps > 0) return g.slow_link_gbps;
  const auto hosts = cluster.hosts();
  double fastest = 0;
  for (size_t a = 0; a < hosts.size(); ++a)
    for (size_t b = a + 1; b < hosts.size(); ++b) fastest = std::max(fastest, cluster.link(hosts[a], hosts[b]).bandwidth_gbps);
  return fastest / 4;
}

int device_of_rank(const Plan& plan, const ClusterSpec& cluster, int rank) {
  const auto pos = plan.locate(rank);
  const StagePlan& st = plan.pipelines[static_cast<size_t>(pos.pipeline)].stages[static_cast<size_t>(pos.stage)];
  if (!st.device.empty()) {
    int d = cluster.device_index(st.device);
    if (d < 0) throw InputError("plan", "rank " + std::to_string(rank) + " runs on device '" + st.device + "', which " +
                                            (cluster.source.empty() ? "the cluster" : cluster.source) + " does not list");
    return d;
  }
  if (rank >= static_cast<int>(cluster.devices.size()))
    throw InputError("plan", "rank " + std::to_string(rank) + " names no device and the cluster has only " +
                                 std::to_string(cluster.devices.size()) + " (rank i runs on device i unless its stage says `device`)");
  return rank;
}

bool needs_slow_links(const GradSyncConfig& g) {
  if (g.lossy()) return g.scope == "slow-links";  // scope all compresses every set: none sums exact
  return g.allreduce == "auto";
}

std::vector<std::pair<int, int>> slow_rank_pairs(const Plan& plan, const ClusterSpec& cluster, const GradSyncConfig& g) {
  const double thr = slow_link_threshold_gbps(cluster, g);
  const int W = plan.world_size();
  std::vector<std::pair<int, int>> out;
  for (int a = 0; a < W; ++a)
    for (int b = a + 1; b < W; ++b) {
      const auto& da = cluster.devices[static_cast<size_t>(device_of_rank(plan, cluster, a))];
      const auto& db = cluster.devices[static_cast<size_t>(device_of_rank(plan, cluster, b))];
      if (da.host != db.host && cluster.link(da.host, db.host).bandwidth_gbps < thr) out.emplace_back(a, b);
    }
  return out;
}

void apply_grad_sync(Plan& plan, const Config& cfg, bool plan_from_file, const std::string& where) {
  GradSyncConfig& p = plan.grad_sync;
  const GradSyncConfig& c = cfg.grad_sync;
  auto take = [&](const char* key, auto GradSyncConfig::*field) {
    if (!plan_from_file || cfg.is_set(std::string("grad_sync.") + key)) p.*field = c.*field;
  };
  take("bucket_mb", &GradSyncConfig::bucket_mb);
  take("compression", &GradSyncConfig::compression);
  take("density", &GradSyncConfig::density);
  take("fusion", &GradSyncConfig::fusion);
  take("error_feedback", &GradSyncConfig::error_feedback);
  take("warmup_steps", &GradSyncConfig::warmup_steps);
  take("dense_steps", &GradSyncConfig::dense_steps);
  take("powersgd_rank", &GradSyncConfig::powersgd_rank);
  take("scope", &GradSyncConfig::scope);
  take("slow_link_gbps", &GradSyncConfig::slow_link_gbps);
  take("dgc_momentum", &GradSyncConfig::dgc_momentum);
  take("momentum_correction", &GradSyncConfig::momentum_correction);
  take("sidco_fit", &GradSyncConfig::sidco_fit);
  take("sidco_stages", &GradSyncConfig::sidco_stages);
  take("allow_lossy", &GradSyncConfig::allow_lossy);
  take("allreduce", &GradSyncConfig::allreduce);
  take("tree_stripes", &GradSyncConfig::tree_stripes);
  plan.validate(cfg.model, where);
}

}  // namespace alloy::plan
