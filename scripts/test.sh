#!/usr/bin/env bash
# Sets everything up and runs the whole test suite (what CI runs).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bash scripts/build.sh
# Each test process uses one intra-op thread so two tests can share the two cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# What `alloy` would set and re-exec for (core/process.h): set here, no test process loads LibTorch twice.
export OMP_WAIT_POLICY=PASSIVE
# Tests read Alloy's info lines; a level the caller exported would hide them.
unset ALLOY_LOG_LEVEL
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 1200
