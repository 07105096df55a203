#!/usr/bin/env bash
# The baseline for benchmarks/bench_ab_small_m.py: REV's small-M kernels copied into DIR (an ignored folder
# such as .devcarry/base, carried to the GPU machine beside the working tree).
#   bash benchmarks/ab_base.sh REV DIR
set -euo pipefail
rev="$1"; dir="$2"
mkdir -p "$dir"
for f in small_m small_m_fast; do git show "$rev:svdq_linear/backends/sm90/$f.py" > "$dir/$f.py"; done
echo "$(git rev-parse --short "$rev") ($(git log -1 --format=%s "$rev" | cut -c1-60))" > "$dir/REV"
echo "baseline $(cat "$dir/REV") in $dir"
