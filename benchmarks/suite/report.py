"""Targets, suite.md and suite.png from the suite's rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# The results ledger (benchmarks/ledger.py): each row's earlier figure on the same device is
# shown beside this run's (``_ledger_section``).
LEDGER = Path(__file__).resolve().parents[1] / "results" / "ledger.jsonl"

__all__ = [
    "FLOOR_TARGETS",
    "FOUR_MODELS",
    "TARGETS",
    "compute_targets",
    "limit_text",
    "markdown",
    "plot",
]

# The rows of the four models' table: (workload, label).
FOUR_MODELS = [
    ("llama-decode", "TinyLlama-shape decode"),
    ("qwen2-decode", "Qwen2-0.5B-shape decode"),
    ("gpt2-decode", "GPT-2 decode"),
    ("bert", "BERT-base 8 x 128"),
]
ZOO_PREFIX = "zoo-"

# (name, workload, metric, backend, baseline backend, limit): backend's metric divided by
# the baseline's must be <= limit. Every target is "at most" its limit unless its
# "direction" says "at least" (FLOOR_TARGETS).
TARGETS = [
    (
        "TinyLlama-shape decode, first call: infinifuse / Dynamo alone",
        "llama-decode",
        "first_call_s",
        "infinifuse",
        "dynamo",
        1.5,
    ),
    (
        "TinyLlama-shape decode, first call: infinifuse / reduce-overhead",
        "llama-decode",
        "first_call_s",
        "infinifuse",
        "reduce-overhead",
        0.3,
    ),
    # Per call with graphs and kernels per call without: the four models.
    *[
        (
            f"{label}, per call with graphs: infinifuse / reduce-overhead",
            workload,
            "per_call_ms",
            "infinifuse",
            "reduce-overhead",
            1.0,
        )
        for workload, label in FOUR_MODELS
    ],
    *[
        (
            f"{label}, kernels per call without graphs: infinifuse / Inductor",
            workload,
            "kernels_per_call",
            "infinifuse",
            "inductor",
            1.0,
        )
        for workload, label in FOUR_MODELS
    ],
    (
        "GPT-2 24-length sweep, first pass: infinifuse / Dynamo alone",
        "gpt2-sweep",
        "first_call_s",
        "infinifuse",
        "dynamo",
        1.5,
    ),
    (
        "GPT-2 24-length sweep, first pass: infinifuse / reduce-overhead",
        "gpt2-sweep",
        "first_call_s",
        "infinifuse",
        "reduce-overhead",
        0.5,
    ),
]


# Fixed per backend: the default color cycle would shift when a backend has no bar.
_COLORS = {
    "eager": "tab:gray",
    "dynamo": "tab:orange",
    "inductor": "tab:blue",
    "reduce-overhead": "tab:green",
    "infinifuse": "tab:red",
    "infinifuse-nofusion": "tab:brown",
    "infinifuse-nomatmul": "tab:pink",
    "infinifuse-nopdl": "tab:purple",
    "infinifuse-fold": "tab:olive",
    "infinifuse-nogemv": "tab:cyan",
}


# (name, workload, limit): infinifuse's ``floor_fraction`` (run.py: the weight-streaming
# floor, the bytes of weights a decode step reads at the copy bandwidth measured in the same
# run, over per call) must be at least limit.
FLOOR_TARGETS = [
    ("TinyLlama-shape decode: fraction of the weight-streaming floor", "llama-decode", 0.55),
]


def limit_text(target: dict[str, Any]) -> str:
    """The limit as suite.md and run.py print it: ">= 0.55" for an at-least target."""
    at_least = target.get("direction") == "at least"
    return f">= {target['limit']}" if at_least else str(target["limit"])


def _row(rows: list[dict[str, Any]], workload: str, backend: str) -> dict[str, Any] | None:
    for row in rows:
        if row["workload"] == workload and row["backend"] == backend:
            return row
    return None


def compute_targets(
    rows: list[dict[str, Any]], generate: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Each target as a ratio with status "met", "missed" or "not measured" (and why); the
    zoo's and generate's targets follow, and the error target over every row comes last."""
    targets = []
    for name, workload, metric, backend, baseline, limit in TARGETS:
        target: dict[str, Any] = {
            "name": name,
            "workload": workload,
            "metric": metric,
            "backend": backend,
            "baseline": baseline,
            "limit": limit,
            "value": None,
        }
        mine, base = _row(rows, workload, backend), _row(rows, workload, baseline)
        if mine is None or base is None:
            target.update(status="not measured", note="row not in this run")
        elif base["status"] != "ok" or mine.get("phase") == "build":
            # No baseline, or the workload itself could not be built: a gap in the data.
            failed = base if base["status"] != "ok" else mine
            target.update(status="not measured", note=f"{failed['backend']}: {failed['status']}")
        elif mine["status"] != "ok":
            # The backend under test failing is a miss, not a gap in the data.
            target.update(status="missed", note=f"{backend}: {mine['status']}")
        elif mine.get(metric) is None or not base.get(metric):
            # Kernel counts without a CUDA device, or a metric the run did not record.
            why = mine.get("kernels_source") or f"no {metric}"
            target.update(status="not measured", note=why)
        else:
            value = mine[metric] / base[metric]
            target.update(
                value=value,
                status="met" if value <= limit else "missed",
                note=f"{mine[metric]:.4g} / {base[metric]:.4g}",
            )
        targets.append(target)
    targets += _floor_targets(rows)
    targets += _zoo_targets(rows)
    targets += _generate_targets(generate)

    measured = [r for r in rows if r["status"] == "ok"]
    over = [
        f"{r['workload']}/{r['backend']}: {r['rel_error']:.2e} > {r['tolerance']:.0e}"
        for r in measured
        if not r["error_ok"]
    ]
    worst = max((r["rel_error"] / r["tolerance"] for r in measured), default=None)
    targets.append(
        {
            "workload": "*",
            "backend": "*",
            "baseline": "eager",
            "name": "every row's rel error <= its dtype tolerance (fp16 1e-2, fp32 1e-4)",
            "metric": "rel_error / tolerance",
            "limit": 1.0,
            "value": worst if worst is None or math.isfinite(worst) else None,
            "status": ("not measured" if not measured else "missed" if over else "met"),
            "note": "; ".join(over) if over else f"{len(measured)} rows checked",
        }
    )
    for target in targets:  # the floor's are "at least"
        target.setdefault("direction", "at most")
    return targets


def _target(name: str, workload: str, metric: str, baseline: str | None, limit: float,
            value: float | None, status: str, note: str) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "workload": workload, "metric": metric, "backend": "infinifuse",
            "baseline": baseline, "limit": limit, "value": value, "status": status,
            "note": note}  # fmt: skip


def _floor_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """infinifuse's fraction of the weight-streaming floor, at least each limit."""
    targets = []
    for name, workload, limit in FLOOR_TARGETS:
        mine = _row(rows, workload, "infinifuse")
        value = None
        if mine is None:
            status, note = "not measured", "row not in this run"
        elif mine["status"] != "ok":
            status = "not measured" if mine.get("phase") == "build" else "missed"
            note = f"infinifuse: {mine['status']}"
        elif mine.get("floor_fraction") is None:
            why = "no CUDA device: no copy bandwidth" if not mine.get("copy_gbs") else "no floor"
            status, note = "not measured", why
        else:
            value = mine["floor_fraction"]
            status = "met" if value >= limit else "missed"
            gigabytes = mine["weight_bytes"] / 1e9
            note = (
                f"floor {mine['floor_ms']:.4g} ms ({gigabytes:.3g} GB at {mine['copy_gbs']:.0f} "
                f"GB/s) / per call {mine['per_call_ms']:.4g} ms"
            )
        target = _target(name, workload, "floor_fraction", None, limit, value, status, note)
        targets.append({**target, "direction": "at least"})
    return targets


def _zoo_families(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """family -> backend -> row, for the zoo's rows."""
    families: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["workload"].startswith(ZOO_PREFIX):
            family = row["workload"].removeprefix(ZOO_PREFIX)
            families.setdefault(family, {})[row["backend"]] = row
    return families


def _worst_ratio(
    families: dict[str, dict[str, dict[str, Any]]], metric: str, baseline: str, limit: float
) -> tuple[float | None, str, str]:
    """The largest infinifuse / baseline ratio over the families: (value, status, note)."""
    ratios, failed = {}, []
    for family, by_backend in sorted(families.items()):
        mine, base = by_backend.get("infinifuse"), by_backend.get(baseline)
        if mine is None or base is None or base["status"] != "ok":
            continue
        if mine["status"] != "ok":
            failed.append(family)
        elif mine.get(metric) is not None and base.get(metric):
            ratios[family] = mine[metric] / base[metric]
    if failed:
        return None, "missed", f"infinifuse failed on {', '.join(failed)}"
    if not ratios:
        return None, "not measured", f"no zoo family with {metric} for infinifuse and {baseline}"
    worst = max(ratios, key=ratios.__getitem__)
    over = sum(r > limit for r in ratios.values())
    note = f"worst {worst}; {over} of {len(ratios)} families over the limit"
    return ratios[worst], "met" if not over else "missed", note


def _zoo_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    families = _zoo_families(rows)
    fuse = {f: b["infinifuse"] for f, b in families.items() if "infinifuse" in b}
    name = "zoo: every infinifuse signature captured, families not (issue 9)"
    if not fuse:
        captured = _target(name, "zoo", "all_captured", None, 0, None, "not measured",
                           "no zoo rows in this run")  # fmt: skip
    elif any(r["status"] != "ok" for r in fuse.values()):
        bad = sorted(f for f, r in fuse.items() if r["status"] != "ok")
        captured = _target(name, "zoo", "all_captured", None, 0, None, "missed",
                           f"infinifuse failed on {', '.join(bad)}")  # fmt: skip
    elif all(r.get("all_captured") is None for r in fuse.values()):
        captured = _target(name, "zoo", "all_captured", None, 0, None, "not measured",
                           "no CUDA device: nothing is captured")  # fmt: skip
    else:
        missing = sorted(f for f, r in fuse.items() if r.get("all_captured") is False)
        captured = _target(
            name,
            "zoo",
            "all_captured",
            None,
            0,
            len(missing),
            "missed" if missing else "met",
            f"not captured: {', '.join(missing)}" if missing else f"{len(fuse)} families",
        )
    targets = [captured]
    for metric, baseline, what in (
        ("kernels_per_call", "inductor", "kernels per call without graphs: infinifuse / Inductor"),
        ("per_call_ms", "reduce-overhead", "per call with graphs: infinifuse / reduce-overhead"),
    ):
        value, status, note = _worst_ratio(families, metric, baseline, 1.0)
        targets.append(_target(f"zoo, {what} (worst family)", "zoo", metric, baseline, 1.0,
                               value, status, note))  # fmt: skip
    return targets


def _generate_targets(generate: dict[str, Any] | None) -> list[dict[str, Any]]:
    """From generate.py's summary: tokens/s >= 1.0x transformers' auto-compile,
    stated as time per token infinifuse / auto-compile <= 1.0; and the fall of tokens/s from
    the shortest to the longest cache, infinifuse's over auto-compile's, <= 1.1."""
    speed_name = "generate: time per token, infinifuse / auto-compile (worst cache length)"
    fall_name = "generate: tokens/s fall shortest -> longest cache, infinifuse / auto-compile"
    summary = (generate or {}).get("summary") or {}
    ratios = {k: v for k, v in summary.items() if k.startswith("tokens_per_s_ratio_")}
    if generate is None:
        why = "generate not in this run"
    elif generate["status"] == "skipped":
        why = f"generate skipped: {generate.get('error', '')}"
    else:
        why = "no infinifuse and auto-compile pair of runs"
    if ratios:
        times = {k.removeprefix("tokens_per_s_ratio_"): 1 / v for k, v in ratios.items()}
        worst = max(times, key=times.__getitem__)
        speed = _target(speed_name, "generate", "tokens_per_s", "autocompile", 1.0,
                        times[worst], "met" if times[worst] <= 1.0 else "missed",
                        f"cache {worst}; tokens/s ratio {1 / times[worst]:.3g}")  # fmt: skip
    else:
        speed = _target(speed_name, "generate", "tokens_per_s", "autocompile", 1.0, None,
                        "not measured", why)  # fmt: skip
    fall = summary.get("cache_growth_fall_ratio")
    if fall is not None:
        falls = summary["cache_growth_fall"]
        fall_target = _target(
            fall_name, "generate", "cache_growth_fall", "autocompile", 1.1, fall,
            "met" if fall <= 1.1 else "missed",
            f"{falls['infinifuse']:.3g}x / {falls['autocompile']:.3g}x",
        )  # fmt: skip
    else:
        fall_target = _target(fall_name, "generate", "cache_growth_fall", "autocompile", 1.1,
                              None, "not measured", why)  # fmt: skip
    return [speed, fall_target]


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _parts_line(parts: list[dict[str, Any] | None]) -> list[str]:
    """Where the rows come from when several runs were merged (``run.py --merge``)."""
    if len(parts) < 2:
        return []
    described = [
        f"{(p or {}).get('date', '?')} ({' '.join((p or {}).get('argv', [])) or 'no argv'})"
        for p in parts
    ]
    return [f"Merged from {len(parts)} runs: " + "; ".join(described) + ".", ""]


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# infinifuse benchmark suite",
        "",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · transformers "
        f"{env['transformers']} · {env['date']}"
        + (" · **quick (tiny sizes)**" if env["quick"] else ""),
        "",
        *_parts_line(report.get("parts", [])),
        "Per call: median over rounds of a timed loop (CPU overhead included); first call: "
        "compile included, after `torch._dynamo.reset()` (gpt2-sweep: the whole first pass "
        "over every length; its per call is the median of each length's warm call). "
        "Error: ||out-ref||/||ref|| vs eager in float64.",
        "",
        "## Targets",
        "",
        "| target | value | limit | status | detail |",
        "|---|---|---|---|---|",
    ]
    for t in report["targets"]:
        lines.append(
            f"| {t['name']} | {_fmt(t['value'], '.3g')} | {limit_text(t)} | "
            f"**{t['status']}** | {t.get('note', '')} |"
        )
    main_rows = [r for r in report["rows"] if not r["workload"].startswith(ZOO_PREFIX)]
    table = [
        "",
        "## Rows",
        "",
        "Kernels per call: CUDA kernel launches of one steady call without CUDA graphs "
        "(torch.profiler; infinifuse compiled with cudagraphs=False; reduce-overhead shows "
        "Inductor's default count, since its graphs hide launches); - where not counted. "
        "Of floor (decode rows, CUDA): the weight-streaming floor over per call, the floor "
        "being the bytes of weights a step reads (every parameter but gathered embedding "
        "tables) at the device-to-device copy bandwidth measured in the same run.",
        "",
        "| workload | shape | backend | status | per call (ms) | first call (s) | to steady (s) "
        "| peak mem (MB) | rel error | tol | mode | kernels per call | of floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if main_rows:  # else only the zoo (its own table below) or generate ran
        lines += table
    for r in main_rows:
        lines.append(
            f"| {r['workload']} | {r.get('shape', '')} | {r['backend']} | {_status(r)} | "
            f"{_fmt(r.get('per_call_ms'), '.4g')} | {_fmt(r.get('first_call_s'), '.3g')} | "
            f"{_fmt(r.get('warm_s'), '.3g')} | {_fmt(r.get('peak_mem_mb'), '.0f')} | "
            f"{_fmt(r.get('rel_error'), '.1e')} | {_fmt(r.get('tolerance'), '.0e')} | "
            f"{r.get('mode', '-')} | {_fmt(r.get('kernels_per_call'), 'd')} | "
            f"{_fmt(r.get('floor_fraction'), '.3f')} |"
        )
    lines += _ledger_section(report)
    lines += _four_models_table(report["rows"])
    lines += _zoo_table(report["rows"])
    lines += _generate_section(report.get("generate"))
    failures = [r for r in report["rows"] if r["status"] == "error"]
    fallbacks = [r for r in report["rows"] if r.get("fallback_reasons")]
    generate_runs = (report.get("generate") or {}).get("runs", [])
    generate_fallbacks = [
        (f"generate/{run['variant']}/{run['cache_len']}", reason[:400])
        for run in generate_runs
        for reason in sorted(set((run.get("fallback_reasons") or {}).values()))
    ]
    if failures or fallbacks or generate_fallbacks:
        lines += ["", "## Errors and fallbacks", ""]
        for r in failures:
            lines.append(f"- {r['workload']}/{r['backend']}: error `{r['error']}`")
        for r in fallbacks:
            for reason in r["fallback_reasons"]:
                lines.append(f"- {r['workload']}/{r['backend']}: fallback `{reason}`")
        for where, reason in generate_fallbacks:
            lines.append(f"- {where}: fallback `{reason}`")
    return "\n".join(lines) + "\n"


def _ledger_section(report: dict[str, Any], path: Path = LEDGER) -> list[str]:
    """Each row's per-call figure beside the latest one the ledger holds for its workload
    and backend on the same device from before this run: what changed since."""
    if not path.exists():
        return []
    env = report["environment"]
    # before the first figure of this run (its rows carry their own dates)
    start = min([env["date"], *(r["date"] for r in report["rows"] if r.get("date"))])
    earlier: dict[tuple[str, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if not row or row["metric"] != "per_call_ms" or row["device"] != env["device"]:
            continue
        if not (row.get("date") or "") < start:
            continue
        key = (row["workload"], row["backend"])
        if key not in earlier or row["date"] > earlier[key]["date"]:
            earlier[key] = row
    pairs = [
        (r, earlier[key])
        for r in report["rows"]
        if (key := (r["workload"], r["backend"])) in earlier
        and isinstance(r.get("per_call_ms"), (int, float))
    ]
    if not pairs:
        return []
    lines = [
        "",
        "## Against the ledger",
        "",
        f"Per call against the latest earlier figure of the same workload and backend on this "
        f"device in `{path.name}` (`python benchmarks/ledger.py --table WORKLOAD`).",
        "",
        "| workload | backend | per call (ms) | earlier (ms) | ratio | earlier from |",
        "|---|---|---|---|---|---|",
    ]
    for row, before in pairs:
        lines.append(
            f"| {row['workload']} | {row['backend']} | {row['per_call_ms']:.4g} | "
            f"{before['value']:.4g} | {row['per_call_ms'] / before['value']:.2f}x | "
            f"{before['source']}, {str(before['date'])[:10]} |"
        )
    return lines


def _status(row: dict[str, Any]) -> str:
    if row["status"] == "skipped":
        return f"skipped ({row.get('error', '')})"
    return row["status"] if row["status"] == "ok" else "error"


def _ratio(a: Any, b: Any, spec: str = ".2f") -> str:
    return f"{a / b:{spec}}x" if a is not None and b else "-"


# Columns of the per-call figures: infinifuse first, then its baselines.
BACKEND_COLUMNS = ("infinifuse", "reduce-overhead", "inductor", "eager")


def _ok(by_backend: dict[str, Any], backend: str, metric: str) -> Any:
    """The metric of a backend's row if it ran, else None."""
    row = by_backend.get(backend)
    return row.get(metric) if row is not None and row["status"] == "ok" else None


def _four_models_table(rows: list[dict[str, Any]]) -> list[str]:
    """The four models' table: per call with graphs and kernels per call without, per model."""
    present = [(w, label) for w, label in FOUR_MODELS if _row(rows, w, "infinifuse")]
    if not present:
        return []
    lines = [
        "",
        "## Issue 10's four models",
        "",
        "| model | per call with graphs: infinifuse / reduce-overhead (ms) | kernels per call "
        "without graphs: infinifuse / Inductor / eager |",
        "|---|---|---|",
    ]
    for workload, label in present:
        by_backend = {b: _row(rows, workload, b) for b in BACKEND_COLUMNS}
        fuse_ms = _ok(by_backend, "infinifuse", "per_call_ms")
        ro_ms = _ok(by_backend, "reduce-overhead", "per_call_ms")
        kernels = [_ok(by_backend, b, "kernels_per_call") for b in ("infinifuse", "inductor",
                                                                     "eager")]  # fmt: skip
        lines.append(
            f"| {label} | {_fmt(fuse_ms, '.3g')} / {_fmt(ro_ms, '.3g')} "
            f"({_ratio(fuse_ms, ro_ms)}) | {' / '.join(_fmt(k, 'd') for k in kernels)} |"
        )
    return lines


def _zoo_table(rows: list[dict[str, Any]]) -> list[str]:
    families = _zoo_families(rows)
    if not families:
        return []
    lines = [
        "",
        "## Model zoo (tests/model_zoo.py: 2 layers, hidden 64, batch 2 x 7, padded mask)",
        "",
        "Captured: every infinifuse signature runs from a CUDA graph (no mode eager; - without "
        "CUDA). Max rel error: the largest over the compiled backends, vs eager.",
        "",
        "| family | kernels per call: infinifuse / Inductor / eager | captured | fused groups "
        "| graphs | max rel error | per call (ms): infinifuse / reduce-overhead / Inductor / "
        "eager | infinifuse / reduce-overhead | infinifuse mode |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, by_backend in sorted(families.items()):
        fuse = by_backend.get("infinifuse", {"status": "missing"})
        kernels = [_ok(by_backend, b, "kernels_per_call") for b in ("infinifuse", "inductor",
                                                                     "eager")]  # fmt: skip
        compiled = [r for b, r in by_backend.items() if b != "eager" and r["status"] == "ok"]
        worst = max((r["rel_error"] for r in compiled), default=None)
        ms = [_ok(by_backend, b, "per_call_ms") for b in BACKEND_COLUMNS]
        captured = fuse.get("all_captured")
        mode = fuse.get("mode", "-") if fuse["status"] == "ok" else _status(fuse)
        lines.append(
            f"| {family} | {' / '.join(_fmt(k, 'd') for k in kernels)} | "
            f"{'-' if captured is None else 'yes' if captured else '**no**'} | "
            f"{_fmt(_ok(by_backend, 'infinifuse', 'fused_groups'), 'd')} | "
            f"{_fmt(_ok(by_backend, 'infinifuse', 'graphs'), 'd')} | {_fmt(worst, '.1e')} | "
            f"{' / '.join(_fmt(m, '.3g') for m in ms)} | {_ratio(ms[0], ms[1])} | {mode} |"
        )
    return lines


def _generate_section(generate: dict[str, Any] | None) -> list[str]:
    if generate is None:
        return []
    lines = ["", f"## generate(): {generate.get('model') or generate['description']}", ""]
    if generate["status"] != "ok":
        lines += [f"Status: **{generate['status']}**: `{generate.get('error', '')[:600]}`", ""]
    if "runs" not in generate:
        return lines
    lines += [
        f"Prompt {generate['prompt_tokens']} tokens, {generate['new_tokens']} new tokens, "
        f"greedy; each variant in its own process with empty compile caches "
        f"(benchmarks/generate.py, full record in {generate['json']}).",
        "",
        "| variant | cache length | first generate (s) | tokens/s | tokens equal eager | "
        "infinifuse modes |",
        "|---|---|---|---|---|---|",
    ]
    for run in generate["runs"]:
        if "error" in run:
            error = run["error"].strip().splitlines()[-1:] or [""]
            lines.append(f"| {run['variant']} | {run['cache_len']} | error: `{error[0][:200]}` "
                         "| | | |")  # fmt: skip
            continue
        modes = run.get("modes")
        mode_text = ",".join(sorted(set(modes.values()))) if modes else "-"
        lines.append(
            f"| {run['variant']} | {run['cache_len']} | {run['first_generate_s']:.3g} | "
            f"{run['tokens_per_s']:.4g} | {run['tokens_equal_eager']}/{run['tokens_total']} | "
            f"{mode_text} |"
        )
    summary_lines = generate.get("summary", {}).get("lines", [])
    if summary_lines:
        lines += [""] + [f"- {line}" for line in summary_lines]
    return lines


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Bar charts (log scale) of per-call latency, first-call time and, where counted, kernels
    per call (zoo rows left out); None if drawn, else why not (no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    # The zoo's 21 families would crowd the bars out: they have their table in suite.md.
    shown = [r for r in report["rows"] if not r["workload"].startswith(ZOO_PREFIX)]
    rows = [r for r in shown if r["status"] == "ok"]
    if not rows:
        return "no successful rows: no plot"
    workloads = list(dict.fromkeys(r["workload"] for r in shown))
    backends = list(dict.fromkeys(r["backend"] for r in shown))
    width = 0.8 / max(1, len(backends))
    panels = [("per_call_ms", "per call (ms)"), ("first_call_s", "first call, compile incl. (s)")]
    if any(r.get("kernels_per_call") for r in rows):
        panels.append(("kernels_per_call", "kernels per call, no graphs"))
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(8, 1.6 * len(workloads)), 4 * len(panels)), sharex=True
    )
    for ax, (metric, label) in zip(axes, panels):
        for j, backend in enumerate(backends):
            xs, ys = [], []
            for i, workload in enumerate(workloads):
                row = _row(rows, workload, backend)
                if row is not None and row.get(metric):
                    xs.append(i + (j - (len(backends) - 1) / 2) * width)
                    ys.append(row[metric])
            ax.bar(xs, ys, width, label=backend, color=_COLORS.get(backend, "black"))
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(ncol=3, fontsize=8)
    axes[-1].set_xticks(range(len(workloads)))
    axes[-1].set_xticklabels(workloads, rotation=20)
    env = report["environment"]
    fig.suptitle(
        f"infinifuse suite: {env['device']}, torch {env['torch']}"
        + (" (quick)" if env["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
