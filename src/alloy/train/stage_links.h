#pragma once
// Who a pipeline stage's rank receives from and sends to (pipeline::StageLinks), from the plan.
#include <string>
#include <vector>

#include "alloy/core/plan.h"
#include "alloy/dist/pipe_channels.h"
#include "alloy/pipeline/executor.h"

namespace alloy::train {

// The links of RANK, member TP_RANK of stage STAGE of pipeline PL (several stages). Without tensor
// parallelism each stage's one rank talks to its neighbours' ranks. With it, the first rank of a
// stage sends to the first rank of each neighbouring stage on each machine (MACHINES: per rank,
// World::machines), which relays to that stage's other ranks there; the others send nothing. Two
// machines' pairs joined by a thin link: one crossing per message instead of two. GROUP is left
// to the caller. An interleaved pipeline (one rank a chunk) fills the chunks' links; STAGE is the
// rank's first chunk.
pipeline::StageLinks stage_links(const PipelinePlan& pl, int stage, int rank, int tp_rank, bool tensor_parallel,
                                 const std::vector<std::string>& machines);

// The one-way message streams RANK's executor sends and receives under LINKS (the executor's
// sends, receives and relays, stream by stream): what PipeChannels::open is offered. The
// receiving end of each lists it too.
std::vector<dist::ChannelKey> message_streams(const pipeline::StageLinks& links, int rank);

}  // namespace alloy::train
