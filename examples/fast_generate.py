"""transformers' generate() through infinifuse's device decode loop (``fusebackend.generate``).

    python examples/fast_generate.py                  # TinyLlama-shaped config, random weights
    python examples/fast_generate.py --tiny           # 2 layers, hidden 64: a CPU smoke test
    python examples/fast_generate.py --k 16 --sample  # 16 steps per replay, sampling

The decode step, token selection, position updates and the stop check run on the device; on
a GPU k steps are one CUDA-graph replay and the host reads one flag per replay. Prints the
first and second call's time, tokens/s of the second, time to first token, the loop's
report, and whether the tokens equal transformers' own generate() (greedy only; eager).
Needs transformers: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_shapes import TINY_LAYERS, TINY_WIDTHS, TINYLLAMA  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 512")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=8, help="decode steps per chunk / replay")
    parser.add_argument("--sample", action="store_true", help="top-k/top-p sampling, seed 0")
    parser.add_argument("--eager-step", action="store_true", help="no torch.compile of the step")
    parser.add_argument("--interpret", action="store_true", help="TRITON_INTERPRET=1 (CPU)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    import transformers

    shape = dict(TINYLLAMA)
    if args.tiny:
        shape.update(TINY_WIDTHS, num_hidden_layers=TINY_LAYERS)
    config = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt_len), generator=g)
    return model, ids.to(args.device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    import fusebackend

    model, ids = build(args)
    kwargs: dict[str, Any] = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    if args.sample:
        kwargs.update(do_sample=True, top_k=50, top_p=0.9, temperature=0.8)
    else:
        kwargs["do_sample"] = False
    backend = None if args.eager_step else "infinifuse"

    def run() -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fusebackend.generate(model, ids, decode_steps=args.k, backend=backend, **kwargs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    with torch.no_grad():
        first, first_s = run()
        tokens, second_s = run()
    report = fusebackend.generation.last_report()
    result = {
        "first_call_s": first_s,
        "second_call_s": second_s,
        "tokens_per_s": args.new_tokens * args.batch / second_s,
        "time_to_first_token_s": report.time_to_first_token_s,
        "report": str(report),
        "repeat_equal": bool(torch.equal(first, tokens)),
    }
    print(f"first call (compile included): {first_s:.2f} s; second: {second_s:.3f} s")
    ttft_ms = report.time_to_first_token_s * 1e3
    print(f"{result['tokens_per_s']:.1f} tokens/s, first token {ttft_ms:.1f} ms")
    print(report)
    if not args.sample:
        expected = model.generate(ids, cache_implementation="static", **kwargs)
        new = tokens[:, ids.shape[1] :]
        result["tokens_equal_generate"] = int((expected[:, ids.shape[1] :] == new).sum())
        equal = result["tokens_equal_generate"]
        print(f"tokens equal to transformers' generate(): {equal}/{new.numel()}")
    return result


if __name__ == "__main__":
    main()
