#include "alloy/train/rank_device.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <cstdlib>

#include "alloy/core/error.h"
#include "alloy/dist/rendezvous.h"

namespace alloy::train {

void configure_threads(int64_t threads) {
  if (threads <= 0) return;
  at::set_num_threads(static_cast<int>(threads));
  // OpenBLAS keeps its own pool, which at::set_num_threads does not reach.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(static_cast<int>(threads));
}

at::Device parse_device(const std::string& spec, const std::string& field) {
  const bool cuda = spec.rfind("cuda", 0) == 0;
  const bool valid = spec == "cpu" || spec == "cuda" ||
                     (cuda && spec.size() > 5 && spec[4] == ':' && spec.find_first_not_of("0123456789", 5) == std::string::npos);
  if (!valid) throw InputError(field, "unknown device '" + spec + "' (expected cpu, cuda or cuda:N)");
  if (cuda && !at::hasCUDA())
    throw InputError(field, "'" + spec + "' asked for, but this LibTorch build has no CUDA or no GPU is visible");
  at::Device d(spec);
  if (d.is_cuda() && d.has_index() && d.index() >= static_cast<int>(at::getNumGPUs()))
    throw InputError(field, "'" + spec + "' asked for, but only " + std::to_string(at::getNumGPUs()) + " GPU(s) are visible");
  return d;
}

std::string device_for_local_rank(const std::string& spec, int local_rank, int num_gpus) {
  if (spec != "cuda" || local_rank < 0 || num_gpus < 2) return spec;
  return "cuda:" + std::to_string(local_rank % num_gpus);
}

std::string rank_device(const Config& cfg) {
  const char* env = std::getenv("ALLOY_DEVICE");
  if (env && *env) return parse_device(env, "ALLOY_DEVICE").str();
  const at::Device d = parse_device(cfg.train.device, "train.device");
  if (!d.is_cuda() || d.has_index()) return d.str();
  return parse_device(device_for_local_rank("cuda", dist::local_rank_from_env(), static_cast<int>(at::getNumGPUs())), "train.device").str();
}

}  // namespace alloy::train
