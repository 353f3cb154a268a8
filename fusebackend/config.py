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
        max_graphs: An optional cap on the entries (input signatures, captured or not)
            kept per compiled graph (LRU); ``None`` (default): no count cap, captured
            entries are bounded by ``graph_memory`` instead.
        graph_memory: Bytes of device memory that the captured entries of every compiled
            graph together may hold (their static input and output buffers; the pool's
            shared intermediates come on top, see ``stats()["graph_pool_bytes"]``). Past
            it, the least recently used captured entries of any graph are evicted
            (``stats()["eviction_reasons"]["graph_memory"]``); an entry larger than the
            budget by itself runs uncaptured. ``None``: no limit.
        capture_on_call: A signature is captured in a CUDA graph on its N-th call; its
            earlier calls run the graph directly. ``None`` (default) decides per signature
            (``runtime/recurrence.py``): the 2nd call for a graph's first signature (a model
            called once costs one run) and for a step of a growing sequence (a decode step
            over a growing cache, which does not come back), the 1st for any other new
            signature (a corpus's lengths, queries: encoded again, they replay). 1 captures
            every signature on its first call, 2 on its second.
        batch_buckets: Increasing batch sizes; the batch is the leading dim of the first
            non-parameter tensor input, inputs with that leading dim are padded up to the
            next bucket and the outputs sliced back, so many batch sizes share a few
            captures; batches above the largest bucket run unpadded. Only correct for
            row-independent models (row i of the output depends only on row i of the
            inputs). Takes effect on graphs whose batch dim is dynamic (a graph Dynamo
            traced for one batch size runs that size unpadded).
        length_buckets: Increasing sequence lengths, for masked encoders (BERT-like models
            called with an attention mask): the length is dim 1 of the first non-parameter
            integer tensor input of rank 2 (``input_ids``); every non-parameter tensor input
            with that dim 1 (``attention_mask``, ``token_type_ids``) is zero-padded up to the
            next bucket (mask 0 and pad id 0 at the padded positions), and outputs whose
            dim 1 is that length are sliced back. Each bucket's first call is checked
            against the unpadded run; a mismatch leaves that bucket unpadded, with the
            reason in ``stats()["ignored_options"]``. Only correct for models whose padded
            positions are masked out (every output position depends only on unmasked
            positions). Takes effect on graphs whose length dim is dynamic. No bucket may
            exceed the model's maximum length (a BERT's ``max_position_embeddings``): a
            padded run past it indexes outside the position table, a device-side assert on
            a GPU.
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
        matmul_groups: Run each linear layer of at most 16 rows (decode and small-batch
            steps) with its sibling projections (q, k, v; gate and up), the norm before it
            and the gated activation, activation or residual add after it as one Triton
            launch that reads the weights in place (passes/matmul_groups.py,
            kernels/matmul.py); a q/k/v launch also takes the rotary embedding and the
            StaticCache write after it (passes/rotary_epilogue.py). ``False`` leaves every
            matmul to cuBLAS, as traced.
        channels_last: Run a graph's 2-d convolutions and the elementwise groups between
            them channels-last (NHWC), where cuDNN runs half-precision convolutions
            without the layout transposes it adds around NCHW ones; the graph's outputs keep
            their traced layout (passes/channels_last.py). ``None`` (default): on CUDA, in
            half precision, unless a convolution is grouped with more than one input
            channel per group; ``True``: wherever the graph has a batched 2-d
            convolution; ``False``: never.
    """

    fusion: bool = True
    cudagraphs: bool | None = None
    warmup_iterations: int = 1
    max_graphs: int | None = None
    # 2 GiB holds the sentence benchmark's corpus with room: a MiniLM-L6 entry at batch 32
    # and length T holds its fp16 hidden states (32 x T x 384 x 2 bytes) and int64 ids,
    # mask and token types (3 x 32 x T x 8 bytes), ~27 KB x T: 50 lengths of 2-260 tokens
    # make ~0.2 GB (BERT-base: ~0.4 GB). Measured per entry, not per pool:
    # stats()["captured_bytes"].
    graph_memory: int | None = 2 << 30
    capture_on_call: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    length_buckets: tuple[int, ...] | None = None
    static_outputs: bool = False
    validate: bool = True
    index_checks: bool = True
    round_intermediates: bool = True
    rewrites: bool = True
    matmul_groups: bool = True
    channels_last: bool | None = None

    def __post_init__(self) -> None:
        for name in ("fusion", "static_outputs", "validate", "index_checks", "round_intermediates",
                     "rewrites", "matmul_groups"):  # fmt: skip
            _expect(isinstance(getattr(self, name), bool), name, "a bool", getattr(self, name))
        _expect(
            self.cudagraphs is None or isinstance(self.cudagraphs, bool),
            "cudagraphs",
            "a bool or None",
            self.cudagraphs,
        )
        _expect(
            self.channels_last is None or isinstance(self.channels_last, bool),
            "channels_last",
            "a bool or None",
            self.channels_last,
        )
        _expect(
            _is_int(self.warmup_iterations) and self.warmup_iterations >= 1,
            "warmup_iterations",
            "an int >= 1",
            self.warmup_iterations,
        )
        _expect(
            self.max_graphs is None or (_is_int(self.max_graphs) and self.max_graphs >= 1),
            "max_graphs",
            "an int >= 1 or None",
            self.max_graphs,
        )
        _expect(
            self.graph_memory is None or (_is_int(self.graph_memory) and self.graph_memory >= 0),
            "graph_memory",
            "a number of bytes (an int >= 0) or None",
            self.graph_memory,
        )
        _expect(
            self.capture_on_call is None
            or (_is_int(self.capture_on_call) and self.capture_on_call >= 1),
            "capture_on_call",
            "an int >= 1 or None",
            self.capture_on_call,
        )
        for name in ("batch_buckets", "length_buckets"):
            buckets = getattr(self, name)
            if buckets is None:
                continue
            ok = (
                isinstance(buckets, (list, tuple))
                and len(buckets) > 0
                and all(_is_int(b) and b >= 1 for b in buckets)
                and all(a < b for a, b in zip(buckets, buckets[1:]))
            )
            _expect(ok, name, "a strictly increasing list of ints >= 1", buckets)
            object.__setattr__(self, name, tuple(buckets))

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
