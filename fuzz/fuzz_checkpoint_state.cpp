// Fuzz target: a checkpoint's manifest, state.json (`alloy train --resume`, `alloy eval`,
// `alloy export`): train::read_checkpoint_state and train::checkpoint_problem
// (src/alloy/train/checkpoint_state.cpp, in the LibTorch-free library).
#include "alloy/train/checkpoint_state.h"

#include "fuzz_util.h"

using alloy::InputError;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto& dir = alloy_fuzz::TempDir::get();
  dir.write("state.json", alloy_fuzz::as_view(data, size));
  (void)alloy::train::checkpoint_problem(dir.path());
  try {
    alloy::train::CheckpointState st = alloy::train::read_checkpoint_state(dir.path());
    (void)alloy::model_differences(st.config.model, alloy::ModelConfig());
  } catch (const InputError& e) {
    alloy_fuzz::rejected(e);
  }
  return 0;
}
