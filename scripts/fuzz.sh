#!/usr/bin/env bash
# Fuzzes every reader of outside input (fuzz/fuzz_*.cpp) for SECONDS each with libFuzzer, ASan and
# UBSan, and prints executions and crashes per target. Exits non-zero if any target crashed.
#
#   scripts/fuzz.sh SECONDS [TARGET...]      e.g. scripts/fuzz.sh 60, scripts/fuzz.sh 300 plan profile
#
# Builds into build-fuzz/ with Debian's clang (installed here if missing: clang-14 and its
# sanitizer/libFuzzer runtime libclang-rt-14-dev; CI's scripts/install-deps.sh stays without them).
# Each target starts from its corpus fuzz/corpus/<target>/ (read-only) and writes the inputs it
# discovers to a temporary directory, so the repository only changes when something crashes: the
# reproducer is written to fuzz/corpus/<target>/crash-<sha1> (or leak-, timeout-, oom-), where the
# fuzz.replay.<target> test then replays it until the bug is fixed and after.
#
# Environment: FUZZ_KEEP_DIR=DIR keeps each target's discovered inputs in DIR/<target> (to merge a
# few into the corpus by hand: fuzz_<target> -merge=1 NEW fuzz/corpus/<target> DIR/<target>).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"

ALL_TARGETS=(config cluster ptafm plan profile synerfuse hetero_config mmidx safetensors checkpoint_state gpt2_vocab)
# Longest input per target: a few times the largest seed, so the fuzzer can grow inputs but spends
# its time on structure rather than on size.
declare -A MAX_LEN=([config]=4096 [cluster]=4096 [ptafm]=4096 [plan]=4096 [profile]=8192 [synerfuse]=512
                    [hetero_config]=4096 [mmidx]=4096 [safetensors]=4096 [checkpoint_state]=8192 [gpt2_vocab]=16384)

if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
  echo "usage: $0 SECONDS [TARGET...]   (targets: ${ALL_TARGETS[*]})" >&2
  exit 2
fi
seconds=$1
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
  [ -n "${MAX_LEN[$t]:-}" ] || { echo "[fuzz] unknown target '$t' (targets: ${ALL_TARGETS[*]})" >&2; exit 2; }
done

# --- dependencies: the project's own, then clang + libFuzzer (idempotent, like install-deps.sh)
bash scripts/install-deps.sh
FUZZ_PKGS=(clang-14 libclang-rt-14-dev)
missing=()
for p in "${FUZZ_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[fuzz] installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
CXX_FUZZ=$(command -v clang++-14 || command -v clang++)

# --- build: every object of alloy_base instrumented (fuzzer-no-link), the targets linked with libFuzzer.
# RelWithDebInfo without -DNDEBUG keeps nlohmann's and our own asserts on.
san="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# A cache made with another compiler cannot be switched over: start that configuration afresh.
if [ -f build-fuzz/CMakeCache.txt ] && ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$CXX_FUZZ" build-fuzz/CMakeCache.txt; then
  rm -rf build-fuzz/CMakeCache.txt build-fuzz/CMakeFiles
fi
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX_FUZZ" \
  "-DCMAKE_CXX_FLAGS=$san" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" \
  -DALLOY_FUZZ=ON -DALLOY_BUILD_TESTS=OFF -DALLOY_BUILD_BENCH=OFF >/dev/null
echo "[fuzz] building ${#targets[@]} targets into build-fuzz/ ($(basename "$CXX_FUZZ"), ASan + UBSan)"
ninja -C build-fuzz -j"$(nproc)" "${targets[@]/#/fuzz_}"

# --- run
work=$(mktemp -d "${TMPDIR:-/tmp}/alloy-fuzz-run.XXXXXX")
trap 'rm -rf "$work"' EXIT
# The targets write the files they hand to path-taking readers under TMPDIR: keep that in memory.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

declare -A EXECS RATE CORPUS CRASH
failed=0
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  corpus="fuzz/corpus/$t"
  mkdir -p "$corpus"
  dict=()
  [ -f "fuzz/dict/$t.dict" ] && dict=("-dict=fuzz/dict/$t.dict")
  log="$work/$t.log"
  echo "[fuzz] $t: ${seconds}s from $(find "$corpus" -type f | wc -l) corpus inputs"
  set +e
  # A 512 KiB stack (a 16th of the usual): recursion that deepens with the input then overflows
  # within -max_len instead of needing inputs of megabytes (fuzz.replay.* use 256 KiB without ASan).
  (ulimit -s 512 && exec "build-fuzz/fuzz/fuzz_$t" "$work/$t" "$corpus" "${dict[@]}" \
    -max_total_time="$seconds" -max_len="${MAX_LEN[$t]}" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$corpus/") >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  # A crash ends the run before the final statistics: take the last status line's count.
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  EXECS[$t]=${execs:-0}
  RATE[$t]=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  [ -n "${RATE[$t]}" ] || RATE[$t]=$(grep -oE 'exec/s: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
  CORPUS[$t]=$(($(find "$corpus" -type f | wc -l) + $(find "$work/$t" -type f | wc -l)))
  if [ $rc -ne 0 ]; then
    failed=1
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)
    CRASH[$t]="1 (${artifact:-see log})"
    echo "[fuzz] $t: CRASH (exit $rc); reproducer: ${artifact:-none written}"
    grep -E "ERROR: |runtime error|FUZZ_CHECK|terminate called|what\(\)|SUMMARY" "$log" | head -8 | sed 's/^/    /'
    cp "$log" "build-fuzz/fuzz-$t.log"
    echo "    full log: build-fuzz/fuzz-$t.log; reproduce: build-fuzz/fuzz/fuzz_$t ${artifact:-FILE}"
  else
    CRASH[$t]=0
  fi
  if [ -n "${FUZZ_KEEP_DIR:-}" ]; then mkdir -p "$FUZZ_KEEP_DIR/$t" && cp -r "$work/$t/." "$FUZZ_KEEP_DIR/$t/"; fi
done

echo
echo "[fuzz] ${seconds}s per target, $(basename "$CXX_FUZZ") -fsanitize=fuzzer,address,undefined"
printf '| %-17s | %12s | %8s | %7s | %s |\n' target executions "exec/s" corpus crashes
printf '|%s|%s|%s|%s|%s|\n' "-------------------" "--------------" "----------" "---------" "---------"
for t in "${targets[@]}"; do
  printf '| %-17s | %12s | %8s | %7s | %s |\n' "$t" "${EXECS[$t]}" "${RATE[$t]:--}" "${CORPUS[$t]}" "${CRASH[$t]}"
done
if [ $failed -ne 0 ]; then
  echo "[fuzz] FAILED: crashes found (reproducers are in fuzz/corpus/<target>/)"
  exit 1
fi
echo "[fuzz] no crashes"
