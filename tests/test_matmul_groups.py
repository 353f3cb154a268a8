"""Matmul groups on real model code (passes/matmul_groups.py, kernels/matmul.py): a decode
step's linears run with their siblings, norm and epilogue as one launch each, equal eager;
weights changed after compile are read as they are; what is left alone says why."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_close,
    compile_fused,
    eager,
    gpu_llama_decode,
    perturb_uniform_parameters,
    rewrites_of,
    row_groups,
    runtime_modes,
    tiny_llama_config,
)

import fusebackend

transformers = pytest.importorskip("transformers")

# Per dtype: a decode step's logits pass 2 layers of fp16/bf16 matmuls whose sums run in
# another order than eager's; one bf16 ulp of a logit near 2 is 2**-7.
_TOLERANCE = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def _matmul_groups(report) -> list[str]:
    """What each matmul group of the last graph computes (``rms_norm + 3 linears``, ...)."""
    return [line.split(": ", 1)[1] for line in report.graphs[-1].rewrites.get("matmul_groups", [])]


def _fused_graph(fn, *args, **tolerance):
    """Compile ``fn`` with infinifuse, check it equals eager on ``args``; its graph report."""
    expected = eager(fn, *args)
    with torch.no_grad():
        actual = compile_fused(fn)(*args)
    assert_close(actual, expected, **tolerance)
    return fusebackend.last_report().graphs[-1]


def _decode(model, config, dtype, steps=2, options=None):
    """Prefill 3 tokens eagerly into two StaticCaches, then ``steps`` decode steps through
    eager and through the compiled model; returns (eager logits, compiled logits)."""
    caches = [transformers.StaticCache(config=config, max_cache_len=16) for _ in range(2)]
    ids = torch.randint(0, config.vocab_size, (1, 3))
    compiled = compile_fused(model, options)
    expected, actual = [], []
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(3))
        for position in range(3, 3 + steps):
            token = torch.randint(0, config.vocab_size, (1, 1))
            where = torch.tensor([position])
            for fn, cache, out in ((model, caches[0], expected), (compiled, caches[1], actual)):
                logits = fn(token, past_key_values=cache, use_cache=True, cache_position=where)
                out.append(logits.logits.float())
    return torch.stack(expected), torch.stack(actual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_llama_decode_step_is_five_matmul_groups_per_layer_equal_eager(dtype):
    torch.manual_seed(0)
    config = tiny_llama_config(layers=2)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval().to(dtype))
    expected, actual = _decode(model, config, dtype)
    assert_close(actual, expected, **_TOLERANCE[dtype])
    groups = _matmul_groups(fusebackend.last_report())
    per_layer = [
        "rms_norm + 3 linears",  # input norm + q, k, v
        "linear + residual",  # o_proj + residual add
        "rms_norm + 2 linears + silu(gate) * up",  # post-attention norm + gate, up, SwiGLU
        "linear + residual",  # down_proj + residual add
    ]
    assert groups == per_layer * 2 + ["rms_norm + linear"], groups  # final norm + LM head
    # what the matmul groups took is gone from the graph: no norm or SwiGLU left to the row
    # kernels (a group reading a replaced node kept both running), only RoPE and cos/sin
    rows = row_groups(fusebackend.last_report().graphs[-1])
    assert not any(g.reductions for g in rows), rows
    assert not any(n.startswith("silu") for g in rows for n in g.nodes), [g.nodes for g in rows]
    assert runtime_modes() == ["fusion"]


def test_qwen2_projections_with_bias_and_tied_head():
    torch.manual_seed(1)
    config = transformers.Qwen2Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = perturb_uniform_parameters(transformers.Qwen2ForCausalLM(config).eval())
    expected, actual = _decode(model, config, torch.float32)
    assert_close(actual, expected, **_TOLERANCE[torch.float32])
    groups = _matmul_groups(fusebackend.last_report())
    assert groups.count("rms_norm + 3 linears + bias") == 2, groups
    assert groups[-1] == "rms_norm + linear", groups  # the tied embedding, read in place


def _tiny_gpt2(dtype: torch.dtype, width: int, seed: int):
    """A 2-layer GPT2LMHeadModel of ``width`` (4 heads, 101 tokens), random weights."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=101, n_embd=width, n_layer=2, n_head=4,
                                     n_positions=64)  # fmt: skip
    return perturb_uniform_parameters(transformers.GPT2LMHeadModel(config).eval().to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpt2_conv1d_layers_with_layer_norms_bias_and_residuals(dtype):
    model = _tiny_gpt2(dtype, 64, seed=8)
    expected, actual = _decode(model, model.config, dtype)
    assert_close(actual, expected, **_TOLERANCE[dtype])
    per_layer = [
        "layer_norm + linear + bias",  # ln_1 + c_attn (Conv1D: addmm on a [K, N] weight)
        "linear + bias + residual",  # the attention's c_proj + its dropout (eval) + residual
        # ln_2 + c_fc + NewGELU, its 8 ops rounded as eager rounds them
        "layer_norm + linear + bias + gelu_new",
        "linear + bias + residual",  # the MLP's c_proj + residual
    ]
    groups = _matmul_groups(fusebackend.last_report())
    assert groups == per_layer * 2 + ["layer_norm + linear"], groups  # ln_f + tied LM head
    rows = row_groups(fusebackend.last_report().graphs[-1])
    assert not any(g.reductions for g in rows), rows  # every LayerNorm is a prologue
    assert not any(n.startswith("tanh") for g in rows for n in g.nodes), rows  # and the GELU


@pytest.mark.parametrize(
    "family, expected",
    [
        # Gemma's RMSNorm: (x.float() * rstd * (1 + w.float())).type_as(x), tanh-GELU gate
        ("gemma", "rms_offset_norm + 2 linears + gelu_tanh(gate) * up"),
        # Phi-3's gate_up_proj: one weight, chunk(2) -> silu(gate) * up
        ("phi3", "rms_norm + linear in halves + silu(gate) * up"),
    ],
)
def test_zoo_norm_and_gate_spellings(family, expected):
    import model_zoo

    torch.manual_seed(10)
    model = perturb_uniform_parameters(model_zoo.build_causal_lm(family))
    expected_logits, actual = _decode(model, model.config, torch.float32)
    assert_close(actual, expected_logits, **_TOLERANCE[torch.float32])
    groups = _matmul_groups(fusebackend.last_report())
    assert groups.count(expected) == model.config.num_hidden_layers, groups
    rows = fusebackend.last_report().graphs[-1].groups
    assert not any(g.reductions for g in rows), rows  # every norm went into a prologue


def test_conv1d_weights_read_transposed_in_place():
    from fusebackend.kernels.ir import MatmulGroup
    from fusebackend.kernels.matmul import matmul_group

    torch.manual_seed(9)
    x, weight, bias = torch.randn(3, 40), torch.randn(40, 72), torch.randn(72)
    group = MatmulGroup(bias=True, weight_layout="kn")
    (actual,) = matmul_group(group, x, None, None, None, weight, bias)
    assert_close(actual, torch.addmm(bias, x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gpt2_one_token_forward_runs_conv1d_projections_as_gemv_along_n(dtype):
    # One token without a cache (issue 38): c_attn (176 -> 528) and c_fc (176 -> 704) are
    # one row of >= 512 columns on weights stored [K, N], so GEMV launches reading along N;
    # the c_proj (176 outputs) and the 101-token LM head keep tensor cores
    model = _tiny_gpt2(dtype, 176, seed=12)
    ids = torch.randint(0, 101, (1, 1))

    def logits(i):
        return model(i, use_cache=False).logits

    graph = _fused_graph(logits, ids, **_TOLERANCE[dtype])
    assert graph.launch_paths == {
        "matmul_group(layer_norm + linear + bias)": {"GEMV": 2},  # ln_1 + c_attn
        "matmul_group(layer_norm + linear + bias + gelu_new)": {"GEMV": 2},  # ln_2 + c_fc
        "matmul_group(linear + bias + residual)": {"tensor cores": 4},  # both c_proj
        "matmul_group(layer_norm + linear)": {"tensor cores": 1},  # ln_f + the LM head
    }, graph.launch_paths


class _Spellings(torch.nn.Module):
    """A LayerNorm, then the three spellings of a product with a weight: ``x @ W`` (W
    stored [K, N]), ``torch.mm`` (the same) and ``x @ W.T`` (W stored [N, K], Falcon's
    FalconLinear)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Parameter(torch.randn(64, 600) / 8)
        self.down = torch.nn.Parameter(torch.randn(600, 64) / 25)
        self.head = torch.nn.Parameter(torch.randn(520, 64) / 8)

    def forward(self, x):
        h = F.gelu(self.norm(x) @ self.up)
        h = torch.mm(h, self.down) + x
        return h @ self.head.T


@pytest.mark.parametrize("rows", [1, 3])
def test_matmul_spellings_of_a_weight_become_groups(rows):
    torch.manual_seed(13)
    graph = _fused_graph(_Spellings().eval(), torch.randn(rows, 64), rtol=1e-4, atol=1e-4)
    assert _matmul_groups(fusebackend.last_report()) == [
        "layer_norm + linear + gelu", "linear + residual", "linear",
    ]  # fmt: skip
    way = "GEMV" if rows == 1 else "tensor cores"  # up (along N) and head (along K): 1 row
    assert graph.launch_paths == {
        "matmul_group(layer_norm + linear + gelu)": {way: 1},
        "matmul_group(linear + residual)": {"tensor cores": 1},  # 64 outputs
        "matmul_group(linear)": {way: 1},
    }, graph.launch_paths
    assert not graph.rewrites.get("matmuls_left_alone")


def test_a_matmul_by_an_activation_is_left_alone_with_its_reason():
    def fn(x, y):
        return x @ (y * 2.0)  # a right operand the graph computes (scores @ values, say)

    graph = _fused_graph(fn, torch.randn(1, 32), torch.randn(32, 40), rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("matmul_groups"), graph.rewrites
    assert graph.rewrites["matmuls_left_alone"] == [
        "matmul: the right operand (mul) is computed in the graph, not a weight",
    ], graph.rewrites


class _Autocast(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m = x @ self.weight
        return m * 2.0


def test_a_matmul_under_autocast_is_left_alone_with_its_reason():
    # eager casts the fp32 operands to bf16 first; a matmul group would multiply in fp32
    # (on an H200 that left validation's tolerance and the graph ran unfused)
    torch.manual_seed(5)
    graph = _fused_graph(_Autocast().eval(), torch.randn(2, 32), rtol=0, atol=0)
    assert not graph.rewrites.get("matmul_groups"), graph.rewrites
    assert graph.rewrites["matmuls_left_alone"] == [
        "m: an autocast region (torch.float32 operands, a torch.bfloat16 result)",
    ], graph.rewrites


def test_many_rows_stay_with_cublas_and_say_why():
    torch.manual_seed(2)
    model = perturb_uniform_parameters(transformers.LlamaModel(tiny_llama_config(layers=1)).eval())
    ids = torch.randint(0, 97, (3, 7))  # 21 rows

    def fn(ids):
        return model(input_ids=ids).last_hidden_state

    expected = eager(fn, ids)
    with torch.no_grad():
        actual = compile_fused(fn)(ids)
    assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    graph = fusebackend.last_report().graphs[-1]
    assert not graph.rewrites.get("matmul_groups")
    left = graph.rewrites["matmuls_left_alone"]
    assert len(left) == 7 and all("21 rows (> 16): cuBLAS" in line for line in left), left


class _WideMLP(torch.nn.Module):
    """LayerNorm + a 600-wide linear + ReLU, then back to 64 with the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 600), torch.nn.Linear(600, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x)))) + x


@pytest.mark.parametrize("rows,gemv", [(1, True), (1, False), (3, True)])
def test_explain_says_which_matmul_groups_run_as_gemv(rows, gemv, monkeypatch):
    # one row of >= 512 output columns runs without tensor cores; the 64-wide down
    # projection, more rows, or the flag off keep them; explain says which way each ran
    from fusebackend.kernels import matmul

    monkeypatch.setattr(matmul, "ONE_ROW_GEMV", gemv)
    torch.manual_seed(3)
    graph = _fused_graph(_WideMLP().eval(), torch.randn(rows, 64), rtol=1e-4, atol=1e-4)
    up = "matmul_group(layer_norm + linear + bias + relu)"
    way = "GEMV" if rows == 1 and gemv else "tensor cores"
    assert graph.launch_paths == {
        up: {way: 1},
        "matmul_group(linear + bias + residual)": {"tensor cores": 1},
    }
    assert f"{up} x 1 ({way} x 1)" in str(fusebackend.last_report())


def test_option_off_leaves_every_matmul_as_traced():
    torch.manual_seed(3)
    config = tiny_llama_config(layers=1)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval())
    expected, actual = _decode(model, config, torch.float32, options={"matmul_groups": False})
    assert_close(actual, expected, **_TOLERANCE[torch.float32])
    assert _matmul_groups(fusebackend.last_report()) == []


class _Mlp(torch.nn.Module):
    """A gated MLP with a norm in front, as a decoder layer spells it."""

    def __init__(self, width=48, hidden=80):
        super().__init__()
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(width)
        self.gate = torch.nn.Linear(width, hidden, bias=False)
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("update", ["load_state_dict", "param.data", "mul_"])
def test_weights_changed_after_compile_are_read_as_they_are(update):
    torch.manual_seed(4)
    mlp = _Mlp().eval()
    x = torch.randn(1, 2, 48)
    compiled = compile_fused(mlp)
    with torch.no_grad():
        assert_close(compiled(x), mlp(x), rtol=1e-4, atol=1e-4)
        assert len(_matmul_groups(fusebackend.last_report())) == 2
        if update == "load_state_dict":
            state = {k: torch.randn_like(v) for k, v in mlp.state_dict().items()}
            mlp.load_state_dict(state)
        elif update == "param.data":
            mlp.up.weight.data = torch.randn_like(mlp.up.weight)
            mlp.norm.weight.data = torch.randn_like(mlp.norm.weight)
        else:
            mlp.gate.weight.mul_(2)
            mlp.norm.weight.mul_(-1)
        expected = mlp(x)
        actual = compiled(x)
    assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_a_write_between_siblings_keeps_them_apart():
    w1, w2 = torch.randn(40, 24), torch.randn(40, 24)

    def fn(x):
        a = F.linear(x, w1)
        x.mul_(2)  # the second product reads the written rows
        b = F.linear(x, w2)
        return a + b

    x = torch.randn(1, 24)
    expected = eager(fn, x.clone())
    with torch.no_grad():
        actual = compile_fused(fn)(x.clone())
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    graph = fusebackend.last_report().graphs[-1]
    assert any("mul_ writes inside the group's span" in line
               for line in graph.rewrites["matmuls_left_alone"]), graph.rewrites  # fmt: skip


def test_more_than_three_siblings_launch_in_threes_without_a_prologue():
    # GPT-J's attention and MLP both read ln_1's output: q, k, v and fc_in. A launch takes
    # up to 3 weights, so they run as 3 + 1, and the norm stays (both launches read it).
    torch.manual_seed(11)
    norm = torch.nn.LayerNorm(40).eval()
    weights = [torch.randn(n, 40) for n in (24, 24, 24, 56)]

    def fn(x):
        h = norm(x)
        return [F.linear(h, w) for w in weights]

    x = torch.randn(1, 3, 40)
    expected = eager(fn, x)
    with torch.no_grad():
        actual = compile_fused(fn)(x)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert _matmul_groups(fusebackend.last_report()) == ["3 linears", "linear"]


def test_residual_computed_after_the_linear_moves_the_launch_down():
    w = torch.randn(32, 32)

    def fn(x, r):
        y = F.linear(x, w)
        s = r * 3.0  # the residual is computed between the linear and the add
        return s + y

    x, r = torch.randn(2, 32), torch.randn(2, 32)
    expected = eager(fn, x, r)
    with torch.no_grad():
        actual = compile_fused(fn)(x, r)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert _matmul_groups(fusebackend.last_report()) == ["linear + residual"]


def test_opt_decoder_fc1_relu_is_one_launch():
    # OPT's MLP: LayerNorm -> fc1 -> relu -> fc2 (+ residual)
    torch.manual_seed(9)
    config = transformers.OPTConfig(vocab_size=101, hidden_size=64, ffn_dim=96,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    word_embed_proj_dim=64, max_position_embeddings=64)  # fmt: skip
    model = perturb_uniform_parameters(transformers.OPTForCausalLM(config).eval().half())
    ids = torch.randint(0, 101, (1, 1))
    expected = eager(lambda i: model(i).logits, ids)
    with torch.no_grad():
        actual = compile_fused(lambda i: model(i).logits)(ids)
    assert_close(actual, expected, **_TOLERANCE[torch.float16])
    groups = _matmul_groups(fusebackend.last_report())
    assert groups.count("layer_norm + linear + bias + relu") == 2, groups


# Activations written out as ops, as models write them: each runs after its linear in the
# matmul kernel (passes/activations.elementwise_tail), rounded op by op as eager rounds.
_TAILS = {
    # NewGELU with 0.045 for 0.044715: not the named one, taken as its ops all the same
    "new_gelu_other_constant": (
        lambda y: 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.045 * y**3.0))),
        "mul, pow, mul, add, mul, tanh, add, mul",
    ),
    "quick_gelu": (lambda y: y * torch.sigmoid(1.702 * y), "mul, sigmoid, mul"),  # CLIP's
    "bloom_gelu": (  # BLOOM's bloom_gelu_forward
        lambda y: y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y))),
        "mul, mul, mul, mul, add, mul, tanh, add, mul",
    ),
    "hardswish_spelled": (lambda y: y * F.relu6(y + 3.0) / 6.0, "add, relu6, mul, div"),
    "leaky_where": (lambda y: torch.where(y > 0, y, 0.01 * y), "gt, mul, where"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_TAILS))
def test_an_activation_written_out_runs_in_the_matmul_launch(name, dtype):
    torch.manual_seed(21)
    w = (torch.randn(48, 33) / 6).to(dtype)
    activation, ops = _TAILS[name]

    def fn(x):
        return activation(F.linear(x, w)) + 1.0  # the + 1.0 joins the tail too

    _fused_graph(fn, torch.randn(3, 33).to(dtype), **_TOLERANCE[dtype])
    assert _matmul_groups(fusebackend.last_report()) == [f"linear + ({ops}, add)"]
    graph = fusebackend.last_report().graphs[-1]
    assert not row_groups(graph)  # nothing left for a row kernel
    (group,) = graph.groups  # the matmul group: every node it absorbed, its generated tail
    assert group.family == "matmul" and group.nodes[0] == "linear"
    assert len(group.nodes) == len(ops.split(", ")) + 2  # the product, the ops, the + 1.0
    assert group.source.count("@triton.jit") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_distilled_head_sum_and_halving_run_in_the_second_heads_launch(dtype):
    """timm LeViT's eval head, ``(head(x) + head_dist(x)) / 2``: the second head's launch
    adds the first head's output and halves the sum (its residual tail), rounded as eager."""
    torch.manual_seed(22)
    w, w_dist = (torch.randn(37, 40) / 6).to(dtype), (torch.randn(37, 40) / 6).to(dtype)
    b, b_dist = torch.randn(37).to(dtype), torch.randn(37).to(dtype)
    scale, scale_dist = torch.rand(40).to(dtype) + 0.5, torch.rand(40).to(dtype) + 0.5

    def fn(x):
        x = x.mean(1)  # each head has its own BatchNorm: two inputs, not siblings
        return (F.linear(x * scale, w, b) + F.linear(x * scale_dist, w_dist, b_dist)) / 2

    _fused_graph(fn, torch.randn(3, 5, 40).to(dtype), **_TOLERANCE[dtype])
    groups = _matmul_groups(fusebackend.last_report())
    assert sorted(groups) == ["linear + bias", "linear + bias + residual + (div)"], groups
    graph = fusebackend.last_report().graphs[-1]
    (tailed,) = [g for g in graph.groups if g.kernel_name == "matmul_1_residual_tail"]
    assert tailed.nodes[-1] == "truediv" and tailed.outputs == ("truediv",)
    assert "truediv" not in {n for g in graph.groups if g.family == "row" for n in g.nodes}


def test_a_residual_tail_with_an_activation_and_constants():
    """``relu(y + r) * 0.5 + 1``: every op after the residual add in the launch."""
    w = torch.randn(24, 32) / 6

    def fn(x, r):
        return torch.relu(F.linear(x, w) + r) * 0.5 + 1.0

    x, r = torch.randn(4, 32), torch.randn(4, 24)
    _fused_graph(fn, x, r, rtol=1e-5, atol=1e-5)
    assert _matmul_groups(fusebackend.last_report()) == ["linear + residual + (relu, mul, add)"]


def test_a_tail_stops_at_a_write_and_the_group_still_forms():
    w = torch.randn(48, 32) / 6

    def fn(x, counter):
        s = torch.sigmoid(F.linear(x, w))
        counter.add_(1.0)  # a write between the tail's ops: the group's span may hold none
        return s * 2.0

    x = torch.randn(3, 32)
    counters = [torch.zeros(2), torch.zeros(2)]
    expected = eager(fn, x, counters[0])
    with torch.no_grad():
        actual = compile_fused(fn)(x, counters[1])
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert counters[1].tolist() == [1.0, 1.0]  # written once
    assert _matmul_groups(fusebackend.last_report()) == ["linear + (sigmoid)"]


def test_a_tail_read_halfway_stops_before_that_value():
    w = torch.randn(48, 32) / 6

    def fn(x):
        y = F.linear(x, w)
        s = torch.sigmoid(y)
        return y * s, s.sum(-1)  # s is read by a reduction: the tail cannot end past it

    x = torch.randn(3, 32)
    expected = eager(fn, x)
    with torch.no_grad():
        actual = compile_fused(fn)(x)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert _matmul_groups(fusebackend.last_report()) == ["linear"]


def test_generate_with_compile_config_matches_eager_tokens():
    torch.manual_seed(5)
    config = tiny_llama_config(layers=2)
    model = perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval())
    ids = torch.randint(0, 97, (1, 5))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    start = fusebackend.report._recorded  # reports() keeps only the newest 256 (CI runs serially)
    with torch.no_grad():
        expected = model.generate(ids, disable_compile=True, **kwargs)
        config = transformers.CompileConfig(backend="infinifuse")
        config._compile_all_devices = True  # transformers compiles on CUDA only by default
        actual = model.generate(ids, compile_config=config, **kwargs)
    assert torch.equal(actual, expected)
    graphs = fusebackend.report._reports_since(start)
    made = rewrites_of(graphs, "matmul_groups")
    assert any("rms_norm + 2 linears + silu(gate) * up" in line for line in made), made


# ---- On a GPU: captured in CUDA graphs, validated against the unfused graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_llama_decode_captured_with_matmul_groups(dtype):
    gpu_llama_decode(dtype, _TOLERANCE[dtype])
    assert len(_matmul_groups(fusebackend.last_report())) == 4 * 2 + 1
    assert runtime_modes() == ["fusion"]
    assert fusebackend.stats()["recordings"] >= 1 and fusebackend.stats()["cache_hits"] >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("update", ["load_state_dict", "param.data", "mul_"])
def test_gpu_weights_changed_after_capture_are_read_as_they_are(update):
    torch.manual_seed(7)
    mlp = _Mlp(256, 688).eval().to("cuda", torch.float16)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    compiled = torch.compile(mlp, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):  # captured on the 2nd call, replayed on the 3rd
            assert_close(compiled(x), mlp(x), **_TOLERANCE[torch.float16])
        if update == "load_state_dict":
            mlp.load_state_dict({k: torch.randn_like(v) for k, v in mlp.state_dict().items()})
        elif update == "param.data":
            mlp.up.weight.data = torch.randn_like(mlp.up.weight)
        else:
            mlp.gate.weight.mul_(2)
        for _ in range(2):
            assert_close(compiled(x), mlp(x), **_TOLERANCE[torch.float16])
    assert len(_matmul_groups(fusebackend.last_report())) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matmul_kernels_are_compiled_and_loaded_before_the_first_launch():
    # K is a constant of the kernel: a width this process has not compiled yet makes fresh
    # kernels, whose loads must happen in the precompile's workers, not at the first launch
    import threading

    import triton

    width = 128 + 8 * int(torch.randint(1, 60, ()).item())
    loads: list[str] = []
    triton.knobs.runtime.kernel_load_start_hook = lambda *a, **k: loads.append(
        threading.current_thread().name
    )
    try:
        mlp = _Mlp(width, 2 * width).eval().to("cuda", torch.float16)
        x = torch.randn(1, 1, width, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            actual = torch.compile(mlp, backend="infinifuse")(x)
            assert_close(actual, mlp(x), **_TOLERANCE[torch.float16])
    finally:
        triton.knobs.runtime.kernel_load_start_hook = None
    assert len(_matmul_groups(fusebackend.last_report())) == 2
    assert loads, "no kernel was compiled in this test"
    assert threading.main_thread().name not in loads, loads


def test_a_weight_of_two_to_the_31_elements_stays_with_cublas():
    # The kernel's weight offsets are 32-bit: a 128k x 16k LM head would wrap. Fake tensors:
    # nothing is allocated.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.passes.matmul_groups import use_matmul_groups

    graph = torch.fx.Graph()
    with FakeTensorMode():
        values = {"x": torch.empty(1, 16384, dtype=torch.float16),
                  "w": torch.empty(131072, 16384, dtype=torch.float16)}  # fmt: skip
    nodes = {}
    for name, value in values.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = value
    out = graph.call_function(F.linear, (nodes["x"], nodes["w"]))
    out.meta["example_value"] = values["x"] @ values["w"].t()
    graph.output(out)
    found = use_matmul_groups(graph, lambda group: None, lambda device: True)
    assert found.made == [] and found.left_alone == [
        "linear: a weight of 2147483648 elements (>= 2**31): cuBLAS"
    ], found
