#pragma once
// Process-wide settings for a training process, applied once at the start of main().
#include <string>
#include <vector>

namespace alloy {

// glibc serves allocations above 128 KiB-32 MiB (adaptive) with mmap and returns them with munmap,
// so a training loop that frees and reallocates the same activation-sized tensors every micro-batch
// pays fresh page faults each time (measured: 165k faults in 12 steps of a 4-block model). Keeping
// such blocks in the heap and not trimming it cut the faults to 71k; the step-time gain (0-6% in
// paired runs) is within this machine's noise.
// Environment variables (MALLOC_MMAP_THRESHOLD_ etc.) still win if the user set them.
void tune_allocator_for_training();

// LibTorch's OpenMP threads and OpenBLAS's own pthread pool each keep a worker per extra core, and
// both spin after their work is done: with two threads per process, an OpenMP worker spinning
// after an element-wise op held the core that OpenBLAS's worker needed for the next matrix
// product, and a Llama training step took 0.53 s instead of 0.17 s (PyTorch from Python, the same
// LibTorch: 0.45 s instead of 0.16 s). OMP_WAIT_POLICY=PASSIVE makes OpenMP workers sleep at once.
// libgomp reads it when it is loaded, before main(), so when it is unset this sets it and re-execs
// the program (/proc/self/exe, same arguments): call it first thing in main(). A value the user
// set is kept. Returns only if no re-exec happened (or it failed).
void prefer_passive_openmp_waits(char** argv);

// Whether ARGV asks `alloy` for --help, --version or `launch` (the subcommand is the first argument
// that is not an option, --log-level's value skipped): main() then skips the re-exec above, whose
// second LibTorch load would be most of the run. `launch` decides itself: it re-execs with the
// ranks' settings only when it forks ranks (cli fork_ranks_when_possible), once, not twice.
bool command_computes_nothing(int argc, char** argv);

// What `ps` shows for a process that runs another command than it was started with (a rank forked
// by `alloy launch`): remember_arguments() keeps where main()'s arguments lie, and
// set_process_title() writes WORDS there (cut to the space the original arguments had; the kernel
// reads /proc/PID/cmdline from it) and NAME (at most 15 characters) as the process's name
// (/proc/PID/comm, what top shows).
void remember_arguments(int argc, char** argv);
void set_process_title(const std::vector<std::string>& words, const std::string& name);

// Whether COMMAND (a path, or a name looked up in PATH) is the executable this process runs.
bool is_this_program(const std::string& command);

}  // namespace alloy
