"""GPU tests of the shape-churn runtime: capture on recurrence with real CUDA graphs, the
``graph_memory`` budget against real pool memory, and ``length_buckets`` on a fp16 BERT
through torch.compile. (CPU versions: test_churn.py, test_length_buckets.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

import fusebackend
from fusebackend.config import FusionConfig
from fusebackend.runtime.graph_cache import GraphCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V, D = 1000, 256


@pytest.fixture
def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def embed_norm(ids, table, weight, bias):
    return (F.layer_norm(F.embedding(ids, table) * 2.0, (D,), weight, bias),)


def norm_cache(dev, **options) -> GraphCache:
    return GraphCache(
        unfused=embed_norm,
        fused=embed_norm,
        config=FusionConfig(**options),
        device=dev,
        static_input_indices=frozenset({1, 2, 3}),
        name="churn",
    )


def weights(dev, dtype=torch.float16):
    return (
        torch.randn(V, D, device=dev, dtype=dtype),
        torch.randn(D, device=dev, dtype=dtype),
        torch.randn(D, device=dev, dtype=dtype),
    )


def counts(*names):
    s = fusebackend.stats()
    return tuple(s[n] for n in names)


@pytest.mark.gpu
def test_sixty_lengths_captured_once_each_on_their_second_call(dev):
    table, w, b = weights(dev)
    cache = norm_cache(dev)
    per_round = []
    for _ in range(3):
        before = counts("recordings", "validations", "cache_misses")
        for n in range(3, 63):
            ids = torch.randint(0, V, (4, n), device=dev)
            assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
        after = counts("recordings", "validations", "cache_misses")
        per_round.append(tuple(a - c for a, c in zip(after, before, strict=True)))
    assert per_round == [(0, 1, 60), (60, 0, 0), (0, 0, 0)]
    s = fusebackend.stats()
    assert s["evictions"] == 0 and s["cache_size"] == 60
    assert 0 < s["captured_bytes"] <= FusionConfig().graph_memory
    assert s["graph_pool_bytes"] > 0
    assert all(row["captured"] for row in cache.describe())


@pytest.mark.gpu
def test_graph_memory_bounds_real_captures(dev):
    """Each entry holds its ids buffer and a [4, n, 256] fp16 output: about 2 KiB per row of
    n. A 64 KiB budget keeps a handful; evictions name the cause; results stay right."""
    table, w, b = weights(dev)
    budget = 64 << 10
    cache = norm_cache(dev, graph_memory=budget, capture_on_call=1)
    for _ in range(2):
        for n in range(3, 23):
            ids = torch.randint(0, V, (4, n), device=dev)
            assert_close(cache(ids, table, w, b)[0], embed_norm(ids, table, w, b)[0])
            assert fusebackend.stats()["captured_bytes"] <= budget
    s = fusebackend.stats()
    assert s["eviction_reasons"].get("graph_memory", 0) > 0
    assert set(s["eviction_reasons"]) == {"graph_memory"}


@pytest.mark.gpu
def test_bert_fp16_length_buckets_equal_eager_and_stop_capturing(dev):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=V, hidden_size=384, num_hidden_layers=2, num_attention_heads=6,
        intermediate_size=1536, max_position_embeddings=512,
    )  # fmt: skip
    model = transformers.BertModel(config).to(dev, torch.float16).eval()
    compiled = torch.compile(
        model, backend="infinifuse", options={"length_buckets": [16, 32, 64, 128]}
    )
    lengths = [81, 70, 39, 9, 17, 33, 5, 64, 100, 12]
    recordings = []
    for _ in range(3):
        with torch.no_grad():
            for n in lengths:
                ids = torch.randint(1, V, (8, n), device=dev)
                mask = torch.ones_like(ids)
                mask[0, n // 2 :] = 0
                out = compiled(input_ids=ids, attention_mask=mask)
                ref = model(input_ids=ids, attention_mask=mask)
                assert_close(out.last_hidden_state, ref.last_hidden_state, atol=2e-2, rtol=2e-2)
        recordings.append(fusebackend.stats()["recordings"])
    assert recordings[2] == recordings[1]  # a third pass captures nothing
    s = fusebackend.stats()
    assert s["ignored_options"] == {}
    # the dynamic graph's entries are the buckets (the static first graph's one superseded)
    assert {shape[0][1] for shape in s["cached_shapes"]} <= {16, 32, 64, 128}
