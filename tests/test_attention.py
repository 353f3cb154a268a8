"""Attention rewrites (passes/attention.py). A boolean mask that several SDPA calls pass
is made additive once, and a mask uniform along the keys is dropped, both equal to
eager; grouped-query attention (transformers' repeat_kv + SDPA) is left to the decode
attention kernel (tests/test_decode_attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FLOAT_DTYPES, assert_close, eager, repeat_kv, tiny_llama_config

import fusebackend
from fusebackend.passes.fx_util import example_value

transformers = pytest.importorskip("transformers")


def _attention(q, k, v, mask):
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask, dropout_p=0.0, scale=0.3
    )


def _inputs(dtype, rows, mask_kind, heads=6, kv_heads=2, length=9, g=None):
    g = g or torch.Generator().manual_seed(rows)
    q = torch.randn(2, heads, rows, 16, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, length, 16, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, length, 16, generator=g).to(dtype)
    allowed = torch.ones(2, 1, rows, length, dtype=torch.bool)
    allowed[1, :, :, :3] = False  # left padding in the second sequence
    for t in range(rows):  # and causal rows, each different
        allowed[:, :, t, length - rows + t + 1 :] = False
    if mask_kind == "bool":
        mask = allowed
    elif mask_kind == "float":
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
    else:
        mask = None
    return q, k, v, mask


def _captured_on_the_gpu(fn, *args):
    """Compile ``fn`` with CUDA graphs, call it three times (capture, then replays); return
    the last output and the graph's report, asserting that no signature ran uncaptured."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            actual = compiled(*args)
    graph = fusebackend.last_report().graphs[-1]
    modes = [e["mode"] for e in graph.runtime_modes()]
    assert modes and "eager" not in modes, modes  # captured in a CUDA graph
    return actual, graph


def _compiled(fn, *args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        out = compiled(*args)
    return out, fusebackend.last_report().graphs[-1]


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_grouped_query_attention_equals_eager(dtype, rows, mask_kind):
    args = _inputs(dtype, rows, mask_kind)
    expected = eager(_attention, *args)
    actual, _ = _compiled(_attention, *args)
    assert_close(actual, expected)


def _layers(q, k, v, mask):
    """Three layers' attention passing one boolean mask, as a decoder's layers do."""
    x = q
    for scale in (0.3, 0.2, 0.25):
        x = F.scaled_dot_product_attention(x, k, v, attn_mask=mask, scale=scale) + q
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_one_bool_mask_for_several_calls_is_made_additive_once(dtype):
    q, k, v, mask = _inputs(dtype, 1, "bool", heads=3, kv_heads=3, length=11)
    mask[0, 0, 0, 5:7] = False  # a hole in the middle too: the conversion keeps every key
    actual, graph = _compiled(_layers, q, k, v, mask)
    assert_close(actual, eager(_layers, q, k, v, mask))
    assert graph.shared_masks == ["l_mask_ (3 calls)"], graph.shared_masks
    assert "boolean attention masks made additive once: l_mask_ (3 calls)" in str(
        fusebackend.last_report()
    )


def test_shared_mask_and_grouped_queries_together_in_a_decode_step():
    def grouped_layers(q, k, v, mask):
        return _attention(q, k, v, mask) + _attention(q * 0.5, k, v, mask)

    args = _inputs(torch.float32, 1, "bool")
    actual, graph = _compiled(grouped_layers, *args)
    assert_close(actual, eager(grouped_layers, *args))
    assert graph.shared_masks == ["l_mask_ (2 calls)"], graph.shared_masks


@pytest.mark.parametrize("layout", ["contiguous", "expanded", "permuted"])
def test_a_shared_mask_s_example_values_have_the_layout_the_ops_give(layout):
    # The conversion's example values must say what where and the cast return, for every
    # mask layout (the runtime allocates its buffers from them).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fusebackend.passes.attention import share_mask_conversion

    q, k, v, _ = _inputs(torch.float16, 1, None, heads=3, kv_heads=3)
    masks = {
        "contiguous": torch.rand(2, 1, 1, 9) > 0.5,
        "expanded": (torch.rand(1, 1, 1, 9) > 0.5).expand(2, 1, 1, 9),
        "permuted": (torch.rand(2, 9, 1) > 0.5).permute(0, 2, 1)[:, :, None],
    }
    mask = masks[layout]
    gm = torch.fx.symbolic_trace(_layers)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        values = [mode.from_tensor(t) for t in (q, k, v, mask)]
        FakeTensorProp(gm, mode).propagate(*values)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    assert share_mask_conversion(gm) == ["mask (3 calls)"]
    additive = torch.where(mask, 0.0, float("-inf"))
    converted = additive.to(torch.float16)
    made = {n.target: n.meta["example_value"] for n in gm.graph.nodes
            if n.target in (torch.where, "to")}  # fmt: skip
    for target, real in ((torch.where, additive), ("to", converted)):
        fake = made[target]
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_a_prefill_mask_is_shared_too_and_single_call_float_and_rewrites_false_stay():
    q, k, v, mask = _inputs(torch.float32, 3, "bool", heads=3, kv_heads=3)
    actual, graph = _compiled(_layers, q, k, v, mask)  # three query rows: a prefill
    assert_close(actual, eager(_layers, q, k, v, mask))
    assert graph.shared_masks == ["l_mask_ (3 calls)"], graph.shared_masks
    q, k, v, mask = _inputs(torch.float32, 1, "bool")
    actual, graph = _compiled(_attention, q, k, v, mask)  # one call
    assert graph.shared_masks == []
    q, k, v, mask = _inputs(torch.float32, 1, "float", heads=3, kv_heads=3)
    actual, graph = _compiled(_layers, q, k, v, mask)  # already additive
    assert_close(actual, eager(_layers, q, k, v, mask))
    assert graph.shared_masks == []
    q, k, v, mask = _inputs(torch.float32, 1, "bool", heads=3, kv_heads=3)
    torch._dynamo.reset()
    compiled = torch.compile(_layers, backend="infinifuse",
                             options={"cudagraphs": False, "rewrites": False})  # fmt: skip
    with torch.no_grad():
        assert_close(compiled(q, k, v, mask), eager(_layers, q, k, v, mask))
    assert fusebackend.last_report().graphs[-1].shared_masks == []


def _uniform_rows(q, k, v, allowed_rows):
    """A mask that allows each query row every key or none, expanded along the keys (stride
    0), as transformers 5.17's traced BERT mask is: twice, as two layers would."""
    b, _, rows, _ = q.shape
    mask = allowed_rows[:, None, :, None].expand(b, 1, rows, k.shape[2])
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    return F.scaled_dot_product_attention(x + q, k, v, attn_mask=mask) * 2


def _one_column(q, k, v, allowed_rows):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_rows[:, None, :, None])


@pytest.mark.parametrize("fn", [_uniform_rows, _one_column], ids=["stride 0", "one column"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_a_mask_uniform_along_the_keys_is_dropped_and_rows_of_no_keys_are_zero(dtype, fn):
    q, k, v, _ = _inputs(dtype, 5, "none", heads=3, kv_heads=3, length=7)
    allowed_rows = torch.ones(2, 5, dtype=torch.bool)
    allowed_rows[1, 3] = False  # a query row that may see no key: SDPA gives 0 there
    expected = eager(fn, q, k, v, allowed_rows)
    actual, graph = _compiled(fn, q, k, v, allowed_rows)
    assert_close(actual, expected)
    assert actual[1, :, 3].abs().amax() == 0 and expected[1, :, 3].abs().amax() == 0
    calls = 2 if fn is _uniform_rows else 1
    assert len(graph.dropped_masks) == calls, graph.dropped_masks
    assert "attention without a mask uniform along the keys" in str(fusebackend.last_report())


def test_masks_that_differ_along_the_keys_are_kept():
    args = _inputs(torch.float32, 3, "bool", heads=3, kv_heads=3)
    actual, graph = _compiled(_layers, *args)
    assert_close(actual, eager(_layers, *args))
    assert graph.dropped_masks == []


def test_llama_decode_step_converts_its_mask_once():
    torch.manual_seed(0)
    config = tiny_llama_config()
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    ids = torch.randint(0, 97, (1, 5))
    mask = torch.ones(1, 5, dtype=torch.long)
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)  # eager prefill
        eager_cache = transformers.StaticCache(config=config, max_cache_len=32)
        model(input_ids=ids, attention_mask=mask, past_key_values=eager_cache)
        token = torch.randint(0, 97, (1, 1))
        mask = torch.ones(1, 6, dtype=torch.long)
        got = compiled(input_ids=token, attention_mask=mask, past_key_values=cache).logits
        want = model(input_ids=token, attention_mask=mask, past_key_values=eager_cache).logits
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    graph = fusebackend.last_report().graphs[-1]
    # every layer passes the one decode mask: converted once for both layers
    assert [m.endswith(f"({config.num_hidden_layers} calls)") for m in graph.shared_masks] == [
        True
    ], graph.shared_masks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 17], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_grouped_queries_on_the_gpu_in_a_cuda_graph(dtype, rows):
    # TinyLlama's grouping: 32 query heads over 4 K/V heads, 64 wide, a 176-slot cache
    args = [t.cuda() for t in _inputs(dtype, rows, "bool", heads=32, kv_heads=4, length=176)]
    expected = eager(_attention, *args)
    actual, _ = _captured_on_the_gpu(_attention, *args)
    assert_close(actual, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_shared_mask_on_the_gpu_in_a_cuda_graph(dtype):
    # decode rows over a 176-slot cache with left padding, as SDPA's fused kernels see them
    q, k, v, mask = (t.cuda() for t in _inputs(dtype, 1, "bool", heads=32, kv_heads=32,
                                                length=176))  # fmt: skip
    expected = eager(_layers, q, k, v, mask)
    actual, graph = _captured_on_the_gpu(_layers, q, k, v, mask)
    assert_close(actual, expected)
    assert graph.shared_masks == ["l_mask_ (3 calls)"], graph.shared_masks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_key_uniform_mask_on_the_gpu_in_a_cuda_graph(dtype):
    # BERT-base's attention at 8 x 128 with the stride-0 mask its traced graph passes; eager
    # runs SDPA's math path on it, the rewritten graph a fused kernel without the mask
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, 12, 128, 64, generator=g).to("cuda", dtype) for _ in range(3))
    allowed_rows = torch.ones(8, 128, dtype=torch.bool, device="cuda")
    allowed_rows[5, 100:] = False
    expected = eager(_uniform_rows, q, k, v, allowed_rows)
    actual, graph = _captured_on_the_gpu(_uniform_rows, q, k, v, allowed_rows)
    assert_close(actual, expected)
    assert actual[5, :, 100:].abs().amax() == 0
    assert len(graph.dropped_masks) == 2, graph.dropped_masks


def _padded_bert(layers=2, seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=37,
                                     max_position_embeddings=64)  # fmt: skip
    return transformers.BertModel(config).eval()


def _padded_batch(batch, length, device="cpu"):
    ids = torch.randint(0, 99, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[1:, length // 2 :] = 0  # padded rows, as a batch of a sorted corpus has
    return ids, mask


def test_encoder_attention_runs_with_cudnn_off_and_the_flag_is_put_back(monkeypatch):
    torch._dynamo.reset()
    model = _padded_bert()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        ids, mask = _padded_batch(3, 8)
        assert_close(
            compiled(input_ids=ids, attention_mask=mask).last_hidden_state,
            model(input_ids=ids, attention_mask=mask).last_hidden_state,
        )
        # one length so far: the static graph keeps SDPA's own choice (one plan serves it)
        assert fusebackend.last_report().graphs[-1].cudnn_free_attention == []
        ids, mask = _padded_batch(3, 11)  # a second length: Dynamo makes the graph dynamic
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        assert_close(actual, expected)
        graph = fusebackend.last_report().graphs[-1]
        assert len(graph.cudnn_free_attention) == 2, graph.cudnn_free_attention
        assert "attention without cuDNN's per-shape plans" in str(fusebackend.last_report())
        # each call of the fused graph's SDPA sees cuDNN off; the flag is back on after it
        seen = []
        sdpa = F.scaled_dot_product_attention

        def spy(*args, **kwargs):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return sdpa(*args, **kwargs)

        import fusebackend.passes.attention as attention

        monkeypatch.setattr(attention, "F", type("F", (), {"scaled_dot_product_attention": spy}))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        again = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
    assert seen == [False, False], seen
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert_close(again, expected)


def test_cudnn_flag_after_a_failing_call_and_when_the_user_turned_it_off():
    from fusebackend.passes.attention import sdpa_without_cudnn

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError):
        sdpa_without_cudnn(q, torch.randn(1, 2, 5, 3), torch.randn(1, 2, 5, 8))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # put back although SDPA raised
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert_close(sdpa_without_cudnn(q, q, q), F.scaled_dot_product_attention(q, q, q))
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # the user's choice stands
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def _attention_and_norm(q, k, v, mask):
    """Attention, then a residual add + norm: a graph with something to fuse (the cuDNN
    rewrite applies to fused graphs)."""
    return F.layer_norm(_attention(q, k, v, mask) + q, (16,))  # _inputs: 16 wide


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "prefill"])
def test_only_calls_of_symbolic_lengths_leave_cudnn(rows, dynamic):
    """Dynamic lengths (a prefill's, or a decode row's growing cache) leave cuDNN; static
    ones keep SDPA's choice."""
    args = _inputs(torch.float32, rows, "bool")
    torch._dynamo.reset()
    compiled = torch.compile(
        _attention_and_norm, backend="infinifuse", dynamic=dynamic, options={"cudagraphs": False}
    )
    with torch.no_grad():
        actual = compiled(*args)
    graph = fusebackend.last_report().graphs[-1]
    assert graph.path == "fused", graph.path
    assert_close(actual, eager(_attention_and_norm, *args))
    assert len(graph.cudnn_free_attention) == dynamic, graph.cudnn_free_attention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_encoder_runs_no_cudnn_kernel_on_the_gpu():
    # A BERT-shaped padded batch at lengths seen once each, as a sorted corpus sends them
    # (Dynamo goes dynamic at the second): eager's SDPA runs cuDNN's kernel (where the
    # device picks it), the fused dynamic graph does not.
    torch._dynamo.reset()
    model = _padded_bert(layers=2).cuda().half()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})

    def kernels(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    with torch.no_grad():
        for length in (13, 22, 31):
            ids, mask = _padded_batch(4, length, "cuda")
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
            actual = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            assert_close(actual, expected)
        ids, mask = _padded_batch(4, 40, "cuda")
        eager_kernels = kernels(lambda: model(input_ids=ids, attention_mask=mask))
        fused_kernels = kernels(lambda: compiled(input_ids=ids, attention_mask=mask))
    assert not [n for n in fused_kernels if "cudnn" in n.lower()], fused_kernels
    assert fusebackend.last_report().graphs[-1].cudnn_free_attention
    if not [n for n in eager_kernels if "cudnn" in n.lower()]:
        pytest.skip(f"SDPA does not pick cuDNN on {torch.cuda.get_device_name()}")


def _multi_query(q, k, v, mask):
    """Falcon-7B's multi-query attention: one K/V head that SDPA broadcasts over the
    query's heads, twice, as two layers would."""
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(x * 0.5 + q, k, v, attn_mask=mask)


def _multi_query_inputs(device="cpu", dtype=torch.float32, heads=4, kv_heads=1):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, heads, 9, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(2, kv_heads, 9, 16, generator=g).to(device, dtype) for _ in range(2))
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool, device=device).tril()
    return q, k, v, mask


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_one_kv_head_is_expanded_to_the_query_heads(kv_heads):
    args = _multi_query_inputs(kv_heads=kv_heads)
    actual, graph = _compiled(_multi_query, *args)
    assert_close(actual, eager(_multi_query, *args))
    expanded = graph.rewrites.get("expanded_kv_heads", [])
    assert len(expanded) == (2 if kv_heads == 1 else 0), expanded  # one head only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_multi_query_attention_runs_a_fused_kernel_on_the_gpu():
    # Eager broadcasts the one K/V head in SDPA's math path (a softmax kernel of its own);
    # the fused graph's calls read K/V expanded and get a fused attention kernel.
    torch._dynamo.reset()
    args = _multi_query_inputs("cuda", torch.float16)
    compiled = torch.compile(_multi_query, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        assert_close(compiled(*args), _multi_query(*args))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(*args)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not [n for n in names if "softmax" in n.lower()], names
    assert len(fusebackend.last_report().graphs[-1].rewrites["expanded_kv_heads"]) == 2


def _pre_scaled(x, w, k, v, mask, scale, reuse, sliced):
    """OPT's and Whisper's attention: the query projection scaled by a number, then viewed
    into heads, and SDPA called with ``scale`` (1.0 where the model scaled already). With
    ``sliced`` the projection is half of a wider one (not dense: the multiply's result is)
    and a view merges its dims, which only the multiply's dense result allows."""
    b, length, _ = x.shape
    x = F.layer_norm(x, (x.shape[-1],))  # (a group: a graph with nothing to fuse stays as traced)
    projected = (x @ w)[..., :16] if sliced else x @ w
    scaled = projected * 0.25
    q = (scaled.view(b, -1) if sliced else scaled).view(b, length, 2, 8).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return (out, scaled + 1) if reuse else out


@pytest.mark.parametrize(
    ("scale", "reuse", "sliced", "moved"),
    [(1.0, False, False, True), (None, False, False, True), (0.5, True, False, False),
     (1.0, False, True, False)],
    ids=["scale 1", "default scale", "multiply read twice", "other strides"],
)  # fmt: skip
def test_a_query_scaled_by_a_number_is_scaled_in_attention(scale, reuse, sliced, moved):
    # (18 rows: more than a matmul group takes, which would run the multiply as its tail)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 9, 16, generator=g), torch.randn(16, 32 if sliced else 16, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    args = (x, w, k, v, mask, scale, reuse, sliced)
    actual, graph = _compiled(_pre_scaled, *args)
    assert_close(actual, eager(_pre_scaled, *args))
    assert len(graph.rewrites.get("attention_scales", [])) == (1 if moved else 0), graph.rewrites


def _position_biased(q, k, v, buckets, keep):
    """T5's attention: a bucket embedding ``[q, k, heads]`` (a constant derived from the
    parameters once) permuted to ``[1, heads, q, k]``, its keys at stride ``heads``, plus the
    padding mask, passed to every layer's SDPA."""
    padding = torch.where(keep, 0.0, float("-inf"))
    bias = buckets.permute(2, 0, 1).unsqueeze(0) + padding
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    return F.scaled_dot_product_attention(first, k, v, attn_mask=bias, scale=1.0)


def test_a_permuted_mask_reaches_attention_contiguous(fused_graphs):
    # Every fused GPU kernel of SDPA refuses a mask whose last dim is not at stride 1 (T5's
    # attention ran the math path); the mask's group writes it contiguous, once for both.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=g) for _ in range(3))
    buckets = torch.randn(7, 7, 4, generator=g)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 5:] = False
    args = (q, k, v, buckets, keep)
    actual, graph = _compiled(_position_biased, *args)
    assert_close(actual, eager(_position_biased, *args))
    assert graph.rewrites.get("contiguous_masks") == ["bias"], graph.rewrites
    masks = [example_value(n.kwargs["attn_mask"]) for n in fused_graphs[-1].graph.nodes
             if n.target is F.scaled_dot_product_attention]  # fmt: skip
    assert len(masks) == 2 and all(m.is_contiguous() for m in masks), [m.stride() for m in masks]
