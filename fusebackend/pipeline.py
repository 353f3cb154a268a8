"""The backend's passes as data: an ordered list of ``Pass`` objects run in a loop.

Each pass is a name, the function that runs it on the ``Compilation`` (the state the passes
share: the graph, its example inputs, the config, what earlier passes found), the options it
needs (``needs_rewrites``, or any predicate on the compilation: ``when``) and what it reports:
the node names it returns, under its ``report`` key in ``GraphReport.rewrites``, with the
label ``explain`` prints before them. The loop times every pass (``GraphReport.pass_seconds``
and a debug log line per pass). The lists themselves are in backend.py, the one module that
sees passes and kernels: a new pass is one module under passes/ and one line there.

Imports no pass, kernel or runtime module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.config import FusionConfig

__all__ = ["Compilation", "Pass", "collector_paused", "pass_failure", "run_passes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Compilation:
    """What the passes of one compiled graph share; each pass reads and sets its fields."""

    name: str  # the graph's report name (graph0, ...)
    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    config: FusionConfig
    device: torch.device | None
    shards: Any = None  # passes/dtensor.LocalShards, under tensor parallelism
    static_address: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    host_inputs: dict[int, torch.device] = dataclasses.field(default_factory=dict)
    mutated: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    split: Any = None  # passes/host_inputs.HostSplit, when the graph has a host part
    # The fusion stage: a copy of the (device part's) graph, rewritten into the fused graph.
    graph: torch.fx.Graph | None = None
    candidates: list[Any] = dataclasses.field(default_factory=list)
    rejections: list[Any] = dataclasses.field(default_factory=list)
    groups: list[Any] = dataclasses.field(default_factory=list)  # GroupReports
    fused_nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    matmul_groups: int = 0  # matmul_group launches the graph got (passes/matmul_groups.py)
    # Run before each call with the graph's inputs (passes/batch_norm_folding.Refresh): keeps
    # the fused graph's derived constants in step with the parameters they come from.
    refresh: Callable[[Sequence[Any]], None] | None = None
    launches: dict[str, int] = dataclasses.field(default_factory=dict)  # kernel -> launches
    # kernel -> how its launches run -> how many (a family's optional launch_path)
    launch_paths: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    stopped: bool = False  # a pass ended its stage (nothing to fuse: no fused graph)
    running: str = ""  # the pass run last (or running): what a failure names
    # What the passes report: report key -> node names, report key -> explain's label, and
    # pass name -> seconds.
    rewrites: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Pass:
    """One step of the backend. ``run(compilation)`` rewrites the graph or records what it
    found on the compilation, and returns the node names to report (or None: nothing)."""

    name: str
    run: Callable[[Compilation], Sequence[str] | None]
    label: str = ""  # explain's label for the names it returns ("": not listed)
    report: str = ""  # the key of its names in GraphReport.rewrites (default: name)
    needs_rewrites: bool = False  # runs only with the option rewrites=True
    when: Callable[[Compilation], bool] | None = None  # runs only where this says so

    def enabled(self, compilation: Compilation) -> bool:
        if self.needs_rewrites and not compilation.config.rewrites:
            return False
        return self.when is None or self.when(compilation)


def run_passes(passes: Sequence[Pass], compilation: Compilation) -> None:
    """Run the enabled passes in order (until one stops the stage), timing each one."""
    for step in passes:
        if compilation.stopped:
            return
        if not step.enabled(compilation):
            continue
        start = time.perf_counter()
        compilation.running = step.name
        names = step.run(compilation)
        seconds = time.perf_counter() - start
        compilation.seconds[step.name] = compilation.seconds.get(step.name, 0.0) + seconds
        if names is not None:
            key = step.report or step.name
            compilation.rewrites.setdefault(key, []).extend(names)
            if step.label:
                compilation.labels[key] = step.label
        log.debug("%s: pass %s in %.4f s", compilation.name, step.name, seconds)


def pass_failure(compilation: Compilation, error: Exception) -> str:
    """What a report says of a pass that raised (an internal error): the pass, the error's
    type and its message, cut at 500 characters."""
    return f"{compilation.running}: {type(error).__name__}: {error}"[:500]


def drop_rejections(c: Compilation, gone: Callable[[torch.fx.Graph], list[str]]) -> list[str]:
    """Run a pass whose nodes gone into groups (a cat built by its parts' groups, a copy
    folded) are then no longer listed as not fused; their names."""
    names = gone(c.graph)
    c.rejections = [r for r in c.rejections if r.node not in names]
    return names


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
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
