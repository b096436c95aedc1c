#!/usr/bin/env bash
# A rank killed mid-run must make every other rank exit non-zero, within the collective timeout,
# with an error naming the dead rank. Ranks are started by hand (not through `alloy launch`, which
# would stop them itself) so what is checked is each survivor's own failure detection.
# SIGNAL STOP freezes the victim instead (a stalled rank): the others then fail when the collective
# timeout expires.
# usage: test_kill.sh ALLOY WORKDIR [VICTIM] [KILL|STOP]
set -uo pipefail
alloy=$(realpath "$1") work=$2 victim=${3:-2} sig=${4:-KILL}
timeout_s=20
rm -rf "$work"; mkdir -p "$work"; cd "$work"
head -c 100000 /usr/share/games/fortunes/fortunes > corpus.txt
"$alloy" data prepare --input corpus.txt --output data/corpus >/dev/null 2>&1 || { echo "FAIL: data prepare"; exit 1; }
cat > cfg.yaml <<YAML
model: {arch: gpt2, layers: 3, hidden: 32, heads: 4, seq_len: 32, vocab_size: 257}
data: {prefix: data/corpus}
train: {steps: 100000, global_batch: 6, lr: 1e-3, eval_interval: 0, threads: 1, checkpoint_interval: 0}
output: {dir: run, tensorboard: false}
YAML
port=$(( 20000 + RANDOM % 20000 ))
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
pids=()
for r in 0 1 2; do
  "$alloy" train --config cfg.yaml --rank $r --world-size 3 --master-addr 127.0.0.1 --master-port $port \
    --timeout $timeout_s > rank$r.log 2>&1 &
  pids+=($!)
done
# Wait until training is under way (rank 0 has logged a few steps), then kill the victim.
for i in $(seq 1 600); do
  [ -f run/metrics.jsonl ] && [ "$(wc -l < run/metrics.jsonl)" -ge 3 ] && break
  sleep 0.2
done
if [ ! -f run/metrics.jsonl ]; then echo "FAIL: training never started"; cat rank*.log | tail -20; kill "${pids[@]}" 2>/dev/null; exit 1; fi
kill -"$sig" "${pids[$victim]}"
killed_at=$(date +%s)
fails=0
for r in 0 1 2; do
  [ "$r" = "$victim" ] && continue
  # A hang guard, not a speed check: twice the collective timeout plus slack.
  for i in $(seq 1 $(( (2 * timeout_s + 30) * 5 ))); do kill -0 "${pids[$r]}" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "${pids[$r]}" 2>/dev/null; then
    echo "FAIL: rank $r still running $(( $(date +%s) - killed_at )) s after rank $victim died"; kill -9 "${pids[$r]}"; fails=$((fails+1)); continue
  fi
  wait "${pids[$r]}"; rc=$?
  took=$(( $(date +%s) - killed_at ))
  if [ $rc -eq 0 ]; then echo "FAIL: rank $r exited 0"; fails=$((fails+1)); continue; fi
  if ! grep -q "rank $victim" rank$r.log; then
    echo "FAIL: rank $r's error does not name rank $victim:"; tail -5 rank$r.log; fails=$((fails+1)); continue
  fi
  echo "ok: rank $r exited with code $rc after ${took} s: $(grep -m1 'error' rank$r.log | cut -c1-240)"
done
kill -9 "${pids[$victim]}" 2>/dev/null
wait 2>/dev/null
[ $fails -eq 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
[ $fails -eq 0 ]
