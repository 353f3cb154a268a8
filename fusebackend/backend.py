"""The ``infinifuse`` Dynamo backend: Dynamo's FX graph -> fused graph -> GraphCache.

Inference graphs are fused straight on Dynamo's own FX graph: no aot_autograd, whose
tracing roughly doubles the first call of a 22-layer Llama (H200: Dynamo alone 2.9-4.7 s,
with aot_autograd 6.7-7.8 s). Graphs that need gradients go through aot_autograd
unfused, so gradients equal eager's.

Graph preparation and fusion are lists of passes (prepare.PREPARE, fusion.FUSE, ``FINISH``
here; fusebackend/pipeline.py runs and times them).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._dynamo.callback import callback_handler

import fusebackend.fusion as fuse_module
from fusebackend.config import FusionConfig
from fusebackend.passes.batch_norm_folding import Refresh
from fusebackend.passes.collectives import collective_nodes
from fusebackend.passes.fx_util import example_value, placeholders
from fusebackend.pipeline import Compilation, Pass, collector_paused, pass_failure, run_passes
from fusebackend.prepare import (
    PREPARE,
    batch_size_inputs,
    device_part,
    is_module_state,
    static_inputs,
)
from fusebackend.report import GraphReport, record
from fusebackend.row_ops import FusedGroupOp, FusedPairOp
from fusebackend.runtime.graph_cache import GraphCache
from fusebackend.runtime.specialization import form_of, operations

__all__ = ["FINISH", "FusedGroupOp", "FusedPairOp", "infinifuse"]  # the ops: row_ops.py

log = logging.getLogger(__name__)
_graph_ids = itertools.count()


# What the report lists of the graph the runtime runs (fused, else unfused).
FINISH = [
    Pass("collective_nodes", lambda c: collective_nodes(c.graph),
         "collectives (in the captured graph on CUDA)", report="collectives"),
]  # fmt: skip


@collector_paused()
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

    fuse_module.warm_compiler(device)
    register_cache_key_start()
    traced = operations(gm)  # before the passes fold anything (frames.route)
    c = Compilation(name, gm, list(example_inputs), config, device)
    # What runs if a pass raises: a copy of the nodes (11 ms for 1200 on this project's CI
    # CPU, 2026-11-30: under 1% of a decode graph's first call).
    as_traced = torch.fx.Graph()
    as_traced.output(as_traced.graph_copy(gm.graph, {}))
    try:
        run_passes(PREPARE, c)
    except Exception as exc:  # noqa: BLE001  (an internal error: the model still runs)
        # A PREPARE pass rewrites ``gm`` in place and may have stopped halfway: Dynamo's
        # graph as traced runs eagerly (no capture: what made the graph's inputs static
        # or host-side is unknown now), and the report and a warning name the pass.
        failure = pass_failure(c, exc)
        log.warning("%s: a preparation pass failed, the graph runs eagerly as traced: %s",
                    name, failure, exc_info=True)  # fmt: skip
        record(GraphReport(name, str(device or "cpu"), f"eager (preparation failed in {failure})",
                           [], [], [], [], time.perf_counter() - start))  # fmt: skip
        return torch.fx.GraphModule(gm, as_traced)
    shards, split, mutated = c.shards, c.split, c.mutated
    part = device_part(c)
    inputs = placeholders(part.graph.graph)
    original = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    mutated_indices = {original[p] for p in mutated}
    # Inputs of the device part that are original inputs the graph writes (the host part
    # writes its own inputs itself, on the caller's tensors).
    mutated_here = frozenset(k for k, i in enumerate(part.original_indices) if i in mutated_indices)
    fusion = fuse_module.fuse(part.graph, device, config, name, part.example_inputs)
    sharded_parameters = frozenset(
        k for k, i in enumerate(part.original_indices) if shards and i in shards.parameters
    )
    static = static_inputs(part.example_inputs, mutated_here, part.host_inputs, config, device)
    static |= sharded_parameters
    constants = part.per_signature
    arity = len(part.example_inputs)  # the inputs callers pass (per-signature ones follow)
    cache = GraphCache(
        unfused=part.graph,
        fused=fusion.graph,
        config=config,
        device=device,
        static_input_indices=static,
        mutated_input_indices=mutated_here,
        host_inputs=part.host_inputs,
        name=name,
        batch_size_input_indices=batch_size_inputs(inputs[:arity], static),
        example_values=[example_value(p) for p in inputs[:arity]],
        form=form_of(part.graph, traced, arity),
        per_signature=constants.graph if constants is not None else None,
        per_signature_count=constants.count if constants is not None else 0,
        before_call=fusion.refresh,
        stale_after_replay=fusion.refresh.stale if isinstance(fusion.refresh, Refresh) else None,
    )
    groups = fusion.groups
    if not config.fusion:
        path = "unfused (option fusion=False)"
    elif fusion.failure:
        path = f"unfused (fusion failed in {fusion.failure})"
    elif fusion.graph is not None:
        path = "fused"
    elif groups:
        path = f"unfused ({groups[0].backend}: {len(groups)} group(s) found)"
    else:
        path = "unfused (nothing to fuse)"
    in_place = [
        inputs[i].name
        for i in sorted(static)
        if not is_module_state(part.example_inputs[i]) and i not in sharded_parameters
    ]
    for key, names in fusion.rewrites.items():
        c.rewrites.setdefault(key, []).extend(names)
    c.labels |= fusion.labels
    c.seconds |= fusion.seconds
    c.graph = (fusion.graph or part.graph).graph
    run_passes(FINISH, c)
    report = GraphReport(
        name=name,
        device=str(device or "cpu"),
        path=path,
        groups=groups,
        rejections=list(fusion.rejections),
        mutated_inputs=[p.name for p in mutated],
        host_inputs=[inputs[i].name for i in part.host_inputs],
        compile_seconds=time.perf_counter() - start,
        runtime_ref=weakref.ref(cache),
        static_inputs=in_place,
        rewrites=c.rewrites,
        labels=c.labels,
        pass_seconds=c.seconds,
        launches=fusion.launches,
        launch_paths=fusion.launch_paths,
    )
    record(report)
    log.info(
        "%s: %s, %d group(s), %d not fused; %d inputs, used in place: %s, mutated: %s, "
        "constants: %d, host nodes: %d",
        name, path, len(groups), len(fusion.rejections), len(inputs), in_place,
        report.mutated_inputs, len(report.constants), len(report.host_nodes),
    )  # fmt: skip
    log.debug("%s: seconds per pass: %s", name, c.seconds)
    compiled = cache if split is None else split.bind(cache)
    return compiled if shards is None else shards.bind(compiled)


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


def _needs_autograd(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _graph_device(example_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device the graph runs on, or None for a CPU graph."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return None


def _start_cache_key_at_compile(*_callback_args: Any) -> None:
    """Dynamo's start callback (``register_cache_key_start``). It runs inside every Dynamo
    compile of the process, whichever backend: an error here would fail that compile, so
    none leaves (the key then starts with a graph for the GPU, or at the first compile)."""
    try:
        fuse_module.warm_compiler_early()
    except Exception:  # noqa: BLE001  (a thread that could not start: no early key, no harm)
        log.debug("Triton's cache key did not start early", exc_info=True)


def register_cache_key_start() -> None:
    """Have Dynamo call ``fusion.warm_compiler_early`` as each compile starts, before its
    trace (what it starts, where, and why: its docstring). Dynamo runs the callback in every
    compile of the process, whichever backend; past the first it costs two checks, as the
    key is computed once per process. Registered at import, and again by each graph, as
    ``torch._dynamo.reset()`` drops Dynamo's callbacks."""
    if _start_cache_key_at_compile not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_start_cache_key_at_compile)


register_cache_key_start()
