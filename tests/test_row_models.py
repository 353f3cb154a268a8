"""Real model code: tiny transformers Llama and BERT (random weights, no download, a padded
attention mask) fused equal eager, and their norms run inside fused groups; Mamba's scan."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, eager, run_fused, tiny_llama_config

transformers = pytest.importorskip("transformers")


def _norm_groups(report) -> int:
    return sum(1 for g in report.groups if g.reductions)


def test_tiny_llama_equals_eager_with_norms_fused():
    torch.manual_seed(0)
    config = tiny_llama_config()
    model = transformers.LlamaModel(config).eval()
    ids = torch.randint(0, 97, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding on the second row

    def fn(ids, mask):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    expected = eager(fn, ids, mask)
    # 14 rows: matmul groups would take the norms (tests/test_matmul_groups.py); the row
    # kernels are what this test checks
    actual, report = run_fused(fn, ids, mask, options={"matmul_groups": False})
    assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # 2 layers x 2 RMSNorms + the final norm; the first one shares the lookup's kernel
    assert _norm_groups(report) >= 5, str(report)
    assert any(g.lookups and g.reductions for g in report.groups), str(report)
    # rotary embeddings: q and k of each layer, one kernel (4 query heads, 2 kv heads), and
    # q's and k's groups of a layer run by one launch of it
    rope = {g.name: g for g in report.groups if "rotate(" in g.source}
    assert len(rope) == 2 * 2, str(report)
    assert all(rope.get(g.launched_with) for g in rope.values()), str(report)
    assert "one launch each: " in str(report)


def test_tiny_bert_equals_eager_with_layer_norms_fused():
    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, 101, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0  # right padding on the first row

    def fn(ids, mask):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    expected = eager(fn, ids, mask)
    actual, report = run_fused(fn, ids, mask)
    assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # the embeddings' LayerNorm with its three lookups, and 2 per layer after a residual add
    assert _norm_groups(report) >= 5, str(report)
    embeddings = [g for g in report.groups if len(g.lookups) >= 2 and g.reductions]
    assert embeddings, str(report)


def test_more_layers_compile_no_more_distinct_kernels():
    # The kernel cache key is the canonical program (no node names): layers 3 and 4 reuse
    # the kernels of layer 2, so a 4-layer model has the 2-layer model's distinct kernels.
    def distinct_kernels(layers: int) -> tuple[int, set[str]]:
        torch.manual_seed(2)
        config = tiny_llama_config(layers)
        model = transformers.LlamaModel(config).eval()
        ids = torch.randint(0, 97, (1, 5))
        # matmul groups off: with them, 5 rows leave no per-layer row kernel (each layer's
        # norms and RoPE go into its matmul launches)
        _, report = run_fused(lambda ids: model(input_ids=ids).last_hidden_state, ids,
                              options={"matmul_groups": False})  # fmt: skip
        return len(report.groups), {g.kernel_name for g in report.groups}

    groups2, kernels2 = distinct_kernels(2)
    groups4, kernels4 = distinct_kernels(4)
    assert groups4 > groups2  # more groups ...
    assert kernels4 == kernels2  # ... the same kernels


def test_tiny_mamba_runs_fused_equal_eager():
    # transformers' Mamba scan (5.24 on the CPU: associative_scan, whose generic mode Dynamo
    # inlines as a torch.vmap) once put batched tensors into a group, and every fused run
    # raised and fell back: the scan's ops now stay out of groups (fx_util.vmapped_nodes)
    import fusebackend

    torch.manual_seed(4)
    config = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, state_size=4,
                                      vocab_size=97, intermediate_size=64)  # fmt: skip
    model = transformers.MambaModel(config).eval()
    ids = torch.randint(0, 97, (2, 7))

    def fn(ids):
        return model(input_ids=ids).last_hidden_state

    out, report = run_fused(fn, ids)
    assert_close(out, eager(fn, ids))
    assert fusebackend.stats()["fallback_reasons"] == {}, str(report)
    assert [e["mode"] for e in report.graphs[-1].runtime_modes()] == ["fusion"], str(report)


def test_tiny_bamba_runs_fused_equal_eager():
    # Bamba (Mamba-2 layers, a padded mask): with no attention layer nobody reads the causal
    # mask's group (a cast and an and); the copy-folding pass's dead-code elimination erased
    # it, and the pass then read the erased node's arguments (None): the graph ran unfused
    import fusebackend

    torch.manual_seed(5)
    config = transformers.BambaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=97, mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=16, mamba_chunk_size=16, use_cache=False,
    )  # fmt: skip
    model = transformers.BambaModel(config).eval()
    ids = torch.randint(2, 97, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, -3:] = 0

    def fn(ids, mask):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    out, report = run_fused(fn, ids, mask)
    assert_close(out, eager(fn, ids, mask))
    assert all(g.path == "fused" for g in report.graphs), str(report)
    assert fusebackend.stats()["fallback_reasons"] == {}, str(report)
