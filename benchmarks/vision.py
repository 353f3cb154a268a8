"""Vision models (timm, random weights): eager, Inductor, reduce-overhead and infinifuse (issue 38).

Each model is ``timm.create_model(name, pretrained=False).eval()`` (``--models``; ``convblock``
is a small ResNet basic block written here, for CPU smoke tests), seeded, fp16 on CUDA (fp32 on
the CPU), fed seeded random ``batch x 3 x 224 x 224`` inputs at each of ``--batches`` (1 and 8).
Before anything is timed the norms are made non-trivial (``--init calibrated``, the default):
every BatchNorm's weight and bias are drawn at random and its running statistics measured over
two random batches in train mode (fp32), and layer-scale ``gamma`` vectors (ConvNeXt's start at
1e-6) are drawn near 1. timm's own init zeroes the last BatchNorm of each ResNet/RegNet block
and ConvNeXt's layer scales make every block almost the identity, so a wrong fused kernel inside
a residual branch would barely move the logits; ``--init timm`` keeps timm's init.

Backends (``--backends``): ``eager``; ``inductor`` (``torch.compile`` default mode);
``reduce-overhead``; ``infinifuse``; and infinifuse with options, ``--variant NAME=JSON``
(repeatable; e.g. ``--variant 'infinifuse-cl={"channels_last":true}'``; every variant runs, added
after ``--backends`` unless named there). An unknown option raises in the backend at the first
call: the row records the error and the run goes on. Every compile passes ``dynamic=False``:
without it Dynamo's automatic dynamic shapes would compile the second batch size as a graph with
a symbolic batch, not a graph of its own.

Each (model, backend) runs in its own process with empty Inductor and Triton cache directories
(a cold start, as a user's first run). The process builds the model, computes eager's outputs
(fp32 with cuDNN's TF32 off, then fp16: the references; this also starts CUDA, cuDNN and
cuBLAS, so no first call pays for them), then for each batch size in turn, in one compiled
callable (a user's process keeps the first size's graph while compiling the second, so the
second size's first call is not a cold one):

- ``first_call_s``: the first call, synchronized (Dynamo, the backend's compile, Triton's
  compiles, everything); ``second_call_s``: the next, where infinifuse captures its CUDA
  graph and reduce-overhead records its own;
- ``warmup`` more calls (default 10: infinifuse captures on its 2nd call, reduce-overhead records
  on its 2nd and replays from its 3rd), then ``per_call_ms``: the median of ``--calls``
  (default 50) calls, each timed alone between ``torch.cuda.synchronize()`` calls (host and
  device time of one call), garbage collection off; ``per_call_ms_loop``: the same calls back to
  back between two synchronizations (host work overlaps the device's), per call;
- ``max_abs_err``: the largest ``|out - eager fp16|`` over the first call's and the last warm-up
  call's outputs (the replayed path); ``max_abs_err_fp32``: the same against eager fp32;
  ``ref_max_abs``: eager fp32's largest logit, for scale;
- ``kernels_per_call``: CUDA kernels (memcpy / memset apart) in ``torch.profiler`` over one call
  WITHOUT CUDA graphs, counted after every batch size was timed: eager and Inductor's default
  mode count their timed callable; infinifuse and its variants are compiled again with
  ``cudagraphs=False`` (after ``torch._dynamo.reset()``); reduce-overhead takes Inductor default
  mode's count (the same generated code): borrowed from the ``inductor`` row of the same run
  when there is one, else compiled in its own process after its timed part (a second Inductor
  compile: the Triton cache of its first makes it cheaper). ``kernels_timed_path``: what the
  profiler saw in one call of the timed (replaying) callable, for the CUDA-graph backends;
- infinifuse rows: every graph's report (``fused_groups``, ``bn_folded``, ``bn_left_alone``,
  ``fused_launches``, the graph paths, the backend's compile seconds) and the modes its
  signatures reached (``fusebackend.stats()``).

The parent prints each process's records on stderr as one JSON line each, writes ``--out``
after every process (a run cut short keeps what finished; a process killed by
``--child-timeout`` keeps the batch sizes it finished), stops starting processes once
``--time-budget`` seconds have passed, and prints the table last: each row's per call and first
call as a ratio to reduce-overhead's, and per backend the geometric mean of the ratios.
``--ledger PATH`` appends each process's rows as it finishes (workload ``vision-<model>-b<batch>``;
per_call_ms, first_call_s, kernels_per_call, max_abs_err). ``--parallel N`` runs N processes at
once, each on a GPU of its own (the first N that ``CUDA_VISIBLE_DEVICES`` lists, else GPUs 0 to
N-1; one host: the timings share its CPUs, and Inductor's compile workers are split between the
processes).

    python benchmarks/vision.py --out /tmp/vision.json --ledger /tmp/vision_ledger.jsonl
    python benchmarks/vision.py --models resnet50,convnext_tiny --backends eager,infinifuse \\
        --variant 'infinifuse-cl={"channels_last":true}' --out /tmp/vision.json
    python benchmarks/vision.py --dry-run --out /tmp/vision.json   # CPU: eager + infinifuse
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# The seven first (a run cut short by --time-budget has them), then more families, all
# made for 224 x 224 inputs: plain and grouped residual convs, RepVGG, GhostNet, LeViT (a
# hybrid whose attention projections are linear + BatchNorm1d), DenseNet (its concatenations
# make the slowest Inductor compile of the list, hence last).
DEFAULT_MODELS = (
    "resnet50", "convnext_tiny", "efficientnet_b0", "mobilenetv3_large_100", "regnety_016",
    "vit_small_patch16_224", "swin_tiny_patch4_window7_224", "resnet18", "resnext50_32x4d",
    "repvgg_a2", "ghostnet_100", "levit_128s", "densenet121",
)  # fmt: skip
BASE_BACKENDS = ("eager", "inductor", "reduce-overhead", "infinifuse")
# (per_call_ms less kernel_us_per_call: the host's share of a call timed alone)
LEDGER_METRICS = {"per_call_ms": "ms", "per_call_ms_loop": "ms", "first_call_s": "s",
                  "kernels_per_call": "count", "kernel_us_per_call": "us",
                  "max_abs_err": "abs"}  # fmt: skip
_MARKER = "VISION_RESULT "


def _cuda_present() -> bool:
    # As tests/conftest.py decides it, without importing torch: TRITON_INTERPRET must be set
    # before torch or Triton is imported.
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


# ---------------------------------------------------------------- child: one model, one backend


def conv_block_net() -> Any:
    """A stem conv-BN-ReLU, one ResNet basic block as timm writes it (conv-BN-ReLU, conv-BN,
    + shortcut, ReLU), a global mean and a linear head: ``--models convblock``."""
    from torch import nn

    class ConvBlockNet(nn.Module):
        def __init__(self, width: int = 16, classes: int = 10) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU())  # fmt: skip
            self.conv1 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.act1 = nn.ReLU()
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.act2 = nn.ReLU()
            self.head = nn.Linear(width, classes)

        def forward(self, x: Any) -> Any:
            x = self.stem(x)
            shortcut = x
            x = self.act1(self.bn1(self.conv1(x)))
            x = self.bn2(self.conv2(x))
            x = self.act2(x + shortcut)
            return self.head(x.mean((2, 3)))

    return ConvBlockNet()


def build_model(name: str, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)  # the same weights in every process: eager's outputs are shared
    if name == "convblock":
        return conv_block_net().eval()
    import timm

    return timm.create_model(name, pretrained=False).eval()


def calibrate_norms(model: Any, image: int, device: Any, seed: int) -> dict[str, int]:
    """Random BatchNorm affine parameters with running statistics measured on random inputs,
    and layer-scale gammas near 1 (module docstring: why); the model is left in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    scales = [p for n, p in model.named_parameters() if n.split(".")[-1] == "gamma"
              and p.dim() == 1]  # fmt: skip
    with torch.no_grad():
        for m in norms:
            if m.affine:
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
        for p in scales:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        if norms:
            momenta = [m.momentum for m in norms]
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the calibration batches
            model.train()
            for _ in range(2):
                model(torch.randn(8, 3, image, image, generator=gen).to(device))
            for m, momentum in zip(norms, momenta):
                m.momentum = momentum
    model.eval()
    return {"batch_norms": len(norms), "layer_scales": len(scales)}


def make_fn(model: Any, backend: str, options: dict[str, Any] | None) -> Any:
    import torch

    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model, dynamic=False)
    if backend == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return torch.compile(model, backend="infinifuse", options=options, dynamic=False)


def count_kernels(fn: Any, x: Any, cuda: bool, step: Any) -> dict[str, Any]:
    """CUDA kernels, copies and device time in torch.profiler over one call of ``fn`` (after
    two calls: a fresh compile's first call and a capture's run stay out); None on the CPU."""
    import torch

    for _ in range(2):
        step()
        fn(x)
    _sync(cuda)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        fn(x)
        _sync(cuda)
    if not cuda:
        return {"kernels_per_call": None, "copies_per_call": None, "kernel_us_per_call": None}
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if e.name.startswith(("Memcpy", "Memset"))]
    kinds: dict[str, list[float]] = {}
    for e in events:
        kinds.setdefault(e.name[:90], []).append(e.device_time)
    top = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:10]
    return {
        "kernels_per_call": len(events) - len(copies),
        "copies_per_call": len(copies),
        "kernel_us_per_call": round(sum(e.device_time for e in events), 2),
        "kernel_kinds": [{"name": n, "count": len(t), "us": round(sum(t), 2)} for n, t in top],
        # every kernel name (cut at 90 characters) with its count: what two backends'
        # counts differ by
        "kernel_counts": {n: len(t) for n, t in sorted(kinds.items())},
        "kernel_us": {n: round(sum(t), 2) for n, t in sorted(kinds.items())},
    }


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def fusion_fields(graphs: list[Any]) -> dict[str, Any]:
    """What infinifuse's reports say about the graphs one batch size compiled."""

    def total(key: str) -> int:
        return sum(len(g.rewrites.get(key, [])) for g in graphs)

    return {
        "graphs": len(graphs),
        "graph_paths": sorted({g.path[:160] for g in graphs}),
        "fused_groups": sum(len(g.groups) for g in graphs),
        "bn_folded": total("batch_norms_folded"),
        "bn_left_alone": total("batch_norms_left_alone"),
        "fused_launches": sum(sum(g.launches.values()) for g in graphs),
        "rejections": sum(len(g.rejections) for g in graphs),
        "backend_compile_s": round(sum(g.compile_seconds for g in graphs), 3),
    }


def time_batch(fn: Any, x: Any, ref: Any, ref32: Any, args: argparse.Namespace, cuda: bool,
               step: Any) -> dict[str, Any]:  # fmt: skip
    """One batch size: first call, warm-up, timed calls, errors (module docstring)."""
    _sync(cuda)
    start = time.perf_counter()
    out = fn(x)
    _sync(cuda)
    first_call_s = time.perf_counter() - start
    outputs = [out.detach().clone().float()]  # cloned: reduce-overhead reuses its buffers
    start = time.perf_counter()
    for k in range(args.warmup):
        out = None  # the previous output dies before the next call, as in a user's loop
        step()
        out = fn(x)
        if k == 0:  # the call that captures (infinifuse) or records (reduce-overhead)
            _sync(cuda)
            second_call_s = time.perf_counter() - start
    outputs.append(out.detach().clone().float())
    out = None
    times = []
    gc.collect()
    gc.disable()  # one collection inside the loop would be an outlier, not the backend's cost
    try:
        for _ in range(args.calls):
            _sync(cuda)
            start = time.perf_counter()
            step()
            out = fn(x)
            _sync(cuda)
            times.append((time.perf_counter() - start) * 1e3)
            out = None
        start = time.perf_counter()
        for _ in range(args.calls):
            out = None
            step()
            out = fn(x)
        _sync(cuda)
        loop_ms = (time.perf_counter() - start) * 1e3 / args.calls
        out = None
    finally:
        gc.enable()
    times.sort()
    return {
        "first_call_s": first_call_s,
        "second_call_s": second_call_s,
        "per_call_ms": statistics.median(times),
        "per_call_ms_min": times[0],
        "per_call_ms_p90": times[int(0.9 * (len(times) - 1))],
        "per_call_ms_loop": loop_ms,
        "timed_calls": len(times),
        "max_abs_err": max((o - ref).abs().max().item() for o in outputs),
        "max_abs_err_fp32": max((o - ref32).abs().max().item() for o in outputs),
        "max_abs_err_first_call": (outputs[0] - ref).abs().max().item(),
        "ref_max_abs": ref32.abs().max().item(),
    }


def _emit(record: dict[str, Any]) -> None:
    print(_MARKER + json.dumps(record, default=str), flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _brief_error(error: str) -> str:
    """The cause's first line (Dynamo wraps a backend's exception in BackendCompilerFailed)."""
    return error.split("raised:\n")[-1].strip().splitlines()[0][:100]


def child_environment(cuda: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }  # fmt: skip
    from importlib import metadata

    for dist in ("triton", "timm", "transformers", "fusebackend"):  # read, not imported
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info


def run_child(args: argparse.Namespace) -> None:
    """Emits the environment, then each batch's record after its timed part and again with
    its kernel counts: the parent keeps the last record of each batch."""
    if not _cuda_present():  # Triton's interpreter runs infinifuse's kernels on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # CPU figures are a smoke test: one thread, no OpenMP waits on a busy host
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    name, backend = args.model, args.backend
    options = args.options
    infinifuse = options is not None or backend == "infinifuse"
    if infinifuse:  # only there: eager and Inductor's processes run as their users' would
        import fusebackend
        import fusebackend.report as fusebackend_report  # _reports_since: a batch's graphs
    base = {"model": name, "backend": backend, "options": options}
    _emit({**base, "kind": "environment", "environment": child_environment(cuda)})
    start = time.perf_counter()
    try:
        model = build_model(name, args.seed).to(device)
        init = calibrate_norms(model, args.image_size, device, args.seed) \
            if args.init == "calibrated" else None  # fmt: skip
        inputs, refs, refs32 = {}, {}, {}
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # (on by default) a true fp32 reference
        with torch.no_grad():
            for b in args.batches:
                gen = torch.Generator().manual_seed(args.seed + b)
                inputs[b] = torch.randn(b, 3, args.image_size, args.image_size, generator=gen)
                refs32[b] = model(inputs[b].to(device)).float()
            torch.backends.cudnn.allow_tf32 = tf32
            model.to(dtype)
            # timm's LeViT caches its attention biases per device in eval mode, and the cache
            # kept from the fp32 reference fails in fp16 ("expected scalar type Float but
            # found Half"); train(True) clears it.
            model.train().eval()
            for b in args.batches:
                inputs[b] = inputs[b].to(device, dtype)
                refs[b] = model(inputs[b]).float()
        _sync(cuda)
    except Exception as exc:  # noqa: BLE001  (timm missing, an unknown name: recorded)
        for b in args.batches:
            _emit({**base, "batch": b, "error": _error(exc), "phase": "build"})
        return
    build_s = time.perf_counter() - start
    step = (torch.compiler.cudagraph_mark_step_begin if backend == "reduce-overhead"
            else lambda: None)  # fmt: skip
    fn = make_fn(model, "infinifuse" if infinifuse else backend, options)
    records: dict[int, dict[str, Any]] = {}
    for b in args.batches:
        record = {**base, "batch": b, "dtype": str(dtype).replace("torch.", ""),
                  "image_size": args.image_size, "build_s": build_s, "init": init,
                  "eager_max_abs_err_fp32": (refs[b] - refs32[b]).abs().max().item()}  # fmt: skip
        before = fusebackend_report._recorded if infinifuse else 0
        try:
            with torch.no_grad():
                record.update(time_batch(fn, inputs[b], refs[b], refs32[b], args, cuda, step))
                if args.kernel_counts and backend not in ("eager", "inductor"):
                    timed = count_kernels(fn, inputs[b], cuda, step)
                    record["kernels_timed_path"] = timed["kernels_per_call"]
        except Exception as exc:  # noqa: BLE001  (an unknown option, a compile failure)
            record["error"] = _error(exc)
            record["traceback_tail"] = traceback.format_exc()[-3000:]
        if infinifuse:
            record.update(fusion_fields(fusebackend_report._reports_since(before)))
            stats = fusebackend.stats()
            record["modes"] = sorted(set(stats["fusion_modes"].values()))
            record["fallback_reasons"] = sorted({str(v)[:300] for v in
                                                 stats["fallback_reasons"].values()})  # fmt: skip
        records[b] = record
        _emit(record)
    if not args.kernel_counts or (backend == "reduce-overhead" and args.borrow_kernels):
        return
    # Kernel counts without CUDA graphs, after every timed part (module docstring)
    if infinifuse:
        torch._dynamo.reset()
        fusebackend.clear_cache()
        fn = make_fn(model, "infinifuse", {**(options or {}), "cudagraphs": False})
    elif backend == "reduce-overhead":
        torch._dynamo.reset()
        fn = make_fn(model, "inductor", None)
    source = {"eager": "own call", "inductor": "own call",
              "reduce-overhead": "Inductor default mode, compiled in this process"
              }.get(backend, "compiled again with cudagraphs=False")  # fmt: skip
    for b, record in records.items():
        if "error" in record:
            continue
        try:
            with torch.no_grad():
                record.update(count_kernels(fn, inputs[b], cuda, lambda: None))
            record["kernels_source"] = source if cuda else "no CUDA device"
        except Exception as exc:  # noqa: BLE001
            record["kernels_error"] = _error(exc)
        _emit(record)


# ---------------------------------------------------------------- parent: every child, the JSON


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, options = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant NAME=JSON, got {text!r}")
    try:
        value = json.loads(options)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--variant {name}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--variant {name}: options must be a JSON object")
    if name in BASE_BACKENDS:
        raise argparse.ArgumentTypeError(f"--variant {name}: a base backend's name")
    return name, value


def run_one(args: argparse.Namespace, model: str, backend: str, gpu: int | None) -> dict:
    """One child with its own empty cache directories; its records and how it went."""
    env = dict(os.environ)
    if gpu is not None:
        # The gpu-th of the GPUs the parent may use (CUDA_VISIBLE_DEVICES, when set, lists
        # them: a device call can keep GPU 0 for the tests and time on the others).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        env["CUDA_VISIBLE_DEVICES"] = (
            visible[gpu] if gpu < len(visible) and visible[gpu] else str(gpu)
        )
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    command = [sys.executable, os.path.abspath(__file__), "--child", "--model", model,
               "--backend", backend, "--batches", ",".join(map(str, args.batches)),
               "--image-size", str(args.image_size), "--calls", str(args.calls),
               "--warmup", str(args.warmup), "--seed", str(args.seed), "--init", args.init,
               "--out", args.out]  # fmt: skip
    if backend in args.variants:
        command += ["--options", json.dumps(args.variants[backend])]
    if not args.kernel_counts:
        command.append("--no-kernel-counts")
    if backend == "reduce-overhead" and (args.borrow_kernels or "inductor" in args.backends):
        command.append("--borrow-kernels")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=args.child_timeout)  # fmt: skip
            stdout, stderr, error = done.stdout, done.stderr, None
            if done.returncode != 0:
                error = f"exit {done.returncode}"
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = (_text(exc.stdout), _text(exc.stderr))
            error = f"timed out after {args.child_timeout} s (--child-timeout)"
    child: dict[str, Any] = {"model": model, "backend": backend, "gpu": gpu,
                             "process_s": round(time.perf_counter() - start, 2)}  # fmt: skip
    records: dict[int, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if line.startswith(_MARKER):
            record = json.loads(line[len(_MARKER) :])
            if record.get("kind") == "environment":
                child["environment"] = record["environment"]
            else:
                records[record["batch"]] = record  # the last record of a batch is complete
    if error is not None:
        child["error"] = error
        child["stderr_tail"] = stderr[-3000:]
    for b in args.batches:
        if b not in records:  # the process died before this batch's record
            records[b] = {"model": model, "backend": backend, "batch": b,
                          "error": error or "no record"}  # fmt: skip
    child["records"] = [records[b] for b in args.batches]
    return child


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def borrow_kernels(runs: list[dict[str, Any]]) -> None:
    """reduce-overhead's rows without a count of their own take the inductor row's (the same
    generated code; its CUDA graphs hide the launches)."""
    inductor = {(r["model"], r["batch"]): r for r in runs if r["backend"] == "inductor"}
    for r in runs:
        source = inductor.get((r["model"], r["batch"]))
        if r["backend"] == "reduce-overhead" and "kernels_per_call" not in r and source \
                and source.get("kernels_per_call") is not None:  # fmt: skip
            r["kernels_per_call"] = source["kernels_per_call"]
            r["kernels_source"] = "the inductor row (Inductor default mode)"


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summarize(runs: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Per backend, over the (model, batch) rows where it and reduce-overhead both ran: the
    geometric mean of per-call and first-call ratios, and the rows over 1.0x (issue 38's
    targets: every row <= 1.0x, geometric mean <= 0.85x per call, first call <= 0.35x), and the
    rows with more kernels than Inductor's."""
    ok = {(r["model"], r["batch"], r["backend"]): r for r in runs if "error" not in r}
    out: dict[str, Any] = {}
    for backend in [b for b in backends if b != "reduce-overhead"]:
        per, first, over, kernels_over = [], [], [], []
        for (model, batch, name), r in ok.items():
            if name != backend:
                continue
            ro = ok.get((model, batch, "reduce-overhead"))
            if ro is not None:
                per.append(r["per_call_ms"] / ro["per_call_ms"])
                first.append(r["first_call_s"] / ro["first_call_s"])
                if per[-1] > 1.0:
                    over.append(f"{model}-b{batch} {per[-1]:.2f}x")
            ind = ok.get((model, batch, "inductor")) or ro
            mine, theirs = r.get("kernels_per_call"), (ind or {}).get("kernels_per_call")
            if mine is not None and theirs is not None and mine > theirs:
                kernels_over.append(f"{model}-b{batch} {mine} > {theirs}")
        out[backend] = {"rows_vs_reduce_overhead": len(per),
                        "per_call_geomean_vs_reduce_overhead": _geomean(per),
                        "first_call_geomean_vs_reduce_overhead": _geomean(first),
                        "rows_over_1x": over, "rows_with_more_kernels_than_inductor":
                        kernels_over}  # fmt: skip
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    ro = {(r["model"], r["batch"]): r for r in runs
          if r["backend"] == "reduce-overhead" and "error" not in r}  # fmt: skip
    head = ("model", "batch", "backend", "per call ms", "x ro", "first s", "x ro", "kernels",
            "max err", "groups", "BN folded", "error")  # fmt: skip
    rows = [head]
    for r in runs:
        if "error" in r:
            rows.append((r["model"], str(r["batch"]), r["backend"], *("",) * 8,
                         _brief_error(r["error"])))  # fmt: skip
            continue
        base = ro.get((r["model"], r["batch"]))
        per = r["per_call_ms"] / base["per_call_ms"] if base else None
        first = r["first_call_s"] / base["first_call_s"] if base else None
        rows.append((r["model"], str(r["batch"]), r["backend"], _fmt(r["per_call_ms"], ".3f"),
                     _fmt(per, ".2f"), _fmt(r["first_call_s"], ".2f"), _fmt(first, ".2f"),
                     _fmt(r.get("kernels_per_call"), "d"), _fmt(r.get("max_abs_err"), ".2e"),
                     _fmt(r.get("fused_groups"), "d"), _fmt(r.get("bn_folded"), "d"),
                     ""))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for backend, s in summary.items():
        if s["rows_vs_reduce_overhead"]:
            per = _fmt(s["per_call_geomean_vs_reduce_overhead"], ".3f")
            first = _fmt(s["first_call_geomean_vs_reduce_overhead"], ".3f")
            lines.append(
                f"{backend}: per call geomean {per}x reduce-overhead over "
                f"{s['rows_vs_reduce_overhead']} rows, first call {first}x; over 1.0x: "
                f"{', '.join(s['rows_over_1x']) or 'none'}"
            )
        if s["rows_with_more_kernels_than_inductor"]:
            lines.append(f"{backend}: more kernels than Inductor: "
                         f"{', '.join(s['rows_with_more_kernels_than_inductor'])}")  # fmt: skip
    return lines


def ledger_rows(records: list[dict[str, Any]], env: dict[str, Any], source: str,
                commit: str | None) -> list[dict[str, Any]]:  # fmt: skip
    """One process's ledger rows, with the device and versions it measured on (the parent
    never imports torch, so ledger.append would fill in a CPU)."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for r in records:
        if "error" in r:
            continue
        for metric, unit in LEDGER_METRICS.items():
            value = r.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"workload": f"vision-{r['model']}-b{r['batch']}",
                             "backend": r["backend"], "metric": metric, "value": value,
                             "unit": unit, "device": env.get("device"), "torch": env.get("torch"),
                             "triton": env.get("triton"), "transformers": env.get("transformers"),
                             "commit": commit[:7] if commit else None, "date": date,
                             "source": source})  # fmt: skip
    return rows


def run_parent(args: argparse.Namespace) -> int:
    # benchmarks/, beside this file: --commit, else git; the JSON written whole (tmp + rename)
    from sentence_embeddings import commit, write

    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "vision",
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commit(args.commit), "argv": sys.argv[1:], "host_cpus": os.cpu_count()},
        "settings": {"models": args.models, "backends": args.backends, "variants": args.variants,
                     "batches": args.batches, "image_size": args.image_size, "calls": args.calls,
                     "warmup": args.warmup, "seed": args.seed, "init": args.init,
                     "time_budget_s": args.time_budget, "parallel": args.parallel},
        "children": [], "runs": [], "not_started": [],
    }  # fmt: skip
    sha = result["environment"].get("commit")
    lock = threading.Lock()
    gpus = list(range(args.parallel))

    def job(model: str, backend: str) -> None:
        if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            with lock:
                result["not_started"].append(f"{model}/{backend}")
            return
        with lock:
            gpu = gpus.pop() if args.parallel > 1 else None
        try:
            child = run_one(args, model, backend, gpu)
        finally:
            if gpu is not None:
                with lock:
                    gpus.append(gpu)
        with lock:
            records = child.pop("records")
            result["children"].append(child)
            others = [r for r in result["runs"] if (r["model"], r["backend"]) != (model, backend)]
            result["runs"] = others + records
            borrow_kernels(result["runs"])
            if "environment" in child:
                result["environment"].setdefault("child", child["environment"])
            for record in records:
                print(json.dumps(record, default=str), file=sys.stderr, flush=True)
            brief = ", ".join(
                f"b{r['batch']} ERROR {_brief_error(r['error'])}" if "error" in r
                else f"b{r['batch']} {r['per_call_ms']:.3f} ms, first {r['first_call_s']:.2f} s"
                for r in records
            )  # fmt: skip
            print(f"{model} {backend} ({child['process_s']:.0f} s): {brief}", flush=True)
            result["summary"] = summarize(result["runs"], args.backends)
            result["total_s"] = round(time.perf_counter() - started, 1)
            write(args.out, result)
            if args.ledger:
                import ledger  # benchmarks/ledger.py, beside this file

                mine = [r for r in result["runs"] if (r["model"], r["backend"]) == (model, backend)]
                rows = ledger_rows(mine, child.get("environment") or {},
                                   os.path.basename(args.out), sha)  # fmt: skip
                ledger.append(rows, args.ledger)

    jobs = [(m, b) for m in args.models for b in args.backends]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for future in [pool.submit(job, m, b) for m, b in jobs]:
            future.result()
    order = {(m, b): k for k, (m, b) in enumerate(jobs)}
    result["runs"].sort(key=lambda r: (order[(r["model"], r["backend"])], r["batch"]))
    result["summary"] = summarize(result["runs"], args.backends)
    result["total_s"] = round(time.perf_counter() - started, 1)
    write(args.out, result)
    print("\n".join(table(result["runs"], result["summary"])))
    if result["not_started"]:
        print(f"not started (--time-budget {args.time_budget} s): "
              f"{', '.join(result['not_started'])}")  # fmt: skip
    print(f"{args.out} ({result['total_s']:.0f} s)")
    if args.ledger:
        print(f"ledger rows appended to {args.ledger}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument(
        "--models",
        help=f"comma-separated timm names, or convblock (default: {','.join(DEFAULT_MODELS)}; "
        "dry run: convblock)",
    )
    parser.add_argument(
        "--backends",
        help=f"comma-separated, of {','.join(BASE_BACKENDS)} (the default; dry run: eager,"
        "infinifuse) and --variant names",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="NAME=JSON",
        help="infinifuse with these options (repeatable)",
    )
    parser.add_argument("--batches", default="1,8", help="comma-separated (default: 1,8)")
    parser.add_argument("--image-size", type=int, default=None, help="default 224 (dry run: 32)")
    parser.add_argument("--calls", type=int, default=None, help="timed calls (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="calls before timing (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init",
        choices=("calibrated", "timm"),
        default="calibrated",
        help="norms made non-trivial (default) or timm's own init",
    )
    parser.add_argument(
        "--no-kernel-counts",
        dest="kernel_counts",
        action="store_false",
        help="leave out the profiled calls (and reduce-overhead's second compile)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no process after this many seconds",
    )
    parser.add_argument(
        "--child-timeout",
        type=int,
        default=300,
        help="seconds one (model, backend) process may take (default 300)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="processes at once, each on a GPU of its own: the first N that CUDA_VISIBLE_DEVICES "
        "lists, or GPUs 0 to N-1 (default 1)",
    )
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU smoke test: convblock, eager + infinifuse (+ variants), "
                        "fp32, 32x32 inputs, 5 timed calls")  # fmt: skip
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git")
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--ledger", metavar="PATH", help="also append rows to the ledger at PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--options", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--borrow-kernels", action="store_true",
                        help="reduce-overhead counts no kernels of its own (no second compile; "
                        "take the inductor rows' counts, this run's or another's); implied "
                        "when --backends has inductor")  # fmt: skip
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.child:
        return args
    args.variants = dict(args.variant)
    models = args.models or ("convblock" if args.dry_run else ",".join(DEFAULT_MODELS))
    backends = args.backends or ("eager,infinifuse" if args.dry_run else ",".join(BASE_BACKENDS))
    args.models = [m for m in models.split(",") if m]
    args.backends = [b for b in backends.split(",") if b]
    if args.dry_run:
        args.image_size = args.image_size or 32
        args.calls = args.calls or 5
    args.image_size = args.image_size or 224
    args.calls = args.calls or 50
    args.backends += [v for v in args.variants if v not in args.backends]
    for backend in args.backends:
        if backend not in BASE_BACKENDS and backend not in args.variants:
            parser.error(f"--backends: unknown {backend!r} (known: "
                         f"{', '.join((*BASE_BACKENDS, *args.variants))})")  # fmt: skip
    if args.parallel < 1 or args.calls < 1 or args.warmup < 1 or not args.batches:
        parser.error("--parallel, --calls, --warmup >= 1 and at least one batch size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
