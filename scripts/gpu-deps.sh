#!/usr/bin/env bash
# Gathers what a GPU image lacks for building Alloy against its PyTorch's LibTorch (CLI11,
# nlohmann-json, yaml-cpp, Gloo's headers, ICU, GoogleTest, rapidcheck) from this Debian machine's
# packages into one folder, for scripts/gpu-check.sh's ALLOY_DEPS:
#
#   bash scripts/gpu-deps.sh .gpudeps          # here (installs the packages if missing)
#   # there, with .gpudeps carried beside the checkout:
#   ALLOY_DEPS=$PWD/.gpudeps/usr ALLOY_STEPS="device parity bench" bash scripts/gpu-check.sh
#
# Also copies Debian's fortunes corpus, the whole folder (the parity checks read
# /usr/share/games/fortunes/fortunes; precision_bench.py and the README's examples read the folder,
# 5 MB of text: the `fortunes` file alone is 28 KB, which 300 steps of small-gpt2 overfit). Copy
# it there with `cp -a .gpudeps/fortunes/. /usr/share/games/fortunes/`. About 48 MB, most of it
# ICU's data library.
set -euo pipefail
out=${1:-.gpudeps}
pkgs=(libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libyaml-cpp0.7 libgloo-dev libicu-dev libicu72 libgtest-dev libgmock-dev
      librapidcheck-dev fortunes)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then apt-get install -y -q "${missing[@]}" >/dev/null; fi
rm -rf "$out"
mkdir -p "$out"
for p in "${pkgs[@]}"; do
  [ "$p" = fortunes ] && continue
  dpkg -L "$p" | while read -r f; do
    [ -f "$f" ] || [ -L "$f" ] || continue
    case "$f" in */doc/* | */man/* | */lintian/*) continue ;; esac
    # ICU: only the two libraries Alloy links (icuuc and its data), not the others' 10 MB.
    case "$f" in *libicu*) case "$f" in *libicuuc.so* | *libicudata.so*) ;; *) continue ;; esac ;; esac
    cp -a --parents "$f" "$out/" 2>/dev/null || true
  done
done
# Gloo's own library is LibTorch's: the headers alone, no dangling link or CMake package.
rm -f "$out"/usr/lib/x86_64-linux-gnu/libgloo.so "$out"/usr/lib/libgloo.so
rm -rf "$out"/usr/share/cmake/Gloo
# FindICU looks in lib/, not only in lib/x86_64-linux-gnu/.
(cd "$out/usr/lib" && for f in x86_64-linux-gnu/*.so x86_64-linux-gnu/*.a; do [ -e "$f" ] && ln -sf "$f" .; done)
mkdir -p "$out/fortunes"
cp -a /usr/share/games/fortunes/. "$out/fortunes/"
du -sh "$out"
