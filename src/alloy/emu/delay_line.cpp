#include "alloy/emu/delay_line.h"

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <utility>

#include "alloy/core/error.h"
#include "alloy/core/log.h"

namespace alloy::emu {
namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  Clock::time_point due;
  std::vector<uint8_t> bytes;
};

// The host index of an emulated host's IPv4 address (10.213.0.<index + 1>), or -1.
int host_of(const uint8_t* ip) {
  if (ip[0] != 10 || ip[1] != 213 || ip[2] != 0 || ip[3] == 0 || ip[3] == 255) return -1;
  return ip[3] - 1;
}

}  // namespace

std::unique_ptr<DelayLine> DelayLine::start(const std::string& netns_path, const std::string& dev, std::vector<std::vector<double>> delay_s,
                                            size_t max_queued_bytes) {
  if (dev.empty() || dev.size() >= IFNAMSIZ) throw Error("delay line: bad device name '" + dev + "'");
  std::unique_ptr<DelayLine> d(new DelayLine());
  d->dev_ = dev;
  d->delay_s_ = std::move(delay_s);
  d->max_queued_bytes_ = max_queued_bytes;
  d->stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (d->stop_fd_ < 0) throw Error(std::string("delay line: eventfd: ") + std::strerror(errno));
  // A tap is made in the network namespace of the thread that creates it, and setns() moves only
  // the calling thread: the delay thread joins the switch's namespace and makes the tap there.
  std::promise<std::string> made;
  auto made_f = made.get_future();
  DelayLine* self = d.get();
  d->thread_ = std::thread([self, netns_path, &made] {
    const int ns = ::open(netns_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (ns < 0) return made.set_value("cannot open " + netns_path + ": " + std::strerror(errno));
    const bool joined = ::setns(ns, CLONE_NEWNET) == 0;
    const int setns_errno = errno;
    ::close(ns);
    if (!joined) return made.set_value("cannot enter " + netns_path + ": " + std::strerror(setns_errno));
    const int fd = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return made.set_value(std::string("needs /dev/net/tun (the tun module) for link latency: ") + std::strerror(errno));
    ifreq ifr{};
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    std::strncpy(ifr.ifr_name, self->dev_.c_str(), IFNAMSIZ - 1);
    if (::ioctl(fd, TUNSETIFF, &ifr) != 0) {
      const int e = errno;
      ::close(fd);
      return made.set_value("cannot create the tap " + self->dev_ + ": " + std::strerror(e));
    }
    self->tap_fd_ = fd;
    made.set_value("");
    self->run();
  });
  const std::string failed = made_f.get();
  if (!failed.empty()) {
    d->thread_.join();
    throw Error("emulator: " + failed);
  }
  return d;
}

DelayLine::~DelayLine() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (::write(stop_fd_, &one, sizeof one) != sizeof one) log_warn("delay line " + dev_ + ": cannot signal its thread to stop");
    thread_.join();
  }
  if (tap_fd_ >= 0) ::close(tap_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

DelayLine::Stats DelayLine::stats() const { return {frames_.load(), bytes_.load(), dropped_.load()}; }

void DelayLine::run() {
  // One FIFO per host pair: every frame of a pair waits the same time, so each queue's head is its
  // next due, and frames of a pair leave in the order they came.
  std::map<std::pair<int, int>, std::deque<Frame>> queues;
  size_t queued = 0;
  std::vector<uint8_t> buf(65536);
  constexpr size_t kEth = 14, kIpSrc = kEth + 12, kIpDst = kEth + 16;
  for (;;) {
    Clock::time_point next = Clock::time_point::max();
    for (const auto& [pair, q] : queues)
      if (!q.empty() && q.front().due < next) next = q.front().due;
    timespec wait{};
    timespec* timeout = nullptr;
    if (next != Clock::time_point::max()) {
      const auto ns = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(next - Clock::now()).count());
      wait.tv_sec = static_cast<time_t>(ns / 1000000000);
      wait.tv_nsec = static_cast<long>(ns % 1000000000);
      timeout = &wait;
    }
    pollfd p[2] = {{tap_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::ppoll(p, 2, timeout, nullptr) < 0 && errno != EINTR) {
      log_warn(std::string("delay line ") + dev_ + ": poll failed (" + std::strerror(errno) + "); link latency is no longer emulated");
      return;
    }
    if (p[1].revents) return;
    if (p[0].revents & POLLIN) {
      // Everything waiting now, so a burst costs one wake-up.
      for (;;) {
        const ssize_t n = ::read(tap_fd_, buf.data(), buf.size());
        if (n <= 0) break;
        const size_t len = static_cast<size_t>(n);
        const bool ipv4 = len >= kIpDst + 4 && buf[12] == 0x08 && buf[13] == 0x00;
        const int src = ipv4 ? host_of(&buf[kIpSrc]) : -1, dst = ipv4 ? host_of(&buf[kIpDst]) : -1;
        const bool known = src >= 0 && dst >= 0 && static_cast<size_t>(src) < delay_s_.size() &&
                           static_cast<size_t>(dst) < delay_s_[static_cast<size_t>(src)].size();
        if (!known || queued + len > max_queued_bytes_) {
          dropped_.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        const double d = delay_s_[static_cast<size_t>(src)][static_cast<size_t>(dst)];
        const auto due = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(std::llround(d * 1e9)));
        queues[{src, dst}].push_back(Frame{due, std::vector<uint8_t>(buf.begin(), buf.begin() + n)});
        queued += len;
      }
    }
    const auto now = Clock::now();
    for (auto& [pair, q] : queues)
      while (!q.empty() && q.front().due <= now) {
        const auto& f = q.front().bytes;
        // Writing to a tap hands the frame to the kernel at once; a failure is a frame lost.
        if (::write(tap_fd_, f.data(), f.size()) == static_cast<ssize_t>(f.size())) {
          frames_.fetch_add(1, std::memory_order_relaxed);
          bytes_.fetch_add(f.size(), std::memory_order_relaxed);
        } else {
          dropped_.fetch_add(1, std::memory_order_relaxed);
        }
        queued -= f.size();
        q.pop_front();
      }
  }
}

}  // namespace alloy::emu
