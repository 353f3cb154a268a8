"""BERT-style input block compiled with infinifuse: word + position + token-type -> LayerNorm.

    python examples/bert_embeddings.py                  # the GPU when there is one, else the CPU
    python examples/bert_embeddings.py --dtype float16 --batch 8 --seq 128
    python examples/bert_embeddings.py --interpret      # CPU: the Triton kernel in the interpreter

The three lookups and their two adds become one generated Triton kernel (one group with three
lookups); LayerNorm is a reduction and stays outside the group. Prints the fusion report, the
group's lookups, and the compiled model's max error against eager. Needs no transformers: the
module is written here with the shapes of ``transformers``' ``BertEmbeddings``. Without CUDA the
group runs its torch reference unless ``--interpret`` sets ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

import fusebackend  # only for explain/stats: the backend needs no import

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class BertStyleEmbeddings(nn.Module):
    """``BertEmbeddings`` without dropout (inference): three tables summed, then LayerNorm."""

    def __init__(
        self,
        vocab: int = 30522,
        max_positions: int = 512,
        type_vocab: int = 2,
        hidden: int = 768,
        eps: float = 1e-12,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        # Buffers, as in transformers: position ids and default token types are sliced from
        # them, so the graph needs no arange or zeros of its own.
        self.register_buffer("position_ids", torch.arange(max_positions)[None], persistent=False)
        self.register_buffer(
            "token_type_ids", torch.zeros(1, max_positions, dtype=torch.long), persistent=False
        )

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq = input_ids.shape[1]
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :seq].expand_as(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(self.position_ids[:, :seq])
        return self.LayerNorm(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=default_device, help="default: cuda if available")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="set TRITON_INTERPRET=1: on the CPU, run the generated Triton kernel in Triton's "
        "interpreter (needs numpy; slow) instead of the group's torch reference",
    )
    # The CPU defaults are small: with --interpret the kernel runs in numpy, slowly.
    parser.add_argument("--batch", type=int, default=8 if default_device == "cuda" else 2)
    parser.add_argument("--seq", type=int, default=128 if default_device == "cuda" else 16)
    parser.add_argument("--hidden", type=int, default=768 if default_device == "cuda" else 64)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--calls", type=int, default=3, help="compiled calls after explain")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Run the example; returns the max |compiled - eager| over the last call's output."""
    args = parse_args(argv)
    if args.interpret:
        # Triton reads the variable when a kernel is first compiled, which happens below.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)
    model = BertStyleEmbeddings(vocab=args.vocab, hidden=args.hidden).to(device, dtype).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    token_types = torch.randint(0, 2, (args.batch, args.seq), device=device)

    with torch.no_grad():  # fusion is for inference graphs; with gradients the graph is unfused
        report = fusebackend.explain(model, ids, token_types)
        print(report)
        groups = report.groups
        three = [g for g in groups if len(g.lookups) == 3]
        print(
            f"\nfused groups: {len(groups)}; lookups per group: {[len(g.lookups) for g in groups]}"
        )
        assert three, (
            f"expected one group with the 3 lookups (word, token type, position):\n{report}"
        )
        print(
            f"three-table group: {three[0].name} -> {three[0].kernel_name} "
            f"(lookups: {', '.join(three[0].lookups)}; runs on {three[0].backend})"
        )

        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(args.calls):
            out = compiled(ids, token_types)
        ref = model(ids, token_types)
        error = (out.double() - ref.double()).abs().max().item()
    print(f"\nmax |compiled - eager| = {error:.2e} ({args.dtype} on {device})")
    print("stats:", {k: v for k, v in fusebackend.stats().items() if k != "cached_shapes"})
    return error


if __name__ == "__main__":
    main(sys.argv[1:])
