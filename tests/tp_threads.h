#pragma once
// A tensor-parallel group of threads in one process, for tests of the model's TP code without
// processes or c10d: each sum waits for every member, adds, and hands the sum back.
#include <ATen/ATen.h>

#include <condition_variable>
#include <mutex>

#include "alloy/model/tensor_parallel.h"

namespace alloy::testing {

class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n) {}
  void sum(at::Tensor& t) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !handing_out_; });  // the previous sum has been taken by everyone
    acc_ = arrived_ == 0 ? t.clone() : acc_ + t;
    if (++arrived_ == n_) handing_out_ = true, cv_.notify_all();
    cv_.wait(lock, [&] { return handing_out_; });
    t.copy_(acc_);
    if (--arrived_ == 0) handing_out_ = false, cv_.notify_all();
  }

 private:
  int n_, arrived_ = 0;
  bool handing_out_ = false;
  at::Tensor acc_;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Sequence parallelism's gathers and reduce-scatters go through TpComm's defaults (sums).
class ThreadComm : public alloy::model::TpComm {
 public:
  ThreadComm(ThreadGroup* g, int rank, int size) : g_(g), rank_(rank), size_(size) {}
  void allreduce_sum(at::Tensor& t) override { g_->sum(t); }
  int size() const override { return size_; }
  int rank() const override { return rank_; }

 private:
  ThreadGroup* g_;
  int rank_, size_;
};

}  // namespace alloy::testing
