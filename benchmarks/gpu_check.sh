#!/usr/bin/env bash
# Everything a change to kernels or the runtime must pass on a GPU, in one device call:
# install, the GPU-marked tests, the examples on the GPU, and the chain-kernel benchmark.
#
#     OUT=/tmp/gpu_out bash benchmarks/gpu_check.sh [tests|examples|bench|generate|fastgen|decode|rows|matmul|splitk|rotary|zoo|census|suite|tp|sentence|vision|groupnorm|firstcall|swin|growing|call|turns|vturns|afterreplay|ab|diag]...
#
# Knobs (environment): COMMIT (the commit measured, for run.py's --commit: the device's
# copy of the checkout has no git), GPU_TESTS (test paths for "tests", default tests), FASTGEN_ARGS (the
# arguments of fast_generate.py for "fastgen", see there), DECODE_ONLY and
# DECODE_BACKENDS (run.py's --only and --backends for "decode"), ROWS_ARGS (more arguments
# of row_kernels.py for "rows", e.g. --sweep), MATMUL_ARGS (more arguments of
# matmul_kernels.py for "matmul", e.g. --sweep), SPLITK_ARGS (more arguments of
# diag_matmul_splitk.py for "splitk", e.g. --sweep-seconds 120 or --shapes tinyllama-o),
# SUITE_ONLY and SUITE_FROM (a part of the
# suite, merged into an earlier part's suite.json: see "suite" below), BUNDLE (a .tgz path:
# $OUT is packed into it after every step, so a call cut off by its time limit still
# returns what the finished steps wrote, in one file; the device tool returns at most 8
# files, so a call with many steps sets OUT to a scratch folder and BUNDLE under the real
# $OUT).
#
# (default: tests examples bench. Asked for by name: generate (transformers' generate()
# through three backends, cold caches, ~4 min), fastgen (issue 36's device decode loop
# against generate(): benchmarks/fast_generate.py with FASTGEN_ARGS), decode (the four
# decode/encoder models of the suite), rows (each row-kernel pattern vs Inductor and copy bandwidth, ~1 min; ROWS_ARGS=--sweep
# adds the launch-config sweep), matmul (matmul groups: GPU tests, each kernel vs cuBLAS,
# the PDL diag, ~2 min), splitk (a diag: split-K few-row matmul kernels against split-K = 1
# and cuBLAS, its launch sweep capped at 240 s; not yet run, ~5-6 min expected), rotary (a
# diag: the q/k/v group with its rotary + KV-cache-write epilogue against the three launches
# it replaces and eager, with its launch sweep capped at 150 s; not yet run), zoo
# (21 architectures: kernels per call, captured or not,
# error vs eager), census (kernels per call by kind without graphs, diag_kernel_census.py:
# infinifuse on the vision models at batch 1 and 8, then the zoo's 21 families under
# infinifuse and Inductor, 14 of which took 88 s on an H200, 2026-11-30), suite (the
# whole benchmarks/run.py suite), tp (tensor parallelism on every
# GPU of the machine: its GPU tests, diag_tp_chain.py and benchmarks/tensor_parallel.py, the
# device loop's generate among its rows), vision (timm models, benchmarks/vision.py:
# VISION_ARGS passed on, VISION_NAME the result's name, default vision; stops starting models
# after 300 s), firstcall (convnets' first calls by phase with Triton's cache cold, and
# MobileNetV3's host time a call, and its cold first call with the launchers built at -O0 and
# at -O3, ~4 min), swin (one Swin block per stage against Inductor's, profiled, and the kernel
# variants of its short-row softmax, ~2 min), call (diag_suite_call.py on CALL_WORKLOAD,
# default gpt2-token, CALL_BACKENDS its builds: host time, the replay's span, a host profile; ~1 min), turns (the zoo
# and GPT-2's one-token forward, both backends in one process in alternating rounds), vturns
# (vision models the same way, batch 1 and 8), afterreplay (a launch's host time right after
# a graph replay against the launch alone, ~1 min), ab (packages in alternating cold
# processes: benchmarks/diag/ab_packages.sh), growing (a
# DynamicCache decode per capture policy, ~1.5 min), diag (why BERT's SDPA runs its
# math path under Dynamo; which SDPA kernel a decode step's attention should get; the decode
# attention kernel against repeat_kv + SDPA and its launch sweep; the host time of a replay
# and of a generate() step, ~5 min). One device call runs at most 10
# minutes: split the steps over calls. On an H100 (2026-11-23), under pytest-xdist: all 234
# GPU tests took 5 min, the chain 30 s, rows 70 s, decode ~75 s per model with four backends;
# so "tests bench rows", then "decode generate".)
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
    if [ -n "${BUNDLE:-}" ]; then
        # tar exits 1 when a file changed while it read it (seen on an H200, 2026-12-01: the
        # folder itself, once per step, and no bundle came back): the archive is written
        # all the same, so only a fatal error (2) keeps the last bundle
        tar czf "$BUNDLE.tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")"
        [ $? -le 1 ] && mv "$BUNDLE.tmp" "$BUNDLE"
    fi
}

# pytest-xdist, where installed, compiles the kernels of 6 tests at once
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6 -p no:benchmark")
for step in $steps; do
    case $step in
    tests)
        # (with pytest-xdist the GPU tests took 52 s on an H100 and ran past 10 minutes
        # without it, 2026-11-23)
        run_step gpu_tests python3 -m pytest -q -m gpu -rfEs $parallel ${GPU_TESTS:-tests}
        ;;
    examples)
        run_step example_quickstart python3 examples/quickstart.py
        run_step example_llama python3 examples/llama_generate.py --layers 4
        run_step example_bert python3 examples/bert_embeddings.py
        run_step example_hf_generate python3 examples/hf_generate.py --layers 4 --compare
        run_step doctor python3 -m fusebackend doctor
        ;;
    bench)
        run_step bench_chain python3 benchmarks/embedding_chain.py --out "$OUT/embedding_chain.json"
        ;;
    generate)
        run_step bench_generate python3 benchmarks/generate.py --out "$OUT/generate.json"
        ;;
    fastgen)
        # the device decode loop (fusebackend.generate) against generate()'s loop through
        # three backends and its decode step alone: FASTGEN_ARGS picks the runs (default the
        # TinyLlama shape, batch 1, 128 slots, greedy, k=8), e.g. "--configs tinyllama:1:128
        # tinyllama:1:128:sampled qwen2-0.5b:1:128 --ks 8". The JSON is rewritten after each
        # run (a call cut off keeps the finished ones); its ledger rows afterwards, on any
        # machine: fast_generate.py --ledger-from JSON --ledger benchmarks/results/ledger.jsonl
        fastgen_args=${FASTGEN_ARGS:-"--configs tinyllama:1:128 --ks 8"}
        run_step bench_fastgen python3 benchmarks/fast_generate.py \
            --out "$OUT/fast_generate.json" $fastgen_args
        ;;
    rows)
        run_step bench_rows python3 benchmarks/row_kernels.py --out "$OUT/row_kernels.json" \
            ${ROWS_ARGS:-}
        ;;
    decode)
        # the suite's four models (~2 min each on an H100, all six backends, cold compiles)
        run_step bench_decode python3 benchmarks/run.py --out-dir "$OUT/suite" \
            --only "${DECODE_ONLY:-llama-decode,qwen2-decode,gpt2-decode,bert}" \
            ${DECODE_BACKENDS:+--backends "$DECODE_BACKENDS"} ${COMMIT:+--commit "$COMMIT"}
        ;;
    matmul)
        # matmul groups: their GPU tests, each kernel against cuBLAS + the ops it replaces
        # and copy bandwidth (MATMUL_ARGS=--sweep adds the launch sweep, ~3 min on an H100),
        # and whether programmatic dependent launch pays for a chain of them
        run_step gpu_tests_matmul python3 -m pytest -q -m gpu -rfEs $parallel \
            tests/test_matmul_groups.py tests/test_matmul_kernel.py
        run_step bench_matmul python3 benchmarks/matmul_kernels.py \
            --out "$OUT/matmul_kernels.json" ${MATMUL_ARGS:-}
        run_step diag_matmul_pdl python3 benchmarks/diag/diag_matmul_pdl.py --out "$OUT/matmul_pdl.json"
        ;;
    splitk)
        # split-K for the few-row matmul (a diag with its own kernels): does giving each
        # column tile several K-slice programs lift the narrow projections to copy bandwidth?
        run_step diag_matmul_splitk python3 benchmarks/diag/diag_matmul_splitk.py \
            --out "$OUT/matmul_splitk.json" ${SPLITK_ARGS:-}
        ;;
    rotary)
        # the q/k/v group's rotary + KV-cache-write epilogue (one launch) against the q/k/v
        # launch + the rotation + write_cache_pair it replaces, and its launch-config sweep
        run_step diag_rotary_epilogue python3 benchmarks/diag/diag_rotary_epilogue.py --sweep \
            --out "$OUT/rotary_epilogue.json"
        ;;
    zoo)
        run_step bench_zoo python3 benchmarks/run.py --out-dir "$OUT/suite" --only zoo \
            ${COMMIT:+--commit "$COMMIT"}
        ;;
    suite)
        # The whole suite runs past one device call (10 min): split it with SUITE_ONLY
        # (run.py's --only) and hand each part the suite.json of the parts before it with
        # SUITE_FROM (a folder of the checkout), which this part merges into (--merge); or
        # run the parts independently and join their suite.json files afterwards, on any
        # machine: python benchmarks/run.py --out-dir DIR --combine part1.json part2.json ...
        # (the full H100 suite of 2026-11-25 took ~21 min in seven parts: chain 1 min;
        # llama, qwen2, bert 8 min; gpt2 3.5 min; generate 4 min; the zoo 9.5 min).
        merge=""
        if [ -n "${SUITE_FROM:-}" ]; then
            mkdir -p "$OUT/suite" && cp "$SUITE_FROM"/suite.json "$OUT/suite/" && merge=--merge
        fi
        run_step bench_suite python3 benchmarks/run.py --out-dir "$OUT/suite" $merge \
            ${SUITE_ONLY:+--only "$SUITE_ONLY"} ${COMMIT:+--commit "$COMMIT"}
        ;;
    tp)
        # Tensor parallelism on every GPU of the machine (2 or more): the GPU tests of
        # tests/test_tensor_parallel.py, then benchmarks/tensor_parallel.py at TP=N and TP=1
        # for each shape in TP_SHAPES (default tinyllama; llama3-8b saves 16 GB of random
        # weights first): eager, infinifuse, reduce-overhead and (generate only) the device
        # loop, infinifuse-loop (fusebackend.generate, k=8), TP_ARGS passed on (e.g. --parts
        # decode, --guard-filter, --decode-steps 16, --backends). TP_SIZES: the process
        # counts (default: every GPU, then 1); TP_BENCH_ONLY=1 skips the tests and the chain
        # diag (a benchmark split over several device calls).
        gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
        if [ -z "${TP_BENCH_ONLY:-}" ]; then
            run_step tp_tests python3 -m pytest -q -m gpu -rfEs tests/test_tensor_parallel.py
            # what an all-reduce costs in a dependent matmul chain, NCCL against symmetric
            # memory's one-shot all-reduce (~1.5 min on 2 GPUs)
            run_step diag_tp_chain torchrun --nproc_per_node "$gpus" \
                benchmarks/diag/diag_tp_chain.py --out "$OUT/tp_chain.json"
            # where the first generate's seconds go at TP=N and unsharded (Dynamo, the
            # backend's passes and Triton's compiles, captures, new signatures' runs)
            run_step diag_tp_first_call torchrun --nproc_per_node "$gpus" \
                benchmarks/diag/diag_tp_first_call.py
            run_step diag_tp_first_call_tp1 torchrun --nproc_per_node 1 \
                benchmarks/diag/diag_tp_first_call.py
        fi
        for shape in ${TP_SHAPES:-tinyllama}; do
            for n in ${TP_SIZES:-$gpus 1}; do
                run_step "bench_tp_${shape}_tp$n" torchrun --nproc_per_node "$n" \
                    benchmarks/tensor_parallel.py --shape "$shape" ${TP_ARGS:-} \
                    --out "$OUT/tensor_parallel_${shape}_tp$n.json"
            done
        done
        ;;
    sentence)
        # sentence-transformers (issue 25): each SENTENCE_SHAPES shape (default minilm-l6) with
        # SENTENCE_BACKENDS (default eager, infinifuse, its capture_on_call=1 variant,
        # reduce-overhead; ~4.5 min for MiniLM, ~6 for BERT-base; SENTENCE_ARGS passed on,
        # e.g. --rounds 2), then the passes diag of capture on the 1st call against the 2nd
        # (~1.5 min a shape)
        for shape in ${SENTENCE_SHAPES:-minilm-l6}; do
            run_step "sentence_$shape" python3 benchmarks/sentence_embeddings.py --shapes "$shape" \
                --backends "${SENTENCE_BACKENDS:-eager,infinifuse,infinifuse-call1,reduce-overhead}" \
                --child-timeout 200 ${SENTENCE_ARGS:-} --out "$OUT/sentence_embeddings_$shape.json"
            run_step "passes_$shape" python3 benchmarks/diag/diag_sentence_passes.py \
                --shape "$shape" --variants default,call2 --profile none \
                --out "$OUT/diag_sentence_passes_$shape.json"
        done
        ;;
    groupnorm)
        # The GroupNorm kernel (2026-12-01): its GPU tests beside the depthwise, spatial-mean
        # and channels-last ones; the kernel against aten's at BiT's and a UNet's shapes, then
        # its grouped rule's sweep against Inductor's kernels at BiT's channels-last norms
        # (diag_group_norm.py, --sweep); ResNet-V2-50x1-BiT against reduce-overhead, its
        # batch-8 call's host time and kernels under both backends, and its fused graph's
        # nodes by device time (diag_node_times.py --device-time) (~6 min)
        run_step gpu_tests_groupnorm python3 -m pytest -q -m gpu -rfEs $parallel \
            tests/test_group_norm_gpu.py tests/test_depthwise_gpu.py \
            tests/test_spatial_means_gpu.py tests/test_channels_last_gpu.py
        run_step diag_group_norm python3 benchmarks/diag/diag_group_norm.py \
            --out "$OUT/diag_group_norm.json"
        run_step diag_group_norm_sweep python3 benchmarks/diag/diag_group_norm.py --sweep \
            --out "$OUT/diag_group_norm_sweep.json"
        run_step bench_vision_bit python3 benchmarks/vision.py --models resnetv2_50x1_bit \
            --backends reduce-overhead,infinifuse --no-kernel-counts --calls 30 --warmup 5 \
            --child-timeout 120 ${COMMIT:+--commit "$COMMIT"} --out "$OUT/vision_bit.json" \
            --ledger "$OUT/vision_bit_ledger.jsonl"
        run_step vision_host_bit_b8 python3 benchmarks/diag/diag_vision_host.py \
            --models resnetv2_50x1_bit --batch 8 --kernels 20 --out "$OUT/vision_host_bit_b8.json"
        run_step node_times_bit_b8 python3 benchmarks/diag/diag_node_times.py \
            --model resnetv2_50x1_bit --batch 8 --device-time --top 20 \
            --out "$OUT/node_times_bit_b8.json"
        ;;
    vision)
        # timm vision models, each (model, backend) in a cold process (issue 38). The defaults
        # below keep the step inside one device call (no process starts after 300 s, none runs
        # past 240 s); VISION_ARGS, after them, can override them. JSON in --variant must hold
        # no spaces: VISION_ARGS is split at spaces. Ledger rows (source: $VISION_NAME.json)
        # land in $OUT for appending to benchmarks/results/ledger.jsonl.
        name=${VISION_NAME:-vision}
        run_step "bench_$name" python3 benchmarks/vision.py --time-budget 300 --child-timeout 240 \
            ${VISION_ARGS:-} --out "$OUT/$name.json" --ledger "$OUT/${name}_ledger.jsonl"
        ;;
    firstcall)
        # Where a convnet's first call goes, phase by phase, each model with Triton's cache
        # cold (FIRSTCALL_MODELS, default three depthwise convnets; ~40 s each), then
        # MobileNetV3-large's host and GPU time a call at batch 8 under both backends in one
        # process (diag_vision_host.py), the replay that read 0.772 ms against 0.518 at
        # 9663a0f (docs/PERFORMANCE.md, c4f116f).
        for model in ${FIRSTCALL_MODELS:-efficientnet_b0 ghostnet_100 mobilenetv3_large_100}; do
            run_step "first_call_$model" env TRITON_CACHE_DIR="$(mktemp -d)" \
                python3 benchmarks/diag/diag_first_call_phases.py --timm "$model" --rounds 1
        done
        run_step vision_host_mobilenetv3_b8 python3 benchmarks/diag/diag_vision_host.py \
            --models mobilenetv3_large_100 --batch 8 --out "$OUT/vision_host_mobilenetv3_b8.json"
        # a cold process's first call (the vision suite's), its compile processes split into
        # compiles and launcher builds: the launchers at -O0 (the default) and at Triton's -O3
        for variant in "" --optimised-launchers; do
            run_step "first_call_cold_mobilenetv3${variant:+_o3}" env TRITON_CACHE_DIR="$(mktemp -d)" \
                python3 benchmarks/diag/diag_first_call_phases.py --timm mobilenetv3_large_100 \
                --rounds 1 --cold --children $variant
        done
        ;;
    census)
        run_step census_vision python3 benchmarks/diag/diag_kernel_census.py \
            ${COMMIT:+--commit "$COMMIT"} --out "$OUT/kernel_census.json"
        run_step census_zoo python3 benchmarks/diag/diag_kernel_census.py --inductor --zoo all \
            ${COMMIT:+--commit "$COMMIT"} --out "$OUT/kernel_census_zoo.json"
        ;;
    swin)
        # Swin's blocks against Inductor's (one block per stage, profiled) and its short-row
        # softmax's kernel variants (the NaN-counting reduction of its max), ~2 min
        commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
        run_step diag_swin_rows python3 benchmarks/diag/diag_swin_rows.py --commit "$commit" \
            --out "$OUT/diag_swin_rows_h200_$commit.json"
        run_step diag_swin_softmax python3 benchmarks/diag/diag_row_variants.py \
            --cases softmax:75264x49,window_softmax:75264x49 \
            --out "$OUT/diag_row_variants_swin_$commit.json"
        ;;
    growing)
        # a Llama decode over a DynamicCache (4 layers at TinyLlama's widths, 48 steps) under
        # each capture policy, each in its own process (recurrence.py's growth rule), ~1.5 min
        run_step diag_growing_decode python3 benchmarks/diag/diag_growing_decode.py \
            --out "$OUT/diag_growing_decode.json"
        ;;
    call)
        # where a suite workload's call goes under infinifuse and reduce-overhead, two builds
        # of infinifuse in one process (host, alone, loop, the replay's span, a cProfile of
        # the host side): CALL_WORKLOAD, default gpt2-token, ~1 min
        run_step diag_suite_call python3 benchmarks/diag/diag_suite_call.py \
            --workload "${CALL_WORKLOAD:-gpt2-token}" \
            --backends "${CALL_BACKENDS:-infinifuse,reduce-overhead,infinifuse}" \
            --profile 30 ${COMMIT:+--commit "$COMMIT"} --out "$OUT/suite_call.json"
        ;;
    vturns)
        # vision models at batch 1 and 8 under infinifuse and reduce-overhead, both builds in
        # one process, timed in alternating rounds (diag_vision_host.py --interleave):
        # VTURNS_MODELS, default the rows read over 1.0x at dabefa5 and two near it
        for batch in 1 8; do
            run_step "vision_turns_b$batch" python3 benchmarks/diag/diag_vision_host.py \
                --models "${VTURNS_MODELS:-inception_v3,efficientnet_b0,repvgg_a2,vit_small_patch16_224,swin_tiny_patch4_window7_224}" \
                --batch "$batch" --calls 100 --interleave 7 --loop 100 \
                ${COMMIT:+--commit "$COMMIT"} --out "$OUT/vision_turns_b$batch.json"
        done
        ;;
    turns)
        # the model zoo's 21 families and GPT-2's one-token forward under infinifuse and
        # reduce-overhead, both builds alive in one process, timed in alternating rounds
        # (diag_suite_call.py --interleave): TURNS_WORKLOADS, default zoo,gpt2-token (a
        # decode workload, e.g. gpt2-decode, has its cache reset before each round)
        run_step diag_suite_turns python3 benchmarks/diag/diag_suite_call.py \
            --workload "${TURNS_WORKLOADS:-zoo,gpt2-token}" --interleave 7 --loop 100 --reps 50 \
            ${COMMIT:+--commit "$COMMIT"} --out "$OUT/suite_turns.json"
        ;;
    afterreplay)
        # the host time of a launch right after a graph replay against the same launch alone
        # (diag_launch_after_replay.py: is the outputs' copy after the replay what costs
        # infinifuse its host time there?), ~1 min
        run_step diag_launch_after_replay python3 benchmarks/diag/diag_launch_after_replay.py \
            --zoo bert roberta llama mistral ${COMMIT:+--commit "$COMMIT"} \
            --out "$OUT/launch_after_replay.json"
        ;;
    ab)
        # two or more packages (source trees: AB_PACKAGES="head=. old=path"), one cold
        # benchmarks/run.py process each, alternating for AB_ROUNDS rounds (default 3):
        # AB_ARGS, default GPT-2's decode under infinifuse and reduce-overhead
        run_step ab_packages env OUT="$OUT/ab" bash benchmarks/diag/ab_packages.sh
        ;;
    diag)
        run_step diag_bert_sdpa python3 benchmarks/diag/diag_bert_sdpa.py
        run_step diag_decode_sdpa python3 benchmarks/diag/diag_decode_sdpa.py
        run_step diag_decode_attention python3 benchmarks/diag/diag_decode_attention.py \
            --out "$OUT/decode_attention.json"
        run_step diag_replay_host python3 benchmarks/diag/diag_replay_host.py
        run_step diag_generate_host python3 benchmarks/diag/diag_generate_host.py
        ;;
    *)
        echo "unknown step: $step (tests, examples, bench, generate, fastgen, rows, decode, matmul, splitk, rotary, zoo, census, suite, tp, sentence, vision, groupnorm, firstcall, swin, growing, call, turns, vturns, afterreplay, ab, diag)"
        status=1
        ;;
    esac
done
exit $status
