"""benchmarks/ledger.py: the results ledger built from result JSONs, appended to, and written by
``benchmarks/run.py --ledger`` (one quick zoo row in a subprocess, ~15 s on two CPU cores)."""

from __future__ import annotations

import json
import os
import subprocess
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


def test_run_py_ledger_flag_appends_rows(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    path = tmp_path / "ledger.jsonl"
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out-dir", str(tmp_path),
               "--quick", "--only", "zoo-llama", "--backends", "eager,infinifuse",
               "--ledger", str(path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["workload"], r["backend"]) for r in rows} == {
        ("zoo-llama", "eager"),
        ("zoo-llama", "infinifuse"),
    }
    metrics = {r["metric"] for r in rows if r["backend"] == "infinifuse"}
    assert {"per_call_ms", "first_call_s"} <= metrics
    for r in rows:
        assert r["source"] == "suite.json" and r["torch"] and r["device"] and r["date"], r


def _section(text: str, title: str) -> str:
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end]


@pytest.mark.parametrize(
    "title", ["Decode steps and an encoder", "Matmul groups", "sentence-transformers"]
)
def test_the_readme_performance_tables_read_the_ledger(ledger, title):
    # Every "N.NNN ms" of these README tables is a ledger figure, at the digits shown: the
    # tables are written from the committed result files, not by hand from memory.
    import re

    text = _section((ROOT / "README.md").read_text(), title)
    table = [line for line in text.splitlines() if line.startswith("|")]
    shown = [m for line in table for m in re.findall(r"(\d+\.\d+) ms", line)]
    assert len(shown) >= 8, shown
    values = [r["value"] for r in ledger.read() if r["unit"] == "ms"]
    missing = [
        s for s in shown
        if not any(round(v, len(s.split(".")[1])) == float(s) for v in values)
    ]  # fmt: skip
    assert not missing, f"README figures that are no ledger row: {missing}"


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
