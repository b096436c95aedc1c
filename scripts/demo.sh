#!/usr/bin/env bash
# The main job: set up, build, then on an emulated 3-device cluster (examples/cluster-3dev.yaml):
# profile, plan (with a diagram), train a small GPT-2 on the fortunes corpus, and report throughput
# against each device alone and predicted against measured step time.
#   bash scripts/demo.sh          the heterogeneous demo (needs root: namespaces, tc, cgroups)
#   bash scripts/demo.sh single   a plain one-device training run of examples/small-gpt2.yaml
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
unset ALLOY_LOG_LEVEL  # the bench reads Alloy's info lines
bash scripts/build.sh alloy_cli
if [ ! -f data/fortunes_train.idx ]; then
  ./build/alloy data prepare --input /usr/share/games/fortunes --output data/fortunes
fi
if [ "${1:-}" = single ]; then
  ./build/alloy train --config examples/small-gpt2.yaml --set output.dir=runs/demo-single
  echo; echo "A sample from the trained model:"
  ./build/alloy generate --checkpoint runs/demo-single --prompt "The " -n 200 --seed 7
  exit 0
fi
/usr/bin/python3 bench/hetero_bench.py --demo --build build --cluster examples/cluster-3dev.yaml \
  --config examples/demo-gpt2.yaml --steps 40
echo; echo "A sample from the model trained on the pool:"
./build/alloy generate --checkpoint runs/hetero/runs/alloy --prompt "The " -n 160 --seed 7 || true
