"""The ways in: ``fusebackend.generate(model, input_ids, **kwargs)`` and the
``custom_generate`` callable ``DeviceDecoding``.

transformers' ``generate()`` takes a callable as ``custom_generate`` (5.17 and 5.24 both):
it prepares the generation config, the special tokens, the attention mask, the position ids,
the cache, the logits processors and the stopping criteria as usual, then calls the callable
instead of its own loop. ``DeviceDecoding`` is such a callable: it runs the device loop
(``loop.py``) when every option has a device form and transformers' own decoding method
otherwise, with the reason in ``last_report()`` and the log.

transformers hands a callable neither the streamer nor the assistant model nor
``synced_gpus`` (``_extract_generation_mode_kwargs`` keeps only the callable's own extra
parameters), so ``fusebackend.generate`` checks those before it calls ``generate()`` and
falls back there.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

import fusebackend.generation.report as _report
import fusebackend.generation.support as support
from fusebackend.generation.loop import loop_for, make_plan

__all__ = ["DEFAULT_K", "DeviceDecoding", "generate"]

# Decode steps per chunk (per CUDA-graph replay). To be set by measurement on the GPU
# (benchmarks/fast_generate.py sweeps 1, 4, 8, 16); 8 until then.
DEFAULT_K = 8

# generate() arguments a custom_generate callable never sees (transformers drops them):
# fusebackend.generate falls back on them before calling generate().
_HOST_ONLY = {
    "streamer": "a streamer is called on the host with every token",
    "assistant_model": "assisted generation runs a second model",
    "synced_gpus": "synced_gpus (ZeRO-3/FSDP) syncs every step across ranks",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "stop_strings": "stop strings are matched on the host",
    "inputs_embeds": "inputs_embeds (the loop starts from input_ids)",
    "custom_generate": "another custom_generate was given",
}


class DeviceDecoding:
    """A ``custom_generate`` callable that runs infinifuse's device loop::

        model.generate(ids, max_new_tokens=64, cache_implementation="static",
                       custom_generate=DeviceDecoding(k=8))

    Args:
        k: Decode steps per chunk: per CUDA-graph replay on a GPU, per stop-flag read always.
        backend: The ``torch.compile`` backend of the decode step (None: eager, no compile).
        options: Backend options; for infinifuse ``cudagraphs`` is False (the loop captures
            the k steps itself, and the runtime must not capture inside that capture).
        capture: Capture the k steps in a CUDA graph (on CUDA devices; False runs them
            directly, as on a CPU).
        started: ``time.perf_counter()`` when the user's call began (the report's time to
            first token counts from it; default: when generate() calls this).
    """

    def __init__(
        self,
        k: int = DEFAULT_K,
        backend: str | None = "infinifuse",
        options: dict[str, Any] | None = None,
        capture: bool = True,
        started: float | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 256:
            raise ValueError(f"k: expected an int in [1, 256] (decode steps per chunk), got {k!r}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                f"backend: expected a torch.compile backend name or None, got {backend!r}"
            )
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options: expected a dict of backend options, got {type(options)}")
        options = dict(options or {})
        if backend == "infinifuse":
            if options.get("cudagraphs", False) is not False:
                raise ValueError(
                    "options['cudagraphs']: must be False for the device loop (it captures the "
                    f"k steps itself), got {options['cudagraphs']!r}"
                )
            options["cudagraphs"] = False
        self.k, self.backend, self.options, self.capture = k, backend, options, capture
        self.started = started

    def __call__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> Any:
        started = self.started if self.started is not None else time.perf_counter()
        self.started = None  # a later call through the same object counts from its own start
        plan, reason = self._plan(
            model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs
        )
        if reason is not None:
            _report.record(_report.GenerateReport(path="transformers", reason=reason))
            return _transformers_loop(
                model,
                input_ids,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                generation_config=generation_config,
                synced_gpus=synced_gpus,
                streamer=streamer,
                **model_kwargs,
            )
        loop = loop_for(model)
        key = support.cache_name(model_kwargs)
        cache = model_kwargs[key]
        returned = generation_config.return_dict_in_generate
        if not getattr(cache, "_is_user_defined", False) and not returned:
            # generate() made this cache for this call: use the loop's own (k - 1 slots more,
            # so that the last chunk is a replay too), whose addresses a captured graph keeps.
            slots = cache.layers[0].max_cache_len + self.k - 1
            model_kwargs = {**model_kwargs, key: loop.own_cache(cache, slots)}
        mask = model_kwargs.get("attention_mask")
        forward = loop.forward(
            key,
            positions=model_kwargs.get("position_ids") is not None,
            mask=mask is not None,
            logits_to_keep="logits_to_keep" in model_kwargs,
            backend=self.backend,
            options=self.options,
        )
        prefill = loop.prefill(self.backend, self.options, input_ids.device)
        sequences, report = loop.run(
            input_ids, plan, model_kwargs, key, forward, self.k, self.capture, started, prefill
        )
        _report.record(report)
        if not returned:
            return sequences
        return _decoder_only_output(sequences, model_kwargs[key])

    def _plan(
        self,
        model: Any,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        model_kwargs: dict[str, Any],
    ) -> tuple[Any, str | None]:
        """The loop's ``Plan`` for this call, or the reason it falls back."""
        from transformers.generation.configuration_utils import GenerationMode

        reason = support.config_reason(model, generation_config, model_kwargs)
        if reason is not None:
            return None, reason
        mode = generation_config.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            return None, f"generation mode {mode.value}: the device loop runs greedy and sampling"
        device = getattr(model, "device", input_ids.device)
        if input_ids.device != device:
            return None, f"input_ids on {input_ids.device}, the model on {device}"
        reason = support.static_cache_reason(model_kwargs.get(support.cache_name(model_kwargs)))
        if reason is not None:
            return None, reason
        stop, reason = support.stop_rule(stopping_criteria)
        if reason is not None:
            return None, reason
        vocab = model.config.get_text_config(decoder=True).vocab_size
        processors, reason = support.device_processors(logits_processor, vocab, input_ids.device)
        if reason is not None:
            return None, reason
        pad = generation_config._pad_token_tensor
        pad = None if pad is None else int(pad)
        if stop.eos and pad is None:
            return None, "EOS without a pad token for finished rows"
        if stop.max_length <= input_ids.shape[1]:
            return None, "no new tokens to generate (max_length <= prompt length)"
        return make_plan(processors, bool(generation_config.do_sample), stop, pad), None


def _transformers_loop(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> Any:
    """transformers' own decoding method for the config's generation mode (the fallback)."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    mode = kwargs["generation_config"].get_generation_mode()
    name = GENERATION_MODES_MAPPING.get(mode)
    if name is None or "/" in name:  # a mode moved to the Hub: generate() loads it itself
        raise ValueError(
            f"generation mode {mode.value} runs from the Hub ({name}); call model.generate "
            "without custom_generate"
        )
    if kwargs.get("streamer") is None:
        kwargs.pop("streamer", None)  # _beam_search takes no streamer
    return getattr(type(model), name)(model, input_ids, **kwargs)


def _decoder_only_output(sequences: torch.Tensor, cache: Any) -> Any:
    """generate()'s ``GenerateDecoderOnlyOutput`` (its cache field is ``cache`` in 5.24,
    ``past_key_values`` in 5.17)."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    name = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=sequences, **{name: cache})


def generate(
    model: Any,
    input_ids: torch.Tensor | None = None,
    *,
    decode_steps: int = DEFAULT_K,
    backend: str | None = "infinifuse",
    options: dict[str, Any] | None = None,
    capture: bool = True,
    **generate_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` with infinifuse's device loop.

    Returns what ``generate()`` returns (the sequences, or a ``GenerateDecoderOnlyOutput``
    with ``return_dict_in_generate=True``). Without a cache argument the cache is static
    (``cache_implementation="static"``). Options the loop cannot run on the device (beam
    search, a streamer, a logits processor without a device form, ...) run transformers'
    own loop instead; ``fusebackend.generation.last_report()`` says which ran and why.

    Args:
        model: A transformers causal LM (decoder-only).
        input_ids: The prompt, ``[batch, length]``, left-padded with an ``attention_mask``
            for rows of different lengths.
        decode_steps: k, the decode steps per chunk (per CUDA-graph replay).
        backend: The decode step's ``torch.compile`` backend (None: eager).
        options: The backend's options (``cudagraphs`` stays False).
        capture: Capture the k steps as one CUDA graph on CUDA devices.
        **generate_kwargs: As for ``model.generate``.
    """
    started = time.perf_counter()
    decoding = DeviceDecoding(decode_steps, backend, options, capture, started=started)
    reason = _entry_reason(model, generate_kwargs)
    if reason is not None:
        _report.record(_report.GenerateReport(path="transformers", reason=reason))
        return model.generate(input_ids, **generate_kwargs)
    kwargs = dict(generate_kwargs)
    if _wants_default_cache(model, kwargs):
        kwargs["cache_implementation"] = "static"
    return model.generate(input_ids, custom_generate=decoding, **kwargs)


def _entry_reason(model: Any, kwargs: dict[str, Any]) -> str | None:
    """A reason visible only before generate() (what a callable is never handed)."""
    params = inspect.signature(model.generate).parameters
    if "custom_generate" not in params:
        return "this transformers' generate() takes no custom_generate callable"
    for name, why in _HOST_ONLY.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            return f"{name}: {why}"
    return None


def _wants_default_cache(model: Any, kwargs: dict[str, Any]) -> bool:
    if any(kwargs.get(name) is not None for name in ("cache", "past_key_values")):
        return False
    if kwargs.get("cache_implementation") is not None:
        return False
    config = kwargs.get("generation_config") or model.generation_config
    return getattr(config, "cache_implementation", None) is None
