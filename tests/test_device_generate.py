"""infinifuse's device decode loop (fusebackend.generate, DeviceDecoding) against transformers'
own generate() with a static cache.

Greedy tokens are compared exactly (tiny random models: logits differ by far more than fp32
rounding). Sampling is compared with transformers' own sampling under the same seed: the loop
draws as torch.multinomial does. Most tests run the decode step eagerly (``backend=None``):
the loop's logic is the same with any backend, and each infinifuse decode step takes about a
second in Triton's interpreter; the per-family tests run it through infinifuse.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusebackend
from fusebackend.generation import DeviceDecoding, last_report, selection, support

pytest.importorskip("transformers")

import model_zoo  # noqa: E402
from helpers import perturb_uniform_parameters  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList, StaticCache  # noqa: E402
from transformers.generation import logits_process as lp  # noqa: E402

PROMPT = 9
FAMILIES = ["llama", "qwen2", "gemma", "gpt2"]


def _model(family: str = "llama", device: str = "cpu", dtype: torch.dtype = torch.float32):
    return perturb_uniform_parameters(model_zoo.build_causal_lm(family, dtype=dtype, device=device))


def _prompt(batch: int = 1, device: str = "cpu", seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model_zoo.VOCAB, (batch, PROMPT), generator=g).to(device)


def _both(model, ids, *, k: int = 4, backend: str | None = None, **kwargs):
    """transformers' tokens (eager, static cache) and the loop's, for the same arguments."""
    kwargs = {"do_sample": False, "cache_implementation": "static", **kwargs}
    expected = model.generate(ids, disable_compile=True, **kwargs)
    actual = fusebackend.generate(model, ids, decode_steps=k, backend=backend, **kwargs)
    return actual, expected


def _stop_token_mid_chunk(tokens: list[int], k: int) -> tuple[int, int]:
    """A token of a greedy run whose first occurrence is neither the first token (the
    prefill's) nor the last of its k-step chunk, and that occurrence's index."""
    for i, t in enumerate(tokens):
        if i >= 1 and tokens.index(t) == i and (i - 1) % k != k - 1:
            return t, i
    pytest.skip(f"no token of {tokens} stops inside a chunk")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_generate_through_infinifuse(family):
    model = _model(family)
    actual, expected = _both(model, _prompt(), k=4, backend="infinifuse", max_new_tokens=6)
    assert actual.tolist() == expected.tolist()
    report = last_report()
    assert report.path == "device loop" and report.new_tokens == 6, report
    # the decode step ran through infinifuse (a graph compiled and its cache served it)
    assert fusebackend.reports().graphs, "no graph was compiled"
    assert fusebackend.stats()["cache_hits"] >= 1, fusebackend.stats()


def test_an_eos_inside_a_chunk_stops_where_generate_stops():
    model = _model("llama")
    ids = _prompt()
    k = 4
    free = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    eos, index = _stop_token_mid_chunk(free[0, PROMPT:].tolist(), k)
    actual, expected = _both(
        model, ids, k=k, backend="infinifuse", max_new_tokens=12, eos_token_id=eos
    )
    assert actual.tolist() == expected.tolist()
    assert actual.shape[1] == PROMPT + index + 1  # generation stopped at the EOS token
    report = last_report()
    assert report.new_tokens == index + 1
    # the chunk holding the EOS ran on past it; those steps' tokens were dropped
    assert report.steps > index, report


def test_a_batch_stops_row_by_row_and_pads_finished_rows():
    model = _model("llama")
    ids = _prompt(batch=2, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is left-padded
    ids[1, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "pad_token_id": 0}
    free = model.generate(ids, do_sample=False, cache_implementation="static", **kwargs)
    row0, row1 = free[0, PROMPT:].tolist(), free[1, PROMPT:].tolist()
    # an EOS that row 0 reaches and row 1 does not reach as early
    eos = next(t for t in row0[1:] if t not in row1[: row0.index(t) + 1])
    actual, expected = _both(model, ids, k=3, eos_token_id=eos, **kwargs)
    assert actual.tolist() == expected.tolist()
    stop = row0.index(eos)
    assert actual.shape[1] > PROMPT + stop + 1, "row 1 should go on after row 0 stopped"
    assert (actual[0, PROMPT + stop + 1 :] == 0).all(), "a finished row emits the pad token"


SAMPLING = {
    "do_sample": True,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.9,
    "repetition_penalty": 1.3,
    "max_new_tokens": 8,
    "cache_implementation": "static",
}


def test_sampling_with_a_seed_repeats_and_draws_what_generate_draws():
    model = _model("llama")
    ids = _prompt()
    torch.manual_seed(11)
    expected = model.generate(ids, **SAMPLING)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(fusebackend.generate(model, ids, decode_steps=3, backend=None, **SAMPLING))
    assert runs[0].tolist() == runs[1].tolist()
    assert runs[0].tolist() == expected.tolist()
    # the generator advances across chunks: a different seed draws other tokens
    torch.manual_seed(12)
    other = fusebackend.generate(model, ids, decode_steps=3, backend=None, **SAMPLING)
    assert other.tolist() != runs[0].tolist()


def _processor_cases():
    eos = [2, 7]
    return {
        "temperature": lp.TemperatureLogitsWarper(0.6),
        "top_k": lp.TopKLogitsWarper(5),
        "top_p": lp.TopPLogitsWarper(0.8, min_tokens_to_keep=2),
        "min_p": lp.MinPLogitsWarper(0.2),
        "repetition_penalty": lp.RepetitionPenaltyLogitsProcessor(1.7),
        "min_length_short": lp.MinLengthLogitsProcessor(20, eos),
        "min_length_reached": lp.MinLengthLogitsProcessor(5, eos),
        "min_new_tokens_short": lp.MinNewTokensLengthLogitsProcessor(6, 8, eos),
        "min_new_tokens_reached": lp.MinNewTokensLengthLogitsProcessor(6, 2, eos),
        "suppress_tokens": lp.SuppressTokensLogitsProcessor([3, 4, 200], device="cpu"),
    }


@pytest.mark.parametrize("name", sorted(_processor_cases()))
def test_each_processor_gives_the_scores_transformers_gives(name):
    processor = _processor_cases()[name]
    vocab, length = 50, 11
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, vocab, generator=g) * 3
    input_ids = torch.randint(0, vocab, (3, length), generator=g)
    expected = processor(input_ids, scores.clone())
    forms, reason = support.device_processors([processor], vocab, torch.device("cpu"))
    assert reason is None and len(forms) == 1, reason
    seen = torch.zeros(3, vocab, dtype=torch.bool).scatter_(1, input_ids, True)
    context = selection.Context(torch.tensor(length), seen)
    actual = selection.process(scores.clone(), forms, context)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


class _Host(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"num_beams": 2}, "beam search (num_beams=2)"),
        ({"logits_processor": LogitsProcessorList([_Host()])}, "_Host has no device form"),
        (
            {"output_scores": True, "return_dict_in_generate": True},
            "output_scores=True: the loop keeps no per-step tensors",
        ),
        ({"streamer": "STREAMER"}, "streamer: a streamer is called on the host"),
        ({"cache_implementation": "dynamic"}, "the loop needs a StaticCache"),
    ],
    ids=["beams", "host_processor", "output_scores", "streamer", "dynamic_cache"],
)
def test_an_option_without_a_device_form_falls_back_with_its_reason(kwargs, reason, caplog):
    model = _model("llama")
    ids = _prompt()
    if kwargs.get("streamer") == "STREAMER":
        from transformers import TextStreamer

        class Silent(TextStreamer):
            def __init__(self):
                self.tokens = []

            def put(self, value):
                self.tokens.append(value)

            def end(self):
                pass

        kwargs = {"streamer": Silent()}
    base = {"max_new_tokens": 4, "do_sample": False}
    if "cache_implementation" not in kwargs:
        base["cache_implementation"] = "static"
    with caplog.at_level("INFO", logger="fusebackend.generation.report"):
        actual = fusebackend.generate(model, ids, backend=None, **base, **kwargs)
    expected = model.generate(ids, **base, **kwargs)
    sequences = getattr(actual, "sequences", actual)
    assert sequences.tolist() == getattr(expected, "sequences", expected).tolist()
    report = last_report()
    assert report.path == "transformers", report
    assert reason in report.reason, report.reason
    assert any(reason in r.getMessage() for r in caplog.records), "the fallback was not logged"


def test_a_sliding_window_cache_falls_back():
    model = _model("mistral")
    actual, expected = _both(model, _prompt(), max_new_tokens=4)
    assert actual.tolist() == expected.tolist()
    assert "sliding-window layers keep their length on the host" in last_report().reason


def test_the_custom_generate_hook_runs_the_loop_and_returns_a_dict_when_asked():
    model = _model("qwen2")
    ids = _prompt()
    kwargs = {"max_new_tokens": 7, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(ids, **kwargs)
    out = model.generate(ids, custom_generate=DeviceDecoding(k=3, backend=None), **kwargs)
    assert out.tolist() == expected.tolist()
    assert last_report().path == "device loop"
    full = model.generate(
        ids,
        custom_generate=DeviceDecoding(k=3, backend=None),
        return_dict_in_generate=True,
        **kwargs,
    )
    assert full.sequences.tolist() == expected.tolist()
    assert last_report().path == "device loop"


def test_a_cache_that_fills_up_ends_with_a_short_chunk_and_keeps_its_length():
    model = _model("llama")
    ids = _prompt()
    new = 9
    slots = PROMPT + new - 1  # exactly what generate needs: no room for a chunk past the end
    reference = StaticCache(config=model.config, max_cache_len=slots)
    expected = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=reference)
    cache = StaticCache(config=model.config, max_cache_len=slots)
    actual = fusebackend.generate(
        model, ids, decode_steps=4, backend=None, max_new_tokens=new, do_sample=False,
        past_key_values=cache,
    )  # fmt: skip
    assert actual.tolist() == expected.tolist()
    assert last_report().path == "device loop" and last_report().steps == new - 1
    lengths = [int(layer.cumulative_length) for layer in cache.layers]
    assert lengths == [int(layer.cumulative_length) for layer in reference.layers]


def test_steps_past_the_stop_are_rewound_in_a_users_cache():
    model = _model("llama")
    ids = _prompt()
    free = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    eos, index = _stop_token_mid_chunk(free[0, PROMPT:].tolist(), 4)
    cache = StaticCache(config=model.config, max_cache_len=64)
    fusebackend.generate(
        model, ids, decode_steps=4, backend=None, max_new_tokens=12, do_sample=False,
        eos_token_id=eos, past_key_values=cache,
    )  # fmt: skip
    assert last_report().steps > index
    # a step-by-step run leaves the prompt and every token but the last in the cache
    assert all(int(layer.cumulative_length) == PROMPT + index for layer in cache.layers)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"k": 0}, "k: expected an int in [1, 256]"),
        ({"k": 2.0}, "k: expected an int in [1, 256]"),
        ({"options": {"cudagraphs": True}}, "options['cudagraphs']: must be False"),
    ],
)
def test_bad_options_raise_naming_the_option(kwargs, error):
    with pytest.raises(ValueError) as info:
        DeviceDecoding(**kwargs)
    assert error in str(info.value)


def test_min_new_tokens_holds_back_eos_on_the_device():
    model = _model("llama")
    ids = _prompt()
    free = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    eos = free[0, PROMPT + 1].item()
    actual, expected = _both(model, ids, k=4, max_new_tokens=12, eos_token_id=eos, min_new_tokens=6)
    assert actual.tolist() == expected.tolist()
    assert actual.shape[1] >= PROMPT + 6


def test_choose_samples_as_torch_multinomial_does():
    scores = torch.randn(4, 33)
    torch.manual_seed(1)
    expected = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
    torch.manual_seed(1)
    assert selection.choose(scores, sample=True).tolist() == expected.tolist()
    assert selection.choose(scores, sample=False).tolist() == scores.argmax(-1).tolist()
    assert not math.isnan(float(selection.choose(scores, sample=True).float().sum()))


def test_a_model_dropped_by_its_user_is_released_with_its_loop():
    """The loop keeps the model weakly: its compiled forwards, cache and captured graph go
    with the model (a closure that held the model kept all of them alive until exit)."""
    import gc
    import weakref

    model = _model()
    fusebackend.generate(model, _prompt(), decode_steps=2, backend="infinifuse",
                         max_new_tokens=3, do_sample=False)  # fmt: skip
    alive = weakref.ref(model)
    del model
    torch._dynamo.reset()
    fusebackend.clear_cache()
    gc.collect()
    assert alive() is None
