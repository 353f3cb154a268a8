#!/usr/bin/env bash
# Everything a change to kernels or the runtime must pass on a GPU, in one device call:
# install, the GPU-marked tests, the examples on the GPU, and the chain-kernel benchmark.
#
#     OUT=/tmp/gpu_out bash benchmarks/gpu_check.sh [tests|examples|bench|generate]...
#
# (default: tests examples bench; generate, transformers' generate() through three backends
# with cold caches, takes ~5 minutes and is asked for by name.)
#
# Logs and results land in $OUT (one file per step); the exit status is non-zero when a
# step failed, and every step runs regardless, so one failure does not hide another.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
steps=${*:-tests examples bench}
status=0

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 || status=1
export PYTHONPATH=$PWD
python3 - <<'EOF' | tee "$OUT/versions.txt"
import torch, triton
print(torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__)
EOF

run_step() {  # name, command...: log to $OUT/name.txt, print its tail and the outcome
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.txt"
    echo "== $name: rc=$rc in $((SECONDS - start)) s"
    [ $rc -eq 0 ] || status=1
}

for step in $steps; do
    case $step in
    tests)
        run_step gpu_tests python3 -m pytest -q -m gpu -rfEs tests
        ;;
    examples)
        run_step example_quickstart python3 examples/quickstart.py
        run_step example_llama python3 examples/llama_generate.py --layers 4
        run_step example_bert python3 examples/bert_embeddings.py
        ;;
    bench)
        run_step bench_chain python3 benchmarks/embedding_chain.py --out "$OUT/embedding_chain.json"
        ;;
    generate)
        run_step bench_generate python3 benchmarks/generate.py --out "$OUT/generate.json"
        ;;
    *)
        echo "unknown step: $step (tests, examples, bench, generate)"
        status=1
        ;;
    esac
done
exit $status
