"""benchmarks/ledger.py: the results ledger built from result JSONs (a folded one's rows kept)
and appended to. ``benchmarks/run.py --ledger`` is checked by the zoo sweep's run in
tests/test_benchmarks_smoke.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {"device": "NVIDIA Test GPU", "torch": "9.9+cu", "triton": "9.9", "transformers": "9.9",
       "date": "2026-01-01T00:00:00+00:00"}  # fmt: skip


@pytest.fixture(scope="module")
def ledger():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ledger

        yield ledger
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _suite_fixture() -> dict:
    row = {"workload": "gpt2-decode", "date": "2026-01-02T00:00:00+00:00", "status": "ok",
           "per_call_ms": 0.5, "first_call_s": 2.5, "kernels_per_call": 140}  # fmt: skip
    skipped = {"workload": "gpt2-decode", "backend": "inductor", "status": "skipped",
               "per_call_ms": None}  # fmt: skip
    return {"environment": dict(ENV), "rows": [{**row, "backend": "infinifuse"}, skipped,
            {**row, "backend": "eager", "per_call_ms": 7.0, "kernels_per_call": None}]}  # fmt: skip


def test_rebuild_from_a_fixture_gives_sorted_rows(ledger, tmp_path):
    (tmp_path / "suite.json").write_text(json.dumps(_suite_fixture()))
    tp = {"environment": {**ENV, "commit": "abcdef123"},
          "ranks": [{"shape": "tiny", "tp": 2, "rank": 0, "backends": {
              "infinifuse": {"decode": {"step_ms": 3.0, "first_call_s": 9.0}}}},
              {"shape": "tiny", "tp": 2, "rank": 1, "backends": {}}]}  # fmt: skip
    (tmp_path / "tp.json").write_text(json.dumps(tp))
    out = tmp_path / "ledger.jsonl"
    rows = ledger.rebuild(tmp_path, out, sources=("tp.json", "suite.json"))
    assert rows == ledger.read(out)
    got = [(r["workload"], r["backend"], r["metric"], r["value"], r["unit"], r["source"])
           for r in rows]  # fmt: skip
    assert got == [
        ("gpt2-decode", "eager", "first_call_s", 2.5, "s", "suite.json"),
        ("gpt2-decode", "eager", "per_call_ms", 7.0, "ms", "suite.json"),
        ("gpt2-decode", "infinifuse", "first_call_s", 2.5, "s", "suite.json"),
        ("gpt2-decode", "infinifuse", "kernels_per_call", 140, "count", "suite.json"),
        ("gpt2-decode", "infinifuse", "per_call_ms", 0.5, "ms", "suite.json"),
        ("tp-tiny-tp2-decode", "infinifuse", "first_call_s", 9.0, "s", "tp.json"),
        ("tp-tiny-tp2-decode", "infinifuse", "step_ms", 3.0, "ms", "tp.json"),
    ]
    assert list(rows[0]) == list(ledger.FIELDS)
    assert rows[0]["date"] == "2026-01-02T00:00:00+00:00"  # the suite row's own date
    assert rows[-1]["commit"] == "abcdef1" and rows[-1]["device"] == "NVIDIA Test GPU"
    first = out.read_bytes()
    ledger.rebuild(tmp_path, out, sources=("suite.json", "tp.json"))
    assert out.read_bytes() == first  # deterministic, whatever the order of the sources
    lines = ledger.table(rows, ["tp-*"])
    assert len(lines) == 3 and lines[1].startswith("tp-tiny-tp2-decode")


def test_the_committed_ledger_is_the_rebuild_of_the_cited_files(ledger, tmp_path):
    out = tmp_path / "ledger.jsonl"
    ledger.rebuild(ledger.RESULTS, out)
    assert out.read_bytes() == ledger.LEDGER.read_bytes(), (
        "run: python benchmarks/ledger.py --rebuild"
    )


def test_a_folded_source_keeps_its_rows_and_a_missing_one_fails(ledger, tmp_path):
    # A source whose file left benchmarks/results/ is folded: the ledger is its only copy and
    # a rebuild keeps its rows as they are; a source in neither place is an error.
    (tmp_path / "suite.json").write_text(json.dumps(_suite_fixture()))
    out = tmp_path / "ledger.jsonl"
    first = ledger.rebuild(tmp_path, out, sources=("suite.json",))
    (tmp_path / "suite.json").unlink()
    assert ledger.rebuild(tmp_path, out, sources=("suite.json",)) == first
    with pytest.raises(FileNotFoundError, match="gone.json"):
        ledger.rebuild(tmp_path, out, sources=("suite.json", "gone.json"))


def test_results_hold_the_ledger_and_cited_files_only(ledger):
    # issue 37: at most 40 files, each the ledger or a file the README, the docs, the code or
    # the tests name; none named after a session; a retired or folded name is not there.
    import re

    names = sorted(p.name for p in ledger.RESULTS.iterdir())
    assert len(names) <= 40, len(names)
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("fusebackend", "benchmarks", "tests"):
        texts += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh")]
    cited = "\n".join(p.read_text() for p in texts)
    assert [n for n in names if n != "ledger.jsonl" and n not in cited] == []
    assert [n for n in names if re.search(r"session_?\d", n, re.I)] == []
    assert set(ledger.RETIRED).isdisjoint(names) and len(set(ledger.RETIRED)) == len(ledger.RETIRED)


def test_append_fills_the_environment_fields(ledger, tmp_path):
    path = tmp_path / "sub" / "ledger.jsonl"
    row = {"workload": "w", "backend": "infinifuse", "metric": "per_call_ms", "value": 1.0,
           "unit": "ms", "source": "x.json"}  # fmt: skip
    ledger.append([row], path)
    ledger.append([{**row, "device": "given", "value": 2.0}], path)
    rows = ledger.read(path)
    assert [r["value"] for r in rows] == [1.0, 2.0]
    for r in rows:
        assert list(r) == list(ledger.FIELDS)
        assert r["torch"] == torch.__version__ and r["date"], r
        assert r["commit"] == ledger._git_commit()  # None outside a git checkout
    assert rows[0]["device"] == ledger.environment()["device"]
    assert rows[1]["device"] == "given"


def test_a_suite_call_build_is_numbered_within_its_workload(ledger):
    # diag_suite_call.py: a backend built twice for one workload is "<backend>#2"; the same
    # backend in the next workload (--workload zoo) is that workload's first build
    rows = [{"workload": w, "backend": b, "interleaved_us": 100.0}
            for w, b in (("zoo-a", "infinifuse"), ("zoo-a", "reduce-overhead"),
                         ("zoo-a", "infinifuse"), ("zoo-b", "infinifuse"),
                         ("zoo-b", "reduce-overhead"))]  # fmt: skip
    out = ledger.rows_of({"benchmark": "diag_suite_call", "environment": dict(ENV),
                          "rows": rows}, "x.json")  # fmt: skip
    assert [(r["workload"], r["backend"]) for r in out] == [
        ("call-zoo-a", "infinifuse"), ("call-zoo-a", "reduce-overhead"),
        ("call-zoo-a", "infinifuse#2"), ("call-zoo-b", "infinifuse"),
        ("call-zoo-b", "reduce-overhead")]  # fmt: skip
    assert {r["metric"] for r in out} == {"interleaved_us"}


def test_a_vision_host_row_is_named_as_the_hand_written_ones(ledger):
    # diag_vision_host.py's JSON: the workload, backend and metric names its rows had when
    # they were written by hand (vision-host-<model>-b<batch>), a missing figure left out
    record = {"model": "resnet18", "batch": 8, "backend": "infinifuse", "host_us": 1.0,
              "alone_us": 2.0, "loop_us": 3.0, "refresh_us": None, "kernels": 40,
              "interleaved_us": 4.0, "interleaved_rounds_us": [4.0, 4.1]}  # fmt: skip
    out = ledger.rows_of({"benchmark": "diag_vision_host", "environment": dict(ENV),
                          "rows": [record]}, "x.json")  # fmt: skip
    assert {r["workload"] for r in out} == {"vision-host-resnet18-b8"}
    assert {(r["metric"], r["value"], r["unit"]) for r in out} == {
        ("host_us", 1.0, "us"), ("alone_us", 2.0, "us"), ("loop_us", 3.0, "us"),
        ("kernels", 40, "count"), ("interleaved_us", 4.0, "us")}  # fmt: skip


def test_a_launch_after_replay_row_is_named_by_graph_size_or_zoo_family(ledger):
    # diag_launch_after_replay.py's JSON: one workload per graph size or zoo family, one
    # metric per timed step, the outputs' count left out
    rows = [{"kernels": 20, "replay": 3.3, "replay+clone": 13.2},
            {"zoo": "bert", "replay": 9.4, "copy_out": 19.5, "outputs": 2}]  # fmt: skip
    out = ledger.rows_of({"benchmark": "diag_launch_after_replay", "environment": dict(ENV),
                          "rows": rows}, "x.json")  # fmt: skip
    assert {(r["workload"], r["metric"], r["value"], r["unit"]) for r in out} == {
        ("launch-after-replay-20-kernels", "replay", 3.3, "us"),
        ("launch-after-replay-20-kernels", "replay+clone", 13.2, "us"),
        ("launch-after-replay-zoo-bert", "replay", 9.4, "us"),
        ("launch-after-replay-zoo-bert", "copy_out", 19.5, "us")}  # fmt: skip


@pytest.fixture(scope="module")
def tables(ledger):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables

        yield readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_every_readme_and_docs_figure_is_tied_to_its_row_or_its_file(tables):
    # Each performance table is written from its ledger rows (workload, backend, metric,
    # device, source file) and each figure of the text is keyed to its row or names its file.
    faults = tables.check_files()
    assert faults == {"README.md": [], "docs/PERFORMANCE.md": [],
                      "docs/PERFORMANCE_HISTORY.md": [], "docs/GENERATION.md": []}, "\n".join(
        f"{name}: {fault}" for name, found in faults.items() for fault in found
    )  # fmt: skip


# The edits of issue 39 (and a few more), each applied alone to docs/PERFORMANCE.md (the
# README's performance section until issue 37 moved it) in memory: the check must fail on
# every one. (old, new) replace one occurrence in the checked part of the doc.
PERFORMANCE_EDITS = {
    "swap TinyLlama's reduce-overhead and infinifuse cells": (
        "| TinyLlama shape, 22 layers, decode | 1.964 ms | **1.744 ms** |",
        "| TinyLlama shape, 22 layers, decode | 1.744 ms | **1.964 ms** |",
    ),
    "a figure replaced by another row's (the re-run's TinyLlama step)": (
        "| 1.964 ms | **1.744 ms** |",
        "| 1.964 ms | **1.698 ms** |",
    ),
    "a ratio": ("| **1.744 ms** | **0.89x** |", "| **1.744 ms** | **0.88x** |"),
    "a first-call time": ("4.5 / 28.3 / **7.0 s**", "4.5 / 28.3 / **6.9 s**"),
    "a kernel count in a table": ("| 423 / **344** |", "| 423 / **343** |"),
    "a kernel count in the text": ("Of the 146 kernels", "Of the 145 kernels"),
    "a microsecond figure in a table": (
        "| 5.8 us | 4.4 us | **4.8 us** |",
        "| 5.8 us | 4.4 us | **4.9 us** |",
    ),  # fmt: skip
    "a microsecond figure in the text": (
        "TinyLlama q/k/v 8.0 against 31.6 us",
        "TinyLlama q/k/v 8.1 against 31.6 us",
    ),  # fmt: skip
    "a sentence pass time in a table": ("**11.3 s / 0.920 s /", "**11.3 s / 0.902 s /"),
    "a sentence pass time in the text": (
        "replays only: 0.524 against 0.920 s",
        "replays only: 0.524 against 0.902 s",
    ),  # fmt: skip
    "a p50": ("| 7.40 / 68.3 ms |", "| 7.04 / 68.3 ms |"),
    "a tensor-parallel figure (the old 10.49 of a 10.4846 ms row)": (
        "| 10.48 ms |",
        "| 10.49 ms |",
    ),  # fmt: skip
    "a tensor-parallel step": ("| 4.76 ms | **3.38 ms** |", "| 4.76 ms | **3.28 ms** |"),
    "a tensor-parallel diag cell": ("| 2.06 / 2.05 ms |", "| 2.05 / 2.06 ms |"),
    "two figures of the text swapped": (
        "TinyLlama 0.543x reduce-overhead's, Qwen2-0.5B 0.553x",
        "TinyLlama 0.553x reduce-overhead's, Qwen2-0.5B 0.543x",
    ),
    "a figure of the text with neither a key nor a file": (
        "Kernels per call: CUDA launches",
        "A step took 1.23 ms. Kernels per call: CUDA launches",
    ),
    "a result file that does not exist": (
        "8bcdfe7, `suite_decode_h100_gemv_run2.json`",
        "8bcdfe7, `suite_decode_h100_gemv_run9.json`",
    ),  # fmt: skip
}


@pytest.mark.parametrize("edit", list(PERFORMANCE_EDITS))
def test_the_ledger_check_fails_on_each_performance_doc_edit(tables, edit):
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    start, end = tables.measured_section(text)
    rows = tables.load()
    assert tables.check(text, rows, (start, end)) == []
    old, new = PERFORMANCE_EDITS[edit]
    section = text[start:end]
    assert section.count(old) == 1, f"{edit}: {old!r} is not once in the checked part"
    edited = text[:start] + section.replace(old, new) + text[end:]
    faults = tables.check(edited, rows, tables.measured_section(edited))
    assert faults, f"the check passed docs/PERFORMANCE.md with {edit}"


# The README keeps a few headline rows, written from the ledger like the doc's tables.
README_EDITS = {
    "a headline figure": ("| **1.051 ms** |", "| **1.015 ms** |"),
    "a headline ratio": ("| **0.54x** |", "| **0.45x** |"),
    "a headline run's commit": (
        "**0.55x** | 2026-11-26, 6fdca0c,",
        "**0.55x** | 2026-11-26, 6fdca0d,",
    ),  # fmt: skip
    "a figure in the README's prose with neither a key nor a file": (
        "The full record: [docs/PERFORMANCE.md]",
        "A step took 1.05 ms. The full record: [docs/PERFORMANCE.md]",
    ),
}


@pytest.mark.parametrize("edit", list(README_EDITS))
def test_the_ledger_check_fails_on_each_readme_edit(tables, edit):
    text = (ROOT / "README.md").read_text()
    rows = tables.load()
    assert tables.check(text, rows, tables.performance_section(text)) == []
    old, new = README_EDITS[edit]
    start, end = tables.performance_section(text)
    assert text[start:end].count(old) == 1, f"{edit}: {old!r} is not once in the section"
    edited = text[:start] + text[start:end].replace(old, new) + text[end:]
    assert tables.check(edited, rows, tables.performance_section(edited)), edit


def test_a_history_figure_swapped_fails(tables):
    text = (ROOT / "docs" / "PERFORMANCE_HISTORY.md").read_text()
    rows = tables.load()
    old, new = "per call 1.698 / 0.492 / 0.909 ms", "per call 0.492 / 1.698 / 0.909 ms"
    assert text.count(old) == 1
    assert tables.check(text.replace(old, new), rows, tables_generated=False)


def test_a_keyed_figure_must_render_from_its_row(tables):
    rows = tables.Rows([{"source": "suite.json", "workload": "w", "backend": b, "metric": "ms",
                         "value": v, "unit": "ms", "device": tables.H100}
                        for b, v in (("a", 1.2346), ("b", 2.0))])  # fmt: skip
    text = "A took 1.235 ms against 2.0 (0.62x, `suite.json`).\n<!-- ledger-keys suite.json:\n"
    keys = "1.235 = [w/a/ms]; 2.0 = [w/b/ms]; 0.62x = [w/a/ms] / [w/b/ms] -->\n"
    assert tables.check(text + keys, rows) == []
    assert tables.check(text.replace("1.235", "1.234") + keys, rows)  # another value
    assert tables.check(text + keys.replace("0.62x", "0.61x"), rows)  # a wrong key
    assert tables.check(text + keys.replace("[w/b/ms]", "[w/c/ms]"), rows)  # no such row
    assert tables.check(text + keys.replace("1.235 = [w/a/ms]", "1.235 = [w/a/ms] in us"), rows)


def test_the_suite_report_shows_the_ledger_figure_before(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from suite import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    row = {"workload": "gpt2-decode", "backend": "infinifuse", "metric": "per_call_ms",
           "value": 0.6, "unit": "ms", "device": ENV["device"], "date": "2025-12-31",
           "source": "old.json"}  # fmt: skip
    later = {**row, "value": 0.1, "date": "2026-01-05", "source": "later.json"}
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(later) + "\n")
    lines = report._ledger_section(_suite_fixture(), path)
    assert "| gpt2-decode | infinifuse | 0.5 | 0.6 | 0.83x | old.json, 2025-12-31 |" in lines
    assert not any("later.json" in line for line in lines)  # after this run started
