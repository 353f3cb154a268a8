"""Fusion: the ``FUSE`` passes on a copy of the graph the runtime runs, and what they make.

``fuse`` copies the prepared graph (the device part of a split one), runs ``FUSE`` on it
(fusebackend/pipeline.py runs and times each pass) and returns a ``Fusion``: the fused
graph, or None where nothing will be fused (the runtime then runs the graph as traced), the
groups found, what was not fused and why, and the kernel launches. The kernels a fused graph
calls are kernel families (kernels/family.py), compiled ahead by one loop (``precompile``).
Each ``Pass`` here wraps one pass of ``passes/`` with what it reports; a new pass is one
entry in ``FUSE``, at the place in the order its docstring asks for.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.config import FusionConfig
from fusebackend.copies import fold_copies, run_lone_copies
from fusebackend.kernels import KernelOptions, kernel_source, triton_usable
from fusebackend.kernels.cache_write import write_cache_pair
from fusebackend.kernels.conv import conv2d_relu
from fusebackend.kernels.decode_attention import decode_attention
from fusebackend.kernels.depthwise_conv import depthwise_conv2d
from fusebackend.kernels.family import compile_weight, family_of, launch_path
from fusebackend.kernels.group_norm import group_norm
from fusebackend.kernels.launch import launch_rank, layout_for, precompile_all
from fusebackend.kernels.matmul import epilogue_source, matmul_op
from fusebackend.kernels.pool2d import pool2d
from fusebackend.kernels.spatial_mean import spatial_mean
from fusebackend.kernels.triton_api import start_cache_key
from fusebackend.kernels.vocab_lookup import vocab_parallel_lookup
from fusebackend.passes.attention import (
    avoid_cudnn_plans,
    contiguous_attention_masks,
    expand_shared_kv_heads,
    scale_in_attention,
)
from fusebackend.passes.axis_reductions import reduce_along_rows
from fusebackend.passes.batch_norm_folding import Refresh, fold_batch_norms
from fusebackend.passes.cache_writes import pair_cache_writes
from fusebackend.passes.channels_last import choose_channels_last, use_channels_last
from fusebackend.passes.collectives import use_vocab_parallel_lookup
from fusebackend.passes.common_values import share_equal_values
from fusebackend.passes.concat_writes import push_into_concatenations, write_concatenations
from fusebackend.passes.concatenation import drop_identity_slices
from fusebackend.passes.conv_activation import fuse_conv_activations
from fusebackend.passes.conv_bias import move_conv_biases
from fusebackend.passes.decode_attention import use_decode_attention
from fusebackend.passes.depthwise import take_residual_adds, use_depthwise_convs
from fusebackend.passes.empty_pads import drop_empty_pads
from fusebackend.passes.full_reductions import split_full_reductions
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.group_norms import use_group_norms
from fusebackend.passes.groups import LoweredGroup
from fusebackend.passes.index_views import arange_indices_as_reshapes
from fusebackend.passes.lowering import lower
from fusebackend.passes.matmul_groups import use_matmul_groups
from fusebackend.passes.matmul_operands import copy_matmul_operands_once, scale_in_matmuls
from fusebackend.passes.out_of_place import make_out_of_place
from fusebackend.passes.pairing import pair_twin_groups
from fusebackend.passes.parameter_work import fold_parameter_work
from fusebackend.passes.partial_rotary import widen_partial_rotary
from fusebackend.passes.partition import Candidate, find_groups
from fusebackend.passes.pooling import use_pool_kernels
from fusebackend.passes.reshapes import move_casts_above_permutes, move_reshapes_up
from fusebackend.passes.rewrite import in_storage_order, reference_graph, rewrite
from fusebackend.passes.rotary_epilogue import use_rotary_epilogues
from fusebackend.passes.spatial_means import use_spatial_means
from fusebackend.pipeline import Compilation, Pass, drop_rejections, pass_failure, run_passes
from fusebackend.prepare import is_parameter_or_buffer
from fusebackend.report import GroupReport, row_groups
from fusebackend.row_ops import FusedGroupOp, FusedPairOp

__all__ = ["FUSE", "Fusion", "fuse", "precompile", "warm_compiler", "warm_compiler_early"]

log = logging.getLogger(__name__)


def _report_left_alone(c: Compilation, key: str, label: str, reasons: list[str]) -> None:
    """A pass's "left alone, and why" lines, under their own report key and explain label."""
    if reasons:
        c.rewrites.setdefault(key, []).extend(reasons)
        c.labels[key] = label


def _fold_batch_norms(c: Compilation) -> list[str]:
    """Eval BatchNorms folded into their convolutions' weight and bias, or made a per-channel
    scale and shift of their input (derived constants the fused graph owns, refreshed before
    each call); those left alone reported with why."""
    assert c.graph is not None
    found = fold_batch_norms(c.graph, c.gm, c.example_inputs, is_parameter_or_buffer)
    _report_left_alone(c, "batch_norms_left_alone", "BatchNorms not folded", found.left_alone)
    c.refresh = found.refresh(c.example_inputs)
    return [
        fold.name if fold.alone is None else f"{fold.name} (a scale and shift: {fold.alone})"
        for fold in found.folds
    ]


def _use_channels_last(c: Compilation) -> list[str]:
    """The graph's 2-d convolutions run channels-last where the option and the graph allow
    (their weights as derived channels-last copies refreshed with the folds); the
    convolutions are reported, or why a graph with convolutions stays as traced."""
    assert c.graph is not None
    why_not = choose_channels_last(c.graph, c.config.channels_last)
    if why_not is not None:
        if why_not != "no batched 2-d convolution":
            _report_left_alone(c, "channels_last_left_alone", "not run channels-last", [why_not])
        return []
    found = use_channels_last(c.graph, c.gm, c.example_inputs, is_parameter_or_buffer)
    _report_left_alone(c, "channels_last_left_alone", "not run channels-last", found.left_alone)
    if found.copies:
        folds = c.refresh.folds if isinstance(c.refresh, Refresh) else []
        c.refresh = Refresh([*folds, *found.copies], c.example_inputs)
    return found.convolutions


def _fold_parameter_work(c: Compilation) -> list[str]:
    """Work on parameters and buffers alone (a relative position bias gathered from its
    table) as derived constants, refreshed with the folds; the folded nodes are reported."""
    assert c.graph is not None
    found = fold_parameter_work(c.graph, c.gm, c.example_inputs, is_parameter_or_buffer)
    if found:
        folds = c.refresh.folds if isinstance(c.refresh, Refresh) else []
        c.refresh = Refresh([*folds, *found], c.example_inputs)
    return [work.name for work in found]


def _make_out_of_place(c: Compilation) -> list[str]:
    """In-place elementwise ops on graph temporaries as out-of-place ops (so they fuse); the
    in-place table ops left alone reported with why."""
    assert c.graph is not None
    found = make_out_of_place(c.graph)
    _report_left_alone(c, "in_place_left_alone", "in-place ops left in place", found.left_alone)
    return found.made


def _use_matmul_groups(c: Compilation) -> list[str]:
    """Few-row linears with their siblings, norm and epilogue as matmul_group launches;
    the linears left alone are reported under their own key."""
    assert c.graph is not None
    found = use_matmul_groups(c.graph, matmul_op, triton_usable)
    _report_left_alone(c, "matmuls_left_alone", "matmuls left as traced", found.left_alone)
    c.matmul_groups = len(found.made)
    for k, made in enumerate(found.groups):
        source = epilogue_source(made.group, made.dtype)
        c.groups.append(GroupReport(
            name=f"matmul{k}", kernel_name=made.kernel, nodes=made.nodes, lookups=(),
            inputs=made.inputs, outputs=made.outputs, source=source, backend="triton",
            family="matmul"))  # fmt: skip
    return found.made


def _use_rotary_epilogues(c: Compilation) -> list[str]:
    """q/k/v groups take over their rotary embedding and KV-cache write; those left alone
    are reported under their own key."""
    assert c.graph is not None
    found = use_rotary_epilogues(c.graph, matmul_op, c.config.index_checks)
    label = "rotary embeddings left to the row kernels"
    _report_left_alone(c, "rotary_left_alone", label, found.left_alone)
    return found.made


def _find_groups(c: Compilation) -> None:
    assert c.graph is not None
    c.candidates, c.rejections = find_groups(c.graph)
    rewritten = c.refresh is not None or any(
        c.rewrites.get(key)
        for key in (
            "channels_last",
            "spatial_means",
            "pool_kernels",
            "depthwise_convs",
            "group_norms",
        )
    )
    c.stopped = not c.candidates and not c.matmul_groups and not rewritten


def _rewrite_groups(c: Compilation) -> None:
    """Each group becomes one call of its FusedGroupOp (its GroupReport recorded)."""
    assert c.graph is not None
    if not c.candidates:
        return
    options = KernelOptions(c.config.index_checks, c.config.round_intermediates)
    devices = {example_value(k.members[0]).device for k in c.candidates}
    if not any(triton_usable(d) for d in devices):
        # Without Triton a rewritten group would run its torch reference through one more
        # module call per group and call (+4-5 us per group on a 2-core CPU: quickstart
        # 93.1 vs 89.0 us), for nothing: the graph stays as traced, and the report still
        # lists what would fuse, and why it does not run fused.
        names = ", ".join(sorted(str(d) for d in devices))
        for candidate in c.candidates:
            _report_group(c, candidate, lower(candidate), options,
                          f"not rewritten: Triton cannot run on {names} "
                          "(the CPU needs TRITON_INTERPRET=1)")  # fmt: skip
        # No fused graph: the runtime runs the traced graph once per call (a fused one would
        # be validated against itself on each signature's first call, running it twice).
        c.stopped = True
        return

    def make_op(candidate: Candidate, lowered: LoweredGroup) -> FusedGroupOp:
        group_device = example_value(candidate.members[0]).device
        use_triton = triton_usable(group_device)
        kernel_name = _report_group(c, candidate, lowered, options,
                                    "triton" if use_triton else "torch reference")  # fmt: skip
        op = FusedGroupOp(lowered.program, kernel_name, reference_graph(candidate, lowered),
                          group_device, options)  # fmt: skip
        op.group = c.groups[-1].name
        return op

    c.fused_nodes = rewrite(c.graph, c.candidates, make_op)


def _report_group(
    c: Compilation, candidate: Candidate, lowered: LoweredGroup, options: KernelOptions,
    backend: str,
) -> str:  # fmt: skip
    """Record the group's report; return its kernel name."""
    layout = layout_for(lowered.program, _static_width(candidate))
    kernel_name, source = kernel_source(lowered.program, _kernel_rank(lowered), options,
                                        layout)  # fmt: skip
    calls = candidate.calls.items()
    c.groups.append(
        GroupReport(
            name=f"group{row_groups(c.groups)}",
            kernel_name=kernel_name,
            nodes=tuple(m.name for m in candidate.members),
            lookups=tuple(m.name for m in candidate.lookups),
            reductions=tuple(
                m.name for m, k in calls if k.op.kind in ("reduction", "norm", "softmax", "scan")
            ),
            moves=tuple(m.name for m, k in calls if k.op.kind in ("move", "concat")),
            inputs=tuple(n.name for n in lowered.inputs),
            outputs=tuple(m.name for m in lowered.outputs),
            source=source,
            backend=backend,
        )
    )
    return kernel_name


def _pair_twin_groups(c: Compilation) -> None:
    assert c.graph is not None
    by_name = {r.name: k for k, r in enumerate(c.groups)}
    for first, second in pair_twin_groups(c.graph, c.fused_nodes, FusedPairOp):
        for op, twin in ((first, second), (second, first)):
            k = by_name[op.group]
            c.groups[k] = dataclasses.replace(c.groups[k], launched_with=twin.group)


def _precompile_pass(c: Compilation) -> None:
    c.launches, c.launch_paths = precompile(c.graph)  # type: ignore[arg-type]


# (Triton runs on one of the graph's devices here; a cache-write pair on another device runs
# its two index_copy_ calls.)
FUSE = [
    Pass("make_out_of_place", _make_out_of_place,
         "in-place ops on graph temporaries made out-of-place (fused graph)",
         report="made_out_of_place"),
    Pass("share_equal_values", lambda c: share_equal_values(c.graph),
         "values computed twice from the same operands, computed once (fused graph)",
         report="values_shared"),
    Pass("drop_empty_pads", lambda c: drop_empty_pads(c.graph),
         "pads by zero amounts replaced by their input (fused graph)", report="empty_pads"),
    Pass("fold_batch_norms", _fold_batch_norms,
         "eval BatchNorms folded into their convolutions or made a scale and shift (fused graph)",
         report="batch_norms_folded"),
    Pass("fuse_conv_activations", lambda c: fuse_conv_activations(c.graph, conv2d_relu),
         "convolutions + bias (+ residual) + ReLU as one cuDNN call (fused graph)",
         report="conv_activations"),
    Pass("move_conv_biases", lambda c: move_conv_biases(c.graph),
         "convolution biases added in the elementwise group after them (fused graph)",
         report="conv_biases_moved"),
    Pass("use_channels_last", _use_channels_last, "convolutions run channels-last (fused graph)",
         report="channels_last"),
    Pass("use_depthwise_convs", lambda c: use_depthwise_convs(c.graph, depthwise_conv2d),
         "depthwise convolutions with their BatchNorm and activation as one kernel "
         "(fused graph)", report="depthwise_convs", needs_rewrites=True,
         when=lambda c: triton_usable(c.device or torch.device("cpu"))),
    Pass("use_spatial_means", lambda c: use_spatial_means(c.graph, spatial_mean),
         "means over H x W of channels-last tensors as one kernel (fused graph)",
         report="spatial_means", needs_rewrites=True,
         when=lambda c: triton_usable(c.device or torch.device("cpu"))),
    Pass("use_pool_kernels", lambda c: use_pool_kernels(c.graph, pool2d),
         "max and average pooling of channels-last tensors as one kernel (fused graph)",
         report="pool_kernels", needs_rewrites=True,
         when=lambda c: triton_usable(c.device or torch.device("cpu"))),
    Pass("use_group_norms", lambda c: use_group_norms(c.graph, group_norm),
         "GroupNorms with their activation as one kernel (fused graph)",
         report="group_norms", needs_rewrites=True,
         when=lambda c: triton_usable(c.device or torch.device("cpu"))),
    Pass("use_vocab_parallel_lookup",
         lambda c: use_vocab_parallel_lookup(c.graph, vocab_parallel_lookup, c.config.index_checks),
         "vocab-parallel lookups as one kernel + all-reduce (fused graph)",
         report="vocab_lookups", needs_rewrites=True),
    Pass("use_matmul_groups", _use_matmul_groups, "matmul groups (fused graph)",
         report="matmul_groups", when=lambda c: c.config.matmul_groups),
    Pass("use_rotary_epilogues", _use_rotary_epilogues,
         "rotary embeddings and KV-cache writes in the q/k/v launch (fused graph)",
         report="rotary_epilogues", when=lambda c: c.config.matmul_groups and c.matmul_groups),
    Pass("widen_partial_rotary", lambda c: widen_partial_rotary(c.graph),
         "partial rotary embeddings over the whole head, no cat (fused graph)",
         report="partial_rotary"),
    Pass("fold_parameter_work", _fold_parameter_work,
         "work on parameters and buffers alone done once, refreshed when they change "
         "(fused graph)", report="parameter_work"),
    Pass("arange_indices_as_reshapes", lambda c: arange_indices_as_reshapes(c.graph, c.gm),
         "indexing by constant aranges read as a reshape (fused graph)", report="arange_indices"),
    Pass("move_reshapes_up", lambda c: move_reshapes_up(c.graph),
         "reshapes moved ahead of elementwise ops (fused graph)", report="reshapes_moved"),
    Pass("move_casts_above_permutes", lambda c: move_casts_above_permutes(c.graph),
         "casts of permuted values run before the permute (fused graph)", report="casts_moved"),
    Pass("copy_matmul_operands_once", lambda c: copy_matmul_operands_once(c.graph),
         "batched-matmul operands copied once where they come from (fused graph)",
         report="matmul_operands_copied", needs_rewrites=True),
    Pass("scale_in_matmuls", lambda c: scale_in_matmuls(c.graph),
         "operands scaled by a number, scaled in their batched matmul (fused graph)",
         report="matmul_scales", needs_rewrites=True),
    Pass("drop_identity_slices", lambda c: drop_identity_slices(c.graph),
         "slices and expands that keep every element read as their source (fused graph)",
         report="identity_slices"),
    Pass("contiguous_attention_masks", lambda c: contiguous_attention_masks(c.graph),
         "attention masks made contiguous for SDPA's fused kernels (fused graph)",
         report="contiguous_masks"),
    Pass("split_full_reductions", lambda c: split_full_reductions(c.graph),
         "whole-tensor any/all reduced by rows first (fused graph)", report="full_reductions"),
    Pass("push_into_concatenations", lambda c: push_into_concatenations(c.graph),
         "elementwise ops on a cat run on its parts (fused graph)", report="pushed_into_cats"),
    Pass("take_residual_adds", lambda c: take_residual_adds(c.graph, depthwise_conv2d),
         "adds after depthwise convolutions in their kernel (fused graph)",
         report="depthwise_residuals"),
    Pass("reduce_along_rows", lambda c: reduce_along_rows(c.graph),
         "reductions over another dim than the last read along rows, with the ops after them "
         "(fused graph)", report="axis_reductions"),
    Pass("find_groups", _find_groups),
    Pass("rewrite_groups", _rewrite_groups),
    Pass("pair_twin_groups", _pair_twin_groups),
    Pass("write_concatenations", lambda c: drop_rejections(c, write_concatenations),
         "concatenations written in place by the groups computing their parts (fused graph)",
         report="concatenations_written", needs_rewrites=True),
    Pass("fold_copies_into_groups", fold_copies,
         "copies that reorder elements written or read in place by groups (fused graph)",
         report="copies_folded", needs_rewrites=True),
    Pass("pair_cache_writes",
         lambda c: pair_cache_writes(c.graph, write_cache_pair, c.config.index_checks),
         "KV-cache writes in one launch (fused graph)", report="cache_writes", needs_rewrites=True),
    Pass("use_decode_attention", lambda c: use_decode_attention(c.graph, decode_attention),
         "decode attention reading K/V unrepeated (fused graph)", report="decode_attention",
         needs_rewrites=True),
    Pass("scale_in_attention", lambda c: scale_in_attention(c.graph),
         "query scalings moved into attention's scale (fused graph)",
         report="attention_scales", needs_rewrites=True),
    Pass("expand_shared_kv_heads", lambda c: expand_shared_kv_heads(c.graph),
         "attention with one K/V head expanded to the query's heads (fused graph)",
         report="expanded_kv_heads", needs_rewrites=True),
    Pass("avoid_cudnn_plans", lambda c: avoid_cudnn_plans(c.graph),
         "attention without cuDNN's per-shape plans (fused graph)", report="cudnn_free_attention",
         needs_rewrites=True),
    Pass("run_lone_copies", run_lone_copies, "copies left alone run as row kernels (fused graph)",
         report="copies_as_row_kernels", needs_rewrites=True,
         when=lambda c: triton_usable(c.device or torch.device("cpu"))),
    Pass("precompile", _precompile_pass),
]  # fmt: skip


@dataclasses.dataclass
class Fusion:
    """What ``_fuse`` made: the fused graph (None: nothing runs fused), the groups found,
    what was not fused, and what its passes reported (their rewrites only with a fused
    graph: without one, the runtime runs the unfused graph), seconds and kernel launches."""

    graph: torch.fx.GraphModule | None = None
    groups: list[GroupReport] = dataclasses.field(default_factory=list)
    rejections: list[Any] = dataclasses.field(default_factory=list)
    rewrites: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    launches: dict[str, int] = dataclasses.field(default_factory=dict)
    launch_paths: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    refresh: Callable[[Sequence[Any]], None] | None = None  # run before each call
    failure: str = ""  # why the passes raised ("": they did not): the graph runs unfused


# The rewrites kept in the report when nothing runs fused: what says why something was not.
# What a graph with nothing fused still reports: what each pass left alone, and why.
_WHY_NOT_FUSED = ("matmuls_left_alone", "batch_norms_left_alone", "in_place_left_alone",
                  "channels_last_left_alone")  # fmt: skip


def fuse(
    gm: torch.fx.GraphModule,
    device: torch.device | None,
    config: FusionConfig,
    name: str = "",
    example_inputs: Sequence[Any] = (),
) -> Fusion:
    """Fuse a copy of ``gm``'s graph: the ``FUSE`` passes (``example_inputs``: its inputs,
    real tensors, from which derived constants are computed)."""
    if not config.fusion:
        return Fusion()
    c = Compilation(name, gm, list(example_inputs), config, device, graph=torch.fx.Graph())
    c.graph.output(c.graph.graph_copy(gm.graph, {}))  # node meta (example values) is kept
    try:
        run_passes(FUSE, c)
    except Exception as exc:  # noqa: BLE001  (a pass's bug: the graph runs as traced, captured)
        # Every exception a FUSE pass raises is an internal error (options are checked
        # before the passes run): the user's model still runs, and the report, explain and
        # this warning name the pass. timm's EVA-02 failed this way in parameter_work
        # (2026-11-30, diag_model_sweep.py) and, before this, failed the whole compile.
        failure = pass_failure(c, exc)
        log.warning("%s: a fusion pass failed, the graph runs unfused: %s", name, failure,
                    exc_info=True)  # fmt: skip
        return Fusion(failure=failure, seconds=c.seconds)
    if c.stopped:
        # No fused graph: only what says why something was not fused stays reported.
        why = {k: v for k, v in c.rewrites.items() if k in _WHY_NOT_FUSED}
        return Fusion(None, c.groups, c.rejections, why, c.labels, seconds=c.seconds)
    fused = torch.fx.GraphModule(gm, c.graph)
    # row groups first (group0, ...), then the matmul groups that the passes made before them
    groups = sorted(c.groups, key=lambda g: g.family != "row")
    return Fusion(fused, groups, c.rejections, c.rewrites, c.labels, c.seconds, c.launches,
                  c.launch_paths, c.refresh)  # fmt: skip


def warm_compiler(device: torch.device | None) -> None:
    """For a graph on the GPU, start what its compiles will need (Triton's cache key) on a
    background thread, to overlap the passes."""
    if device is not None and device.type == "cuda" and triton_usable(device):
        start_cache_key()


def warm_compiler_early() -> None:
    """Start Triton's cache key before any graph arrives, where this process already uses
    CUDA: called as each Dynamo compile starts (a callback backend.py registers), so the
    key's hashing (about 1 s on the H200 machine) overlaps Dynamo's first trace (its share of
    a cold first call: 1.6-3.4 s for three timm convnets there). Started at the graph's
    arrival, it overlapped only the passes, and ResNet-50's precompile waited 0.56 s for it
    (2026-11-30, c8492f4). A process that has not initialised CUDA is left alone, and is not
    asked for a GPU first: that would initialise the CUDA driver, and a process that forks
    afterwards could no longer use CUDA in its children; ``warm_compiler`` starts the key
    there when a graph for the GPU arrives."""
    if torch.cuda.is_initialized() and triton_usable(torch.device("cuda")):
        start_cache_key()


def precompile(graph: torch.fx.Graph) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Compile the graph's CUDA kernels now, concurrently, rather than one by one at their
    first launches (a 22-layer Llama's fused decode graph took 2.3 s longer to its first
    call than the unfused one on an H100, 2026-11-23, most of it compiling ~7 kernels).
    Returns each kernel family's launches in the graph (by ``describe()``) and, for
    families that say how a launch on the traced values runs (``launch_path``: a matmul
    group as GEMV or on tensor cores), how many run each way.

    Launches alike in every way Triton specialises on (each family's ``precompile_job``
    key) are warmed up once: each warm-up of a kernel not yet compiled costs Triton a source
    hash even when the compile itself is shared, and a 22-layer Llama's decode graph has 157
    launches of 10 kernels.

    The jobs run heaviest first (each family's ``compile_weight``), so that the compile
    processes, each taking the next compile in line, start the longest ones first and no
    process is left with a long compile at the end. In GhostNet-100's cold first call
    (H200, 2026-12-01, ``diag_first_call_phases.py --cold --children``) the processes' phase
    took 1.63 s, one process running four compiles for 1.47 s while the longest alone (a
    5 x 5 depthwise convolution) took 1.12 s; MobileNetV3-large's, 1.45 s and 1.01 s."""
    jobs: dict[Any, tuple[float, Callable[[], None]]] = {}
    kernels: dict[str, int] = {}
    paths: dict[str, dict[str, int]] = {}
    launches = 0
    for node in graph.nodes:
        family = family_of(node.target)
        if family is None:
            continue
        name = family.describe()
        kernels[name] = kernels.get(name, 0) + 1
        values = [example_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
        path = launch_path(family, values)
        if path:
            ways = paths.setdefault(name, {})
            ways[path] = ways.get(path, 0) + 1
        job = family.precompile_job(values)
        if job is not None:
            launches += 1
            if job[0] not in jobs:
                jobs[job[0]] = (compile_weight(family, values), job[1])
    if jobs:
        start = time.perf_counter()
        heaviest_first = sorted(jobs.values(), key=lambda weighted: -weighted[0])  # (stable)
        failed = precompile_all([job for _, job in heaviest_first])
        log.info("precompiled %d launch(es), %d distinct, in %.2f s (%d failed)",
                 launches, len(jobs), time.perf_counter() - start, failed)  # fmt: skip
    return kernels, paths


def _kernel_rank(lowered: LoweredGroup) -> int:
    """The rank of the kernel the group's launches run, for the report's name and source:
    the launcher collapses lead dims (a decode row ``[1, 1, D]`` runs rank 1), so the
    name in a profile matches ``explain``'s. Symbolic sizes: at their hints (the traced
    call's), else the traced rank."""
    inputs = [example_value(n) for n in lowered.inputs]
    if lowered.order is not None:  # the kernel reads its tensors in storage order
        inputs = [x if k in lowered.program.scalar_inputs else in_storage_order(x, lowered.order)
                  for k, x in enumerate(inputs)]  # fmt: skip
    rank = launch_rank(lowered.program, inputs)
    return lowered.rank if rank is None else rank


def _static_width(candidate: Candidate) -> int:
    """The group's row width as traced (the widest last dim of its members), for the
    report's source: the launcher picks the layout again from each call's real width."""
    values = [example_value(m) for m in candidate.members]  # a split's value is a tuple
    widths = [v.shape[-1] for v in values if isinstance(v, torch.Tensor) and v.dim()]
    return max((w for w in widths if isinstance(w, int)), default=1)
