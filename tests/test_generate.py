"""transformers' own generate() with a StaticCache through infinifuse: greedy tokens equal
eager's, through ``CompileConfig(backend="infinifuse")`` (transformers' documented way) and
through a compiled ``model.forward``. On the GPU, the prefill and the decode graphs must both
run captured (no signature in mode "eager"). On both, every graph runs the fused path: a
validation demotion keeps tokens equal, so only the mode shows a broken kernel.

Greedy tokens are compared exactly: the logits of a tiny random model differ between tokens by
far more than fp32 rounding, so any difference is a bug (a cache position applied twice, a
stale captured value), not noise.
"""

from __future__ import annotations

import pytest
import torch

import fusebackend

pytest.importorskip("transformers")

import model_zoo  # noqa: E402
from helpers import assert_model_fused, graphs_since, perturb_uniform_parameters  # noqa: E402
from transformers.generation import CompileConfig  # noqa: E402

# The prefill's token and 3 decode steps: the 2 after the first decode are served by its
# cache entry (sliding-window families: each step a new signature), so a stale captured value
# or a cache position applied twice still changes a token. (6 ran 2 more such steps.)
NEW_TOKENS = 4

# family -> the fewest row groups of its graphs (prefill, decode) on the CPU, with transformers
# 5.24 (2026-11-28); each graph has 9 matmul-group launches (QKV, output, gate-up, down per
# layer, 2 layers, and the LM head).
ROW_GROUPS_ON_CPU = {"llama": 2, "qwen2": 2, "mistral": 2, "gemma2": 10, "phi3": 6, "gpt2": 1}


def _generate_both_ways(family: str, how: str, device: str, dtype: torch.dtype):
    model = perturb_uniform_parameters(
        model_zoo.build_causal_lm(family, dtype=dtype, device=device)
    )
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model_zoo.VOCAB, (1, 9), generator=g).to(device)
    previous = fusebackend.reports()
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(ids, disable_compile=True, **kwargs)
    if how == "compile_config":
        config = CompileConfig(backend="infinifuse")
        config._compile_all_devices = True  # transformers compiles on CUDA only by default
        actual = model.generate(ids, compile_config=config, **kwargs)
    else:
        model.forward = torch.compile(model.forward, backend="infinifuse")
        actual = model.generate(ids, **kwargs)
    return actual, expected, graphs_since(previous)


def test_the_row_group_table_names_every_family():
    assert sorted(ROW_GROUPS_ON_CPU) == sorted(model_zoo.GENERATE_FAMILIES)


# The rotary families that the left-padded test below runs through a compiled forward are
# run here through CompileConfig alone (each such pair took 12-14 s of CI's 2-core machine).
LEFT_PADDED_FAMILIES = ["llama", "gemma2", "phi3"]


@pytest.mark.parametrize(
    ("family", "how"),
    [(f, "compile_config") for f in model_zoo.GENERATE_FAMILIES]
    + [(f, "compiled_forward") for f in model_zoo.GENERATE_FAMILIES
       if f not in LEFT_PADDED_FAMILIES],
)  # fmt: skip
def test_generate_cpu_tokens_equal_eager_fused(family, how):
    actual, expected, graphs = _generate_both_ways(family, how, "cpu", torch.float32)
    assert actual.tolist() == expected.tolist()
    assert_model_fused(graphs, row_groups=ROW_GROUPS_ON_CPU[family], matmul_launches=9)
    if family not in model_zoo.SLIDING_WINDOW_FAMILIES:
        assert fusebackend.stats()["cache_hits"] >= 1, "no decode step was served by the cache"


@pytest.mark.parametrize("family", LEFT_PADDED_FAMILIES)  # rotary, as the bug needs
def test_generate_a_left_padded_batch_of_two_cpu_tokens_equal_eager(family):
    # generate() passes position ids of the batch's size: a rotary embedding's inv_freq
    # expanded to it (stride 0) was once folded as parameter work into a buffer with those
    # strides, and the compile raised at batch 2 in every rotary family (found by a sweep of
    # architectures, 2026-11-30). The second row is padded on the left.
    model = perturb_uniform_parameters(model_zoo.build_causal_lm(family))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model_zoo.VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": NEW_TOKENS, "do_sample": False,
              "pad_token_id": 0, "cache_implementation": "static"}  # fmt: skip
    expected = model.generate(ids, disable_compile=True, **kwargs)
    previous = fusebackend.reports()
    model.forward = torch.compile(model.forward, backend="infinifuse")
    actual = model.generate(ids, **kwargs)
    assert actual.tolist() == expected.tolist()
    assert_model_fused(graphs_since(previous))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("how", ["compile_config", "compiled_forward"])
@pytest.mark.parametrize("family", model_zoo.GENERATE_FAMILIES)
def test_generate_gpu_tokens_equal_eager_and_captured(family, how, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    actual, expected, graphs = _generate_both_ways(family, how, "cuda", dtype)
    assert actual.tolist() == expected.tolist()
    assert_model_fused(graphs)
    modes = fusebackend.stats()["fusion_modes"]
    # A compiled forward compiles the prefill and the decode step; CompileConfig leaves the
    # prefill to eager in transformers 5.x (GenerationMixin._prefill), so only decode there.
    least = 2 if how == "compiled_forward" else 1
    assert len(modes) >= least, f"expected {least} signature(s) (prefill, decode), got {modes}"
    # Sliding-window families too: the host split keeps their per-token int out of the key.
    assert fusebackend.stats()["cache_hits"] >= 1, "no decode step was served by the cache"
    uncaptured = {k: m for k, m in modes.items() if m == "eager"}
    assert not uncaptured, (uncaptured, fusebackend.stats()["fallback_reasons"])
