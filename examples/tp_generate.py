"""transformers' ``generate`` on a model sharded across processes (``tp_plan="auto"``),
compiled by infinifuse on every rank.

    torchrun --nproc_per_node 2 examples/tp_generate.py             # TinyLlama shape
    torchrun --nproc_per_node 2 examples/tp_generate.py --tiny --kind qwen2
    torchrun --nproc_per_node 2 examples/tp_generate.py --model-dir /path/to/local/model

Each rank loads its shard with ``from_pretrained(dir, tp_plan="auto")`` (a random config is
first saved to a temporary directory by rank 0), generates greedily with a StaticCache
(eager, then ``CompileConfig(backend="infinifuse")``, then a forward compiled with
``torch.compile(model.forward, backend="infinifuse")``), and prints its tokens/s, whether
its tokens equal eager tensor-parallel's (and, with ``--single``, one device's eager run),
the backend's stats and what was fused. On GPUs the process group is NCCL and each step is
captured in one CUDA graph per rank, the all-reduces inside it; on CPUs it is gloo (add
``--interpret`` to run the fused kernels in Triton's interpreter). Never downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from llama_shapes import TINY_LAYERS, TINY_WIDTHS, TINYLLAMA  # noqa: E402  (examples/ on sys.path)

# A random config has TinyLlama's shape, or (--tiny) its widths shrunk for a CPU.
TINY = {**TINYLLAMA, **TINY_WIDTHS, "num_hidden_layers": TINY_LAYERS}
MARK = None  # diagnostics: called with a phase's name as each starts (benchmarks/diag)


def _mark(text: str) -> None:
    if MARK is not None:
        MARK(text)


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", help="a local transformers model (never downloads)")
    parser.add_argument(
        "--kind",
        choices=("llama", "qwen2"),
        default="llama",
        help="random config's family; qwen2 ties the LM head to the embedding",
    )
    parser.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (CPU runs)")
    parser.add_argument("--layers", type=int, help="layers of the random config")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--batch", type=int, default=1, help="prompts; above 1 the first is left-padded by 3 tokens"
    )
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default: float16 on GPUs")
    parser.add_argument(
        "--single",
        action="store_true",
        help="also generate with the whole model on one device (eager)",
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="run the fused kernels in Triton's interpreter (CPU)",
    )
    parser.add_argument(
        "--device-loop",
        action="store_true",
        help="also run fusebackend.generate (the device decode loop) and compare its tokens",
    )
    parser.add_argument("--decode-steps", type=int, default=4, help="the loop's k")
    parser.add_argument(
        "--once",
        action="store_true",
        help="each compiled path generates once, its first call's time (CPU tests: "
        "the second, timed call checks nothing more)",
    )
    parser.add_argument("--json", help="write each rank's results to this path + .rankN.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model_dir and (args.tiny or args.layers is not None):
        parser.error("--tiny and --layers shape a random config; --model-dir loads its own")
    return args


def setup() -> torch.device:
    """Join the process group torchrun describes; this rank's device."""
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node N examples/tp_generate.py")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def random_model_dir(args: argparse.Namespace, root: str) -> str:
    """Rank 0 saves a random model of the chosen shape under ``root``; every rank gets its path."""
    import transformers

    path = os.path.join(root, "model")
    if dist.get_rank() == 0:
        shape = dict(TINY if args.tiny else TINYLLAMA)
        if args.layers is not None:
            shape["num_hidden_layers"] = args.layers
        if args.kind == "qwen2":
            config = transformers.Qwen2Config(**shape, tie_word_embeddings=True)
        else:
            config = transformers.LlamaConfig(**shape)
        torch.manual_seed(args.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(path)
    dist.barrier()
    return path


def prompts(args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded random prompts (the same on every rank); the first left-padded when batched."""
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=generator)
    mask = torch.ones_like(ids)
    if args.batch > 1:
        ids[0, :3] = 0
        mask[0, :3] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def generate(model: Any, inputs: dict[str, torch.Tensor], new_tokens: int, **kwargs: Any) -> Any:
    # min_new_tokens = max_new_tokens: a random model may emit its EOS id early.
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    out = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        cache_implementation="static",
        pad_token_id=pad,
        **kwargs,
    )
    return out[:, inputs["input_ids"].shape[1] :].cpu()


def timed(device: torch.device, fn: Any) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def first_and_again(
    device: torch.device, fn: Any, once: bool, name: str
) -> tuple[Any, float, float]:
    """(the last call's output, the first call's seconds, the last call's): ``fn`` run
    twice, the first paying the compiles (and captures), or only once with ``once``."""
    _mark(f"first {name}")
    out, first_s = timed(device, fn)
    if once:
        return out, first_s, first_s
    _mark(f"second {name}")
    out, warm_s = timed(device, fn)
    return out, first_s, warm_s


def compile_config() -> Any:
    import transformers

    config = transformers.CompileConfig(backend="infinifuse")
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    return config


def fused_summary() -> dict[str, Any]:
    """Graphs compiled so far on this rank: path, groups and rewrites of each."""
    import fusebackend

    graphs = fusebackend.reports().graphs
    return {
        "graphs": [
            {
                "name": g.name,
                "path": g.path,
                "groups": len(g.groups),
                "local_shards": len(getattr(g, "local_shards", [])),
                "reduce_copies": list(getattr(g, "reduce_copies", [])),
                "in_place_reduces": list(getattr(g, "in_place_reduces", [])),
                "vocab_lookups": list(getattr(g, "vocab_lookups", [])),
                "collectives": len(getattr(g, "collectives", [])),
                "matmul_groups": list(g.rewrites.get("matmul_groups", [])),
                "rotary_epilogues": list(g.rewrites.get("rotary_epilogues", [])),
            }
            for g in graphs
        ]
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = setup()
    try:
        result = _run(args, device)
    except BaseException:
        # Free the captured graphs before the interpreter tears NCCL down (see shutdown);
        # no barrier and no synchronize: a peer may be stuck in a collective, and torchrun
        # stops the others.
        _free_graphs(device, wait=False)
        raise
    shutdown(device)
    return result


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import transformers

    import fusebackend

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = _DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }
    with tempfile.TemporaryDirectory() as root:
        # Every rank needs the same path: rank 0's temporary directory, broadcast.
        shared = [root]
        dist.broadcast_object_list(shared, src=0)
        path = args.model_dir or random_model_dir(args, shared[0])
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", dtype=dtype, local_files_only=True
        ).eval()
        single = None
        if args.single:
            single = (
                transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, local_files_only=True
                )
                .to(device)
                .eval()
            )
        dist.barrier()  # rank 0's directory outlives every rank's load
    inputs = prompts(args, model.config.vocab_size, device)
    n = args.new_tokens
    with torch.no_grad():
        _mark("eager TP generate")
        eager, eager_s = timed(device, lambda: generate(model, inputs, n, disable_compile=True))
        cc = compile_config()
        tokens, first_s, warm_s = first_and_again(
            device, lambda: generate(model, inputs, n, compile_config=cc), args.once,
            "CompileConfig generate",
        )  # fmt: skip
        result["compile_config"] = {
            "first_generate_s": first_s,
            "generate_s": warm_s,
            "tokens_per_s": n * args.batch / warm_s,
            "tokens_equal_eager_tp": int((tokens == eager).sum()),
            "tokens": tokens.tolist(),
        }
        result["compile_config"].update(fused_summary())
        # A compiled forward: what torch.compile(model) users run, here under generate().
        forward = model.forward
        model.forward = torch.compile(forward, backend="infinifuse")
        try:
            compiled, _, compiled_s = first_and_again(
                device, lambda: generate(model, inputs, n, disable_compile=True), args.once,
                "compiled forward generate",
            )  # fmt: skip
        finally:
            model.forward = forward
        result["compiled_forward"] = {
            "generate_s": compiled_s,
            "tokens_per_s": n * args.batch / compiled_s,
            "tokens_equal_eager_tp": int((compiled == eager).sum()),
        }
        if args.device_loop:  # fusebackend.generate: k decode steps per captured graph
            result["device_loop"] = device_loop(args, model, inputs, eager, device)
        result["eager_tp"] = {
            "generate_s": eager_s,
            "tokens_per_s": n * args.batch / eager_s,
            "tokens": eager.tolist(),
        }
        if single is not None:
            reference = generate(single, inputs, n, disable_compile=True)
            result["tokens_equal_single_device"] = int((tokens == reference).sum())
    _mark("done")
    stats = fusebackend.stats()
    result["stats"] = {k: v for k, v in stats.items() if k not in ("cached_shapes",)}
    result["tokens_total"] = n * args.batch
    _print(result)
    if args.json:
        with open(f"{args.json}.rank{rank}.json", "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


def device_loop(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, torch.Tensor],
    eager: Any,
    device: torch.device,
) -> dict[str, Any]:
    """``fusebackend.generate`` on this rank's shards: the first call (compile and capture),
    then a timed one; its tokens against eager tensor-parallel's, and its report."""
    import fusebackend
    import fusebackend.generation

    n = args.new_tokens

    def run() -> Any:
        kwargs = {"do_sample": False, "max_new_tokens": n, "min_new_tokens": n}
        eos = model.generation_config.eos_token_id
        pad = model.generation_config.pad_token_id
        kwargs["pad_token_id"] = (
            pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
        )
        out = fusebackend.generate(model, inputs["input_ids"], decode_steps=args.decode_steps,
                                   attention_mask=inputs["attention_mask"], **kwargs)  # fmt: skip
        return out[:, inputs["input_ids"].shape[1] :].cpu()

    tokens, first_s, warm_s = first_and_again(device, run, args.once, "device-loop generate")
    report = fusebackend.generation.last_report()
    return {
        "first_generate_s": first_s,
        "generate_s": warm_s,
        "tokens_per_s": n * args.batch / warm_s,
        "tokens_equal_eager_tp": int((tokens == eager).sum()),
        "path": report.path,
        "reason": report.reason,
        "captured": report.captured,
    }


def shutdown(device: torch.device) -> None:
    """Free the captured graphs, then leave the process group. NCCL's communicator teardown
    waited forever while CUDA graphs holding its collectives were alive (2 H100s, NCCL
    2.28, torch 2.11: destroy_process_group hung on both ranks after a captured generate)."""
    _free_graphs(device)
    dist.barrier()
    dist.destroy_process_group()


def _free_graphs(device: torch.device, wait: bool = True) -> None:
    import fusebackend

    wait = wait and device.type == "cuda"
    if wait:
        torch.cuda.synchronize(device)  # no replay of a graph in flight when it is freed
    torch._dynamo.reset()
    fusebackend.clear_cache()
    if wait:
        torch.cuda.synchronize(device)


def _print(result: dict[str, Any]) -> None:
    rank, total = result["rank"], result["tokens_total"]
    cc, fwd = result["compile_config"], result["compiled_forward"]
    lines = [
        f"[rank {rank}/{result['world']} on {result['device']}, {result['dtype']}]",
        f"  eager TP: {result['eager_tp']['tokens_per_s']:.1f} tokens/s",
        f"  CompileConfig(backend='infinifuse'): first generate {cc['first_generate_s']:.2f} s, "
        f"then {cc['tokens_per_s']:.1f} tokens/s; tokens equal eager TP "
        f"{cc['tokens_equal_eager_tp']}/{total}",
        f"  torch.compile(model.forward, backend='infinifuse'): {fwd['tokens_per_s']:.1f} "
        f"tokens/s; tokens equal eager TP {fwd['tokens_equal_eager_tp']}/{total}",
    ]
    if "device_loop" in result:
        loop = result["device_loop"]
        lines.append(
            f"  fusebackend.generate (device loop, {loop['path']}): {loop['tokens_per_s']:.1f} "
            f"tokens/s; tokens equal eager TP {loop['tokens_equal_eager_tp']}/{total}"
        )
    if "tokens_equal_single_device" in result:
        lines.append(
            f"  tokens equal one device's eager: {result['tokens_equal_single_device']}/{total}"
        )
    for graph in cc["graphs"]:
        lines.append(
            f"  {graph['name']}: {graph['path']}, {graph['groups']} fused group(s), "
            f"{graph['collectives']} collective(s), {graph['local_shards']} DTensor "
            f"inputs as local shards, {len(graph['matmul_groups'])} matmul group(s), "
            f"{len(graph['rotary_epilogues'])} with their rotary embedding"
        )
    modes = result["stats"]["fusion_modes"]
    lines.append(
        f"  signatures: {len(modes)}, modes: {sorted(set(modes.values()))}, "
        f"captures: {result['stats']['recordings']}"
    )
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    run(args)


if __name__ == "__main__":
    main()
