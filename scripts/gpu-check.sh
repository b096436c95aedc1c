#!/usr/bin/env bash
# Builds Alloy against a CUDA LibTorch 2.x (the one inside a PyTorch install) and runs the checks
# that need a GPU: the test suite under LibTorch 2.x, then training on CUDA against the CPU
# (one device, and ranks on CUDA and CPU in one run through Gloo).
#
# usage: scripts/gpu-check.sh [BUILD_DIR]
#   ALLOY_PYTHON   python3 whose torch has CUDA (default: python3 on PATH)
#   ALLOY_DEPS     extra CMake prefix for what the machine lacks (e.g. rapidcheck, ICU headers):
#                  scripts/gpu-deps.sh gathers it from a Debian machine's packages
#   The tests read Debian's fortunes corpus from /usr/share/games/fortunes (package `fortunes`;
#   the whole folder, which scripts/gpu-deps.sh carries).
#   ALLOY_CHECK_OUT  folder for logs and results (default: BUILD_DIR/gpu-check)
#   ALLOY_STEPS    which checks (default all: suite parity precision bench pool, run in that order):
#                  suite (every test), device (the CUDA unit tests only: allocator memory, fused
#                  AdamW, NCCL at world size 1, the GPU's UUID), parity (CUDA against the CPU;
#                  on a machine with two or more GPUs cuda-pp2's stages also pass their messages
#                  GPU to GPU on NCCL channels, which the run asserts), precision
#                  (bench/precision_bench.py on CUDA: 300 steps of fp32, bf16 and fp16), bench
#                  (bench/gpu_bench.py: Alloy vs PyTorch eager and torch.compile), pool (GPU + CPU,
#                  --plan auto: predicted against measured step and memory)
#                  Without suite or device only the alloy binary is built.
#   ALLOY_PARITY   the parity layouts (default: all of tests/dist/test_parity.py's --devices)
#   ALLOY_BENCH_ARGS  extra arguments for bench/gpu_bench.py
#   ALLOY_POOL_STEPS  the pool run's steps (default 30; it re-plans at step 6)
# Graphviz is left out (-DALLOY_GRAPHVIZ=OFF): GPU images rarely carry libgvc.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
py=${ALLOY_PYTHON:-$(command -v python3)}
out=${ALLOY_CHECK_OUT:-$build/gpu-check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Libraries carried under ALLOY_DEPS (yaml-cpp, ICU) must be found at link and run time.
[ -n "${ALLOY_DEPS:-}" ] && export LD_LIBRARY_PATH="$ALLOY_DEPS/lib/x86_64-linux-gnu:$ALLOY_DEPS/lib:${LD_LIBRARY_PATH:-}"
torch_dir=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))') || { echo "no torch in $py"; exit 1; }
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake${ALLOY_DEPS:+;$ALLOY_DEPS;$ALLOY_DEPS/share/cmake;$ALLOY_DEPS/lib/x86_64-linux-gnu/cmake}" \
  ${ALLOY_DEPS:+-DICU_ROOT=$ALLOY_DEPS} \
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DALLOY_GRAPHVIZ=OFF -DALLOY_BUILD_BENCH=OFF \
  -DALLOY_PYTHON="$py" >"$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
steps=" ${ALLOY_STEPS:-suite parity precision bench pool} "
has() { [[ "$steps" == *" $1 "* ]]; }
targets=""
has suite || targets="alloy_cli"
has suite || ! has device || targets="alloy_cli test_torch"
stamp() { echo "[gpu-check $(date +%T)] $*"; }
grep "Alloy: CUDA" "$out/configure.log"
ninja -C "$build" $targets >"$out/build.log" 2>&1 || { grep -B2 -A12 "error" "$out/build.log" | head -150; exit 1; }
stamp "built: $(grep -c 'Building CXX' "$out/build.log") files"

status=0
if has suite; then
  # The emulator needs cgroup v1 and network namespaces, and the GPT-2 tokenizer check needs node:
  # both belong to the CPU machines' suite.
  (cd "$build" && OMP_NUM_THREADS=1 ctest -j8 --output-on-failure -E '^emu\.|tokenizer.gpt2_matches_js' \
     >"$out/ctest.log" 2>&1) || status=1
  tail -5 "$out/ctest.log"
  grep -E "\*\*\*Failed|Not Run|Timeout" "$out/ctest.log" | head -20
elif has device; then
  OMP_NUM_THREADS=4 "$build/tests/test_torch" --gtest_filter='DeviceMemory.*:FusedAdamW.*:Nccl*.*' >"$out/device-tests.log" 2>&1 || status=1
  tail -25 "$out/device-tests.log"
fi
# Those tests skip without a GPU or without NCCL; here either means the build missed what it came
# for (a CPU LibTorch, no nccl.h beside the wheel), so a skip fails the check.
if has suite || has device; then
  skipped=$(grep -hoE "(DeviceMemory|FusedAdamW|Nccl)[A-Za-z]*\.[A-Za-z]+ \(Skipped\)|\[  SKIPPED \] (DeviceMemory|FusedAdamW|Nccl)[A-Za-z]*\.[A-Za-z]+" \
    "$out/ctest.log" "$out/device-tests.log" 2>/dev/null | sort -u)
  if [ -n "$skipped" ]; then echo "GPU tests skipped on the GPU machine:"; echo "$skipped"; status=1; fi
fi

if has parity; then
  stamp "parity"
  "$py" tests/dist/test_parity.py "$build/alloy" "$out/cuda-parity" --devices ${ALLOY_PARITY:-} 2>&1 | tee "$out/cuda-parity.log" || status=1
fi

if has precision; then
  stamp "precision"
  "$py" bench/precision_bench.py --build "$build" --device cuda --threads 4 --rounds 2 --results "$out/precision-cuda.json" 2>&1 |
    tee "$out/precision.log" || status=1
fi

if has bench; then
  stamp "bench"
  "$py" bench/gpu_bench.py "$build/alloy" --out "$out/bench" ${ALLOY_BENCH_ARGS:-} 2>&1 | tee "$out/gpu-bench.log" || status=1
fi
has pool || exit $status
stamp "pool"

# A pool of the GPU and the CPU: each rank profiles its own device, the planner splits the work,
# and the run reports predicted against measured.
pool=$out/pool
mkdir -p "$pool"
cat >"$pool/cluster.yaml" <<'EOF'
name: gpu-and-cpu
devices:
  - {name: gpu, host: h0, kind: cuda, type: gpu, memory_gb: 16, speed: 1.0}
  - {name: cpu, host: h1, kind: cpu, type: cpu, memory_gb: 16, speed: 0.1}
default_link: {bandwidth_gbps: 10, latency_ms: 0.05}
EOF
"$build/alloy" data prepare --input /usr/share/games/fortunes/fortunes --output "$pool/fortunes" >/dev/null || status=1
"$build/alloy" launch --nproc 2 --devices cuda,cpu --threads-per-rank 4 -- "$build/alloy" train -c examples/demo-gpt2.yaml \
  --plan auto --cluster "$pool/cluster.yaml" --set data.prefix="$pool/fortunes" --set output.dir="$pool/run" \
  --set train.steps=${ALLOY_POOL_STEPS:-30} --set train.replan_step=6 --set train.threads=4 --set train.log_interval=5 \
  >"$pool/train.log" 2>&1 || status=1
cp "$pool/run/plan.json" "$pool/run/ranks.json" "$pool/" 2>/dev/null
grep -vE "it/s" "$pool/train.log" | grep -vE "step +[0-9]+: " | tail -40
stamp "done"
exit $status
