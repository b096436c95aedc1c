#pragma once
// Link latency for the emulator on kernels without netem (and without fq, whose departure times a
// BPF program could set): the frames of host pairs whose link asks for latency are taken off the
// switch as they enter it (tc mirred, see EmulatedCluster), into a tap device that this class
// reads; each is held for its link's one-way latency and written back into the same tap, which is
// a port of the switch's bridge that neither learns addresses nor receives floods, so the bridge
// forwards it on to its destination as if it had just arrived. Frames keep their order per host
// pair (one latency per pair, one FIFO per pair).
//
// The cost is CPU time in the process that owns the cluster (a read and a write per frame, about
// 2-4 microseconds), outside every device's quota: at 0.1 Gbit/s about 8,300 full frames per
// second and way. That is why the emulator delays only links of at least kMinEmulatedLatencyMs.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace alloy::emu {

// Links below this latency keep the veth's own (tens of microseconds): such a link is fast, so its
// frames are many, and what a delay line adds to the whole machine's CPU would distort the devices'
// speeds more than the missing fraction of a millisecond distorts the link.
inline constexpr double kMinEmulatedLatencyMs = 1.0;

class DelayLine {
 public:
  // Creates the tap DEV in the network namespace at NETNS_PATH (/run/netns/NAME) and starts the
  // thread that delays its frames. DELAY_S[k][j]: seconds that a frame from host k to host j is
  // held (hosts by index: address 10.213.0.<index + 1>); frames of other pairs, and frames that are
  // not IPv4, are dropped (only frames the caller's filters redirect reach the tap, and the bridge
  // must never see a broadcast come back). Frames beyond MAX_QUEUED_BYTES in flight are dropped,
  // as a router's full queue would. Throws alloy::Error naming what failed.
  static std::unique_ptr<DelayLine> start(const std::string& netns_path, const std::string& dev, std::vector<std::vector<double>> delay_s,
                                          size_t max_queued_bytes = size_t{64} << 20);
  ~DelayLine();  // stops the thread and closes the tap (the device goes with it)
  DelayLine(const DelayLine&) = delete;
  DelayLine& operator=(const DelayLine&) = delete;

  struct Stats {
    uint64_t frames = 0, bytes = 0;  // delivered after their delay
    uint64_t dropped = 0;            // not IPv4, an unknown pair, or over the queue's bound
  };
  Stats stats() const;
  const std::string& device() const { return dev_; }

 private:
  DelayLine() = default;
  void run();

  std::string dev_;
  std::vector<std::vector<double>> delay_s_;
  size_t max_queued_bytes_ = 0;
  int tap_fd_ = -1, stop_fd_ = -1;
  std::thread thread_;
  std::atomic<uint64_t> frames_{0}, bytes_{0}, dropped_{0};
};

}  // namespace alloy::emu
