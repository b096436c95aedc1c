#!/usr/bin/env bash
# Installs dependencies (idempotent) and builds Alloy into build/ (Release, Ninja, ccache).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
echo "[build] compiling with $jobs jobs (first build takes several minutes: LibTorch headers)"
# Targets may be named (the demo needs only `alloy_cli`); none = everything, tests included.
ninja -C build -j"$jobs" "$@"
echo "[build] done: build/alloy"
