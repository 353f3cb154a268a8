"""The performance tables of the README, docs/PERFORMANCE.md and docs/PERFORMANCE_HISTORY.md,
written from the results ledger, and the check that ties every figure of the README's
performance section and of both docs to its source.

Three kinds of figure, three rules:

* A table between ``<!-- ledger-table: NAME -->`` and ``<!-- /ledger-table -->`` is written by
  ``TABLES[NAME]`` from ledger rows chosen by source file, workload, backend, metric and device;
  its ratios are computed from those rows. The check renders it again and compares the text,
  so an edited or swapped cell fails.
* A figure in prose is keyed by an HTML comment after its paragraph (or list item)::

      <!-- ledger-keys suite.json:
      1.744 = [llama-decode/infinifuse/per_call_ms];
      0.89x = [llama-decode/infinifuse/per_call_ms] / [llama-decode/reduce-overhead/per_call_ms];
      23.0 = [row_kernels_h100_full_suite.json:row-rope-4096x4096/infinifuse/ms] in us;
      0.95-0.98x = [a/b/m] / [c/d/m] .. [e/f/m] / [g/h/m];
      3.28 = [diag_query_host_h200_e37d61a.json:w/b/m@H200] -->

  Each entry is the figure as the text shows it, then an expression of ledger rows in
  brackets (``[workload/backend/metric]`` of the comment's source file, or
  ``[file:workload/backend/metric]``), ``+ - * /``, parentheses and numbers; ``in us`` (``ms``,
  ``s``) converts times first, ``@H200`` after a row takes it from that device's runs (rows are
  H100's otherwise), and a figure ending in ``%`` is a fraction times 100. The
  figure must equal the expression rendered at the digits shown, and the paragraph must show
  the keyed figures in the comment's order, so a swap or another row's value fails.
* Any other figure of the section (a number with a unit: ms, s, us, x, %, MB, ...) must come
  from a file its sentence, or an earlier sentence of its paragraph, names in backticks
  (a result under ``benchmarks/results/``, a diag script): measured outside the ledger, said
  so where it stands. A named result file must exist: under ``benchmarks/results/``, or
  removed from there as a ledger source (its rows folded into the ledger) or a retired file
  (``benchmarks/ledger.py``'s ``RETIRED``, in git at ``FOLDED_AT``).

    python benchmarks/readme_tables.py           # check README.md and the docs: rc 1 on a fault
    python benchmarks/readme_tables.py --write   # rewrite every table between its markers
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import math
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger  # noqa: E402  (benchmarks/ledger.py, beside this file)

ROOT = ledger.ROOT
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
HISTORY = ROOT / "docs" / "PERFORMANCE_HISTORY.md"
GENERATION = ROOT / "docs" / "GENERATION.md"  # its keys only (its other numbers are design)
H100 = "NVIDIA H100 80GB HBM3"
DEVICES = {"H100": H100, "H200": "NVIDIA H200"}  # a key's row of another device: [...@H200]
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


class Rows:
    """The ledger's rows by (source, workload, backend, metric); each lookup checks the
    device."""

    def __init__(self, rows: Iterable[dict[str, Any]]):
        self.rows = {(r["source"], r["workload"], r["backend"], r["metric"]): r for r in rows}

    def row(self, source: str, workload: str, backend: str, metric: str,
            device: str = H100) -> dict[str, Any]:  # fmt: skip
        key = (source, workload, backend, metric)
        if key not in self.rows:
            raise KeyError(f"no ledger row {'/'.join(key)}")
        row = self.rows[key]
        if row["device"] != device:
            raise KeyError(f"ledger row {'/'.join(key)} is of {row['device']}, not {device}")
        return row

    def get(self, source: str, workload: str, backend: str, metric: str,
            device: str = H100) -> float:  # fmt: skip
        return self.row(source, workload, backend, metric, device)["value"]


def load(path: str | Path = ledger.LEDGER) -> Rows:
    return Rows(ledger.read(path))


# ---- rendering


def num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def sig3(value: float) -> str:
    """Three significant digits for values under 100 (2.59, 23.4), none after the point
    from 100."""
    return num(value, 2 if value < 10 else 1 if value < 100 else 0)


def bold(text: str) -> str:
    return f"**{text}**"


def ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}x"


def table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


DECODERS = [("TinyLlama shape, 22 layers, decode", "llama-decode"),
            ("Qwen2-0.5B shape, 24 layers, decode", "qwen2-decode"),
            ("GPT-2, 12 layers, decode", "gpt2-decode")]  # fmt: skip


def decode_steps(rows: Rows) -> list[str]:
    def v(w: str, b: str, m: str) -> float:
        return rows.get("suite.json", w, b, m)

    body = []
    for label, w in [*DECODERS, ("BERT-base, 8 x 128", "bert")]:
        ro, inf = v(w, "reduce-overhead", "per_call_ms"), v(w, "infinifuse", "per_call_ms")
        first = [v(w, b, "first_call_s") for b in ("dynamo", "reduce-overhead", "infinifuse")]
        body.append([label, f"{num(ro, 3)} ms", bold(f"{num(inf, 3)} ms"), bold(ratio(inf, ro)),
                     f"{num(first[0], 1)} / {num(first[1], 1)} / " + bold(f"{num(first[2], 1)} s"),
                     f"{v(w, 'inductor', 'kernels_per_call')} / "
                     + bold(str(v(w, "infinifuse", "kernels_per_call")))])  # fmt: skip
    return table(["model", "reduce-overhead", bold("infinifuse"), "ratio",
                  "first call: Dynamo alone / reduce-overhead / " + bold("infinifuse"),
                  "kernels per call: Inductor / " + bold("infinifuse")], body)  # fmt: skip


def matmul_groups(rows: Rows) -> list[str]:
    body = []
    for label, w, source in [
        (*DECODERS[0], "matmul_groups_decode_h100.json"),
        (*DECODERS[1], "matmul_groups_decode_h100.json"),
        ("TinyLlama shape, batch 16, decode", "llama-b16-decode", "matmul_groups_decode_h100.json"),
        (*DECODERS[2], "matmul_groups_gpt2_h100.json"),
    ]:
        ro, off, on = (
            rows.get(source, w, b, "per_call_ms")
            for b in ("reduce-overhead", "infinifuse-nomatmul", "infinifuse")
        )
        k_off, k_on = (rows.get(source, w, b, "kernels_per_call")
                       for b in ("infinifuse-nomatmul", "infinifuse"))  # fmt: skip
        body.append([label, f"{num(ro, 3)} ms", f"{num(off, 3)} ms", bold(f"{num(on, 3)} ms"),
                     bold(ratio(on, ro)), f"{k_off} / " + bold(str(k_on))])  # fmt: skip
    return table(["model", "reduce-overhead", "matmul groups off", bold("matmul groups"),
                  "ratio to reduce-overhead", "kernels per call (off / on)"], body)  # fmt: skip


def _decode_against(rows: Rows, sources: list[str], off: str | None,
                    kernels: bool) -> list[list[str]]:  # fmt: skip
    """Rows of reduce-overhead, infinifuse with a feature off (off), infinifuse, the ratio and
    the kernels per call or the fraction of the weight-streaming floor, one source per model."""
    body = []
    for (label, w), source in zip(DECODERS, sources):
        ro, inf = (rows.get(source, w, b, "per_call_ms") for b in ("reduce-overhead", "infinifuse"))
        line = [label, f"{num(ro, 3)} ms"]
        if off:
            line.append(f"{num(rows.get(source, w, off, 'per_call_ms'), 3)} ms")
        line += [bold(f"{num(inf, 3)} ms"), bold(ratio(inf, ro, 3))]
        if kernels:
            line.append(str(rows.get(source, w, "infinifuse", "kernels_per_call")))
        # GPT-2's floor is not shown: its step is host-bound, a fraction of it says nothing
        floor = rows.get(source, w, "infinifuse", "floor_fraction") if w != "gpt2-decode" else None
        line.append("-" if floor is None else num(floor, 3))
        body.append(line)
    return body


def decode_epilogues(rows: Rows) -> list[str]:
    floor, first = "suite_decode_h100_epilogues_floor.json", "suite_decode_h100_epilogues.json"
    return table(["model", "reduce-overhead", bold("infinifuse"), "ratio", "kernels per call",
                  "of the weight-streaming floor"],
                 _decode_against(rows, [floor, floor, first], None, True))  # fmt: skip


def decode_launch_overlap(rows: Rows) -> list[str]:
    source = "suite_decode_h100_pdl_attention.json"
    return table(["model", "reduce-overhead", "infinifuse without overlap", bold("infinifuse"),
                  "ratio", "of the weight-streaming floor"],
                 _decode_against(rows, [source] * 3, "infinifuse-nopdl", False))  # fmt: skip


def decode_gemv(rows: Rows) -> list[str]:
    source = "suite_decode_h100_gemv.json"
    return table(["model", "reduce-overhead", "infinifuse without GEMV", bold("infinifuse"),
                  "ratio", "of the weight-streaming floor"],
                 _decode_against(rows, [source] * 3, "infinifuse-nogemv", False))  # fmt: skip


def gemv_launches(rows: Rows) -> list[str]:
    diag, kernels = "matmul_gemv_h100.json", "matmul_kernels_h100_gemv.json"

    def us(source: str, w: str, b: str) -> str:
        return f"{num(rows.get(source, w, b, 'device_us'), 1)} us"

    def pct(source: str, w: str, b: str) -> str:
        return f"{rows.get(source, w, b, 'fraction_of_copy') * 100:.0f}%"

    rotary = "rotary-tinyllama-qkv-rotary-b1"
    body = [["TinyLlama q/k/v + RMSNorm + rotary + cache write (10 MB)",
             us("rotary_gemv_h100.json", rotary, "infinifuse-tensor-core-splitk4"), "-",
             bold(us("rotary_gemv_h100.json", rotary, "infinifuse-default")), "-"]]  # fmt: skip
    for label, shape in [("TinyLlama o + residual (8 MB)", "tinyllama-o"),
                         ("TinyLlama RMSNorm + gate/up + SwiGLU (46 MB)", "tinyllama-gate-up"),
                         ("TinyLlama down + residual (23 MB)", "tinyllama-down"),
                         ("Qwen2-0.5B down + residual (8.7 MB)", "qwen2-down")]:  # fmt: skip
        w = f"matmul-{shape}-m1"
        body.append(
            [
                label,
                us(diag, w, "infinifuse-tensor-cores"),
                us(diag, w, "gemv-best-pdl"),
                bold(us(kernels, w, "infinifuse")),
                pct(kernels, w, "infinifuse"),
            ]
        )
    for label, shape in [
        ("Llama-3-8B, TP=2: RMSNorm + gate/up + SwiGLU (117 MB)", "llama3-8b-tp2-gate-up"),
        ("Llama-3-8B, TP=2: down + residual (59 MB)", "llama3-8b-tp2-down"),
    ]:
        w = f"matmul-{shape}-m1"
        body.append([label, us(diag, w, "infinifuse-tensor-cores"),
                     f"{us(diag, w, 'gemv-best-pdl')} ({pct(diag, w, 'gemv-best-pdl')})", "-",
                     "-"])  # fmt: skip
    return table(["launch, 1 row", "tensor cores", "GEMV, best tile", bold("GEMV as launched"),
                  "of copy bandwidth, as launched"], body)  # fmt: skip


def _generate(rows: Rows, source: str) -> list[str]:
    body = []
    for cache in (128, 4096):
        w = f"generate-cache{cache}"
        auto, inf = (
            rows.get(source, w, b, "first_generate_s") for b in ("autocompile", "infinifuse")
        )
        body.append([f"{cache} slots: first generate", f"{num(auto, 1)} s",
                     bold(f"{num(inf, 1)} s"), ratio(inf, auto)])  # fmt: skip
        auto, inf = (rows.get(source, w, b, "tokens_per_s") for b in ("autocompile", "infinifuse"))
        body.append([f"{cache} slots: tokens/s", num(auto, 0), bold(num(inf, 0)),
                     bold(ratio(inf, auto))])  # fmt: skip
    return table(["StaticCache", "auto-compile (Inductor, reduce-overhead)", bold("infinifuse"),
                  "ratio"], body)  # fmt: skip


def generate_gemv(rows: Rows) -> list[str]:
    return _generate(rows, "generate_h100_gemv.json")


def generate_launch_overlap(rows: Rows) -> list[str]:
    return _generate(rows, "generate_h100_pdl.json")


TP_BACKENDS = ("eager", "inductor", "infinifuse")  # inductor: the benchmark's reduce-overhead


def _tp_row(rows: Rows, label: str, source: str, workload: str, metric: str,
            strong: bool = True, backends: tuple[str, ...] = TP_BACKENDS) -> list[str]:  # fmt: skip
    """One row of a tensor-parallel table: eager, reduce-overhead and infinifuse's figure,
    infinifuse's ratio to reduce-overhead's (in bold where strong)."""
    eager, ro, inf = (rows.get(source, workload, b, metric) for b in backends)
    if metric == "step_ms":
        cells = [f"{num(eager, 1)} ms", f"{num(ro, 2)} ms", bold(f"{num(inf, 2)} ms")]
    elif metric == "first_call_s":
        cells = [f"{num(eager, 1)} s", f"{num(ro, 1)} s", bold(f"{num(inf, 1)} s")]
    else:  # tokens/s: the ratio is infinifuse's over reduce-overhead's
        cells = [num(eager, 0), num(ro, 0), bold(num(inf, 0))]
    r = ratio(inf, ro)
    return [label, *cells, bold(r) if strong else r]


def tp_first(rows: Rows) -> list[str]:
    tp2, tp1 = "tensor_parallel_tinyllama_tp2_h100.json", "tensor_parallel_tinyllama_tp1_h100.json"
    body = [_tp_row(rows, "TP=2 decode step", tp2, "tp-tinyllama-tp2-decode", "step_ms"),
            _tp_row(rows, "TP=2 first call", tp2, "tp-tinyllama-tp2-decode", "first_call_s"),
            _tp_row(rows, "TP=2 generate, tokens/s", tp2, "tp-tinyllama-tp2-generate",
                    "tokens_per_s"),
            _tp_row(rows, "TP=1 decode step", tp1, "tp-tinyllama-tp1-decode", "step_ms",
                    strong=False)]  # fmt: skip
    return table(["TinyLlama shape", "eager", "reduce-overhead", bold("infinifuse"), "ratio"], body)


def _tp_runs(rows: Rows, tail: str, strong: dict[str, bool]) -> list[str]:
    """The seven rows of a tensor-parallel run of both shapes, its files
    tensor_parallel_{shape}_tp{n}_h100x2_{tail}.json."""

    def src(shape: str, tp: int) -> str:
        return f"tensor_parallel_{shape}_tp{tp}_h100x2_{tail}.json"

    specs = [("TinyLlama TP=2", "tinyllama", 2, "decode", "step_ms"),
             ("TinyLlama TP=2, first call", "tinyllama", 2, "decode", "first_call_s"),
             ("TinyLlama TP=2, generate tokens/s", "tinyllama", 2, "generate", "tokens_per_s"),
             ("TinyLlama TP=1", "tinyllama", 1, "decode", "step_ms"),
             ("Llama-3-8B TP=2", "llama3-8b", 2, "decode", "step_ms"),
             ("Llama-3-8B TP=2, first call", "llama3-8b", 2, "decode", "first_call_s"),
             ("Llama-3-8B TP=1", "llama3-8b", 1, "decode", "step_ms")]  # fmt: skip
    body = [_tp_row(rows, label, src(shape, tp), f"tp-{shape}-tp{tp}-{part}", metric,
                    strong[label])
            for label, shape, tp, part, metric in specs]  # fmt: skip
    return table(
        ["decode step, B=1", "eager", "reduce-overhead", bold("infinifuse"), "ratio"], body
    )


def tp_guard_filter(rows: Rows) -> list[str]:
    strong = dict.fromkeys(["TinyLlama TP=2", "TinyLlama TP=2, first call",
                            "TinyLlama TP=2, generate tokens/s", "Llama-3-8B TP=2",
                            "Llama-3-8B TP=2, first call"], True)  # fmt: skip
    strong.update({"TinyLlama TP=1": False, "Llama-3-8B TP=1": False})
    return _tp_runs(rows, "guard_filter_0eb9757", strong)


def tp_launch_overlap(rows: Rows) -> list[str]:
    strong = dict.fromkeys(["TinyLlama TP=2", "TinyLlama TP=2, generate tokens/s",
                            "Llama-3-8B TP=2"], True)  # fmt: skip
    strong.update(
        dict.fromkeys(
            [
                "TinyLlama TP=2, first call",
                "TinyLlama TP=1",
                "Llama-3-8B TP=2, first call",
                "Llama-3-8B TP=1",
            ],
            False,
        )
    )
    return _tp_runs(rows, "launch_overlap_9bdc3da", strong)


def _per_rank(rows: Rows, source: str, ranks: list[str], metric: str, scale: float = 1.0) -> str:
    values = [num(rows.get(source, w, "infinifuse", metric) * scale, 2) for w in ranks]
    return " / ".join(values) + " ms"


def tp_step_diag(rows: Rows) -> list[str]:
    """diag_tp_step.py's runs, one a row: each rank's GPU busy time and host time per replayed
    step (ms), and the step (the same on both ranks at the digits shown)."""
    body = []
    for label, shape, tp, run in [
        ("TinyLlama TP=1", "tinyllama", 1, "before_in_place"),
        ("TinyLlama TP=2", "tinyllama", 2, "host"),
        ("TinyLlama TP=2, guards on parameters skipped", "tinyllama", 2, "guard_filter"),
        ("Llama-3-8B TP=1", "llama3-8b", 1, "before_in_place"),
        ("Llama-3-8B TP=2", "llama3-8b", 2, "host"),
        ("Llama-3-8B TP=2, guards on parameters skipped", "llama3-8b", 2, "guard_filter"),
    ]:
        source = f"diag_tp_step_{shape}_tp{tp}_h100_{run}.json"
        ranks = [f"diag-tp-step-{shape}-tp{tp}-rank{r}" for r in range(tp)]
        if tp == 1:  # the TP=1 runs profiled the step run direct only
            busy = _per_rank(rows, source, ranks, "device_us_per_step_direct", 1e-3)
            busy, host = busy + " (run direct)", "-"
        else:
            busy = _per_rank(rows, source, ranks, "device_us_per_step_graphs", 1e-3)
            host = _per_rank(rows, source, ranks, "host_ms_per_step")
        steps = {num(rows.get(source, w, "infinifuse", "step_ms_graphs"), 2) for w in ranks}
        assert len(steps) == 1, (source, steps)
        step = f"{steps.pop()} ms"
        body.append([label, busy, host, bold(step) if "skipped" in label else step])
    return table(["decode step, infinifuse, replayed", "GPU busy, rank 0 / 1",
                  "host per step, rank 0 / 1", "step"], body)  # fmt: skip


def digits(n: int | None) -> Callable[[float], str]:
    """A renderer at n decimals, or at three significant digits (sig3) where n is None."""
    return sig3 if n is None else lambda value: num(value, n)


def _sentence_rows(rows: Rows, source: str, workload: str, backends: list[str],
                   first_label: str, first_digits: int | None = None,
                   p90_digits: int | None = None, new_length_rows: bool = False,
                   ) -> list[list[str]]:  # fmt: skip
    """first pass / second pass / query p50 and p90 of one shape, a column per backend
    (infinifuse's in bold): the second pass at three decimals, the rest at three significant
    digits unless first_digits or p90_digits says otherwise; with new_length_rows, the p90 of
    the queries at a new token length and at a length seen before."""

    def v(backend: str, metric: str) -> float:
        return rows.get(source, workload, backend, metric)

    def cells(text: Callable[[str], str]) -> list[str]:
        return [bold(text(b)) if b == "infinifuse" else text(b) for b in backends]

    def pair(metric_a: str, metric_b: str, render_a: Callable, render_b: Callable) -> list[str]:
        return cells(lambda b: f"{render_a(v(b, metric_a))} / {render_b(v(b, metric_b))} ms")

    first, second = digits(first_digits), digits(3)
    body = [
        [first_label, *cells(lambda b: f"{first(v(b, 'first_pass_s'))} s")],
        ["second pass", *cells(lambda b: f"{second(v(b, 'second_pass_s'))} s")],
        ["single query p50 / p90", *pair("query_p50_ms", "query_p90_ms", sig3, digits(p90_digits))],
    ]
    if new_length_rows:
        body.append(["query p90, a new length / a length seen before",
                     *pair("query_p90_ms_new_length", "query_p90_ms_seen_length", digits(1),
                           digits(1))])  # fmt: skip
    return body


def sentence_first(rows: Rows) -> list[str]:
    source, backends = "sentence_embeddings_h100.json", ["eager", "reduce-overhead", "infinifuse"]
    body = _sentence_rows(rows, source, "sentence-minilm-l6", backends,
                          "MiniLM-L6 shape: first pass (compiles included)")  # fmt: skip
    body += _sentence_rows(rows, source, "sentence-bert-base", backends,
                           "BERT-base shape: first pass")  # fmt: skip
    return table(["", "eager", "reduce-overhead", bold("infinifuse")], body)


def sentence_routes(rows: Rows) -> list[str]:
    backends = ["eager", "reduce-overhead", "infinifuse"]
    body = _sentence_rows(
        rows,
        "sentence_embeddings_h100_minilm_routes.json",
        "sentence-minilm-l6",
        backends,
        "MiniLM-L6 shape: first pass",
    )
    body += _sentence_rows(
        rows,
        "sentence_embeddings_h100_bert_routes.json",
        "sentence-bert-base",
        backends,
        "BERT-base shape: first pass",
    )
    return table(["", "eager", "reduce-overhead", bold("infinifuse")], body)


def sentence_dynamo(rows: Rows) -> list[str]:
    backends = ["eager", "dynamo", "reduce-overhead", "infinifuse"]
    body = _sentence_rows(
        rows,
        "sentence_embeddings_h100_minilm_dynamo.json",
        "sentence-minilm-l6",
        backends,
        "first pass",
    )
    off = _sentence_rows(rows, "sentence_embeddings_h100_minilm_dynamo_no_cudnn_sdp.json",
                         "sentence-minilm-l6", backends, "without cuDNN's SDPA: first pass",
                         p90_digits=2)  # fmt: skip
    return table(["MiniLM-L6 shape", *backends[:3], bold("infinifuse")], body + off)


def sentence_bert_dynamo(rows: Rows) -> list[str]:
    backends = ["eager", "dynamo", "reduce-overhead", "infinifuse"]
    body = _sentence_rows(
        rows,
        "sentence_embeddings_h100_bert_dynamo.json",
        "sentence-bert-base",
        backends,
        "first pass",
        first_digits=2,
        new_length_rows=True,
    )
    return table(["BERT-base shape", *backends[:3], bold("infinifuse")], body)


def sentence_cudnn_plans(rows: Rows) -> list[str]:
    backends = ["eager", "reduce-overhead", "infinifuse"]
    body = _sentence_rows(
        rows,
        "sentence_embeddings_h100_minilm_cudnn_plans.json",
        "sentence-minilm-l6",
        backends,
        "before (library of 8b74142): first pass",
    )
    body += _sentence_rows(
        rows,
        "sentence_embeddings_h100_minilm_no_cudnn_plans.json",
        "sentence-minilm-l6",
        backends,
        "after (a84ef3b): first pass",
    )
    body += _sentence_rows(
        rows,
        "sentence_embeddings_h100_bert_no_cudnn_plans.json",
        "sentence-bert-base",
        backends,
        "BERT-base shape, after: first pass",
    )
    return table(["MiniLM-L6 shape", "eager", "reduce-overhead", bold("infinifuse")], body)


def sentence_call1_dynamic(rows: Rows) -> list[str]:
    def four(source: str, workload: str, backend: str, strong: str = "") -> str:
        v = [
            rows.get(source, workload, backend, m)
            for m in ("first_pass_s", "second_pass_s", "query_p50_ms", "query_p90_ms")
        ]
        parts = [f"{sig3(v[0])} s", f"{num(v[1], 3)} s", num(v[2], 2), f"{num(v[3], 1)} ms"]
        if strong == "all":
            return bold(" / ".join(parts))
        return " / ".join(bold(p) if i == {"first": 0, "second": 1}.get(strong) else p
                          for i, p in enumerate(parts))  # fmt: skip

    a = ("sentence_embeddings_minilm_h100_call1.json", "sentence-minilm-l6")
    b = ("sentence_embeddings_minilm_h100_dynamic.json", "sentence-minilm-l6")
    c = ("sentence_embeddings_bert_h100_dynamic.json", "sentence-bert-base")
    body = [["A, MiniLM-L6", four(*a, "eager"), four(*a, "reduce-overhead"),
             four(*a, "infinifuse", "all"),
             "call1: " + four(*a, "infinifuse-call1", "second")]]  # fmt: skip
    for label, run in [("B, MiniLM-L6", b), ("C, BERT-base", c)]:
        body.append(
            [
                label,
                four(*run, "eager"),
                four(*run, "reduce-overhead"),
                four(*run, "infinifuse", "all"),
                "dynamic: "
                + four(*run, "infinifuse-dynamic", "first")
                + "; reduce-overhead dynamic: "
                + four(*run, "reduce-overhead-dynamic"),
            ]
        )
    return table(["first pass / second pass / query p50 / p90", "eager", "reduce-overhead",
                  bold("infinifuse"), "variant"], body)  # fmt: skip


ZOO = ["albert", "bert", "bloom", "distilbert", "electra", "falcon", "gemma", "gemma2", "gpt2",
       "gpt_neox", "gptj", "llama", "mistral", "mpnet", "opt", "phi3", "qwen2", "roberta",
       "stablelm", "t5_encoder", "xlm_roberta"]  # fmt: skip


def model_zoo(rows: Rows) -> list[str]:
    body = []
    for family in ZOO:
        w = f"zoo-{family}"
        k_ind, k_inf = (rows.get("suite.json", w, b, "kernels_per_call")
                        for b in ("inductor", "infinifuse"))  # fmt: skip
        ro, inf = (rows.get("suite.json", w, b, "per_call_ms")
                   for b in ("reduce-overhead", "infinifuse"))  # fmt: skip
        r = ratio(inf, ro)
        body.append([family, f"{k_ind} / {k_inf}", ratio(k_inf, k_ind, 1), f"{num(ro, 3)} ms",
                     f"{num(inf, 3)} ms", bold(r) if inf > ro else r])  # fmt: skip
    return table(["family", "kernels per call: Inductor / infinifuse", "ratio",
                  "per call: reduce-overhead", "infinifuse", "ratio"], body)  # fmt: skip


ROW_PATTERNS = [("RMSNorm", "rmsnorm"), ("add + RMSNorm", "add_rmsnorm"),
                ("add + LayerNorm", "add_layernorm"), ("softmax", "softmax"),
                ("SwiGLU", "swiglu"), ("tanh GELU", "gelu_tanh"), ("RoPE", "rope")]  # fmt: skip


def row_kernels(rows: Rows) -> list[str]:
    source = "row_kernels_h100_full_suite.json"
    body = []
    for label, pattern in ROW_PATTERNS:
        line = [label]
        for rows_n in (4096, 1):
            for width in (2048, 4096, 8192):
                w = f"row-{pattern}-{rows_n}x{width}"
                inf, ind = (rows.get(source, w, b, "ms") for b in ("infinifuse", "inductor"))
                line.append(ratio(inf, ind))
        body.append(line)
    return table(["infinifuse / Inductor", "4096 x 2048", "4096 x 4096", "4096 x 8192",
                  "1 x 2048", "1 x 4096", "1 x 8192"], body)  # fmt: skip


VISION_MODELS = ["resnet50", "convnext_tiny", "efficientnet_b0", "mobilenetv3_large_100",
                 "regnety_016", "vit_small_patch16_224", "swin_tiny_patch4_window7_224",
                 "resnet18", "resnext50_32x4d", "repvgg_a2", "ghostnet_100",
                 "levit_128s"]  # fmt: skip


def vision_suite(
    *sources: str, models: list[str] = VISION_MODELS, kernels: bool = True
) -> Callable[[Rows], list[str]]:
    """The table of one whole run of benchmarks/vision.py (``sources``: its result files, one
    per device call): per call and kernels per call of each of ``models`` at batch 1 and 8
    against reduce-overhead (Inductor's kernels), and the geometric means; without
    ``kernels`` (a run with ``--no-kernel-counts``) the first calls take their columns."""

    def render(rows: Rows) -> list[str]:
        body, ratios, firsts = [], [], []
        for model in models:
            line = [model]
            for batch in (1, 8):
                inf, ro = _vision_pair(rows, sources, model, batch, "per_call_ms")
                k_inf, k_ind = (_vision_pair(rows, sources, model, batch, "kernels_per_call")
                                if kernels else (0, 0))  # fmt: skip
                f_inf, f_ro = _vision_pair(rows, sources, model, batch, "first_call_s")
                ratios.append(inf / ro)
                firsts.append(f_inf / f_ro)
                r = ratio(inf, ro)
                third = (f"{k_inf:.0f} / {k_ind:.0f}" if kernels else
                         f"{num(f_inf, 2)} / {num(f_ro, 2)} s ({ratio(f_inf, f_ro)})")  # fmt: skip
                line += [f"{num(inf, 3)} / {num(ro, 3)} ms", bold(r) if inf > ro else r, third]
            body.append(line)
        body.append(["geometric mean (both batches)", "per call", f"{_geomean(ratios):.2f}x",
                     "", "first call", f"{_geomean(firsts):.2f}x", ""])  # fmt: skip
        third = "kernels: infinifuse / Inductor" if kernels else "first call: infinifuse / RO"
        return table(["model", "b1 per call: infinifuse / RO", "ratio", third, "b8 per call",
                      "ratio", "kernels" if kernels else "first call"], body)  # fmt: skip

    return render


def vision_summary(
    *runs: tuple[str, str, tuple[str, ...], list[str]],
) -> Callable[[Rows], list[str]]:
    """One row per run of benchmarks/vision.py (``runs``: its models' label, its commit, its
    result files, its timm names): infinifuse over reduce-overhead per call and at the first
    call, the geometric mean of batch 1 and 8 of every model and the highest row."""

    def render(rows: Rows) -> list[str]:
        body = []
        for label, commit, sources, models in runs:
            cells = []
            for metric in ("per_call_ms", "first_call_s"):
                ratios = {}
                for model in models:
                    for batch in (1, 8):
                        inf, ro = _vision_pair(rows, sources, model, batch, metric)
                        ratios[f"{model} b{batch}"] = inf / ro
                top = max(ratios, key=ratios.get)
                cells.append(f"{_geomean(ratios.values()):.2f}x "
                             f"(highest {ratios[top]:.2f}x: {top})")  # fmt: skip
            body.append([label, commit, *cells])
        header = ["timm models, fp16, H200, batch 1 and 8", "commit",
                  "per call / reduce-overhead", "first call / reduce-overhead"]  # fmt: skip
        return table(header, body)

    return render


def _vision_pair(
    rows: Rows, sources: tuple[str, ...], model: str, batch: int, metric: str
) -> tuple[float, float]:
    """(infinifuse's, reduce-overhead's) ``metric`` for ``model`` at ``batch``, from the
    first of ``sources`` holding the model's infinifuse row (H200)."""
    w = f"vision-{model}-b{batch}"
    source = _holding(rows, sources, w)
    inf, ro = (rows.get(source, w, b, metric, DEVICES["H200"])
               for b in ("infinifuse", "reduce-overhead"))  # fmt: skip
    return inf, ro


def _geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def _holding(rows: Rows, sources: tuple[str, ...], workload: str) -> str:
    """The first of ``sources`` with infinifuse's per-call row of ``workload``."""
    for source in sources:
        try:
            rows.get(source, workload, "infinifuse", "per_call_ms", DEVICES["H200"])
        except KeyError:
            continue
        return source
    raise KeyError(f"no row of {workload} in {', '.join(sources)}")


def _run(rows: Rows, source: str, workload: str, backend: str, metric: str) -> str:
    """Where a headline figure comes from: its row's date and commit, and its source file."""
    row = rows.row(source, workload, backend, metric)
    commit = row["commit"] or "commit not recorded"
    return f"{row['date'][:10]}, {commit}, `{source}`"


def headline(rows: Rows) -> list[str]:
    """The README's short table: a few rows of the latest runs, each with its date, commit and
    source file (docs/PERFORMANCE.md has the rest)."""
    body = []

    def line(label: str, source: str, w: str, base: str, metric: str, unit: str, digits: int,
             against: str) -> None:  # fmt: skip
        b, inf = rows.get(source, w, base, metric), rows.get(source, w, "infinifuse", metric)
        body.append([label, against, f"{num(b, digits)}{unit}", bold(f"{num(inf, digits)}{unit}"),
                     bold(ratio(inf, b)),
                     _run(rows, source, w, "infinifuse", metric)])  # fmt: skip

    gemv = "suite_decode_h100_gemv.json"
    for label, w in DECODERS:
        line(label.replace("decode", "decode step"), gemv, w, "reduce-overhead", "per_call_ms",
             " ms", 3, "reduce-overhead")  # fmt: skip
    line("BERT-base, 8 x 128, encoder call", "suite.json", "bert", "reduce-overhead",
         "per_call_ms", " ms", 3, "reduce-overhead")  # fmt: skip
    line("TinyLlama shape, first decode call (cold caches)", "suite.json", "llama-decode",
         "reduce-overhead", "first_call_s", " s", 1, "reduce-overhead")  # fmt: skip
    for cache in (128, 4096):
        line(f"`generate()`, {cache}-slot StaticCache, tokens/s (higher is better)",
             "generate_h100_gemv.json", f"generate-cache{cache}", "autocompile", "tokens_per_s",
             "", 0, "auto-compile")  # fmt: skip
    line("Llama-3-8B shape, TP=2 on 2 GPUs, decode step",
         "tensor_parallel_llama3-8b_tp2_h100x2_launch_overlap_9bdc3da.json",
         "tp-llama3-8b-tp2-decode", "inductor", "step_ms", " ms", 2, "reduce-overhead")  # fmt: skip
    line("sentence-transformers MiniLM-L6, single query p90",
         "sentence_embeddings_minilm_h100_call1.json", "sentence-minilm-l6", "reduce-overhead",
         "query_p90_ms", " ms", 1, "reduce-overhead")  # fmt: skip
    # the zoo: both backends in one process, rounds in turns (diag_suite_call.py --interleave)
    turns, h200 = "diag_suite_turns_h200_919f9e2.json", DEVICES["H200"]
    ratios = sorted(
        rows.get(turns, f"call-zoo-{f}", "infinifuse", "interleaved_us", h200)
        / rows.get(turns, f"call-zoo-{f}", "reduce-overhead", "interleaved_us", h200)
        for f in ZOO
    )
    slower = sum(r > 1 for r in ratios)
    zoo_run = rows.row(turns, "call-zoo-llama", "infinifuse", "interleaved_us", h200)
    body.append([f"model zoo, {len(ZOO)} families (2 layers, hidden 64), per call, H200, "
                 "timed in turns", "reduce-overhead", "-", "-",
                 f"{ratios[0]:.2f}-{ratios[-1]:.2f}x ({slower} over 1.00x)",
                 f"{zoo_run['date'][:10]}, {zoo_run['commit']}, `{turns}`"])  # fmt: skip
    return table(["workload (H100, fp16, batch 1 unless said)", "against", "its figure",
                  bold("infinifuse"), "ratio", "run: date, commit, ledger source"],
                 body)  # fmt: skip


# Two runs of benchmarks/vision.py --no-kernel-counts, as vision_summary takes them: the
# models' label, the commit, the result files, the timm names
VISION_D92C6AD = (
    "ResNet-50, ResNeXt-50, ResNet-18, ConvNeXt-T, ViT-S/16, EfficientNet-B0, MobileNetV3-L, "
    "GhostNet-100", "d92c6ad",
    ("vision_h200_d92c6ad.json", "vision_h200_d92c6ad_resnets.json",
     "vision_h200_d92c6ad_vit.json"),
    ["resnet50", "resnext50_32x4d", "resnet18", "convnext_tiny", "vit_small_patch16_224",
     "efficientnet_b0", "mobilenetv3_large_100", "ghostnet_100"],
)  # fmt: skip
VISION_BE6FDBB = (
    "RegNetY-016, Swin-T, RepVGG-A2, LeViT-128S, Inception-v3, DenseNet-121", "be6fdbb",
    ("vision_h200_be6fdbb_six.json",),
    ["regnety_016", "swin_tiny_patch4_window7_224", "repvgg_a2", "levit_128s", "inception_v3",
     "densenet121"],
)  # fmt: skip
VISION_DABEFA5 = (
    "all 14 of the suite", "dabefa5",
    ("vision_h200_dabefa5_a.json", "vision_h200_dabefa5_b.json", "vision_h200_dabefa5_c.json"),
    VISION_MODELS + ["inception_v3", "densenet121"],
)  # fmt: skip


def zoo_turns(source: str) -> Callable[[Rows], list[str]]:
    """The zoo's 21 families and GPT-2's one-token forward timed in alternating rounds
    (diag_suite_call.py --interleave, both builds in one process) in ``source``: the median
    round a call, its host time after the graph replay returns, and the ratio."""
    return lambda rows: _zoo_turns(rows, source)


def _zoo_turns(rows: Rows, source: str) -> list[str]:
    body = []
    for workload in [f"zoo-{family}" for family in ZOO] + ["gpt2-token"]:
        w = f"call-{workload}"
        inf, ro = (rows.get(source, w, b, "interleaved_us", DEVICES["H200"])
                   for b in ("infinifuse", "reduce-overhead"))  # fmt: skip
        post_inf, post_ro = (rows.get(source, w, b, "post_replay_us", DEVICES["H200"])
                             for b in ("infinifuse", "reduce-overhead"))  # fmt: skip
        r = ratio(inf, ro)
        body.append(
            [
                workload,
                f"{num(ro, 1)} us",
                f"{num(inf, 1)} us",
                bold(r) if inf > ro else r,
                f"{num(post_ro, 1)} / {num(post_inf, 1)} us",
            ]
        )
    return table(["workload", "per call: reduce-overhead", "infinifuse", "ratio",
                  "after the replay: RO / infinifuse"], body)  # fmt: skip


def vision_turns(sources: tuple[str, ...], models: list[str]) -> Callable[[Rows], list[str]]:
    """Vision models at batch 1 and 8 timed in alternating rounds (diag_vision_host.py
    --interleave, both builds in one process; one file a batch, in ``sources``): the median
    round a call and the ratio."""

    def render(rows: Rows) -> list[str]:
        body = []
        for batch, source in zip((1, 8), sources, strict=True):
            for model in models:
                w = f"vision-host-{model}-b{batch}"
                inf, ro = (rows.get(source, w, b, "interleaved_us", DEVICES["H200"])
                           for b in ("infinifuse", "reduce-overhead"))  # fmt: skip
                r = ratio(inf, ro)
                body.append([model, str(batch), f"{num(ro, 1)} us", f"{num(inf, 1)} us",
                             bold(r) if inf > ro else r])  # fmt: skip
        return table(["model", "batch", "per call: reduce-overhead", "infinifuse", "ratio"], body)

    return render


TABLES: dict[str, Callable[[Rows], list[str]]] = {
    "headline": headline,
    "decode-steps": decode_steps,
    "matmul-groups": matmul_groups,
    "decode-epilogues": decode_epilogues,
    "decode-launch-overlap": decode_launch_overlap,
    "gemv-launches": gemv_launches,
    "decode-gemv": decode_gemv,
    "generate-gemv": generate_gemv,
    "generate-launch-overlap": generate_launch_overlap,
    "model-zoo": model_zoo,
    "tp-first": tp_first,
    "tp-guard-filter": tp_guard_filter,
    "tp-launch-overlap": tp_launch_overlap,
    "tp-step-diag": tp_step_diag,
    "sentence-first": sentence_first,
    "sentence-routes": sentence_routes,
    "sentence-dynamo": sentence_dynamo,
    "sentence-bert-dynamo": sentence_bert_dynamo,
    "sentence-cudnn-plans": sentence_cudnn_plans,
    "sentence-call1-dynamic": sentence_call1_dynamic,
    "row-kernels": row_kernels,
    "vision-suite": vision_suite("vision_h200_1b6e300.json"),
    "vision-suite-c4a113d": vision_suite(
        "vision_h200_c4a113d_a.json", "vision_h200_c4a113d_b.json"
    ),
    "vision-suite-a865516": vision_suite("vision_h200_a865516.json"),
    "vision-suite-d92c6ad": vision_suite(
        *VISION_D92C6AD[2], models=VISION_D92C6AD[3], kernels=False
    ),
    "vision-summary": vision_summary(VISION_DABEFA5),
    "vision-suite-dabefa5": vision_suite(
        *VISION_DABEFA5[2], models=VISION_DABEFA5[3], kernels=False
    ),
    "zoo-turns": zoo_turns("diag_suite_turns_h200_dabefa5.json"),
    "zoo-turns-2e81c0b": zoo_turns("diag_suite_turns_h200_2e81c0b.json"),
    "zoo-turns-919f9e2": zoo_turns("diag_suite_turns_h200_919f9e2.json"),
    "vision-turns-919f9e2": vision_turns(
        ("vision_turns_h200_919f9e2_b1.json", "vision_turns_h200_919f9e2_b8.json"),
        ["inception_v3", "vit_small_patch16_224"],
    ),
    "vision-turns-e56272b": vision_turns(
        ("vision_turns_h200_e56272b_b1.json", "vision_turns_h200_e56272b_b8.json"),
        ["inception_v3", "resnet50"],
    ),
    "vision-turns-2e81c0b": vision_turns(
        ("vision_turns_h200_2e81c0b_b1.json", "vision_turns_h200_2e81c0b_b8.json"),
        [
            "inception_v3",
            "efficientnet_b0",
            "repvgg_a2",
            "vit_small_patch16_224",
            "swin_tiny_patch4_window7_224",
        ],
    ),  # fmt: skip
    "vision-suite-be6fdbb": vision_suite(
        *VISION_BE6FDBB[2], models=VISION_BE6FDBB[3], kernels=False
    ),
}


# ---- the check

BLOCK = re.compile(r"<!-- ledger-table: ([\w-]+) -->\n(.*?)<!-- /ledger-table -->", re.S)
KEYS = re.compile(r"<!-- ledger-keys(?: ([^\s:]+))?:(.*?)-->", re.S)
TERM = re.compile(r"\[([^\]]+)\]")
SHOWN = re.compile(r"^(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?(x|%)?$")
UNITS = r"(?:\s?(?:ms|s|us|GB|MB|MiB|KB|GB/s|TB/s|tokens/s)|x|%)"
NUMBER = r"\d+(?:\.\d+)?"
# a figure: a number with a unit, a range of them, or a number with a decimal point (a version
# such as 2.11.0 or a name such as 8b74142 is none)
FIGURE = re.compile(
    rf"(?<![\w.\-/=+])(?:{NUMBER}(?:\s?(?:-|to)\s?{NUMBER})?{UNITS}|\d+\.\d+)(?![\w.]*\d)(?!\w)"
)
# what precedes a number that is not a measured figure: a version, a target or threshold
VERSION_OR_TARGET = re.compile(
    r"(torch|Triton|transformers|NCCL|Python|H100|target:?|>=|<=|over|under)\s$"
)
CODE = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
RESULT_FILE = re.compile(r"`([\w./*\-]+\.(?:json|txt|md|png|py)|[\w./*\-]+\.\*)`")


def render(text: str, rows: Rows) -> str:
    """text with every ledger table written again from rows."""

    def one(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise KeyError(f"no table named {name!r} in benchmarks/readme_tables.py")
        body = "\n".join(TABLES[name](rows))
        return f"<!-- ledger-table: {name} -->\n\n{body}\n\n<!-- /ledger-table -->"

    return BLOCK.sub(one, text)


def _evaluate(expr: str, rows: Rows, source: str | None) -> float:
    unit = None
    if m := re.search(r"\s+in\s+(s|ms|us)\s*$", expr):
        unit, expr = m.group(1), expr[: m.start()]
    values: dict[str, float] = {}

    def term(match: re.Match) -> str:
        text = match.group(1).strip()
        src = source
        if ":" in text:
            src, text = text.split(":", 1)
        device = H100
        if "@" in text:  # [workload/backend/metric@H200]: a row of another device
            text, short = text.rsplit("@", 1)
            if short not in DEVICES:
                raise ValueError(f"[{match.group(1)}]: device {short!r} not in {sorted(DEVICES)}")
            device = DEVICES[short]
        parts = text.split("/")
        if len(parts) < 3 or not src:
            raise ValueError(f"[{match.group(1)}]: not [file:workload/backend/metric]")
        row = rows.row(src, parts[0], "/".join(parts[1:-1]), parts[-1], device)
        value = row["value"]
        if unit and row["unit"] in TIME_UNITS:
            value = value * TIME_UNITS[row["unit"]] / TIME_UNITS[unit]
        name = f"t{len(values)}"
        values[name] = value
        return name

    tree = ast.parse(TERM.sub(term, expr).strip(), mode="eval")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
            if isinstance(node.op, ast.Div):
                return a / b
            if type(node.op) in ops:
                return ops[type(node.op)]
        raise ValueError(f"{expr!r}: only ledger rows, numbers, + - * / and parentheses")

    return ev(tree)


def _entries(body: str, source: str | None) -> Iterable[tuple[str, str, str | None]]:
    """(shown, expression, source) of a keys comment's entries; 'source FILE' switches."""
    for entry in body.split(";"):
        entry = " ".join(entry.split())
        if not entry:
            continue
        if entry.startswith("source "):
            source = entry.split(None, 1)[1]
            continue
        shown, sep, expr = entry.partition(" = ")
        if not sep:
            raise ValueError(f"{entry!r}: not 'FIGURE = EXPRESSION'")
        yield shown.strip(), expr.strip(), source


def _figure_at(text: str, shown: str, start: int) -> re.Match | None:
    return re.compile(rf"(?<![\w.]){re.escape(shown)}(?![\w%]|\.\d)").search(text, start)


def _region_start(text: str, end: int) -> int:
    """Where the paragraph (or list item) before a keys comment at end starts: after the last
    blank line or comment before it."""
    blank = text.rfind("\n\n", 0, end)
    comment = text.rfind("-->", 0, end)
    return max(blank + 2 if blank >= 0 else 0, comment + 3 if comment >= 0 else 0)


def check_keys(text: str, rows: Rows) -> tuple[list[str], list[tuple[int, int]]]:
    """Faults of the keys comments in text, and the spans of the figures they key."""
    faults: list[str] = []
    spans: list[tuple[int, int]] = []
    for match in KEYS.finditer(text):
        where = f"line {text.count(chr(10), 0, match.start()) + 1}"
        region_start = _region_start(text, match.start())
        pos = region_start
        try:
            entries = list(_entries(match.group(2), match.group(1)))
        except ValueError as error:
            faults.append(f"{where}: {error}")
            continue
        for shown, expr, source in entries:
            parsed = SHOWN.match(shown)
            if not parsed:
                faults.append(f"{where}: {shown!r} is not a figure (1.23, 0.89x, 45%, 1.2-3.4x)")
                continue
            low, high, suffix = parsed.groups()
            exprs = expr.split(" .. ")
            if len(exprs) != (2 if high else 1):
                faults.append(f"{where}: {shown}: a range takes two expressions (A .. B)")
                continue
            try:
                values = [_evaluate(e, rows, source) for e in exprs]
            except (KeyError, ValueError, ZeroDivisionError, SyntaxError) as error:
                faults.append(f"{where}: {shown} = {expr}: {error}")
                continue
            for figure, value in zip([low, high] if high else [low], values):
                value = value * 100 if suffix == "%" else value
                digits = len(figure.split(".")[1]) if "." in figure else 0
                if num(value, digits) != figure:
                    faults.append(f"{where}: {shown} = {expr}: the ledger gives "
                                  f"{num(value, digits)} ({value:.6g})")  # fmt: skip
            found = _figure_at(text[: match.start()], shown, pos)
            if not found:
                faults.append(f"{where}: {shown}, keyed, is not in its paragraph (after the "
                              f"figure keyed before it)")  # fmt: skip
                continue
            spans.append(found.span())
            pos = found.end()
    return faults, spans


def _blank(text: str, pattern: re.Pattern) -> str:
    """text with pattern's matches replaced by spaces (offsets kept)."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _result_exists(name: str) -> bool:
    """A script under benchmarks/, a file under benchmarks/results/ (or a path from the root),
    or a result file removed from results/: a ledger source (its rows folded into the ledger)
    or a retired file (benchmarks/ledger.py: git show FOLDED_AT:benchmarks/results/NAME)."""
    name = name.replace("...", "*")
    if name.endswith(".py"):
        return any(fnmatch.fnmatch(p.name, Path(name).name)
                   for p in (ROOT / "benchmarks").rglob("*.py"))  # fmt: skip
    base = ROOT if "/" in name and not name.startswith("*") else ledger.RESULTS
    if any(base.glob(name if base is ROOT else name.split("/")[-1])):
        return True
    removed = (*ledger.SOURCES, *ledger.RETIRED)
    return any(fnmatch.fnmatch(n, name.split("/")[-1]) for n in removed)


def _is_source(name: str) -> bool:
    """A result under benchmarks/results/ or a benchmark script (not the backend's code)."""
    if name.endswith(".py"):
        return not name.startswith(("fusebackend/", "passes/", "kernels/", "tests/"))
    return not name.startswith(("fusebackend/", "tests/", "docs/"))


def check_sources(text: str, spans: list[tuple[int, int]], start: int = 0,
                  end: int | None = None) -> list[str]:  # fmt: skip
    """Faults of figures in text[start:end] outside tables and keys whose sentence, or an
    earlier sentence of its paragraph, names no result file; and result files that do not
    exist."""
    end = len(text) if end is None else end
    plain = _blank(_blank(text, BLOCK), COMMENT)
    faults = []
    for m in RESULT_FILE.finditer(text, start, end):
        if _is_source(m.group(1)) and not _result_exists(m.group(1)):
            where = f"line {text.count(chr(10), 0, m.start()) + 1}"
            faults.append(f"{where}: `{m.group(1)}` is not in benchmarks/results/ or a script")
    scan = _blank(plain, CODE)
    for m in FIGURE.finditer(scan, start, end):
        if any(a < m.end() and m.start() < b for a, b in spans):
            continue
        line_start = scan.rfind("\n", 0, m.start()) + 1
        line = text[line_start : text.find("\n", m.start())]
        before, after = scan[max(m.start() - 12, 0) : m.start()], scan[m.end() : m.end() + 8]
        if (line.lstrip().startswith("#") or re.search(VERSION_OR_TARGET, before)
                or after.startswith(" target")):  # fmt: skip
            continue  # a heading's date, a version, a target
        if line.lstrip().startswith("|"):
            para_start = _table_intro_start(plain, line_start)
            sentence_end = line_start
        else:
            para_start = _paragraph_start(plain, m.start())
            stop = re.compile(r"\.(\s|$)|\n\n|\n\s*[-*] ").search(plain, m.end())
            sentence_end = stop.start() if stop else len(plain)
        named = [
            n for n in RESULT_FILE.findall(plain[para_start : sentence_end + 1]) if _is_source(n)
        ]
        if not named:
            where = f"line {text.count(chr(10), 0, m.start()) + 1}"
            faults.append(f"{where}: {m.group(0).strip()!r} has no ledger key and its sentence "
                          f"names no result file: {line.strip()[:90]}")  # fmt: skip
    return faults


def _paragraph_start(text: str, pos: int) -> int:
    """The start of the paragraph or list item holding pos."""
    blank = text.rfind("\n\n", 0, pos)
    item = max(text.rfind("\n- ", 0, pos), text.rfind("\n  - ", 0, pos))
    return max(blank + 2 if blank >= 0 else 0, item + 1 if item >= 0 else 0)


def _table_intro_start(text: str, line_start: int) -> int:
    """The start of the paragraph before the table holding the line at line_start."""
    pos = line_start
    while pos > 0 and text[pos:].startswith("|"):
        pos = text.rfind("\n", 0, pos - 1) + 1
    return _paragraph_start(text, max(pos - 2, 0))


def performance_section(text: str) -> tuple[int, int]:
    """The README's performance section."""
    start = text.index("\n## Performance\n")
    return start, text.index("\n## ", start + 1)


def measured_section(text: str) -> tuple[int, int]:
    """docs/PERFORMANCE.md up to its known limits (a list of limits whose figures repeat, in
    words, figures of the sections above: its tables and keys are still checked)."""
    end = text.find("\n## Known limits\n")
    return 0, len(text) if end < 0 else end


def check(text: str, rows: Rows, section: tuple[int, int] | None = None,
          tables_generated: bool = True) -> list[str]:  # fmt: skip
    """Every fault of text: a ledger table that differs from its rendering, a key whose
    figure is not its row's, a figure of section (default: all of text) with neither a key
    nor a result file named where it stands, a table of section outside the markers (where
    tables_generated)."""
    faults = []
    try:
        written = render(text, rows)
    except (KeyError, ValueError) as error:
        return [f"a ledger table cannot be written: {error}"]
    if written != text:
        for (name, got), (_, want) in zip(BLOCK.findall(text), BLOCK.findall(written)):
            if got != want:
                diff = [f"    README: {a}\n    ledger: {b}" for a, b in
                        zip(got.splitlines(), want.splitlines()) if a != b]  # fmt: skip
                diff = diff or ["    (lines added or removed)"]
                faults.append(
                    f"ledger table {name} differs from its rows "
                    f"(python benchmarks/readme_tables.py --write):\n" + "\n".join(diff)
                )
    key_faults, spans = check_keys(text, rows)
    faults += key_faults
    start, end = section or (0, len(text))
    faults += check_sources(text, spans, start, end)
    if tables_generated:
        plain = _blank(text, BLOCK)
        for m in re.finditer(r"^\|.*\|$", plain[start:end], re.M):
            where = f"line {text.count(chr(10), 0, start + m.start()) + 1}"
            faults.append(f"{where}: a table outside <!-- ledger-table --> markers")
            break
    return faults


def check_files(rows: Rows | None = None) -> dict[str, list[str]]:
    """The faults of README.md's performance section, of docs/PERFORMANCE.md and of the
    performance history."""
    rows = rows or load()
    readme = README.read_text()
    return {
        "README.md": check(readme, rows, performance_section(readme)),
        "docs/PERFORMANCE.md": check(
            performance := PERFORMANCE.read_text(), rows, measured_section(performance)
        ),
        "docs/PERFORMANCE_HISTORY.md": check(HISTORY.read_text(), rows, tables_generated=False),
        "docs/GENERATION.md": check(GENERATION.read_text(), rows, (0, 0), tables_generated=False),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the ledger tables of README.md and the docs")  # fmt: skip
    args = parser.parse_args(argv)
    rows = load()
    if args.write:
        for path in (README, PERFORMANCE, HISTORY):
            text = path.read_text()
            if (new := render(text, rows)) != text:
                path.write_text(new)
                print(f"rewrote the ledger tables of {path.relative_to(ROOT)}")
    faults = check_files(rows)
    for name, found in faults.items():
        for fault in found:
            print(f"{name}: {fault}")
    count = sum(map(len, faults.values()))
    print(f"{count} fault(s)" if count else "every figure is tied to its ledger row or its file")
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main())
