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

int tag_of(int64_t seq, int stripe, int64_t chunk, int dir) {
  // The sum's sequence number keeps two sums' chunks apart should a late one linger; Gloo matches
  // a pair's messages of one tag in order anyway.
  return static_cast<int>(((seq & 0xFFF) << 18) | (static_cast<int64_t>(stripe) << 16) | (chunk << 1) | dir);
}

// One stripe of a sum on this member: its slice of the buffer and its messages.
struct Slice {
  const SyncTree* tree = nullptr;
  at::Tensor flat;  // the slice of the caller's buffer
  int64_t chunk = 0, chunks = 0;
  std::vector<at::Tensor> from_kid;
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> kid_recv;
  at::Tensor total;  // what comes down from the parent
  std::vector<c10::intrusive_ptr<c10d::Work>> parent_recv;
  at::Tensor part(const at::Tensor& t, int64_t k) const { return t.narrow(0, k * chunk, std::min(chunk, t.numel() - k * chunk)); }
};

std::string what_of(const Group& g, const char* dir, int member) {
  return "gradient sum (tree) in group " + g.name() + ": " + dir + " rank " + std::to_string(g.ranks()[static_cast<size_t>(member)]);
}
}  // namespace

struct TreeAllreduce::Job {
  at::Tensor flat;
  c10::intrusive_ptr<TreeWork> work;
  int64_t seq = 0;
  std::vector<Slice> slices;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, std::string>> sends;
};

TreeAllreduce::TreeAllreduce(std::shared_ptr<Group> group, std::vector<SyncTree> stripes, int64_t chunk_bytes)
    : group_(std::move(group)), stripes_(std::move(stripes)), chunk_bytes_(std::max<int64_t>(chunk_bytes, 1)), me_(group_->rank()) {
  if (stripes_.empty() || static_cast<int>(stripes_.size()) > kMaxStripes)
    throw Error("group " + group_->name() + ": a tree sum takes 1 to " + std::to_string(kMaxStripes) + " trees, not " +
                std::to_string(stripes_.size()));
  for (const SyncTree& t : stripes_)
    if (t.empty() || t.parent.size() != static_cast<size_t>(group_->size()))
      throw Error("group " + group_->name() + ": a sum tree needs one node per member (" + std::to_string(group_->size()) + ")");
  up_worker_ = std::thread([this] { run_up(); });
  down_worker_ = std::thread([this] { run_down(); });
}

TreeAllreduce::~TreeAllreduce() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  up_worker_.join();
  down_worker_.join();
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
    up_queue_.push_back(std::move(job));
  }
  cv_.notify_all();
  return handle;
}

void TreeAllreduce::run_up() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !up_queue_.empty(); });
      if (up_queue_.empty()) {  // stopping, nothing left
        up_done_ = true;
        cv_.notify_all();
        return;
      }
      job = std::move(up_queue_.front());
      up_queue_.pop_front();
    }
    try {
      up(*job);
    } catch (...) {
      job->work->complete(std::current_exception());
      continue;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      down_queue_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
}

void TreeAllreduce::run_down() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return up_done_ || !down_queue_.empty(); });
      if (down_queue_.empty()) return;  // the up thread has ended and handed over everything
      job = std::move(down_queue_.front());
      down_queue_.pop_front();
    }
    try {
      down(*job);
      job->work->complete(nullptr);
    } catch (...) {
      job->work->complete(std::current_exception());
    }
  }
}

void TreeAllreduce::up(Job& job) {
  at::NoGradGuard no_grad;
  const int64_t n = job.flat.numel();
  if (n == 0) return;
  const int64_t elem = static_cast<int64_t>(job.flat.element_size());
  const int64_t S = std::min<int64_t>(static_cast<int64_t>(stripes_.size()), n);
  auto global = [&](int member) { return group_->ranks()[static_cast<size_t>(member)]; };
  // Every receive is posted before anything is waited for: Gloo moves a payload only once its
  // receive is posted, so a late post would put a whole transfer on the critical path.
  int64_t most = 0;
  for (int64_t s = 0; s < S; ++s) {
    Slice sl;
    sl.tree = &stripes_[static_cast<size_t>(s)];
    const int64_t begin = s * n / S, end = (s + 1) * n / S;
    sl.flat = job.flat.narrow(0, begin, end - begin);
    const int64_t len = end - begin;
    sl.chunk = std::max((chunk_bytes_ + elem - 1) / elem, (len + kMaxChunks - 1) / kMaxChunks);
    sl.chunks = (len + sl.chunk - 1) / sl.chunk;
    most = std::max(most, sl.chunks);
    const auto& kids = sl.tree->children[static_cast<size_t>(me_)];
    sl.kid_recv.resize(kids.size());
    for (size_t c = 0; c < kids.size(); ++c) {
      sl.from_kid.push_back(at::empty({len}, job.flat.options()));
      const std::string text = what_of(*group_, "receiving a partial sum from", kids[c]);
      for (int64_t k = 0; k < sl.chunks; ++k) {
        at::Tensor p = sl.part(sl.from_kid[c], k);
        sl.kid_recv[c].push_back(step(text, [&] { return group_->recv(p, global(kids[c]), tag_of(job.seq, static_cast<int>(s), k, kUp)); }));
      }
    }
    const int up = sl.tree->parent[static_cast<size_t>(me_)];
    if (up >= 0 || sl.tree->twin >= 0) sl.total = at::empty({len}, job.flat.options());
    if (up >= 0) {
      const std::string text = what_of(*group_, "receiving the total from", up);
      for (int64_t k = 0; k < sl.chunks; ++k) {
        at::Tensor p = sl.part(sl.total, k);
        sl.parent_recv.push_back(step(text, [&] { return group_->recv(p, global(up), tag_of(job.seq, static_cast<int>(s), k, kDown)); }));
      }
    }
    job.slices.push_back(std::move(sl));
  }
  // Up: this member's chunk plus its children's, in ascending member order (a root with a twin
  // leaves the twin's for the way down); the stripes' chunks taken in turn so every stripe's line
  // carries its share at once.
  for (int64_t k = 0; k < most; ++k)
    for (size_t s = 0; s < job.slices.size(); ++s) {
      Slice& sl = job.slices[s];
      if (k >= sl.chunks) continue;
      const auto& kids = sl.tree->children[static_cast<size_t>(me_)];
      const int up = sl.tree->parent[static_cast<size_t>(me_)];
      const bool root = up < 0, paired = root && sl.tree->twin >= 0;
      at::Tensor mine = sl.part(sl.flat, k);
      for (size_t c = 0; c < kids.size(); ++c) {
        if (paired && kids[c] == sl.tree->twin) continue;
        wait_step(sl.kid_recv[c][static_cast<size_t>(k)], what_of(*group_, "receiving a partial sum from", kids[c]));
        mine.add_(sl.part(sl.from_kid[c], k));
      }
      // A root sends its total down; paired with a twin, its side's partial to the twin only (the
      // twin's comes up as any child's); others send their partial up.
      std::vector<int> to = !root ? std::vector<int>{up} : paired ? std::vector<int>{sl.tree->twin} : kids;
      for (int dest : to) {
        const std::string text = what_of(*group_, root && !paired ? "sending the total to" : "sending a partial sum to", dest);
        job.sends.emplace_back(
            step(text, [&] { return group_->send(mine, global(dest), tag_of(job.seq, static_cast<int>(s), k, root ? kDown : kUp)); }),
            text);
      }
    }
}

void TreeAllreduce::down(Job& job) {
  at::NoGradGuard no_grad;
  auto global = [&](int member) { return group_->ranks()[static_cast<size_t>(member)]; };
  int64_t most = 0;
  for (const Slice& sl : job.slices) most = std::max(most, sl.chunks);
  // Down: the totals, passed on to the children as they arrive. The ends of a root edge first add
  // the other end's partial: the root P_root + P_twin into its total (its own partial is still
  // being sent from the buffer), the twin P_root (received as its total) + P_twin, the same sum.
  for (int64_t k = 0; k < most; ++k)
    for (size_t s = 0; s < job.slices.size(); ++s) {
      Slice& sl = job.slices[s];
      const SyncTree& t = *sl.tree;
      const int up = t.parent[static_cast<size_t>(me_)];
      if (k >= sl.chunks || (up < 0 && t.twin < 0)) continue;
      at::Tensor p = sl.part(sl.total, k);
      const auto& kids = t.children[static_cast<size_t>(me_)];
      if (up < 0) {
        const size_t c = static_cast<size_t>(std::find(kids.begin(), kids.end(), t.twin) - kids.begin());
        wait_step(sl.kid_recv[c][static_cast<size_t>(k)], what_of(*group_, "receiving a partial sum from", t.twin));
        at::add_out(p, sl.part(sl.flat, k), sl.part(sl.from_kid[c], k));
      } else {
        const char* what = me_ == t.twin ? "receiving a partial sum from" : "receiving the total from";
        wait_step(sl.parent_recv[static_cast<size_t>(k)], what_of(*group_, what, up));
        if (me_ == t.twin) p.add_(sl.part(sl.flat, k));
      }
      for (int kid : kids) {
        if (up < 0 && kid == t.twin) continue;
        const std::string text = what_of(*group_, "sending the total to", kid);
        job.sends.emplace_back(step(text, [&] { return group_->send(p, global(kid), tag_of(job.seq, static_cast<int>(s), k, kDown)); }), text);
      }
    }
  for (auto& [w, text] : job.sends) wait_step(w, text);
  for (Slice& sl : job.slices)
    if (sl.total.defined()) sl.flat.copy_(sl.total);
}

}  // namespace alloy::dist
