"""Buckets for masked encoders: ``length_buckets`` pads the sequence dim of the
ids, mask and token types up to a bucket (mask 0, pad id 0) and slices the outputs back;
each bucket's first call is checked against the unpadded run. And ``batch_buckets`` on a
transformers ``BertModel`` whatever its first batch (a graph Dynamo traced for one batch
size, or one length, is never padded).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, rand_ids, rand_table

import fusebackend
from fusebackend.config import FusionConfig
from fusebackend.runtime.graph_cache import GraphCache

V, D = 40, 16


def masked_mean(ids, mask, table):
    """A masked encoder in small: per-token states [B, T, D] and a masked mean [B, D]."""
    h = F.embedding(ids, table) * 2.0 + 1.0
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m, (h * m).sum(1) / m.sum(1))


def unmasked_mean(ids, mask, table):
    return (F.embedding(ids, table).mean(1),)  # the padded positions count: wrong when padded


def cache_of(fn, **options) -> GraphCache:
    return GraphCache(
        unfused=fn,
        fused=None,
        config=FusionConfig(**options),
        device=None,
        static_input_indices=frozenset({2}),
        name="lengths",
    )


def inputs(batch: int, length: int, dtype=torch.int64):
    ids = rand_ids(V, (batch, length)).to(dtype)
    mask = torch.ones(batch, length, dtype=dtype)
    mask[0, length // 2 :] = 0  # a padded sentence, as a tokenizer gives
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lengths_share_their_bucket_and_equal_the_unpadded_run(dtype):
    table = rand_table(V, D)
    cache = cache_of(masked_mean, length_buckets=[8, 16, 32])
    for length in (5, 7, 8, 9, 12, 16, 20, 31, 40):
        ids, mask = inputs(3, length, dtype)
        out = cache(ids, mask, table)
        assert_close(out, masked_mean(ids, mask, table))
        assert out[0].shape == (3, length, D)  # sliced back along dim 1
    s = fusebackend.stats()
    # 5 and 7 share bucket 8, 9-16 bucket 16, 20 and 31 bucket 32; 40 is above the largest
    assert sorted({shape[0][1] for shape in s["cached_shapes"]}) == [8, 16, 32, 40]
    assert s["cache_size"] == 4 and s["ignored_options"] == {}


def test_an_output_whose_dim_1_only_equals_the_bucket_is_not_sliced():
    """A pooled [B, H] output with H equal to a bucket (a hidden size of 16) keeps its H:
    only outputs whose dim 1 was the length in the unpadded run are sliced."""
    table = rand_table(V, 16)
    cache = cache_of(masked_mean, length_buckets=[16, 32])
    ids, mask = inputs(2, 10)
    for _ in range(2):  # the checked first call, then a plain one
        pooled = cache(ids, mask, table)[1]
        assert pooled.shape == (2, 16)
        assert_close(pooled, masked_mean(ids, mask, table)[1])
    s = fusebackend.stats()
    assert s["ignored_options"] == {}  # the bucket is used: the check passed
    assert s["cached_shapes"] == [((2, 16), (2, 16))]  # padded to 16


def test_a_model_that_sees_its_padding_keeps_the_bucket_unpadded_with_the_reason():
    table = rand_table(V, D)
    cache = cache_of(unmasked_mean, length_buckets=[16])
    for length in (5, 9, 5):
        ids, mask = inputs(2, length)
        assert_close(cache(ids, mask, table), unmasked_mean(ids, mask, table))
    s = fusebackend.stats()
    (reasons,) = s["ignored_options"].values()
    assert len(reasons) == 1  # reported once, at the bucket's first call
    assert "length_buckets: bucket 16 is not used" in reasons[0]
    assert "differs from the unpadded run" in reasons[0]
    assert sorted(shape[0][1] for shape in s["cached_shapes"]) == [5, 9]  # unpadded


def test_length_buckets_without_ids_or_on_a_writing_graph_are_reported():
    plain = cache_of(lambda x, y, t: (x * 2,), length_buckets=[8])
    plain(torch.randn(2, 3), torch.randn(2, 3), torch.randn(1))
    (why,) = plain.ignored_options
    assert why.startswith("length_buckets=[8] has no effect") and "input_ids" in why

    def writes(ids, mask, table):
        mask.add_(0)
        return (ids * 2,)

    writing = GraphCache(unfused=writes, fused=None, config=FusionConfig(length_buckets=[8]),
                         device=None, mutated_input_indices=frozenset({1}))  # fmt: skip
    ids, mask = inputs(2, 5)
    assert_close(writing(ids, mask, None)[0], ids * 2)
    (why,) = writing.ignored_options
    assert "writes its inputs in place" in why


# --------------------------------------------------------------- transformers BertModel

transformers = pytest.importorskip("transformers")


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.BertModel(config).eval()


def bert_inputs(batch: int, length: int, token_types: bool = True) -> dict[str, torch.Tensor]:
    ids, mask = inputs(batch, length)
    ids = ids.clamp(min=1)  # id 0 is BERT's [PAD]
    out = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        out["token_type_ids"] = torch.zeros_like(ids)
    return out


def assert_bert_close(compiled, model, kwargs) -> None:
    with torch.no_grad():
        out, ref = compiled(**kwargs), model(**kwargs)
    assert_close(out.last_hidden_state, ref.last_hidden_state)
    assert_close(out.pooler_output, ref.pooler_output)


@pytest.mark.parametrize("dynamic", [None, True], ids=["recompiles", "dynamic"])
def test_bert_length_buckets_equal_eager(dynamic):
    """dynamic=None: Dynamo's first graph is static in the length (runs unpadded); the
    recompile makes the length dynamic, and from then on lengths share their buckets. The
    static graph's entry is dropped once its length goes to the newer graph."""
    model = tiny_bert()
    compiled = torch.compile(
        model, backend="infinifuse", dynamic=dynamic,
        options={"length_buckets": [16, 32, 64], "fusion": False},
    )  # fmt: skip
    for length in (20, 13, 9, 30, 17, 5, 20):
        assert_bert_close(compiled, model, bert_inputs(3, length))
    s = fusebackend.stats()
    assert sorted(shape[0][1] for shape in s["cached_shapes"]) == [16, 32]
    assert s["ignored_options"] == {}
    if dynamic is None:
        assert s["eviction_reasons"] == {"superseded": 1}


def test_bert_length_buckets_with_the_fused_graph():
    model = tiny_bert()
    compiled = torch.compile(
        model, backend="infinifuse", dynamic=True, options={"length_buckets": [16, 32]}
    )
    for length in (9, 13, 20):
        assert_bert_close(compiled, model, bert_inputs(2, length))
    assert fusebackend.last_report().graphs[-1].path == "fused"
    s = fusebackend.stats()
    assert sorted(shape[0][1] for shape in s["cached_shapes"]) == [16, 32]
    assert s["validations"] == 1 and set(s["fusion_modes"].values()) == {"fusion"}


def test_bert_without_an_attention_mask_keeps_its_buckets_unpadded():
    """Without a mask BERT attends to the padding: the check finds it and says so."""
    model = tiny_bert()
    compiled = torch.compile(
        model, backend="infinifuse", dynamic=True,
        options={"length_buckets": [16], "fusion": False},
    )  # fmt: skip
    for length in (9, 12):
        kwargs = bert_inputs(2, length)
        del kwargs["attention_mask"]
        assert_bert_close(compiled, model, kwargs)
    (reasons,) = fusebackend.stats()["ignored_options"].values()
    assert any("bucket 16 is not used" in r for r in reasons), reasons


@pytest.mark.parametrize("token_types", [True, False], ids=["token-types", "no-token-types"])
@pytest.mark.parametrize("first", [1, 2, 3, 4, 5])
def test_bert_batch_buckets_whatever_the_first_batch(first, token_types):
    """The first batch 3 used to fail ("The size of tensor a (4) must match the size of
    tensor b (3)"): Dynamo's first graph has the batch baked in, and the runtime padded it."""
    model = tiny_bert()
    compiled = torch.compile(
        model, backend="infinifuse", options={"batch_buckets": [1, 2, 4], "fusion": False}
    )
    for batch in (first, 2, 3, 4, 5, 3, first):
        assert_bert_close(compiled, model, bert_inputs(batch, 16, token_types))
    s = fusebackend.stats()
    batches = sorted(shape[0][0] for shape in s["cached_shapes"])
    # batch 3 runs padded to 4 in the dynamic graph (unpadded only in a static first graph,
    # dropped once batch 3 goes to the dynamic one), 5 is above the largest bucket
    assert 3 not in batches and {2, 4, 5} <= set(batches)


def test_bert_length_and_batch_buckets_together():
    """A corpus pass: batches of varied size and length share a few padded signatures."""
    model = tiny_bert()
    compiled = torch.compile(
        model, backend="infinifuse",
        options={"length_buckets": [16, 32, 64], "batch_buckets": [1, 2, 4], "fusion": False},
    )  # fmt: skip
    for batch, length in [(3, 20), (2, 13), (3, 9), (4, 30), (3, 5), (3, 20), (2, 13)]:
        assert_bert_close(compiled, model, bert_inputs(batch, length, token_types=False))
    s = fusebackend.stats()
    assert sorted(shape[0] for shape in s["cached_shapes"]) == [(2, 16), (4, 16), (4, 32)]
    assert s["ignored_options"] == {}
