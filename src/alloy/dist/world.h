#pragma once
// The distributed world of one training job: the rendezvous store (c10d TCPStore hosted by rank
// 0), the process groups built from the Plan, and failure detection. Every collective has a
// timeout; when one fails, failure_report() names the ranks that died (their heartbeat stopped) or
// stalled (their progress fell behind), so no rank hangs or dies with a bare socket error.
#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alloy/core/sync_tree.h"
#include "alloy/dist/rendezvous.h"

namespace c10d {
class Store;
class ProcessGroupGloo;
class Work;
}  // namespace c10d

namespace alloy::dist {

class DeviceCollectives;
class TreeAllreduce;
class Group;

// The receives of one all-gather posted ahead of it (Group::post_gather).
class PostedGather {
 public:
  PostedGather();
  PostedGather(PostedGather&&) noexcept;
  PostedGather& operator=(PostedGather&&) noexcept;
  ~PostedGather();  // receives never finished are aborted: nothing may land in freed buffers
  bool posted() const;  // false for a group of one
  // Sends MINE (of the size and type posted) to every other member and returns every member's
  // tensor by group rank (MINE's own place a flat view of it). Once.
  std::vector<at::Tensor> finish(const at::Tensor& mine, const std::string& what);

 private:
  friend class Group;
  struct Posted;
  std::unique_ptr<Posted> p_;
};

// The receives of one small sum posted ahead of it (Group::post_sum_small).
class PostedSum {
 public:
  // Sums T (of the size and type posted) over the group as sum_small does, to the same bits.
  void finish(at::Tensor& t, const std::string& what);

 private:
  friend class Group;
  Group* group_ = nullptr;
  PostedGather gather_;  // not posted along a sum tree: finish() is sum_small
};

// A process group over a subset of the world's ranks, on Gloo, which moves host memory: callers
// stage CUDA tensors through the CPU (pipeline sends, mixed groups' reducer buckets). A group whose
// members all train on CUDA devices also has NCCL (dist/nccl.h): all-reduce, broadcast and
// all-gather of CUDA tensors go there, host tensors still through Gloo.
class Group {
 public:
  Group(std::string name, std::vector<int> ranks, int my_global_rank);
  ~Group();
  const std::string& name() const { return name_; }
  const std::vector<int>& ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int rank() const { return my_rank_; }  // rank within the group
  int group_rank_of(int global_rank) const;

  // Whether CUDA tensors' all-reduce, broadcast and all-gather stay on the device (NCCL).
  bool device_collectives() const { return device_ != nullptr; }
  // Asynchronous SUM all-reduce in place; wait() on the handle. Host tensors go along the group's
  // sum tree when it has one (route_sums), else through Gloo's ring.
  c10::intrusive_ptr<c10d::Work> allreduce_sum(at::Tensor& t);
  // A synchronous SUM of a few values (a step's figures) in as few hops as the route allows: along
  // the sum tree when the group has one; otherwise every member's values in one all-gather (n - 1
  // hops of Gloo's ring where its all-reduce takes 2 (n - 1): 20 against 40 ms a step between two
  // hosts 20 ms apart), added in rank order on every member, so all hold the same bits. WHAT
  // names the sum in a timeout's report.
  void sum_small(at::Tensor& t, const std::string& what);
  // sum_small with its receives posted now, well before the values exist (at the step's start).
  // Gloo's collectives, and a send to a receive not yet posted, first wait for the receiver's
  // ready notice, a round trip; a send to a posted receive crosses the link once. Measured between
  // two emulated hosts 20 ms apart: an all-gather of 8 doubles 41.7 ms, a send to a posted receive
  // 20. Each member sends its values to every other one (the bytes of the ring's all-gather, n - 1
  // messages). Along a sum tree, finish() is sum_small. TAG sets apart sums posted at once.
  PostedSum post_sum_small(int64_t numel, at::ScalarType dtype, int tag);
  // The receives of an all-gather of NUMEL elements of DTYPE from every other member, posted now;
  // PostedGather::finish sends this member's straight into the others' (point-to-point, TAG).
  PostedGather post_gather(int64_t numel, at::ScalarType dtype, int tag);
  // From now on host tensors' SUM all-reduces travel along STRIPES (one tree, or several each
  // summing a slice; over this group's members in rank order; dist/tree_allreduce.h), through
  // P2P: a group of the same members used for nothing else. Every member calls it with the same
  // trees.
  void route_sums(std::shared_ptr<Group> p2p, std::vector<SyncTree> stripes);
  const std::vector<SyncTree>* sum_trees() const;  // the trees route_sums gave, or null
  void clear_sum_route();            // back to Gloo's ring
  // Asynchronous all-gather of equal-sized tensors: OUT[i] receives group rank i's IN.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<at::Tensor>& out, at::Tensor& in);
  // Asynchronous all-to-all along dimension 0: IN's first IN_ROWS[i] rows (after those for
  // lower ranks) go to group rank i, and OUT receives OUT_ROWS[i] rows from each rank i, in order.
  c10::intrusive_ptr<c10d::Work> alltoall_rows(at::Tensor& out, at::Tensor& in, std::vector<int64_t> out_rows, std::vector<int64_t> in_rows);
  // Asynchronous SUM reduce in place onto group rank ROOT (the others' T is left unspecified).
  c10::intrusive_ptr<c10d::Work> reduce_sum(at::Tensor& t, int root);
  // Asynchronous broadcast from group rank ROOT, in place.
  c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor& t, int root);
  c10::intrusive_ptr<c10d::Work> send(at::Tensor& t, int dst_global, int tag);
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor& t, int src_global, int tag);
  void barrier();

 private:
  friend class World;
  std::string name_;
  std::vector<int> ranks_;
  int my_rank_ = -1;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo_;
  std::unique_ptr<DeviceCollectives> device_;
  std::unique_ptr<TreeAllreduce> tree_;
};

// What a rank publishes of its device (World::set_device): "cpu", "cuda:I@host#UUID" when it
// will use NCCL (NCCL; the GPU's UUID where the build can read it), "cuda-gloo:I@host..." when not.
std::string device_label(const at::Device& device, bool nccl);
// Whether this rank will use NCCL: the build has it and ALLOY_NCCL allows it.
bool nccl_wanted();
// Whether ALLOY_NCCL's VALUE (null: unset) allows NCCL: all but "0", "off" and "false".
bool nccl_allowed_by(const char* value);
// Whether a group whose members published these devices (World::set_device) gets NCCL: every
// member on a GPU of its own and able to use NCCL.
bool nccl_eligible(const std::vector<std::string>& published);

// Waits for WORK, turning a timeout or failure into an alloy::Error whose text comes from
// WHAT plus the world's failure report. For NCCL work this orders the current CUDA stream after
// the collective (the host does not wait), and NCCL's own watchdog enforces the timeout, ending
// the process; the other ranks' reports then name it.
void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
// What E says, for an error message of ours: its first line, at most 300 characters (c10's errors
// carry a backtrace after it).
std::string first_line(const std::exception& e);

class World {
 public:
  // Connects to (rank 0: hosts) the TCPStore and starts the heartbeat. TIMEOUT bounds every store
  // wait and every collective.
  static std::shared_ptr<World> create(const Rendezvous& rv, std::chrono::milliseconds timeout);
  ~World();

  int rank() const { return rv_.rank; }
  int size() const { return rv_.world_size; }
  const Rendezvous& rendezvous() const { return rv_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  c10d::Store& store() { return *store_; }
  // A connection of its own to the store, for a thread that must not wait behind the training
  // thread's store calls (the checkpoint writer).
  c10::intrusive_ptr<c10d::Store> connect_store_client() const;

  // Every rank calls this with the same WHAT (and ROUND: a re-planned trainer checks again under
  // keys of its own); fails on every rank when the values differ, naming the ranks that disagree
  // with rank 0 and how: both values when short, else the first JSON field that differs.
  void check_same(const std::string& what, const std::string& value, const std::string& round = "");
  // The device this rank trains on, published for the others before the trainer makes its groups
  // (all(), made with the world, stays on Gloo): a group whose members all train on GPUs of their
  // own gets NCCL beside Gloo (nccl_eligible; ALLOY_NCCL=0 on any member keeps it on Gloo).
  void set_device(const at::Device& device);
  // Which machine each rank runs on (index: rank), as each published it when the world was made:
  // its hostname and the address its Gloo device binds (the emulator's hosts share a hostname but
  // not an address). Ranks with equal strings share a machine; compare them, do not parse them.
  std::vector<std::string> machines();
  // All members of RANKS call this, in the same order across ranks, with a NAME unique in the job.
  std::shared_ptr<Group> new_group(const std::string& name, std::vector<int> ranks);
  // What RANK published of its device (set_device: "cpu", "cuda:0@host", ...), waited for.
  std::string published_device(int rank);
  // A transport of two ranks, FIRST (pair rank 0) and SECOND, both of which call this with the
  // same NAME (unique in the job): NCCL when NCCL is set (both ends nccl_eligible), else a
  // Gloo group of the two, which moves host tensors only. Gloo connects here, both ends at once;
  // NCCL makes its communicator at the first message.
  std::unique_ptr<DeviceCollectives> new_pair(const std::string& name, int first, int second, bool nccl);
  Group& all();  // every rank

  // Publishes this rank's position ("step 12") so a stall can be pinned on the rank behind.
  void set_progress(int64_t step);
  // Horovod's stall inspector: when this rank has waited STALL_S seconds in one collective
  // (wait_work), it logs which ranks have not entered it and what they do instead (their step,
  // the collective they wait in, or no heartbeat). 0 = off. Default: a quarter of the timeout.
  void set_stall_seconds(double s) { stall_s_ = s; }
  // Records this rank's error for the others to read, best effort.
  void report_exit(const std::string& message);
  // Who is dead, stalled or failed, as a sentence; empty if nothing can be said.
  std::string failure_report();
  // MESSAGE, with the failure report on a line of its own when there is one.
  std::string with_failure_report(const std::string& message);

  static World* current();  // the world of this process, if any (for wait_work's reports)

 private:
  World(const Rendezvous& rv, std::chrono::milliseconds timeout);
  void heartbeat_loop();
  // A Gloo group of SIZE over the store's PREFIX, as group rank RANK, connected (every member at
  // once); WHAT begins the error when it cannot connect.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> connect_gloo(const std::string& prefix, int rank, int size, const std::string& what);
  std::string stall_report(const std::string& waiting, double waited);

  Rendezvous rv_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_, hb_store_;
  std::shared_ptr<Group> all_;
  at::Device device_{at::kCPU};  // set_device's; the CPU until said
  std::thread hb_thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> progress_{-1};
  std::atomic<double> stall_s_{0};
  std::chrono::steady_clock::time_point last_stall_report_{};
  // What the heartbeat thread last saw of every rank: its counter and when it last changed. Lets a
  // failure report name a dead or frozen rank at once, even if the store dies meanwhile.
  std::mutex seen_mu_;
  std::vector<std::string> seen_beat_;
  std::vector<std::chrono::steady_clock::time_point> seen_change_;
};

}  // namespace alloy::dist
