"""CPU tests of the runtime: keys, LRU, counters, the fallback chain, controls, buckets,
mutations, output ownership and threads.

Capture is driven without a GPU by replacing ``capture.capture_graph`` with
``FakeGraph``: fixed input buffers and fixed output buffers overwritten on every replay,
which is exactly the part of CUDA-graph semantics the cache has to get right.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch
from helpers import FakeGraph, backend_warnings, one_fallback_reason

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as cap
from fusebackend.runtime import graph_cache
from fusebackend.runtime import stats as runtime_stats
from fusebackend.runtime.graph_cache import EAGER, FUSION, GRAPH_REPLAY, GraphCache
from fusebackend.runtime.stats import (
    clear_cache,
    fusion_enabled,
    reset_stats,
    set_fusion_enabled,
    stats,
)
from fusebackend.runtime.validation import mismatch

# A CUDA device object on a machine without CUDA: with cudagraphs=True the cache takes the
# capture path, and capture_graph (faked or refusing CPU inputs) is the only CUDA boundary.
FAKE_CUDA = torch.device("cuda", 0)

STATS_KEYS = {
    "enabled",
    "ignored_options",
    "fusion_scheduler_available",
    "cache_size",
    "cache_hits",
    "cache_misses",
    "recordings",
    "fusion_attempts",
    "fusion_successes",
    "fusion_fallbacks",
    "cached_shapes",
    "fusion_modes",
    "evictions",
    "rerecords",
    "capture_failures",
    "older_graph_calls",
    "replays_on_stale_constants",
    "graph_pool_bytes",
    "fallback_reasons",
    "eviction_reasons",
    "validations",
    "validations_within_noise",
    "validations_nearer_float32",
    "captured_bytes",
}
COUNTER_KEYS = {
    "validations_within_noise",
    "validations_nearer_float32",
    "cache_hits",
    "cache_misses",
    "recordings",
    "fusion_attempts",
    "fusion_successes",
    "fusion_fallbacks",
    "validations",
    "evictions",
    "rerecords",
    "capture_failures",
    "older_graph_calls",
    "replays_on_stale_constants",
}


@pytest.fixture
def fake_capture(monkeypatch):
    """Replace capture with FakeGraph; returns weak references to the graphs made."""
    graphs: list[weakref.ref[FakeGraph]] = []

    def capture(fn, inputs, *, device, warmup_iterations):
        assert device == FAKE_CUDA
        for _ in range(warmup_iterations):
            fn(*inputs)
        graph = FakeGraph(fn, inputs)
        graphs.append(weakref.ref(graph))
        return graph, graph.outputs

    monkeypatch.setattr(cap, "capture_graph", capture)
    return graphs


class Counting:
    """A callable that counts its calls."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def mul_add(x, y):
    return (x * y + 1,)


# Most tests here are about what a captured entry does, so their caches capture on a
# signature's first call (capture_on_call=1); the tests of capture on recurrence (the default,
# 2) pass it explicitly.
FIRST_CALL = {"capture_on_call": 1}


def make(unfused=mul_add, fused=mul_add, device=None, **options) -> GraphCache:
    return GraphCache(
        unfused=unfused,
        fused=fused,
        config=FusionConfig(**(FIRST_CALL | options)),
        device=device,
        name="t",
    )


def captured(fn, static=(), mutated=(), **options) -> GraphCache:
    """A cache of ``fn`` (unfused only) captured through the fake capture on FAKE_CUDA."""
    return GraphCache(
        unfused=fn,
        fused=None,
        config=FusionConfig(cudagraphs=True, **(FIRST_CALL | options)),
        device=FAKE_CUDA,
        static_input_indices=frozenset(static),
        mutated_input_indices=frozenset(mutated),
    )


def counters() -> dict[str, int]:
    s = stats()
    return {k: s[k] for k in COUNTER_KEYS}


# ----------------------------------------------------------------------------------- keys


def test_key_same_metadata_same_key_other_metadata_other_key():
    cache = make()
    x = torch.randn(4, 8)
    key = cache.key_for(x, 3)
    assert isinstance(key, tuple)
    assert cache.key_for(torch.randn(4, 8), 3) == key  # values do not matter
    assert hash(cache.key_for(torch.randn(4, 8), 3)) == hash(key)
    variants = {
        "shape": (torch.randn(5, 8), 3),
        "dtype": (x.double(), 3),
        "stride": (torch.randn(8, 4).t(), 3),
        "device": (torch.empty(4, 8, device="meta"), 3),
        "int value": (x, 4),
        "scalar type": (x, 3.0),
    }
    keys = {name: cache.key_for(*args) for name, args in variants.items()}
    for name, other in keys.items():
        assert other != key, name
    assert len(set(keys.values())) == len(keys)


def test_staged_cpu_scalars_are_not_keyed_by_value_baked_ones_are():
    """A CPU 0-d host input (a position counter the host part computes) is copied to the
    device before each replay, so its value must stay out of the key: keyed by value, every
    decode step was a new signature and a new capture."""
    from fusebackend.runtime.keys import Signatures

    x = torch.randn(4, 8)
    staged = Signatures(frozenset(), False, bakes_cpu_scalars=True, staged=frozenset({1}))
    assert staged.key((x, torch.tensor(3))) == staged.key((x, torch.tensor(4)))
    baked = Signatures(frozenset(), False, bakes_cpu_scalars=True)
    assert baked.key((x, torch.tensor(3))) != baked.key((x, torch.tensor(4)))
    # a baked one by its dtype and value alone: a new tensor of the same number (Dynamo
    # builds one per call) is the same signature, another dtype is not
    assert baked.key((x, torch.tensor(0.5))) == baked.key((x, torch.tensor(0.5)))
    wider = torch.tensor(0.5, dtype=torch.float64)
    assert baked.key((x, torch.tensor(0.5))) != baked.key((x, wider))


def test_static_inputs_are_not_in_the_key_and_fusion_switch_is():
    cache = GraphCache(
        unfused=mul_add,
        fused=mul_add,
        config=FusionConfig(),
        device=None,
        static_input_indices=frozenset({1}),
    )
    x = torch.randn(4, 8)
    key = cache.key_for(x, torch.randn(8))
    assert cache.key_for(x, torch.randn(3, 8).double()) == key
    set_fusion_enabled(False)
    assert cache.key_for(x, torch.randn(8)) != key


# ------------------------------------------------------------------------------------ LRU


def test_lru_evicts_least_recently_used_and_counts():
    cache = make(max_graphs=2)
    a, b, c = (torch.randn(n) for n in (1, 2, 3))
    cache(a, a)
    cache(b, b)
    cache(a, a)  # a is now the most recent
    cache(c, c)  # evicts b
    s = stats()
    assert s["evictions"] == 1
    assert s["cache_size"] == 2
    assert s["cached_shapes"] == [((1,), (1,)), ((3,), (3,))]
    assert cache.mode_for(b, b) is None
    cache(b, b)  # miss again, evicts a
    s = stats()
    assert (s["cache_misses"], s["cache_hits"], s["evictions"]) == (4, 1, 2)
    assert cache.mode_for(a, a) is None


# ---------------------------------------------------------------------------------- stats


def test_stats_exact_keys_and_counters_move_only_on_events():
    s = stats()
    assert set(s) == STATS_KEYS
    assert all(s[k] == 0 for k in COUNTER_KEYS)
    assert s["enabled"] is True
    assert s["graph_pool_bytes"] == 0
    assert s["fusion_scheduler_available"] == (
        torch.cuda.is_available() and runtime_stats._triton_importable()
    )

    fused = Counting(mul_add)
    cache = make(fused=fused)
    x = torch.randn(2, 3)
    cache(x, x)
    assert counters() == {
        **dict.fromkeys(COUNTER_KEYS, 0),
        "cache_misses": 1,
        "fusion_attempts": 1,
        "fusion_successes": 1,
        "validations": 1,
    }
    cache(x, x)
    cache(torch.randn(2, 3), x)
    c = counters()
    assert (c["cache_hits"], c["cache_misses"], c["fusion_attempts"]) == (2, 1, 1)
    assert fused.calls == 3
    s = stats()
    assert s["cache_size"] == 1
    assert s["cached_shapes"] == [((2, 3), (2, 3))]
    assert list(s["fusion_modes"].values()) == [FUSION]
    (label,) = s["fusion_modes"]
    assert "float32[2, 3]" in label and "fused" in label
    assert s["fallback_reasons"] == {}
    assert (s["eviction_reasons"], s["captured_bytes"]) == ({}, 0)

    reset_stats()
    assert all(v == 0 for v in counters().values())
    assert stats()["cache_size"] == 1  # reset_stats keeps the entries
    cache(x, x)
    assert counters()["cache_hits"] == 1


def test_dead_cache_leaves_stats():
    cache = make()
    cache(torch.randn(2), torch.randn(2))
    assert stats()["cache_size"] == 1
    del cache
    gc.collect()
    assert stats()["cache_size"] == 0


def test_describe_lists_entries():
    cache = make(fused=lambda x, y: (x * y,))  # wrong numbers: falls back
    cache(torch.randn(2), torch.randn(2))
    cache(torch.randn(2), torch.randn(2))
    (row,) = cache.describe()
    assert row["mode"] == EAGER
    assert row["captured"] is False
    assert row["hits"] == 1
    assert "does not match" in row["reason"]
    assert "float32[2]" in row["key"]


# --------------------------------------------------------------------------- fallback chain


def test_the_fallback_chain_is_one_rule():
    """modes.demote: where each cause sends each mode, and how the step reads in the reason."""
    from fusebackend.runtime.modes import Cause, Mode, demote

    def step(mode, cause, **kw):
        result = demote(mode, cause, "why", None, **kw)
        return result.mode, result.reason

    assert step(Mode.FUSION, Cause.FUSED_FAILED) == (
        GRAPH_REPLAY,
        "fusion -> graph_replay: why",
    )
    assert step(Mode.FUSION, Cause.FUSED_FAILED, captures=False) == (EAGER, "fusion -> eager: why")
    assert step(Mode.FUSION, Cause.CAPTURE_FAILED)[0] == GRAPH_REPLAY
    assert step(Mode.GRAPH_REPLAY, Cause.CAPTURE_FAILED) == (EAGER, "graph_replay -> eager: why")
    # A fused graph that is not captured stays in fusion, run directly; unfused goes eager.
    assert step(Mode.FUSION, Cause.NOT_CAPTURABLE) == (FUSION, "not captured: why")
    assert step(Mode.GRAPH_REPLAY, Cause.NOT_CAPTURABLE) == (EAGER, "graph_replay -> eager: why")
    assert step(Mode.FUSION, Cause.OVER_BUDGET) == (FUSION, "not captured: why")
    assert step(Mode.GRAPH_REPLAY, Cause.OVER_BUDGET) == (
        EAGER,
        "graph_replay -> eager: not captured: why",
    )
    assert step(Mode.FUSION, Cause.NO_PAYOFF) == (FUSION, "why")
    assert step(Mode.GRAPH_REPLAY, Cause.NO_PAYOFF) == (EAGER, "graph_replay -> eager: why")
    assert (
        demote(Mode.FUSION, Cause.FUSED_FAILED, "b", "a").reason == "a; fusion -> graph_replay: b"
    )
    # The modes read as the names users see, in text and compared with strings.
    assert (str(FUSION), f"{GRAPH_REPLAY}", EAGER.value) == ("fusion", "graph_replay", "eager")
    assert {"fusion"} == {FUSION}


def test_fused_that_raises_falls_back_to_eager_logged_once(caplog):
    def broken(x, y):
        raise RuntimeError("triton compile boom")

    fused = Counting(broken)
    cache = make(fused=fused)
    x, y = torch.randn(3), torch.randn(3)
    with caplog.at_level(logging.WARNING, logger=graph_cache.__name__):
        for _ in range(3):
            (out,) = cache(x, y)
            torch.testing.assert_close(out, x * y + 1)
    assert fused.calls == 1
    assert cache.mode_for(x, y) == EAGER
    s = stats()
    assert (s["fusion_attempts"], s["fusion_successes"], s["fusion_fallbacks"]) == (1, 0, 1)
    (reason,) = s["fallback_reasons"].values()
    assert "triton compile boom" in reason and "RuntimeError" in reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "triton compile boom" in warnings[0].getMessage()


def test_validation_catches_wrong_numbers():
    fused = Counting(lambda x, y: (x * y + 1.5,))
    cache = make(fused=fused)
    x, y = torch.randn(3), torch.randn(3)
    (out,) = cache(x, y)
    torch.testing.assert_close(out, x * y + 1)  # the first call already returns the truth
    (out,) = cache(x, y)
    torch.testing.assert_close(out, x * y + 1)
    assert fused.calls == 1
    assert cache.mode_for(x, y) == EAGER
    s = stats()
    assert (s["fusion_attempts"], s["fusion_successes"], s["fusion_fallbacks"]) == (1, 0, 1)
    assert "does not match" in next(iter(s["fallback_reasons"].values()))


def test_without_validation_wrong_numbers_are_not_caught():
    cache = make(fused=lambda x, y: (x * y + 1.5,), validate=False)
    x, y = torch.randn(3), torch.randn(3)
    (out,) = cache(x, y)
    torch.testing.assert_close(out, x * y + 1.5)
    assert cache.mode_for(x, y) == FUSION
    assert stats()["fusion_successes"] == 1


def _fp16_chain_rounding_each_op(x, y):
    return (((x * y) + 1) * 3,)


def _fp16_chain_fp32_rounded_once(x, y):
    return ((((x.float() * y.float()) + 1) * 3).half(),)


@pytest.mark.parametrize(
    ("fused", "keeps_fusion"),
    [
        (_fp16_chain_fp32_rounded_once, True),  # what a fused kernel legitimately produces
        (lambda x, y: ((((x * y) + 1) * 3) * 1.1,), False),  # 10% off
        (lambda x, y: ((((x * y) + 1) * 3).float(),), False),  # wrong dtype
    ],
)
def test_validation_tolerance_is_per_dtype(fused, keeps_fusion):
    torch.manual_seed(0)
    x = torch.randn(64, 127).half()
    y = torch.randn(64, 127).half()
    cache = make(unfused=_fp16_chain_rounding_each_op, fused=fused)
    cache(x, y)
    assert (cache.mode_for(x, y) == FUSION) is keeps_fusion


def _noisy(x):
    # one ulp on x (fp16, in [1, 2)) moves the output by about 6% of its norm
    return (torch.sin(x.float() * 40).half(),)


@pytest.mark.parametrize(
    ("off_by", "keeps_fusion"),
    [(1.02, True), (1.10, False)],  # within half the model's own noise (6%), or not
)
def test_validation_bounds_grow_with_the_models_own_noise(off_by, keeps_fusion):
    torch.manual_seed(0)
    x = (torch.rand(64, 127) + 1).half()
    cache = make(unfused=_noisy, fused=lambda x: ((_noisy(x)[0].float() * off_by).half(),))
    (out,) = cache(x)
    assert (cache.mode_for(x) == FUSION) is keeps_fusion
    assert stats()["validations_within_noise"] == int(keeps_fusion)
    if not keeps_fusion:
        (reason,) = stats()["fallback_reasons"].values()
        assert "one ulp of input noise moves the output 0.06" in reason, reason
        torch.testing.assert_close(out, _noisy(x)[0])  # the unfused graph's result


@pytest.mark.parametrize(("off_by", "keeps_fusion"), [(1.024, True), (1.10, False)])
def test_a_model_as_noisy_as_inception_v3_in_fp16_is_validated_within_its_noise(
    off_by, keeps_fusion
):
    # one ulp on x moves sin(x * 100) by about 15% of its norm, as one ulp of the image moved
    # timm Inception-v3's logits in fp16; its fused graph was 2.4% from the unfused one
    x = (torch.rand(64, 127, generator=torch.Generator().manual_seed(1)) + 1).half()

    def noisy(x):
        return (torch.sin(x.float() * 100).half(),)

    cache = make(unfused=noisy, fused=lambda x: ((noisy(x)[0].float() * off_by).half(),))
    cache(x)
    assert (cache.mode_for(x) == FUSION) is keeps_fusion
    if not keeps_fusion:
        (reason,) = stats()["fallback_reasons"].values()
        assert "one ulp of input noise moves the output 0.1" in reason, reason


def test_an_output_noisier_than_the_cap_keeps_the_fixed_bounds():
    # sin(x * 3000): one ulp moves the output by its whole norm, past NOISE_CAP
    x = (torch.rand(64, 127, generator=torch.Generator().manual_seed(0)) + 1).half()

    def chaotic(x):
        return (torch.sin(x.float() * 3000).half(),)

    cache = make(unfused=chaotic, fused=lambda x: ((chaotic(x)[0].float() * 1.02).half(),))
    cache(x)
    assert cache.mode_for(x) != FUSION
    assert stats()["validations_within_noise"] == 0


def _cancelling(x):
    # fp16 rounds x + 100 to a step of 1/16: x's low bits are lost, where float32 keeps them
    return ((x + 100) - 100,)


@pytest.mark.parametrize(("fused", "keeps_fusion"), [
    (lambda x: (x.clone(),), True),  # x itself: what float32 computes
    (lambda x: ((x.float() * 1.1).half(),), False),  # 10% off: farther from it than eager
])  # fmt: skip
def test_a_half_graph_nearer_float32_than_the_unfused_graph_keeps_fusion(fused, keeps_fusion):
    # The unfused graph's rounding is 3% of the output's norm (past the 1% bound), and one
    # ulp on x rarely moves it (no noise to widen the bounds): only the float32 rerun of the
    # unfused graph tells the exact fused result from a wrong one.
    x = torch.rand(64, 127, generator=torch.Generator().manual_seed(0)).half()
    cache = make(unfused=_cancelling, fused=fused)
    (out,) = cache(x)
    assert (cache.mode_for(x) == FUSION) is keeps_fusion
    assert stats()["validations_nearer_float32"] == int(keeps_fusion)
    assert stats()["validations_within_noise"] == 0
    if not keeps_fusion:
        torch.testing.assert_close(out, _cancelling(x)[0])  # the unfused graph's result


def test_a_graph_that_cannot_run_on_moved_inputs_gets_no_noise():
    from fusebackend.runtime.validation import input_noise

    def picky(x):
        if not torch.equal(x, torch.ones_like(x)):
            raise RuntimeError("only ones")
        return (x * 2,)

    x = torch.ones(3, 4)
    assert input_noise(picky, [x], picky(x)) is None


def test_a_two_percent_error_on_a_quiet_model_is_still_caught():
    torch.manual_seed(0)
    x, y = torch.randn(64, 127).half(), torch.randn(64, 127).half()
    cache = make(
        unfused=_fp16_chain_rounding_each_op,
        fused=lambda x, y: ((_fp16_chain_rounding_each_op(x, y)[0].float() * 1.02).half(),),
    )
    cache(x, y)
    assert cache.mode_for(x, y) != FUSION
    assert stats()["validations_within_noise"] == 0


def test_validation_treats_nan_as_equal():
    x = torch.tensor([1.0, float("nan"), 2.0])
    cache = make(unfused=lambda x: (x * 2,), fused=lambda x: (x + x,))
    cache(x)
    assert cache.mode_for(x) == FUSION


def test_validation_nan_equals_nan_and_inf_equals_inf_of_the_same_sign_only():
    inf = float("inf")
    x = torch.tensor([1.0, float("nan"), inf, -inf])
    assert mismatch([x.clone()], [x], "output") is None
    assert mismatch([x.half()], [x.half()], "output") is None
    flipped = x.clone()
    flipped[2] = -inf
    assert "output 0" in mismatch([flipped], [x], "output")
    nan_for_inf = x.clone()
    nan_for_inf[3] = float("nan")
    assert mismatch([nan_for_inf], [x], "output") is not None
    cache = make(unfused=lambda x: (x * 2,), fused=lambda x: (-x * 2,))
    cache(torch.tensor([inf, 1.0]))  # -inf against +inf: falls back
    assert cache.mode_for(torch.tensor([inf, 1.0])) == EAGER


def test_validation_passes_rounding_spread_and_rejects_real_errors():
    # The H100 case that an element-wise check rejected: fp16 logits of a deep model, one of
    # 32000 apart by 0.0115, the rest by rounding. A norm comparison lets it through; a wrong
    # kernel does not get through.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 1, 32000, generator=g) * 3).half()
    rounded = (logits.float() + torch.randn(logits.shape, generator=g) * 2e-3).half()
    rounded[0, 0, 31450] += 0.0115
    assert mismatch([rounded], [logits], "output") is None
    unwritten_row = torch.randn(32, 1024, generator=g)
    broken = unwritten_row.clone()
    broken[-1] = 0  # a kernel that skipped its last row: 1/32 of the tensor
    assert "relative difference" in mismatch([broken], [unwritten_row], "output")
    half = unwritten_row.half()
    one_garbage = half.clone()
    one_garbage[7, 9] += 0.25  # within its row's norm bound (0.25 / 32), caught alone
    assert "one element" in mismatch([one_garbage], [half], "output")
    # Wrong rows hide in a large tensor's norm; each row is compared too.
    big_first_row = torch.randn(512, 1024, generator=g).half()
    big_first_row[0] *= 100
    unwritten_last = big_first_row.clone()
    unwritten_last[-1] = 0
    assert "row 511" in mismatch([unwritten_last], [big_first_row], "output")
    many_rows = torch.randn(1024, 1024, generator=g).half()
    scaled = many_rows.clone()
    scaled[-1] = (scaled[-1].float() * 0.9).half()  # 1 row of 1024 off by 10%
    assert "row 1023" in mismatch([scaled], [many_rows], "output")
    tail = logits.clone()
    tail[..., -16:] += 1.0  # a tail block off by 1.0: 16 logits of 32000
    assert "one element" in mismatch([tail], [logits], "output")
    assert "compared exactly" in mismatch([torch.tensor([1, 2])], [torch.tensor([1, 3])], "x")
    assert "expected torch.float32" in mismatch([logits], [logits.float()], "output")


def test_validation_compares_complex_outputs():
    z = torch.randn(4, 8, dtype=torch.complex64)
    assert mismatch([z.clone()], [z], "output") is None
    wrong = z.clone()
    wrong[1] *= 1.5
    assert "relative difference" in mismatch([wrong], [z], "output")
    # through the runtime: a graph returning a complex tensor validates on its first call
    cache = make(unfused=lambda x: (x * 2,), fused=lambda x: (x + x,))
    cache(z)
    assert cache.mode_for(z) == FUSION


def test_capture_failures_walk_the_chain_to_eager_and_never_retry(monkeypatch):
    attempts = []

    def failing_capture(fn, inputs, *, device, warmup_iterations):
        attempts.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cap, "capture_graph", failing_capture)
    fused = Counting(mul_add)
    cache = make(fused=fused, device=FAKE_CUDA, cudagraphs=True, max_graphs=1)
    x, y = torch.randn(3), torch.randn(3)
    (out,) = cache(x, y)
    torch.testing.assert_close(out, x * y + 1)
    assert attempts == [fused, mul_add]  # fused capture, then unfused capture
    assert cache.mode_for(x, y) == EAGER
    s = stats()
    assert (s["capture_failures"], s["recordings"], s["fusion_fallbacks"]) == (2, 0, 1)
    (reason,) = s["fallback_reasons"].values()
    assert "fusion -> graph_replay" in reason and "graph_replay -> eager" in reason
    assert "not permitted when stream is capturing" in reason

    cache(x, y)
    other = torch.randn(5)
    cache(other, other)  # evicts (x, y)'s entry
    cache(x, y)  # miss: the verdict is remembered, no capture retried
    assert len(attempts) == 4  # only the new shape tried (twice)
    assert cache.mode_for(x, y) == EAGER
    torch.testing.assert_close(cache(x, y)[0], x * y + 1)


def test_real_capture_refuses_cpu_tensors_without_touching_cuda():
    cache = make(fused=None, device=FAKE_CUDA, cudagraphs=True)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(cache(x, y)[0], x * y + 1)
    assert cache.mode_for(x, y) == EAGER
    s = stats()
    assert s["capture_failures"] == 1
    assert s["fusion_fallbacks"] == 0  # it never was in "fusion"
    (reason,) = s["fallback_reasons"].values()
    assert "graph_replay -> eager" in reason and "cpu tensor" in reason


def test_config_fusion_false_ignores_the_fused_callable():
    fused = Counting(mul_add)
    cache = make(fused=fused, fusion=False)
    x = torch.randn(3)
    cache(x, x)
    assert fused.calls == 0
    assert cache.mode_for(x, x) == EAGER
    assert stats()["fusion_attempts"] == 0


# ------------------------------------------------------------------------- captured path


def test_captured_entries_replay_and_outputs_are_never_stale(fake_capture):
    cache = make(device=FAKE_CUDA, cudagraphs=True)
    x1, y1 = torch.randn(4), torch.randn(4)
    x2, y2 = torch.randn(4), torch.randn(4)
    (out1,) = cache(x1, y1)  # miss: direct run, then capture
    (out2,) = cache(x2, y2)  # hit: replay
    (out3,) = cache(x1 * 3, y2)
    torch.testing.assert_close(out1, x1 * y1 + 1)
    torch.testing.assert_close(out2, x2 * y2 + 1)
    torch.testing.assert_close(out3, x1 * 3 * y2 + 1)
    (graph,) = (ref() for ref in fake_capture)
    assert graph.replays == 2
    assert cache.mode_for(x1, y1) == FUSION
    s = stats()
    assert (s["recordings"], s["cache_hits"], s["cache_misses"]) == (1, 2, 1)
    assert cache.describe()[0]["captured"] is True


def several_outputs(x, y):
    """Outputs as graphs return them: mixed dtypes, a transposed (dense) view, a slice with
    a gap (not dense), a channels-last 4-D value, a 0-d value; an input returned as it is and
    a non-tensor between them. (No expanded output: FakeGraph's replay cannot write one.)"""
    z = x * y + 1
    wide = torch.cat([z, z], dim=1)
    image = torch.stack([z, -z], dim=-1).unsqueeze(0).contiguous(memory_format=CHANNELS_LAST)
    return (z, y, z.t(), 3, wide[:, ::2], image, (z > 0).to(torch.int32), z.sum())


CHANNELS_LAST = torch.channels_last
AS_GIVEN = (1, 3)  # several_outputs' input and constant, returned as they are


def test_several_outputs_are_copied_out_and_never_overwritten(fake_capture):
    # runtime/outputs.py: two or more outputs are allocated one by one and copied by one
    # _foreach_copy_; each copy must land in its own place with clone's strides, and none
    # may be a graph buffer
    cache = captured(several_outputs)
    x1, y1, x2, y2 = (torch.randn(3, 5) for _ in range(4))
    cache(x1, y1)  # the first call runs directly, then captures
    first = cache(x1, y1)
    (graph,) = (ref() for ref in fake_capture)
    assert graph.replays == 1
    second = cache(x2, y2)
    assert graph.replays == 2
    for outs, (x, y) in ((first, (x1, y1)), (second, (x2, y2))):
        expected = several_outputs(x, y)
        assert outs[1] is y and outs[3] == 3  # the input itself, the constant as it is
        for k, (got, want, buffer) in enumerate(zip(outs, expected, graph.outputs, strict=True)):
            if k in AS_GIVEN:
                continue
            torch.testing.assert_close(got, want)
            assert got.dtype == want.dtype and got.stride() == buffer.clone().stride(), k
            assert got.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert first[5].is_contiguous(memory_format=CHANNELS_LAST)
    # the two copied-out calls share no memory either
    assert first[0].data_ptr() != second[0].data_ptr()


def test_captured_inputs_with_odd_strides_and_empty_batches(fake_capture):
    cache = make(device=FAKE_CUDA, cudagraphs=True)
    for _ in range(2):
        x = torch.randn(8, 4).t()  # transposed
        y = torch.randn(1, 8).expand(4, 8)  # stride 0: its static buffer must be dense
        torch.testing.assert_close(cache(x, y)[0], x * y + 1)
        e = torch.randn(0, 3)
        assert cache(e, e)[0].shape == (0, 3)
    assert stats()["recordings"] == 2
    assert stats()["cache_hits"] == 2


def test_static_outputs_returns_the_graph_buffers(fake_capture):
    cache = make(device=FAKE_CUDA, cudagraphs=True, static_outputs=True)
    x = torch.randn(4)
    cache(x, x)
    (out1,) = cache(x, x)
    (out2,) = cache(x * 2, x)
    assert out1 is out2  # the documented hazard: the second call overwrote the first
    torch.testing.assert_close(out1, x * 2 * x + 1)


def test_container_type_is_preserved(fake_capture):
    direct = make(unfused=lambda x: [x + 1], fused=None)
    captured = make(unfused=lambda x: [x + 1], fused=None, device=FAKE_CUDA, cudagraphs=True)
    as_tuple = make(
        unfused=lambda x: (x + 1, None, 7), fused=None, device=FAKE_CUDA, cudagraphs=True
    )
    x = torch.randn(2)
    for _ in range(2):
        assert type(direct(x)) is list
        assert type(captured(x)) is list
        out = as_tuple(x)
        assert type(out) is tuple and out[1:] == (None, 7)


def test_parameter_address_change_rerecords(fake_capture):
    w = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    cache = captured(lambda x, w: (x * w,), static={1})
    x = torch.randn(8)
    cache(x, w)
    cache(x, w)
    assert stats()["rerecords"] == 0
    with torch.no_grad():
        w.mul_(2)  # in place: same address, the graph reads it where it is
    torch.testing.assert_close(cache(x, w)[0], x * w)
    assert stats()["rerecords"] == 0
    w.data = torch.randn(8)
    torch.testing.assert_close(cache(x, w)[0], x * w)
    s = stats()
    assert (s["rerecords"], s["recordings"]) == (1, 2)
    torch.testing.assert_close(cache(x, w)[0], x * w)  # replays the new graph
    assert stats()["rerecords"] == 1
    assert len(fake_capture) == 2 and fake_capture[1]().replays == 1


class _Doubled:
    """A derived constant (the protocol of batch_norm_folding.Fold): ``value = 2 * w``."""

    sources, eps_source = (1,), None

    def __init__(self, w):
        self.value = w.detach() * 2

    def derive(self, inputs):
        self.value.copy_(inputs[1].detach() * 2)


@pytest.mark.parametrize("writes_an_input", [False, True])
def test_derived_constants_are_checked_after_the_replay_and_a_stale_one_replays_again(
    fake_capture, writes_an_input
):
    from fusebackend.passes.batch_norm_folding import Refresh

    w = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    doubled = _Doubled(w)

    def fn(x, w, state):
        if writes_an_input:
            state.add_(1)
        return (x + doubled.value,)

    refresh = Refresh([doubled], [None, w])
    order = []
    real_call, real_stale = refresh.__call__, refresh.stale

    class Spy:
        def __call__(self, inputs):
            order.append("before")
            real_call(inputs)

        def stale(self, inputs):
            order.append("stale")
            return real_stale(inputs)

    spy = Spy()
    mutated = {2} if writes_an_input else set()
    cache = GraphCache(
        unfused=fn, fused=None, config=FusionConfig(cudagraphs=True, **FIRST_CALL),
        device=FAKE_CUDA, static_input_indices=frozenset({1, 2}),
        mutated_input_indices=frozenset(mutated), before_call=spy, stale_after_replay=spy.stale,
    )  # fmt: skip
    x, state = torch.randn(8), torch.zeros(1)
    cache(x, w, state)  # capture
    order.clear()
    torch.testing.assert_close(cache(x, w, state)[0], x + 2 * w)
    (graph,) = (ref() for ref in fake_capture)
    replays = graph.replays
    if writes_an_input:  # a replay that writes must not run twice: checked before it
        assert order == ["before"]
    else:  # launched first, checked while it runs
        assert order == ["stale"]
    with torch.no_grad():
        w.mul_(-3)  # in place: the replay read the old doubled value
    torch.testing.assert_close(cache(x, w, state)[0], x + 2 * w)
    stale_replays = stats()["replays_on_stale_constants"]
    assert (graph.replays - replays, stale_replays) == ((1, 0) if writes_an_input else (2, 1))
    torch.testing.assert_close(cache(x, w, state)[0], x + 2 * w)
    assert stats()["replays_on_stale_constants"] == stale_replays
    if writes_an_input:
        assert state.item() == 4  # once per call, four calls


def test_static_input_at_a_new_address_every_call_is_copied_after_three_moves(fake_capture):
    """Mutated inputs are used in place (static); one passed fresh on every call (an output
    buffer) would re-record every call. After 3 moves it is copied in like other inputs, and
    the graph's write still reaches the caller's tensor."""
    cache = captured(lambda x, out: (out.copy_(x * 2),), static={1}, mutated={1})
    x = torch.randn(8)
    for call in range(8):
        out = torch.zeros(8)
        cache(x + call, out)
        torch.testing.assert_close(out, (x + call) * 2)
    s = stats()
    assert s["rerecords"] == 3, s
    assert s["recordings"] == 4, s  # first capture + 3 re-records, then replays with a copy
    assert fake_capture[-1]().replays == 8 - 4


def test_cudagraphs_true_on_a_cpu_graph_is_reported_once(caplog):
    cache = make(cudagraphs=True)  # device None: a CPU graph
    x = torch.randn(3)
    cache(x, x)
    cache(x, x)
    notes = stats()["ignored_options"]
    assert list(notes.values()) == [
        ["cudagraphs=True has no effect: the graph runs on the CPU; nothing is captured"]
    ]
    assert sum("cudagraphs=True has no effect" in m for m in backend_warnings(caplog)) == 1
    assert stats()["recordings"] == 0


def test_batch_buckets_without_a_batch_dimension_is_reported_once(caplog):
    cache = make(batch_buckets=[2, 4])
    for value in (1.0, 2.0):
        torch.testing.assert_close(cache(torch.tensor(value), 3)[0], torch.tensor(value * 3 + 1))
    (notes,) = stats()["ignored_options"].values()
    assert notes == [
        "batch_buckets=[2, 4] has no effect: the graph has no non-parameter tensor input "
        "with a batch dimension"
    ]
    assert sum("batch_buckets" in m for m in backend_warnings(caplog)) == 1


def test_options_that_take_effect_are_not_reported():
    cache = make(batch_buckets=[2, 4])
    cache(torch.randn(3, 2), torch.randn(3, 2))
    assert stats()["ignored_options"] == {}


# ------------------------------------------------------------------------------- controls


def test_set_fusion_enabled_switches_modes_and_back():
    fused = Counting(mul_add)
    unfused = Counting(mul_add)
    cache = make(unfused=unfused, fused=fused)
    x = torch.randn(3)
    cache(x, x)
    assert cache.mode_for(x, x) == FUSION

    set_fusion_enabled(False)
    assert fusion_enabled() is False and stats()["enabled"] is False
    calls = fused.calls
    cache(x, x)
    cache(x, x)
    assert fused.calls == calls
    assert cache.mode_for(x, x) == EAGER
    assert sorted(stats()["fusion_modes"].values()) == [EAGER, FUSION]

    set_fusion_enabled(True)
    before = counters()
    cache(x, x)
    after = counters()
    assert fused.calls == calls + 1
    assert after["cache_hits"] == before["cache_hits"] + 1  # the fused entry was kept
    assert after["fusion_attempts"] == before["fusion_attempts"]
    assert cache.mode_for(x, x) == FUSION


def test_fusion_off_captures_the_unfused_graph(fake_capture):
    fused = Counting(mul_add)
    cache = make(fused=fused, device=FAKE_CUDA, cudagraphs=True)
    set_fusion_enabled(False)
    x = torch.randn(3)
    cache(x, x)
    assert cache.mode_for(x, x) == GRAPH_REPLAY
    assert fused.calls == 0
    assert stats()["recordings"] == 1


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_set_fusion_enabled_rejects_non_bool(value):
    with pytest.raises(TypeError, match="bool"):
        set_fusion_enabled(value)
    assert fusion_enabled() is True


def test_clear_cache_frees_graphs_and_verdicts(fake_capture, monkeypatch):
    cache_a = make(device=FAKE_CUDA, cudagraphs=True)
    cache_b = make(fused=lambda x, y: (x,))  # falls back (mismatch)
    x = torch.randn(4)
    cache_a(x, x)
    cache_b(x, x)
    assert stats()["cache_size"] == 2
    assert fake_capture[0]() is not None

    clear_cache()
    gc.collect()
    assert stats()["cache_size"] == 0
    assert cache_a.describe() == [] and cache_b.describe() == []
    assert fake_capture[0]() is None  # the graph and its buffers are gone
    misses = stats()["cache_misses"]
    cache_a(x, x)
    cache_b(x, x)
    assert stats()["cache_misses"] == misses + 2
    assert stats()["fusion_attempts"] == 4  # cache_b's verdict was dropped: fusion retried


# --------------------------------------------------------------------------- batch buckets


def test_batch_buckets_pad_with_zeros_and_slice_back():
    seen = []

    def fn(x, table, n):
        seen.append((x.clone(), n))
        return (x * 2, x.sum(1), table * 3, n)

    cache = GraphCache(
        unfused=fn,
        fused=None,
        config=FusionConfig(batch_buckets=(4, 8)),
        device=None,
        static_input_indices=frozenset({1}),
        batch_size_input_indices=frozenset({2}),
    )
    table = torch.randn(4, 5)  # static, leading dim == bucket: not padded, but its output is
    x3 = torch.randn(3, 5) + 10
    out = cache(x3, table, 3)
    padded, n = seen[-1]
    assert padded.shape == (4, 5) and n == 4
    torch.testing.assert_close(padded[:3], x3)
    assert (padded[3] == 0).all()
    torch.testing.assert_close(out[0], x3 * 2)
    torch.testing.assert_close(out[1], x3.sum(1))
    assert out[2].shape == (3, 5)  # leading dim == bucket: sliced like any batch output
    assert out[3] == 4

    x2 = torch.randn(2, 5)
    torch.testing.assert_close(cache(x2, table, 2)[0], x2 * 2)
    assert seen[-1][0].shape == (4, 5)
    x4 = torch.randn(4, 5)
    torch.testing.assert_close(cache(x4, table, 4)[0], x4 * 2)
    s = stats()
    assert (s["cache_misses"], s["cache_hits"]) == (1, 2)

    x9 = torch.randn(9, 5)
    torch.testing.assert_close(cache(x9, table, 9)[0], x9 * 2)
    assert seen[-1][0].shape == (9, 5)
    assert stats()["cached_shapes"] == [((4, 5),), ((9, 5),)]


def test_batch_buckets_with_capture_are_correct_for_every_batch(fake_capture):
    cache = make(
        unfused=lambda ids, scale: (ids * scale, ids.sum(1)),
        fused=None,
        device=FAKE_CUDA,
        cudagraphs=True,
        batch_buckets=(8,),
    )
    for batch in (7, 3, 8, 1, 5):
        ids = torch.randint(0, 100, (batch, 6))
        scale = torch.randn(batch, 6)
        a, b = cache(ids, scale)
        torch.testing.assert_close(a, ids * scale)
        torch.testing.assert_close(b, ids.sum(1))
    assert stats()["recordings"] == 1
    graph = fake_capture[0]()
    assert graph.replays == 4
    # The static buffer of the last call (batch 5) holds zeros past row 5, not rows of the
    # earlier batch-7 call.
    assert (graph.inputs[0][5:] == 0).all()


# ------------------------------------------------------------------------------- mutation


def _add_one_then_double(x, y):
    x.add_(1)
    return (x * 2 + y,)


@pytest.mark.parametrize("capture", [False, True])
def test_mutated_inputs_are_written_exactly_once_per_call(fake_capture, capture):
    options = {"device": FAKE_CUDA, "cudagraphs": True} if capture else {}
    cache = GraphCache(
        unfused=_add_one_then_double,
        fused=_add_one_then_double,
        config=FusionConfig(
            warmup_iterations=3, **{k: v for k, v in options.items() if k != "device"}
        ),
        device=options.get("device"),
        mutated_input_indices=frozenset({0}),
    )
    x = torch.zeros(4)
    y = torch.randn(4)
    for step in range(1, 5):
        (out,) = cache(x, y)
        assert (x == step).all(), f"call {step}: x = {x.tolist()}"
        torch.testing.assert_close(out, 2 * x + y)
    assert cache.mode_for(x, y) == FUSION
    assert stats()["recordings"] == (1 if capture else 0)


def test_fused_failing_after_a_partial_write_leaves_no_trace():
    def half_broken(x, y):
        x.add_(100)
        raise RuntimeError("launch failed")

    cache = GraphCache(
        unfused=_add_one_then_double,
        fused=half_broken,
        config=FusionConfig(),
        device=None,
        mutated_input_indices=frozenset({0}),
    )
    x = torch.zeros(3)
    cache(x, torch.zeros(3))
    assert (x == 1).all()
    assert cache.mode_for(x, torch.zeros(3)) == EAGER


def test_mutated_parameter_is_not_advanced_by_warmup_or_capture(fake_capture):
    def step(x, counter):
        counter.add_(1)
        return (x + counter,)

    counter = torch.zeros(1)
    cache = GraphCache(
        unfused=step,
        fused=None,
        config=FusionConfig(cudagraphs=True, warmup_iterations=2),
        device=FAKE_CUDA,
        static_input_indices=frozenset({1}),
        mutated_input_indices=frozenset({1}),
    )
    x = torch.zeros(2)
    for n in range(1, 4):
        (out,) = cache(x, counter)
        assert counter.item() == n
        torch.testing.assert_close(out, torch.full((2,), float(n)))


def test_returned_input_is_the_callers_tensor(fake_capture):
    def inc(x):
        x.add_(1)
        return (x,)

    cache = GraphCache(
        unfused=inc,
        fused=None,
        config=FusionConfig(cudagraphs=True),
        device=FAKE_CUDA,
        mutated_input_indices=frozenset({0}),
    )
    x = torch.zeros(3)
    cache(x)
    (out,) = cache(x)
    assert out is x
    assert (x == 2).all()


# -------------------------------------------------------------------------------- threads


def test_two_threads_with_different_shapes_get_their_own_results(fake_capture):
    cache = make(device=FAKE_CUDA, cudagraphs=True)
    errors: list[str] = []
    start = threading.Barrier(2)

    def worker(rows: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start.wait()
        for i in range(300):
            # Alternate between a private shape and one shared with the other thread, so the
            # two threads also contend for the same entry's static buffers.
            shape = (rows, 16) if i % 2 else (2, 16)
            x = torch.randn(shape, generator=gen)
            y = torch.randn(shape, generator=gen)
            (out,) = cache(x, y)
            if not torch.allclose(out, x * y + 1):
                errors.append(f"rows={rows} call {i}")

    threads = [threading.Thread(target=worker, args=(r, r)) for r in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert stats()["recordings"] == 3


# ------------------------------------------------------------------------------ CPU graphs


def test_cpu_graph_makes_no_cuda_call(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA called for a CPU graph")

    for name in ("is_available", "current_stream", "Stream", "graph_pool_handle", "Event"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    cache = make(fused=lambda x, y: (x * y + 1,), cudagraphs=True, batch_buckets=(4,))
    x = torch.randn(3, 2)
    for _ in range(2):
        torch.testing.assert_close(cache(x, x)[0], x * x + 1)
    assert cache.mode_for(x, x) == FUSION


def test_cpu_scalar_inputs_are_captured_and_keyed_by_value(fake_capture):
    # Under dynamic=True a Python float reaches the graph as a CPU 0-d tensor; a captured
    # graph keeps its capture-time value, so the value is part of the signature.
    cache = make(device=FAKE_CUDA, cudagraphs=True)
    x1, x2, x3 = torch.randn(4), torch.randn(4), torch.randn(4)
    torch.testing.assert_close(cache(x1, torch.tensor(2.0, dtype=torch.float64))[0], x1 * 2 + 1)
    torch.testing.assert_close(cache(x2, torch.tensor(3.0, dtype=torch.float64))[0], x2 * 3 + 1)
    torch.testing.assert_close(cache(x3, torch.tensor(2.0, dtype=torch.float64))[0], x3 * 2 + 1)
    s = stats()
    assert (s["recordings"], s["cache_misses"], s["cache_hits"]) == (2, 2, 1)
    assert set(s["fusion_modes"].values()) == {FUSION}


def test_replay_waits_for_the_last_replay_only_when_the_stream_changes(monkeypatch):
    # The GPU test (test_runtime_gpu.py::test_replays_on_two_streams_never_overlap) shows
    # why; this pins the bookkeeping down on any machine: streams are read as
    # (id, device, type) tuples and a Stream is built only to wait.
    current = {"stream": (7, 0, 1)}
    waits: list[tuple[int, int]] = []

    class FakeStream:
        def __init__(self, data):
            self.id = data[0]

        def wait_stream(self, other):
            waits.append((self.id, other.id))

    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentStream", lambda index: current["stream"], raising=False
    )
    monkeypatch.setattr(cap, "_stream", FakeStream)
    monkeypatch.setattr(cap._CAPTURE, "replay_streams", {})
    for stream_id in (7, 7, 9, 9, 7, 11):
        current["stream"] = (stream_id, 0, 1)
        cap.wait_for_last_replay(0)
    assert waits == [(9, 7), (7, 9), (11, 7)]
    assert cap._CAPTURE.replay_streams == {0: (11, 0, 1)}


# ---------------------------------------------------------------------------- exactly once


def _counters_step(param, buf, x):
    """A graph with in-place state: ``param`` (static: a parameter or a KV cache used in
    place) and ``buf`` (copied into a static buffer) each advance by one per call."""
    param.add_(1)
    buf.add_(1)
    return (x * 2 + param + buf,)


def _wrong_step(param, buf, x):
    param.add_(1)
    buf.add_(1)
    return (x * 2 + param + buf + 1,)


def _raising_step(param, buf, x):
    param.add_(1)  # a partial write before the failure
    buf.add_(1)
    raise RuntimeError("fused kernel boom")


def _capture_after_warmup_fails(fn, inputs, *, device, warmup_iterations):
    for _ in range(warmup_iterations):
        fn(*inputs)  # the warm-ups ran (and wrote their state) before the capture failed
    raise RuntimeError("operation not permitted when stream is capturing")


EXACTLY_ONCE_PATHS = [
    "first_run",
    "validation_mismatch",
    "fused_raises",
    "capture_warmup",
    "capture_failure",
    "rerecord",
    "eviction",
    "large_output_trial",
    "uncaptured_cpu",
]


@pytest.mark.parametrize("path", EXACTLY_ONCE_PATHS)
def test_every_runtime_path_advances_state_exactly_once_per_call(fake_capture, monkeypatch, path):
    fused = {"validation_mismatch": _wrong_step, "fused_raises": _raising_step}.get(
        path, _counters_step
    )
    capture = path != "uncaptured_cpu"
    if path == "capture_failure":
        monkeypatch.setattr(cap, "capture_graph", _capture_after_warmup_fails)
    cache = GraphCache(
        unfused=_counters_step,
        fused=fused,
        config=FusionConfig(
            cudagraphs=capture, warmup_iterations=3, max_graphs=1 if path == "eviction" else 16
        ),
        device=FAKE_CUDA if capture else None,
        static_input_indices=frozenset({0}),
        mutated_input_indices=frozenset({0, 1}),
    )
    param, buf = torch.zeros(1), torch.zeros(1)
    n = (1 << 21) if path == "large_output_trial" else 5  # 8 MiB of fp32 output
    xs = [torch.randn(n), torch.randn(n + 1)]
    for call in range(1, 10):
        x = xs[call % 2] if path == "eviction" else xs[0]
        if path == "rerecord" and call == 3:
            param.data = param.data.clone()  # a new address: the next hit re-records
        (out,) = cache(param, buf, x)
        assert param.item() == call and buf.item() == call, (path, call, param, buf)
        torch.testing.assert_close(out, x * 2 + 2 * call)
    s = stats()
    expected_mode = {"validation_mismatch": GRAPH_REPLAY, "fused_raises": GRAPH_REPLAY}
    if path == "capture_failure":
        assert cache.mode_for(param, buf, xs[0]) == EAGER
    else:
        assert cache.mode_for(param, buf, x) == expected_mode.get(path, FUSION)
    if path == "rerecord":
        assert s["rerecords"] == 1
    if path == "eviction":
        assert s["evictions"] == 8
    if path == "large_output_trial":
        assert cache.describe()[0]["decision"] is not None


def test_cpu_scalar_counter_is_never_captured_and_advances_once(fake_capture):
    def step(count, x):
        count.add_(1)  # a position counter on the host (0-d CPU tensor)
        return (x + 1,)

    cache = GraphCache(
        unfused=step,
        fused=step,
        config=FusionConfig(cudagraphs=True, warmup_iterations=2),
        device=FAKE_CUDA,
        mutated_input_indices=frozenset({0}),
    )
    x = torch.randn(3)
    for call in range(1, 4):
        count = torch.tensor(float(call - 1))  # a new value each call: a new key each call
        torch.testing.assert_close(cache(count, x)[0], x + 1)
        assert count.item() == call
    s = stats()
    assert s["recordings"] == 0
    assert set(s["fusion_modes"].values()) == {FUSION}  # the fused graph runs, uncaptured
    reason = next(iter(s["fallback_reasons"].values()))
    assert "not captured" in reason and "CPU scalar tensor" in reason
    assert all(row["captured"] is False for row in cache.describe())


def test_first_run_returns_the_callers_tensor_for_a_returned_mutated_input(fake_capture):
    def write(cache_t, pos, val):
        out = cache_t.index_copy_(0, pos, val)  # returns cache_t itself
        return (out, out[1:])

    cache = GraphCache(
        unfused=write,
        fused=write,
        config=FusionConfig(cudagraphs=True),
        device=FAKE_CUDA,
        static_input_indices=frozenset({0}),
        mutated_input_indices=frozenset({0}),
    )
    kv = torch.zeros(5, 3)
    out, tail = cache(kv, torch.tensor([2]), torch.ones(1, 3))
    assert out is kv
    assert tail.data_ptr() == kv[1:].data_ptr()
    assert kv[2].eq(1).all() and kv.sum() == 3


# --------------------------------------------------------------------------- large outputs


def _big(x):
    return (x * 2,)


@pytest.mark.parametrize(
    ("replay_ms", "direct_ms", "captured"), [(0.188, 0.114, False), (0.109, 0.5, True)]
)
def test_large_outputs_keep_the_faster_of_replay_and_direct(
    fake_capture, monkeypatch, replay_ms, direct_ms, captured
):
    from fusebackend.runtime import payoff

    kinds = []

    def fake_time(fn, device_index, prime_s=0.0):
        # The partial tells which path the trial took: _replay or _direct.
        replayed = fn.func.__name__ == "_replay"
        kinds.append(replayed)
        seconds = (replay_ms if replayed else direct_ms) / 1e3
        return fn(), seconds / 2, seconds  # device-bound: the device time decides

    monkeypatch.setattr(payoff, "time_call", fake_time)
    cache = make(unfused=_big, fused=_big, device=FAKE_CUDA, cudagraphs=True)
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4)  # fp32: exactly the threshold
    for _ in range(1 + 2 * payoff.TRIAL_CALLS + 2):
        torch.testing.assert_close(cache(x)[0], x * 2)
    assert kinds == [True, False] * payoff.TRIAL_CALLS  # alternating, then decided
    (row,) = cache.describe()
    assert row["captured"] is captured
    assert row["mode"] == FUSION
    if captured:
        assert row["decision"] == "captured: replay + output copy 0.109 ms <= direct 0.500 ms"
        assert stats()["fallback_reasons"] == {}
    else:
        expected = "uncaptured: replay + output copy 0.188 ms > direct 0.114 ms"
        assert row["decision"] == expected
        assert list(stats()["fallback_reasons"].values()) == [expected]
        # Remembered: after a clear of the entries (not the verdicts) it is not re-captured.
        recordings = stats()["recordings"]
        cache.table.remove(cache.key_for(x))
        cache(x)
        assert stats()["recordings"] == recordings
        assert cache.describe()[0]["captured"] is False


def test_a_trial_costs_each_kind_as_back_to_back_calls_do():
    """Per call, the larger of the fastest host and the fastest device time: the chain's
    direct run (0.1 ms host before its 0.12 ms kernel) costs 0.12 ms back to back, though
    timed serially it looked as slow as the replay with its output copy (0.22 ms)."""
    from fusebackend.runtime import payoff

    trial = payoff.CaptureTrial()
    for _ in range(payoff.TRIAL_CALLS):
        trial.add(True, 0.02e-3, 0.22e-3)  # replay + copy: device-bound
        trial.add(False, 0.10e-3, 0.12e-3)  # direct: host 0.10, kernel 0.12
    assert trial.cost(True) == pytest.approx(0.22e-3)
    assert trial.cost(False) == pytest.approx(0.12e-3)
    keep, why = trial.verdict()
    assert not keep
    assert why == "uncaptured: replay + output copy 0.220 ms > direct 0.120 ms"

    host_bound = payoff.CaptureTrial()
    for _ in range(payoff.TRIAL_CALLS):
        host_bound.add(True, 0.05e-3, 0.30e-3)
        host_bound.add(False, 2.0e-3, 0.25e-3)  # thousands of launches: the host decides
    assert host_bound.verdict()[0] is True


def test_a_trial_primes_each_call_past_the_host_time_of_its_kind():
    from fusebackend.runtime import payoff

    trial = payoff.CaptureTrial()
    assert trial.prime_for(True) == 0.0 and trial.prime_for(False) == 0.0
    trial.add(True, 2.0e-3, 0.5e-3)  # the first replay: its host time carries the upload
    trial.add(True, 0.2e-3, 0.5e-3)
    trial.add(False, 1.0e-3, 0.4e-3)
    assert trial.prime_for(True) == pytest.approx(payoff.PRIME_FACTOR * 0.2e-3)  # shortest
    assert trial.prime_for(False) == pytest.approx(payoff.PRIME_FACTOR * 1.0e-3)
    host_bound = payoff.CaptureTrial()
    host_bound.add(False, 1.0, 0.4e-3)
    assert host_bound.prime_for(False) == payoff.MAX_PRIME_S  # capped


def test_the_graph_cache_passes_each_trial_call_its_prime(fake_capture, monkeypatch):
    from fusebackend.runtime import payoff

    primes = []

    def fake_time(fn, device_index, prime_s=0.0):
        primes.append((fn.func.__name__ == "_replay", prime_s))
        return fn(), 1e-3, 1e-3

    monkeypatch.setattr(payoff, "time_call", fake_time)
    cache = make(unfused=_big, fused=_big, device=FAKE_CUDA, cudagraphs=True)
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4)
    for _ in range(1 + 2 * payoff.TRIAL_CALLS):
        cache(x)
    later = [prime for _, prime in primes[2:]]
    assert primes[:2] == [(True, 0.0), (False, 0.0)]
    assert later == [pytest.approx(payoff.PRIME_FACTOR * 1e-3)] * len(later)


def test_a_kept_capture_decision_survives_a_rerecord(fake_capture, monkeypatch):
    """The trial's "capture pays" is kept when a moved static input re-records the entry:
    each trial call synchronizes the host, so it must not run again after every move."""
    from fusebackend.runtime import payoff

    timed = []
    monkeypatch.setattr(
        payoff, "time_call", lambda fn, d, p=0.0: (timed.append(1), (fn(), 1e-4, 1e-4))[1]
    )
    cache = captured(lambda x, w: (x * w,), static={1})
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4)
    w = torch.randn(1)
    for _ in range(1 + 2 * payoff.TRIAL_CALLS):
        cache(x, w)
    assert len(timed) == 2 * payoff.TRIAL_CALLS
    w = torch.randn(1)  # a new address: re-recorded
    for _ in range(3):
        torch.testing.assert_close(cache(x, w)[0], x * w)
    assert stats()["rerecords"] == 1
    assert len(timed) == 2 * payoff.TRIAL_CALLS, "the trial ran again after the re-record"
    assert cache.describe()[0]["decision"].startswith("captured:")


def test_small_outputs_skip_the_trial(fake_capture, monkeypatch):
    from fusebackend.runtime import payoff

    monkeypatch.setattr(
        payoff, "time_call", lambda fn, d, p=0.0: pytest.fail("timed a small graph")
    )
    cache = make(unfused=_big, fused=_big, device=FAKE_CUDA, cudagraphs=True)
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4 - 1)
    for _ in range(4):
        cache(x)
    (row,) = cache.describe()
    assert row["captured"] is True and row["decision"] is None


def test_static_outputs_skip_the_trial(fake_capture, monkeypatch):
    from fusebackend.runtime import payoff

    monkeypatch.setattr(payoff, "time_call", lambda fn, d, p=0.0: pytest.fail("timed"))
    cache = make(unfused=_big, fused=_big, device=FAKE_CUDA, cudagraphs=True, static_outputs=True)
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4)
    for _ in range(4):
        cache(x)
    assert cache.describe()[0]["captured"] is True


def test_graph_replay_entry_uncaptured_by_the_trial_becomes_eager(fake_capture, monkeypatch):
    from fusebackend.runtime import payoff

    def fake_time(fn, device_index, prime_s=0.0):
        return fn(), 0.0, (1.0 if fn.func.__name__ == "_replay" else 0.5)

    monkeypatch.setattr(payoff, "time_call", fake_time)
    cache = make(unfused=_big, fused=None, device=FAKE_CUDA, cudagraphs=True)
    x = torch.randn(payoff.LARGE_OUTPUT_BYTES // 4)
    for _ in range(1 + 2 * payoff.TRIAL_CALLS):
        cache(x)
    (row,) = cache.describe()
    assert row["mode"] == EAGER and not row["captured"]
    assert row["reason"].startswith("graph_replay -> eager: uncaptured: replay + output copy")


# --------------------------------------------------------------------------------- streams


def test_captures_and_evictions_join_the_replay_order(fake_capture, monkeypatch):
    # The failure mode (GPU test: test_runtime_gpu.py::test_capture_on_another_stream_...):
    # thread A replays a graph on s1; thread B, on s2, captures a new signature and evicts
    # A's entry. Unordered, B's capture-time copies and first run queue beside A's replay,
    # and A's freed static buffers are handed to B's allocations on s2 while A's replay has
    # yet to read them. This pins the bookkeeping down: streams are (id, device, type).
    current = {"stream": (7, 0, 1)}
    waits: list[tuple[int, int]] = []
    events: list[FakeEvent] = []

    class FakeStream:
        def __init__(self, data):
            self.id = data[0]

        def wait_stream(self, other):
            waits.append((self.id, other.id))

    class FakeEvent:
        def __init__(self):
            self.stream = None
            self.done = False
            events.append(self)

        def record(self, stream=None):
            self.stream = stream.id if stream is not None else current["stream"][0]

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentStream", lambda index: current["stream"], raising=False
    )
    monkeypatch.setattr(cap, "_stream", FakeStream)
    monkeypatch.setattr(cap, "_new_event", FakeEvent)
    monkeypatch.setattr(cap._CAPTURE, "replay_streams", {})
    monkeypatch.setattr(cap._CAPTURE, "retired", [])
    with monkeypatch.context() as cuda:
        # Built as on a CUDA device: its replays are ordered on device 0, with the fakes above.
        cuda.setattr(torch.cuda, "is_available", lambda: True)
        cache = make(device=FAKE_CUDA, cudagraphs=True, max_graphs=1)
    x, y = torch.randn(3), torch.randn(4)

    cache(x, x)  # stream 7 captures x's entry
    assert waits == [] and cap._CAPTURE.replay_streams[0] == (7, 0, 1)
    current["stream"] = (9, 0, 1)
    cache(x, x)  # stream 9 replays it: waits for 7
    assert waits == [(9, 7)]
    current["stream"] = (11, 0, 1)
    cache(y, y)  # stream 11 captures y's entry, evicting x's
    assert waits == [(9, 7), (11, 9)]  # before its first run, not after the capture
    assert cap._CAPTURE.replay_streams[0] == (11, 0, 1)
    # x's graph is held until an event on the last replay stream (11, after 9) completes.
    (event,) = events
    assert event.stream == 11
    x_graph = fake_capture[0]
    gc.collect()
    assert x_graph() is not None
    event.done = True
    current["stream"] = (9, 0, 1)
    cache(x, x)  # stream 9 captures x again (waits for 11), evicting y: reaps x's old graph
    assert waits[-1] == (9, 11)
    gc.collect()
    assert x_graph() is None
    assert len(cap._CAPTURE.retired) == 1  # y's entry, until its event completes
    cap.release_pools()  # clear_cache: waits for every retired entry, then lets them go
    assert cap._CAPTURE.retired == []


def test_inputs_sharing_a_mutated_storage_keep_the_write_and_see_it():
    """a = base, b = base[1:]: the graph writes through a and reads through b. The first
    call of a signature runs on private copies (validation); cloned one by one, b's copy
    missed a's write (wrong output) and, written back after a's, erased it."""
    table, ids = torch.randn(11, 5), torch.randint(0, 11, (3,))

    def step(ids, table, a, b):
        a.add_(1.0)
        return torch.nn.functional.embedding(ids, table) * 2.0 + b.sum()

    compiled = torch.compile(step, backend="infinifuse", fullgraph=True)
    base, eager_base = torch.zeros(4), torch.zeros(4)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(ids, table, base, base[1:])
            expected = step(ids, table, eager_base, eager_base[1:])
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(base, eager_base)


def test_captured_input_sharing_a_storage_with_a_written_one_is_read_in_place(fake_capture):
    """b = a[1:] while the graph writes a (used in place): a copy of b made before each
    replay missed the graph's own write, so every replay returned stale values."""
    cache = captured(lambda a, b: (a.add_(1), b * 2)[1:], static={0}, mutated={0})
    base, eager_base = torch.zeros(4), torch.zeros(4)
    for _ in range(4):
        (out,) = cache(base, base[1:])
        eager_base.add_(1)
        torch.testing.assert_close(out, eager_base[1:] * 2)
        torch.testing.assert_close(base, eager_base)
    assert stats()["recordings"] == 1


def test_a_static_input_that_moves_now_and_then_stays_in_place(fake_capture):
    """Only consecutive moves stop in-place use: weights or a cache that move once (a new
    StaticCache per generate) and then stay must not be copied on every replay."""
    cache = captured(lambda x, w: (x * w,), static={1})
    x = torch.randn(8)
    for _ in range(5):
        w = torch.randn(8)  # a new address, then two calls at the same one
        for _ in range(2):
            torch.testing.assert_close(cache(x, w)[0], x * w)
    assert stats()["rerecords"] == 4
    assert cache.copied_static == frozenset()


def test_a_cpu_scalar_used_in_place_is_never_captured(fake_capture):
    cache = captured(lambda x, s: (x * s,), static={1})
    x, s = torch.randn(3), torch.tensor(2.0)
    cache(x, s)
    s.fill_(5.0)  # same address: a captured graph would keep 2.0
    torch.testing.assert_close(cache(x, s)[0], x * 5.0)
    assert stats()["recordings"] == 0
    assert "CPU scalar tensor used in place" in one_fallback_reason()


def test_write_back_slices_a_padded_batch_and_copies_0d_tensors_whole():
    from fusebackend.runtime.effects import write_back

    dst_rows, dst_scalar = torch.zeros(2, 3), torch.tensor(0.0)
    padded, scalar = torch.randn(4, 3), torch.tensor(7.0)
    write_back([0, 1], {0: padded, 1: scalar}, (dst_rows, dst_scalar))
    torch.testing.assert_close(dst_rows, padded[:2])
    assert dst_scalar.item() == 7.0


def test_batch_buckets_leave_inputs_sharing_a_written_storage_unpadded():
    """Padding copies each input on its own; base and base[:, 1:] padded apart lost the write
    through one of them (the second write-back erased the first)."""
    cache = GraphCache(
        unfused=lambda a, b: (a.add_(1), b * 2)[1:],
        fused=None,
        config=FusionConfig(batch_buckets=[4]),
        device=None,
        mutated_input_indices=frozenset({0}),
    )
    base, eager_base = torch.zeros(3, 4), torch.zeros(3, 4)
    for _ in range(2):
        (out,) = cache(base, base[:, 1:])
        eager_base.add_(1)
        torch.testing.assert_close(out, eager_base[:, 1:] * 2)
        torch.testing.assert_close(base, eager_base)


def test_a_collected_cache_retires_its_captured_entries(fake_capture, monkeypatch):
    """Entries of a cache that is garbage-collected (Dynamo recompiled, model deleted) go
    through capture.retire like evicted ones: a replay queued on another stream may still
    read their buffers."""
    retired = []
    monkeypatch.setattr(cap, "retire", lambda things, index: retired.append(things))
    cache = captured(lambda x: (x * 2,))
    cache(torch.randn(3))
    graph = fake_capture[0]()
    del cache
    gc.collect()
    assert any(graph is things[0] for things in retired), retired


def test_a_new_signature_holds_at_most_two_copies_of_a_written_input(monkeypatch):
    """Snapshot, fused run's copy, reference run's copy: the snapshot goes once the last
    private copy is made, so a multi-GB KV cache costs two extra copies at most, not three."""
    from fusebackend.runtime import effects as effects_module

    live: list[weakref.ref] = []
    real_clone = effects_module._clone

    def tracked_clone(x):
        copy = real_clone(x)
        live.append(weakref.ref(copy))
        return copy

    monkeypatch.setattr(effects_module, "_clone", tracked_clone)
    peak = [0]

    def step(cache, x):
        gc.collect()
        peak[0] = max(peak[0], sum(ref() is not None for ref in live))
        cache.add_(1)
        return (x * 2,)

    cache = GraphCache(
        unfused=step, fused=step, config=FusionConfig(), device=None,
        mutated_input_indices=frozenset({0}),
    )  # fmt: skip
    kv = torch.zeros(16)
    cache(kv, torch.randn(3))  # fused run, then the validating reference run
    assert kv.tolist() == [1.0] * 16
    assert peak[0] <= 2, peak[0]


# --- validation classes: a class counts as checked once a comparison matched


def test_after_a_mismatch_the_next_shape_of_its_class_is_compared_again():
    """A fused graph that is wrong at one shape may be wrong at the next: a validation class
    counts as checked only once a comparison matched, so each new shape here is compared,
    falls back, and every call returns the unfused graph's result."""
    cache = GraphCache(
        unfused=lambda x, y: (x * y + 1,),
        fused=lambda x, y: (x * y + 1.25,),
        config=FusionConfig(capture_on_call=1),
        device=None,
        name="t",
    )
    g = torch.Generator().manual_seed(3)
    for n in (3, 5, 11):
        x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
        (out,) = cache(x, y)
        torch.testing.assert_close(out, x * y + 1)
        assert cache.mode_for(x, y) == EAGER
    s = stats()
    assert (s["validations"], s["fusion_successes"], s["fusion_fallbacks"]) == (3, 0, 3)
