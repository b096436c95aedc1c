#pragma once
// Tensor parallelism inside a block (Megatron's layout, split unevenly by heads):
//   attention: QKV (GQA: Q, K, V) column-parallel by heads, the output projection row-parallel;
//   MLP: up (and gate) column-parallel, down row-parallel, its columns split in the heads' ratio.
// A rank holding heads [h0, h1) computes its heads' attention and its share of the MLP columns;
// the partial outputs of the two row-parallel projections are summed over the group (tp_exit), and
// the gradient of the input the group shares is summed in the backward (tp_enter). Norms and the
// row-parallel biases are held whole by every rank of the group; the bias is added once, after the
// sum.
//
// Pieces: in a block that any stage of the plan splits, every holder stores each split parameter
// as pieces along the union of all the plan's head boundaries for that block, named
// "NAME#hA-B" (heads [A, B)). So a piece is one parameter to everything that works by name (the
// gradient sync's holder sets, ZeRO, AdamW, checkpoints): a rank with heads [0, 3) of group split
// 3:1 and a replica without tensor parallelism beside it both hold "h.0.attn.c_attn.weight#h0-3"
// and sum its gradient as any other parameter's. A holder whose range spans several pieces
// multiplies piece by piece (a column-parallel weight's outputs joined, a row-parallel one's inputs
// split and the products summed), so its backward keeps the pieces, not a joined copy.
// Checkpoints stay layout-independent: a reader joins pieces into the whole tensor and cuts the
// range it needs (tp_resolve).
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "alloy/core/config.h"

namespace alloy::model {

// The group's sum, as the model sees it (dist/tensor_parallel.h implements it over c10d).
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual void allreduce_sum(at::Tensor& t) = 0;
  virtual int size() const = 0;
  virtual int rank() const = 0;  // within the group
  // Sequence parallelism. Member i's MINE has ROWS[i] rows (dimension 0): all of them stacked in
  // member order, on every member.
  virtual at::Tensor gather_rows(const at::Tensor& mine, const std::vector<int64_t>& rows);
  // FULL (the sum of ROWS' rows) summed over the group: this member's rows of the sum.
  virtual at::Tensor scatter_sum_rows(const at::Tensor& full, const std::vector<int64_t>& rows);
};

// What one rank's slice stores and computes.
struct TpLayout {
  // Block index -> head boundaries of its pieces (0, ..., heads). Blocks absent keep whole
  // parameters under their plain names.
  std::map<int64_t, std::vector<int64_t>> pieces;
  int64_t head_begin = 0, head_end = 0;  // this rank's heads; head_end 0: all of them
  TpComm* comm = nullptr;                // the stage's group; null: the stage has one rank
  // Pipeline boundaries inside an MLP (StagePlan::mlp_cut): block -> the piece boundaries of its
  // MLP's split parameters (0, ..., heads; the union with PIECES' where the block has those too),
  // so that each side of the cut holds its columns as pieces and a replica holding the whole block
  // sums each piece's gradient with the side that holds it. Other parameters of such a block stay
  // whole unless PIECES splits them.
  std::map<int64_t, std::vector<int64_t>> mlp_pieces;
  // This slice's own cut MLPs: the block whose MLP it ends inside (computing heads [0, k)'s columns
  // and sending the residual and its partial output side by side) and the one it starts inside
  // (heads [k, heads), adding the received partial, the bias and the residual); block -1: none.
  struct MlpCut {
    int64_t block = -1, head_begin = 0, head_end = 0;
  };
  MlpCut cut_out, cut_in;
  bool splits(int64_t block) const { return pieces.count(block) != 0 || mlp_pieces.count(block) != 0; }
  // Vocabulary-parallel embedding and head: the vocabulary rows' piece boundaries (0, ...,
  // vocab_size; empty: whole), and this rank's rows (vocab_end 0: all of them).
  std::vector<int64_t> vocab_pieces;
  int64_t vocab_begin = 0, vocab_end = 0;
  bool splits_vocab() const { return !vocab_pieces.empty(); }
  // Sequence parallelism (Megatron's): between the group's products each member holds only its
  // share of the sequence positions, in the heads' ratio (group_heads: the stage's head
  // boundaries), so norms and the residual stream are computed and stored once, not on every
  // member. The sums become reduce-scatters and the products' inputs all-gathers.
  bool sequence_parallel = false;
  std::vector<int64_t> group_heads;
};

// Sequence parallelism: positions [bounds[i], bounds[i + 1]) of T are member i's, in the ratio
// of the group's head boundaries HEADS (0, ..., heads).
std::vector<int64_t> sequence_bounds(const std::vector<int64_t>& heads, int64_t T);
struct SeqSplit {
  TpComm* comm = nullptr;  // null: no sequence parallelism
  std::vector<int64_t> bounds;
  explicit operator bool() const { return comm != nullptr; }
};
// Along dimension 1 ([B, T, ...]): the group's shards joined, whose gradient is reduce-scattered
// (before a column-parallel product: each member's input gradient is a part).
at::Tensor sp_gather(const at::Tensor& shard, const SeqSplit& s);
// The group's sum, this member's positions only; gradient all-gathered (after a row-parallel one).
at::Tensor sp_scatter(const at::Tensor& full, const SeqSplit& s);
// At a stage's edges, where every member has the same whole tensor and the same whole gradient:
// this member's positions (gradient all-gathered), and the shards joined (gradient cut).
at::Tensor sp_split(const at::Tensor& full, const SeqSplit& s);
at::Tensor sp_join(const at::Tensor& shard, const SeqSplit& s);

// What a block's column-parallel products keep for the backward under sequence parallelism is its
// all-gathered inputs: every position, on every member. A block records them here (each with this
// member's shard), the Transformer releases their storage after the block's forward, and the
// block's output passes through regather_on_backward, whose backward gathers them again before any
// of the block's backward runs (every member does so in the same order: they run the same
// schedule). So between a micro-batch's forward and backward a member keeps its shard only.
struct SeqGathered : torch::CustomClassHolder {
  SeqSplit seq;
  std::vector<std::pair<at::Tensor, at::Tensor>> full_and_shard;
};
at::Tensor regather_on_backward(const at::Tensor& block_output, const c10::intrusive_ptr<SeqGathered>& g);

// How a parameter splits: by its HuggingFace name's suffix.
enum class TpKind { None, Qkv, Heads, KvHeads, Ffn, Vocab };
struct TpParam {
  TpKind kind = TpKind::None;
  int dim = 0;  // the dimension that splits
};
TpParam tp_param(const std::string& name);

// The piece boundaries of a block parameter of kind K in BLOCK under L (empty: it is whole), and
// the heads [first, second) of it that the slice holds (HEADS: the model's).
std::vector<int64_t> tp_piece_bounds(const TpLayout& l, int64_t block, TpParam k);
std::pair<int64_t, int64_t> tp_held_heads(const TpLayout& l, int64_t block, TpParam k, int64_t heads);

// "NAME#hA-B" (heads) or, for the vocabulary's rows, "NAME#vA-B".
std::string piece_name(const std::string& name, int64_t h0, int64_t h1);
// NAME is a piece: its whole parameter's name and its heads (rows for the vocabulary).
bool parse_piece(const std::string& name, std::string* base, int64_t* h0, int64_t* h1);

// The whole parameter's size along the dimension K splits.
int64_t tp_extent(TpParam k, const ModelConfig& c);
// Heads [H0, H1)'s part of the whole parameter FULL (contiguous).
at::Tensor tp_cut(const at::Tensor& full, TpParam k, int64_t h0, int64_t h1, const ModelConfig& c);
// Consecutive pieces (heads [bounds[i], bounds[i + 1])) joined into heads [bounds.front(), bounds.back()).
at::Tensor tp_join(const std::vector<at::Tensor>& pieces, const std::vector<int64_t>& bounds, TpParam k, const ModelConfig& c);

// The tensor a checkpoint reader wants under NAME (a whole parameter or a piece), from what the
// checkpoint has: NAME itself, or the whole tensor cut to the piece, or pieces joined (and cut).
// LOOKUP returns the stored tensor or an undefined one; NAMES lists what is stored. Undefined when
// it cannot be made.
at::Tensor tp_resolve(const std::string& name, const std::function<at::Tensor(const std::string&)>& lookup,
                      const std::vector<std::string>& names, const ModelConfig& c);

// Megatron's f and g: identity forward and the group's sum backward (before a column-parallel
// product), and the group's sum forward and identity backward (after a row-parallel one). With a
// null COMM both are the identity.
at::Tensor tp_enter(const at::Tensor& x, TpComm* comm);
at::Tensor tp_exit(const at::Tensor& y, TpComm* comm);

// Vocabulary-parallel embedding: the rows [V0, V0 + W.size(0)) of the embedding W looked up,
// other ids giving zeros, summed over the group: every member gets the whole embedding (with SEQ,
// its positions of it).
at::Tensor vocab_parallel_embedding(const at::Tensor& w, const at::Tensor& ids, int64_t v0, TpComm* comm, const SeqSplit& seq = {});
// Vocabulary-parallel cross-entropy: LOGITS [..., Vl] are this member's columns [V0, V0 + Vl) of
// the whole logits; the sum of the token cross-entropies (targets < 0 ignored) of the whole
// vocabulary, the same on every member, by three sums over the group (the rows' maxima, their
// exponentials' sums, the target logits). Backward: softmax minus one-hot in this member's columns.
at::Tensor vocab_parallel_loss_sum(const at::Tensor& logits, const at::Tensor& targets, int64_t v0, TpComm* comm);

}  // namespace alloy::model
