"""Graph preparation: the passes that ready Dynamo's graph for capture, in place, before
fusion (``PREPARE``, run by backend.py through fusebackend/pipeline.py), the device part the
runtime runs, and which of its inputs the runtime uses in place (docs/ARCHITECTURE.md,
"Graph preparation"). A new preparation pass is a module under passes/ and one line in
``PREPARE``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.config import FusionConfig
from fusebackend.passes.attention import drop_key_uniform_masks, share_mask_conversion
from fusebackend.passes.batching import batch_scalar_updates, batch_state_sums
from fusebackend.passes.collectives import drop_reduce_copies, reduce_in_place
from fusebackend.passes.constants import fold_constants, fold_list_indices
from fusebackend.passes.dtensor import unwrap_dtensors
from fusebackend.passes.fx_util import example_value, placeholders
from fusebackend.passes.host_inputs import (
    HostSplit,
    hoist_host_to_device,
    split_host,
    stage_scalars,
)
from fusebackend.passes.mutations import mutated_placeholders
from fusebackend.passes.signature_constants import (
    SignatureConstants,
    signature_chain_nodes,
    split_signature_constants,
)
from fusebackend.pipeline import Compilation, Pass
from fusebackend.runtime.graph_cache import captures

__all__ = ["PREPARE", "DevicePart", "batch_size_inputs", "device_part", "is_module_state",
           "is_parameter_or_buffer",
           "static_inputs"]  # fmt: skip


# ---- Graph preparation: Dynamo's graph, in place, before fusion (docs/ARCHITECTURE.md).


def _unwrap_dtensors(c: Compilation) -> list[str] | None:
    """Tensor parallelism: DTensor inputs (sharded parameters) run as their local shards."""
    c.shards = unwrap_dtensors(c.gm, c.example_inputs)
    if c.shards is None:
        return None
    c.example_inputs = c.shards.local_inputs(c.example_inputs)
    return list(c.shards.names)


def _static_addresses(c: Compilation) -> None:
    # A sharded parameter's (or static DTensor's) mark is on the DTensor, not on the local
    # shard that example_inputs now holds.
    sharded = c.shards.parameters if c.shards is not None else frozenset()
    inputs = zip(placeholders(c.gm.graph), c.example_inputs, strict=False)
    c.static_address = [
        node
        for i, (node, value) in enumerate(inputs)
        if i in sharded or getattr(value, "_dynamo_static_input_type", None) is not None
    ]


def _hoist_host_to_device(c: Compilation) -> None:
    c.host_inputs = hoist_host_to_device(c.gm, c.example_inputs)


def _drop_reduce_copies(c: Compilation) -> list[str]:
    dropped = drop_reduce_copies(c.gm.graph)
    if dropped:
        c.gm.recompile()
    return dropped


def _reduce_in_place(c: Compilation) -> list[str]:
    made = reduce_in_place(c.gm.graph)
    if made:
        c.gm.recompile()
    return made


def _mutated_placeholders(c: Compilation) -> None:
    c.mutated = mutated_placeholders(c.gm.graph)


def _split_host(c: Compilation) -> list[str] | None:
    # A host chain of sizes and constants (MPNet-5.17's position buckets at static shapes:
    # folded up to an in-place ``+=``, the rest host work) gives the same tensor at every call
    # of a signature: left to the device part, the runtime computes it once per signature
    # (``device_part``) where the host part would run it and stage its copy every call.
    c.split = split_host(c.gm, _on_host, signature_chain_nodes(c.gm, _on_host))
    return c.split.nodes if c.split is not None else None


def _captured(c: Compilation) -> bool:
    # Nothing is captured without CUDA graphs: the split would only add snapshot clones.
    return captures(c.config, c.device)


# (name, run, explain's label, report key, needs_rewrites, when). The functions are looked
# up at each call, so a test may patch them on this module.
PREPARE = [
    Pass("unwrap_dtensors", _unwrap_dtensors, "DTensor inputs run as their local shards",
         report="local_shards"),
    Pass("static_addresses", _static_addresses),
    Pass("hoist_host_to_device", _hoist_host_to_device),
    Pass("fold_constants", lambda c: fold_constants(c.gm), report="constants"),
    Pass("fold_list_indices", lambda c: fold_list_indices(c.gm),
         "list indices as index tensors on the device", report="list_indices"),
    Pass("batch_scalar_updates", lambda c: batch_scalar_updates(c.gm, c.static_address),
         "batched into foreach ops", report="batched_updates", needs_rewrites=True),
    Pass("batch_state_sums",
         lambda c: batch_state_sums(c.gm, c.static_address, c.device or torch.device("cpu")),
         "batched into foreach ops", report="batched_updates", needs_rewrites=True),
    Pass("drop_key_uniform_masks", lambda c: drop_key_uniform_masks(c.gm),
         "attention without a mask uniform along the keys", report="dropped_masks",
         needs_rewrites=True),
    Pass("share_mask_conversion", lambda c: share_mask_conversion(c.gm),
         "boolean attention masks made additive once", report="shared_masks",
         needs_rewrites=True),
    Pass("drop_reduce_copies", _drop_reduce_copies, "all-reduce copies dropped",
         report="reduce_copies", needs_rewrites=True),
    Pass("reduce_in_place", _reduce_in_place, "all-reduces in place (no clone of their input)",
         report="in_place_reduces", needs_rewrites=True),
    Pass("mutated_placeholders", _mutated_placeholders),
    Pass("split_host", _split_host, "run on the host each call", report="host_nodes",
         when=_captured),
]  # fmt: skip


def device_part(c: Compilation) -> DevicePart:
    """What the runtime runs of the prepared graph (timed as the pass ``device_part``).

    Where CUDA graphs capture, host chains of that part that read only sizes become its
    per-signature inputs (``split_signature_constants``; ``explain`` lists their nodes and
    why other host-to-device copies stay in the graph)."""
    start = time.perf_counter()
    if c.split is None:
        inputs = c.example_inputs
        part = DevicePart(c.gm, list(inputs), c.host_inputs, range(len(inputs)))
    else:
        part = _device_part_of(c.split, c.example_inputs, c.host_inputs, c.device)
    if _captured(c):
        found = split_signature_constants(part.graph, _on_host)
        if found.module is not None:
            part.graph, part.per_signature = found.module, found
            c.rewrites.setdefault("signature_constants", []).extend(found.nodes)
            c.labels["signature_constants"] = "computed once per signature (sizes only)"
        if found.refused:
            c.rewrites.setdefault("host_copies_kept", []).extend(found.refused)
            c.labels["host_copies_kept"] = "host-to-device copies left in the captured graph"
    c.seconds["device_part"] = time.perf_counter() - start
    return part


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
    # Host chains of sizes taken out of ``graph``: its last ``per_signature.count`` inputs,
    # which ``example_inputs`` leaves out (the runtime computes them per signature).
    per_signature: SignatureConstants | None = None


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
    nodes = placeholders(split.device.graph)
    examples = [None] * first + [example_value(p) for p in nodes[first:]]
    moved |= {i: d for i, d in hoist_host_to_device(split.device, examples).items() if i >= first}
    inputs = [example_inputs[i] for i in split.device_args] + [None] * split.num_boundary
    return DevicePart(split.device, inputs, moved, split.device_args)


def batch_size_inputs(placeholders: list[torch.fx.Node], static: frozenset[int]) -> frozenset[int]:
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


def static_inputs(
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
    static = {i for i, t in enumerate(example_inputs) if is_parameter_or_buffer(t)}
    if config.batch_buckets is None:
        tensors = {i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor)}
        static |= (mutated & tensors) - set(host_inputs)
    if device is not None:
        static -= {i for i in static if _on_host_scalar(example_inputs[i])}
    return frozenset(static)


def _on_host_scalar(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and _on_host(t)


def is_parameter_or_buffer(t: Any) -> bool:
    # Dynamo marks the parameters and buffers of inlined nn.Modules, and mark_static_address
    # marks any tensor, with this attribute.
    return isinstance(t, torch.nn.Parameter) or (
        isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is not None
    )


def is_module_state(t: Any) -> bool:
    """A parameter or a module buffer (Dynamo sets ``_is_buffer`` on buffers it inlines)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_is_buffer", False)
