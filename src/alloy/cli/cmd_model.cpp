#include <cstdio>
#include <filesystem>

#include "alloy/cli/commands.h"
#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/json_file.h"
#include "alloy/core/fs.h"
#include "alloy/data/tokenizer.h"
#include "alloy/core/log.h"
#include "alloy/model/megatron_checkpoint.h"
#include "alloy/model/weights.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/evaluate.h"
#include "alloy/train/trainer.h"

namespace alloy::cli {

namespace {
struct ModelArgs {
  std::string config, weights, text, checkpoint, output, hf_config, prompt, megatron;
  std::vector<std::string> sets;
  train::SampleOptions sample;
  int64_t threads = 0;
  bool merge = false;
};

std::string dir_of(const std::string& file) {
  auto p = std::filesystem::path(file).parent_path();
  return p.empty() ? "." : p.string();
}
}  // namespace

void add_model_commands(CLI::App& app, Action& action) {
  auto a = std::make_shared<ModelArgs>();

  auto* ev = app.add_subcommand("eval", "Mean next-token loss of a model on a text file; prints {\"loss\", \"tokens\"}");
  ev->add_option("-c,--config", a->config, "Config (model and data.tokenizer are used)")->required()->check(CLI::ExistingFile);
  ev->add_option("--set", a->sets, "Override a config key (repeatable)");
  ev->add_option("-w,--weights", a->weights, "safetensors file or checkpoint directory")->required();
  ev->add_option("--text", a->text, "Text file")->required()->check(CLI::ExistingFile);
  ev->add_option("--threads", a->threads, "Intra-op threads; 0 = all cores");
  ev->callback([a, &action]() {
    action = [a]() {
      Config cfg = Config::load(a->config, a->sets);
      train::configure_threads(a->threads);
      auto tok = data::make_tokenizer(cfg.data.tokenizer, cfg.data.vocab_dir, cfg.data.tokenizer_model, cfg.data.add_bos);
      auto m = train::load_model(cfg.model, a->weights);
      auto r = train::evaluate_tokens(*m, tok->encode(read_file(a->text)));
      if (r.tokens == 0)
        throw InputError(a->text, "has fewer than model.seq_len + 1 = " + std::to_string(cfg.model.seq_len + 1) + " tokens");
      std::printf("%s\n", nlohmann::json({{"loss", r.loss}, {"tokens", r.tokens}}).dump().c_str());
      return 0;
    };
  });

  auto* gen = app.add_subcommand("generate", "Sample text from a checkpoint");
  gen->add_option("--checkpoint", a->checkpoint, "Checkpoint or run directory")->required();
  gen->add_option("-p,--prompt", a->prompt, "Prompt text")->capture_default_str();
  gen->add_option("-n,--max-tokens", a->sample.max_new_tokens, "Tokens to generate")->capture_default_str();
  gen->add_option("--temperature", a->sample.temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  gen->add_option("--top-k", a->sample.top_k, "Sample among the k most likely tokens; 0 = all")->capture_default_str();
  gen->add_option("--seed", a->sample.seed, "Sampling seed")->capture_default_str();
  gen->callback([a, &action]() {
    action = [a]() {
      std::string dir = train::resolve_checkpoint(a->checkpoint);
      Config cfg = train::read_checkpoint_state(dir).config;
      auto tok = data::make_tokenizer(cfg.data.tokenizer, cfg.data.vocab_dir, cfg.data.tokenizer_model, cfg.data.add_bos);
      auto m = train::load_model(cfg.model, dir);
      std::vector<int32_t> prompt = tok->encode(a->prompt);
      if (prompt.empty()) prompt.push_back(tok->eot_id());
      auto out = train::generate(*m, prompt, a->sample);
      std::vector<int32_t> text;
      for (int32_t id : out)
        if (id < tok->vocab_size() && id != tok->eot_id()) text.push_back(id);
      std::printf("%s\n", tok->decode(text).c_str());
      return 0;
    };
  });

  auto* ex = app.add_subcommand("export", "Write a checkpoint's weights as HuggingFace safetensors plus config.json beside it");
  ex->add_option("--checkpoint", a->checkpoint, "Checkpoint or run directory")->required();
  ex->add_option("-o,--output", a->output, "Output .safetensors file")->required();
  ex->add_flag("--merge", a->merge,
               "A LoRA run: fold its adapters into the (dequantized) base and write the whole fine-tuned model");
  ex->callback([a, &action]() {
    action = [a]() {
      std::string dir = train::resolve_checkpoint(a->checkpoint);
      Config cfg = train::read_checkpoint_state(dir).config;
      if (cfg.lora.enabled() && !a->merge)
        throw InputError(dir, "is a LoRA run: its adapters are in the run's adapter/ directory (PEFT's layout); pass --merge "
                              "to fold them into the base and export the whole fine-tuned model");
      if (!cfg.lora.enabled() && a->merge)
        throw InputError("--merge", dir + " is not a LoRA run (lora.rank 0): there are no adapters to fold in");
      auto m = train::load_model(cfg.model, dir);
      ensure_writable_dir(dir_of(a->output));
      std::vector<std::pair<std::string, model::TensorBlob>> blobs;
      int64_t count = 0;
      for (const auto& [n, t] : m->merged_weights()) {
        blobs.emplace_back(n, model::to_blob(t));
        count += t.numel();
      }
      model::write_safetensors(a->output, blobs, {{"format", "pt"}});
      std::string cfg_path = dir_of(a->output) + "/config.json";
      write_file_atomic(cfg_path, model::hf_config(cfg.model).dump(2) + "\n");
      std::printf("wrote %s and %s (%s, %lld parameters%s)\n", a->output.c_str(), cfg_path.c_str(), cfg.model.arch.c_str(),
                  static_cast<long long>(count), cfg.lora.enabled() ? ", LoRA adapters folded in" : "");
      return 0;
    };
  });

  auto* im = app.add_subcommand("import", "Turn HuggingFace safetensors (+ config.json), or a Megatron-LM / SynerFuse checkpoint, "
                                           "into an Alloy checkpoint");
  auto* w = im->add_option("-w,--weights", a->weights,
                           "HuggingFace weights: a .safetensors file, a model directory (model.safetensors, or shards with "
                           "model.safetensors.index.json), or that index file")
                ->check(CLI::ExistingPath);
  auto* meg = im->add_option("--megatron", a->megatron,
                             "Megatron-LM checkpoint (--save's DIR, one iter_NNNNNNN directory in it, or a model_optim_rng.pt): every "
                             "tensor-parallel piece and pipeline stage joined; the model from its saved arguments")
                  ->check(CLI::ExistingPath);
  w->excludes(meg);
  im->add_option("--hf-config", a->hf_config, "HuggingFace config.json (default: beside the weights)");
  im->add_option("-c,--config", a->config, "Alloy config for the other sections (optional; its model section stands for a Megatron "
                                           "checkpoint's arguments when the checkpoint carries none)");
  im->add_option("-o,--output", a->output, "Run directory to create the checkpoint in")->required();
  im->callback([a, &action]() {
    action = [a]() {
      if (a->weights.empty() && a->megatron.empty()) throw InputError("alloy import", "give -w/--weights (HuggingFace) or --megatron DIR");
      if (!a->megatron.empty()) {
        Config cfg = a->config.empty() ? Config{} : Config::load(a->config);
        const model::MegatronCheckpoint ck =
            model::read_megatron_checkpoint(a->megatron, a->config.empty() ? nullptr : &cfg.model, /*only_without_args=*/true,
                                            /*progress=*/true);
        for (const auto& n : ck.notes) log_warn(a->megatron + ": " + n);
        cfg.model = ck.model;
        cfg.output.dir = a->output;
        cfg.validate();
        auto m = model::Transformer::full(cfg.model, 0);
        model::load_megatron_weights(*m, ck);
        std::string dir = train::save_checkpoint(a->output, {0, 0, 0, cfg}, *m, nullptr);
        std::printf("wrote %s (%s, %lld parameters) from %s: %s Megatron code, %d tensor-parallel x %d pipeline piece(s)\n", dir.c_str(),
                    cfg.model.arch.c_str(), static_cast<long long>(m->num_parameters()),
                    ck.iteration < 0 ? "the release checkpoint" : ("iteration " + std::to_string(ck.iteration)).c_str(), ck.code.c_str(),
                    ck.tp, ck.pp);
        return 0;
      }
      if (model::is_megatron_checkpoint(a->weights))
        throw InputError(a->weights, "is a Megatron-LM checkpoint: import it with --megatron");
      const bool is_dir = std::filesystem::is_directory(a->weights);
      std::string hf = !a->hf_config.empty() ? a->hf_config : is_dir ? a->weights + "/config.json" : dir_of(a->weights) + "/config.json";
      if (!file_exists(hf))
        throw InputError(hf, "does not exist: the HuggingFace config.json describes the model (give its path with --hf-config)");
      nlohmann::json j = read_json_file(hf);
      Config cfg = a->config.empty() ? Config{} : Config::load(a->config);
      cfg.model = model::model_config_from_hf(j, hf);
      cfg.output.dir = a->output;
      cfg.validate();
      auto m = model::Transformer::full(cfg.model, 0);
      // A large model comes as shards named by model.safetensors.index.json: one set of weights.
      std::vector<model::SafetensorsFile> files;
      for (const auto& f : model::hf_weight_files(a->weights)) files.push_back(model::SafetensorsFile::open(f));
      std::vector<const model::SafetensorsFile*> ptrs;
      for (const auto& f : files) ptrs.push_back(&f);
      model::load_weights(*m, ptrs, /*allow_extra=*/false);
      std::string dir = train::save_checkpoint(a->output, {0, 0, 0, cfg}, *m, nullptr);
      std::printf("wrote %s (%s, %lld parameters)\n", dir.c_str(), cfg.model.arch.c_str(),
                  static_cast<long long>(m->num_parameters()));
      return 0;
    };
  });
}

}  // namespace alloy::cli
