#pragma once
// Megatron-LM's model, training, data and logging flags (what SynerFuse's run.sh passes to
// pretrain_gpt.py besides the parallelism flags) in Alloy's config keys, so a run.sh argument list
// can be pasted after `alloy train -c CONFIG`. Like Alloy's other flags they override the config
// file and --set.
//
// Every flag is one of:
//  - mapped: it becomes a config key (--hidden-size -> model.hidden, --lr -> train.lr, ...);
//  - checked: a value Alloy can only honour as it is (--lr-decay-style cosine, --attention-dropout
//    0, a single --data-path); any other value is an error that says what Alloy does instead;
//  - noted: accepted, with one line saying why it changes nothing here (--use-flash-attn: Alloy
//    picks the attention kernel itself). Nothing is accepted silently.
// The parallelism flags (--pipeline-model-parallel-size, --hetero-pipeline-stages, ...) are not
// handled here: `alloy train` declares them itself (plan_convert.h converts them).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace alloy {

struct MegatronTranslation {
  std::vector<std::string> sets;   // "section.key=value", in the order the flags came
  std::vector<std::string> notes;  // flags accepted without effect, each with the reason
  std::optional<double> warmup_fraction;  // --lr-warmup-fraction: train.warmup = round(f x train.steps)
  std::string load;                // --load DIR: resume from DIR's latest checkpoint if it has one
  bool finetune = false;           // --finetune: --load's weights only, from step 0
  // Read and checked once every flag is in (the flags come in any order).
  int64_t num_query_groups = 0, seq_length = 0, max_position_embeddings = 0;
  bool group_query_attention = false, warmup_iters = false;
};

// Translates ARGV (flags and their values, e.g. {"--hidden-size", "256", "--swiglu"}; "--flag=value"
// too). Throws InputError naming the flag for an unknown flag (with the closest known one), a
// missing or ill-typed value, or a value Alloy cannot honour.
// ALSO_KNOWN: the caller's own flag names, offered too when a name is misspelled.
MegatronTranslation translate_megatron_args(const std::vector<std::string>& argv, const std::vector<std::string>& also_known = {});

// 0 for a switch, 1 for a flag with a value, -1 for a name translate_megatron_args does not know.
int megatron_flag_arity(const std::string& name);

// The flags translate_megatron_args knows, one line each with what they become (for --help).
std::string megatron_flags_reference();

}  // namespace alloy
