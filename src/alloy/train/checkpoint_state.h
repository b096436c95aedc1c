#pragma once
// A checkpoint's state.json: what it says and whether the checkpoint's files are what it lists.
// Kept apart from the rest of train/checkpoint (no LibTorch), so the fuzz target for outside
// input calls the very code that reads it.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"

namespace alloy::train {

inline constexpr const char* kCheckpointFormat = "alloy-checkpoint";
inline constexpr int kCheckpointVersion = 2;

struct CheckpointState {
  int64_t step = 0;               // optimizer steps completed
  uint64_t consumed_samples = 0;  // position in the sample stream
  int64_t optimizer_steps = 0;
  Config config;
  int world_size = 1;
  nlohmann::json plan;            // the plan that wrote it (informational)
  // LoRA runs save only what trains (the adapters): the frozen base comes from BASE again (the
  // run's --init-from: a safetensors file or checkpoint), or from the seed when it is empty.
  std::string base;
  // Dynamic loss scaling's state (train.precision fp16): its scale (0 = not scaling) and the finite
  // steps since it last changed, so a resumed run scales exactly as an uninterrupted one.
  double loss_scale = 0;
  int64_t loss_scale_good_steps = 0;
};

// Reads and validates state.json; throws InputError naming the file and field.
CheckpointState read_checkpoint_state(const std::string& ckpt_dir);
// Why the checkpoint in DIR cannot be used (a missing file, a size or CRC32C that differs from
// state.json's list, no state.json); empty when it checks out.
std::string checkpoint_problem(const std::string& dir);
// Every regular file of DIR but state.json: {NAME: {"bytes", "crc32c"}}, what state.json lists.
nlohmann::json file_manifest(const std::string& dir);

}  // namespace alloy::train
