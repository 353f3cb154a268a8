"""In-place effects of a graph on its inputs: each happens exactly once per call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["RngState", "with_clones", "write_back"]


class RngState:
    """The CPU generator's state and, for a CUDA graph, that device's, to replay draws."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        on_cuda = device is not None and torch.cuda.is_available()
        self.cuda = torch.cuda.get_rng_state(device) if on_cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def with_clones(args: Sequence[Any], indices: Iterable[int]) -> list[Any]:
    out = list(args)
    for i in indices:
        out[i] = args[i].clone()
    return out


def write_back(mutated: Iterable[int], call_args: Sequence[Any], user_args: Sequence[Any]) -> None:
    """Copy mutated inputs that ran on a copy (padded, moved, cloned) into the caller's."""
    for i in mutated:
        if i >= len(user_args):
            continue
        src, dst = call_args[i], user_args[i]
        if src is dst or not isinstance(dst, torch.Tensor):
            continue
        dst.copy_(src if src.shape == dst.shape else src[: dst.shape[0]])
