// A pipeline stage's links (train/stage_links.h).
#include "alloy/train/stage_links.h"

#include <algorithm>

namespace alloy::train {

pipeline::StageLinks stage_links(const PipelinePlan& pl, int stage, int rank, int tp_rank, bool tensor_parallel,
                                 const std::vector<std::string>& machines) {
  pipeline::StageLinks links;
  const auto S = static_cast<int>(pl.stages.size());
  const auto& ranks_of = [&](int s) -> const std::vector<int>& { return pl.stages[static_cast<size_t>(s)].ranks; };
  if (stage > 0) links.prev_rank = ranks_of(stage - 1)[0];
  if (stage + 1 < S) links.next_rank = ranks_of(stage + 1)[0];
  if (pl.interleaved()) {
    // Every S-th listed stage is this rank's next chunk; chunk c's neighbours are c - 1 and c + 1.
    for (int c = stage; c < S; c += static_cast<int>(pl.depth())) {
      links.chunk_prev.push_back(c > 0 ? ranks_of(c - 1)[0] : -1);
      links.chunk_next.push_back(c + 1 < S ? ranks_of(c + 1)[0] : -1);
      links.chunk_stage.push_back(c);
    }
    links.prev_rank = links.chunk_prev.front();
    links.next_rank = links.chunk_next.back();
  }
  if (!tensor_parallel) return links;
  auto machine = [&](int r) -> const std::string& { return machines[static_cast<size_t>(r)]; };
  auto entries = [&](const std::vector<int>& ranks) {  // the first rank of RANKS on each machine
    std::vector<int> out;
    for (int r : ranks)
      if (std::none_of(out.begin(), out.end(), [&](int e) { return machine(e) == machine(r); })) out.push_back(r);
    return out;
  };
  const std::vector<int>& mine = ranks_of(stage);
  const std::vector<int> my_entries = entries(mine);
  if (std::find(my_entries.begin(), my_entries.end(), rank) != my_entries.end()) {
    for (int r : mine)
      if (r != rank && machine(r) == machine(rank)) links.relay.push_back(r);
  } else {
    // Receive from this machine's entry of the stage, in both directions.
    for (int e : my_entries)
      if (machine(e) == machine(rank)) {
        if (links.prev_rank >= 0) links.prev_rank = e;
        if (links.next_rank >= 0) links.next_rank = e;
      }
  }
  if (tp_rank > 0) {
    links.send_prev = links.send_next = {-1};
  } else {
    if (stage > 0) links.send_prev = entries(ranks_of(stage - 1));
    if (stage + 1 < S) links.send_next = entries(ranks_of(stage + 1));
  }
  return links;
}

std::vector<dist::ChannelKey> message_streams(const pipeline::StageLinks& links, int rank) {
  std::vector<dist::ChannelKey> out;
  const bool chunks = !links.chunk_stage.empty();
  const size_t n = chunks ? links.chunk_stage.size() : 1;
  for (size_t v = 0; v < n; ++v) {
    const int prev = chunks ? links.chunk_prev[v] : links.prev_rank;
    const int next = chunks ? links.chunk_next[v] : links.next_rank;
    const int64_t key = chunks ? links.chunk_stage[v] : 0;
    // What the executor does per chunk (StageExecutor::run): receive activations from PREV and
    // gradients from NEXT, pass both on to RELAY, send activations to SEND_NEXT (else NEXT) and
    // gradients to SEND_PREV (else PREV); a message's stream is that of the virtual stage receiving it.
    auto sends = [&](const std::vector<int>& targets, int fallback, bool grad, int64_t into) {
      if (targets.empty()) return out.push_back({rank, fallback, dist::stream_of(grad, into)});
      for (int dst : targets)
        if (dst >= 0) out.push_back({rank, dst, dist::stream_of(grad, into)});
    };
    if (prev >= 0) {
      out.push_back({prev, rank, dist::stream_of(false, key)});
      for (int r : links.relay) out.push_back({rank, r, dist::stream_of(false, key)});
      sends(links.send_prev, prev, true, chunks ? key - 1 : 0);
    }
    if (next >= 0) {
      out.push_back({next, rank, dist::stream_of(true, key)});
      for (int r : links.relay) out.push_back({rank, r, dist::stream_of(true, key)});
      sends(links.send_next, next, false, chunks ? key + 1 : 0);
    }
  }
  return out;
}

}  // namespace alloy::train
