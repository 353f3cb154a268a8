"""Tensor parallelism: a decode step and transformers' generate() on N GPUs, four backends.

    torchrun --nproc_per_node 2 benchmarks/tensor_parallel.py --shape tinyllama --out tp2.json
    torchrun --nproc_per_node 1 benchmarks/tensor_parallel.py --shape tinyllama --out tp1.json

With N > 1 the model is loaded with ``tp_plan="auto"`` (NCCL); with N = 1 it is the whole
model on one GPU (what "TP=1" means in the results). Random weights of the chosen shape are
saved once by rank 0 (``--model-root``, reused by later runs of the same shape).

Per backend (eager, infinifuse, Inductor with mode="reduce-overhead", and infinifuse-loop:
generate only), each from cold Dynamo caches, on every rank at once:
- decode step: ``torch.compile(model.forward)``, B=1 with a StaticCache after a 64-token
  prefill; the first call (compilation included), then the median over rounds of the time
  per step of 32 back-to-back steps;
- generate: ``CompileConfig(backend=...)`` (eager: ``disable_compile=True``), 64 new tokens
  after a 16-token prompt, greedy; the first generate, then the median of 3.
  ``infinifuse-loop`` is ``fusebackend.generate(..., decode_steps=k)`` (``--decode-steps``,
  default 8): infinifuse's device decode loop, k steps per captured graph on every rank, the
  all-reduces inside it (docs/GENERATION.md). Rank 0 records, per backend, whether every
  rank generated the same tokens and how many equal eager tensor-parallel's.
Also the time of one all-reduce of a decode step's hidden row (NCCL, captured in a CUDA
graph, 200 replays) times the step's all-reduces: the communication share of a step.
Rank 0 writes the JSON: device, versions, date, every rank's figures. ``--guard-filter``
compiles infinifuse with Dynamo's guards on the parameters skipped (README: Tensor
parallelism), the loop's step included; each rank's row records it. The loop's graph replays
skip Dynamo's guards anyway, so without the filter the loop is compared with a CompileConfig
row that pays them on every step.

On CPUs the ranks join with gloo (a smoke test of the plumbing: transformers compiles only on
accelerators, so CompileConfig's rows run eagerly there, and nothing is captured):

    torchrun --nproc_per_node 2 benchmarks/tensor_parallel.py --shape tiny \
        --backends eager,infinifuse,infinifuse-loop --parts generate --new-tokens 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from llama_shapes import TINYLLAMA  # noqa: E402  (the examples' shapes)

SHAPES = {
    "tinyllama": TINYLLAMA,
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
LOOP = "infinifuse-loop"  # fusebackend.generate: the device decode loop (generate part only)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--backends", default=f"eager,infinifuse,inductor,{LOOP}")
    parser.add_argument("--parts", default="decode,generate", help="decode, generate or both")
    parser.add_argument("--model-root", default="/tmp/fusebackend_tp_models")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--decode-steps", type=int, default=8, help=f"{LOOP}: the loop's k (steps per replay)"
    )
    parser.add_argument(
        "--guard-filter",
        action="store_true",
        help="infinifuse compiled with options={'guard_filter_fn': torch.compiler."
        "skip_guard_on_all_nn_modules_unsafe}: no per-call guards on the DTensor parameters "
        "(README: Tensor parallelism)",
    )
    parser.add_argument("--commit", default=os.environ.get("FUSEBACKEND_COMMIT"))
    parser.add_argument("--out", help="JSON path (rank 0 writes it)")
    parser.add_argument(
        "--ledger",
        metavar="PATH",
        help="also append rank 0's figures to the results ledger at PATH",
    )
    return parser.parse_args()


def setup() -> tuple[torch.device, int, int]:
    """This rank's device (a CPU with gloo where there is no GPU: the smoke test), rank, world."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        if world > 1:
            dist.init_process_group("gloo")
        return torch.device("cpu"), int(os.environ.get("RANK", "0")), world
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    return device, int(os.environ.get("RANK", "0")), world


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def model_dir(args: argparse.Namespace, rank: int, world: int) -> str:
    import transformers

    path = os.path.join(args.model_root, args.shape)
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config = transformers.LlamaConfig(**{**SHAPES[args.shape], "max_position_embeddings": 4096})
        torch.manual_seed(0)
        # Built on the GPU in fp16: random init of 8B parameters on a CPU takes minutes.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_of())
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    barrier(world)
    return path


def dtype_of() -> torch.dtype:
    return torch.float16 if torch.cuda.is_available() else torch.float32


def load(path: str, device: torch.device, world: int) -> Any:
    import transformers

    kwargs: dict[str, Any] = {"dtype": dtype_of(), "local_files_only": True}
    if world > 1:
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", **kwargs
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()


def synced(device: torch.device, world: int, fn: Any) -> tuple[Any, float]:
    """``fn()`` and its wall time, every rank starting together, the GPU's work included."""
    sync(device)
    barrier(world)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def reset_compilers() -> None:
    import fusebackend

    torch._dynamo.reset()
    fusebackend.clear_cache()
    fusebackend.reset_stats()


def prefilled_step(model: Any, forward: Any, device, length: int, prompt: int = 64) -> Any:
    """A B=1 decode step calling ``forward`` (the model's forward, compiled or not) on a
    StaticCache of ``length`` slots after an eager ``prompt``-token prefill; each call feeds
    its argmax back as the next token (``length`` bounds the calls: prompt + calls)."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=length)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=generator).to(device)
    with torch.no_grad():
        model(
            ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(prompt, device=device),
        )
    token = ids[:, -1:].clone()
    position = [prompt]

    def step() -> None:
        p = position[0]
        out = forward(
            token,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.tensor([p], device=device),
        )
        token.copy_(out.logits[:, -1:].argmax(-1))
        position[0] = p + 1

    return step


def decode(model: Any, backend: str, args: argparse.Namespace, device, world) -> dict[str, Any]:
    if backend == "eager":
        forward = model.forward
    elif backend == "infinifuse":
        options = compile_options(args.guard_filter)
        forward = torch.compile(model.forward, backend="infinifuse", options=options)
    else:
        forward = torch.compile(model.forward, mode="reduce-overhead")
    length = 64 + 1 + args.steps * (args.rounds + 1) + 8
    step = prefilled_step(model, forward, device, length)
    with torch.no_grad():
        _, first = synced(device, world, step)
        for _ in range(3):
            step()
        rounds = []
        for _ in range(args.rounds):

            def run() -> None:
                for _ in range(args.steps):
                    step()

            rounds.append(synced(device, world, run)[1] / args.steps)
    return {
        "first_call_s": first,
        "step_ms": statistics.median(rounds) * 1e3,
        "step_ms_rounds": [r * 1e3 for r in rounds],
    }


def generate(model: Any, backend: str, args: argparse.Namespace, device, world) -> dict[str, Any]:
    import transformers

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, 16), generator=generator).to(device)
    kwargs: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "cache_implementation": "static",
        "pad_token_id": 0,
    }
    if backend == LOOP:
        return device_loop(model, ids, kwargs, args, device, world)
    if backend == "eager":
        kwargs["disable_compile"] = True
    elif backend == "infinifuse":
        # torch.compile takes a mode or options, not both (CompileConfig's default is a mode)
        options = compile_options(args.guard_filter)
        kwargs["compile_config"] = transformers.CompileConfig(
            backend="infinifuse", **({"mode": None, "options": options} if options else {})
        )
    else:
        kwargs["compile_config"] = transformers.CompileConfig()  # Inductor, reduce-overhead
    with torch.no_grad():
        return timed_generate(lambda: model.generate(ids, **kwargs), args, device, world)


def timed_generate(run: Any, args: argparse.Namespace, device, world) -> dict[str, Any]:
    """The first call of ``run`` (a generate) and the median of 3 more: the figures and the
    first call's new tokens (after the 16-token prompt)."""
    tokens, first = synced(device, world, run)
    times = [synced(device, world, run)[1] for _ in range(3)]
    median = statistics.median(times)
    return {
        "first_generate_s": first,
        "generate_s": median,
        "tokens_per_s": args.new_tokens / median,
        "tokens": tokens[0, 16:].tolist(),
    }


def device_loop(model: Any, ids: Any, kwargs: dict[str, Any], args, device, world) -> dict:
    """generate()'s figures for ``fusebackend.generate`` (the same arguments as the other
    backends' generate; the decode step compiled with --guard-filter's options too) and
    whether its chunks were captured; an error where it fell back to transformers' loop."""
    import fusebackend
    import fusebackend.generation.loop

    options = compile_options(args.guard_filter)

    def run() -> Any:
        return fusebackend.generate(
            model, ids, decode_steps=args.decode_steps, options=options, **kwargs
        )

    try:
        with torch.no_grad():
            figures = timed_generate(run, args, device, world)
    finally:
        # The loop keeps its captured k-step graph (NCCL all-reduces inside) for the model's
        # next call, out of reach of fusebackend.clear_cache(), as long as the model lives (here:
        # to the end of the run): NCCL's teardown waited forever while such graphs lived
        # (examples/tp_generate.py's shutdown). Synchronized above: no replay in flight when
        # it goes.
        fusebackend.generation.loop._loops.pop(model, None)
    report = fusebackend.generation.last_report()
    if report.path != "device loop":  # the figures would be transformers' loop's
        raise RuntimeError(f"fusebackend.generate fell back to transformers' loop: {report.reason}")
    return {**figures, "decode_steps": args.decode_steps, "captured": report.captured,
            "replays": report.replays}  # fmt: skip


def compile_options(guard_filter: bool) -> dict[str, Any] | None:
    """infinifuse's torch.compile options: with ``guard_filter`` (--guard-filter), Dynamo's
    guards on the model's parameters skipped (their DTensor spec checks cost more host time
    per call than a B=1 step's kernels take on 2 H100s: benchmarks/diag/diag_tp_step.py)."""
    if not guard_filter:
        return None
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def all_reduce_ms(model: Any, device: torch.device, world: int) -> float | None:
    """One NCCL all-reduce of a decode step's hidden row, replayed from a CUDA graph."""
    if world == 1 or device.type != "cuda":
        return None
    row = torch.randn(1, 1, model.config.hidden_size, device=device, dtype=torch.float16)
    for _ in range(5):
        dist.all_reduce(row)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(20):
            dist.all_reduce(row)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    _, seconds = synced(device, world, lambda: [graph.replay() for _ in range(10)])
    return seconds / 200 * 1e3


def environment(world: int, commit: str | None) -> dict[str, Any]:
    import transformers
    import triton

    import fusebackend

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})",
        "gpus": world if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "fusebackend": fusebackend.__version__,
        "commit": commit,
        "python": platform.python_version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main() -> None:
    args = parse_args()
    device, rank, world = setup()
    model = load(model_dir(args, rank, world), device, world)
    config = model.config
    # all-reduces of a decode step: after each layer's o_proj and down_proj, the embedding's.
    reduces = 2 * config.num_hidden_layers + 1
    result: dict[str, Any] = {"shape": args.shape, "tp": world, "rank": rank, "backends": {},
                              "guard_filter": args.guard_filter}  # fmt: skip
    one = all_reduce_ms(model, device, world)
    if one is not None:
        result["all_reduce_ms"] = one
        result["all_reduces_per_step"] = reduces
        result["all_reduce_ms_per_step"] = one * reduces
    for backend in args.backends.split(","):
        row: dict[str, Any] = {}
        for part, fn in (("decode", decode), ("generate", generate)):
            if part not in args.parts or (part == "decode" and backend == LOOP):
                continue  # (the loop is a way to generate(); the infinifuse row times a step)
            reset_compilers()
            try:
                row[part] = fn(model, backend, args, device, world)
            except Exception as error:  # recorded, and the other rows still run
                row[part] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            if backend == "infinifuse":
                import fusebackend

                stats = fusebackend.stats()
                row[part]["modes"] = sorted(set(stats["fusion_modes"].values()))
                row[part]["recordings"] = stats["recordings"]
        result["backends"][backend] = row
        print(
            f"[rank {rank}] {args.shape} TP={world} {backend}: {json.dumps(row)[:600]}", flush=True
        )
    gathered: list[Any] = [result]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
    if rank == 0:
        report = {"environment": environment(world, args.commit), "ranks": gathered,
                  "generate_tokens": token_checks(gathered)}  # fmt: skip
        _summary(report)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        if args.ledger:
            import ledger  # benchmarks/ledger.py, beside this file (sys.path[0])

            source = args.out or f"tensor_parallel_{args.shape}_tp{world}.json"
            count = ledger.append_result(report, source, args.ledger)
            print(f"ledger: {count} rows -> {args.ledger}", flush=True)
    # Captured graphs first: NCCL's teardown hung while graphs holding its collectives lived
    # (examples/tp_generate.py's shutdown).
    reset_compilers()
    sync(device)
    barrier(world)
    if world > 1:
        dist.destroy_process_group()


def token_checks(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per backend that generated: whether every rank's tokens are the same (each rank
    chooses them from its own copy of the logits: ranks that part have seen different logits),
    and how many of rank 0's equal eager tensor-parallel's."""

    def tokens(rank: dict[str, Any], backend: str) -> list[int] | None:
        return ((rank["backends"].get(backend) or {}).get("generate") or {}).get("tokens")

    checks = {}
    eager = tokens(ranks[0], "eager")
    for backend in ranks[0]["backends"]:
        per_rank = [tokens(rank, backend) for rank in ranks]
        if per_rank[0] is None:
            continue
        check: dict[str, Any] = {"same_on_every_rank": all(t == per_rank[0] for t in per_rank)}
        if eager is not None and backend != "eager":
            check["tokens_equal_eager"] = sum(a == b for a, b in zip(per_rank[0], eager))
            check["tokens"] = len(eager)
        checks[backend] = check
    return checks


def _summary(report: dict[str, Any]) -> None:
    rank0 = report["ranks"][0]
    print(f"\n{rank0['shape']}, TP={rank0['tp']} on {report['environment']['device']}")
    if "all_reduce_ms_per_step" in rank0:
        print(
            f"  all-reduce: {rank0['all_reduce_ms'] * 1e3:.1f} us each, "
            f"{rank0['all_reduce_ms_per_step']:.3f} ms per step"
        )
    checks = report.get("generate_tokens", {})
    for backend, row in rank0["backends"].items():
        d, g = row.get("decode", {}), row.get("generate", {})
        check = checks.get(backend, {})
        tokens = ""
        if check:
            tokens = f"  same on every rank {check['same_on_every_rank']}"
        if "tokens_equal_eager" in check:
            tokens += f", equal eager {check['tokens_equal_eager']}/{check['tokens']}"
        print(
            f"  {backend:15s} step {d.get('step_ms', float('nan')):7.3f} ms  first call "
            f"{d.get('first_call_s', float('nan')):6.2f} s | generate "
            f"{g.get('tokens_per_s', float('nan')):7.1f} tok/s  first "
            f"{g.get('first_generate_s', float('nan')):6.2f} s{tokens}  {d.get('error', '')}"
            f"{g.get('error', '')}"[:400]
        )


if __name__ == "__main__":
    main()
