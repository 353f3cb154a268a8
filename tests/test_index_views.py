"""Indexing by constant aranges read as a reshape (passes/index_views.py), and the padded
attention mask it lets one group build.

transformers' mask functions index the padding mask by broadcast aranges; at static shapes
those fold into constants and the gather stopped the mask's group. Each test compares with
eager at odd sizes and proves the rewrite (the report's ``arange_indices``) and the group, or,
where the indices are not a reshape, that the gather stays.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TritonCompiles, assert_close, check, eager, run_fused, single_group

import fusebackend


def _graph(report):
    return report.graphs[-1]


def _padding_mask(attention_mask, q, k, v):
    """transformers 5.x's bidirectional padding mask (``masking_utils``, no vmap), passed to
    two attention calls as two encoder layers do."""
    b, length = attention_mask.shape
    batch_idx = torch.arange(b)[:, None, None, None]
    kv_idx = torch.arange(length)[None, None, None, :]
    q_idx = torch.arange(length)[None, None, :, None]
    padding = attention_mask.to(dtype=torch.bool)[batch_idx, kv_idx]
    mask = (q_idx >= 0) & padding
    mask = mask.expand(b, -1, length, length)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(x + q, k, v, attn_mask=mask)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_padded_encoder_mask_is_one_kernel_and_made_additive_once(batch, dtype):
    torch.manual_seed(0)
    length = 7
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[-1, 4:] = 0  # the last sequence padded
    q, k, v = (torch.randn(batch, 3, length, 16).to(dtype) for _ in range(3))
    report = check(_padding_mask, attention_mask, q, k, v)
    graph = _graph(report)
    assert len(graph.rewrites["arange_indices"]) == 1, str(report)
    assert graph.shared_masks and graph.shared_masks[0].endswith("(2 calls)"), str(report)
    group = single_group(report)  # the cast, the &, the conversion (where, cast): one kernel
    assert len(group.nodes) == 4 and any("where" in n for n in group.nodes), str(report)
    assert graph.rewrites["identity_slices"], str(report)  # the expand to the mask's own shape


def _swapped(x):
    """``x[i, j]`` with dim 0's arange along axis 1 and dim 1's along axis 0: ``x.t()``, a
    transpose, not a reshape."""
    rows, cols = x.shape
    i = torch.arange(rows)[None, :]
    j = torch.arange(cols)[:, None]
    return x[i, j] * 2 + 1


def _partial(x):
    """An arange that stops one short of its dim: a slice, not every element."""
    rows, cols = x.shape
    return x[torch.arange(rows)[:, None], torch.arange(cols - 1)[None, :]] * 2 + 1


def _reversed(x):
    rows, cols = x.shape
    return x[torch.arange(rows)[:, None], torch.arange(cols).flip(0)[None, :]] * 2 + 1


@pytest.mark.parametrize("fn", [_swapped, _partial, _reversed], ids=lambda f: f.__name__)
def test_indices_that_are_not_a_reshape_stay_a_gather(fn):
    x = torch.randn(5, 6)
    expected = eager(fn, x)
    torch._dynamo.reset()
    actual, report = run_fused(fn, x, expect_fused=False)
    assert_close(actual, expected)
    assert _graph(report).rewrites.get("arange_indices", []) == [], str(report)


def test_an_indexed_tensor_written_in_place_keeps_its_gather():
    def gather_then_write(x):
        rows, cols = x.shape
        picked = x[torch.arange(rows)[:, None], torch.arange(cols)[None, :]]
        x.mul_(3)  # a reshape would now read the tripled values
        return picked * 2 + 1

    x = torch.randn(4, 5)
    expected_x = x.clone()
    expected = eager(gather_then_write, expected_x)
    torch._dynamo.reset()
    actual, report = run_fused(gather_then_write, x, expect_fused=False)
    assert_close(actual, expected)
    assert_close(x, expected_x)
    assert _graph(report).rewrites.get("arange_indices", []) == [], str(report)


def _left_padded_causal(attention_mask, q, k, v):
    """A causal mask with left padding: the padding positions' query rows allow no key."""
    b, length = attention_mask.shape
    batch_idx = torch.arange(b)[:, None, None, None]
    kv_idx = torch.arange(length)[None, None, None, :]
    q_idx = torch.arange(length)[None, None, :, None]
    mask = (kv_idx <= q_idx) & attention_mask.to(dtype=torch.bool)[batch_idx, kv_idx]
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(x, k, v, attn_mask=mask)


def test_rows_that_allow_no_key_give_zero_as_with_the_boolean_mask():
    torch.manual_seed(0)
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding: rows 0 and 1 of sequence 1 see no key
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    expected = eager(_left_padded_causal, attention_mask, q, k, v)
    report = check(_left_padded_causal, attention_mask, q, k, v)
    assert expected[1, :, :2].abs().amax() == 0  # SDPA's convention for such rows
    assert _graph(report).shared_masks, str(report)


def test_single_queries_of_new_lengths_reuse_the_mask_kernel_s_binary():
    # A query encoder meets a new length at most calls (static shapes: a signature each).
    # The mask's group is as wide as the sequence; its launches share one launch config (a
    # Triton binary) across lengths up to 64, at most two binaries with Triton's
    # specialisation of sizes by divisibility by 16 (counted by its own rules).
    torch.manual_seed(0)
    compiled = torch.compile(_padding_mask, backend="infinifuse", dynamic=False)
    with torch.no_grad(), TritonCompiles() as compiles:
        for length in (3, 5, 9, 16, 17, 33, 47, 64):  # (Dynamo recompiles up to 8 times)
            attention_mask = torch.ones(1, length, dtype=torch.long)
            q, k, v = (torch.randn(1, 2, length, 8, dtype=torch.float16) for _ in range(3))
            assert_close(compiled(attention_mask, q, k, v), _padding_mask(attention_mask, q, k, v))
    masks = {grp.kernel_name for grp in fusebackend.reports().groups}
    launches = [key for key in compiles.keys if key[0] in masks]
    configs = {(key[0], key[1][-4:], key[2]) for key in launches}
    assert len(launches) >= 8 and len(configs) == 1, sorted(configs)
    assert len(set(launches)) <= 2, sorted(set(launches))
