"""Greedy generation with a Llama-architecture decoder compiled with infinifuse.

    python examples/llama_generate.py                      # tiny random Llama, runs on CPU
    python examples/llama_generate.py --tinyllama          # TinyLlama-1.1B's shape, random
    python examples/llama_generate.py --model-path DIR     # a local HF-format checkpoint
    python examples/llama_generate.py --tinyllama --backend reduce-overhead   # compare
    python examples/llama_generate.py --no-fusion          # infinifuse, fusion off
    python examples/llama_generate.py --interpret          # CPU: Triton kernels in the interpreter

Needs transformers: ``pip install -e ".[hf]"``. Without CUDA, fused groups run their torch
reference (no slower than eager); ``--interpret`` sets ``TRITON_INTERPRET=1`` so the generated
Triton kernels run in Triton's interpreter instead (numpy; about 10x slower: for checking them).

The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded), or
loaded from ``--model-path``. The decode loop is written here: one prefill call over the
prompt, then one call per new token with the KV cache (``past_key_values``). Prints the
compiled model's first-call times, decode tokens/s and ``fusebackend.stats()``, and whether
the generated tokens match eager's.

KV cache: ``--cache static`` (default) uses transformers' ``StaticCache``, allocated before
the first call (``early_initialization``), so every decode step has the same shapes and the
cache tensors keep their addresses: one compiled graph and one CUDA graph for all decode
steps. ``--cache dynamic`` uses ``DynamicCache``: the cache grows every step, so each step
is a new shape (Dynamo goes dynamic after the second; the CUDA-graph cache keys by shape).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

import fusebackend  # only for stats: the backend needs no import

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKENDS = ("infinifuse", "eager", "inductor", "reduce-overhead", "none")

from llama_shapes import TINY_WIDTHS, TINYLLAMA  # noqa: E402  (examples/ is on sys.path)

# 2 layers of the tiny widths: Dynamo and the interpreter finish in seconds on a CPU.
TINY = dict(TINY_WIDTHS, num_hidden_layers=2, rms_norm_eps=1e-5)


def build_model(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as exc:
        raise SystemExit(
            f"{exc}: this example needs transformers; install it with "
            'pip install -e ".[hf]" (from the repository root)'
        ) from exc

    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, local_files_only=True
        )
        return model.to(device).eval()
    shape = dict(TINYLLAMA if args.tinyllama else TINY)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    config = LlamaConfig(**shape)
    torch.manual_seed(args.seed)
    # Built on the target device: random init of 1.1B parameters takes ~10 s on a CPU.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval()  # no-op moves if built in place


def make_cache(kind: str, model: torch.nn.Module, batch: int, max_len: int) -> Any:
    """A KV cache for one generation; ``static`` falls back to ``dynamic`` if unsupported."""
    from transformers import DynamicCache

    config = model.config
    if kind == "static":
        try:
            from transformers import StaticCache

            cache = StaticCache(config=config, max_cache_len=max_len)
            # Lazily-initialised layers would create the cache tensors inside the compiled
            # prefill graph, where transformers skips mark_static_address: the decode graph
            # then sees them as ordinary inputs (copied on every CUDA-graph replay). Early
            # allocation marks them static, so they are used in place.
            if hasattr(cache, "early_initialization"):
                head_dim = getattr(config, "head_dim", None) or (
                    config.hidden_size // config.num_attention_heads
                )
                param = next(model.parameters())
                cache.early_initialization(
                    batch, config.num_key_value_heads, head_dim, param.dtype, param.device
                )
            return cache
        except (ImportError, TypeError, AttributeError, ValueError) as exc:
            print(f"StaticCache unavailable ({type(exc).__name__}: {exc}); using DynamicCache")
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56 takes no config
        return DynamicCache()


def reset_cache(cache: Any, kind: str, model: torch.nn.Module, batch: int, max_len: int) -> Any:
    """Empty the cache for a new generation; a static cache keeps its tensors (addresses)."""
    if type(cache).__name__ == "StaticCache":
        cache.reset()  # zeroes in place: captured graphs stay valid
        return cache
    return make_cache(kind, model, batch, max_len)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    fn: Any,
    prompt: torch.Tensor,
    new_tokens: int,
    cache: Any,
    device: torch.device,
    mark_step: bool = False,
) -> dict[str, Any]:
    """Greedy decode: prefill, then one token per call. Returns tokens, logits, timings.

    Timed with a device sync at the end of each phase, CPU overhead included: the prefill,
    the first decode call (where compilers compile the decode graph), then the other steps.
    """

    def step(ids: torch.Tensor) -> torch.Tensor:
        if mark_step:  # reduce-overhead: a new step, earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    timer = _Timer(device)
    # Cloned: reduce-overhead's outputs are overwritten by its next call.
    first_logits = step(prompt).float().clone()
    tokens = [first_logits.argmax(-1, keepdim=True)]
    prefill_s = timer.lap()
    if new_tokens > 1:
        tokens.append(step(tokens[-1]).argmax(-1, keepdim=True))
    first_decode_s = timer.lap()
    for _ in range(new_tokens - 2):
        tokens.append(step(tokens[-1]).argmax(-1, keepdim=True))
    decode_s = timer.lap()
    return {
        "tokens": torch.cat(tokens, dim=1).cpu(),
        "first_logits": first_logits,
        "prefill_s": prefill_s,
        "first_decode_s": first_decode_s,
        "decode_s": decode_s,
        "decode_steps": max(0, new_tokens - 2),
    }


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        sync(device)
        self.last = time.perf_counter()

    def lap(self) -> float:
        sync(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


def compile_model(model: torch.nn.Module, backend: str, fusion: bool) -> Any:
    if backend == "none":
        return model
    if backend == "infinifuse":
        return torch.compile(model, backend="infinifuse", options={"fusion": fusion})
    if backend == "eager":
        return torch.compile(model, backend="eager")
    if backend == "inductor":
        return torch.compile(model)
    return torch.compile(model, mode="reduce-overhead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tinyllama", action="store_true", help="TinyLlama-1.1B's shape")
    source.add_argument("--model-path", help="local HF-format model directory")
    parser.add_argument("--layers", type=int, help="override the number of layers")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="infinifuse",
        help="eager = torch.compile(backend='eager'); none = no compile",
    )
    parser.add_argument(
        "--enable-fusion",
        dest="fusion",
        action="store_true",
        default=True,
        help="infinifuse with fusion on (the default)",
    )
    parser.add_argument(
        "--no-fusion",
        dest="fusion",
        action="store_false",
        help="infinifuse with options={'fusion': False}",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="default: float16 on cuda, float32 on cpu"
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="set TRITON_INTERPRET=1: on the CPU, run the generated Triton kernels in Triton's "
        "interpreter (needs numpy; slow) instead of the groups' torch reference",
    )
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="default: 64 on cuda, 8 on cpu"
    )
    parser.add_argument("--prompt", help="text prompt (needs --model-path with a tokenizer)")
    parser.add_argument(
        "--no-check", dest="check", action="store_false", help="skip the eager reference generation"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prompt and not args.model_path:
        parser.error("--prompt needs --model-path (random models have no tokenizer)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the numbers it prints (used by the smoke test)."""
    args = parse_args(argv)
    if args.interpret:
        # Triton reads the variable when a kernel is first compiled, which happens below.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    new_tokens = args.new_tokens or (64 if device.type == "cuda" else 8)
    model = build_model(args, device, dtype)
    config = model.config

    tokenizer = None
    if args.prompt:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
        prompt = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
        prompt = prompt.expand(args.batch, -1)
    else:
        generator = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(
            0, config.vocab_size, (args.batch, args.prompt_len), generator=generator
        ).to(device)
    max_len = prompt.shape[1] + new_tokens
    print(
        f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype}, "
        f"{device}; prompt {tuple(prompt.shape)}, {new_tokens} new tokens"
    )

    fusebackend.clear_cache()
    fusebackend.reset_stats()
    result: dict[str, Any] = {}
    with torch.no_grad():
        cache = make_cache(args.cache, model, args.batch, max_len)
        print(f"cache: {type(cache).__name__}")
        reference = None
        if args.check:
            reference = generate(model, prompt, new_tokens, cache, device)
            cache = reset_cache(cache, args.cache, model, args.batch, max_len)

        label = args.backend + (
            "" if args.fusion or args.backend != "infinifuse" else " (fusion off)"
        )
        compiled = compile_model(model, args.backend, args.fusion)
        mark_step = args.backend == "reduce-overhead"
        cold = generate(compiled, prompt, new_tokens, cache, device, mark_step)  # compiles
        cache = reset_cache(cache, args.cache, model, args.batch, max_len)
        warm = generate(compiled, prompt, new_tokens, cache, device, mark_step)

    tokens_per_s = args.batch * warm["decode_steps"] / warm["decode_s"] if warm["decode_s"] else 0.0
    result.update(
        backend=label,
        first_call_s=cold["prefill_s"],
        first_decode_call_s=cold["first_decode_s"],
        prefill_s=warm["prefill_s"],
        decode_tokens_per_s=tokens_per_s,
        tokens=warm["tokens"],
        cache=type(cache).__name__,
    )
    print(
        f"\n[{label}] first call (prefill, compile included): {cold['prefill_s']:.2f} s; "
        f"first decode call (compile included): {cold['first_decode_s']:.2f} s"
    )
    print(
        f"[{label}] warm: prefill {warm['prefill_s'] * 1e3:.1f} ms, decode "
        f"{tokens_per_s:.1f} tokens/s ({warm['decode_steps']} steps x batch {args.batch})"
    )
    print(f"generated: {warm['tokens'][0].tolist()}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(warm['tokens'][0])!r}")
    if reference is not None:
        ref, got = reference["first_logits"].double(), warm["first_logits"].double()
        rel = ((got - ref).norm() / ref.norm()).item()
        same = torch.equal(reference["tokens"], warm["tokens"])
        diverge = (reference["tokens"] != warm["tokens"]).any(0).nonzero()
        where = "" if same else f" (first difference at new token {int(diverge[0])})"
        # Greedy tokens of a random-weight model can flip on near-ties in fp16; the logits'
        # relative error is the number to judge.
        print(f"vs eager: prefill logits rel error {rel:.2e}; tokens identical: {same}{where}")
        result.update(rel_error=rel, tokens_match=same)
    stats = fusebackend.stats()
    result["stats"] = stats
    print("fusebackend.stats():")
    for key, value in stats.items():
        if key == "cached_shapes":
            value = f"{len(value)} entries"
        print(f"  {key}: {value}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
