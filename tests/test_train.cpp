#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/data/prepare.h"
#include "alloy/model/safetensors.h"
#include "alloy/train/checkpoint.h"
#include "alloy/train/optimizer.h"
#include "alloy/train/trainer.h"

namespace fs = std::filesystem;
using alloy::Config;

namespace {
// A small slice of the real fortunes corpus (Debian's `fortunes` package, installed by the
// project's install script) so the loop trains on English text, not noise.
// One copy per process: ctest runs each test in its own process, in parallel, and a shared
// directory that one process recreates while another maps its files crashes the other. Removed
// when the tests end. alloy::remove_tree, not std::filesystem::remove_all: see core/fs.h.
const std::filesystem::path& corpus_dir() {
  static const fs::path dir = fs::temp_directory_path() / ("alloy_train_test_data_" + std::to_string(::getpid()));
  return dir;
}

struct RemoveCorpusAfterTests : ::testing::Environment {
  void TearDown() override {
    alloy::remove_tree(corpus_dir().string());
  }
};
::testing::Environment* const remove_corpus_after_tests = ::testing::AddGlobalTestEnvironment(new RemoveCorpusAfterTests);

const std::string& corpus_prefix() {
  static std::string prefix = [] {
    const fs::path& dir = corpus_dir();
    alloy::remove_tree(dir.string());
    fs::create_directories(dir);
    std::string text = alloy::read_file("/usr/share/games/fortunes/fortunes").substr(0, 60000);
    alloy::write_file_atomic((dir / "corpus.txt").string(), text);
    alloy::data::PrepareOptions o;
    o.inputs = {(dir / "corpus.txt").string()};
    o.output = (dir / "fortunes").string();
    o.valid_fraction = 0.1;
    o.progress = false;
    alloy::data::prepare_dataset(o);
    return o.output;
  }();
  return prefix;
}

Config tiny_config(const std::string& run, const std::string& arch = "gpt2") {
  std::string yaml = "model:\n  arch: " + arch +
                     "\n  layers: 2\n  hidden: 32\n  heads: 4\n  seq_len: 32\n  vocab_size: 257\n"
                     "train:\n  steps: 6\n  global_batch: 4\n  micro_batch: 2\n  lr: 3e-3\n  warmup: 2\n"
                     "  eval_interval: 3\n  eval_batches: 2\n  threads: 1\n"
                     "output:\n  tensorboard: false\n";
  fs::path dir = fs::temp_directory_path() / ("alloy_train_test_" + run);
  alloy::remove_tree(dir.string());
  return Config::from_yaml_string(yaml, "test", {"data.prefix=" + corpus_prefix(), "output.dir=" + dir.string()});
}

std::vector<alloy::train::StepRecord> train(const Config& c, const std::string& resume = "") {
  alloy::train::TrainOptions o;
  o.resume = resume;
  o.quiet = true;
  alloy::train::Trainer t(c, o);
  return t.run().steps;
}
}  // namespace

TEST(Train, ResumeContinuesBitwiseIdentically) {
  for (std::string arch : {"gpt2", "llama"}) {
    Config a = tiny_config("resume_a_" + arch, arch);
    a.train.checkpoint_interval = 3;
    auto straight = train(a);
    ASSERT_EQ(straight.size(), 6u);

    // A second run starts from the first run's step-3 checkpoint, as after a crash at step 4.
    Config b = tiny_config("resume_b_" + arch, arch);
    alloy::ensure_writable_dir(b.output.dir + "/checkpoints");
    fs::copy(a.output.dir + "/checkpoints/step_00000003", b.output.dir + "/checkpoints/step_00000003",
             fs::copy_options::recursive);
    alloy::write_file_atomic(b.output.dir + "/checkpoints/latest", "step_00000003\n");
    auto resumed = train(b, b.output.dir);
    ASSERT_EQ(resumed.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(resumed[i].step, straight[i + 3].step);
      EXPECT_EQ(resumed[i].loss, straight[i + 3].loss) << arch << " step " << resumed[i].step;  // bitwise
    }
    auto wa = alloy::model::SafetensorsFile::open(a.output.dir + "/checkpoints/step_00000006/model.safetensors");
    auto wb = alloy::model::SafetensorsFile::open(b.output.dir + "/checkpoints/step_00000006/model.safetensors");
    for (const auto& n : wa.names()) EXPECT_EQ(wa.bytes(n), wb.bytes(n)) << n;
  }
}

TEST(Train, MicroBatchesAddUpToTheWholeBatch) {
  Config a = tiny_config("micro_a");
  a.train.micro_batch = 1;
  Config b = tiny_config("micro_b");
  b.train.micro_batch = 4;
  auto la = train(a), lb = train(b);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i].loss, lb[i].loss, 1e-5 * lb[i].loss);
}

TEST(Train, LossGoesDownAndMetricsAreWritten) {
  Config c = tiny_config("learns");
  c.train.steps = 30;
  auto steps = train(c);
  ASSERT_EQ(steps.size(), 30u);
  EXPECT_LT(steps.back().loss, steps.front().loss - 1.0);  // from ~ln(257)=5.5 down
  std::string jsonl = alloy::read_file(c.output.dir + "/metrics.jsonl");
  EXPECT_NE(jsonl.find("\"step\":30"), std::string::npos);
  EXPECT_NE(jsonl.find("\"val_loss\""), std::string::npos);
  EXPECT_NE(jsonl.find("\"tokens_per_s\""), std::string::npos);
}

TEST(Train, ResumingWithAnotherModelNamesTheDifferingFields) {
  Config a = tiny_config("other_model_a");
  train(a);
  Config b = tiny_config("other_model_b");
  b.model.layers = 3;
  try {
    train(b, a.output.dir);
    FAIL() << "expected an error";
  } catch (const alloy::InputError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("state.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.layers: 2 vs 3"), std::string::npos) << msg;
  }
}

TEST(Train, BadOutputDirFailsBeforeTraining) {
  Config c = tiny_config("bad_out");
  std::string file = fs::temp_directory_path() / "alloy_not_a_dir";
  alloy::write_file_atomic(file, "x");
  c.output.dir = file + "/run";
  try {
    train(c);
    FAIL() << "expected an error";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(file + "/run"), std::string::npos) << e.what();
  }
}

TEST(Train, CheckpointWithoutStateIsRejectedClearly) {
  fs::path dir = fs::temp_directory_path() / "alloy_bad_ckpt";
  alloy::remove_tree(dir.string());
  fs::create_directories(dir / "checkpoints" / "step_00000001");
  alloy::write_file_atomic((dir / "checkpoints" / "step_00000001" / "state.json").string(), "{\"format\": \"other\"}");
  alloy::write_file_atomic((dir / "checkpoints" / "latest").string(), "step_00000001\n");
  try {
    alloy::train::read_checkpoint_state(alloy::train::resolve_checkpoint(dir.string()));
    FAIL();
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not an Alloy checkpoint"), std::string::npos) << e.what();
  }
}

// On the CPU, fp32 parameters update in one fused loop (core/fused_loops.h); it follows
// torch.optim.AdamW's operators (float64 parameters still run them) within float rounding, with
// and without weight decay, across the chunks the loop is split into.
TEST(AdamW, FusedCpuLoopFollowsTorchsOperators) {
  using alloy::train::AdamW;
  const std::vector<int64_t> sizes = {3, 70001};  // the second spans several parallel chunks
  std::vector<alloy::model::Param> ps;
  for (size_t i = 0; i < sizes.size(); ++i)
    for (bool decay : {false, true})
      ps.push_back({"p" + std::to_string(ps.size()), at::randn({sizes[i]}, at::kFloat), decay});
  std::vector<at::Tensor> w, m, v;
  std::vector<alloy::model::Param*> pp;
  for (auto& p : ps) {
    w.push_back(p.tensor.clone()), m.push_back(at::zeros_like(p.tensor)), v.push_back(at::zeros_like(p.tensor));
    pp.push_back(&p);
  }
  const AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  AdamW opt(pp, o);
  const double lr = 1e-2;
  for (int t = 1; t <= 4; ++t) {
    for (size_t i = 0; i < ps.size(); ++i) {
      at::Tensor g = at::randn_like(ps[i].tensor);
      ps[i].tensor.mutable_grad() = g;
      // torch.optim.AdamW, single-tensor: decay, both moments, the bias-corrected step.
      if (ps[i].decay) w[i].mul_(1 - lr * o.weight_decay);
      m[i].mul_(o.beta1).add_(g, 1 - o.beta1);
      v[i].mul_(o.beta2).addcmul_(g, g, 1 - o.beta2);
      at::Tensor denom = v[i].sqrt().div_(std::sqrt(1 - std::pow(o.beta2, t))).add_(o.eps);
      w[i].addcdiv_(m[i], denom, -lr / (1 - std::pow(o.beta1, t)));
    }
    opt.step(lr);
    opt.zero_grad();
  }
  const auto state = opt.state();
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_TRUE(at::allclose(ps[i].tensor, w[i], 1e-6, 1e-7)) << ps[i].name << ": " << (ps[i].tensor - w[i]).abs().max();
  }
  for (const auto& [name, t] : state) {
    const size_t i = static_cast<size_t>(std::stoi(name.substr(name.find(".p") + 2)));
    const at::Tensor& want = name.rfind("exp_avg_sq.", 0) == 0 ? v[i] : m[i];
    EXPECT_TRUE(at::allclose(t, want, 1e-5, 1e-6)) << name << ": " << (t - want).abs().max();
  }
}

// Sparsely synced parameters: after the exact steps AdamW's second moment stays where it was (with
// a floor for elements those steps never moved) and the update is linear in what arrives.
TEST(AdamW, ReadsSparseArrivalsLinearlyAfterTheExactSteps) {
  using alloy::train::AdamW;
  auto make = [] { return alloy::model::Param{"w", at::zeros({4}, at::kDouble), false}; };
  alloy::model::Param plain = make(), lin = make(), lin2 = make();
  AdamW::Options o{0.9, 0.95, 1e-8, 0.0};
  AdamW a({&plain}, o), b({&lin}, o), c({&lin2}, o);
  b.read_linearly({"w"}, 2, 0.9);
  c.read_linearly({"w"}, 2, 0.9);
  auto step = [](AdamW& opt, alloy::model::Param& p, at::Tensor g) {
    p.tensor.mutable_grad() = g;
    opt.step(1e-2);
    opt.zero_grad();
  };
  // The last element gets no gradient in the exact steps.
  for (auto g : {at::tensor({1.0, -2.0, 0.5, 0.0}, at::kDouble), at::tensor({0.5, -1.0, 1.5, 0.0}, at::kDouble)}) {
    step(a, plain, g);
    step(b, lin, g);
    step(c, lin2, g);
  }
  ASSERT_TRUE(at::equal(plain.tensor, lin.tensor)) << "exact steps are plain AdamW";
  at::Tensor v = b.state()[1].second.clone();
  EXPECT_EQ(v[3].item<double>(), 0.0);

  const at::Tensor w0 = lin.tensor.clone();
  const at::Tensor g = at::tensor({30.0, 0.0, -4.0, 2.0}, at::kDouble);  // an accumulated arrival
  step(b, lin, g);
  step(c, lin2, 2 * g);
  step(a, plain, g);
  at::Tensor floored = v.clamp_min(0.01 * v.mean().item<double>());
  EXPECT_TRUE(at::equal(b.state()[1].second, floored)) << "v frozen at the floored value";
  EXPECT_GT(floored[3].item<double>(), 0.0);
  const double bc2 = 1 - 0.95 * 0.95;
  at::Tensor expect = w0 - 1e-2 * (1 - 0.9) * g / ((floored / bc2).sqrt() + 1e-8);
  EXPECT_TRUE(at::allclose(lin.tensor, expect, 1e-12, 0)) << lin.tensor << expect;
  EXPECT_TRUE(at::allclose(lin2.tensor - w0, 2 * (lin.tensor - w0), 1e-12, 0)) << "linear in the arrival";
  EXPECT_FALSE(at::allclose(plain.tensor, lin.tensor)) << "plain AdamW normalises the arrival away";
}

#include "alloy/train/sweep.h"

// The hybrid_lora_parallel study's "uniform parameter split": a pipeline cut so each stage holds
// about the same parameters. With GPT-2's large embedding the first stage gets fewer blocks.
TEST(Sweep, UniformParameterSplitCutsByParameters) {
  const alloy::train::PartParams gpt2_small{38.6, 7.1, 0.0};  // millions: wte + wpe, a block, the tied head
  EXPECT_EQ(alloy::train::cuts_by_params(2, 12, gpt2_small), (std::vector<int64_t>{3}));    // 59.9 of 123.8
  EXPECT_EQ(alloy::train::cuts_by_params(3, 12, gpt2_small), (std::vector<int64_t>{1, 6}));  // every stage a block
  EXPECT_EQ(alloy::train::cuts_by_params(4, 8, {0, 1, 0}), (std::vector<int64_t>{2, 4, 6}));  // even without ends
  const alloy::Plan p = alloy::train::sweep_plan("pp-params", 2, 12, 8, 2, gpt2_small);
  ASSERT_EQ(p.pipelines.size(), 1u);
  ASSERT_EQ(p.pipelines[0].stages.size(), 2u);
  EXPECT_EQ(p.pipelines[0].stages[0].layer_end, 3);
  EXPECT_EQ(p.pipelines[0].stages[1].layer_begin, 3);
  EXPECT_THROW(alloy::train::sweep_plan("pp-params", 2, 12, 8, 2), alloy::InputError);  // no parameter counts
  EXPECT_EQ(alloy::train::sweep_plan("ddp", 2, 12, 8, 2).pipelines.size(), 2u);          // the study's name for dp
  EXPECT_EQ(alloy::train::sweep_plan("fsdp2", 2, 12, 8, 2).sharding.at(0).stage, 3);
}

// The study's activation-checkpointing axis: LAYOUT+ac is LAYOUT with every stage recomputing.
TEST(Sweep, ActivationCheckpointingIsALayoutSuffix) {
  for (const std::string layout : {"dp", "pp", "zero3", "pp:4"}) {
    const alloy::Plan plain = alloy::train::sweep_plan(layout, 2, 12, 8, 2), ac = alloy::train::sweep_plan(layout + "+ac", 2, 12, 8, 2);
    ASSERT_EQ(ac.pipelines.size(), plain.pipelines.size()) << layout;
    EXPECT_EQ(ac.sharding.size(), plain.sharding.size()) << layout;
    for (size_t q = 0; q < ac.pipelines.size(); ++q) {
      ASSERT_EQ(ac.pipelines[q].stages.size(), plain.pipelines[q].stages.size()) << layout;
      for (size_t s = 0; s < ac.pipelines[q].stages.size(); ++s) {
        EXPECT_TRUE(ac.pipelines[q].stages[s].recompute) << layout;
        EXPECT_FALSE(plain.pipelines[q].stages[s].recompute) << layout;
        EXPECT_EQ(ac.pipelines[q].stages[s].layer_end, plain.pipelines[q].stages[s].layer_end) << layout;
      }
    }
  }
  EXPECT_THROW(alloy::train::sweep_plan("auto+ac", 2, 12, 8, 2), alloy::InputError);
  EXPECT_THROW(alloy::train::sweep_plan("+ac", 2, 12, 8, 2), alloy::InputError);
}

// torchrun --nproc_per_node 8 (or SLURM, mpirun) on an 8-GPU machine: train.device cuda puts each
// rank on its local rank's GPU, not all on the first.
TEST(Device, CudaWithoutAnIndexIsTheLocalRanksGpu) {
  using alloy::train::device_for_local_rank;
  EXPECT_EQ(device_for_local_rank("cuda", 3, 8), "cuda:3");
  EXPECT_EQ(device_for_local_rank("cuda", 9, 8), "cuda:1");   // more ranks than GPUs: they share
  EXPECT_EQ(device_for_local_rank("cuda", 3, 1), "cuda");     // one visible GPU (CUDA_VISIBLE_DEVICES per rank)
  EXPECT_EQ(device_for_local_rank("cuda", -1, 8), "cuda");    // no launcher said
  EXPECT_EQ(device_for_local_rank("cuda:5", 3, 8), "cuda:5"); // the user's index stands
  EXPECT_EQ(device_for_local_rank("cpu", 3, 8), "cpu");
}

// Megatron's --lr-decay-iters (train.decay_steps): the cosine reaches min_lr there and stays;
// 0 decays over train.steps as before.
TEST(LearningRate, DecayEndsAtDecayStepsThenHoldsMinLr) {
  alloy::TrainConfig t;
  t.steps = 100;
  t.warmup = 10;
  t.lr = 1.0;
  t.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(alloy::train::lr_at(t, 4), 0.5);                  // warm-up: (4 + 1) / 10
  EXPECT_NEAR(alloy::train::lr_at(t, 55), 0.55, 1e-12);              // half way through 90 steps of decay
  t.decay_steps = 50;
  EXPECT_NEAR(alloy::train::lr_at(t, 30), 0.55, 1e-12);              // half way through 40
  EXPECT_DOUBLE_EQ(alloy::train::lr_at(t, 50), 0.1);
  EXPECT_DOUBLE_EQ(alloy::train::lr_at(t, 99), 0.1);
  EXPECT_GT(alloy::train::lr_at(t, 49), 0.1);
  EXPECT_DOUBLE_EQ(alloy::train::lr_at(t, 4), 0.5);
  alloy::Config c;
  c.train = t;
  c.train.decay_steps = 10;
  try {
    c.validate();
    ADD_FAILURE() << "decay_steps at the warm-up's end was accepted";
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("train.decay_steps"), std::string::npos) << e.what();
  }
}
