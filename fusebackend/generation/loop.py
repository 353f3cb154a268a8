"""The decode loop on the device: prefill, k-step chunks, one stop flag per chunk.

A generate() call runs:

1. **Prefill** through the model as transformers' own loop runs it (its
   ``prepare_inputs_for_generation``), into the static cache; the first token is chosen from
   its logits by the same step code as every later token, and the host waits for it once
   (time to first token).
2. **Decode chunks** of ``k`` steps. A step is: the compiled decode forward (one token per
   row, ``torch.compile(..., backend="infinifuse", options={"cudagraphs": False})``), the
   logits processors and the token choice (``selection.py``), the pad token for finished
   rows, the EOS check and the updates of every piece of state (next ids, positions, length,
   tokens seen), all in place in static buffers (``_Buffers``). On CUDA the k steps are
   captured as one ``torch.cuda.CUDAGraph`` after a first uncaptured chunk (Dynamo's
   compile, the backend's validation run), and replayed; without CUDA a chunk runs its k
   steps directly. Either way the host reads one flag per chunk (any row unfinished?).
3. **Output**: each chunk's tokens are copied into the output buffer; the length is the
   number of steps that ran while some row was unfinished (counted on the device), capped
   at max_new_tokens. Tokens chosen after the stop inside a chunk are dropped, so the output
   equals a step-by-step run's. The static layers' lengths are put back to what a
   step-by-step run leaves.

The infinifuse runtime is told not to capture (``cudagraphs=False``): inside an outer
capture a graph-cache hit runs the compiled callable directly, with no inner capture and no
host sync, so the runtime needs no change for this loop.

A chunk is a replay only where its k steps fit the cache (the steps after the last wanted
token still write their K/V rows); otherwise the last chunk runs its few steps directly.
Captured graphs are kept per model with their buffers and reused while the cache tensors,
batch, k and the selection options stay the same (a StaticCache made by generate() is
replaced by one the loop keeps, so that repeated calls reuse the graph).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import fusebackend.generation.selection as selection
from fusebackend.generation.report import GenerateReport
from fusebackend.generation.support import StopRule

__all__ = ["DecodeLoop", "Plan", "loop_for"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call's decode steps do.

    Attributes:
        processors: Device forms of the logits processors, in transformers' order.
        sample: Draw from the processed distribution (else greedy).
        stop: EOS ids and the max length.
        pad: The id finished rows emit (transformers' ``pad_token_id``); None without EOS.
        key: A hashable description of all of the above (the processors' masks by value),
            part of the key a captured graph is reused under.
    """

    processors: tuple[Any, ...]
    sample: bool
    stop: StopRule
    pad: int | None
    key: tuple[Any, ...]


def make_plan(processors: Sequence[Any], sample: bool, stop: StopRule, pad: int | None) -> Plan:
    """A ``Plan``, its ``key`` built from the processors' fields (masks as id tuples)."""

    def field_key(value: Any) -> Any:
        if isinstance(value, Tensor):
            return tuple(value.nonzero().flatten().tolist())
        return value

    described = tuple(
        (type(p).__name__, *(field_key(getattr(p, f.name)) for f in dataclasses.fields(p)))
        for p in processors
    )
    if not stop.eos:
        pad = None  # transformers pads finished rows only when an EOS criterion exists
    return Plan(tuple(processors), sample, stop, pad, (described, sample, stop.eos, pad))


@dataclasses.dataclass
class _Buffers:
    """Static tensors the decode steps read and write in place (a captured graph holds
    their addresses)."""

    ids: Tensor  # [B, 1] the token each row feeds next
    positions: Tensor | None  # [B, 1] its position id
    mask: Tensor | None  # [B, cache slots] the prompt's padding mask, then ones
    length: Tensor  # 0-d, the length input_ids would have
    produced: Tensor  # 0-d, tokens in the output so far (steps run while a row was unfinished)
    unfinished: Tensor  # [B] int64, 1 while the row has not stopped
    seen: Tensor | None  # [B, V] bool, tokens each row holds (repetition penalty)
    eos: Tensor | None  # [n] the EOS ids
    pad: Tensor | None  # 0-d the pad id
    chunk: Tensor  # [B, k] the tokens of the last chunk
    out: Tensor  # [B, max_new + k] every token chosen


@dataclasses.dataclass
class _Captured:
    """A captured k-step graph with everything it reads."""

    key: tuple[Any, ...]
    buffers: _Buffers
    plan: Plan
    graph: Any = None  # torch.cuda.CUDAGraph once captured


class DecodeLoop:
    """The device loop of one model: its compiled decode forwards, the StaticCache it keeps
    for generate()'s own caches, and the last captured graph."""

    def __init__(self, model: Any) -> None:
        self._model = weakref.ref(model)
        self._forwards: dict[tuple[Any, ...], Callable[..., Tensor]] = {}
        self._captured: _Captured | None = None
        self._own_cache: tuple[tuple[Any, ...], Any] | None = None
        self._stream: Any = None

    # ------------------------------------------------------------------ the cache

    def own_cache(self, cache: Any, slots: int) -> Any:
        """A StaticCache of ``slots`` slots like ``cache`` (which generate() made for this call
        and nothing holds yet), kept across calls so its tensors keep their addresses."""
        from transformers import StaticCache

        model = self._model()
        key = (type(cache), slots)
        if self._own_cache is not None and self._own_cache[0] == key:
            kept = self._own_cache[1]
            kept.reset()
            return kept
        config = model.config.get_text_config(decoder=True)
        fresh = StaticCache(config=config, max_cache_len=slots)
        self._own_cache = (key, fresh)
        return fresh

    # ------------------------------------------------------------------ the forward

    def forward(
        self,
        cache_key: str,
        positions: bool,
        mask: bool,
        logits_to_keep: bool,
        backend: str | None,
        options: dict[str, Any] | None,
    ) -> Callable[..., Tensor]:
        """The decode forward ``(ids, positions, mask, cache) -> last logits [B, V]``,
        compiled with ``backend`` (None: eager), one per input layout."""
        key = (cache_key, positions, mask, logits_to_keep, backend, _frozen(options))
        fn = self._forwards.get(key)
        if fn is not None:
            return fn
        model_ref = self._model  # a closure holding the model would keep it (and its loop,
        # cache and captured graph, whose NCCL collectives hang teardown) alive for good

        def decode_forward(ids: Tensor, pos: Tensor | None, attn: Tensor | None, cache: Any):
            kwargs: dict[str, Any] = {"input_ids": ids, cache_key: cache, "use_cache": True}
            if positions:
                kwargs["position_ids"] = pos
            if mask:
                kwargs["attention_mask"] = attn
            if logits_to_keep:
                kwargs["logits_to_keep"] = 1
            return model_ref()(**kwargs).logits[:, -1]

        fn = decode_forward
        if backend is not None:
            fn = torch.compile(decode_forward, backend=backend, options=dict(options or {}))
        self._forwards[key] = fn
        return fn

    def prefill(self, backend: str | None, options: dict[str, Any] | None, device: Any) -> Any:
        """The prefill forward ``(inputs) -> last logits [B, V]``. On CUDA it is compiled with
        ``backend`` and its runtime's own capture on (``options`` with ``cudagraphs`` as the
        user set it, not the decode step's False): a warm process replays a prompt length it
        has seen (TinyLlama shape on an H200: the eager prefill took 17.4 ms to the first
        token, 2026-11-28). Eager on a CPU, where nothing is captured."""
        model_ref = self._model

        def prefill_forward(inputs: dict[str, Any]) -> Tensor:
            return model_ref()(**inputs, return_dict=True).logits[:, -1]

        if backend is None or device.type != "cuda":
            return prefill_forward
        key = ("prefill", backend, _frozen(options))
        fn = self._forwards.get(key)
        if fn is None:
            given = {k: v for k, v in (options or {}).items() if k != "cudagraphs"}
            fn = torch.compile(prefill_forward, backend=backend, options=given)
            self._forwards[key] = fn
        return fn

    # ------------------------------------------------------------------ the call

    def run(
        self,
        input_ids: Tensor,
        plan: Plan,
        model_kwargs: dict[str, Any],
        cache_key: str,
        forward: Callable[..., Tensor],
        k: int,
        capture: bool,
        started: float,
        prefill: Callable[[dict[str, Any]], Tensor],
    ) -> tuple[Tensor, GenerateReport]:
        """Generate; returns the sequences (prompt + new tokens) and the call's report
        (``prefill``: the prompt's forward, ``DecodeLoop.prefill``)."""
        model = self._model()
        batch, prompt = input_ids.shape
        max_new = plan.stop.max_length - prompt
        report = GenerateReport(path="device loop", k=k, batch=batch)
        cache = model_kwargs[cache_key]
        device = input_ids.device
        capture = capture and device.type == "cuda"
        if capture and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream if capture else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            inputs = model.prepare_inputs_for_generation(
                input_ids, is_first_iteration=True, **model_kwargs
            )
            logits = prefill(inputs)
            slots = cache.layers[0].max_cache_len
            entry = self._entry(input_ids, plan, model_kwargs, cache, logits.shape[-1], k, slots)
            buffers = entry.buffers
            step = _Step(buffers, plan, forward, cache)
            step.select(logits, 0)
            buffers.out[:, :1].copy_(buffers.chunk[:, :1])
            done = not bool(buffers.unfinished.any())  # the host waits for the first token
            report.time_to_first_token_s = time.perf_counter() - started
            written = prompt  # cache slots holding K/V rows
            wanted = max_new - 1  # decode steps still wanted at most
            filled = 1  # columns of buffers.out written
            warmed = entry.graph is not None
            while wanted > 0 and not done:
                fits = written + k <= slots
                if capture and warmed and fits:
                    if entry.graph is None:
                        entry.graph = _capture_steps(step, k, stream)
                        report.captures += 1
                    entry.graph.replay()
                    report.replays += 1
                    n = k
                else:
                    # Uncaptured: the warm-up chunk (at least 2 steps: Dynamo may compile
                    # again on the second call) or a last chunk whose k steps do not fit.
                    n = min(max(k, 2) if not warmed else k, wanted)
                    for j in range(n):
                        step(j)
                    warmed = True
                buffers.out[:, filled : filled + n].copy_(buffers.chunk[:, :n])
                filled += n
                written += n
                wanted -= n
                report.steps += n
                report.chunks += 1
                done = not bool(buffers.unfinished.any())  # the one host read per chunk
            total = min(int(buffers.produced), max_new)
            sequences = torch.cat([input_ids, buffers.out[:, :total]], dim=-1)
            _rewind(cache, prompt + total - 1, written)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
            sequences.record_stream(torch.cuda.current_stream(device))
        report.captured = report.replays > 0
        report.new_tokens = total
        report.total_s = time.perf_counter() - started
        return sequences, report

    def _entry(
        self,
        input_ids: Tensor,
        plan: Plan,
        model_kwargs: dict[str, Any],
        cache: Any,
        vocab: int,
        k: int,
        slots: int,
    ) -> _Captured:
        """The buffers (and captured graph, when the key matches the last one) for this call,
        set to the state after the prefill."""
        batch, prompt = input_ids.shape
        mask = model_kwargs.get("attention_mask")
        positions = model_kwargs.get("position_ids")
        max_new = plan.stop.max_length - prompt
        layout = tuple(
            (layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr())
            for layer in cache.layers
        )
        key = (batch, vocab, k, slots, max_new, mask is not None, positions is not None)
        key += (input_ids.device, layout, plan.key)
        entry = self._captured
        if entry is None or entry.key != key:
            entry = _Captured(
                key, _allocate(input_ids, plan, mask, positions, vocab, k, slots), plan
            )
            self._captured = entry
        _reset(entry.buffers, input_ids, mask, positions)
        return entry


class _Step:
    """One decode step over the static buffers (``select`` alone: the choice from logits
    already computed, as for the prefill's)."""

    def __init__(self, buffers: _Buffers, plan: Plan, forward: Callable[..., Tensor], cache: Any):
        self.b, self.plan, self.forward, self.cache = buffers, plan, forward, cache

    def __call__(self, j: int) -> None:
        b = self.b
        self.select(self.forward(b.ids, b.positions, b.mask, self.cache), j)

    def select(self, logits: Tensor, j: int) -> None:
        """Choose the next tokens from ``logits`` into column ``j`` of the chunk and advance
        every piece of state, in place and without a host sync."""
        b, plan = self.b, self.plan
        # float32 as transformers' loop (logits.to(copy=True, dtype=torch.float32))
        scores = selection.process(
            logits.float(), plan.processors, selection.Context(b.length, b.seen)
        )
        chosen = selection.choose(scores, plan.sample)
        alive = b.unfinished.bool()
        if plan.pad is not None:
            chosen = torch.where(alive, chosen, b.pad)
        b.chunk[:, j].copy_(chosen)
        b.produced.add_(alive.any().long())
        if b.eos is not None:
            stopped = (chosen[:, None] == b.eos).any(dim=-1)
            b.unfinished.mul_((~stopped).long())
        b.ids.copy_(chosen[:, None])
        if b.positions is not None:
            b.positions.add_(1)
        b.length.add_(1)
        if b.seen is not None:
            b.seen.scatter_(1, chosen[:, None], True)


def _allocate(
    input_ids: Tensor,
    plan: Plan,
    mask: Tensor | None,
    positions: Tensor | None,
    vocab: int,
    k: int,
    slots: int,
) -> _Buffers:
    batch, prompt = input_ids.shape
    device = input_ids.device
    max_new = plan.stop.max_length - prompt
    longs = {"dtype": torch.long, "device": device}
    reads_seen = any(p.reads_seen for p in plan.processors)
    return _Buffers(
        ids=torch.zeros(batch, 1, **longs),
        positions=None if positions is None else torch.zeros(batch, 1, **longs),
        mask=None if mask is None else torch.ones(batch, slots, dtype=mask.dtype, device=device),
        length=torch.zeros((), **longs),
        produced=torch.zeros((), **longs),
        unfinished=torch.ones(batch, **longs),
        seen=torch.zeros(batch, vocab, dtype=torch.bool, device=device) if reads_seen else None,
        eos=torch.tensor(plan.stop.eos, **longs) if plan.stop.eos else None,
        pad=None if plan.pad is None else torch.tensor(plan.pad, **longs),
        chunk=torch.zeros(batch, k, **longs),
        out=torch.zeros(batch, max_new + k, **longs),
    )


def _reset(b: _Buffers, input_ids: Tensor, mask: Tensor | None, positions: Tensor | None) -> None:
    """The state after the prefill, before its token is chosen (device copies only)."""
    prompt = input_ids.shape[1]
    b.length.fill_(prompt)
    b.produced.zero_()
    b.unfinished.fill_(1)
    if b.seen is not None:
        b.seen.zero_()
        b.seen.scatter_(1, input_ids, True)
    if b.positions is not None:
        b.positions.copy_(positions[:, -1:] + 1)
    if b.mask is not None:
        b.mask.fill_(1)
        b.mask[:, :prompt].copy_(mask)


def _capture_steps(step: _Step, k: int, stream: Any) -> Any:
    """k steps captured as one CUDA graph on ``stream``. The default CUDA generator is
    registered with every capture by torch: each replay draws fresh numbers (its philox
    offset advances by what the k steps consume), as k uncaptured steps would."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for j in range(k):
            step(j)
    return graph


def _rewind(cache: Any, length: int, written: int) -> None:
    """Put each static layer's length back to ``length`` (what a step-by-step run leaves)
    when the chunks ran steps past the stop (``written`` > ``length``)."""
    if written <= length:
        return
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def _frozen(options: dict[str, Any] | None) -> tuple[Any, ...]:
    return tuple(sorted((options or {}).items(), key=lambda kv: kv[0]))


_loops: weakref.WeakKeyDictionary[Any, DecodeLoop] = weakref.WeakKeyDictionary()


def loop_for(model: Any) -> DecodeLoop:
    """The model's ``DecodeLoop`` (one per model, dropped with it)."""
    loop = _loops.get(model)
    if loop is None:
        loop = _loops[model] = DecodeLoop(model)
    return loop
