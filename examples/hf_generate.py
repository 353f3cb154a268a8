"""transformers ``generate`` with a StaticCache, compiled by infinifuse through ``CompileConfig``.

    python examples/hf_generate.py                    # TinyLlama-shaped config, random weights
    python examples/hf_generate.py --layers 2         # the same shape with 2 layers
    python examples/hf_generate.py --tiny             # 2 layers, hidden 64: a CPU smoke test
    python examples/hf_generate.py --model-dir DIR    # a local model directory (never downloads)
    python examples/hf_generate.py --compare          # also transformers' own auto-compile

Needs transformers: ``pip install -e ".[hf]"``. The compiled run is transformers' documented
way to compile generation::

    model.generate(ids, cache_implementation="static",
                   compile_config=CompileConfig(backend="infinifuse"))

transformers compiles the forward only on accelerators (cuda, xpu, ...); on the CPU this
example sets ``compile_config._compile_all_devices = True`` (transformers' own switch for
that). In transformers 5.23 the compiled forward runs the decode steps; the prefill runs
uncompiled unless ``prefill_chunk_size`` is set (``GenerationMixin._prefill``), so stats show
one signature, the decode step's. Without CUDA, fused groups run their torch reference;
``--interpret`` runs the generated Triton kernels in Triton's interpreter instead (slow).

Prints the first generate's time (compilation included), tokens/s of a second generate (prefill
included), ``fusebackend.stats()``, and whether the tokens equal eager's
(``disable_compile=True``). ``--compare`` runs the same prompt through transformers' default
``CompileConfig()`` (Inductor, mode ``reduce-overhead``) in a subprocess, so that neither run
sees the other's compile caches or Dynamo state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from llama_shapes import TINY_LAYERS, TINY_WIDTHS, TINYLLAMA  # noqa: E402  (examples/ on sys.path)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The marker before the JSON line a --compare subprocess prints for its parent.
_RESULT_MARKER = "HF_GENERATE_RESULT "


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise SystemExit(
            f"{exc}: this example needs transformers; install it with "
            'pip install -e ".[hf]" (from the repository root)'
        ) from exc
    return transformers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        help="a local model directory (config and weights; loaded with local_files_only, "
        "never downloaded). Default: a TinyLlama-shaped config with random weights",
    )
    parser.add_argument(
        "--layers", type=int, help=f"layers of the config (default 22; --tiny: {TINY_LAYERS})"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"a tiny config: {TINY_LAYERS} layers (unless --layers), hidden 64, vocab 512",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="default: float16 on cuda, float32 on cpu"
    )
    parser.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens")
    parser.add_argument("--prompt", help="a text prompt (needs --model-dir with a tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens to generate")
    parser.add_argument(
        "--backend",
        default="infinifuse",
        help="CompileConfig's backend (default infinifuse); --compare runs 'inductor'",
    )
    parser.add_argument(
        "--mode",
        help="CompileConfig's mode (default: CompileConfig's own default, 'reduce-overhead')",
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="set TRITON_INTERPRET=1: on the CPU, run the generated Triton kernels in Triton's "
        "interpreter (needs numpy; slow) instead of the groups' torch reference",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run transformers' default CompileConfig() (Inductor, reduce-overhead) on "
        "the same prompt, in a subprocess",
    )
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip eager")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # --compare's
    args = parser.parse_args(argv)
    if args.prompt and not args.model_dir:
        parser.error("--prompt needs --model-dir (random models have no tokenizer)")
    if args.model_dir and (args.layers is not None or args.tiny):
        parser.error("--layers and --tiny shape a random config; --model-dir loads its own")
    return args


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    transformers = _transformers()
    if args.model_dir:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model_dir, dtype=dtype, local_files_only=True
        )
        return model.to(device).eval()
    shape = dict(TINYLLAMA)
    if args.tiny:
        shape.update(TINY_WIDTHS, num_hidden_layers=TINY_LAYERS)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(args.seed)
    # Built on the target device: random init of 1.1B parameters takes ~10 s on a CPU.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval()


def make_prompt(args: argparse.Namespace, model: Any, device: torch.device) -> torch.Tensor:
    if args.prompt:
        tokenizer = _transformers().AutoTokenizer.from_pretrained(
            args.model_dir, local_files_only=True
        )
        return tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (1, args.prompt_len)
    return torch.randint(0, model.config.vocab_size, shape, generator=generator).to(device)


def compile_config(args: argparse.Namespace, device: torch.device) -> Any:
    kwargs: dict[str, Any] = {"backend": args.backend}
    if args.mode is not None:
        kwargs["mode"] = args.mode
    config = _transformers().CompileConfig(**kwargs)
    if device.type == "cpu":
        # transformers auto-compiles only on accelerators; this is its switch for other devices.
        config._compile_all_devices = True
    return config


def generate(model: Any, prompt: torch.Tensor, new_tokens: int, **kwargs: Any) -> torch.Tensor:
    # min_new_tokens = max_new_tokens: a random model may emit its EOS id early; every run
    # generates the same number of tokens, so tokens/s compare.
    pad = model.generation_config.pad_token_id
    if pad is None:  # random configs have none; generate warns and picks EOS without this
        pad = model.generation_config.eos_token_id
    if isinstance(pad, list):  # some models list several EOS ids
        pad = pad[0]
    out = model.generate(
        prompt,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        cache_implementation="static",
        pad_token_id=pad,
        **kwargs,
    )
    return out[:, prompt.shape[1] :].cpu()


def _timed(device: torch.device, fn: Any) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate with ``args.backend`` (and eager unless --no-check); the numbers printed."""
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    model = build_model(args, device, dtype)
    prompt = make_prompt(args, model, device)
    config = model.config
    print(
        f"model: {config.model_type}, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, {dtype}, {device}; prompt {tuple(prompt.shape)}, "
        f"{args.new_tokens} new tokens, StaticCache"
    )
    result: dict[str, Any] = {"backend": args.backend, "mode": args.mode}
    with torch.no_grad():
        reference = None
        if args.check:
            reference = generate(model, prompt, args.new_tokens, disable_compile=True)
        cc = compile_config(args, device)
        label = f"CompileConfig(backend={cc.backend!r}, mode={cc.mode!r})"
        _, first_s = _timed(
            device, lambda: generate(model, prompt, args.new_tokens, compile_config=cc)
        )
        tokens, warm_s = _timed(
            device, lambda: generate(model, prompt, args.new_tokens, compile_config=cc)
        )
    result.update(
        label=label,
        first_generate_s=first_s,
        generate_s=warm_s,
        tokens_per_s=args.new_tokens / warm_s,
        tokens=tokens[0].tolist(),
    )
    print(f"\n[{label}]")
    print(f"first generate (compilation included): {first_s:.2f} s")
    print(
        f"second generate: {warm_s:.3f} s, {result['tokens_per_s']:.1f} tokens/s (prefill included)"
    )
    print(f"tokens: {result['tokens']}")
    if reference is not None:
        same = int((reference == tokens).sum())
        result.update(tokens_match=bool(torch.equal(reference, tokens)), tokens_equal=same)
        print(f"tokens equal to eager (disable_compile=True): {same}/{tokens.numel()}")
    if args.backend == "infinifuse":
        import fusebackend

        stats = fusebackend.stats()
        result["stats"] = {k: v for k, v in stats.items() if k != "cached_shapes"}
        print("fusebackend.stats():")
        for key, value in result["stats"].items():
            print(f"  {key}: {value}")
    return result


def compare_in_subprocess(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """transformers' default CompileConfig() for the same model and prompt, in a fresh process."""
    drop = {"--compare", "--json", "--interpret"}
    child = [a for a in argv if a not in drop]
    for flag in ("--backend", "--mode"):  # the child takes CompileConfig's own defaults
        while flag in child:
            i = child.index(flag)
            del child[i : i + 2]
        child = [a for a in child if not a.startswith(flag + "=")]
    command = [sys.executable, os.path.abspath(__file__), *child, "--backend", "inductor"]
    command += ["--no-check", "--json"]
    print(f"\n--compare: {' '.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"--compare subprocess failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
            f"\n{done.stderr[-4000:]}"
        )
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(_RESULT_MARKER))
    return json.loads(line[len(_RESULT_MARKER) :])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the numbers it prints (used by the smoke test)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    _transformers()  # the extra's name before any work, if it is missing
    if args.interpret:
        # Triton reads the variable when a kernel is first compiled, which happens below.
        os.environ["TRITON_INTERPRET"] = "1"
    result = run(args)
    if args.json:
        print(_RESULT_MARKER + json.dumps(result, default=str), flush=True)
        return result
    if args.compare:
        other = compare_in_subprocess(args, argv)
        result["compare"] = other
        same = sum(a == b for a, b in zip(other["tokens"], result["tokens"]))
        print(f"\n[{other['label']}] (subprocess)")
        print(f"first generate (compilation included): {other['first_generate_s']:.2f} s")
        print(f"second generate: {other['tokens_per_s']:.1f} tokens/s (prefill included)")
        print(f"tokens equal to {args.backend}'s: {same}/{len(result['tokens'])}")
        print(
            f"\n{args.backend} / transformers' auto-compile: first generate "
            f"{result['first_generate_s'] / other['first_generate_s']:.2f}x, tokens/s "
            f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x"
        )
    return result


if __name__ == "__main__":
    main()
