// Sharding and recomputation in the cost model: memory terms and gather times (cost_model.h).
#include "alloy/plan/cost_sharding.h"

#include <algorithm>
#include <functional>

namespace alloy::plan {

double CostContext::act_bytes_per_sample(double blocks, bool first, bool last, bool recompute) const {
  if (!recompute) return act_bytes_per_sample(blocks, first, last);
  const MemoryProfile& mem = profile_->memory;
  double b = static_cast<double>(blocks) * act_message_bytes_;  // each block's input
  if (first) b += mem.act_bytes_per_sample_embed;
  if (last) b += mem.act_bytes_per_sample_head;
  return b;
}

double CostContext::memory_floor_bytes(double param_bytes, double bucket_bytes, int64_t in_flight, int64_t m, int64_t blocks, bool first,
                                       bool last) const {
  const double mb = static_cast<double>(m);
  const double act = static_cast<double>(in_flight) * mb * act_bytes_per_sample(blocks, first, last, true) + working_bytes(blocks, m, true);
  if (!(bucket_bytes > 0)) return param_bytes * state_bytes_per_param_byte() + act;
  double largest = blocks > 0 ? profile_->memory.param_bytes_per_block : 0.0;
  if (first) largest = std::max(largest, embed_rest_ + wte_);
  if (last) largest = std::max(largest, head_rest_ + (first ? 0.0 : wte_));
  return bucket_bytes + std::min(param_bytes, 2 * largest) + act;
}

double CostContext::shard_gather_s(const Ring& r, double bytes, double min_share) const {
  if (r.n < 2) return 0;
  return static_cast<double>(r.n - 1) / r.n * r.latency_sum_s + std::max(0.0, 1 - min_share) * bytes / r.slowest_bytes_per_s;
}

namespace detail {

std::vector<std::vector<CostContext::Holder>> plan_holders(const Plan& plan, int64_t plan_heads) {
  std::vector<std::vector<CostContext::Holder>> holders(plan.pipelines.size());
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    const auto& stages = plan.pipelines[p].stages;
    for (size_t s = 0; s < stages.size(); ++s)
      holders[p].push_back({stages[s].ranks[0], stages[s].unit_begin(), stages[s].unit_end(), s == 0, s + 1 == stages.size(),
                            stages[s].cuts_mlp() ? static_cast<double>(stages[s].mlp_cut) / static_cast<double>(plan_heads) : 0.0});
  }
  return holders;
}

std::vector<RankShard> rank_shards(const Plan& plan, const CostContext& ctx, const std::vector<CostContext::SyncSet>& sets,
                                   const std::vector<int>& dev_of) {
  std::vector<RankShard> out(dev_of.size());
  for (auto& rs : out) rs.unit_gather_s.assign(static_cast<size_t>(ctx.num_units()), 0.0);
  std::vector<std::vector<double>> z3_units(dev_of.size());
  std::vector<double> largest(dev_of.size(), 0.0);
  for (const auto& set : sets) {
    const ShardingPlan* sp = plan.sharding_of(set.ids);
    if (!sp || sp->stage == 0) continue;
    const size_t n = set.ids.size();
    std::vector<double> share(n, 1.0 / static_cast<double>(n));
    if (!sp->shares.empty()) {
      double sum = 0;
      for (double v : sp->shares) sum += v;
      for (size_t j = 0; j < n; ++j) share[j] = sp->shares[j] / sum;
    }
    const double min_share = *std::min_element(share.begin(), share.end());
    std::vector<int> order(set.ids);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return ctx.ring_less(dev_of[static_cast<size_t>(a)], a, dev_of[static_cast<size_t>(b)], b);
    });
    std::vector<int> devs;
    for (int r : order) devs.push_back(dev_of[static_cast<size_t>(r)]);
    const CostContext::Ring ring = ctx.ring(devs);
    for (size_t j = 0; j < n; ++j) {
      const size_t r = static_cast<size_t>(set.ids[j]);
      RankShard& rs = out[r];
      const double kept_elsewhere = (1 - share[j]) * set.bytes;
      rs.optimizer_saved += kept_elsewhere;
      rs.zero = std::max(rs.zero, sp->stage);
      if (set.bytes > largest[r]) largest[r] = set.bytes, rs.shard = share[j];
      if (sp->stage == 3) {
        rs.weights_saved += kept_elsewhere;
        rs.grads_saved += kept_elsewhere;
        for (const auto& [u, bytes] : set.units) {
          rs.unit_gather_s[static_cast<size_t>(u)] = ctx.shard_gather_s(ring, bytes, min_share);
          z3_units[r].push_back(bytes);
        }
      } else {
        rs.param_gather_s = std::max(rs.param_gather_s, ctx.shard_gather_s(ring, set.bytes, min_share));
      }
    }
  }
  for (size_t r = 0; r < out.size(); ++r) {
    auto& u = z3_units[r];
    std::sort(u.begin(), u.end(), std::greater<double>());
    for (size_t k = 0; k < u.size() && k < 2; ++k) out[r].gathered += u[k];
  }
  return out;
}

std::pair<double, double> zero3_exposed_s(const CostContext& ctx, const RankShard& rs, int type, int64_t begin, int64_t end, bool first,
                                          bool last, bool recompute, int64_t m) {
  auto g = [&](int u) { return rs.unit_gather_s[static_cast<size_t>(u)]; };
  // The runtime's layers in forward order: embedding (with a tied wte), blocks, head.
  std::vector<double> gather, fwd, bwd;
  if (first) {
    gather.push_back(g(ctx.embed_unit()) + g(ctx.wte_unit()));
    fwd.push_back(ctx.forward_s(type, 0, true, false, m));
    bwd.push_back(ctx.backward_s(type, 0, true, false, m));
  }
  const double block_fwd = ctx.forward_s(type, 1, false, false, m);
  const double block_bwd = ctx.backward_s(type, 1, false, false, m) + (recompute ? block_fwd : 0.0);
  for (int64_t l = begin; l < end; ++l) {
    gather.push_back(g(ctx.half_unit(2 * l)) + g(ctx.half_unit(2 * l + 1)));  // a half this rank lacks gathers nothing
    fwd.push_back(block_fwd);
    bwd.push_back(block_bwd);
  }
  if (last) {
    gather.push_back(g(0) + (first ? 0.0 : g(ctx.wte_unit())));
    fwd.push_back(ctx.forward_s(type, 0, false, true, m));
    bwd.push_back(ctx.backward_s(type, 0, false, true, m));
  }
  double f = 0, b = 0;
  const size_t n = gather.size();
  for (size_t i = 0; i < n; ++i) {
    f += i == 0 ? gather[i] : std::max(0.0, gather[i] - fwd[i - 1]);
    const size_t k = n - 1 - i;  // backward order
    b += i == 0 ? gather[k] : std::max(0.0, gather[k] - bwd[k + 1]);
  }
  return {f, b};
}

}  // namespace detail
}  // namespace alloy::plan
