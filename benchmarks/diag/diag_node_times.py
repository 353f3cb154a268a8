"""Which nodes of a fused graph take the device time, with their operands' shapes and strides?

A profile of a captured replay names kernels (``diag_vision_host.py --kernels``) but not the
node that launched them nor its operands: ResNet-V2-50x1-BiT's batch-8 call launched 68 aten
elementwise kernels for 545 of its 1705 us (H200, 2026-12-01), which a kernel name cannot
tell apart (a weight's layout copy? an activation's?). This compiles a timm model
(``pretrained=False``, norms calibrated as ``vision.py`` does, fp16) with infinifuse, keeps
each fused graph the backend builds and its example inputs, runs the graph node by node on
real values, and times each node on its own: ``--reps`` back-to-back runs of the node between
two CUDA events, after a warm-up run, per run (launch overhead included: small nodes read
high, the large ones are what this is for). ``--device-time`` times device work alone
instead: ``--reps`` runs of the node captured in one CUDA graph, its replays timed
(``diag_spatial_mean.device_us``); a node that cannot be captured falls back to the events
and is marked ``host_timed`` (not yet run on a GPU as of 2026-12-01). In-place nodes (a name
ending in ``_``) are run once and not timed.

Prints the ``--top`` nodes by time (target, the operands' and the value's shapes and strides)
and the time per target; ``--out`` keeps both as JSON.

    python benchmarks/diag/diag_node_times.py --model resnetv2_50x1_bit --batch 8 [--top 25] \
        [--device-time]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

import torch
import torch.fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vision  # noqa: E402  (benchmarks/vision.py: the suite's model set-up)

import fusebackend  # noqa: E402
from fusebackend import fusion  # noqa: E402


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}{tuple(value.stride())}"
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    return repr(value)[:40]


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _time(run: Any, reps: int) -> float:
    """Microseconds per run of ``run`` over ``reps`` back-to-back runs."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _device_time(run: Any, reps: int) -> float | None:
    """Microseconds of device time per run of ``run``, ``reps`` runs captured in one CUDA
    graph; None where the node cannot be captured (a host sync, an allocation capture
    refuses)."""
    from diag_spatial_mean import device_us

    try:
        return device_us(run, calls=reps, rep_ms=50)
    except Exception:  # noqa: BLE001  (the caller falls back to timing with events)
        torch.cuda.synchronize()
        return None


def _caller(gm: torch.fx.GraphModule, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    """A function running ``node`` on the values ``args``, ``kwargs``."""
    if node.op == "call_function":
        return lambda: node.target(*args, **kwargs)
    if node.op == "call_method":
        return lambda: getattr(args[0], node.target)(*args[1:], **kwargs)
    return lambda: getattr(gm, node.target)(*args, **kwargs)


def node_times(
    gm: torch.fx.GraphModule, inputs: list[Any], reps: int, device_time: bool = False
) -> list[dict[str, Any]]:
    """Each computing node of ``gm`` timed on the values its graph gives it (device time
    alone where ``device_time`` and the node can be captured)."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    rows = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
            continue
        if node.op == "output":
            break
        if node.op == "get_attr":
            env[node] = getattr(gm, node.target)
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        call = _caller(gm, node, args, kwargs)
        env[node] = call()
        name = _target_name(node)
        if name.endswith("_") or name in ("size", "dim"):
            continue
        us = _device_time(call, reps) if device_time else None
        host_timed = us is None
        if host_timed:
            us = _time(call, reps)
        rows.append({
            "node": node.name, "target": name, "us": round(us, 2), "host_timed": host_timed,
            "reads": [_describe(a) for a in args if isinstance(a, torch.Tensor)],
            "value": _describe(env[node]),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnetv2_50x1_bit")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="device time alone: each node's runs captured in a CUDA graph",
    )
    args = parser.parse_args()

    kept: list[tuple[torch.fx.GraphModule, list[Any]]] = []
    real = fusion.fuse

    def keep(gm, device, config, name="", example_inputs=()):
        fused = real(gm, device, config, name, example_inputs)
        if fused.graph is not None:
            kept.append((fused.graph, list(example_inputs)))
        return fused

    fusion.fuse = keep
    model = vision.build_model(args.model, seed=0).to("cuda")
    vision.calibrate_norms(model, 224, torch.device("cuda"), seed=0)
    model.to(torch.float16).eval()
    fusebackend.clear_cache()
    fn = torch.compile(model, backend="infinifuse", options={"cudagraphs": False}, dynamic=False)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        fn(x)
        rows = [
            r for gm, inputs in kept for r in node_times(gm, inputs, args.reps, args.device_time)
        ]
    rows.sort(key=lambda r: -r["us"])
    by_target: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        by_target[r["target"]].append(r["us"])
    totals = sorted(((t, len(v), round(sum(v), 1)) for t, v in by_target.items()),
                    key=lambda item: -item[2])  # fmt: skip
    total = sum(r["us"] for r in rows)
    print(f"{args.model} b{args.batch}: {len(rows)} nodes timed, {total:.0f} us")
    for target, count, us in totals:
        print(f"  {target:40s} {count:4d} nodes {us:9.1f} us")
    for r in rows[: args.top]:
        print(
            f"{r['us']:8.1f} us  {r['node']:28s} {r['target']:24s} reads {r['reads']} "
            f"-> {r['value']}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "by_target": totals,
                       "nodes": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
