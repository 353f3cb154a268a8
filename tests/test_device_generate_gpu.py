"""The device loop's CUDA-graph path: k decode steps captured as one graph and replayed.

Greedy tokens are compared with transformers' eager generate() (fp16/bf16 tiny models, as
tests/test_generate.py's GPU test does) and with the loop run uncaptured (``capture=False``):
the captured replays must choose exactly what the same steps choose one by one. Sampling
replays must draw what uncaptured steps draw under the same seed (the default CUDA
generator's philox offset advances per replay).
"""

from __future__ import annotations

import pytest
import torch

import fusebackend
from fusebackend.generation import last_report

pytest.importorskip("transformers")

import model_zoo  # noqa: E402
from helpers import perturb_uniform_parameters  # noqa: E402
from transformers import StaticCache  # noqa: E402

PROMPT = 9


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _model(family: str, dtype: torch.dtype):
    return perturb_uniform_parameters(model_zoo.build_causal_lm(family, dtype=dtype, device="cuda"))


def _prompt(batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, model_zoo.VOCAB, (batch, PROMPT), generator=g).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2"])
def test_captured_greedy_tokens_equal_generate(family, dtype):
    _needs_cuda()
    model = _model(family, dtype)
    ids = _prompt()
    kwargs = {"max_new_tokens": 20, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(ids, disable_compile=True, **kwargs)
    uncaptured = fusebackend.generate(model, ids, decode_steps=4, capture=False, **kwargs)
    captured = fusebackend.generate(model, ids, decode_steps=4, **kwargs)
    report = last_report()
    assert report.path == "device loop" and report.captured and report.replays >= 3, report
    assert captured.tolist() == uncaptured.tolist()
    assert captured.tolist() == expected.tolist()
    # a second call reuses the captured graph (the loop keeps its cache and buffers)
    again = fusebackend.generate(model, ids, decode_steps=4, **kwargs)
    assert again.tolist() == expected.tolist()
    assert last_report().captures == 0 and last_report().replays >= 3, last_report()


@pytest.mark.gpu
def test_the_eos_flag_stops_inside_a_replay():
    _needs_cuda()
    model = _model("llama", torch.float16)
    ids = _prompt()
    k = 4
    free = model.generate(ids, max_new_tokens=24, do_sample=False, cache_implementation="static")
    tokens = free[0, PROMPT:].tolist()
    # the first token that first appears after the warm-up chunk, not last in its replay
    index = next(
        i
        for i, t in enumerate(tokens)
        if i > k + 1 and tokens.index(t) == i and (i - 1) % k != k - 1
    )
    kwargs = {"max_new_tokens": 24, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(ids, eos_token_id=tokens[index], **kwargs)
    actual = fusebackend.generate(model, ids, decode_steps=k, eos_token_id=tokens[index], **kwargs)
    assert actual.tolist() == expected.tolist()
    report = last_report()
    assert report.captured and report.new_tokens == index + 1 and report.steps > index, report


@pytest.mark.gpu
def test_a_cache_that_fills_up_ends_uncaptured_and_equals_generate():
    _needs_cuda()
    model = _model("llama", torch.float16)
    ids = _prompt()
    new = 15  # 14 decode steps: 3 replays of 4, then 2 steps that do not fit a replay
    slots = PROMPT + new - 1
    reference = StaticCache(config=model.config, max_cache_len=slots)
    expected = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=reference)
    cache = StaticCache(config=model.config, max_cache_len=slots)
    actual = fusebackend.generate(
        model, ids, decode_steps=4, max_new_tokens=new, do_sample=False, past_key_values=cache
    )
    assert actual.tolist() == expected.tolist()
    report = last_report()
    assert report.captured and report.steps == new - 1, report
    lengths = [int(layer.cumulative_length) for layer in cache.layers]
    assert lengths == [int(layer.cumulative_length) for layer in reference.layers]


@pytest.mark.gpu
def test_captured_sampling_repeats_with_a_seed_and_equals_uncaptured_steps():
    _needs_cuda()
    model = _model("llama", torch.float16)
    ids = _prompt(batch=2)
    kwargs = {
        "do_sample": True, "temperature": 0.8, "top_k": 30, "top_p": 0.95,
        "repetition_penalty": 1.2, "max_new_tokens": 20, "cache_implementation": "static",
    }  # fmt: skip
    runs = []
    for capture in (True, True, False):
        torch.manual_seed(7)
        runs.append(fusebackend.generate(model, ids, decode_steps=4, capture=capture, **kwargs))
        assert last_report().captured == capture, last_report()
    assert runs[0].tolist() == runs[1].tolist(), "the same seed drew other tokens"
    assert runs[0].tolist() == runs[2].tolist(), "replays drew other numbers than steps"
