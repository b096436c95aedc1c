#pragma once
// Process-wide settings for a training process, applied once at the start of main().
namespace alloy {

// glibc serves allocations above 128 KiB-32 MiB (adaptive) with mmap and returns them with munmap,
// so a training loop that frees and reallocates the same activation-sized tensors every micro-batch
// pays fresh page faults each time (measured: 165k faults in 12 steps of a 4-block model). Keeping
// such blocks in the heap and not trimming it cut the faults to 71k; the step-time gain (0-6% in
// paired runs) is within this machine's noise.
// Environment variables (MALLOC_MMAP_THRESHOLD_ etc.) still win if the user set them.
void tune_allocator_for_training();

}  // namespace alloy
