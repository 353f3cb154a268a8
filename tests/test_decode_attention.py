"""Decode attention from unrepeated K/V: the kernel (kernels/decode_attention.py) equals SDPA
on repeated K/V, and passes/decode_attention.py gives it exactly the decode steps' SDPA
calls of transformers models, whose logits then equal eager's.

Tolerances: fp32 as ``assert_close``'s defaults; fp16 and bf16 as helpers.TOLERANCES. The
kernel rounds only its output to the inputs' dtype (the attention weights go to tf32,
fp16's mantissa, before the product with V), so it is at most an ulp or two from SDPA's
own fp32 math rounded once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FLOAT_DTYPES,
    LaunchRecorder,
    as_triton_sees,
    assert_close,
    repeat_kv,
    tiny_llama_config,
)

import fusebackend
from fusebackend.kernels import arrivals
from fusebackend.kernels import decode_attention as kernel
from fusebackend.kernels.decode_attention import decode_attention


def _sdpa_repeated(q, k, v, mask, scale, groups):
    """What the traced graph computes: transformers' repeat_kv, then SDPA."""
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), mask, scale=scale
    )


def _inputs(dtype, batch, kv_heads, groups, slots, width, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    # q as transformers makes it: a transposed view of [B, T, H, D]
    q = torch.randn(batch, 1, heads, width, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, slots, width, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, width, generator=g).to(dtype)
    if mask_kind is None:
        return q, k, v, None
    if mask_kind == "bool":  # a StaticCache's decode mask: the first slots, shared by heads
        filled = torch.randint(1, slots + 1, (batch,), generator=g)
        mask = torch.arange(slots)[None, :] < filled[:, None]
        return q, k, v, mask[:, None, None, :]
    if mask_kind == "bool-per-head":  # any pattern, rows allowing no key included
        return q, k, v, torch.rand(batch, heads, 1, slots, generator=g) > 0.5
    if mask_kind == "additive":  # [1, 1, 1, S]: broadcast over batch and heads
        mask = torch.randn(1, 1, 1, slots, generator=g)
        mask[..., slots // 2 :] = float("-inf")
        return q, k, v, mask.to(dtype)
    raise ValueError(mask_kind)


CASES = [  # batch, K/V heads, groups, slots, head width
    (1, 4, 8, 176, 64),  # TinyLlama's decode step: 4 K/V heads of 8 queries each
    (2, 3, 1, 7, 17),  # GPT-2-like (no groups), odd width, two batches
    (1, 2, 3, 65, 80),  # a group of 3 and a second key block of one key
    (3, 1, 2, 1, 16),  # one slot
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "bool-per-head", "additive"])
def test_kernel_equals_sdpa_on_repeated_kv(dtype, case, mask_kind):
    # one program per K/V head (1 and 7 slots) or splits of 32 keys (65: 3, 176: 6)
    batch, kv_heads, groups, slots, width = case
    q, k, v, mask = _inputs(dtype, batch, kv_heads, groups, slots, width, mask_kind)
    want = _sdpa_repeated(q, k, v, mask, None, groups)
    got = decode_attention(q, k, v, mask, None, groups, want.stride())
    assert got.stride() == want.stride()
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_long_cache_is_split_and_combined(dtype):
    # 10 blocks of 32 keys, one program each, then the combining kernel; the mask leaves
    # whole splits with no allowed key.
    q, k, v, mask = _inputs(dtype, 2, 2, 4, 300, 64, "bool-per-head", seed=3)
    mask[0, :, :, 100:] = False
    mask[1, 3] = False  # a row that allows no key: 0, as SDPA's safe softmax gives
    plan = kernel._Plan(q, k, v, mask, 0.3, 4, q)
    assert plan.splits == 10 and plan.meta["BLOCKS"] == 1
    want = _sdpa_repeated(q, k, v, mask, 0.3, 4)
    got = decode_attention(q, k, v, mask, 0.3, 4, want.stride())
    assert_close(got, want)
    assert got[1, 3].abs().amax() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_folded_combine_merges_in_the_last_program_and_zeroes_its_counters(monkeypatch, dtype):
    # FOLD_COMBINE: no second launch; the program that counts the last split of its rows
    # merges them. Twice: the second launch must find the counters the first one reset.
    monkeypatch.setattr(kernel, "FOLD_COMBINE", True)
    monkeypatch.setattr(kernel, "_combine_kernel", lambda: pytest.fail("combine launched"))
    q, k, v, mask = _inputs(dtype, 2, 2, 4, 300, 64, "bool-per-head", seed=3)
    mask[0, :, :, 100:] = False  # whole splits with no allowed key
    mask[1, 3] = False  # a row that allows no key: 0
    for scale in (0.3, 0.7):
        want = _sdpa_repeated(q, k, v, mask, scale, 4)
        got = decode_attention(q, k, v, mask, scale, 4, want.stride())
        assert_close(got, want)
        assert got[1, 3].abs().amax() == 0
    assert arrivals._counters[q.device].abs().amax() == 0


@pytest.mark.parametrize("fold", [False, True])
def test_several_blocks_per_split(monkeypatch, fold):
    # more programs than the limit (a large batch): several blocks of keys per program
    monkeypatch.setattr(kernel, "FOLD_COMBINE", fold)
    monkeypatch.setattr(kernel, "_MAX_PROGRAMS", 8)
    q, k, v, mask = _inputs(torch.float32, 2, 3, 1, 700, 16, "bool")
    plan = kernel._Plan(q, k, v, mask, None, 1, q)
    assert plan.splits > 1 and plan.meta["BLOCKS"] > 1
    want = _sdpa_repeated(q, k, v, mask, None, 1)
    assert_close(decode_attention(q, k, v, mask, None, 1, want.stride()), want)


@pytest.mark.parametrize("fold", [False, True])
def test_precompile_warms_the_kernels_the_call_launches(monkeypatch, fold):
    # The warm-up must specialise as the launch does (grid, meta-parameters, ints; each
    # tensor as its dtype and alignment), or the first call compiles the kernels again.
    monkeypatch.setattr(kernel, "FOLD_COMBINE", fold)
    launches, warmups = [], []
    recorder = LaunchRecorder(launches, warmups)
    monkeypatch.setattr(kernel, "_attend_kernel", lambda: recorder)
    monkeypatch.setattr(kernel, "_combine_kernel", lambda: recorder)
    q, k, v, mask = _inputs(torch.float16, 1, 2, 4, 130, 64, "bool")
    # k a view 128 bytes in (aligned), v one 2 bytes in (not)
    k = torch.randn(1, 2, 131 * 64, dtype=torch.float16)[:, :, 64:].view(1, 2, 130, 64)
    v = torch.randn(1, 2, 130 * 64 + 1, dtype=torch.float16)[:, :, 1:].view(1, 2, 130, 64)
    stride = (512, 64, 512, 1)
    decode_attention(q, k, v, mask, None, 4, stride)
    kernel.precompile_decode_attention(q, k, v, mask, None, 4, stride)
    assert len(launches) == len(warmups) == (1 if fold else 2)  # split: attend, then combine

    seen = as_triton_sees
    for (run_args, run_grid, run_meta), (warm_args, warm_grid, warm_meta) in zip(
        launches, warmups, strict=True
    ):
        assert [seen(x) for x in warm_args] == [seen(x) for x in run_args]
        assert (warm_grid, warm_meta) == (run_grid, run_meta)
    assert seen(launches[0][0][2]) == (torch.float16, False)  # the unaligned value view


transformers = pytest.importorskip("transformers")


def _causal_lm(family):
    if family == "llama":
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    import model_zoo  # tests/ is on sys.path (rootdir conftest)

    return model_zoo.build_causal_lm(family)


def _fused_graph() -> torch.fx.Graph:
    return fusebackend.last_report().graphs[-1].runtime._fused.graph  # what runs fused


def _calls(graph: torch.fx.Graph, target) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is target]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3", "gpt2", "gpt_neox"])
def test_decode_steps_attend_through_the_kernel_and_equal_eager(family):
    # Llama, Qwen2, Gemma (heads 16 wide) and Phi-3 (one fused QKV projection) repeat 2 K/V
    # heads for 4 query heads; GPT-2 and GPT-NeoX have one K/V head per query head.
    model = _causal_lm(family)
    config, vocab = model.config, model.config.vocab_size
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    eager_cache = transformers.StaticCache(config=config, max_cache_len=32)
    ids = torch.randint(0, vocab, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        for c in (cache, eager_cache):
            model(input_ids=ids, attention_mask=mask, past_key_values=c)  # eager prefill
        for _ in range(2):
            token = torch.randint(0, vocab, (2, 1))
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            got = compiled(input_ids=token, attention_mask=mask, past_key_values=cache).logits
            want = model(input_ids=token, attention_mask=mask, past_key_values=eager_cache).logits
            assert_close(got, want, rtol=1e-4, atol=1e-4)
    graph = fusebackend.last_report().graphs[-1]
    assert len(graph.decode_attention) == config.num_hidden_layers, graph.decode_attention
    modes = [e["mode"] for e in graph.runtime_modes()]
    assert modes and set(modes) == {"fusion"}, modes  # the fused graph passed validation
    fused = _fused_graph()
    assert not _calls(fused, F.scaled_dot_product_attention)
    assert len(_calls(fused, decode_attention)) == config.num_hidden_layers
    expands = [n for n in fused.nodes if n.target == "expand"]
    assert all(n.meta["example_value"].dim() == 4 for n in expands)  # repeat_kv's are gone
    assert "decode attention reading K/V unrepeated" in str(fusebackend.last_report())


def test_prefill_and_rewrites_false_keep_sdpa():
    model = _causal_lm("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        torch.compile(model, backend="infinifuse", options={"cudagraphs": False})(ids)
        assert fusebackend.last_report().graphs[-1].decode_attention == []  # 6 query rows
        assert _calls(_fused_graph(), F.scaled_dot_product_attention)
        torch._dynamo.reset()
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        model(input_ids=ids, past_key_values=cache)
        compiled = torch.compile(model, backend="infinifuse",
                                 options={"cudagraphs": False, "rewrites": False})  # fmt: skip
        compiled(input_ids=ids[:, :1], past_key_values=cache)
    assert fusebackend.last_report().graphs[-1].decode_attention == []


def test_a_write_between_the_repeat_and_sdpa_keeps_the_copy():
    # repeat_kv copies K/V where it runs; a write to the cache after it must not reach the
    # attention, so the kernel (which reads the cache at SDPA's place) is not used there.
    def fn(q, k, v):
        k_all, v_all = repeat_kv(k, 2), repeat_kv(v, 2)
        k.mul_(3.0)  # after the copy
        return torch.relu(F.scaled_dot_product_attention(q, k_all, v_all) * 2.0 + 1.0)

    q, k, v, _ = _inputs(torch.float32, 1, 2, 2, 9, 16, None)
    want_k = k.clone()
    want = fn(q, want_k, v.clone())
    compiled = torch.compile(fn, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        got = compiled(q, k, v)
    assert_close(got, want)
    assert_close(k, want_k)  # written once
    graph = fusebackend.last_report().graphs[-1]
    assert graph.groups and graph.decode_attention == []  # a fused graph, without the kernel


def test_causal_calls_keep_sdpa():
    # is_causal with one query row allows the first key only (SDPA aligns it top left)
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    q, k, v, _ = _inputs(torch.float32, 1, 2, 1, 9, 16, None)
    compiled = torch.compile(fn, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        assert_close(compiled(q, k, v), fn(q, k, v))
    assert fusebackend.last_report().graphs[-1].decode_attention == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slots", [176, 4096])
@pytest.mark.parametrize("fold", [False, True])
def test_kernel_on_the_gpu_in_a_cuda_graph(monkeypatch, dtype, slots, fold):
    # TinyLlama's step (4 K/V heads of 8 queries, 64 wide): split 6 ways at 176 slots, 32 at
    # 4096; with FOLD_COMBINE the last program of each K/V head merges (replayed 3 times:
    # each replay must find the counters zeroed and every split's partials visible)
    monkeypatch.setattr(kernel, "FOLD_COMBINE", fold)
    q, k, v, mask = (t.cuda() for t in _inputs(dtype, 1, 4, 8, slots, 64, "bool"))
    want = _sdpa_repeated(q, k, v, mask, None, 8)
    out = decode_attention(q, k, v, mask, None, 8, want.stride())  # compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, mask, None, 8, want.stride())
    for _ in range(3):
        k.copy_(torch.randn_like(k))  # new values in place: the replay reads them
        want = _sdpa_repeated(q, k, v, mask, None, 8)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, want)


def test_launches_alike_are_precompiled_once(monkeypatch):
    # 22 layers launch the same kernels on tensors of one layout: one warm-up each, and one
    # more for a launch Triton would specialise otherwise (an unaligned view).
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fusebackend.fusion as fusion

    jobs = []
    monkeypatch.setattr(fusion, "precompile_all", lambda js: jobs.extend(js) or 0)
    graph = torch.fx.Graph()
    with FakeTensorMode():
        q = torch.empty(1, 8, 1, 64, device="cuda", dtype=torch.float16)
        kv = torch.empty(2 * 48 * 64 + 1, device="cuda", dtype=torch.float16)
        layout = ((1, 2, 48, 64), (2 * 48 * 64, 48 * 64, 64, 1))
        aligned, unaligned = kv.as_strided(*layout, 0), kv.as_strided(*layout, 1)
        for cache in [aligned] * 22 + [unaligned]:
            args = []
            for name, value in (("q", q), ("k", cache), ("v", aligned)):
                node = graph.placeholder(f"{name}{len(graph.nodes)}")
                node.meta["example_value"] = value
                args.append(node)
            graph.call_function(decode_attention, (*args, None, None, 4, q.stride()))
    fusion.precompile(graph)
    assert len(jobs) == 2
