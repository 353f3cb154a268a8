"""Which kernels does one call launch, by kind, under infinifuse and Inductor?

Issue 38 asks for no more kernels per call than Inductor's on every vision model. The vision
suite counts them (``vision.py``'s ``kernels_per_call``) but costs a cold process per model
and backend with timed calls; this counts only, in one process: per model (timm,
``pretrained=False``, norms calibrated as ``vision.py`` does, fp16) and batch, one call
without CUDA graphs after two (infinifuse with ``cudagraphs=False``; Inductor's default mode
with ``--inductor``: the code reduce-overhead replays), through ``vision.count_kernels``.
``--zoo FAMILIES`` counts the model zoo's families instead (``tests/model_zoo.py``: 2 layers,
hidden 64, batch 2 x 7 with a padded mask, fp16, as ``run.py``'s zoo workloads).

Each kernel name falls in a kind (``KINDS``: infinifuse's Triton kernels, Inductor's, fused
attention, cuDNN's norms and pooling, convolutions, GEMMs, aten's own kernels, layout
transforms, other), and the table prints the count per kind; ``--names`` prints, per model,
the names whose counts differ most between the two backends (or infinifuse's most frequent
ones without ``--inductor``). The JSON keeps every name's count.

    python benchmarks/diag/diag_kernel_census.py [--models ghostnet_100,regnety_016]
        [--batches 1,8] [--inductor] [--names] [--out F.json]
    python benchmarks/diag/diag_kernel_census.py --zoo bert,t5_encoder --inductor --names
    python benchmarks/diag/diag_kernel_census.py --zoo all --inductor
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vision  # noqa: E402  (benchmarks/vision.py: the suite's model set-up and counting)

# tests/model_zoo.py, read-only; appended, as suite/workloads.py does, so that nothing in
# tests/ shadows a module of benchmarks/
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import model_zoo  # noqa: E402

MODELS = [
    "resnet50", "convnext_tiny", "efficientnet_b0", "mobilenetv3_large_100", "regnety_016",
    "vit_small_patch16_224", "swin_tiny_patch4_window7_224", "ghostnet_100", "resnet18",
    "resnext50_32x4d", "levit_128s", "inception_v3", "densenet121", "repvgg_a2",
]  # fmt: skip

# A kernel name's kind: the first kind one of whose markers the lower-cased name contains.
KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("inductor triton", ("triton_poi", "triton_per", "triton_red", "triton_tem")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("layout transform", ("nchwtonhwc", "nhwctonchw", "transpose", "permute", "copy_kernel")),
    ("cudnn (norm, pool)", ("bn_fw", "pooling")),
    ("conv", ("conv", "cudnn", "implicit", "fprop", "dgrad", "wgrad", "winograd")),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "cublas", "matmul")),
    ("aten", ("at::native", "elementwise", "reduce_kernel", "softmax", "layer_norm",
              "batch_norm", "pool", "cat", "index")),
]  # fmt: skip


def kind_of(name: str) -> str:
    # infinifuse's generated and hand-written kernels are all named "_..." (codegen.py,
    # epilogue.py, the kernels' modules); library kernels carry a namespace or a signature,
    # or stay mangled ("_Z..."). Names come cut at 90 characters (vision.count_kernels), so
    # a kind is a name's first markers' (an aten copy kernel may count as "aten").
    if name.startswith("_") and not name.startswith("_Z") and "::" not in name and " " not in name:
        return "infinifuse triton"
    lowered = name.lower()
    for kind, markers in KINDS:
        if any(m in lowered for m in markers):
            return kind
    return "other"


def _vision_case(model_name: str) -> tuple[Any, Any]:
    """A timm model set up as ``vision.py`` sets it up, and a maker of its call per batch."""
    model = vision.build_model(model_name, seed=0).to("cuda")
    vision.calibrate_norms(model, 224, torch.device("cuda"), seed=0)
    model.to(torch.float16).train().eval()

    def call_at(batch: int) -> Any:
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
        return lambda fn: fn(x)

    return model, call_at


def _zoo_case(family: str) -> tuple[Any, Any]:
    """A model zoo family in fp16, and its call on the zoo's padded 2 x 7 batch (any batch)."""
    model = model_zoo.build(family, dtype=torch.float16, device="cuda")
    kwargs = model_zoo.inputs(family, device="cuda")
    return model, lambda batch: lambda fn: model_zoo.main_output(fn(**kwargs))


def census(name: str, batches: list[int], backend: str, zoo: bool) -> list[dict[str, Any]]:
    """One record per batch: kernels per call, by kind and by name."""
    torch._dynamo.reset()
    model, call_at = (_zoo_case if zoo else _vision_case)(name)
    if backend == "infinifuse":
        import fusebackend

        fusebackend.clear_cache()
        fn = torch.compile(model, backend="infinifuse", options={"cudagraphs": False},
                           dynamic=False)  # fmt: skip
    else:
        fn = torch.compile(model, dynamic=False)
    records = []
    for batch in batches:
        call = call_at(batch)
        start = time.perf_counter()
        with torch.no_grad():
            # (count_kernels calls its first argument on its second: here call(fn))
            counted = vision.count_kernels(call, fn, True, lambda: None)
        by_kind: collections.Counter[str] = collections.Counter()
        us_by_kind: collections.Counter[str] = collections.Counter()
        for kernel, count in counted["kernel_counts"].items():
            if not kernel.startswith(("Memcpy", "Memset")):
                by_kind[kind_of(kernel)] += count
                us_by_kind[kind_of(kernel)] += counted["kernel_us"][kernel]
        workload = f"zoo-{name}" if zoo else f"vision-{name}-b{batch}"
        records.append({
            "model": name, "workload": workload, "backend": backend,
            "batch": None if zoo else batch,  # (the zoo's own 2 x 7 padded batch)
            "kernels_per_call": counted["kernels_per_call"],
            "kernel_us_per_call": counted["kernel_us_per_call"],
            "by_kind": dict(by_kind), "kernel_counts": counted["kernel_counts"],
            "us_by_kind": {k: round(us, 1) for k, us in us_by_kind.items()},
            "kernel_us": counted["kernel_us"],
            "seconds": round(time.perf_counter() - start, 1),
        })  # fmt: skip
    return records


def print_names(records: list[dict[str, Any]], top: int = 12) -> None:
    """Per model and batch, the names whose counts differ most between the backends, then
    those whose summed device times differ most."""
    pairs: dict[tuple[str, int], dict[str, dict[str, int]]] = collections.defaultdict(dict)
    times: dict[tuple[str, int], dict[str, dict[str, float]]] = collections.defaultdict(dict)
    for r in records:
        pairs[(r["model"], r["batch"])][r["backend"]] = r["kernel_counts"]
        times[(r["model"], r["batch"])][r["backend"]] = r["kernel_us"]
    for (model, batch), counts in pairs.items():
        ours, theirs = counts.get("infinifuse", {}), counts.get("inductor", {})
        names = set(ours) | set(theirs)
        ranked = sorted(names, key=lambda n: -abs(ours.get(n, 0) - theirs.get(n, 0)))[:top]
        print(f"{model} {'zoo' if batch is None else f'b{batch}'}: name, infinifuse, inductor")
        for name in ranked:
            print(f"    {ours.get(name, 0):4d} {theirs.get(name, 0):4d}  {name[:88]}")
        ours_us, theirs_us = (
            times[(model, batch)].get("infinifuse", {}),
            times[(model, batch)].get("inductor", {}),
        )
        by_time = sorted(names, key=lambda n: -abs(ours_us.get(n, 0) - theirs_us.get(n, 0)))[:top]
        print(f"{model} {'zoo' if batch is None else f'b{batch}'}: name, us: infinifuse, inductor")
        for name in by_time:
            print(f"    {ours_us.get(name, 0):7.1f} {theirs_us.get(name, 0):7.1f}  {name[:88]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--zoo", metavar="FAMILIES",
                        help="model zoo families (all: every one), not --models")  # fmt: skip
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--inductor", action="store_true", help="Inductor's counts too")
    parser.add_argument("--names", action="store_true", help="the names behind the counts")
    parser.add_argument("--out", help="the JSON of every record")
    parser.add_argument("--commit", help="the commit measured (the device's copy has no git)")
    args = parser.parse_args()
    batches = [1] if args.zoo else [int(b) for b in args.batches.split(",")]
    backends = ["infinifuse"] + (["inductor"] if args.inductor else [])
    records: list[dict[str, Any]] = []
    environment = {**vision.child_environment(True), "commit": args.commit}
    names = ",".join(sorted(model_zoo.ZOO)) if args.zoo == "all" else args.zoo or args.models
    for model_name in names.split(","):
        for backend in backends:
            try:
                records += census(model_name, batches, backend, bool(args.zoo))
            except Exception as exc:  # noqa: BLE001  (one model's failure: recorded)
                records.append({"model": model_name, "backend": backend,
                                "error": f"{type(exc).__name__}: {exc}"[:500]})  # fmt: skip
            if args.out:
                with open(args.out, "w") as out:
                    json.dump({"benchmark": "kernel_census", "environment": environment,
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                               "records": records}, out, indent=1)  # fmt: skip
    kinds = sorted({k for r in records for k in r.get("by_kind", {})})
    print("model, backend, batch, kernels | " + ", ".join(kinds))
    for r in records:
        if "error" in r:
            print(f"{r['model']} {r['backend']}: {r['error'][:200]}")
            continue
        batch = "zoo" if r["batch"] is None else f"b{r['batch']}"
        print(f"{r['model']:30s} {r['backend']:10s} {batch:3s} {r['kernels_per_call']:4d} | "
              + " ".join(f"{r['by_kind'].get(k, 0):4d}" for k in kinds))  # fmt: skip
        print(f"{'':30s} {'us':10s} {'':3s} {r['kernel_us_per_call']:6.0f} | "
              + " ".join(f"{r['us_by_kind'].get(k, 0):6.1f}" for k in kinds))  # fmt: skip
    if args.names:
        print_names([r for r in records if "error" not in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
