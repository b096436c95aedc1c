#include "alloy/plan/profiler.h"

#include "alloy/model/deferred_weights.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <optional>
#include <cmath>
#include <chrono>
#include <map>
#include <memory>

#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/dist/compress/codec.h"
#include "alloy/dist/compress/comm.h"
#include "alloy/dist/tensor_parallel.h"
#include "alloy/dist/world.h"
#include "alloy/model/transformer.h"
#include "alloy/pipeline/executor.h"
#include "alloy/train/optimizer.h"

namespace alloy::plan {
namespace {
using Clock = std::chrono::steady_clock;

// The mean of V without the values over FACTOR times its median: a quota's throttling (up to about
// 8x a short piece's time here) stays in, a stall of another kind does not.
double mean_without_stalls(const std::vector<double>& v, double factor) {
  std::vector<double> s(v);
  std::sort(s.begin(), s.end());
  const double limit = factor * s[s.size() / 2];
  double sum = 0;
  size_t n = 0;
  for (double x : s)
    if (x <= limit) sum += x, ++n;
  return sum / static_cast<double>(n);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct FwdBwd {
  double fwd, bwd;
  int64_t act_bytes;
  double seconds = 0;  // compute timed (the window)
  double weight = 0;   // SPLIT: the weight pass (bwd is then the rest of the backward)
  bool deferred = false;  // SPLIT: some weight product was held back
};

std::vector<std::vector<std::pair<double, double>>> noise_figures(const std::vector<const std::vector<std::vector<FwdBwd>>*>& slices) {
  std::vector<std::vector<std::pair<double, double>>> out;
  for (const auto* slice : slices)
    for (const auto& rounds : *slice) {
      out.emplace_back();
      for (const auto& t : rounds) out.back().push_back({t.fwd + t.bwd, t.seconds});
    }
  return out;
}

// Times forward and backward of SLICE on a batch of M samples. The calls repeat back to back for
// at least WINDOW seconds and the times are averages over that window: a CPU quota (cgroup CFS)
// lets a process run at full speed in bursts and then stalls it, so a single short call would
// measure the burst, not the device.
// A CUDA call returns before its kernels finish: the clock reads after waiting for them.
void wait_for(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.has_index() ? d.index() : -1);
}

// SPLIT: the backward as zb-h1 runs it on a stage that holds its weight passes back (model/
// deferred_weights.h): the input part, then the weight pass, timed apart.
FwdBwd time_slice(model::Transformer& slice, int64_t m, double window_s, bool ids_in, bool loss_out, const at::Device& dev,
                  bool split = false) {
  const auto& c = slice.config();
  auto gen = at::detail::createCPUGenerator(5);
  at::Tensor x0 = (ids_in ? at::randint(c.vocab_size, {m, c.seq_len}, gen, at::kLong)
                          : at::randn({m, c.seq_len, c.hidden}, gen, at::TensorOptions().dtype(slice.dtype())))
                      .to(dev);
  at::Tensor tgt = at::randint(c.vocab_size, {m, c.seq_len}, gen, at::kLong).to(dev);
  double f = 0, b = 0, w = 0;
  int64_t act = 0, n = 0;
  bool deferred = false;
  model::DeferredWeightGrads held;
  auto start = Clock::now();
  for (int64_t it = 0;; ++it) {
    at::Tensor x = ids_in ? x0 : x0.detach().requires_grad_(true);
    int64_t before = pipeline::memory_in_use(dev);
    wait_for(dev);
    std::optional<model::DeferredWeightGrads::Scope> recording;
    if (split) recording.emplace(&held, 0);
    auto t0 = Clock::now();
    at::Tensor out = slice.forward(x);
    if (loss_out) out = model::Transformer::loss_sum(out, tgt) / static_cast<double>(m * c.seq_len);
    wait_for(dev);
    auto t1 = Clock::now();
    int64_t held_bytes = pipeline::memory_in_use(dev) - before;
    // A LoRA embedding is frozen and has nothing to back-propagate into.
    if (loss_out) out.backward();
    else if (out.requires_grad()) out.backward(at::ones_like(out));
    wait_for(dev);
    auto t2 = Clock::now();
    recording.reset();
    deferred = deferred || !held.empty();
    held.run(0, false);
    wait_for(dev);
    auto t3 = Clock::now();
    for (auto* p : slice.trainable()) p->tensor.mutable_grad().reset();
    if (it == 0) {  // warm-up: first calls allocate and pick kernels
      start = Clock::now();
      continue;
    }
    f += std::chrono::duration<double>(t1 - t0).count();
    b += std::chrono::duration<double>(t2 - t1).count();
    w += std::chrono::duration<double>(t3 - t2).count();
    act = std::max<int64_t>(act, held_bytes);
    ++n;
    if (n >= 2 && std::chrono::duration<double>(Clock::now() - start).count() >= window_s) break;
  }
  return {f / static_cast<double>(n), b / static_cast<double>(n), act, f + b + w, w / static_cast<double>(n), deferred};
}

}  // namespace

// Every lossy codec's encode (error feedback and selection included) and decode (one member's
// share) per gradient element, at density 0.01, on a gradient the size of a block (at least 256k
// elements): the cost model charges them per bucket. Codecs run where gradients live: the host.
static std::map<std::string, CodecCost> measure_codecs(int64_t block_elems, double window_s) {
  namespace cz = dist::compress;
  std::map<std::string, CodecCost> out;
  const int64_t n = std::max<int64_t>(block_elems, int64_t(1) << 18);
  at::Tensor grad = at::randn({n}, at::detail::createCPUGenerator(11), at::kFloat) * 1e-3;
  for (const auto& method : GradSyncConfig::compression_methods()) {
    if (method == "none") continue;
    GradSyncConfig g;
    g.compression = method;
    g.density = 0.01;
    auto opts = cz::Options::from(g, /*aligned=*/true);
    auto codec = cz::make_codec(opts);
    // PowerSGD needs a matrix: a block's widest is about [n / 4 / hidden, ...]; a square one of n.
    const int64_t rows = static_cast<int64_t>(std::sqrt(static_cast<double>(n)));
    const int64_t m = method == "powersgd" ? rows * rows : n;
    std::vector<cz::TensorSlot> slots{{0, m, method == "powersgd" ? std::vector<int64_t>{rows, rows} : std::vector<int64_t>{m}}};
    cz::CodecState st;
    cz::StepContext ctx;
    ctx.seed = 5;
    cz::LocalHub hub(1);
    auto comm = hub.member(0);
    at::Tensor out_buf = at::zeros({m});
    double enc = 0, dec = 0;
    int reps = 0;
    auto t_start = Clock::now();
    while (reps < 2 || (std::chrono::duration<double>(Clock::now() - t_start).count() < window_s / 8 && reps < 20)) {
      ctx.step = reps;
      auto t0 = Clock::now();
      std::vector<cz::Encoded> parts{codec->encode(grad, 0, m, slots, st, ctx)};
      auto t1 = Clock::now();
      cz::BufferLayout L{0, m, {{0, m}}, slots};
      at::Tensor wire = codec->exchange(parts, L, *comm, ctx);
      auto t2 = Clock::now();
      codec->decode(wire, L, out_buf, ctx);
      auto t3 = Clock::now();
      if (reps > 0) {  // the first call allocates the residual
        enc += std::chrono::duration<double>(t1 - t0).count();
        dec += std::chrono::duration<double>(t3 - t2).count();
      }
      ++reps;
    }
    out[method] = {enc / (reps - 1) / static_cast<double>(m), dec / (reps - 1) / static_cast<double>(m)};
  }
  return out;
}

// Parameters that train in SLICE, and the bytes its frozen ones hold.
int64_t trained(model::Transformer& slice) {
  int64_t n = 0;
  for (auto* p : slice.trainable()) n += p->numel();
  return n;
}
double frozen_bytes(const model::Transformer& slice) {
  double b = 0;
  for (const auto* p : slice.parameters())
    if (p->frozen) b += static_cast<double>(p->storage_bytes());
  return b;
}

QuotaFigures quota_from_times(const std::vector<double>& steady, const std::vector<std::vector<double>>& after_waits, double gap_s) {
  QuotaFigures out;
  if (steady.size() < 2 || after_waits.empty()) return out;
  double running = 0;
  for (size_t i = 1; i < steady.size(); ++i)
    if (steady[i] - steady[i - 1] <= gap_s) running += steady[i] - steady[i - 1];
  const double fraction = running / std::max(steady.back() - steady.front(), 1e-12);
  std::vector<double> bursts;
  size_t gapless = 0;
  for (const auto& t : after_waits) {
    size_t i = 1;
    while (i < t.size() && t[i] - t[i - 1] <= gap_s) ++i;
    if (i >= t.size()) ++gapless;  // ran the whole stretch unthrottled
    else if (i > 1) bursts.push_back(t[i - 1] - t.front());
  }
  if (fraction >= 0.95 || bursts.empty() || gapless * 2 >= after_waits.size()) return out;
  out.fraction = std::max(fraction, 1e-3);
  out.burst_s = std::min(median(bursts), 1.0);
  return out;
}

// DeviceProfile::quota_fraction and quota_burst_s (quota_from_times): pieces of two 64 x 64
// products (about 10 us), timed back to back for 0.3 s, then from each of 6 waits of 120 ms
// (longer than a container quota's 100 ms period) until the first gap or 150 ms. Measured by hand
// on the 2-core VM at 5 ms periods: throttling waits for the 4 ms timer tick, so a 0.2-core
// quota runs 3.6-3.9 ms and stops 16 ms, not 1 ms and 4; hence a measurement, not quota x period.
QuotaFigures measure_quota(const std::string& device) {
  if (!at::Device(device).is_cpu()) return {};
  auto gen = at::detail::createCPUGenerator(13);
  const at::Tensor a = at::randn({64, 64}, gen) * 0.1, b = at::randn({64, 64}, gen) * 0.1;
  auto piece = [&] { return at::mm(at::mm(a, b), b); };
  auto run = [&](double limit_s, bool stop_at_gap, double gap_s) {
    std::vector<double> t{0.0};
    const auto t0 = Clock::now();
    while (t.back() < limit_s) {
      piece();
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (stop_at_gap && t.back() - t[t.size() - 2] > gap_s) break;
    }
    return t;
  };
  run(0.05, false, 0);  // warm, and spend any burst before the steady run
  const std::vector<double> steady = run(0.3, false, 0);
  std::vector<double> piece_s;
  for (size_t i = 1; i < steady.size(); ++i) piece_s.push_back(steady[i] - steady[i - 1]);
  // A throttled wait lasts at least the rest of a period; a piece is some 10 us.
  const double gap_s = std::max(4e-4, 10 * median(piece_s));
  std::vector<std::vector<double>> after;
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    after.push_back(run(0.15, true, gap_s));
  }
  return quota_from_times(steady, after, gap_s);
}

DeviceProfile measure_device(const ModelConfig& model, const ProfileOptions& o, MemoryProfile* mem) {
  const int64_t L = model.layers;
  model::Transformer embed(model, {0, 1}, 1), block(model, {1, 2}, 1), head(model, {L + 1, L + 2}, 1);
  // Blocks are timed as a stack of up to blocks_timed, the per-block figure being the stack's
  // share: one block called over and over keeps its weights in cache, which a stage of several
  // blocks does not.
  const int64_t K = std::max<int64_t>(1, std::min<int64_t>(L, o.blocks_timed));
  model::Transformer stack(model, {1, 1 + K}, 1);
  const at::Device dev(o.device);
  for (auto* t : {&embed, &block, &head, &stack}) {
    t->apply_lora(o.lora, 1);
    t->to(dev);
  }
  DeviceProfile d;
  // Each figure is the median of several rounds spread over the whole measurement (every round
  // times every size and slice), so a slow spell of a shared machine (seconds of CPU steal in a
  // VM) spoils one round of each figure instead of every figure of one size.
  const int rounds = std::max(1, o.rounds);
  const double window = o.window_s / rounds;
  const size_t n = o.micro_batch_sizes.size();
  std::vector<std::vector<FwdBwd>> te(n), tb(n), th(n);
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < n; ++i) {
      const int64_t m = o.micro_batch_sizes[i];
      te[i].push_back(time_slice(embed, m, window, true, false, dev));
      FwdBwd t = time_slice(stack, m, window, false, false, dev);
      t.fwd /= static_cast<double>(K), t.bwd /= static_cast<double>(K), t.act_bytes /= K;
      tb[i].push_back(t);
      th[i].push_back(time_slice(head, m, window, false, true, dev));
    }
  auto med = [](const std::vector<FwdBwd>& v, bool fwd) {
    std::vector<double> x;
    for (const auto& t : v) x.push_back(fwd ? t.fwd : t.bwd);
    return median(x);
  };
  auto peak = [](const std::vector<FwdBwd>& v) {
    int64_t a = 0;
    for (const auto& t : v) a = std::max(a, t.act_bytes);
    return a;
  };
  std::vector<double> xs, ef, eb, bf, bb, hf, hb;
  for (size_t i = 0; i < n; ++i) {
    xs.push_back(static_cast<double>(o.micro_batch_sizes[i]));
    ef.push_back(med(te[i], true)), eb.push_back(med(te[i], false));
    bf.push_back(med(tb[i], true)), bb.push_back(med(tb[i], false));
    hf.push_back(med(th[i], true)), hb.push_back(med(th[i], false));
  }
  // Activation memory at the largest size, the most any round kept.
  const int64_t act_e = peak(te.back()), act_b = peak(tb.back()), act_h = peak(th.back());
  const auto measured = &MicroBatchCost::measured;
  d.embed_fwd = measured(xs, ef), d.embed_bwd = measured(xs, eb);
  d.block_fwd = measured(xs, bf), d.block_bwd = measured(xs, bb);
  d.head_fwd = measured(xs, hf), d.head_bwd = measured(xs, hb);
  d.step_noise = pooled_step_noise(noise_figures({&te, &tb, &th}));

  // The halves of a block, one of each (block 1's attention, block 0's MLP: neither slice holds
  // the embedding or the head), at the largest size: their shares of a block's time.
  if (L >= 2) {
    model::Transformer attn(model, model::LayerRange::for_units(2, 3, L), 1), mlp(model, model::LayerRange::for_units(1, 2, L), 1);
    for (auto* t : {&attn, &mlp}) {
      t->apply_lora(o.lora, 1);
      t->to(dev);
    }
    const int64_t m = o.micro_batch_sizes.back();
    std::vector<double> af, ab, mf, mb;
    for (int r = 0; r < rounds; ++r) {
      const FwdBwd a = time_slice(attn, m, window, false, false, dev), b = time_slice(mlp, m, window, false, false, dev);
      af.push_back(a.fwd), ab.push_back(a.bwd), mf.push_back(b.fwd), mb.push_back(b.bwd);
    }
    const double a_f = median(af), a_b = median(ab), m_f = median(mf), m_b = median(mb);
    if (a_f > 0 && m_f > 0) d.attn_share_fwd = a_f / (a_f + m_f);
    if (a_b > 0 && m_b > 0) d.attn_share_bwd = a_b / (a_b + m_b);
  }

  // zb-h1's split of a block's backward: the stack's backward with its weight products held, then
  // their pass, at the largest size (LoRA: the frozen weights hold nothing back, the share stays 0).
  {
    const int64_t m = o.micro_batch_sizes.back();
    std::vector<double> share;
    for (int r = 0; r < rounds; ++r) {
      const FwdBwd t = time_slice(stack, m, window, false, false, dev, true);
      if (!t.deferred) break;  // LoRA: nothing was held back
      if (t.weight > 0 && t.bwd > 0) share.push_back(t.weight / (t.bwd + t.weight));
    }
    if (!share.empty()) d.weight_share = std::clamp(median(share), 0.01, 0.99);
  }

  // A tensor-parallel member's compute per shard size: the stack as the first member of a pair
  // holds it (its heads and their MLP columns; norms, residual and rotary positions whole), its sums
  // left out, at the largest size, for the even pair and the smallest piece a split allows
  // (DeviceProfile::tp_shard_shares). From the even pair, whose time over the whole stack's is
  // 1/2 + c/2, also c, the share every member computes whole (DeviceProfile::tp_whole_share).
  if (const auto even = even_tp_split(model, 2); even.size() == 2) {
    struct NoSums : model::TpComm {
      void allreduce_sum(at::Tensor&) override {}
      int size() const override { return 2; }
      int rank() const override { return 0; }
    } none;
    std::vector<int64_t> heads;  // the first member's, smallest first
    for (int64_t h = 1; h < even[0]; ++h)
      if (tp_split_problem(model, {h, model.heads - h}).empty()) {
        heads.push_back(h);
        break;
      }
    heads.push_back(even[0]);
    std::vector<model::TpLayout> layouts(heads.size());
    std::vector<std::unique_ptr<model::Transformer>> members;
    for (size_t i = 0; i < heads.size(); ++i) {
      for (int64_t b = 0; b < K; ++b) layouts[i].pieces[b] = {0, heads[i], model.heads};
      layouts[i].head_begin = 0, layouts[i].head_end = heads[i];
      layouts[i].comm = &none;
      members.push_back(std::make_unique<model::Transformer>(model, model::LayerRange{1, 1 + K}, 1, &layouts[i]));
      members.back()->apply_lora(o.lora, 1);
      members.back()->to(dev);
    }
    const int64_t m = o.micro_batch_sizes.back();
    std::vector<std::vector<double>> ratio(heads.size());
    for (int r = 0; r < rounds; ++r) {
      const FwdBwd whole = time_slice(stack, m, window, false, false, dev);
      for (size_t i = 0; i < heads.size(); ++i) {
        const FwdBwd piece = time_slice(*members[i], m, window, false, false, dev);
        if (whole.fwd + whole.bwd > 0) ratio[i].push_back((piece.fwd + piece.bwd) / (whole.fwd + whole.bwd));
      }
    }
    if (!ratio.back().empty()) {
      const double c = 2 * median(ratio.back()) - 1;
      if (c > 0.01) d.tp_whole_share = std::min(c, 0.95);
      // Each share at least its heads' fraction and at most the whole; a larger piece never cheaper.
      double floor = 0;
      for (size_t i = 0; i < heads.size(); ++i) {
        if (ratio[i].empty()) continue;
        const double f = static_cast<double>(heads[i]) / static_cast<double>(model.heads);
        floor = std::clamp(median(ratio[i]), std::max(f, floor), 1.0);
        d.tp_shard_shares.emplace_back(f, floor);
      }
    }
  }

  // The optimizer step (AdamW + clipping's norm) per parameter, on one block's parameters: the
  // mean of the steps after the first (which makes the moments), stalls over 20x the median left
  // out. A whole mean once read 160x the usual figure on an emulated 0.4-core device (a stall of
  // about a second in a window of 0.1 s; three profiles before and after read 4-6e-9 s per
  // parameter), and the plan priced its optimizer at 1.1 s of a 2.3 s step.
  {
    train::AdamW opt(block.trainable(), {});
    for (auto* p : block.trainable()) p->tensor.mutable_grad() = at::randn_like(p->tensor);
    auto one = [&] {
      const auto t0 = Clock::now();
      train::global_grad_norm_sq(block.trainable());
      opt.step(1e-6);
      wait_for(dev);
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    one();
    std::vector<double> steps;
    double spent = 0;
    while (steps.size() < 8 || spent < o.window_s / 2) {
      steps.push_back(one());
      spent += steps.back();
    }
    d.optimizer_s_per_param = mean_without_stalls(steps, 20) / static_cast<double>(trained(block));
  }
  if (model.dtype == "float32") d.codecs = measure_codecs(trained(block), o.window_s);
  const QuotaFigures quota = measure_quota(o.device);
  d.quota_fraction = quota.fraction;
  d.quota_burst_s = quota.burst_s;
  if (mem) {
    const double bytes = model.dtype == "float64" ? 8.0 : 4.0;
    const double m = static_cast<double>(o.micro_batch_sizes.back());
    mem->param_bytes_per_block = static_cast<double>(trained(block)) * bytes;
    mem->param_bytes_embed = static_cast<double>(trained(embed)) * bytes;
    mem->param_bytes_head = static_cast<double>(trained(head)) * bytes;
    mem->frozen_bytes_per_block = frozen_bytes(block);
    mem->frozen_bytes_embed = frozen_bytes(embed);
    mem->frozen_bytes_head = frozen_bytes(head);
    mem->act_bytes_per_sample_block = static_cast<double>(act_b) / m;
    mem->act_bytes_per_sample_embed = static_cast<double>(act_e) / m;
    mem->act_bytes_per_sample_head = static_cast<double>(act_h) / m;
    mem->state_bytes_per_param_byte = 4.0;  // weights, gradients, two AdamW moments
  }
  return d;
}

// Tensor-parallel sums between ranks A and B (both call this; the others wait at the barriers of
// the caller), at the smallest and the largest micro-batch size M. Each member runs K forwards of
// one block as the members of an even pair hold it (half the heads and MLP columns each), with its
// two sums per block over the pair, exactly as a TP stage of two runs them: the compute between
// sums, and so the members' uneven arrival and the CPU quota periods met, is training's. Models
// whose heads do not split evenly run the whole block with one sum after it instead. The figure is
// the time per sum inside the sums on the member that spent least there, the median of the rounds:
// ranks.json's tp_comm_s measures the same in training (the member arriving last waits least).
// Earlier profiles timed what the sums added to a whole block's forward: a wide block's forward
// varies more than a sum takes, and members computing four times longer between sums than in
// training waited more for each other (17.5 ms per 512 KiB priced where training spent 4.5 ms).
std::vector<TpSumProfile> measure_tp_sums(const ModelConfig& model, const ClusterSpec& spec, dist::World& world, int a, int b,
                                          const ProfileOptions& o) {
  dist::GroupTpComm comm(world.new_group("profile-tp-" + std::to_string(a) + "-" + std::to_string(b), {a, b}));
  // Times each sum: the member's wait for the other included, as the trainer counts it.
  struct TimedComm : model::TpComm {
    dist::GroupTpComm* inner = nullptr;
    double seconds = 0;
    int64_t count = 0;
    void allreduce_sum(at::Tensor& t) override {
      const auto t0 = Clock::now();
      inner->allreduce_sum(t);
      seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      ++count;
    }
    int size() const override { return inner->size(); }
    int rank() const override { return inner->rank(); }
  } timed;
  timed.inner = &comm;
  const at::Device dev(o.device);
  model::TpLayout tl;
  const std::vector<int64_t> split = even_tp_split(model, 2);
  const bool member = split.size() == 2;
  if (member) {
    tl.pieces[0] = {0, split[0], model.heads};
    tl.head_begin = comm.rank() == 0 ? 0 : split[0];
    tl.head_end = comm.rank() == 0 ? split[0] : model.heads;
    tl.comm = &timed;
  }
  model::Transformer block(model, {1, 2}, 1, member ? &tl : nullptr);
  block.to(dev);
  at::NoGradGuard no_grad;
  // Both members' figures, summed over the pair (a Gloo group has no max): slot 0 is A's, 1 B's.
  auto both = [&](double mine) {
    at::Tensor t = at::zeros({2}, at::kDouble);
    t[comm.rank()] = mine;
    comm.allreduce_sum(t);
    return std::pair<double, double>{t[0].item<double>(), t[1].item<double>()};
  };
  std::vector<int64_t> sizes{o.micro_batch_sizes.empty() ? 1 : o.micro_batch_sizes.front()};
  if (o.micro_batch_sizes.size() > 1 && o.micro_batch_sizes.back() != sizes[0]) sizes.push_back(o.micro_batch_sizes.back());
  std::vector<TpSumProfile> out;
  for (int64_t m : sizes) {
    auto gen = at::detail::createCPUGenerator(7);
    const at::Tensor x = at::randn({m, model.seq_len, model.hidden}, gen, at::TensorOptions().dtype(block.dtype())).to(dev);
    auto forward = [&] {
      at::Tensor y = block.forward(x);
      if (!member) timed.allreduce_sum(y);
      wait_for(dev);
    };
    forward(), forward();  // warm-up: allocations, kernels
    auto t0 = Clock::now();
    for (int i = 0; i < 3; ++i) forward();
    const auto [ta, tb] = both(std::chrono::duration<double>(Clock::now() - t0).count() / 3);
    const int rounds = std::max(1, o.rounds);
    const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(o.window_s / rounds / std::max({ta, tb, 1e-6})), 8, 64);
    std::vector<double> per_sum;
    const double bytes = static_cast<double>(x.numel()) * 4.0;  // a block's output has its input's shape; summed in fp32
    at::Tensor start = at::zeros({1});
    for (int r = 0; r < rounds; ++r) {
      comm.allreduce_sum(start);  // both start together
      timed.seconds = 0, timed.count = 0;
      for (int64_t i = 0; i < k; ++i) forward();
      const auto [sums_a, sums_b] = both(timed.seconds);
      per_sum.push_back(std::min(sums_a, sums_b) / static_cast<double>(std::max<int64_t>(1, timed.count)));
    }
    out.push_back({spec.devices[static_cast<size_t>(a)].name, spec.devices[static_cast<size_t>(b)].name, bytes, median(per_sum)});
  }
  return out;
}

// The CPU time messages take from compute on rank A (DeviceProfile::comm_cpu_s_per_byte), with B
// as the far end: A times a block's forward and backward, N times over, alone, then again while a
// thread of its own streams 1 MiB round trips with B (B echoes each one). The figure is the time
// the compute lost divided by the bytes A sent and received meanwhile, the median of o.rounds
// rounds. Both ranks call it; B returns 0.
double measure_comm_cpu(const ModelConfig& model, dist::World& world, int a, int b, const ProfileOptions& o) {
  const int rank = world.rank();
  constexpr int64_t kMessageFloats = 1 << 18;  // 1 MiB
  // A message's first element: 1 carry on, -1 this round is over, -2 A failed (B returns).
  constexpr float kGo = 1, kRoundOver = -1, kAbort = -2;
  auto tag = [](int64_t k, int dir) { return static_cast<int>(20000 + 2 * (k % 100000) + dir); };
  const int rounds = std::max(1, o.rounds);
  if (rank == b) {
    at::Tensor t = at::zeros({kMessageFloats}, at::kFloat);
    for (int r = 0; r < rounds; ++r)
      for (int64_t k = 0;; ++k) {
        dist::wait_work(world.all().recv(t, a, tag(k, 0)), "profiling communication's CPU time: receive");
        const float code = t[0].item<float>();
        if (code == kAbort) return 0;
        if (code == kRoundOver) break;
        dist::wait_work(world.all().send(t, a, tag(k, 1)), "profiling communication's CPU time: send");
      }
    return 0;
  }
  // A failure on A between streams still releases B, which waits for a round's first message.
  auto release_partner = [&] {
    try {
      at::Tensor t = at::zeros({kMessageFloats}, at::kFloat);
      t[0] = kAbort;
      dist::wait_work(world.all().send(t, b, tag(0, 0)), "profiling communication's CPU time: abort");
    } catch (...) {
    }
  };
  bool released = false;  // B has been told to return, or cannot be told
  try {
    const at::Device dev(o.device);
    model::Transformer block(model, {1, 2}, 1);
    block.to(dev);
    auto gen = at::detail::createCPUGenerator(11);
    const int64_t m = o.micro_batch_sizes.empty() ? 1 : o.micro_batch_sizes.front();
    const at::Tensor x0 = at::randn({m, model.seq_len, model.hidden}, gen, at::TensorOptions().dtype(block.dtype())).to(dev);
    auto step = [&] {
      at::Tensor x = x0.detach().requires_grad_(true);
      at::Tensor y = block.forward(x);
      y.backward(at::ones_like(y));
      wait_for(dev);
      for (auto* p : block.trainable()) p->tensor.mutable_grad().reset();
    };
    auto seconds_since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    step(), step();  // warm-up
    auto t0 = Clock::now();
    step();
    const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(o.window_s / std::max(seconds_since(t0), 1e-6)), 4, 2000);
    std::vector<double> lost;
    for (int r = 0; r < rounds; ++r) {
      t0 = Clock::now();
      for (int64_t i = 0; i < n; ++i) step();
      const double alone = seconds_since(t0);
      std::atomic<float> code{kGo};
      std::atomic<int64_t> moved{0};
      std::exception_ptr failed;
      std::thread stream([&] {
        try {
          at::Tensor t = at::ones({kMessageFloats}, at::kFloat);
          for (int64_t k = 0;; ++k) {
            const float c = code.load();
            t[0] = c;
            dist::wait_work(world.all().send(t, b, tag(k, 0)), "profiling communication's CPU time: send");
            if (c != kGo) break;
            dist::wait_work(world.all().recv(t, b, tag(k, 1)), "profiling communication's CPU time: receive");
            moved += 2 * kMessageFloats * 4;
          }
        } catch (...) {
          failed = std::current_exception();
        }
      });
      double with = 0;
      int64_t bytes = 0;
      try {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the stream under way first
        const int64_t moved0 = moved.load();
        t0 = Clock::now();
        for (int64_t i = 0; i < n; ++i) step();
        with = seconds_since(t0);
        bytes = moved.load() - moved0;
      } catch (...) {
        code = kAbort;  // the stream's next message tells B to return
        stream.join();
        released = true;
        throw;
      }
      code = kRoundOver;
      stream.join();
      if (failed) {
        released = true;  // the link failed: B's own receive fails or times out
        std::rethrow_exception(failed);
      }
      if (bytes > 0) lost.push_back(std::max(0.0, with - alone) / static_cast<double>(bytes));
    }
    return lost.empty() ? 0.0 : median(lost);
  } catch (...) {
    if (!released) release_partner();
    throw;
  }
}

Profile run_profile(const ModelConfig& model, const ClusterSpec& spec, dist::World* world, const ProfileOptions& o) {
  Profile prof;
  prof.model = model;
  prof.lora = o.lora;
  const int rank = world ? world->rank() : 0;
  const int n = world ? world->size() : 1;
  if (world && n != static_cast<int>(spec.devices.size()))
    throw InputError(spec.source, "has " + std::to_string(spec.devices.size()) + " devices but the job has " + std::to_string(n) +
                                      " ranks: run one rank per device");
  // Rank r is device r. The first device of each type measures that type.
  std::map<std::string, int> measurer;
  for (int r = 0; r < static_cast<int>(spec.devices.size()) && r < n; ++r) measurer.emplace(spec.devices[static_cast<size_t>(r)].type, r);
  if (!world) {
    MemoryProfile mem;
    prof.devices[spec.devices.empty() ? "cpu" : spec.devices[0].type] = measure_device(model, o, &mem);
    prof.memory = mem;
    complete_profile(prof, spec);
    return prof;
  }
  auto& store = world->store();
  auto put = [&](const std::string& k, const std::string& v) { store.set(k, std::vector<uint8_t>(v.begin(), v.end())); };
  auto get = [&](const std::string& k) {
    store.wait({k});
    auto b = store.get(k);
    return std::string(b.begin(), b.end());
  };
  // Compute. Concurrent: every rank measures its device at the same time, under the same load as
  // in training (the figures are time-window based, so fast and slow devices measure for about as
  // long). Otherwise the measuring ranks take turns on an idle machine.
  auto measure_mine = [&](const std::string& type, bool publish) {
    log_info("profiling device type " + type + " on rank " + std::to_string(rank) + (publish ? "" : " (as load only)"));
    MemoryProfile mem;
    DeviceProfile d = measure_device(model, o, &mem);
    if (publish) put("alloy/profile/type/" + type, Profile{model, {{type, d}}, {}, {}, mem, o.lora}.to_json().dump());
  };
  const std::string& my_type = spec.devices[static_cast<size_t>(rank)].type;
  if (o.concurrent) {
    world->all().barrier();
    measure_mine(my_type, measurer.at(my_type) == rank);
  } else {
    for (const auto& [type, r] : measurer) {
      world->all().barrier();
      if (rank == r) measure_mine(type, true);
    }
  }
  world->all().barrier();
  // Links: one representative rank per host; one pair at a time.
  if (o.measure_links) {
    std::map<std::string, int> rep;
    for (int r = 0; r < n; ++r) rep.emplace(spec.devices[static_cast<size_t>(r)].host, r);
    std::vector<std::pair<int, int>> pairs;
    for (auto a = rep.begin(); a != rep.end(); ++a)
      for (auto b = std::next(a); b != rep.end(); ++b) pairs.emplace_back(a->second, b->second);
    for (auto [a, b] : pairs) {
      world->all().barrier();
      if (rank != a && rank != b) continue;
      std::vector<double> xs, ys;
      for (int64_t bytes : o.message_bytes) {
        at::Tensor t = at::zeros({bytes / 4}, at::kFloat);
        std::vector<double> rtts;
        // Slow links make every repeat of a large message costly; small ones are cheap, and the
        // latency rests on them.
        const int link_repeats = bytes <= (int64_t(1) << 16) ? std::max(o.repeats, 8) : std::min(o.repeats, 3);
        for (int k = 0; k < link_repeats + 1; ++k) {
          auto t0 = Clock::now();
          if (rank == a) {
            dist::wait_work(world->all().send(t, b, 7000 + k), "profiling link send");
            dist::wait_work(world->all().recv(t, b, 8000 + k), "profiling link receive");
          } else {
            dist::wait_work(world->all().recv(t, a, 7000 + k), "profiling link receive");
            dist::wait_work(world->all().send(t, a, 8000 + k), "profiling link send");
          }
          if (k) rtts.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / 2);
        }
        xs.push_back(static_cast<double>(bytes));
        // The fastest repeat, not the median: a device under a small CPU quota answers a ping
        // late whenever it is throttled (the half and quarter devices of the 3-device pool read
        // 2-4.7 ms of "latency" over a veth with none), but its kernel receives the bytes on
        // time; in training that wait is already in the device's compute figures, which are
        // averaged over quota periods.
        ys.push_back(*std::min_element(rtts.begin(), rtts.end()));
      }
      if (rank == a) {
        const LinkProfile l = link_from_pings(xs, ys);
        nlohmann::json j = {{"a", spec.devices[static_cast<size_t>(a)].host},
                            {"b", spec.devices[static_cast<size_t>(b)].host},
                            {"bytes_per_s", l.bytes_per_s},
                            {"latency_s", l.latency_s}};
        put("alloy/profile/link/" + std::to_string(a) + "-" + std::to_string(b), j.dump());
        log_info("link " + j["a"].get<std::string>() + " <-> " + j["b"].get<std::string>() + ": " +
                 std::to_string(j["bytes_per_s"].get<double>() * 8 / 1e6) + " Mbit/s, latency " +
                 std::to_string(l.latency_s * 1e3) + " ms");
      }
    }
    world->all().barrier();
    if (rank == 0)
      for (auto [a, b] : pairs) {
        auto j = nlohmann::json::parse(get("alloy/profile/link/" + std::to_string(a) + "-" + std::to_string(b)));
        prof.links.push_back({j["a"], j["b"], j["bytes_per_s"], j["latency_s"], 0});
      }
  }
  // Communication's CPU time: each type's measuring rank against the rank on its fastest link to
  // another host (or another rank of its own host), one pair at a time.
  std::map<std::string, double> comm_cpu;
  if (o.measure_links && n >= 2) {
    for (const auto& [type, a] : measurer) {
      int b = -1;
      double best = -1;
      for (int r = 0; r < n; ++r) {
        if (r == a) continue;
        const auto& ha = spec.devices[static_cast<size_t>(a)].host;
        const auto& hr = spec.devices[static_cast<size_t>(r)].host;
        const double bw = ha == hr ? 0 : spec.link(ha, hr).bandwidth_gbps;  // another host first: training's messages cross hosts
        if (bw > best) best = bw, b = r;
      }
      world->all().barrier();
      if (rank != a && rank != b) continue;
      const double v = measure_comm_cpu(model, *world, a, b, o);
      if (rank == a) {
        put("alloy/profile/commcpu/" + type, nlohmann::json(v).dump());  // std::to_string would print 0.000000
        log_info("communication's CPU time on " + type + ": " + std::to_string(v * 1e9) + " ns of compute lost per byte sent or received (with rank " +
                 std::to_string(b) + ")");
      }
    }
    world->all().barrier();
    if (rank == 0)
      for (const auto& [type, a] : measurer) comm_cpu[type] = std::stod(get("alloy/profile/commcpu/" + type));
  }
  // Tensor-parallel sums: every pair of devices, one pair at a time.
  if (o.measure_tp_sums && n >= 2 && n <= 8) {
    std::vector<std::pair<int, int>> pairs;
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b) pairs.emplace_back(a, b);
    for (auto [a, b] : pairs) {
      world->all().barrier();
      if (rank != a && rank != b) continue;
      const std::vector<TpSumProfile> sums = measure_tp_sums(model, spec, *world, a, b, o);
      if (rank == a) {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& t : sums) {
          j.push_back({{"a", t.device_a}, {"b", t.device_b}, {"bytes", t.bytes}, {"seconds", t.seconds}});
          log_info("tensor-parallel sum " + t.device_a + " + " + t.device_b + ": " + std::to_string(t.seconds * 1e3) + " ms per sum of " +
                   std::to_string(static_cast<int64_t>(t.bytes)) + " bytes under compute");
        }
        put("alloy/profile/tp/" + std::to_string(a) + "-" + std::to_string(b), j.dump());
      }
    }
    world->all().barrier();
    if (rank == 0)
      for (auto [a, b] : pairs) {
        for (const auto& j : nlohmann::json::parse(get("alloy/profile/tp/" + std::to_string(a) + "-" + std::to_string(b))))
          prof.tp_sums.push_back({j["a"], j["b"], j["bytes"], j["seconds"]});
      }
  }
  if (rank == 0) {
    for (const auto& [type, r] : measurer) {
      Profile part = Profile::from_json(nlohmann::json::parse(get("alloy/profile/type/" + type)), "profile from rank " + std::to_string(r));
      prof.devices[type] = part.devices.at(type);
      if (comm_cpu.count(type)) prof.devices[type].comm_cpu_s_per_byte = std::min(comm_cpu[type], 9e-7);
      prof.memory = part.memory;
    }
    complete_profile(prof, spec);
  }
  world->all().barrier();
  return prof;
}

}  // namespace alloy::plan
