#pragma once
// Checkpoints written off the training thread. The step pays only for copying its rank's tensors
// (ShardSnapshot); a writer thread writes the files, and rank 0's, once every rank has reported its
// files written through the store, writes state.json with every file's size and CRC32C and moves
// the checkpoint into place (publish_checkpoint). Until then `latest` names the previous one, so a
// crash meanwhile loses nothing that was published. One save is in flight at a time: the next
// save, the end of training and a plan switch wait for it first, and an error in it (a full disk,
// a rank that never reported) surfaces there on the training thread.
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "alloy/train/checkpoint.h"

namespace c10d {
class Store;
}
namespace alloy::dist {
class World;
}

namespace alloy::train {

class CheckpointWriter {
 public:
  // WORLD may be null (one process). KEY_PREFIX makes store keys unique in the job (a plan
  // generation's prefix).
  CheckpointWriter(dist::World* world, std::string key_prefix);
  ~CheckpointWriter();  // waits for a save in flight; logs (never throws) its error
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Starts writing SNAP into STAGING_DIR for STEP; on rank 0 PUBLISH then runs once every rank's
  // files are written. Waits for the previous save first (and rethrows its error).
  void start(int64_t step, const std::string& staging_dir, ShardSnapshot snap, std::function<void()> publish);
  // Waits for the save in flight, if any; throws alloy::Error with its failure.
  void wait();
  // Seconds the last finished save spent writing (its thread's time, publication included).
  double last_write_s() const { return last_write_s_.load(); }

 private:
  void run(int64_t step, std::string staging_dir, ShardSnapshot snap, std::function<void()> publish);

  dist::World* world_;
  std::string key_prefix_;
  c10::intrusive_ptr<c10d::Store> store_;  // the writer thread's own connection
  std::thread thread_;
  std::mutex mu_;
  std::string error_;
  std::atomic<double> last_write_s_{0};
};

}  // namespace alloy::train
