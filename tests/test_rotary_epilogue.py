"""The q/k/v matmul group's rotary embedding and KV-cache write in its own launch
(passes/rotary_epilogue.py, ``MatmulGroup.rotary`` / ``.cache_write`` in kernels/matmul.py):
transformers' decoders equal eager, logits and caches; the kernel against transformers' own
``apply_rotary_pos_emb`` + ``index_copy_`` at odd shapes; what stays apart says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_close,
    compile_fused,
    gpu_llama_decode,
    perturb_uniform_parameters,
    row_groups,
    runtime_modes,
    tiny_llama_config,
)

import fusebackend
from fusebackend.kernels import matmul
from fusebackend.kernels.ir import MatmulGroup

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

# Logits after 2 layers of matmuls summed in another order than eager's (as in
# test_matmul_groups.py); bf16 on the interpreter: its fp32 -> bf16 casts truncate (see
# test_matmul_kernel.py), and a rotated value is rounded 4 times more than a linear's.
_TOLERANCE = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2},
}
# On a GPU bf16 rounds to nearest even: the matmul-group tests' tolerances
_GPU_TOLERANCE = {
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}
_ROTARY = "rms_norm + 3 linears + rotary(q, k)"


def _epilogues(report) -> list[str]:
    graph = report.graphs[-1]
    return [line.split(": ", 1)[1] for line in graph.rewrites.get("rotary_epilogues", [])]


def _decode(model, config, steps=3, batch=1, new=1, cache_class="StaticCache", options=None):
    """Prefill 3 tokens eagerly into two caches, then ``steps`` steps of ``new`` tokens
    through eager and through the compiled model; returns (eager logits, compiled logits,
    the two caches)."""
    make = getattr(transformers, cache_class)
    kwargs = {"config": config, "max_cache_len": 16} if cache_class == "StaticCache" else {}
    caches = [make(**kwargs) for _ in range(2)]
    ids = torch.randint(0, config.vocab_size, (batch, 3))
    compiled = compile_fused(model, options)
    expected, actual = [], []
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(3))
        for step in range(steps):
            token = torch.randint(0, config.vocab_size, (batch, new))
            where = torch.arange(3 + step * new, 3 + (step + 1) * new)
            for fn, cache, out in ((model, caches[0], expected), (compiled, caches[1], actual)):
                logits = fn(token, past_key_values=cache, use_cache=True, cache_position=where)
                out.append(logits.logits.float())
    return torch.stack(expected), torch.stack(actual), caches


def _assert_caches_equal(caches, dtype):
    for want, got in zip(caches[0].layers, caches[1].layers, strict=True):
        assert_close(got.keys.float(), want.keys.float(), **_TOLERANCE[dtype])
        assert_close(got.values.float(), want.values.float(), **_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_llama_decode_rotates_and_writes_its_caches_in_the_qkv_launch(dtype):
    torch.manual_seed(0)
    config = tiny_llama_config(layers=2)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval().to(dtype))
    expected, actual, caches = _decode(model, config)
    assert_close(actual, expected, **_TOLERANCE[dtype])
    _assert_caches_equal(caches, dtype)
    assert caches[1].layers[0].keys[:, :, 6:].abs().amax() == 0  # slots after the last step
    report = fusebackend.last_report()
    assert _epilogues(report) == [_ROTARY + " + cache write(k, v)"] * 2
    graph = report.graphs[-1]
    # what the launch took over is gone: no rotary row kernel, no cache-write pair
    assert graph.cache_writes == [], graph.cache_writes
    rows = row_groups(graph)
    assert not any(n.startswith("neg") for g in rows for n in g.nodes), rows
    assert "write_cache_pair" not in str(graph.launches), graph.launches
    # the group it replaced is gone too (a k kept as heads would keep it computing q, k, v)
    assert graph.launches.get("matmul_group(rms_norm + 3 linears)") is None, graph.launches
    assert graph.launches[f"matmul_group({_ROTARY} + cache write(k, v))"] == 2
    assert runtime_modes() == ["fusion"]


def _qwen2_config():
    """A 2-layer Qwen2 (q/k/v with biases, 4 query and 2 K/V heads of 16)."""
    return transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def test_qwen2_biases_batch_of_two_and_three_new_tokens_per_step():
    torch.manual_seed(1)
    config = _qwen2_config()
    model = perturb_uniform_parameters(transformers.Qwen2ForCausalLM(config).eval().half())
    expected, actual, caches = _decode(model, config, steps=2, batch=2, new=3)
    assert_close(actual, expected, **_TOLERANCE[torch.float16])
    _assert_caches_equal(caches, torch.float16)
    want = "rms_norm + 3 linears + bias + rotary(q, k) + cache write(k, v)"
    assert _epilogues(fusebackend.last_report()) == [want] * 2


@pytest.mark.parametrize(
    "family, norm",
    [("mistral", "rms_norm"), ("gemma", "rms_offset_norm"), ("gemma2", "rms_offset_norm")],
)
def test_zoo_families_rotate_in_the_qkv_launch(family, norm):
    import model_zoo  # tests/ is on sys.path (rootdir conftest)

    model = perturb_uniform_parameters(model_zoo.build_causal_lm(family))
    expected, actual, caches = _decode(model, model.config, steps=2)
    assert_close(actual, expected, **_TOLERANCE[torch.float32])
    _assert_caches_equal(caches, torch.float32)
    want = f"{norm} + 3 linears + rotary(q, k) + cache write(k, v)"
    assert _epilogues(fusebackend.last_report()) == [want] * model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_qwen3_head_norms_rotation_and_cache_write_in_one_launch(dtype):
    # Qwen3 normalises each q and k head (q_norm, k_norm: RMSNorm over the head's width)
    # before the rotation: 2 launches of a layer's 10 before, none with them in the launch
    torch.manual_seed(4)
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    # no biases; the norm weights under test are moved below (moving every norm's weight
    # as well put 1 of 1024 bf16 values 0.06 off in the interpreter, which truncates fp32
    # to bf16 where eager rounds: see helpers.py)
    model = transformers.Qwen3ForCausalLM(config).eval()
    for name, p in model.named_parameters():  # norm weights away from 1, so they count
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.data += torch.randn_like(p) * 0.3
    model = model.to(dtype)
    # 2 decode steps, as the zoo families' test (the llama test above runs 3)
    expected, actual, caches = _decode(model, config, steps=2)
    assert_close(actual, expected, **_TOLERANCE[dtype])
    _assert_caches_equal(caches, dtype)
    want = "rms_norm + 3 linears + rms_norm(q, k heads) + rotary(q, k) + cache write(k, v)"
    assert _epilogues(fusebackend.last_report()) == [want] * 2
    graph = fusebackend.last_report().graphs[-1]
    # per layer: q/k/v, decode attention (one launch: a 16-slot cache needs no combine),
    # o + residual, gate/up, down + residual; then the LM head. The row kernels left are
    # the step's cos and sin (2-3 by dtype), none per layer
    layered = [n for name, n in graph.launches.items() if not name.startswith("_")]
    assert sum(layered) == 5 * 2 + 1, graph.launches
    rows = row_groups(graph)
    assert len(rows) <= 3 and not any("variance" in n for g in rows for n in g.nodes), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma3_offset_head_norms_after_the_transpose_in_the_launch(dtype):
    # Gemma3 normalises q and k after the transpose, with its (1 + weight) RMSNorm rounded
    # once; sliding-window and global layers rotate with their own cos and sin
    torch.manual_seed(5)
    config = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        sliding_window=8,
    )  # fmt: skip
    # no biases; the norm weights under test are moved below (moving every norm's weight
    # as well put 1 of 1024 bf16 values 0.06 off in the interpreter, which truncates fp32
    # to bf16 where eager rounds: see helpers.py)
    model = transformers.Gemma3ForCausalLM(config).eval()
    for name, p in model.named_parameters():  # (1 + weight) away from 1, so they count
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.data += torch.randn_like(p) * 0.3
    model = model.to(dtype)
    expected, actual, caches = _decode(model, config, steps=2)  # 2 decode steps, as above
    assert_close(actual, expected, **_TOLERANCE[dtype])
    _assert_caches_equal(caches, dtype)
    want = ("rms_offset_norm + 3 linears + rms_offset_norm(q, k heads) + rotary(q, k) + "
            "cache write(k, v)")  # fmt: skip
    assert _epilogues(fusebackend.last_report()) == [want] * 2


def test_dynamic_cache_rotates_in_the_launch_and_returns_k_and_v():
    # DynamicCache concatenates (no index_copy_): the rotary embedding alone is taken
    torch.manual_seed(2)
    config = tiny_llama_config(layers=2)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval())
    expected, actual, _ = _decode(model, config, steps=2, cache_class="DynamicCache")
    assert_close(actual, expected, **_TOLERANCE[torch.float32])
    graph = fusebackend.last_report().graphs[-1]
    assert _epilogues(fusebackend.last_report()) == [_ROTARY] * 2
    assert graph.launches.get("matmul_group(rms_norm + 3 linears)") is None, graph.launches


def test_matmul_groups_off_leaves_the_rotary_embedding_to_the_row_kernels():
    torch.manual_seed(3)
    config = tiny_llama_config(layers=1)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval())
    expected, actual, _ = _decode(model, config, steps=1, options={"matmul_groups": False})
    assert_close(actual, expected, **_TOLERANCE[torch.float32])
    graph = fusebackend.last_report().graphs[-1]
    assert "rotary_epilogues" not in graph.rewrites and len(graph.cache_writes) == 1


# ---- A hand-written attention block: odd shapes, what stays apart


def _block(h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index, peek: bool):
    """transformers' Llama attention input as written in its modeling code."""
    batch, seq, _ = h.shape
    x = h.float()
    x = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    width = k_cache.shape[-1]
    q = F.linear(x, wq).view(batch, seq, -1, width).transpose(1, 2)
    k = F.linear(x, wk).view(batch, seq, -1, width).transpose(1, 2)
    v = F.linear(x, wv).view(batch, seq, -1, width).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    seen = k_cache.sum() if peek else None  # a read of the cache before its write
    k_cache.index_copy_(2, index, k)
    v_cache.index_copy_(2, index, v)
    return (q, seen) if peek else q


def _block_inputs(dtype, batch=2, seq=3, width=10, heads=(3, 1), slots=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = 40

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    h, norm_w = rand(batch, seq, hidden), rand(hidden)
    wq, wk, wv = (rand(n * width, hidden) / 6 for n in (heads[0], heads[1], heads[1]))
    # each row of the batch at its own positions (as left-padded rows are): cos and sin
    # differ along the batch, so the kernel must read them per row
    positions = torch.arange(seq)[None, :] + 3 * torch.arange(batch)[:, None]
    angles = positions[..., None] * torch.linspace(0.1, 1.0, width // 2) + 0.3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache, v_cache = rand(batch, heads[1], slots, width), rand(batch, heads[1], slots, width)
    index = torch.arange(seq) * 2 + 1  # slots 1, 3, 5, 7: every other one stays as it was
    return [h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_block_at_odd_shapes_equals_eager(dtype):
    # head width 10 (halves of 5: not a power of two), 3 query heads over 1 K/V head, 6 rows
    inputs = _block_inputs(dtype)
    want = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = _block(*want, peek=False)
        actual = compile_fused(_block)(*inputs, peek=False)
    assert_close(actual.float(), expected.float(), **_TOLERANCE[dtype])
    for k in (7, 8):  # the caches, every slot: written ones and untouched ones
        assert_close(inputs[k].float(), want[k].float(), **_TOLERANCE[dtype])
    assert _epilogues(fusebackend.last_report()) == [_ROTARY + " + cache write(k, v)"]


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_one_row_as_gemv_at_odd_shapes_equals_eager(dtype, split_k, monkeypatch):
    # one decode row as a GEMV launch (its 2-column tiles straddle heads of width 10: halves
    # of 5), with and without split-K; the graph's launch is asked for GEMV (weights along K,
    # no head norm) and gets it from this config
    from fusebackend.kernels import arrivals

    asked = []
    config = matmul.LaunchConfig(2, 16, 4, 1, split_k=split_k, gemv=True)

    def gemv_config(*args):
        asked.append(args)
        return config

    monkeypatch.setattr(matmul, "_launch_config", gemv_config)
    inputs = _block_inputs(dtype, batch=1, seq=1)
    want = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = _block(*want, peek=False)
        actual = compile_fused(_block)(*inputs, peek=False)
    assert_close(actual.float(), expected.float(), **_TOLERANCE[dtype])
    for k in (7, 8):
        assert_close(inputs[k].float(), want[k].float(), **_TOLERANCE[dtype])
    assert _epilogues(fusebackend.last_report()) == [_ROTARY + " + cache write(k, v)"]
    assert asked and all(a[0] == 1 and a[-1] is True for a in asked), asked  # rows, gemv
    if split_k > 1:  # every tile's arrival counter set back to zero by its last program
        assert arrivals._counters[inputs[0].device].abs().amax() == 0


def test_a_head_norm_group_of_one_row_stays_on_tensor_cores(monkeypatch):
    # its programs hold whole heads (BLOCK_N = head width / 2): never a 2-column GEMV tile
    asked = []
    default = matmul.launch_config

    def spy(*args):
        asked.append(args)
        return default(*args)

    monkeypatch.setattr(matmul, "_launch_config", spy)
    h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index = _block_inputs(
        torch.float32, batch=1, seq=1, width=16, heads=(40, 8), slots=4)  # fmt: skip
    q_norm, k_norm = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    group = MatmulGroup(siblings=3, norm="rms", eps=1e-6, rotary=16, cache_write=True,
                        head_norm="rms", head_eps=1e-6)  # fmt: skip
    weights, biases, heads = matmul._split_params(
        group, (wq, wk, wv, cos[:, None], sin[:, None], q_norm, k_norm, k_cache, v_cache, index)
    )
    _, _, meta, _ = matmul._launch(group, h, norm_w, None, None, weights, biases, heads)
    assert asked == [(1, 40, 320 + 64 + 128, True, True, False, False)], asked  # not along N
    assert (meta["BLOCK_M"], meta["BLOCK_N"]) == (16, 8), meta


def test_a_read_of_the_cache_between_keeps_the_write_apart():
    inputs = _block_inputs(torch.float32)
    want = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = _block(*want, peek=True)
        actual = compile_fused(_block)(*inputs, peek=True)
    assert_close(actual, expected)  # the sum saw the cache before the write
    graph = fusebackend.last_report().graphs[-1]
    assert not graph.rewrites.get("rotary_epilogues")
    (reason,) = graph.rewrites["rotary_left_alone"]
    assert "touches what the launch reads or writes" in reason, reason


def _cache_before_rotation(h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index):
    """The cache keeps k before its rotation: the write reads the heads, not the rotated k."""
    q, k, v = _heads(h, norm_w, wq, wk, wv, k_cache.shape[-1])
    k_cache.index_copy_(2, index, k)
    v_cache.index_copy_(2, index, v)
    return apply_rotary_pos_emb(q, k, cos, sin)


def _scaled_in_place(h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index):
    """q's heads are scaled in place (a node with no users) before the rotation."""
    q, k, v = _heads(h, norm_w, wq, wk, wv, k_cache.shape[-1])
    q.mul_(0.5)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k_cache.index_copy_(2, index, k)
    v_cache.index_copy_(2, index, v)
    return q


def _heads(h, norm_w, wq, wk, wv, width):
    batch, seq, _ = h.shape
    x = h.float()
    x = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    return [F.linear(x, w).view(batch, seq, -1, width).transpose(1, 2) for w in (wq, wk, wv)]


@pytest.mark.parametrize("fn", [_cache_before_rotation, _scaled_in_place], ids=lambda f: f.__name__)
def test_other_uses_of_the_heads_are_kept(fn):
    # The heads' other users (a write of them, an in-place op whose result goes unused) are
    # not part of the rotation: the rotation stays apart, and nothing is dropped.
    inputs = _block_inputs(torch.float32)
    want = [t.clone() for t in inputs]
    with torch.no_grad():
        expected = fn(*want)
        actual = compile_fused(fn)(*inputs)
    assert_close(actual, expected)
    for k in (7, 8):
        assert_close(inputs[k], want[k])
    graph = fusebackend.last_report().graphs[-1]
    assert not graph.rewrites.get("rotary_epilogues"), graph.rewrites


KERNEL_CONFIGS = {
    "default": None,
    # the last of a tile's 3 slices rotates the sums and writes the caches
    "split_k": matmul.LaunchConfig(16, 16, 4, 2, split_k=3),
    # one row without tensor cores: 2-column tiles of rotate_half pairs
    "gemv": matmul.LaunchConfig(2, 16, 4, 1, gemv=True),
}


@pytest.mark.parametrize("config", KERNEL_CONFIGS)
def test_kernel_matches_transformers_rotary_and_index_copy(monkeypatch, config):
    # the launch itself, rows 1 to 16 (B x T), against the eager code it replaces
    if KERNEL_CONFIGS[config] is not None:
        monkeypatch.setattr(matmul, "_launch_config", lambda *a: KERNEL_CONFIGS[config])
    shapes = ((1, 1),) if config == "gemv" else ((1, 1), (2, 3), (4, 4))
    for batch, seq in shapes:
        inputs = _block_inputs(torch.float16, batch=batch, seq=seq, width=16, heads=(4, 2))
        h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index = inputs
        want_caches = k_cache.clone(), v_cache.clone()
        expected = _block(h, norm_w, wq, wk, wv, cos, sin, *want_caches, index, peek=False)
        group = MatmulGroup(siblings=3, norm="rms", eps=1e-6, rotary=16, cache_write=True)
        (q,) = matmul.matmul_group(group, h, norm_w, None, None, wq, wk, wv, cos[:, None],
                                   sin[:, None], k_cache, v_cache, index)  # fmt: skip
        got = q.view(batch, seq, -1, 16).transpose(1, 2)
        assert_close(got, expected, **_TOLERANCE[torch.float16])
        assert_close(k_cache, want_caches[0], **_TOLERANCE[torch.float16])
        assert_close(v_cache, want_caches[1], **_TOLERANCE[torch.float16])


def test_an_index_outside_the_cache_raises_and_writes_nothing():
    h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, _ = _block_inputs(torch.float32)
    before = k_cache.clone(), v_cache.clone()
    group = MatmulGroup(siblings=3, norm="rms", eps=1e-6, rotary=10, cache_write=True)
    for bad in (9, -1):
        index = torch.tensor([0, bad, 3])
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for a cache of 9"):
            matmul.matmul_group(group, h, norm_w, None, None, wq, wk, wv, cos[:, None],
                                sin[:, None], k_cache, v_cache, index)  # fmt: skip
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_group_validation():
    with pytest.raises(ValueError, match="rotary"):
        MatmulGroup(siblings=2, rotary=16)
    with pytest.raises(ValueError, match="rotary"):
        MatmulGroup(siblings=3, rotary=15)
    with pytest.raises(ValueError, match="cache write"):
        MatmulGroup(siblings=3, cache_write=True)
    with pytest.raises(ValueError, match="index checks"):
        MatmulGroup(siblings=3, rotary=16, index_checks=True)
    with pytest.raises(ValueError, match="head norms"):
        MatmulGroup(siblings=3, rotary=48, head_norm="rms")  # halves of 24: no tl.arange
    with pytest.raises(ValueError, match=r"rows are \[B, T, K\]"):  # [B*T, K] would misread
        inputs = _block_inputs(torch.float32)
        rotary = MatmulGroup(siblings=3, norm="rms", eps=1e-6, rotary=10)
        matmul.matmul_group(rotary, inputs[0].flatten(0, 1), *inputs[1:2], None, None,
                            *inputs[2:7])  # fmt: skip
    group = MatmulGroup(siblings=3, bias=True, rotary=64, cache_write=True)
    # rows, norm w, norm b, residual, 3 weights, 3 biases, cos, sin, then the caches
    assert matmul.matmul_op(group).writes_arguments == (12, 13)


# ---- On a GPU: captured, validated against the unfused graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_llama_decode_captured_with_rotary_and_cache_write_in_the_launch(dtype):
    tolerance = _GPU_TOLERANCE[dtype]
    caches = gpu_llama_decode(dtype, tolerance)
    for want, got in zip(caches[0].layers, caches[1].layers, strict=True):
        assert_close(got.keys.float(), want.keys.float(), **tolerance)
        assert_close(got.values.float(), want.values.float(), **tolerance)
    assert _epilogues(fusebackend.last_report()) == [_ROTARY + " + cache write(k, v)"] * 2
    assert runtime_modes() == ["fusion"]
    assert fusebackend.stats()["recordings"] >= 1 and fusebackend.stats()["cache_hits"] >= 3


def test_generate_of_a_left_padded_batch_equals_eager_tokens():
    # transformers' generate() through CompileConfig: two prompts, one left-padded (the
    # padded row's mask reaches every decode step's attention)
    torch.manual_seed(11)
    config = _qwen2_config()
    model = perturb_uniform_parameters(transformers.Qwen2ForCausalLM(config).eval())
    ids = torch.randint(1, 97, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0  # the second prompt is 3 tokens, left-padded
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False,
              "cache_implementation": "static", "pad_token_id": 0}  # fmt: skip
    start = fusebackend.report._recorded
    with torch.no_grad():
        expected = model.generate(ids, disable_compile=True, **kwargs)
        compile_config = transformers.CompileConfig(backend="infinifuse")
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only
        actual = model.generate(ids, compile_config=compile_config, **kwargs)
    assert torch.equal(actual, expected)
    made = [line for g in fusebackend.report._reports_since(start)
            for line in g.rewrites.get("rotary_epilogues", [])]  # fmt: skip
    assert any("bias + rotary(q, k) + cache write(k, v)" in line for line in made), made


def test_the_index_checked_build_checks_the_index_alone():
    # Triton's debug mode (built for the cache index's assert) would also check every 32-bit
    # add and multiply of the K loop for overflow: the launch turns that part off
    h, norm_w, wq, wk, wv, cos, sin, k_cache, v_cache, index = _block_inputs(torch.float16)
    for checks in (False, True):
        group = MatmulGroup(siblings=3, norm="rms", eps=1e-6, rotary=10, cache_write=True,
                            index_checks=checks)  # fmt: skip
        weights, biases, heads = matmul._split_params(
            group, (wq, wk, wv, cos[:, None], sin[:, None], k_cache, v_cache, index)
        )
        _, _, meta, _ = matmul._launch(group, h, norm_w, None, None, weights, biases, heads)
        assert meta.get("sanitize_overflow", True) is not checks, meta
