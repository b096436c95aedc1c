#include "alloy/dist/compress/codec.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "alloy/core/error.h"
#include "alloy/core/fused_loops.h"
#include "alloy/dist/compress/comm.h"

namespace alloy::dist::compress {

namespace {

// Seeds per piece: the same on every member for a given step, set and piece.
uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 29;
  return x;
}

void ensure_state(CodecState& st, const at::Tensor& g, const Options& o) {
  if (o.error_feedback && !st.residual.defined()) st.residual = at::zeros_like(g);
  if (GradSyncConfig::local_velocity(o.method, o.error_feedback, o.dgc_momentum, o.momentum_correction) && !st.velocity.defined())
    st.velocity = at::zeros_like(g);
}

bool plain_cpu_float(const at::Tensor& t) { return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }

// accumulate() with the velocity as one pass over CPU float arrays (core/fused_loops.h); with CAND,
// also DGC's hinted candidate scan in the same pass: every index of the piece (from 0) whose
// accumulated magnitude reaches FLOOR, ascending. Fixed chunks, each with its own candidates joined
// in order: the same list on any thread count.
void accumulate_fused(const at::Tensor& g, int64_t begin, int64_t numel, CodecState& st, const Options& o, float floor,
                      std::vector<int64_t>* cand) {
  const float* gp = g.data_ptr<float>() + begin;
  float* v = st.velocity.data_ptr<float>() + begin;
  float* r = st.residual.data_ptr<float>() + begin;
  const float momentum = static_cast<float>(o.dgc_momentum);
  constexpr int64_t kChunk = int64_t(1) << 18;
  const int64_t chunks = (numel + kChunk - 1) / kChunk;
  std::vector<std::vector<int64_t>> found(cand ? static_cast<size_t>(chunks) : 0);
  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t at = c * kChunk, len = std::min(kChunk, numel - at);
      if (cand) dgc_accumulate_scan(gp + at, v + at, r + at, len, momentum, floor, at, found[static_cast<size_t>(c)]);
      else dgc_accumulate(gp + at, v + at, r + at, len, momentum);
    }
  });
  if (!cand) return;
  size_t total = 0;
  for (const auto& f : found) total += f.size();
  cand->reserve(total);
  for (const auto& f : found) cand->insert(cand->end(), f.begin(), f.end());
}

// ---------------------------------------------------------------------------------------------
// Sparse: (index, value) pairs, all-gathered; wire = int32 [n, count_0..count_{n-1}, then per
// member idx(count_i) bits(values(count_i))].

// The wire from N gathered payloads of WIDTH pairs each (int32 [idx(width), bits(width)]), of
// which member i's first COUNTS[i] are real.
at::Tensor sparse_wire(const std::vector<at::Tensor>& gathered, const std::vector<int64_t>& counts, int64_t width) {
  const int n = static_cast<int>(gathered.size());
  int64_t total = 0;
  for (auto c : counts) total += c;
  at::Tensor wire = at::empty({1 + n + 2 * total}, at::TensorOptions().dtype(at::kInt));
  auto* w = wire.data_ptr<int32_t>();
  w[0] = n;
  int64_t pos = 1 + n;
  for (int i = 0; i < n; ++i) {
    const int64_t c = counts[static_cast<size_t>(i)];
    w[1 + i] = static_cast<int32_t>(c);
    const auto* src = gathered[static_cast<size_t>(i)].data_ptr<int32_t>();
    std::copy(src, src + c, w + pos);
    std::copy(src + width, src + width + c, w + pos + c);
    pos += 2 * c;
  }
  return wire;
}

class SparseCodec : public Codec {
 public:
  explicit SparseCodec(const Options& o) : method_(method_of(o.method)) {
    opt_ = o;
    name_ = o.method;
  }
  const std::string& name() const override { return name_; }

  Encoded encode(const at::Tensor& g, int64_t begin, int64_t numel, const std::vector<TensorSlot>&, CodecState& st,
                 const StepContext& ctx) override {
    ensure_state(st, g, opt_);
    const int64_t k = target_count(numel, opt_.density_at(ctx.step));
    const uint64_t seed = mix(ctx.seed, static_cast<uint64_t>(begin));
    Selection s;
    double* hint = opt_.method == "dgc" ? &st.dgc_hint[begin] : nullptr;  // 0 until its first selection
    if (hint && opt_.error_feedback && plain_cpu_float(g) && plain_cpu_float(st.velocity) && plain_cpu_float(st.residual) &&
        dgc_hint_usable(numel, k, *hint)) {
      // The hinted candidates come out of the accumulation's own pass.
      std::vector<int64_t> cand;
      accumulate_fused(g, begin, numel, st, opt_, static_cast<float>(kDgcHintFloor * *hint), &cand);
      at::Tensor acc = st.residual.narrow(0, begin, numel);
      if (!select_dgc_candidates(acc, k, cand, hint, s)) {
        *hint = 0;  // fewer than k reached it: select_dgc would scan again for nothing
        s = select_dgc(acc, k, opt_.aligned, seed, hint);
      }
    } else {
      at::Tensor acc = accumulate(g, begin, numel, st, opt_);
      if (opt_.method == "topk" || opt_.method == "oktopk") s = select_topk(acc, k);
      else if (opt_.method == "randomk") s = select_randomk(acc, k, seed);
      else if (hint) s = select_dgc(acc, k, opt_.aligned, seed, hint);
      else s = select_threshold(method_, acc, k, opt_.aligned, seed, opt_.sidco_fit, opt_.sidco_stages);
    }
    Encoded e;
    e.begin = begin;
    e.numel = numel;
    e.selected = s.selected;
    e.indices = s.indices + begin;
    e.values = s.values.contiguous();
    forget_sent(e.indices, s.selected, st, opt_);
    return e;
  }

  at::Tensor exchange(std::vector<Encoded>& parts, const BufferLayout&, Comm& comm, const StepContext&) override {
    std::vector<at::Tensor> idx, val;
    for (auto& p : parts) idx.push_back(p.indices), val.push_back(p.values);
    at::Tensor my_idx = idx.size() == 1 ? idx[0] : at::cat(idx);
    at::Tensor my_val = val.size() == 1 ? val[0] : at::cat(val);
    if (opt_.method == "randomk") {
      // Everybody chose the same indices: sum the values alone.
      at::Tensor sum = my_val.clone();
      comm.allreduce_sum(sum);
      return sum;
    }
    const int n = comm.size();
    int64_t count = my_idx.numel();
    std::vector<int64_t> counts(static_cast<size_t>(n), count);
    int64_t width = count;
    if (!opt_.aligned) {  // sizes differ: exchange them first, pad everyone to the largest
      at::Tensor c = at::full({1}, count, at::TensorOptions().dtype(at::kInt));
      auto all = comm.allgather(c);
      width = 0;
      for (int i = 0; i < n; ++i) counts[static_cast<size_t>(i)] = all[static_cast<size_t>(i)].item<int>(), width = std::max(width, counts[static_cast<size_t>(i)]);
    }
    at::Tensor payload = at::zeros({2 * width}, at::TensorOptions().dtype(at::kInt));
    payload.narrow(0, 0, count).copy_(my_idx);
    payload.narrow(0, width, count).copy_(my_val.view(at::kInt));
    return sparse_wire(comm.allgather(payload), counts, width);
  }

  int64_t gather_numel(const BufferLayout& L, const StepContext& ctx) const override {
    if (!opt_.aligned || opt_.method == "randomk") return -1;
    int64_t k = 0;  // every piece sends exactly its k (padded): exchange()'s payload is [idx(k), bits(k)]
    for (const auto& [pb, pn] : L.pieces) k += target_count(pn, opt_.density_at(ctx.step));
    return 2 * k;
  }

  void decode(const at::Tensor& wire, const BufferLayout& b, at::Tensor& out, const StepContext& ctx) override {
    at::Tensor dst = out.narrow(0, b.begin, b.numel);
    dst.zero_();
    if (opt_.method == "randomk") {
      int64_t pos = 0;
      for (const auto& [pb, pn] : b.pieces) {
        at::Tensor idx = randomk_indices(pn, target_count(pn, opt_.density_at(ctx.step)), mix(ctx.seed, static_cast<uint64_t>(pb)));
        out.narrow(0, pb, pn).index_put_({idx}, wire.narrow(0, pos, idx.numel()));
        pos += idx.numel();
      }
      return;
    }
    const auto* w = wire.data_ptr<int32_t>();
    const int n = w[0];
    int64_t pos = 1 + n;
    for (int i = 0; i < n; ++i) {
      const int64_t c = w[1 + i];
      if (c > 0) {
        at::Tensor idx = wire.narrow(0, pos, c).to(at::kLong);
        at::Tensor val = wire.narrow(0, pos + c, c).clone().view(at::kFloat);
        out.index_add_(0, idx, val);
      }
      pos += 2 * c;
    }
  }

 private:
  std::string name_;
  ThresholdMethod method_;
  static ThresholdMethod method_of(const std::string& m) {
    if (m == "gaussiank") return ThresholdMethod::GaussianK;
    if (m == "redsync") return ThresholdMethod::RedSync;
    if (m == "sidco") return ThresholdMethod::Sidco;
    return ThresholdMethod::Dgc;
  }
};

// ---------------------------------------------------------------------------------------------
// Cast: fp16 is all-reduced in fp16 (wire: the fp16 sum); bf16 is all-gathered (as 16-bit words:
// Gloo has no bf16) and summed in fp32 (wire: every member's words, one after the other).

class CastCodec : public Codec {
 public:
  explicit CastCodec(const Options& o) {
    opt_ = o;
    name_ = o.method;
    dtype_ = o.method == "bf16" ? at::kBFloat16 : at::kHalf;
  }
  const std::string& name() const override { return name_; }

  Encoded encode(const at::Tensor& g, int64_t begin, int64_t numel, const std::vector<TensorSlot>&, CodecState& st,
                 const StepContext&) override {
    ensure_state(st, g, opt_);
    at::Tensor acc = accumulate(g, begin, numel, st, opt_);
    // fp16 saturates at 65504; what does not fit stays in the residual.
    at::Tensor src = dtype_ == at::kHalf ? acc.clamp(-65504.0, 65504.0) : acc;
    Encoded e;
    e.begin = begin;
    e.numel = numel;
    e.selected = numel;
    e.dense = src.to(dtype_);
    if (opt_.error_feedback) st.residual.narrow(0, begin, numel).copy_(acc - e.dense.to(at::kFloat));
    return e;
  }

  at::Tensor exchange(std::vector<Encoded>& parts, const BufferLayout&, Comm& comm, const StepContext&) override {
    std::vector<at::Tensor> d;
    for (auto& p : parts) d.push_back(p.dense);
    at::Tensor mine = d.size() == 1 ? d[0].contiguous() : at::cat(d);
    if (dtype_ == at::kHalf) {
      comm.allreduce_sum(mine);
      return mine;
    }
    auto all = comm.allgather(mine.view(at::kHalf));
    return at::cat(all).view(at::kBFloat16);
  }

  void decode(const at::Tensor& wire, const BufferLayout& b, at::Tensor& out, const StepContext&) override {
    at::Tensor dst = out.narrow(0, b.begin, b.numel);
    if (dtype_ == at::kHalf) {
      dst.copy_(wire.to(at::kFloat));
      return;
    }
    const int64_t n = wire.numel() / b.numel;
    dst.zero_();
    for (int64_t i = 0; i < n; ++i) dst.add_(wire.narrow(0, i * b.numel, b.numel).to(at::kFloat));
  }

 private:
  std::string name_;
  at::ScalarType dtype_;
};

// ---------------------------------------------------------------------------------------------
// PowerSGD (Vogels et al.), one power iteration per step with warm start, SUM semantics:
//   P = sum_i M_i Q, P^ = orthonormal(P), Q' = sum_i M_i^T P^, sum ~ P^ Q'^T,
// and each encoder keeps M_i - (P^ Q'^T) / contributors, so the residuals add up to what the
// approximation missed. Q starts from a seed every member shares. Matrices where rank * (rows +
// cols) >= rows * cols, and vectors, are sent dense in the first all-reduce.
// Wire (fp32): per piece in order, matrices: P^ (rows x r) then Q' (cols x r); dense: the sum.

class PowerSgdCodec : public Codec {
 public:
  explicit PowerSgdCodec(const Options& o) {
    opt_ = o;
    name_ = "powersgd";
  }
  const std::string& name() const override { return name_; }
  bool per_tensor_only() const override { return true; }
  bool encodes_in_hook() const override { return false; }

  static int rank_for(const std::vector<int64_t>& shape, int64_t r) {
    if (shape.size() != 2) return 0;
    const int64_t rows = shape[0], cols = shape[1];
    const int64_t rr = std::min({r, rows, cols});
    return rr * (rows + cols) < rows * cols ? static_cast<int>(rr) : 0;
  }

  Encoded encode(const at::Tensor& g, int64_t begin, int64_t numel, const std::vector<TensorSlot>& slots, CodecState& st,
                 const StepContext& ctx) override {
    if (slots.size() != 1 || slots[0].offset != begin || slots[0].numel != numel)
      throw Error("powersgd encodes one parameter at a time (internal: a piece spans several tensors)");
    ensure_state(st, g, opt_);
    Encoded e;
    e.begin = begin;
    e.numel = numel;
    e.selected = numel;
    at::Tensor acc = accumulate(g, begin, numel, st, opt_);
    e.rank = rank_for(slots[0].shape, opt_.powersgd_rank);
    if (e.rank == 0) {
      e.dense = acc.clone();
      if (opt_.error_feedback) st.residual.narrow(0, begin, numel).zero_();
      return e;
    }
    const int64_t rows = slots[0].shape[0], cols = slots[0].shape[1];
    e.m = acc.view({rows, cols}).clone();
    at::Tensor& q = st.q[begin];
    if (!q.defined() || q.size(1) != e.rank) {
      // The same start on every member: a seed of the set and tensor, not of the rank.
      q = at::randn({cols, e.rank}, at::detail::createCPUGenerator(mix(ctx.seed >> 20, static_cast<uint64_t>(begin))), at::kFloat);
    }
    e.p = at::mm(e.m, q);
    e.selected = e.rank * (rows + cols);
    return e;
  }

  at::Tensor exchange(std::vector<Encoded>& parts, const BufferLayout&, Comm& comm, const StepContext&) override {
    // Round 1: every P and every dense vector.
    std::vector<at::Tensor> first;
    for (auto& e : parts) first.push_back(e.rank ? e.p.reshape({-1}) : e.dense);
    at::Tensor r1 = at::cat(first);
    comm.allreduce_sum(r1);
    // Orthonormalise each P (identical on every member), then Q_i = M_i^T P^.
    std::vector<at::Tensor> phat(parts.size()), second;
    int64_t pos = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Encoded& e = parts[i];
      const int64_t len = e.rank ? e.p.numel() : e.dense.numel();
      at::Tensor sum = r1.narrow(0, pos, len);
      pos += len;
      if (!e.rank) {
        phat[i] = sum;
        continue;
      }
      phat[i] = orthonormal(sum.view({e.m.size(0), e.rank}));
      second.push_back(at::mm(e.m.t(), phat[i]).reshape({-1}));
    }
    at::Tensor r2 = second.empty() ? at::empty({0}) : at::cat(second);
    if (!second.empty()) comm.allreduce_sum(r2);
    std::vector<at::Tensor> wire;
    int64_t qpos = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Encoded& e = parts[i];
      if (!e.rank) {
        wire.push_back(phat[i]);
        continue;
      }
      const int64_t qlen = e.m.size(1) * e.rank;
      wire.push_back(phat[i].reshape({-1}));
      wire.push_back(r2.narrow(0, qpos, qlen));
      parts[i].p = r2.narrow(0, qpos, qlen).view({e.m.size(1), e.rank}).clone();  // the next step's Q
      qpos += qlen;
    }
    return at::cat(wire);
  }

  void decode(const at::Tensor& wire, const BufferLayout& b, at::Tensor& out, const StepContext&) override {
    int64_t pos = 0;
    for (const auto& slot : b.slots) {
      const int r = rank_for(slot.shape, opt_.powersgd_rank);
      at::Tensor dst = out.narrow(0, slot.offset, slot.numel);
      if (!r) {
        dst.copy_(wire.narrow(0, pos, slot.numel));
        pos += slot.numel;
        continue;
      }
      const int64_t rows = slot.shape[0], cols = slot.shape[1];
      at::Tensor p = wire.narrow(0, pos, rows * r).view({rows, r});
      pos += rows * r;
      at::Tensor q = wire.narrow(0, pos, cols * r).view({cols, r});
      pos += cols * r;
      dst.view({rows, cols}).copy_(at::mm(p, q.t()));
    }
  }

  void after_decode(std::vector<Encoded>& parts, const at::Tensor& out, CodecState& st, const StepContext& ctx) override {
    for (auto& e : parts) {
      if (!e.rank) continue;
      at::Tensor approx = out.narrow(0, e.begin, e.numel).view(e.m.sizes());
      if (opt_.error_feedback) st.residual.narrow(0, e.begin, e.numel).view(e.m.sizes()).copy_(e.m - approx / ctx.contributors);
      // Warm start: this step's summed Q' starts the next step's power iteration (exchange() left
      // it in e.p); it is the same on every member.
      st.q[e.begin] = e.p;
    }
  }

 private:
  static at::Tensor orthonormal(const at::Tensor& p) {
    // Gram-Schmidt on the columns; a column that vanishes becomes zero rather than NaN.
    at::Tensor o = p.clone();
    for (int64_t c = 0; c < o.size(1); ++c) {
      at::Tensor col = o.select(1, c);
      for (int64_t d = 0; d < c; ++d) {
        at::Tensor prev = o.select(1, d);
        col.sub_(prev * at::dot(prev, col));
      }
      const double nrm = col.norm().item<double>();
      if (nrm > 1e-12) col.div_(nrm);
      else col.zero_();
    }
    return o;
  }
  std::string name_;
};

}  // namespace

Options Options::from(const GradSyncConfig& g, bool aligned) {
  Options o;
  o.method = g.compression;
  o.density = g.density;
  o.error_feedback = g.error_feedback;
  o.warmup_steps = g.warmup_steps;
  o.dense_steps = g.dense_steps;
  o.powersgd_rank = g.powersgd_rank;
  o.dgc_momentum = g.dgc_momentum;
  o.momentum_correction = g.momentum_correction;
  o.sidco_fit = parse_sidco_fit(g.sidco_fit);
  o.sidco_stages = static_cast<int>(g.sidco_stages);
  o.aligned = aligned;
  return o;
}

double Options::density_at(int64_t step) const {
  step -= dense_steps;  // the warm-up follows the exact steps
  if (warmup_steps <= 0 || step >= warmup_steps || density >= 0.25) return density;
  if (step < 0) return 0.25;
  const double f = static_cast<double>(step) / static_cast<double>(warmup_steps);
  return std::max(density, 0.25 * std::pow(density / 0.25, f));
}

at::Tensor accumulate(const at::Tensor& g, int64_t begin, int64_t numel, CodecState& st, const Options& o) {
  at::Tensor grad = g.narrow(0, begin, numel);
  if (!o.error_feedback) return grad;
  at::Tensor res = st.residual.narrow(0, begin, numel);
  if (st.velocity.defined() && plain_cpu_float(g) && plain_cpu_float(st.velocity) && plain_cpu_float(st.residual)) {
    accumulate_fused(g, begin, numel, st, o, 0.0f, nullptr);  // v = g + momentum * v; r += v in one pass
  } else if (st.velocity.defined()) {
    at::Tensor v = st.velocity.narrow(0, begin, numel);
    v.mul_(o.dgc_momentum).add_(grad);  // rounded as the fused pass rounds: g + (momentum * v)
    res.add_(v);
  } else {
    res.add_(grad);
  }
  // The residual itself: the caller reads what to send from it (copying the values out) before
  // forget_sent() clears them, so nothing is copied whole.
  return res;
}

void forget_sent(const at::Tensor& indices, int64_t selected, CodecState& st, const Options& o) {
  if (!o.error_feedback) return;
  // Padding entries (aligned mode, past SELECTED) carry value 0 and were not sent.
  at::Tensor idx = indices.narrow(0, 0, selected);
  st.residual.index_fill_(0, idx, 0.0);
  if (st.velocity.defined()) st.velocity.index_fill_(0, idx, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Ok-Topk (Li and Hoefler, PPoPP 2022), SAFusion's sparse all-reduce baseline: each member sends
// its local top-k, region by region, to the region's owner (split and reduce: one all-to-all
// instead of every member's pairs to everyone), the owner sums them and keeps the largest
// ceil(k / n) of its region, and the owners' picks are all-gathered (balanced: the same count
// each, so no sizes). Every member sends about 2k pairs whatever the group size, where an
// all-gather of top-k moves k (n - 1). Here the regions are equal slices of the buffer and the
// local selection is exact top-k (the paper re-balances the regions and re-estimates its
// thresholds every few steps). With error feedback, what a member sent that the owners did not
// keep goes back into its residual, so sent + residual stays its gradient + old residual.
class OkTopkCodec : public SparseCodec {
 public:
  explicit OkTopkCodec(const Options& o) : SparseCodec(o) {}
  int64_t gather_numel(const BufferLayout&, const StepContext&) const override { return -1; }  // its own exchanges

  at::Tensor exchange(std::vector<Encoded>& parts, const BufferLayout& L, Comm& comm, const StepContext& ctx) override {
    const int n = comm.size();
    std::vector<at::Tensor> idx, val;
    int64_t k_total = 0;
    for (auto& p : parts) {
      idx.push_back(p.indices.narrow(0, 0, p.selected));
      val.push_back(p.values.narrow(0, 0, p.selected));
    }
    for (const auto& [pb, pn] : L.pieces) k_total += target_count(pn, opt_.density_at(ctx.step));
    at::Tensor my_idx = idx.empty() ? at::empty({0}, at::kLong) : at::cat(idx);
    at::Tensor my_val = val.empty() ? at::empty({0}, at::kFloat) : at::cat(val);
    at::Tensor order = std::get<1>(my_idx.sort());
    my_idx = my_idx.index_select(0, order).to(at::kInt).contiguous();
    my_val = my_val.index_select(0, order).contiguous();
    auto bound = [&](int j) { return L.begin + L.numel * j / n; };
    // Split: this member's pairs by region, as rows (index, value bits).
    std::vector<int64_t> send(static_cast<size_t>(n), 0);
    const auto* ip = my_idx.data_ptr<int32_t>();
    for (int64_t i = 0, j = 0; i < my_idx.numel(); ++i) {
      while (ip[i] >= bound(static_cast<int>(j) + 1)) ++j;
      ++send[static_cast<size_t>(j)];
    }
    at::Tensor rows = at::stack({my_idx, my_val.view(at::kInt)}, 1).contiguous();
    auto counts = comm.allgather(at::tensor(send, at::TensorOptions().dtype(at::kLong)));
    std::vector<int64_t> recv(static_cast<size_t>(n));
    for (int m = 0; m < n; ++m) recv[static_cast<size_t>(m)] = counts[static_cast<size_t>(m)][comm.rank()].item<int64_t>();
    at::Tensor got = comm.alltoall_rows(rows, send, recv);
    // Reduce: this member owns region [lo, hi); members' pairs are added in member order.
    const int64_t lo = bound(comm.rank()), hi = bound(comm.rank() + 1);
    at::Tensor sum = at::zeros({hi - lo}, at::kFloat);
    at::Tensor any = at::zeros({hi - lo}, at::kBool);
    for (int64_t m = 0, pos = 0; m < n; pos += recv[static_cast<size_t>(m)], ++m) {
      if (recv[static_cast<size_t>(m)] == 0) continue;
      at::Tensor block = got.narrow(0, pos, recv[static_cast<size_t>(m)]);
      at::Tensor where = block.select(1, 0).to(at::kLong) - lo;
      sum.index_add_(0, where, block.select(1, 1).contiguous().view(at::kFloat));
      any.index_fill_(0, where, true);
    }
    // Select: the owner's largest ceil(k / n) of what arrived, padded with index -1.
    const int64_t keep = (k_total + n - 1) / n;
    at::Tensor cand = any.nonzero().view({-1});
    if (cand.numel() > keep) cand = cand.index_select(0, std::get<1>(sum.index_select(0, cand).abs().topk(keep)));
    cand = std::get<0>(cand.sort());
    at::Tensor payload = at::full({2 * keep}, -1, at::TensorOptions().dtype(at::kInt));
    const int64_t c = cand.numel();
    payload.narrow(0, 0, c).copy_(cand + lo);
    payload.narrow(0, keep, c).copy_(sum.index_select(0, cand).view(at::kInt));
    auto gathered = comm.allgather(payload);
    // The wire SparseCodec decodes; each owner's picks end at its first padding index.
    std::vector<int64_t> have(static_cast<size_t>(n), 0);
    for (int m = 0; m < n; ++m) {
      const auto* g = gathered[static_cast<size_t>(m)].data_ptr<int32_t>();
      while (have[static_cast<size_t>(m)] < keep && g[have[static_cast<size_t>(m)]] >= 0) ++have[static_cast<size_t>(m)];
    }
    at::Tensor wire = sparse_wire(gathered, have, keep);
    const auto* w = wire.data_ptr<int32_t>();
    // The buffer's kept indices, for after_decode (the worker runs exchange, decode and
    // after_decode of one buffer in turn).
    kept_ = at::zeros({L.numel}, at::kBool);
    for (int m = 0, q = 1 + n; m < n; q += 2 * w[1 + m], ++m)
      if (w[1 + m] > 0) kept_.index_fill_(0, wire.narrow(0, q, w[1 + m]).to(at::kLong) - L.begin, true);
    kept_begin_ = L.begin;
    return wire;
  }

  void after_decode(std::vector<Encoded>& parts, const at::Tensor&, CodecState& st, const StepContext&) override {
    if (!opt_.error_feedback || !st.residual.defined() || !kept_.defined()) return;
    for (auto& p : parts) {
      if (p.selected == 0) continue;
      at::Tensor idx = p.indices.narrow(0, 0, p.selected);
      at::Tensor lost = kept_.index_select(0, idx - kept_begin_).logical_not();
      st.residual.index_add_(0, idx.masked_select(lost), p.values.narrow(0, 0, p.selected).masked_select(lost));
    }
  }

 private:
  at::Tensor kept_;
  int64_t kept_begin_ = 0;
};

std::unique_ptr<Codec> make_codec(const Options& o) {
  if (o.method == "fp16" || o.method == "bf16") return std::make_unique<CastCodec>(o);
  if (o.method == "powersgd") return std::make_unique<PowerSgdCodec>(o);
  if (o.method == "oktopk") return std::make_unique<OkTopkCodec>(o);
  if (GradSyncConfig::sparse_method(o.method)) return std::make_unique<SparseCodec>(o);
  throw InputError("grad_sync.compression", "no codec for '" + o.method + "'");
}

}  // namespace alloy::dist::compress
