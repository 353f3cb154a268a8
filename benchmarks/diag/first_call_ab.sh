#!/usr/bin/env bash
# Does loading the kernels in the precompile cut the first call's one-time costs? An A/B
# (diag_first_call_phases.py with and without --without-loading), each variant in its own
# process with an empty Triton cache (round 0 cold, round 1 warm), alternated twice:
#     OUT=/tmp/out bash benchmarks/diag/first_call_ab.sh [model]
set -u
OUT=${OUT:-/tmp/first_call_ab}
mkdir -p "$OUT"
model=${1:-llama-decode}
for turn in 1 2; do
    for variant in "--without-loading" ""; do
        cache=$(mktemp -d)
        TRITON_CACHE_DIR=$cache python3 benchmarks/diag/diag_first_call_phases.py \
            --model "$model" --rounds 2 $variant 2>&1 | grep -v "Warning\|forward_call" \
            | tee -a "$OUT/first_call_ab.txt"
        rm -rf "$cache"
    done
done
