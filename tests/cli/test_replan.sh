#!/usr/bin/env bash
# Re-planning from measured speeds through the real `alloy` binary. Apart from test_cli.sh and run
# alone (RUN_SERIAL): the re-plan after step 3 acts on two ranks' measured compute, which another
# test's load on the same cores can triple (measured: a 0.014 s micro-batch instead of 0.005 s),
# enough to keep the plan the wrong profile gave.
# usage: test_replan.sh ALLOY WORKDIR
set -uo pipefail
alloy=$(realpath "$1") work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"; mkdir -p "$work"; cd "$work"
source "$here/common.sh"

head -c 200000 /usr/share/games/fortunes/fortunes > corpus.txt
expect_ok "data prepare" "$alloy" data prepare --input corpus.txt --output data/corpus --valid-fraction 0.1
cp "$here/pool-two-types.yaml" pool.yaml
# --- re-planning from measured speeds: a profile that puts the small device 8x slower than the
# big one (both are the same here) gives it one sample in three; after step 3 the measured compute
# corrects it, the job switches plans at a checkpoint, and the loss stays the one-device loss.
cat > mid.yaml <<YAML
model: {arch: gpt2, layers: 2, hidden: 128, heads: 4, seq_len: 64, vocab_size: 257}
data: {prefix: data/corpus}
train: {steps: 8, global_batch: 8, lr: 1e-3, warmup: 2, eval_interval: 0, eval_batches: 2, threads: 1}
YAML
expect_ok "profile for re-planning" "$alloy" launch --nproc 2 -- "$alloy" profile --cluster pool.yaml --config mid.yaml \
  --micro-batches 1 4 --window 0.05 -o prof-mid.json
/usr/bin/python3 - <<'PY'
import json
p = json.load(open("prof-mid.json"))
big = p["devices"]["cpu-big"]
slow = {}
for k, v in big.items():
    if k == "codecs":  # per-element codec costs: {method: {encode_s_per_elem, decode_s_per_elem}}
        v = {m: {n: 8 * t for n, t in c.items()} for m, c in v.items()}
    elif isinstance(v, dict):
        v = dict(v, fixed_s=8 * v["fixed_s"], per_sample_s=8 * v["per_sample_s"])
        if "points" in v:
            v["points"] = [[m, 8 * t] for m, t in v["points"]]
    # Ratios stay: the noise is relative (a slower device need not be noisier), and so are the
    # attention half's share of a block, what a tensor-parallel member computes whole and per shard
    # size, and a CPU quota (a share of a core and the CPU it hands out per period).
    if not isinstance(v, dict) and k not in ("step_noise", "attn_share_fwd", "attn_share_bwd", "weight_share", "tp_whole_share",
                                             "tp_shard_shares", "quota_fraction", "quota_burst_s"):
        v = 8 * v
    slow[k] = v
p["devices"]["cpu-small"] = slow
json.dump(p, open("prof-wrong.json", "w"))
PY
for r in 3 0; do
  expect_ok "train --plan auto, replan_step=$r" "$alloy" launch --nproc 2 -- "$alloy" train --config mid.yaml --plan auto \
    --cluster pool.yaml --profile prof-wrong.json --set output.dir=replan$r --set train.replan_step=$r
done
expect_ok "one device, for the loss" "$alloy" train --config mid.yaml --set output.dir=mid-one
/usr/bin/python3 - <<'PY' && ok "re-planned at step 3: the small device takes more, the loss is the one-device loss" || bad "re-planning"
import json
rows = lambda d: [json.loads(l) for l in open(d + "/metrics.jsonl")]
r, one = rows("replan3"), rows("mid-one")
# Switched at step 3; at step 6 it calibrates again and may switch once more (equal devices: noise).
switched = [x["step"] for x in r if x.get("replanned")]
assert len(r) == 8 and switched[:1] == [3] and set(switched) <= {3, 6}, switched
assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(r, one)) < 1e-5
doc = json.load(open("replan3/replan.json"))
rp = doc["replans"][0]
assert doc["format"] == "alloy-replan" and rp["step"] == 3 and rp["switched"] and rp["factors"]["cpu-small"] < 0.5, doc
assert [e["step"] for e in doc["replans"]] == [3, 6] and [e["step"] for e in doc["replans"] if e["switched"]] == switched, doc
small = lambda d: sum(pl["micro_batch_size"] * pl["num_micro_batches"] for pl in json.load(open(d + "/plan.json"))["pipelines"]
                      if any(st["device"] == "small" for st in pl["stages"]))
assert small("replan3") > small("replan0"), (small("replan3"), small("replan0"))
assert not any(x.get("replanned") for x in rows("replan0"))
cal = json.load(open("replan3/profile-calibrated.json"))["devices"]["cpu-small"]["block_bwd"]["per_sample_s"]
wrong = json.load(open("prof-wrong.json"))["devices"]["cpu-small"]["block_bwd"]["per_sample_s"]
assert cal < 0.5 * wrong, (cal, wrong)
PY
expect_ok "plan with the run's calibrated profile" "$alloy" plan --cluster pool.yaml --config mid.yaml \
  --profile replan3/profile-calibrated.json --no-compare -o replanned-again.json
# With the profile measured here the plan is right: whether the measurement after step 3 keeps it
# or not, the ranks measure again after step 6.
expect_ok "train --plan auto on a right profile" "$alloy" launch --nproc 2 -- "$alloy" train --config mid.yaml --plan auto \
  --cluster pool.yaml --profile prof-mid.json --set output.dir=replan-right --set train.replan_step=3
/usr/bin/python3 - <<'PY' && ok "a kept plan is measured once more, later" || bad "measuring a kept plan again"
import json
doc = json.load(open("replan-right/replan.json"))
assert [e["step"] for e in doc["replans"]] == [3, 6], doc["replans"]
r = [json.loads(l) for l in open("replan-right/metrics.jsonl")]
assert len(r) == 8, len(r)
PY

echo "cli re-planning: $fails failed"
[ $fails -eq 0 ]
