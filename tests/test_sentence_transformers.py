"""sentence-transformers with the inner transformers model compiled by infinifuse .

A tiny BertModel (2 layers, hidden 32, random weights) from a config, with a WordPiece tokenizer
built here from a vocab file (nothing is downloaded), under
``SentenceTransformer(modules=[Transformer(dir), Pooling(32, "mean")])``; the inner model's
forward is compiled in place, as examples/sentence_embeddings.py does::

    hf = st[0].auto_model
    hf.forward = torch.compile(hf.forward, backend="infinifuse")

(sentence-transformers 6 calls ``auto_model.forward`` directly, so ``auto_model.compile()``
would not take effect.) On the CPU tests/conftest.py sets TRITON_INTERPRET=1: the fused groups'
Triton kernels really run, in the interpreter, so the model and the 40 sentences (2-24 words)
are small. Without sentence-transformers the tests skip, except in CI (``CI=true``), where the
test extra installs it.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import fusebackend

LAYERS, HIDDEN = 2, 32
SYLLABLES = [c + v for c in "bdgklmnprst" for v in "aeiou"]  # 55
# LayerNorm of hidden states of unit scale in fp32: the fused kernels and eager reduce in a
# different order, so results differ by rounding only; torch.testing's fp32 defaults.
RTOL, ATOL = 1.3e-6, 1e-5


def _sentence_transformers():
    try:
        import sentence_transformers
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail('sentence-transformers is missing in CI: .ci/run installs ".[test]"')
        pytest.skip('needs sentence-transformers: pip install -e ".[test]"')
    return sentence_transformers


def _words() -> list[str]:
    rng = random.Random(1)
    return sorted({"".join(rng.choices(SYLLABLES, k=rng.choice((1, 2, 3)))) for _ in range(400)})


def _sentences(n: int = 40, seed: int = 0) -> list[str]:
    """``n`` sentences of 2-24 pseudo-words (varied lengths, so varied padded shapes)."""
    rng = random.Random(seed)
    words = _words()
    lengths = [2, 24] + [rng.randint(2, 24) for _ in range(n - 2)]
    return [" ".join(rng.choices(words, k=k)) + "." for k in lengths]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    _sentence_transformers()
    import transformers

    directory = tmp_path_factory.mktemp("tiny_bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
    vocab += SYLLABLES + ["##" + s for s in SYLLABLES]  # any pseudo-word splits into these
    vocab += [w for w in _words()[::2] if w not in vocab]  # half the words are whole tokens
    # transformers 5 takes vocab= (vocab_file= is ignored there: every word would be [UNK])
    tokenizer = transformers.BertTokenizerFast(
        vocab={t: i for i, t in enumerate(vocab)}, model_max_length=128
    )
    assert len(tokenizer.get_vocab()) == len(vocab)
    tokenizer.save_pretrained(directory)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(directory)
    return str(directory)


def _load(model_dir: str):
    st = _sentence_transformers()
    try:  # 6.x (sentence_transformers.models, the older spelling, warns there)
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer

    modules = [Transformer(model_dir), Pooling(HIDDEN, "mean")]
    return st.SentenceTransformer(modules=modules, device="cpu").eval()


def _compile_inner(model, options=None) -> None:
    hf = model[0].auto_model
    hf.forward = torch.compile(hf.forward, backend="infinifuse", options=options)


def _encode(model, sentences: list[str], batch_size: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.as_tensor(model.encode(sentences, batch_size=batch_size))


@pytest.mark.parametrize("batch_size", [1, 8])
def test_embeddings_equal_eager_and_groups_fuse(model_dir, batch_size):
    sentences = _sentences()
    model = _load(model_dir)
    expected = _encode(model, sentences, batch_size)  # eager: nothing compiled yet
    _compile_inner(model)
    got = _encode(model, sentences, batch_size)

    ids = model.tokenizer(sentences)["input_ids"]  # the words really are split, not [UNK]
    assert all(model.tokenizer.unk_token_id not in row for row in ids)
    assert got.shape == (40, HIDDEN)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    stats = fusebackend.stats()
    # Every padded shape ran through infinifuse, fused, with nothing falling back.
    lengths = {len(model.tokenizer(s)["input_ids"]) for s in sentences}
    assert stats["cache_misses"] >= (len(lengths) if batch_size == 1 else 2), stats
    assert stats["fusion_successes"] == stats["fusion_attempts"] >= 2, stats
    assert stats["fusion_fallbacks"] == 0, stats["fallback_reasons"]
    assert set(stats["fusion_modes"].values()) == {"fusion"}, stats["fusion_modes"]
    # The report of the last graph Dynamo made (after its recompile for new lengths): BERT's
    # three lookups + LayerNorm in one group, then each layer's two residual add + LayerNorm.
    report = fusebackend.last_report()
    groups = report.groups
    assert len(groups) >= 1 + 2 * LAYERS, str(report)
    lookups = [g for g in groups if len(g.lookups) == 3]
    assert len(lookups) == 1, str(report)
    assert all(g.backend == "triton" for g in groups), str(report)
    # that graph's lengths are dynamic: each layer's attention runs with cuDNN's kernel off
    # (no execution plan per new length on a GPU)
    assert len(report.graphs[-1].cudnn_free_attention) == LAYERS, str(report)


def test_second_pass_adds_no_entry_and_no_capture(model_dir):
    """No re-capture on a second pass, on the CPU (where nothing is captured,
    each new cache entry stands for a capture on a GPU).

    Dynamo compiles the first (longest) batch's length statically, then recompiles with a
    dynamic length for the next: on the second pass the first length goes to the newer
    graph, which routes it to the static graph's entry (frames.route): nothing is new,
    nothing evicted or superseded, nothing captured, and from the third pass every batch
    hits."""
    sentences = _sentences()
    model = _load(model_dir)
    _compile_inner(model)
    _encode(model, sentences, 8)
    first = fusebackend.stats()
    _encode(model, sentences, 8)
    second = fusebackend.stats()
    third_out = _encode(model, sentences, 8)
    third = fusebackend.stats()

    batches = -(-len(sentences) // 8)
    assert first["cache_misses"] >= 2 and first["evictions"] == 0, first
    # second pass: the statically compiled length is routed to its graph; nothing is new
    assert second["cache_misses"] == first["cache_misses"], (first, second)
    assert second["older_graph_calls"] > first["older_graph_calls"], (first, second)
    assert second["evictions"] == 0, second["eviction_reasons"]
    assert second["cache_size"] == first["cache_size"], (first, second)
    assert second["recordings"] == first["recordings"], (first, second)
    # third pass: every batch's signature has its entry
    assert third["cache_misses"] == second["cache_misses"], (second, third)
    assert third["cache_hits"] - second["cache_hits"] == batches, (second, third)
    assert third["cache_size"] == second["cache_size"], (second, third)
    assert third["evictions"] == second["evictions"], third["eviction_reasons"]
    assert third["recordings"] == first["recordings"] and third["capture_failures"] == 0, third
    assert set(third["fusion_modes"].values()) == {"fusion"}, third["fusion_modes"]
    torch.testing.assert_close(third_out, _encode_eager(model, sentences, 8), rtol=RTOL, atol=ATOL)


def _encode_eager(model, sentences: list[str], batch_size: int) -> torch.Tensor:
    hf = model[0].auto_model
    compiled = vars(hf).pop("forward")  # the class's forward again
    try:
        return _encode(model, sentences, batch_size)
    finally:
        hf.forward = compiled
