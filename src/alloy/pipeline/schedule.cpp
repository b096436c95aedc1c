#include "alloy/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace alloy::pipeline {

namespace {

void check_args(const char* who, int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(who) + "(stage " + std::to_string(stage) + ", stages " +
                                std::to_string(num_stages) + ", micro-batches " + std::to_string(num_micro_batches) +
                                "): " + why);
  };
  if (num_stages < 1) fail("a pipeline needs at least one stage");
  if (stage < 0 || stage >= num_stages) fail("stage must be in [0, " + std::to_string(num_stages) + ")");
  if (num_micro_batches < 1) fail("a step needs at least one micro-batch");
}

// Appends a forward with its receive and send, so every schedule gets the placement rules from
// one place. FIRST / LAST: the stage starts / ends the pipeline, in its chunk 0 / LAST_CHUNK (an
// interleaved rank's chunks in between have neighbours both ways).
struct Builder {
  bool first, last;
  std::vector<Action> out;
  int64_t last_chunk = 0;
  void forward(int64_t m, int64_t v = 0) {
    if (!(first && v == 0)) out.push_back({ActionKind::RecvActivation, m, v});
    out.push_back({ActionKind::Forward, m, v});
    if (!(last && v == last_chunk)) out.push_back({ActionKind::SendActivation, m, v});
  }
  void backward(int64_t m, int64_t v = 0) {
    if (!(last && v == last_chunk)) out.push_back({ActionKind::RecvGrad, m, v});
    out.push_back({ActionKind::Backward, m, v});
    if (!(first && v == 0)) out.push_back({ActionKind::SendGrad, m, v});
  }
  void weight(int64_t m) { out.push_back({ActionKind::BackwardWeight, m}); }
};

Builder builder(int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  Builder b{stage == 0, stage == num_stages - 1, {}};
  const int64_t per_mb = 2 + (b.first ? 0 : 2) + (b.last ? 0 : 2);
  b.out.reserve(static_cast<size_t>(per_mb * num_micro_batches));
  return b;
}

}  // namespace

std::vector<Action> gpipe(int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  check_args("gpipe", stage, num_stages, num_micro_batches);
  Builder b = builder(stage, num_stages, num_micro_batches);
  for (int64_t m = 0; m < num_micro_batches; ++m) b.forward(m);
  for (int64_t m = 0; m < num_micro_batches; ++m) b.backward(m);
  return std::move(b.out);
}

int64_t one_f_one_b_warmup(int64_t extra, int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  // Stage i must run ahead by the number of stages after it, so that (with messages that take no
  // time) the gradient of its oldest micro-batch arrives just as its steady phase starts. Eager
  // runs EXTRA forwards further ahead on every stage but the last (whose backward waits on nothing).
  const int64_t ahead = num_stages - stage - 1 + (stage + 1 < num_stages ? extra : 0);
  return std::min(ahead, num_micro_batches);
}

int64_t eager_extra(const std::string& name) {
  if (name == "1f1b") return 0;
  if (name == "eager-1f1b") return 1;
  static_assert(kMaxEagerExtra <= 9, "eager_extra reads the depth as one digit");
  const std::string prefix = "eager-1f1b-";
  if (name.size() == prefix.size() + 1 && name.compare(0, prefix.size(), prefix) == 0) {
    const int64_t n = name.back() - '0';
    if (n >= 2 && n <= kMaxEagerExtra) return n;
  }
  return -1;
}

namespace {

std::vector<Action> one_f_one_b_with(const char* who, int64_t extra, int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  check_args(who, stage, num_stages, num_micro_batches);
  Builder b = builder(stage, num_stages, num_micro_batches);
  const int64_t warmup = one_f_one_b_warmup(extra, stage, num_stages, num_micro_batches);
  const int64_t steady = num_micro_batches - warmup;
  for (int64_t m = 0; m < warmup; ++m) b.forward(m);
  for (int64_t i = 0; i < steady; ++i) {
    b.forward(warmup + i);
    b.backward(i);
  }
  for (int64_t m = steady; m < num_micro_batches; ++m) b.backward(m);
  return std::move(b.out);
}

}  // namespace

std::vector<Action> one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  return one_f_one_b_with("one_f_one_b", 0, stage, num_stages, num_micro_batches);
}

std::vector<Action> eager_one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t extra) {
  if (extra < 1 || extra > kMaxEagerExtra)
    throw std::invalid_argument("eager_one_f_one_b: " + std::to_string(extra) + " extra forwards (1 to " + std::to_string(kMaxEagerExtra) + ")");
  return one_f_one_b_with("eager_one_f_one_b", extra, stage, num_stages, num_micro_batches);
}

std::vector<Action> zb_h1(int64_t stage, int64_t num_stages, int64_t num_micro_batches) {
  check_args("zb_h1", stage, num_stages, num_micro_batches);
  Builder b = builder(stage, num_stages, num_micro_batches);
  const int64_t M = num_micro_batches;
  const int64_t warmup = std::min(num_stages - stage - 1, M), steady = M - warmup;
  // Stage i holds back i weight passes: the later a stage, the sooner its last backward must come,
  // since every stage before it waits for that backward's gradient. Stage 0 sends no gradient and
  // holds none back, so it runs whole backwards (a split costs it time and gains nothing).
  const int64_t lag = stage;
  int64_t next_w = stage == 0 ? M : 0;
  auto weights_after = [&](int64_t backwards_done) {
    for (; next_w < backwards_done - lag; ++next_w) b.weight(next_w);
  };
  for (int64_t m = 0; m < warmup; ++m) b.forward(m);
  for (int64_t i = 0; i < steady; ++i) {
    b.forward(warmup + i);
    b.backward(i);
    weights_after(i + 1);
  }
  for (int64_t m = steady; m < M; ++m) {
    b.backward(m);
    weights_after(m + 1);
  }
  for (; next_w < M; ++next_w) b.weight(next_w);
  return std::move(b.out);
}

int64_t interleaved_warmup(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t virtual_stages) {
  // Rank s's first backward is of the last chunk's oldest micro-batch: before it arrives, every
  // chunk before the last must have forwarded that group of S micro-batches ((V - 1) S forwards),
  // and the ranks after s must finish their share of the round trip (two per rank: the forward
  // going on and the backward coming back).
  return std::min(num_micro_batches * virtual_stages, 2 * (num_stages - stage - 1) + (virtual_stages - 1) * num_stages);
}

std::vector<Action> interleaved_one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t virtual_stages) {
  check_args("interleaved_one_f_one_b", stage, num_stages, num_micro_batches);
  if (num_stages < 2 || virtual_stages < 2)
    throw std::invalid_argument("interleaved_one_f_one_b: " + std::to_string(num_stages) + " stages of " + std::to_string(virtual_stages) +
                                " chunks each (interleaving needs at least 2 stages and 2 chunks a stage)");
  // A last group shorter than S breaks the warm-up's count: with a short last group some ranks
  // wait on each other (S = 4, M = 5 deadlocks). Megatron asks the same of its interleaved schedule.
  if (num_micro_batches > num_stages && num_micro_batches % num_stages != 0)
    throw std::invalid_argument("interleaved_one_f_one_b: " + std::to_string(num_micro_batches) + " micro-batches on " +
                                std::to_string(num_stages) + " stages (interleaving needs a multiple of the stages, or at most as many)");
  const int64_t S = num_stages, M = num_micro_batches, V = virtual_stages, total = M * V;
  // The K-th forward (BACKWARD: backward) of every rank, as (chunk, micro-batch): groups of G =
  // min(S, M) micro-batches (the checks above leave no shorter last group), the chunks in turn
  // within a group (reversed for backwards).
  const int64_t G = std::min(S, M);
  auto item = [&](int64_t k, bool backward, int64_t& chunk, int64_t& m) {
    const int64_t r = k % (G * V);
    chunk = backward ? V - 1 - r / G : r / G;
    m = k / (G * V) * G + r % G;
  };
  Builder b = builder(stage, S, M);
  b.last_chunk = V - 1;
  b.out.reserve(static_cast<size_t>(6 * total));
  auto forward = [&](int64_t k) {
    int64_t v, m;
    item(k, false, v, m);
    b.forward(m, v);
  };
  auto backward = [&](int64_t k) {
    int64_t v, m;
    item(k, true, v, m);
    b.backward(m, v);
  };
  const int64_t warmup = interleaved_warmup(stage, S, M, V);
  for (int64_t k = 0; k < warmup; ++k) forward(k);
  for (int64_t k = 0; k < total - warmup; ++k) {
    forward(warmup + k);
    backward(k);
  }
  for (int64_t k = total - warmup; k < total; ++k) backward(k);
  return std::move(b.out);
}

bool splits_backward(const std::string& name) { return name == "zb-h1"; }

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = {"1f1b", "eager-1f1b"};
    for (int64_t k = 2; k <= kMaxEagerExtra; ++k) n.push_back("eager-1f1b-" + std::to_string(k));
    n.insert(n.end(), {"gpipe", "zb-h1"});
    return n;
  }();
  return names;
}

std::string schedule_names_text(const char* last_sep) {
  const auto& n = schedule_names();
  std::string out;
  for (size_t i = 0; i < n.size(); ++i) out += (i == 0 ? "" : i + 1 == n.size() ? last_sep : ", ") + n[i];
  return out;
}

bool is_schedule_name(const std::string& name) {
  const auto& n = schedule_names();
  return name == kInterleaved || std::find(n.begin(), n.end(), name) != n.end();
}

std::vector<Action> make_schedule(const std::string& name, int64_t stage, int64_t num_stages, int64_t num_micro_batches,
                                  int64_t virtual_stages) {
  if (name == kInterleaved) return interleaved_one_f_one_b(stage, num_stages, num_micro_batches, virtual_stages);
  if (virtual_stages != 1 && is_schedule_name(name))
    throw std::invalid_argument("pipeline schedule '" + name + "' runs one chunk a stage, not " + std::to_string(virtual_stages) +
                                " (virtual stages need " + kInterleaved + ")");
  if (name == "1f1b") return one_f_one_b(stage, num_stages, num_micro_batches);
  if (const int64_t extra = eager_extra(name); extra > 0) return eager_one_f_one_b(stage, num_stages, num_micro_batches, extra);
  if (name == "gpipe") return gpipe(stage, num_stages, num_micro_batches);
  if (name == "zb-h1") return zb_h1(stage, num_stages, num_micro_batches);
  throw std::invalid_argument("unknown pipeline schedule '" + name + "' (valid: " + schedule_names_text() + ", " + kInterleaved + ")");
}

std::string to_string(const Action& a) {
  const char* prefix = "?";
  switch (a.kind) {
    case ActionKind::RecvActivation: prefix = "recvA"; break;
    case ActionKind::Forward: prefix = "F"; break;
    case ActionKind::SendActivation: prefix = "sendA"; break;
    case ActionKind::RecvGrad: prefix = "recvG"; break;
    case ActionKind::Backward: prefix = "B"; break;
    case ActionKind::SendGrad: prefix = "sendG"; break;
    case ActionKind::BackwardWeight: prefix = "W"; break;
  }
  return prefix + std::to_string(a.micro_batch) + (a.chunk != 0 ? "." + std::to_string(a.chunk) : "");
}

std::string to_string(const std::vector<Action>& actions) {
  std::string s;
  for (const auto& a : actions) {
    if (!s.empty()) s += ' ';
    s += to_string(a);
  }
  return s;
}

size_t last_backward_index(const std::vector<Action>& actions) {
  for (size_t i = actions.size(); i-- > 0;)
    if (actions[i].kind == ActionKind::Backward) return i;
  return actions.size();
}

namespace {

struct Message {
  int64_t micro_batch;
  double arrival;
};

// What a stage has done with one micro-batch; the simulator refuses any action whose inputs the
// executor would not have at that point.
struct MbState {
  bool recv_act = false, forward = false, send_act = false, recv_grad = false, backward = false, send_grad = false, weight = false;
};

}  // namespace

void SimCosts::check(const char* who, size_t num_stages, int64_t num_micro_batches) const {
  for (const auto* per : {&forward_mb, &backward_mb, &weight_mb})
    for (size_t s = 0; s < per->size() && s < num_stages; ++s) {
      const auto& v = (*per)[s];
      if (v.empty()) continue;
      if (static_cast<int64_t>(v.size()) < num_micro_batches)
        throw std::invalid_argument(std::string(who) + ": per-micro-batch costs of stage " + std::to_string(s) + " cover " +
                                    std::to_string(v.size()) + " of " + std::to_string(num_micro_batches) + " micro-batches");
      for (double c : v)
        if (c < 0) throw std::invalid_argument(std::string(who) + ": negative compute cost for stage " + std::to_string(s));
    }
  const bool any_weight = !weight.empty() || !weight_mb.empty();
  for (size_t s = 0; any_weight && s < num_stages; ++s)
    for (int64_t m = 0; m < num_micro_batches; ++m) {
      const double w = weight_of(s, m);
      if (w < 0 || w > backward_of(s, m))
        throw std::invalid_argument(std::string(who) + ": stage " + std::to_string(s) + "'s weight pass (" + std::to_string(w) +
                                    " s) is negative or larger than its whole backward (" + std::to_string(backward_of(s, m)) + " s)");
    }
  for (size_t link = 0; link < p2p_latency.size() && link + 1 < num_stages; ++link) {
    const double whole = p2p_link.empty() ? p2p : link < p2p_link.size() ? p2p_link[link] : 0.0;
    if (p2p_latency[link] < 0 || p2p_latency[link] > whole)
      throw std::invalid_argument(std::string(who) + ": link " + std::to_string(link) + "'s latency (" + std::to_string(p2p_latency[link]) +
                                  " s) is negative or longer than its message time (" + std::to_string(whole) + " s)");
  }
}

SimResult simulate(const std::vector<std::vector<Action>>& per_stage, const SimCosts& costs) {
  // R ranks, each with V chunks (1 unless the lists are interleaved): C = R V virtual stages, the
  // costs indexed by virtual stage (chunk R + rank).
  const size_t R = per_stage.size();
  int64_t max_mb = -1, max_chunk = 0;
  for (size_t s = 0; s < R; ++s)
    for (const auto& a : per_stage[s]) {
      max_mb = std::max(max_mb, a.micro_batch);
      max_chunk = std::max(max_chunk, a.chunk);
      if (a.chunk < 0) throw std::logic_error("pipeline schedule: stage " + std::to_string(s) + " (" + to_string(a) + "): negative chunk");
    }
  const size_t V = static_cast<size_t>(max_chunk + 1), C = R * V;
  if (V > 1 && R < 2) throw std::logic_error("pipeline schedule: chunks on a one-stage pipeline (interleaving needs two stages or more)");
  if (costs.forward.size() < C || costs.backward.size() < C)
    throw std::invalid_argument("simulate: costs cover " + std::to_string(std::min(costs.forward.size(), costs.backward.size())) +
                                " stages, the schedule has " + std::to_string(C) + (V > 1 ? " virtual stages" : ""));
  for (size_t c = 0; c < C; ++c)
    if (costs.forward[c] < 0 || costs.backward[c] < 0)
      throw std::invalid_argument("simulate: negative compute cost for stage " + std::to_string(c));
  if (costs.p2p < 0) throw std::invalid_argument("simulate: negative p2p cost");
  // Interleaved over three ranks or more, the wrap from the last rank to the first is a link of its own.
  const size_t links = V > 1 && R > 2 ? R : R - (R > 0 ? 1 : 0);
  if (!costs.p2p_link.empty() && costs.p2p_link.size() < links)
    throw std::invalid_argument("simulate: p2p_link covers " + std::to_string(costs.p2p_link.size()) + " links, the pipeline has " +
                                std::to_string(links) + (links == R && R > 1 ? " (the wrap from the last stage to the first included)" : ""));
  for (double p : costs.p2p_link)
    if (p < 0) throw std::invalid_argument("simulate: negative p2p cost on a link");
  costs.check("simulate", C, max_mb + 1);

  // act[c]: activations travelling virtual stage c -> c+1; grad[c]: gradients travelling c+1 -> c.
  // dir_last[a R + b]: when the last message sent from rank a to rank b has left (a direction
  // carries one message's bytes at a time, whatever its kind).
  std::vector<std::deque<Message>> act(C), grad(C);
  std::vector<double> dir_last(R * R, 0.0);
  auto rank_of = [&](size_t c) { return c % R; };
  auto link_between = [&](size_t a, size_t b) { return a + 1 == b || b + 1 == a ? std::min(a, b) : R - 1; };
  std::vector<size_t> pc(R, 0);
  std::vector<double> clock(R, 0.0);
  std::vector<int64_t> in_flight(R, 0);
  std::vector<std::unordered_map<int64_t, MbState>> state(R);  // by micro-batch V + chunk
  std::vector<std::vector<SimEvent>> events(R);
  SimResult r;
  r.peak_in_flight.assign(R, 0);
  r.last_backward_start.assign(R, 0.0);
  r.last_backward_end.assign(R, 0.0);
  // A stage whose list has weight passes runs the input part of its backward in Backward, and a
  // micro-batch's activations stay until its weight pass.
  std::vector<char> split(R, 0);
  for (size_t s = 0; s < R; ++s)
    for (const auto& a : per_stage[s]) split[s] |= a.kind == ActionKind::BackwardWeight;

  auto fail = [&](size_t s, const Action& a, const std::string& why) {
    throw std::logic_error("pipeline schedule: stage " + std::to_string(s) + " action " + std::to_string(pc[s]) + " (" +
                           to_string(a) + "): " + why);
  };
  // Returns false when the stage must wait for a message that has not been sent yet.
  auto receive = [&](size_t s, const Action& a, std::deque<Message>& box, const char* what) {
    if (box.empty()) return false;
    if (box.front().micro_batch != a.micro_batch)
      fail(s, a, std::string("the next ") + what + " on this link is for micro-batch " + std::to_string(box.front().micro_batch) +
                     " (both sides must use the same micro-batch order)");
    const double start = clock[s];
    clock[s] = std::max(clock[s], box.front().arrival);
    box.pop_front();
    events[s].push_back({static_cast<int64_t>(s), a, start, clock[s]});
    return true;
  };
  // A message from rank S to rank TO.
  auto send = [&](size_t s, const Action& a, std::deque<Message>& box, size_t to) {
    const double arrival = costs.carry(link_between(s, to), clock[s], dir_last[s * R + to]);
    box.push_back({a.micro_batch, arrival});
    events[s].push_back({static_cast<int64_t>(s), a, clock[s], arrival});
  };
  auto compute = [&](size_t s, const Action& a, double cost) {
    events[s].push_back({static_cast<int64_t>(s), a, clock[s], clock[s] + cost});
    clock[s] += cost;
  };

  // Timing is pure dataflow: a stage's times depend only on its own list and the arrival times of
  // its messages, which are fixed once sent. So advancing stages in any order until none can move
  // gives the same timelines as an event-driven simulation, and "none can move, some unfinished"
  // is exactly deadlock.
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t s = 0; s < R; ++s) {
      for (; pc[s] < per_stage[s].size(); ++pc[s]) {
        const Action& a = per_stage[s][pc[s]];
        if (a.micro_batch < 0) fail(s, a, "negative micro-batch");
        const size_t c = static_cast<size_t>(a.chunk) * R + s;  // the virtual stage
        const bool first = c == 0, last = c + 1 == C;
        MbState& st = state[s][a.micro_batch * static_cast<int64_t>(V) + a.chunk];
        auto once = [&](bool& done) {
          if (done) fail(s, a, "repeated for the same micro-batch");
          done = true;
        };
        bool blocked = false;
        switch (a.kind) {
          case ActionKind::RecvActivation:
            if (first) fail(s, a, "the first stage has no previous stage to receive from");
            if (st.recv_act) fail(s, a, "repeated for the same micro-batch");
            blocked = !receive(s, a, act[c - 1], "activation");
            if (!blocked) st.recv_act = true;
            break;
          case ActionKind::Forward:
            if (!first && !st.recv_act) fail(s, a, "forward before its activation was received");
            once(st.forward);
            compute(s, a, costs.forward_of(c, a.micro_batch));
            if (++in_flight[s] > r.peak_in_flight[s]) r.peak_in_flight[s] = in_flight[s];
            break;
          case ActionKind::SendActivation:
            if (last) fail(s, a, "the last stage has no next stage to send to");
            if (!st.forward) fail(s, a, "sends an activation that has not been computed");
            once(st.send_act);
            send(s, a, act[c], rank_of(c + 1));
            break;
          case ActionKind::RecvGrad:
            if (last) fail(s, a, "the last stage has no next stage to receive from");
            if (st.recv_grad) fail(s, a, "repeated for the same micro-batch");
            blocked = !receive(s, a, grad[c], "gradient");
            if (!blocked) st.recv_grad = true;
            break;
          case ActionKind::Backward:
            if (!st.forward) fail(s, a, "backward before forward");
            if (!last && !st.recv_grad) fail(s, a, "backward before its gradient was received");
            once(st.backward);
            compute(s, a, costs.backward_of(c, a.micro_batch) - (split[s] ? costs.weight_of(c, a.micro_batch) : 0.0));
            if (!split[s]) --in_flight[s];
            break;
          case ActionKind::BackwardWeight:
            if (!st.backward) fail(s, a, "weight pass before its backward");
            once(st.weight);
            compute(s, a, costs.weight_of(c, a.micro_batch));
            --in_flight[s];
            break;
          case ActionKind::SendGrad:
            if (first) fail(s, a, "the first stage has no previous stage to send to");
            if (!st.backward) fail(s, a, "sends a gradient that has not been computed");
            once(st.send_grad);
            send(s, a, grad[c - 1], rank_of(c - 1));
            break;
        }
        if (blocked) break;
        progress = true;
      }
    }
  }

  std::string stuck;
  for (size_t s = 0; s < R; ++s)
    if (pc[s] < per_stage[s].size())
      stuck += (stuck.empty() ? "" : ", ") + ("stage " + std::to_string(s) + " waits at action " + std::to_string(pc[s]) + " (" +
                                              to_string(per_stage[s][pc[s]]) + ")");
  if (!stuck.empty()) throw std::logic_error("pipeline schedule deadlocks: " + stuck);

  std::string left;
  auto name = [&](size_t c) {
    return "stage " + std::to_string(rank_of(c)) + (V > 1 ? " chunk " + std::to_string(c / R) : std::string());
  };
  for (size_t c = 0; c + 1 < C; ++c) {
    for (const auto& m : act[c]) left += (left.empty() ? "" : ", ") + ("activation " + std::to_string(m.micro_batch) + " from " + name(c));
    for (const auto& m : grad[c]) left += (left.empty() ? "" : ", ") + ("gradient " + std::to_string(m.micro_batch) + " from " + name(c + 1));
  }
  if (!left.empty()) throw std::logic_error("pipeline schedule: sent but never received: " + left);

  for (size_t s = 0; s < R; ++s) {
    for (const auto& e : events[s]) {
      r.makespan = std::max(r.makespan, e.end);
      if (e.action.kind == ActionKind::Backward && !split[s]) r.last_backward_start[s] = e.start, r.last_backward_end[s] = e.end;
      if (e.action.kind == ActionKind::BackwardWeight) {
        r.last_backward_end[s] = e.end;
        r.last_backward_start[s] = e.end - costs.backward_of(static_cast<size_t>(e.action.chunk) * R + s, e.action.micro_batch);
      }
    }
    r.events.insert(r.events.end(), events[s].begin(), events[s].end());
  }
  return r;
}

StageTimes simulate_times(const std::string& schedule, int64_t num_stages, int64_t num_micro_batches, const SimCosts& costs) {
  const bool gp = schedule == "gpipe", zb = schedule == "zb-h1";
  const int64_t extra = eager_extra(schedule);
  if (!gp && !zb && extra < 0) make_schedule(schedule, 0, 1, 1);  // throws, naming the valid schedules
  check_args("simulate_times", 0, num_stages, num_micro_batches);
  const int64_t S = num_stages, M = num_micro_batches;
  const size_t Su = static_cast<size_t>(S);
  if (costs.forward.size() < Su || costs.backward.size() < Su)
    throw std::invalid_argument("simulate_times: costs cover " + std::to_string(std::min(costs.forward.size(), costs.backward.size())) +
                                " stages, the pipeline has " + std::to_string(S));
  if (!costs.p2p_link.empty() && costs.p2p_link.size() + 1 < Su)
    throw std::invalid_argument("simulate_times: p2p_link covers " + std::to_string(costs.p2p_link.size()) + " links, the pipeline has " +
                                std::to_string(S - 1));
  for (size_t s = 0; s < Su; ++s)
    if (costs.forward[s] < 0 || costs.backward[s] < 0)
      throw std::invalid_argument("simulate_times: negative compute cost for stage " + std::to_string(s));
  if (costs.p2p < 0) throw std::invalid_argument("simulate_times: negative p2p cost");
  for (double p : costs.p2p_link)
    if (p < 0) throw std::invalid_argument("simulate_times: negative p2p cost on a link");
  costs.check("simulate_times", Su, M);

  StageTimes r;
  r.last_backward_start.assign(Su, 0.0);
  r.last_backward_end.assign(Su, 0.0);
  r.peak_in_flight.assign(Su, 0);
  // End times of each stage's forwards and backwards by micro-batch; -1 = not run yet (real
  // times are >= 0). Receives and sends are folded into the compute that follows or precedes
  // them: a receive only moves the stage clock to the arrival time, which is what simulate() does.
  // Scratch kept per thread: the planner calls this millions of times on small pipelines.
  thread_local std::vector<double> end_f, end_b, clock;
  thread_local std::vector<int64_t> pc, in_flight;
  // When the last message on each link direction has left: activations s -> s+1, gradients back.
  thread_local std::vector<double> last_a, last_g;
  last_a.assign(Su, 0.0);
  last_g.assign(Su, 0.0);
  end_f.assign(static_cast<size_t>(S * M), -1.0);
  end_b.assign(static_cast<size_t>(S * M), -1.0);
  pc.assign(Su, 0);
  in_flight.assign(Su, 0);
  clock.assign(Su, 0.0);
  enum Op : char { kF, kB, kW };
  // zb-h1's weight passes sit where zb_h1() puts them: its compute actions, per (S, M) once.
  thread_local std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<std::pair<Op, int64_t>>>> zb_ops;
  const std::vector<std::vector<std::pair<Op, int64_t>>>* zops = nullptr;
  if (zb) {
    if (zb_ops.size() > 256 && !zb_ops.count({S, M})) zb_ops.clear();  // the planner sweeps (S, M): keep it bounded
    auto& lists = zb_ops[{S, M}];
    if (lists.empty())
      for (int64_t s = 0; s < S; ++s) {
        lists.emplace_back();
        for (const Action& a : zb_h1(s, S, M))
          if (a.kind == ActionKind::Forward || a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight)
            lists.back().push_back({a.kind == ActionKind::Forward ? kF : a.kind == ActionKind::Backward ? kB : kW, a.micro_batch});
      }
    zops = &lists;
  }
  // Compute ops of stage s: a forward and a backward per micro-batch, and zb_h1's weight passes.
  auto n_ops = [&](size_t s) { return zops ? static_cast<int64_t>((*zops)[s].size()) : 2 * M; };
  // Op K of stage s as (kind, micro-batch), following gpipe() / (eager_)one_f_one_b() / zb_h1() exactly.
  auto op = [&](int64_t s, int64_t k, Op& kind, int64_t& j) {
    if (zops) {
      const auto& o = (*zops)[static_cast<size_t>(s)][static_cast<size_t>(k)];
      kind = o.first, j = o.second;
      return;
    }
    if (gp) {
      kind = k < M ? kF : kB;
      j = k < M ? k : k - M;
      return;
    }
    const int64_t w = one_f_one_b_warmup(extra < 0 ? 0 : extra, s, S, M);
    if (k < w) {
      kind = kF, j = k;
    } else if (k < 2 * M - w) {
      const int64_t i = (k - w) / 2;
      const bool fwd = (k - w) % 2 == 0;
      kind = fwd ? kF : kB;
      j = fwd ? w + i : i;
    } else {
      kind = kB, j = M - w + (k - (2 * M - w));
    }
  };
  int64_t done = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < S; ++s) {
      const size_t su = static_cast<size_t>(s);
      for (const int64_t n = n_ops(su); pc[su] < n; ++pc[su]) {
        Op kind;
        int64_t j;
        op(s, pc[su], kind, j);
        double t = clock[su];
        if (kind == kW) {
          clock[su] = t + costs.weight_of(su, j);
          --in_flight[su];
          r.last_backward_end[su] = clock[su];
          r.last_backward_start[su] = clock[su] - costs.backward_of(su, j);
        } else if (kind == kF) {
          if (s > 0) {
            const double a = end_f[static_cast<size_t>((s - 1) * M + j)];
            if (a < 0) break;
            t = std::max(t, costs.carry(su - 1, a, last_a[su - 1]));
          }
          clock[su] = t + costs.forward_of(su, j);
          end_f[static_cast<size_t>(s * M + j)] = clock[su];
          r.peak_in_flight[su] = std::max(r.peak_in_flight[su], ++in_flight[su]);
        } else {
          if (s + 1 < S) {
            const double a = end_b[static_cast<size_t>((s + 1) * M + j)];
            if (a < 0) break;
            t = std::max(t, costs.carry(su, a, last_g[su]));
          }
          const bool split = zb && s > 0;  // zb_h1's stage 0 runs whole backwards
          clock[su] = t + (costs.backward_of(su, j) - (split ? costs.weight_of(su, j) : 0.0));
          end_b[static_cast<size_t>(s * M + j)] = clock[su];
          if (!split) {
            --in_flight[su];
            r.last_backward_start[su] = t;
            r.last_backward_end[su] = clock[su];
          }
        }
        progress = true;
      }
    }
    done = 0;
    for (size_t s = 0; s < Su; ++s) done += pc[s] == n_ops(s);
    if (done == S) break;
  }
  if (done != S) throw std::logic_error("simulate_times: schedule '" + schedule + "' deadlocked");
  for (size_t s = 0; s < Su; ++s) r.makespan = std::max(r.makespan, clock[s]);
  return r;
}

}  // namespace alloy::pipeline
