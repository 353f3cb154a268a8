"""Benchmark suite: eager, Dynamo alone, Inductor, reduce-overhead and infinifuse (fusion on
and off) on an embedding chain and transformers models built from configs (random weights).

    python benchmarks/run.py --out-dir benchmarks/results                 # full, one GPU
    python benchmarks/run.py --out-dir benchmarks/results --only llama    # a part
    python benchmarks/run.py --out-dir benchmarks/results --only gpt2 --merge   # add rows
    python benchmarks/run.py --out-dir /tmp/suite --quick                 # tiny, CPU is fine

    python benchmarks/run.py --out-dir benchmarks/results --only zoo --merge     # model zoo
    python benchmarks/run.py --out-dir benchmarks/results --only generate --merge
    python benchmarks/run.py --out-dir benchmarks/results --combine a/suite.json b/suite.json

--combine joins the suite.json files of parts run apart (one per device call) into one
report without running anything: rows of a later file replace those of the same (workload,
backend) in an earlier one, and "parts" lists every run in order.

Parts beyond the per-call/first-call rows:
- Kernels per call without CUDA graphs (torch.profiler, CUDA activity, one steady call) for
  the four models of docs/PERFORMANCE.md's decode table (llama-decode, qwen2-decode,
  gpt2-decode, bert) and the zoo;
  infinifuse is compiled again with cudagraphs=False for it, and reduce-overhead shows
  Inductor's default count (its graphs hide launches). None without a CUDA device.
- The model zoo ("zoo-<family>", the 21 families of tests/model_zoo.py; 3 with --quick):
  eager, inductor, reduce-overhead, infinifuse; kernels per call, whether every infinifuse
  signature is captured (no mode "eager"), error vs eager, per call with graphs, fused groups.
- Decode rows (llama-, qwen2-, gpt2-, llama-b4-, llama-b16-decode), every backend: the
  weight-streaming floor. ``weight_bytes`` (the parameters a step reads: all but embedding
  tables it only gathers, a tied head once), ``copy_gbs`` (device-to-device copy, read +
  write, measured once per run), ``floor_ms`` (weight_bytes at copy_gbs) and
  ``floor_fraction`` (floor_ms / per call; target: TinyLlama's >= 0.55); the last three
  None without CUDA.
- generate: benchmarks/generate.py (transformers generate(), each variant in its own cold
  process) writes generate.json under --out-dir; its summary goes into suite.json/suite.md.

Writes suite.json (environment, every row, targets), suite.md and suite.png under
--out-dir and prints the targets. Each (workload, backend) starts from a fresh state
(``torch._dynamo.reset()``, ``fusebackend.clear_cache()``, ``fusebackend.reset_stats()``)
and is guarded: a failure is recorded in its row and the suite goes on. Compile caches:
Inductor's are disabled and each row gets an empty Triton cache directory, so every first
call is a cold compile (``--warm-caches`` keeps both). Without CUDA this script sets
TRITON_INTERPRET=1, so infinifuse's rows run its generated kernels in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

# Models are built from configs; nothing may be fetched (the GPU machine has no network).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# force_disable_caches also turns off Dynamo's profile-guided dynamism and says so each time.
warnings.filterwarnings("ignore", message=".*force disabled by torch.compiler.config")

if not torch.cuda.is_available():
    # Without a GPU, infinifuse's kernels run in Triton's interpreter. Must be set before
    # Triton is first imported (fusebackend and transformers' model classes import it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from suite import measure, report, workloads  # noqa: E402  (benchmarks/ is sys.path[0])

import fusebackend  # noqa: E402


class Progress:
    """tqdm when installed, else one printed line per step."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, desc="suite", unit="row", dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.done = total, 0

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        else:
            print(f"[{self.done + 1}/{self.total}] {label} ...", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def environment(device: torch.device, quick: bool) -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers_version,
        "fusebackend": fusebackend.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "argv": sys.argv[1:],
    }


def _environment_of(generate_json: Path) -> dict[str, Any]:
    """The machine and versions a generate.py JSON was measured with."""
    measured = json.loads(generate_json.read_text())
    keys = ("device", "torch", "triton", "transformers", "python", "date")
    return {"cuda": None, **{k: measured.get(k) for k in keys}, "read_from": str(generate_json)}


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:600]


def _line(row: dict[str, Any]) -> str:
    where = f"{row['workload']:>14s} {row['backend']:<20s}"
    if row["status"] != "ok":
        return f"{where} {row['status']}: {row.get('error', '')[:160]}"
    kernels = f"  kernels {row['kernels_per_call']}" if "kernels_per_call" in row else ""
    floor = row.get("floor_fraction")
    floor_text = f"  {floor:.3f} of floor" if floor is not None else ""
    return (
        f"{where} per call {row['per_call_ms']:9.3f} ms  first {row['first_call_s']:7.2f} s"
        f"  err {row['rel_error']:.1e}{'' if row['error_ok'] else ' (> tol)'}"
        f"  mode {row['mode']}{kernels}{floor_text}"
    )


def _backends_of(workload: workloads.Workload, backends: list[str]) -> list[str]:
    if workload.kind == "generate":
        return []
    if workload.backends is None:
        return backends
    return [b for b in backends if b in workload.backends]


def run_suite(
    args: argparse.Namespace, device: torch.device, out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows of every selected in-process workload, and generate's record if selected."""
    selected = workloads.select(workloads.workloads(args.quick, device), args.only)
    if args.generate_json and not any(w.kind == "generate" for w in selected):
        raise SystemExit("--generate-json: the generate workload is not selected (--only)")
    backends = (
        [b.strip() for b in args.backends.split(",")]
        if args.backends
        else list(measure.DEFAULT_BACKENDS)
    )
    unknown = [b for b in backends if b not in measure.BACKENDS]
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; backends: {', '.join(measure.BACKENDS)}")
    try:
        import transformers  # noqa: F401

        have_transformers = True
    except ImportError:
        have_transformers = False

    if not args.warm_caches:
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config, "force_disable_caches"):
            inductor_config.force_disable_caches = True
    cache_root = Path(tempfile.mkdtemp(prefix="suite-triton-cache-"))
    triton_cache_dir = os.environ.get("TRITON_CACHE_DIR")

    rows: list[dict[str, Any]] = []
    generate = None
    in_process = [w for w in selected if w.kind == "model"]
    progress = Progress(sum(len(_backends_of(w, backends)) for w in in_process))
    try:
        with torch.no_grad():
            if in_process:
                progress.start("process warm-up")
                measure.warm_process(device, backends)
            # once per run, for the decode rows' weight-streaming floor (None without CUDA)
            copy_gbs = None
            if any(w.decode for w in in_process):
                progress.start("copy bandwidth")
                copy_gbs = measure.copy_bandwidth(device)
                if copy_gbs is not None:
                    progress.write(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
            for workload in in_process:
                rows += _run_workload(
                    workload,
                    _backends_of(workload, backends),
                    device,
                    args,
                    have_transformers,
                    cache_root,
                    progress,
                    copy_gbs,
                )
    finally:
        progress.close()
        if triton_cache_dir is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = triton_cache_dir
        shutil.rmtree(cache_root, ignore_errors=True)
    for workload in selected:
        if workload.kind == "generate":
            generate = run_generate(workload, out_dir, have_transformers, args.generate_json)
    return rows, generate


def run_generate(
    workload: workloads.Workload,
    out_dir: Path,
    have_transformers: bool,
    existing: str | None = None,
) -> dict[str, Any]:
    """benchmarks/generate.py in a subprocess (it starts one cold process per variant and
    cache length); its JSON goes to generate.json under out_dir, its summary into the suite.
    With ``existing``, that JSON of an earlier generate.py run is read instead."""
    record: dict[str, Any] = {"workload": workload.name, "description": workload.description}
    if existing is not None:
        return {**record, "argv": ["(read)", existing],
                **_generate_record(Path(existing))}  # fmt: skip
    if not have_transformers:
        return {**record, "status": "skipped", "error": "transformers not installed"}
    json_path = out_dir / "generate.json"
    command = [sys.executable, str(Path(__file__).with_name("generate.py")),
               "--out", str(json_path), *workload.argv]  # fmt: skip
    print(f"generate: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    # stdout streams through (one JSON line per run as it ends); stderr is kept for the record.
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    record["seconds"] = time.perf_counter() - start
    record["argv"] = list(workload.argv)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        return {**record, "status": "error",
                "error": f"generate.py exited {done.returncode}: {done.stderr[-600:]}"}  # fmt: skip
    return {**record, **_generate_record(json_path)}


def _generate_record(json_path: Path) -> dict[str, Any]:
    """The suite's record of a generate.py JSON: status, summary and every run."""
    result = json.loads(json_path.read_text())
    runs = result["runs"]
    failed = [f"{r['variant']}/{r['cache_len']}" for r in runs if "error" in r]
    return {
        "status": "error" if failed else "ok",
        **({"error": f"runs failed: {', '.join(failed)} (see {json_path.name})"} if failed else {}),
        "json": json_path.name,
        "model": result.get("model"),
        "device": result.get("device"),
        "prompt_tokens": result.get("prompt_tokens"),
        "new_tokens": result.get("new_tokens"),
        "summary": result["summary"],
        "runs": runs,
    }


def _run_workload(
    workload: workloads.Workload,
    backends: list[str],
    device: torch.device,
    args: argparse.Namespace,
    have_transformers: bool,
    cache_root: Path,
    progress: Progress,
    copy_gbs: float | None = None,
) -> list[dict[str, Any]]:
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    base = {
        "workload": workload.name,
        "description": workload.description,
        "dtype": str(workload.dtype).removeprefix("torch."),
        "date": date,
    }
    rows: list[dict[str, Any]] = []

    def skip_all(status: str, why: str) -> list[dict[str, Any]]:
        for backend in backends:
            rows.append({**base, "backend": backend, "status": status, "error": why,
                         "phase": "build"})  # fmt: skip
            progress.write(_line(rows[-1]))
            progress.step()
        return rows

    if workload.needs_transformers and not have_transformers:
        return skip_all("skipped", "transformers not installed")
    measure.fresh_state(device)
    progress.start(f"{workload.name}: build + eager reference")
    try:
        calls = 1 + measure.WARMUP + workload.rounds * workload.loop
        case = workload.build(device, calls)
        refs = measure.references(case, device)
    except Exception as exc:  # noqa: BLE001  (recorded; the suite goes on)
        traceback.print_exc()
        return skip_all("error", f"building the workload: {_error_text(exc)}")
    base["shape"] = case.shape
    if case.weight_bytes is not None:  # decode: the weight-streaming floor (measure.py)
        base.update(measure.floor_fields(case.weight_bytes, copy_gbs, None))
    progress.start(f"{workload.name}: Dynamo warm-up trace")
    try:
        measure.prewarm(case, device)
    except Exception:  # noqa: BLE001  (the dynamo row will record the failure)
        measure.fresh_state(device)

    for backend in backends:
        progress.start(f"{workload.name} / {backend}")
        row: dict[str, Any] = {**base, "backend": backend}
        if backend in measure.CUDA_ONLY and device.type != "cuda":
            row.update(status="skipped", error="no CUDA")
        else:
            if not args.warm_caches:  # read by Triton at each compile
                os.environ["TRITON_CACHE_DIR"] = str(cache_root / f"{workload.name}-{backend}")
            measure.fresh_state(device)
            start = time.perf_counter()
            try:
                row.update(measure.measure(workload, case, backend, device, refs))
                row["status"] = "ok"
                if case.weight_bytes is not None:
                    row.update(measure.floor_fields(case.weight_bytes, copy_gbs,
                                                    row["per_call_ms"]))  # fmt: skip
            except Exception as exc:  # noqa: BLE001  (recorded; the suite goes on)
                row.update(
                    status="error", error=_error_text(exc), traceback=traceback.format_exc()[-3000:]
                )
                if backend.startswith("infinifuse"):
                    row.update(measure.infinifuse_state(device))
            row["row_seconds"] = time.perf_counter() - start
            measure.fresh_state(device)
        rows.append(row)
        progress.write(_line(row))
        progress.step()
    measure.borrow_kernel_counts(rows)
    del case, refs
    measure.fresh_state(device)
    return rows


def merge(previous: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Previous rows, with this run's rows replacing those of the same (workload, backend)."""
    new = {(r["workload"], r["backend"]) for r in rows}
    kept = [r for r in previous.get("rows", []) if (r["workload"], r["backend"]) not in new]
    return kept + rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The whole module docstring, line breaks kept: its first sentence spans two lines.
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out-dir",
        default="benchmarks/results",
        help="where suite.json, suite.md and suite.png go (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny configs (CPU smoke test)")
    parser.add_argument(
        "--only",
        help="comma-separated workload names or prefixes (chain, llama, qwen2, bert, gpt2, "
        "gpt2-sweep, zoo (every family), zoo-llama, generate, ...; --list names them all)",
    )
    parser.add_argument(
        "--backends", help=f"comma-separated subset of {','.join(measure.BACKENDS)}"
    )
    parser.add_argument(
        "--commit",
        help="the commit measured, recorded in suite.json's environment and its ledger rows "
        "(the device machine's copy of a checkout has no git: the zoo runs of 2026-11-25 and "
        "2026-11-29 had to have theirs written in by hand)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available, else cpu",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep rows of an existing suite.json that this run does not redo",
    )
    parser.add_argument(
        "--warm-caches",
        action="store_true",
        help="keep Inductor's and Triton's compile caches (warm first calls)",
    )
    parser.add_argument(
        "--generate-json",
        metavar="PATH",
        help="with the generate workload selected: merge this JSON of an earlier "
        "benchmarks/generate.py run instead of running it again",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        metavar="SUITE_JSON",
        help="run nothing: join these suite.json files (later rows replace earlier ones of "
        "the same workload and backend) into --out-dir's suite.json, suite.md and suite.png",
    )
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument(
        "--ledger",
        metavar="PATH",
        help="also append this run's figures to the results ledger at PATH "
        "(benchmarks/ledger.py; e.g. benchmarks/results/ledger.jsonl)",
    )
    return parser.parse_args(argv)


def join(results: list[dict[str, Any]]) -> dict[str, Any]:
    """suite.json results joined in order: the last one's environment, every run in
    "parts", rows merged (later rows replace earlier ones of the same workload and backend),
    and the last generate record."""
    joined: dict[str, Any] = {"environment": None, "parts": [], "rows": []}
    for result in results:
        joined["environment"] = result.get("environment")
        joined["parts"] += result.get("parts", [result.get("environment")])
        joined["rows"] = merge(joined, result["rows"])
        if result.get("generate") is not None:
            joined["generate"] = result["generate"]
    return joined


def combine(paths: list[str]) -> dict[str, Any]:
    """The suite.json files at paths, joined in order."""
    return join([json.loads(Path(path).read_text()) for path in paths])


def write_report(result: dict[str, Any], out_dir: Path) -> None:
    """Targets computed from result's rows; suite.json, suite.md and suite.png written to
    out_dir; the targets printed."""
    rows, generate = result["rows"], result.get("generate")
    result["targets"] = report.compute_targets(rows, generate)
    json_path = out_dir / "suite.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "suite.md").write_text(report.markdown(result))
    plot_note = report.plot(result, out_dir / "suite.png")

    if generate is not None:
        print(f"generate: {generate['status']} {generate.get('error', '')}".rstrip())
        for line in generate.get("summary", {}).get("lines", []):
            print(f"  {line}")
    seconds = sum(p.get("suite_seconds") or 0 for p in result["parts"])
    print(
        f"\nsuite: {len(rows)} rows in {seconds:.0f} s -> {json_path}, "
        f"suite.md" + ("" if plot_note else ", suite.png")
    )
    if plot_note:
        print(plot_note)
    print("targets:")
    for t in result["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        limit = report.limit_text(t)
        print(f"  [{t['status']:>12s}] {t['name']}: {value} (limit {limit}; {t['note']})")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.list:
        for w in workloads.workloads(args.quick, device):
            print(f"{w.name:16s} {w.description}")
        return {}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.combine:
        result = combine(args.combine)
        write_report(result, out_dir)
        _append_ledger(args, result, out_dir)
        return result
    start = time.perf_counter()
    rows, generate = run_suite(args, device, out_dir)
    json_path = out_dir / "suite.json"
    env = environment(device, args.quick)
    env["suite_seconds"] = time.perf_counter() - start
    if args.commit:
        env["commit"] = args.commit
    if args.generate_json and not rows:
        # Nothing ran here: this part is the generate.py run it read, on that run's machine.
        env.update(_environment_of(Path(args.generate_json)))
    result: dict[str, Any] = {"environment": env, "parts": [env], "rows": rows}
    if generate is not None:
        result["generate"] = generate
    ran_here = result
    if args.merge and json_path.exists():
        # each run merged into this file, in order: its environment (argv, date, seconds)
        result = join([json.loads(json_path.read_text()), result])
    write_report(result, out_dir)
    _append_ledger(args, ran_here, out_dir)
    return result


def _append_ledger(args: argparse.Namespace, result: dict[str, Any], out_dir: Path) -> None:
    """With --ledger: result's rows (this run's, not those merged from an earlier file)
    appended to the ledger."""
    if not args.ledger:
        return
    import ledger  # benchmarks/ledger.py, beside this file

    count = ledger.append_result(result, out_dir / "suite.json", args.ledger)
    print(f"ledger: {count} rows -> {args.ledger}")


if __name__ == "__main__":
    main(sys.argv[1:])
