#include "alloy/dist/nccl.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "alloy/core/error.h"

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace alloy::dist {

#ifdef USE_C10D_NCCL
namespace {
class NcclCollectives final : public DeviceCollectives {
 public:
  explicit NcclCollectives(c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg) : pg_(std::move(pg)) {}
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor& t) override {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return pg_->allreduce(v, o);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor& t, int root) override {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return pg_->broadcast(v, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<at::Tensor>& out, at::Tensor& in) override {
    std::vector<std::vector<at::Tensor>> outs{out};
    std::vector<at::Tensor> ins{in};
    return pg_->allgather(outs, ins);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};
}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<DeviceCollectives> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                             std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return std::make_unique<NcclCollectives>(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts));
}
#else
bool nccl_built() { return false; }

std::unique_ptr<DeviceCollectives> make_nccl(const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds) {
  throw Error("this build of Alloy has no NCCL (its LibTorch has no CUDA)");
}
#endif

}  // namespace alloy::dist
