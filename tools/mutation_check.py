"""Mutation check: planted bugs that the test suite must catch (a maintainers' tool, not CI).

Each mutation is one precise source edit (``old`` -> ``new``, ``old`` found exactly once in
its file) planted in a fresh copy of the repository, with the tests that must catch it. For
each mutation the tool copies the repository (everything but .git and caches) into a
temporary directory, plants the bug, checks that ``fusebackend`` imports from the copy (the
package is installed editable from the checkout: ``PYTHONPATH=<copy>`` must win), and runs

    python3 -m pytest -q -x -p no:cacheprovider [-n N] <tests>

in the copy. Results: ``caught`` (pytest exit 1: a test failed), ``missed`` (exit 0: every
test passed with the bug in place) or ``broken`` (any other exit: collection or usage
error, no test selected, timeout; or the old text not found exactly once). A clean run of
every distinct selection comes first (``clean``: no mutation), to show the selections pass
without a bug. GPU-only mutations (``gpu=True``: behaviour the CPU interpreter cannot show)
run their ``-m gpu`` tests only where CUDA is available, else they are ``skipped``.

Usage (from the repository root; the whole list, clean runs included, took 7-9 min on a
2-core machine shared with other work):

    python3 tools/mutation_check.py                    # everything; writes docs/MUTATIONS.md
    python3 tools/mutation_check.py --list             # the mutations, their files and tests
    python3 tools/mutation_check.py --only NAME [--only NAME2]   # some (no table written)
    python3 tools/mutation_check.py --workers 2        # pytest-xdist -n 2 per selection
    python3 tools/mutation_check.py --rev HEAD         # copy a commit (git archive), not the
                                                       # working tree
    python3 tools/mutation_check.py --no-clean         # skip the clean run
    python3 tools/mutation_check.py --out FILE         # write the table elsewhere
    python3 tools/mutation_check.py --logs DIR         # keep each run's pytest output

Keep every mutation caught: a missed one means the suite lets that bug through; add or
strengthen a test (behaviour compared with eager PyTorch, never the source text), rerun
``--only NAME`` and commit the refreshed table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "MUTATIONS.md"
TIMEOUT_S = 1200  # one selection; past it the mutation counts as broken
_IGNORE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", ".hypothesis",
    ".benchmarks", "build", "dist", "*.pyc",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    family: str  # what it breaks: "kernel: ...", "pass: ...", "runtime: ..."
    file: str  # relative to the repository root
    old: str  # found exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, files, ``-k`` expressions
    gpu: bool = False  # only GPU-marked tests on a GPU can catch it
    note: str = ""


MUTATIONS: list[Mutation] = [
    # ---- the six planted bugs of issue 39 (a review at a4dc674)
    Mutation(
        "matmul_layernorm_var_k_minus_1",
        "kernel: matmul prologue (LayerNorm)",
        "fusebackend/kernels/matmul_triton.py",
        "rstd = tl.rsqrt(squares / K + eps)",
        "rstd = tl.rsqrt(squares / (K - 1) + eps)",
        (
            "tests/test_matmul_kernel.py::test_prologue_epilogue_matrix[layer-linear-float32-5x64]",
            "tests/test_matmul_groups.py",
            "-k",
            "layer",
        ),
        note="issue 39 #1",
    ),
    Mutation(
        "matmul_layernorm_var_k_minus_1_in_models",
        "kernel: matmul prologue (LayerNorm), seen from whole models",
        "fusebackend/kernels/matmul_triton.py",
        "rstd = tl.rsqrt(squares / K + eps)",
        "rstd = tl.rsqrt(squares / (K - 1) + eps)",
        ("tests/test_model_zoo.py", "-k", "cpu and (gpt2 or opt)"),
        note="issue 39: GPT-2 and OPT passed the zoo with this bug at a4dc674 (validation "
        "demoted them to eager, outputs stayed equal); the zoo tests assert mode fusion since "
        "a1d4d01",
    ),
    Mutation(
        "rotary_upper_half_reads_lower_bias",
        "kernel: rotary epilogue (q/k bias)",
        "fusebackend/kernels/matmul_triton.py",
        "hi = _add_bias(hi, bias + HALF, cols, N)",
        "hi = _add_bias(hi, bias, cols, N)",
        ("tests/test_rotary_epilogue.py", "tests/test_matmul_groups.py", "-k", "bias or qwen2"),
        note="issue 39 #2: missed at a4dc674 (zero biases); caught since a1d4d01 gave the q/k "
        "tests non-zero biases",
    ),
    Mutation(
        "demotion_drops_uncaptured_fusion_to_eager",
        "runtime: demotion",
        "fusebackend/runtime/modes.py",
        "new = Mode.FUSION if mode is Mode.FUSION else Mode.EAGER",
        "new = Mode.EAGER",
        (
            "tests/test_runtime.py",
            "tests/test_reliability.py",
            "-k",
            "chain or falls_back or capture",
        ),
        note="issue 39 #3",
    ),
    Mutation(
        "validation_mismatch_keeps_fused_writes",
        "runtime: first-run validation",
        "fusebackend/runtime/validation.py",
        "outputs, winner = expected, ref_args",
        "outputs = expected",
        ("tests/test_reliability.py", "-k", "validation"),
        note="issue 39 #4: missed at a4dc674; caught since a469a68 (tests/test_reliability.py::"
        "test_validation_mismatch_restores_written_input)",
    ),
    Mutation(
        "constants_fold_without_dtype_shape_device_check",
        "pass: constant folding",
        "fusebackend/passes/constants.py",
        "    if not isinstance(value, torch.Tensor) or "
        "(value.dtype, value.shape, value.device) != (\n"
        "        expected.dtype,\n"
        "        expected.shape,\n"
        "        expected.device,\n"
        "    ):\n",
        "    if not isinstance(value, torch.Tensor):\n",
        ("tests/test_graph_prep.py", "-k", "constant or fold or autocast"),
        note="issue 39 #5: missed at a4dc674; caught since a469a68 (the autocast / dtype / "
        "shape folding tests of tests/test_graph_prep.py)",
    ),
    Mutation(
        "constants_fold_returned_storages",
        "pass: constant folding",
        "fusebackend/passes/constants.py",
        "return storages | written_storages(graph.nodes)",
        "return written_storages(graph.nodes)",
        ("tests/test_graph_prep.py", "-k", "constant or fold or autocast"),
        note="issue 39 #6",
    ),
    # ---- kernel families
    Mutation(
        "row_mean_over_padded_block",
        "kernel: row reductions / norms",
        "fusebackend/kernels/codegen.py",
        '            count = "D"\n',
        '            count = "BLOCK_D"\n',
        ("tests/test_row_patterns.py", "-k", "norm and float32"),
        note="a mean over the block width, not the row's (rows not a power of two wide)",
    ),
    Mutation(
        "softmax_max_padding_is_zero",
        "kernel: softmax / amax",
        "fusebackend/kernels/codegen.py",
        """init = {"sum": "0.0", "mean": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}""",
        """init = {"sum": "0.0", "mean": "0.0", "max": "0.0", "min": 'float("inf")'}""",
        (
            "tests/test_row_rope_softmax.py",
            "-k",
            "softmax_is_one_group and float32 or row_max or negative_rows",
        ),
        note="masked columns count as 0 in a row max: wrong for all-negative rows",
    ),
    Mutation(
        "embedding_gather_assumes_contiguous_table",
        "kernel: embedding lookup",
        "fusebackend/kernels/codegen.py",
        'f"v{j} = tl.load({tab}_ptr + idx{j}[:, None] * {tab}_s0 + cols[None, :] * "',
        'f"v{j} = tl.load({tab}_ptr + idx{j}[:, None] * D + cols[None, :] * "',
        ("tests/test_reliability.py", "-k", "weight_layouts"),
        note="table rows addressed by the row width instead of the table's row stride",
    ),
    Mutation(
        "decode_attention_sum_not_rescaled",
        "kernel: decode attention",
        "fusebackend/kernels/decode_attention.py",
        "total = total * rescale + tl.sum(weight, axis=1)",
        "total = total + tl.sum(weight, axis=1)",
        ("tests/test_decode_attention.py", "-k", "several_blocks or split"),
        note="online softmax: the running sum is not rescaled when the max grows",
    ),
    Mutation(
        "cache_write_head_from_wrong_axis",
        "kernel: KV-cache write pair",
        "fusebackend/kernels/cache_write.py",
        "head = (program // rows) % heads",
        "head = program % heads",
        (
            "tests/test_cache_writes.py",
            "-k",
            "pair_kernel_equals or cache_pair",
        ),
        note="right for one new row (decode) and where rows and heads are coprime, "
        "wrong for a prefill whose rows and heads share a factor",
    ),
    Mutation(
        "matmul_gelu_tanh_square_not_cube",
        "kernel: matmul epilogue activation",
        "fusebackend/kernels/matmul_triton.py",
        "_tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))",
        "_tanh(0.7978845608028654 * (g + 0.044715 * g * g))",
        ("tests/test_matmul_kernel.py", "-k", "prologue_epilogue_matrix and gelu_tanh"),
    ),
    Mutation(
        "matmul_gemv_kn_strides_swapped",
        "kernel: matmul GEMV of weights stored [K, N]",
        "fusebackend/kernels/matmul_triton.py",
        "b = tl.load(w + ks[:, None] * w_k + cols[None, :] * w_n, mask=keep, other=0.0)",
        "b = tl.load(w + ks[:, None] * w_n + cols[None, :] * w_k, mask=keep, other=0.0)",
        ("tests/test_matmul_kernel.py", "-k", "along_n or stored_kn"),
        note="GPT-2's Conv1D GEMV walks its [K, N] weight with the N and K strides swapped",
    ),
    # ---- passes
    Mutation(
        "batch_norm_fold_never_refreshed",
        "pass: folded BatchNorms follow their parameters",
        "fusebackend/passes/batch_norm_folding.py",
        "list(map(_VERSION, current)) == self._versions",
        "True",
        ("tests/test_batch_norm_folding.py",),
        note="a weight edited in place after compiling leaves the folded conv's W' stale",
    ),
    Mutation(
        "out_of_place_readers_not_redirected",
        "pass: in-place ops made out-of-place",
        "fusebackend/passes/out_of_place.py",
        "                if reader is not node and position[reader] > position[node]:",
        "                if False:",
        ("tests/test_out_of_place.py",),
        note="readers after a rewritten in-place op keep reading the tensor it no longer writes",
    ),
    Mutation(
        "conv_bias_added_twice",
        "pass: a convolution's bias moved after it",
        "fusebackend/passes/conv_bias.py",
        "conv.args = (*conv.args[:2], None, *conv.args[3:])",
        "pass",
        ("tests/test_out_of_place.py",),
        note="the convolution keeps its bias and the group after it adds it again",
    ),
    Mutation(
        "half_precision_batch_norm_shift_dropped",
        "pass: folded BatchNorms follow their parameters",
        "fusebackend/passes/batch_norm_folding.py",
        "            self.bias.copy_(shift)",
        "            self.bias.zero_()",
        ("tests/test_batch_norm_folding.py",),
        note="the BatchNorm's shift is never applied after the convolution",
    ),
    Mutation(
        "channels_last_weight_copy_never_refreshed",
        "pass: channels-last graphs",
        "fusebackend/backend.py",
        "    if found.copies:",
        "    if found.copies and False:",
        ("tests/test_channels_last.py",),
        note="a weight edited after compiling leaves its channels-last copy stale",
    ),
    Mutation(
        "storage_order_output_not_permuted_back",
        "pass: elementwise groups in storage order",
        "fusebackend/passes/rewrite.py",
        "back = tuple(sorted(range(len(lowered.order)), key=lowered.order.__getitem__))",
        "back = lowered.order",
        ("tests/test_channels_last.py",),
        note="a channels-last group's outputs come back in the wrong dim order",
    ),
    Mutation(
        "channels_last_output_not_restored",
        "pass: channels-last graphs",
        "fusebackend/passes/channels_last.py",
        "            reader.replace_input_with(source, back)",
        "            pass",
        ("tests/test_channels_last.py",),
        note="a view() of a channels-last value raises; the graph's outputs change strides",
    ),
    Mutation(
        "spatial_mean_partial_sums_drop_the_last_part",
        "kernel: spatial mean",
        "fusebackend/kernels/spatial_mean.py",
        "        while part < parts:",
        "        while part < parts - 1:",
        ("tests/test_spatial_means.py",),
        note="a mean split over the positions loses its last part's sum",
    ),
    Mutation(
        "validation_noise_uncapped",
        "runtime: validation",
        "fusebackend/runtime/validation.py",
        "noise = noise if noise <= NOISE_CAP else 0.0",
        "noise = noise * 10",
        ("tests/test_runtime.py", "-k", "noise"),
        note="a model's own noise excuses any wrong fused kernel",
    ),
    Mutation(
        "stale_replay_kept",
        "runtime: derived constants",
        "fusebackend/runtime/graph_cache.py",
        "                    outputs = self._replay(entry, call)\n                return outputs",
        "                return outputs",
        ("tests/test_runtime.py", "-k", "derived_constants"),
        note="a replay that read a folded BatchNorm's old values is returned after an edit",
    ),
    Mutation(
        "reshape_moved_over_a_per_row_operand",
        "pass: reshapes",
        "fusebackend/passes/reshapes.py",
        "    sizes = list(operand.shape)\n",
        "    return True\n    sizes = list(operand.shape)\n",
        ("tests/test_reshapes.py",),
        note="an operand broadcast per row is read per channel after the reshape moves",
    ),
    Mutation(
        "parameter_work_not_refreshed",
        "pass: parameter work",
        "fusebackend/backend.py",
        "        c.refresh = Refresh([*folds, *found], c.example_inputs)\n    return [work.name",
        "        pass\n    return [work.name",
        ("tests/test_parameter_work.py",),
        note="a relative position bias keeps the values of the compile after a weight edit",
    ),
    Mutation(
        "empty_pad_dropped_though_its_input_is_written",
        "pass: empty pads",
        "fusebackend/passes/empty_pads.py",
        "example_value(pad))} & written:\n",
        "example_value(pad))} & set():\n",
        ("tests/test_empty_pads.py",),
        note="a pad's copy, dropped, sees a later in-place write to its input",
    ),
    Mutation(
        "concatenation_parts_written_at_offset_zero",
        "pass: concatenation writes",
        "fusebackend/passes/concat_writes.py",
        "        part.offset = offset\n",
        "        part.offset = 0\n",
        ("tests/test_concat_writes.py",),
        note="every group writes its part at the start of the buffer; the rest is garbage",
    ),
    Mutation(
        "pushed_operand_narrowed_at_the_wrong_offset",
        "pass: concatenation writes",
        "fusebackend/passes/concat_writes.py",
        "(n, dim, start - lo, stop - start)",
        "(n, dim, 0, stop - start)",
        ("tests/test_concat_writes.py",),
        note="every part of a concatenation gets the first part's slice of a residual",
    ),
    Mutation(
        "folded_copy_finer_dims_given_the_atoms_stride",
        "pass: folded copies",
        "fusebackend/passes/folded_copies.py",
        "inner_first.append((piece, stride * covered))",
        "inner_first.append((piece, stride))",
        ("tests/test_folded_copies.py",),
        note="a dim split finer than a copy's own split steps by the outer stride throughout",
    ),
    Mutation(
        "folded_read_starts_at_the_source_start",
        "pass: folded copies",
        "fusebackend/passes/folded_copies.py",
        "(read.source, sizes, strides, read.base, traced)",
        "(read.source, sizes, strides, 0, traced)",
        ("tests/test_folded_copies.py",),
        note="an operand read from inside its source is read from the source's first element",
    ),
    Mutation(
        "row_wise_program_rows_split",
        "pass: folded copies",
        "fusebackend/passes/folded_copies.py",
        "    return not (program.has_reduction or",
        "    return True or not (program.has_reduction or",
        ("tests/test_folded_copies.py",),
        note="a softmax's or norm's rows are split by a folded copy: it reduces part rows",
    ),
    Mutation(
        "gathered_row_numbers_reversed",
        "pass: gathered rows",
        "fusebackend/passes/gathered_rows.py",
        "    numbers = relative // row_stride\n",
        "    numbers = (relative // row_stride).flip(-1)\n",
        ("tests/test_folded_copies.py",),
        note="rows gathered or placed by a roll's table land in the wrong rows",
    ),
    Mutation(
        "placed_rows_stepped_by_the_column_stride",
        "kernels: row codegen",
        "fusebackend/kernels/codegen.py",
        '.to(tl.int64) * {prefix}_s0")',
        '.to(tl.int64) * {prefix}_sc")',
        ("tests/test_folded_copies.py",),
        note="a placed output's row number is multiplied by its column stride",
    ),
    Mutation(
        "softmax_moved_below_its_reshape_along_dim_0",
        "pass: reshapes",
        "fusebackend/passes/reshapes.py",
        "args, kwargs = (source, -1, *softmax.args[2:]), dict(softmax.kwargs)",
        "args, kwargs = (source, 0, *softmax.args[2:]), dict(softmax.kwargs)",
        ("tests/test_reshapes.py",),
        note="the softmax moved ahead of a reshape runs along the first dim",
    ),
    Mutation(
        "concatenation_destination_strides_ignored",
        "kernels: row launch",
        "fusebackend/kernels/launch.py",
        "            strides = _expand_strides(out_shape, given.stride(), shape)\n",
        "            strides = _expand_strides(out_shape, _contiguous_strides(out_shape), shape)\n",
        ("tests/test_concat_writes.py",),
        note="a part is written as a contiguous tensor over a view of the buffer",
    ),
    Mutation(
        "batch_norm_scale_and_shift_ignores_the_mean",
        "pass: BatchNorm folding",
        "fusebackend/passes/batch_norm_folding.py",
        "                self.center.copy_(mean if bias is None else mean - bias)",
        "                self.center.copy_(torch.zeros_like(mean))",
        ("tests/test_batch_norm_folding.py", "-k", "not_after_a_conv or cannot_fold"),
        note="BatchNorms applied as a scale and shift forget the running mean",
    ),
    Mutation(
        "partition_multi_dim_reduction_as_last_dim",
        "pass: partition (fusion checker)",
        "fusebackend/passes/ops.py",
        "if isinstance(dim, (list, tuple)) and len(dim) == 1:",
        "if isinstance(dim, (list, tuple)) and len(dim) >= 1:",
        ("tests/test_passes.py", "-k", "reduc or reject"),
        note="x.mean(dim=(-1, -2)) taken as a last-dim reduction",
    ),
    Mutation(
        "host_inputs_hoist_a_dtype_changing_move",
        "pass: host inputs",
        "fusebackend/passes/host_inputs.py",
        "        and result.dtype == source.dtype\n",
        "",
        ("tests/test_graph_prep.py", "-k", "hoist or host_input"),
        note="ids.to('cuda', torch.float32) staged as a plain copy: the cast is lost",
    ),
    Mutation(
        "collectives_drop_copy_despite_earlier_reader",
        "pass: collectives",
        "fusebackend/passes/collectives.py",
        "    if (set(source.users) - {reduce, copy}) & set(nodes_between(source, copy)):\n"
        "        return None\n",
        "",
        ("tests/test_tensor_parallel.py", "-k", "copy"),
        note="a reader of x between the all-reduce and the copy is handed the reduced x",
    ),
    Mutation(
        "lowering_comparison_scalar_not_rounded",
        "pass: lowering",
        "fusebackend/passes/lowering.py",
        "                return torch.tensor(value, dtype=dtype).item()\n",
        "                return value\n",
        ("tests/test_ops_table.py", "-k", "compare_with_python_scalar"),
        note="x == 0.1 on fp16 compares with fp32 0.1, not fp16(0.1) as eager does",
    ),
    # ---- runtime rules
    Mutation(
        "row_kernel_index_assert_compiled_out",
        "kernel: row kernel lookups (device-side index check)",
        "fusebackend/kernels/codegen.py",
        'f"@triton.jit(debug={self.options.index_checks and bool(self.p.lookups)}, "',
        'f"@triton.jit(debug=False, "',
        ("tests/test_reliability_gpu.py", "-k", "device_side_assert and not first"),
        gpu=True,
        note="GPU-only: an out-of-range id reads zeros instead of stopping the kernel (the "
        "CPU checks ids on the host before the kernel runs; the CPU suite passes with it). "
        "Last GPU run: caught on an H200 (torch 2.11, 2026-11-28) by "
        "test_out_of_range_index_through_torch_compile_is_a_device_side_assert"
        "[replay-options2-100] in 28 s; its selection passed clean in 56 s",
    ),
    Mutation(
        "per_signature_inputs_copied_per_replay",
        "runtime: per-signature inputs",
        "fusebackend/runtime/recapture.py",
        """        if not self._per_signature_count:
            return self._static
        n = len(args)""",
        """        if True:
            return self._static
        n = len(args)""",
        ("tests/test_signature_constants.py", "-k", "once_per_signature"),
        note="an entry's per-signature tensors captured as copied inputs: right values, but "
        "every replay copies them again",
    ),
    Mutation(
        "key_ignores_fusion_switch",
        "runtime: graph cache key",
        "fusebackend/runtime/keys.py",
        "self._has_fused and fusion_enabled(),",
        "self._has_fused,",
        ("tests/test_runtime.py",),
    ),
    Mutation(
        "replay_returns_static_output_buffers",
        "runtime: output ownership",
        "fusebackend/runtime/graph_cache.py",
        "result.append(out.clone() if clone else out)",
        "result.append(out)",
        ("tests/test_runtime.py",),
        note="a later call overwrites the outputs the caller kept",
    ),
    Mutation(
        "eviction_hits_do_not_refresh_recency",
        "runtime: eviction",
        "fusebackend/runtime/graph_cache.py",
        "            self._table.touch(key)\n",
        "",
        ("tests/test_runtime.py",),
        note="max_graphs evicts the oldest inserted, not the least recently used",
    ),
    Mutation(
        "fallback_reason_forgets_earlier_steps",
        "runtime: fallback reasons",
        "fusebackend/runtime/modes.py",
        'step if previous is None else f"{previous}; {step}"',
        "step",
        ("tests/test_runtime.py",),
    ),
    Mutation(
        "mismatch_counted_as_fusion_success",
        "runtime: stats counters",
        "fusebackend/runtime/validation.py",
        "    if failure is None and first:\n",
        "    if first:\n",
        ("tests/test_runtime.py", "tests/test_reliability.py", "-k", "valid or stats"),
    ),
    Mutation(
        "failed_validation_class_marked_validated",
        "runtime: validation classes",
        "fusebackend/runtime/graph_cache.py",
        "        if validate and failure is None:\n            self._validated.add(cls)\n",
        "        if validate:\n            self._validated.add(cls)\n",
        ("tests/test_runtime.py", "-k", "valid or compared_again"),
        note="after a mismatch the class's next shape runs fused unchecked",
    ),
    Mutation(
        "matmul_operand_copy_given_its_order_as_inverse",
        "pass: matmul operands",
        "fusebackend/passes/matmul_operands.py",
        "    inverse = tuple(order.index(d) for d in range(len(order)))\n",
        "    inverse = order\n",
        ("tests/test_matmul_operands.py",),
        note="the one copy of a packed q/k/v is viewed back in the wrong dim order",
    ),
    Mutation(
        "matmul_operand_ready_without_a_unit_stride",
        "pass: matmul operands",
        "fusebackend/passes/matmul_operands.py",
        "    if col_stride == 1 and row_stride >= max(1, cols):",
        "    if row_stride >= max(1, cols):",
        ("tests/test_matmul_operands.py",),
        note="an operand ATen copies (no unit-stride matrix dim) is taken as ready for bmm",
    ),
    Mutation(
        "matmul_operand_copy_leaves_stale_layouts_below",
        "pass: matmul operands",
        "fusebackend/passes/matmul_operands.py",
        "        if not _same_layout(value, example_value(node)):",
        "        if False:",
        ("tests/test_matmul_operands.py",),
        note="nodes below the copy keep their traced strides (Swin's q * scale)",
    ),
    Mutation(
        "matmul_scale_dropped",
        "pass: matmul operands",
        "fusebackend/passes/matmul_operands.py",
        "    return first, float(second) if is_mul else 1.0 / float(second)\n",
        "    return first, 1.0 if is_mul else 1.0 / float(second)\n",
        ("tests/test_matmul_operands.py",),
        note="a q scaled by a number loses its scale when the product takes it",
    ),
    Mutation(
        "lone_copy_negates",
        "pass: lone copies",
        "fusebackend/passes/lone_copies.py",
        'instrs=(Instr("cast", (InputRef(0),), value.dtype),),',
        'instrs=(Instr("neg", (InputRef(0),), value.dtype),),',
        ("tests/test_lone_copies.py",),
        note="a copy run as a row kernel computes instead of moving values",
    ),
    Mutation(
        "lone_copy_reshape_viewed_as_its_source",
        "pass: lone copies",
        "fusebackend/passes/lone_copies.py",
        "    if tuple(value.shape) != tuple(example_value(node).shape):",
        "    if False:",
        ("tests/test_lone_copies.py",),
        note="a copying reshape run as a row kernel keeps its source's shape",
    ),
    Mutation(
        "lone_copy_of_rows_read_across",
        "pass: lone copies",
        "fusebackend/passes/lone_copies.py",
        "        and value.stride(-1) == 1\n",
        "\n",
        ("tests/test_lone_copies.py",),
        note="a transpose of the last two dims is run as a row kernel reading across rows",
    ),
    Mutation(
        "epilogue_skips_a_rounding",
        "kernels: epilogue",
        "fusebackend/kernels/epilogue.py",
        '        Instr("mul", (ValueRef(3), Const.of(math.sqrt(2.0 / math.pi))), dtype),  # v4\n',
        '        Instr("mul", (ValueRef(3), Const.of(math.sqrt(2.0 / math.pi))), torch.float32),\n',
        (
            "tests/test_epilogue.py",
            "tests/test_matmul_kernel.py::test_gelu_new_rounds_where_eager_rounds_op_by_op",
        ),  # noqa: E501
        note="NewGELU's fourth product kept in fp32 where eager rounds it to the dtype",
    ),
    Mutation(
        "epilogue_input_read_as_its_negation",
        "kernels: epilogue",
        "fusebackend/kernels/epilogue.py",
        '            self.emit(self.outer, f"x{slot} = in{slot}.to({self.compute})")',
        '            self.emit(self.outer, f"x{slot} = -in{slot}.to({self.compute})")',
        ("tests/test_epilogue.py",),
        note="the matmul kernel's activation function reads its input wrongly",
    ),
    Mutation(
        "matmul_tail_ends_early",
        "pass: matmul groups",
        "fusebackend/passes/lowering.py",
        "    return RowProgram(tuple(b.dtypes), (), tuple(b.instrs), (b.values[nodes[-1]],))",
        "    return RowProgram(tuple(b.dtypes), (), tuple(b.instrs), (b.values[nodes[0]],))",
        ("tests/test_matmul_groups.py",),
        note="an elementwise tail in the matmul launch returns its first value, not its last",
    ),
    Mutation(
        "matmul_tail_taken_past_an_outside_read",
        "pass: matmul groups",
        "fusebackend/passes/activations.py",
        "        if set(y.users) <= members and read_outside == [tail[-1]]:",
        "        if read_outside[-1:] == [tail[-1]]:",
        ("tests/test_matmul_groups.py",),
        note="a tail whose middle value is read outside is taken whole (that read is lost)",
    ),
    Mutation(
        "matmul_tail_crosses_a_write",
        "pass: matmul groups",
        "fusebackend/passes/activations.py",
        "        if is_mutation(node):\n",
        "        if False:\n",
        ("tests/test_matmul_groups.py::test_a_tail_stops_at_a_write_and_the_group_still_forms",),
        note="a tail grown past an in-place write makes the whole group unsafe and left alone",
    ),
    Mutation(
        "capture_leaves_a_read_input_unchecked",
        "runtime: capture",
        "fusebackend/runtime/recording.py",
        "    return frozenset(i for i, node in enumerate(inputs) if not node.users)",
        "    return frozenset(i for i, node in enumerate(inputs) if len(node.users) <= 1)",
        ("tests/test_runtime.py", "tests/test_batch_norm_folding.py"),
        note="an input the captured graph reads once is neither copied in nor address-checked",
    ),
    Mutation(
        "concat_row_part_shifted_by_the_column_stride",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        'address = (f"{prefix}_ptr + ({row} - {lo} * {prefix}_cs)[:, None] + "',
        'address = (f"{prefix}_ptr + ({row} - {lo} * {prefix}_sc)[:, None] + "',
        ("tests/test_concatenation.py",),
        note="a part of a row-dim concatenation read at its offset times the wrong stride",
    ),
    Mutation(
        "concat_column_part_off_by_one",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        'address = f"{prefix}_ptr + {row}[:, None] + (cols - {lo})[None, :] * {prefix}_sc"',
        'address = f"{prefix}_ptr + {row}[:, None] + (cols - {lo} + 1)[None, :] * {prefix}_sc"',
        ("tests/test_concatenation.py",),
        note="a part of a column concatenation read one column late",
    ),
    Mutation(
        "concat_row_index_from_the_wrong_divisor",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        "cc{i} = ((rows.to(R.dtype) // cat{i}_inner) % cat{i}_n)",
        "cc{i} = ((rows.to(R.dtype) // cat{i}_n) % cat{i}_n)",
        ("tests/test_concatenation.py",),
        note="a row's index along the concatenation's dim from the wrong row count",
    ),
    Mutation(
        "concat_parts_picked_in_reverse",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        'value = f"tl.where({mask}, {load}, {value})"',
        'value = f"tl.where({mask}, {value}, {load})"',
        ("tests/test_concatenation.py",),
        note="each element takes the other part's value",
    ),
    Mutation(
        "integers_computed_in_fp32",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        'return "tl.int64" if dtype in INTEGER_DTYPES else self.compute',
        "return self.compute if dtype in INTEGER_DTYPES else self.compute",
        ("tests/test_integers.py",),
        note="integer values computed in fp32: ids above 2**24 round to their neighbours",
    ),
    Mutation(
        "int32_results_never_wrapped",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        "            rounds = dtype != torch.int64\n",
        "            rounds = False\n",
        ("tests/test_integers.py",),
        note="int32 arithmetic keeps int64's range instead of wrapping as eager's does",
    ),
    Mutation(
        "scan_chunks_forget_the_running_sum",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        'self.emit(scope, f"carry{index}_{self.loops} += tl.sum(s{index}, axis=1, "',
        'self.emit(scope, f"carry{index}_{self.loops} += 0 * tl.sum(s{index}, axis=1, "',
        ("tests/test_integers.py",),
        note="a chunked row's prefix sums restart at every chunk",
    ),
    Mutation(
        "concat_of_a_group_value",
        "pass: partition",
        "fusebackend/passes/partition.py",
        "            if part in self.members:\n                return _concat_reason(part)\n",
        "            if False:\n                return _concat_reason(part)\n",
        ("tests/test_concatenation.py",),
        note="a concatenation joins a group that computes one of its parts",
    ),
    Mutation(
        "arange_axes_out_of_order",
        "pass: index_views",
        "fusebackend/passes/index_views.py",
        "    if any(a >= b for (a, _), (b, _) in zip(placed, placed[1:])):\n",
        "    if any(a > b + 99 for (a, _), (b, _) in zip(placed, placed[1:])):\n",
        ("tests/test_index_views.py",),
        note="indices laid along swapped axes (a transpose) read as a reshape",
    ),
    Mutation(
        "arange_index_of_a_written_tensor",
        "pass: index_views",
        "fusebackend/passes/index_views.py",
        "        if {storage_id(example_value(source)), storage_id(example_value(node))} & "
        "written:\n",
        "        if False:\n",
        ("tests/test_index_views.py",),
        note="a gather of a tensor the graph writes later read as a view of it",
    ),
    Mutation(
        "empty_part_cat_of_a_written_copy",
        "pass: concatenation",
        "fusebackend/passes/concatenation.py",
        "            free = written is not None and not storages & written\n",
        "            free = True\n",
        ("tests/test_concatenation.py",),
        note="a cat of one part and empty ones read as that part where the graph writes the cat",
    ),
    Mutation(
        "empty_part_cat_of_another_layout",
        "pass: concatenation",
        "fusebackend/passes/concatenation.py",
        "            if free and (kept or _reads_any_layout(node)):\n",
        "            if free:\n",
        ("tests/test_concatenation.py",),
        note="a cat's one part of other strides read in its place by a view that needs the cat's",
    ),
    Mutation(
        "small_tiles_configured_by_their_rows",
        "kernels: configs",
        "fusebackend/kernels/configs.py",
        "    if rows * width <= QUANTIZED_TILE_ELEMENTS:\n",
        "    if False:\n",
        ("tests/test_index_views.py",),
        note="a small group's launch config follows its rows and width: a binary per new length",
    ),
    Mutation(
        "shared_value_across_a_write",
        "pass: common_values",
        "fusebackend/passes/common_values.py",
        "        if first is None or _written_between(writes, position[first], position[node], "
        "node):\n",
        "        if first is None:\n",
        ("tests/test_common_values.py",),
        note="a value computed again after its operand was written in place reads the old one",
    ),
    Mutation(
        "shared_value_returned_twice",
        "pass: common_values",
        "fusebackend/passes/common_values.py",
        "    excluded = written | {storage_id(example_value(a)) for a in output.all_input_nodes}\n",
        "    excluded = written\n",
        ("tests/test_common_values.py",),
        note="two equal outputs merged into one tensor",
    ),
    Mutation(
        "shared_random_draws",
        "pass: common_values",
        "fusebackend/passes/common_values.py",
        "    if is_mutation(node) or is_random(node):\n",
        "    if is_mutation(node):\n",
        ("tests/test_common_values.py",),
        note="two random draws merged into one",
    ),
    Mutation(
        "interleaved_rotation_swaps_the_wrong_columns",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        "(cols % 2 == 0)[None, :]",
        "(cols % 2 == 1)[None, :]",
        ("tests/test_row_rope_softmax.py",),
        note="rotate_every_two's even columns read the previous column, odd ones the next",
    ),
    Mutation(
        "interleaving_without_a_swap_is_a_rotation",
        "pass: rotation",
        "fusebackend/passes/rotation.py",
        "    if src0 is not src1 or (odd0, odd1) != (1, 0):\n",
        "    if src0 is not src1:\n",
        ("tests/test_row_rope_softmax.py",),
        note="a stack of every other column in order (x itself) matched as a pair swap",
    ),
    Mutation(
        "permuted_mask_left_as_traced",
        "pass: attention",
        "fusebackend/passes/attention.py",
        "        if value.stride(-1) in (0, 1):\n",
        "        if True:\n",
        ("tests/test_attention.py",),
        note="T5's permuted position-bias mask reaches SDPA with its keys at stride heads",
    ),
    Mutation(
        "zero_dim_values_never_join",
        "pass: partition",
        "fusebackend/passes/partition.py",
        "        if value.dim() == 0 and not (upstream and call.op.kind == OpKind.ELEMENTWISE):\n",
        "        if value.dim() == 0:\n",
        ("tests/test_row_patterns.py",),
        note="T5's clamp bound (where of a 0-d flag, its negation) left as aten launches",
    ),
    Mutation(
        "constants_are_not_parameter_work_sources",
        "pass: parameter_work",
        "fusebackend/passes/parameter_work.py",
        '        if n.op == "get_attr" and str(n.target).startswith(CONSTANT_PREFIX)\n',
        '        if n.op == "get_attr" and False\n',
        ("tests/test_parameter_work.py",),
        note="GPT-J's sine table gathered by constant positions left to run every call",
    ),
    Mutation(
        "partial_rotary_pass_columns_scaled_by_zero",
        "pass: partial_rotary",
        "fusebackend/passes/partial_rotary.py",
        "            cos_w = _padded(graph, pads, cos, width, 1.0)\n",
        "            cos_w = _padded(graph, pads, cos, width, 0.0)\n",
        ("tests/test_row_rope_softmax.py",),
        note="the pass-through columns of a partial rotary embedding multiplied by 0",
    ),
    Mutation(
        "partial_rotation_wraps_at_the_row_end",
        "kernels: codegen",
        "fusebackend/kernels/codegen.py",
        '        width = str(rot.width) if rot.width else "D"  '
        "# the columns rotated; 0 after them\n",
        '        width = "D"\n',
        ("tests/test_row_rope_softmax.py",),
        note="a rotation of the first r columns wraps at the head's width instead of r",
    ),
    Mutation(
        "empty_part_cat_read_through_views_of_other_strides",
        "pass: concatenation",
        "fusebackend/passes/concatenation.py",
        "        if not same_layout(values[chain[-1]], example_value(chain[-1])):\n",
        "        if False:\n",
        ("tests/test_concatenation.py",),
        note="a cat's part of other strides read in its place by views that keep those strides",
    ),
    Mutation(
        "shared_collectives",
        "pass: common_values",
        "fusebackend/passes/common_values.py",
        "    if isinstance(node.target, torch._ops.HigherOrderOperator) or _communicates(node):\n",
        "    if isinstance(node.target, torch._ops.HigherOrderOperator):\n",
        ("tests/test_common_values.py",),
        note="two all-reduces of one value merged: a rank issues fewer collectives than traced",
    ),
    Mutation(
        "isinf_never_true",
        "kernels: expressions",
        "fusebackend/kernels/expressions.py",
        """    "isinf": _unary('(tl.abs({}) == float("inf"))'),\n""",
        """    "isinf": _unary('(tl.abs({}) > float("inf"))'),\n""",
        ("tests/test_row_patterns.py",),
        note="T5's overflow check never sees an infinity",
    ),
    Mutation(
        "any_of_one_true_is_false",
        "pass: lowering",
        "fusebackend/passes/lowering.py",
        '    found = b.add(Instr("gt", (count, Const.of(0.0)), torch.bool))\n',
        '    found = b.add(Instr("gt", (count, Const.of(1.0)), torch.bool))\n',
        ("tests/test_row_patterns.py",),
        note="a row's any needs two true values",
    ),
    Mutation(
        "conv_relu_drops_the_residual",
        "kernels: conv",
        "fusebackend/kernels/conv.py",
        "    return torch.relu(out if residual is None else out + residual)\n",
        "    return torch.relu(out)\n",
        ("tests/test_conv_activation.py",),
        note="a bottleneck's last convolution + ReLU without its shortcut",
    ),
    Mutation(
        "conv_activation_takes_the_later_shortcut_conv_too",
        "pass: conv_activation",
        "fusebackend/passes/conv_activation.py",
        "    if mine is not None and theirs is not None and _comes_before(theirs, mine):\n",
        "    if False:\n",
        ("tests/test_conv_activation.py",),
        note="a projected shortcut's BatchNorm folded into fp16 weights that gain no fused call",
    ),
    Mutation(
        "nearer_float32_by_any_margin",
        "runtime: validation",
        "fusebackend/runtime/validation.py",
        "        if fused_far > WIDE_SLACK * eager_far + atol:\n",
        "        if fused_far > 10 * WIDE_SLACK * eager_far + atol:\n",
        ("tests/test_runtime.py",),
        note="a half graph 10% off passes as nearer float32 than eager",
    ),
    Mutation(
        "parameter_work_before_a_write",
        "pass: parameter_work",
        "fusebackend/passes/parameter_work.py",
        "        if _written(node, written):\n",
        "        if False:\n",
        ("tests/test_parameter_work.py",),
        note="BEiT's index summed as made, before the graph writes into it",
    ),
    Mutation(
        "parameter_work_into_an_expanded_buffer",
        "pass: parameter_work",
        "fusebackend/passes/parameter_work.py",
        "        if size > budget or _overlaps_itself(value):\n",
        "        if size > budget:\n",
        ("tests/test_parameter_work.py",),
        note="a rotary embedding's expanded inv_freq folded into a buffer no copy can write",
    ),
    Mutation(
        "channels_last_for_any_number_of_convolutions",
        "pass: channels-last graphs",
        "fusebackend/passes/channels_last.py",
        "    if nodes >= _NODES_PER_CONVOLUTION * len(convs):\n",
        "    if nodes >= _NODES_PER_CONVOLUTION * len(convs) * 1000:\n",
        ("tests/test_channels_last.py",),
        note="a ViT's one patch embedding made channels-last: the image's conversion and "
        "cuDNN's channel padding cost kernels the layout does not save",
    ),
    Mutation(
        "batch_norm_fold_ignores_training_steps",
        "pass: BatchNorm folding",
        "fusebackend/passes/batch_norm_folding.py",
        "        fold.counter = counters.get(id(inputs[fold.sources[2]]))\n",
        "        fold.counter = None\n",
        ("tests/test_batch_norm_folding.py",),
        note="running statistics a train-mode forward updated (no version counter moves) "
        "leave the folds stale",
    ),
    Mutation(
        "matmul_residual_tail_skipped",
        "kernel: matmul group",
        "fusebackend/kernels/matmul_triton.py",
        "        y = TAIL(y.to(tl.float32)).to(y.dtype)\n",
        "        y = y\n",
        ("tests/test_matmul_groups.py", "-k", "residual_tail or distilled"),
        note="the elementwise ops after a residual add (LeViT's head halving) never run",
    ),
    Mutation(
        "axis_reduction_kept_dims_reversed",
        "pass: reductions along rows",
        "fusebackend/passes/axis_reductions.py",
        "    order = [d for d in range(rank) if d != dim] + [dim]\n",
        "    order = [d for d in range(rank) if d != dim][::-1] + [dim]\n",
        ("tests/test_axis_reductions.py",),
        note="the permuted view lays the kept dims out in the wrong order",
    ),
    Mutation(
        "depthwise_window_row_off_by_one",
        "kernel: depthwise convolution",
        "fusebackend/kernels/depthwise_conv.py",
        "            ih = oh * STRIDE_H - pad_h + kh * dilation_h\n",
        "            ih = oh * STRIDE_H - pad_h + kh * dilation_h + (kh == KH - 1)\n",
        ("tests/test_depthwise.py",),
        note="the window's last row is read one row too low",
    ),
    Mutation(
        "depthwise_residual_dropped",
        "kernel: depthwise convolution",
        "fusebackend/kernels/depthwise_conv.py",
        "            value = (value.to(tl.float32) + added).to(out.dtype.element_ty)\n",
        "            value = value\n",
        ("tests/test_depthwise.py",),
        note="the residual (GhostNet's shortcut) is loaded but never added",
    ),
    Mutation(
        "depthwise_broadcast_residual_taken",
        "pass: depthwise convolutions",
        "fusebackend/passes/depthwise.py",
        "        if _layout(example_value(add)) != _layout(value) or _another_tensor(residual, "
        "value):\n",
        "        if _layout(example_value(add)) != _layout(value):\n",
        ("tests/test_depthwise.py",),
        note="an add of a per-channel vector (broadcast) becomes the residual, which the "
        "kernel reads as a tensor of the value's shape",
    ),
    Mutation(
        "compile_processes_skipped",
        "runtime: precompile",
        "fusebackend/kernels/triton_api.py",
        "        if processes > 1 and len(compiles) > 1:\n",
        "        if False:\n",
        ("tests/test_forked_compiles.py",),
        note="the precompile's compiles never go to forked processes: they hold the GIL on "
        "its threads again",
    ),
    Mutation(
        "cancelled_compiles_not_notified",
        "runtime: precompile",
        "fusebackend/kernels/triton_api.py",
        "                    future.set_running_or_notify_cancel()\n",
        "                    pass\n",
        ("tests/test_forked_compiles.py",),
        note="an interrupted precompile cancels its compiles without telling as_completed: "
        "the call waits forever instead of raising",
    ),
    Mutation(
        "compile_queue_not_shared",
        "runtime: precompile",
        "fusebackend/kernels/forked_compiles.py",
        "                compiles[_RECORD.unpack(record)[0]]()\n",
        "                [c() for c in compiles]\n",
        ("tests/test_forked_compiles.py",),
        note="every child runs every compile instead of the next one no other has taken",
    ),
    Mutation(
        "launchers_built_optimised",
        "runtime: precompile",
        "fusebackend/kernels/triton_api.py",
        "        knobs.build.impl = before or _unoptimised_build\n",
        "        knobs.build.impl = before\n",
        ("tests/test_forked_compiles.py",),
        note="the compile processes build each launcher at Triton's -O3, about twice the "
        "build time, on the first call's path",
    ),
    Mutation(
        "launcher_build_keeps_o3",
        "runtime: precompile",
        "fusebackend/kernels/triton_api.py",
        'source, "-O0", "-shared"',
        'source, "-O3", "-shared"',
        ("tests/test_forked_compiles.py",),
        note="the unoptimised build is Triton's optimised one: no time saved",
    ),
    Mutation(
        "shortcut_drops_dtype",
        "pass: example values",
        "fusebackend/passes/fx_util.py",
        "    return torch.empty_like(first, dtype=traced.dtype)",
        "    return torch.empty_like(first)",
        ("tests/test_evaluate_shortcut.py",),
        note="an elementwise op's shortcut value takes its first operand's dtype, not type "
        "promotion's (a half times a float is half)",
    ),
    Mutation(
        "shortcut_mixes_layouts",
        "pass: example values",
        "fusebackend/passes/fx_util.py",
        "    if not all(_same_sizes(t.stride(), first.stride()) for t in full):",
        "    if not full:",
        ("tests/test_evaluate_shortcut.py",),
        note="operands of two layouts get the first one's: eager's TensorIterator may pick "
        "the other",
    ),
    Mutation(
        "in_place_shortcut_promotes",
        "pass: example values",
        "fusebackend/passes/fx_util.py",
        "        and all(t.dtype == traced.dtype for t in tensors)",
        "        and True",
        ("tests/test_evaluate_shortcut.py",),
        note="an in-place op's out-of-place value keeps the written tensor's dtype where an "
        "operand of another dtype promotes it: make_out_of_place would rewrite a casting write",
    ),
    Mutation(
        "erased_group_renamed",
        "pass: copies folded",
        "fusebackend/copies.py",
        "        if node not in live or (op, node.args) == traced",
        "        if node.graph is not c.graph or (op, node.args) == traced",
        ("tests/test_row_models.py::test_tiny_bamba_runs_fused_equal_eager",),
        note="a group the copy folding's dead-code elimination erased is read again (its "
        "arguments are None): the pass raises and the graph runs unfused",
    ),
    Mutation(
        "vmapped_ops_grouped",
        "pass: fusion partition",
        "fusebackend/passes/fx_util.py",
        '        if name == "_add_batch_dim" or (\n',
        '        if name == "_no_such_op" or (\n',
        ("tests/test_passes.py", "tests/test_row_models.py"),
        note="ops inside an inlined torch.vmap join groups: their kernels cannot read "
        "batched tensors and every fused run falls back",
    ),
    Mutation(
        "pass_error_fails_the_compile",
        "backend: pass failures",
        "fusebackend/fusion.py",
        "    except Exception as exc:  # noqa: BLE001  (a pass's bug: the graph runs as traced, "
        "captured)\n",
        "    except ZeroDivisionError as exc:\n",
        ("tests/test_reliability.py",),
        note="a fusion pass that raises fails the user's compile instead of leaving the "
        "graph unfused",
    ),
    Mutation(
        "split_of_parameter_work_as_a_tensor",
        "pass: parameter work",
        "fusebackend/passes/parameter_work.py",
        '                 "movedim", "swapaxes", "detach", "split", "tensor_split", "chunk",\n',
        '                 "movedim", "swapaxes", "detach", "split", "chunk",\n',
        ("tests/test_parameter_work.py",),
        note="a tensor_split of derived work is not read as a view: nothing is derived, or "
        "(without the tensor check) the compile asks a tuple its size",
    ),
    Mutation(
        "traced_holder_never_found",
        "pass: BatchNorm folding (batch counters)",
        "fusebackend/passes/traced_sources.py",
        "    if base is None or frame is None:\n",
        "    if True:\n",
        ("tests/test_batch_norm_folding.py", "-k", "batch_counters or traced"),
        note="every running mean's counter comes from the garbage collector's scan of every "
        "object (0.3 s with big libraries loaded), as before traced_sources",
    ),
    Mutation(
        "traced_holder_items_skipped",
        "pass: BatchNorm folding (batch counters)",
        "fusebackend/passes/traced_sources.py",
        "                value = value[index]\n",
        "                value = value\n",
        ("tests/test_batch_norm_folding.py", "-k", "batch_counters or traced"),
        note="a source's item is not taken: the holder found is the dict's owner (a module), "
        "not the buffer dict",
    ),
    Mutation(
        "cache_key_early_asks_for_a_gpu",
        "runtime: first call (Triton's cache key)",
        "fusebackend/fusion.py",
        '    if torch.cuda.is_initialized() and triton_usable(torch.device("cuda")):',
        '    if triton_usable(torch.device("cuda")):',
        ("tests/test_first_call_costs.py", "-k", "cache_key"),
        note="the key's early start asks for a GPU in a process that has not initialised "
        "CUDA (initialising it: a fork afterwards could not use CUDA in its children)",
    ),
    Mutation(
        "cache_key_early_asks_before_checking_cuda",
        "runtime: first call (Triton's cache key)",
        "fusebackend/fusion.py",
        '    if torch.cuda.is_initialized() and triton_usable(torch.device("cuda")):',
        '    if triton_usable(torch.device("cuda")) and torch.cuda.is_initialized():',
        ("tests/test_first_call_costs.py", "-k", "cache_key"),
        note="the early start asks for a GPU (initialising the CUDA driver) before it checks "
        "that the process already uses CUDA",
    ),
    Mutation(
        "cache_key_not_registered_at_import",
        "runtime: first call (Triton's cache key)",
        "fusebackend/backend.py",
        "\n\nregister_cache_key_start()\n",
        "\n",
        ("tests/test_first_call_costs.py", "-k", "cache_key or registered"),
        note="the callback is registered only by a graph: a process's first trace, the one "
        "the early start is for, runs without it",
    ),
    Mutation(
        "cache_key_started_after_the_trace",
        "runtime: first call (Triton's cache key)",
        "fusebackend/backend.py",
        "        callback_handler.register_start_callback(_start_cache_key_at_compile)",
        "        callback_handler.register_end_callback(_start_cache_key_at_compile)",
        ("tests/test_first_call_costs.py", "-k", "cache_key"),
        note="the key starts as the compile ends (an end callback), after the trace and the "
        "backend it was to overlap",
    ),
    Mutation(
        "cache_key_early_lost_after_reset",
        "runtime: first call (Triton's cache key)",
        "fusebackend/backend.py",
        "    fuse_module.warm_compiler(device)\n    register_cache_key_start()\n",
        "    fuse_module.warm_compiler(device)\n",
        ("tests/test_first_call_costs.py", "-k", "cache_key"),
        note="torch._dynamo.reset() drops Dynamo's callbacks and no graph registers the "
        "early start again: where the reset came before the process's first CUDA graph, "
        "later compiles start the key only at their graph",
    ),
    # ---- the heaviest compiles first; a depthwise window's rows in a loop (d92c6ad)
    Mutation(
        "compiles_in_graph_order",
        "runtime: first call (the compile processes' order)",
        "fusebackend/fusion.py",
        "key=lambda weighted: -weighted[0]",
        "key=lambda weighted: 0",
        ("tests/test_first_call_costs.py", "-k", "heaviest or depthwise_compile"),
        note="the jobs run in the graph's order: a process that ran short compiles takes a "
        "long one last",
    ),
    Mutation(
        "depthwise_row_loop_drops_a_row",
        "kernel: depthwise convolution (row loop)",
        "fusebackend/kernels/depthwise_triton.py",
        "for kh in range(KH):",
        "for kh in range(KH - 1):",
        ("tests/test_depthwise.py", "-k", "equals_atens"),
        note="a window over 3 x 3 loses its last row",
    ),
    Mutation(
        "depthwise_row_loop_never_taken",
        "kernel: depthwise convolution (row loop)",
        "fusebackend/kernels/depthwise_conv.py",
        "    return kh * kw > 9",
        "    return False",
        ("tests/test_depthwise.py", "-k", "only_windows"),
        note="every window unrolled again: the 5 x 5 compiles back to the longest",
    ),
    Mutation(
        "compile_weight_raises_through",
        "runtime: first call (the compile processes' order)",
        "fusebackend/kernels/family.py",
        "    try:\n        weight = answer(args)\n    except Exception as exc:  # noqa: BLE001  "
        '(an ordering hint never fails a compile)\n        log.debug("compile_weight of %s raised '
        '%r: weighed 1.0", family.describe(), exc)\n        return 1.0\n',
        "    weight = answer(args)\n",
        ("tests/test_first_call_costs.py", "-k", "weigh"),
        note="a family's weight that raises fails the precompile pass: the graph runs unfused",
    ),
    Mutation(
        "compile_weight_guards_a_symbol",
        "runtime: first call (the compile processes' order)",
        "fusebackend/kernels/family.py",
        "    return float(weight) if isinstance(weight, (int, float)) else 1.0",
        "    return float(weight)",
        ("tests/test_first_call_costs.py", "-k", "weigh"),
        note="a weight read off symbolic sizes is turned into a float: a guard on the size",
    ),
    # ---- GroupNorm with its activation (kernels/group_norm.py, passes/group_norms.py)
    Mutation(
        "group_norm_parts_read_past_their_count",
        "kernel: GroupNorm (rows split into parts)",
        "fusebackend/kernels/group_norm_triton.py",
        "tl.load(slots, mask=k < parts, other=0.0)",
        "tl.load(slots, mask=k < PARTS, other=0.0)",
        ("tests/test_group_norm.py", "-k", "parts"),
        note="the sums of the next row's parts (or past the buffer) added to a row's",
    ),
    Mutation(
        "group_norm_pivot_dropped",
        "kernel: GroupNorm (rows split into parts)",
        "fusebackend/kernels/group_norm_triton.py",
        "    mean = pivot + shift\n",
        "    mean = shift\n",
        ("tests/test_group_norm.py", "-k", "parts or far_from_zero"),
        note="the shifted mean taken for the mean: wrong wherever the pivot is not 0",
    ),
    Mutation(
        "group_norm_stores_through_the_inputs_strides",
        "kernel: GroupNorm (layouts)",
        "fusebackend/kernels/group_norm_triton.py",
        "        _, place = _place(e, CG, HW, so_c, so_s, CHANNELS_INNER)\n"
        "        tl.store(target + place, y, mask=inside)",
        "        tl.store(target + offset, y, mask=inside)",
        ("tests/test_group_norm.py", "-k", "another_layout"),
        note="a row held whole written in the input's layout where the output's differs",
    ),
    Mutation(
        "group_norm_grouped_reads_another_images_sums",
        "kernel: GroupNorm (several groups a program)",
        "fusebackend/kernels/group_norm_triton.py",
        "            slots = partial + ((n * groups + g)[:, None] * parts + k[None, :]) * 2",
        "            slots = partial + (g[:, None] * parts + k[None, :]) * 2",
        ("tests/test_group_norm.py", "-k", "parts"),
        note="every image normalised by the first image's statistics",
    ),
    Mutation(
        "group_norm_grouped_padding_channels_read",
        "kernel: GroupNorm (several groups a program)",
        "fusebackend/kernels/group_norm_triton.py",
        "    real = (g[:, None] < groups) & (j[None, :] < CG)",
        "    real = g[:, None] < groups",
        ("tests/test_group_norm.py", "-k", "equals_eagers"),
        note="the lanes past a group's channels read the next group's into its sums",
    ),
    Mutation(
        "group_norm_channels_last_for_any_reader",
        "pass: GroupNorm (the layout it writes)",
        "fusebackend/passes/group_norms.py",
        "        if not conv or not is_batched(reader) or reader.args[0] is not last:\n"
        "            return None\n",
        "",
        ("tests/test_group_norm.py", "-k", "stays_channels_last"),
        note="the input's layout written where a mean reads the value too (not a convolution)",
    ),
    Mutation(
        "group_norm_never_channels_last",
        "pass: GroupNorm (the layout it writes)",
        "fusebackend/passes/group_norms.py",
        "    return x.stride()\n",
        "    return None\n",
        ("tests/test_group_norm.py", "-k", "stays_channels_last"),
        note="the traced NCHW layout written before convolutions: a transpose before each",
    ),
    Mutation(
        "group_norm_activation_of_a_shared_value_taken",
        "pass: GroupNorm (the activation it takes)",
        "fusebackend/passes/group_norms.py",
        "    reader = single_user(norm)\n",
        "    reader = next(iter(norm.users), None)\n",
        ("tests/test_group_norm.py", "-k", "read_twice"),
        note="the activation taken where another node reads the norm's value too",
    ),
    Mutation(
        "group_norm_channels_last_copy_not_a_convolution",
        "pass: GroupNorm (the layout it writes)",
        "fusebackend/passes/group_norms.py",
        "        if is_channels_last_copy(reader):\n            continue",
        "        if False:\n            continue",
        ("tests/test_group_norm.py", "-k", "stays_channels_last"),
        note="the NCHW layout written where channels_last's copy stands before the convolutions: "
        "each value copied back (BiT's 49 copies)",
    ),
    Mutation(
        "channels_last_computed_weight_left_to_cudnn",
        "pass: channels-last (weights)",
        "fusebackend/passes/channels_last.py",
        '    if weight.op != "placeholder":\n',
        "    if False:\n",
        ("tests/test_channels_last.py", "-k", "computed_from_parameters"),
        note="a weight computed in the graph (BiT's standardised one) converted by cuDNN each call",
    ),
]


@dataclasses.dataclass
class Result:
    name: str
    family: str
    tests: str
    result: str
    seconds: float
    first_failure: str = ""
    detail: str = ""


# ------------------------------------------------------------------------------ the copy


def make_copy(dest: Path, rev: str | None) -> None:
    """The repository's files (working tree, or ``rev`` through git archive) under ``dest``."""
    if rev is None:
        for entry in sorted(ROOT.iterdir()):
            if _IGNORE(str(ROOT), [entry.name]):
                continue
            target = dest / entry.name
            if entry.is_dir():
                shutil.copytree(entry, target, ignore=_IGNORE, symlinks=True)
            else:
                shutil.copy2(entry, target)
        return
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def plant(copy: Path, mutation: Mutation) -> str | None:
    """Apply ``mutation`` in ``copy``; why not (the old text not found exactly once)."""
    path = copy / mutation.file
    if not path.exists():
        return f"{mutation.file} does not exist"
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        return f"old text found {count} times in {mutation.file}"
    path.write_text(text.replace(mutation.old, mutation.new))
    return None


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def check_imports_from(copy: Path) -> None:
    """Fail unless ``fusebackend`` and ``tests`` resolve inside ``copy`` (PYTHONPATH first:
    the editable install of the checkout must not win)."""
    code = (
        "import importlib.util as u;"
        "print(u.find_spec('fusebackend').origin);"
        "print(u.find_spec('tests').submodule_search_locations[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=copy,
        env=_env(copy),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for found in out:
        if not Path(found).resolve().is_relative_to(copy.resolve()):
            raise SystemExit(f"the copy does not shadow the checkout: {found} (copy: {copy})")


# ------------------------------------------------------------------------------ running


def run_tests(
    copy: Path, tests: tuple[str, ...], workers: str | None, gpu: bool, log: Path | None
) -> Result:
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    if workers:
        command += ["-n", workers]
    if gpu:
        command += ["-m", "gpu"]
    command += list(tests)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return Result("", "", "", "broken", time.monotonic() - start, "", f"timeout {TIMEOUT_S}s")
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    if log is not None:
        log.write_text(" ".join(command) + "\n\n" + output)
    failure = _first_failure(output)
    returncode = proc.returncode
    if workers and returncode == 2 and "\nFAILED " in "\n" + output:
        # pytest-xdist ends a -x run at its first failure as "Interrupted", exit 2, where
        # one process exits 1: a failing test still caught the mutation
        returncode = 1
    result = {0: "missed", 1: "caught"}.get(returncode, "broken")
    detail = "" if returncode in (0, 1) else f"pytest exit {returncode}: " + _tail(output)
    return Result("", "", "", result, seconds, failure, detail)


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ", 1)[0].split(" ", 1)[1]
    return ""


def _tail(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-400:]


def run_mutation(
    mutation: Mutation | None, tests: tuple[str, ...], gpu: bool, args, label: str = "clean"
) -> Result:
    """Plant ``mutation`` (None: the clean run, logged as ``label``) in a fresh copy and run
    ``tests`` there (``gpu``: only the GPU-marked ones)."""
    name = mutation.name if mutation else "clean"
    family = mutation.family if mutation else "(no mutation)"
    shown = " ".join(("-m gpu", *tests) if gpu else tests)
    if gpu and not _cuda():
        return Result(name, family, shown, "skipped (no CUDA)", 0.0)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as tmp:
        copy = Path(tmp)
        make_copy(copy, args.rev)
        if mutation is not None:
            why = plant(copy, mutation)
            if why is not None:
                return Result(name, family, shown, "broken", time.monotonic() - start, "", why)
        check_imports_from(copy)
        log = args.logs / f"{mutation.name if mutation else label}.log" if args.logs else None
        result = run_tests(copy, tests, args.workers, gpu, log)
    result.name, result.family, result.tests = name, family, shown
    result.seconds = time.monotonic() - start
    return result


@functools.cache
def _cuda() -> bool:
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------ reporting


def _row(r: Result) -> str:
    cells = [r.name, r.family, f"`{r.tests}`", r.result, f"{r.seconds:.0f}", r.first_failure]
    if r.detail:
        cells[-1] = (cells[-1] + " " if cells[-1] else "") + f"({r.detail})"
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table(results: list[Result]) -> str:
    head = "| mutation | family | tests | result | seconds | first failing test |"
    return "\n".join([head, "|---|---|---|---|---|---|", *map(_row, results)])


def _commit(rev: str | None) -> str:
    def git(*a: str) -> str:
        return subprocess.run(  # (rstrip: a porcelain line starts with its status's space)
            ["git", "-C", str(ROOT), *a], capture_output=True, text=True
        ).stdout.rstrip()

    sha = git("rev-parse", "--short", rev or "HEAD")
    if rev is not None:
        return sha
    dirty = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return sha + (f" + uncommitted changes ({', '.join(dirty)})" if dirty else "")


def _machine() -> str:
    code = (
        "import torch, triton; print(torch.__version__, triton.__version__, "
        "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    )
    versions = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    torch_v, triton_v, device = (versions.stdout.strip().split(" ", 2) + ["?"] * 3)[:3]
    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, {device}; "
        f"Python {platform.python_version()}, torch {torch_v}, triton {triton_v}"
    )


def write_doc(path: Path, results: list[Result], clean: list[Result], args, total: float) -> None:
    notes = [f"- **{m.name}**: {m.note}" for m in MUTATIONS if m.note]
    counts = {k: sum(r.result.startswith(k) for r in results) for k in
              ("caught", "missed", "broken", "skipped")}  # fmt: skip
    text = "\n".join(
        [
            "# Mutation check",
            "",
            "Planted bugs and the tests that must catch each (`tools/mutation_check.py`: its",
            "docstring says how to run it). Each row: one source edit planted in a fresh copy",
            "of the repository, then `pytest -q -x` on its selection. `caught`: a test failed;",
            "`missed`: every test passed with the bug in place; `broken`: the run itself failed",
            "(collection error, nothing selected, the edit no longer applies).",
            "",
            f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
            f"- commit: {_commit(args.rev)}",
            f"- machine: {_machine()}",
            f"- pytest workers per selection: {args.workers or 1}",
            f"- total: {total / 60:.1f} min; "
            + ", ".join(f"{v} {k}" for k, v in counts.items() if v),
            "",
            "## Clean run (no mutation): every selection passes",
            "",
            table(clean) if clean else "(skipped: --no-clean)",
            "",
            "## Mutations",
            "",
            table(results),
            "",
            "## Notes",
            "",
            *notes,
            "",
        ]
    )
    path.write_text(text)


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only these")
    parser.add_argument("--workers", metavar="N", help="pytest-xdist workers (-n N)")
    parser.add_argument("--rev", help="copy this git revision instead of the working tree")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    parser.add_argument("--logs", type=Path, help="keep each run's pytest output in this dir")
    parser.add_argument("--out", type=Path, help=f"markdown file (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            where = " [GPU]" if m.gpu else ""
            print(f"{m.name}{where}\n    {m.family}; {m.file}\n    tests: {' '.join(m.tests)}")
        return 0
    chosen = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTATIONS if m.name in args.only]

    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    clean: list[Result] = []
    if not args.no_clean:
        selections = list(dict.fromkeys((m.tests, m.gpu) for m in chosen))
        for k, (tests, gpu) in enumerate(selections):
            r = run_mutation(None, tests, gpu, args, f"clean-{k}")
            if not r.result.startswith("skipped"):  # exit 0: every test passed
                r.result = "passed" if r.result == "missed" else f"FAILED ({r.result})"
            print(f"clean: {r.result} in {r.seconds:.0f}s: {r.tests}", r.first_failure, r.detail,
                  flush=True)  # fmt: skip
            clean.append(r)
    results = []
    for m in chosen:
        r = run_mutation(m, m.tests, m.gpu, args)
        print(f"{m.name}: {r.result} in {r.seconds:.0f}s", r.first_failure, r.detail, flush=True)
        results.append(r)
    total = time.monotonic() - start
    print()
    print(table(results))
    print(f"\ntotal {total / 60:.1f} min")
    out = args.out or (None if args.only else DEFAULT_OUT)
    if out is not None:
        write_doc(out, results, clean, args, total)
        print(f"written to {out}")
    ran = [r for r in clean + results if not r.result.startswith("skipped")]
    good = all(r.result in ("passed", "caught") for r in ran)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
