"""FusionReport: what the backend decided for each graph, for people (``explain`` is in
explaining.py: it compiles through the backend, which records here)."""

from __future__ import annotations

import dataclasses
import textwrap
import threading
from typing import Any

__all__ = ["FusionReport", "GraphReport", "GroupReport", "RejectionReport", "last_report",
           "reports", "row_groups"]  # fmt: skip


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
    reductions: tuple[str, ...] = ()  # members that read whole rows (norms, softmax, cumsum)
    moves: tuple[str, ...] = ()  # members that move elements (rotate_half, cat)
    launched_with: str = ""  # the group of the same kernel run by the same launch, if any
    # the kernel family: "row" (generated row kernels: kernels/codegen.py) or "matmul" (a
    # matmul group: kernels/matmul.py, its source the generated activation, if any)
    family: str = "row"


def row_groups(groups: list[GroupReport]) -> int:
    """How many of ``groups`` are row kernels' (row groups are named group0, group1, ...;
    matmul groups matmul0, ...)."""
    return sum(g.family == "row" for g in groups)


@dataclasses.dataclass(frozen=True)
class RejectionReport:
    """A candidate that was not fused, or a consumer where a group stopped growing."""

    node: str
    reason: str


def _rewrite(key: str, doc: str) -> property:
    return property(lambda self: self.rewrites.get(key, []), doc=doc)


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
    # What each pass reported (backend.py's pass lists, fusebackend/pipeline.py), in the
    # order they ran: report key -> node names, and report key -> explain's label for them
    # (constants are counted, not listed).
    rewrites: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    # Seconds each pass took, by pass name.
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Kernel (a kernel family's describe()) -> its launches in the fused graph.
    launches: dict[str, int] = dataclasses.field(default_factory=dict)
    # Kernel -> how its launches run on the traced values -> how many (matmul groups: "GEMV"
    # for one row, "tensor cores", with their K slices; kernels/family.launch_path).
    launch_paths: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    # The rewrites under their names before they were data (read-only).
    constants = _rewrite("constants", "Nodes built from Python values alone (passes/constants)")
    list_indices = _rewrite("list_indices", "Indexing nodes with list indices as index tensors")
    batched_updates = _rewrite("batched_updates", "Per-layer updates and sums as foreach ops")
    dropped_masks = _rewrite("dropped_masks", "SDPA calls whose key-uniform mask was dropped")
    shared_masks = _rewrite("shared_masks", "Boolean masks made additive once for all calls")
    reduce_copies = _rewrite("reduce_copies", "all-reduce copies dropped (passes/collectives)")
    in_place_reduces = _rewrite("in_place_reduces", "all-reduces run in place, with no clone")
    host_nodes = _rewrite("host_nodes", "Nodes that run on the host at each call")
    local_shards = _rewrite("local_shards", "DTensor inputs run as their local shards")
    vocab_lookups = _rewrite("vocab_lookups", "Vocab-parallel lookups as one kernel")
    cache_writes = _rewrite("cache_writes", "KV-cache write pairs run as one launch")
    decode_attention = _rewrite("decode_attention", "SDPA calls run by decode_attention")
    cudnn_free_attention = _rewrite("cudnn_free_attention", "SDPA calls run with cuDNN's off")
    collectives = _rewrite("collectives", "Collectives in the graph the runtime runs")

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
                served = entry.get("served_by")
                where = f", served by {served} (an older compilation)" if served else ""
                lines.append(f"  signature {entry['key']}: mode {entry['mode']}{reason}{where}")
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
            if graph.launches:
                # the backend's own kernels in the fused graph, one launch per call each
                # (what else the graph runs, as Dynamo traced it, is not counted here)
                lines.append(f"fused kernel launches per call: {sum(graph.launches.values())}")
                for name, n in sorted(graph.launches.items(), key=lambda kv: -kv[1]):
                    ways = graph.launch_paths.get(name, {})  # e.g. (GEMV x 22)
                    how = ", ".join(f"{way} x {k}" for way, k in sorted(ways.items()))
                    lines.append(f"  {name} x {n}" + (f" ({how})" if how else ""))
            for key, names in graph.rewrites.items():
                label = graph.labels.get(key)
                if not (names and label):  # constants have none: counted above
                    continue
                if any(": " in name for name in names):  # entries that explain themselves
                    lines.append(f"{label}:")  # (matmul groups): one per line
                    lines += [f"  {name}" for name in names]
                else:
                    lines.append(f"{label}: {', '.join(names)}")
            if graph.local_shards:
                # On 2 H100s these checks took 2.1 ms of host time per TinyLlama TP=2 decode
                # step against its kernels' 1.2 ms (benchmarks/diag/diag_tp_step.py)
                lines += [
                    "note: before each call Dynamo checks every DTensor input's sharding on the "
                    "host, which can take",
                    "  longer than a small step's kernels; where parameters are not replaced "
                    "after compile, compile with",
                    "  options={'guard_filter_fn': "
                    "torch.compiler.skip_guard_on_all_nn_modules_unsafe} (a new dict for each",
                    "  torch.compile call: it takes the filter out of the dict it is given; "
                    "README: Tensor parallelism)",
                ]
        return "\n".join(lines)


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
