"""Quickstart: token + position embeddings compiled with infinifuse.

    python examples/quickstart.py               # the GPU when there is one, else the CPU
    python examples/quickstart.py --interpret   # CPU: run the Triton kernel in Triton's interpreter

Without CUDA, a fused group runs its torch reference (the same ops, no generated kernel): never
slower than eager. ``--interpret`` sets ``TRITON_INTERPRET=1`` so the generated Triton kernel
itself runs, in Triton's interpreter (numpy; slow: for checking the kernel, not for speed).

Prints the fusion report (what was fused into which kernel, what was not and why), the
compiled model's agreement with eager, and the runtime counters.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusebackend  # only for explain/stats: the backend needs no import


class TinyEmbedder(nn.Module):
    """Gemma/GPT-style input block: scaled token embedding + position embedding."""

    def __init__(self, vocab: int = 1000, max_len: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.norm = nn.LayerNorm(dim)
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos_ids = torch.arange(ids.shape[1], device=ids.device)[None]
        x = F.gelu(self.tok(ids) * self.scale + self.pos(pos_ids))
        return self.norm(x)


def main(argv: list[str] | None = None) -> float:
    """Run the example; returns the max |compiled - eager| over the last call's output."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="set TRITON_INTERPRET=1: without CUDA, run the generated Triton kernel in "
        "Triton's interpreter (needs numpy; slow) instead of the group's torch reference",
    )
    args = parser.parse_args(argv)
    if args.interpret:
        # Triton reads the variable when a kernel is first compiled, which happens below.
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyEmbedder().to(device).eval()
    ids = torch.randint(0, 1000, (2, 16), device=device)

    with torch.no_grad():  # fusion is for inference graphs
        report = fusebackend.explain(model, ids)
        print(report)
        if device == "cpu" and not args.interpret:
            print("(no CUDA: the group is not rewritten; --interpret runs its kernel)")
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(3):
            out = compiled(ids)
        error = (out - model(ids)).abs().max().item()
    print(f"\nmax |compiled - eager| = {error:.2e} on {device}")
    print("stats:", {k: v for k, v in fusebackend.stats().items() if k != "cached_shapes"})
    return error


if __name__ == "__main__":
    main()
