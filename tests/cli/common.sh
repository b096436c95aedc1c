# What the command-line tests share: counting checks, and running a command that must fail or succeed.
# Sourced by test_cli.sh and test_replan.sh; each ends with `[ $fails -eq 0 ]`.
fails=0
ok() { echo "ok   - $1"; }
bad() { echo "FAIL - $1"; fails=$((fails + 1)); }
# expect_fail NAME SUBSTRING... -- CMD...: CMD must exit non-zero and print every SUBSTRING.
expect_fail() {
  local name=$1; shift
  local subs=()
  while [ "$1" != "--" ]; do subs+=("$1"); shift; done; shift
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ $rc -eq 0 ]; then bad "$name: exited 0"; echo "$out" | tail -5; return; fi
  for s in "${subs[@]}"; do
    if ! grep -qF -- "$s" <<<"$out"; then bad "$name: output lacks '$s'"; echo "$out" | tail -5; return; fi
  done
  ok "$name"
}
# expect_ok NAME CMD...
expect_ok() {
  local name=$1; shift
  if out=$("$@" 2>&1); then ok "$name"; else bad "$name"; echo "$out" | tail -10; fi
}
