// The cost model's simulation of a whole plan (simulate_plan) and its JSON form; the per-device
// and per-link figures it combines are CostContext's (cost_model.cpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/cost_sharding.h"
#include "alloy/plan/cost_tp.h"

namespace alloy::plan {

namespace {

std::string gb(double bytes) {
  std::ostringstream o;
  o.precision(bytes >= 1e9 ? 4 : 3);
  if (std::fabs(bytes) >= 1e9) o << bytes / 1e9 << " GB";
  else if (std::fabs(bytes) >= 1e6) o << bytes / 1e6 << " MB";
  else o << bytes / 1e3 << " kB";
  return o.str();
}

std::string sharding_text(const StageCost& sc) {
  if (sc.zero_stage == 0 && !sc.recompute) return "";
  std::ostringstream o;
  o << " (";
  if (sc.zero_stage > 0) o << "ZeRO-" << sc.zero_stage << ", share " << sc.shard;
  if (sc.recompute) o << (sc.zero_stage > 0 ? ", " : "") << "recomputing";
  o << ")";
  return o.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// simulate_plan

namespace {

// The ranks of interleaved pipeline P (no tensor parallelism, no sharding, whole units: Plan::validate
// and training_problem see to it), one StageCost each over all its chunks: COSTS per chunk (listed
// stage), SIM per rank. Memory: each chunk's weights with its embedding or head; activations as
// the rank's peak of chunk-micro-batches in flight, each the size of its average chunk's.
void interleaved_stage_costs(const CostContext& ctx, const Plan& plan, size_t p, const pipeline::SimCosts& costs,
                             const pipeline::SimResult& sim, const std::vector<double>& p2p, const std::vector<int>& dev_of, PlanCost* pc) {
  const PipelinePlan& pl = plan.pipelines[p];
  const int64_t D = pl.depth(), n = static_cast<int64_t>(pl.stages.size()), M = pl.num_micro_batches, m = pl.micro_batch_size;
  for (int64_t s = 0; s < D; ++s) {
    const StagePlan& st = pl.stages[static_cast<size_t>(s)];
    const int r = st.ranks[0], d = dev_of[static_cast<size_t>(r)];
    StageCost sc;
    sc.pipeline = static_cast<int>(p);
    sc.stage = static_cast<int>(s);
    sc.rank = r;
    sc.device = ctx.cluster().devices[static_cast<size_t>(d)].name;
    sc.type = ctx.type_name(ctx.type_of(d));
    sc.host = ctx.host_name(ctx.host_of(d));
    sc.layer_begin = st.layer_begin;
    sc.layer_end = pl.stages[static_cast<size_t>(n - D + s)].layer_end;
    sc.unit_begin = st.unit_begin();
    sc.unit_end = pl.stages[static_cast<size_t>(n - D + s)].unit_end();
    double blocks = 0, param_bytes = 0, frozen = 0, working = 0;
    bool any_recompute = false, first_any = false, last_any = false;
    for (int64_t c = s; c < n; c += D) {
      const StagePlan& ch = pl.stages[static_cast<size_t>(c)];
      const bool first = c == 0, last = c + 1 == n;
      sc.chunk_units.emplace_back(ch.unit_begin(), ch.unit_end());
      sc.forward_s += static_cast<double>(M) * costs.forward[static_cast<size_t>(c)];
      sc.backward_s += static_cast<double>(M) * costs.backward[static_cast<size_t>(c)];
      const double b = ctx.compute_blocks(ch.unit_begin(), ch.unit_end());
      const double pb = ctx.param_blocks(ch.unit_begin(), ch.unit_end());
      blocks += b;
      param_bytes += ctx.param_bytes(pb, first, last);
      frozen += ctx.frozen_bytes(pb, first, last);
      working = std::max(working, ctx.working_bytes(b, m, ch.recompute));
      any_recompute = any_recompute || ch.recompute;
      first_any = first_any || first;
      last_any = last_any || last;
    }
    const double chunks = static_cast<double>(pl.virtual_stages);
    sc.p2p_s = p2p[static_cast<size_t>(s)];
    sc.bubble_s = std::max(0.0, sim.makespan - sc.forward_s - sc.backward_s);
    sc.peak_in_flight = sim.peak_in_flight[static_cast<size_t>(s)];
    sc.recompute = any_recompute;
    sc.param_bytes = param_bytes;
    sc.activation_bytes = static_cast<double>(sc.peak_in_flight * m) * ctx.act_bytes_per_sample(blocks / chunks, first_any, last_any, any_recompute) +
                          working;
    sc.weight_bytes = param_bytes + frozen;
    sc.grad_bytes = param_bytes;
    sc.optimizer_bytes = (ctx.state_bytes_per_param_byte() - 2) * param_bytes;
    sc.memory_capacity_bytes = ctx.capacity_bytes(d);
    sc.optimizer_s = ctx.optimizer_s(ctx.type_of(d), param_bytes);
    pc->stages.push_back(sc);
  }
}

}  // namespace

PlanCost simulate_plan(const Plan& plan, const ClusterSpec& cluster, const Profile& profile) {
  plan.validate(profile.model, "plan");
  CostContext ctx(cluster, profile);
  PlanCost pc;
  const int W = plan.world_size();
  std::vector<int> dev_of(static_cast<size_t>(W), -1);
  std::map<int, int> rank_on_device;
  for (size_t p = 0; p < plan.pipelines.size(); ++p)
    for (size_t s = 0; s < plan.pipelines[p].stages.size(); ++s) {
      const StagePlan& st = plan.pipelines[p].stages[s];
      const std::string f = "pipelines[" + std::to_string(p) + "].stages[" + std::to_string(s) + "].device";
      if (st.device.empty()) throw InputError("plan", f + ": missing; the cost model needs the device each stage runs on");
      int d = cluster.device_index(st.device);
      if (d < 0) {
        std::vector<std::string> names;
        for (const auto& x : cluster.devices) names.push_back(x.name);
        throw InputError("plan", f + ": no device '" + st.device + "' in the cluster (devices: " + names_text(names) + ")");
      }
      if (st.tp() > 1 && st.devices.size() != st.ranks.size())
        throw InputError("plan", "pipelines[" + std::to_string(p) + "].stages[" + std::to_string(s) +
                                     "].devices: a tensor-parallel stage needs each rank's device for the cost model");
      for (size_t k = 0; k < st.ranks.size(); ++k) {
        const std::string& name = st.tp() > 1 ? st.devices[k] : st.device;
        const int dk = st.tp() > 1 ? cluster.device_index(name) : d;
        if (dk < 0) throw InputError("plan", f + "s: no device '" + name + "' in the cluster");
        auto [it, fresh] = rank_on_device.emplace(dk, st.ranks[k]);
        if (!fresh && it->second != st.ranks[k])  // an interleaved rank's later chunks meet its device again
          throw InputError("plan", f + ": device '" + name + "' already runs rank " + std::to_string(it->second) +
                                       "; the cost model puts one rank on a device");
        dev_of[static_cast<size_t>(st.ranks[k])] = dk;
      }
    }

  // The holder sets first: sharding changes the stages' compute (ZeRO-3's gathers) and memory.
  const std::vector<std::vector<CostContext::Holder>> holders = detail::plan_holders(plan, profile.model.heads);
  ctx.set_grad_sync(plan.grad_sync);
  const auto sets = ctx.sync_sets(holders);
  const std::vector<detail::RankShard> shard = detail::rank_shards(plan, ctx, sets, dev_of);

  std::vector<double> last_bwd_start(static_cast<size_t>(W), 0), phase_end(static_cast<size_t>(W), 0);
  std::vector<size_t> stage_of_rank(static_cast<size_t>(W), 0);
  std::vector<double> gather_s(static_cast<size_t>(W), 0);
  std::map<std::pair<size_t, int64_t>, double> tp_comm;  // (pipeline, stage) -> the step's TP sums
  std::vector<std::vector<int>> pipeline_hosts;
  for (const auto& pl : plan.pipelines) {
    pipeline_hosts.emplace_back();
    // An interleaved pipeline crosses its ranks' links V times, one message at a time each way (the
    // simulation queues them): its positions and the wrap back to the first.
    const size_t listed = pl.interleaved() ? static_cast<size_t>(pl.depth()) + 1 : pl.stages.size();
    for (size_t s = 0; s < listed; ++s) pipeline_hosts.back().push_back(ctx.host_of(dev_of[static_cast<size_t>(pl.stages[s].ranks[0])]));
  }
  const std::vector<std::vector<int>> link_share = ctx.pipeline_link_shares(pipeline_hosts);
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    const PipelinePlan& pl = plan.pipelines[p];
    // S: the listed stages (an interleaved pipeline's chunks, costed one by one); D: the ranks.
    const int64_t S = static_cast<int64_t>(pl.stages.size()), D = pl.depth(), M = pl.num_micro_batches, m = pl.micro_batch_size;
    pipeline::SimCosts costs;
    const bool split = pipeline::splits_backward(plan.schedule_of(p));
    std::vector<std::vector<pipeline::Action>> actions;
    for (int64_t s = 0; s < S; ++s) {
      const StagePlan& st = pl.stages[static_cast<size_t>(s)];
      const int d = dev_of[static_cast<size_t>(st.ranks[0])];
      const bool first = s == 0, last = s + 1 == S;
      const int type = ctx.type_of(d);
      const int64_t ub = st.unit_begin(), ue = st.unit_end();
      const detail::RankShard& rs = shard[static_cast<size_t>(st.ranks[0])];
      const auto [gf, gb3] = rs.zero == 3 ? detail::zero3_exposed_s(ctx, rs, ctx.type_of(d), st.layer_begin, st.layer_end, first, last,
                                                                     st.recompute, m)
                                          : std::pair<double, double>{0, 0};
      gather_s[static_cast<size_t>(st.ranks[0])] = static_cast<double>(M) * (gf + gb3);
      costs.forward_mb.emplace_back();
      costs.backward_mb.emplace_back();
      costs.weight_mb.emplace_back();
      // A cut MLP (StagePlan::mlp_cut): the shares of its first and last units' columns this stage
      // computes, and its messages' widths in hidden states.
      const StagePlan* prev = s > 0 ? &pl.stages[static_cast<size_t>(s - 1)] : nullptr;
      const double heads = static_cast<double>(profile.model.heads);
      const double in_share = prev && prev->cuts_mlp() ? 1 - static_cast<double>(prev->mlp_cut) / heads : 1.0;
      const double out_share = st.cuts_mlp() ? static_cast<double>(st.mlp_cut) / heads : 1.0;
      const double in_width = prev && prev->cuts_mlp() ? 2.0 : 1.0, out_width = st.cuts_mlp() ? 2.0 : 1.0;
      // One micro-batch of MM samples through units [b, e): forward, backward, weight pass, TP sums.
      struct MbCost {
        double forward, backward, weight, tp_comm;
      };
      auto cost_at = [&](int64_t mm, int64_t b, int64_t e) -> MbCost {
        const double p2p_cpu = ctx.p2p_cpu_s(type, first, last, mm, in_width, out_width);  // the stage's messages' CPU time
        if (st.tp() > 1) {
          const detail::TpStageTime t = detail::tp_stage_time(ctx, profile.model, st, dev_of, first, last, mm);
          // Split: the members' weight passes come out of the backward, its sums stay in it.
          return {t.forward_s + gf + p2p_cpu, (split ? t.input_backward_s + t.weight_s : t.backward_s) + gb3 + p2p_cpu,
                  split ? t.weight_s : 0.0, t.comm_s};
        }
        // A float's units differ per micro-batch (a float and a cut never share a boundary).
        const double in = b == ub ? in_share : 1.0, out = e == ue ? out_share : 1.0;
        return {ctx.forward_units_s(type, b, e, first, last, mm, in, out) + gf + p2p_cpu,
                ctx.backward_units_s(type, b, e, first, last, mm, in, out) + gb3 + p2p_cpu +
                    (st.recompute ? ctx.forward_units_s(type, b, e, false, false, mm, in, out) : 0.0),
                split ? ctx.weight_units_s(type, b, e, mm, in, out) : 0.0, 0.0};
      };
      if (!pl.floats() && !pl.short_last()) {
        const MbCost c = cost_at(m, ub, ue);
        costs.forward.push_back(c.forward);
        costs.backward.push_back(c.backward);
        costs.weight.push_back(c.weight);
        if (st.tp() > 1) tp_comm[{p, s}] = static_cast<double>(M) * c.tp_comm;
      } else {
        // A floating boundary, or a short last micro-batch: each micro-batch has its own figures;
        // the stage's per-micro-batch figure (and so its step figures below) is their mean.
        double f_sum = 0, b_sum = 0, comm = 0;
        for (int64_t j = 0; j < M; ++j) {
          const auto [b, e] = pl.units_of(static_cast<size_t>(s), j);
          const MbCost c = cost_at(j + 1 == M ? pl.last_size() : m, b, e);
          costs.forward_mb.back().push_back(c.forward);
          costs.backward_mb.back().push_back(c.backward);
          costs.weight_mb.back().push_back(c.weight);
          f_sum += c.forward, b_sum += c.backward, comm += c.tp_comm;
        }
        costs.forward.push_back(f_sum / static_cast<double>(M));
        costs.backward.push_back(b_sum / static_cast<double>(M));
        costs.weight.push_back(0);  // weight_mb[s] holds its figures
        if (st.tp() > 1) tp_comm[{p, s}] = comm;
      }
      if (!last) {
        const int next = dev_of[static_cast<size_t>(pl.stages[static_cast<size_t>(s + 1)].ranks[0])];
        costs.p2p_link.push_back(ctx.p2p_s(ctx.host_of(d), ctx.host_of(next), m, link_share[p][static_cast<size_t>(s % D)], out_width));
        costs.p2p_latency.push_back(ctx.latency_s(ctx.host_of(d), ctx.host_of(next)));
      }
      if (s < D) actions.push_back(pipeline::make_schedule(plan.schedule_of(p), s, D, M, pl.virtual_stages));
    }
    // Interleaved, the links simulate() needs are the first D boundaries': D - 1 between the ranks'
    // positions, and boundary D - 1 (rank D - 1's first chunk to rank 0's second) the wrap.
    pipeline::SimResult sim = pipeline::simulate(actions, costs);
    PipelineCost pcost;
    pcost.micro_batch_size = m;
    pcost.num_micro_batches = M;
    pcost.phase_s = sim.makespan;
    std::vector<double> p2p(static_cast<size_t>(D), 0);
    for (const auto& e : sim.events)
      if (e.action.kind == pipeline::ActionKind::SendActivation || e.action.kind == pipeline::ActionKind::SendGrad)
        p2p[static_cast<size_t>(e.stage)] += e.end - e.start;
    for (size_t s = 0; s < static_cast<size_t>(D); ++s) {
      const size_t r = static_cast<size_t>(pl.stages[s].ranks[0]);
      last_bwd_start[r] = sim.last_backward_start[s];
      phase_end[r] = sim.last_backward_end[s];
    }
    if (pl.interleaved()) {
      interleaved_stage_costs(ctx, plan, p, costs, sim, p2p, dev_of, &pc);
      for (int64_t s = 0; s < D; ++s) stage_of_rank[static_cast<size_t>(pl.stages[static_cast<size_t>(s)].ranks[0])] = pc.stages.size() - static_cast<size_t>(D - s);
      pc.pipelines.push_back(pcost);
      continue;
    }
    for (int64_t s = 0; s < S; ++s) {
      const StagePlan& st = pl.stages[static_cast<size_t>(s)];
      const int r = st.ranks[0], d = dev_of[static_cast<size_t>(r)];
      const bool first = s == 0, last = s + 1 == S;
      StageCost sc;
      sc.pipeline = static_cast<int>(p);
      sc.stage = static_cast<int>(s);
      sc.rank = r;
      sc.device = cluster.devices[static_cast<size_t>(d)].name;
      sc.type = ctx.type_name(ctx.type_of(d));
      sc.host = ctx.host_name(ctx.host_of(d));
      sc.layer_begin = st.layer_begin;
      sc.layer_end = st.layer_end;
      sc.unit_begin = st.unit_begin();
      sc.unit_end = st.unit_end();
      sc.forward_s = static_cast<double>(M) * costs.forward[static_cast<size_t>(s)];
      sc.backward_s = static_cast<double>(M) * costs.backward[static_cast<size_t>(s)];
      sc.p2p_s = p2p[static_cast<size_t>(s)];
      sc.bubble_s = std::max(0.0, sim.makespan - sc.forward_s - sc.backward_s);
      sc.phase_end_s = phase_end[static_cast<size_t>(r)];
      sc.peak_in_flight = sim.peak_in_flight[static_cast<size_t>(s)];
      const double blocks = ctx.compute_blocks(st.unit_begin(), st.unit_end());
      // A tensor-parallel rank holds its heads' share of the blocks (norms and biases aside).
      // Memory is checked on the member likeliest not to fit: the largest share for its capacity.
      size_t mem_k = 0;
      for (size_t k = 1; k < st.ranks.size(); ++k) {
        auto need = [&](size_t j) {
          const double cap = ctx.capacity_bytes(dev_of[static_cast<size_t>(st.ranks[j])]);
          return detail::tp_share(st, profile.model, j) / (cap > 0 ? cap : 1e30);
        };
        if (need(k) > need(mem_k)) mem_k = k;
      }
      const int mem_dev = dev_of[static_cast<size_t>(st.ranks[mem_k])];
      const double param_blocks = ctx.param_blocks(st.unit_begin(), st.unit_end()) * detail::tp_share(st, profile.model, mem_k);
      if (st.tp() > 1) {
        sc.tp = st.tp();
        sc.tp_comm_s = tp_comm[{p, s}];
        const auto members = detail::tp_member_times(ctx, profile.model, st, dev_of, first, last, m);
        for (size_t k = 0; k < members.size(); ++k) {
          const int dk = dev_of[static_cast<size_t>(st.ranks[k])];
          sc.tp_members.push_back({st.ranks[k], ctx.type_name(ctx.type_of(dk)),
                                   static_cast<double>(M) * (members[k].forward_s + members[k].backward_s)});
        }
      }
      const detail::RankShard& rs = shard[static_cast<size_t>(r)];
      sc.param_bytes = ctx.param_bytes(param_blocks, first, last);
      sc.recompute = st.recompute;
      sc.zero_stage = rs.zero;
      sc.shard = rs.shard;
      // Under tensor parallelism a block's saved tensors split with its heads but for the residual
      // stream's (block input, the two norms' outputs, the summed outputs: about a fifth of them);
      // sequence parallelism splits those too, by positions in the heads' ratio (the gathered
      // inputs its products keep are released after the forward and gathered again in the backward).
      const double tp_f = detail::tp_share(st, profile.model, mem_k);
      const double act_blocks = st.tp() > 1 ? blocks * (st.sequence_parallel ? tp_f : 0.2 + 0.8 * tp_f) : blocks;
      sc.activation_bytes = static_cast<double>(sc.peak_in_flight * m) * ctx.act_bytes_per_sample(act_blocks, first, last, st.recompute) +
                            ctx.working_bytes(act_blocks, m, st.recompute);
      // zb-h1: a recomputing stage's held weight passes (s of them on stage s) keep the recomputed
      // projections' inputs and output gradients, about a whole block's saved tensors, not its input.
      if (split && st.recompute && s > 0)
        sc.activation_bytes += static_cast<double>(std::min<int64_t>(s, M) * m) *
                               (ctx.act_bytes_per_sample(act_blocks, first, last, false) - ctx.act_bytes_per_sample(act_blocks, first, last, true));
      sc.weight_bytes = sc.param_bytes - rs.weights_saved +
                        (st.tp() > 1 ? ctx.tp_frozen_bytes(param_blocks, first, last) : ctx.frozen_bytes(param_blocks, first, last));
      sc.grad_bytes = sc.param_bytes - rs.grads_saved;
      sc.optimizer_bytes = (ctx.state_bytes_per_param_byte() - 2) * (sc.param_bytes - rs.optimizer_saved);
      sc.gathered_bytes = rs.gathered;
      sc.gather_s = gather_s[static_cast<size_t>(r)];
      sc.param_gather_s = rs.param_gather_s;
      sc.memory_capacity_bytes = ctx.capacity_bytes(mem_dev);
      sc.optimizer_s = ctx.optimizer_s(ctx.type_of(d), sc.param_bytes - rs.optimizer_saved);
      stage_of_rank[static_cast<size_t>(r)] = pc.stages.size();
      pc.stages.push_back(sc);
    }
    pc.pipelines.push_back(pcost);
  }

  // Gradient sync per holder set, bucket by bucket. First every set's load on the links (they
  // share them), then each set's buckets on its share.
  const double bucket_bytes = plan.grad_sync.bucket_mb * 1024 * 1024;
  std::vector<double> done(phase_end), bucket(static_cast<size_t>(W), 0), longest(static_cast<size_t>(W), 0);
  // own[r]: when rank r would be done if every other holder were early: the term it adds to the
  // max that makes the step (the search's per-replica decomposition, cost 5 for stragglers).
  std::vector<double> own(phase_end), tail;
  std::vector<double> encode_total(static_cast<size_t>(W), 0);
  std::vector<const CostContext::Holder*> holder_of(static_cast<size_t>(W), nullptr);
  std::vector<int64_t> mbs_of(static_cast<size_t>(W), 0);
  for (size_t p = 0; p < holders.size(); ++p)
    for (const auto& h : holders[p]) {
      // An interleaved rank's first chunk: its last backward is the step's last (the others' buckets
      // wait in the reducer for it).
      if (!holder_of[static_cast<size_t>(h.id)]) holder_of[static_cast<size_t>(h.id)] = &h;
      mbs_of[static_cast<size_t>(h.id)] = plan.pipelines[p].last_size();  // the buckets fill during the last backward
    }
  std::vector<std::vector<int>> ring_ranks(sets.size()), ring_devs(sets.size());
  CostContext::LinkLoads loads = ctx.empty_loads();
  for (size_t i = 0; i < sets.size(); ++i) {
    ring_ranks[i] = sets[i].ids;
    std::sort(ring_ranks[i].begin(), ring_ranks[i].end(), [&](int a, int b) {
      return ctx.ring_less(dev_of[static_cast<size_t>(a)], a, dev_of[static_cast<size_t>(b)], b);
    });
    for (int r : ring_ranks[i]) ring_devs[i].push_back(dev_of[static_cast<size_t>(r)]);
    ctx.add_load(ring_devs[i], sets[i].bytes, &loads);
  }
  for (size_t p = 0; p < plan.pipelines.size(); ++p) ctx.add_pipeline_tail_load(pipeline_hosts[p], plan.pipelines[p].last_size(), &loads);
  std::vector<CostContext::Bucket> bks;
  for (size_t i = 0; i < sets.size(); ++i) {
    const auto& set = sets[i];
    SyncGroupCost g;
    g.ranks = ring_ranks[i];
    const CostContext::SyncShape shape = ctx.sync_shape(ring_devs[i], &loads, set.bytes);
    g.bytes = set.bytes;
    g.compressed = shape.compressed;
    g.hierarchical = shape.hierarchical;
    g.regions = shape.num_regions;
    g.tree = shape.tree;
    g.stripes = shape.tree ? shape.sum_tree.stripes : 1;
    g.slowest_bytes_per_s = shape.tree           ? shape.sum_tree.slowest_bytes_per_s
                            : shape.hierarchical ? shape.leaders.slowest_bytes_per_s
                                                 : shape.ring.slowest_bytes_per_s;
    if (shape.compressed) {
      g.wire_bytes = ctx.wire_ratio() * set.bytes;
      g.encode_s = (shape.encode_s_per_elem + shape.decode_s_per_elem) * set.bytes / ctx.dtype_bytes();
    }
    ctx.buckets(shape, set.units, bucket_bytes, &bks);
    const double once = ctx.chain_latency_s(shape, set.bytes);  // a tree's round trip, once a chain
    tail.assign(bks.size() + 1, once);
    for (size_t k = bks.size(); k-- > 0;) tail[k] = tail[k + 1] + bks[k].time_s;
    double end = 0;
    for (size_t k = 0; k < bks.size(); ++k) {
      double ready = 0;
      for (int r : g.ranks) {
        const CostContext::Holder& h = *holder_of[static_cast<size_t>(r)];
        const MicroBatchCost off = ctx.unit_ready(ctx.type_of(dev_of[static_cast<size_t>(r)]), h.begin, h.end, h.first, h.last, bks[k].last_unit);
        const double mine = last_bwd_start[static_cast<size_t>(r)] + off.at(static_cast<double>(mbs_of[static_cast<size_t>(r)]));
        ready = std::max(ready, mine);
        own[static_cast<size_t>(r)] = std::max(own[static_cast<size_t>(r)], mine + tail[k]);
      }
      if (k == 0) g.ready_s = ready, g.time_s = once;
      end = std::max(ready + once, end) + bks[k].time_s;
      g.time_s += bks[k].time_s;
      g.buckets += bks[k].collectives;
    }
    g.done_s = end;
    for (int r : g.ranks) {
      done[static_cast<size_t>(r)] = std::max(done[static_cast<size_t>(r)], end);
      bucket[static_cast<size_t>(r)] += ctx.sync_buffer_bytes(shape, set.bytes);
      longest[static_cast<size_t>(r)] = std::max(longest[static_cast<size_t>(r)], g.time_s);
      if (shape.compressed && !shape.hierarchical) encode_total[static_cast<size_t>(r)] += ctx.encode_s(shape, set.bytes);
      encode_total[static_cast<size_t>(r)] +=
          ctx.sync_cpu_s(ctx.type_of(dev_of[static_cast<size_t>(r)]), shape, set.bytes, g.ranks.size(), dev_of[static_cast<size_t>(r)]);
    }
    pc.sync_groups.push_back(g);
  }
  // Flat sets encode on the autograd thread: the backward ends that much later. And the sync's
  // CPU time shares the rank's CPU with its compute: no earlier than the backward plus that.
  for (int r = 0; r < W; ++r) {
    done[static_cast<size_t>(r)] = std::max(done[static_cast<size_t>(r)], phase_end[static_cast<size_t>(r)] + encode_total[static_cast<size_t>(r)]);
    own[static_cast<size_t>(r)] = std::max(own[static_cast<size_t>(r)], phase_end[static_cast<size_t>(r)] + encode_total[static_cast<size_t>(r)]);
  }

  pc.world_allreduce_s = ctx.world_sum_s(dev_of);

  std::vector<std::string> overflow;
  for (auto& sc : pc.stages) {
    const size_t r = static_cast<size_t>(sc.rank);
    sc.sync_s = longest[r];
    sc.sync_exposed_s = done[r] - phase_end[r];
    const auto& pl = plan.pipelines[static_cast<size_t>(sc.pipeline)];
    // An interleaved rank's chunks send both ways, whatever its position.
    sc.bucket_bytes = bucket[r] + ctx.send_buffer_bytes(sc.stage == 0 && !pl.interleaved(), sc.stage + 1 == pl.depth() && !pl.interleaved(),
                                                        pl.num_micro_batches, pl.micro_batch_size);
    sc.state_bytes = sc.weight_bytes + sc.grad_bytes + sc.optimizer_bytes;
    sc.memory_bytes = (sc.state_bytes + sc.bucket_bytes) + sc.gathered_bytes + sc.activation_bytes;
    sc.fits = sc.memory_capacity_bytes <= 0 || sc.memory_bytes <= sc.memory_capacity_bytes;
    if (!sc.fits) {
      const double over = sc.memory_bytes - sc.memory_capacity_bytes;
      std::ostringstream o;
      o << "device '" << sc.device << "' (rank " << sc.rank << ", pipeline " << sc.pipeline << " stage " << sc.stage << ", blocks "
        << blocks_text(sc.unit_begin, sc.unit_end) << ") needs " << gb(sc.memory_bytes) << " (" << static_cast<int64_t>(sc.memory_bytes)
        << " bytes: weights+gradients+AdamW " << gb(sc.state_bytes) << sharding_text(sc) << ", sync buckets and sent messages " << gb(sc.bucket_bytes)
        << (sc.gathered_bytes > 0 ? ", gathered layers " + gb(sc.gathered_bytes) : std::string()) << ", activations "
        << gb(sc.activation_bytes) << " for " << sc.peak_in_flight << " micro-batch" << (sc.peak_in_flight == 1 ? "" : "es") << " of "
        << pl.micro_batch_size << " in flight) but has " << gb(sc.memory_capacity_bytes) << ": over by " << gb(over) << " ("
        << static_cast<int64_t>(std::ceil(over)) << " bytes, " << static_cast<int>(std::ceil(100 * over / sc.memory_capacity_bytes)) << "%)";
      overflow.push_back(o.str());
    }
    pc.sync_done_s = std::max(pc.sync_done_s, done[r]);
    pc.optimizer_s = std::max(pc.optimizer_s, sc.optimizer_s);
    pc.param_gather_s = std::max(pc.param_gather_s, sc.param_gather_s);
  }
  for (const auto& p : pc.pipelines) pc.phase_s = std::max(pc.phase_s, p.phase_s);
  for (size_t p = 0; p < pc.pipelines.size(); ++p)
    for (const auto& st : plan.pipelines[p].stages) {
      pc.pipelines[p].done_s = std::max(pc.pipelines[p].done_s, done[static_cast<size_t>(st.ranks[0])]);
      pc.pipelines[p].own_done_s = std::max(pc.pipelines[p].own_done_s, own[static_cast<size_t>(st.ranks[0])]);
    }
  std::vector<std::pair<double, double>> draws;
  for (size_t p = 0; p < pc.pipelines.size(); ++p) {
    double noise = 0;
    for (const auto& st : plan.pipelines[p].stages) noise = std::max(noise, ctx.step_noise(ctx.type_of(dev_of[static_cast<size_t>(st.ranks[0])])));
    pc.pipelines[p].noise_s = CostContext::done_sd(noise, pc.pipelines[p].own_done_s);
    draws.push_back({pc.pipelines[p].own_done_s, pc.pipelines[p].noise_s});
  }
  pc.straggler_s = std::max(0.0, expected_max(draws) - pc.sync_done_s);
  bool one_stage = true;  // replicas of one stage of one rank, unsharded
  for (const auto& sc : pc.stages) one_stage = one_stage && sc.zero_stage == 0;
  for (const auto& pl : plan.pipelines) one_stage = one_stage && pl.stages.size() == 1 && pl.stages[0].ranks.size() == 1;
  pc.world_allreduce_exposed_s = ctx.world_sum_exposed_s(one_stage);
  pc.step_s = ((pc.sync_done_s + pc.straggler_s) + pc.world_allreduce_exposed_s) + pc.optimizer_s + pc.param_gather_s;
  pc.fits = overflow.empty();
  for (size_t i = 0; i < overflow.size(); ++i) pc.explanation += (i ? "; " : "") + overflow[i];
  return pc;
}

nlohmann::json PlanCost::to_json() const {
  using nlohmann::json;
  json j = {{"step_s", step_s},
            {"phase_s", phase_s},
            {"sync_done_s", sync_done_s},
            {"straggler_s", straggler_s},
            {"world_allreduce_s", world_allreduce_s},
            {"world_allreduce_exposed_s", world_allreduce_exposed_s},
            {"optimizer_s", optimizer_s},
            {"param_gather_s", param_gather_s},
            {"fits", fits}};
  if (!explanation.empty()) j["explanation"] = explanation;
  j["pipelines"] = json::array();
  for (const auto& p : pipelines)
    j["pipelines"].push_back({{"micro_batch_size", p.micro_batch_size},
                              {"num_micro_batches", p.num_micro_batches},
                              {"phase_s", p.phase_s},
                              {"done_s", p.done_s},
                              {"own_done_s", p.own_done_s},
                              {"noise_s", p.noise_s}});
  j["per_stage"] = json::array();
  for (const auto& s : stages) {
    j["per_stage"].push_back({{"pipeline", s.pipeline},
                              {"stage", s.stage},
                              {"rank", s.rank},
                              {"device", s.device},
                              {"type", s.type},
                              {"host", s.host},
                              {"layers", {s.layer_begin, s.layer_end}},
                              {"units", {s.unit_begin, s.unit_end}},
                              {"forward_s", s.forward_s},
                              {"backward_s", s.backward_s},
                              {"p2p_s", s.p2p_s},
                              {"bubble_s", s.bubble_s},
                              {"phase_end_s", s.phase_end_s},
                              {"sync_s", s.sync_s},
                              {"sync_exposed_s", s.sync_exposed_s},
                              {"optimizer_s", s.optimizer_s},
                              {"peak_in_flight", s.peak_in_flight},
                              {"zero_stage", s.zero_stage},
                              {"shard", s.shard},
                              {"recompute", s.recompute},
                              {"gather_s", s.gather_s},
                              {"param_gather_s", s.param_gather_s},
                              {"memory", {{"weights", s.weight_bytes},
                                          {"gradients", s.grad_bytes},
                                          {"optimizer", s.optimizer_bytes},
                                          {"buffers", s.bucket_bytes},
                                          {"gathered", s.gathered_bytes},
                                          {"activations", s.activation_bytes}}},
                              {"memory_bytes", s.memory_bytes},
                              {"memory_capacity_bytes", s.memory_capacity_bytes},
                              {"fits", s.fits}});
    if (!s.chunk_units.empty()) {
      json cu = json::array();
      for (const auto& [b, e] : s.chunk_units) cu.push_back({b, e});
      j["per_stage"].back()["chunk_units"] = cu;
    }
    if (s.tp > 1) {
      // ranks.json's tp_comm_s_median measures the same sums on each member.
      j["per_stage"].back()["tp"] = s.tp;
      j["per_stage"].back()["tp_comm_s"] = s.tp_comm_s;
    }
  }
  j["sync_groups"] = json::array();
  for (const auto& g : sync_groups) {
    json gj = {{"ranks", g.ranks},
               {"bytes", g.bytes},
               {"buckets", g.buckets},
               {"slowest_bytes_per_s", g.slowest_bytes_per_s},
               {"ready_s", g.ready_s},
               {"time_s", g.time_s},
               {"done_s", g.done_s}};
    if (g.tree) gj["route"] = "tree", gj["stripes"] = g.stripes;
    if (g.compressed) {
      gj["compressed"] = g.hierarchical ? "hierarchical" : "flat";
      gj["regions"] = g.regions;
      gj["wire_bytes"] = g.wire_bytes;
      gj["codec_s"] = g.encode_s;
    }
    j["sync_groups"].push_back(gj);
  }
  return j;
}

}  // namespace alloy::plan
