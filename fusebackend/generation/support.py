"""Which generate() options the device loop runs, and the reason when it cannot.

transformers prepares a ``LogitsProcessorList`` and a ``StoppingCriteriaList`` from the
``GenerationConfig`` (and the user's own lists) before it calls a decoding method. The loop
reads them object by object: each class it knows becomes its device form
(``selection.py``, stopping tokens), and the first one it does not know is the reason to run
transformers' own loop instead. So a processor the user passes is honoured when it has a
device form and never silently dropped when it has none.

Every check returns a reason string (None: supported); none raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

import fusebackend.generation.selection as selection

__all__ = [
    "MODEL_INPUTS",
    "StopRule",
    "cache_name",
    "config_reason",
    "device_processors",
    "stop_rule",
    "static_cache_reason",
]

# Model inputs the decode step feeds itself; any other non-None model kwarg of generate() is a
# reason to fall back (the loop would otherwise drop it).
MODEL_INPUTS = frozenset(
    {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values"}
)


def cache_name(model_kwargs: Mapping[str, Any]) -> str | None:
    """The key the model's cache has in generate()'s model kwargs: ``cache`` (transformers
    5.24), ``past_key_values`` (5.17), or None without a cache."""
    for name in ("cache", "past_key_values"):
        if model_kwargs.get(name) is not None:
            return name
    return None


def config_reason(
    model: Any, generation_config: Any, model_kwargs: Mapping[str, Any]
) -> str | None:
    """Why the options of ``generation_config`` and ``model_kwargs`` cannot run on the device
    (None: they can)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (decoder-only causal LMs only)"
    beams = generation_config.num_beams or 1
    if beams > 1:
        return f"beam search (num_beams={beams}) keeps several hypotheses per row"
    for option in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, option, False) and generation_config.return_dict_in_generate:
            return f"{option}=True: the loop keeps no per-step tensors"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size: chunked prefill is transformers' own"
    if generation_config.use_cache is False:
        return "use_cache=False: the loop decodes from a static KV cache"
    if getattr(generation_config, "penalty_alpha", None):
        return "contrastive search (penalty_alpha)"
    extra = sorted(
        key for key, value in model_kwargs.items() if value is not None and key not in MODEL_INPUTS
    )
    if extra:
        return (
            f"model input(s) {', '.join(extra)}: the decode step feeds only ids, positions and mask"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return f"a {mask.dim()}-D attention_mask (2-D only)"
    return None


def static_cache_reason(cache: Any) -> str | None:
    """Why ``cache`` cannot serve the device loop: every layer must be a full-attention static
    layer whose position is a device tensor (transformers' ``StaticLayer``), and the cache
    empty (None: it can)."""
    if cache is None:
        return "no cache: pass cache_implementation='static' or a StaticCache"
    from transformers.cache_utils import StaticCache, StaticLayer

    layers = getattr(cache, "layers", None)
    if not isinstance(cache, StaticCache) or not layers:
        return (
            f"a {type(cache).__name__}: the loop needs a StaticCache "
            "(cache_implementation='static')"
        )
    for layer in layers:
        if type(layer) is not StaticLayer:
            # Sliding-window layers keep a Python int of their length beside the tensor
            # (cumulative_length_int): a captured graph would replay a stale value.
            return (
                f"cache layer {type(layer).__name__}: only full-attention static layers "
                "(sliding-window layers keep their length on the host)"
            )
    if getattr(cache, "offloading", False):
        return "an offloaded static cache"
    first = layers[0]
    if first.is_initialized and int(first.cumulative_length) != 0:
        return "the cache already holds tokens (continuing a generation)"
    return None


def device_processors(
    processors: Iterable[Any], vocab_size: int, device: torch.device
) -> tuple[list[Any], str | None]:
    """The device forms of transformers' ``processors`` (in order), or the reason the first
    one without a device form stops the loop."""
    from transformers.generation import logits_process as lp

    out: list[Any] = []
    for p in processors:
        kind = type(p)
        if kind is lp.TemperatureLogitsWarper:
            out.append(selection.Temperature(float(p.temperature)))
        elif kind is lp.TopKLogitsWarper:
            out.append(selection.TopK(int(p.top_k), float(p.filter_value)))
        elif kind is lp.TopPLogitsWarper:
            out.append(
                selection.TopP(float(p.top_p), float(p.filter_value), int(p.min_tokens_to_keep))
            )
        elif kind is getattr(lp, "MinPLogitsWarper", None):
            out.append(
                selection.MinP(float(p.min_p), float(p.filter_value), int(p.min_tokens_to_keep))
            )
        elif kind is lp.RepetitionPenaltyLogitsProcessor:
            ignore = getattr(p, "prompt_ignore_length", None)
            if ignore is not None:
                return out, "repetition penalty with prompt_ignore_length"
            out.append(selection.RepetitionPenalty(float(p.penalty)))
        elif kind is lp.MinLengthLogitsProcessor:
            eos = selection.vocab_mask(_ids(p.eos_token_id), vocab_size, device)
            out.append(selection.MinLength(int(p.min_length), eos))
        elif kind is lp.MinNewTokensLengthLogitsProcessor:
            eos = selection.vocab_mask(_ids(p.eos_token_id), vocab_size, device)
            out.append(
                selection.MinNewTokens(int(p.prompt_length_to_skip), int(p.min_new_tokens), eos)
            )
        elif kind is lp.SuppressTokensLogitsProcessor:
            tokens = selection.vocab_mask(_ids(p.suppress_tokens), vocab_size, device)
            out.append(selection.SuppressTokens(tokens))
        else:
            return out, f"logits processor {kind.__name__} has no device form"
    return out, None


@dataclasses.dataclass(frozen=True)
class StopRule:
    """What stops a row: ``eos`` (token ids; empty: none) and ``max_length`` (the whole
    sequence, prompt included), from transformers' stopping criteria."""

    eos: tuple[int, ...]
    max_length: int


def stop_rule(criteria: Iterable[Any]) -> tuple[StopRule | None, str | None]:
    """The ``StopRule`` of transformers' stopping ``criteria``, or the reason one of them
    cannot be checked on the device."""
    from transformers.generation import stopping_criteria as sc

    eos: list[int] = []
    max_length = None
    for c in criteria:
        kind = type(c)
        if kind is sc.MaxLengthCriteria:
            max_length = int(c.max_length) if max_length is None else min(max_length, c.max_length)
        elif kind is sc.EosTokenCriteria:
            eos.extend(_ids(c.eos_token_id))
        else:
            return None, f"stopping criterion {kind.__name__} runs on the host"
    if max_length is None:
        return None, "no max_length: the loop needs a bound (max_new_tokens or max_length)"
    return StopRule(tuple(dict.fromkeys(eos)), max_length), None


def _ids(value: Any) -> list[int]:
    """Token ids given as an int, a list or a tensor, as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
