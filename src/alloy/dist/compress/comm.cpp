#include "alloy/dist/compress/comm.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <deque>

#include "alloy/core/error.h"
#include "alloy/dist/world.h"

namespace alloy::dist::compress {

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Point-to-point tags of posted all-gathers in a gradient-sync group (nothing else sends there).
constexpr int kPostedTagBase = 0x5a170000;
constexpr int kPostedTags = 4096;

class GroupComm : public Comm {
 public:
  explicit GroupComm(Group& g) : g_(g) {}

  void post_allgather(int64_t numel, at::ScalarType dtype) override {
    if (size() == 1) return;
    posted_.push_back({numel, dtype, g_.post_gather(numel, dtype, kPostedTagBase + static_cast<int>(posted_seq_++ % kPostedTags))});
  }

  int cancel_posted() override {
    const int n = static_cast<int>(posted_.size());
    posted_.clear();  // PostedGather aborts what it posted
    return n;
  }

  int size() const override { return g_.size(); }
  int rank() const override { return g_.rank(); }
  std::string name() const override { return g_.name(); }

  void allreduce_sum(at::Tensor& t) override {
    wait_work(g_.allreduce_sum(t), "compressed gradient all-reduce in group " + g_.name());
    const int n = size();
    bytes_sent_ += n > 1 ? 2 * (n - 1) * nbytes(t) / n : 0;  // ring: reduce-scatter + all-gather
  }

  std::vector<at::Tensor> allgather(const at::Tensor& t) override {
    if (!posted_.empty() && posted_.front().numel == t.numel() && posted_.front().dtype == t.scalar_type()) return gather_posted(t);
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

  at::Tensor alltoall_rows(const at::Tensor& in, const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows) override {
    int64_t total = 0;
    for (int64_t r : out_rows) total += r;
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape[0] = total;
    at::Tensor out = at::empty(shape, in.options());
    at::Tensor src = in.contiguous();
    wait_work(g_.alltoall_rows(out, src, out_rows, in_rows), "compressed gradient all-to-all in group " + g_.name());
    const int64_t row_bytes = in.size(0) > 0 ? nbytes(in) / in.size(0) : 0;
    for (int i = 0; i < size(); ++i)
      if (i != rank()) bytes_sent_ += in_rows[static_cast<size_t>(i)] * row_bytes;
    return out;
  }

 private:
  struct Posted {
    int64_t numel = 0;
    at::ScalarType dtype = at::kInt;
    PostedGather gather;
  };

  std::vector<at::Tensor> gather_posted(const at::Tensor& t) {
    Posted p = std::move(posted_.front());
    posted_.pop_front();
    std::vector<at::Tensor> out = p.gather.finish(t, "compressed gradient all-gather in group " + g_.name());
    for (auto& o : out) o = o.view(t.sizes());
    out[static_cast<size_t>(rank())] = out[static_cast<size_t>(rank())].clone();  // the caller's tensor stays its own
    bytes_sent_ += (size() - 1) * nbytes(t);  // to each other member, as the ring forwards
    return out;
  }

  Group& g_;
  std::deque<Posted> posted_;
  uint64_t posted_seq_ = 0;
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
  at::Tensor alltoall_rows(const at::Tensor& in, const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows) override {
    auto all = hub_.meet(rank_, in);
    auto counts = hub_.meet(rank_, at::tensor(in_rows, at::TensorOptions().dtype(at::kLong)));
    std::vector<at::Tensor> parts;
    for (int m = 0; m < size(); ++m) {
      const auto* c = counts[static_cast<size_t>(m)].data_ptr<int64_t>();
      int64_t first = 0;
      for (int j = 0; j < rank_; ++j) first += c[j];
      if (c[rank_] != out_rows[static_cast<size_t>(m)])
        throw Error("all-to-all: member " + std::to_string(m) + " sent " + std::to_string(c[rank_]) + " rows, " +
                    std::to_string(out_rows[static_cast<size_t>(m)]) + " expected");
      parts.push_back(all[static_cast<size_t>(m)].narrow(0, first, c[rank_]));
    }
    const int64_t row_bytes = in.size(0) > 0 ? nbytes(in) / in.size(0) : 0;
    for (int i = 0; i < size(); ++i)
      if (i != rank_) bytes_sent_ += in_rows[static_cast<size_t>(i)] * row_bytes;
    return at::cat(parts);
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
