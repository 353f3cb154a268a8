"""sentence-transformers encode: eager vs infinifuse vs Inductor reduce-overhead.

The workload of ``examples/sentence_embeddings.py`` (built locally; nothing is downloaded): a
random-weight BertModel with a locally built WordPiece tokenizer under
``SentenceTransformer(modules=[Transformer(dir), Pooling(hidden, "mean")])``, the inner
transformers model's forward compiled; a synthetic corpus (3000 sentences of 2-199 words,
median ~14, fixed seed) encoded twice with ``batch_size=32``, then single queries one at a time.
Shapes: ``minilm-l6`` (6 layers, hidden 384) and ``bert-base`` (12 layers, hidden 768: BERT-base's
and MPNet-base's widths). fp16 on CUDA, fp32 on the CPU.

Every (shape, backend) runs in its own process with empty Inductor and Triton cache directories
(so Dynamo's profile-guided dynamism starts empty too): a cold start, as a user's first run.
Each process first runs one small eager ``encode`` (CUDA context, cuBLAS; ``warmup_s``; left out
with ``--no-warmup``), then, with nothing compiled yet, times: the first corpus pass (compiles
and captures included), the second pass, and each single query (p50 / p90 over all of them, the
first call of each new length included); then each query again (``query_repeat_p50_ms`` /
``_p90_ms``: every length seen before; ``--no-repeat-queries``); then, uncompiled, eager's
embeddings of the same inputs for the cosine check. Per query (``--no-query-probe`` to leave out):
its words and tokens, whether its token length was new to the loop, and its time split into
tokenize / the transformers model call (host; on CUDA also its GPU time from events) / pooling /
the rest of ``encode`` (``.cpu()`` and the GPU wait among it) / garbage collections
(``gc.callbacks``): ``query_trace`` (rows), ``query_phases`` (p50/p90 per phase, each phase's
share of the slowest 10%, total by token bucket and by new vs seen length, correlation with
tokens, gc counts); ``query_repeat_phases`` / ``query_repeat_trace`` for the second loop.
``--rounds N`` runs every backend N times, alternating, and takes each backend's median for
the target ratios (these machines' hosts moved eager's own second pass by 40% between runs).
Backends ``infinifuse-call1`` (``capture_on_call=1``) and ``infinifuse-buckets``
(``length_buckets``) are infinifuse with those options, as rows of the same run;
``infinifuse-dynamic`` and ``reduce-overhead-dynamic`` compile with ``dynamic=True`` (symbolic
lengths from the first trace, as sentence-transformers' docs advise: no recompiles).
``--no-cudnn-sdp`` turns cuDNN's SDPA off in each process (eager attention on an H100 ran
it; it builds an execution plan per new shape).
For infinifuse, ``fusebackend.stats()`` per phase: new entries, captures
(``recordings``), evictions, live entries and the graph pool's bytes. ``second_pass_captures``
counts every capture made while encoding the corpus a second time; ``second_pass_recaptures``
only those of signatures captured before (a runtime that captures a signature on its second call
makes its first captures there; ``recaptures_counted_as`` says how the count was made).

    python benchmarks/sentence_embeddings.py --out benchmarks/results/sentence_embeddings_h100.json
    python benchmarks/sentence_embeddings.py --quick --out /tmp/s.json        # 1000 sentences
    python benchmarks/sentence_embeddings.py --tiny --backends eager,infinifuse --out /tmp/s.json
    python benchmarks/sentence_embeddings.py --backends eager --no-cudnn-sdp --out /tmp/s2.json
    python benchmarks/sentence_embeddings.py --backends eager,infinifuse-call1 --out /tmp/s3.json

Writes the JSON (environment: device, torch, CUDA, Triton, transformers, sentence-transformers,
date, commit) after every process, so a run cut short keeps what finished, and prints the
table and the target ratios last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("eager", "infinifuse", "reduce-overhead")
# A backend with options or torch.compile(dynamic=True), as more rows of one run (each in its
# own cold process, like every backend): name -> (backend, infinifuse options, dynamic);
# ``--options`` applies to the infinifuse rows too, under theirs
VARIANTS: dict[str, tuple[str, dict[str, Any], bool | None]] = {
    "infinifuse-call1": ("infinifuse", {"capture_on_call": 1}, None),
    "infinifuse-buckets": (
        "infinifuse",
        {"length_buckets": [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]},
        None,
    ),
    "infinifuse-dynamic": ("infinifuse", {}, True),
    "reduce-overhead-dynamic": ("reduce-overhead", {}, True),
}
DEFAULT_SHAPES = ("minilm-l6", "bert-base")
_MARKER = "SENTENCE_BENCH_RESULT "


def _example() -> Any:
    """examples/sentence_embeddings.py, the workload's one definition (loaded by path: this
    file has the same module name)."""
    import importlib.util

    name = "_sentence_embeddings_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "examples" / "sentence_embeddings.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# ---------------------------------------------------------------- child: one shape, one backend


def child_environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    for key, module in (("triton", "triton"), ("transformers", "transformers"),
                        ("sentence_transformers", "sentence_transformers"),
                        ("fusebackend", "fusebackend")):  # fmt: skip
        try:
            info[key] = __import__(module).__version__
        except ImportError:
            info[key] = None
    return info


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        # Without a GPU infinifuse's kernels run in Triton's interpreter; set before Triton is
        # first imported (fusebackend and transformers' model classes import it).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ex = _example()
    import fusebackend

    if not args.cudnn_sdp:  # SDPA picks among flash / memory-efficient / math only
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    corpus = ex.make_sentences(args.sentences, seed=args.seed, high=args.max_words)
    # queries: the same length distribution, without the two forced extremes
    queries = ex.make_sentences(args.queries + 2, seed=args.seed + 1, high=args.max_words)[2:]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        shape = ex.SHAPES[args.shape]
        ex.build_model_dir(tmp, shape, args.seed)
        model = ex.load_sentence_transformer(tmp, device, dtype, shape["hidden_size"])
    ex.check_tokenizer(model)
    build_s = time.perf_counter() - start
    shapes = ex.padded_shapes(model, corpus, args.batch_size)
    warmup_s = None
    if args.warmup:  # CUDA context, cuBLAS, the allocator: the same for every backend
        _, warmup_s = ex._timed(device, lambda: model.encode(["warm up", "the device"]))
    fusebackend.reset_stats()
    backend, options, dynamic = args.backend, args.options, None
    if backend in VARIANTS:
        backend, extra, dynamic = VARIANTS[backend]
        options = {**(options or {}), **extra} if backend == "infinifuse" else None
    result, embeddings = ex.measure(
        model, backend, corpus, queries, args.batch_size, device, options,
        probe=args.query_probe, repeat_queries=args.repeat_queries, dynamic=dynamic,
    )  # fmt: skip
    result["backend"], result["options"], result["dynamic"] = args.backend, options, dynamic
    result.update(
        shape=args.shape,
        model=ex.describe(model),
        dtype=str(dtype).replace("torch.", ""),
        build_s=build_s,
        warmup_s=warmup_s,
        batches=len(shapes),
        distinct_padded_shapes=len(set(shapes)),
    )
    if args.backend != "eager":  # eager's embeddings of the same inputs, same process
        reference_corpus = model.encode(corpus, batch_size=args.batch_size)
        reference_queries = [model.encode(q) for q in queries]
        result["cosine_vs_eager"] = ex.cosine(embeddings["corpus"], reference_corpus)
        if reference_queries:
            import numpy as np

            result["query_cosine_vs_eager"] = ex.cosine(
                embeddings["queries"], np.stack(reference_queries)
            )
    if backend == "infinifuse":
        stats = fusebackend.stats()
        result["fallback_reasons"] = {str(k): str(v)[:300] for k, v in
                                      stats.get("fallback_reasons", {}).items()}  # fmt: skip
    result["environment"] = child_environment()
    return result


# ---------------------------------------------------------------- parent: every child, the JSON


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def commit(given: str | None) -> dict[str, Any]:
    """--commit where given (the device machine's copy of a checkout can carry an older .git
    than its files), else the checkout's commit (git) and whether tracked files were modified."""
    if given:
        return {"commit": given, "commit_source": "--commit"}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        head = dirty = None
    if head is not None and head.returncode == 0:
        return {"commit": head.stdout.strip(), "commit_source": "git",
                "modified_tracked_files": bool(dirty and dirty.stdout.strip())}  # fmt: skip
    return {"commit": None, "commit_source": "unknown (no git)"}


def run_one(args: argparse.Namespace, shape: str, backend: str) -> list[dict[str, Any]]:
    """The backend's cold process; with ``--restart`` then a second process on the same cache
    directories (its row's backend is ``<backend>-restart``): a user's restarted process."""
    with tempfile.TemporaryDirectory() as cache_dir:
        runs = [_run_child(args, shape, backend, cache_dir)]
        if args.restart and "error" not in runs[0]:
            again = _run_child(args, shape, backend, cache_dir)
            again["backend"] = f"{backend}-restart"
            runs.append(again)
    return runs


def _run_child(
    args: argparse.Namespace, shape: str, backend: str, cache_dir: str
) -> dict[str, Any]:
    """One child process with its Inductor and Triton caches under ``cache_dir``."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    command = [sys.executable, os.path.abspath(__file__), "--child", "--out", args.out,
               "--shape", shape, "--backend", backend, "--sentences", str(args.sentences),
               "--queries", str(args.queries), "--batch-size", str(args.batch_size),
               "--max-words", str(args.max_words), *([] if args.warmup else ["--no-warmup"]),
               *([] if args.query_probe else ["--no-query-probe"]),
               *([] if args.repeat_queries else ["--no-repeat-queries"]),
               *([] if args.cudnn_sdp else ["--no-cudnn-sdp"]),
               "--seed", str(args.seed)]  # fmt: skip
    if args.options is not None:
        command += ["--options", json.dumps(args.options)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"shape": shape, "backend": backend,
                "error": f"timed out after {args.child_timeout} s (--child-timeout)",
                "stderr_tail": tail}  # fmt: skip
    wall = time.perf_counter() - start
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARKER)]
    if done.returncode != 0 or not lines:
        return {"shape": shape, "backend": backend, "process_s": wall,
                "error": f"exit {done.returncode}", "stderr_tail": done.stderr[-4000:],
                "stdout_tail": done.stdout[-1000:]}  # fmt: skip
    result = json.loads(lines[-1][len(_MARKER) :])
    result["process_s"] = wall
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# (name, numerator backend, key, denominator backend, target): the targets
TARGETS = (
    ("first pass / eager", "infinifuse", "first_pass_s", "eager", 1.0),
    ("second pass / eager", "infinifuse", "second_pass_s", "eager", 0.7),
    ("query p50 / reduce-overhead", "infinifuse", "query_p50_ms", "reduce-overhead", 1.0),
    ("query p50 / eager", "infinifuse", "query_p50_ms", "eager", 0.5),
    ("query p90 / reduce-overhead", "infinifuse", "query_p90_ms", "reduce-overhead", 1.0),
)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The target ratios per shape, from each backend's median over its rounds (``--rounds``;
    one run each by default); re-captures count the worst round."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            by.setdefault((r["shape"], r["backend"]), []).append(r)

    def median(shape: str, backend: str, key: str) -> float | None:
        values = [r[key] for r in by.get((shape, backend), []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    out: dict[str, Any] = {}
    for shape in dict.fromkeys(r["shape"] for r in runs):
        rows = []
        for name, num, key, den, target in TARGETS:
            value = _ratio(median(shape, num, key), median(shape, den, key))
            rows.append({"name": name, "ratio": value, "target": target,
                         "met": None if value is None else value <= target})  # fmt: skip
        counts = [r.get("second_pass_recaptures") for r in by.get((shape, "infinifuse"), [])]
        recaptures = max((c for c in counts if c is not None), default=None)
        met = None if recaptures is None else recaptures == 0
        rows.append({"name": "re-captures on the second pass", "value": recaptures,
                     "target": 0, "met": met})  # fmt: skip
        first = {b: median(shape, b, "first_pass_s") for b in ("eager", "infinifuse",
                                                               "reduce-overhead")}  # fmt: skip
        context = {
            "reduce-overhead first pass / eager": _ratio(first["reduce-overhead"], first["eager"]),
            "infinifuse first pass / reduce-overhead": _ratio(
                first["infinifuse"], first["reduce-overhead"]
            ),
            "rounds": max((len(v) for (s, _), v in by.items() if s == shape), default=0),
        }
        out[shape] = {"targets": rows, "context": context}
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    head = ("shape", "backend", "1st pass s", "2nd pass s", "query p50 ms", "p90 ms",
            "cos min", "entries", "captures", "evict", "2nd pass: cap", "recap",
            "pool MiB")  # fmt: skip
    rows = [head]
    for r in runs:
        if "error" in r:
            rows.append((r["shape"], r["backend"], "ERROR: " + r["error"][:60]) + ("",) * 10)
            continue
        end = r.get("stats", {}).get("queries", {})
        pool = end.get("graph_pool_bytes")
        label = r["backend"] + (f" #{r['round']}" if "round" in r else "")
        rows.append((
            r["shape"], label, _fmt(r.get("first_pass_s"), ".2f"),
            _fmt(r.get("second_pass_s"), ".3f"), _fmt(r.get("query_p50_ms"), ".2f"),
            _fmt(r.get("query_p90_ms"), ".2f"),
            _fmt(r.get("cosine_vs_eager", {}).get("min"), ".5f"),
            _fmt(end.get("cache_size"), "d"), _fmt(end.get("recordings"), "d"),
            _fmt(end.get("evictions"), "d"), _fmt(r.get("second_pass_captures"), "d"),
            _fmt(r.get("second_pass_recaptures"), "d"),
            _fmt(pool / 2**20 if pool is not None else None, ".1f"),
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for shape, s in summary.items():
        parts = []
        for t in s["targets"]:
            shown = _fmt(t.get("ratio", t.get("value")), ".2f" if "ratio" in t else "d")
            mark = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
            parts.append(f"{t['name']} {shown} (<= {t['target']}: {mark})")
        lines.append(f"{shape}: " + "; ".join(parts))
    return lines


def write(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, default=str)
    os.replace(tmp, path)


def _record(
    args: argparse.Namespace,
    result: dict[str, Any],
    run: dict[str, Any],
    round_no: int,
    started: float,
) -> None:
    """Add one process's row to ``result``, print its brief and rewrite the JSON."""
    if args.rounds > 1:
        run["round"] = round_no
    result["runs"].append(run)
    if "environment" in run and "device" not in result["environment"]:
        # the device and versions as the measuring process saw them
        keys = ("device", "torch", "cuda", "triton", "transformers",
                "sentence_transformers", "fusebackend", "triton_interpret",
                "cudnn_sdp_enabled")  # fmt: skip
        result["environment"].update({k: run["environment"].get(k) for k in keys})
    brief = {k: run.get(k) for k in ("first_pass_s", "second_pass_s", "query_p50_ms",
             "query_p90_ms", "query_repeat_p50_ms", "query_repeat_p90_ms",
             "second_pass_captures", "second_pass_recaptures", "process_s",
             "error")}  # fmt: skip
    by_new = run.get("query_phases", {}).get("total_by_new_length_ms", {})
    if by_new:
        brief["query_p90_ms_new_vs_seen_length"] = [by_new[k].get("p90")
                                                    for k in ("new", "seen")]  # fmt: skip
    print(json.dumps({k: v for k, v in brief.items() if v is not None}), flush=True)
    if "error" in run:
        print(run.get("stderr_tail", "")[-2000:], flush=True)
    result["summary"] = summarize(result["runs"])
    result["total_s"] = time.perf_counter() - started
    write(args.out, result)


def run_parent(args: argparse.Namespace) -> int:
    ex = _example()
    corpus = ex.make_sentences(args.sentences, seed=args.seed, high=args.max_words)
    words = sorted(len(s.split()) for s in corpus)
    result: dict[str, Any] = {
        "benchmark": "sentence_embeddings",
        "environment": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commit(args.commit),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "sentence_transformers": _version("sentence-transformers"),
            "argv": sys.argv[1:],
            "quick": args.quick,
            "tiny": args.tiny,
            "warmup": args.warmup,
            "query_probe": args.query_probe,
            "repeat_queries": args.repeat_queries,
            "cudnn_sdp": args.cudnn_sdp,
            "rounds": args.rounds,
        },
        "workload": {
            "sentences": args.sentences,
            "queries": args.queries,
            "sentence_words": {"min": words[0], "median": words[len(words) // 2], "max": words[-1]},
            "max_words": args.max_words,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "options": args.options,
            "shapes": {s: ex.SHAPES[s] for s in args.shapes},
        },  # fmt: skip
        "runs": [],
    }
    started = time.perf_counter()
    # rounds: every backend once, then again (alternating, so a host that slows down during
    # the run weighs on each backend alike); the targets use each backend's median
    plan = [(shape, n, backend) for shape in args.shapes for n in range(1, args.rounds + 1)
            for backend in args.backends]  # fmt: skip
    for shape, round_no, backend in plan:
        print(f"== {shape} / {backend}" + (f" (round {round_no})" if args.rounds > 1 else "")
              + " ...", flush=True)  # fmt: skip
        for run in run_one(args, shape, backend):
            _record(args, result, run, round_no, started)
    lines = table(result["runs"], result["summary"])
    result["lines"] = lines
    write(args.out, result)
    print(f"\nwrote {args.out} in {result['total_s']:.0f} s "
          f"({result['environment'].get('device')})")  # fmt: skip
    for line in lines:
        print(line)
    if args.ledger:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ledger  # benchmarks/ledger.py, beside this file

        count = ledger.append_result(result, args.out, args.ledger)
        print(f"ledger: {count} rows -> {args.ledger}")
    return 1 if any("error" in r for r in result["runs"]) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(ln for ln in __doc__.splitlines() if ln.startswith("    python")),
    )
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help="comma-separated: minilm-l6, bert-base, tiny (default "
                        "minilm-l6,bert-base)")  # fmt: skip
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated, in order (default eager,infinifuse,"
                        "reduce-overhead; also: inductor, dynamo)")  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true", help="1000 sentences and 100 queries (unless given)"
    )
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU smoke run: shape tiny, 24 sentences of up to 40 words, batch "
                        "size 8, 6 queries (each unless given)")  # fmt: skip
    parser.add_argument("--sentences", type=int, help="corpus size (default 3000)")
    parser.add_argument("--queries", type=int, help="single queries (default 200)")
    parser.add_argument("--batch-size", type=int, help="encode's batch_size (default 32; --tiny 8)")
    parser.add_argument("--max-words", type=int,
                        help="longest sentence, in words (default 199; --tiny 40)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every backend this many times, alternating; the targets use "
                        "each backend's median (default 1)")  # fmt: skip
    parser.add_argument(
        "--options",
        type=json.loads,
        default=None,
        help="infinifuse's options as JSON, e.g. '{\"max_graphs\": 64}'",
    )
    parser.add_argument(
        "--child-timeout",
        type=int,
        default=240,
        help="seconds one (shape, backend) process may take (default 240)",
    )
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="leave out the eager encode of two short sentences before the timed "
                        "passes, so the first pass includes starting the device (CUDA context, "
                        "cuBLAS) too")  # fmt: skip
    parser.add_argument("--no-query-probe", dest="query_probe", action="store_false",
                        help="leave out the per-query probe (tokens; tokenize / model / pooling / "
                        "rest / gc times: query_phases, query_trace), a few microseconds a "
                        "query")  # fmt: skip
    parser.add_argument("--no-repeat-queries", dest="repeat_queries", action="store_false",
                        help="leave out the second encode of every query after the timed loop "
                        "(query_repeat_*: each length seen before)")  # fmt: skip
    parser.add_argument("--no-cudnn-sdp", dest="cudnn_sdp", action="store_false",
                        help="torch.backends.cuda.enable_cudnn_sdp(False) in each process: "
                        "eager attention without cuDNN's SDPA, which builds an execution plan "
                        "for each new shape")  # fmt: skip
    parser.add_argument(
        "--restart",
        action="store_true",
        help="run each backend a second time on the first one's cache "
        "directories (rows <backend>-restart: a restarted process)",
    )
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git")
    parser.add_argument("--ledger", metavar="PATH",
                        help="also append the figures to the results ledger at PATH")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)  # the child's one shape
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # the child's one backend
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.backends = [b for b in args.backends.split(",") if b]
    if args.tiny and args.shapes == list(DEFAULT_SHAPES):
        args.shapes = ["tiny"]
    known_shapes = tuple(_example().SHAPES)
    for shape in args.shapes:
        if shape not in known_shapes:
            parser.error(f"--shapes: unknown shape {shape!r} (known: {', '.join(known_shapes)})")
    for backend in args.backends:
        if backend not in (*BACKENDS, *VARIANTS, "inductor", "dynamo"):
            parser.error(f"--backends: unknown backend {backend!r} (known: "
                         f"{', '.join((*BACKENDS, *VARIANTS))}, inductor, dynamo)")  # fmt: skip
    if args.sentences is None:
        args.sentences = 24 if args.tiny else 1000 if args.quick else 3000
    if args.queries is None:
        args.queries = 6 if args.tiny else 100 if args.quick else 200
    if args.batch_size is None:
        args.batch_size = 8 if args.tiny else 32
    if args.max_words is None:
        args.max_words = 40 if args.tiny else 199
    if args.rounds < 1:
        parser.error("--rounds >= 1")
    if args.max_words < 2 or args.sentences < 1 or args.batch_size < 1 or args.queries < 0:
        parser.error("--max-words >= 2, --sentences >= 1, --batch-size >= 1, --queries >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(args)
        print(_MARKER + json.dumps(result, default=str), flush=True)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
