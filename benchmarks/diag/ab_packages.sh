#!/usr/bin/env bash
# Is a timing gap between two packages real? benchmarks/run.py in one cold process per
# package, the packages alternating for AB_ROUNDS rounds, so a host's drift during the call
# reaches every package alike (GPT-2's decode read 0.611 ms at 2e81c0b and 0.346 at 1c42a4c
# in one call on an H200, 2026-12-01, one process each: one reading per package was all
# there was).
#
#     git archive 1c42a4c | tar x -C /path/old     # a package is a source tree
#     OUT=/tmp/ab AB_PACKAGES="head=. old=/path/old" \
#         AB_ARGS="--only gpt2-decode --backends infinifuse,reduce-overhead" \
#         bash benchmarks/diag/ab_packages.sh
#
# Each process runs its own tree's benchmarks/run.py with that tree first on PYTHONPATH, and
# its log names the fusebackend file it imported. $OUT/ab_packages.txt gets one line per
# process and row: round, package, workload, backend, per call (ms) and its rounds.
set -u
OUT=${OUT:-/tmp/ab_packages}
mkdir -p "$OUT"
rounds=${AB_ROUNDS:-3}
args=${AB_ARGS:---only gpt2-decode --backends infinifuse,reduce-overhead}
summary=$OUT/ab_packages.txt
for round in $(seq 1 "$rounds"); do
    for entry in ${AB_PACKAGES:?set AB_PACKAGES to name=tree pairs}; do
        name=${entry%%=*}
        tree=$(cd "${entry#*=}" && pwd)
        dir=$OUT/$name-$round
        mkdir -p "$dir"
        (cd "$tree" && PYTHONPATH=$tree python3 -c \
            "import fusebackend; print('package', fusebackend.__file__)" &&
            PYTHONPATH=$tree python3 benchmarks/run.py $args --out-dir "$dir") \
            >"$dir/log.txt" 2>&1
        echo "round $round $name: rc=$? ($(head -n 1 "$dir/log.txt"))"
        python3 - "$dir/suite.json" "$round" "$name" >>"$summary" <<'EOF'
import json, sys
path, round_, name = sys.argv[1:]
try:
    rows = json.load(open(path))["rows"]
except (OSError, ValueError, KeyError) as error:
    print(round_, name, "no suite.json:", error)
    rows = []
for row in rows:
    spread = " ".join(f"{ms:.3f}" for ms in row.get("per_call_ms_rounds") or [])
    per_call = row.get("per_call_ms")
    shown = f"{per_call:.4f}" if isinstance(per_call, float) else per_call
    print(round_, name, row["workload"], row["backend"], shown, f"({spread})",
          "kernels", row.get("kernels_per_call"))
EOF
    done
done
cat "$summary"
