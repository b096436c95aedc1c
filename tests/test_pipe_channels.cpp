// Device-to-device pipeline channels (dist/pipe_channels.h): which streams a rank opens, and when
// a link gets one. The channels carrying real steps are checked by dist.parity's ch-* layouts
// (ALLOY_PIPE_CHANNELS=gloo: the same channels on Gloo pairs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>

#include "alloy/core/error.h"
#include "alloy/dist/pipe_channels.h"
#include "alloy/train/stage_links.h"

namespace {
using alloy::PipelinePlan;
using alloy::StagePlan;
using alloy::dist::ChannelKey;

StagePlan stage(std::vector<int> ranks, int64_t begin, int64_t end) {
  StagePlan s;
  s.ranks = std::move(ranks);
  s.layer_begin = begin, s.layer_end = end;
  return s;
}

// Every rank's streams under PL (ranks 0..WORLD-1 on MACHINES), checked: each stream is listed by
// exactly its two ends. Returns them by rank.
std::map<int, std::set<ChannelKey>> streams_of(const PipelinePlan& pl, int world, const std::vector<std::string>& machines) {
  std::map<int, std::set<ChannelKey>> by_rank;
  const bool tp = pl.has_tensor_parallel();
  for (int rank = 0; rank < world; ++rank) {
    int first = -1, tp_rank = 0;
    for (size_t c = 0; c < pl.stages.size() && first < 0; ++c) {
      const auto& rs = pl.stages[c].ranks;
      auto it = std::find(rs.begin(), rs.end(), rank);
      if (it != rs.end()) first = static_cast<int>(c), tp_rank = static_cast<int>(it - rs.begin());
    }
    if (first < 0) continue;
    auto links = alloy::train::stage_links(pl, first, rank, tp_rank, tp, machines);
    for (const ChannelKey& k : alloy::train::message_streams(links, rank)) {
      EXPECT_TRUE(k.src == rank || k.dst == rank) << "rank " << rank << " lists " << k.src << " -> " << k.dst;
      EXPECT_NE(k.src, k.dst);
      by_rank[rank].insert(k);
    }
  }
  for (const auto& [rank, keys] : by_rank)
    for (const ChannelKey& k : keys) {
      const int other = k.src == rank ? k.dst : k.src;
      EXPECT_TRUE(by_rank[other].count(k)) << "rank " << rank << " lists " << k.src << " -> " << k.dst << " stream " << k.stream
                                           << ", rank " << other << " does not";
    }
  return by_rank;
}

TEST(PipeChannels, AThreeStagePipelineHasOneStreamEachWayPerLink) {
  PipelinePlan pl;
  pl.stages = {stage({0}, 0, 1), stage({1}, 1, 6), stage({2}, 6, 8)};
  auto s = streams_of(pl, 3, {"m", "m", "m"});
  const int64_t act = alloy::dist::stream_of(false, 0), grad = alloy::dist::stream_of(true, 0);
  EXPECT_EQ(s[0], (std::set<ChannelKey>{{0, 1, act}, {1, 0, grad}}));
  // The middle stage: activations in from 0 and out to 2, gradients in from 2 and out to 0, each
  // its own one-way channel (NCCL would make one communicator's two directions wait on each other).
  EXPECT_EQ(s[1], (std::set<ChannelKey>{{0, 1, act}, {1, 2, act}, {2, 1, grad}, {1, 0, grad}}));
  EXPECT_EQ(s[2], (std::set<ChannelKey>{{1, 2, act}, {2, 1, grad}}));
}

TEST(PipeChannels, InterleavedChunksBetweenTheSameRanksGetStreamsOfTheirOwn) {
  PipelinePlan pl;
  pl.virtual_stages = 2;
  pl.stages = {stage({0}, 0, 2), stage({1}, 2, 4), stage({0}, 4, 6), stage({1}, 6, 8)};
  auto s = streams_of(pl, 2, {"m", "m"});
  using alloy::dist::stream_of;
  // Rank 0 holds virtual stages 0 and 2: activations into 1 and 3 go to rank 1, those into 2 come
  // back; gradients into 0 and 2 come from rank 1, those into 1 go to it.
  EXPECT_EQ(s[0], (std::set<ChannelKey>{{0, 1, stream_of(false, 1)}, {0, 1, stream_of(false, 3)}, {1, 0, stream_of(false, 2)},
                                        {1, 0, stream_of(true, 0)}, {1, 0, stream_of(true, 2)}, {0, 1, stream_of(true, 1)}}));
}

TEST(PipeChannels, TensorParallelStagesRelayOnEachMachine) {
  PipelinePlan pl;
  // Stage 0 on rank 0; stage 1 a TP group of ranks 1, 2 (machine a) and 3 (machine b).
  pl.stages = {stage({0}, 0, 3), stage({1, 2, 3}, 3, 8)};
  auto s = streams_of(pl, 4, {"a", "a", "a", "b"});
  const int64_t act = alloy::dist::stream_of(false, 0), grad = alloy::dist::stream_of(true, 0);
  // Rank 0 sends to each machine's first member of the group and hears gradients from rank 1 only.
  EXPECT_EQ(s[0], (std::set<ChannelKey>{{0, 1, act}, {0, 3, act}, {1, 0, grad}}));
  // Rank 1 passes activations on to rank 2 beside it; rank 2 hears only rank 1.
  EXPECT_TRUE(s[1].count({1, 2, act}));
  EXPECT_EQ(s[2], (std::set<ChannelKey>{{1, 2, act}}));
  EXPECT_EQ(s[3], (std::set<ChannelKey>{{0, 3, act}}));
}

TEST(PipeChannels, OnlyLinksBetweenTwoGpusOfTheirOwnWithNcclQualifyByDefault) {
  using alloy::dist::ChannelMode;
  using alloy::dist::channel_qualifies;
  EXPECT_TRUE(channel_qualifies(ChannelMode::Auto, "cuda:0@h", "cuda:1@h"));
  EXPECT_TRUE(channel_qualifies(ChannelMode::Auto, "cuda:0@h", "cuda:0@g"));
  EXPECT_FALSE(channel_qualifies(ChannelMode::Auto, "cuda:0@h", "cuda:0@h"));       // one GPU: NCCL refuses
  EXPECT_FALSE(channel_qualifies(ChannelMode::Auto, "cuda:0@h", "cuda-gloo:1@h"));  // one end without NCCL
  EXPECT_FALSE(channel_qualifies(ChannelMode::Auto, "cuda:0@h", "cpu"));
  EXPECT_FALSE(channel_qualifies(ChannelMode::Auto, "cpu", "cpu"));
  EXPECT_FALSE(channel_qualifies(ChannelMode::Off, "cuda:0@h", "cuda:1@h"));
  EXPECT_TRUE(channel_qualifies(ChannelMode::Gloo, "cpu", "cpu"));
}

TEST(PipeChannels, TheModeComesFromTheEnvironmentAndABadOneIsNamed) {
  using alloy::dist::ChannelMode;
  const char* old = std::getenv("ALLOY_PIPE_CHANNELS");
  const std::string saved = old ? old : "";
  ::unsetenv("ALLOY_PIPE_CHANNELS");
  EXPECT_EQ(alloy::dist::channel_mode_from_env(), ChannelMode::Auto);
  for (auto [text, mode] : {std::pair{"auto", ChannelMode::Auto}, {"off", ChannelMode::Off}, {"gloo", ChannelMode::Gloo}}) {
    ::setenv("ALLOY_PIPE_CHANNELS", text, 1);
    EXPECT_EQ(alloy::dist::channel_mode_from_env(), mode) << text;
    EXPECT_STREQ(alloy::dist::to_string(mode), text);
  }
  ::setenv("ALLOY_PIPE_CHANNELS", "nccl", 1);
  try {
    alloy::dist::channel_mode_from_env();
    ADD_FAILURE() << "no error";
  } catch (const alloy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ALLOY_PIPE_CHANNELS='nccl'"), std::string::npos) << e.what();
  }
  if (old) ::setenv("ALLOY_PIPE_CHANNELS", saved.c_str(), 1);
  else ::unsetenv("ALLOY_PIPE_CHANNELS");
}

}  // namespace
