"""Shapes that keep changing: what a new signature costs, and what the cache keeps.

- A signature is captured on its ``capture_on_call``-th call; by default
  (``runtime/recurrence.py``) a graph's first signature and a step of a growing sequence on
  their 2nd call, any other new signature on its 1st: a corpus sorted longest first replays
  every length but the first on its second pass, a decode step over a growing cache costs
  one run.
- The fused graph is compared with the unfused one once per compiled graph and validation
  class, not once per shape; verdicts (successes too) outlive evictions.
- Captured entries are bounded by bytes across every compiled graph (``graph_memory``), not
  by a count; evictions are counted by cause.
- Entries of older compilations of a function that Dynamo no longer routes a shape to are
  dropped ("superseded").

Capture runs on the CPU through a fake ``capture_graph`` (as in test_runtime.py); counts come
from ``stats()``.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import FakeGraph, assert_close, rand_ids, rand_table

import fusebackend
from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as cap
from fusebackend.runtime import graph_cache
from fusebackend.runtime.graph_cache import EAGER, FUSION, GRAPH_REPLAY, GraphCache
from fusebackend.runtime.keys import Signatures
from fusebackend.runtime.recurrence import extends

FAKE_CUDA = torch.device("cuda", 0)
V, D = 50, 16


class Captures:
    def __init__(self):
        self.graphs: list[weakref.ref[FakeGraph]] = []
        self.warmups: list[int] = []  # warmup_iterations of each capture

    def __call__(self, fn, inputs, *, device, warmup_iterations):
        assert device == FAKE_CUDA
        self.warmups.append(warmup_iterations)
        for _ in range(warmup_iterations):
            fn(*inputs)
        graph = FakeGraph(fn, inputs)
        self.graphs.append(weakref.ref(graph))
        return graph, graph.outputs

    def live(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.graphs)


@pytest.fixture
def fake_capture(monkeypatch) -> Captures:
    captures = Captures()
    monkeypatch.setattr(cap, "capture_graph", captures)
    return captures


@pytest.fixture
def fake_cuda_backend(fake_capture, monkeypatch) -> Captures:
    """torch.compile's graphs are captured (through the fake) as if they ran on a GPU."""
    monkeypatch.setattr(fusebackend.backend, "_graph_device", lambda inputs: FAKE_CUDA)
    return fake_capture


@pytest.fixture
def reference_groups(monkeypatch):
    # These tests are about the cache, not the kernels: each fused group runs its torch
    # reference instead of interpreted Triton launches (the graph is still rewritten).
    def run_reference(self, *inputs):
        return tuple(self.reference(*inputs))

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", run_reference)


def embed_norm(ids, table, weight, bias):
    return (F.layer_norm(F.embedding(ids, table) * 2.0, (table.shape[1],), weight, bias),)


def norm_cache(fused=embed_norm, **options) -> GraphCache:
    """A captured cache of ``embed_norm`` with the table and norm weights used in place."""
    return GraphCache(
        unfused=embed_norm,
        fused=fused,
        config=FusionConfig(cudagraphs=True, **options),
        device=FAKE_CUDA,
        static_input_indices=frozenset({1, 2, 3}),
        name="churn",
    )


def counts(*names: str) -> tuple[int, ...]:
    s = fusebackend.stats()
    return tuple(s[n] for n in names)


def weights():
    return rand_table(V, D), torch.randn(D), torch.randn(D)


LENGTHS = list(range(3, 63))  # 60 distinct lengths


# ------------------------------------------------------------------------------ churn


def test_a_capture_right_after_a_direct_run_skips_its_warm_up(fake_capture, monkeypatch):
    """The call that captures a signature runs the graph on it first (its outputs): where the
    capture stream is set up, that run is the warm-up. Not before the stream's first capture,
    and not when the run was another mode's (the fused graph failed: the unfused one is
    captured, never run at this signature)."""
    table, w, b = weights()
    warm = {"stream": False}
    monkeypatch.setattr(cap, "side_stream_warm", lambda device: warm["stream"])
    cache = norm_cache(capture_on_call=1, warmup_iterations=2)
    cache(rand_ids(V, (2, 5)), table, w, b)
    warm["stream"] = True
    for n in (6, 7):
        ids = rand_ids(V, (2, n))
        assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
    assert fake_capture.warmups == [2, 0, 0]

    def failing(*args):
        raise RuntimeError("kernel failed")

    broken = norm_cache(fused=failing, capture_on_call=1, warmup_iterations=2)
    ids = rand_ids(V, (2, 8))
    assert_close(broken(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
    assert broken.mode_for(ids) == GRAPH_REPLAY
    assert fake_capture.warmups[-1] == 2


def test_sixty_lengths_twice_capture_once_each_and_validate_once(fake_capture):
    """Round 1: one run per new length, one validation for the graph, nothing captured.
    Round 2: each length recurs and is captured once (no validation, no miss). Round 3 and
    after: replays only."""
    table, w, b = weights()
    cache = norm_cache()
    rounds = []
    for _ in range(3):
        before = counts("cache_misses", "recordings", "validations", "fusion_attempts")
        for n in LENGTHS:
            ids = rand_ids(V, (2, n))
            assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
        after = counts("cache_misses", "recordings", "validations", "fusion_attempts")
        rounds.append(tuple(a - c for a, c in zip(after, before, strict=True)))
    # (misses, recordings, validations, fused first runs) per round
    assert rounds == [(60, 0, 1, 60), (0, 60, 0, 0), (0, 0, 0, 0)]
    s = fusebackend.stats()
    assert s["cache_size"] == 60 and s["evictions"] == 0  # the default holds them all
    assert set(s["fusion_modes"].values()) == {FUSION}
    assert fake_capture.live() == 60


def test_capture_on_the_first_call_leaves_the_second_round_nothing_to_do(fake_capture):
    table, w, b = weights()
    cache = norm_cache(capture_on_call=1)
    for expected in [(60, 60, 1), (0, 0, 0)]:
        before = counts("cache_misses", "recordings", "validations")
        for n in LENGTHS:
            ids = rand_ids(V, (2, n))
            assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
        after = counts("cache_misses", "recordings", "validations")
        assert tuple(a - c for a, c in zip(after, before, strict=True)) == expected


def test_a_decode_step_is_captured_on_its_second_call_and_advances_state_once(fake_capture):
    """A StaticCache decode step: the same signature every call, a cache written in place.
    Captured on call 2, replayed from call 3; the state moves exactly once per call."""

    def step(cache_, pos, x):
        cache_.index_copy_(0, pos, x)
        return (cache_.sum(0, keepdim=True) * 2,)

    kv = torch.zeros(8, 4)
    cache = GraphCache(
        unfused=step,
        fused=step,
        config=FusionConfig(cudagraphs=True),
        device=FAKE_CUDA,
        static_input_indices=frozenset({0}),
        mutated_input_indices=frozenset({0}),
    )
    expected = torch.zeros(8, 4)
    recordings = []
    decisions = []
    for t in range(5):
        x = torch.randn(1, 4)
        pos = torch.tensor([t])
        out = cache(kv, pos, x)[0]
        expected[t] = x[0]
        assert_close(kv, expected)  # written once, whatever ran inside the call
        assert_close(out, expected.sum(0, keepdim=True) * 2)
        recordings.append(fusebackend.stats()["recordings"])
        decisions.append(cache.describe()[0]["decision"])
    assert recordings == [0, 1, 1, 1, 1]
    assert decisions == ["captured on its call 2 (recurs)"] + [None] * 4
    assert counts("cache_misses", "cache_hits") == (1, 4)
    assert [e["captured"] for e in cache.describe()] == [True]


def _signature(*args):
    return Signatures(frozenset(), has_fused=False, bakes_cpu_scalars=False).key(args)


def test_extends_reads_one_common_growth_step():
    """A decode step over a growing cache: every size that changed grew by one common step."""
    ids = torch.zeros(2, 1, dtype=torch.long)

    def step(length, grown=1, dtype=torch.float16):
        kv = torch.zeros(2, 4, length, 8, dtype=dtype)
        return _signature(ids, kv, kv, torch.ones(2, length + grown - 1), length)

    assert extends(step(9), step(10))
    assert extends(step(9), step(13, grown=1)) and not extends(step(9), step(9))
    assert extends(step(7, grown=3), step(10, grown=3))  # 3 tokens a step: all grow by 3
    assert not extends(step(10), step(9))  # shorter: a corpus sorted longest first
    assert not extends(step(9), step(11, grown=2))  # the mask grew by 3, the cache by 2
    assert not extends(step(9), step(10, dtype=torch.float32))  # another dtype
    assert not extends(_signature(ids, 9), _signature(ids, 10.0))  # an int became a float
    assert not extends(_signature(ids), _signature(ids, ids))  # another arity
    assert not extends(_signature(ids), _signature(torch.zeros(2, 1, 1, dtype=torch.long)))


def test_a_corpus_sorted_longest_first_replays_every_length_on_its_second_pass(fake_capture):
    """sentence-transformers' order: lengths falling. The graph's first length is captured
    when it comes back, every other one on its first call; the second pass then captures
    only that first length, and the third replays. ``capture_on_call=2`` leaves all 60 to
    the second pass."""
    table, w, b = weights()
    for options, expected in [
        ({}, [(60, 59), (0, 1), (0, 0)]),
        ({"capture_on_call": 2}, [(60, 0), (0, 60), (0, 0)]),
    ]:
        cache = norm_cache(**options)
        rounds = []
        for _ in range(3):
            before = counts("cache_misses", "recordings")
            for n in reversed(LENGTHS):
                ids = rand_ids(V, (2, n))
                assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
            after = counts("cache_misses", "recordings")
            rounds.append(tuple(a - c for a, c in zip(after, before, strict=True)))
        assert rounds == expected, options
        cache.clear()


def test_decode_over_a_growing_cache_is_captured_only_where_a_length_comes_back(fake_capture):
    """A step over a cache that grows by a token a call (the cache, its mask and the length
    as an int all grow by one): no signature comes back within a sequence, so none is
    captured (each costs one run); a second sequence over the same lengths captures each on
    its second call. Outputs equal the step's own every call."""

    def step(k, mask, length, x):
        scores = (k @ x.unsqueeze(-1)).squeeze(-1) + (mask - 1) * 1e4
        return (torch.softmax(scores, -1) * length,)

    cache = GraphCache(
        unfused=step, fused=step, config=FusionConfig(cudagraphs=True), device=FAKE_CUDA,
        name="growing",
    )  # fmt: skip
    per_sequence = []
    for _ in range(2):
        before = counts("recordings")[0]
        for length in range(5, 13):
            args = (torch.randn(2, length, 4), torch.ones(2, length), length, torch.randn(2, 4))
            assert_close(cache(*args)[0], step(*args)[0])
        per_sequence.append(counts("recordings")[0] - before)
    assert per_sequence == [0, 8]


def test_bert_s_second_pass_captures_only_each_graph_s_first_shape(
    fake_cuda_backend, reference_groups
):
    """A transformers BertModel over four shapes, longest first, as sentence-transformers
    sends them: Dynamo compiles a static graph (6, 19), one dynamic in the length (6, 13 and
    6, 9) and one dynamic in the batch too (3, 5). The first pass captures (6, 9), the
    dynamic graph's second shape; the second pass the three graphs' first shapes; the third
    nothing. Every output equals eager's."""
    model = _tiny_bert()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": True})
    per_pass = []
    for _ in range(3):
        before = counts("recordings")[0]
        _bert_pass(compiled, model)
        per_pass.append(counts("recordings")[0] - before)
    assert per_pass == [1, 3, 0]


BERT_SHAPES = [(6, 19), (6, 13), (6, 9), (3, 5)]  # longest first, then a smaller batch


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=120,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def _bert_pass(compiled, model):
    """One pass over ``BERT_SHAPES`` with a padded row each, every output equal to eager's."""
    with torch.no_grad():
        for batch, length in BERT_SHAPES:
            ids = rand_ids(model.config.vocab_size, (batch, length))
            mask = torch.ones(batch, length, dtype=torch.long)
            mask[0, length // 2 :] = 0  # a padded row
            out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            assert_close(out, model(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_a_llama_decode_over_a_dynamic_cache_captures_no_step_of_its_first_sequence(
    fake_cuda_backend, reference_groups
):
    """transformers' LlamaForCausalLM stepped over a DynamicCache (the cache grows by a token
    a step: Dynamo's graph for the steps takes its length as a size): in the first sequence
    only one signature is captured, the steps cost one run each; the same prompt again
    finds each step's signature recurring and captures it. The tokens equal eager's both
    times. Before ``GraphForm.outputs`` the second sequence's calls were routed to a graph
    that returns its outputs from its host part, and raised."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": True})
    prompt = rand_ids(config.vocab_size, (1, 7))

    def decode(fn, steps=6):
        out = fn(input_ids=prompt, past_key_values=transformers.DynamicCache(), use_cache=True)
        tokens = []
        for _ in range(steps):
            tokens.append(out.logits[:, -1:].argmax(-1))
            out = fn(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        return torch.cat(tokens, 1)

    with torch.no_grad():
        expected = decode(model)
        per_sequence = []
        for _ in range(2):
            before = counts("recordings")[0]
            assert torch.equal(decode(compiled), expected)
            per_sequence.append(counts("recordings")[0] - before)
    assert per_sequence == [1, 7]


def test_a_third_call_captures_with_capture_on_call_3(fake_capture):
    table, w, b = weights()
    cache = norm_cache(capture_on_call=3)
    ids = rand_ids(V, (2, 5))
    seen = []
    for _ in range(4):
        assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
        seen.append(fusebackend.stats()["recordings"])
    assert seen == [0, 0, 1, 1]


def test_a_returning_signature_is_neither_validated_nor_left_uncaptured(fake_capture):
    """Verdicts (successes too) outlive evictions: a key evicted and seen again recurs, so it
    is captured at once, and it is not compared with the unfused graph again."""
    table, w, b = weights()
    cache = norm_cache(max_graphs=1, validate=True)
    a, c = rand_ids(V, (2, 4)), rand_ids(V, (2, 9))
    cache(a, table, w, b)
    cache(c, table, w, b)  # evicts a (never captured: seen once)
    assert counts("validations", "recordings", "evictions") == (1, 0, 1)
    out = cache(a, table, w, b)[0]  # a returns: its 2nd call, captured now
    assert_close(out, embed_norm(a, table, w, b)[0])
    assert counts("validations", "recordings") == (1, 1)
    assert fusebackend.stats()["eviction_reasons"] == {"max_graphs": 2}
    assert cache.table.verdict_count == 2


def test_verdict_memory_is_bounded(fake_capture, monkeypatch):
    monkeypatch.setattr(graph_cache, "_MAX_VERDICTS", 5)
    table, w, b = weights()
    cache = norm_cache(max_graphs=2)
    for n in range(1, 12):
        cache(rand_ids(V, (1, n)), table, w, b)
    assert cache.table.verdict_count == 5


def test_validation_runs_once_per_graph_until_one_matches(fake_capture):
    """The first new signature is compared; once one matched, later new signatures of the
    graph run unchecked. A mismatch falls back with its reason, and the next new signature
    is compared again."""
    table, w, b = weights()
    calls = {"n": 0}

    def wrong_first(ids, table, weight, bias):
        calls["n"] += 1
        (out,) = embed_norm(ids, table, weight, bias)
        return (out + 1.0,) if calls["n"] == 1 else (out,)

    cache = norm_cache(fused=wrong_first)
    shapes = [(2, 3), (2, 4), (2, 5), (2, 6)]
    for shape in shapes:
        ids = rand_ids(V, shape)
        assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
    s = fusebackend.stats()
    assert s["validations"] == 2  # the mismatch, then the first match
    assert s["fusion_attempts"] == 4 and s["fusion_successes"] == 3
    modes = [e["mode"] for e in cache.describe()]
    assert modes == [GRAPH_REPLAY, FUSION, FUSION, FUSION]
    (reason,) = s["fallback_reasons"].values()
    assert "fused graph does not match the unfused graph" in reason


def test_another_dtype_is_another_validation_class(fake_capture):
    table, w, b = weights()
    cache = norm_cache()
    for dtype in (torch.int64, torch.int32):
        for n in (3, 4):
            cache(rand_ids(V, (2, n)).to(dtype), table, w, b)
    assert fusebackend.stats()["validations"] == 2


def test_a_fused_run_that_raises_at_capture_falls_back_with_its_reason(fake_capture):
    """The call that captures a recurring signature runs the fused graph again; if it raises
    there, the entry falls back to the unfused graph (captured) with the reason."""
    table, w, b = weights()
    calls = {"n": 0}

    def fails_second(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel fault (injected)")
        return embed_norm(*args)

    cache = norm_cache(fused=fails_second)
    ids = rand_ids(V, (2, 5))
    for _ in range(3):
        assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
    (entry,) = cache.describe()
    assert entry["mode"] == GRAPH_REPLAY and entry["captured"]
    assert "kernel fault (injected)" in entry["reason"]


# ---------------------------------------------------------------------- memory budget


def big(x):
    return (x.repeat(1, 4),)  # 4x the input: an output of a known size


def big_cache(**options) -> GraphCache:
    return GraphCache(
        unfused=big, fused=None, config=FusionConfig(cudagraphs=True, capture_on_call=1,
                                                     **options), device=FAKE_CUDA,
    )  # fmt: skip


def test_graph_memory_evicts_the_least_recently_used_across_graphs(fake_capture):
    """Each entry holds its input buffer (128 fp32) and its output (512 fp32): 2560 bytes. A
    budget of 3 entries, shared by two compiled graphs: the 4th capture evicts the least
    recently used entry of either graph."""
    entry_bytes = (128 + 512) * 4
    budget = 3 * entry_bytes
    first, second = big_cache(graph_memory=budget), big_cache(graph_memory=budget)
    a = torch.randn(8, 16)
    first(a)
    second(torch.randn(16, 8))
    first(torch.randn(8, 16))  # a's entry used again: second's is now the oldest
    first(torch.randn(4, 32))
    s = fusebackend.stats()
    assert s["captured_bytes"] == budget and s["evictions"] == 0
    second(torch.randn(32, 4))
    s = fusebackend.stats()
    assert s["eviction_reasons"] == {"graph_memory": 1}
    assert s["captured_bytes"] == budget
    assert len(first) == 2 and len(second) == 1
    assert second.mode_for(torch.randn(16, 8)) is None  # the one evicted
    assert fake_capture.live() == 3
    assert_close(first(a)[0], big(a)[0])  # still replayed correctly


def test_an_entry_larger_than_the_budget_runs_uncaptured_with_its_reason(fake_capture):
    cache = big_cache(graph_memory=1000)
    x = torch.randn(8, 16)  # 512 + 2048 bytes
    for _ in range(3):
        assert_close(cache(x)[0], big(x)[0])
    (entry,) = cache.describe()
    assert entry["mode"] == EAGER and not entry["captured"]
    assert "exceed graph_memory" in entry["reason"]
    assert fusebackend.stats()["captured_bytes"] == 0
    assert fake_capture.live() == 0


def test_max_graphs_is_an_optional_count_cap(fake_capture):
    cache = big_cache(max_graphs=2)
    for n in (1, 2, 3):
        cache(torch.randn(n, 16))
    s = fusebackend.stats()
    assert s["eviction_reasons"] == {"max_graphs": 1} and len(cache) == 2
    fusebackend.reset_stats()
    assert fusebackend.stats()["eviction_reasons"] == {}


def test_the_entry_limit_bounds_uncaptured_entries(monkeypatch):
    monkeypatch.setattr(graph_cache, "_MAX_ENTRIES", 3)
    cache = GraphCache(unfused=big, fused=None, config=FusionConfig(), device=None)
    for n in range(1, 6):
        cache(torch.randn(n, 2))
    assert len(cache) == 3
    assert fusebackend.stats()["eviction_reasons"] == {"entry_limit": 2}


# ------------------------------------------------------- through torch.compile (Dynamo)


def chain(ids, mask, table, weight, bias):
    h = F.layer_norm(F.embedding(ids, table) * 2.0, (table.shape[1],), weight, bias)
    return (h * mask.unsqueeze(-1)).sum(1)


def _corpus_pass(compiled, table, w, b, shapes):
    with torch.no_grad():
        for batch, length in shapes:
            ids = rand_ids(V, (batch, length))
            mask = torch.ones(batch, length, dtype=torch.long)
            assert_close(compiled(ids, mask, table, w, b), chain(ids, mask, table, w, b))


def test_dynamo_recompiles_route_each_shape_to_the_graph_that_holds_it():
    """Recompile churn on the CPU: Dynamo compiles a static graph, then one dynamic in the
    length, then one dynamic in both; a second pass sends every shape to the newest graph.
    The older graphs compute the same function at the shapes they hold, so those calls are
    routed to their entries: 4 entries for 4 shapes, none made twice, none dropped."""
    table, w, b = weights()
    compiled = torch.compile(chain, backend="infinifuse")
    shapes = [(32, 81), (32, 70), (32, 39), (16, 9)]
    _corpus_pass(compiled, table, w, b, shapes)
    before = counts("cache_misses", "cache_hits")
    _corpus_pass(compiled, table, w, b, shapes)
    s = fusebackend.stats()
    assert (s["cache_misses"] - before[0], s["cache_hits"] - before[1]) == (0, 4)
    assert s["older_graph_calls"] == 3  # all but the newest graph's own shape
    assert s["cache_size"] == 4 and s["eviction_reasons"] == {}
    assert sorted(shape[0] for shape in s["cached_shapes"]) == sorted(shapes)
    # explain / describe show the routed signatures and which graph serves them
    newest = fusebackend.last_report().graphs[-1]
    served = [row["served_by"] for row in newest.runtime_modes() if row.get("served_by")]
    assert len(served) == 3 and len(set(served)) == 2, newest.runtime_modes()
    assert str(fusebackend.last_report()).count("served by graph") == 3


def test_bert_recompiles_route_a_second_pass_to_the_graphs_that_hold_its_shapes():
    """A transformers BertModel with padded masks (its static graph folds the position ids
    and mask sizes into constants, its dynamic ones compute them): a second pass over four
    shapes makes no entry, every output equal to eager's."""
    model = _tiny_bert()
    compiled = torch.compile(model, backend="infinifuse")
    for _ in range(2):
        before = counts("cache_misses")
        _bert_pass(compiled, model)
        misses = counts("cache_misses")[0] - before[0]
    s = fusebackend.stats()
    assert misses == 0 and s["older_graph_calls"] == 3
    assert s["cache_size"] == 4 and s["eviction_reasons"] == {}


def test_dynamo_recompiles_leave_one_entry_per_shape(monkeypatch):
    """Graphs that cannot be compared (no form: routing off) fall back to supersession: the
    older graphs' entries for the shapes the newest graph is handed are dropped, 4 entries
    for 4 shapes (7 with neither rule)."""
    monkeypatch.setattr(fusebackend.backend, "form_of", lambda runs, traced, arity=None: None)
    table, w, b = weights()
    compiled = torch.compile(chain, backend="infinifuse")
    shapes = [(32, 81), (32, 70), (32, 39), (16, 9)]
    for _ in range(2):
        _corpus_pass(compiled, table, w, b, shapes)
    s = fusebackend.stats()
    assert s["cache_size"] == 4 and s["older_graph_calls"] == 0
    assert s["eviction_reasons"] == {"superseded": 3}
    assert sorted(shape[0] for shape in s["cached_shapes"]) == sorted(shapes)


def test_a_value_the_older_graph_was_specialized_on_is_checked_per_call():
    """``x * n``: a graph for (x, n = 2), then, after a call at another shape and n, one
    taking n and the sizes as inputs. (x, 2) again goes to the newer graph and is routed to
    the older one (it computes x * 2 at x's shape); (x, 5) is not (the older graph would
    return x * 2)."""

    def scale(x, n):
        return x * n + x.shape[1]

    compiled = torch.compile(scale, backend="infinifuse")
    x, y = torch.randn(3, 7), torch.randn(4, 7)
    with torch.no_grad():
        for t, n in ((x, 2), (y, 3), (x, 2)):
            assert_close(compiled(t, n), scale(t, n))
        assert fusebackend.stats()["older_graph_calls"] == 1
        assert_close(compiled(x, 5), scale(x, 5))
    s = fusebackend.stats()
    assert s["older_graph_calls"] == 1
    assert len({label.split()[0] for label in s["fusion_modes"]}) == 2, s["fusion_modes"]


def test_churn_across_dynamo_recompiles_captures_each_shape_once(
    fake_cuda_backend, reference_groups
):
    """60 lengths through torch.compile (default dynamic=None: a static graph for the first
    length, a dynamic one for the rest). Round 2 captures each length once, the length first
    served by the static graph included (routed there, not made again in the newer graph);
    nothing is validated again; round 3 adds nothing."""
    table, w, b = weights()
    compiled = torch.compile(chain, backend="infinifuse", options={"cudagraphs": True})
    shapes = [(2, n) for n in LENGTHS]
    per_round = []
    for _ in range(3):
        before = counts("recordings", "validations", "cache_misses")
        _corpus_pass(compiled, table, w, b, shapes)
        after = counts("recordings", "validations", "cache_misses")
        per_round.append(tuple(a - c for a, c in zip(after, before, strict=True)))
    graphs = fusebackend.last_report().graphs
    assert all(g.path == "fused" for g in graphs), [g.path for g in graphs]
    # (recordings, validations, misses): one validation per compiled graph; in round 2 the
    # first length is routed to the static graph and captured there
    assert per_round == [(0, 2, 60), (60, 0, 0), (0, 0, 0)]
    s = fusebackend.stats()
    assert s["cache_size"] == 60 and s["eviction_reasons"] == {}
    assert s["older_graph_calls"] == 2  # rounds 2 and 3
    assert fake_cuda_backend.live() == 60


class Embed(torch.nn.Module):
    """Token + position embeddings and a scale: parameters, so dynamic=True keeps D static."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Embedding(64, D)

    def forward(self, ids, mask):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        h = (self.tok(ids) * 2.0 + self.pos(pos)) * 0.5
        return (h * mask.unsqueeze(-1)).sum(1)


def test_churn_under_dynamic_true(fake_cuda_backend, reference_groups):
    torch.manual_seed(0)
    model = Embed()
    compiled = torch.compile(
        model, backend="infinifuse", dynamic=True, options={"cudagraphs": True}
    )
    per_round = []
    for _ in range(2):
        before = counts("recordings", "validations", "cache_misses")
        with torch.no_grad():
            for n in LENGTHS:
                ids, mask = rand_ids(V, (2, n)), torch.ones(2, n, dtype=torch.long)
                assert_close(compiled(ids, mask), model(ids, mask))
        after = counts("recordings", "validations", "cache_misses")
        per_round.append(tuple(a - c for a, c in zip(after, before, strict=True)))
    (graph,) = fusebackend.last_report().graphs  # one graph for every length
    assert graph.path == "fused", str(fusebackend.last_report())
    assert per_round == [(0, 1, 60), (60, 0, 0)]


def test_eviction_warning_names_its_cause(fake_capture, caplog):
    with caplog.at_level(logging.WARNING, logger="fusebackend"):
        cache = big_cache(max_graphs=1)
        cache(torch.randn(1, 16))
        cache(torch.randn(2, 16))
    assert any("max_graphs=1" in r.getMessage() for r in caplog.records)


def test_another_function_after_a_dynamo_reset_supersedes_nothing():
    """torch._dynamo.reset() numbers frames from 0 again: a new function's first graph must
    not take an older function's graph (still alive here) for its earlier compilation."""
    table, w, b = weights()
    first = torch.compile(chain, backend="infinifuse")
    _corpus_pass(first, table, w, b, [(2, 5)])
    (report,) = fusebackend.last_report().graphs
    kept = report.runtime_ref()  # a caller still holding the first function's graph
    torch._dynamo.reset()

    def other(ids, mask, table, weight, bias):
        return chain(ids, mask, table, weight, bias) * 2

    second = torch.compile(other, backend="infinifuse")
    with torch.no_grad():
        ids, mask = rand_ids(V, (2, 5)), torch.ones(2, 5, dtype=torch.long)
        assert_close(second(ids, mask, table, w, b), other(ids, mask, table, w, b))
    s = fusebackend.stats()
    assert s["eviction_reasons"] == {} and len(kept) == 1


def test_two_graphs_of_one_function_called_in_turn_keep_their_entries():
    """Two compilations that differ in a Python value (not a more general recompile) are
    both routed calls: the newer one's first miss drops the older's entry once (the older
    graph had no call since), and after that neither drops the other's shapes (5 drops
    without that rule)."""
    table, w, b = weights()

    def scaled(ids, mask, table, weight, bias, double: bool):
        out = chain(ids, mask, table, weight, bias)
        return out * 2 if double else out

    compiled = torch.compile(scaled, backend="infinifuse", dynamic=True)
    with torch.no_grad():
        for n in (4, 6, 8, 10, 12) * 2:
            for double in (True, False):
                ids, mask = rand_ids(V, (2, n)), torch.ones(2, n, dtype=torch.long)
                expected = scaled(ids, mask, table, w, b, double)
                assert_close(compiled(ids, mask, table, w, b, double), expected)
    s = fusebackend.stats()
    assert len({label.split()[0] for label in s["fusion_modes"]}) == 2  # two graphs
    assert s["eviction_reasons"] == {"superseded": 1}
    assert s["cache_size"] == 10


# ------------------------------------------------- capture on promotion, then replay


class NoEffectGraph:
    """A captured graph as CUDA records one: capturing runs nothing (the inputs are put
    back after the outputs are computed), each replay runs the function once."""

    def __init__(self, fn, inputs):
        self.fn, self.inputs, self.replays = fn, list(inputs), 0
        saved = [(t, t.clone()) for t in self.inputs if isinstance(t, torch.Tensor)]
        self.outputs = fn(*self.inputs)
        for t, before in saved:
            t.copy_(before)

    def replay(self):
        self.replays += 1
        for buf, new in zip(self.outputs, self.fn(*self.inputs), strict=True):
            if isinstance(buf, torch.Tensor) and buf is not new:
                buf.copy_(new)


@pytest.fixture
def recording_capture(monkeypatch):
    made: list[tuple[NoEffectGraph, int]] = []

    def capture(fn, inputs, *, device, warmup_iterations):
        assert device == FAKE_CUDA
        for _ in range(warmup_iterations):
            fn(*inputs)
        graph = NoEffectGraph(fn, inputs)
        made.append((graph, warmup_iterations))
        return graph, graph.outputs

    monkeypatch.setattr(cap, "capture_graph", capture)
    return made


def step(x, counter):
    counter.add_(1)  # in place, on a static input: must happen once per call
    return (x * 2 + counter,)


def call_step(cache: GraphCache, x: torch.Tensor, counter: torch.Tensor, n: int) -> None:
    """The ``n``-th call of ``step_cache()``: the counter updated once, the call's output."""
    (out,) = cache(x, counter)
    assert counter.item() == n
    assert_close(out, x * 2 + n)


def step_cache() -> GraphCache:
    return GraphCache(
        unfused=step, fused=None, config=FusionConfig(cudagraphs=True), device=FAKE_CUDA,
        static_input_indices=frozenset({1}), mutated_input_indices=frozenset({1}),
        name="step",
    )  # fmt: skip


@pytest.mark.parametrize("warm", [True, False], ids=["warm-stream", "cold-stream"])
def test_a_recurring_signature_is_captured_and_replayed_for_its_call(
    recording_capture, monkeypatch, warm
):
    """The 2nd call of a signature: with the capture stream warm, captured without a run
    first and replayed for the call (one replay on that call); cold, run then captured (no
    replay on that call). Either way the in-place update happens once per call."""
    monkeypatch.setattr(cap, "side_stream_warm", lambda device: warm)
    cache = step_cache()
    counter = torch.zeros(1)
    x = torch.randn(3, 4)
    for n in range(1, 5):
        call_step(cache, x, counter, n)
        if n == 2:
            ((graph, warmups),) = recording_capture
            assert graph.replays == (1 if warm else 0)
            assert warmups == (0 if warm else 1)
    assert graph.replays == (3 if warm else 2)
    assert fusebackend.stats()["recordings"] == 1


def test_a_failed_capture_on_promotion_runs_then_captures(recording_capture, monkeypatch):
    """The capture without a run fails once (as a capture can): the call runs the graph and
    captures it after the run, as a new signature would; the result and the in-place
    update are those of one call."""
    monkeypatch.setattr(cap, "side_stream_warm", lambda device: True)
    inner = cap.capture_graph
    failures = []

    def flaky(fn, inputs, *, device, warmup_iterations):
        if not failures:
            failures.append(1)
            raise RuntimeError("capture invalidated")
        return inner(fn, inputs, device=device, warmup_iterations=warmup_iterations)

    monkeypatch.setattr(cap, "capture_graph", flaky)
    cache = step_cache()
    counter = torch.zeros(1)
    x = torch.randn(3, 4)
    for n in range(1, 4):
        call_step(cache, x, counter, n)
    assert failures == [1] and len(recording_capture) == 1
    assert cache.describe()[0]["captured"] is True
    assert fusebackend.stats()["capture_failures"] == 0  # retried at once, not a fallback
