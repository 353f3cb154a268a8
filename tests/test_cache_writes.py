"""A layer's two KV-cache writes in one launch: the ``fusebackend::write_cache_pair`` kernel
(kernels/cache_write.py) equals two ``index_copy_`` calls bit for bit, never writes outside
the cache, and passes/cache_writes.py joins StaticCache's writes only where moving the
first write down to the second changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FLOAT_DTYPES,
    LaunchRecorder,
    as_triton_sees,
    assert_close,
    eager,
    tiny_llama_config,
)

import fusebackend
from fusebackend.kernels.cache_write import write_cache_pair

transformers = pytest.importorskip("transformers")


def _caches(dtype, batch=2, heads=3, slots=13, width=24, rows=2, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(batch, heads, slots, width, generator=g).to(device, dtype)
    v_cache = torch.randn(batch, heads, slots, width, generator=g).to(device, dtype)
    k = torch.randn(batch, heads, rows, width, generator=g).to(device, dtype)
    # v as transformers makes it: a transposed view of [B, T, H, D], not contiguous
    v = torch.randn(batch, rows, heads, width, generator=g).to(device, dtype).transpose(1, 2)
    return k_cache, v_cache, k, v


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_pair_kernel_equals_two_index_copies_exactly(dtype):
    k_cache, v_cache, k, v = _caches(dtype)
    index = torch.tensor([7, 2])  # unsorted, odd width 24, strided v
    _assert_pair_writes_like_index_copy(k_cache, v_cache, index, k, v)


def _assert_pair_writes_like_index_copy(k_cache, v_cache, index, k, v):
    """write_cache_pair leaves both caches exactly as two ``index_copy_`` calls do."""
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(2, index, k)
    want_v.index_copy_(2, index, v)
    write_cache_pair(k_cache, v_cache, index, k, v, True)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_an_index_outside_the_cache_raises_and_writes_nothing():
    k_cache, v_cache, k, v = _caches(torch.float32)
    before = k_cache.clone(), v_cache.clone()
    for bad in (13, -1):
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for a cache of 13"):
            write_cache_pair(k_cache, v_cache, torch.tensor([3, bad]), k, v, True)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_precompile_warms_the_kernel_the_write_launches(monkeypatch):
    # The warm-up must specialise as the launch does (same grid, meta-parameters, ints; each
    # tensor as its dtype and alignment), or the first call compiles the kernel again.
    from fusebackend.kernels import cache_write

    launches, warmups = [], []
    monkeypatch.setattr(cache_write, "_kernel", lambda checks: LaunchRecorder(launches, warmups))
    k_cache, v_cache, k, v = _caches(torch.float16, width=40)
    v_cache = v_cache[..., 1:]  # a view 2 bytes in: unaligned, as the launch sees it
    k_cache, k, v = k_cache[..., :39], k[..., :39], v[..., 1:]
    index = torch.tensor([3, 5])
    write_cache_pair(k_cache, v_cache, index, k, v, False)
    cache_write.precompile_pair(k_cache, v_cache, index, k, v, False)
    ((run_args, run_grid, run_meta),) = launches
    ((warm_args, warm_grid, warm_meta),) = warmups

    seen = as_triton_sees
    assert [seen(x) for x in warm_args] == [seen(x) for x in run_args]
    assert seen(run_args[1]) == (torch.float16, False)  # the unaligned cache view
    assert (warm_grid, warm_meta) == (run_grid, run_meta)


def test_the_pair_s_node_writes_both_caches_and_nothing_else():
    from fusebackend.passes.mutations import written_args

    graph = torch.fx.Graph()
    k_cache, v_cache, index, k, v = (graph.placeholder(n) for n in ("kc", "vc", "i", "k", "v"))
    node = graph.call_function(write_cache_pair, (k_cache, v_cache, index, k, v, True))
    assert written_args(node) == [k_cache, v_cache]


def _layer_write(k_cache, v_cache, position, k, v):
    k = k * 0.5 + 1.0  # a fused group, so that the graph has a fused version
    k_cache.index_copy_(2, position, k)
    v_cache.index_copy_(2, position, v)
    return k.sum(dim=-1)


def _read_between(k_cache, v_cache, position, k, v):
    k = k * 0.5 + 1.0
    k_cache.index_copy_(2, position, k)
    seen = k_cache.amax(dim=-1)  # reads the written cache: the write must stay here
    v_cache.index_copy_(2, position, v)
    return seen


def _two_indices(k_cache, v_cache, position, k, v):
    k = k * 0.5 + 1.0
    k_cache.index_copy_(2, position, k)
    v_cache.index_copy_(2, position + 1, v)
    return k.sum(dim=-1)


def _one_projection(k_cache, v_cache, position, k, v):
    kv = torch.cat([k, v], dim=-1) * 0.5 + 1.0  # GPT-2: K and V split from one tensor
    k, v = kv.split(k.shape[-1], dim=-1)
    k_cache.index_copy_(2, position, k)
    v_cache.index_copy_(2, position, v)
    return k.sum(dim=-1)


def _rows_from_the_cache(k_cache, v_cache, position, k, v):
    k = k * 0.5 + 1.0
    v = k_cache[:, :, 3:5]  # a view of the cache that the first write changes
    k_cache.index_copy_(2, position, k)
    v_cache.index_copy_(2, position, v)  # reads k_cache after its write
    return k.sum(dim=-1)


@pytest.mark.parametrize(
    ("fn", "paired"),
    [(_layer_write, 1), (_one_projection, 1), (_read_between, 0), (_two_indices, 0),
     (_rows_from_the_cache, 0)],
    ids=["a layer's writes", "K and V of one tensor", "read between", "two indices",
         "rows from the cache"],
)  # fmt: skip
def test_writes_pair_only_where_the_first_may_move_down(fn, paired):
    k_cache, v_cache, k, v = _caches(torch.float32)
    position = torch.tensor([4, 9])
    want_caches = k_cache.clone(), v_cache.clone()
    want = eager(fn, *want_caches, position, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        got = compiled(k_cache, v_cache, position, k, v)  # validated against the unfused
        assert_close(got, want)
        assert torch.equal(k_cache, want_caches[0]) and torch.equal(v_cache, want_caches[1])
        position, k = torch.tensor([11, 0]), k.flip(2)  # the same signature: fused graph only
        want = eager(fn, *want_caches, position, k, v)
        got = compiled(k_cache, v_cache, position, k, v)
    assert_close(got, want)
    assert torch.equal(k_cache, want_caches[0]) and torch.equal(v_cache, want_caches[1])
    graph = fusebackend.last_report().graphs[-1]
    assert len(graph.cache_writes) == paired, graph.cache_writes
    assert [e["mode"] for e in graph.runtime_modes()] == ["fusion"]  # validated, kept


def _causal_lm(family):
    if family == "llama":
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    import model_zoo  # tests/ is on sys.path (rootdir conftest)

    return model_zoo.build_causal_lm(family)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decode_writes_each_layer_s_cache_in_one_launch_and_equals_eager(family):
    # GPT-2 splits K and V from one projection: rows of one storage, paired all the same.
    # Llama's q/k/v matmul group would take its writes (test_rotary_epilogue.py): off here.
    model = _causal_lm(family)
    config, vocab = model.config, model.config.vocab_size
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    eager_cache = transformers.StaticCache(config=config, max_cache_len=32)
    ids, mask = torch.randint(0, vocab, (1, 5)), torch.ones(1, 5, dtype=torch.long)
    options = {"cudagraphs": False, "matmul_groups": family != "llama"}
    compiled = torch.compile(model, backend="infinifuse", options=options)
    with torch.no_grad():
        for c in (cache, eager_cache):
            model(input_ids=ids, attention_mask=mask, past_key_values=c)  # eager prefill
        for step in range(3):  # each step writes the next slot, exactly once
            token = torch.randint(0, vocab, (1, 1))
            mask = torch.ones(1, 6 + step, dtype=torch.long)
            got = compiled(input_ids=token, attention_mask=mask, past_key_values=cache).logits
            want = model(input_ids=token, attention_mask=mask, past_key_values=eager_cache).logits
            assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        assert_close(layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-5)
        assert_close(layer.values, eager_layer.values, rtol=1e-5, atol=1e-5)
        assert layer.keys[:, :, 8:].abs().amax() == 0  # slots after the last step untouched
    graph = fusebackend.last_report().graphs[-1]
    assert len(graph.cache_writes) == config.num_hidden_layers, graph.cache_writes
    modes = [e["mode"] for e in graph.runtime_modes()]
    assert modes and set(modes) == {"fusion"}, modes  # the fused graph passed validation
    assert "KV-cache writes in one launch" in str(fusebackend.last_report())


def test_rewrites_false_keeps_two_index_copies():
    k_cache, v_cache, k, v = _caches(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(_layer_write, backend="infinifuse",
                             options={"cudagraphs": False, "rewrites": False})  # fmt: skip
    with torch.no_grad():
        compiled(k_cache, v_cache, torch.tensor([1, 2]), k, v)
    assert fusebackend.last_report().graphs[-1].cache_writes == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_pair_kernel_on_the_gpu_in_a_cuda_graph(dtype):
    # TinyLlama's cache: 4 K/V heads, 64 wide, 176 slots; one decode row
    k_cache, v_cache, k, v = _caches(dtype, batch=1, heads=4, slots=176, width=64, rows=1,
                                     device="cuda")  # fmt: skip
    index = torch.tensor([100], device="cuda")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(2, index, k)
    want_v.index_copy_(2, index, v)
    graph = torch.cuda.CUDAGraph()
    write_cache_pair(k_cache, v_cache, index, k, v, True)  # compile outside the capture
    with torch.cuda.graph(graph):
        write_cache_pair(k_cache, v_cache, index, k, v, True)
    k_cache.zero_(), v_cache.zero_()
    want_k[:, :, :100].zero_(), want_k[:, :, 101:].zero_()
    want_v[:, :, :100].zero_(), want_v[:, :, 101:].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# --- a prefill: several rows per head


@pytest.mark.parametrize("heads, rows", [(4, 2), (2, 6), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_pair_writes_a_prefill_of_several_rows_per_head(heads, rows, dtype):
    """A prefill writes T > 1 rows per head; with a power-of-two number of heads (every
    Llama) T and H share factors. Exactly ``index_copy_``'s result, both caches. Guards a
    program -> (batch, head, row) split that is right only when T and H are coprime (the
    other cache-write tests use 3 heads and 2 rows)."""
    g = torch.Generator().manual_seed(heads * 10 + rows)
    batch, slots, width = 2, 11, 20
    k_cache = torch.randn(batch, heads, slots, width, generator=g).to(dtype)
    v_cache = torch.randn(batch, heads, slots, width, generator=g).to(dtype)
    k = torch.randn(batch, heads, rows, width, generator=g).to(dtype)
    v = torch.randn(batch, rows, heads, width, generator=g).to(dtype).transpose(1, 2)
    index = torch.randperm(slots, generator=g)[:rows]
    _assert_pair_writes_like_index_copy(k_cache, v_cache, index, k, v)
