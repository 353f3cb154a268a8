"""The ``infinifuse`` Dynamo backend: Dynamo's FX graph -> fused graph -> GraphCache.

Inference graphs are fused straight on Dynamo's own FX graph: no aot_autograd, whose
tracing roughly doubles the first call of a 22-layer Llama (H200: Dynamo alone 2.9-4.7 s,
with aot_autograd 6.7-7.8 s). Graphs that need gradients go through aot_autograd
unfused, so gradients equal eager's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.config import FusionConfig
from fusebackend.kernels import (
    KernelOptions,
    RowProgram,
    kernel_source,
    row_kernel,
    row_kernel_pair,
    triton_usable,
)
from fusebackend.kernels.cache_write import precompile_pair, write_cache_pair
from fusebackend.kernels.decode_attention import decode_attention, precompile_decode_attention
from fusebackend.kernels.launch import (
    hinted_examples,
    launch_rank,
    layout_for,
    precompile,
    precompile_all,
)
from fusebackend.kernels.vocab_lookup import precompile_vocab_lookup, vocab_parallel_lookup
from fusebackend.passes.attention import (
    drop_key_uniform_masks,
    share_mask_conversion,
)
from fusebackend.passes.batching import batch_scalar_updates, batch_state_sums
from fusebackend.passes.cache_writes import pair_cache_writes
from fusebackend.passes.collectives import (
    collective_nodes,
    drop_reduce_copies,
    use_vocab_parallel_lookup,
)
from fusebackend.passes.constants import fold_constants, fold_list_indices
from fusebackend.passes.decode_attention import use_decode_attention
from fusebackend.passes.dtensor import unwrap_dtensors
from fusebackend.passes.fx_util import static_tensor
from fusebackend.passes.graph import example_value
from fusebackend.passes.host_inputs import (
    HostSplit,
    hoist_host_to_device,
    split_host,
    stage_scalars,
)
from fusebackend.passes.lowering import lower
from fusebackend.passes.mutations import mutated_placeholders
from fusebackend.passes.pairing import pair_twin_groups
from fusebackend.passes.partition import Candidate, find_groups
from fusebackend.passes.rewrite import reference_graph, rewrite
from fusebackend.report import GraphReport, GroupReport, record
from fusebackend.runtime.graph_cache import GraphCache, captures

__all__ = ["FusedGroupOp", "infinifuse"]

log = logging.getLogger(__name__)
_graph_ids = itertools.count()


class FusedGroupOp:
    """The callable a fused group becomes in the rewritten FX graph.

    Runs the generated Triton kernel when Triton can run on the group's device (a CUDA
    device, or the CPU through ``TRITON_INTERPRET=1``), otherwise the group's original
    torch ops (``reference``), so a CPU-only machine still gets correct results.
    """

    def __init__(
        self,
        program: RowProgram,
        kernel_name: str,
        reference: torch.fx.Graph,
        device: torch.device,
        options: KernelOptions,
    ) -> None:
        self.program = program
        self._reference_graph = reference
        self.options = options
        self.use_triton = triton_usable(device)
        self.group = ""  # its GroupReport's name, for the report of a paired launch
        self.plans: dict = {}  # launches per input signature (kernels/launch.py)
        self.__name__ = kernel_name  # FX's generated code calls the node after this name
        self.__qualname__ = kernel_name

    @functools.cached_property
    def reference(self) -> torch.fx.GraphModule:
        """The group's torch ops as a module, compiled on first use (passes/rewrite.py)."""
        return torch.fx.GraphModule(torch.nn.Module(), self._reference_graph)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.use_triton:
            return row_kernel(self.program, inputs, options=self.options, plans=self.plans)
        return tuple(self.reference(*inputs))

    def __repr__(self) -> str:
        return f"FusedGroupOp({self.__name__})"


class FusedPairOp:
    """Two fused groups of one kernel run by one launch (passes/pairing.py): called on the
    first group's inputs then the second's, returns the first's outputs then the second's."""

    def __init__(self, first: FusedGroupOp, second: FusedGroupOp, split: int) -> None:
        self.first, self.second, self.split = first, second, split
        self.use_triton = first.use_triton and second.use_triton
        self.plans: dict = {}  # launches per input signature (kernels/launch.py)
        self.__name__ = f"{first.__name__}_pair"
        self.__qualname__ = self.__name__

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first, second = inputs[: self.split], inputs[self.split :]
        if self.use_triton:
            return row_kernel_pair(
                self.first.program, first, second, self.first.options, self.plans
            )
        return (*self.first(*first), *self.second(*second))

    def __repr__(self) -> str:
        return f"FusedPairOp({self.__name__})"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (as it was, after).

    The passes allocate many small objects (FX nodes, example values), which trigger full
    collections over everything the process holds: Dynamo's graphs, fake tensors, earlier
    compiled graphs. On a CPU (TRITON_INTERPRET=1, a 22-layer Llama decode graph, the 2nd to
    4th compile in one process) the backend took 0.43-0.47 s, 0.30-0.33 s of it in the
    collector's pauses, against 0.12-0.14 s with the collector paused (2026-11-25). What
    the passes leave behind is collected at the next collection after this.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def infinifuse(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | FusionConfig | None = None,
    mode: str | None = None,
) -> Any:
    """Dynamo backend entry point (``torch.compile(model, backend="infinifuse")``).

    ``mode`` is torch.compile's: see ``MODES``. torch.compile passes it only when it is not
    None or "default", and refuses ``mode`` and ``options`` together.
    """
    config = _apply_mode(FusionConfig.from_options(options), mode, options)
    start = time.perf_counter()
    name = f"graph{next(_graph_ids)}"
    device = _graph_device(example_inputs)

    if _needs_autograd(example_inputs):
        log.info("%s: gradients needed; compiled through aot_autograd without fusion", name)
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
        path = "unfused (gradients needed: aot_autograd; run under torch.no_grad() to fuse)"
        record(GraphReport(name, str(device or "cpu"), path, [], [], [], [],
                           time.perf_counter() - start))  # fmt: skip
        return compiled

    # Tensor parallelism: DTensor inputs (sharded parameters) run as their local shards.
    shards = unwrap_dtensors(gm, example_inputs)
    if shards is not None:
        example_inputs = shards.local_inputs(example_inputs)
    static_address = [
        node
        for node, value in zip(_placeholders(gm), example_inputs, strict=False)
        if getattr(value, "_dynamo_static_input_type", None) is not None
    ]
    host_inputs = hoist_host_to_device(gm, example_inputs)
    constants = fold_constants(gm)
    list_indices = fold_list_indices(gm)
    batched_updates: list[str] = []
    reduce_copies: list[str] = []
    shared_masks: list[str] = []
    dropped_masks: list[str] = []
    if config.rewrites:
        batched_updates = batch_scalar_updates(gm, static_address)
        batched_updates += batch_state_sums(gm, static_address, device or torch.device("cpu"))
        dropped_masks = drop_key_uniform_masks(gm)
        shared_masks = share_mask_conversion(gm)
        reduce_copies = drop_reduce_copies(gm.graph)
        if reduce_copies:
            gm.recompile()
    mutated = mutated_placeholders(gm.graph)
    # Nothing is captured without CUDA graphs: the split would only add snapshot clones.
    split = split_host(gm, _on_host) if captures(config, device) else None
    if split is None:
        part = DevicePart(gm, list(example_inputs), host_inputs, range(len(example_inputs)))
    else:
        part = _device_part_of(split, example_inputs, host_inputs, device)
    placeholders = [n for n in part.graph.graph.nodes if n.op == "placeholder"]
    original = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    mutated_indices = {original[p] for p in mutated}
    # Inputs of the device part that are original inputs the graph writes (the host part
    # writes its own inputs itself, on the caller's tensors).
    mutated_here = frozenset(k for k, i in enumerate(part.original_indices) if i in mutated_indices)
    fused_gm, groups, rejections, cache_writes, attention, vocab_lookups = _fuse(
        part.graph, device, config
    )
    sharded_parameters = frozenset(
        k for k, i in enumerate(part.original_indices) if shards and i in shards.parameters
    )
    static = _static_inputs(part.example_inputs, mutated_here, part.host_inputs, config, device)
    static |= sharded_parameters
    cache = GraphCache(
        unfused=part.graph,
        fused=fused_gm,
        config=config,
        device=device,
        static_input_indices=static,
        mutated_input_indices=mutated_here,
        host_inputs=part.host_inputs,
        name=name,
        batch_size_input_indices=_batch_size_inputs(placeholders, static),
        example_values=[example_value(p) for p in placeholders],
    )
    if not config.fusion:
        path = "unfused (option fusion=False)"
    else:
        rewritten = [g for g in groups if not g.backend.startswith("not rewritten")]
        if rewritten:
            path = "fused"
        elif groups:
            path = f"unfused ({groups[0].backend}: {len(groups)} group(s) found)"
        else:
            path = "unfused (nothing to fuse)"
    in_place = [
        placeholders[i].name
        for i in sorted(static)
        if not _is_module_state(part.example_inputs[i]) and i not in sharded_parameters
    ]
    report = GraphReport(
        name=name,
        device=str(device or "cpu"),
        path=path,
        groups=groups,
        rejections=list(rejections),
        mutated_inputs=[p.name for p in mutated],
        host_inputs=[placeholders[i].name for i in part.host_inputs],
        compile_seconds=time.perf_counter() - start,
        runtime_ref=weakref.ref(cache),
        static_inputs=in_place,
        constants=constants,
        batched_updates=batched_updates,
        list_indices=list_indices,
        shared_masks=shared_masks,
        dropped_masks=dropped_masks,
        cache_writes=cache_writes,
        decode_attention=attention,
        host_nodes=split.nodes if split is not None else [],
        local_shards=list(shards.names) if shards is not None else [],
        reduce_copies=reduce_copies,
        vocab_lookups=vocab_lookups,
        collectives=collective_nodes((fused_gm or part.graph).graph),
    )
    record(report)
    log.info(
        "%s: %s, %d group(s), %d not fused; %d inputs, used in place: %s, mutated: %s, "
        "constants: %d, host nodes: %d",
        name, path, len(groups), len(rejections), len(placeholders), in_place,
        report.mutated_inputs, len(constants), len(report.host_nodes),
    )  # fmt: skip
    compiled = cache if split is None else split.bind(cache)
    return compiled if shards is None else shards.bind(compiled)


def _on_host(value: torch.Tensor) -> bool:
    return value.device.type == "cpu"


@dataclasses.dataclass
class DevicePart:
    """What the runtime runs: the whole graph, or the device part of a split one.

    ``original_indices[k]`` is the original input that input ``k`` is, for the inputs that
    are original ones (a split's device part reads host values after them).
    """

    graph: torch.fx.GraphModule
    example_inputs: list[Any]  # None for the host values a split passes
    host_inputs: dict[int, torch.device]  # input index -> device the runtime stages it to
    original_indices: Sequence[int]


def _device_part_of(
    split: HostSplit,
    example_inputs: Sequence[Any],
    host_inputs: Mapping[int, torch.device],
    device: torch.device,
) -> DevicePart:
    """The device part of a split graph, its example inputs and its host inputs.

    Its inputs are the original inputs it reads, then the host values; a host value it moves
    to the device (or a 0-d one it reads there: ``stage_scalars``) is staged by the runtime
    like a CPU input, so it is in ``host_inputs`` and its value is not part of the key.
    """
    first = len(split.device_args)
    moved = {k: host_inputs[i] for k, i in enumerate(split.device_args) if i in host_inputs}
    stage_scalars(split.device, first, device)
    placeholders = [n for n in split.device.graph.nodes if n.op == "placeholder"]
    examples = [None] * first + [example_value(p) for p in placeholders[first:]]
    moved |= {i: d for i, d in hoist_host_to_device(split.device, examples).items() if i >= first}
    inputs = [example_inputs[i] for i in split.device_args] + [None] * split.num_boundary
    return DevicePart(split.device, inputs, moved, split.device_args)


# torch.compile's modes -> does the mode turn CUDA graphs off? "reduce-overhead" and the
# max-autotune modes are Inductor's; infinifuse captures CUDA graphs by default, so only
# "max-autotune-no-cudagraphs" changes anything. transformers' CompileConfig passes
# mode="reduce-overhead" unless told otherwise.
MODES: dict[str | None, bool] = {
    None: False,
    "default": False,
    "reduce-overhead": False,
    "max-autotune": False,
    "max-autotune-no-cudagraphs": True,
}


def _apply_mode(
    config: FusionConfig, mode: str | None, options: Mapping[str, Any] | FusionConfig | None
) -> FusionConfig:
    """The config ``mode`` gives; a ``cudagraphs`` the user set in ``options`` wins."""
    if mode not in MODES:
        valid = ", ".join(repr(m) for m in MODES)
        raise ValueError(f"infinifuse: unknown torch.compile mode {mode!r}; valid modes: {valid}")
    explicit = (
        config.cudagraphs is not None
        if isinstance(options, FusionConfig)
        else options is not None and "cudagraphs" in options
    )
    if MODES[mode] and not explicit:
        return config.replace(cudagraphs=False)
    return config


def _fuse(
    gm: torch.fx.GraphModule, device: torch.device | None, config: FusionConfig
) -> tuple[
    torch.fx.GraphModule | None, list[GroupReport], list[Any], list[str], list[str], list[str]
]:
    """Fuse a copy of ``gm``'s graph. Returns (fused module or None, groups, rejections,
    KV-cache write pairs joined, SDPA calls given to the decode attention kernel,
    vocab-parallel lookups given to their kernel)."""
    if not config.fusion:
        return None, [], [], [], [], []
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node meta (example values) is kept
    vocab_lookups = []
    if config.rewrites:
        vocab_lookups = use_vocab_parallel_lookup(graph, vocab_parallel_lookup, config.index_checks)
    candidates, rejections = find_groups(graph)
    if not candidates:
        return None, [], rejections, [], [], []
    reports: list[GroupReport] = []
    options = KernelOptions(config.index_checks, config.round_intermediates)

    def report(candidate: Candidate, backend: str) -> str:
        """Record the group's report; return its kernel name."""
        assert candidate.program is not None
        layout = layout_for(candidate.program, _static_width(candidate))
        kernel_name, source = kernel_source(candidate.program, _kernel_rank(candidate), options,
                                            layout)  # fmt: skip
        calls = candidate.calls.items()
        reports.append(
            GroupReport(
                name=f"group{len(reports)}",
                kernel_name=kernel_name,
                nodes=tuple(m.name for m in candidate.members),
                lookups=tuple(m.name for m in candidate.lookups),
                reductions=tuple(
                    m.name for m, c in calls if c.op.kind in ("reduction", "norm", "softmax")
                ),
                moves=tuple(m.name for m, c in calls if c.op.kind == "move"),
                inputs=tuple(n.name for n in candidate.inputs),
                outputs=tuple(m.name for m in candidate.outputs),
                source=source,
                backend=backend,
            )
        )
        return kernel_name

    devices = {example_value(c.members[0]).device for c in candidates}
    if not any(triton_usable(d) for d in devices):
        # Without Triton a rewritten group would run its torch reference through one more
        # module call per group and call (+4-5 us per group on a 2-core CPU: quickstart
        # 93.1 vs 89.0 us), for nothing: the graph stays as traced, and the report still
        # lists what would fuse, and why it does not run fused.
        names = ", ".join(sorted(str(d) for d in devices))
        for candidate in candidates:
            lower(candidate)
            report(candidate, f"not rewritten: Triton cannot run on {names} "
                              "(the CPU needs TRITON_INTERPRET=1)")  # fmt: skip
        # No fused graph: the runtime runs the traced graph once per call (a fused one would
        # be validated against itself on each signature's first call, running it twice).
        return None, reports, rejections, [], [], []

    def make_op(candidate: Candidate) -> FusedGroupOp:
        assert candidate.program is not None
        group_device = example_value(candidate.members[0]).device
        use_triton = triton_usable(group_device)
        kernel_name = report(candidate, "triton" if use_triton else "torch reference")
        op = FusedGroupOp(candidate.program, kernel_name, reference_graph(candidate),
                          group_device, options)  # fmt: skip
        op.group = reports[-1].name
        return op

    fused_nodes = rewrite(graph, candidates, make_op)
    by_name = {r.name: k for k, r in enumerate(reports)}
    for first, second in pair_twin_groups(graph, fused_nodes, FusedPairOp):
        for op, twin in ((first, second), (second, first)):
            k = by_name[op.group]
            reports[k] = dataclasses.replace(reports[k], launched_with=twin.group)
    # (Triton runs on one of the graph's devices here; a pair on another device runs its
    # two index_copy_ calls.)
    cache_writes, attention = [], []
    if config.rewrites:
        cache_writes = pair_cache_writes(graph, write_cache_pair, config.index_checks)
        attention = use_decode_attention(graph, decode_attention)
    _precompile(graph)
    return (
        torch.fx.GraphModule(gm, graph),
        reports,
        rejections,
        cache_writes,
        attention,
        vocab_lookups,
    )


def _precompile(graph: torch.fx.Graph) -> None:
    """Compile the graph's CUDA kernels now, concurrently, rather than one by one at their
    first launches (a 22-layer Llama's fused decode graph took 2.3 s longer to its first
    call than the unfused one on an H100, 2026-11-23, most of it compiling ~7 kernels).

    Launches alike in every way Triton specialises on (``_launch_key``) are warmed up once:
    each warm-up of a kernel not yet compiled costs Triton a source hash even when the
    compile itself is shared, and a 22-layer Llama's decode graph has 157 launches of 10
    kernels."""
    jobs: dict[tuple[Any, ...], Callable[[], None]] = {}
    launches = 0
    for node in graph.nodes:
        op = node.target
        if op is write_cache_pair:
            *tensors, checks = node.args
            values = [example_value(a) for a in tensors]
            if all(_concrete_cuda_tensor(v) for v in values):
                launches += 1
                key = ("pair", checks, *map(_launch_key, values))
                jobs.setdefault(key, functools.partial(precompile_pair, *values, checks))
            continue
        if op is vocab_parallel_lookup:
            ids, table, *rest = node.args
            values = [example_value(ids), example_value(table)]
            if all(_concrete_cuda_tensor(v) for v in values):
                launches += 1
                key = ("vocab", *rest, *map(_launch_key, values))
                jobs.setdefault(key, functools.partial(precompile_vocab_lookup, *values, *rest))
            continue
        if op is decode_attention:
            query, key_states, value, mask, *rest = node.args
            values = [example_value(a) for a in (query, key_states, value)]
            values.append(example_value(mask) if mask is not None else None)
            if all(_concrete_cuda_tensor(v) for v in values if v is not None):
                launches += 1
                key = ("attention", *rest, *map(_launch_key, values))
                jobs.setdefault(key, functools.partial(precompile_decode_attention, *values,
                                                       *rest))  # fmt: skip
            continue
        if not isinstance(op, FusedGroupOp | FusedPairOp) or not op.use_triton:
            continue
        values = [example_value(a) for a in node.args]
        if not all(_concrete_cuda_tensor(v) for v in values):
            # Symbolic shapes (dynamic=True, Dynamo's recompiles) or a number (a norm's eps):
            # compiled for the traced call's sizes (their hints), whose binary later lengths
            # of the same launch config share; none where a size has no hint
            values = hinted_examples(values)
            if values is None:
                continue
        if isinstance(op, FusedPairOp):
            program, options, split = op.first.program, op.first.options, op.split
        else:
            program, options, split = op.program, op.options, None
        launches += 1
        key = ("group", program, options, split, *map(_launch_key, values))
        jobs.setdefault(key, functools.partial(precompile, program, values, options, split))
    if jobs:
        start = time.perf_counter()
        failed = precompile_all(list(jobs.values()))
        log.info("precompiled %d launch(es), %d distinct, in %.2f s (%d failed)",
                 launches, len(jobs), time.perf_counter() - start, failed)  # fmt: skip


def _launch_key(value: Any) -> Any:
    """What a launch's warm-up depends on of one argument: a tensor's dtype, device, sizes,
    strides and 16-byte alignment (its byte offset: fresh bases count as aligned), or the
    value itself."""
    if not isinstance(value, torch.Tensor):
        return value
    offset = value.storage_offset() * value.element_size()
    return (value.dtype, value.device, tuple(value.shape), value.stride(), offset % 16 == 0)


def _concrete_cuda_tensor(value: Any) -> bool:
    return (
        static_tensor(value)
        and value.device.type == "cuda"
        and all(isinstance(n, int) for n in value.stride())
    )


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _kernel_rank(candidate: Candidate) -> int:
    """The rank of the kernel the group's launches run, for the report's name and source:
    the launcher collapses lead dims (a decode row ``[1, 1, D]`` runs rank 1), so the
    name in a profile matches ``explain``'s. Symbolic sizes: at their hints (the traced
    call's), else the traced rank."""
    assert candidate.program is not None
    rank = launch_rank(candidate.program, [example_value(n) for n in candidate.inputs])
    return candidate.rank if rank is None else rank


def _static_width(candidate: Candidate) -> int:
    """The group's row width as traced (the widest last dim of its members), for the
    report's source: the launcher picks the layout again from each call's real width."""
    values = [example_value(m) for m in candidate.members]  # a split's value is a tuple
    widths = [v.shape[-1] for v in values if isinstance(v, torch.Tensor)]
    return max((w for w in widths if isinstance(w, int)), default=1)


def _batch_size_inputs(placeholders: list[torch.fx.Node], static: frozenset[int]) -> frozenset[int]:
    """Int inputs holding a tensor input's leading (batch) size, under dynamic shapes.

    Dynamo passes a dynamic size as its own SymInt input; with ``batch_buckets`` the runtime
    pads the tensors and must give the graph the padded size in these inputs too.
    """
    leading = set()
    for i, node in enumerate(placeholders):
        value = example_value(node)
        if i not in static and isinstance(value, torch.Tensor) and value.dim() > 0:
            if isinstance(value.shape[0], torch.SymInt):
                leading.add(str(value.shape[0].node.expr))
    return frozenset(
        i
        for i, node in enumerate(placeholders)
        if isinstance(example_value(node), torch.SymInt)
        and str(example_value(node).node.expr) in leading
    )


def _needs_autograd(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _static_inputs(
    example_inputs: Sequence[Any],
    mutated: frozenset[int],
    host_inputs: Mapping[int, torch.device],
    config: FusionConfig,
    device: torch.device | None,
) -> frozenset[int]:
    """Inputs the runtime uses in place (no copy in, no write-back; address checked per hit).

    Parameters, buffers and ``mark_static_address`` tensors (the StaticCache's key/value
    tensors when its prefill ran eagerly), and every tensor input the graph mutates in place:
    a KV cache created inside a compiled prefill is not marked (transformers skips
    ``mark_static_address`` while Dynamo traces), and copying it in and back out around each
    replay would cost two passes over the whole cache per token. A mutated input that comes
    at a new address re-records (``rerecords``); on 3 consecutive calls, the runtime copies it
    in from then on. Not with ``batch_buckets``: static inputs are not padded.

    Never a 0-d CPU tensor of a CUDA graph (a CPU counter the graph writes, a CPU buffer): a
    captured graph never reads it again on replay, and the runtime keys such a scalar by
    its value only when it is not static. A larger CPU tensor stays static: the device part
    reads one only in CPU ops (a device value copied to the host, which cannot be captured
    anyway; CPU ops on CPU inputs alone are the host part's), and on the fake-CUDA test path
    every tensor is on the CPU, where parameters must stay in place as on a GPU.
    """
    static = {i for i, t in enumerate(example_inputs) if _is_parameter_or_buffer(t)}
    if config.batch_buckets is None:
        tensors = {i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)}
        static |= (mutated & tensors) - set(host_inputs)
    if device is not None:
        static -= {i for i in static if _on_host_scalar(example_inputs[i])}
    return frozenset(static)


def _on_host_scalar(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and _on_host(t)


def _is_parameter_or_buffer(t: Any) -> bool:
    # Dynamo marks the parameters and buffers of inlined nn.Modules, and mark_static_address
    # marks any tensor, with this attribute.
    return isinstance(t, torch.nn.Parameter) or (
        isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is not None
    )


def _is_module_state(t: Any) -> bool:
    """A parameter or a module buffer (Dynamo sets ``_is_buffer`` on buffers it inlines)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_is_buffer", False)


def _graph_device(example_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device the graph runs on, or None for a CPU graph."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return None
