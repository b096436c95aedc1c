#!/usr/bin/env bash
# The fine-tuning demo: pretrain a small GPT-2 on most of the fortunes corpus, then LoRA fine-tune
# it on the held-out technical files on an emulated 3-device pool (examples/cluster-3dev.yaml,
# planned with --plan auto), and report the held-out loss before and after, the adapters' bytes
# against the model's and the gradient bytes per step against full fine-tuning.
#   bash scripts/finetune-demo.sh          on the emulated pool (needs root: namespaces, tc, cgroups)
#   bash scripts/finetune-demo.sh local    on 3 local ranks instead
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/build.sh alloy_cli
if [ "${1:-}" = local ]; then
  exec /usr/bin/python3 scripts/finetune_demo.py --nproc 3
fi
exec /usr/bin/python3 scripts/finetune_demo.py --emulate examples/cluster-3dev.yaml
