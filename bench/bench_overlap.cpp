// Is gradient sync really overlapped with backward? Run as 2+ ranks (alloy launch --nproc 2 --
// bench_overlap). Each round measures, on the same model and batch:
//   backward alone            (no reducer armed)
//   sync alone                (all buckets reduced after backward, nothing to hide behind)
//   backward with sync        (buckets launched from backward hooks, then waited for)
// and rank 0 prints medians and whether backward+sync < backward + sync.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "alloy/dist/reducer.h"
#include "alloy/dist/world.h"
#include "alloy/core/process.h"
#include "alloy/model/transformer.h"
#include "alloy/train/trainer.h"

using Clock = std::chrono::steady_clock;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  alloy::tune_allocator_for_training();
  std::map<std::string, std::string> a = {{"layers", "4"}, {"hidden", "256"}, {"heads", "4"}, {"seq-len", "128"},
                                          {"batch", "8"},  {"rounds", "7"},  {"bucket-mb", "4"}};
  for (int i = 1; i + 1 < argc; i += 2) a[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto rv = alloy::dist::resolve_rendezvous({});
  auto world = alloy::dist::World::create(rv, std::chrono::seconds(120));
  alloy::train::configure_threads(1);

  alloy::ModelConfig m;
  m.layers = std::stoll(a["layers"]);
  m.hidden = std::stoll(a["hidden"]);
  m.heads = std::stoll(a["heads"]);
  m.seq_len = std::stoll(a["seq-len"]);
  auto model = alloy::model::Transformer::full(m, 1);
  std::vector<int> all;
  for (int r = 0; r < world->size(); ++r) all.push_back(r);
  auto group = world->new_group("bench", all);
  auto params = model->parameters();
  alloy::dist::Reducer::ParamGroup pg{group, {params.rbegin(), params.rend()}};
  alloy::dist::Reducer reducer({pg}, std::stod(a["bucket-mb"]));

  const int64_t B = std::stoll(a["batch"]);
  auto gen = at::detail::createCPUGenerator(world->rank());
  at::Tensor tok = at::randint(m.vocab_size, {B, m.seq_len + 1}, gen, at::kLong);
  auto backward = [&](bool armed) {
    for (auto* p : params) p->tensor.mutable_grad().reset();
    auto loss = alloy::model::Transformer::loss_sum(model->forward(tok.narrow(1, 0, m.seq_len)), tok.narrow(1, 1, m.seq_len));
    world->all().barrier();
    auto t0 = Clock::now();
    if (armed) reducer.arm();
    loss.backward();
    return t0;
  };
  std::vector<double> bwd, sync, both;
  for (int r = 0; r < std::stoi(a["rounds"]) + 1; ++r) {
    auto t0 = backward(false);
    double tb = std::chrono::duration<double>(Clock::now() - t0).count();
    world->all().barrier();
    auto t1 = Clock::now();
    reducer.reduce_all_now();
    reducer.finish();
    double ts = std::chrono::duration<double>(Clock::now() - t1).count();
    auto t2 = backward(true);
    reducer.finish();
    double tbs = std::chrono::duration<double>(Clock::now() - t2).count();
    if (r == 0) continue;  // warm-up round
    bwd.push_back(tb), sync.push_back(ts), both.push_back(tbs);
  }
  double b = median(bwd), s = median(sync), bs = median(both);
  if (world->rank() == 0) {
    std::printf("{\"benchmark\":\"overlap\",\"world\":%d,\"buckets\":%lld,\"grad_mb\":%.1f,\"backward_s\":%.4f,\"sync_s\":%.4f,"
                "\"backward_with_sync_s\":%.4f,\"serial_s\":%.4f,\"hidden_fraction_of_sync\":%.3f,\"overlapped\":%s}\n",
                world->size(), static_cast<long long>(reducer.num_buckets()),
                static_cast<double>(model->num_parameters()) * 4 / 1e6, b, s, bs, b + s, (b + s - bs) / s,
                bs < b + s ? "true" : "false");
  }
  world->all().barrier();
  return 0;
}
