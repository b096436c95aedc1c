#pragma once
// Pipeline messages straight between two GPUs: one channel per one-way stream of messages (a
// sender, a receiver and what flows: activations or gradients of one virtual stage), each a
// two-rank NCCL communicator of its own. NCCL pairs messages in the order they are posted and runs
// a communicator's sends and receives on one stream, so under 1F1B a stage's gradient going back
// and its neighbour's activation coming forward, on one communicator, would each wait for the
// other's receive. One direction per channel leaves each channel a FIFO of one sender, which the
// schedules keep in micro-batch order (schedule.h); every message's header rides along and is
// checked on arrival, so a stream out of order is an error, not another micro-batch's tensor.
//
// Which links get channels (ALLOY_PIPE_CHANNELS): "auto" (default) those whose two ranks both
// train on GPUs of their own with NCCL (nccl_eligible); "off" none (every message through the
// world's Gloo group, staged through the host); "gloo" every link, on two-rank Gloo groups: the
// same channels, opening and FIFO matching on machines without GPUs, which is how the CPU tests
// check the path (dist.parity's ch-* layouts).
#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace c10d {
class Work;
}

namespace alloy::dist {

class DeviceCollectives;
class World;

enum class ChannelMode { Off, Auto, Gloo };
// ALLOY_PIPE_CHANNELS: unset or "auto", "off", "gloo"; anything else throws, naming the variable.
ChannelMode channel_mode_from_env();
const char* to_string(ChannelMode m);

// One-way stream of messages from SRC to DST; STREAM tells apart what flows between the same two
// ranks (stream_of: the kind and the receiving virtual stage).
struct ChannelKey {
  int src = -1, dst = -1;
  int64_t stream = 0;
  bool operator<(const ChannelKey& o) const { return std::tie(src, dst, stream) < std::tie(o.src, o.dst, o.stream); }
  bool operator==(const ChannelKey& o) const { return src == o.src && dst == o.dst && stream == o.stream; }
};
// Activations (GRAD false) or gradients into virtual stage KEY (0 without interleaving).
inline int64_t stream_of(bool grad, int64_t key) { return key * 2 + (grad ? 1 : 0); }

class PipeChannel {
 public:
  explicit PipeChannel(std::unique_ptr<DeviceCollectives> transport, int peer);
  ~PipeChannel();
  c10::intrusive_ptr<c10d::Work> send(at::Tensor& t);
  c10::intrusive_ptr<c10d::Work> recv(at::Tensor& t);

 private:
  std::unique_ptr<DeviceCollectives> transport_;
  int peer_;  // the other end's rank in the pair
};

class PipeChannels {
 public:
  // Opens those of CANDIDATES (the streams this rank sends or receives; both ends of each list it)
  // whose two ranks qualify under MODE, every rank in one global order, each with a one-element
  // message that makes its communicator now: made at the first real message, a receive posted
  // ahead would sit in NCCL's set-up for a neighbour that first waits for this rank's own message.
  // NAME (unique per plan) prefixes the pairs' store keys. DEVICE: this rank's. Null when none
  // qualifies.
  static std::unique_ptr<PipeChannels> open(World& world, const std::string& name, std::vector<ChannelKey> candidates,
                                            ChannelMode mode, const at::Device& device);
  ~PipeChannels();
  // Every message sent on the channels has been received (each channel, in the global order, carries
  // one last message whose receiver acknowledges it through the store): NCCL aborts a destroyed
  // communicator's work, so a neighbour's last receive must not still be in flight. Once, after
  // the last step, by both ends of every channel.
  void close();
  // This rank's channel to DST (from SRC) for STREAM, or null: that stream did not qualify and
  // goes through the world's Gloo group. A stream open() was never given is an internal error
  // (message_streams and the executor disagree), not a quiet fallback to the group.
  PipeChannel* to(int dst, int64_t stream);
  PipeChannel* from(int src, int64_t stream);
  size_t size() const { return channels_.size(); }
  const std::string& transport() const { return transport_; }  // "nccl" | "gloo"
  // Where messages on the channels live: the rank's GPU under NCCL, the host under Gloo.
  const at::Device& message_device() const { return message_device_; }
  // "4 NCCL channels: to ranks 2 (activations), 0 (gradients); from ..." for the log.
  std::string describe() const;

 private:
  PipeChannels(World& world, std::string name, std::string transport, at::Device device);
  // KEY's one-element message from its sender to its receiver, checked; WHAT names it in errors.
  void exchange_probe(const ChannelKey& key, PipeChannel& ch, double value, const std::string& what);
  std::string pair_name(const ChannelKey& k) const;
  PipeChannel* find(const ChannelKey& k) const;
  World& world_;
  std::string name_;
  int rank_;
  std::string transport_;
  at::Device message_device_;
  std::map<ChannelKey, std::unique_ptr<PipeChannel>> channels_;
  std::vector<ChannelKey> listed_;  // every stream open() was given, sorted: qualified or not
};

// Whether a link between ranks publishing devices A and B gets a channel under MODE.
bool channel_qualifies(ChannelMode mode, const std::string& a, const std::string& b);

}  // namespace alloy::dist
