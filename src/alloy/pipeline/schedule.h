#pragma once
// Pipeline schedules as data: for each stage, the ordered list of actions its executor runs for
// one optimizer step. Keeping schedules as plain lists (rather than code inside the executor) lets
// the same schedule be checked, simulated by the cost model and executed, with no drift between
// what is predicted and what runs.
//
// Conventions shared by every schedule here:
//  - micro-batches are numbered 0..M-1 and every stage forwards (and backwards) them in the same
//    order, so the messages on each link pair up in FIFO order, which is what NCCL point-to-point
//    delivers (the executor also checks the micro-batch number carried in each message header);
//  - a receive sits immediately before the Forward/Backward that consumes it and a send
//    immediately after the Forward/Backward that produced it, so buffers live no longer than
//    needed and the executor never has to look ahead;
//  - the first stage has no RecvActivation/SendGrad, the last no SendActivation/RecvGrad; a
//    one-stage pipeline is plain forward/backward (gradient accumulation).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace alloy::pipeline {

// Backward computes the gradients a stage needs to send on (its input's) and those of every
// parameter but the blocks' projection weights under a schedule that has BackwardWeight actions
// (zb-h1): there, BackwardWeight(m) computes those weights' gradients of micro-batch m later,
// off the critical path (Qi et al., "Zero Bubble Pipeline Parallelism", 2023). Schedules without
// BackwardWeight run the whole backward in Backward.
enum class ActionKind { RecvActivation, Forward, SendActivation, RecvGrad, Backward, SendGrad, BackwardWeight };

struct Action {
  ActionKind kind;
  int64_t micro_batch;
  // Interleaved schedules: which of this rank's model chunks (virtual stages) the action is for,
  // 0..V-1; 0 in every other schedule.
  int64_t chunk = 0;
  bool operator==(const Action& o) const { return kind == o.kind && micro_batch == o.micro_batch && chunk == o.chunk; }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

// All forwards, then all backwards (both in micro-batch order): every stage holds the
// activations of all M micro-batches at once.
// Throws std::invalid_argument unless num_stages >= 1, 0 <= stage < num_stages, num_micro_batches >= 1.
std::vector<Action> gpipe(int64_t stage, int64_t num_stages, int64_t num_micro_batches);

// Non-interleaved 1F1B (PipeDream-Flush, Megatron-LM): min(num_stages - stage - 1, M) warm-up
// forwards, then alternating one forward / one backward, then the remaining backwards. Same bubble
// as GPipe, but stage i holds at most min(num_stages - i, M) micro-batches of activations.
// Same argument checks as gpipe().
std::vector<Action> one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches);

// Eager 1F1B: 1F1B with EXTRA more warm-up forwards on every stage but the last (stage i holds up
// to min(S - i + EXTRA, M) micro-batches; the last stage as in 1F1B). Under 1F1B, two stages of
// equal forward+backward time wait in every steady slot for two messages (the activation going on
// and the gradient coming back): one extra forward in flight fills that wait. Stages that differ
// hide the messages in the slower one's slack anyway, so this pays only where they are balanced (a
// cut inside an MLP, PipelinePlan::units_of) or the link is slow. Across a distant link a round
// trip (the activation out, the downstream stage's work, the gradient back) can span several of a
// stage's forwards: more extra forwards keep it busy meanwhile. Each costs one micro-batch of
// activations per stage. Named "eager-1f1b" (EXTRA 1) and "eager-1f1b-N" (EXTRA N, 2 to
// kMaxEagerExtra). Same argument checks as gpipe(), and EXTRA in [1, kMaxEagerExtra].
constexpr int64_t kMaxEagerExtra = 4;
std::vector<Action> eager_one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t extra = 1);
// The warm-up forwards of stage STAGE under 1F1B (EXTRA 0) or eager 1F1B with EXTRA more.
int64_t one_f_one_b_warmup(int64_t extra, int64_t stage, int64_t num_stages, int64_t num_micro_batches);
// The extra forwards of schedule NAME: 0 for "1f1b", 1 for "eager-1f1b", N for "eager-1f1b-N";
// -1 for a schedule outside the 1F1B family (gpipe, zb-h1) or an unknown name.
int64_t eager_extra(const std::string& name);

// Zero-bubble ZB-H1: 1F1B's forwards and (input-gradient) backwards, each followed by its send,
// with stage i > 0 holding back its weight-gradient passes by i micro-batches and running the held
// ones after its last backward (stage 0, which sends no gradient, runs whole backwards). The last stages thus reach their last backward sooner, the
// gradient chain back to stage 0 costs backwards without their weight part, and the weight
// passes fill what were the drain's waits: with equal stages of costs F, B (input part) and W,
// the makespan is M(F+B+W) + (S-1)(F+B-W) where 1F1B takes M(F+B+W) + (S-1)(F+B+W). Stage i
// holds at most min(S, M) micro-batches' activations (1F1B: min(S - i, M)): the held weight
// passes keep their layers' inputs and output gradients.
std::vector<Action> zb_h1(int64_t stage, int64_t num_stages, int64_t num_micro_batches);
// Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
// Clusters Using Megatron-LM", 2021): the pipeline's layers are cut into S x V chunks and rank s
// holds chunks s, S + s, ..., (V - 1) S + s, its V virtual stages; virtual stage c = v S + s
// (Action::chunk v on rank s) hands its activation to c + 1, so the last rank's chunk v feeds
// rank 0's chunk v + 1 (the pipeline wraps round once per chunk). Each rank forwards in groups of
// S micro-batches, all its chunks in turn per group, and backwards in the same groups with the
// chunks reversed; it runs
// min(V M, 2 (S - s - 1) + (V - 1) S) forwards before its first backward, then one of each. With
// equal chunks of f / V and b / V the bubble shrinks V times: M (f + b) + (S - 1)(f + b) / V,
// where 1F1B takes M (f + b) + (S - 1)(f + b); the price is V times the messages (each crossing
// carries a whole hidden state, the wrap link S - 1 -> 0 included) and more activations held:
// rank s up to its warm-up + 1 chunk-micro-batches. Throws std::invalid_argument unless
// num_stages >= 2, virtual_stages >= 2, the gpipe() checks hold and S divides M or M <= S (as in
// Megatron: a last group shorter than S deadlocks under this warm-up, S = 4 and M = 5 does).
std::vector<Action> interleaved_one_f_one_b(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t virtual_stages);
int64_t interleaved_warmup(int64_t stage, int64_t num_stages, int64_t num_micro_batches, int64_t virtual_stages);
// Whether schedule NAME splits the backward (has BackwardWeight actions).
bool splits_backward(const std::string& name);

// "gpipe" | "1f1b" | "eager-1f1b" | "eager-1f1b-N" (N 2..kMaxEagerExtra) | "zb-h1", and
// "interleaved-1f1b" with VIRTUAL_STAGES >= 2 (every other name with 1); anything else throws
// std::invalid_argument naming the valid names.
constexpr const char* kInterleaved = "interleaved-1f1b";
std::vector<Action> make_schedule(const std::string& name, int64_t stage, int64_t num_stages, int64_t num_micro_batches,
                                  int64_t virtual_stages = 1);
// The schedules of one chunk a rank, in the order error messages list them: what the planner
// searches (it does not build interleaved plans; a plan may name kInterleaved).
const std::vector<std::string>& schedule_names();
// Whether a plan may name NAME: schedule_names() and kInterleaved.
bool is_schedule_name(const std::string& name);
// Them joined for a message: "1f1b, gpipe, zb-h1" (SEP ", "), or with LAST_SEP before the last
// ("1f1b, gpipe or zb-h1").
std::string schedule_names_text(const char* last_sep = ", ");

// "F3", "B0", "W0", "recvA3", "sendA3", "recvG1", "sendG1"; an action of chunk v > 0 adds ".v"
// ("F3.1": micro-batch 3 through this rank's second chunk).
std::string to_string(const Action& a);
// Actions joined by spaces, e.g. "F0 sendA0 F1 sendA1 recvG0 B0".
std::string to_string(const std::vector<Action>& actions);

// Index of the last Backward (the reducer arms gradient sync right before it), or actions.size()
// when there is none, so `i == last_backward_index(actions)` is simply never true then.
size_t last_backward_index(const std::vector<Action>& actions);

// --- Simulation -------------------------------------------------------------------------------
// Runs all stages' action lists against each other: receives block until the message is there,
// sends never block the sender. Each link direction is a FIFO, as with NCCL and Gloo's pair
// connections, carrying one message's bytes at a time: a message leaves when it is sent or when
// the bytes of the one before it on that direction have left, whichever is later, and lands its
// link's p2p seconds after (on a thin link, messages sent faster than it carries them queue). The
// latency part of p2p (SimCosts::p2p_latency) is not the link's to hold: messages queued on a
// distant link are in flight together, each landing one latency after its last byte left, as over
// one TCP connection whose receiver has posted its receives ahead (Gloo sends a message's bytes
// once the receiver has said it is ready; the executor posts its receives several messages ahead). A receive whose expected
// micro-batch is not at the head of its mailbox is an error, not a reordering.
//
// Besides deadlock, simulate() throws std::logic_error on schedules the executor could not run:
// a receive on a stage with no neighbour on that side, a send with nothing to send (SendActivation
// before Forward, SendGrad before Backward), Forward without its activation on a non-first stage,
// Backward before Forward or without its gradient on a non-last stage, any action repeated for the
// same micro-batch, a negative micro-batch, or a message still unreceived at the end. It does not
// require every micro-batch to be present; that is a property of the schedule generators, which
// the tests check separately.
//
// Interleaved lists (actions with chunks up to V - 1, per_stage holding each rank's list): the
// pipeline is S x V virtual stages, virtual stage c = chunk x S + rank, and the per-stage costs
// (forward, backward, their _mb and weight forms) are indexed by c; a rank's chunks share its
// clock. Messages between virtual stages c and c + 1 cross link c mod S, and the wrap from rank
// S - 1 to rank 0 crosses link S - 1 (p2p_link then needs S entries; with two ranks it is link 0
// the other way). Messages from one rank to another share that direction's FIFO whatever their
// kind, as on one connection. SimResult's per-stage figures are per rank (peak_in_flight counts
// chunk-micro-batches).
struct SimCosts {
  std::vector<double> forward, backward;  // per stage: seconds per micro-batch
  double p2p = 0;                         // seconds from send to arrival, per message
  // Per link: p2p_link[s] is the message time between stages s and s+1, both directions (links
  // differ in a heterogeneous pool). When non-empty it must cover every link and replaces p2p.
  std::vector<double> p2p_link;
  // Per link: the part of its message time (p2p_link[s]) that is the link's latency, in which
  // messages overlap (see above). Empty, or shorter than the links: 0, every message holds its link
  // direction for its whole time. Must not exceed the link's message time.
  std::vector<double> p2p_latency;
  double latency_of(size_t link) const { return link < p2p_latency.size() ? p2p_latency[link] : 0.0; }
  double link_time(size_t link) const { return p2p_link.empty() ? p2p : p2p_link[link]; }
  // A message sent at SENT over LINK: its bytes leave after LEFT (when the previous message's bytes
  // have left that way), which it updates; returns when it lands. Both simulators carry every
  // message through this, so they agree to the bit.
  double carry(size_t link, double sent, double& left) const {
    const double latency = latency_of(link);
    left = (sent > left ? sent : left) + (link_time(link) - latency);
    return left + latency;
  }
  // Per stage and micro-batch, for stages whose work differs between micro-batches (a floating
  // boundary, PipelinePlan::units_of): a non-empty forward_mb[s] (backward_mb[s]) gives micro-batch
  // m's seconds as forward_mb[s][m] and replaces forward[s] (backward[s]); it must cover every
  // micro-batch.
  std::vector<std::vector<double>> forward_mb, backward_mb;
  // Split backwards (BackwardWeight actions): weight[s] is the part of stage s's backward that
  // its BackwardWeight runs (per micro-batch: weight_mb[s][m] when non-empty), the rest its
  // Backward. Empty (or shorter than the stages): 0. backward/backward_mb stay the whole backward.
  std::vector<double> weight;
  std::vector<std::vector<double>> weight_mb;
  double forward_of(size_t s, int64_t m) const { return s < forward_mb.size() && !forward_mb[s].empty() ? forward_mb[s][static_cast<size_t>(m)] : forward[s]; }
  double backward_of(size_t s, int64_t m) const { return s < backward_mb.size() && !backward_mb[s].empty() ? backward_mb[s][static_cast<size_t>(m)] : backward[s]; }
  double weight_of(size_t s, int64_t m) const {
    if (s < weight_mb.size() && !weight_mb[s].empty()) return weight_mb[s][static_cast<size_t>(m)];
    return s < weight.size() ? weight[s] : 0.0;
  }
  // Throws std::invalid_argument (WHO names the caller) on negative costs, a weight part larger than
  // its backward, or per-micro-batch lists shorter than M.
  void check(const char* who, size_t num_stages, int64_t num_micro_batches) const;
};

// Timing of one action. Compute and receive events of a stage run back to back in list order
// (a receive spans its wait). A send event spans [send, arrival], its wait for the link included;
// it does not occupy its stage, so it may overlap the stage's later events.
struct SimEvent {
  int64_t stage;
  Action action;
  double start, end;
};

struct SimResult {
  double makespan = 0;                  // latest end of any event
  std::vector<SimEvent> events;         // grouped by stage, each stage's in list order
  // Per stage: most micro-batches forwarded but not yet backwarded (split backwards: whose weight
  // pass has not run yet).
  std::vector<int64_t> peak_in_flight;
  // Per stage, the window in which its gradients become final: its last Backward's start and end;
  // with split backwards its last action's end, and that end less the whole backward of the last
  // micro-batch (an approximation: the norms' and embeddings' gradients are final at the last
  // Backward, before the window's end, and the projections' during the last weight pass, in layer
  // order, later than a whole backward's ladder puts the early layers').
  std::vector<double> last_backward_start, last_backward_end;
};

// Throws std::invalid_argument if costs has fewer entries than stages or a negative cost.
SimResult simulate(const std::vector<std::vector<Action>>& per_stage, const SimCosts& costs);

// What simulate() gives for make_schedule(name, s, S, M) on every stage, without building action
// lists or events: the planner asks this for millions of candidate pipelines. Same arithmetic in
// the same order, so the figures are identical to simulate()'s (tests check this).
struct StageTimes {
  double makespan = 0;
  std::vector<double> last_backward_start, last_backward_end;  // per stage
  std::vector<int64_t> peak_in_flight;                         // per stage
};
// Throws std::invalid_argument on an unknown schedule, bad sizes or costs as simulate() does.
StageTimes simulate_times(const std::string& schedule, int64_t num_stages, int64_t num_micro_batches, const SimCosts& costs);

}  // namespace alloy::pipeline
