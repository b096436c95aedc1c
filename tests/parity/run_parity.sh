#!/usr/bin/env bash
# Alloy's loss and gradients vs the independent PyTorch reference for one (arch, dtype).
# usage: run_parity.sh PARITY_DUMP ARCH DTYPE WORKDIR
set -euo pipefail
dump=$1 arch=$2 dtype=$3 dir=$4
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$dir"
"$dump" "$arch" "$dtype" "$dir"
# float32: both sides round differently, 1e-5 relative is the promise; float64 shows the math is
# the same to near machine precision.
rtol=1e-5
[ "$dtype" = float64 ] && rtol=1e-10
exec "${ALLOY_PYTHON:-/usr/bin/python3}" "$here/reference.py" "$dir" --rtol "$rtol"
