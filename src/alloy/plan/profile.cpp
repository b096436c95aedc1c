#include "alloy/plan/profile.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"

namespace alloy::plan {

namespace {

using nlohmann::json;

const char* const kFormat = "alloy-profile";
// Version 2 added each compute cost's measured points; version 3 the gradient codecs' costs
// ("codecs" per device type); version 4 each type's step_noise; version 5 LoRA ("lora" and the
// frozen base's bytes in "memory"); version 6 each type's attn_share_fwd/bwd (the halves of a
// block); version 7 the tensor-parallel sums per device pair ("tp_sums"); version 8 each type's
// weight_share (zb-h1's weight passes); version 9 each type's comm_cpu_s_per_byte; version 10 each
// type's tp_whole_share; version 11 each type's burst_speedup (a short stretch's speed after a
// wait; read and no longer used: it timed a wake-up's cold start as much as the quota); version 12
// each type's quota_fraction and quota_burst_s; version 13 each type's tp_shard_shares. Versions 1
// to 12 still read.
constexpr int kVersion = 13;

// The cost terms of a DeviceProfile, in file order; one table keeps to_json and from_json in step.
struct CostField {
  const char* key;
  MicroBatchCost DeviceProfile::*member;
};
const CostField kCostFields[] = {
    {"block_fwd", &DeviceProfile::block_fwd}, {"block_bwd", &DeviceProfile::block_bwd},
    {"embed_fwd", &DeviceProfile::embed_fwd}, {"embed_bwd", &DeviceProfile::embed_bwd},
    {"head_fwd", &DeviceProfile::head_fwd},   {"head_bwd", &DeviceProfile::head_bwd},
};

struct MemField {
  const char* key;
  double MemoryProfile::*member;
};
const MemField kMemFields[] = {
    {"param_bytes_per_block", &MemoryProfile::param_bytes_per_block},
    {"param_bytes_embed", &MemoryProfile::param_bytes_embed},
    {"param_bytes_head", &MemoryProfile::param_bytes_head},
    {"act_bytes_per_sample_block", &MemoryProfile::act_bytes_per_sample_block},
    {"act_bytes_per_sample_embed", &MemoryProfile::act_bytes_per_sample_embed},
    {"act_bytes_per_sample_head", &MemoryProfile::act_bytes_per_sample_head},
    {"state_bytes_per_param_byte", &MemoryProfile::state_bytes_per_param_byte},
};
// Optional (version 5): absent means no frozen base.
const MemField kFrozenFields[] = {
    {"frozen_bytes_per_block", &MemoryProfile::frozen_bytes_per_block},
    {"frozen_bytes_embed", &MemoryProfile::frozen_bytes_embed},
    {"frozen_bytes_head", &MemoryProfile::frozen_bytes_head},
};

json cost_json(const MicroBatchCost& c) {
  json j{{"fixed_s", c.fixed_s}, {"per_sample_s", c.per_sample_s}};
  if (c.n > 0) {
    j["points"] = json::array();
    for (int i = 0; i < c.n; ++i) j["points"].push_back({c.m[static_cast<size_t>(i)], c.t[static_cast<size_t>(i)]});
  }
  return j;
}

class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    throw InputError(where_, field.empty() ? msg : field + ": " + msg);
  }

  const json& object(const json& parent, const char* key, const std::string& field) const {
    if (!parent.contains(key)) fail(field, "is missing");
    const json& v = parent[key];
    if (!v.is_object()) fail(field, std::string("must be an object, got ") + v.type_name());
    return v;
  }

  // Profiles are written by `alloy profile`; a key it never writes is a typo or another file.
  void only_keys(const json& obj, const std::set<std::string>& allowed, const std::string& field) const {
    for (const auto& kv : obj.items())
      if (!allowed.count(kv.key())) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        fail(field.empty() ? kv.key() : field + "." + kv.key(), "unknown key (expected " + list + ")");
      }
  }

  double number(const json& obj, const char* key, const std::string& field, bool required = true,
                double fallback = 0) const {
    if (!obj.contains(key)) {
      if (required) fail(field, "is missing");
      return fallback;
    }
    const json& v = obj[key];
    if (!v.is_number()) fail(field, "must be a number, got " + v.dump());
    double d = v.get<double>();
    if (!std::isfinite(d)) fail(field, "must be finite, got " + v.dump());
    return d;
  }

  std::string string(const json& obj, const char* key, const std::string& field) const {
    if (!obj.contains(key)) fail(field, "is missing");
    const json& v = obj[key];
    if (!v.is_string()) fail(field, "must be a string, got " + v.dump());
    return v.get<std::string>();
  }

  MicroBatchCost cost(const json& parent, const char* key, const std::string& field) const {
    const json& o = object(parent, key, field);
    only_keys(o, {"fixed_s", "per_sample_s", "points"}, field);
    MicroBatchCost c;
    c.fixed_s = number(o, "fixed_s", field + ".fixed_s");
    c.per_sample_s = number(o, "per_sample_s", field + ".per_sample_s");
    if (c.per_sample_s < 0) fail(field + ".per_sample_s", "must be >= 0 seconds, got " + json(c.per_sample_s).dump());
    // A least-squares fit may put the intercept a little below zero; what must hold is that one
    // sample never takes negative time.
    if (c.fixed_s + c.per_sample_s < 0)
      fail(field, "fixed_s + per_sample_s = " + json(c.fixed_s + c.per_sample_s).dump() + " s for one sample; it must be >= 0");
    if (o.contains("points")) {
      const json& pts = o["points"];
      const std::string pf = field + ".points";
      if (!pts.is_array()) fail(pf, std::string("must be an array of [micro-batch size, seconds], got ") + pts.type_name());
      if (pts.size() > static_cast<size_t>(MicroBatchCost::kMaxPoints))
        fail(pf, "has " + std::to_string(pts.size()) + " points; at most " + std::to_string(MicroBatchCost::kMaxPoints));
      std::vector<double> ms, ts;
      for (size_t i = 0; i < pts.size(); ++i) {
        const std::string f = pf + "[" + std::to_string(i) + "]";
        const json& q = pts[i];
        if (!q.is_array() || q.size() != 2 || !q[0].is_number() || !q[1].is_number())
          fail(f, "must be [micro-batch size, seconds], got " + q.dump());
        const double m = q[0].get<double>(), t = q[1].get<double>();
        if (!(m >= 1) || !std::isfinite(m)) fail(f, "micro-batch size must be >= 1, got " + q[0].dump());
        if (!ms.empty() && !(m > ms.back())) fail(f, "micro-batch sizes must increase, got " + q[0].dump() + " after " + json(ms.back()).dump());
        if (!(t >= 0) || !std::isfinite(t)) fail(f, "seconds must be finite and >= 0, got " + q[1].dump());
        ms.push_back(m), ts.push_back(t);
      }
      c.set_points(ms, ts);
    }
    return c;
  }

 private:
  std::string where_;
};

}  // namespace

double MicroBatchCost::at(double x) const {
  if (n == 0) return fixed_s + per_sample_s * x;
  const size_t last = static_cast<size_t>(n - 1);
  if (x <= m[0]) return std::max(t[0] * x / m[0], t[0] - per_sample_s * (m[0] - x));
  if (x >= m[last]) return t[last] + per_sample_s * (x - m[last]);
  size_t i = 1;
  while (m[i] < x) ++i;
  const double w = (x - m[i - 1]) / (m[i] - m[i - 1]);
  return t[i - 1] + w * (t[i] - t[i - 1]);
}

void MicroBatchCost::add(const MicroBatchCost& other, double k) {
  if (n > 0 || other.n > 0) {
    std::vector<double> xs(m.begin(), m.begin() + n);
    xs.insert(xs.end(), other.m.begin(), other.m.begin() + other.n);
    std::sort(xs.begin(), xs.end());
    xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
    if (xs.size() > static_cast<size_t>(kMaxPoints))  // unlike grids: keep one of them
      xs.assign(n > 0 ? m.begin() : other.m.begin(), n > 0 ? m.begin() + n : other.m.begin() + other.n);
    std::vector<double> ts;
    for (double x : xs) ts.push_back(at(x) + k * other.at(x));
    set_points(xs, ts);
  }
  fixed_s += k * other.fixed_s;
  per_sample_s += k * other.per_sample_s;
}

void MicroBatchCost::set_points(const std::vector<double>& ms, const std::vector<double>& ts) {
  if (ms.size() != ts.size() || ms.size() > static_cast<size_t>(kMaxPoints))
    throw Error("MicroBatchCost::set_points: " + std::to_string(ms.size()) + " sizes and " + std::to_string(ts.size()) + " times (at most " +
                std::to_string(kMaxPoints) + ")");
  n = static_cast<int>(ms.size());
  std::copy(ms.begin(), ms.end(), m.begin());
  std::copy(ts.begin(), ts.end(), t.begin());
}

namespace {
// Least-squares non-decreasing fit of V (pool adjacent violators, equal weights).
std::vector<double> isotonic_increasing(const std::vector<double>& v) {
  std::vector<double> mean;
  std::vector<size_t> count;
  for (double x : v) {
    mean.push_back(x), count.push_back(1);
    while (mean.size() > 1 && mean[mean.size() - 2] > mean.back()) {
      const size_t b = mean.size() - 1, a = b - 1;
      mean[a] = (mean[a] * static_cast<double>(count[a]) + mean[b] * static_cast<double>(count[b])) / static_cast<double>(count[a] + count[b]);
      count[a] += count[b];
      mean.pop_back(), count.pop_back();
    }
  }
  std::vector<double> out;
  for (size_t i = 0; i < mean.size(); ++i) out.insert(out.end(), count[i], mean[i]);
  return out;
}
}  // namespace

MicroBatchCost MicroBatchCost::measured(const std::vector<double>& ms, const std::vector<double>& ts) {
  if (ms.size() != ts.size()) throw Error("MicroBatchCost::measured: " + std::to_string(ms.size()) + " sizes and " + std::to_string(ts.size()) + " times");
  // Per sample, non-increasing: the negated values fitted non-decreasing.
  std::vector<double> neg;
  for (size_t i = 0; i < ms.size(); ++i) neg.push_back(-ts[i] / ms[i]);
  neg = isotonic_increasing(neg);
  std::vector<double> shaped;
  for (size_t i = 0; i < ms.size(); ++i) shaped.push_back(-neg[i] * ms[i]);
  // Then the times, non-decreasing. A pooled run of times starts at or above its mean and ends at
  // or below it, so the per-sample order survives (tests/test_cluster.cpp checks both).
  shaped = isotonic_increasing(shaped);
  const Line line = fit_line(ms, shaped);
  MicroBatchCost c{line.intercept, line.slope};
  if (!ms.empty() && ms.size() <= static_cast<size_t>(kMaxPoints)) c.set_points(ms, shaped);
  return c;
}

double Profile::activation_bytes_per_sample() const {
  double bytes = 0;
  if (model.dtype == "float32") {
    bytes = 4;
  } else if (model.dtype == "float64") {
    bytes = 8;
  } else {
    throw InputError("profile", "model.dtype: unknown dtype '" + model.dtype + "' (expected float32 or float64)");
  }
  return static_cast<double>(model.seq_len) * static_cast<double>(model.hidden) * bytes;
}

nlohmann::json Profile::to_json() const {
  json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["model"] = model_to_json(model);
  j["devices"] = json::object();
  for (const auto& [type, d] : devices) {
    json dj = json::object();
    for (const auto& f : kCostFields) dj[f.key] = cost_json(d.*(f.member));
    dj["optimizer_s_per_param"] = d.optimizer_s_per_param;
    dj["step_noise"] = d.step_noise;
    if (d.attn_share_fwd > 0) dj["attn_share_fwd"] = d.attn_share_fwd;
    if (d.attn_share_bwd > 0) dj["attn_share_bwd"] = d.attn_share_bwd;
    if (d.weight_share > 0) dj["weight_share"] = d.weight_share;
    if (d.comm_cpu_s_per_byte > 0) dj["comm_cpu_s_per_byte"] = d.comm_cpu_s_per_byte;
    if (d.tp_whole_share > 0) dj["tp_whole_share"] = d.tp_whole_share;
    if (!d.tp_shard_shares.empty()) {
      json pts = json::array();
      for (const auto& [f, share] : d.tp_shard_shares) pts.push_back({f, share});
      dj["tp_shard_shares"] = pts;
    }
    if (d.quota_burst_s > 0) {
      dj["quota_fraction"] = d.quota_fraction;
      dj["quota_burst_s"] = d.quota_burst_s;
    }
    if (!d.codecs.empty()) {
      json cj = json::object();
      for (const auto& [m, c] : d.codecs) cj[m] = {{"encode_s_per_elem", c.encode_s_per_elem}, {"decode_s_per_elem", c.decode_s_per_elem}};
      dj["codecs"] = cj;
    }
    j["devices"][type] = dj;
  }
  j["links"] = json::array();
  for (const auto& l : links)
    j["links"].push_back({{"host_a", l.host_a},
                          {"host_b", l.host_b},
                          {"bytes_per_s", l.bytes_per_s},
                          {"latency_s", l.latency_s},
                          {"allreduce_bytes_per_s", l.allreduce_bytes_per_s}});
  if (!tp_sums.empty()) {
    j["tp_sums"] = json::array();
    for (const auto& t : tp_sums)
      j["tp_sums"].push_back({{"device_a", t.device_a}, {"device_b", t.device_b}, {"bytes", t.bytes}, {"seconds", t.seconds}});
  }
  j["memory"] = json::object();
  for (const auto& f : kMemFields) j["memory"][f.key] = memory.*(f.member);
  if (lora.enabled()) {
    for (const auto& f : kFrozenFields) j["memory"][f.key] = memory.*(f.member);
    j["lora"] = {{"rank", lora.rank}, {"alpha", lora.alpha}, {"targets", lora.targets},
                 {"base_dtype", lora.base_dtype}, {"double_quant", lora.double_quant}};
  }
  return j;
}

Profile Profile::from_json(const nlohmann::json& j, const std::string& where) {
  Reader rd(where);
  if (!j.is_object()) rd.fail("", std::string("expected a JSON object (an alloy profile), got ") + j.type_name());
  // "meta" is free-form provenance (who measured, when, with what); it is accepted and not kept.
  rd.only_keys(j, {"format", "version", "model", "devices", "links", "tp_sums", "memory", "lora", "meta"}, "");
  if (!j.contains("format")) rd.fail("format", "is missing; expected \"alloy-profile\" (is this a profile?)");
  if (j["format"] != kFormat) rd.fail("format", j["format"].dump() + ", not \"alloy-profile\"");
  if (!j.contains("version")) rd.fail("version", "is missing");
  if (!j["version"].is_number_integer() || j["version"].get<int>() < 1 || j["version"].get<int>() > kVersion)
    rd.fail("version", j["version"].dump() + "; this Alloy reads versions 1 to " + std::to_string(kVersion));

  Profile p;
  if (!j.contains("model")) rd.fail("model", "is missing");
  if (!j["model"].is_object()) rd.fail("model", std::string("must be an object, got ") + j["model"].type_name());
  // The model section has the schema of a config's model section; reuse its checks and messages.
  p.model = Config::from_json(json{{"model", j["model"]}}, where).model;

  const json& devs = rd.object(j, "devices", "devices");
  if (devs.empty()) rd.fail("devices", "the profile has no device types");
  std::set<std::string> dev_keys{"optimizer_s_per_param", "step_noise", "codecs", "attn_share_fwd", "attn_share_bwd", "weight_share",
                                 "comm_cpu_s_per_byte", "tp_whole_share", "tp_shard_shares", "burst_speedup", "quota_fraction",
                                 "quota_burst_s"};
  for (const auto& f : kCostFields) dev_keys.insert(f.key);
  for (const auto& kv : devs.items()) {
    const std::string f = "devices." + kv.key();
    if (kv.key().empty()) rd.fail("devices", "a device type must have a name");
    if (!kv.value().is_object()) rd.fail(f, std::string("must be an object, got ") + kv.value().type_name());
    rd.only_keys(kv.value(), dev_keys, f);
    DeviceProfile d;
    for (const auto& cf : kCostFields) d.*(cf.member) = rd.cost(kv.value(), cf.key, f + "." + cf.key);
    d.optimizer_s_per_param = rd.number(kv.value(), "optimizer_s_per_param", f + ".optimizer_s_per_param");
    if (d.optimizer_s_per_param < 0) rd.fail(f + ".optimizer_s_per_param", "must be >= 0");
    if (kv.value().contains("step_noise")) {
      d.step_noise = rd.number(kv.value(), "step_noise", f + ".step_noise");
      // A spread of a whole step's size per second would be a stall, not noise.
      if (!(d.step_noise >= 0 && d.step_noise < 1)) rd.fail(f + ".step_noise", "must be in [0, 1) (relative spread of one second of compute)");
    }
    struct Share {
      const char* key;
      double DeviceProfile::*member;
      const char* of;
    };
    for (const Share& sh : {Share{"attn_share_fwd", &DeviceProfile::attn_share_fwd, "the attention half's share of a block's time"},
                            Share{"attn_share_bwd", &DeviceProfile::attn_share_bwd, "the attention half's share of a block's time"},
                            Share{"weight_share", &DeviceProfile::weight_share, "the weight products' share of a block's backward"},
                            Share{"tp_whole_share", &DeviceProfile::tp_whole_share,
                                  "the share of a block a tensor-parallel member computes whole"}}) {
      if (!kv.value().contains(sh.key)) continue;
      d.*sh.member = rd.number(kv.value(), sh.key, f + "." + sh.key);
      if (!(d.*sh.member > 0 && d.*sh.member < 1)) rd.fail(f + "." + sh.key, std::string("must be in (0, 1) (") + sh.of + ")");
    }
    if (kv.value().contains("comm_cpu_s_per_byte")) {
      d.comm_cpu_s_per_byte = rd.number(kv.value(), "comm_cpu_s_per_byte", f + ".comm_cpu_s_per_byte");
      // The profiler keeps its figure under 1 us per byte (a link of 1 MB/s made of CPU alone);
      // calibration and speed hints may scale it up from there, not by 100x.
      if (!(d.comm_cpu_s_per_byte >= 0 && d.comm_cpu_s_per_byte < 1e-4))
        rd.fail(f + ".comm_cpu_s_per_byte", "must be in [0, 1e-4) (seconds of compute lost per byte communicated)");
    }
    if (kv.value().contains("burst_speedup")) {
      // Version 11's figure: checked as it was written, then dropped (see kVersion).
      const double b = rd.number(kv.value(), "burst_speedup", f + ".burst_speedup");
      if (!(b >= 1 && b <= 50)) rd.fail(f + ".burst_speedup", "must be in [1, 50] (a short stretch's speed after a wait over the steady speed)");
    }
    if (kv.value().contains("quota_fraction") != kv.value().contains("quota_burst_s"))
      rd.fail(f + (kv.value().contains("quota_fraction") ? ".quota_burst_s" : ".quota_fraction"),
              "is missing (a CPU quota is its fraction of a core and its burst together)");
    if (kv.value().contains("quota_fraction")) {
      d.quota_fraction = rd.number(kv.value(), "quota_fraction", f + ".quota_fraction");
      // The profiler records a quota only below 0.95 of a core and above the kernel's 1 ms per 1 s.
      if (!(d.quota_fraction >= 1e-3 && d.quota_fraction < 1))
        rd.fail(f + ".quota_fraction", "must be in [0.001, 1) (the share of a core a CPU quota leaves the device)");
      d.quota_burst_s = rd.number(kv.value(), "quota_burst_s", f + ".quota_burst_s");
      // The profiler caps it at 1 s (the kernel's longest period).
      if (!(d.quota_burst_s > 0 && d.quota_burst_s <= 1))
        rd.fail(f + ".quota_burst_s", "must be in (0, 1] (seconds a device under a CPU quota computes at full speed after a wait)");
    }
    if (kv.value().contains("tp_shard_shares")) {
      const std::string tf = f + ".tp_shard_shares";
      const json& pts = kv.value()["tp_shard_shares"];
      if (!pts.is_array()) rd.fail(tf, std::string("must be an array of [fraction, share] pairs, got ") + pts.type_name());
      for (size_t i = 0; i < pts.size(); ++i) {
        const std::string pf = tf + "[" + std::to_string(i) + "]";
        if (!pts[i].is_array() || pts[i].size() != 2 || !pts[i][0].is_number() || !pts[i][1].is_number())
          rd.fail(pf, "must be [fraction, share] (two numbers), got " + pts[i].dump());
        const double fr = pts[i][0].get<double>(), share = pts[i][1].get<double>();
        if (!(fr > 0 && fr < 1)) rd.fail(pf, "fraction must be in (0, 1) (the share of the heads a piece holds), got " + pts[i][0].dump());
        if (!(share > 0 && share <= 1))
          rd.fail(pf, "share must be in (0, 1] (the piece's time over the whole block's), got " + pts[i][1].dump());
        if (!d.tp_shard_shares.empty() && !(fr > d.tp_shard_shares.back().first && share >= d.tp_shard_shares.back().second))
          rd.fail(pf, "must come after " + tf + "[" + std::to_string(i - 1) + "] in fraction and not fall in share");
        d.tp_shard_shares.emplace_back(fr, share);
      }
    }
    if (kv.value().contains("codecs")) {
      const json& cs = rd.object(kv.value(), "codecs", f + ".codecs");
      for (const auto& c : cs.items()) {
        const std::string cf = f + ".codecs." + c.key();
        const auto& methods = GradSyncConfig::compression_methods();
        if (std::find(methods.begin(), methods.end(), c.key()) == methods.end() || c.key() == "none")
          rd.fail(cf, "is not a compression method (" + c.key() + ")");
        if (!c.value().is_object()) rd.fail(cf, std::string("must be an object, got ") + c.value().type_name());
        rd.only_keys(c.value(), {"encode_s_per_elem", "decode_s_per_elem"}, cf);
        CodecCost cc;
        cc.encode_s_per_elem = rd.number(c.value(), "encode_s_per_elem", cf + ".encode_s_per_elem");
        cc.decode_s_per_elem = rd.number(c.value(), "decode_s_per_elem", cf + ".decode_s_per_elem");
        if (cc.encode_s_per_elem < 0 || cc.decode_s_per_elem < 0) rd.fail(cf, "costs must be >= 0");
        d.codecs[c.key()] = cc;
      }
    }
    p.devices[kv.key()] = d;
  }

  if (j.contains("links")) {
    const json& ls = j["links"];
    if (!ls.is_array()) rd.fail("links", std::string("must be an array, got ") + ls.type_name());
    for (size_t i = 0; i < ls.size(); ++i) {
      const std::string f = "links[" + std::to_string(i) + "]";
      if (!ls[i].is_object()) rd.fail(f, std::string("must be an object, got ") + ls[i].type_name());
      rd.only_keys(ls[i], {"host_a", "host_b", "bytes_per_s", "latency_s", "allreduce_bytes_per_s"}, f);
      LinkProfile l;
      l.host_a = rd.string(ls[i], "host_a", f + ".host_a");
      l.host_b = rd.string(ls[i], "host_b", f + ".host_b");
      if (l.host_a.empty()) rd.fail(f + ".host_a", "must not be empty");
      if (l.host_b.empty()) rd.fail(f + ".host_b", "must not be empty");
      l.bytes_per_s = rd.number(ls[i], "bytes_per_s", f + ".bytes_per_s");
      if (!(l.bytes_per_s > 0)) rd.fail(f + ".bytes_per_s", "must be > 0, got " + ls[i]["bytes_per_s"].dump());
      l.latency_s = rd.number(ls[i], "latency_s", f + ".latency_s");
      if (l.latency_s < 0) rd.fail(f + ".latency_s", "must be >= 0, got " + ls[i]["latency_s"].dump());
      l.allreduce_bytes_per_s = rd.number(ls[i], "allreduce_bytes_per_s", f + ".allreduce_bytes_per_s", false, 0);
      if (l.allreduce_bytes_per_s < 0) rd.fail(f + ".allreduce_bytes_per_s", "must be >= 0 (0 = not measured)");
      p.links.push_back(l);
    }
  }

  if (j.contains("tp_sums")) {
    const json& ts = j["tp_sums"];
    if (!ts.is_array()) rd.fail("tp_sums", std::string("must be an array, got ") + ts.type_name());
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::string f = "tp_sums[" + std::to_string(i) + "]";
      if (!ts[i].is_object()) rd.fail(f, std::string("must be an object, got ") + ts[i].type_name());
      rd.only_keys(ts[i], {"device_a", "device_b", "bytes", "seconds"}, f);
      TpSumProfile t;
      t.device_a = rd.string(ts[i], "device_a", f + ".device_a");
      t.device_b = rd.string(ts[i], "device_b", f + ".device_b");
      if (t.device_a.empty() || t.device_b.empty() || t.device_a == t.device_b)
        rd.fail(f, "must name two different devices");
      t.bytes = rd.number(ts[i], "bytes", f + ".bytes");
      if (!(t.bytes > 0)) rd.fail(f + ".bytes", "must be > 0, got " + ts[i]["bytes"].dump());
      t.seconds = rd.number(ts[i], "seconds", f + ".seconds");
      // A sum that takes longer than a minute is a stall, not a figure to plan with.
      if (!(t.seconds >= 0 && t.seconds < 60)) rd.fail(f + ".seconds", "must be in [0, 60), got " + ts[i]["seconds"].dump());
      p.tp_sums.push_back(t);
    }
  }

  const json& mem = rd.object(j, "memory", "memory");
  std::set<std::string> mem_keys;
  for (const auto& f : kMemFields) mem_keys.insert(f.key);
  for (const auto& f : kFrozenFields) mem_keys.insert(f.key);
  rd.only_keys(mem, mem_keys, "memory");
  for (const auto& f : kFrozenFields) {
    const double v = rd.number(mem, f.key, std::string("memory.") + f.key, false, 0.0);
    if (v < 0) rd.fail(std::string("memory.") + f.key, "must be >= 0, got " + mem[f.key].dump());
    p.memory.*(f.member) = v;
  }
  if (j.contains("lora")) {
    // The lora section has the schema of a config's; reuse its checks and messages.
    if (!j["lora"].is_object()) rd.fail("lora", std::string("must be an object, got ") + j["lora"].type_name());
    json cfg = {{"model", j["model"]}, {"lora", j["lora"]}};
    p.lora = Config::from_json(cfg, where + " (field 'lora')").lora;
  }
  for (const auto& f : kMemFields) {
    const std::string field = std::string("memory.") + f.key;
    double v = rd.number(mem, f.key, field);
    if (v < 0) rd.fail(field, "must be >= 0, got " + mem[f.key].dump());
    p.memory.*(f.member) = v;
  }
  if (!(p.memory.state_bytes_per_param_byte > 0))
    rd.fail("memory.state_bytes_per_param_byte", "must be > 0 (weights alone are 1 byte per parameter byte)");
  return p;
}

std::string Profile::mismatch(const Config& cfg) const {
  auto diffs = model_differences(model, cfg.model);
  if (!diffs.empty()) return "was measured for another model (" + diffs.front() + ")";
  auto say = [](const LoraConfig& l) {
    if (!l.enabled()) return std::string("training every parameter");
    return "LoRA rank " + std::to_string(l.rank) + " on " + (l.targets.empty() ? "the attention projections" : l.targets) +
           " over a " + l.base_dtype + (l.double_quant ? " (double-quantized)" : "") + " base";
  };
  const LoraConfig &a = lora, &b = cfg.lora;
  const bool same = a.enabled() == b.enabled() &&
                    (!a.enabled() || (a.rank == b.rank && a.target_list(model.arch) == b.target_list(model.arch) &&
                                      a.base_dtype == b.base_dtype && a.double_quant == b.double_quant));
  return same ? "" : "was measured " + say(a) + ", this run is " + say(b);
}

Profile Profile::load(const std::string& path) {
  nlohmann::json j = read_json_file(path);
  return from_json(j, path);
}

void Profile::save(const std::string& path) const { write_file_atomic(path, to_json().dump(2) + "\n"); }

double pooled_step_noise(const std::vector<std::vector<std::pair<double, double>>>& figures) {
  double ss = 0, dof = 0;
  for (const auto& rounds : figures) {
    if (rounds.size() < 2) continue;
    double mean = 0;
    for (const auto& [t, window] : rounds) mean += t;
    mean /= static_cast<double>(rounds.size());
    if (!(mean > 0)) continue;
    for (const auto& [t, window] : rounds) {
      const double z = (t / mean - 1) * std::sqrt(window);
      ss += z * z;
    }
    dof += static_cast<double>(rounds.size() - 1);
  }
  return dof > 0 ? std::min(0.5, std::sqrt(ss / dof)) : 0.0;
}

Line fit_line(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
  const double den = n * sxx - sx * sx;
  Line c;
  c.slope = den > 0 ? (n * sxy - sx * sy) / den : (sx > 0 ? sy / sx : 0);
  c.intercept = (sy - c.slope * sx) / n;
  if (c.slope < 0) {
    c.slope = 0;
    c.intercept = sy / n;
  }
  if (c.intercept < 0) {
    c.intercept = 0;
    c.slope = sxx > 0 ? sxy / sxx : c.slope;
  }
  return c;
}

LinkProfile link_from_pings(const std::vector<double>& x, const std::vector<double>& y) {
  LinkProfile l;
  const size_t n = std::min(x.size(), y.size());
  if (n == 0) return l;
  double bw = 0;
  if (n >= 2 && x[n - 1] > x[n - 2] && y[n - 1] > y[n - 2]) bw = (x[n - 1] - x[n - 2]) / (y[n - 1] - y[n - 2]);
  if (!(bw > 0) && n >= 2) {
    const Line c = fit_line(x, y);
    if (c.slope > 0) bw = 1.0 / c.slope;
  }
  // Under load one slow ping-pong can leave no slope at all; the largest message's own rate is
  // then a measured lower bound, better than no figure.
  if (!(bw > 0) && y[n - 1] > 0) bw = x[n - 1] / y[n - 1];
  double latency = y[0];
  if (bw > 0)
    for (size_t i = 0; i < n; ++i) latency = std::min(latency, y[i] - x[i] / bw);
  l.bytes_per_s = bw;
  l.latency_s = std::max(0.0, latency);
  return l;
}

std::vector<std::string> complete_profile(Profile& p, const ClusterSpec& spec) {
  std::vector<std::string> notes;
  if (p.devices.empty()) throw Error("profile has no measured device type to extrapolate from");
  // Reference: the measured type; others scale by the spec's speed hints (flops when given).
  auto hint = [&](const std::string& type) {
    for (const auto& d : spec.devices)
      if (d.type == type) return d.flops > 0 ? d.flops : d.speed;
    return 1.0;
  };
  const std::string ref = p.devices.begin()->first;
  const DeviceProfile base = p.devices.begin()->second;
  for (const auto& type : spec.types()) {
    if (p.devices.count(type)) continue;
    double s = hint(ref) / hint(type);  // a device twice as fast takes half the time
    auto scale = [&](MicroBatchCost c) {
      c.fixed_s *= s, c.per_sample_s *= s;
      for (int i = 0; i < c.n; ++i) c.t[static_cast<size_t>(i)] *= s;
      return c;
    };
    DeviceProfile d{scale(base.block_fwd), scale(base.block_bwd), scale(base.embed_fwd),
                    scale(base.embed_bwd), scale(base.head_fwd),  scale(base.head_bwd), base.optimizer_s_per_param * s, base.step_noise, {}};
    for (const auto& [m, c] : base.codecs) d.codecs[m] = {c.encode_s_per_elem * s, c.decode_s_per_elem * s};
    d.attn_share_fwd = base.attn_share_fwd, d.attn_share_bwd = base.attn_share_bwd;  // ratios: speed cancels
    d.weight_share = base.weight_share;
    d.tp_whole_share = base.tp_whole_share;
    d.tp_shard_shares = base.tp_shard_shares;
    d.comm_cpu_s_per_byte = base.comm_cpu_s_per_byte * s;  // CPU seconds: a slower device loses more per byte
    p.devices[type] = d;
    notes.push_back("device type " + type + ": estimated from " + ref + " scaled by speed hints (" + std::to_string(hint(type)) +
                    " vs " + std::to_string(hint(ref)) + ")");
  }
  auto hosts = spec.hosts();
  for (size_t i = 0; i < hosts.size(); ++i)
    for (size_t j = i + 1; j < hosts.size(); ++j) {
      bool have = false;
      for (const auto& l : p.links)
        if ((l.host_a == hosts[i] && l.host_b == hosts[j]) || (l.host_a == hosts[j] && l.host_b == hosts[i])) have = true;
      if (have) continue;
      Link l = spec.link(hosts[i], hosts[j]);
      p.links.push_back({hosts[i], hosts[j], l.bytes_per_s(), l.latency_s(), 0});
    }
  return notes;
}

}  // namespace alloy::plan
