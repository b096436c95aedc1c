#include <unistd.h>

#include <ATen/Context.h>

#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <thread>
#include <cstdio>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/core/megatron_args.h"
#include "alloy/core/plan.h"
#include "alloy/core/plan_convert.h"
#include "alloy/dist/rendezvous.h"
#include "alloy/dist/launch.h"
#include "alloy/dist/world.h"
#include "alloy/model/megatron_checkpoint.h"
#include "alloy/core/fs.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/run_plan.h"
#include "alloy/plan/planner.h"
#include "alloy/viz/diagram.h"
#include "alloy/train/trainer.h"

namespace alloy::cli {

namespace {
struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  bool resume = false, auto_resume = false;
  std::string resume_from, init_weights, trace;
  int64_t trace_step = 0;
  train::PlanSources src;
  dist::RendezvousFlags rv;
  double timeout_s = 300;
  double stall_s = -1;
  std::vector<std::string> megatron;  // the arguments CLI11 did not know: Megatron's (megatron_args.h)
  std::vector<std::string> own_flags;  // this command's own flag names, for "did you mean"
  bool micro_batch_given = false;
  // HeteroShard's own command-line overrides of its hetero_config.json.
  int64_t hs_resume_step = -1;
  std::string hs_checkpoint_dir;
  // SAFusion's flags, as --set grad_sync.* overrides.
  std::string compressor, memory;
  double density = 0;
  int64_t threshold = 0;
  bool mgwfbp = false;
  // Sharding (ZeRO), DeepSpeed's and Megatron's names.
  int64_t zero_stage = -1;
  std::vector<double> shard_ratio;
  bool distributed_optimizer = false;
  bool recompute = false;
  bool sequence_parallel = false;
  // LoRA, PEFT's names.
  int64_t lora_rank = -1;
  double lora_alpha = 0, lora_dropout = -1;
  bool rslora = false;
  std::vector<std::string> lora_targets;
  std::string base_dtype;
  // Megatron's precision flags.
  bool bf16 = false, fp16 = false, grad_bf16 = false;
};

// The LoRA flags as --set lora.* overrides (after the user's --set).
std::vector<std::string> lora_overrides(const TrainArgs& a) {
  std::vector<std::string> out;
  if (a.lora_rank >= 0) out.push_back("lora.rank=" + std::to_string(a.lora_rank));
  if (a.rslora) out.push_back("lora.rslora=true");
  if (a.lora_alpha != 0) {
    std::ostringstream ss;
    ss << a.lora_alpha;
    out.push_back("lora.alpha=" + ss.str());
  }
  if (a.lora_dropout >= 0) {
    std::ostringstream ss;
    ss << a.lora_dropout;
    out.push_back("lora.dropout=" + ss.str());
  }
  if (!a.lora_targets.empty()) {
    std::string t;
    for (const auto& x : a.lora_targets) t += (t.empty() ? "" : ",") + x;
    out.push_back("lora.targets=" + t);
  }
  if (!a.base_dtype.empty()) out.push_back("lora.base_dtype=" + a.base_dtype);
  return out;
}

// The sharding flags as --set train.* overrides (after the user's --set, as flags given later win).
std::vector<std::string> sharding_overrides(const TrainArgs& a) {
  std::vector<std::string> out;
  if (a.zero_stage >= 0 && a.distributed_optimizer && a.zero_stage != 1)
    throw InputError("--use-distributed-optimizer", "is ZeRO-1 and contradicts --zero-stage " + std::to_string(a.zero_stage));
  if (a.zero_stage > 3 || (a.zero_stage < 0 && a.zero_stage != -1))
    throw InputError("--zero-stage", "must be 0, 1, 2 or 3, got " + std::to_string(a.zero_stage));
  if (a.zero_stage >= 0) out.push_back("train.zero_stage=" + std::to_string(a.zero_stage));
  if (a.distributed_optimizer) out.push_back("train.zero_stage=1");
  if (a.recompute) out.push_back("train.recompute=true");
  if (a.sequence_parallel) out.push_back("train.sequence_parallel=true");
  if (!a.shard_ratio.empty()) {
    std::string r;
    for (double v : a.shard_ratio) {  // validated with the config (train.shard_ratio)
      std::ostringstream ss;
      ss << v;
      r += (r.empty() ? "" : ",") + ss.str();
    }
    out.push_back("train.shard_ratio=" + r);
  }
  return out;
}

// SAFusion's command line in Alloy's keys, appended after the user's --set (so they win, as flags
// given later do).
std::vector<std::string> safusion_overrides(const TrainArgs& a) {
  std::vector<std::string> out;
  if (!a.compressor.empty()) out.push_back("grad_sync.compression=" + a.compressor);
  if (a.density > 0) out.push_back("grad_sync.density=" + std::to_string(a.density));
  if (!a.memory.empty()) {
    if (a.memory != "residual" && a.memory != "none" && a.memory != "dgc")
      throw InputError("--memory", "must be residual, dgc or none (error feedback, with DGC's momentum correction, or off), got '" +
                                       a.memory + "'");
    out.push_back(std::string("grad_sync.error_feedback=") + (a.memory == "none" ? "false" : "true"));
    // GRACE's DgcMemory: a local velocity accumulates into the residual, both cleared where sent.
    if (a.memory == "dgc") out.push_back("grad_sync.momentum_correction=on");
  }
  if (a.threshold > 0) out.push_back("grad_sync.bucket_mb=" + std::to_string(static_cast<double>(a.threshold) * 4 / (1 << 20)));
  if (a.mgwfbp) out.push_back("grad_sync.fusion=omgs");
  return out;
}

// A HeteroShard stage's device in Alloy's terms: auto picks CUDA where there is one.
std::string hetero_device(const std::string& d, const std::string& file, int rank) {
  if (d == "auto") return at::hasCUDA() ? "cuda" : "cpu";
  if (d == "mps")
    throw InputError(file, "the device of shard_plan[" + std::to_string(rank) + "] (rank " + std::to_string(rank) +
                               ") is 'mps', which this LibTorch build cannot use; say cpu, cuda or auto");
  return d;
}

// resume_step's checkpoint under the run directory (checkpoint_dir), which must exist.
std::string hetero_resume_dir(const Config& cfg, const HeteroShardRun& hs, const std::string& file) {
  const std::string dir = cfg.output.dir + "/checkpoints/" + train::step_name(hs.resume_step);
  if (file_exists(dir + "/state.json")) return dir;
  std::string have;
  if (std::filesystem::is_directory(cfg.output.dir + "/checkpoints"))
    for (const auto& e : std::filesystem::directory_iterator(cfg.output.dir + "/checkpoints"))
      if (e.path().filename().string().rfind("step_", 0) == 0) have += (have.empty() ? "" : ", ") + e.path().filename().string();
  throw InputError(file, "resume_step: " + std::to_string(hs.resume_step) + ", but " + dir + " holds no checkpoint (" +
                             (have.empty() ? "none written yet" : "there are " + have) + ")");
}

void print_summary(const train::TrainResult& r) {
  if (r.steps.empty()) return;
  std::printf("\nloss curve (step: train loss%s)\n", r.val_loss.empty() ? "" : " | validation loss");
  const size_t n = r.steps.size();
  const size_t points = std::min<size_t>(n, 10);
  for (size_t i = 0; i < points; ++i) {
    size_t k = points == 1 ? n - 1 : i * (n - 1) / (points - 1);
    const auto& s = r.steps[k];
    std::printf("  step %6lld: %.4f", static_cast<long long>(s.step), s.loss);
    for (const auto& [vs, vl] : r.val_loss)
      if (vs == s.step) std::printf(" | %.4f", vl);
    std::printf("\n");
  }
  if (!r.val_loss.empty())
    std::printf("validation loss: %.4f at step %lld -> %.4f at step %lld\n", r.val_loss.front().second,
                static_cast<long long>(r.val_loss.front().first), r.val_loss.back().second,
                static_cast<long long>(r.val_loss.back().first));
  double tps = 0;
  for (const auto& s : r.steps) tps += s.tokens_per_s;
  std::printf("mean throughput: %.0f tokens/s\n", tps / static_cast<double>(n));
  if (r.checkpoints > 0)
    std::printf("checkpoints: %lld, the training thread paused %.1f ms per checkpoint\n", static_cast<long long>(r.checkpoints),
                1e3 * r.checkpoint_pause_s / static_cast<double>(r.checkpoints));
}

}  // namespace

void add_train_commands(CLI::App& app, Action& action) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a model: on one device, or as one rank of a distributed plan");
  cmd->add_option("-c,--config", a->config, "YAML config with sections model, data, train, output")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", a->sets, "Override a config key: --set section.key=value (repeatable)");
  cmd->add_flag("--resume", a->resume, "Resume from the latest checkpoint in output.dir");
  auto* bf16 = cmd->add_flag("--bf16", a->bf16, "Mixed precision in bf16 (Megatron's flag; train.precision=bf16): fp32 weights, "
                                                 "gradients and AdamW state");
  cmd->add_flag("--fp16", a->fp16, "Mixed precision in fp16 with dynamic loss scaling (Megatron's flag; train.precision=fp16)")
      ->excludes(bf16);
  cmd->add_flag("--grad-reduce-in-bf16", a->grad_bf16,
                "Sum gradients in bf16 on the wire (Megatron's flag; grad_sync.dtype=bf16, exact sync's casting compression)");
  cmd->add_option("--resume-from", a->resume_from, "Resume from this checkpoint or run directory");
  cmd->add_flag("--auto-resume", a->auto_resume,
                "Resume from output.dir's last complete checkpoint if there is one, else start afresh (what a restarted "
                "job does by itself: ALLOY_RESTART, TORCHELASTIC_RESTART_COUNT or SLURM_RESTART_COUNT above 0)");
  cmd->add_option("--init-from,--init-weights", a->init_weights,
                  "Start from pretrained weights (an Alloy checkpoint or run directory; safetensors with HuggingFace "
                  "names, or a HuggingFace model directory or model.safetensors.index.json with its shards), fresh "
                  "optimizer; with LoRA the frozen base");

  auto* g_plan = "Parallel plan (default: one device; with several ranks and no plan, equal data parallelism)";
  cmd->add_option("--plan", a->src.plan_file, "Plan JSON (see `alloy plan`), or `auto`: profile (or reuse --profile), plan, train")
      ->group(g_plan);
  cmd->add_option("--cluster", a->src.cluster, "ClusterSpec for --plan auto and grad_sync.scope slow-links (default: $ALLOY_CLUSTER, set by `alloy launch --emulate`)")
      ->group(g_plan);
  cmd->add_option("--profile", a->src.profile, "Profile for --plan auto (default: OUTPUT/profile.json if it matches, else measure)")
      ->group(g_plan);
  cmd->add_option("--hetero-config", a->src.hetero_config, "HeteroShard hetero_config.json: its shard_plan becomes the plan")
      ->group(g_plan)->check(CLI::ExistingFile);
  cmd->add_option("--resume_step", a->hs_resume_step, "HeteroShard: resume at this step's checkpoint (overrides resume_step)")
      ->group(g_plan);
  cmd->add_option("--checkpoint_dir", a->hs_checkpoint_dir, "HeteroShard: the run directory (overrides checkpoint_dir; output.dir)")
      ->group(g_plan);
  cmd->add_option("--trace", a->trace, "Write a Chrome trace (chrome://tracing, Perfetto) of one step's schedule, all ranks")
      ->group(g_plan);
  cmd->add_option("--trace-step", a->trace_step,
                  "The step --trace records (counted from 1 as in metrics.jsonl); default: the second step of this run")
      ->group(g_plan)->check(CLI::PositiveNumber);

  auto* g_sf = "SynerFuse / Megatron flags (instead of a plan)";
  cmd->add_option("--num-layers", a->src.synerfuse.num_layers, "Transformer blocks (model.layers)")->group(g_sf);
  cmd->add_option("--pipeline-model-parallel-size", a->src.synerfuse.pipeline_model_parallel_size, "Pipeline stages")->group(g_sf);
  cmd->add_option("--tensor-model-parallel-size", a->src.synerfuse.tensor_model_parallel_size,
                  "Ranks per stage, splitting each block's heads and MLP columns (Megatron's tensor parallelism)")
      ->group(g_sf);
  cmd->add_option("--tp-split", a->src.synerfuse.tp_split,
                  "h0 h1 ...: attention heads per rank of a tensor-parallel stage, e.g. 3 1 (default: even)")
      ->group(g_sf);
  cmd->add_flag("--sequence-parallel", a->sequence_parallel,
                "Tensor-parallel stages split norms and the residual stream by sequence position, in the heads' ratio "
                "(train.sequence_parallel)")
      ->group(g_sf);
  cmd->add_option("--global-batch-size", a->src.synerfuse.global_batch_size, "Overrides train.global_batch")->group(g_sf);
  cmd->add_option("--micro-batch-size", a->src.synerfuse.micro_batch_size, "Uniform micro-batch size")->group(g_sf);
  cmd->add_option("--hetero-pipeline-stages", a->src.synerfuse.hetero_pipeline_stages, "n0 l00 l01 ... n1 l10 ...: layers per stage")
      ->group(g_sf);
  cmd->add_option("--num-layers-per-virtual-pipeline-stage", a->src.synerfuse.layers_per_virtual_stage,
                  "Interleaved schedule: each pipeline's layers in chunks of this many, chunk c on stage c mod the stages "
                  "(each rank holds layers / (stages x this) chunks)")
      ->group(g_sf);
  cmd->add_option("--micro-batch-size-per-dp", a->src.synerfuse.micro_batch_size_per_dp, "n0 mbs0 n1 mbs1 ...")->group(g_sf);
  cmd->add_option("--num-micro-batches-per-dp", a->src.synerfuse.num_micro_batches_per_dp, "n0 nmb0 n1 nmb1 ...")->group(g_sf);
  cmd->add_flag("--use-tp-pp-dp-mapping", a->src.synerfuse.tp_pp_dp_mapping,
                "Rank order tp-pp-dp (consecutive ranks form a pipeline; implied by the per-dp lists); without it Megatron's "
                "tp-dp-pp (stage 0 on the first tp x dp ranks)")
      ->group(g_sf);
  // Megatron's model, training, data and logging flags (run.sh's other arrays) are read by the
  // library's table (core/megatron_args.h), which the footer lists.
  cmd->allow_extras();

  auto* g_gs = "Gradient compression, SAFusion's flags (or --set grad_sync.KEY=VALUE; see the keys below)";
  cmd->add_option("--compressor", a->compressor,
                  "none | fp16 | bf16 | topk | randomk | dgc | gaussiank | redsync | sidco | oktopk | powersgd (SAFusion's "
                  "gaussian and eftopk too): grad_sync.compression")
      ->group(g_gs);
  cmd->add_option("--density", a->density, "Fraction of each gradient sent, in (0, 1]: grad_sync.density")->group(g_gs);
  cmd->add_option("--memory", a->memory,
                  "residual | dgc | none: error feedback, with DGC's momentum correction (grad_sync.momentum_correction=on), "
                  "or off (grad_sync.error_feedback)")
      ->group(g_gs);
  cmd->add_option("--threshold", a->threshold, "Fusion buffer size in gradient elements (grad_sync.bucket_mb = 4 x N bytes)")
      ->group(g_gs);
  cmd->add_flag("--mgwfbp", a->mgwfbp, "Merge gradients by the link model (MG-WFBP): grad_sync.fusion=omgs")->group(g_gs);

  auto* g_sh = "Memory: sharded data parallelism (ZeRO) and recomputation (or --set train.zero_stage / shard_ratio / recompute)";
  cmd->add_option("--zero-stage", a->zero_stage,
                  "0: full replicas; 1: optimizer state sharded among the ranks holding the same layers; 2: gradients too; "
                  "3: parameters too, gathered per layer before its forward and backward (FSDP)")
      ->group(g_sh);
  cmd->add_option("--shard-ratio", a->shard_ratio,
                  "r0 r1 ...: each shard's share within its group, in rank order (one per group member, or one per rank); "
                  "default even")
      ->group(g_sh);
  cmd->add_flag("--use-distributed-optimizer", a->distributed_optimizer, "Megatron/SynerFuse: the same as --zero-stage 1")
      ->group(g_sh);
  cmd->add_flag("--recompute", a->recompute,
                "Recompute every block's activations in the backward instead of keeping them (train.recompute)")
      ->group(g_sh);

  auto* g_lora = "Fine-tuning: LoRA adapters over a frozen (optionally quantized) base (or --set lora.KEY=VALUE)";
  cmd->add_option("--lora-rank", a->lora_rank, "Rank of the adapters; 0 = off (lora.rank)")->group(g_lora);
  cmd->add_option("--lora-alpha", a->lora_alpha, "Adapters' output scaled by alpha / rank (lora.alpha)")->group(g_lora);
  cmd->add_option("--lora-dropout", a->lora_dropout, "Dropout on the adapters' input (lora.dropout)")->group(g_lora);
  cmd->add_flag("--use-rslora", a->rslora, "Rank-stabilized LoRA: adapters scaled by alpha / sqrt(rank) (lora.rslora, PEFT's use_rslora)")
      ->group(g_lora);
  cmd->add_option("--lora-targets", a->lora_targets,
                  "Projections to adapt: names, dotted suffixes or globs (c_attn q_proj mlp.* all); default the attention "
                  "projections (lora.targets)")
      ->group(g_lora);
  cmd->add_option("--base-dtype", a->base_dtype, "fp32 | int8 | nf4: storage of the frozen base's projections (lora.base_dtype)")
      ->group(g_lora);

  auto* g_rv = "Rendezvous (default: torchrun or SLURM variables, else one process)";
  cmd->add_option("--rank", a->rv.rank, "This process's rank")->group(g_rv);
  cmd->add_option("--world-size", a->rv.world_size, "Number of ranks")->group(g_rv);
  cmd->add_option("--master-addr", a->rv.master_addr, "Host of rank 0 (the rendezvous store)")->group(g_rv);
  cmd->add_option("--master-port", a->rv.master_port, "Port of the rendezvous store")->group(g_rv);
  cmd->add_option("--dist-url", a->rv.dist_url, "tcp://HOST:PORT (PTAFM style)")->group(g_rv);
  cmd->add_option("--timeout", a->timeout_s, "Seconds any collective or rendezvous may take before the job fails")
      ->group(g_rv)->capture_default_str();
  cmd->add_option("--stall-seconds", a->stall_s,
                  "Report which ranks have not entered a collective this rank has waited in this long (default: a quarter "
                  "of --timeout; 0 = off)")
      ->group(g_rv);
  cmd->footer("Config keys (section.key, help, type and default):\n" + config_reference() +
              "\nMegatron flags (SynerFuse's run.sh) and what they become; like Alloy's other flags they override the config and --set:\n" +
              megatron_flags_reference());

  cmd->callback([a, cmd, &action]() {
    a->megatron = cmd->remaining();
    for (const CLI::Option* o : cmd->get_options())
      for (const auto& l : o->get_lnames()) a->own_flags.push_back("--" + l);
    a->micro_batch_given = cmd->count("--micro-batch-size") > 0;
    action = [a]() {
      // A HeteroShard file says more than the layout: its settings come first, so --set still wins.
      HeteroShardRun hs;
      if (!a->src.hetero_config.empty()) hs = hetero_run_settings_file(a->src.hetero_config);
      // The file's level yields to --log-level and to a valid ALLOY_LOG_LEVEL (main sets the
      // variable for the flag).
      if (!hs.log_level.empty() && !log_level_from_env()) set_log_level(parse_log_level(hs.log_level));
      if (a->hs_resume_step >= 0) hs.resume_step = a->hs_resume_step;
      if (!a->hs_checkpoint_dir.empty()) hs.config_overrides.push_back("output.dir=" + a->hs_checkpoint_dir);
      std::vector<std::string> sets = hs.config_overrides;
      sets.insert(sets.end(), a->sets.begin(), a->sets.end());
      // Megatron's flags, like Alloy's other flags, come after --set: given later, they win.
      const MegatronTranslation mt = translate_megatron_args(a->megatron, a->own_flags);
      sets.insert(sets.end(), mt.sets.begin(), mt.sets.end());
      const SynerFuseArgs& sf = a->src.synerfuse;
      if (sf.num_layers > 0) sets.push_back("model.layers=" + std::to_string(sf.num_layers));
      // The global batch before the micro-batch: the config checks that one divides the other.
      if (sf.global_batch_size > 0) sets.push_back("train.global_batch=" + std::to_string(sf.global_batch_size));
      // Megatron's --micro-batch-size is every rank's micro-batch, with or without a SynerFuse layout.
      if (sf.micro_batch_size < 0 || (sf.micro_batch_size == 0 && a->micro_batch_given))
        throw InputError("--micro-batch-size", "must be >= 1, got " + std::to_string(sf.micro_batch_size));
      if (sf.micro_batch_size > 0) sets.push_back("train.micro_batch=" + std::to_string(sf.micro_batch_size));
      for (auto& o : safusion_overrides(*a)) sets.push_back(o);
      for (auto& o : sharding_overrides(*a)) sets.push_back(o);
      for (auto& o : lora_overrides(*a)) sets.push_back(o);
      if (a->bf16) sets.push_back("train.precision=bf16");
      if (a->fp16) sets.push_back("train.precision=fp16");
      if (a->grad_bf16) sets.push_back("grad_sync.dtype=bf16");
      Config cfg = Config::load(a->config, sets);
      if (mt.warmup_fraction) cfg.train.warmup = std::llround(*mt.warmup_fraction * static_cast<double>(cfg.train.steps));
      dist::Rendezvous rv = dist::resolve_rendezvous(a->rv);
      if (!a->src.hetero_config.empty() && rv.source == "single process" && hs.stage_addresses.size() > 1)
        rv = dist::rendezvous_by_address(hs.stage_addresses, hs.coordinator_address, a->src.hetero_config, a->rv.master_port);
      if (rv.rank == 0)
        for (const auto& n : mt.notes) log_info(n);
      const std::string& fusion = cfg.grad_sync.fusion;
      if (a->threshold > 0 && rv.rank == 0 && cfg.grad_sync.lossy() && (fusion == "saf-adaptive" || fusion == "omgs" || fusion == "cupcake"))
        log_info("--threshold " + std::to_string(a->threshold) + ": fusion " + fusion +
                 " cuts its buffers from the measured backward and exchange times, so the size shapes the first steps "
                 "only (grad_sync.fusion bucket keeps it)");
      if (sf.global_batch_size > 0) cfg.train.global_batch = sf.global_batch_size;
      if (static_cast<size_t>(rv.rank) < hs.stage_devices.size() && !hs.stage_devices[static_cast<size_t>(rv.rank)].empty() &&
          !std::getenv("ALLOY_DEVICE"))
        cfg.train.device = hetero_device(hs.stage_devices[static_cast<size_t>(rv.rank)], a->src.hetero_config, rv.rank);
      std::shared_ptr<dist::World> world;
      int exit_code = 0;
      if (rv.world_size > 1) {
        if (!std::getenv("ALLOY_OUTPUT_PREFIXED")) set_log_prefix("[rank " + std::to_string(rv.rank) + "] ");
        world = dist::World::create(rv, std::chrono::milliseconds(static_cast<int64_t>(a->timeout_s * 1000)));
        if (a->stall_s >= 0) world->set_stall_seconds(a->stall_s);
      }
      try {
        train::ResolvedPlan rp = train::resolve_plan(cfg, a->src, rv.world_size, world.get());
        train::TrainOptions o;
        std::string load_weights_only;  // --load of a Megatron checkpoint, or --load with --finetune
        if (mt.finetune && (!a->resume_from.empty() || a->resume || hs.resume_step >= 0))
          throw InputError("--finetune", "starts from --load's weights at step 0: it cannot be combined with --resume, --resume-from or "
                                         "resume_step");
        if (mt.finetune && mt.load.empty()) throw InputError("--finetune", "needs --load DIR: the checkpoint whose weights start the run");
        std::string own;  // a restarted job's own progress (output.dir, Megatron's --save) comes first
        const bool restarting = a->auto_resume || train::restart_count() > 0;
        if (!a->resume_from.empty()) o.resume = a->resume_from;
        else if (a->resume) o.resume = cfg.output.dir;
        else if (hs.resume_step >= 0) o.resume = hetero_resume_dir(cfg, hs, a->src.hetero_config);
        else if (restarting && !(own = train::last_checkpoint_agreed(cfg, world.get())).empty()) o.resume = own;
        else if (!mt.load.empty()) {
          // Megatron's --load: the latest complete checkpoint there (every rank agrees which), or
          // a fresh start when there is none; with --finetune its weights only. Where that is a
          // Megatron-LM checkpoint, its weights start the run (Alloy's own checkpoints there, from an
          // earlier run saving into the same directory, come first).
          Config from = cfg;
          from.output.dir = mt.load;
          const std::string latest = train::last_checkpoint_agreed(from, world.get());
          if (!latest.empty()) {
            (mt.finetune ? load_weights_only : o.resume) = latest;
          } else if (model::is_megatron_checkpoint(mt.load)) {
            load_weights_only = mt.load;
            if (rv.rank == 0)
              log_info("--load " + mt.load + " is a Megatron-LM checkpoint: its weights start this run at step 0; its optimizer state, "
                       "iteration and RNG states are not read (as with Megatron's --finetune)");
          } else if (mt.finetune) {
            throw InputError("--load", mt.load + " holds no complete checkpoint to fine-tune from (--finetune)");
          }
        }
        if (!load_weights_only.empty() && !a->init_weights.empty())
          throw InputError("--init-from", "and --load " + mt.load + " (" + (mt.finetune ? "with --finetune" : "a Megatron-LM checkpoint") +
                                              ") both give the starting weights: keep one");
        if (hs.visualize && rv.rank == 0 && rp.plan) {
          std::string format = hs.visualization_format;
          // A build without Graphviz still draws: as Mermaid text, instead of failing the run.
          if (format != "mmd" && !viz::diagram_renders()) {
            log_warn(a->src.hetero_config + ": training.visualization_format " + format +
                     " needs Graphviz, which this build lacks: writing architecture.mmd (Mermaid) instead");
            format = "mmd";
          }
          const std::string path = cfg.output.dir + "/architecture." + format;
          ensure_writable_dir(cfg.output.dir);
          // A hetero_config.json's machines and devices (its links assumed, and said so), as
          // HeteroShard draws them; without one, a box per pipeline.
          std::optional<plan::ClusterSpec> hosts;
          if (!a->src.hetero_config.empty()) hosts = plan::load_cluster(a->src.hetero_config);
          viz::write_diagram({rp.plan.get(), hosts ? &*hosts : nullptr, cfg.model.layers, {}}, path);
          log_info("wrote the plan's diagram to " + path + " (" + a->src.hetero_config + ": training.visualize)");
        }
        o.init_weights = a->init_weights.empty() ? load_weights_only : a->init_weights;
        o.trace = a->trace;
        o.trace_step = a->trace_step;
        o.world = world;
        train::TrainResult all = train::train_with_replanning(cfg, o, rp);
        if (all.stopped_for_rejoin) exit_code = dist::kExitRejoin;
        else if (rv.rank == 0) print_summary(all);
      } catch (const std::exception& e) {
        if (!world) throw;
        // Tell the others why, then leave at once: tearing down process groups whose peers are
        // gone can block, and a stuck rank is what this path exists to prevent.
        world->report_exit(e.what());
        // Most distributed errors already name this rank first; say it once.
        const std::string own = "rank " + std::to_string(rv.rank) + ": ";
        const std::string msg = e.what();
        std::fprintf(stderr, "alloy: error: %s%s\n", msg.rfind(own, 0) == 0 ? "" : own.c_str(), msg.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        // Rank 0 hosts the store: linger a moment so the others can still read why before it goes.
        if (rv.rank == 0 && world->size() > 1) std::this_thread::sleep_for(std::chrono::seconds(3));
        ::_exit(1);
      }
      std::fflush(stdout);
      if (world) {
        world->all().barrier();  // nobody tears down a group a peer still uses
      }
      return exit_code;
    };
  });
}

}  // namespace alloy::cli
