#include "alloy/train/sweep.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/json_file.h"
#include "alloy/core/log.h"
#include "alloy/plan/cluster.h"
#include "alloy/plan/planner.h"
#include "alloy/plan/cost_model.h"
#include "alloy/plan/profile.h"

namespace alloy::train {

namespace {

std::string fmt(double v, int digits = 3) {
  std::ostringstream s;
  s.precision(digits);
  s << v;
  return s.str();
}

// The numbers of a layout's "NAME:A,B,..." suffix; the error reads "<LABEL>'x' is not <WHAT>".
std::vector<int64_t> layout_numbers(const std::string& list, const std::string& where, const std::string& label,
                                    const std::string& what) {
  std::vector<int64_t> out;
  std::stringstream in(list);
  for (std::string x; std::getline(in, x, ',');) {
    try {
      out.push_back(std::stoll(x));
    } catch (const std::exception&) {
      throw InputError(where, label + "'" + x + "' is not " + what);
    }
  }
  return out;
}

std::vector<int> range_to(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// Runs ARGV (argv[0] a path) with stdout and stderr into LOG; its exit code, 128 + signal when killed.
int run_command(const std::vector<std::string>& argv, const std::string& log) {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("fork failed while running " + argv[0]);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

std::string self_exe() {
  std::string p = executable_path();
  if (p.empty()) throw Error("cannot find the alloy binary (/proc/self/exe); pass --alloy");
  return p;
}

// The last "error:" line of a cell's log, for the table's note.
std::string last_error(const std::string& log) {
  std::ifstream f(log);
  std::string line, last;
  while (std::getline(f, line))
    if (line.find("error") != std::string::npos) last = line;
  if (last.size() > 300) last = last.substr(0, 300) + "...";
  return last;
}

bool looks_out_of_memory(const std::string& log, int code) {
  if (code == 128 + 9) return true;  // the kernel's OOM killer
  std::ifstream f(log);
  std::string line;
  while (std::getline(f, line))
    if (line.find("bad_alloc") != std::string::npos || line.find("out of memory") != std::string::npos ||
        line.find("Cannot allocate memory") != std::string::npos || line.find("CUDA out of memory") != std::string::npos)
      return true;
  return false;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The bar a row is drawn as within its layout's cluster.
std::string series_of(const SweepRow& r) {
  return (r.layout == "auto" ? "planner" : "m=" + std::to_string(r.micro_batch)) + ", T=" + std::to_string(r.seq_len);
}

// A cluster of bars: the layout, and the rank count when the sweep has several.
std::string cluster_of(const SweepRow& r, bool ranks_axis) { return ranks_axis ? r.layout + " n=" + std::to_string(r.ranks) : r.layout; }

// Clustered bars with gnuplot: one cluster per layout, one bar per (micro-batch, length). Missing
// cells are drawn as 0. Returns false (and says why) when gnuplot is not installed.
bool bar_chart(const std::string& png, const std::string& title, const std::string& ylabel, const std::vector<SweepRow>& rows,
               double (*value)(const SweepRow&)) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("gnuplot not found: %s not drawn (install gnuplot-nox)\n", png.c_str());
    return false;
  }
  std::vector<std::string> layouts, series;
  const bool ranks_axis = std::any_of(rows.begin(), rows.end(), [&](const SweepRow& r) { return r.ranks != rows.front().ranks; });
  for (const auto& r : rows) {
    const std::string l = cluster_of(r, ranks_axis);
    if (std::find(layouts.begin(), layouts.end(), l) == layouts.end()) layouts.push_back(l);
    const std::string s = series_of(r);
    if (std::find(series.begin(), series.end(), s) == series.end()) series.push_back(s);
  }
  const std::string dat = png.substr(0, png.size() - 4) + ".dat", gp = png.substr(0, png.size() - 4) + ".gp";
  std::ostringstream d;
  d << "layout";
  for (const auto& s : series) d << " \"" << s << "\"";
  d << "\n";
  for (const auto& l : layouts) {
    d << "\"" << l << "\"";
    for (const auto& s : series) {
      double v = 0;
      for (const auto& r : rows)
        if (cluster_of(r, ranks_axis) == l && series_of(r) == s && r.status == "ok") v = value(r);
      d << " " << v;
    }
    d << "\n";
  }
  write_file_atomic(dat, d.str());
  std::ostringstream g;
  const double width = 0.8 / static_cast<double>(series.size());
  g << "set terminal pngcairo size 1000,560\nset output '" << png << "'\nset title '" << title << "'\n"
    << "set style fill solid 0.7 border -1\nset ylabel '" << ylabel << "'\nset yrange [0:*]\nset grid ytics\n"
    << "set key outside right top autotitle columnhead\nset offsets 0.5, 0.5, graph 0.1, 0\nset xtics (";
  for (size_t i = 0; i < layouts.size(); ++i) g << (i ? ", " : "") << "\"" << layouts[i] << "\" " << i;
  g << ")\nplot ";
  for (size_t k = 0; k < series.size(); ++k) {
    const double off = (static_cast<double>(k) - (static_cast<double>(series.size()) - 1) / 2) * width;
    g << (k ? ", " : "") << "'" << dat << "' using ($0+" << off << "):" << k + 2 << ":(" << width << ") with boxes title columnhead("
      << k + 2 << ")";
  }
  g << "\n";
  write_file_atomic(gp, g.str());
  if (std::system(("gnuplot '" + gp + "' 2>/dev/null").c_str()) != 0) {
    std::printf("gnuplot failed on %s\n", gp.c_str());
    return false;
  }
  return true;
}

}  // namespace

std::string sweep_layouts() {
  return "dp (ddp), pp, pp-params, pp:C1,C2,..., zero1, zero2, zero3 (fsdp, fsdp2), auto, tp, tp:H1,H2,...; any but auto with "
         "+ac (activation checkpointing: every stage recomputes), e.g. dp+ac";
}

namespace {
// The hybrid_lora_parallel study's names for the same layouts.
std::string canonical_layout(const std::string& layout) {
  if (layout == "ddp") return "dp";
  if (layout == "fsdp" || layout == "fsdp2") return "zero3";
  return layout;
}

// LAYOUT without its "+ac" (activation checkpointing) suffix, or nullopt when it has none.
std::optional<std::string> without_ac(const std::string& layout) {
  const std::string ac = "+ac";
  if (layout.size() <= ac.size() || layout.compare(layout.size() - ac.size(), ac.size(), ac) != 0) return std::nullopt;
  return layout.substr(0, layout.size() - ac.size());
}

bool known_layout(const std::string& layout) {
  if (const auto inner = without_ac(layout)) return *inner != "auto" && known_layout(*inner);
  const std::string l = canonical_layout(layout);
  return l == "dp" || l == "pp" || l == "pp-params" || l == "auto" || l == "tp" || l == "zero1" || l == "zero2" || l == "zero3" ||
         l.rfind("pp:", 0) == 0 || l.rfind("tp:", 0) == 0;
}
}  // namespace

std::vector<int64_t> cuts_by_params(int n, int64_t layers, const PartParams& p) {
  if (n < 1 || n > layers) throw InputError("layout 'pp-params'", std::to_string(n) + " stages for " + std::to_string(layers) + " blocks");
  const double total = p.embed + static_cast<double>(layers) * p.block + p.head;
  std::vector<int64_t> cuts;
  int64_t prev = 0;
  for (int s = 1; s < n; ++s) {
    const double target = total * s / n;
    // The cut whose prefix (embedding + blocks) comes closest to the target, leaving each stage a block.
    int64_t best = prev + 1;
    for (int64_t c = prev + 1; c <= layers - (n - s); ++c)
      if (std::abs(p.embed + static_cast<double>(c) * p.block - target) < std::abs(p.embed + static_cast<double>(best) * p.block - target))
        best = c;
    cuts.push_back(best);
    prev = best;
  }
  return cuts;
}

Plan sweep_plan(const std::string& layout, int n, int64_t layers, int64_t global_batch, int64_t m, const PartParams& params) {
  const std::string where = "layout '" + layout + "'";
  if (const auto ac = without_ac(layout)) {
    // The study's activation checkpointing (its "ac1" runs): every stage recomputes its blocks'
    // activations in the backward instead of keeping them.
    const std::string inner = *ac;
    if (inner == "auto") throw InputError(where, "+ac is for the layouts given by hand; auto recomputes where the planner finds it needs to");
    Plan p = sweep_plan(inner, n, layers, global_batch, m, params);
    for (auto& pl : p.pipelines)
      for (auto& st : pl.stages) st.recompute = true;
    return p;
  }
  if (n < 1) throw InputError(where, "needs at least one rank");
  if (m < 1) throw InputError(where, "micro-batch size must be >= 1");
  Plan p;
  p.global_batch = global_batch;
  std::string name = canonical_layout(layout);
  int zero = 0;
  if (name == "zero1" || name == "zero2" || name == "zero3") {
    zero = name[4] - '0';
    name = "dp";
  }
  if (name == "tp" || name.rfind("tp:", 0) == 0) {
    if (n < 2) throw InputError(where, "tensor parallelism needs at least 2 ranks");
    if (global_batch % m != 0)
      throw InputError(where, "global batch " + std::to_string(global_batch) + " is not a whole number of micro-batches of " +
                                  std::to_string(m));
    StagePlan st{range_to(n), 0, layers, "", false};
    if (name != "tp") {
      st.tp_split = layout_numbers(name.substr(3), where, "", "a number of heads");
      if (static_cast<int>(st.tp_split.size()) != n)
        throw InputError(where, std::to_string(st.tp_split.size()) + " head counts for " + std::to_string(n) + " ranks");
    }
    PipelinePlan pl{m, global_batch / m, {}};
    pl.stages.push_back(st);
    p.pipelines.push_back(pl);
    return p;
  }
  if (name == "dp") {
    if (global_batch % (static_cast<int64_t>(n) * m) != 0)
      throw InputError(where, "global batch " + std::to_string(global_batch) + " does not split into " + std::to_string(n) +
                                  " replicas of whole micro-batches of " + std::to_string(m));
    for (int r = 0; r < n; ++r) {
      PipelinePlan pl{m, global_batch / (static_cast<int64_t>(n) * m), {}};
      pl.stages.push_back({{r}, 0, layers, "", false});
      p.pipelines.push_back(pl);
    }
    if (zero > 0 && n > 1) p.sharding.push_back({range_to(n), zero, {}});
    return p;
  }
  if (name == "pp" || name == "pp-params" || name.rfind("pp:", 0) == 0) {
    if (global_batch % m != 0)
      throw InputError(where, "global batch " + std::to_string(global_batch) + " is not a whole number of micro-batches of " +
                                  std::to_string(m));
    std::vector<int64_t> cuts;
    if (name == "pp") {
      if (n > layers) throw InputError(where, std::to_string(n) + " stages for " + std::to_string(layers) + " blocks");
      for (int s = 1; s < n; ++s) cuts.push_back(layers * s / n);
    } else if (name == "pp-params") {
      if (!(params.block > 0)) throw InputError(where, "needs the model's parameters per part (the profile's memory figures)");
      cuts = cuts_by_params(n, layers, params);
    } else {
      cuts = layout_numbers(name.substr(3), where, "cut ", "a block number");
      if (static_cast<int>(cuts.size()) != n - 1)
        throw InputError(where, std::to_string(cuts.size()) + " cuts for " + std::to_string(n) + " ranks (need " +
                                    std::to_string(n - 1) + ")");
    }
    PipelinePlan pl{m, global_batch / m, {}};
    int64_t begin = 0;
    cuts.push_back(layers);
    for (size_t s = 0; s < cuts.size(); ++s) {
      if (cuts[s] <= begin || cuts[s] > layers)
        throw InputError(where, "cut " + std::to_string(cuts[s]) + " leaves a stage without blocks (blocks 0.." +
                                    std::to_string(layers) + ")");
      pl.stages.push_back({{static_cast<int>(s)}, begin, cuts[s], "", false});
      begin = cuts[s];
    }
    p.pipelines.push_back(pl);
    return p;
  }
  throw InputError(where, "unknown layout; known: " + sweep_layouts());
}

namespace {
// One pool's grid: N local ranks (0: the given cluster's devices), every length x layout x size.
// Returns the ClusterSpec it ran (and predicted) on.
std::string sweep_pool(const SweepOptions& o, const Config& base, const std::string& alloy, int n, const std::string& given_cluster,
                bool ranks_axis, const std::vector<int64_t>& lengths, size_t cells, size_t& done, std::vector<SweepRow>& rows) {
  std::string cluster = given_cluster;
  if (cluster.empty()) {
    std::ostringstream y;
    y << "name: local-" << n << "\ndevices:\n";
    for (int r = 0; r < n; ++r) y << "  - {name: cpu" << r << ", host: localhost, kind: cpu, type: cpu, speed: 1.0}\n";
    y << "default_link: {bandwidth_gbps: 10, latency_ms: 0.05}\n";
    cluster = o.out_dir + (ranks_axis ? "/local-cluster-n" + std::to_string(n) + ".yaml" : "/local-cluster.yaml");
    write_file_atomic(cluster, y.str());
  }
  const plan::ClusterSpec spec = plan::load_cluster(cluster);
  if (n < 1) n = static_cast<int>(spec.devices.size());
  if (n != static_cast<int>(spec.devices.size()))
    throw InputError(cluster, "has " + std::to_string(spec.devices.size()) + " devices, the sweep runs " + std::to_string(n) + " ranks");
  std::vector<std::string> launch = {alloy, "launch"};
  if (!o.emulate.empty()) launch.insert(launch.end(), {"--emulate", o.emulate});
  else launch.insert(launch.end(), {"--nproc", std::to_string(n)});
  launch.push_back("--");
  // File and run names carry the rank count only when the sweep has several.
  const std::string tag_n = ranks_axis ? "-n" + std::to_string(n) : "";

  for (int64_t T : lengths) {
    // Every cell of this length starts from the same config file, with the length set.
    Config c = base;
    c.model.seq_len = T;
    c.validate();
    const std::string cfg_path = o.out_dir + "/config-T" + std::to_string(T) + ".yaml";
    write_file_atomic(cfg_path, c.to_yaml());
    // A profile of this model on this pool, for the predictions (measured once per length).
    std::string prof_path = o.profile;
    if (prof_path.empty() || !plan::Profile::load(prof_path).mismatch(c).empty()) {
      prof_path = o.out_dir + "/profile" + tag_n + "-T" + std::to_string(T) + ".json";
      if (!file_exists(prof_path) || !plan::Profile::load(prof_path).mismatch(c).empty()) {
        std::printf("profiling the pool (%d ranks) for seq_len %lld (%s)\n", n, static_cast<long long>(T), prof_path.c_str());
        auto argv = launch;
        argv.insert(argv.end(), {alloy, "profile", "--cluster", cluster, "--config", cfg_path, "-o", prof_path});
        const std::string log = o.out_dir + "/profile" + tag_n + "-T" + std::to_string(T) + ".log";
        if (run_command(argv, log) != 0) throw Error("profiling failed (" + log + "): " + last_error(log));
      }
    }
    const plan::Profile prof = plan::Profile::load(prof_path);

    for (const auto& layout : o.layouts) {
      const std::vector<int64_t> sizes = layout == "auto" ? std::vector<int64_t>{0} : o.micro_batches;
      for (int64_t m : sizes) {
        SweepRow row;
        row.layout = layout;
        row.ranks = n;
        row.micro_batch = m;
        row.seq_len = T;
        const std::string name = layout + tag_n + (m > 0 ? "-m" + std::to_string(m) : "") + "-T" + std::to_string(T);
        row.run_dir = o.out_dir + "/runs/" + name;
        std::vector<std::string> train = {alloy, "train", "--config", cfg_path, "--set", "output.dir=" + row.run_dir,
                                          "--set", "train.steps=" + std::to_string(o.steps), "--set", "train.eval_batches=0",
                                          "--set", "train.replan_step=0", "--set", "output.tensorboard=false"};
        ++done;
        Plan p;
        if (layout == "auto") {
          train.insert(train.end(), {"--plan", "auto", "--cluster", cluster, "--profile", prof_path});
        } else {
          try {
            const auto& mem = prof.memory;
            const PartParams parts{mem.param_bytes_embed + mem.frozen_bytes_embed, mem.param_bytes_per_block + mem.frozen_bytes_per_block,
                                   mem.param_bytes_head + mem.frozen_bytes_head};
            p = sweep_plan(layout, n, c.model.layers, c.train.global_batch, m, parts);
            for (auto& pl : p.pipelines)  // rank r is device r of the pool
              for (auto& st : pl.stages) {
                st.device = spec.devices[static_cast<size_t>(st.ranks[0])].name;
                if (st.tp() > 1)
                  for (int r : st.ranks) st.devices.push_back(spec.devices[static_cast<size_t>(r)].name);
              }
            if (c.train.sequence_parallel) p.set_sequence_parallel();  // priced as the trainer will run it
            if (const std::string why = p.training_problem(c); !why.empty()) throw InputError(name, why);
            p.validate(c.model, name);
          } catch (const InputError& e) {
            row.status = "skipped";
            row.note = e.what();
            std::printf("[%zu/%zu] %s: %s (%s)\n", done, cells, name.c_str(), row.status.c_str(), row.note.c_str());
            rows.push_back(row);
            continue;
          }
          const plan::PlanCost pc = plan::simulate_plan(p, spec, prof);
          row.predicted_step_s = pc.step_s;
          for (const auto& s : pc.stages) row.predicted_mem_max_bytes = std::max(row.predicted_mem_max_bytes, s.memory_bytes);
          if (!pc.fits) {
            row.status = "oom-predicted";
            row.note = pc.explanation;
            std::printf("[%zu/%zu] %s: does not fit (%s)\n", done, cells, name.c_str(), pc.explanation.c_str());
            rows.push_back(row);
            continue;
          }
          ensure_writable_dir(o.out_dir + "/runs");
          const std::string plan_path = o.out_dir + "/runs/" + name + ".plan.json";
          p.save(plan_path);
          train.insert(train.end(), {"--plan", plan_path});
        }
        auto argv = launch;
        argv.insert(argv.end(), train.begin(), train.end());
        ensure_writable_dir(row.run_dir);
        const std::string log = row.run_dir + ".log";
        const int code = run_command(argv, log);
        if (code != 0) {
          row.status = looks_out_of_memory(log, code) ? "oom" : "failed";
          row.note = last_error(log) + " (" + log + ")";
          std::printf("[%zu/%zu] %s: %s: %s\n", done, cells, name.c_str(), row.status.c_str(), row.note.c_str());
          rows.push_back(row);
          continue;
        }
        // Step time: the median over the steps after the warm-up ones.
        std::vector<double> steps;
        std::ifstream mf(row.run_dir + "/metrics.jsonl");
        for (std::string line; std::getline(mf, line);) {
          if (line.empty()) continue;
          const auto j = nlohmann::json::parse(line);
          if (j.value("step", 0) > o.warmup) steps.push_back(j.value("step_s", 0.0));
        }
        row.step_s = median(steps);
        row.tokens_per_s = row.step_s > 0 ? static_cast<double>(c.train.global_batch * T) / row.step_s : 0;
        const nlohmann::json ranks = read_json_file(row.run_dir + "/ranks.json");
        for (const auto& r : ranks) {
          const double b = r.value("model_memory_bytes", 0.0);
          row.mem_max_bytes = std::max(row.mem_max_bytes, b);
          row.mem_sum_bytes += b;
        }
        if (!ranks.empty() && row.mem_sum_bytes > 0)
          row.mem_imbalance = row.mem_max_bytes / (row.mem_sum_bytes / static_cast<double>(ranks.size()));
        if (layout == "auto") {
          const Plan ran = Plan::load(row.run_dir + "/plan.json");
          row.micro_batch = ran.pipelines.front().micro_batch_size;
          row.note = "the planner's plan: " + ran.describe().substr(0, ran.describe().find('\n'));
          const plan::PlanCost pc = plan::simulate_plan(ran, spec, prof);
          row.predicted_step_s = pc.step_s;
          for (const auto& s : pc.stages) row.predicted_mem_max_bytes = std::max(row.predicted_mem_max_bytes, s.memory_bytes);
        }
        row.status = "ok";
        std::printf("[%zu/%zu] %s: %.0f tokens/s, step %.1f ms (predicted %.1f), model memory max %.2f MB (predicted %.2f), "
                    "imbalance %.2f\n",
                    done, cells, name.c_str(), row.tokens_per_s, row.step_s * 1e3, row.predicted_step_s * 1e3, row.mem_max_bytes / 1e6,
                    row.predicted_mem_max_bytes / 1e6, row.mem_imbalance);
        rows.push_back(row);
      }
    }
  }
  return cluster;
}
}  // namespace

std::vector<SweepRow> run_sweep(const SweepOptions& o) {
  // Before anything is profiled or written: a misspelled layout or an impossible count would
  // otherwise fail after minutes of it.
  for (const auto& l : o.layouts)
    if (!known_layout(l)) throw InputError("--layouts", "unknown layout '" + l + "'; known: " + sweep_layouts());
  // The pool: the emulated cluster, or N CPUs of this machine (for the predictions), for each
  // count N of --nproc (the study's "# of GPUs" axis: local ranks only, since a ClusterSpec fixes
  // its pool's size; there 0 or no count means one rank per device).
  const std::string given_cluster = !o.cluster.empty() ? o.cluster : o.emulate;
  std::vector<int> counts = o.nprocs;
  if (!given_cluster.empty() && counts.size() == 1 && counts[0] == 0) counts.clear();
  if (counts.size() > 1 && !given_cluster.empty())
    throw InputError("--nproc", "several rank counts run local ranks on this machine; --emulate and --cluster fix the pool's size");
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 1) throw InputError("--nproc", "rank counts must be >= 1, got " + std::to_string(counts[i]));
    if (std::find(counts.begin(), counts.begin() + static_cast<std::ptrdiff_t>(i), counts[i]) != counts.begin() + static_cast<std::ptrdiff_t>(i))
      throw InputError("--nproc", std::to_string(counts[i]) + " is listed twice");
  }
  if (counts.empty()) {
    if (given_cluster.empty()) throw InputError("--nproc", "say how many local ranks (or --emulate CLUSTER)");
    counts = {0};
  }
  const Config base = Config::load(o.config, o.sets);
  const std::string alloy = o.alloy.empty() ? self_exe() : o.alloy;
  ensure_writable_dir(o.out_dir);

  const bool ranks_axis = counts.size() > 1;
  std::vector<int64_t> lengths = o.seq_lens.empty() ? std::vector<int64_t>{base.model.seq_len} : o.seq_lens;
  std::vector<SweepRow> rows;
  size_t cells = 0, done = 0;
  for (const auto& l : o.layouts) cells += (l == "auto" ? lengths.size() : lengths.size() * o.micro_batches.size()) * counts.size();

  // The CSV and JSON are rewritten after each pool, so a later count that fails (its profile, say)
  // keeps the finished counts' results.
  std::vector<std::string> clusters;
  auto write_tables = [&]() {
    write_file_atomic(o.out_dir + "/sweep.csv", sweep_csv(rows));
    nlohmann::json j;
    j["config"] = o.config;
    j["ranks"] = counts.size() == 1 ? nlohmann::json(rows.empty() ? counts[0] : rows.front().ranks) : nlohmann::json(counts);
    j["cluster"] = clusters.size() == 1 ? nlohmann::json(clusters[0]) : nlohmann::json(clusters);
    j["emulated"] = !o.emulate.empty();
    j["global_batch"] = base.train.global_batch;
    j["steps"] = o.steps;
    j["machine"] = {{"cores", std::thread::hardware_concurrency()}};
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
      j["rows"].push_back({{"layout", r.layout},
                           {"ranks", r.ranks},
                           {"micro_batch", r.micro_batch},
                           {"seq_len", r.seq_len},
                           {"status", r.status},
                           {"note", r.note},
                           {"tokens_per_s", r.tokens_per_s},
                           {"step_s", r.step_s},
                           {"predicted_step_s", r.predicted_step_s},
                           {"mem_max_bytes", r.mem_max_bytes},
                           {"mem_sum_bytes", r.mem_sum_bytes},
                           {"mem_imbalance", r.mem_imbalance},
                           {"predicted_mem_max_bytes", r.predicted_mem_max_bytes},
                           {"run_dir", r.run_dir}});
    j["prediction_errors"] = prediction_errors(rows);
    write_file_atomic(o.out_dir + "/sweep.json", j.dump(2) + "\n");
  };
  for (int n : counts) {
    clusters.push_back(sweep_pool(o, base, alloy, n, given_cluster, ranks_axis, lengths, cells, done, rows));
    write_tables();
  }
  bar_chart(o.out_dir + "/sweep-tokens.png", "tokens/s per layout", "tokens/s", rows, [](const SweepRow& r) { return r.tokens_per_s; });
  bar_chart(o.out_dir + "/sweep-latency.png", "step latency per layout", "ms", rows,
            [](const SweepRow& r) { return r.step_s * 1e3; });
  bar_chart(o.out_dir + "/sweep-memory.png", "model memory of the largest rank", "MB", rows,
            [](const SweepRow& r) { return r.mem_max_bytes / 1e6; });
  return rows;
}

std::string sweep_csv(const std::vector<SweepRow>& rows) {
  std::ostringstream s;
  s << "layout,ranks,micro_batch,seq_len,status,tokens_per_s,step_s,predicted_step_s,step_error,mem_max_bytes,mem_sum_bytes,"
       "mem_imbalance,predicted_mem_max_bytes,mem_error,note\n";
  for (const auto& r : rows) {
    const bool ok = r.status == "ok";
    std::string note = r.note;
    std::replace(note.begin(), note.end(), '"', '\'');
    std::string layout = r.layout;  // quoted: pp:C1,C2 and tp:H1,H2 hold commas
    std::replace(layout.begin(), layout.end(), '"', '\'');
    s << "\"" << layout << "\"," << r.ranks << "," << r.micro_batch << "," << r.seq_len << "," << r.status << "," << (ok ? fmt(r.tokens_per_s, 6) : "") << ","
      << (ok ? fmt(r.step_s, 6) : "") << "," << (r.predicted_step_s > 0 ? fmt(r.predicted_step_s, 6) : "") << ","
      << (ok && r.predicted_step_s > 0 ? fmt(r.predicted_step_s / r.step_s - 1, 4) : "") << ","
      << (ok ? fmt(r.mem_max_bytes, 10) : "") << "," << (ok ? fmt(r.mem_sum_bytes, 10) : "") << ","
      << (ok ? fmt(r.mem_imbalance, 4) : "") << "," << (r.predicted_mem_max_bytes > 0 ? fmt(r.predicted_mem_max_bytes, 10) : "") << ","
      << (ok && r.mem_max_bytes > 0 && r.predicted_mem_max_bytes > 0 ? fmt(r.predicted_mem_max_bytes / r.mem_max_bytes - 1, 4) : "")
      << ",\"" << note << "\"\n";
  }
  return s.str();
}

nlohmann::json prediction_errors(const std::vector<SweepRow>& rows) {
  std::vector<double> step, mem;
  for (const auto& r : rows) {
    if (r.status != "ok") continue;
    if (r.step_s > 0 && r.predicted_step_s > 0) step.push_back(r.predicted_step_s / r.step_s - 1);
    if (r.mem_max_bytes > 0 && r.predicted_mem_max_bytes > 0) mem.push_back(r.predicted_mem_max_bytes / r.mem_max_bytes - 1);
  }
  auto summary = [](const std::vector<double>& e) {
    nlohmann::json j = {{"rows", e.size()}, {"errors", e}};
    if (e.empty()) return j;
    std::vector<double> a;
    for (double x : e) a.push_back(std::fabs(x));
    double mean = 0;
    for (double x : a) mean += x;
    j["median"] = median(e);
    j["mean_abs"] = mean / static_cast<double>(a.size());
    j["worst_abs"] = *std::max_element(a.begin(), a.end());
    size_t within10 = 0;
    for (double x : a) within10 += x <= 0.10;
    j["within_10_percent"] = within10;
    return j;
  };
  return {{"step", summary(step)}, {"memory", summary(mem)}};
}

}  // namespace alloy::train
