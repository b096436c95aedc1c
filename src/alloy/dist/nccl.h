#pragma once
// Collectives on CUDA tensors through NCCL, for a group whose members all train on CUDA devices
// (World::new_group decides; every member reads the same published devices, so all agree). Gloo
// stays beside it for host tensors and barriers. Only this file's .cpp names NCCL: it is compiled
// with ALLOY_WITH_NCCL (and c10d's USE_C10D_NCCL) when the LibTorch has CUDA (CMakeLists.txt), so
// a CPU LibTorch needs nothing of it and nccl_built() is false there.
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
class Work;
}  // namespace c10d

namespace alloy::dist {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor& t) = 0;
  virtual c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor& t, int root) = 0;
  virtual c10::intrusive_ptr<c10d::Work> allgather(std::vector<at::Tensor>& out, at::Tensor& in) = 0;
  // Point-to-point with group rank PEER. NCCL matches a pair's messages in the order they are
  // posted (no tags), on one stream per communicator for both directions: a transport carrying
  // messages one way only (dist/pipe_channels.h) is what keeps crossing sends from waiting on
  // each other.
  virtual c10::intrusive_ptr<c10d::Work> send(at::Tensor& t, int peer) = 0;
  virtual c10::intrusive_ptr<c10d::Work> recv(at::Tensor& t, int peer) = 0;
};

// Whether this build can make NCCL groups (a CUDA LibTorch with c10d's NCCL backend).
bool nccl_built();
// GPU INDEX's UUID as 32 hex digits, "" without NCCL or when it cannot be read: tells apart ranks
// that each see their own GPU as cuda:0 (CUDA_VISIBLE_DEVICES per rank), and finds two on one.
std::string gpu_uuid(int index);
// An NCCL communicator over STORE's namespace for group rank RANK of SIZE; its collectives time out
// after TIMEOUT. HIGH_PRIORITY: its stream from CUDA's high-priority pool (pipeline channels: c10
// hands out 32 streams per pool and device round-robin, and two communicators on one stream would
// queue one's sends behind the other's pending receives; the groups keep the other pool). Throws
// when the build has no NCCL.
std::unique_ptr<DeviceCollectives> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                             std::chrono::milliseconds timeout, bool high_priority = false);
// Streams per pool and device that c10 hands out before it reuses one.
constexpr int kCudaStreamsPerPool = 32;

}  // namespace alloy::dist
