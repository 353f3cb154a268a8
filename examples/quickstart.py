"""Quickstart: token + position embeddings compiled with infinifuse.

    python examples/quickstart.py            # the GPU when there is one, else the CPU

Prints the fusion report (what was fused into which kernel, what was not and why), the
compiled model's agreement with eager, and the runtime counters.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    # Without a GPU, run the generated Triton kernels through Triton's interpreter. The
    # variable must be set before Triton is first imported, which happens lazily below.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusebackend  # noqa: E402  (only for explain/stats: the backend needs no import)


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


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyEmbedder().to(device).eval()
    ids = torch.randint(0, 1000, (2, 16), device=device)

    with torch.no_grad():  # fusion is for inference graphs
        report = fusebackend.explain(model, ids)
        print(report)
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(3):
            out = compiled(ids)
        error = (out - model(ids)).abs().max().item()
    print(f"\nmax |compiled - eager| = {error:.2e} on {device}")
    print("stats:", {k: v for k, v in fusebackend.stats().items() if k != "cached_shapes"})


if __name__ == "__main__":
    main()
