"""Token selection on the device: logits processors and the token choice as tensor functions.

Every function here is a pure function of device tensors: no ``.item()``, no Python branch on
a tensor's value, no host copy, so a decode step built from them can be captured in a CUDA
graph and replayed. Values that transformers' processors read from the host (the length of
``input_ids``, the tokens seen so far) are device tensors of the loop's state instead
(``Context``).

Each processor mirrors one of transformers' classes (``transformers.generation.logits_process``)
and gives the same scores for the same input: the tests compare them on random logits.

Sampling draws ``q ~ Exp(1)`` per vocabulary entry and takes ``argmax(probs / q)``: the
algorithm ``torch.multinomial`` itself uses for one sample, without its validity check, whose
``.item()`` is a host sync that a CUDA graph cannot capture. It consumes the generator as
``torch.multinomial(probs, 1)`` does, so a seed gives the tokens transformers' own sampling
gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "Context",
    "MinLength",
    "MinNewTokens",
    "MinP",
    "RepetitionPenalty",
    "SuppressTokens",
    "Temperature",
    "TopK",
    "TopP",
    "choose",
    "process",
    "vocab_mask",
]


@dataclasses.dataclass(frozen=True)
class Context:
    """The loop state a processor may read, all on the device.

    Attributes:
        length: 0-d int64, the length ``input_ids`` has when this token is chosen (prompt and
            padding included), as transformers' processors read ``input_ids.shape[-1]``.
        seen: ``[batch, vocab]`` bool, the tokens each row holds (prompt, padding and the
            tokens chosen so far), or None when no processor reads it.
    """

    length: Tensor
    seen: Tensor | None = None


def vocab_mask(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> Tensor:
    """A ``[vocab]`` bool mask that is True at ``token_ids`` (ids outside the vocabulary are
    ignored, as ``torch.isin`` over ``arange(vocab)`` ignores them)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = [t for t in token_ids if 0 <= t < vocab_size]
    if ids:
        mask[torch.tensor(ids, device=device)] = True
    return mask


@dataclasses.dataclass(frozen=True)
class Temperature:
    """``TemperatureLogitsWarper``: scores / temperature."""

    temperature: float
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        return scores / self.temperature


@dataclasses.dataclass(frozen=True)
class TopK:
    """``TopKLogitsWarper``: scores below the k-th largest become ``filter_value``."""

    top_k: int
    filter_value: float = -math.inf
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        return scores.masked_fill(scores < kth, self.filter_value)


@dataclasses.dataclass(frozen=True)
class TopP:
    """``TopPLogitsWarper``: keep the smallest set of tokens whose probability reaches
    ``top_p`` (at least ``min_tokens_to_keep``); the rest become ``filter_value``."""

    top_p: float
    filter_value: float = -math.inf
    min_tokens_to_keep: int = 1
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - self.top_p)
        drop_sorted[..., -self.min_tokens_to_keep :] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        return scores.masked_fill(drop, self.filter_value)


@dataclasses.dataclass(frozen=True)
class MinP:
    """``MinPLogitsWarper``: tokens less probable than ``min_p`` times the most probable one
    become ``filter_value`` (the ``min_tokens_to_keep`` most probable always stay)."""

    min_p: float
    filter_value: float = -math.inf
    min_tokens_to_keep: int = 1
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        probs = torch.softmax(scores, dim=-1)
        drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
        keep = torch.topk(probs, min(self.min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
        drop = drop.scatter(-1, keep, False)
        return scores.masked_fill(drop, self.filter_value)


@dataclasses.dataclass(frozen=True)
class RepetitionPenalty:
    """``RepetitionPenaltyLogitsProcessor``: the score of every token a row already holds is
    multiplied by ``penalty`` where negative, divided by it elsewhere. transformers gathers
    and scatters at ``input_ids``; a mask of the tokens seen gives the same scores without a
    tensor that grows each step."""

    penalty: float
    reads_seen = True

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        assert context.seen is not None, "RepetitionPenalty needs the tokens seen"
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(context.seen, penalized, scores)


@dataclasses.dataclass(frozen=True, eq=False)
class MinLength:
    """``MinLengthLogitsProcessor``: EOS scores are -inf while ``input_ids`` is shorter than
    ``min_length``. ``eos``: a ``[vocab]`` mask (``vocab_mask``)."""

    min_length: int
    eos: Tensor
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        return torch.where(self.eos & (context.length < self.min_length), -math.inf, scores)


@dataclasses.dataclass(frozen=True, eq=False)
class MinNewTokens:
    """``MinNewTokensLengthLogitsProcessor``: EOS scores are -inf while fewer than
    ``min_new_tokens`` tokens follow the first ``prompt_length`` ones."""

    prompt_length: int
    min_new_tokens: int
    eos: Tensor
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        short = (context.length - self.prompt_length) < self.min_new_tokens
        return torch.where(self.eos & short, -math.inf, scores)


@dataclasses.dataclass(frozen=True, eq=False)
class SuppressTokens:
    """``SuppressTokensLogitsProcessor``: the listed tokens always score -inf. ``tokens``: a
    ``[vocab]`` mask."""

    tokens: Tensor
    reads_seen = False

    def __call__(self, scores: Tensor, context: Context) -> Tensor:
        return torch.where(self.tokens, -math.inf, scores)


def process(scores: Tensor, processors: Sequence, context: Context) -> Tensor:
    """``scores`` ([batch, vocab], float32) through ``processors`` in order."""
    for processor in processors:
        scores = processor(scores, context)
    return scores


def choose(scores: Tensor, sample: bool, generator: torch.Generator | None = None) -> Tensor:
    """The next token of each row ([batch] int64): the first highest score (greedy, as
    ``torch.argmax``), or one draw from ``softmax(scores)`` (``sample``) with ``generator``
    (None: the device's default generator, as transformers' ``generate`` draws)."""
    if not sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # torch.multinomial's one-sample path: argmax(p / q), q ~ Exp(1), drawn over p's shape.
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1)
