#include "alloy/dist/pipe_channels.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
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

PipeChannels::PipeChannels(World& world, std::string name, std::string transport, at::Device device)
    : world_(world), name_(std::move(name)), rank_(world.rank()), transport_(std::move(transport)), message_device_(device) {}
PipeChannels::~PipeChannels() = default;

std::string PipeChannels::pair_name(const ChannelKey& k) const {
  return name_ + "/" + std::to_string(k.src) + ">" + std::to_string(k.dst) + "/" + std::to_string(k.stream);
}

void PipeChannels::exchange_probe(const ChannelKey& k, PipeChannel& ch, double value, const std::string& what) {
  at::Tensor probe = at::full({1}, k.src == rank_ ? value : -1.0, at::TensorOptions().dtype(at::kFloat).device(message_device_));
  try {
    // NCCL makes the communicator inside the first send or receive, and fails there.
    wait_work(k.src == rank_ ? ch.send(probe) : ch.recv(probe), what);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(world_.with_failure_report("rank " + std::to_string(rank_) + ": " + what + ": " + first_line(e)));
  }
  if (k.dst != rank_) return;
  // The host reads it: NCCL's wait orders only the stream.
  const double got = probe.item<double>();
  if (got != value)
    throw Error("rank " + std::to_string(rank_) + ": " + what + ": got " + std::to_string(got) + ", expected " + std::to_string(value) +
                " (the two ends disagree on their channels)");
}

std::unique_ptr<PipeChannels> PipeChannels::open(World& world, const std::string& name, std::vector<ChannelKey> candidates,
                                                 ChannelMode mode, const at::Device& device) {
  if (mode == ChannelMode::Off) return nullptr;
  const bool nccl = mode == ChannelMode::Auto;
  std::unique_ptr<PipeChannels> out(new PipeChannels(world, name, nccl ? "nccl" : "gloo", nccl ? device : at::Device(at::kCPU)));
  // One global order: each opening waits for its two ends only, so the first pending channel in
  // this order always has both ends at it, and no rank waits forever.
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  std::vector<ChannelKey> qualified;
  for (const ChannelKey& k : candidates) {
    if (k.src != world.rank() && k.dst != world.rank())
      throw Error("pipeline channel " + std::to_string(k.src) + " -> " + std::to_string(k.dst) + " listed on rank " +
                  std::to_string(world.rank()) + ", which is neither end (internal error)");
    if (channel_qualifies(mode, world.published_device(k.src), world.published_device(k.dst))) qualified.push_back(k);
  }
  if (nccl && static_cast<int>(qualified.size()) > kCudaStreamsPerPool)
    throw Error("rank " + std::to_string(world.rank()) + ": " + std::to_string(qualified.size()) +
                " pipeline channels on NCCL would share CUDA streams (" + std::to_string(kCudaStreamsPerPool) +
                " per device), and a shared stream can stall a send behind a receive: fewer virtual stages, or "
                "ALLOY_PIPE_CHANNELS=off on every rank (messages through the host)");
  for (const ChannelKey& k : qualified) {
    const bool sending = k.src == world.rank();
    auto ch = std::make_unique<PipeChannel>(world.new_pair(out->pair_name(k), k.src, k.dst, nccl), sending ? 1 : 0);
    out->exchange_probe(k, *ch, static_cast<double>(k.stream),
                        "opening pipeline channel " + std::to_string(k.src) + " -> " + std::to_string(k.dst));
    out->channels_.emplace(k, std::move(ch));
  }
  if (out->channels_.empty()) return nullptr;
  out->listed_ = std::move(candidates);
  return out;
}

void PipeChannels::close() {
  const auto timeout = world_.timeout();
  for (auto& [k, ch] : channels_) {  // the map's order is the global one opening used
    const std::string what = "closing pipeline channel " + std::to_string(k.src) + " -> " + std::to_string(k.dst);
    const std::string acked = "alloy/pair/" + pair_name(k) + "/closed";
    // FIFO: the last message received means every one before it was.
    exchange_probe(k, *ch, -2.0 - static_cast<double>(k.stream), what);
    if (k.dst == rank_) {
      world_.store().set(acked, std::vector<uint8_t>{1});
      continue;
    }
    try {
      world_.store().wait({acked}, timeout);
    } catch (const std::exception&) {
      throw Error(world_.with_failure_report("rank " + std::to_string(rank_) + ": " + what + ": rank " + std::to_string(k.dst) +
                                             " never acknowledged the last message"));
    }
  }
}

PipeChannel* PipeChannels::find(const ChannelKey& k) const {
  if (auto it = channels_.find(k); it != channels_.end()) return it->second.get();
  if (!std::binary_search(listed_.begin(), listed_.end(), k))
    throw Error("rank " + std::to_string(rank_) + ": pipeline stream " + std::to_string(k.src) + " -> " + std::to_string(k.dst) +
                " (" + (k.stream % 2 ? "gradients" : "activations") + " into virtual stage " + std::to_string(k.stream / 2) +
                ") was not among the streams its channels were opened for (internal error: message_streams misses it)");
  return nullptr;
}

PipeChannel* PipeChannels::to(int dst, int64_t stream) { return find({rank_, dst, stream}); }
PipeChannel* PipeChannels::from(int src, int64_t stream) { return find({src, rank_, stream}); }

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
