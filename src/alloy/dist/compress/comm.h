#pragma once
// The few blocking collectives gradient compression needs, behind one small interface so that the
// codecs and fusion strategies run unchanged over a c10d Gloo group (training) and over an
// in-process hub of threads (tests, no sockets), the way Gloo tests its own algorithms.
//
// Every call blocks the calling thread (a sync worker, never the training loop) and is bounded by
// the group's timeout; a peer that does not come makes it throw with the world's failure report.
// Every member must make the same calls in the same order with the same sizes: the callers keep
// that true by construction (sizes derive from the plan and the step) or exchange sizes first.
#include <ATen/ATen.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace alloy::dist {
class Group;
}

namespace alloy::dist::compress {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;  // within this communicator
  virtual std::string name() const = 0;
  virtual void allreduce_sum(at::Tensor& t) = 0;                          // in place
  virtual std::vector<at::Tensor> allgather(const at::Tensor& t) = 0;     // equal sizes on every member
  virtual void broadcast(at::Tensor& t, int root) = 0;                    // in place; ROOT's value everywhere
  // All-to-all along dimension 0: IN's first IN_ROWS[0] rows go to member 0, the next IN_ROWS[1]
  // to member 1, ...; returns what the members sent here, in member order (OUT_ROWS[i] rows from
  // member i: the callers exchange the counts first).
  virtual at::Tensor alltoall_rows(const at::Tensor& in, const std::vector<int64_t>& in_rows,
                                   const std::vector<int64_t>& out_rows) = 0;
  // Posts the receives of a later all-gather of NUMEL elements of DTYPE from every other member.
  // allgather() then takes the oldest posted entry when its size and type match: each member sends
  // its tensor straight to the others' posted receives, and the data crosses each link once. A
  // Gloo collective (or a send to a receive not yet posted) first waits for the receiver's ready
  // notice, a round trip: 41.7 ms against 20 ms one way between two emulated hosts. Every member
  // posts the same sizes in the same order. Default (the in-process hub): nothing to post.
  virtual void post_allgather(int64_t /*numel*/, at::ScalarType /*dtype*/) {}
  // Drops posted receives no all-gather took (none should be left at the end of a step).
  virtual int cancel_posted() { return 0; }
  // Bytes this member put on the wire in calls so far (its share of each ring or gather).
  int64_t bytes_sent() const { return bytes_sent_; }

 protected:
  int64_t bytes_sent_ = 0;
};

// A c10d group (Gloo today). The group must outlive the Comm.
std::unique_ptr<Comm> group_comm(Group& group);

// N members in one process: member(i) is used by thread i. Collectives meet at a barrier and
// read each other's inputs from shared memory.
class LocalHub {
 public:
  explicit LocalHub(int n);
  std::unique_ptr<Comm> member(int rank);

 private:
  friend class LocalComm;
  // Deposits IN as member RANK's contribution and returns every member's once all have arrived.
  std::vector<at::Tensor> meet(int rank, const at::Tensor& in);
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<at::Tensor> slots_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  std::vector<at::Tensor> last_;
  int readers_left_ = 0;
};

}  // namespace alloy::dist::compress
