#include "alloy/core/process.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdlib>

namespace alloy {

void tune_allocator_for_training() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_TOP_PAD_")) return;
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);  // tensors above 256 MiB still get their own mapping
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  ::mallopt(M_TOP_PAD, 64 << 20);
}

void prefer_passive_openmp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || !argv || !argv[0]) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);
  // Exec failed (no /proc?): carry on with the runtime's default waits.
}

}  // namespace alloy
