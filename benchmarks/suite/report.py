"""Targets, suite.md and suite.png from the suite's rows."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "compute_targets", "markdown", "plot"]

# (name, workload, metric, backend, baseline backend, limit): backend's metric divided by
# the baseline's must be <= limit.
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
    (
        "TinyLlama-shape decode, per call: infinifuse / reduce-overhead",
        "llama-decode",
        "per_call_ms",
        "infinifuse",
        "reduce-overhead",
        2.0,
    ),
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
}


def _row(rows: list[dict[str, Any]], workload: str, backend: str) -> dict[str, Any] | None:
    for row in rows:
        if row["workload"] == workload and row["backend"] == backend:
            return row
    return None


def compute_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target as a ratio with status "met", "missed" or "not measured" (and why)."""
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
        else:
            value = mine[metric] / base[metric]
            target.update(
                value=value,
                status="met" if value <= limit else "missed",
                note=f"{mine[metric]:.4g} / {base[metric]:.4g}",
            )
        targets.append(target)

    measured = [r for r in rows if r["status"] == "ok"]
    over = [
        f"{r['workload']}/{r['backend']}: {r['rel_error']:.2e} > {r['tolerance']:.0e}"
        for r in measured
        if not r["error_ok"]
    ]
    worst = max((r["rel_error"] / r["tolerance"] for r in measured), default=None)
    targets.append(
        {
            "name": "every row's rel error <= its dtype tolerance (fp16 1e-2, fp32 1e-4)",
            "metric": "rel_error / tolerance",
            "limit": 1.0,
            "value": worst if worst is None or math.isfinite(worst) else None,
            "status": ("not measured" if not measured else "missed" if over else "met"),
            "note": "; ".join(over) if over else f"{len(measured)} rows checked",
        }
    )
    return targets


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# infinifuse benchmark suite",
        "",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · transformers "
        f"{env['transformers']} · {env['date']}"
        + (" · **quick (tiny sizes)**" if env["quick"] else ""),
        "",
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
            f"| {t['name']} | {_fmt(t['value'], '.3g')} | {t['limit']} | "
            f"**{t['status']}** | {t.get('note', '')} |"
        )
    lines += [
        "",
        "## Rows",
        "",
        "| workload | shape | backend | status | per call (ms) | first call (s) | to steady (s) "
        "| peak mem (MB) | rel error | tol | mode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        status = r["status"] if r["status"] in ("ok", "skipped") else "error"
        if r["status"] == "skipped":
            status = f"skipped ({r.get('error', '')})"
        lines.append(
            f"| {r['workload']} | {r.get('shape', '')} | {r['backend']} | {status} | "
            f"{_fmt(r.get('per_call_ms'), '.4g')} | {_fmt(r.get('first_call_s'), '.3g')} | "
            f"{_fmt(r.get('warm_s'), '.3g')} | {_fmt(r.get('peak_mem_mb'), '.0f')} | "
            f"{_fmt(r.get('rel_error'), '.1e')} | {_fmt(r.get('tolerance'), '.0e')} | "
            f"{r.get('mode', '-')} |"
        )
    failures = [r for r in report["rows"] if r["status"] == "error"]
    fallbacks = [r for r in report["rows"] if r.get("fallback_reasons")]
    if failures or fallbacks:
        lines += ["", "## Errors and fallbacks", ""]
        for r in failures:
            lines.append(f"- {r['workload']}/{r['backend']}: error `{r['error']}`")
        for r in fallbacks:
            for reason in r["fallback_reasons"]:
                lines.append(f"- {r['workload']}/{r['backend']}: fallback `{reason}`")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Bar charts (log scale) of per-call latency and first-call time; None if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    if not rows:
        return "no successful rows: no plot"
    workloads = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    backends = list(dict.fromkeys(r["backend"] for r in report["rows"]))
    width = 0.8 / max(1, len(backends))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(workloads)), 8), sharex=True)
    panels = (("per_call_ms", "per call (ms)"), ("first_call_s", "first call, compile incl. (s)"))
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
    axes[1].set_xticks(range(len(workloads)))
    axes[1].set_xticklabels(workloads, rotation=20)
    env = report["environment"]
    fig.suptitle(
        f"infinifuse suite: {env['device']}, torch {env['torch']}"
        + (" (quick)" if env["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
