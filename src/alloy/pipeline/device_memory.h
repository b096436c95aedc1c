#pragma once
// Memory a device holds, measured where it lives: the host heap for a CPU rank (mallinfo2), the
// CUDA caching allocator's own statistics for a CUDA rank (bytes in tensors, not the allocator's
// cached reserve, which a later allocation reuses). The profile, the executor's activation peaks
// and ranks.json's model_memory_bytes all read it, so the planner's memory figures for a GPU are
// the GPU's, not the CPU heap beside it.
#include <ATen/ATen.h>

#include <cstdint>

namespace alloy::pipeline {

// The host heap in use (what LibTorch's CPU tensors and everything else hold).
int64_t heap_bytes_in_use();

// Bytes in use on DEVICE now: the heap for a CPU device, the allocator's allocated bytes for a
// CUDA one (in a build with CUDA; else the heap, and measures_device_memory says so).
int64_t memory_in_use(const at::Device& device);
// Whether memory_in_use(DEVICE) reads DEVICE's own memory (false: a CUDA device in a build without
// the allocator's statistics, which then reads the host heap).
bool measures_device_memory(const at::Device& device);

// The allocator's exact peak since the last reset_memory_peak (CUDA devices; -1 elsewhere, where
// callers sample memory_in_use instead).
int64_t memory_peak(const at::Device& device);
void reset_memory_peak(const at::Device& device);

}  // namespace alloy::pipeline
