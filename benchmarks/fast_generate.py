"""generate() variants against infinifuse's device decode loop (issue 36): tokens/s, time to
first token, decode-step time, and the loop's decode step timed alone.

Shapes (random weights, bf16 on CUDA, fp32 on a CPU): TinyLlama (22 layers), Qwen2-0.5B,
Llama-3.2-1B configs built from dicts. Variants, each on a StaticCache of ``--cache-lens``
slots that the caller passes (reset between calls, so its tensors keep their addresses):

    eager         model.generate(..., disable_compile=True)
    autocompile   transformers' default CompileConfig (Inductor, reduce-overhead)
    infinifuse    CompileConfig(backend="infinifuse")
    step          the loop's decode step called alone, one call per token (no generate())
    loop-kN       fusebackend.generate(..., decode_steps=N)   (N in --ks)

Greedy, or with ``--sample`` sampled: do_sample, temperature 0.7, top-k 50, top-p 0.9,
repetition penalty 1.1 (each has a device form, fusebackend/generation/support.py; a loop
row whose calls fell back to transformers' loop records why as ``fallback`` and writes no
ledger rows). ``--new-tokens`` tokens (``min_new_tokens`` too, so each variant makes as
many; capped by the cache: prompt + new <= slots). ``torch.manual_seed(SEED)`` precedes
every call: transformers' loop and the device loop both draw from the device's default
generator (a captured replay advances its philox offset as the uncaptured steps would:
docs/GENERATION.md), so every call of a variant draws alike.

Per run: the first call (compile included), the median of ``--repeats`` later calls as
tokens/s (batch x new tokens / s), the time to first token (the loop's report; for
transformers' loop a call with one new token), the decode-step time ((call - first token) /
(new - 1)) and ``tokens_equal_repeat``: of the batch x new tokens (``tokens_compared``),
those of the first call equal to the last timed call's (seeded alike, so all unless a
variant does not repeat itself; for the loop the first call runs a chunk uncaptured and
captures, the later calls only replay). Greedy runs also count the tokens equal to eager's
(``tokens_equal_eager``) and, for loop rows, to infinifuse's through transformers' loop;
sampled runs do not (a different rounding of the logits is enough for a draw to part
ways), and their ledger workload ends in ``-sampled``.

``step`` times the compiled one-token decode step by itself: the function the loop compiles
(``model(ids, positions, mask, cache, logits_to_keep=1).logits[:, -1]``, each input passed
where generate() hands it to the loop: a ``custom_generate`` callable that returns at once
probes them), through ``torch.compile(..., backend="infinifuse")`` with its default options
(the backend's own CUDA-graph capture, where the loop captures k steps itself). An eager
prefill of the prompt fills the same StaticCache; then one token per row per call, the
positions advanced in place between calls (the cache's length advances itself, as in
generate()); ``STEP_WARMUP`` calls (captured on the 2nd), then ``STEP_CALLS`` calls, each
timed alone between two synchronizations (so the host's time per call counts: guards, input
copies, the replay): ``step_alone_ms`` is their median. Each loop-kN row gets
``step_bound_fraction`` = tokens/s / (batch x 1000 / step_alone_ms), the loop's throughput
against back-to-back steps with nothing between (issue 36's target at batch 1: >= 0.85).

Each shape, batch, cache length and mode runs in its own process (``--one`` is that child):
the product of ``--shapes``, ``--batches`` and ``--cache-lens``, or the runs listed by
``--configs SHAPE:BATCH:CACHE[:sampled]``. The JSON is rewritten after each child, so a run
cut off keeps what finished; ``--ledger-from`` appends a JSON's rows to the ledger later.

    python benchmarks/fast_generate.py --out benchmarks/results/fast_generate_h100.json \
        --ledger benchmarks/results/ledger.jsonl
    python benchmarks/fast_generate.py --configs tinyllama:1:128 tinyllama:1:128:sampled \
        qwen2-0.5b:1:128 --ks 8 --out /tmp/fast_generate.json
    python benchmarks/fast_generate.py --quick [--sample] --out /tmp/fast_generate.json  # smoke
    python benchmarks/fast_generate.py --ledger-from R.json --ledger benchmarks/results/ledger.jsonl
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
BASE_VARIANTS = ("eager", "autocompile", "infinifuse", "step")
# --sample's options: each is one of the processors the loop runs on the device
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9,
            "repetition_penalty": 1.1}  # fmt: skip
SEED = 1234  # torch.manual_seed before every call
STEP_WARMUP = 5  # step calls before timing: the 1st compiles, the 2nd captures
STEP_CALLS = 60  # step calls timed (fewer where the cache has fewer slots left)


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


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def step_alone(model: Any, ids: Any, cache: Any, device: str) -> dict[str, Any]:
    """The loop's decode step (see the module docstring) timed call by call: its first call
    (compile included), the median of ``STEP_CALLS`` synchronized calls after the warm-up."""
    import torch

    given: dict[str, Any] = {}

    def probe(model: Any, input_ids: Any, logits_processor: Any, stopping_criteria: Any,
              generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
              **model_kwargs: Any) -> Any:  # fmt: skip
        given.update(model_kwargs)  # the model inputs generate() hands a decoding method
        return input_ids

    cache.reset()
    model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=cache,
                   custom_generate=probe)  # fmt: skip
    # The cache's key is "cache" (transformers 5.24) or "past_key_values" (5.17), as the loop
    # finds it (fusebackend/generation/support.py: cache_name).
    key = next(k for k in ("cache", "past_key_values") if given.get(k) is not None)
    batch, prompt = ids.shape
    cache.reset()
    inputs = model.prepare_inputs_for_generation(ids, is_first_iteration=True, **given)
    model(**inputs)  # the prefill, eager: the prompt's K/V rows in the cache
    slots = cache.layers[0].max_cache_len
    token = ids[:, -1:].clone()  # any token will do: the step's work does not depend on it
    positions = None
    if given.get("position_ids") is not None:
        positions = given["position_ids"][:, -1:] + 1
    mask = None
    if given.get("attention_mask") is not None:  # as the loop's: the prompt's, then ones
        mask = torch.ones(batch, slots, dtype=given["attention_mask"].dtype, device=ids.device)
        mask[:, :prompt] = given["attention_mask"]

    def decode_forward(ids: Any, pos: Any, attn: Any, cache: Any) -> Any:
        kwargs: dict[str, Any] = {"input_ids": ids, key: cache, "use_cache": True}
        if pos is not None:
            kwargs["position_ids"] = pos
        if attn is not None:
            kwargs["attention_mask"] = attn
        if "logits_to_keep" in given:
            kwargs["logits_to_keep"] = 1
        return model(**kwargs).logits[:, -1]

    compiled = torch.compile(decode_forward, backend="infinifuse")
    calls = min(STEP_CALLS, slots - prompt - STEP_WARMUP)  # each call writes one cache row
    times = []
    for _ in range(STEP_WARMUP + calls):
        sync(device)
        start = time.perf_counter()
        compiled(token, positions, mask, cache)
        sync(device)
        times.append(time.perf_counter() - start)
        if positions is not None:
            positions.add_(1)  # outside the timed window
    return {"first_call_s": times[0], "step_alone_ms": statistics.median(times[STEP_WARMUP:]) * 1e3,
            "step_calls": calls}  # fmt: skip


def run_one(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant for one shape, batch, cache length and mode, in this process."""
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
    base = {**(SAMPLING if args.sample else {"do_sample": False}), "past_key_values": cache}
    mode = "sampled" if args.sample else "greedy"

    def call(variant: str, tokens: int) -> tuple[Any, float]:
        kwargs = {**base, "max_new_tokens": tokens, "min_new_tokens": tokens}
        cache.reset()
        torch.manual_seed(SEED)  # every call of every variant draws the same numbers
        sync(device)
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
        sync(device)
        return out[:, args.prompt :].cpu(), time.perf_counter() - start

    def generate_figures(variant: str) -> dict[str, Any]:
        result: dict[str, Any] = {}
        tokens, result["first_call_s"] = call(variant, new)
        timed = [call(variant, new) for _ in range(args.repeats)]
        call_s = statistics.median(seconds for _, seconds in timed)
        result["tokens_per_s"] = args.batch * new / call_s
        ttft = None
        if variant.startswith("loop-k"):
            report = fusebackend.generation.last_report()
            result["report"] = str(report)
            if report.path != "device loop":  # its figures are transformers' loop's
                result["fallback"] = report.reason
            ttft = report.time_to_first_token_s
        if ttft is None:
            ttft = statistics.median(call(variant, 1)[1] for _ in range(args.repeats))
        result["time_to_first_token_ms"] = ttft * 1e3
        result["decode_step_ms"] = (call_s - ttft) / max(new - 1, 1) * 1e3
        result["tokens_compared"] = tokens.numel()
        result["tokens_equal_repeat"] = int((tokens == timed[-1][0]).sum())
        result["tokens"] = tokens
        return result

    runs = []
    reference = through_transformers = None
    with torch.no_grad():
        for variant in args.variants:
            torch._dynamo.reset()
            fusebackend.clear_cache()
            result: dict[str, Any] = {"shape": args.shape, "batch": args.batch, "mode": mode,
                                      "variant": variant, "cache_len": args.cache_len,
                                      "new_tokens": new}  # fmt: skip
            try:
                if variant == "step":
                    result.update(step_alone(model, ids, cache, device))
                else:
                    result.update(generate_figures(variant))
            except Exception as exc:  # a variant that fails is recorded, the others still run
                result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            new_ids = result.pop("tokens", None)
            if new_ids is not None and not args.sample:  # sampled tokens are not compared
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
    step = [r for r in runs if r["variant"] == "step" and "step_alone_ms" in r]
    for run in runs:
        if step and run["variant"].startswith("loop-k") and "tokens_per_s" in run:
            bound = args.batch * 1e3 / step[0]["step_alone_ms"]  # tokens/s of back-to-back steps
            run["step_bound_fraction"] = run["tokens_per_s"] / bound
    return runs


LEDGER_METRICS = {"tokens_per_s": "tokens/s", "time_to_first_token_ms": "ms",
                  "decode_step_ms": "ms", "first_call_s": "s", "tokens_equal_eager": "tokens",
                  "tokens_equal_infinifuse": "tokens", "tokens_equal_repeat": "tokens",
                  "tokens_compared": "tokens",
                  "step_alone_ms": "ms", "step_bound_fraction": "fraction"}  # fmt: skip
ENV_FIELDS = ("device", "torch", "triton", "transformers", "commit", "date")


def ledger_rows(result: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """Ledger rows (benchmarks/ledger.py's fields) of a result, its device, versions, commit and
    date with them (ledger.append fills in this process's where one is missing). Failed runs
    and loop rows that fell back to transformers' loop give none."""
    env = {k: result.get(k) for k in ENV_FIELDS}
    rows = []
    for run in result["runs"]:
        if "error" in run or "fallback" in run:
            continue
        workload = f"fast-generate-{run['shape']}-b{run['batch']}-cache{run['cache_len']}"
        if run.get("mode") == "sampled":
            workload += "-sampled"
        for metric, unit in LEDGER_METRICS.items():
            value = run.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"workload": workload, "backend": run["variant"], "metric": metric,
                             "value": value, "unit": unit, "source": source, **env})  # fmt: skip
    return rows


def parse_config(text: str) -> tuple[str, int, int, str | None]:
    """``SHAPE:BATCH:CACHE[:sampled|greedy]`` -> (shape, batch, cache slots, mode or None)."""
    parts = text.split(":")
    modes = ([], ["sampled"], ["greedy"])
    if len(parts) not in (3, 4) or parts[0] not in SHAPES or parts[3:] not in modes:
        raise argparse.ArgumentTypeError(
            f"expected SHAPE:BATCH:CACHE[:sampled] with SHAPE one of {sorted(SHAPES)}, got {text!r}"
        )
    return parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else None


def summary_line(run: dict[str, Any]) -> str:
    where = (
        f"{run['shape']:>13} b{run['batch']} cache {run['cache_len']:>5} {run.get('mode', ''):7}"
    )
    if "error" in run:
        return f"{where} {run.get('variant', '')}: ERROR {run['error'][-300:]}"
    if run["variant"] == "step":
        return (f"{where} {'step':>12}: alone {run['step_alone_ms']:6.3f} ms (median of "
                f"{run['step_calls']} calls), first call {run['first_call_s']:.1f} s")  # fmt: skip
    line = (f"{where} {run['variant']:>12}: {run['tokens_per_s']:8.1f} tokens/s, first token "
            f"{run['time_to_first_token_ms']:7.1f} ms, step {run['decode_step_ms']:6.2f} ms, "
            f"repeat equal {run['tokens_equal_repeat']}/{run['tokens_compared']}")  # fmt: skip
    if "tokens_equal_eager" in run:
        line += f", equal eager {run['tokens_equal_eager']}"
    if "step_bound_fraction" in run:
        line += f", {run['step_bound_fraction']:.2f} of the step alone's tokens/s"
    if "fallback" in run:
        line += f"; FELL BACK to transformers' loop: {run['fallback']}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tinyllama", "qwen2-0.5b", "llama-3.2-1b"],
                        choices=sorted(SHAPES))  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        metavar="SHAPE:B:CACHE[:sampled]",
        help="the runs, instead of the product of --shapes, --batches and --cache-lens (a "
        "fourth field overrides --sample for its run)",
    )
    parser.add_argument("--sample", action="store_true", help="sampled, not greedy (SAMPLING)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--variants", nargs="+", default=list(BASE_VARIANTS),
                        choices=BASE_VARIANTS)  # fmt: skip
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the tiny shape, batch 1, 64 slots, 8 tokens, eager, infinifuse, step "
        "and k=4 (greedy, or sampled with --sample)",
    )
    parser.add_argument("--out", help="JSON file to write (required unless --ledger-from)")
    parser.add_argument("--ledger", help="also append the figures to the ledger at PATH")
    parser.add_argument(
        "--ledger-from",
        metavar="JSON",
        help="append this result file's rows to --ledger, and run nothing",
    )
    parser.add_argument(
        "--commit",
        default=os.environ.get("FUSEBACKEND_COMMIT"),
        help="the commit to record (default $FUSEBACKEND_COMMIT, else git's)",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import ledger  # benchmarks/ledger.py, beside this file (sys.path[0])

    if args.ledger_from:
        if not args.ledger:
            parser.error("--ledger-from needs --ledger")
        with open(args.ledger_from) as f:
            result = json.load(f)
        written = ledger.append(
            ledger_rows(result, os.path.basename(args.ledger_from)), args.ledger
        )
        print(f"ledger: {len(written)} rows -> {args.ledger}")
        return
    if not args.out:
        parser.error("--out is required")
    if args.quick:
        args.configs = [("tiny", 1, 64, None)]
        args.new_tokens, args.repeats, args.ks = 8, 1, [4]
        args.variants = ["eager", "infinifuse", "step"]
    if args.one:
        args.variants = args.variants + [f"loop-k{k}" for k in args.ks]
        print(json.dumps(run_one(args)))
        return
    plan = args.configs or [(s, b, c, None) for s in args.shapes for b in args.batches
                            for c in args.cache_lens]  # fmt: skip
    import generate  # benchmarks/generate.py: the environment fields every result records

    result = {"benchmark": "fast_generate", **generate.versions(),
              "commit": args.commit or ledger._git_commit(), "prompt_tokens": args.prompt,
              "seed": SEED, "sampling": SAMPLING, "runs": []}  # fmt: skip
    for shape, batch, cache_len, mode in plan:
        sampled = mode == "sampled" if mode else args.sample
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--out", args.out,
               "--shape", shape, "--batch", str(batch), "--cache-len", str(cache_len),
               "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--ks", *map(str, args.ks),
               "--variants", *args.variants, *(["--sample"] if sampled else [])]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            mode = "sampled" if sampled else "greedy"
            runs = [{"shape": shape, "batch": batch, "cache_len": cache_len, "mode": mode,
                     "error": proc.stderr[-3000:]}]  # fmt: skip
        else:
            runs = json.loads(proc.stdout.strip().splitlines()[-1])
        result["runs"].extend(runs)
        for run in runs:
            print(summary_line(run), flush=True)
        with open(args.out, "w") as f:  # after every child: a run cut off keeps what finished
            json.dump(result, f, indent=2)
    if args.ledger:
        written = ledger.append(ledger_rows(result, os.path.basename(args.out)), args.ledger)
        print(f"ledger: {len(written)} rows -> {args.ledger}")


if __name__ == "__main__":
    main()
