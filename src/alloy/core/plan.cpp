#include "alloy/core/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/pipeline/schedule.h"
#include "alloy/core/fs.h"

namespace alloy {

namespace {

// nlohmann's get<int64_t>() / get<int>() convert a floating-point value with a plain cast:
// undefined behaviour outside the integer's range ("ranks": [1e300]), silent truncation inside it
// (2.5 -> 2), and an integer is narrowed silently too (4294967296 -> rank 0). A plan's counts and
// ranks are whole numbers (written 2 or 2.0) within T's range; anything else throws json's
// type_error or out_of_range, which from_json reports as an ill-typed field.
template <typename T>
T whole(const nlohmann::json& v) {
  constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
  constexpr double hi = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;  // exclusive, exact
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<T>::max()))
      throw nlohmann::json::out_of_range::create(406, "number " + v.dump() + " is out of range", &v);
    return static_cast<T>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < std::numeric_limits<T>::min() || i > std::numeric_limits<T>::max())
      throw nlohmann::json::out_of_range::create(406, "number " + v.dump() + " is out of range", &v);
    return static_cast<T>(i);
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d != std::trunc(d) || !(d >= lo && d < hi))
      throw nlohmann::json::out_of_range::create(406, "number " + v.dump() + " is not a whole number in range", &v);
    return static_cast<T>(d);
  }
  throw nlohmann::json::type_error::create(302, std::string("type must be number, but is ") + v.type_name(), &v);
}

template <typename T>
std::vector<T> whole_list(const nlohmann::json& v) {
  if (!v.is_array())
    throw nlohmann::json::type_error::create(302, std::string("type must be array, but is ") + v.type_name(), &v);
  std::vector<T> out;
  for (const auto& e : v) out.push_back(whole<T>(e));
  return out;
}

template <typename T>
T whole_or(const nlohmann::json& obj, const char* key, T fallback) {
  return obj.contains(key) ? whole<T>(obj[key]) : fallback;
}

}  // namespace

int Plan::world_size() const {
  int n = 0;
  for (const auto& p : pipelines)
    for (int64_t s = 0; s < p.depth(); ++s) n += static_cast<int>(p.stages[static_cast<size_t>(s)].ranks.size());
  return n;
}

std::vector<int> Plan::chunks_of(int rank) const {
  const Position at = locate(rank);
  const PipelinePlan& pl = pipelines[static_cast<size_t>(at.pipeline)];
  std::vector<int> out;
  for (int64_t c = at.stage; c < static_cast<int64_t>(pl.stages.size()); c += pl.depth()) out.push_back(static_cast<int>(c));
  return out;
}

Plan::Position Plan::locate(int rank) const {
  for (size_t p = 0; p < pipelines.size(); ++p)
    for (size_t s = 0; s < pipelines[p].stages.size(); ++s)
      for (int r : pipelines[p].stages[s].ranks)
        if (r == rank) {
          const auto& rs = pipelines[p].stages[s].ranks;
          return {static_cast<int>(p), static_cast<int>(s), static_cast<int>(std::find(rs.begin(), rs.end(), r) - rs.begin())};
        }
  throw InputError("plan", "rank " + std::to_string(rank) + " does not appear in the plan (world size " +
                               std::to_string(world_size()) + ")");
}

std::vector<int64_t> even_tp_split(const ModelConfig& model, int n) {
  // Heads go in whole key/value groups (GQA: REP query heads read one key/value head).
  const int64_t kv = model.kv_heads_resolved(), rep = model.heads / std::max<int64_t>(kv, 1);
  if (n < 1 || kv < n) return {};
  std::vector<int64_t> out;
  for (int i = 0; i < n; ++i) out.push_back((kv / n + (i < kv % n ? 1 : 0)) * rep);
  return tp_split_problem(model, out).empty() ? out : std::vector<int64_t>{};
}

std::string tp_split_problem(const ModelConfig& model, const std::vector<int64_t>& split) {
  auto text = [](const std::vector<int64_t>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
    return s;
  };
  auto suggest = [&]() {
    const auto even = even_tp_split(model, static_cast<int>(split.size()));
    return even.empty() ? std::string(" (no split over ") + std::to_string(split.size()) + " ranks divides it)"
                        : " (e.g. tp_split " + text(even) + ")";
  };
  const int64_t H = model.heads, kv = model.kv_heads_resolved(), F = model.ffn_resolved();
  int64_t sum = 0;
  for (int64_t h : split) {
    if (h < 1) return "every rank needs at least one head, got " + text(split) + suggest();
    sum += h;
  }
  if (sum != H) return "heads " + text(split) + " sum to " + std::to_string(sum) + ", the model has " + std::to_string(H) + suggest();
  if (F % H != 0)
    return "the MLP's " + std::to_string(F) + " columns do not divide by the " + std::to_string(H) +
           " heads, so they cannot follow the heads' split";
  const int64_t rep = H / kv;
  int64_t at = 0;
  for (int64_t h : split) {
    at += h;
    if (at % rep != 0)
      return "with " + std::to_string(kv) + " key/value heads each serves " + std::to_string(rep) +
             " query heads, and heads " + text(split) + " cut a group" + suggest();
  }
  return "";
}

std::vector<int64_t> StagePlan::tp_heads(int64_t heads) const {
  if (!tp_split.empty()) return tp_split;
  const int64_t n = static_cast<int64_t>(ranks.size());
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(heads / n + (i < heads % n ? 1 : 0));
  return out;
}

std::vector<int64_t> StagePlan::tp_bounds(int64_t heads) const {
  std::vector<int64_t> b{0};
  for (int64_t h : tp_heads(heads)) b.push_back(b.back() + h);
  return b;
}

std::vector<int64_t> StagePlan::positions_by_heads(const std::vector<int64_t>& head_bounds, int64_t seq_len) {
  std::vector<int64_t> b;
  for (int64_t h : head_bounds) b.push_back(seq_len * h / head_bounds.back());
  return b;
}

int StagePlan::member_without_positions(const std::vector<int64_t>& bounds) {
  for (size_t k = 0; k + 1 < bounds.size(); ++k)
    if (bounds[k] == bounds[k + 1]) return static_cast<int>(k);
  return -1;
}

void PipelinePlan::set_samples(int64_t samples, int64_t m) {
  micro_batch_size = m;
  num_micro_batches = (samples + m - 1) / m;
  const int64_t last = samples - m * (num_micro_batches - 1);
  last_micro_batch_size = last == m ? 0 : last;
}

std::string PipelinePlan::batch_text() const {
  return std::to_string(micro_batch_size) + " x " + std::to_string(num_micro_batches) +
         (short_last() ? " (the last of " + std::to_string(last_size()) + ")" : "");
}

bool PipelinePlan::has_tensor_parallel() const {
  for (const auto& s : stages)
    if (s.ranks.size() > 1) return true;
  return false;
}

bool Plan::has_tensor_parallel() const {
  for (const auto& p : pipelines)
    if (p.has_tensor_parallel()) return true;
  return false;
}

bool PipelinePlan::cuts_mlp() const {
  for (const auto& s : stages)
    if (s.cuts_mlp()) return true;
  return false;
}

bool Plan::cuts_mlp() const {
  for (const auto& p : pipelines)
    if (p.cuts_mlp()) return true;
  return false;
}

void Plan::set_sequence_parallel() {
  for (auto& p : pipelines)
    for (auto& st : p.stages)
      if (st.tp() > 1) st.sequence_parallel = true;
}

std::string Plan::training_problem(const Config& cfg) const {
  for (size_t p = 0; p < pipelines.size(); ++p)
    if (pipelines[p].interleaved() && (cfg.train.zero_stage > 0 || !sharding.empty()))
      return "pipelines[" + std::to_string(p) + "] is interleaved (virtual_stages " + std::to_string(pipelines[p].virtual_stages) +
             "): ZeRO (train.zero_stage, the plan's sharding) over chunks is not supported; set train.zero_stage 0 and drop the plan's sharding";
  for (size_t p = 0; p < pipelines.size(); ++p)
    for (size_t s = 0; s < pipelines[p].stages.size(); ++s) {
      const StagePlan& st = pipelines[p].stages[s];
      if (st.cuts_mlp() && cfg.lora.enabled())
        return "pipelines[" + std::to_string(p) + "].stages[" + std::to_string(s) +
               "]: LoRA adapters on a cut MLP (mlp_cut) are not supported: move the boundary to a whole unit";
      if (st.tp() < 2 || !(cfg.train.sequence_parallel || st.sequence_parallel)) continue;
      const int k = StagePlan::member_without_positions(st.sequence_bounds(cfg.model.heads, cfg.model.seq_len));
      if (k < 0) continue;
      const auto h = st.tp_bounds(cfg.model.heads);
      return "pipelines[" + std::to_string(p) + "].stages[" + std::to_string(s) + "]: sequence parallelism gives rank " +
             std::to_string(st.ranks[static_cast<size_t>(k)]) + " (heads " + std::to_string(h[static_cast<size_t>(k)]) + "-" +
             std::to_string(h[static_cast<size_t>(k) + 1]) + " of " + std::to_string(cfg.model.heads) + ") none of the " +
             std::to_string(cfg.model.seq_len) + " positions: use a longer sequence or a more even tp_split";
    }
  return "";
}

void StagePlan::set_units(int64_t begin, int64_t end) {
  layer_begin = begin / 2;
  layer_end = (end + 1) / 2;
  from_mlp = begin % 2 != 0;
  to_attention = end % 2 != 0;
}

int64_t PipelinePlan::float_count(size_t s) const {
  const StagePlan& st = stages.at(s);
  if (!st.floats()) return 0;
  return std::clamp<int64_t>(std::llround(st.float_share * static_cast<double>(num_micro_batches)), 0, num_micro_batches);
}

int64_t PipelinePlan::cut(size_t s, int64_t mb) const {
  const StagePlan& st = stages.at(s);
  if (!st.floats()) return st.unit_end();
  // Micro-batch MB takes the late cut when floor((MB + 1) k / M) steps past floor(MB k / M). Of
  // the orders tried on the demo's pool (spread, the k in the middle, first, last), spreading
  // left the smallest bubble: a 1F1B stage pairs one micro-batch's forward with another's
  // backward, so alternating heavy and light micro-batches evens out its ticks.
  const int64_t k = float_count(s), M = num_micro_batches;
  const bool late = (mb + 1) * k / M > mb * k / M;
  return late ? st.unit_end() : st.unit_end() - 1;
}

std::pair<int64_t, int64_t> PipelinePlan::units_of(size_t s, int64_t mb) const {
  // Across a cut MLP both stages run the shared unit (each its columns).
  const int64_t begin = s == 0 ? stages.front().unit_begin() : stages[s - 1].cuts_mlp() ? stages[s - 1].unit_end() - 1 : cut(s - 1, mb);
  const int64_t end = s + 1 == stages.size() ? stages.back().unit_end() : cut(s, mb);
  return {begin, end};
}

bool PipelinePlan::floats() const {
  for (const auto& st : stages)
    if (st.floats()) return true;
  return false;
}

const std::string& Plan::schedule_of(size_t p) const {
  return p < pipelines.size() && !pipelines[p].schedule.empty() ? pipelines[p].schedule : schedule;
}

std::string Plan::schedules_text() const {
  std::string own;
  for (size_t p = 0; p < pipelines.size(); ++p)
    if (schedule_of(p) != schedule) own += (own.empty() ? "" : ", ") + ("pipeline " + std::to_string(p) + " ") + schedule_of(p);
  return own.empty() ? schedule : schedule + " (" + own + ")";
}

std::string Plan::schedule_mismatch(const std::vector<int>& ranks) const {
  auto key = [&](int r) {
    const Position at = locate(r);
    const PipelinePlan& pl = pipelines[static_cast<size_t>(at.pipeline)];
    const StagePlan& st = pl.stages[static_cast<size_t>(at.stage)];
    return std::make_tuple(st.unit_begin(), st.unit_end(), at.stage, pl.stages.size(), pl.num_micro_batches,
                           schedule_of(static_cast<size_t>(at.pipeline)));
  };
  auto text = [&](int r) {
    const auto [b, e, s, n, m, sched] = key(r);
    return "rank " + std::to_string(r) + " runs units [" + std::to_string(b) + ", " + std::to_string(e) + ") as stage " +
           std::to_string(s) + " of " + std::to_string(n) + " with " + std::to_string(m) + " micro-batches on " + sched;
  };
  for (int r : ranks)
    if (key(r) != key(ranks.front())) return text(ranks.front()) + ", " + text(r);
  return "";
}

int64_t Plan::sample_offset(int pipeline) const {
  int64_t off = 0;
  for (int p = 0; p < pipeline; ++p) off += pipelines[static_cast<size_t>(p)].samples();
  return off;
}

void Plan::validate(const ModelConfig& model, const std::string& where) const {
  auto fail = [&](const std::string& field, const std::string& msg) { throw InputError(where, field + ": " + msg); };
  if (pipelines.empty()) fail("pipelines", "the plan has no pipelines");
  const std::string valid = pipeline::schedule_names_text() + " or " + pipeline::kInterleaved;
  if (!pipeline::is_schedule_name(schedule)) fail("schedule", "must be " + valid + ", got '" + schedule + "'");
  for (size_t p = 0; p < pipelines.size(); ++p) {
    const std::string& own = pipelines[p].schedule;
    const std::string field = own.empty() ? "schedule" : "pipelines[" + std::to_string(p) + "].schedule";
    if (!own.empty() && !pipeline::is_schedule_name(own)) fail(field, "must be " + valid + ", got '" + own + "'");
  }
  grad_sync.validate(where, "grad_sync");
  int64_t total = 0;
  std::string sum_text;
  std::map<int, std::string> seen;
  for (size_t p = 0; p < pipelines.size(); ++p) {
    const auto& pl = pipelines[p];
    std::string pf = "pipelines[" + std::to_string(p) + "]";
    if (pl.micro_batch_size < 1) fail(pf + ".micro_batch_size", "must be >= 1, got " + std::to_string(pl.micro_batch_size));
    if (pl.num_micro_batches < 1) fail(pf + ".num_micro_batches", "must be >= 1, got " + std::to_string(pl.num_micro_batches));
    if (pl.last_micro_batch_size < 0 || pl.last_micro_batch_size >= pl.micro_batch_size)
      fail(pf + ".last_micro_batch_size", "must be 1.." + std::to_string(pl.micro_batch_size - 1) +
                                              " (fewer than micro_batch_size) or absent, got " + std::to_string(pl.last_micro_batch_size));
    int64_t samples = 0;
    if (__builtin_mul_overflow(pl.micro_batch_size, pl.num_micro_batches, &samples) ||
        __builtin_add_overflow(total, samples, &total))
      fail(pf, "micro_batch_size x num_micro_batches, summed over the pipelines, overflows a 64-bit integer");
    total -= pl.micro_batch_size - pl.last_size();
    sum_text += (sum_text.empty() ? "" : " + ") + std::to_string(pl.micro_batch_size) + "x" + std::to_string(pl.num_micro_batches);
    if (pl.short_last()) sum_text += "-" + std::to_string(pl.micro_batch_size - pl.last_size());
    if (pl.stages.empty()) fail(pf + ".stages", "a pipeline needs at least one stage");
    const std::string& sched = schedule_of(p);
    const std::string sched_field = pl.schedule.empty() ? "schedule" : pf + ".schedule";
    if (pl.virtual_stages < 1) fail(pf + ".virtual_stages", "must be >= 1, got " + std::to_string(pl.virtual_stages));
    if (pl.interleaved() != (sched == "interleaved-1f1b"))
      fail(pl.interleaved() ? pf + ".virtual_stages" : sched_field,
           pl.interleaved() ? "virtual stages run on the interleaved-1f1b schedule only, this pipeline's is " + sched
                            : "interleaved-1f1b needs the pipeline's virtual_stages (chunks a rank), 2 or more");
    if (pl.interleaved()) {
      const int64_t V = pl.virtual_stages, n = static_cast<int64_t>(pl.stages.size()), S = n / V;
      const std::string vf = pf + ".virtual_stages";
      if (n % V != 0 || S < 2)
        fail(vf, std::to_string(n) + " stages do not make " + std::to_string(V) + " chunks for each of two or more ranks (list S x " +
                     std::to_string(V) + " stages, chunk c on the ranks of chunk c mod S)");
      for (int64_t c = S; c < n; ++c)
        if (pl.stages[static_cast<size_t>(c)].ranks != pl.stages[static_cast<size_t>(c % S)].ranks)
          fail(pf + ".stages[" + std::to_string(c) + "].ranks", "chunk " + std::to_string(c) + " runs on the ranks of chunk " + std::to_string(c % S) +
                                                                    " (every S = " + std::to_string(S) + "th chunk is the same rank's)");
      for (size_t c = 0; c < pl.stages.size(); ++c) {
        const auto& st = pl.stages[c];
        const std::string sf = pf + ".stages[" + std::to_string(c) + "]";
        if (st.ranks.size() != 1) fail(sf + ".ranks", "an interleaved pipeline has one rank a chunk (no tensor parallelism)");
        if (st.floats() || st.cuts_mlp())
          fail(sf + (st.floats() ? ".float_share" : ".mlp_cut"), "chunks of an interleaved pipeline meet at whole units (no floats or cut MLPs)");
      }
      if (pl.num_micro_batches > S && pl.num_micro_batches % S != 0)
        fail(pf + ".num_micro_batches", std::to_string(pl.num_micro_batches) + " on " + std::to_string(S) +
                                            " ranks: interleaving needs a multiple of the ranks, or at most as many");
    }
    int64_t expect = 0;  // in units (half blocks)
    for (size_t s = 0; s < pl.stages.size(); ++s) {
      const auto& st = pl.stages[s];
      std::string sf = pf + ".stages[" + std::to_string(s) + "]";
      const bool split = st.splits_block() || expect % 2;
      const std::string field = sf + (split ? ".units" : ".layers");
      auto at = [&](int64_t u) { return std::to_string(split ? u : u / 2); };
      const bool shared = s > 0 && (pl.stages[s - 1].floats() || pl.stages[s - 1].cuts_mlp());
      if (shared && st.unit_begin() != expect - 1)
        fail(field, "starts at unit " + std::to_string(st.unit_begin()) + " but the previous stage has " +
                        (pl.stages[s - 1].floats() ? "a float_share" : "an mlp_cut") + ", so the two share unit " +
                        std::to_string(expect - 1) + ": start at " + std::to_string(expect - 1));
      if (!shared && st.unit_begin() != expect)
        fail(field, std::string("starts at ") + (split ? "unit " : "block ") + at(st.unit_begin()) + " but the previous stage ended at " +
                        at(expect) + (st.unit_begin() > expect ? " (a gap)" : " (an overlap)"));
      if (st.unit_end() <= st.unit_begin())
        fail(field, split ? "[" + std::to_string(st.unit_begin()) + ", " + std::to_string(st.unit_end()) + ") is empty"
                          : "[" + std::to_string(st.layer_begin) + ", " + std::to_string(st.layer_end) + ") is empty");
      expect = st.unit_end();
      if (st.float_share < 0 || st.float_share >= 1 || !std::isfinite(st.float_share))
        fail(sf + ".float_share", "must be in (0, 1): the share of micro-batches for which this stage runs the unit it shares with the next");
      if (st.floats()) {
        if (s + 1 == pl.stages.size()) fail(sf + ".float_share", "the last stage has no next stage to share a unit with");
        const int64_t runs = st.unit_end() - st.unit_begin() - 1 - (shared ? 1 : 0);
        if (runs < 1)
          fail(sf + ".float_share", "the stage holds units [" + std::to_string(st.unit_begin()) + ", " + std::to_string(st.unit_end()) +
                                        ") and shares its first and last with its neighbours: it would run none of its own");
        if (st.ranks.size() > 1 || pl.stages[s + 1].ranks.size() > 1)
          fail(sf + ".float_share", "a floating boundary needs one rank on each side (no tensor parallelism)");
      }
      if (st.mlp_cut < 0 || st.mlp_cut >= model.heads)
        fail(sf + ".mlp_cut", "must be in [1, " + std::to_string(model.heads - 1) + "] (heads whose share of the MLP's columns this stage computes), got " +
                                  std::to_string(st.mlp_cut));
      if (st.cuts_mlp()) {
        const std::string mf = sf + ".mlp_cut";
        if (s + 1 == pl.stages.size()) fail(mf, "the last stage has no next stage to share an MLP with");
        if (st.floats()) fail(mf, "a stage ends either in a float (float_share) or inside an MLP, not both");
        if (st.unit_end() % 2 != 0)
          fail(mf, "the stage's last unit " + std::to_string(st.unit_end() - 1) + " is an attention half; a cut goes inside an MLP half (end at an even unit)");
        if (st.unit_end() - st.unit_begin() - 1 - (shared ? 1 : 0) < 1)
          fail(mf, "the stage holds units [" + std::to_string(st.unit_begin()) + ", " + std::to_string(st.unit_end()) +
                       ") and shares its first and last with its neighbours: it would run none of its own");
        if (st.ranks.size() > 1 || pl.stages[s + 1].ranks.size() > 1) fail(mf, "a cut MLP needs one rank on each side (no tensor parallelism)");
        if (model.ffn_resolved() % model.heads != 0)
          fail(mf, "the MLP's " + std::to_string(model.ffn_resolved()) + " columns do not divide into " + std::to_string(model.heads) +
                       " heads' shares: no cut inside this model's MLP");
      }
      if (shared && st.unit_end() - st.unit_begin() < 2)
        fail(field, "shares unit " + std::to_string(st.unit_begin()) + " with the previous stage and holds no other");
      if (st.ranks.empty()) fail(sf + ".ranks", "a stage needs a rank");
      if (!st.tp_split.empty() && st.tp_split.size() != st.ranks.size())
        fail(sf + ".tp_split", "has " + std::to_string(st.tp_split.size()) + " entries for " + std::to_string(st.ranks.size()) + " ranks");
      if (st.ranks.size() > 1) {
        if (st.tp_split.empty() && model.heads % static_cast<int64_t>(st.ranks.size()) != 0) {
          const auto even = even_tp_split(model, st.tp());
          std::string alt;
          for (size_t k = 0; k < even.size(); ++k) alt += (k ? ", " : "") + std::to_string(even[k]);
          fail(sf + ".ranks", std::to_string(model.heads) + " heads do not split evenly over " + std::to_string(st.ranks.size()) +
                                  " tensor-parallel ranks" + (alt.empty() ? "" : ": give tp_split [" + alt + "]"));
        }
        if (const std::string why = tp_split_problem(model, st.tp_heads(model.heads)); !why.empty())
          fail(sf + (st.tp_split.empty() ? ".ranks" : ".tp_split"), why);
      }
      if (st.sequence_parallel && st.ranks.size() < 2)
        fail(sf + ".sequence_parallel", "needs a tensor-parallel stage (several ranks): it splits the group's positions");
      if (st.sequence_parallel) {  // the split is valid by now
        const int k = StagePlan::member_without_positions(st.sequence_bounds(model.heads, model.seq_len));
        if (k >= 0)
          fail(sf + ".sequence_parallel", "rank " + std::to_string(st.ranks[static_cast<size_t>(k)]) + " would hold none of the " +
                                              std::to_string(model.seq_len) + " positions (they split in the heads' ratio): use a longer "
                                              "sequence or a more even tp_split");
      }
      for (int r : st.ranks) {
        if (static_cast<int64_t>(s) >= pl.depth()) break;  // a later chunk of a rank met already (checked above)
        if (r < 0) fail(sf + ".ranks", "rank " + std::to_string(r) + " is negative");
        if (seen.count(r)) fail(sf + ".ranks", "rank " + std::to_string(r) + " already appears in " + seen[r]);
        seen[r] = sf;
      }
    }
    if (expect != 2 * model.layers)
      fail(pf + ".stages", (expect % 2 ? "cover units [0, " + std::to_string(expect) + ") (half blocks) but the model has " +
                                             std::to_string(2 * model.layers)
                                       : "cover blocks [0, " + std::to_string(expect / 2) + ") but the model has " +
                                             std::to_string(model.layers)) +
                               " (model.layers)");
  }
  if (total != global_batch)
    fail("global_batch", std::to_string(global_batch) + " != the pipelines' samples, micro_batch_size x num_micro_batches less a short last one's gap (" +
                             sum_text + " = " + std::to_string(total) + ")");
  int world = world_size();
  for (int r = 0; r < world; ++r)
    if (!seen.count(r))
      fail("pipelines", "ranks must be 0.." + std::to_string(world - 1) + " with none missing; rank " + std::to_string(r) +
                            " is missing");
  for (size_t i = 0; i < sharding.size(); ++i) {
    const auto& e = sharding[i];
    const std::string sf = "sharding[" + std::to_string(i) + "]";
    if (e.ranks.size() < 2) fail(sf + ".ranks", "sharding needs two or more ranks holding the same layers");
    for (size_t k = 0; k < e.ranks.size(); ++k) {
      if (e.ranks[k] < 0 || e.ranks[k] >= world) fail(sf + ".ranks", "rank " + std::to_string(e.ranks[k]) + " is not in the plan");
      if (k && e.ranks[k] <= e.ranks[k - 1]) fail(sf + ".ranks", "must be ascending and distinct");
    }
    if (e.stage < 0 || e.stage > 3) fail(sf + ".stage", "must be 0, 1, 2 or 3, got " + std::to_string(e.stage));
    if (!e.shares.empty() && e.shares.size() != e.ranks.size())
      fail(sf + ".shares", "has " + std::to_string(e.shares.size()) + " entries for " + std::to_string(e.ranks.size()) + " ranks");
    for (double v : e.shares)
      if (!(v > 0)) fail(sf + ".shares", "must be positive");
    for (size_t k = 0; k < i; ++k)
      if (sharding[k].ranks == e.ranks) fail(sf + ".ranks", "the same ranks as sharding[" + std::to_string(k) + "]");
  }
  for (const auto& [a, b] : slow_links)
    if (a < 0 || b < 0 || a >= world || b >= world || a == b)
      fail("grad_sync.slow_links", "[" + std::to_string(a) + ", " + std::to_string(b) + "] must name two different ranks of 0.." +
                                       std::to_string(world - 1));
}

nlohmann::json Plan::to_json() const {
  nlohmann::json j;
  j["format"] = "alloy-plan";
  // Each version is written only when the plan needs it: readers of version 1 know no sharding
  // and no recomputation, readers of 2 no half-block stages.
  bool v2 = !sharding.empty(), v3 = false, v4 = has_tensor_parallel(), v5 = false, v6 = false, v7 = false, v8 = cuts_mlp(), v9 = false,
       v10 = false;
  for (const auto& p : pipelines) {
    v10 = v10 || p.interleaved();
    v5 = v5 || p.floats();
    v9 = v9 || p.short_last();
    v6 = v6 || (!p.schedule.empty() && p.schedule != schedule);
    for (const auto& st : p.stages) {
      v2 = v2 || st.recompute;
      v3 = v3 || st.splits_block();
      v7 = v7 || st.sequence_parallel;
    }
  }
  j["version"] = v10 ? 10 : v9 ? 9 : v8 ? 8 : v7 ? 7 : v6 ? 6 : v5 ? 5 : v4 ? 4 : v3 ? 3 : v2 ? 2 : 1;
  j["global_batch"] = global_batch;
  j["schedule"] = schedule;
  j["pipelines"] = nlohmann::json::array();
  for (const auto& p : pipelines) {
    nlohmann::json pj = {{"micro_batch_size", p.micro_batch_size}, {"num_micro_batches", p.num_micro_batches}};
    if (p.short_last()) pj["last_micro_batch_size"] = p.last_micro_batch_size;
    if (p.interleaved()) pj["virtual_stages"] = p.virtual_stages;
    if (!p.schedule.empty() && p.schedule != schedule) pj["schedule"] = p.schedule;
    pj["stages"] = nlohmann::json::array();
    for (const auto& s : p.stages) {
      nlohmann::json sj = {{"ranks", s.ranks}, {"layers", {s.layer_begin, s.layer_end}}};
      if (s.splits_block()) sj["units"] = {s.unit_begin(), s.unit_end()};
      if (s.floats()) sj["float_share"] = s.float_share;
      if (s.cuts_mlp()) sj["mlp_cut"] = s.mlp_cut;
      if (!s.device.empty()) sj["device"] = s.device;
      if (s.recompute) sj["recompute"] = true;
      if (!s.tp_split.empty()) sj["tp_split"] = s.tp_split;
      if (s.devices.size() > 1) sj["devices"] = s.devices;
      if (s.sequence_parallel) sj["sequence_parallel"] = true;
      pj["stages"].push_back(sj);
    }
    j["pipelines"].push_back(pj);
  }
  const GradSyncConfig& g = grad_sync;
  j["grad_sync"] = {{"bucket_mb", g.bucket_mb}, {"compression", g.compression}};
  if (g.lossy()) {
    j["grad_sync"].update({{"density", g.density},
                           {"fusion", g.fusion},
                           {"error_feedback", g.error_feedback},
                           {"warmup_steps", g.warmup_steps},
                           {"dense_steps", g.dense_steps},
                           {"powersgd_rank", g.powersgd_rank},
                           {"scope", g.scope},
                           {"dgc_momentum", g.dgc_momentum},
                           {"momentum_correction", g.momentum_correction},
                           {"sidco_fit", g.sidco_fit},
                           {"sidco_stages", g.sidco_stages}});
  }
  if (g.allreduce != "auto") j["grad_sync"]["allreduce"] = g.allreduce;
  if (g.tree_stripes != GradSyncConfig{}.tree_stripes) j["grad_sync"]["tree_stripes"] = g.tree_stripes;
  if (!slow_links.empty()) {
    nlohmann::json sl = nlohmann::json::array();
    for (const auto& [a, b] : slow_links) sl.push_back({a, b});
    j["grad_sync"]["slow_links"] = sl;
  }
  if (!sharding.empty()) {
    j["sharding"] = nlohmann::json::array();
    for (const auto& e : sharding) {
      nlohmann::json ej = {{"ranks", e.ranks}, {"stage", e.stage}};
      if (!e.shares.empty()) ej["shares"] = e.shares;
      j["sharding"].push_back(ej);
    }
  }
  if (!predicted.is_null()) j["predicted"] = predicted;
  return j;
}

Plan Plan::from_json(const nlohmann::json& j, const std::string& where) {
  Plan p;
  std::string field = "";
  try {
    if (j.contains("format") && j["format"] != "alloy-plan")
      throw InputError(where, "field 'format' is " + j["format"].dump() + ", not \"alloy-plan\"");
    const auto known_version = [](const nlohmann::json& v) {
      return v.is_number() && v.get<double>() >= 1 && v.get<double>() <= 10 && v.get<double>() == std::floor(v.get<double>());
    };
    if (j.contains("version") && !known_version(j["version"]))
      throw InputError(where, "field 'version' is " + j["version"].dump() + "; this Alloy reads versions 1 to 10");
    field = "global_batch";
    p.global_batch = whole<int64_t>(j.at("global_batch"));
    field = "schedule";
    p.schedule = j.value("schedule", std::string("1f1b"));
    field = "pipelines";
    const auto& pls = j.at("pipelines");
    for (size_t i = 0; i < pls.size(); ++i) {
      field = "pipelines[" + std::to_string(i) + "]";
      PipelinePlan pl;
      pl.micro_batch_size = whole<int64_t>(pls[i].at("micro_batch_size"));
      pl.num_micro_batches = whole<int64_t>(pls[i].at("num_micro_batches"));
      if (pls[i].contains("last_micro_batch_size")) {
        field += ".last_micro_batch_size";
        pl.last_micro_batch_size = whole<int64_t>(pls[i].at("last_micro_batch_size"));
        field = "pipelines[" + std::to_string(i) + "]";
      }
      if (pls[i].contains("virtual_stages")) {
        field += ".virtual_stages";
        pl.virtual_stages = whole<int64_t>(pls[i].at("virtual_stages"));
        field = "pipelines[" + std::to_string(i) + "]";
      }
      if (pls[i].contains("schedule")) {
        field += ".schedule";
        pl.schedule = pls[i].at("schedule").get<std::string>();
        field = "pipelines[" + std::to_string(i) + "]";
      }
      const auto& sts = pls[i].at("stages");
      for (size_t s = 0; s < sts.size(); ++s) {
        field = "pipelines[" + std::to_string(i) + "].stages[" + std::to_string(s) + "]";
        StagePlan st;
        st.ranks = whole_list<int>(sts[s].at("ranks"));
        if (sts[s].contains("units")) {
          // Half-block units are what the stage holds; "layers" (the blocks it touches) must agree.
          auto units = whole_list<int64_t>(sts[s].at("units"));
          if (units.size() != 2) throw InputError(where, field + ".units: must be [begin, end) in half blocks");
          if (units[0] < 0 || units[1] <= units[0] || units[1] > (int64_t{1} << 40))
            throw InputError(where, field + ".units: [" + std::to_string(units[0]) + ", " + std::to_string(units[1]) +
                                        ") is not a range of half blocks");
          st.set_units(units[0], units[1]);
          if (sts[s].contains("layers")) {
            auto layers = whole_list<int64_t>(sts[s].at("layers"));
            if (layers.size() != 2 || layers[0] != st.layer_begin || layers[1] != st.layer_end)
              throw InputError(where, field + ".layers: must be [" + std::to_string(st.layer_begin) + ", " +
                                          std::to_string(st.layer_end) + "], the blocks units [" + std::to_string(units[0]) +
                                          ", " + std::to_string(units[1]) + ") touch");
          }
        } else {
          auto layers = whole_list<int64_t>(sts[s].at("layers"));
          if (layers.size() != 2) throw InputError(where, field + ".layers: must be [begin, end)");
          st.layer_begin = layers[0];
          st.layer_end = layers[1];
        }
        st.device = sts[s].value("device", std::string());
        st.recompute = sts[s].value("recompute", false);
        if (sts[s].contains("float_share")) {
          const std::string stage_field = field;
          field = stage_field + ".float_share";
          st.float_share = sts[s].at("float_share").get<double>();
          field = stage_field;
        }
        if (sts[s].contains("mlp_cut")) {
          const std::string stage_field = field;
          field = stage_field + ".mlp_cut";
          st.mlp_cut = whole<int64_t>(sts[s].at("mlp_cut"));
          field = stage_field;
        }
        if (sts[s].contains("tp_split")) st.tp_split = whole_list<int64_t>(sts[s].at("tp_split"));
        if (sts[s].contains("sequence_parallel")) {
          const std::string stage_field = field;
          field = stage_field + ".sequence_parallel";
          st.sequence_parallel = sts[s].at("sequence_parallel").get<bool>();
          field = stage_field;
        }
        if (sts[s].contains("devices")) {
          st.devices = sts[s].at("devices").get<std::vector<std::string>>();
          if (st.devices.size() != st.ranks.size())
            throw InputError(where, field + ".devices: names " + std::to_string(st.devices.size()) + " devices for " +
                                        std::to_string(st.ranks.size()) + " ranks");
          if (st.device.empty() && !st.devices.empty()) st.device = st.devices.front();
        }
        pl.stages.push_back(st);
      }
      p.pipelines.push_back(pl);
    }
    field = "grad_sync";
    if (j.contains("grad_sync")) {
      const auto& g = j["grad_sync"];
      GradSyncConfig& o = p.grad_sync;
      field = "grad_sync.bucket_mb";
      o.bucket_mb = g.value("bucket_mb", o.bucket_mb);
      field = "grad_sync.compression";
      o.compression = GradSyncConfig::canonical_method(g.value("compression", o.compression));
      field = "grad_sync.density";
      o.density = g.value("density", o.density);
      field = "grad_sync.fusion";
      o.fusion = g.value("fusion", o.fusion);
      field = "grad_sync.error_feedback";
      o.error_feedback = g.value("error_feedback", o.error_feedback);
      field = "grad_sync.warmup_steps";
      o.warmup_steps = whole_or(g, "warmup_steps", o.warmup_steps);
      field = "grad_sync.dense_steps";
      o.dense_steps = whole_or(g, "dense_steps", o.dense_steps);
      field = "grad_sync.powersgd_rank";
      o.powersgd_rank = whole_or(g, "powersgd_rank", o.powersgd_rank);
      field = "grad_sync.scope";
      o.scope = g.value("scope", o.scope);
      field = "grad_sync.dgc_momentum";
      o.dgc_momentum = g.value("dgc_momentum", o.dgc_momentum);
      field = "grad_sync.momentum_correction";
      o.momentum_correction = g.value("momentum_correction", o.momentum_correction);
      field = "grad_sync.sidco_fit";
      o.sidco_fit = g.value("sidco_fit", o.sidco_fit);
      field = "grad_sync.sidco_stages";
      o.sidco_stages = whole_or(g, "sidco_stages", o.sidco_stages);
      field = "grad_sync.allreduce";
      o.allreduce = g.value("allreduce", o.allreduce);
      field = "grad_sync.tree_stripes";
      o.tree_stripes = whole_or(g, "tree_stripes", o.tree_stripes);
      field = "grad_sync.slow_links";
      if (g.contains("slow_links"))
        for (const auto& e : g.at("slow_links")) {
          auto v = whole_list<int>(e);
          if (v.size() != 2) throw InputError(where, "grad_sync.slow_links: each entry must be [rank_a, rank_b]");
          p.slow_links.emplace_back(std::min(v[0], v[1]), std::max(v[0], v[1]));
        }
    }
    if (j.contains("sharding"))
      for (size_t i = 0; i < j["sharding"].size(); ++i) {
        field = "sharding[" + std::to_string(i) + "]";
        const auto& e = j["sharding"][i];
        ShardingPlan sp;
        sp.ranks = whole_list<int>(e.at("ranks"));
        sp.stage = whole<int64_t>(e.at("stage"));
        if (e.contains("shares")) sp.shares = e.at("shares").get<std::vector<double>>();
        p.sharding.push_back(sp);
      }
    if (j.contains("predicted")) p.predicted = j["predicted"];
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where, "field '" + field + "' is missing or ill-typed (" + e.what() + ")");
  }
  return p;
}

const ShardingPlan* Plan::sharding_of(const std::vector<int>& ranks) const {
  for (const auto& e : sharding)
    if (e.ranks == ranks) return &e;
  return nullptr;
}

Plan Plan::load(const std::string& path) {
  nlohmann::json j = read_json_file(path);
  return from_json(j, path);
}

void Plan::save(const std::string& path) const { write_file_atomic(path, to_json().dump(2) + "\n"); }

std::string Plan::describe() const {
  std::ostringstream out;
  out << "global batch " << global_batch << ", schedule " << schedule << ", " << pipelines.size() << " pipeline"
      << (pipelines.size() == 1 ? "" : "s") << ", " << world_size() << " rank" << (world_size() == 1 ? "" : "s") << "\n";
  for (size_t p = 0; p < pipelines.size(); ++p) {
    const auto& pl = pipelines[p];
    out << "  pipeline " << p << ": " << pl.batch_text() << " = " << pl.samples() << " samples |";
    for (size_t s = 0; s < pl.stages.size(); ++s) {
      const auto& st = pl.stages[s];
      out << (s ? " ->" : "");
      if (st.ranks.size() == 1) {
        out << " rank " << st.ranks[0];
      } else {
        out << " ranks ";
        for (size_t k = 0; k < st.ranks.size(); ++k) out << (k ? "+" : "") << st.ranks[k];
        out << " (tp";
        if (!st.tp_split.empty())
          for (size_t k = 0; k < st.tp_split.size(); ++k) out << (k ? ":" : " heads ") << st.tp_split[k];
        if (st.sequence_parallel) out << ", sequence parallel";
        out << ")";
      }
      if (st.devices.size() > 1) {
        out << " (";
        for (size_t k = 0; k < st.devices.size(); ++k) out << (k ? "+" : "") << st.devices[k];
        out << ")";
      }
      if (st.splits_block())
        out << " units [" << st.unit_begin() << "," << st.unit_end() << ")";
      else
        out << " blocks [" << st.layer_begin << "," << st.layer_end << ")";
      if (st.floats())
        out << " (runs unit " << st.unit_end() - 1 << " for " << pl.float_count(s) << " of " << pl.num_micro_batches << " micro-batches)";
      if (st.cuts_mlp()) out << " (unit " << st.unit_end() - 1 << "'s MLP columns of " << st.mlp_cut << " heads; the next stage the rest)";
      if (!st.device.empty() && st.devices.size() < 2) out << " (" << st.device << ")";
      if (st.recompute) out << " recompute";
    }
    if (schedule_of(p) != schedule) out << " | schedule " << schedule_of(p);
    out << "\n";
  }
  for (const auto& e : sharding) {
    out << "  sharding: ranks";
    for (size_t k = 0; k < e.ranks.size(); ++k) out << (k ? "," : " ") << e.ranks[k];
    out << " ZeRO-" << e.stage;
    if (!e.shares.empty()) {
      out << ", shares";
      for (size_t k = 0; k < e.shares.size(); ++k) out << (k ? ":" : " ") << e.shares[k];
    }
    out << "\n";
  }
  return out.str();
}

Plan Plan::single_device(const Config& cfg) {
  int64_t mb = cfg.train.micro_batch_resolved();
  return data_parallel(cfg.model.layers, {{mb, cfg.train.global_batch / mb}});
}

Plan Plan::data_parallel(int64_t num_layers, const std::vector<std::pair<int64_t, int64_t>>& mbs_nmb,
                         const std::string& schedule) {
  Plan p;
  p.schedule = schedule;
  int rank = 0;
  for (const auto& [mbs, nmb] : mbs_nmb) {
    PipelinePlan pl;
    pl.micro_batch_size = mbs;
    pl.num_micro_batches = nmb;
    pl.stages.push_back({{rank++}, 0, num_layers, ""});
    p.global_batch += mbs * nmb;
    p.pipelines.push_back(pl);
  }
  return p;
}

}  // namespace alloy
