"""generate() variants against infinifuse's device decode loop (issue 36): tokens/s, time to
first token, decode-step time.

Shapes (random weights, bf16 on CUDA, fp32 on a CPU): TinyLlama (22 layers), Qwen2-0.5B,
Llama-3.2-1B configs built from dicts. Variants, each on a StaticCache of ``--cache-lens``
slots that the caller passes (reset between calls, so its tensors keep their addresses):

    eager         model.generate(..., disable_compile=True)
    autocompile   transformers' default CompileConfig (Inductor, reduce-overhead)
    infinifuse    CompileConfig(backend="infinifuse")
    loop-kN       fusebackend.generate(..., decode_steps=N)   (N in --ks)

Greedy, ``--new-tokens`` tokens (``min_new_tokens`` too, so each variant makes as many; capped
by the cache: prompt + new <= slots). Per run: the first call (compile included), the median
of ``--repeats`` later calls as tokens/s (batch x new tokens / s), the time to first token
(the loop's report; for transformers' loop a call with one new token), the decode-step time
((call - first token) / (new - 1)) and the tokens equal to eager's. Each shape, batch and
cache length runs in its own process (``--one`` is that child).

    python benchmarks/fast_generate.py --out benchmarks/results/fast_generate_h100.json \
        --ledger benchmarks/results/ledger.jsonl
    python benchmarks/fast_generate.py --quick --out /tmp/fast_generate.json   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from llama_shapes import TINY_LAYERS, TINY_WIDTHS, TINYLLAMA  # noqa: E402

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tinyllama": ("LlamaConfig", dict(TINYLLAMA)),
    "qwen2-0.5b": ("Qwen2Config", {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "llama-3.2-1b": ("LlamaConfig", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "head_dim": 64, "tie_word_embeddings": True, "rope_theta": 500000.0}),
    "tiny": ("LlamaConfig", {**TINYLLAMA, **TINY_WIDTHS, "num_hidden_layers": TINY_LAYERS}),
}  # fmt: skip
BASE_VARIANTS = ("eager", "autocompile", "infinifuse")


def build_model(shape: str, device: str) -> Any:
    import torch
    import transformers

    class_name, fields = SHAPES[shape]
    fields = {**fields, "max_position_embeddings": 8192}
    config = getattr(transformers, class_name)(
        **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init in bf16 on the device: seconds
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # far-apart greedy choices (see benchmarks/generate.py)
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def run_one(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant for one shape, batch and cache length, in this process."""
    import torch
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    import fusebackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.shape, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=g)
    ids = ids.to(device)
    new = min(args.new_tokens, args.cache_len - args.prompt)
    cache = StaticCache(config=model.config, max_cache_len=args.cache_len)
    base = {"do_sample": False, "past_key_values": cache}

    def call(variant: str, tokens: int) -> tuple[Any, float]:
        kwargs = {**base, "max_new_tokens": tokens, "min_new_tokens": tokens}
        cache.reset()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if variant.startswith("loop-k"):
            out = fusebackend.generate(model, ids, decode_steps=int(variant[6:]), **kwargs)
        elif variant == "eager":
            out = model.generate(ids, disable_compile=True, **kwargs)
        else:
            config = (
                CompileConfig(backend="infinifuse") if variant == "infinifuse" else CompileConfig()
            )
            config._compile_all_devices = device != "cuda"  # transformers compiles on GPUs only
            out = model.generate(ids, compile_config=config, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    runs = []
    reference = through_transformers = None
    with torch.no_grad():
        for variant in args.variants:
            torch._dynamo.reset()
            fusebackend.clear_cache()
            result: dict[str, Any] = {"shape": args.shape, "batch": args.batch, "variant": variant,
                                      "cache_len": args.cache_len, "new_tokens": new}  # fmt: skip
            try:
                tokens, result["first_call_s"] = call(variant, new)
                times = [call(variant, new)[1] for _ in range(args.repeats)]
            except Exception as exc:  # a variant that fails is recorded, the others still run
                result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                runs.append(result)
                continue
            call_s = statistics.median(times)
            result["tokens_per_s"] = args.batch * new / call_s
            if variant.startswith("loop-k"):
                report = fusebackend.generation.last_report()
                result["report"] = str(report)
                ttft = report.time_to_first_token_s
            else:
                ttft = statistics.median(call(variant, 1)[1] for _ in range(args.repeats))
            result["time_to_first_token_ms"] = ttft * 1e3
            result["decode_step_ms"] = (call_s - ttft) / max(new - 1, 1) * 1e3
            new_ids = tokens[:, args.prompt :].cpu()
            if variant == "eager":
                reference = new_ids
            if variant == "infinifuse":  # the loop's tokens against the same compiled step's
                through_transformers = new_ids
            if reference is not None:
                result["tokens_equal_eager"] = int((new_ids == reference).sum())
            if variant.startswith("loop-k") and through_transformers is not None:
                result["tokens_equal_infinifuse"] = int((new_ids == through_transformers).sum())
            runs.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    return runs


LEDGER_METRICS = {"tokens_per_s": "tokens/s", "time_to_first_token_ms": "ms",
                  "decode_step_ms": "ms", "first_call_s": "s", "tokens_equal_eager": "tokens",
                  "tokens_equal_infinifuse": "tokens"}  # fmt: skip


def ledger_rows(runs: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """Ledger rows (benchmarks/ledger.py's fields; the environment is filled on append)."""
    rows = []
    for run in runs:
        workload = f"fast-generate-{run['shape']}-b{run['batch']}-cache{run['cache_len']}"
        for metric, unit in LEDGER_METRICS.items():
            if isinstance(run.get(metric), (int, float)):
                rows.append({"workload": workload, "backend": run["variant"], "metric": metric,
                             "value": run[metric], "unit": unit, "source": source})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama", "qwen2-0.5b", "llama-3.2-1b"],
                        choices=sorted(SHAPES))  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--variants", nargs="+", default=list(BASE_VARIANTS),
                        choices=BASE_VARIANTS)  # fmt: skip
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the tiny shape, batch 1, 64 slots, 8 tokens, k=4",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--ledger", help="also append the figures to the ledger at PATH")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.batches, args.cache_lens = ["tiny"], [1], [64]
        args.new_tokens, args.repeats, args.ks = 8, 1, [4]
        args.variants = ["eager", "infinifuse"]
    if args.one:
        args.variants = args.variants + [f"loop-k{k}" for k in args.ks]
        print(json.dumps(run_one(args)))
        return
    runs: list[dict[str, Any]] = []
    for shape in args.shapes:
        for batch in args.batches:
            for cache_len in args.cache_lens:
                cmd = [sys.executable, os.path.abspath(__file__), "--one", "--out", args.out,
                       "--shape", shape, "--batch", str(batch), "--cache-len", str(cache_len),
                       "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                       "--repeats", str(args.repeats), "--ks", *map(str, args.ks),
                       "--variants", *args.variants]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    runs.append({"shape": shape, "batch": batch, "cache_len": cache_len,
                                 "error": proc.stderr[-3000:]})  # fmt: skip
                    continue
                runs.extend(json.loads(proc.stdout.strip().splitlines()[-1]))
    import generate  # benchmarks/generate.py: the environment fields every result records

    result = {"benchmark": "fast_generate", **generate.versions(), "prompt_tokens": args.prompt,
              "runs": runs}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for run in runs:
        if "error" in run:
            print(f"{run['shape']} b{run['batch']} cache {run['cache_len']} "
                  f"{run.get('variant', '')}: ERROR {run['error'][-300:]}")  # fmt: skip
        else:
            print(f"{run['shape']:>13} b{run['batch']} cache {run['cache_len']:>5} "
                  f"{run['variant']:>12}: {run['tokens_per_s']:8.1f} tokens/s, first token "
                  f"{run['time_to_first_token_ms']:7.1f} ms, step {run['decode_step_ms']:6.2f} "
                  f"ms, equal eager {run.get('tokens_equal_eager')}")  # fmt: skip
    if args.ledger:
        import ledger  # benchmarks/ledger.py, beside this file

        written = ledger.append(ledger_rows(runs, os.path.basename(args.out)), args.ledger)
        print(f"ledger: {len(written)} rows -> {args.ledger}")


if __name__ == "__main__":
    main()
