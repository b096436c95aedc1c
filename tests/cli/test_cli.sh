#!/usr/bin/env bash
# End-to-end checks through the real `alloy` binary: help, data preparation, training, resume,
# export/import, eval, generate, and that bad input fails clearly without touching earlier output.
# usage: test_cli.sh ALLOY WORKDIR
set -uo pipefail
alloy=$(realpath "$1") work=$2
repo=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work"; mkdir -p "$work"; cd "$work"
source "$repo/tests/cli/common.sh"

# --- help lists every command and the config keys
out=$("$alloy" --help)
for c in train eval generate export import data; do grep -q "$c" <<<"$out" || bad "help lacks $c"; done
# (captured first: grep -q closing the pipe early would kill the writer under pipefail)
th=$("$alloy" train --help); grep -q "train.global_batch" <<<"$th" && grep -q -- "--hetero-pipeline-stages" <<<"$th" && ok "train --help lists config keys and flags" || bad "train --help lacks keys"
dh=$("$alloy" data prepare --help); grep -q -- "--valid-fraction" <<<"$dh" && ok "data prepare --help" || bad "data prepare --help"
for c in launch plan; do grep -q "$c" <<<"$out" || bad "help lacks $c"; done

# --- data: a slice of the real corpus
head -c 200000 /usr/share/games/fortunes/fortunes > corpus.txt
expect_ok "data prepare" "$alloy" data prepare --input corpus.txt --output data/corpus --valid-fraction 0.1
[ -s data/corpus_train.idx ] && [ -s data/corpus_valid.bin ] && ok "datasets written" || bad "datasets missing"

cat > tiny.yaml <<YAML
model: {arch: gpt2, layers: 2, hidden: 64, heads: 4, seq_len: 32, vocab_size: 257}
data: {prefix: data/corpus}
train: {steps: 8, global_batch: 4, lr: 1e-3, warmup: 2, eval_interval: 4, eval_batches: 2, checkpoint_interval: 4, threads: 1}
output: {dir: run}
YAML

# --- train, then the files a user expects
expect_ok "train" "$alloy" train --config tiny.yaml
[ "$(wc -l < run/metrics.jsonl)" -eq 8 ] && ok "metrics.jsonl has 8 steps" || bad "metrics.jsonl line count"
grep -q '"tokens_per_s"' run/metrics.jsonl && grep -q '"lr"' run/metrics.jsonl && ok "metrics fields" || bad "metrics fields"
ls run/tensorboard/events.out.tfevents.* >/dev/null 2>&1 && ok "tensorboard events" || bad "no tensorboard events"
[ "$(cat run/checkpoints/latest)" = step_00000008 ] && ok "latest checkpoint" || bad "latest checkpoint"

# --- resume: more steps continue from step 8 and metrics stay one line per step
expect_ok "resume" "$alloy" train --config tiny.yaml --set train.steps=10 --resume
[ "$(wc -l < run/metrics.jsonl)" -eq 10 ] && ok "metrics after resume" || bad "metrics after resume: $(wc -l < run/metrics.jsonl) lines"

# --- bad input: clear errors, non-zero exit, and the earlier run untouched
before=$(md5sum run/metrics.jsonl run/checkpoints/latest)
expect_fail "misspelled override" "--set train.stpes=3" "did you mean 'train.steps'" -- "$alloy" train --config tiny.yaml --set train.stpes=3
printf 'train:\n  steps: 3\n  global_bacth: 4\n' > misspelled.yaml
expect_fail "misspelled key in file" "misspelled.yaml (line 3)" "train.global_bacth" "did you mean 'train.global_batch'" -- "$alloy" train --config misspelled.yaml
printf 'model:\n  layers: four\n' > typo.yaml
expect_fail "ill-typed key" "typo.yaml (line 2)" "model.layers" -- "$alloy" train --config typo.yaml
expect_fail "missing data" "data.prefix" "nope" -- "$alloy" train --config tiny.yaml --set data.prefix=nope
cp data/corpus_train.bin trunc_train.bin; head -c 100 data/corpus_train.idx > trunc_train.idx
expect_fail "truncated idx" "trunc_train.idx" -- "$alloy" train --config tiny.yaml --set data.prefix=trunc_train
cp data/corpus_train.idx short.idx; head -c 1000 data/corpus_train.bin > short.bin
expect_fail "truncated bin" "short.bin" -- "$alloy" train --config tiny.yaml --set data.prefix=short
expect_fail "checkpoint of another model" "state.json" "model.layers: 2 vs 3" -- \
  "$alloy" train --config tiny.yaml --set model.layers=3 --set train.steps=12 --resume
echo x > afile
expect_fail "output dir not writable" "afile/run" -- "$alloy" train --config tiny.yaml --set output.dir=afile/run
expect_fail "vocab too small for data" "model.vocab_size" -- "$alloy" train --config tiny.yaml --set model.vocab_size=100 --set output.dir=run2
[ "$before" = "$(md5sum run/metrics.jsonl run/checkpoints/latest)" ] && ok "failed runs left the run untouched" || bad "run modified"

# --- a Chrome trace of the step asked for, and a step outside the run named
expect_ok "trace of step 3" "$alloy" train --config tiny.yaml --set output.dir=tracerun --set train.steps=4 --set train.eval_interval=0 \
  --trace trace.json --trace-step 3
/usr/bin/python3 -c "import json,sys; n={e['name'] for e in json.load(open('trace.json'))['traceEvents']}; sys.exit(0 if {'F0','B0','clip and optimizer'} <= n else 1)" \
  && ok "the trace holds the step's forward, backward and optimizer" || bad "trace spans: $(head -c 300 trace.json)"
expect_fail "trace step outside the run" "--trace-step" "step 9" "1 to 4" -- \
  "$alloy" train --config tiny.yaml --set output.dir=tracerun2 --set train.steps=4 --trace t2.json --trace-step 9

# --- export to HuggingFace names, import back, eval both the same
expect_ok "export" "$alloy" export --checkpoint run --output hf/model.safetensors
grep -q '"n_layer": 2' hf/config.json && ok "config.json" || bad "config.json"
expect_ok "import" "$alloy" import --weights hf/model.safetensors --output imported
head -c 20000 /usr/share/games/fortunes/linux > eval.txt
e1=$("$alloy" eval --config tiny.yaml --weights hf/model.safetensors --text eval.txt 2>/dev/null)
e2=$("$alloy" eval --config tiny.yaml --weights imported --text eval.txt 2>/dev/null)
e3=$("$alloy" eval --config tiny.yaml --weights run --text eval.txt 2>/dev/null)
[ -n "$e1" ] && [ "$e1" = "$e2" ] && [ "$e1" = "$e3" ] && ok "eval identical on exported/imported/original: $e1" || bad "eval differs: $e1 / $e2 / $e3"
# A model directory whose weights are split into shards named by model.safetensors.index.json
# (HuggingFace's layout for large models) imports as the one file did.
mkdir -p hfshard && cp hf/config.json hfshard/
/usr/bin/python3 - "$repo/tests/parity" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
import st
w, _ = st.load("hf/model.safetensors")
names = sorted(w)
shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
for f, ns in shards.items():
    st.save("hfshard/" + f, {n: w[n] for n in ns})
json.dump({"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}, open("hfshard/model.safetensors.index.json", "w"))
PY
expect_ok "import a sharded model directory" "$alloy" import --weights hfshard --output imported-shards
e_shard=$("$alloy" eval --config tiny.yaml --weights imported-shards --text eval.txt 2>/dev/null)
[ -n "$e_shard" ] && [ "$e_shard" = "$e1" ] && ok "eval identical on the sharded import" || bad "sharded import evals differently: $e_shard / $e1"
# 20000 bytes -> floor(19999/32) = 624 windows of 32 predicted tokens
grep -q '"tokens":19968' <<<"$e1" && ok "eval token count" || bad "eval token count: $e1"
expect_fail "eval with another model's weights" "model.safetensors" "wte.weight" "[257, 64]" "[257, 128]" -- \
  "$alloy" eval --config tiny.yaml --set model.hidden=128 --weights hf/model.safetensors --text eval.txt

# --- plan conversions print and write the plan they mean
expect_ok "plan from SynerFuse flags" "$alloy" plan --from-synerfuse --num-layers 8 --pipeline-model-parallel-size 2 \
  --hetero-pipeline-stages 1 6 1 2 --global-batch-size 32 --micro-batch-size 4 -o sf.json
grep -q '"layers": \[\s*0,\s*6' sf.json 2>/dev/null || /usr/bin/python3 -c "import json,sys; p=json.load(open('sf.json')); s=p['pipelines'][0]['stages']; sys.exit(0 if [st['layers'] for st in s]==[[0,6],[6,8]] else 1)" \
  && ok "SynerFuse plan splits 6/2" || bad "SynerFuse plan split"
echo '{"version": 1, "shard_plan": [{"id": "local", "start": 0, "end": 2}]}' > hetero-as-config.json
# --- Megatron's model and training flags (SynerFuse's run.sh) override the config; --micro-batch-size
# alone sets every rank's micro-batch; nothing is accepted silently
out=$("$alloy" train --config tiny.yaml --set output.dir=mgrun --train-iters 3 --hidden-size 32 --num-attention-heads 2 \
  --micro-batch-size 2 --lr 2e-3 --lr-warmup-fraction .34 --lr-decay-style cosine --use-flash-attn --attention-dropout 0 \
  --tensorboard-dir mgtb --seed 9 2>&1) && ok "train with Megatron flags" || { bad "train with Megatron flags"; echo "$out" | tail -5; }
grep -q "hidden: 32" mgrun/config.yaml && grep -q "steps: 3" mgrun/config.yaml && grep -q "warmup: 1" mgrun/config.yaml \
  && ok "Megatron flags in the run's config" || bad "Megatron flags not in mgrun/config.yaml"
grep -q '"micro_batch_size": 2' mgrun/plan.json && ok "--micro-batch-size alone sets the micro-batch" || bad "--micro-batch-size ignored"
ls mgtb/events.out.tfevents.* >/dev/null 2>&1 && ok "--tensorboard-dir" || bad "no events in --tensorboard-dir"
grep -q -- "--use-flash-attn: Alloy uses" <<<"$out" && ok "a flag without effect says so" || bad "--use-flash-attn accepted silently"
# Megatron's --split carves one dataset (a plain PREFIX.bin/.idx) into training and validation shares
out=$("$alloy" train --config tiny.yaml --set output.dir=splitrun --data-path data/corpus_train --split 90,10 --train-iters 2 \
  --eval-interval 2 2>&1) && grep -q '"val_loss"' splitrun/metrics.jsonl && grep -q "split: \"90,10\"" splitrun/config.yaml \
  && ok "--split validates on its share of one dataset" || { bad "--split"; echo "$out" | tail -5; }
expect_fail "Megatron flag misspelled" "--lr-decay-styel" "did you mean --lr-decay-style" -- \
  "$alloy" train --config tiny.yaml --set output.dir=mgbad --lr-decay-styel cosine
expect_fail "HeteroShard file as the config" "--hetero-config" -- "$alloy" train --config hetero-as-config.json
expect_fail "SynerFuse constraint" "--hetero-pipeline-stages" "7" -- "$alloy" plan --from-synerfuse --num-layers 8 \
  --pipeline-model-parallel-size 2 --hetero-pipeline-stages 1 6 1 1 --global-batch-size 32 --micro-batch-size 4
cat > hetero.json <<JSON
{"version": "0.1.0", "coordinator": {"hostname": "mac", "ip": "10.0.0.1", "device": "mps"},
 "workers": [{"id": 1, "hostname": "box", "ip": "10.0.0.2", "port": 9999, "device": "cuda", "num_gpus": 1}],
 "shard_plan": [{"id": "local", "start": 0, "end": 5}, {"id": 1, "start": 5, "end": 8, "is_last": true}]}
JSON
expect_ok "plan from shard_plan" "$alloy" plan --from-shard-plan hetero.json --global-batch 8 --micro-batch 2 -o hs.json
/usr/bin/python3 -c "import json,sys; p=json.load(open('hs.json')); s=p['pipelines'][0]['stages']; sys.exit(0 if [st['layers'] for st in s]==[[0,5],[5,8]] and p['pipelines'][0]['num_micro_batches']==4 else 1)" \
  && ok "shard_plan converted 5/3" || bad "shard_plan conversion"
sed -i 's/"start": 5, "end": 8/"start": 4, "end": 8/' hetero.json
expect_fail "shard_plan overlap" "hetero.json" "shard_plan[1].start" -- "$alloy" plan --from-shard-plan hetero.json --global-batch 8 --micro-batch 2
printf '{"global_batch": 8, "pipelines": [{"micro_batch_size": 2, "num_micro_batches": 4, "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [2, 2]}]}]}' > gap.json
expect_fail "plan with a gap rejected before training" "gap.json" "a gap" -- "$alloy" train --config tiny.yaml --plan gap.json --set output.dir=gaprun
[ ! -e gaprun ] && ok "rejected plan started nothing" || bad "rejected plan created output"

# --- profile on real ranks (all at once, and in turns), then --plan auto plans and trains
cp "$repo/tests/cli/pool-two-types.yaml" pool.yaml
check_profile() {  # FILE: both types timed (a micro-batch of 4 costs time), the h0-h1 link and the pair's TP sums measured
  /usr/bin/python3 - "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
at4 = lambda c: c["fixed_s"] + 4 * c["per_sample_s"]
for t in ("cpu-big", "cpu-small"):
    d = p["devices"][t]
    # A tiny model on a loaded machine may fit a flat line, but never a free one.
    assert at4(d["block_fwd"]) > 0 and at4(d["block_bwd"]) > 0 and at4(d["head_bwd"]) > 0, (t, d)
    assert d["optimizer_s_per_param"] > 0, (t, d)
    # Rounds of the same timing never agree to the last nanosecond on a real machine.
    assert 0 < d["step_noise"] <= 0.5, (t, d)
    # zb-h1's weight passes: timed apart from the rest of the backward, a share strictly inside.
    assert 0 < d["weight_share"] < 1, (t, d)
    # Communication's CPU time per byte: measured (the log says so); zero when no slowdown showed.
    assert 0 <= d.get("comm_cpu_s_per_byte", 0) < 1e-6, (t, d)  # the profiler's own bound
    # What a tensor-parallel member computes whole: a share, when it showed at all.
    assert 0 <= d.get("tp_whole_share", 0) <= 0.95, (t, d)
    # ... and per shard size: the even pair's piece at least, each share at least its fraction.
    s = d["tp_shard_shares"]
    assert s and s[-1][0] == 0.5 and all(f <= x <= 1 for f, x in s), (t, d)
    # A CPU quota: absent on ranks without one (or both figures, bounded).
    assert ("quota_fraction" in d) == ("quota_burst_s" in d), (t, d)
    assert 0 < d.get("quota_fraction", 0.5) < 1 and 0 < d.get("quota_burst_s", 0.5) <= 1, (t, d)
    assert "burst_speedup" not in d, (t, d)
links = [l for l in p["links"] if {l["host_a"], l["host_b"]} == {"h0", "h1"}]
assert links and links[0]["bytes_per_s"] > 0, p["links"]
# Tensor-parallel sums of the pair, timed at the smallest and the largest micro-batch (1 and 4).
sums = sorted((t["bytes"], t["seconds"]) for t in p["tp_sums"] if {t["device_a"], t["device_b"]} == {"big", "small"})
assert len(sums) == 2 and sums[1][0] == 4 * sums[0][0] and all(s > 0 for _, s in sums), p.get("tp_sums")
PY
}
for mode in together one-at-a-time; do
  extra=(); [ $mode = one-at-a-time ] && extra=(--one-at-a-time)
  expect_ok "profile 2 ranks ($mode)" "$alloy" launch --nproc 2 -- "$alloy" profile --cluster pool.yaml --config tiny.yaml \
    --micro-batches 1 4 --window 0.05 "${extra[@]}" -o prof-$mode.json
  check_profile prof-$mode.json && ok "profile ($mode) has both types and the link" || bad "profile ($mode) incomplete"
  for t in cpu-big cpu-small; do
    grep -q "communication's CPU time on $t: .* ns of compute lost per byte" <<<"$out" || bad "profile ($mode) did not time $t's communication CPU time"
  done
done
expect_ok "train --plan auto (reusing the profile)" "$alloy" launch --nproc 2 -- "$alloy" train --config tiny.yaml --plan auto \
  --cluster pool.yaml --profile prof-together.json --set output.dir=autorun --set train.steps=3
/usr/bin/python3 -c "import json,sys; p=json.load(open('autorun/plan.json')); sys.exit(0 if sum(pl['micro_batch_size']*pl['num_micro_batches'] for pl in p['pipelines'])==4 and 'step_s' in p['predicted'] else 1)" \
  && ok "--plan auto wrote its plan with a prediction" || bad "--plan auto plan: $(head -c 300 autorun/plan.json 2>&1)"
[ "$(wc -l < autorun/metrics.jsonl)" -eq 3 ] && ok "--plan auto trained 3 steps" || bad "--plan auto metrics"
# --devices places each rank (ALLOY_DEVICE over train.device); ranks.json says where each ran.
expect_ok "launch --devices cpu,cpu" "$alloy" launch --nproc 2 --devices cpu,cpu -- "$alloy" train --config tiny.yaml \
  --set output.dir=devrun --set train.steps=1
/usr/bin/python3 -c "import json,sys; sys.exit(0 if [r['device'] for r in json.load(open('devrun/ranks.json'))]==['cpu','cpu'] else 1)" \
  && ok "ranks.json names each rank's device" || bad "ranks.json devices: $(head -c 300 devrun/ranks.json 2>&1)"
expect_fail "launch --devices count" "--devices" "3 devices for 2 ranks" -- "$alloy" launch --nproc 2 --devices cpu,cpu,cpu -- "$alloy" train --config tiny.yaml
expect_fail "unknown device" "ALLOY_DEVICE" "unknown device 'gpu0'" -- "$alloy" launch --nproc 1 --devices gpu0 -- "$alloy" train --config tiny.yaml
# ZeRO's flags: a stage that is not built and shares that do not fit the group are named.
expect_fail "zero stage 4" "--zero-stage" "must be 0, 1, 2 or 3" -- "$alloy" train --config tiny.yaml --zero-stage 4
expect_fail "shard ratio for another group size" "--shard-ratio" "ranks 0,1" "3 shares" -- \
  "$alloy" launch --nproc 2 -- "$alloy" train --config tiny.yaml --set output.dir=zerobad --zero-stage 1 --shard-ratio 3 1 1
expect_fail "distributed optimizer vs zero stage" "--use-distributed-optimizer" -- \
  "$alloy" train --config tiny.yaml --zero-stage 2 --use-distributed-optimizer
# ZeRO-3 gathers per layer in each member's schedule: replicas with unlike micro-batch counts are
# refused by a plan's sharding entry (and fall back to ZeRO-2 under --zero-stage 3, with a warning).
printf '{"version": 2, "global_batch": 4, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 3, "stages": [{"ranks": [0], "layers": [0, 2]}]}, {"micro_batch_size": 1, "num_micro_batches": 1, "stages": [{"ranks": [1], "layers": [0, 2]}]}], "sharding": [{"ranks": [0, 1], "stage": 3}]}' > z3bad.json
expect_fail "zero-3 over unlike schedules" "sharding stage 3 for ranks 0,1" "3 micro-batches" "1 micro-batches" -- \
  "$alloy" launch --nproc 2 -- "$alloy" train --config tiny.yaml --set output.dir=z3bad --set train.steps=1 --plan z3bad.json
/usr/bin/python3 -c "import json; p=json.load(open('z3bad.json')); del p['sharding']; json.dump(p, open('z3fallback.json','w'))"
out=$("$alloy" launch --nproc 2 -- "$alloy" train --config tiny.yaml --set output.dir=z3fb --set train.steps=2 --plan z3fallback.json --zero-stage 3 2>&1) \
  && grep -qF "ZeRO-2 there" <<<"$out" && ok "--zero-stage 3 over unlike schedules falls back to ZeRO-2" \
  || { bad "--zero-stage 3 fallback"; echo "$out" | tail -5; }
# --evaluate predicts a given plan on the same inputs: the planner's own plan gets the step time
# the planner gave it; a hand-made change of it gets its own, shown beside the searched plans.
expect_ok "plan --evaluate" "$alloy" plan --cluster pool.yaml --config tiny.yaml --profile prof-together.json \
  --evaluate autorun/plan.json -o evaluated.json
/usr/bin/python3 - <<'PY' && ok "--evaluate reproduces the planner's prediction" || bad "--evaluate prediction differs"
import json, math
a = json.load(open("autorun/plan.json"))["predicted"]["step_s"]
b = json.load(open("evaluated.json"))["predicted"]["step_s"]
assert math.isclose(a, b, rel_tol=1e-9), (a, b)
PY
/usr/bin/python3 - <<'PY'
import json
p = json.load(open("autorun/plan.json"))
p.pop("predicted", None)
for pl in p["pipelines"]:  # the same samples in micro-batches of 1
    pl["num_micro_batches"] *= pl["micro_batch_size"]
    pl["micro_batch_size"] = 1
json.dump(p, open("by-ones.json", "w"))
PY
out=$("$alloy" plan --cluster pool.yaml --config tiny.yaml --profile prof-together.json --evaluate by-ones.json 2>&1)
grep -q "plan (given)" <<<"$out" && grep -q "1 x " <<<"$out" && grep -qE "^  alloy +[0-9.]+ ms" <<<"$out" \
  && ok "--evaluate shows the given plan beside the searched one" || bad "--evaluate output: $out"

# A boundary inside an MLP: the plan says which heads' columns the first stage computes; --evaluate
# prices it, the summary and the diagram say so, and a cut out of range names the field.
printf '{"version": 8, "global_batch": 4, "pipelines": [{"micro_batch_size": 1, "num_micro_batches": 4, "stages": [{"ranks": [0], "units": [0, 2], "mlp_cut": 3, "device": "big"}, {"ranks": [1], "units": [1, 4], "device": "small"}]}]}' > cut.json
out=$("$alloy" plan --cluster pool.yaml --config tiny.yaml --profile prof-together.json --evaluate cut.json -o cut-evaluated.json --diagram cut.dot 2>&1)
grep -qF "unit 1's MLP columns of 3 heads" <<<"$out" && grep -qF "units [1,4)" <<<"$out" && grep -qF "last MLP: columns of 3 heads" cut.dot \
  && ok "--evaluate prices a cut MLP and the diagram shows it" || bad "cut MLP plan: $out"
sed 's/"mlp_cut": 3/"mlp_cut": 4/' cut.json > cut-bad.json
expect_fail "cut MLP out of range" "cut-bad.json" "stages[0].mlp_cut: must be in [1, 3]" -- \
  "$alloy" plan --cluster pool.yaml --config tiny.yaml --profile prof-together.json --evaluate cut-bad.json -o /dev/null

# --- LoRA fine-tuning from the exported model: adapters in PEFT's layout, a small checkpoint, and
# the errors a user meets
expect_ok "lora fine-tune from safetensors" "$alloy" train --config tiny.yaml --set output.dir=lora --init-from hf/model.safetensors \
  --lora-rank 4 --lora-targets c_attn mlp.c_fc --base-dtype int8
[ -s lora/adapter/adapter_model.safetensors ] && grep -q '"peft_type": "LORA"' lora/adapter/adapter_config.json \
  && grep -q '"base_model_name_or_path": ".*hf/model.safetensors"' lora/adapter/adapter_config.json \
  && ok "lora adapter in PEFT's layout" || bad "lora adapter files"
full_kb=$(du -k run/checkpoints/step_00000008/model.safetensors | cut -f1); lora_kb=$(du -k lora/checkpoints/step_00000008/model.safetensors | cut -f1)
[ "$lora_kb" -lt $((full_kb / 5)) ] && ok "lora checkpoint holds the adapters alone (${lora_kb} kB vs ${full_kb} kB)" || bad "lora checkpoint ${lora_kb} kB vs ${full_kb} kB"
e4=$("$alloy" eval --config tiny.yaml --weights lora --text eval.txt 2>/dev/null)
expect_ok "export --merge" "$alloy" export --checkpoint lora --output merged/model.safetensors --merge
e5=$("$alloy" eval --config tiny.yaml --weights merged/model.safetensors --text eval.txt 2>/dev/null)
/usr/bin/python3 -c "import json,sys; a=json.loads('$e4')['loss']; b=json.loads('$e5')['loss']; base=json.loads('$e1')['loss']; sys.exit(0 if abs(a-b) <= 1e-5*abs(a) and a != base else 1)" \
  && ok "merged export evaluates as the LoRA checkpoint ($e4 / $e5)" || bad "merged export: $e4 / $e5 (base $e1)"
expect_fail "export of a LoRA run needs --merge" "--merge" "adapter/" -- "$alloy" export --checkpoint lora --output x/model.safetensors
expect_fail "lora target of another arch" "lora.targets" "'q_proj'" "mlp.c_fc" -- \
  "$alloy" train --config tiny.yaml --set output.dir=lorabad --lora-rank 4 --lora-targets q_proj
expect_fail "quantized base without adapters" "lora.base_dtype" "lora.rank" -- "$alloy" train --config tiny.yaml --base-dtype nf4
expect_fail "resume a LoRA run without LoRA" "with LoRA" "--init-from" -- "$alloy" train --config tiny.yaml --set output.dir=lora \
  --set train.steps=10 --resume

# --- HeteroShard's whole file: LoRA over a 4-bit base, its diagram when training starts, its
# checkpoint_dir, and resume_step; plan --diagram draws converted plans too
sed 's/layers: 2/layers: 3/' tiny.yaml > tiny3.yaml
cat > hs.json <<'JSON'
{"version": "0.1.0",
 "coordinator": {"hostname": "mac", "ip": "127.0.0.1", "device": "cpu"},
 "workers": [{"id": 1, "hostname": "gpu-a", "ip": "127.0.0.1", "port": 9999, "device": "auto"},
             {"id": 2, "hostname": "gpu-b", "ip": "127.0.0.1", "port": 9999, "device": "cpu"}],
 "training": {"visualize": true, "visualization_format": "svg", "log_level": "INFO"},
 "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"], "load_in_4bit": true},
 "shard_plan": [{"id": "local", "start": 0, "end": 1}, {"id": 1, "start": 1, "end": 2}, {"id": 2, "start": 2, "end": 3, "is_last": true}],
 "checkpoint_dir": "hs_run"}
JSON
out=$("$alloy" launch --nproc 3 -- "$alloy" train --config tiny3.yaml --hetero-config hs.json 2>&1) \
  && grep -q "projections in nf4" <<<"$out" && grep -q "<svg" hs_run/architecture.svg && grep -qE "gpu(-|&#45;)b" hs_run/architecture.svg \
  && [ -s hs_run/adapter/adapter_model.safetensors ] && [ -d hs_run/checkpoints/step_00000004 ] \
  && ok "HeteroShard file: LoRA on nf4 over 3 ranks, diagram and checkpoints in checkpoint_dir" \
  || { bad "HeteroShard file run"; echo "$out" | tail -5; }
/usr/bin/python3 -c "import json; j=json.load(open('hs.json')); j['resume_step']=4; json.dump(j, open('hs-resume.json','w'))"
out=$("$alloy" launch --nproc 3 -- "$alloy" train --config tiny3.yaml --hetero-config hs-resume.json --set train.steps=10 2>&1) \
  && grep -q "resumed from hs_run/checkpoints/step_00000004 at step 4" <<<"$out" && [ "$(wc -l < hs_run/metrics.jsonl)" -eq 10 ] \
  && ok "HeteroShard resume_step resumes there" || { bad "HeteroShard resume_step"; echo "$out" | tail -5; }
/usr/bin/python3 -c "import json; j=json.load(open('hs.json')); j['resume_step']=6; json.dump(j, open('hs-bad.json','w'))"
expect_fail "HeteroShard resume_step without a checkpoint" "hs-bad.json" "resume_step: 6" "step_00000004" -- \
  "$alloy" launch --nproc 3 -- "$alloy" train --config tiny3.yaml --hetero-config hs-bad.json
/usr/bin/python3 -c "import json; j=json.load(open('hs.json')); j['workers'][1]['device']='mps'; json.dump(j, open('hs-mps.json','w'))"
expect_fail "HeteroShard mps device named" "hs-mps.json" "shard_plan[2] (rank 2)" "'mps'" -- \
  "$alloy" launch --nproc 3 -- "$alloy" train --config tiny3.yaml --hetero-config hs-mps.json --set output.dir=mps
# HeteroShard's "same command on every machine": no ranks given, each process finds its stage in the
# file (all three machines are this one here, so the processes take the stages in turn); its own
# --checkpoint_dir and --resume_step flags override the file's
port=$(/usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
same() {
  for i in 0 1 2; do "$alloy" train --config tiny3.yaml --hetero-config hs.json --master-port "$port" --checkpoint_dir hs_same "$@" > same$i.log 2>&1 & done
  wait
}
same --set train.steps=2
roles=$(grep -ho "runs shard_plan\[[0-9]\]" same0.log same1.log same2.log | sort | tr '\n' ' ')
[ "$roles" = "runs shard_plan[0] runs shard_plan[1] runs shard_plan[2] " ] && [ "$(wc -l < hs_same/metrics.jsonl)" -eq 2 ] \
  && ok "HeteroShard: the same command on every machine finds each stage" || { bad "HeteroShard same command: roles '$roles'"; tail -3 same*.log; }
same --set train.steps=3 --resume_step 2
grep -q "resumed from hs_same/checkpoints/step_00000002 at step 2" same0.log same1.log same2.log && [ "$(wc -l < hs_same/metrics.jsonl)" -eq 3 ] \
  && ok "HeteroShard --resume_step and --checkpoint_dir flags" || { bad "HeteroShard --resume_step flag"; tail -3 same*.log; }
expect_ok "plan --from-shard-plan --diagram" "$alloy" plan --from-shard-plan hs.json --global-batch 4 --micro-batch 1 --diagram hs-plan.mmd
grep -q "gpu-a" hs-plan.mmd && ok "converted plan's diagram written" || bad "converted plan's diagram"
expect_ok "plan --from-synerfuse --diagram" "$alloy" plan --from-synerfuse --num-layers 8 --pipeline-model-parallel-size 2 \
  --hetero-pipeline-stages 1 6 1 2 --global-batch-size 32 --micro-batch-size 4 --diagram sf-plan.dot
grep -q "digraph" sf-plan.dot && ok "SynerFuse plan's diagram written" || bad "SynerFuse plan's diagram"
expect_fail "an option that cannot apply" "--profile" "--cluster" -- "$alloy" plan --from-shard-plan hs.json --profile hs.json

# --- generate prints text
gen=$("$alloy" generate --checkpoint run --prompt "The " -n 40 2>/dev/null)
[ ${#gen} -ge 40 ] && ok "generate: $(head -c 60 <<<"$gen" | tr '\n' ' ')" || bad "generate printed '${gen}'"

echo "cli end-to-end: $fails failed"
[ $fails -eq 0 ]
