#include "alloy/train/checkpoint_writer.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/log.h"
#include "alloy/dist/world.h"

namespace alloy::train {

CheckpointWriter::CheckpointWriter(dist::World* world, std::string key_prefix) : world_(world), key_prefix_(std::move(key_prefix)) {}

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (const std::exception& e) {
    log_error(e.what());
  }
}

void CheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  std::string err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    err.swap(error_);
  }
  if (!err.empty()) throw Error(err);
}

void CheckpointWriter::start(int64_t step, const std::string& staging_dir, ShardSnapshot snap, std::function<void()> publish) {
  wait();
  if (world_ && !store_) store_ = world_->connect_store_client();
  thread_ = std::thread([this, step, staging_dir, snap = std::move(snap), publish = std::move(publish)]() mutable {
    run(step, std::move(staging_dir), std::move(snap), std::move(publish));
  });
}

void CheckpointWriter::run(int64_t step, std::string staging_dir, ShardSnapshot snap, std::function<void()> publish) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string key = "alloy/ckpt/" + key_prefix_ + std::to_string(step) + "/";
  std::string status = "ok";
  try {
    ensure_writable_dir(staging_dir);
    write_shard(staging_dir, snap);
  } catch (const std::exception& e) {
    status = std::string("rank ") + std::to_string(snap.rank) + " could not write its part of the checkpoint of step " +
             std::to_string(step) + ": " + e.what();
  }
  std::string failure;
  try {
    if (store_) store_->set(key + std::to_string(snap.rank), std::vector<uint8_t>(status.begin(), status.end()));
    if (snap.rank == 0) {
      // Every rank's files must be complete before state.json lists them.
      failure = status == "ok" ? "" : status;
      for (int r = 1; store_ && r < snap.world_size; ++r) {
        const std::string k = key + std::to_string(r);
        store_->wait({k});
        const auto b = store_->get(k);
        const std::string s(b.begin(), b.end());
        if (s != "ok" && failure.empty()) failure = s;
      }
      if (failure.empty()) publish();
    } else if (status != "ok") {
      failure = status;
    }
  } catch (const std::exception& e) {
    failure = "the checkpoint of step " + std::to_string(step) + " was not published: " + e.what();
  }
  last_write_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!failure.empty()) {
    log_error(failure + " (the previous checkpoint stays the latest)");
    std::lock_guard<std::mutex> lk(mu_);
    error_ = failure;
  }
}

}  // namespace alloy::train
