"""FusionConfig: the one validated, frozen set of options every layer reads.

Users pass options as ``torch.compile(model, backend="infinifuse", options={...})``;
``FusionConfig.from_options`` turns that dict into this dataclass or raises a ``ValueError``
naming the option, what was expected, what was given and every valid option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["FusionConfig"]


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """Options of the ``infinifuse`` backend.

    Attributes:
        fusion: Fuse row-wise chains (embedding lookups, elementwise ops, last-dim
            reductions, norms, softmax, rotary embeddings) into generated Triton kernels.
            ``False`` compiles the graph unfused (the CUDA-graph cache still applies).
            ``fusebackend.set_fusion_enabled`` switches at run time.
        cudagraphs: Capture the compiled graph in CUDA graphs, one per input signature.
            ``None`` (default) means "when the graph runs on a CUDA device".
        warmup_iterations: Eager runs on a side stream before a capture (>= 1).
        max_graphs: Entries (input signatures, captured or not) kept per compiled graph
            (LRU); older ones are evicted.
        batch_buckets: Increasing batch sizes; the batch is the leading dim of the first
            non-parameter tensor input, inputs with that leading dim are padded up to the
            next bucket and the outputs sliced back, so many batch sizes share a few
            captures; batches above the largest bucket run unpadded. Only correct for
            row-independent models (row i of the output depends only on row i of the
            inputs).
        static_outputs: Return views of the captured graph's own output buffers instead
            of fresh tensors. Zero-copy, but a later call OVERWRITES what an earlier call
            returned (any shape: the captured graphs share one memory pool); only for
            callers whose use of each output is queued before the next call (on the same
            stream; another stream's call does not wait for later reads).
        validate: On the first run of each input signature, compare the fused graph's
            outputs with the unfused graph's; a mismatch falls back to the unfused graph.
        index_checks: Compile fused kernels with a device-side bounds assert on every
            index (as eager CUDA embedding does). Turning it off skips the assert but the
            kernel still never reads outside the table (out-of-range rows read as 0).
        round_intermediates: Round every intermediate value of a fused chain to the dtype
            eager gives it, so a chain rounds where eager rounds. ``False`` rounds only the
            kernel's outputs, as Inductor does: closer to the exact result, and may be
            faster (two fewer conversions per op in half precision; not measurably on the
            fp16 embedding chain).
        rewrites: Rewrite the graph beside fusion: per-layer state updates and sums run as
            foreach ops, an SDPA mask the same for every key is dropped, a boolean mask
            that every layer passes to SDPA is made additive once per step, a layer's two
            KV-cache writes run as one launch, and a decode step's attention reads K/V
            without transformers' repeat_kv copies through its own kernel
            (passes/batching.py, attention.py, cache_writes.py, decode_attention.py).
            ``False`` leaves those as traced; constants and list indices are folded either
            way (capture needs them).
    """

    fusion: bool = True
    cudagraphs: bool | None = None
    warmup_iterations: int = 1
    max_graphs: int = 16
    batch_buckets: tuple[int, ...] | None = None
    static_outputs: bool = False
    validate: bool = True
    index_checks: bool = True
    round_intermediates: bool = True
    rewrites: bool = True

    def __post_init__(self) -> None:
        for name in ("fusion", "static_outputs", "validate", "index_checks", "round_intermediates",
                     "rewrites"):  # fmt: skip
            _expect(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        _expect(
            self.cudagraphs is None or isinstance(self.cudagraphs, bool),
            "cudagraphs",
            "a bool or None",
            self.cudagraphs,
        )
        _expect(
            _is_int(self.warmup_iterations) and self.warmup_iterations >= 1,
            "warmup_iterations",
            "an int >= 1",
            self.warmup_iterations,
        )
        _expect(
            _is_int(self.max_graphs) and self.max_graphs >= 1,
            "max_graphs",
            "an int >= 1",
            self.max_graphs,
        )
        if self.batch_buckets is not None:
            buckets = self.batch_buckets
            ok = (
                isinstance(buckets, (list, tuple))
                and len(buckets) > 0
                and all(_is_int(b) and b >= 1 for b in buckets)
                and all(a < b for a, b in zip(buckets, buckets[1:]))
            )
            _expect(ok, "batch_buckets", "a strictly increasing list of ints >= 1", buckets)
            object.__setattr__(self, "batch_buckets", tuple(buckets))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | FusionConfig | None) -> FusionConfig:
        """Build a config from ``torch.compile``'s ``options`` dict (or pass one through)."""
        if options is None:
            return cls()
        if isinstance(options, FusionConfig):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(
                f"infinifuse options must be a dict, got {type(options).__name__}; "
                f"valid options: {', '.join(valid_option_names())}"
            )
        unknown = [key for key in options if key not in valid_option_names()]
        if unknown:
            raise ValueError(
                f"unknown infinifuse option(s) [{', '.join(sorted(map(repr, unknown)))}]; "
                f"valid options: {', '.join(valid_option_names())}"
            )
        return cls(**options)

    def replace(self, **changes: Any) -> FusionConfig:
        return dataclasses.replace(self, **changes)


def valid_option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(FusionConfig)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(ok: bool, name: str, expected: str, given: Any) -> None:
    if not ok:
        raise ValueError(
            f"infinifuse option {name!r} must be {expected}, got {given!r}; "
            f"valid options: {', '.join(valid_option_names())}"
        )
