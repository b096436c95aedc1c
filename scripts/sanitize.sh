#!/usr/bin/env bash
# Builds Alloy with sanitizers and runs the test suite under them.
#
#   scripts/sanitize.sh [address|thread] [CTEST ARGS...]
#
#   address (default): ASan + UBSan over the whole suite, in build-asan/. Any report fails the test
#                      that hit it (UBSan is fatal, ASan always is).
#   thread:            TSan, in build-tsan/, over the tests that run Alloy's own threads: the
#                      reducer's communication thread, the pipeline executor's send/receive
#                      threads, the heartbeat and stall watchers and the async checkpoint writer
#                      (ctest -L threads, then three pipeline/replica layouts of dist.parity). LibTorch, Gloo and OpenMP are not instrumented, so
#                      races inside them are suppressed (scripts/tsan.supp says which and why);
#                      races in Alloy's code are not.
#
# Extra arguments go to ctest (e.g. -R dist.restart). The build is separate from build/, so the
# normal build and its ccache entries are untouched; the first sanitizer build compiles everything
# (about as long as a fresh build/).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
kind=${1:-address}
[ $# -gt 0 ] && shift
case "$kind" in
  address) dir=build-asan ;;
  thread) dir=build-tsan ;;
  *) echo "usage: $0 [address|thread] [ctest args...]" >&2; exit 2 ;;
esac
bash scripts/install-deps.sh
jobs=$(nproc)
# -O1 keeps the instrumented tests within a small factor of the normal build's speed; -g names
# lines in the reports.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DALLOY_SANITIZE="$kind" -DALLOY_BUILD_BENCH=OFF >/dev/null
echo "[sanitize] building $dir ($kind) with $jobs jobs"
ninja -C "$dir" -j"$jobs"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# LibTorch and Python keep their globals to the end of the process: leak reports would be theirs.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_init_order=1:detect_stack_use_after_return=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$repo/scripts/tsan.supp"
extra=()
[ "$kind" = thread ] && extra=(-L threads)
echo "[sanitize] running the tests under $kind"
ctest --test-dir "$dir" --output-on-failure -j"$jobs" --timeout 2400 "${extra[@]}" "$@"
if [ "$kind" = thread ] && [ $# -eq 0 ]; then
  # The executor's send/receive threads in pipelines (one cut inside a block), the reducer's beside
  # them in a replica, and ZeRO-2's owner reduces: three parity layouts of dist.parity under TSan.
  echo "[sanitize] pipeline and replica layouts of dist.parity under thread"
  /usr/bin/python3 tests/dist/test_parity.py "$dir/alloy" "$dir/tsan_parity" pp2-6+2-1f1b mixed-5+3_and_8 halves-zero2-recompute
fi
