#!/usr/bin/env bash
# The main job: set up, build, prepare the fortunes corpus and train a small GPT-2 on it, printing
# the loss curve. (The heterogeneous emulated-cluster demo replaces this once it exists.)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/build.sh
if [ ! -f data/fortunes_train.idx ]; then
  ./build/alloy data prepare --input /usr/share/games/fortunes --output data/fortunes
fi
config=${1:-examples/small-gpt2.yaml}
shift || true
run_dir=runs/demo
./build/alloy train --config "$config" --set output.dir=$run_dir "$@"
echo
echo "A sample from the trained model:"
./build/alloy generate --checkpoint "$run_dir" --prompt "The " -n 200 --seed 7
