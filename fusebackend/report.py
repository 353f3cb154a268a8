"""FusionReport: what the backend decided for each graph, for people; explain()."""

from __future__ import annotations

import dataclasses
import textwrap
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FusionReport", "GraphReport", "GroupReport", "RejectionReport", "explain",
           "last_report", "reports"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GroupReport:
    """One fused group: the nodes it absorbed and the kernel that runs it."""

    name: str
    kernel_name: str
    nodes: tuple[str, ...]  # FX node names absorbed (lookups first are marked in lookups)
    lookups: tuple[str, ...]
    inputs: tuple[str, ...]  # graph values the kernel reads
    outputs: tuple[str, ...]  # node names whose values the kernel writes
    source: str  # generated Triton source
    backend: str  # "triton" or "torch reference" (no usable Triton for this device)
    reductions: tuple[str, ...] = ()  # members that reduce along the row (norms, softmax)
    moves: tuple[str, ...] = ()  # members that move columns (rotate_half)
    launched_with: str = ""  # the group of the same kernel run by the same launch, if any


@dataclasses.dataclass(frozen=True)
class RejectionReport:
    """A candidate that was not fused, or a consumer where a group stopped growing."""

    node: str
    reason: str


@dataclasses.dataclass
class GraphReport:
    """The backend's decisions for one graph Dynamo produced."""

    name: str
    device: str
    path: str  # "fused", "unfused (...reason...)"
    groups: list[GroupReport]
    rejections: list[RejectionReport]
    mutated_inputs: list[str]
    host_inputs: list[str]
    compile_seconds: float
    # A weak reference to the graph's GraphCache: a report must not keep captured graphs
    # alive after the compiled model is gone (reports are kept for last_report/explain).
    runtime_ref: Any = None
    # Inputs used in place other than parameters and buffers (marked static, or mutated).
    static_inputs: list[str] = dataclasses.field(default_factory=list)
    # Nodes built from Python values alone, computed once at compile time (passes/constants).
    constants: list[str] = dataclasses.field(default_factory=list)
    # Per-layer state updates and sums run as foreach ops (passes/batching).
    batched_updates: list[str] = dataclasses.field(default_factory=list)
    # Indexing nodes whose list indices became index tensors (passes/constants).
    list_indices: list[str] = dataclasses.field(default_factory=list)
    # Boolean attention masks made additive once for all their SDPA calls (passes/attention).
    shared_masks: list[str] = dataclasses.field(default_factory=list)
    # SDPA calls whose mask, the same for every key, was dropped (passes/attention).
    dropped_masks: list[str] = dataclasses.field(default_factory=list)
    # Pairs of KV-cache index_copy_ writes run as one launch in the fused graph
    # (passes/cache_writes).
    cache_writes: list[str] = dataclasses.field(default_factory=list)
    # Decode steps' SDPA calls run by the kernel that reads K/V unrepeated, in the fused
    # graph (passes/decode_attention).
    decode_attention: list[str] = dataclasses.field(default_factory=list)
    # Nodes that run on the host at each call, before the captured device part.
    host_nodes: list[str] = dataclasses.field(default_factory=list)
    # Tensor parallelism: DTensor inputs run as their local shards (passes/dtensor).
    local_shards: list[str] = dataclasses.field(default_factory=list)
    # all-reduce copies dropped: readers take the reduced tensor (passes/collectives).
    reduce_copies: list[str] = dataclasses.field(default_factory=list)
    # Vocab-parallel embeddings run as one kernel + all-reduce (passes/collectives).
    vocab_lookups: list[str] = dataclasses.field(default_factory=list)
    # Collectives in the graph the runtime runs (captured with it on CUDA graphs).
    collectives: list[str] = dataclasses.field(default_factory=list)

    @property
    def runtime(self) -> Any:
        """The graph's GraphCache while it is alive, else None."""
        return self.runtime_ref() if self.runtime_ref is not None else None

    def runtime_modes(self) -> list[dict[str, Any]]:
        runtime = self.runtime
        return runtime.describe() if runtime is not None else []


@dataclasses.dataclass
class FusionReport:
    """Reports of every graph compiled during one ``explain`` call (or the last one)."""

    graphs: list[GraphReport]

    @property
    def groups(self) -> list[GroupReport]:
        return [g for graph in self.graphs for g in graph.groups]

    @property
    def rejections(self) -> list[RejectionReport]:
        return [r for graph in self.graphs for r in graph.rejections]

    @property
    def source(self) -> str:
        """Generated Triton source of every fused group, in order."""
        return "\n\n".join(g.source for g in self.groups)

    def __str__(self) -> str:
        if not self.graphs:
            return "FusionReport: no graph was compiled (was the function already compiled?)"
        lines = []
        for index, graph in enumerate(self.graphs):
            lines.append(
                f"== {graph.name} on {graph.device}: {graph.path}, "
                f"{len(graph.groups)} group(s), compiled in {graph.compile_seconds:.3f}s"
            )
            if graph.groups:
                lines += _table(
                    ["group", "kernel", "runs on", "lookups", "nodes", "outputs"],
                    [[g.name, g.kernel_name, g.backend, ", ".join(g.lookups),
                      ", ".join(g.nodes), ", ".join(g.outputs)] for g in graph.groups],
                )  # fmt: skip
            twins = sorted({tuple(sorted((g.name, g.launched_with)))
                            for g in graph.groups if g.launched_with})  # fmt: skip
            if twins:
                lines.append("one launch each: " + ", ".join(f"{a} + {b}" for a, b in twins))
            if graph.rejections:
                lines.append("not fused:")
                lines += _table(["node", "reason"],
                                [[r.node, r.reason] for r in graph.rejections], 90)  # fmt: skip
            for entry in graph.runtime_modes():
                reason = f" ({entry['reason']})" if entry.get("reason") else ""
                lines.append(f"  signature {entry['key']}: mode {entry['mode']}{reason}")
            if graph.mutated_inputs:
                lines.append(f"mutated inputs: {', '.join(graph.mutated_inputs)}")
            if graph.host_inputs:
                lines.append(f"host inputs copied to the device: {', '.join(graph.host_inputs)}")
            if graph.static_inputs:
                lines.append(f"inputs used in place: {', '.join(graph.static_inputs)}")
            if graph.constants:
                # The folded nodes' names are Dynamo's (arange, tensor_3, getitem): a count
                # says what happened, the names stay one attribute away.
                lines.append(
                    f"constants built once: {len(graph.constants)} tensor(s) made from Python "
                    "values alone (torch.arange, torch.tensor and ops on them),"
                )
                lines.append(
                    "  computed at compile time, not at each call (node names: "
                    f"report.graphs[{index}].constants)"
                )
            for field, label in _REWRITE_LINES:
                names = getattr(graph, field)
                if names:
                    lines.append(f"{label}: {', '.join(names)}")
            if graph.host_nodes:
                lines.append(f"run on the host each call: {', '.join(graph.host_nodes)}")
        return "\n".join(lines)


# The graph rewrites a report lists after its constants, in order: (GraphReport field,
# explain's label).
_REWRITE_LINES = (
    ("batched_updates", "batched into foreach ops"),
    ("list_indices", "list indices as index tensors on the device"),
    ("shared_masks", "boolean attention masks made additive once"),
    ("dropped_masks", "attention without a mask uniform along the keys"),
    ("cache_writes", "KV-cache writes in one launch (fused graph)"),
    ("decode_attention", "decode attention reading K/V unrepeated (fused graph)"),
    ("local_shards", "DTensor inputs run as their local shards"),
    ("reduce_copies", "all-reduce copies dropped"),
    ("vocab_lookups", "vocab-parallel lookups as one kernel + all-reduce (fused graph)"),
    ("collectives", "collectives (in the captured graph on CUDA)"),
)


def _table(header: list[str], rows: list[list[str]], width: int = 80) -> list[str]:
    """Rows as text columns; a cell wider than ``width`` wraps at spaces onto the next lines
    of its row (nothing is cut: node lists and rejection reasons are shown whole)."""
    cells = [[_wrap(str(c), width) for c in row] for row in rows]
    widths = [max(len(line) for cell in col for line in cell) for col in
              zip([[h] for h in header], *cells)]  # fmt: skip

    def fmt(row: list[str]) -> str:
        return "  " + " | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    lines = [fmt(header), "  " + "-+-".join("-" * w for w in widths)]
    for row in cells:
        for k in range(max(len(cell) for cell in row)):
            lines.append(fmt([cell[k] if k < len(cell) else "" for cell in row]))
    return lines


def _wrap(text: str, width: int) -> list[str]:
    # break_on_hyphens off: node names (embedding_1) and op spellings stay whole; a single
    # word longer than the column (a long kernel name) is broken only then.
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


_REPORTS: list[GraphReport] = []
_REPORTS_LOCK = threading.Lock()
_MAX_KEPT = 256  # reports are small, but a recompiling loop must not grow memory forever
_recorded = 0  # reports ever recorded; explain() counts from it


def record(report: GraphReport) -> None:
    global _recorded
    with _REPORTS_LOCK:
        _REPORTS.append(report)
        del _REPORTS[:-_MAX_KEPT]
        _recorded += 1


def _reports_since(count: int) -> list[GraphReport]:
    with _REPORTS_LOCK:
        new = _recorded - count
        return list(_REPORTS[-new:]) if new else []


def last_report() -> FusionReport:
    """The report of the most recent graph compiled (one graph), or an empty report.

    A compiled model that Dynamo split at graph breaks, or recompiled, has several graphs:
    ``reports()`` shows them all."""
    with _REPORTS_LOCK:
        return FusionReport(_REPORTS[-1:])


def reports() -> FusionReport:
    """The reports of every graph compiled in this process so far, oldest first.

    One ``torch.compile``d model makes one graph per piece Dynamo splits it into at graph
    breaks, and one more per recompile (a new shape, dtype or grad mode): all are here,
    beside those of other compiled models (each graph's header names its device and path).
    The most recent 256 are kept."""
    with _REPORTS_LOCK:
        return FusionReport(list(_REPORTS))


def _uncompiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself when it is the result of ``torch.compile`` (a module or a function)."""
    import torch

    if isinstance(fn, torch._dynamo.eval_frame.OptimizedModule):
        return fn._orig_mod
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def explain(
    fn: Callable[..., Any], *args: Any, options: dict[str, Any] | None = None, **kwargs: Any
) -> FusionReport:
    """Compile ``fn`` with infinifuse, run it once on the arguments and report.

    Returns the report of every graph Dynamo produced during that call: the fused
    groups (nodes absorbed, kernel name, inputs, outputs, generated source) and every
    candidate not fused, with its reason. ``options`` are the backend's options.

    An inference tool: ``fn`` runs under ``torch.no_grad()`` (graphs that need gradients are
    never fused). ``fn`` is traced anew whether or not it was compiled before, by the user
    or by an earlier ``explain`` (a ``torch.compile``d module or function is unwrapped
    first); that compile is kept apart from the user's own (``isolate_recompiles``), so it
    neither reuses nor counts against their compiled entries.
    """
    import inspect

    import torch

    from fusebackend.backend import infinifuse

    def backend(gm: Any, example_inputs: Any, **backend_kwargs: Any) -> Any:
        # A new callable per explain call: Dynamo reuses a compiled entry only for the
        # backend that made it, so the user's earlier torch.compile(fn, backend="infinifuse")
        # is not served here (it was: "no graph was compiled", issue 25).
        return infinifuse(gm, example_inputs, **backend_kwargs)

    extra: dict[str, Any] = {}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        extra["isolate_recompiles"] = True
    with _REPORTS_LOCK:
        start = _recorded
    compiled = torch.compile(_uncompiled(fn), backend=backend, options=options, **extra)
    with torch.no_grad():
        compiled(*args, **kwargs)
    return FusionReport(_reports_since(start))
