// The cost model's tensor-parallel stages (cost_tp.h).
#include "alloy/plan/cost_tp.h"

#include <algorithm>

namespace alloy::plan::detail {

double tp_share(const StagePlan& st, const ModelConfig& model, size_t k) {
  if (st.tp() < 2) return 1.0;
  return static_cast<double>(st.tp_heads(model.heads)[k]) / static_cast<double>(model.heads);
}

// One micro-batch through a tensor-parallel stage: every rank computes its heads' share of the
// blocks (and what it computes whole of them: CostContext::tp_block_share) and of the embedding
// and head (their vocabulary rows split in the heads' ratio), and the
// group waits for its slowest member at each sum: one per half block forward and one backward,
// the embedding's (forward) and the head's (backward), and the vocabulary-parallel loss's three
// (forward). The members' compute is a max, the sums are added, all on the critical path; each
// sum as CostContext::tp_sum_s prices it (the profile's measured pairs, else a floor). Sequence
// parallelism keeps the sums' price (a reduce-scatter and an all-gather in place of each) and adds a
// re-gather per half block in the backward and a gather of the stage's output.
std::vector<TpMemberTime> tp_member_times(const CostContext& ctx, const ModelConfig& model, const StagePlan& st,
                                          const std::vector<int>& dev_of, bool first, bool last, int64_t m) {
  const int64_t ub = st.unit_begin(), ue = st.unit_end();
  std::vector<TpMemberTime> out;
  for (size_t k = 0; k < st.ranks.size(); ++k) {
    const int type = ctx.type_of(dev_of[static_cast<size_t>(st.ranks[k])]);
    const double f = tp_share(st, model, k);
    const double fb = ctx.forward_units_s(type, ub, ue, false, false, m), bb = ctx.backward_units_s(type, ub, ue, false, false, m);
    const double fe = ctx.forward_units_s(type, ub, ue, first, last, m) - fb, be = ctx.backward_units_s(type, ub, ue, first, last, m) - bb;
    const double fk = ctx.tp_block_share(type, f);  // the blocks' norms and residual are whole on every member
    // The projections' weight products split exactly in the heads' ratio (the norms are no projections).
    out.push_back({fk * fb + f * fe, fk * bb + f * be + (st.recompute ? fk * fb : 0.0), f * ctx.weight_units_s(type, ub, ue, m)});
  }
  return out;
}

TpStageTime tp_stage_time(const CostContext& ctx, const ModelConfig& model, const StagePlan& st, const std::vector<int>& dev_of,
                          bool first, bool last, int64_t m) {
  const int64_t ub = st.unit_begin(), ue = st.unit_end();
  TpStageTime t;
  std::vector<int> devs;
  for (int r : st.ranks) devs.push_back(dev_of[static_cast<size_t>(r)]);
  const double bytes = static_cast<double>(m * model.seq_len * model.hidden) * ctx.dtype_bytes();
  const double units = static_cast<double>(ue - ub);
  // The sums of one micro-batch, forward and backward, when the group waits for WAITS_FOR at each.
  auto sums = [&](const std::vector<int>& waits_for) {
    const double one = ctx.tp_sum_s(devs, bytes, waits_for);
    const double small = ctx.tp_sum_s(devs, static_cast<double>(m * model.seq_len) * 4.0 * 2.0, waits_for);
    double fwd = units * one + (first ? one : 0.0) + (last ? 3 * small : 0.0), bwd = units * one + (last ? one : 0.0);
    if (st.sequence_parallel) {
      // Sequence parallelism: each sum becomes a reduce-scatter and the all-gather before the next
      // column-parallel product, the pair moving a sum's bytes back to back; priced as the sum they
      // replace (measured on the emulated cluster-tp pair: the pairs cost about what the sums did).
      // What comes on top, each an all-gather of half a sum's bytes at the measured line's price:
      // the backward's re-gather of every half block's released input, the stage's output gathered
      // (for the next stage or the head), and in the backward the gradient of what the stage cut on
      // entry (the embedding's lookups on the first stage, the received input on the others).
      const double half = ctx.tp_sum_s(devs, bytes / 2, waits_for);
      fwd += half;
      // Under recomputation nothing is released to re-gather (the recomputed forward's own
      // exchanges are priced below, as without SP).
      bwd += (st.recompute ? 0.0 : units * half) + half;  // + the embedding's gradient or the input's, gathered
    }
    // Recomputation runs each block's forward again in the backward, its sums with it.
    if (st.recompute) bwd += units * one;
    return std::pair<double, double>{fwd, bwd};
  };
  // The slowest member sets the pace; each computes in stretches between the sums, faster than
  // its steady rate where a CPU quota refills in them (CostContext::tp_member_s). A stretch ends
  // at each half block's sum, the embedding's, the loss's (its three small sums come back to back)
  // and the head's backward one; sequence parallelism's pairs come back to back too.
  const double fwd_chunks = units + (first ? 1 : 0) + (last ? 1 : 0);
  const double bwd_chunks = units * (st.recompute ? 2 : 1) + (last ? 1 : 0);
  const std::vector<TpMemberTime> members = tp_member_times(ctx, model, st, dev_of, first, last, m);
  // The members the sums wait for: those whose compute, less what their quotas' bursts give back,
  // takes longest at the pairs' measured price.
  std::vector<double> compute;
  for (const auto& mt : members) compute.push_back(mt.forward_s + mt.backward_s);
  const auto [fwd_measured, bwd_measured] = sums({});
  const auto [fwd, bwd] = sums(ctx.tp_waited_for(devs, compute, fwd_measured + bwd_measured, fwd_chunks + bwd_chunks));
  t.comm_s = fwd + bwd;
  for (size_t k = 0; k < members.size(); ++k) {
    const int type = ctx.type_of(devs[k]);
    t.forward_s = std::max(t.forward_s, ctx.tp_member_s(type, members[k].forward_s, fwd, fwd_chunks));
    t.backward_s = std::max(t.backward_s, ctx.tp_member_s(type, members[k].backward_s, bwd, bwd_chunks));
    t.weight_s = std::max(t.weight_s, members[k].weight_s);
    t.input_backward_s =
        std::max(t.input_backward_s, ctx.tp_member_s(type, members[k].backward_s - members[k].weight_s, bwd, bwd_chunks));
  }
  return t;
}

}  // namespace alloy::plan::detail
