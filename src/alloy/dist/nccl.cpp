#include "alloy/dist/nccl.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "alloy/core/error.h"

// ALLOY_WITH_NCCL, not USE_C10D_NCCL: a CUDA LibTorch's torch_cuda target hands USE_C10D_NCCL to every
// file that links it, so only CMake's own definition says that the NCCL beside the wheel was found
// and that ALLOY_NCCL is on.
#ifdef ALLOY_WITH_NCCL
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "alloy/dist/collectives_of.h"
#endif

namespace alloy::dist {

#ifdef ALLOY_WITH_NCCL

bool nccl_built() { return true; }

std::string gpu_uuid(int index) {
  try {
    if (index < 0 || index >= c10::cuda::device_count()) return "";
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
    std::string out;
    static const char* hex = "0123456789abcdef";
    for (char b : p->uuid.bytes) {
      const auto u = static_cast<unsigned char>(b);
      out += hex[u >> 4];
      out += hex[u & 15];
    }
    return out;
  } catch (const std::exception&) {
    return "";
  }
}

std::unique_ptr<DeviceCollectives> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                             std::chrono::milliseconds timeout, bool high_priority) {
  auto opts = c10d::ProcessGroupNCCL::Options::create(high_priority);
  opts->timeout = timeout;
  return std::make_unique<CollectivesOf<c10d::ProcessGroupNCCL>>(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts));
}
#else
bool nccl_built() { return false; }
std::string gpu_uuid(int) { return ""; }

std::unique_ptr<DeviceCollectives> make_nccl(const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds, bool) {
  throw Error("this build of Alloy has no NCCL (its LibTorch has no CUDA)");
}
#endif

}  // namespace alloy::dist
