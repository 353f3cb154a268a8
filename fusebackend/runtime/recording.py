"""Recording a captured entry: which inputs are used in place, copied in or staged from the
host, the capture itself (``capture.capture_graph``), which outputs are inputs, and what the
entry holds alone; and why a signature must not be captured at all (``capture_blocker``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fusebackend.runtime import capture as _capture
from fusebackend.runtime import payoff
from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.effects import storage_ptr
from fusebackend.runtime.entries import Entry
from fusebackend.runtime.modes import Mode
from fusebackend.runtime.staging import PinnedRing

__all__ = ["capture_blocker", "record", "unread_inputs"]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def record(
    mode: Mode,
    fn: Callable[..., Sequence[Any]],
    args: tuple[Any, ...],
    *,
    device: torch.device | None,
    warmup_iterations: int,
    static: Collection[int],
    copied_static: set[int],
    host: Mapping[int, torch.device],
    mutated: Sequence[int],
    static_outputs: bool,
) -> Entry:
    """Capture ``fn`` on ``args`` into a new entry in ``mode``.

    ``static``: inputs used in place, except ``copied_static`` (they moved too often);
    ``host``: CPU inputs staged to that device; ``mutated``: inputs the graph writes (a copied
    one is written back after each replay). Inputs ``fn`` never reads (``unread_inputs``)
    are neither copied in nor checked for a new address. Raises whatever the capture raised.
    """
    _capture.reap()
    unread = unread_inputs(fn)
    inputs = list(args)
    copies: list[tuple[int, Tensor]] = []
    host_copies: list[tuple[int, Tensor, PinnedRing]] = []
    static_idx: list[int] = []
    static_ptrs: list[int | None] = [None] * len(args)
    tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor) and i not in unread]
    staged = {i for i in tensors if i in host and args[i].device.type == "cpu"}
    in_place = {i for i in tensors if i in static} - copied_static - staged
    # An input sharing a storage with one used in place (b = a[1:] while the graph writes
    # a) is used in place too: a copy of it would miss the graph's own writes on replay.
    shared = {storage_ptr(args[i]) for i in in_place} - {0}
    for i in tensors:
        a = args[i]
        if i in in_place or (i not in staged and storage_ptr(a) in shared):
            static_idx.append(i)
            static_ptrs[i] = a.data_ptr()
        elif i in staged:
            # Before the 0-d case: a staged CPU scalar is copied in on every replay.
            buf = torch.empty_like(a, device=host[i])
            ring = PinnedRing(a)
            ring.copy(buf, a)
            host_copies.append((i, buf, ring))
            inputs[i] = buf
        elif a.dim() == 0 and a.device.type == "cpu":
            continue  # read on the host at capture, baked in: its value is in the key
        else:
            buf = torch.empty_like(a)
            buf.copy_(a)
            copies.append((i, buf))
            inputs[i] = buf
    graph, outputs = _capture.capture_graph(
        fn, inputs, device=device, warmup_iterations=warmup_iterations
    )
    COUNTERS.recordings += 1
    by_identity = {id(inputs[i]): i for i in tensors}
    host_idx = {i for i, _, _ in host_copies}
    aliases = tuple(
        by_identity.get(id(out)) if isinstance(out, Tensor) else None for out in outputs
    )
    # A returned host input lives on the device in the graph; the caller's tensor is on
    # the CPU, so it is returned as a device copy like any other output.
    aliases = tuple(None if a in host_idx else a for a in aliases)
    buffers = {i: buf for i, buf in copies} | {i: buf for i, buf, _ in host_copies}
    out_bytes = payoff.output_bytes(outputs, aliases)
    large = out_bytes >= payoff.LARGE_OUTPUT_BYTES
    return Entry(
        mode=mode,
        fn=fn,
        graph=graph,
        copy_idx=tuple(i for i, _ in copies),
        copy_bufs=[buf for _, buf in copies],
        host_copies=tuple(host_copies),
        written=tuple(i for i in mutated if i in buffers),
        buffers_by_index=buffers,
        static_idx=static_idx,
        static_ptrs=static_ptrs,
        outputs=tuple(outputs),
        aliases=aliases,
        out_tuple=isinstance(outputs, tuple),
        # What this entry holds alone: the pool's intermediates are shared by all graphs
        # of the device (replays never overlap), its outputs and input buffers are not.
        nbytes=out_bytes + sum(_nbytes(buf) for buf in buffers.values()),
        # Kept outputs are copied after each replay; static_outputs copies nothing.
        trial=payoff.CaptureTrial() if large and not static_outputs else None,
    )


def unread_inputs(fn: Callable[..., Any]) -> frozenset[int]:
    """Inputs of an FX graph module ``fn`` that no node reads (placeholders without users).

    With its BatchNorms folded and its weights copied channels-last, a fused graph reads the
    derived constants it owns instead of the parameters they come from (``Refresh`` checks
    those after each replay's launch). Checking the parameters' addresses before every replay
    as well cost ~100 ns a tensor in torch's C++ check: for RegNetY-016's and MobileNetV3's
    several hundred parameters a large part of the host time before the launch
    (``diag_vision_host.py``, H200, 2026-11-29). Any other callable reads every input."""
    graph = getattr(fn, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return frozenset()
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    return frozenset(i for i, node in enumerate(inputs) if not node.users)


def capture_blocker(
    args: tuple[Any, ...], static: Collection[int], mutated: Sequence[int]
) -> str | None:
    """Why the graph must not be captured for these inputs, or None."""
    for i in static:
        a = args[i] if i < len(args) else None
        if isinstance(a, Tensor) and a.dim() == 0 and a.device.type == "cpu":
            # Read on the host at capture and baked in; as a static input its value is
            # not in the key either, so a later in-place change would never be seen.
            return (
                f"input {i} is a CPU scalar tensor used in place: a CUDA graph would keep "
                f"the value it had at capture"
            )
    for i in mutated:
        a = args[i] if i < len(args) else None
        if not isinstance(a, Tensor) or a.device.type != "cpu":
            continue
        # A CPU 0-d tensor (a counter on the host) is updated by a CPU kernel while the
        # graph is captured, never on replay. Other CPU tensors fail capture anyway
        # (capture_graph), except host inputs: the graph writes their device copy, which
        # each replay copies back.
        if a.dim() == 0:
            return (
                f"input {i} is a CPU scalar tensor the graph writes in place: "
                f"a CUDA graph replay would not update it"
            )
    return None
