"""One table of benchmark figures: ``benchmarks/results/ledger.jsonl``, a JSON object a line.

Each row is one figure: workload, backend, metric, value, unit, device, torch, triton,
transformers, commit, date, and source (the result JSON it came from). The benchmarks
(``run.py``, ``tensor_parallel.py``, ``sentence_embeddings.py``) append their rows when given
``--ledger PATH``; ``--rebuild`` builds the file from the result JSONs in ``SOURCES``, sorted,
so a rebuild of the same files writes the same bytes. A source no longer under
``benchmarks/results/`` is folded: the ledger is its only copy, and a rebuild keeps its rows
as they are (``git show FOLDED_AT:benchmarks/results/NAME`` prints the file it came from).
``RETIRED`` lists result files the docs still cite that are in neither form (logs, diag
outputs of their own format): removed from ``benchmarks/results/``, in git at
``FOLDED_AT``. ``benchmarks/readme_tables.py`` writes the performance tables of the README
and ``docs/PERFORMANCE.md`` from these rows and checks each figure of their text against its
row.

    python benchmarks/ledger.py --rebuild
    python benchmarks/ledger.py --table llama-decode gpt2-decode
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LEDGER = RESULTS / "ledger.jsonl"
FIELDS = ("workload", "backend", "metric", "value", "unit", "device", "torch", "triton",
          "transformers", "commit", "date", "source")  # fmt: skip
ENV_FIELDS = ("device", "torch", "triton", "transformers", "commit", "date")
# The result files whose rows make the ledger: in benchmarks/results/, or folded (the file
# removed, its rows kept by --rebuild).
SOURCES = (
    "suite.json",
    "decode_recheck_h100.json",
    "generate_h100_full_suite.json",
    "embedding_chain_h100_full_suite.json",
    "row_kernels_h100_full_suite.json",
    "row_kernels_h100_columns_first.json",
    "sentence_embeddings_h100.json",
    "tensor_parallel_tinyllama_tp1_h100.json",
    "tensor_parallel_tinyllama_tp2_h100.json",
    "tensor_parallel_llama3-8b_tp1_h100.json",
    "tensor_parallel_llama3-8b_tp2_h100.json",
    "matmul_groups_decode_h100.json",
    "matmul_groups_gpt2_h100.json",
    "suite_decode_h100_epilogues.json",
    "suite_decode_h100_epilogues_floor.json",
    "sentence_embeddings_h100_minilm_routes.json",
    "sentence_embeddings_h100_bert_routes.json",
    "sentence_embeddings_h100_minilm_dynamo.json",
    "sentence_embeddings_h100_minilm_dynamo_no_cudnn_sdp.json",
    "suite_decode_h100_pdl.json",
    "suite_decode_h100_gpt2_pdl_old.json",
    "suite_decode_h100_gpt2_pdl_new.json",
    "suite_decode_h100_pdl_attention.json",
    "suite_decode_h100_rotary_split.json",
    "generate_h100_pdl.json",
    "suite_decode_h100_gemv.json",
    "suite_decode_h100_gemv_run2.json",
    "generate_h100_gemv.json",
    "tensor_parallel_tinyllama_tp1_h100x2_guard_filter_0eb9757.json",
    "tensor_parallel_tinyllama_tp2_h100x2_guard_filter_0eb9757.json",
    "tensor_parallel_llama3-8b_tp1_h100x2_guard_filter_0eb9757.json",
    "tensor_parallel_llama3-8b_tp2_h100x2_guard_filter_0eb9757.json",
    "tensor_parallel_tinyllama_tp1_h100x2_launch_overlap_9bdc3da.json",
    "tensor_parallel_tinyllama_tp2_h100x2_launch_overlap_9bdc3da.json",
    "tensor_parallel_llama3-8b_tp1_h100x2_launch_overlap_9bdc3da.json",
    "tensor_parallel_llama3-8b_tp2_h100x2_launch_overlap_9bdc3da.json",
    "tensor_parallel_llama3-8b_tp1_h100x2_gemv_8bcdfe7.json",
    "tensor_parallel_llama3-8b_tp2_h100x2_gemv_8bcdfe7.json",
    "sentence_embeddings_h100_bert_dynamo.json",
    "sentence_embeddings_h100_minilm_cudnn_plans.json",
    "sentence_embeddings_h100_minilm_no_cudnn_plans.json",
    "sentence_embeddings_h100_bert_no_cudnn_plans.json",
    "sentence_embeddings_h100_minilm_length_buckets.json",
    "sentence_embeddings_minilm_h100_call1.json",
    "sentence_embeddings_minilm_h100_dynamic.json",
    "sentence_embeddings_bert_h100_dynamic.json",
    "tensor_parallel_tinyllama_tp2_h100x2_decode_2fb76a0.json",
    "suite_decode_h100_gemv_no_lm_head.json",
    "suite_decode_h100_kernel_loading.json",
    "suite_decode_h100_pdl_experiments.json",
    # folded from the earlier runs docs/PERFORMANCE_HISTORY.md describes (and runs no doc cites)
    "embedding_chain_h100.json",
    "embedding_chain_h100_kernel_loading.json",
    "embedding_chain_h100_launch_plans.json",
    "embedding_chain_h100_no_packing.json",
    "embedding_chain_h100_trial_costs.json",
    "embedding_chain_h200.json",
    "generate_h100.json",
    "generate_h100_columns_first.json",
    "generate_h100_decode_attention.json",
    "generate_h100_decode_attention_run2.json",
    "generate_h100_kernel_loading.json",
    "generate_h100_kernel_loading_run2.json",
    "generate_h100_launch_plans.json",
    "generate_h100_loading_key_thread.json",
    "generate_h100_no_packing.json",
    "generate_h100_no_packing_128_first_run.json",
    "generate_h100_no_packing_run3.json",
    "matmul_kernels_h100_before_pdl.json",
    "matmul_kernels_h100_pdl.json",
    "row_kernels_h100.json",
    "row_kernels_h100_lookup_blocks.json",
    "row_kernels_h100_prefill_configs.json",
    "row_kernels_h100_rotation_loads.json",
    "sentence_embeddings_h100_c7ca9d9.json",
    "suite_decode_h100_decode_attention.json",
    "suite_decode_h100_gpt2_launch_plans.json",
    "suite_decode_h100_kernel_loading_gpt2_bert.json",
    "suite_decode_h100_launch_plans.json",
    "suite_decode_h100_no_packing.json",
    "suite_first_call_h100_decode_attention.json",
    "tensor_parallel_llama3-8b_tp1_h100x2_summed_rows_0d18dff.json",
    "tensor_parallel_llama3-8b_tp2_h100x2_summed_rows_0d18dff.json",
    # each matmul kernel against cuBLAS + the eager ops it replaces (matmul_kernels.py)
    "matmul_kernels_h100.json",
    "matmul_kernels_h100_gemv.json",
    # one-row launches: tensor cores against GEMV tiles (diag_matmul_gemv.py)
    "matmul_gemv_h100.json",
    # the q/k/v launch with its rotation and cache write (diag_rotary_epilogue.py)
    "rotary_epilogue_h100.json",
    "rotary_splitk_h100.json",
    "rotary_gemv_h100.json",
    # a tensor-parallel step per rank, replayed and run direct (diag_tp_step.py)
    "diag_tp_step_tinyllama_tp1_h100_before_in_place.json",
    "diag_tp_step_tinyllama_tp2_h100_before_in_place.json",
    "diag_tp_step_tinyllama_tp2_h100_in_place.json",
    "diag_tp_step_tinyllama_tp2_h100_host.json",
    "diag_tp_step_tinyllama_tp2_h100_guard_filter.json",
    "diag_tp_step_tinyllama_tp2_h100_guard_filter_b9295ce.json",
    "diag_tp_step_llama3-8b_tp1_h100_before_in_place.json",
    "diag_tp_step_llama3-8b_tp2_h100_before_in_place.json",
    "diag_tp_step_llama3-8b_tp2_h100_in_place.json",
    "diag_tp_step_llama3-8b_tp2_h100_host.json",
    "diag_tp_step_llama3-8b_tp2_h100_guard_filter.json",
    "diag_tp_step_llama3-8b_tp2_h100_guard_filter_0eb9757.json",
    "diag_tp_step_llama3-8b_tp2_h100_summed_rows_0d18dff.json",
    # issue 37 on an H200 at e37d61a (2026-11-28): a cold process and a restarted one on the
    # same cache directories; a repeated single query's parts; one call's host time, static
    # against dynamic=True (diag formats, their rows written by hand from the diag JSONs)
    "sentence_embeddings_restart_h200_e37d61a.json",
    "diag_query_host_h200_e37d61a.json",
    "diag_dynamic_host_h200_e37d61a.json",
    # issue 36 on an H200 at 32c90b8 (2026-11-28): TinyLlama shape, batch 1, 128 slots, bf16
    # (benchmarks/fast_generate.py's rows, written by hand from its JSON)
    "fast_generate_h200_32c90b8.json",
    # the same at 127aca0, the prefill through the backend (no eager row in this run)
    "fast_generate_h200_127aca0.json",
    # GPT-2's decode step after the (K, N) GEMV's fix, 9147d04 (benchmarks/run.py's rows)
    "suite_gpt2_decode_h200_9147d04.json",
    # issue 36's matrix at c3dac07 (2026-11-28, H200): TinyLlama b1/b4, 128/4096 slots, greedy
    # and sampled, Qwen2-0.5B and Llama-3.2-1B shapes (fast_generate.py --ledger-from), and the
    # device loop at TP=2 and 1 on two H200s (tensor_parallel.py --guard-filter)
    "fast_generate_h200_c3dac07.json",
    "tensor_parallel_tinyllama_tp2_h200_c3dac07.json",
    "tensor_parallel_tinyllama_tp1_h200_c3dac07.json",
    # issue 38's vision suite at c3dac07 (benchmarks/vision.py, four timm models, fp16)
    "vision_h200_c3dac07.json",
    # the same at ffe1664: BatchNorms as fp32 scale + shift after the conv in half precision,
    # in-place activations fused (resnet50, efficientnet_b0, mobilenetv3_large_100)
    "vision_h200_ffe1664.json",
    # channels-last per graph at bead187 (resnet50, convnext_tiny, efficientnet_b0: default
    # against channels_last=False, reduce-overhead beside them) and 7a07b46 (mobilenetv3, and
    # vit_small's reduce-overhead rows; its infinifuse process was not started in the budget)
    "vision_h200_bead187.json",
    "vision_h200_7a07b46.json",
    # a LayerNorm alone at ConvNeXt's and ViT's widths against aten's and Inductor's, and the
    # vision rows after it (convnext_tiny, vit_small_patch16_224) at 0cb9249
    "row_kernels_layernorm_h200_0cb9249.json",
    "vision_h200_0cb9249.json",
    # issue 37's restart with FUSEBACKEND_DYNAMIC_SHAPES=1 at ffe1664 (MiniLM-L6, --quick)
    "sentence_embeddings_restart_h200_ffe1664.json",
    # BERT-base and DeBERTa-v3-base encoders at c3dfa5a (--quick, 600 sentences, 40 queries)
    "sentence_embeddings_encoders_h200_c3dfa5a.json",
    # the whole vision suite against reduce-overhead at 11c362e (levit_128s failed in eager fp16
    # in the benchmark itself; densenet121 not started in the budget), then nine models at
    # b7cc5c6: BatchNorms not after a conv as a scale and shift, writes into views made
    # out-of-place, conv biases after permutes, Inductor's channels-last rule
    "vision_h200_11c362e.json",
    "vision_h200_b7cc5c6.json",
    # twelve models at a865516 (densenet121 not started in the budget): validation within the
    # model's own noise (RegNetY-016 fused), means over H x W as one kernel
    "vision_h200_a865516.json",
    # the host time of a call (benchmarks/diag/diag_vision_host.py) at 77f2a90, b133d2a and
    # 1b6e300 (the derived constants' check: one pass per kind, then after the launch), and
    # the vision suite at b133d2a (20 rows in the budget: reshapes moved ahead of elementwise
    # ops) and 1b6e300 (24 rows; densenet121 not started in the budget)
    "diag_vision_host_h200_77f2a90.json",
    "diag_vision_host_h200_b133d2a.json",
    "diag_vision_host_h200_1b6e300.json",
    "vision_h200_b133d2a.json",
    "vision_h200_1b6e300.json",
    # parameter work folded and concatenations written in place (967a7e5: GhostNet-100,
    # Swin-T, Inception-v3 under reduce-overhead; its infinifuse row fell back on validation
    # at 015bb9f), the host time of Swin-T's call at 015bb9f, and Inception-v3 at bae8e61
    # (validation's noise cap 0.25: fused)
    "vision_h200_967a7e5.json",
    "vision_h200_015bb9f.json",
    "diag_vision_host_h200_015bb9f.json",
    "vision_h200_bae8e61.json",
    # stack writes, empty pads dropped and ops pushed into concatenations (4366de0:
    # GhostNet-100, Swin-T, Inception-v3), copies folded into groups (2bb405a: Swin-T)
    "vision_h200_4366de0.json",
    "vision_h200_2bb405a.json",
    # ... and by row numbers where a roll wraps the order (e9b71e0: Swin-T)
    "vision_h200_e9b71e0.json",
    # one-op groups that take a folded copy in (efca184: LeViT-128S's hardswish)
    "vision_h200_efca184.json",
    # batched-matmul operands copied once (6e4ef06: LeViT-128S, Swin-T)
    "vision_h200_6e4ef06.json",
    # one Swin block per stage and shift: kernel time and copies (diag_swin_rows.py at a85573a)
    "diag_swin_rows_h200_a85573a.json",
    # copies left alone run as row kernels, q's scale in its matmul (980bcf5: Swin-T, LeViT-128S,
    # ViT-S; the Swin block diag again)
    "vision_h200_980bcf5.json",
    "vision_h200_980bcf5_vit.json",
    "diag_swin_rows_h200_980bcf5.json",
    # RegNetY-016 at batch 8 channels-last and NCHW against reduce-overhead, with cuDNN's
    # tensor transforms counted (benchmarks/diag/diag_conv_layout.py at 1b6e300)
    "diag_conv_layout_h200_1b6e300.json",
    # BERT-base's corpus passes by capture policy (why its second pass read 1.2x eager's), the
    # Swin block diag again, and Swin's short-row softmax's kernel variants (7864e69, 6ce301d)
    "diag_sentence_passes_bert_h200_7864e69.json",
    "diag_swin_rows_h200_7864e69.json",
    "diag_row_variants_swin_h200_6ce301d.json",
    # GPT-2's decode step after the activations moved to the row codegen (6ce301d)
    "suite_gpt2_decode_h200_6ce301d.json",
    # GPT-2's one-token forward without a cache (issue 38's GEMV target; 3e5121f)
    "suite_gpt2_token_h200_3e5121f.json",
    # one row's GEMV configs swept (3e5121f), the measured rule against the sweep again with
    # GPT-2's, TinyLlama's and Qwen2's decode steps (81ea8bc), Qwen2's after the LM-head
    # exception (cfb366a)
    "matmul_gpt2_gemv_h200_3e5121f.json",
    "matmul_gemv_rule_h200_81ea8bc.json",
    "suite_gemv_h200_81ea8bc.json",
    "suite_qwen2_decode_h200_cfb366a.json",
    # one row's GEMV along N swept again with K steps up to 1024 (6eb5265's kernel; the
    # sweep's wider K steps landed in 1c42a4c) and GPT-2's one-token forward before the new
    # rule; the rule's launches and GPT-2's one-token forward and decode step after it
    # (1c42a4c). Folded: in git at bf26ac8
    "matmul_gemv_sweep_h200_6eb5265.json",
    "suite_gpt2_token_h200_6eb5265.json",
    "matmul_gemv_rule_h200_1c42a4c.json",
    "suite_gemv_h200_1c42a4c.json",
    # Swin's window softmax: its kernel's variants at 17263c0 (the row index's divisions as
    # constants), launch configs swept over rows Triton cannot prove aligned and Swin-T and
    # LeViT-128S against reduce-overhead after the one-warp rule (f351192)
    "diag_row_variants_swin_h200_17263c0.json",
    "row_kernels_sweep_unaligned_h200_f351192.json",
    "vision_h200_f351192.json",
    # the host time of a call with captured graphs checking the addresses of the inputs they
    # read against every input's (diag_vision_host.py --check-every-address, edd9415)
    "diag_vision_host_h200_edd9415.json",
    # concatenations read by row groups (a83371e, f77a0d1): ViT-S, GhostNet, LeViT-128S and
    # DenseNet-121 (its infinifuse rows in _dn), then ConvNeXt-T, ResNeXt-50, RegNetY-016 and
    # EfficientNet-B0 (_b, _c: ViT-S and ConvNeXt-T again), one H200, cold processes
    "vision_h200_a83371e_a.json",
    "vision_h200_f77a0d1_dn.json",
    "vision_h200_f77a0d1_b.json",
    "vision_h200_f77a0d1_c.json",
    # The model zoo (21 families) on an H200 at ebee42d, then ten of them at a226f89 (integer
    # values and prefix sums in row groups) beside the GPU tests: its per-call times are not
    # comparable, its kernel counts are (both folded: `git show 5349bb9:benchmarks/results/NAME`)
    "suite_zoo_h200_ebee42d.json",
    "suite_zoo_h200_a226f89.json",
    # eight of them again at 0560a01 (a226f89's library code), alone on a one-GPU host
    # (folded: `git show c4da9f8:benchmarks/results/suite_zoo_h200_0560a01.json`)
    "suite_zoo_h200_0560a01.json",
    # MPNet, RoBERTa, XLM-R and BLOOM at e6b1a55 (a static host chain of sizes and constants
    # computed once per signature), alone on a one-GPU host (folded: in git at 50395c1)
    "suite_zoo_h200_e6b1a55.json",
    # all 21 at abd7e56 (padded masks in one kernel), two-GPU H200 host: _a (14 families)
    # beside the GPU tests on the other GPU, _b (7) after them (folded: in git at 0e5e89e)
    "suite_zoo_h200_abd7e56_a.json",
    "suite_zoo_h200_abd7e56_b.json",
    # six of them at e7d9a06 (one K/V head expanded for SDPA, cats with empty parts dropped):
    # _a beside sentence-transformers on the other GPU, _b after the GPU tests (folded, as
    # the two below: in git at aa487c8)
    "suite_zoo_h200_e7d9a06_a.json",
    "suite_zoo_h200_e7d9a06_b.json",
    # sentence-transformers, MiniLM-L6, --quick: eager and infinifuse at e7d9a06 (padded
    # masks as a group: a query at a new length compiled a binary), infinifuse at 4598feb
    # (one launch config per band of widths for small tile groups)
    "sentence_embeddings_minilm_h200_e7d9a06.json",
    "sentence_embeddings_minilm_h200_4598feb.json",
    # model zoo on an H200: T5 encoder, GPT-J, GPT-NeoX, OPT and StableLM at d27a495 (a 0-d
    # clamp bound in its group; four backends); six families at b0b4712 (values computed once,
    # contiguous attention masks, pairwise rotation; infinifuse and Inductor); 17 families at
    # bb0716f (parameter work on constants, partial rotary over the head), parsed from the
    # log of a run cut by its time limit (the file's note). Folded: in git at 6e9214d (its
    # date, 22:38, corrected in the ledger to the call's end by the device's clock, 22:35:40:
    # the tests' junit start, 22:24:32, plus the two calls' 352 and 315 s)
    "suite_zoo_h200_d27a495.json",
    "suite_zoo_h200_b0b4712.json",
    "suite_zoo_h200_bb0716f_partial.json",
    # the 21 families in one run at 3218872 (casts ahead of permutes, Phi-3's repeat_kv cat;
    # two device calls of 11 and 10 families joined with run.py --combine; four backends).
    # Folded: in git at fb15e37
    "suite_zoo_h200_3218872.json",
    # convolutions ending in ReLU as one cuDNN call: the convolutions of ResNet-50 timed each
    # way (diag_cudnn_fused_conv.py at 1dd1509), then ResNet-50 and -18 against
    # reduce-overhead (ae67d72) and four more convnets, infinifuse alone (4a2edfe). Folded:
    # in git at aec1910
    "diag_cudnn_fused_conv_h200_1dd1509.json",
    "vision_h200_ae67d72.json",
    "vision_h200_4a2edfe.json",
    # the vision suite at c4a113d (12 models, infinifuse and reduce-overhead, two device calls
    # of an H200 x2 host: 4 models beside the GPU tests, then 8 with --parallel 2); where a
    # call timed alone spends its time (diag_replay_gaps.py: GhostNet-100 at f2910a5,
    # ConvNeXt-tiny at 436a774; diag_vision_host.py: GhostNet-100 at f2910a5) and whether a
    # graph's launch grows with its kernels (diag_graph_launch.py at 53971a9 and 436a774).
    # Folded: in git at 5390797
    "vision_h200_c4a113d_a.json",
    "vision_h200_c4a113d_b.json",
    "diag_replay_gaps_h200_f2910a5.json",
    "diag_replay_gaps_h200_436a774.json",
    "diag_vision_host_h200_f2910a5.json",
    "diag_graph_launch_h200_53971a9.json",
    "diag_graph_launch_h200_436a774.json",
    # channels-last only with a convolution per 300 nodes (1ca0d7f): ViT-S/16 against
    # reduce-overhead and Swin-T, infinifuse alone. Folded: in git at 9afbe98
    "vision_h200_1ca0d7f.json",
    # the residual tail of matmul groups (b66c8cc) and the remembered BatchNorm counters
    # (40bc83e): LeViT-128S, EfficientNet-B0, GhostNet-100 against reduce-overhead, once beside
    # the GPU-marked tests on the other GPU of an H200 x2 host, once alone on an H200.
    # Folded: in git at 9c7a86c
    "vision_h200_40bc83e_beside_tests.json",
    "vision_h200_40bc83e.json",
    # reductions over another dim than the last in the group after them (aa6313a):
    # diag_axis_reductions.py, and LeViT-128S's kernels, infinifuse alone (H200). Folded: in
    # git at 821ea12
    "diag_axis_reductions_h200_aa6313a.json",
    "vision_h200_aa6313a.json",
    # the same diag with sentence-transformers' mean pooling, and EfficientNet-B0's first call
    # by phase (diag_first_call_phases.py --timm, its rows kept here), at d628af3 (H200).
    # Folded: in git at fee8859
    "diag_axis_reductions_h200_d628af3.json",
    # depthwise convolutions as one Triton kernel with their norm and activation (43e5ff0):
    # cuDNN's first calls by kind of convolution and the kernel's launch sweep
    # (diag_depthwise_conv.py, on the working tree that became 43e5ff0), EfficientNet-B0's
    # first call by phase before and after it (diag_first_call_phases.py --timm), and
    # EfficientNet-B0, MobileNetV3-large, GhostNet-100 against reduce-overhead, beside the
    # GPU tests on the other GPU of an H200 x2 host. Folded: in git at 1dc7630
    "diag_depthwise_conv_h200_43e5ff0.json",
    "vision_h200_43e5ff0.json",
    # EfficientNet-B0's first call by phase after the spatial means joined the precompile
    # (d7372f8), Triton's cache cold, on a one-GPU H200 host. Folded: in git at 6ceb07c
    "diag_first_call_phases_h200_d7372f8.json",
    # GhostNet-100, EfficientNet-B0 (both backends) and MobileNetV3-large (infinifuse alone:
    # the run's time budget ended) at 9663a0f, after GhostNet's first ghost modules wrote
    # their depthwise values in place, beside the GPU tests on the other GPU of an H200 x2
    # host. Folded: in git at 3da1d9f
    "vision_h200_9663a0f.json",
    # Models outside the suites (diag_model_sweep.py, one process each, fp16, batch 1, H200
    # x2): 58 timm and torchvision vision models at aea0e54, then EVA-02 again after the
    # parameter_work fix and 21 transformers architectures outside the zoo at e0927bf; and
    # per call against reduce-overhead (vision.py) for MobileNetV2 (8f5d8b6), DenseNet-121
    # and EfficientNetV2-RW-T (infinifuse alone: the time budget ended) at e0927bf. Folded:
    # in git at 42c4d93
    "diag_model_sweep_h200_aea0e54.json",
    "diag_model_sweep_h200_e0927bf.json",
    "vision_h200_8f5d8b6.json",
    "vision_h200_e0927bf.json",
    # the three MoE architectures of that sweep in bf16 (diag_model_sweep.py --dtype), and
    # ConvNeXt-tiny's host time a call at batch 8 under both backends in one process
    # (diag_vision_host.py, its rows written by hand: the file is a bare list), aa2c8e9, H200.
    # Folded: in git at fc0f096
    "diag_model_sweep_h200_aa2c8e9_bf16.json",
    "diag_vision_host_h200_aa2c8e9.json",
    # EfficientNet-B0 and GhostNet-100 (both backends) at 63d9d5d, after the precompile's
    # compiles moved to forked processes, on an H200 x2 host (32 cores) after its GPU tests.
    # Folded: in git at c9cb989
    "vision_h200_63d9d5d.json",
    # GhostNet-100 (both backends) at a47a608, after its second ghost modules' depthwise
    # convolutions took their shortcut add as the kernel's residual, on a one-GPU H200 host
    # after the depthwise GPU tests. Folded: in git at 63636af
    "vision_h200_a47a608.json",
    # MobileNetV3-large (both backends) at c4f116f, the compile processes' first run on it,
    # on a one-GPU H200 host. Folded: in git at 27d21dd
    "vision_h200_c4f116f.json",
    # At 35c5b5f on a one-GPU H200 host: MobileNetV3-large's host time a call at batch 8
    # under both backends in one process (diag_vision_host.py, a bare list), and cold first
    # calls phase by phase (diag_first_call_phases.py --cold --children; its printed output,
    # the rows written by hand from it). Folded: in git at ec9fec4
    "diag_vision_host_h200_35c5b5f.json",
    "first_call_cold_h200_35c5b5f.txt",
    # The vision suite at 9d8bf8e (launchers built at -O0 in the compile processes), reduce-
    # overhead and infinifuse only, each (model, backend) in a cold process, on a one-GPU
    # H200 host after its GPU tests: 11 models in two device calls (Swin-T's infinifuse,
    # RepVGG-A2's infinifuse, LeViT and DenseNet not reached in them). Folded: in git at 58b837c
    "vision_h200_9d8bf8e.json",
    "vision_h200_9d8bf8e_more.json",
    # Kernels per call without graphs at 0ecf8ad's library code (diag_kernel_census.py), on a
    # one-GPU H200 host: infinifuse on 14 timm models at batch 1 and 8, Inductor's default
    # mode on six of them at batch 1 (the library's commit written into the files by hand).
    # Folded: in git at e901501
    "kernel_census_h200_0ecf8ad.json",
    "kernel_census_h200_0ecf8ad_inductor.json",
    # The model zoo's 21 families, kernels per call without graphs under infinifuse and
    # Inductor's default mode (diag_kernel_census.py --zoo), one-GPU H200 host, at ae5733f
    # (14 families) and e7060ea (the other 7; the same library code). Folded: in git at d8b8c3f
    "kernel_census_zoo_h200_ae5733f.json",
    "kernel_census_zoo_h200_e7060ea.json",
    # MobileNetV3-large and ResNet-18 at e7060ea, reduce-overhead and infinifuse, batch 1 then
    # 8 in one process each (vision.py --no-kernel-counts, its --ledger rows): the second
    # size's first call after make_out_of_place's and evaluate's shortcuts (13326e2, cac2ba3).
    # Folded: in git at d8b8c3f
    "vision_h200_e7060ea.json",
    # MobileNetV3-large's cold first call at 0ecf8ad, one-GPU H200 host, after the GPU tests:
    # the compile processes' launchers at -O0 (the default) and at Triton's -O3, alternating,
    # two rounds (diag_first_call_phases.py --cold --children [--optimised-launchers]; its
    # printed output, the rows written by hand from it). Folded: in git at 7eb4dbe
    "first_call_launchers_ab_h200_0ecf8ad.txt",
    # Cold first calls with Triton's cache key started at the graph's arrival (c8492f4:
    # ResNet-50) and as Dynamo starts (5f75501: ResNet-50, MobileNetV3-large), one-GPU H200
    # hosts, one round each (diag_first_call_phases.py --cold; printed output, rows by hand).
    # Folded: in git at 461a26e
    "first_call_key_start_h200_5f75501.txt",
    # Eight timm models at d92c6ad (the heaviest compiles first, depthwise windows over 3 x 3
    # in a row loop), reduce-overhead and infinifuse, batch 1 then 8 in one cold process each
    # (vision.py --no-kernel-counts, its --ledger rows), one-GPU H200 host after its GPU
    # tests, in three device calls: the depthwise convnets, the ResNets, ViT-S and ConvNeXt-T.
    # Folded: in git at 333fec3
    "vision_h200_d92c6ad.json",
    "vision_h200_d92c6ad_resnets.json",
    "vision_h200_d92c6ad_vit.json",
    # Cold first calls, one-GPU H200 host, 2026-12-01: at 6418a1c, with the compile order of
    # d92c6ad alone, and at d92c6ad (diag_first_call_phases.py --cold --children; printed
    # output, the rows written from it: first call, precompile, processes, longest compile).
    # Folded: in git at 333fec3
    "first_call_compile_order_h200_d92c6ad.txt",
    # At 6418a1c on a one-GPU H200 host, 2026-12-01: host time a call at batch 1 of ViT-S,
    # ResNet-18, GhostNet-100 and ConvNeXt-T under both backends (diag_vision_host.py, a bare
    # list, rows written from it), and the depthwise kernel's window unrolled against its rows
    # in a loop, per shape (a scratch script's printed output; rows: per model, batch and
    # window, the summed device time, and the 110 shapes' total). Folded: in git at 3ca08c3
    "diag_vision_host_h200_6418a1c.json",
    "depthwise_row_loop_ab_h200.txt",
    # The six models of the vision suite not run at d92c6ad (RegNetY-016, Swin-T, RepVGG-A2,
    # LeViT-128S, Inception-v3, DenseNet-121) at be6fdbb, reduce-overhead and infinifuse in
    # one cold process each (vision.py --no-kernel-counts, its --ledger rows), one-GPU H200
    # host; then LeViT-128S and RegNetY-016 at batch 1 under both backends and infinifuse
    # without matmul groups in one process each, with one call's device kernel time
    # (diag_vision_host.py --variant --kernels, a bare list, rows written from it).
    # Folded: the file never landed (a session cut off before its hand-in): the rows alone.
    "vision_h200_be6fdbb_six.json",
    "diag_vision_host_h200_be6fdbb.json",
    # Cold first calls of RegNetY-016 and RepVGG-A2 at be6fdbb by phase, one-GPU H200 host
    # (diag_first_call_phases.py --cold --children; printed output, the rows written from
    # it: first call, Dynamo's share, Dynamo alone, backend, precompile, processes, runs).
    # Folded: the file never landed (a session cut off before its hand-in): the rows alone.
    "first_call_phases_h200_be6fdbb.txt",
    # sentence-transformers at 37ed38f, MiniLM-L6 and BERT-base shapes, eager and
    # infinifuse (sentence_embeddings.py --quick: 1000 sentences, 100 queries, each backend
    # in a cold process), one-GPU H200 host after its GPU tests. 37ed38f is a commit that
    # never landed (a session cut off before its hand-in); its package code is d269019's.
    # Folded: the file never landed either: the rows alone.
    "sentence_embeddings_h200_37ed38f.json",
    # Cold first calls of GhostNet-100, MobileNetV3-large and EfficientNet-B0 at 37ed38f (the
    # compile weights of cb06774) by phase, one-GPU H200 host (diag_first_call_phases.py
    # --cold --children; printed output, the rows written from it). Folded: the file never
    # landed (a session cut off before its hand-in): the rows alone.
    "first_call_phases_h200_37ed38f.txt",
    # GroupNorm + ReLU as one kernel at 2d660d0 against aten's GroupNorm then ReLU at
    # ResNet-V2-50's (BiT) and a UNet's shapes, fp16, NCHW and channels-last
    # (diag_group_norm.py, a result of rows, written from it); then ResNet-V2-50x1-BiT
    # against reduce-overhead (vision.py --no-kernel-counts, its --ledger rows), one-GPU H200
    # host after the GPU tests of the GroupNorm and depthwise kernels. Folded: in git at 95be7f7
    "diag_group_norm_h200_2d660d0.json",
    "vision_h200_2d660d0_bit.json",
    # ResNet-V2-50x1-BiT on a one-GPU H200 host, step by step: at ec68823 (standardised
    # weights folded as channels-last constants) and c699f5f (+ norms read by convolutions
    # written channels-last), against reduce-overhead (vision.py --no-kernel-counts, its
    # --ledger rows) and its fused graph's node times at batch 8 summed per target
    # (diag_node_times.py, rows written from its by_target); at c699f5f its batch-8 call's
    # host and kernel time under both backends (diag_vision_host.py --kernels, rows written
    # from it). Then at 35e7ee7 (several channels-last groups a program only in images of
    # 256 KiB or more, 256-byte spans) BiT again, and BiT's channels-last norms + ReLU at
    # batch 1 and 8 under Inductor and four variants of the grouped rule
    # (diag_group_norm.py --sweep, rows written from it: the launcher's rule is backend
    # "infinifuse"), after the GPU tests of the GroupNorm, channels-last and depthwise files.
    # Folded: in git at 9c44a3c
    "vision_h200_ec68823_bit.json",
    "diag_node_times_h200_ec68823_bit.json",
    "vision_h200_c699f5f_bit.json",
    "diag_node_times_h200_c699f5f_bit.json",
    "diag_vision_host_h200_c699f5f_bit.json",
    "vision_h200_35e7ee7_bit.json",
    "diag_group_norm_sweep_h200_35e7ee7.json",
    # GPT-2's one-token forward at f46059b: the suite's row against reduce-overhead, and its
    # call split at the graph replay (diag_suite_call.py: host time before, inside and after
    # the replay, two infinifuse builds, one without programmatic dependent launch)
    "suite_gpt2_token_h200_f46059b.json",
    "suite_call_gpt2_token_h200_f46059b.json",
    # corpus passes by capture policy, MiniLM-L6 and BERT-base shapes, 1000 sentences: at
    # f46059b (capture on the 2nd call by default, and capture_on_call=1), at 7a84fe4
    # (capture_on_call None, recurrence.py, and capture_on_call=2); sentence_embeddings.py
    # --quick for MiniLM-L6 at 7a84fe4 against eager and reduce-overhead. Folded: in git at
    # b199ed7 (the four diag_sentence_passes files, their device fixed: 37d6730)
    "diag_sentence_passes_minilm_h200_f46059b.json",
    "diag_sentence_passes_bert_h200_f46059b.json",
    "diag_sentence_passes_minilm_h200_7a84fe4.json",
    "diag_sentence_passes_bert_h200_7a84fe4.json",
    "sentence_embeddings_minilm_h200_7a84fe4.json",
    # a 4-layer TinyLlama-wide decode over a DynamicCache per capture policy (2cf5d85).
    # Folded: in git at 8db2d86
    "diag_growing_decode_h200_2cf5d85.json",
    # 2026-12-01, H200, package at 3e2abf5: the same decode with each sequence split into its
    # prefill and its steps (the diag at 4ae618c); MiniLM-L6's corpus passes, the first one
    # cProfile'd, static against dynamic=True; one replayed call's host time, static against
    # dynamic=True (diag_dynamic_host.py's JSON is a list: its rows written by hand, as
    # e37d61a's, the file never in benchmarks/results/). Folded: in git at 18a74c2
    "diag_growing_decode_h200_4ae618c.json",
    "diag_sentence_passes_minilm_h200_3e2abf5.json",
    "diag_dynamic_host_h200_3e2abf5.json",
    # the same passes run's printed Dynamo compile metrics under cProfile (torch._dynamo.utils
    # .compile_times()): per variant, the traces of the first pass, the seconds of
    # _compile.compile_inner summed over them and of OutputGraph.call_user_compiler (the
    # backend) within that; rows written by hand, the log never in benchmarks/results/
    "diag_sentence_passes_minilm_h200_3e2abf5.txt",
    # 2026-12-01, one-GPU H200 host, package at dabefa5, four device calls on one held
    # machine: the model zoo's 21 families and GPT-2's one-token forward, infinifuse and
    # reduce-overhead built in one process and timed in alternating rounds
    # (diag_suite_call.py --interleave 7); the vision suite's 14 models, reduce-overhead and
    # infinifuse, each (model, backend) in a cold process (vision.py --no-kernel-counts, its
    # --ledger rows) in three calls (_a: ViT-S/16's infinifuse row not reached, its
    # reduce-overhead row kept; _b has both of its rows). Folded: in git at 0377092
    "diag_suite_turns_h200_dabefa5.json",
    "vision_h200_dabefa5_a.json",
    "vision_h200_dabefa5_b.json",
    "vision_h200_dabefa5_c.json",
    # the host time of copying a call's outputs, the same session and host: fp16 tensors of
    # 2 x 7 x 64 and 2 x 64 (a 2-layer BERT's two outputs), 20000 calls between two
    # synchronizations after 200 (clone, empty_like, empty_like + one _foreach_copy_; a
    # throwaway probe's printed output, the rows written by hand, never in benchmarks/results/)
    "probe_output_copies_h200_dabefa5.txt",
    # 2026-12-01, one-GPU H200 host, package at 2e81c0b (runtime/outputs.py's copy_out in),
    # four device calls on one held machine: the GPU tests (456 passed, 3 skipped), the zoo
    # and GPT-2's one-token forward in alternating rounds (diag_suite_call.py --interleave 7),
    # five vision models at batch 1 and 8 the same way (diag_vision_host.py --interleave 7),
    # the suite's four decode/encoder rows (run.py, eager, reduce-overhead, infinifuse) and
    # generate.py (its JSON carries no commit: set to the package's by hand). Folded: in git
    # at c2fa178
    "diag_suite_turns_h200_2e81c0b.json",
    "vision_turns_h200_2e81c0b_b1.json",
    "vision_turns_h200_2e81c0b_b8.json",
    "suite_decode_h200_2e81c0b.json",
    "generate_h200_2e81c0b.json",
    # the same session, a fifth call: qwen2-decode and gpt2-decode under infinifuse with the
    # packages at 2e81c0b, 1c42a4c and cfb366a, one cold process each (workloads
    # "ab-WORKLOAD-COMMIT", the commit field the package's too); rows written by hand from the
    # printed rows and the two suite.json files that came back. Folded: in git at c2fa178
    "ab_decode_h200_2e81c0b.txt",
    # 2026-12-02, this project's CPU machine (2 cores, transformers 5.24), package at 2cea41c:
    # diag_model_sweep.py --cpu --parallel 2, the 62 transformers architectures of HF_MODELS
    # and HF_MORE under Triton's interpreter in fp32, for correctness alone. Folded: in git at
    # 089443c
    "diag_model_sweep_cpu_2cea41c.json",
    # 2026-12-02, one-GPU H200 host, fusebackend/ as at 2e81c0b, two device calls on one held
    # machine: the four decode/encoder rows in alternating rounds (diag_suite_call.py
    # --interleave 7 at 00a1ac4; its rel_error compared the fifth decode step with eager's
    # fourth, fixed at 04a67e0, and is not a ledger metric); a launch's host time after a
    # replay (diag_launch_after_replay.py: the JSON's benchmark and environment written in by
    # hand, the diag wrote neither then); zoo-bert's call under infinifuse, infinifuse-nopdl
    # and reduce-overhead, one build after another; GPT-2's decode in alternating rounds again
    # at 04a67e0; and an A/B of GPT-2's decode, 04a67e0's package against 1c42a4c's in
    # alternating cold processes (ab_packages.sh; rows written by hand, workloads
    # "ab-gpt2-decode-PACKAGE-rROUND"). Folded: in git at 36d038b
    "diag_suite_turns_decode_h200_00a1ac4.json",
    "launch_after_replay_h200_00a1ac4.json",
    "diag_suite_call_zoo_bert_h200_04a67e0.json",
    "diag_suite_turns_gpt2_decode_h200_04a67e0.json",
    "ab_gpt2_decode_h200_04a67e0.txt",
    # the same host and session, later: the zoo and GPT-2's one-token forward in alternating
    # rounds again (919f9e2, fusebackend/ still 2e81c0b's), Inception-v3 and ViT-S/16 the
    # same way; Inception-v3's kernels at batch 8 by kind and name against Inductor's before
    # (5d417ac) and after (e56272b) its pools became pool2d launches; Inception-v3 and
    # ResNet-50 in alternating rounds at e56272b. Folded: in git at 1c36c84
    "diag_suite_turns_h200_919f9e2.json",
    "vision_turns_h200_919f9e2_b1.json",
    "vision_turns_h200_919f9e2_b8.json",
    "kernel_census_inception_b8_h200_5d417ac.json",
    "kernel_census_inception_b8_h200_e56272b.json",
    "vision_turns_h200_e56272b_b1.json",
    "vision_turns_h200_e56272b_b8.json",
)
# The commit whose benchmarks/results/ last held every folded source and retired file:
# git show FOLDED_AT:benchmarks/results/NAME prints one.
FOLDED_AT = "e37d61a"
# Result files the docs cite that are neither in benchmarks/results/ nor ledger sources (test
# logs, diag outputs in formats of their own), removed to keep results/ to what is read.
RETIRED = (
    "decode_attention_h100.json",
    "diag_call_host_gpt2_h100.txt",
    "diag_call_host_gpt2_order_h100.txt",
    "diag_capture_trial_h100_3_calls.json",
    "diag_capture_trial_h100_5_calls.json",
    "diag_first_call_h100.txt",
    "diag_generate_host_h100.txt",
    "diag_sentence_passes_minilm_h100_before.json",
    "diag_sentence_passes_minilm_h100_first_profile.json",
    "diag_sentence_passes_minilm_h100_first_profile.txt",
    "diag_sentence_passes_minilm_h100_routes.json",
    "diag_suite_host_gpt2_h100.txt",
    "diag_tp_first_call_cpu_gloo.txt",
    "gpu_tests_h100.txt",
    "gpu_tests_h100_columns_first.txt",
    "gpu_tests_h100_full_suite.txt",
    "gpu_tests_h100_gemv.txt",
    "gpu_tests_h100_issue24_25.txt",
    "gpu_tests_h100_kernel_loading.txt",
    "gpu_tests_h100_runtime_gpu_fix.txt",
    "gpu_tests_h200_issue39.txt",
    "matmul_sweep_h100_pdl.json",
    "overhead_h200_second_host.json",
    "overhead_h200_third_host_cold.json",
    "overhead_h200_third_host_warm_inductor_cache.json",
    "sentence_query_p90_cpu.md",
    "suite_decode_h100_columns_first_llama.txt",
)
# metric name in a result row -> unit
# diag_depthwise_conv.py's depthwise shapes, summed: cuDNN's convolution alone, and the Triton
# kernel with its scale, shift and SiLU at its fastest configuration per shape
DEPTHWISE_TIMES = {"cudnn": "cudnn_us", "infinifuse-swept-best": "best_us"}
SWEEP_METRICS = {"outputs_ok": "flag", "captured": "flag", "first_call_s": "s",
                 "max_abs_err": "abs", "eager_max_abs_err": "abs"}  # fmt: skip
SUITE_METRICS = {"per_call_ms": "ms", "first_call_s": "s", "kernels_per_call": "count",
                 "kernel_us_per_call": "us",
                 "floor_fraction": "fraction"}  # fmt: skip
TP_METRICS = {
    "decode": {"step_ms": "ms", "first_call_s": "s"},
    "generate": {"tokens_per_s": "tokens/s", "first_generate_s": "s"},
}
TP_ALL_REDUCE = {"all_reduce_ms": "ms", "all_reduces_per_step": "count",
                 "all_reduce_ms_per_step": "ms"}  # fmt: skip
# (query_repeat_*: each query timed again, every length seen before; second_pass_captures:
# the captures the second pass made, signatures seen once in the first)
SENTENCE_METRICS = {"first_pass_s": "s", "second_pass_s": "s", "query_p50_ms": "ms",
                    "query_p90_ms": "ms", "query_p90_ms_new_length": "ms",
                    "query_p90_ms_seen_length": "ms", "query_repeat_p50_ms": "ms",
                    "query_repeat_p90_ms": "ms", "second_pass_captures": "count"}  # fmt: skip
GENERATE_METRICS = {"first_generate_s": "s", "tokens_per_s": "tokens/s"}
# diag_tp_step.py, per rank: the step replayed (with the all-reduce's clones put back: _cloned)
# and run direct, the host's time per replayed step, and each profile's device time
TP_STEP_METRICS = {"step_ms_graphs": "ms", "step_ms_graphs_cloned": "ms", "step_ms_direct": "ms",
                   "host_ms_per_step": "ms"}  # fmt: skip
TP_STEP_PROFILES = {"profile_graphs": "graphs", "profile_direct": "direct"}
PROFILE_FIELDS = ("device_us_per_step", "nccl_us_per_step")
# matmul_kernels.py, per shape and row count: backend -> the record's time
MATMUL_TIMES = {"infinifuse": "fused_us", "eager": "eager_us", "cublas-linear": "cublas_us"}
# diag_matmul_gemv.py, per one-row shape: backend -> the record's field (gemv: its sweep's)
GEMV_TIMES = {"infinifuse-tensor-cores": "production_us",
              "infinifuse-tensor-cores-nopdl": "production_nopdl_us", "cublas-linear": "cublas_us",
              "gemv-best": "gemv.best_us", "gemv-best-pdl": "gemv.best_pdl_us"}  # fmt: skip
GEMV_FRACTIONS = {"infinifuse-tensor-cores": "production_fraction_of_copy",
                  "gemv-best": "gemv.best_fraction_of_copy",
                  "gemv-best-pdl": "gemv.best_pdl_fraction_of_copy"}  # fmt: skip
# diag_rotary_epilogue.py: the fused q/k/v + rotation + cache write launch against the launches
# it replaces ("before"), the plain q/k/v launch alone and eager, each row's time
ROTARY_TIMES = {"infinifuse": "fused_us", "before": "before_us", "qkv-only": "qkv_only_us",
                "eager": "eager_us"}  # fmt: skip
# diag_cudnn_fused_conv.py, a model's convolutions summed: backend -> the record's time
CUDNN_CONV_TIMES = {"conv-alone": "conv_us", "conv-then-bias-relu": "conv_then_bias_relu_us",
                    "cudnn-relu": "cudnn_relu_us",
                    "conv-then-add-bias-relu": "conv_then_add_bias_relu_us",
                    "cudnn-add-relu": "cudnn_add_relu_us"}  # fmt: skip
# diag_swin_rows.py: one Swin block's kernel time, kernels and the time of its copies
SWIN_BLOCK_METRICS = {"total_us": "us", "kernel_count": "count", "aten_copy_us": "us",
                      "row_copy_us": "us", "inductor_copy_us": "us"}  # fmt: skip
# matmul_kernels.py --sweep-gemv: one row's GEMV under the default config and the sweep's best
GEMV_SWEEP_TIMES = {"infinifuse-default-config": "default_us",
                    "infinifuse-swept-best": "best_us"}  # fmt: skip
# diag_sentence_passes.py: each variant's passes over one corpus (eager's in its process)
SENTENCE_PASSES_METRICS = {"eager_s": "s", "first_s": "s", "second_s": "s", "third_s": "s",
                           "eager_again_s": "s", "second_captures": "count",
                           "second_capture_s": "s"}  # fmt: skip
# diag_growing_decode.py: a DynamicCache decode's sequences per capture policy
GROWING_DECODE_METRICS = {
    f"{phase}_{metric}": unit
    for phase in ("warm", "new", "again")
    for metric, unit in (("s", "s"), ("prefill_s", "s"), ("steps_s", "s"),
                         ("captures", "count"), ("dynamo_graphs", "count"))
} | {"eager_prefill_s": "s", "eager_steps_s": "s"}  # fmt: skip
# diag_suite_call.py: a suite workload's call, host side split at its graph replays
SUITE_CALL_METRICS = {k: "us" for k in ("host_us", "alone_us", "loop_us", "span_us",
                                         "kernel_us", "pre_replay_us", "replay_us",
                                         "post_replay_us", "interleaved_us")}  # fmt: skip
# diag_vision_host.py: a vision model's call per backend in one process (interleaved_us: the
# backends' rounds taken in turns, --interleave; in such a run every figure was timed with
# the other backends' builds alive)
VISION_HOST_METRICS = {"kernels": "count"} | {
    k: "us" for k in ("host_us", "alone_us", "loop_us", "kernel_us", "refresh_us", "interleaved_us")
}
# the config diag_rotary_epilogue.py times second at one row: the tensor-core split-K pick
TENSOR_CORE_SPLITK = {"block_n": 32, "block_k": 128, "warps": 2, "stages": 3, "split_k": 4,
                      "gemv": False}  # fmt: skip


def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """This process's device, versions, commit and date: the fields a row lacks on append."""
    device = "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "device": device,
        "torch": torch.__version__ if torch is not None else _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _row(env: dict[str, Any], source: str, workload: str, backend: str, metric: str,
         value: Any, unit: str) -> dict[str, Any]:  # fmt: skip
    row = {"workload": workload, "backend": backend, "metric": metric, "value": value,
           "unit": unit, "source": source}  # fmt: skip
    row.update({k: env.get(k) for k in ENV_FIELDS})
    return {k: row[k] for k in FIELDS}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field(record: dict[str, Any], path: str) -> Any:
    """record's field at a dotted path ("gemv.best_us"), None where a part is missing."""
    for part in path.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


def rows_of(data: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The ledger rows of one result JSON (any of the benchmarks' formats), source its name."""
    env = dict(data.get("environment") or {})
    for key in ENV_FIELDS:  # generate.py, row_kernels.py and embedding_chain.py: top level
        env.setdefault(key, data.get(key))
    if isinstance(env.get("commit"), str):
        env["commit"] = env["commit"][:7]
    out: list[dict[str, Any]] = []

    def add(workload: str, backend: str, metrics: dict[str, str], record: dict) -> None:
        for metric, unit in metrics.items():
            if _number(record.get(metric)):
                out.append(_row(env, source, workload, backend, metric, record[metric], unit))

    if "ranks" in data and "step_ms_graphs" in data["ranks"][0]:  # diag_tp_step.py: each rank
        for rank in data["ranks"]:
            workload = f"diag-tp-step-{rank['shape']}-tp{rank['tp']}-rank{rank['rank']}"
            add(workload, "infinifuse", TP_STEP_METRICS, rank)
            for profile, name in TP_STEP_PROFILES.items():
                record = rank.get(profile) or {}
                add(workload, "infinifuse", {f"{k}_{name}": "us" for k in PROFILE_FIELDS},
                    {f"{k}_{name}": record.get(k) for k in PROFILE_FIELDS})  # fmt: skip
    elif "ranks" in data:  # tensor_parallel.py: rank 0's figures
        rank = data["ranks"][0]
        for backend, parts in rank.get("backends", {}).items():
            for part, metrics in TP_METRICS.items():
                workload = f"tp-{rank['shape']}-tp{rank['tp']}-{part}"
                add(workload, backend, metrics, parts.get(part) or {})
        # one all-reduce of a decode row replayed alone, and the step's count of them
        add(f"tp-{rank['shape']}-tp{rank['tp']}-decode", "nccl", TP_ALL_REDUCE, rank)
    elif data.get("benchmark") == "sentence_embeddings":
        for run in data.get("runs", []):
            # the p90 of the queries at a new token length and at a length seen before
            split = run.get("query_phases", {}).get("total_by_new_length_ms", {})
            run = {**run, "query_p90_ms_new_length": split.get("new", {}).get("p90"),
                   "query_p90_ms_seen_length": split.get("seen", {}).get("p90")}  # fmt: skip
            add(f"sentence-{run.get('shape')}", run.get("backend"), SENTENCE_METRICS, run)
    elif data.get("benchmark") == "generate":
        for run in data.get("runs", []):
            add(f"generate-cache{run.get('cache_len')}", run.get("variant"), GENERATE_METRICS,
                run)  # fmt: skip
    elif data.get("benchmark") == "matmul_kernels":  # as matmul_kernels.ledger_rows names them
        for record in data.get("shapes", []):
            workload = f"matmul-{record['shape']}-m{record['rows']}"
            for backend, key in MATMUL_TIMES.items():
                add(workload, backend, {"device_us": "us"}, {"device_us": record.get(key)})
            add(workload, "infinifuse", {"fraction_of_copy": "fraction"}, record)
        for record in data.get("sweep", []):  # --sweep-gemv: the default config and the best
            if record.get("gemv"):
                workload = f"matmul-{record['shape']}-m{record['rows']}"
                for backend, key in GEMV_SWEEP_TIMES.items():
                    add(workload, backend, {"device_us": "us"}, {"device_us": record.get(key)})
    elif data.get("benchmark") == "diag_matmul_gemv":
        for record in data.get("shapes", []):
            workload = f"matmul-{record['shape']}-m1"
            for backend, key in GEMV_TIMES.items():
                add(workload, backend, {"device_us": "us"}, {"device_us": _field(record, key)})
            for backend, key in GEMV_FRACTIONS.items():
                add(workload, backend, {"fraction_of_copy": "fraction"},
                    {"fraction_of_copy": _field(record, key)})  # fmt: skip
    elif data.get("benchmark") == "diag_cudnn_fused_conv":  # a model's convolutions, summed
        for record in data.get("summed", []):
            workload = f"cudnn-conv-{record['model']}-b{record['batch']}"
            for backend, key in CUDNN_CONV_TIMES.items():
                add(workload, backend, {"device_us": "us"}, {"device_us": record.get(key)})
    elif data.get("benchmark") == "diag_model_sweep":  # models outside the suites
        for record in data.get("records", []):
            modes = record.get("modes") or ["none"]
            flags = {"outputs_ok": float(bool(record.get("ok"))),
                     "captured": float(all(m in ("fusion", "graph_replay") for m in modes)),
                     "max_abs_err": record.get("err"),
                     "eager_max_abs_err": record.get("eager_err")}  # fmt: skip
            dtype = "" if data.get("dtype", "float16") == "float16" else f"-{data['dtype']}"
            add(f"sweep-{record['model'].replace(':', '-')}-b{data.get('batch', 1)}{dtype}",
                "infinifuse", SWEEP_METRICS, {**record, **flags})  # fmt: skip
    elif data.get("benchmark") == "diag_depthwise_conv":
        for record in data.get("first_calls", []):  # cuDNN's first calls, by kind
            workload = f"depthwise-first-calls-{record['model']}-b{record['batch']}"
            for state in ("cold", "warm"):
                times = {f"{state}_s_{kind}": v for kind, v in record[f"{state}_s"].items()}
                add(workload, "cudnn", dict.fromkeys(times, "s"), times)
        for batch in sorted({r["batch"] for r in data.get("per_call", [])}):  # summed per batch
            shapes = [r for r in data["per_call"] if r["batch"] == batch]
            workload = f"depthwise-convs-b{batch}"
            for backend, key in DEPTHWISE_TIMES.items():
                add(workload, backend, {"device_us": "us"},
                    {"device_us": round(sum(r[key] for r in shapes), 2)})  # fmt: skip
    elif data.get("benchmark") == "diag_swin_rows":  # one Swin block per stage and shift
        for record in data.get("rows", []):
            workload = f"swin-block-d{record['dim']}-shift{record['shift']}-b{record['batch']}"
            add(workload, record["backend"], SWIN_BLOCK_METRICS, record)
    elif data.get("benchmark") == "diag_row_variants":  # one row kernel's source variants
        for record in data.get("results", []):
            workload = f"row-variant-{record['pattern']}-{record['rows']}x{record['width']}"
            variant = record["variant"]
            backend = variant if variant == "inductor" else (
                "infinifuse" if variant == "base" else f"infinifuse-{variant}")  # fmt: skip
            add(workload, backend, {"device_us": "us"}, {"device_us": record.get("us")})
    elif data.get("benchmark") == "diag_suite_call":  # one workload's call; a build named
        seen: dict[tuple[str, str], int] = {}  # twice is "<backend>#2" the second time
        for record in data.get("rows", []):
            backend, build = record["backend"], (record["workload"], record["backend"])
            seen[build] = seen.get(build, 0) + 1
            name = backend if seen[build] == 1 else f"{backend}#{seen[build]}"
            add(f"call-{record['workload']}", name, SUITE_CALL_METRICS, record)
    elif data.get("benchmark") == "diag_launch_after_replay":  # a graph's size or zoo family
        for record in data.get("rows", []):
            size = f"zoo-{record['zoo']}" if "zoo" in record else f"{record['kernels']}-kernels"
            steps = {k: "us" for k, v in record.items() if k not in ("zoo", "kernels", "outputs")}
            add(f"launch-after-replay-{size}", "infinifuse", steps, record)
    elif data.get("benchmark") == "diag_vision_host":  # as its rows were written by hand
        for record in data.get("rows", []):
            workload = f"vision-host-{record['model']}-b{record['batch']}"
            add(workload, record["backend"], VISION_HOST_METRICS, record)
    elif data.get("benchmark") == "diag_growing_decode":  # per capture policy
        for run in data.get("runs", []):
            variant = run.get("variant")
            backend = "infinifuse" if variant == "default" else f"infinifuse-{variant}"
            add(f"growing-decode-l{run.get('layers')}", backend, GROWING_DECODE_METRICS, run)
    elif data.get("benchmark") == "diag_sentence_passes":  # a corpus's passes, per variant
        for run in data.get("runs", []):
            variant = run.get("variant")
            backend = "infinifuse" if variant == "default" else f"infinifuse-{variant}"
            add(f"sentence-passes-{data.get('shape')}", backend, SENTENCE_PASSES_METRICS, run)
    elif data.get("benchmark") == "diag_rotary_epilogue":
        for record in data.get("rows", []):
            workload = f"rotary-{record['shape']}-b{record['batch']}"
            for backend, key in ROTARY_TIMES.items():
                add(workload, backend, {"device_us": "us"}, {"device_us": record.get(key)})
        for record in data.get("sweep", []):
            workload = f"rotary-{record['shape']}-b{record['batch']}"
            pick = [t for t in record.get("tried", []) if all(
                (t.get("config") or {}).get(k, False if k == "gemv" else None) == v
                for k, v in TENSOR_CORE_SPLITK.items())]  # fmt: skip
            times = {
                "infinifuse-default": record.get("default_us"),
                "infinifuse-swept-best": record.get("best_us"),
                "infinifuse-tensor-core-splitk4": pick[0].get("us") if pick else None,
            }
            for backend, value in times.items():
                add(workload, backend, {"device_us": "us"}, {"device_us": value})
    elif data.get("benchmark") == "kernel_census":  # diag_kernel_census.py, as vision.py names
        for record in data["records"]:
            if "error" not in record:
                workload = record.get("workload") or f"vision-{record['model']}-b{record['batch']}"
                add(workload, record["backend"],
                    {"kernels_per_call": "count", "kernel_us_per_call": "us"}, record)  # fmt: skip
                # (device time by kind of kernel, where the census timed it: "aten" ->
                # kernel_us_aten, "infinifuse triton" -> kernel_us_infinifuse_triton)
                by_kind = {f"kernel_us_{kind.replace(' ', '_')}": us
                           for kind, us in (record.get("us_by_kind") or {}).items()}  # fmt: skip
                add(workload, record["backend"], dict.fromkeys(by_kind, "us"), by_kind)
    elif data.get("benchmark") == "embedding_chain":
        shape = data.get("shape", {})
        workload = f"embedding-chain-B{shape.get('B')}xT{shape.get('T')}"
        metrics = {"ms": "ms", "per_call_ms_cpu_included": "ms", "fraction_of_copy": "fraction"}
        for backend, record in data.get("results", {}).items():
            add(workload, backend, metrics, record)
        # as users call it, each output kept (its own backends' names)
        for backend, value in (data.get("per_call_outputs_kept_ms") or {}).items():
            if backend != "ratio":
                add(workload, backend, {"per_call_ms_outputs_kept": "ms"},
                    {"per_call_ms_outputs_kept": value})  # fmt: skip
    elif isinstance(data.get("results"), list):  # row_kernels.py
        for record in data["results"]:
            workload = f"row-{record.get('pattern')}-{record.get('rows')}x{record.get('width')}"
            for backend in ("infinifuse", "inductor", "eager"):
                add(workload, backend, {"ms": "ms", "fraction_of_copy": "fraction"},
                    {"ms": record.get(f"{backend}_ms"),
                     "fraction_of_copy": record.get(f"{backend}_fraction_of_copy")})  # fmt: skip
        for record in data.get("sweep", []):  # --sweep: one row per launch config
            workload = f"row-{record['pattern']}-{record['rows']}x{record['width']}"
            config = f"w{record['num_warps']}-r{record['block_r']}"
            if record.get("chunk"):
                config += f"-c{record['chunk']}"
            add(workload, f"infinifuse-{config}", {"ms": "ms"}, record)
    elif isinstance(data.get("rows"), list):  # run.py's suite.json
        for record in data["rows"]:
            if record.get("status", "ok") == "ok":
                row_env = {**env, "date": record.get("date") or env.get("date")}
                for metric, unit in SUITE_METRICS.items():
                    if _number(record.get(metric)):
                        out.append(_row(row_env, source, record["workload"], record["backend"],
                                        metric, record[metric], unit))  # fmt: skip
    if data.get("benchmark") in ("diag_depthwise_conv", "diag_first_call_phases"):
        # diag_first_call_phases.py --timm's phases, transcribed, each at its own commit
        for record in data.get("first_call_phases", []):
            workload = f"first-call-phases-{record['model']}-b{record['batch']}-{record['commit']}"
            start = len(out)
            add(workload, f"infinifuse-triton-cache-{record['triton_cache']}",
                dict.fromkeys(record["phases_s"], "s"), record["phases_s"])  # fmt: skip
            for row in out[start:]:
                row["commit"] = record["commit"]
    return out


def _key(row: dict[str, Any]) -> tuple:
    return tuple("" if row.get(k) is None else str(row.get(k)) for k in FIELDS)


def dumps(rows: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, sort_keys=False) + "\n" for row in rows)


def append(rows: Iterable[dict[str, Any]], path: str | Path = LEDGER) -> list[dict[str, Any]]:
    """Appends rows to the ledger at path; a field a row lacks (device, versions, commit,
    date) is this process's. Returns the rows as written."""
    env = None
    written = []
    for row in rows:
        missing = [k for k in ENV_FIELDS if row.get(k) is None]
        if missing and env is None:
            env = environment()
        full = {k: row.get(k) for k in FIELDS}
        for k in missing:
            full[k] = env[k]
        written.append(full)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(dumps(written))
    return written


def append_result(data: dict[str, Any], source: str | Path, path: str | Path) -> int:
    """Appends the rows of one result JSON (as rows_of reads it); returns how many."""
    return len(append(rows_of(data, Path(source).name), path))


def rebuild(results: str | Path = RESULTS, out: str | Path | None = None,
            sources: Iterable[str] = SOURCES,
            folded_from: str | Path | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The ledger built from the result JSONs in results named by sources, sorted; written to
    out (default: results/ledger.jsonl). A source with no file in results is folded: its rows
    are taken from the ledger at folded_from (default: results/ledger.jsonl) as they are; a
    source in neither place raises FileNotFoundError."""
    results = Path(results)
    folded_from = Path(folded_from) if folded_from is not None else results / "ledger.jsonl"
    kept: list[dict[str, Any]] | None = None
    rows: list[dict[str, Any]] = []
    for name in sources:
        if (results / name).exists():
            rows += rows_of(json.loads((results / name).read_text()), name)
            continue
        if kept is None:
            kept = read(folded_from) if folded_from.exists() else []
        old = [row for row in kept if row["source"] == name]
        if not old:
            raise FileNotFoundError(f"{name}: not in {results} and no rows of it in {folded_from}")
        rows += old
    rows.sort(key=_key)
    out = Path(out) if out is not None else results / "ledger.jsonl"
    out.write_text(dumps(rows))
    return rows


def read(path: str | Path = LEDGER) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def table(rows: list[dict[str, Any]], workloads: list[str]) -> list[str]:
    """Lines of a plain table: the rows of the named workloads (a name ending in '*' is a
    prefix), in ledger order."""

    def chosen(workload: str) -> bool:
        return any(
            workload.startswith(w[:-1]) if w.endswith("*") else workload == w for w in workloads
        )

    head = ("workload", "backend", "metric", "value", "unit", "device", "commit", "date", "source")
    body = [
        tuple(
            f"{r['value']:.4g}" if k == "value" and _number(r[k]) else str(r.get(k) or "-")
            for k in head
        )
        for r in rows
        if chosen(r["workload"])
    ]
    if not body:
        return [f"no rows for {' '.join(workloads)}"]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in (head, *body)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ledger", default=str(LEDGER), help="default: %(default)s")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the ledger from SOURCES (folded: rows kept)")  # fmt: skip
    parser.add_argument("--results", default=str(RESULTS), help="where --rebuild reads")
    parser.add_argument("--table", nargs="+", metavar="WORKLOAD",
                        help="print these workloads' rows ('name*': a prefix)")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.rebuild and not args.table:
        parser.error("give --rebuild, --table WORKLOAD... or both")
    if args.rebuild:
        rows = rebuild(args.results, args.ledger)
        print(f"{len(rows)} rows -> {args.ledger}")
    if args.table:
        for line in table(read(args.ledger), args.table):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
