// Megatron's model and training flags (SynerFuse's run.sh) in Alloy's config keys.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/core/megatron_args.h"
#include "expect_error.h"

using alloy::Config;
using alloy::InputError;
using alloy::MegatronTranslation;
using alloy::translate_megatron_args;

namespace {

std::string error_of(const std::vector<std::string>& argv) {
  try {
    translate_megatron_args(argv);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// SynerFuse's published run.sh, its arguments but the parallelism ones `alloy train` declares
// itself (--micro-batch-size, --global-batch-size, --hetero-pipeline-stages, --bf16, ...).
TEST(MegatronArgs, RunShsFlagsBecomeTheConfigTheyDescribe) {
  const std::vector<std::string> run_sh = {
      "--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "688", "--num-attention-heads", "8",
      "--seq-length", "64", "--max-position-embeddings", "64", "--group-query-attention", "--num-query-groups", "2",
      "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/data/tokenizer.model", "--swiglu", "--use-flash-attn",
      "--use-rotary-position-embeddings", "--no-position-embedding", "--disable-bias-linear",
      "--train-iters", "5", "--weight-decay", "1e-2", "--clip-grad", "1.0", "--attention-softmax-in-fp32",
      "--lr", "0.00015", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".2", "--lr-decay-iters", "20",
      "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--attention-dropout", "0", "--hidden-dropout", "0",
      "--untie-embeddings-and-output-weights", "--distributed-backend", "nccl", "--initial-loss-scale", "65536",
      "--min-loss-scale", "1.0", "--loss-scale-window", "1024", "--transformer-impl", "transformer_engine",
      "--data-path", "data/merged", "--split", "1", "--log-interval", "1", "--timing-log-level", "1",
      "--init-method-std", "0.02", "--seed", "1234"};
  const MegatronTranslation t = translate_megatron_args(run_sh);
  Config c = Config::from_yaml_string("model: {arch: gpt2}\n", "test", t.sets);
  EXPECT_EQ(c.model.arch, "llama");
  EXPECT_EQ(c.model.layers, 8);
  EXPECT_EQ(c.model.hidden, 256);
  EXPECT_EQ(c.model.ffn, 688);
  EXPECT_EQ(c.model.heads, 8);
  EXPECT_EQ(c.model.kv_heads, 2);
  EXPECT_EQ(c.model.seq_len, 64);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.02);
  EXPECT_EQ(c.train.steps, 5);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.00015);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 6.0e-6);
  EXPECT_EQ(c.train.decay_steps, 20);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 1e-2);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 1.0);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.train.loss_scale_init, 65536);
  EXPECT_EQ(c.train.loss_scale_window, 1024);
  EXPECT_EQ(c.train.log_interval, 1);
  EXPECT_EQ(c.train.seed, 1234);
  EXPECT_EQ(c.data.prefix, "data/merged");
  ASSERT_TRUE(t.warmup_fraction.has_value());
  EXPECT_DOUBLE_EQ(*t.warmup_fraction, 0.2);
  EXPECT_TRUE(t.load.empty());
  // What changes nothing here is said, flag by flag; the architecture switches select llama once.
  auto noted = [&](const std::string& flag) {
    for (const auto& n : t.notes)
      if (n.rfind(flag, 0) == 0) return true;
    return false;
  };
  EXPECT_EQ(c.data.split, "1");
  // LLaMA's tokenizer is SentencePiece's, run in the alloy-spm helper.
  EXPECT_EQ(c.data.tokenizer, "sentencepiece");
  EXPECT_EQ(c.data.tokenizer_model, "/data/tokenizer.model");
  EXPECT_TRUE(c.data.add_bos);  // Llama2Tokenizer starts every text with <s>
  for (const char* f : {"--use-flash-attn", "--distributed-backend",
                        "--transformer-impl", "--min-loss-scale", "--attention-dropout", "--max-position-embeddings", "--swiglu"})
    EXPECT_TRUE(noted(f)) << f;
  int arch_sets = 0;
  for (const auto& s : t.sets) arch_sets += s == "model.arch=llama";
  EXPECT_EQ(arch_sets, 1);
}

// As Megatron: --num-query-groups counts only under --group-query-attention, which alone means one.
TEST(MegatronArgs, QueryGroupsNeedGroupQueryAttention) {
  auto kv = [](const std::vector<std::string>& argv) {
    return Config::from_yaml_string("model: {arch: llama, heads: 4, hidden: 64}\n", "test", translate_megatron_args(argv).sets).model.kv_heads;
  };
  EXPECT_EQ(kv({"--num-query-groups", "2"}), 0);  // every head its own keys and values
  EXPECT_EQ(kv({"--num-query-groups", "2", "--group-query-attention"}), 2);
  EXPECT_EQ(kv({"--group-query-attention"}), 1);
  EXPECT_FALSE(translate_megatron_args({"--num-query-groups", "2"}).notes.empty());
}

// --add-qkv-bias (Qwen-style blocks) is model.qkv_bias; on a GPT model, whose projections always
// have biases, the config refuses it by its key.
TEST(MegatronArgs, AddQkvBiasIsTheLlamasQkvBias) {
  const auto sets = translate_megatron_args({"--swiglu", "--add-qkv-bias"}).sets;
  EXPECT_TRUE(Config::from_yaml_string("model: {arch: gpt2}\n", "test", sets).model.qkv_bias);
  EXPECT_FALSE(Config::from_yaml_string("model: {arch: gpt2}\n", "test", translate_megatron_args({"--swiglu"}).sets).model.qkv_bias);
  try {
    Config::from_yaml_string("model: {arch: gpt2}\n", "test", translate_megatron_args({"--add-qkv-bias"}).sets);
    FAIL() << "expected an error";
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "model.qkv_bias");
  }
}

TEST(MegatronArgs, CheckpointsLogsAndTheGpt2Tokenizer) {
  const MegatronTranslation t = translate_megatron_args({"--save", "runs/x", "--load=runs/y", "--save-interval", "50",
                                                          "--eval-interval", "25", "--eval-iters", "3",
                                                          "--tensorboard-dir", "tb/x", "--tokenizer-type", "GPT2BPETokenizer"});
  Config c = Config::from_yaml_string("", "test", t.sets);
  EXPECT_EQ(c.output.dir, "runs/x");
  EXPECT_EQ(t.load, "runs/y");
  EXPECT_EQ(c.train.checkpoint_interval, 50);
  EXPECT_EQ(c.train.eval_interval, 25);
  EXPECT_EQ(c.train.eval_batches, 3);
  EXPECT_TRUE(c.output.tensorboard);
  EXPECT_EQ(c.output.tensorboard_dir, "tb/x");
  EXPECT_EQ(c.data.tokenizer, "gpt2");
}

TEST(MegatronArgs, WhatAlloyCannotHonourIsAnErrorNamingTheFlag) {
  EXPECT_HAS(error_of({"--lr-decay-styel", "cosine"}), "--lr-decay-styel: unknown flag (did you mean --lr-decay-style?)");
  EXPECT_HAS(error_of({"--lr-decay-style", "linear"}), "--lr-decay-style: Alloy decays the learning rate by cosine");
  EXPECT_HAS(error_of({"--attention-dropout", "0.1"}), "--attention-dropout: Alloy's pretraining has no dropout");
  EXPECT_HAS(error_of({"--normalization", "Foo"}), "Alloy has RMSNorm (model.arch=llama) and LayerNorm (gpt2)");
  EXPECT_HAS(error_of({"--distributed-backend", "mpi"}), "must be nccl or gloo");
  EXPECT_HAS(error_of({"--optimizer", "sgd"}), "Alloy trains with AdamW");
  EXPECT_HAS(error_of({"--lr-warmup-fraction", "1.5"}), "must be in [0, 1]");
  EXPECT_HAS(error_of({"--hidden-size"}), "--hidden-size: needs a value");
  EXPECT_HAS(error_of({"--hidden-size", "--lr", "1"}), "--hidden-size: needs a value");
  EXPECT_HAS(error_of({"--hidden-size", "big"}), "--hidden-size: needs a whole number, got 'big'");
  EXPECT_HAS(error_of({"--lr", "fast"}), "--lr: needs a number, got 'fast'");
  EXPECT_HAS(error_of({"--swiglu=1"}), "--swiglu: takes no value");
  EXPECT_HAS(error_of({"256"}), "unexpected value '256'");
  EXPECT_HAS(error_of({"--seq-length", "1024", "--max-position-embeddings", "512"}), "512 is less than --seq-length 1024");
  EXPECT_HAS(error_of({"--lr-warmup-iters", "10", "--lr-warmup-fraction", ".1"}), "both given");
  // The caller's own flags are suggested too.
  try {
    translate_megatron_args({"--pland", "auto"}, {"--plan", "--profile"});
    ADD_FAILURE() << "--pland accepted";
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "did you mean --plan?");
  }
  // A value the flag accepts but the config refuses is named by the config's key.
  const MegatronTranslation t = translate_megatron_args({"--num-attention-heads", "0"});
  try {
    Config::from_yaml_string("", "flags", t.sets).validate();
    ADD_FAILURE() << "0 heads accepted";
  } catch (const InputError& e) {
    EXPECT_HAS(e.what(), "heads");
  }
  // LayerNorm and learned positions are GPT-2's: they select nothing.
  const MegatronTranslation g = translate_megatron_args({"--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute"});
  EXPECT_TRUE(g.sets.empty());
  EXPECT_EQ(Config::from_yaml_string("model: {arch: gpt2}\n", "test", g.sets).model.arch, "gpt2");
  const MegatronTranslation r = translate_megatron_args({"--normalization", "RMSNorm"});
  EXPECT_EQ(Config::from_yaml_string("", "test", r.sets).model.arch, "llama");
}

TEST(MegatronArgs, TheReferenceListsEveryFlagOnce) {
  const std::string ref = alloy::megatron_flags_reference();
  for (const char* f : {"--hidden-size V", "--swiglu ", "--lr V", "--train-iters V", "--tensorboard-dir V", "--load V"})
    EXPECT_HAS(ref, f);
  EXPECT_EQ(alloy::megatron_flag_arity("--swiglu"), 0);
  EXPECT_EQ(alloy::megatron_flag_arity("--lr"), 1);
  EXPECT_EQ(alloy::megatron_flag_arity("--no-such-flag"), -1);
}
