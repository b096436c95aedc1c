#include "alloy/core/plan_convert.h"

#include "alloy/core/megatron_args.h"

#include <charconv>
#include <climits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/core/text.h"

namespace alloy {
namespace {

const char* const kSynerFuse = "SynerFuse arguments";

std::string str(int64_t v) { return std::to_string(v); }

[[noreturn]] void sf_fail(const std::string& msg) { throw InputError(kSynerFuse, msg); }

// Every number here is typed by a user, so a sum or product that wraps would turn a typo into a
// plausible-looking plan; refuse instead.
int64_t add(int64_t a, int64_t b, const std::string& what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) sf_fail(what + " overflows a 64-bit integer");
  return r;
}
int64_t mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) sf_fail(what + " overflows a 64-bit integer");
  return r;
}

int64_t parse_int(const std::string& flag, const std::string& text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc::result_out_of_range) sf_fail(flag + ": '" + text + "' is out of range");
  if (ec != std::errc() || ptr != end || text.empty()) sf_fail(flag + ": expected an integer, got '" + text + "'");
  return v;
}

bool is_flag(const std::string& tok) { return tok.size() > 2 && tok.compare(0, 2, "--") == 0; }

// One `n0 v0 n1 v1 ...` list, checked and expanded to one value per data-parallel index.
struct GroupList {
  std::vector<std::pair<int64_t, int64_t>> groups;  // (n_i, value_i)
  int64_t total = 0;                                // sum n_i
  std::string total_text;                           // "1 + 1 = 2"
};

GroupList parse_groups(const std::vector<int64_t>& v, const std::string& flag, const std::string& value_name) {
  GroupList g;
  if (v.size() % 2 != 0)
    sf_fail(flag + ": " + str(static_cast<int64_t>(v.size())) + (v.size() == 1 ? " value" : " values") +
            ", but it takes pairs n0 " + value_name + "0 n1 " + value_name + "1 ...");
  std::vector<int64_t> ns;
  for (size_t i = 0; i < v.size(); i += 2) {
    std::string k = str(static_cast<int64_t>(i / 2));
    if (v[i] < 1) sf_fail(flag + ": n" + k + " = " + str(v[i]) + ", but a group needs at least 1 data-parallel rank");
    if (v[i + 1] < 1) sf_fail(flag + ": " + value_name + k + " = " + str(v[i + 1]) + ", but it must be >= 1");
    g.groups.emplace_back(v[i], v[i + 1]);
    g.total = add(g.total, v[i], flag + " group sizes");
    ns.push_back(v[i]);
  }
  g.total_text = join(ns, " + ") + " = " + str(g.total);
  return g;
}

std::vector<int64_t> expand_groups(const GroupList& g, const std::string& flag, int64_t dp,
                                   const std::string& dp_text) {
  if (g.total != dp)
    sf_fail(flag + ": the group sizes n_i sum to " + g.total_text + ", but the data-parallel size is " + dp_text);
  std::vector<int64_t> out;
  for (const auto& [n, value] : g.groups) out.insert(out.end(), static_cast<size_t>(n), value);
  return out;
}

// "n x a x b" terms over runs of data-parallel indices with equal values, so the arithmetic in a
// message reads like the user's own group lists even when the two lists group differently.
std::string runs_text(const std::vector<int64_t>& a, const std::vector<int64_t>* b) {
  std::string out;
  size_t i = 0;
  while (i < a.size()) {
    size_t j = i;
    while (j < a.size() && a[j] == a[i] && (!b || (*b)[j] == (*b)[i])) ++j;
    out +=
        (out.empty() ? "" : " + ") + str(static_cast<int64_t>(j - i)) + "x" + str(a[i]) + (b ? "x" + str((*b)[i]) : "");
    i = j;
  }
  return out;
}

std::vector<int64_t> stage_layers(const SynerFuseArgs& a) {
  const int64_t pp = a.pipeline_model_parallel_size, layers = a.num_layers;
  const auto& v = a.hetero_pipeline_stages;
  if (v.empty()) {
    if (layers % pp != 0)
      sf_fail("--num-layers " + str(layers) + " is not divisible by --pipeline-model-parallel-size " + str(pp) +
              "; without --hetero-pipeline-stages every stage holds the same number of layers");
    return std::vector<int64_t>(static_cast<size_t>(pp), layers / pp);
  }
  const std::string flag = "--hetero-pipeline-stages " + join(v, " ");
  std::vector<int64_t> out, ns;
  int64_t n_sum = 0, layer_sum = 0;
  size_t i = 0;
  for (int64_t group = 0; i < v.size(); ++group) {
    const std::string k = str(group);
    const int64_t n = v[i];
    if (n < 1) sf_fail(flag + ": n" + k + " = " + str(n) + ", but a group needs at least 1 stage");
    const size_t follow = v.size() - i - 1;
    if (static_cast<uint64_t>(n) > follow)
      sf_fail(flag + ": n" + k + " = " + str(n) + " stages, but only " + str(static_cast<int64_t>(follow)) +
              (follow == 1 ? " value follows it" : " values follow it"));
    for (int64_t s = 0; s < n; ++s) {
      const int64_t l = v[i + 1 + static_cast<size_t>(s)];
      if (l < 1)
        sf_fail(flag + ": layers_" + k + "_" + str(s) + " = " + str(l) + ", but every stage needs at least 1 layer");
      out.push_back(l);
      layer_sum = add(layer_sum, l, "the layer counts");
    }
    ns.push_back(n);
    n_sum = add(n_sum, n, "the stage counts");
    i += 1 + static_cast<size_t>(n);
  }
  if (n_sum != pp)
    sf_fail(flag + ": the stage counts n_i sum to " + join(ns, " + ") + " = " + str(n_sum) +
            ", but --pipeline-model-parallel-size is " + str(pp));
  if (layer_sum != layers)
    sf_fail(flag + ": the layer counts sum to " + join(out, " + ") + " = " + str(layer_sum) + ", but --num-layers is " +
            str(layers));
  return out;
}

}  // namespace

SynerFuseArgs parse_synerfuse_args(const std::vector<std::string>& argv, std::vector<std::string>* ignored) {
  SynerFuseArgs a;
  const std::map<std::string, int64_t*> ints = {
      {"--num-layers", &a.num_layers},
      {"--pipeline-model-parallel-size", &a.pipeline_model_parallel_size},
      {"--tensor-model-parallel-size", &a.tensor_model_parallel_size},
      {"--global-batch-size", &a.global_batch_size},
      {"--micro-batch-size", &a.micro_batch_size},
      {"--data-parallel-size", &a.data_parallel_size},
      {"--world-size", &a.world_size},
      {"--num-layers-per-virtual-pipeline-stage", &a.layers_per_virtual_stage},
  };
  const std::map<std::string, std::vector<int64_t>*> lists = {
      {"--hetero-pipeline-stages", &a.hetero_pipeline_stages},
      {"--micro-batch-size-per-dp", &a.micro_batch_size_per_dp},
      {"--num-micro-batches-per-dp", &a.num_micro_batches_per_dp},
      {"--tp-split", &a.tp_split},
  };
  const std::set<std::string> switches = {"--use-tp-pp-dp-mapping"};
  // Switches of a SynerFuse run.sh that `alloy train` reads itself (cli/cmd_train.cpp) rather than
  // through the Megatron table: the plan ignores them but for --sequence-parallel, which its
  // tensor-parallel stages record.
  const std::set<std::string> train_switches = {"--bf16", "--fp16", "--grad-reduce-in-bf16", "--use-distributed-optimizer",
                                                "--sequence-parallel"};

  size_t i = 0;
  while (i < argv.size()) {
    const std::string& tok = argv[i++];
    if (!is_flag(tok)) sf_fail("unexpected value '" + tok + "': values must follow a --flag");
    std::string name = tok;
    std::optional<std::string> inline_value;
    if (auto eq = tok.find('='); eq != std::string::npos) {
      name = tok.substr(0, eq);
      inline_value = tok.substr(eq + 1);
    }
    if (auto it = ints.find(name); it != ints.end()) {
      if (inline_value) {
        *it->second = parse_int(name, *inline_value);
      } else {
        if (i >= argv.size() || is_flag(argv[i])) sf_fail(name + " needs a value");
        *it->second = parse_int(name, argv[i++]);
      }
    } else if (auto lt = lists.find(name); lt != lists.end()) {
      std::vector<int64_t> values;
      if (inline_value) values.push_back(parse_int(name, *inline_value));
      while (i < argv.size() && !is_flag(argv[i])) values.push_back(parse_int(name, argv[i++]));
      if (values.empty()) sf_fail(name + " needs at least one value");
      *lt->second = std::move(values);
    } else if (switches.count(name)) {
      if (inline_value) sf_fail(name + " takes no value, got '" + *inline_value + "'");
      a.tp_pp_dp_mapping = true;
    } else if (train_switches.count(name)) {
      if (inline_value) sf_fail(name + " takes no value, got '" + *inline_value + "'");
      if (name == "--sequence-parallel") a.sequence_parallel = true;
      else if (ignored) ignored->push_back(name);
    } else if (const int arity = megatron_flag_arity(name); arity >= 0) {
      // run.sh's model and training flags: a plan does not depend on them, but a pasted argument
      // list holds them. The heads do matter to a tensor-parallel split.
      std::string value = inline_value.value_or("");
      if (arity == 1 && !inline_value) {
        if (i >= argv.size() || is_flag(argv[i])) sf_fail(name + " needs a value");
        value = argv[i++];
      }
      if (name == "--num-attention-heads") a.num_attention_heads = parse_int(name, value);
      else if (ignored) ignored->push_back(name);
    } else {
      std::string known;
      for (const auto& [k, _] : ints) known += " " + k;
      for (const auto& [k, _] : lists) known += " " + k;
      for (const auto& k : switches) known += " " + k;
      sf_fail("unknown flag '" + name + "'; Alloy reads the parallelism flags" + known +
              " and skips Megatron's model and training flags (`alloy train --help` lists them)");
    }
  }
  return a;
}

namespace {

// Megatron's --num-layers-per-virtual-pipeline-stage N: each pipeline's L layers in L / N chunks of
// N, chunk c on the ranks of stage c mod pp, V = L / (pp N) chunks a rank, interleaved 1F1B.
void interleave_synerfuse(const SynerFuseArgs& a, Plan* plan) {
  const int64_t n = a.layers_per_virtual_stage, pp = a.pipeline_model_parallel_size, L = a.num_layers;
  const std::string flag = "--num-layers-per-virtual-pipeline-stage " + str(n);
  if (n < 1) sf_fail(flag + ": must be >= 1");
  if (pp < 2) sf_fail(flag + ": interleaving needs --pipeline-model-parallel-size 2 or more, got " + str(pp));
  if (!a.hetero_pipeline_stages.empty())
    sf_fail(flag + ": with --hetero-pipeline-stages the stages differ, and Megatron's virtual stages are equal: give one or the other");
  if (L % (pp * n) != 0)
    sf_fail(flag + ": --num-layers " + str(L) + " is not a multiple of --pipeline-model-parallel-size " + str(pp) + " x " + str(n));
  const int64_t V = L / (pp * n);
  if (V < 2) sf_fail(flag + ": " + str(L) + " layers on " + str(pp) + " stages make one chunk a stage; leave the flag out");
  plan->schedule = "interleaved-1f1b";
  for (size_t d = 0; d < plan->pipelines.size(); ++d) {
    PipelinePlan& pl = plan->pipelines[d];
    if (pl.num_micro_batches > pp && pl.num_micro_batches % pp != 0)
      sf_fail(flag + ": data-parallel rank " + str(static_cast<int64_t>(d)) + " runs " + str(pl.num_micro_batches) +
              " micro-batches, not a multiple of --pipeline-model-parallel-size " + str(pp) + " (Megatron's interleaved schedule asks the same)");
    const std::vector<StagePlan> ranks = pl.stages;
    pl.stages.clear();
    for (int64_t c = 0; c < pp * V; ++c) {
      StagePlan st = ranks[static_cast<size_t>(c % pp)];
      st.layer_begin = c * n, st.layer_end = (c + 1) * n;
      pl.stages.push_back(st);
    }
    pl.virtual_stages = V;
  }
}

}  // namespace

Plan plan_from_synerfuse(const SynerFuseArgs& a) {
  if (a.num_layers < 1) sf_fail("--num-layers must be >= 1, got " + str(a.num_layers));
  const int64_t tp = a.tensor_model_parallel_size;
  if (tp < 1) sf_fail("--tensor-model-parallel-size must be >= 1, got " + str(tp));
  if (!a.tp_split.empty() && static_cast<int64_t>(a.tp_split.size()) != tp)
    sf_fail("--tp-split " + join(a.tp_split, " ") + " gives " + str(static_cast<int64_t>(a.tp_split.size())) +
            " ranks' heads, but --tensor-model-parallel-size is " + str(tp));
  const int64_t pp = a.pipeline_model_parallel_size;
  if (pp < 1) sf_fail("--pipeline-model-parallel-size must be >= 1, got " + str(pp));
  if (a.global_batch_size < 1) sf_fail("--global-batch-size must be >= 1, got " + str(a.global_batch_size));
  if (a.data_parallel_size < 0)
    sf_fail("--data-parallel-size must be >= 1 (or 0 to derive it), got " + str(a.data_parallel_size));
  if (a.world_size < 0) sf_fail("world size must be >= 1 (or 0 to derive it), got " + str(a.world_size));

  const std::string mbs_flag = "--micro-batch-size-per-dp " + join(a.micro_batch_size_per_dp, " ");
  const std::string nmb_flag = "--num-micro-batches-per-dp " + join(a.num_micro_batches_per_dp, " ");
  std::optional<GroupList> mbs_groups, nmb_groups;
  if (!a.micro_batch_size_per_dp.empty()) mbs_groups = parse_groups(a.micro_batch_size_per_dp, mbs_flag, "mbs");
  if (!a.num_micro_batches_per_dp.empty()) nmb_groups = parse_groups(a.num_micro_batches_per_dp, nmb_flag, "nmb");

  // The data-parallel size: stated, implied by the world size, or (SynerFuse's usual case, where
  // torchrun fixes the world) implied by the per-dp group lists.
  int64_t dp = a.data_parallel_size;
  std::string dp_text = str(dp) + " (--data-parallel-size)";
  if (dp == 0) {
    if (a.world_size > 0) {
      if (a.world_size % (pp * tp) != 0)
        sf_fail("world size " + str(a.world_size) + " is not a multiple of --pipeline-model-parallel-size " + str(pp) +
                " x --tensor-model-parallel-size " + str(tp));
      dp = a.world_size / (pp * tp);
      dp_text = str(dp) + " (world size " + str(a.world_size) + " / --pipeline-model-parallel-size " + str(pp) +
                (tp > 1 ? " / --tensor-model-parallel-size " + str(tp) : "") + ")";
    } else if (mbs_groups) {
      dp = mbs_groups->total;
      dp_text = str(dp) + " (the group sizes of --micro-batch-size-per-dp)";
    } else if (nmb_groups) {
      dp = nmb_groups->total;
      dp_text = str(dp) + " (the group sizes of --num-micro-batches-per-dp)";
    } else {
      dp = 1;
      dp_text = "1";
    }
  }
  const int64_t world = mul(mul(pp, dp, "--pipeline-model-parallel-size x data-parallel size"), tp,
                            "x --tensor-model-parallel-size");
  if (a.world_size > 0 && a.world_size != world)
    sf_fail("world size " + str(a.world_size) + " != --pipeline-model-parallel-size " + str(pp) +
            " x data-parallel size " + str(dp) + " x --tensor-model-parallel-size " + str(tp) + " = " + str(world));
  // The plan holds a pipeline per data-parallel index and a stage per rank: past this many ranks a
  // typo (--data-parallel-size 2000000000) would exhaust memory before any check could name it.
  constexpr int64_t kMaxRanks = int64_t{1} << 16;
  if (world > kMaxRanks)
    sf_fail(str(world) + " ranks (" + str(pp) + " x " + str(dp) + ") is more than Alloy plans for (" + str(kMaxRanks) + ")");

  const std::vector<int64_t> layers = stage_layers(a);

  std::vector<int64_t> mbs;
  if (mbs_groups) {
    mbs = expand_groups(*mbs_groups, mbs_flag, dp, dp_text);
  } else {
    if (a.micro_batch_size < 1)
      sf_fail("--micro-batch-size must be >= 1, got " + str(a.micro_batch_size) +
              " (or give --micro-batch-size-per-dp)");
    mbs.assign(static_cast<size_t>(dp), a.micro_batch_size);
  }

  std::vector<int64_t> nmb;
  if (nmb_groups) {
    nmb = expand_groups(*nmb_groups, nmb_flag, dp, dp_text);
    int64_t total = 0;
    for (size_t d = 0; d < mbs.size(); ++d)
      total = add(total, mul(mbs[d], nmb[d], "micro-batch size x count"), "the global batch");
    if (total != a.global_batch_size)
      sf_fail("--global-batch-size " + str(a.global_batch_size) +
              " != sum of n_i x mbs_i x nmb_i = " + runs_text(mbs, &nmb) + " = " + str(total));
  } else {
    int64_t per_step = 0;
    for (int64_t m : mbs) per_step = add(per_step, m, "the sum of micro-batch sizes");
    const std::string per_step_text = mbs_groups
                                          ? "sum of n_i x mbs_i = " + runs_text(mbs, nullptr) + " = " + str(per_step)
                                          : "data-parallel size " + str(dp) + " x --micro-batch-size " +
                                                str(a.micro_batch_size) + " = " + str(per_step);
    if (a.global_batch_size % per_step != 0)
      sf_fail("--global-batch-size " + str(a.global_batch_size) + " is not a multiple of the " + per_step_text +
              "; every data-parallel rank runs the same number of micro-batches unless --num-micro-batches-per-dp says "
              "otherwise");
    nmb.assign(static_cast<size_t>(dp), a.global_batch_size / per_step);
  }

  // SynerFuse's heterogeneous data parallelism works only in the tp-pp-dp order (see the header).
  const bool pipeline_major = a.tp_pp_dp_mapping || mbs_groups || nmb_groups;
  Plan plan;
  plan.global_batch = a.global_batch_size;
  plan.schedule = a.schedule;
  for (int64_t d = 0; d < dp; ++d) {
    PipelinePlan pl;
    pl.micro_batch_size = mbs[static_cast<size_t>(d)];
    pl.num_micro_batches = nmb[static_cast<size_t>(d)];
    int64_t begin = 0;
    for (int64_t s = 0; s < pp; ++s) {
      const int64_t end = begin + layers[static_cast<size_t>(s)];
      StagePlan st;
      const int64_t group = pipeline_major ? d * pp + s : s * dp + d;
      for (int64_t t = 0; t < tp; ++t) st.ranks.push_back(static_cast<int>(group * tp + t));
      st.layer_begin = begin, st.layer_end = end;
      if (tp > 1) st.tp_split = a.tp_split;
      pl.stages.push_back(std::move(st));
      begin = end;
    }
    plan.pipelines.push_back(std::move(pl));
  }
  if (a.layers_per_virtual_stage != 0) interleave_synerfuse(a, &plan);
  if (a.sequence_parallel) plan.set_sequence_parallel();
  ModelConfig model;
  model.layers = a.num_layers;
  // The heads' split is checked against the model where it is known (the trainer checks it again
  // with the whole config); otherwise against what the flags imply.
  int64_t heads_given = 0;
  for (int64_t h : a.tp_split) heads_given += h;
  model.heads = a.num_attention_heads > 0 ? a.num_attention_heads : heads_given > 0 ? heads_given : tp;
  model.kv_heads = 0;
  model.hidden = model.heads * 64;
  model.ffn = 0;
  plan.validate(model, kSynerFuse);
  return plan;
}

namespace {

// Shard ids and worker ids are compared by value so that 1 and "1" name the same worker.
std::optional<std::string> id_key(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return v.dump();
  return std::nullopt;
}

[[noreturn]] void hc_fail(const std::string& where, const std::string& path, const std::string& msg) {
  throw InputError(where, path.empty() ? msg : path + ": " + msg);
}

}  // namespace

Plan plan_from_hetero_config(const nlohmann::json& j, int64_t num_layers, int64_t global_batch, int64_t micro_batch,
                             const std::string& where) {
  if (micro_batch < 1) hc_fail(where, "", "micro-batch size must be >= 1, got " + str(micro_batch));
  if (global_batch < 1) hc_fail(where, "", "global batch must be >= 1, got " + str(global_batch));
  if (global_batch % micro_batch != 0)
    hc_fail(where, "",
            "global batch " + str(global_batch) + " is not a multiple of micro-batch size " + str(micro_batch) +
                "; a shard_plan is one pipeline running global / micro-batch micro-batches");
  if (!j.is_object())
    hc_fail(where, "", "expected a JSON object with a \"shard_plan\" array, got " + std::string(j.type_name()));

  auto hostname_of = [&](const nlohmann::json& obj, const std::string& path) {
    if (!obj.contains("hostname")) return std::string();
    if (!obj["hostname"].is_string())
      hc_fail(where, path + ".hostname", "must be a string, got " + obj["hostname"].dump());
    return obj["hostname"].get<std::string>();
  };

  std::string coordinator_host;
  if (j.contains("coordinator")) {
    if (!j["coordinator"].is_object())
      hc_fail(where, "coordinator", "must be an object, got " + j["coordinator"].dump());
    coordinator_host = hostname_of(j["coordinator"], "coordinator");
  }

  struct Worker {
    std::string hostname;
    size_t index = 0;
  };
  std::map<std::string, Worker> workers;
  std::vector<std::string> worker_ids;  // in file order, for messages
  if (j.contains("workers")) {
    const auto& ws = j["workers"];
    if (!ws.is_array()) hc_fail(where, "workers", "must be an array, got " + ws.dump());
    for (size_t w = 0; w < ws.size(); ++w) {
      const std::string path = "workers[" + std::to_string(w) + "]";
      if (!ws[w].is_object()) hc_fail(where, path, "must be an object, got " + ws[w].dump());
      if (!ws[w].contains("id")) hc_fail(where, path + ".id", "is missing");
      auto id = id_key(ws[w]["id"]);
      if (!id) hc_fail(where, path + ".id", "must be an integer or a string, got " + ws[w]["id"].dump());
      if (auto it = workers.find(*id); it != workers.end())
        hc_fail(where, path + ".id",
                ws[w]["id"].dump() + " is also the id of workers[" + std::to_string(it->second.index) + "]");
      workers[*id] = {hostname_of(ws[w], path), w};
      worker_ids.push_back(ws[w]["id"].dump());
    }
  }

  if (!j.contains("shard_plan")) hc_fail(where, "shard_plan", "is missing; HeteroShard needs an explicit shard_plan");
  const auto& sp = j["shard_plan"];
  if (!sp.is_array() || sp.empty()) hc_fail(where, "shard_plan", "must be a non-empty array, got " + sp.dump());

  PipelinePlan pl;
  pl.micro_batch_size = micro_batch;
  pl.num_micro_batches = global_batch / micro_batch;
  std::map<std::string, size_t> used;  // worker id -> shard_plan index holding it
  std::vector<size_t> last;            // indices with is_last: true
  int64_t expect = 0;
  for (size_t k = 0; k < sp.size(); ++k) {
    const std::string path = "shard_plan[" + std::to_string(k) + "]";
    const auto& e = sp[k];
    if (!e.is_object()) hc_fail(where, path, "must be an object {\"id\", \"start\", \"end\"}, got " + e.dump());

    if (!e.contains("id")) hc_fail(where, path + ".id", "is missing");
    auto id = id_key(e["id"]);
    if (!id) hc_fail(where, path + ".id", "must be \"local\" or a worker id, got " + e["id"].dump());
    std::string device;
    if (k == 0) {
      if (*id != "local")
        hc_fail(where, path + ".id", e["id"].dump() + ", but the first stage must be the coordinator's, \"local\"");
      device = coordinator_host;
    } else {
      if (*id == "local")
        hc_fail(where, path + ".id", "\"local\" again; the coordinator holds only the first stage, shard_plan[0]");
      auto it = workers.find(*id);
      if (it == workers.end()) {
        std::string known;
        for (const auto& w : worker_ids) known += (known.empty() ? "" : ", ") + w;
        hc_fail(where, path + ".id",
                e["id"].dump() + " matches no worker in \"workers\"" +
                    (known.empty() ? std::string(" (the list is empty or missing)") : " (ids: " + known + ")"));
      }
      if (auto u = used.find(*id); u != used.end())
        hc_fail(where, path + ".id",
                "worker " + e["id"].dump() + " already holds shard_plan[" + std::to_string(u->second) +
                    "]; HeteroShard runs one worker process per stage");
      used[*id] = k;
      device = it->second.hostname;
    }

    int64_t range[2] = {0, 0};
    const char* names[2] = {"start", "end"};
    for (int b = 0; b < 2; ++b) {
      if (!e.contains(names[b])) hc_fail(where, path + "." + names[b], "is missing");
      const auto& v = e[names[b]];
      if (!v.is_number_integer())
        hc_fail(where, path + "." + names[b], "must be an integer block index, got " + v.dump());
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        hc_fail(where, path + "." + names[b], v.dump() + " is out of range");
      range[b] = v.get<int64_t>();
    }
    const int64_t start = range[0], end = range[1];
    if (k == 0 && start != 0)
      hc_fail(where, path + ".start", str(start) + ", but the first stage must start at block 0");
    if (start > expect)
      hc_fail(where, path + ".start",
              str(start) + ", but the previous stage ended at " + str(expect) + " (gap: blocks [" + str(expect) + ", " +
                  str(start) + ") belong to no stage)");
    if (start < expect)
      hc_fail(where, path + ".start", str(start) + ", but the previous stage ended at " + str(expect) + " (overlap)");
    if (end <= start)
      hc_fail(where, path + ".end", str(end) + ", but start is " + str(start) + ": the range [start, end) is empty");
    expect = end;

    if (e.contains("is_last")) {
      if (!e["is_last"].is_boolean())
        hc_fail(where, path + ".is_last", "must be true or false, got " + e["is_last"].dump());
      if (e["is_last"].get<bool>()) last.push_back(k);
    }
    pl.stages.push_back({{static_cast<int>(k)}, start, end, device});
  }

  const std::string final_path = "shard_plan[" + std::to_string(sp.size() - 1) + "]";
  if (last.empty())
    hc_fail(where, "shard_plan", "no stage has \"is_last\": true; the final entry, " + final_path + ", must");
  if (last.size() > 1) {
    std::string which;
    for (size_t k : last) which += (which.empty() ? "" : ", ") + ("shard_plan[" + std::to_string(k) + "]");
    hc_fail(where, "shard_plan",
            std::to_string(last.size()) + " stages have \"is_last\": true (" + which +
                "); exactly one, the final entry, may");
  }
  if (last[0] != sp.size() - 1)
    hc_fail(where, "shard_plan[" + std::to_string(last[0]) + "].is_last",
            "true, but it is not the final entry; the final entry is " + final_path);
  if (num_layers > 0 && expect != num_layers)
    hc_fail(where, final_path + ".end",
            str(expect) + ", but the model has " + str(num_layers) + " blocks; the stages must cover [0, " +
                str(num_layers) + ")");

  Plan plan;
  plan.global_batch = global_batch;
  plan.pipelines.push_back(std::move(pl));
  ModelConfig model;
  model.layers = num_layers > 0 ? num_layers : expect;
  plan.validate(model, where);
  return plan;
}

Plan plan_from_hetero_config_file(const std::string& path, int64_t num_layers, int64_t global_batch,
                                  int64_t micro_batch) {
  nlohmann::json j = read_json_file(path);
  return plan_from_hetero_config(j, num_layers, global_batch, micro_batch, path);
}

HeteroShardRun hetero_run_settings(const nlohmann::json& j, const std::string& where) {
  HeteroShardRun r;
  if (!j.is_object()) hc_fail(where, "", "must be a JSON object");
  auto string_of = [&](const nlohmann::json& obj, const char* key, const std::string& path) -> std::string {
    if (!obj.contains(key) || obj[key].is_null()) return "";
    if (!obj[key].is_string()) hc_fail(where, path, "must be a string, got " + obj[key].dump());
    return obj[key].get<std::string>();
  };
  if (j.contains("training")) {
    const auto& t = j["training"];
    if (!t.is_object()) hc_fail(where, "training", "must be an object, got " + t.dump());
    if (t.contains("visualize")) {
      if (!t["visualize"].is_boolean()) hc_fail(where, "training.visualize", "must be true or false, got " + t["visualize"].dump());
      r.visualize = t["visualize"].get<bool>();
    }
    std::string fmt = string_of(t, "visualization_format", "training.visualization_format");
    if (!fmt.empty()) {
      if (fmt != "png" && fmt != "svg" && fmt != "pdf" && fmt != "mmd")
        hc_fail(where, "training.visualization_format", "'" + fmt + "' is not one of png, svg, pdf, mmd");
      r.visualization_format = fmt;
    }
    r.log_level = string_of(t, "log_level", "training.log_level");
    if (!r.log_level.empty()) {
      try {
        parse_log_level(r.log_level);
      } catch (const std::invalid_argument&) {
        hc_fail(where, "training.log_level", "'" + r.log_level + "' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL");
      }
    }
  }
  r.checkpoint_dir = string_of(j, "checkpoint_dir", "checkpoint_dir");
  if (j.contains("resume_step") && !j["resume_step"].is_null()) {
    const auto& v = j["resume_step"];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      hc_fail(where, "resume_step", "must be a step number >= 0, got " + v.dump());
    r.resume_step = v.get<int64_t>();
  }
  auto device_of = [&](const nlohmann::json& obj, const std::string& path) {
    std::string d = string_of(obj, "device", path + ".device");
    const bool cuda_n = d.rfind("cuda:", 0) == 0 && d.size() > 5 && d.find_first_not_of("0123456789", 5) == std::string::npos;
    if (!d.empty() && d != "auto" && d != "cuda" && d != "mps" && d != "cpu" && !cuda_n)
      hc_fail(where, path + ".device", "'" + d + "' is not one of auto, cuda, cuda:N, mps, cpu");
    return d;
  };
  // Stage k runs on the coordinator (k = 0) or on the worker its shard_plan entry names.
  auto addresses_of = [&](const nlohmann::json& obj, const std::string& path) {
    std::vector<std::string> a;
    for (const char* key : {"ip", "hostname"})
      if (std::string v = string_of(obj, key, path + "." + key); !v.empty()) a.push_back(v);
    return a;
  };
  std::map<std::string, std::string> worker_device;
  std::map<std::string, std::vector<std::string>> worker_addresses;
  if (j.contains("workers") && j["workers"].is_array())
    for (size_t w = 0; w < j["workers"].size(); ++w) {
      const auto& wk = j["workers"][w];
      if (!wk.is_object() || !wk.contains("id")) continue;  // plan_from_hetero_config names these
      const std::string path = "workers[" + std::to_string(w) + "]";
      if (auto id = id_key(wk["id"])) {
        worker_device[*id] = device_of(wk, path);
        worker_addresses[*id] = addresses_of(wk, path);
      }
    }
  const bool has_coordinator = j.contains("coordinator") && j["coordinator"].is_object();
  const std::string coordinator = has_coordinator ? device_of(j["coordinator"], "coordinator") : "";
  const std::vector<std::string> coordinator_addresses = has_coordinator ? addresses_of(j["coordinator"], "coordinator")
                                                                         : std::vector<std::string>{};
  if (!coordinator_addresses.empty()) r.coordinator_address = coordinator_addresses.front();
  if (j.contains("shard_plan") && j["shard_plan"].is_array())
    for (const auto& e : j["shard_plan"]) {
      auto id = e.is_object() && e.contains("id") ? id_key(e["id"]) : std::nullopt;
      const bool local = !id || *id == "local";
      r.stage_devices.push_back(local ? coordinator : worker_device[*id]);
      r.stage_addresses.push_back(local ? coordinator_addresses : worker_addresses[*id]);
    }
  if (j.contains("lora") && !j["lora"].is_null()) {
    const auto& l = j["lora"];
    if (!l.is_object()) hc_fail(where, "lora", "must be an object {r, lora_alpha, lora_dropout, target_modules, ...}");
    auto number = [&](const char* key, const std::string& config_key, bool integer) {
      if (!l.contains(key)) return;
      const auto& v = l[key];
      if (integer ? !v.is_number_integer() : !v.is_number()) hc_fail(where, std::string("lora.") + key, "must be a number, got " + v.dump());
      r.config_overrides.push_back(config_key + "=" + (integer ? std::to_string(v.get<int64_t>()) : v.dump()));
    };
    number("r", "lora.rank", true);
    number("lora_alpha", "lora.alpha", false);
    number("lora_dropout", "lora.dropout", false);
    if (l.contains("target_modules")) {
      const auto& t = l["target_modules"];
      std::string joined;
      if (t.is_string()) joined = t.get<std::string>();
      else if (t.is_array())
        for (const auto& x : t) {
          if (!x.is_string()) hc_fail(where, "lora.target_modules", "must list module names, got " + x.dump());
          joined += (joined.empty() ? "" : ",") + x.get<std::string>();
        }
      else hc_fail(where, "lora.target_modules", "must be a name or a list of names, got " + t.dump());
      r.config_overrides.push_back("lora.targets=" + joined);
    }
    auto flag = [&](const char* key) {
      if (!l.contains(key)) return false;
      if (!l[key].is_boolean()) hc_fail(where, std::string("lora.") + key, "must be true or false, got " + l[key].dump());
      return l[key].get<bool>();
    };
    if (flag("use_rslora")) r.config_overrides.push_back("lora.rslora=true");
    const bool four = flag("load_in_4bit"), eight = flag("load_in_8bit");
    if (four && eight) hc_fail(where, "lora.load_in_8bit", "and load_in_4bit are both true; choose one");
    if (four) r.config_overrides.push_back("lora.base_dtype=nf4");
    if (eight) r.config_overrides.push_back("lora.base_dtype=int8");
    if (flag("bnb_4bit_use_double_quant")) r.config_overrides.push_back("lora.double_quant=true");
  }
  if (!r.checkpoint_dir.empty()) r.config_overrides.push_back("output.dir=" + r.checkpoint_dir);
  return r;
}

HeteroShardRun hetero_run_settings_file(const std::string& path) { return hetero_run_settings(read_json_file(path), path); }

int64_t default_micro_batch(const Config& cfg, const SynerFuseArgs& a, int64_t world_size) {
  if (cfg.train.micro_batch > 0) return cfg.train.micro_batch;
  const int64_t pp = std::max<int64_t>(1, a.pipeline_model_parallel_size);
  int64_t dp = a.data_parallel_size;
  if (dp <= 0 && world_size > 0) dp = std::max<int64_t>(1, world_size / (pp * std::max<int64_t>(1, a.tensor_model_parallel_size)));
  if (dp <= 0) dp = 1;
  const int64_t gb = a.global_batch_size > 0 ? a.global_batch_size : cfg.train.global_batch;
  int64_t per_replica = std::max<int64_t>(1, gb / dp);
  if (pp > 1 && per_replica % pp == 0) return per_replica / pp;
  return per_replica;
}

}  // namespace alloy
