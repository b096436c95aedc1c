#include "alloy/dist/pipe_channels.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cstdlib>

#include "alloy/core/error.h"
#include "alloy/dist/nccl.h"
#include "alloy/dist/world.h"

namespace alloy::dist {

ChannelMode channel_mode_from_env() {
  const char* env = std::getenv("ALLOY_PIPE_CHANNELS");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") return ChannelMode::Auto;
  if (v == "off") return ChannelMode::Off;
  if (v == "gloo") return ChannelMode::Gloo;
  throw Error("ALLOY_PIPE_CHANNELS='" + v + "': expected auto (NCCL between GPUs, the default), off or gloo");
}

const char* to_string(ChannelMode m) {
  switch (m) {
    case ChannelMode::Off: return "off";
    case ChannelMode::Auto: return "auto";
    case ChannelMode::Gloo: return "gloo";
  }
  return "?";
}

bool channel_qualifies(ChannelMode mode, const std::string& a, const std::string& b) {
  switch (mode) {
    case ChannelMode::Off: return false;
    case ChannelMode::Gloo: return true;
    case ChannelMode::Auto: return nccl_eligible({a, b});
  }
  return false;
}

PipeChannel::PipeChannel(std::unique_ptr<DeviceCollectives> transport, int peer) : transport_(std::move(transport)), peer_(peer) {}
PipeChannel::~PipeChannel() = default;
c10::intrusive_ptr<c10d::Work> PipeChannel::send(at::Tensor& t) { return transport_->send(t, peer_); }
c10::intrusive_ptr<c10d::Work> PipeChannel::recv(at::Tensor& t) { return transport_->recv(t, peer_); }

PipeChannels::~PipeChannels() = default;

std::unique_ptr<PipeChannels> PipeChannels::open(World& world, const std::string& name, std::vector<ChannelKey> candidates,
                                                 ChannelMode mode, const at::Device& device) {
  if (mode == ChannelMode::Off) return nullptr;
  const bool nccl = mode == ChannelMode::Auto;
  std::unique_ptr<PipeChannels> out(new PipeChannels(world.rank(), nccl ? "nccl" : "gloo", nccl ? device : at::Device(at::kCPU)));
  // One global order: each opening waits for its two ends only, so the first pending channel in
  // this order always has both ends at it, and no rank waits forever.
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  for (const ChannelKey& k : candidates) {
    if (k.src != world.rank() && k.dst != world.rank())
      throw Error("pipeline channel " + std::to_string(k.src) + " -> " + std::to_string(k.dst) + " listed on rank " +
                  std::to_string(world.rank()) + ", which is neither end (internal error)");
    if (!channel_qualifies(mode, world.published_device(k.src), world.published_device(k.dst))) continue;
    const bool sending = k.src == world.rank();
    const std::string pair = name + "/" + std::to_string(k.src) + ">" + std::to_string(k.dst) + "/" + std::to_string(k.stream);
    auto ch = std::make_unique<PipeChannel>(world.new_pair(pair, k.src, k.dst, nccl), sending ? 1 : 0);
    at::Tensor probe = at::full({1}, static_cast<double>(k.stream), at::TensorOptions().dtype(at::kFloat).device(out->message_device_));
    const std::string what = "opening pipeline channel " + std::to_string(k.src) + " -> " + std::to_string(k.dst);
    if (sending) {
      wait_work(ch->send(probe), what);
    } else {
      probe.fill_(-1);
      wait_work(ch->recv(probe), what);
      // The host reads it: NCCL's wait orders only the stream, and the communicator must be whole now.
      if (probe.item<double>() != static_cast<double>(k.stream))
        throw Error(what + ": the first message carried " + std::to_string(probe.item<double>()) + ", expected " +
                    std::to_string(k.stream) + " (the two ends disagree on their channels)");
    }
    out->channels_.emplace(k, std::move(ch));
  }
  if (out->channels_.empty()) return nullptr;
  return out;
}

PipeChannel* PipeChannels::to(int dst, int64_t stream) {
  auto it = channels_.find({rank_, dst, stream});
  return it == channels_.end() ? nullptr : it->second.get();
}

PipeChannel* PipeChannels::from(int src, int64_t stream) {
  auto it = channels_.find({src, rank_, stream});
  return it == channels_.end() ? nullptr : it->second.get();
}

std::string PipeChannels::describe() const {
  // Interleaved chunks: every stream names its virtual stage (0 included).
  const bool staged = std::any_of(channels_.begin(), channels_.end(), [](const auto& c) { return c.first.stream >= 2; });
  auto side = [&](bool sending) {
    std::string s;
    for (const auto& [k, ch] : channels_) {
      if ((k.src == rank_) != sending) continue;
      if (!s.empty()) s += ", ";
      s += std::to_string(sending ? k.dst : k.src) + (k.stream % 2 ? " (gradients" : " (activations");
      if (staged) s += " of virtual stage " + std::to_string(k.stream / 2);
      s += ")";
    }
    return s.empty() ? std::string("none") : s;
  };
  return std::to_string(channels_.size()) + (transport_ == "nccl" ? " NCCL" : " Gloo") + " channel(s): to " + side(true) +
         "; from " + side(false);
}

}  // namespace alloy::dist
