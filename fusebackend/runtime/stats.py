"""The public runtime controls: ``stats()``, ``reset_stats()``, ``clear_cache()`` and the fusion
switch.

Reads the counters and the cache registry of ``counters.py`` (where the graph caches write),
so this module imports the graph cache's modules and none of them imports it.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import torch

from fusebackend.runtime.capture import pool_bytes, release_pools
from fusebackend.runtime.counters import (
    COUNTERS,
    EVICTION_REASONS,
    Counters,
    fusion_enabled,
    live_caches,
    set_fusion_enabled,
)

__all__ = [
    "COUNTERS",
    "Counters",
    "clear_cache",
    "fusion_enabled",
    "reset_stats",
    "set_fusion_enabled",
    "stats",
]


def reset_stats() -> None:
    """Zero every counter. Cached graphs stay; use ``clear_cache()`` to drop them."""
    COUNTERS.reset()


def clear_cache() -> None:
    """Free every captured graph, static buffer and fallback verdict of every live cache.

    Also drops the shared graph memory pools so their memory goes back to the allocator
    (and, with ``torch.cuda.empty_cache()``, to the device). Outputs a caller still holds
    (``static_outputs=True`` views) keep their own memory alive. Counters are not reset.
    """
    for cache in live_caches():
        cache.clear()
    release_pools()
    # The collection is for device memory held by reference cycles (tensors inside a cycle
    # with the model); without CUDA there is none, and a full collection costs ~0.1 s.
    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def stats() -> dict[str, Any]:
    """Counters and a snapshot of the live caches.

    Keys:
        enabled: The global fusion switch (``set_fusion_enabled``).
        fusion_scheduler_available: Triton imports and a CUDA device is available, i.e.
            fused kernels can run natively (without ``TRITON_INTERPRET``).
        cache_size: Live entries (input signatures) across all caches, any mode.
        cache_hits: Calls whose signature already had an entry.
        cache_misses: Calls that created an entry (first call of a signature, or again after
            its entry was evicted or cleared).
        recordings: Successful CUDA-graph captures (re-records included).
        fusion_attempts: First runs of a fused callable (one per new signature in "fusion").
        fusion_successes: Fused first runs that ran without error and, when compared with
            the unfused graph (``validations``), matched it; uncompared ones (``validate``
            off, or their class already matched) that ran without error. A graph rewritten
            but never run counts nothing.
        validations: First runs compared with the unfused graph: once per compiled graph and
            validation class (``keys.plan_class``: the dtypes, ranks and layouts of the
            inputs, not their sizes) until one matches; a failed one falls back and the
            class's next new signature is compared again.
        validations_within_noise: Validations that matched only within the model's own
            noise: outside the fixed tolerances, but within half of how far one ulp of noise
            on the floating inputs moves the unfused graph's outputs (``runtime/validation``).
        validations_nearer_float32: Half-precision validations that matched neither way, but
            whose fused outputs are as near the unfused graph's float32 result as the unfused
            outputs are (BatchNorms folded into fp16 weights; ``runtime/validation``).
        fusion_fallbacks: Signatures that left "fusion" for another mode (fused callable
            raised, mismatched, or could not be captured).
        cached_shapes: For each live entry, the shapes of its non-static tensor inputs as a
            tuple of tuples (after batch-bucket padding). Parameters and buffers are not in
            keys: their addresses are checked instead.
        fusion_modes: Readable key -> "fusion" | "graph_replay" | "eager" for each live entry.
            "fusion": the fused graph (captured when CUDA graphs are on); "graph_replay": the
            unfused graph, captured; "eager": the unfused graph run directly.
        fallback_reasons: Readable key -> why the entry is not in its first-choice mode, for
            live entries that fell back.
        evictions: Entries dropped, for any of ``eviction_reasons``.
        eviction_reasons: Cause -> entries dropped for it: ``"graph_memory"`` (the least
            recently used captured entries of all graphs past the ``graph_memory`` budget),
            ``"max_graphs"`` (the per-graph count cap), ``"superseded"`` (a newer compilation
            of the same function, after Dynamo's recompiles, serves those shapes),
            ``"entry_limit"`` (more than 4096 signatures in one graph).
        rerecords: Captures redone because an input used in place (parameter, buffer, KV
            cache, written input) changed address (e.g. ``param.data = ...``); one that moves
            on 3 consecutive calls is copied in from then on.
        capture_failures: CUDA-graph captures (warm-up included) that raised; each one moves
            its signature one step down the fallback chain.
        older_graph_calls: Calls a newer compilation of a function (after Dynamo's
            recompiles) handed to an older one that holds an entry for their signature and
            computes the same function for it, instead of a new entry of their own; the
            older graph counts them as hits (or misses, if its entry went since).
        replays_on_stale_constants: Replays run again because the check after a replay
            found a derived constant's source changed (an edited weight or BatchNorm
            statistic): the replay had read the old folded values, its outputs were dropped.
        graph_pool_bytes: Device memory reserved by the shared graph memory pools (0 without
            CUDA).
        captured_bytes: Device memory the live captured entries hold alone (their static
            input and output buffers): what ``graph_memory`` bounds. The pools' shared
            intermediates (in ``graph_pool_bytes``) come on top.
        ignored_options: Compiled graph (name#number) -> the options it was given that cannot
            take effect on it, with the reason (``cudagraphs=True`` on a CPU graph or without
            CUDA, ``batch_buckets`` on a graph with no batch dimension, ``length_buckets`` on
            a graph without ``input_ids`` or that writes its inputs, a length bucket whose
            padded run differed from the unpadded one); each is also logged once as a
            warning.

    Readable keys look like ``"embed#0 fused (int64[4, 7], float16[7, 64]@cpu, 3)"``: cache
    name and number, whether the fused graph is selected, then each non-static input (dtype
    and shape, then strides if not contiguous and device if not the graph's own).
    """
    result: dict[str, Any] = {
        "enabled": fusion_enabled(),
        "fusion_scheduler_available": _scheduler_available(),
    }
    rows = [row for cache in live_caches() for row in cache.stats_rows()]
    result["cache_size"] = len(rows)
    result.update(COUNTERS.as_dict())
    result["cached_shapes"] = [row.shapes for row in rows]
    result["fusion_modes"] = {row.label: row.mode for row in rows}
    result["fallback_reasons"] = {row.label: row.reason for row in rows if row.reason}
    result["eviction_reasons"] = dict(EVICTION_REASONS)
    result["graph_pool_bytes"] = pool_bytes()
    result["captured_bytes"] = sum(cache.table.held_bytes for cache in live_caches())
    result["ignored_options"] = {
        cache.label_prefix: list(cache.ignored_options)
        for cache in live_caches()
        if cache.ignored_options
    }
    return result


def _scheduler_available() -> bool:
    return torch.cuda.is_available() and _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True
