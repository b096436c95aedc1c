#include "alloy/dist/world.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "alloy/core/error.h"
#include "alloy/core/log.h"
#include "alloy/dist/collectives_of.h"
#include "alloy/dist/nccl.h"
#include "alloy/dist/tree_allreduce.h"

namespace alloy::dist {
namespace {
World* g_world = nullptr;
// What this process waits for (wait_work), for the stall report: the collective's name and since when.
std::mutex g_wait_mu;
std::string g_waiting;
std::chrono::steady_clock::time_point g_wait_since;
std::mutex g_hb_mu;  // guards the heartbeat store client, shared by the heartbeat thread and reports

std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const Rendezvous& rv) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (const char* host = std::getenv("ALLOY_GLOO_HOST")) return c10d::ProcessGroupGloo::createDeviceForHostname(host);
  if (rv.master_addr.rfind("127.", 0) == 0 || rv.master_addr == "localhost")
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Store> connect_store(const Rendezvous& rv, bool server, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(rv.master_port);
  o.isServer = server;
  o.waitWorkers = false;  // joining is checked below, naming the ranks that never came
  o.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(rv.master_addr, o);
  } catch (const std::exception& e) {
    throw Error("rank " + std::to_string(rv.rank) + ": cannot " + (server ? "host" : "reach") +
                " the rendezvous store at " + rv.master_addr + ":" + std::to_string(rv.master_port) + " (" +
                first_line(e) + ")");
  }
}
}  // namespace

Group::Group(std::string name, std::vector<int> ranks, int my_global_rank) : name_(std::move(name)), ranks_(std::move(ranks)) {
  my_rank_ = group_rank_of(my_global_rank);
}
Group::~Group() = default;

int Group::group_rank_of(int global_rank) const {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  if (it == ranks_.end()) throw Error("rank " + std::to_string(global_rank) + " is not in group " + name_);
  return static_cast<int>(it - ranks_.begin());
}

c10::intrusive_ptr<c10d::Work> Group::allreduce_sum(at::Tensor& t) {
  if (device_ && t.is_cuda()) return device_->allreduce_sum(t);
  if (tree_ && t.is_cpu()) return tree_->allreduce_sum(t);
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  return gloo_->allreduce(v, o);
}

void Group::sum_small(at::Tensor& t, const std::string& what) {
  if (size() == 1) return;
  if (tree_ || !t.is_cpu()) {
    wait_work(allreduce_sum(t), what);
    return;
  }
  at::Tensor in = t.contiguous();
  std::vector<at::Tensor> all;
  for (int i = 0; i < size(); ++i) all.push_back(at::empty_like(in));
  wait_work(allgather(all, in), what);
  at::Tensor sum = all[0].clone();
  for (size_t i = 1; i < all.size(); ++i) sum.add_(all[i]);
  t.copy_(sum);
}

struct PostedGather::Posted {
  Group* group = nullptr;
  int tag = 0;
  int64_t numel = 0;
  at::ScalarType dtype = at::kDouble;
  std::vector<at::Tensor> in;  // by group rank; this member's filled by finish()
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> recvs;  // (group rank, receive)
  bool finished = false;
};

PostedGather::PostedGather() = default;
PostedGather::PostedGather(PostedGather&&) noexcept = default;
PostedGather& PostedGather::operator=(PostedGather&&) noexcept = default;

PostedGather::~PostedGather() {
  if (!p_ || p_->finished) return;
  for (auto& [from, w] : p_->recvs) {
    try {
      if (!w->isCompleted()) w->abort();
    } catch (...) {
    }
  }
}

bool PostedGather::posted() const { return p_ && !p_->recvs.empty(); }

PostedGather Group::post_gather(int64_t numel, at::ScalarType dtype, int tag) {
  PostedGather g;
  g.p_ = std::make_unique<PostedGather::Posted>();
  auto& p = *g.p_;
  p.group = this, p.tag = tag, p.numel = numel, p.dtype = dtype;
  p.in.resize(static_cast<size_t>(size()));
  for (int i = 0; i < size(); ++i) {
    if (i == my_rank_) continue;
    p.in[static_cast<size_t>(i)] = at::empty({numel}, at::TensorOptions().dtype(dtype));
    p.recvs.emplace_back(i, recv(p.in[static_cast<size_t>(i)], ranks_[static_cast<size_t>(i)], tag));
  }
  return g;
}

std::vector<at::Tensor> PostedGather::finish(const at::Tensor& mine, const std::string& what) {
  if (!p_ || p_->finished) throw Error(what + ": a posted all-gather finishes once");
  Posted& p = *p_;
  Group& g = *p.group;
  if (!mine.is_cpu() || mine.numel() != p.numel || mine.scalar_type() != p.dtype)
    throw Error(what + ": the values differ from the posted receives (" + std::to_string(mine.numel()) + " elements, " +
                std::to_string(p.numel) + " posted)");
  at::Tensor flat = mine.contiguous().view({-1});
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  for (int i = 0; i < g.size(); ++i)
    if (i != g.rank()) sends.push_back(g.send(flat, g.ranks()[static_cast<size_t>(i)], p.tag));
  for (auto& [from, w] : p.recvs) wait_work(w, what + " (from rank " + std::to_string(g.ranks()[static_cast<size_t>(from)]) + ")");
  p.finished = true;
  for (auto& w : sends) wait_work(w, what + " (sending)");
  p.in[static_cast<size_t>(g.rank())] = flat;
  return std::move(p.in);
}

PostedSum Group::post_sum_small(int64_t numel, at::ScalarType dtype, int tag) {
  PostedSum s;
  s.group_ = this;
  if (size() > 1 && !tree_) s.gather_ = post_gather(numel, dtype, tag);  // else finish() sums as sum_small does
  return s;
}

void PostedSum::finish(at::Tensor& t, const std::string& what) {
  if (!gather_.posted()) {
    group_->sum_small(t, what);
    return;
  }
  const std::vector<at::Tensor> all = gather_.finish(t, what);
  // In rank order on every member, as sum_small adds: every member holds the same bits.
  at::Tensor sum = all[0].clone();
  for (size_t i = 1; i < all.size(); ++i) sum.add_(all[i]);
  t.copy_(sum.view(t.sizes()));
}

void Group::route_sums(std::shared_ptr<Group> p2p, std::vector<SyncTree> stripes) {
  if (!p2p || p2p->ranks() != ranks_) throw Error("group " + name_ + ": its sum tree needs a group of the same members");
  tree_ = std::make_unique<TreeAllreduce>(std::move(p2p), std::move(stripes));
}

const std::vector<SyncTree>* Group::sum_trees() const { return tree_ ? &tree_->stripes() : nullptr; }
void Group::clear_sum_route() { tree_.reset(); }

c10::intrusive_ptr<c10d::Work> Group::allgather(std::vector<at::Tensor>& out, at::Tensor& in) {
  if (device_ && in.is_cuda()) return device_->allgather(out, in);
  std::vector<std::vector<at::Tensor>> outs{out};
  std::vector<at::Tensor> ins{in};
  auto w = gloo_->allgather(outs, ins);
  // Gloo writes into the tensors it was given; OUT shares their storage.
  return w;
}

c10::intrusive_ptr<c10d::Work> Group::alltoall_rows(at::Tensor& out, at::Tensor& in, std::vector<int64_t> out_rows, std::vector<int64_t> in_rows) {
  return gloo_->alltoall_base(out, in, out_rows, in_rows);
}

c10::intrusive_ptr<c10d::Work> Group::reduce_sum(at::Tensor& t, int root) {
  std::vector<at::Tensor> v{t};
  c10d::ReduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.rootRank = root;
  return gloo_->reduce(v, o);
}

c10::intrusive_ptr<c10d::Work> Group::broadcast(at::Tensor& t, int root) {
  if (device_ && t.is_cuda()) return device_->broadcast(t, root);
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return gloo_->broadcast(v, o);
}

c10::intrusive_ptr<c10d::Work> Group::send(at::Tensor& t, int dst_global, int tag) {
  std::vector<at::Tensor> v{t};
  return gloo_->send(v, group_rank_of(dst_global), tag);
}

c10::intrusive_ptr<c10d::Work> Group::recv(at::Tensor& t, int src_global, int tag) {
  std::vector<at::Tensor> v{t};
  return gloo_->recv(v, group_rank_of(src_global), tag);
}

void Group::barrier() { wait_work(gloo_->barrier(), "barrier of group " + name_); }

std::string first_line(const std::exception& e) {
  std::string msg = e.what();
  msg = msg.substr(0, msg.find('\n'));
  return msg.size() > 300 ? msg.substr(0, 297) + "..." : msg;
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  {
    std::lock_guard<std::mutex> lk(g_wait_mu);
    g_waiting = what;
    g_wait_since = std::chrono::steady_clock::now();
  }
  struct Done {
    ~Done() {
      std::lock_guard<std::mutex> lk(g_wait_mu);
      g_waiting.clear();
    }
  } done;
  try {
    work->wait();  // bounded by the group's timeout (set at creation)
  } catch (const std::exception& e) {
    const std::string msg = what + " failed: " + first_line(e);
    throw Error(World::current() ? World::current()->with_failure_report(msg) : msg);
  }
}

World::World(const Rendezvous& rv, std::chrono::milliseconds timeout) : rv_(rv), timeout_(timeout) {
  stall_s_ = static_cast<double>(timeout.count()) / 4000.0;
}

World* World::current() { return g_world; }

c10::intrusive_ptr<c10d::Store> World::connect_store_client() const { return connect_store(rv_, false, timeout_); }

std::shared_ptr<World> World::create(const Rendezvous& rv, std::chrono::milliseconds timeout) {
  std::shared_ptr<World> w(new World(rv, timeout));
  w->store_ = connect_store(rv, rv.rank == 0, timeout);
  // The heartbeat has its own connection so it never waits behind a blocking store call.
  w->hb_store_ = connect_store(rv, false, std::chrono::milliseconds(5000));
  {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    w->store_->set("alloy/machine/" + std::to_string(rv.rank), bytes_of(std::string(host) + " " + make_gloo_device(rv)->str()));
  }
  w->store_->set("alloy/joined/" + std::to_string(rv.rank), bytes_of("1"));
  w->store_->add("alloy/joined", 1);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (w->store_->add("alloy/joined", 0) < rv.world_size) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      for (int r = 0; r < rv.world_size; ++r)
        if (!w->store_->check({"alloy/joined/" + std::to_string(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw Error("rank " + std::to_string(rv.rank) + ": rank(s) " + missing + " never joined the rendezvous at " +
                  rv.master_addr + ":" + std::to_string(rv.master_port) + " within " +
                  std::to_string(timeout.count() / 1000) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  g_world = w.get();
  w->hb_thread_ = std::thread([p = w.get()] { p->heartbeat_loop(); });
  std::vector<int> all(static_cast<size_t>(rv.world_size));
  for (int r = 0; r < rv.world_size; ++r) all[static_cast<size_t>(r)] = r;
  w->all_ = w->new_group("all", all);
  return w;
}

World::~World() {
  stop_ = true;
  if (hb_thread_.joinable()) hb_thread_.join();
  if (g_world == this) g_world = nullptr;
}

void World::heartbeat_loop() {
  int64_t beat = 0;
  const size_t n = static_cast<size_t>(rv_.world_size);
  {
    std::lock_guard<std::mutex> lk(seen_mu_);
    seen_beat_.assign(n, "");
    seen_change_.assign(n, std::chrono::steady_clock::now());
  }
  // Watching every peer costs N store reads per period; beyond a few dozen ranks the report falls
  // back to sampling the heartbeats when a failure happens.
  const bool watch = rv_.world_size <= 64;
  while (!stop_) {
    try {
      std::lock_guard<std::mutex> lk(g_hb_mu);
      hb_store_->set("alloy/hb/" + std::to_string(rv_.rank), bytes_of(std::to_string(++beat)));
      hb_store_->set("alloy/progress/" + std::to_string(rv_.rank), bytes_of(std::to_string(progress_.load())));
      std::string waiting;
      double waited = 0;
      {
        std::lock_guard<std::mutex> wl(g_wait_mu);
        waiting = g_waiting;
        waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_wait_since).count();
      }
      hb_store_->set("alloy/waiting/" + std::to_string(rv_.rank), bytes_of(waiting));
      // The stall inspector: a wait that lasts stall_s is reported once (and again every stall_s
      // after), naming what every other rank is doing, well before the timeout ends the job.
      if (!waiting.empty() && stall_s_ > 0 && waited >= stall_s_ &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - last_stall_report_).count() >= stall_s_) {
        last_stall_report_ = std::chrono::steady_clock::now();
        log_warn(stall_report(waiting, waited));
      }
      if (watch) {
        auto now = std::chrono::steady_clock::now();
        for (size_t r = 0; r < n; ++r) {
          std::string k = "alloy/hb/" + std::to_string(r);
          std::string v = hb_store_->check({k}) ? str_of(hb_store_->get(k)) : "";
          std::lock_guard<std::mutex> sl(seen_mu_);
          if (v != seen_beat_[r]) seen_beat_[r] = v, seen_change_[r] = now;
        }
      }
    } catch (const std::exception&) {
      // The store host is gone; failure_report() says so when a collective fails.
    }
    for (int i = 0; i < 5 && !stop_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void World::set_progress(int64_t step) { progress_ = step; }

std::string World::stall_report(const std::string& waiting, double waited) {
  // Called on the heartbeat thread with g_hb_mu held.
  std::string out = "stall: rank " + std::to_string(rv_.rank) + " (step " + std::to_string(progress_.load()) + ") has waited " +
                    std::to_string(static_cast<int>(waited)) + " s in " + waiting + " (the job fails after " +
                    std::to_string(timeout_.count() / 1000) + " s)";
  std::string behind, along;
  const auto now = std::chrono::steady_clock::now();
  for (int r = 0; r < rv_.world_size; ++r) {
    if (r == rv_.rank) continue;
    const std::string rs = std::to_string(r);
    std::string theirs, step;
    try {
      if (hb_store_->check({"alloy/waiting/" + rs})) theirs = str_of(hb_store_->get("alloy/waiting/" + rs));
      if (hb_store_->check({"alloy/progress/" + rs})) step = str_of(hb_store_->get("alloy/progress/" + rs));
    } catch (const std::exception&) {
    }
    double quiet = 0;
    {
      std::lock_guard<std::mutex> sl(seen_mu_);
      if (static_cast<size_t>(r) < seen_change_.size()) quiet = std::chrono::duration<double>(now - seen_change_[static_cast<size_t>(r)]).count();
    }
    std::string what = "rank " + rs + " (step " + (step.empty() ? "?" : step) + ")";
    if (quiet > 1.5) what += " has sent no heartbeat for " + std::to_string(static_cast<int>(quiet)) + " s: dead or frozen";
    else if (theirs.empty()) what += " is not in a collective (computing, or stuck outside one)";
    else if (theirs == waiting) {
      along += (along.empty() ? "" : ", ") + rs;
      continue;
    } else what += " waits in " + theirs;
    behind += "\n  " + what;
  }
  if (!behind.empty()) out += "; the ranks that have not entered it:" + behind;
  if (!along.empty()) out += "\n  waiting in it too: rank(s) " + along;
  return out;
}

void World::report_exit(const std::string& message) {
  try {
    std::lock_guard<std::mutex> lk(g_hb_mu);
    hb_store_->set("alloy/exit/" + std::to_string(rv_.rank), bytes_of(message.substr(0, 2000)));
  } catch (const std::exception&) {
  }
}

std::string World::failure_report() {
  // First what the heartbeat thread has watched: peers silent for over 1.5 s are dead or frozen.
  // This needs no store access, which matters when the store's host exits first.
  {
    std::lock_guard<std::mutex> sl(seen_mu_);
    if (!seen_change_.empty() && rv_.world_size <= 64) {
      auto now = std::chrono::steady_clock::now();
      std::string out;
      for (int r = 0; r < rv_.world_size; ++r) {
        if (r == rv_.rank) continue;
        double quiet = std::chrono::duration<double>(now - seen_change_[static_cast<size_t>(r)]).count();
        if (quiet > 1.5)
          out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " died or froze (no heartbeat for " +
                 std::to_string(static_cast<int>(quiet)) + " s)";
      }
      if (!out.empty()) return out;
    }
  }
  auto read_all = [&](const std::string& prefix) {
    std::vector<std::string> out(static_cast<size_t>(rv_.world_size));
    std::lock_guard<std::mutex> lk(g_hb_mu);
    for (int r = 0; r < rv_.world_size; ++r) {
      std::string k = prefix + std::to_string(r);
      if (hb_store_->check({k})) out[static_cast<size_t>(r)] = str_of(hb_store_->get(k));
    }
    return out;
  };
  try {
    auto before = read_all("alloy/hb/");
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // three heartbeat periods
    auto after = read_all("alloy/hb/");
    auto exits = read_all("alloy/exit/");
    auto progress = read_all("alloy/progress/");
    std::ostringstream out;
    std::string sep;
    for (int r = 0; r < rv_.world_size; ++r) {
      size_t i = static_cast<size_t>(r);
      if (r == rv_.rank) continue;
      if (!exits[i].empty()) {
        out << sep << "rank " << r << " failed: " << exits[i];
        sep = "; ";
      } else if (before[i] == after[i]) {
        out << sep << "rank " << r << " died (no heartbeat for 1.5 s)";
        sep = "; ";
      }
    }
    int64_t most = -1;
    for (const auto& p : progress)
      if (!p.empty()) most = std::max<int64_t>(most, std::stoll(p));
    for (int r = 0; r < rv_.world_size; ++r) {
      const auto& p = progress[static_cast<size_t>(r)];
      if (r != rv_.rank && !p.empty() && std::stoll(p) < most && before[static_cast<size_t>(r)] != after[static_cast<size_t>(r)]) {
        out << sep << "rank " << r << " is alive but behind (step " << p << " while others reached " << most << ")";
        sep = "; ";
      }
    }
    return out.str();
  } catch (const std::exception&) {
    if (rv_.rank == 0) return "";
    return "the rendezvous store hosted by rank 0 (" + rv_.master_addr + ":" + std::to_string(rv_.master_port) +
           ") is unreachable: rank 0 died";
  }
}

namespace {
// How VALUE differs from REF for a reader: both values when short, the first field that differs
// when both are JSON (a config and plan), else nothing.
std::string difference(const std::string& ref, const std::string& value) {
  constexpr size_t kShort = 40;
  if (ref.size() <= kShort && value.size() <= kShort) return " ('" + value + "' against '" + ref + "')";
  const auto a = nlohmann::json::parse(ref, nullptr, false), b = nlohmann::json::parse(value, nullptr, false);
  if (a.is_discarded() || b.is_discarded()) return "";
  const auto patch = nlohmann::json::diff(a, b);
  if (patch.empty()) return "";
  const auto& first = patch.front();
  const std::string path = first.value("path", "");
  const nlohmann::json::json_pointer at(path);
  auto shown = [&](const nlohmann::json& j) {
    if (!j.contains(at)) return std::string("nothing");
    std::string text = j.at(at).dump();
    return text.size() > 60 ? text.substr(0, 57) + "..." : text;
  };
  return " (first difference at " + path + ": " + shown(b) + " against " + shown(a) + ")";
}
}  // namespace

void World::check_same(const std::string& what, const std::string& value, const std::string& round) {
  std::string key = "alloy/check/" + round + what + "/";
  store_->set(key + std::to_string(rv_.rank), bytes_of(value));
  std::vector<std::string> keys;
  for (int r = 0; r < rv_.world_size; ++r) keys.push_back(key + std::to_string(r));
  try {
    store_->wait(keys, timeout_);
  } catch (const std::exception& e) {
    std::string missing;
    for (int r = 0; r < rv_.world_size; ++r)
      if (!store_->check({keys[static_cast<size_t>(r)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    throw Error("rank " + std::to_string(rv_.rank) + ": rank(s) " + missing + " never reported their " + what);
  }
  const std::string ref = str_of(store_->get(keys[0]));
  std::string differ, how;
  for (int r = 1; r < rv_.world_size; ++r) {
    std::string v = str_of(store_->get(keys[static_cast<size_t>(r)]));
    if (v == ref) continue;
    if (differ.empty()) how = difference(ref, v);
    differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!differ.empty())
    throw Error("rank(s) " + differ + " hold a different " + what + " than rank 0" + how + ": every rank must be started with the same " + what);
}

std::vector<std::string> World::machines() {
  std::vector<std::string> out;
  for (int r = 0; r < rv_.world_size; ++r) out.push_back(str_of(store_->get("alloy/machine/" + std::to_string(r))));
  return out;
}

std::shared_ptr<Group> World::new_group(const std::string& name, std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  auto g = std::make_shared<Group>(name, ranks, rv_.rank);
  g->gloo_ = connect_gloo("alloy/group/" + name, g->rank(), g->size(), "rank " + std::to_string(rv_.rank) + ": connecting group '" + name + "'");
  if (device_.is_cuda()) {
    std::vector<std::string> published;
    for (int r : g->ranks()) {
      try {
        published.push_back(published_device(r));
      } catch (const Error& e) {
        throw Error(std::string(e.what()) + " (group '" + name + "')");
      }
    }
    if (nccl_eligible(published)) {
      try {
        g->device_ = make_nccl(c10::make_intrusive<c10d::PrefixStore>("alloy/nccl/" + name, store_), g->rank(), g->size(), timeout_);
        // The communicator now, not at the group's first sum in a step: made then, NCCL's set-up
        // would run while pipeline channels' kernels wait on the GPU for a neighbour.
        at::Tensor probe = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
        wait_work(g->device_->allreduce_sum(probe), "the first sum of group '" + name + "' on NCCL");
        (void)probe.item<float>();
      } catch (const std::exception& e) {
        throw Error("rank " + std::to_string(rv_.rank) + ": NCCL for group '" + name + "' failed: " + first_line(e) +
                    " (ALLOY_NCCL=0 on any rank keeps such groups on Gloo)");
      }
    }
  }
  return g;
}

std::string World::published_device(int rank) {
  const std::string key = "alloy/device/" + std::to_string(rank);
  try {
    store_->wait({key}, timeout_);
  } catch (const std::exception&) {
    throw Error("rank " + std::to_string(rv_.rank) + ": rank " + std::to_string(rank) + " never said which device it trains on");
  }
  return str_of(store_->get(key));
}

std::unique_ptr<DeviceCollectives> World::new_pair(const std::string& name, int first, int second, bool nccl) {
  if (rv_.rank != first && rv_.rank != second)
    throw Error("rank " + std::to_string(rv_.rank) + " is not in pair '" + name + "' (internal error)");
  const int me = rv_.rank == first ? 0 : 1;
  const std::string who = "rank " + std::to_string(rv_.rank) + ": pair '" + name + "' with rank " + std::to_string(me ? first : second);
  if (nccl) {
    try {
      return make_nccl(c10::make_intrusive<c10d::PrefixStore>("alloy/pair/" + name, store_), me, 2, timeout_, /*high_priority=*/true);
    } catch (const std::exception& e) {
      throw Error(who + ": NCCL failed: " + first_line(e) + " (ALLOY_NCCL=0 on either rank keeps it on Gloo)");
    }
  }
  return std::make_unique<CollectivesOf<c10d::ProcessGroupGloo>>(connect_gloo("alloy/pair/" + name, me, 2, who + ": connecting"));
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> World::connect_gloo(const std::string& prefix, int rank, int size, const std::string& what) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
  opts->devices.push_back(make_gloo_device(rv_));
  opts->threads = 1;  // one worker per group: several groups per rank, and under a CPU quota every thread costs
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(prefix, store_), rank, size, opts);
  } catch (const std::exception& e) {
    throw Error(with_failure_report(what + " failed: " + first_line(e)));
  }
}

std::string World::with_failure_report(const std::string& message) {
  const std::string report = failure_report();
  return report.empty() ? message : message + "\n  " + report;
}

bool nccl_eligible(const std::vector<std::string>& published) {
  // Every member on a GPU of its own, every member able and willing to use NCCL ("cuda:" means
  // both; "cuda-gloo:" a rank built without NCCL or run with ALLOY_NCCL=0). Every member reads the
  // same published strings, so all decide alike.
  std::set<std::string> gpus;
  for (const auto& dev : published) {
    // A GPU is its UUID where the label has one (one GPU may show under two indices), else its
    // index and machine.
    const size_t hash = dev.find('#');
    if (dev.rfind("cuda:", 0) != 0 || !gpus.insert(hash == std::string::npos ? dev : dev.substr(hash)).second) return false;
  }
  return !published.empty();
}

std::string device_label(const at::Device& device, bool nccl) {
  if (device.is_cpu()) return "cpu";
  if (!device.is_cuda()) return device.str();
  // Which GPU of which machine ("cuda:0@host#<uuid>"), so members sharing one are told apart and
  // ranks each seeing their own GPU as cuda:0 are not taken for one; a rank that cannot or will
  // not use NCCL says so ("cuda-gloo:0@host") and its groups stay on Gloo for all.
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  const int index = device.has_index() ? device.index() : 0;
  const std::string uuid = gpu_uuid(index);
  return std::string(nccl ? "cuda:" : "cuda-gloo:") + std::to_string(index) + "@" + host + (uuid.empty() ? "" : "#" + uuid);
}

bool nccl_allowed_by(const char* value) {
  if (!value) return true;
  const std::string v = value;
  return v != "0" && v != "off" && v != "false";
}

bool nccl_wanted() { return nccl_built() && nccl_allowed_by(std::getenv("ALLOY_NCCL")); }

void World::set_device(const at::Device& device) {
  device_ = device;
  store_->set("alloy/device/" + std::to_string(rv_.rank), bytes_of(device_label(device, nccl_wanted())));
}

Group& World::all() { return *all_; }

}  // namespace alloy::dist
