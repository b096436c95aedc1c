#include "alloy/dist/compress/comm.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "alloy/core/error.h"
#include "alloy/dist/world.h"

namespace alloy::dist::compress {

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

class GroupComm : public Comm {
 public:
  explicit GroupComm(Group& g) : g_(g) {}
  int size() const override { return g_.size(); }
  int rank() const override { return g_.rank(); }
  std::string name() const override { return g_.name(); }

  void allreduce_sum(at::Tensor& t) override {
    wait_work(g_.allreduce_sum(t), "compressed gradient all-reduce in group " + g_.name());
    const int n = size();
    bytes_sent_ += n > 1 ? 2 * (n - 1) * nbytes(t) / n : 0;  // ring: reduce-scatter + all-gather
  }

  std::vector<at::Tensor> allgather(const at::Tensor& t) override {
    std::vector<at::Tensor> out;
    for (int i = 0; i < size(); ++i) out.push_back(at::empty_like(t));
    at::Tensor in = t.contiguous();
    wait_work(g_.allgather(out, in), "compressed gradient all-gather in group " + g_.name());
    bytes_sent_ += (size() - 1) * nbytes(t);  // ring all-gather: every member forwards n-1 blocks
    return out;
  }

  void broadcast(at::Tensor& t, int root) override {
    wait_work(g_.broadcast(t, root), "broadcast in group " + g_.name());
    if (rank() == root) bytes_sent_ += nbytes(t);
  }

 private:
  Group& g_;
};

}  // namespace

std::unique_ptr<Comm> group_comm(Group& group) { return std::make_unique<GroupComm>(group); }

class LocalComm : public Comm {
 public:
  LocalComm(LocalHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int size() const override { return hub_.n_; }
  int rank() const override { return rank_; }
  std::string name() const override { return "local"; }

  void allreduce_sum(at::Tensor& t) override {
    auto all = hub_.meet(rank_, t);
    // Every member sums in rank order, so all get the same bits (as a ring would).
    at::Tensor sum = all[0].clone();
    for (size_t i = 1; i < all.size(); ++i) sum.add_(all[i]);
    t.copy_(sum);
    const int n = size();
    bytes_sent_ += n > 1 ? 2 * (n - 1) * nbytes(t) / n : 0;
  }
  std::vector<at::Tensor> allgather(const at::Tensor& t) override {
    auto all = hub_.meet(rank_, t);
    for (size_t i = 0; i < all.size(); ++i)
      if (!all[i].sizes().equals(t.sizes()) || all[i].scalar_type() != t.scalar_type())
        throw Error("all-gather: member " + std::to_string(i) + " sent a tensor of another size or type");
    bytes_sent_ += (size() - 1) * nbytes(t);
    return all;
  }
  void broadcast(at::Tensor& t, int root) override {
    auto all = hub_.meet(rank_, t);
    t.copy_(all[static_cast<size_t>(root)]);
    if (rank_ == root) bytes_sent_ += nbytes(t);
  }

 private:
  LocalHub& hub_;
  int rank_;
};

LocalHub::LocalHub(int n) : n_(n), slots_(static_cast<size_t>(n)) {}

std::unique_ptr<Comm> LocalHub::member(int rank) { return std::make_unique<LocalComm>(*this, rank); }

std::vector<at::Tensor> LocalHub::meet(int rank, const at::Tensor& in) {
  std::unique_lock<std::mutex> lk(mu_);
  // A member may arrive at the next collective while others still read the last one's result.
  cv_.wait(lk, [&] { return readers_left_ == 0; });
  slots_[static_cast<size_t>(rank)] = in.clone();
  const int64_t gen = generation_;
  if (++arrived_ == n_) {
    last_ = slots_;
    arrived_ = 0;
    readers_left_ = n_;
    ++generation_;
    cv_.notify_all();
  } else {
    cv_.wait(lk, [&] { return generation_ != gen; });
  }
  std::vector<at::Tensor> out;
  for (const auto& t : last_) out.push_back(t.clone());
  if (--readers_left_ == 0) cv_.notify_all();
  return out;
}

}  // namespace alloy::dist::compress
