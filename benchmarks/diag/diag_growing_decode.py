"""What does a decode over a growing DynamicCache cost under each capture policy? (GPU diag)

``capture_on_call=None`` (``fusebackend/runtime/recurrence.py``) captures a new signature on
its first call unless it extends the graph's previous new one by a common step, as the steps
of a decode over a growing cache do: those never come back within the sequence. This
steps a ``LlamaForCausalLM`` (TinyLlama's widths, ``--layers`` layers, random weights, fp16)
through ``torch.compile(model, backend="infinifuse")`` with a ``DynamicCache``, greedy,
for each policy in its own process: a sequence at another prompt length first (Dynamo's
recompiles, Triton's compiles), then a prompt of a new length twice (``new``: every step
a new signature; ``again``: every step seen once before), each split into its prompt's call
and its steps, with the captures and Dynamo's new graphs in each, eager's sequence timed the
same way, and whether the tokens equal eager's.

What it found (H200, 2026-12-01, 4 layers, 48 steps): at 2cf5d85 the new prompt's sequence
took 2.48 s under the default and 2.20 s with ``capture_on_call=2``, neither capturing,
against 3.14 s with ``capture_on_call=1``, which captured all 49 signatures. Split (the diag
at 4ae618c), almost all of it is the prompt's call, which Dynamo traces once more at a new
length (1.90 s under the default); the 48 steps took 0.354 s (7.4 ms a step run directly),
against eager's 2.86 s.

    python benchmarks/diag/diag_growing_decode.py [--layers 4] [--steps 48] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

VARIANTS = {"call1": 1, "call2": 2, "default": None}


def child(variant: str, layers: int, steps: int) -> dict[str, Any]:
    import torch
    import transformers
    from torch._dynamo.utils import counters

    import fusebackend

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.float16)
    option = VARIANTS[variant]
    options = {} if option is None else {"capture_on_call": option}
    compiled = torch.compile(model, backend="infinifuse", options=options)

    def decode(fn: Any, prompt: Any, split: dict[str, float] | None = None) -> Any:
        start = time.perf_counter()
        out = fn(input_ids=prompt, past_key_values=transformers.DynamicCache(), use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)]
        torch.cuda.synchronize()
        prefilled = time.perf_counter()
        for _ in range(steps):
            out = fn(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(-1))
        torch.cuda.synchronize()
        if split is not None:
            split["prefill_s"] = prefilled - start
            split["steps_s"] = time.perf_counter() - prefilled
        return torch.cat(tokens[:-1], 1)

    def timed(prompt: Any) -> dict[str, Any]:
        before = fusebackend.stats()["recordings"]
        traces = counters["stats"]["unique_graphs"]
        split: dict[str, float] = {}
        tokens = decode(compiled, prompt, split)
        return {
            **split,
            "captures": fusebackend.stats()["recordings"] - before,
            "dynamo_graphs": counters["stats"]["unique_graphs"] - traces,
            "tokens": tokens,
        }

    with torch.no_grad():
        warm = torch.randint(0, config.vocab_size, (1, 24), device="cuda")
        prompt = torch.randint(0, config.vocab_size, (1, 100), device="cuda")  # lengths unseen
        decode(model, warm)
        eager: dict[str, float] = {}
        expected = decode(model, prompt, eager)
        phases = {"warm": timed(warm), "new": timed(prompt), "again": timed(prompt)}
    tokens = {name: phase.pop("tokens") for name, phase in phases.items()}
    equal = torch.equal(tokens["new"], expected) and torch.equal(tokens["again"], expected)
    row: dict[str, Any] = {"variant": variant, "layers": layers, "steps": steps,
                           "eager_prefill_s": eager["prefill_s"],
                           "eager_steps_s": eager["steps_s"], "tokens_equal": equal}  # fmt: skip
    for name, phase in phases.items():
        row[f"{name}_s"] = phase["prefill_s"] + phase["steps_s"]
        row |= {f"{name}_{key}": value for key, value in phase.items()}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.steps)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--layers", str(args.layers),
             "--steps", str(args.steps)],
            capture_output=True, text=True, env=os.environ.copy(),
        )  # fmt: skip
        if proc.returncode != 0:
            print(variant, "failed:", proc.stderr[-3000:])
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        import torch  # noqa: F401  (environment() reads the device through it)
        from ledger import environment  # benchmarks/ledger.py reads this format

        record = {"benchmark": "diag_growing_decode", "environment": environment(),
                  "runs": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
