"""Model zoo: 21 transformers architectures from small configs, compiled with infinifuse,
equal eager on padded batches, through the fused path: every graph rewritten, every signature
in mode "fusion" (first-run validation demotes a graph whose kernels disagree with the unfused
graph, and its outputs then equal eager's: only the mode shows the broken kernel), and on the
CPU at least the row groups and matmul-group launches each family had when the table below
was taken (transformers 5.24, 2026-11-28). On the GPU (fp32 and fp16) every signature is also
captured.

Tolerances: fp32 uses assert_close's defaults. fp16 uses 2e-2: the fused kernels compute in
fp32 and round once where eager rounds each op, and two transformer layers of random weights
carry such one-ulp differences (fp16 ulp ~1e-3 relative) through LayerNorm/RMSNorm and
attention, which amplify them a few times.
"""

from __future__ import annotations

import pytest
import torch

import fusebackend

pytest.importorskip("transformers")

import model_zoo  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)
from helpers import assert_model_fused, graphs_since, perturb_uniform_parameters  # noqa: E402

FAMILIES = sorted(model_zoo.ZOO)
_FP16_TOL = {"rtol": 2e-2, "atol": 2e-2}

# family -> (row groups, matmul-group launches) of its graph on the CPU. Falcon's FalconLinear
# computes `x @ weight.T`, a matmul of the weight's transpose: per layer input_layernorm +
# query_key_value and dense_h_to_4h (parallel attention: one input), dense, dense_4h_to_h;
# the LayerNorms and MLP products that moved into them left 7 row groups of the 9 before.
FUSED_ON_CPU = {
    "albert": (1, 10), "bert": (1, 9), "bloom": (5, 8), "distilbert": (1, 8),
    "electra": (1, 9), "falcon": (7, 6), "gemma": (4, 8), "gemma2": (9, 8), "gpt2": (1, 8),
    "gpt_neox": (7, 8), "gptj": (7, 8), "llama": (3, 8), "mistral": (3, 8), "mpnet": (3, 9),
    "opt": (1, 8), "phi3": (7, 8), "qwen2": (3, 8), "roberta": (1, 9), "stablelm": (6, 8),
    "t5_encoder": (5, 8), "xlm_roberta": (1, 9),
}  # fmt: skip


def _run(family: str, dtype: torch.dtype, device: str) -> list:
    """Compile ``family``, check two calls against eager; return the graphs compiled."""
    previous = fusebackend.reports()
    model = perturb_uniform_parameters(model_zoo.build(family, dtype=dtype, device=device))
    x = model_zoo.inputs(family, device=device)
    with torch.no_grad():
        expected = model_zoo.main_output(model(**x))
        compiled = torch.compile(model, backend="infinifuse")
        first = model_zoo.main_output(compiled(**x)).clone()
        second = model_zoo.main_output(compiled(**x))  # a hit: replayed where captured
    tol = _FP16_TOL if dtype == torch.float16 else {}
    torch.testing.assert_close(first, expected, equal_nan=True, **tol)
    torch.testing.assert_close(second, expected, equal_nan=True, **tol)
    assert fusebackend.stats()["cache_hits"] >= 1, "the second call was not served by the cache"
    return graphs_since(previous)


def test_the_fused_table_names_every_family():
    assert sorted(FUSED_ON_CPU) == FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_cpu_equals_eager_fused(family):
    graphs = _run(family, torch.float32, "cpu")
    row_groups, matmul_launches = FUSED_ON_CPU[family]
    assert_model_fused(graphs, row_groups=row_groups, matmul_launches=matmul_launches)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_gpu_equals_eager_and_captures(family, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    graphs = _run(family, dtype, "cuda")
    assert_model_fused(graphs)
    assert fusebackend.stats()["recordings"] >= 1, "nothing was captured"


# family -> ops its fused fp16 graph no longer runs (each a launch a layer or more before
# 2026-11-29): GPT-J's pairwise rotation (stack, neg), its sine tables (gather, repeats) and
# partial rotary cat; GPT-NeoX's and StableLM's partial rotary cat; T5's clamp bound (where,
# neg of the 0-d flag).
GONE_ON_CPU = {
    "gptj": {"cat", "stack", "neg", "gather", "repeat_interleave", "to"},
    "gpt_neox": {"cat"},
    "stablelm": {"cat"},
    "t5_encoder": {"where", "neg"},
}


@pytest.mark.parametrize("family", sorted(GONE_ON_CPU))
def test_zoo_fp16_graph_runs_none_of_the_ops_fused_away(family, fused_graphs):
    _run(family, torch.float16, "cpu")
    nodes = [n for g in fused_graphs if g is not None for n in g.graph.nodes]
    left = {getattr(n.target, "__name__", n.target) for n in nodes
            if n.op in ("call_function", "call_method")}  # fmt: skip
    assert not left & GONE_ON_CPU[family], sorted(left & GONE_ON_CPU[family])
    for node in nodes:  # every attention mask reaches SDPA with its keys at stride 1
        mask = node.kwargs.get("attn_mask") if node.op == "call_function" else None
        if node.target is torch.nn.functional.scaled_dot_product_attention and mask is not None:
            assert mask.meta["example_value"].stride(-1) == 1, node.name
