#include "alloy/pipeline/device_memory.h"

#include <malloc.h>

#include <mutex>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
// libasan/libtsan export it; GCC ships no header for it.
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

// ALLOY_CUDA_MEMORY: set by CMake for this file alone when the LibTorch has CUDA (c10_cuda among
// its libraries), so a CPU LibTorch needs none of these headers.
#ifdef ALLOY_CUDA_MEMORY
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace alloy::pipeline {

int64_t heap_bytes_in_use() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitizer replaces glibc's allocator, whose statistics then read 0; its own count includes
  // redzones, a few KB per block, small beside the tensors the memory checks compare.
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#endif
  struct mallinfo2 mi = ::mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

bool measures_device_memory(const at::Device& device) {
#ifdef ALLOY_CUDA_MEMORY
  if (device.is_cuda()) return true;
#endif
  return device.is_cpu();
}

#ifdef ALLOY_CUDA_MEMORY
namespace {
// Index 0 of the allocator's per-pool statistics is the aggregate over its pools in every LibTorch
// version (the enum's name moved between namespaces across versions).
constexpr size_t kAggregate = 0;
// The allocator's statistics exist once CUDA is initialised, which LibTorch does lazily at the
// first CUDA tensor; asking before (a rank measuring its baseline) throws "Invalid device argument".
c10::DeviceIndex index_of(const at::Device& d) {
  const c10::DeviceIndex i = d.has_index() ? d.index() : 0;
  static std::once_flag init;
  std::call_once(init, [&] { (void)at::empty({1}, at::TensorOptions().device(at::kCUDA, i)); });
  return i;
}
}  // namespace
#endif

int64_t memory_in_use(const at::Device& device) {
#ifdef ALLOY_CUDA_MEMORY
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device)).allocated_bytes[kAggregate].current;
#endif
  return heap_bytes_in_use();
}

int64_t memory_peak(const at::Device& device) {
#ifdef ALLOY_CUDA_MEMORY
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device)).allocated_bytes[kAggregate].peak;
#endif
  (void)device;
  return -1;
}

void reset_memory_peak(const at::Device& device) {
#ifdef ALLOY_CUDA_MEMORY
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
#endif
  (void)device;
}

}  // namespace alloy::pipeline
