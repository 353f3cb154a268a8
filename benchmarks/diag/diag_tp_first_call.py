"""Where does the first ``generate()`` of a tensor-parallel model go: Dynamo's tracing or
infinifuse's own passes? On N ranks (issue 24: the first call at TP=2 took 0.38-0.42x
reduce-overhead's on 2 H100s at 9bdc3da against 0.32x at 0eb9757, both 2026-11-26, and
infinifuse's 8B TP=2 first call took ~9 s more than its TP=1 one).

A random Llama of ``examples/tp_generate.py``'s tiny widths (hidden 64) with ``LAYERS``
layers (default 22) is saved once, loaded with ``tp_plan="auto"`` (on one rank: unsharded,
unless TP1_PLAN is set), and generates 2 tokens through ``CompileConfig(backend=
"infinifuse")``. Rank 0 prints the first generate's time, each graph's compile seconds in
the backend (``GraphReport.compile_seconds``) with its slowest passes, and Dynamo's own
compile metrics (``torch._dynamo.utils.compile_times``). On CPUs (gloo) the kernels run in
Triton's interpreter, so the figures say nothing of Triton's compiles or CUDA graph captures:
only of tracing and the backend's passes. Where a GPU is present (``/dev/nvidiactl``; NCCL)
the model has TinyLlama's widths in fp16, and rank 0 also prints the seconds spent in CUDA
graph captures and in the runs of new signatures (fused, validated once per class); the
backend's compile seconds include Triton's compiles (its ``precompile`` pass).

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/diag/diag_tp_first_call.py
    PYTHONPATH=. torchrun --nproc_per_node 1 benchmarks/diag/diag_tp_first_call.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

GPU = os.path.exists("/dev/nvidiactl")
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch and Triton: CPU ranks
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))  # fmt: skip

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import tp_generate as tg  # noqa: E402
import transformers  # noqa: E402
from torch._dynamo.utils import compile_times  # noqa: E402

import fusebackend  # noqa: E402


def _time_runtime() -> dict[str, float]:
    """Seconds in CUDA graph captures and in the runs of new signatures (fused, with their
    validation), summed (both functions are looked up on their modules at each call)."""
    from fusebackend.runtime import capture, graph_cache

    spent = {"capture_s": 0.0, "captures": 0, "new_key_runs_s": 0.0, "new_key_runs": 0}

    def timed(owner, name: str, count: str, seconds: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                spent[seconds] += time.perf_counter() - start
                spent[count] += 1

        setattr(owner, name, wrapper)

    timed(capture, "capture_graph", "captures", "capture_s")
    timed(graph_cache, "fused_run", "new_key_runs", "new_key_runs_s")
    return spent


def main() -> None:
    layers = os.environ.get("LAYERS", "22")
    shape = [] if GPU else ["--tiny", "--interpret"]
    args = tg.parse_args([*shape, "--layers", layers, "--new-tokens", "2"])
    device = tg.setup()
    spent = _time_runtime()
    sharded = dist.get_world_size() > 1 or bool(os.environ.get("TP1_PLAN"))
    with tempfile.TemporaryDirectory() as root:
        shared = [root]
        dist.broadcast_object_list(shared, src=0)
        path = tg.random_model_dir(args, shared[0])
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float16 if GPU else torch.float32, local_files_only=True,
            **({"tp_plan": "auto"} if sharded else {}),
        ).eval()  # fmt: skip
        if not sharded:  # from_pretrained without a tp_plan loads onto the CPU
            model.to(device)
        dist.barrier()
    inputs = tg.prompts(args, model.config.vocab_size, device)
    with torch.no_grad():
        config = tg.compile_config()
        _, first_s = tg.timed(device, lambda: tg.generate(model, inputs, 2, compile_config=config))
    graphs = fusebackend.reports().graphs
    report = {
        "world": dist.get_world_size(), "layers": int(layers), "sharded": sharded,
        "first_generate_s": first_s,
        "graphs": [{"name": g.name, "backend_compile_s": g.compile_seconds,
                    "slowest_passes_s": dict(sorted(g.pass_seconds.items(),
                                                    key=lambda kv: -kv[1])[:6])}
                   for g in graphs],
        "backend_compile_s": sum(g.compile_seconds for g in graphs),
        **spent,
    }  # fmt: skip
    if dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
        print(compile_times(repr="str", aggregate=True))
    fusebackend.clear_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
