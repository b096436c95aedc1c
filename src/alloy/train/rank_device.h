#pragma once
// What a rank runs on: its device (train.device, $ALLOY_DEVICE, the local rank's GPU) and its
// intra-op threads. Every command that trains, profiles or plans on this machine asks here.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "alloy/core/config.h"

namespace alloy::train {

// Intra-op threads for LibTorch and OpenBLAS; 0 = leave the defaults.
void configure_threads(int64_t threads);
at::Device parse_device(const std::string& spec, const std::string& field = "train.device");
// This rank's device: $ALLOY_DEVICE (set per rank by `alloy launch --devices`) over train.device,
// where "cuda" without an index is the GPU of the process's local rank (device_for_local_rank), so
// torchrun --nproc_per_node 8, SLURM or mpirun spread a machine's ranks over its GPUs.
// Checked: throws InputError naming the variable or key when unknown or not present.
std::string rank_device(const Config& cfg);
// "cuda" on a machine with NUM_GPUS visible: cuda:LOCAL_RANK (modulo NUM_GPUS: more ranks than
// GPUs share them, as `alloy launch --devices` may). Unchanged: an indexed or non-CUDA SPEC, no
// local rank (-1), or a single visible GPU (a launcher that sets CUDA_VISIBLE_DEVICES per rank).
std::string device_for_local_rank(const std::string& spec, int local_rank, int num_gpus);

}  // namespace alloy::train
