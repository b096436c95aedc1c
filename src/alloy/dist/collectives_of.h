#pragma once
// DeviceCollectives over one c10d process group of type PG (ProcessGroupNCCL in nccl.cpp,
// ProcessGroupGloo for a pair in world.cpp): one set of calls for both, which include PG's header
// before this one.
#include <utility>
#include <vector>

#include "alloy/dist/nccl.h"

namespace alloy::dist {

template <class PG>
class CollectivesOf final : public DeviceCollectives {
 public:
  explicit CollectivesOf(c10::intrusive_ptr<PG> pg) : pg_(std::move(pg)) {}
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
  // One tag: NCCL has none, and Gloo matches a pair's messages of one tag in the order posted.
  c10::intrusive_ptr<c10d::Work> send(at::Tensor& t, int peer) override {
    std::vector<at::Tensor> v{t};
    return pg_->send(v, peer, 0);
  }
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor& t, int peer) override {
    std::vector<at::Tensor> v{t};
    return pg_->recv(v, peer, 0);
  }

 private:
  c10::intrusive_ptr<PG> pg_;
};

}  // namespace alloy::dist
