#include "alloy/dist/tree_allreduce.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "alloy/core/error.h"
#include "alloy/dist/world.h"

namespace alloy::dist {

namespace {
// A Work the tree's thread completes.
class TreeWork : public c10d::Work {
 public:
  void complete(std::exception_ptr e) { finish(std::move(e)); }
};

constexpr int64_t kMaxChunks = 1 << 15;  // chunk indices take 15 bits of a tag
constexpr int kUp = 0, kDown = 1;
// A step of a sum (posting a receive or a send, or waiting for one): its error names the step and
// the peer; the training thread's wait_work on the sum's Work adds the world's failure report once.
template <typename F>
auto step(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::string msg = e.what();
    msg = msg.substr(0, msg.find('\n'));
    throw Error(what + ": " + msg);
  }
}
void wait_step(const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) {
  step(what, [&] { return w->wait(); });  // bounded by the group's timeout
}

int tag_of(int64_t seq, int64_t chunk, int dir) {
  // The sum's sequence number keeps two sums' chunks apart should a late one linger; Gloo matches
  // a pair's messages of one tag in order anyway.
  return static_cast<int>(((seq & 0x3FFF) << 16) | (chunk << 1) | dir);
}
}  // namespace

struct TreeAllreduce::Job {
  at::Tensor flat;
  c10::intrusive_ptr<TreeWork> work;
  int64_t seq = 0;
};

TreeAllreduce::TreeAllreduce(std::shared_ptr<Group> group, SyncTree tree, int64_t chunk_bytes)
    : group_(std::move(group)), tree_(std::move(tree)), chunk_bytes_(std::max<int64_t>(chunk_bytes, 1)), me_(group_->rank()) {
  if (tree_.empty() || tree_.parent.size() != static_cast<size_t>(group_->size()))
    throw Error("group " + group_->name() + ": a sum tree needs one node per member (" + std::to_string(group_->size()) + ")");
  worker_ = std::thread([this] { run(); });
}

TreeAllreduce::~TreeAllreduce() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

c10::intrusive_ptr<c10d::Work> TreeAllreduce::allreduce_sum(at::Tensor& t) {
  if (!t.is_cpu() || !t.is_contiguous())
    throw Error("group " + group_->name() + ": the tree all-reduce sums contiguous host tensors");
  auto job = std::make_unique<Job>();
  job->flat = t.view({-1});
  job->work = c10::make_intrusive<TreeWork>();
  c10::intrusive_ptr<c10d::Work> handle = job->work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job->seq = seq_++;
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return handle;
}

void TreeAllreduce::run() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      sum(job->flat, job->seq);
      job->work->complete(nullptr);
    } catch (...) {
      job->work->complete(std::current_exception());
    }
  }
}

void TreeAllreduce::sum(at::Tensor& flat, int64_t seq) {
  at::NoGradGuard no_grad;
  const int64_t n = flat.numel();
  if (n == 0) return;
  const int64_t elem = static_cast<int64_t>(flat.element_size());
  const int64_t chunk = std::max((chunk_bytes_ + elem - 1) / elem, (n + kMaxChunks - 1) / kMaxChunks);
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto part = [&](const at::Tensor& t, int64_t k) { return t.narrow(0, k * chunk, std::min(chunk, n - k * chunk)); };
  const auto& kids = tree_.children[static_cast<size_t>(me_)];
  const int up = tree_.parent[static_cast<size_t>(me_)];
  auto global = [&](int member) { return group_->ranks()[static_cast<size_t>(member)]; };
  auto what = [&](const char* dir, int member) {
    return "gradient sum (tree) in group " + group_->name() + ": " + dir + " rank " + std::to_string(global(member));
  };

  // Every receive is posted before anything is waited for: Gloo moves a payload only once its
  // receive is posted, so a late post would put a whole transfer on the critical path.
  std::vector<at::Tensor> from_kid;
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> kid_recv(kids.size());
  for (size_t c = 0; c < kids.size(); ++c) {
    from_kid.push_back(at::empty({n}, flat.options()));
    for (int64_t k = 0; k < chunks; ++k) {
      at::Tensor p = part(from_kid[c], k);
      kid_recv[c].push_back(step(what("receiving a partial sum from", kids[c]), [&] { return group_->recv(p, global(kids[c]), tag_of(seq, k, kUp)); }));
    }
  }
  at::Tensor total;  // what comes down from the parent
  std::vector<c10::intrusive_ptr<c10d::Work>> parent_recv;
  if (up >= 0) {
    total = at::empty({n}, flat.options());
    for (int64_t k = 0; k < chunks; ++k) {
      at::Tensor p = part(total, k);
      parent_recv.push_back(step(what("receiving the total from", up), [&] { return group_->recv(p, global(up), tag_of(seq, k, kDown)); }));
    }
  }
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, std::string>> sends;
  auto send_down = [&](const at::Tensor& src, int64_t k) {
    for (int kid : kids) {
      at::Tensor p = part(src, k);
      const std::string text = what("sending the total to", kid);
      sends.emplace_back(step(text, [&] { return group_->send(p, global(kid), tag_of(seq, k, kDown)); }), text);
    }
  };
  // Up: this member's chunk plus its children's, in ascending member order.
  for (int64_t k = 0; k < chunks; ++k) {
    at::Tensor mine = part(flat, k);
    for (size_t c = 0; c < kids.size(); ++c) {
      wait_step(kid_recv[c][static_cast<size_t>(k)], what("receiving a partial sum from", kids[c]));
      mine.add_(part(from_kid[c], k));
    }
    if (up >= 0) {
      const std::string text = what("sending a partial sum to", up);
      sends.emplace_back(step(text, [&] { return group_->send(mine, global(up), tag_of(seq, k, kUp)); }), text);
    } else {
      send_down(flat, k);
    }
  }
  // Down: the total, passed on to the children as it arrives.
  if (up >= 0)
    for (int64_t k = 0; k < chunks; ++k) {
      wait_step(parent_recv[static_cast<size_t>(k)], what("receiving the total from", up));
      send_down(total, k);
    }
  for (auto& [w, text] : sends) wait_step(w, text);
  if (up >= 0) flat.copy_(total);
}

}  // namespace alloy::dist
