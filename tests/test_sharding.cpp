// ZeRO's pieces that need no second process: shard bounds, AdamW over slices, and optimizer state
// saved in slices loading into any other split. (Multi-rank parity: tests/dist/test_parity.py.)
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <map>

#include "alloy/core/config.h"
#include "alloy/core/error.h"
#include "alloy/dist/sharding.h"
#include "alloy/train/optimizer.h"

using alloy::dist::set_shares;
using alloy::dist::shard_bounds;
using alloy::model::Param;
using alloy::model::ParamSlice;
using alloy::train::AdamW;

TEST(ShardBounds, FollowTheSharesWithinOneElement) {
  EXPECT_EQ(shard_bounds(10, {1, 1}), (std::vector<int64_t>{0, 5, 10}));
  EXPECT_EQ(shard_bounds(100, {3, 1}), (std::vector<int64_t>{0, 75, 100}));
  EXPECT_EQ(shard_bounds(0, {1, 2, 3}), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(shard_bounds(2, {1, 1, 1}).back(), 2);
  EXPECT_THROW(shard_bounds(10, {1, 0}), alloy::Error);
}

RC_GTEST_PROP(ShardBounds, CoverEveryElementOnceInProportion, ()) {
  const int64_t n = *rc::gen::inRange<int64_t>(0, 1 << 22);
  const auto w = *rc::gen::container<std::vector<int>>(*rc::gen::inRange<size_t>(1, 9), rc::gen::inRange(1, 50));
  std::vector<double> shares(w.begin(), w.end());
  double total = 0;
  for (double s : shares) total += s;
  const auto b = shard_bounds(n, shares);
  RC_ASSERT(b.size() == shares.size() + 1);
  RC_ASSERT(b.front() == 0);
  RC_ASSERT(b.back() == n);
  for (size_t i = 0; i < shares.size(); ++i) {
    RC_ASSERT(b[i] <= b[i + 1]);
    // Rounding the cumulative share: each shard within one element of its exact size... per side.
    RC_ASSERT(std::abs(static_cast<double>(b[i + 1] - b[i]) - static_cast<double>(n) * shares[i] / total) <= 1.0 + 1e-9);
  }
}

TEST(ShardBounds, SlicesInCoverTheRangeAcrossParameters) {
  Param a{"a", at::zeros({5}), false}, b{"b", at::zeros({4}), false}, c{"c", at::zeros({3}), false};
  const auto s = alloy::dist::slices_in({&a, &b, &c}, 3, 10);  // a[3,5) b[0,4) c[0,1)
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].p, &a);
  EXPECT_EQ(s[0].begin, 3);
  EXPECT_EQ(s[0].numel, 2);
  EXPECT_EQ(s[1].p, &b);
  EXPECT_EQ(s[1].begin, 0);
  EXPECT_EQ(s[1].numel, 4);
  EXPECT_EQ(s[2].p, &c);
  EXPECT_EQ(s[2].numel, 1);
  EXPECT_TRUE(alloy::dist::slices_in({&a, &b, &c}, 5, 5).empty());
}

TEST(ShardBounds, SharesOfAGroupComeFromTheRatioByMemberOrByRank) {
  EXPECT_EQ(set_shares({0, 2}, {}, 3, "f"), (std::vector<double>{1, 1}));
  EXPECT_EQ(set_shares({0, 2}, {3, 1}, 3, "f"), (std::vector<double>{3, 1}));
  EXPECT_EQ(set_shares({0, 2}, {3, 2, 1}, 3, "f"), (std::vector<double>{3, 1}));
  try {
    set_shares({0, 1}, {3, 2, 1, 1}, 3, "--shard-ratio");
    FAIL();
  } catch (const alloy::InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--shard-ratio"), std::string::npos) << m;
    EXPECT_NE(m.find("ranks 0,1"), std::string::npos) << m;
  }
}

TEST(ShardConfig, StagesAndRatiosAreValidatedByKey) {
  alloy::Config c;
  c.train.shard_ratio = "3:1";
  EXPECT_EQ(c.train.shard_shares(), (std::vector<double>{3, 1}));
  c.train.shard_ratio = "3, 1 2";
  EXPECT_EQ(c.train.shard_shares(), (std::vector<double>{3, 1, 2}));
  c.train.shard_ratio = "3,x";
  EXPECT_THROW(c.train.shard_shares(), alloy::InputError);
  c.train.shard_ratio = "";
  c.train.zero_stage = 4;
  try {
    c.validate();
    FAIL();
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("train.zero_stage"), std::string::npos) << e.what();
  }
  c.train.zero_stage = -1;
  EXPECT_THROW(c.validate(), alloy::InputError);
  for (int64_t stage : {0, 1, 2, 3}) {
    c.train.zero_stage = stage;
    c.validate();
  }
}

namespace {
std::vector<Param> make_params() {
  at::manual_seed(7);
  return {Param{"a.weight", at::randn({5, 3}, at::kDouble), true}, Param{"a.bias", at::randn({7}, at::kDouble), false},
          Param{"b.weight", at::randn({4, 4}, at::kDouble), true}};
}
std::vector<Param> clone(const std::vector<Param>& ps) {
  std::vector<Param> out;
  for (const auto& p : ps) out.push_back(Param{p.name, p.tensor.clone(), p.decay});
  return out;
}
// The three parameters as one flat buffer of 38 elements, cut at BOUNDS: the slices of shard I.
std::vector<ParamSlice> shard(std::vector<Param>& ps, const std::vector<int64_t>& bounds, size_t i) {
  std::vector<Param*> ptrs;
  for (auto& p : ps) ptrs.push_back(&p);
  return alloy::dist::slices_in(ptrs, bounds[i], bounds[i + 1]);
}
void set_grads(std::vector<Param>& ps, int step) {
  for (size_t k = 0; k < ps.size(); ++k)
    ps[k].tensor.mutable_grad() = at::sin(at::arange(ps[k].tensor.numel(), at::kDouble) * (step + 1) + static_cast<double>(k)).view(ps[k].tensor.sizes());
}
}  // namespace

// Uneven shards updating their own ranges, then copied together (what the all-gather does), give
// the whole-tensor update bit for bit: AdamW is element-wise.
TEST(AdamWSlices, ShardsUpdateAsTheWholeTensors) {
  AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  auto whole = make_params();
  std::vector<Param*> wp;
  for (auto& p : whole) wp.push_back(&p);
  AdamW full(wp, o);
  const std::vector<int64_t> bounds = shard_bounds(38, {3, 1, 2});
  std::vector<std::vector<Param>> copies;
  std::vector<std::unique_ptr<AdamW>> opts;
  for (size_t i = 0; i < 3; ++i) copies.push_back(clone(whole));
  for (size_t i = 0; i < 3; ++i) opts.push_back(std::make_unique<AdamW>(shard(copies[i], bounds, i), o));
  for (int step = 0; step < 4; ++step) {
    set_grads(whole, step);
    full.step(1e-2);
    full.zero_grad();
    for (size_t i = 0; i < 3; ++i) {
      set_grads(copies[i], step);
      opts[i]->step(1e-2);
      opts[i]->zero_grad();
    }
    // The gather: every shard's range from its owner into every copy.
    for (size_t i = 0; i < 3; ++i)
      for (const auto& sl : shard(copies[i], bounds, i))
        for (size_t j = 0; j < 3; ++j) {
          if (j == i) continue;
          auto& dst = copies[j][static_cast<size_t>(sl.p - copies[i].data())];
          ParamSlice{&dst, sl.begin, sl.numel}.of(dst.tensor).copy_(sl.of(sl.p->tensor));
        }
  }
  for (size_t j = 0; j < 3; ++j)
    for (size_t k = 0; k < whole.size(); ++k) EXPECT_TRUE(at::equal(copies[j][k].tensor, whole[k].tensor)) << j << " " << k;
  EXPECT_EQ(opts[0]->state_bytes() + opts[1]->state_bytes() + opts[2]->state_bytes(), full.state_bytes());
  EXPECT_NEAR(static_cast<double>(opts[0]->state_bytes()) / full.state_bytes(), 0.5, 1.0 / 38);
}

// ZeRO-3: a shard's values and gradients live in flat tensors of its own (ParamSlice::value/grad),
// not in the parameters, which are freed between uses; AdamW and the norm read and update those.
TEST(AdamWSlices, ShardsHeldOutsideTheParametersUpdateAsTheWholeTensors) {
  AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  auto whole = make_params();
  std::vector<Param*> wp;
  for (auto& p : whole) wp.push_back(&p);
  AdamW full(wp, o);
  const std::vector<int64_t> bounds = shard_bounds(38, {1, 2});
  auto flat = [&](std::vector<Param>& ps, bool grads) {
    std::vector<at::Tensor> parts;
    for (auto& p : ps) parts.push_back((grads ? p.tensor.grad() : p.tensor).reshape({-1}));
    return at::cat(parts);
  };
  std::vector<at::Tensor> values, grads;
  std::vector<std::vector<ParamSlice>> slices;
  std::vector<std::unique_ptr<AdamW>> opts;
  auto layout = make_params();  // names and shapes only: the shards never read these tensors' values
  for (size_t i = 0; i < 2; ++i) {
    values.push_back(flat(whole, false).narrow(0, bounds[i], bounds[i + 1] - bounds[i]).clone());
    grads.push_back(at::zeros_like(values.back()));
    slices.push_back(shard(layout, bounds, i));
    int64_t at = 0;
    for (auto& sl : slices.back()) {
      sl.value = values[i].narrow(0, at, sl.numel);
      sl.grad = grads[i].narrow(0, at, sl.numel);
      at += sl.numel;
    }
    opts.push_back(std::make_unique<AdamW>(slices.back(), o));
  }
  for (int step = 0; step < 4; ++step) {
    set_grads(whole, step);
    const at::Tensor g = flat(whole, true);
    for (size_t i = 0; i < 2; ++i) grads[i].copy_(g.narrow(0, bounds[i], bounds[i + 1] - bounds[i]));
    EXPECT_NEAR(alloy::train::global_grad_norm_sq(slices[0]) + alloy::train::global_grad_norm_sq(slices[1]),
                g.pow(2).sum().item<double>(), 1e-9);
    full.step(1e-2);
    full.zero_grad();
    for (size_t i = 0; i < 2; ++i) opts[i]->step(1e-2);
  }
  const at::Tensor want = flat(whole, false);
  EXPECT_TRUE(at::equal(at::cat({values[0], values[1]}), want));
}

// Optimizer state written in slices loads into another split, and into whole tensors; a gap in
// the slices is named.
TEST(AdamWSlices, StateSavedInSlicesLoadsIntoAnyOtherSplit) {
  AdamW::Options o{0.9, 0.95, 1e-8, 0.1};
  auto ps = make_params();
  const auto b31 = shard_bounds(38, {3, 1});
  AdamW s0(shard(ps, b31, 0), o), s1(shard(ps, b31, 1), o);
  for (int step = 0; step < 3; ++step) {
    set_grads(ps, step);
    s0.step(1e-2);
    s1.step(1e-2);
    s0.zero_grad();
    s1.zero_grad();
  }
  std::map<std::string, at::Tensor> saved;
  for (auto* s : {&s0, &s1})
    for (auto& [k, t] : s->state()) saved[k] = t;
  // 3:1 of 38 elements cuts b.weight (elements 22-37 of the flat order) at its 8th element.
  EXPECT_TRUE(saved.count("exp_avg.a.weight@0")) << "a shard's whole tensor is saved as a slice, by its owner";
  EXPECT_TRUE(saved.count("exp_avg.b.weight@0"));
  EXPECT_TRUE(saved.count("exp_avg.b.weight@7"));

  std::vector<Param*> wp;
  for (auto& p : ps) wp.push_back(&p);
  AdamW whole(wp, o);
  whole.load_state(saved, 3, "test");
  auto ws = whole.state();
  // Assembled from the slices: each element where its owner kept it.
  const at::Tensor m_bw = ws[4].second.reshape({-1});  // exp_avg.b.weight
  ASSERT_EQ(ws[4].first, "exp_avg.b.weight");
  EXPECT_TRUE(at::equal(m_bw.narrow(0, 0, 7), saved.at("exp_avg.b.weight@0")));
  EXPECT_TRUE(at::equal(m_bw.narrow(0, 7, 9), saved.at("exp_avg.b.weight@7")));
  EXPECT_GT(m_bw.abs().min().item<double>(), 0.0) << "every element came from a slice";

  const auto b11 = shard_bounds(38, {1, 1});
  AdamW e1(shard(ps, b11, 1), o);
  e1.load_state(saved, 3, "test");
  // Shard 1 of the even split starts at element 19 (a.bias[4..6], b.weight): compare with whole.
  auto es = e1.state();
  for (const auto& [k, t] : es) {
    const size_t at = k.find('@');  // a whole tensor's key has none
    const std::string name = k.substr(0, at);
    const int64_t begin = at == std::string::npos ? 0 : std::stoll(k.substr(at + 1));
    at::Tensor w;
    for (auto& [wk, wt] : ws)
      if (wk == name) w = wt.reshape({-1}).narrow(0, begin, t.numel());
    ASSERT_TRUE(w.defined()) << k;
    EXPECT_TRUE(at::equal(t.reshape({-1}), w)) << k;
  }

  saved.erase("exp_avg_sq.b.weight@" + std::to_string(b31[1] - 22));  // the slice holding b.weight's tail
  AdamW again(wp, o);
  try {
    again.load_state(saved, 3, "ckpt");
    FAIL();
  } catch (const alloy::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg_sq.b.weight"), std::string::npos) << e.what();
  }
}
