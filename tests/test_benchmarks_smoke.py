"""The benchmark suite's model-zoo sweep, kernel counts, zoo and generate targets, their
suite.md sections, and its ledger rows. One test runs ``benchmarks/run.py --quick --only
zoo-... --ledger`` for two families in a subprocess (~60 s on two CPU cores: run.py sets
process-wide state); the others feed
hand-made rows to the report code, as a GPU run would produce them. No test asserts a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The keys every zoo row of a backend that ran carries, and those of infinifuse's rows.
ZOO_KEYS = ("per_call_ms", "first_call_s", "rel_error", "tolerance", "error_ok", "mode",
            "kernels_per_call", "copies_per_call", "kernels_source")  # fmt: skip
INFINIFUSE_KEYS = ("all_captured", "signatures", "eager_signatures", "fused_groups", "graphs",
                   "kernels_modes", "stats")  # fmt: skip


def _assert_ledger_rows(path: Path, cuda: bool) -> None:
    """run.py's ``--ledger`` rows: one set per backend that ran, each with its source,
    versions, date and the ``--commit`` given (the device's copy of the checkout has no git)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ran = (
        ("eager", "inductor", "reduce-overhead", "infinifuse") if cuda else ("eager", "infinifuse")
    )
    assert {(r["workload"], r["backend"]) for r in rows} == {
        (f"zoo-{family}", backend) for family in ("llama", "bert") for backend in ran
    }
    metrics = {r["metric"] for r in rows if r["backend"] == "infinifuse"}
    assert {"per_call_ms", "first_call_s"} <= metrics
    for r in rows:
        assert r["source"] == "suite.json" and r["torch"] and r["device"] and r["date"], r
        assert r["commit"] == "abc1234", r


@pytest.fixture(scope="module")
def suite_modules():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from suite import measure, report

        yield measure, report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_zoo_sweep_quick_writes_rows_with_counts_and_captures(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ)
    cuda = torch.cuda.is_available()
    if not cuda:
        env["TRITON_INTERPRET"] = "1"
    ledger = tmp_path / "ledger.jsonl"  # (run.py's --ledger flag, checked here too)
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out-dir", str(tmp_path),
               "--quick", "--ledger", str(ledger), "--commit", "abc1234",
               "--only", "zoo-llama,zoo-bert"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "suite.json").read_text())
    _assert_ledger_rows(ledger, cuda)

    rows = {(r["workload"], r["backend"]): r for r in report["rows"]}
    backends = ("eager", "inductor", "reduce-overhead", "infinifuse")  # the zoo's four
    assert set(rows) == {(f"zoo-{f}", b) for f in ("llama", "bert") for b in backends}
    for (_, backend), row in rows.items():
        if backend in ("inductor", "reduce-overhead") and not cuda:
            assert row["status"] == "skipped" and row["error"] == "no CUDA", row
            continue
        assert row["status"] == "ok", row
        missing = [k for k in ZOO_KEYS if k not in row]
        assert not missing, (missing, row)
        assert row["error_ok"], row
        if cuda:
            assert row["kernels_per_call"] > 0, row
        else:  # the counting path ran; there is no CUDA kernel to count
            assert row["kernels_per_call"] is None and row["kernels_source"] == "no CUDA device"
        if backend == "infinifuse":
            missing = [k for k in INFINIFUSE_KEYS if k not in row]
            assert not missing, (missing, row)
            assert row["fused_groups"] >= 1 and row["graphs"] >= 1, row  # norms fuse
            assert row["signatures"] >= 1 and row["eager_signatures"] == 0, row
            assert row["all_captured"] is (True if cuda else None), row
            # The counting compile ran without CUDA graphs and fused too.
            assert row["kernels_modes"] == ["fusion"], row
    if cuda:
        reduce_overhead = rows["zoo-llama", "reduce-overhead"]
        assert (
            reduce_overhead["kernels_per_call"] == rows["zoo-llama", "inductor"]["kernels_per_call"]
        )

    targets = {t["name"]: t for t in report["targets"]}
    captured = targets["zoo: every infinifuse signature captured, families not (issue 9)"]
    if cuda:
        assert captured["status"] in ("met", "missed") and captured["value"] is not None
    else:
        assert captured["status"] == "not measured", captured
        assert "no CUDA" in captured["note"], captured
    markdown = (tmp_path / "suite.md").read_text()
    assert "## Model zoo" in markdown
    assert "| llama |" in markdown and "| bert |" in markdown
    assert "## Rows" not in markdown  # zoo rows have their own table only

    first_part = tmp_path / "first" / "suite.json"
    first_part.parent.mkdir()
    shutil.copy(tmp_path / "suite.json", first_part)

    # A second part merged in (as a suite split over device calls is: gpu_check.sh's
    # SUITE_FROM): its rows replace those it redid, the others stay, and both runs are named.
    merged = [*command[:-1], "zoo-bert", "--backends", "eager", "--merge"]
    done = subprocess.run(merged, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    second = json.loads((tmp_path / "suite.json").read_text())
    assert {(r["workload"], r["backend"]) for r in second["rows"]} == set(rows)
    assert [part["argv"][-2:] for part in second["parts"]] == [
        ["--only", "zoo-llama,zoo-bert"],
        ["eager", "--merge"],
    ]
    assert "Merged from 2 runs" in (tmp_path / "suite.md").read_text()

    # --combine joins parts run apart, running nothing: the later part's rows replace the
    # earlier part's of the same (workload, backend), the others stay, every run is listed.
    redone = [r for r in second["rows"] if r["backend"] == "eager" and r["workload"] == "zoo-bert"]
    second_part = tmp_path / "second.json"
    second_part.write_text(json.dumps({**second, "parts": second["parts"][1:], "rows": redone}))
    combined_dir = tmp_path / "combined"
    joined = [*command[:3], str(combined_dir), "--combine", str(first_part), str(second_part)]
    done = subprocess.run(joined, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    combined = json.loads((combined_dir / "suite.json").read_text())
    assert sorted(map(json.dumps, combined["rows"])) == sorted(map(json.dumps, second["rows"]))
    assert len(combined["parts"]) == 2 and combined["targets"]
    assert "Merged from 2 runs" in (combined_dir / "suite.md").read_text()


def _row(workload, backend, status="ok", **metrics):
    return {"workload": workload, "backend": backend, "status": status, "rel_error": 0.0,
            "tolerance": 1e-2, "error_ok": True, "per_call_ms": 1.0, "first_call_s": 1.0,
            **metrics}  # fmt: skip


def test_reduce_overhead_borrows_inductors_kernel_count(suite_modules):
    measure, _ = suite_modules
    rows = [
        _row(
            "bert",
            "inductor",
            kernels_per_call=193,
            copies_per_call=2,
            kernels_source="own call, no CUDA graphs",
        ),  # fmt: skip
        _row("bert", "reduce-overhead"),
        _row("chain-decode", "inductor"),  # a workload that counts nothing
        _row("chain-decode", "reduce-overhead"),
    ]
    measure.borrow_kernel_counts(rows)
    assert rows[1]["kernels_per_call"] == 193 and rows[1]["copies_per_call"] == 2
    assert "Inductor's default mode" in rows[1]["kernels_source"]
    assert "kernels_per_call" not in rows[3]


def test_decode_weight_bytes_leaves_out_gathered_tables_and_counts_a_tied_head_once(
    suite_modules,
):
    transformers = pytest.importorskip("transformers")
    from suite import workloads  # loaded with measure

    def build(config):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    def all_bytes(model):  # every parameter once (parameters() skips shared ones)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    widths = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    # Llama, head not tied: the embedding table (100 x 64 fp32) is only gathered
    untied = build(transformers.LlamaConfig(**widths, tie_word_embeddings=False))
    assert workloads.decode_weight_bytes(untied) == all_bytes(untied) - 100 * 64 * 4
    # tied (Qwen2-0.5B's case): the head reads the whole table, counted once
    tied = build(transformers.LlamaConfig(**widths, tie_word_embeddings=True))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert workloads.decode_weight_bytes(tied) == all_bytes(tied)
    assert all_bytes(tied) == all_bytes(untied) - 100 * 64 * 4
    # GPT-2: wte tied to the head counted once, wpe (positions, 32 x 64) gathered only
    gpt2_config = transformers.GPT2Config(
        n_embd=64, n_layer=1, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    gpt2 = build(gpt2_config)
    assert workloads.decode_weight_bytes(gpt2) == all_bytes(gpt2) - 32 * 64 * 4
    # half precision: 2 bytes a parameter
    assert workloads.decode_weight_bytes(gpt2.half()) == (all_bytes(gpt2) - 32 * 64 * 2)

    class SharedStorage(torch.nn.Module):  # a head tied by memory, not by Parameter
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(10, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = torch.nn.Parameter(self.table.weight.data)

        def get_output_embeddings(self):
            return self.head

    assert workloads.decode_weight_bytes(SharedStorage()) == (40 + 4 + 4) * 4


def test_floor_fields_and_the_floor_target(suite_modules):
    measure, report = suite_modules
    # TinyLlama's shape: 2.069 GB of weights a step (all but the 32000 x 2048 embedding, fp16)
    # at 3000 GB/s of copy (read + write) -> 0.6897 ms; per call 1.3 ms -> 0.53 of the floor
    fields = measure.floor_fields(2_069_024_768, 3000.0, 1.3)
    assert fields["weight_bytes"] == 2_069_024_768 and fields["copy_gbs"] == 3000.0
    assert fields["floor_ms"] == pytest.approx(2_069_024_768 / 3e12 * 1e3)
    assert fields["floor_fraction"] == pytest.approx(fields["floor_ms"] / 1.3)
    # no CUDA (no copy bandwidth) or a row that did not run (no per call): no floor
    assert measure.floor_fields(2_069_024_768, None, 1.3) == {
        "weight_bytes": 2_069_024_768, "copy_gbs": None, "floor_ms": None,
        "floor_fraction": None}  # fmt: skip
    assert measure.floor_fields(100, 1.0, None)["floor_fraction"] is None
    assert measure.copy_bandwidth(torch.device("cpu")) is None

    name = "TinyLlama-shape decode: fraction of the weight-streaming floor"

    def target(*rows):
        found = {t["name"]: t for t in report.compute_targets(list(rows))}
        return found[name]

    slow = _row("llama-decode", "infinifuse", per_call_ms=1.3, **fields)
    missed = target(slow)
    assert missed["status"] == "missed" and missed["value"] == pytest.approx(0.5306, abs=1e-4)
    assert missed["direction"] == "at least" and missed["limit"] == 0.55
    assert "2.07 GB at 3000 GB/s" in missed["note"], missed
    fast = _row("llama-decode", "infinifuse", per_call_ms=1.2,
                **measure.floor_fields(2_069_024_768, 3000.0, 1.2))  # fmt: skip
    assert target(fast)["status"] == "met"  # 0.575
    cpu = _row("llama-decode", "infinifuse", **measure.floor_fields(2_069_024_768, None, 1.0))
    assert target(cpu)["status"] == "not measured" and "no CUDA" in target(cpu)["note"]
    failed = _row("llama-decode", "infinifuse", status="error")
    assert target(failed)["status"] == "missed"
    assert target()["status"] == "not measured"
    # every other target is "at most" its limit
    targets = report.compute_targets([slow])
    assert {t["direction"] for t in targets if t["name"] != name} == {"at most"}

    environment = {"device": "test", "torch": "-", "triton": "-", "transformers": "-",
                   "date": "-", "quick": False}  # fmt: skip
    markdown = report.markdown({"environment": environment, "rows": [slow],
                                "targets": targets})  # fmt: skip
    assert f"| {name} | 0.531 | >= 0.55 | **missed** |" in markdown, markdown
    assert "| kernels per call | of floor |" in markdown
    assert markdown.split("| llama-decode |")[1].splitlines()[0].endswith("| - | 0.531 |")


def test_zoo_and_four_model_targets_and_tables(suite_modules):
    _, report = suite_modules
    rows = [
        # zoo-llama: fewer kernels than Inductor, captured, slower than reduce-overhead.
        _row("zoo-llama", "eager", kernels_per_call=90, per_call_ms=0.9),
        _row("zoo-llama", "inductor", kernels_per_call=40, per_call_ms=0.5),
        _row("zoo-llama", "reduce-overhead", kernels_per_call=40, per_call_ms=0.10),
        _row(
            "zoo-llama",
            "infinifuse",
            kernels_per_call=30,
            per_call_ms=0.12,
            all_captured=True,
            fused_groups=13,
            graphs=1,
            mode="fusion",
        ),  # fmt: skip
        # zoo-bert: not captured, more kernels than Inductor.
        _row("zoo-bert", "inductor", kernels_per_call=20, per_call_ms=0.5),
        _row("zoo-bert", "reduce-overhead", kernels_per_call=20, per_call_ms=0.10),
        _row(
            "zoo-bert",
            "infinifuse",
            kernels_per_call=25,
            per_call_ms=0.08,
            all_captured=False,
            fused_groups=5,
            graphs=2,
            mode="eager,fusion",
        ),  # fmt: skip
        # The four models' table: BERT-base with fewer kernels, but slower per call.
        _row("bert", "eager", kernels_per_call=166),
        _row("bert", "inductor", kernels_per_call=193),
        _row("bert", "reduce-overhead", per_call_ms=1.14),
        _row("bert", "infinifuse", per_call_ms=1.87, kernels_per_call=150),
        # No CUDA: counts are None; the target says why.
        _row("gpt2-decode", "inductor", kernels_per_call=None, kernels_source="no CUDA device"),
        _row("gpt2-decode", "infinifuse", kernels_per_call=None, kernels_source="no CUDA device"),
    ]
    targets = {t["name"]: t for t in report.compute_targets(rows)}
    captured = targets["zoo: every infinifuse signature captured, families not (issue 9)"]
    assert captured["status"] == "missed" and captured["value"] == 1
    assert "bert" in captured["note"] and "llama" not in captured["note"]
    kernels = targets["zoo, kernels per call without graphs: infinifuse / Inductor (worst family)"]
    assert kernels["status"] == "missed" and kernels["value"] == pytest.approx(25 / 20)
    per_call = targets["zoo, per call with graphs: infinifuse / reduce-overhead (worst family)"]
    assert per_call["status"] == "missed" and per_call["value"] == pytest.approx(1.2)
    assert "worst llama" in per_call["note"]
    bert = "BERT-base 8 x 128"
    bert_kernels = targets[f"{bert}, kernels per call without graphs: infinifuse / Inductor"]
    assert bert_kernels["status"] == "met" and bert_kernels["value"] == pytest.approx(150 / 193)
    bert_call = targets[f"{bert}, per call with graphs: infinifuse / reduce-overhead"]
    assert bert_call["status"] == "missed" and bert_call["value"] == pytest.approx(1.87 / 1.14)
    gpt2 = targets["GPT-2 decode, kernels per call without graphs: infinifuse / Inductor"]
    assert gpt2["status"] == "not measured" and gpt2["note"] == "no CUDA device"
    assert list(targets)[-1].startswith("every row's rel error")

    environment = {"device": "test", "torch": "-", "triton": "-", "transformers": "-",
                   "date": "-", "quick": False}  # fmt: skip
    markdown = report.markdown({"environment": environment, "rows": rows,
                                "targets": list(targets.values())})  # fmt: skip
    assert "| BERT-base 8 x 128 | 1.87 / 1.14 (1.64x) | 150 / 193 / 166 |" in markdown
    zoo = markdown.split("## Model zoo")[1]
    assert "| bert | 25 / 20 / - | **no** | 5 | 2 |" in zoo, zoo
    assert "| llama | 30 / 40 / 90 | yes | 13 | 1 |" in zoo, zoo
    assert "| zoo-llama |" not in markdown  # zoo rows stay out of the main table


def test_generate_summary_becomes_targets_and_a_section(suite_modules):
    _, report = suite_modules
    run = {"first_generate_s": 4.0, "tokens_per_s": 200.0, "tokens_equal_eager": 64,
           "tokens_total": 64}  # fmt: skip
    generate = {
        "workload": "generate",
        "description": "generate()",
        "status": "ok",
        "json": "generate.json",
        "model": "TinyLlama-shaped Llama, 22 layers",
        "prompt_tokens": 16,
        "new_tokens": 64,
        "runs": [
            {
                **run,
                "variant": "infinifuse",
                "cache_len": 128,
                "modes": {"k": "fusion"},
                "fallback_reasons": {"k2": "fusion -> eager: capture failed"},
            },  # fmt: skip
            {**run, "variant": "autocompile", "cache_len": 128, "tokens_per_s": 250.0},
            {"variant": "eager", "cache_len": 128, "error": "Traceback\nRuntimeError: boom"},
        ],
        "summary": {
            "tokens_per_s_ratio_128": 0.8,
            "tokens_per_s_ratio_4096": 1.25,
            "cache_growth_fall": {"infinifuse": 1.3, "autocompile": 1.1},
            "cache_growth_fall_ratio": 1.3 / 1.1,
            "lines": ["cache 128: tokens/s 200 vs 250 (0.80x)"],
        },
    }
    targets = {t["name"]: t for t in report.compute_targets([], generate)}
    speed = targets["generate: time per token, infinifuse / auto-compile (worst cache length)"]
    assert speed["status"] == "missed" and speed["value"] == pytest.approx(1.25)
    assert "cache 128" in speed["note"]
    fall = targets["generate: tokens/s fall shortest -> longest cache, infinifuse / auto-compile"]
    assert fall["status"] == "missed" and fall["value"] == pytest.approx(1.3 / 1.1)
    absent = {t["name"]: t for t in report.compute_targets([], None)}
    assert absent[speed["name"]]["status"] == "not measured"
    assert absent[speed["name"]]["note"] == "generate not in this run"

    environment = {"device": "test", "torch": "-", "triton": "-", "transformers": "-",
                   "date": "-", "quick": False}  # fmt: skip
    markdown = report.markdown({"environment": environment, "rows": [], "generate": generate,
                                "targets": list(targets.values())})  # fmt: skip
    section = markdown.split("## generate(): TinyLlama-shaped Llama, 22 layers")[1]
    assert "| infinifuse | 128 | 4 | 200 | 64/64 | fusion |" in section, section
    assert "| eager | 128 | error: `RuntimeError: boom` |" in section, section
    assert "- cache 128: tokens/s 200 vs 250 (0.80x)" in section
    assert "- generate/infinifuse/128: fallback `fusion -> eager: capture failed`" in markdown


def test_generate_json_read_in_is_recorded_as_measured_where_it_ran(tmp_path):
    # A suite part that only reads an earlier generate.py JSON measured nothing here: its
    # environment is the machine that JSON names, not this one.
    measured = {"device": "NVIDIA Test GPU", "torch": "9.9+cu", "triton": "9.9",
                "transformers": "9.9", "python": "3.99", "date": "2026-01-01T00:00:00+00:00",
                "model": "m", "prompt_tokens": 16, "new_tokens": 64,
                "runs": [{"variant": "infinifuse", "cache_len": 128, "first_generate_s": 4.0,
                          "tokens_per_s": 1.0, "tokens_equal_eager": 64, "tokens_total": 64}],
                "summary": {"lines": ["cache 128: a line"]}}  # fmt: skip
    source = tmp_path / "generate.json"
    source.write_text(json.dumps(measured))
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out-dir", str(tmp_path),
               "--only", "generate", "--generate-json", str(source)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "suite.json").read_text())
    environment = result["environment"]
    for key in ("device", "torch", "triton", "transformers", "python", "date"):
        assert environment[key] == measured[key], (key, environment)
    assert environment["read_from"] == str(source)
    assert result["parts"] == [environment]
    assert result["generate"]["status"] == "ok" and result["generate"]["runs"] == measured["runs"]


@pytest.fixture
def row_kernels_on_cpu(monkeypatch):
    """benchmarks/row_kernels.py with its timing faked and its inputs on the CPU."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import row_kernels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    real_inputs = row_kernels.make_inputs
    timed = []

    def fake_device_ms(fn, calls=20, reps=10):
        fn()
        timed.append(1)
        return 1e-3 * len(timed)

    monkeypatch.setattr(row_kernels, "device_ms", fake_device_ms)
    monkeypatch.setattr(row_kernels, "make_inputs", lambda n, r, w, d: real_inputs(n, r, w, "cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return row_kernels


def test_row_kernel_measure_alternates_the_backends_over_rounds(row_kernels_on_cpu, monkeypatch):
    rk = row_kernels_on_cpu
    real_compiled = rk.compiled  # Inductor's CPU compile is slow and not what is under test
    monkeypatch.setattr(
        rk, "compiled", lambda fn, b: real_compiled(fn, "eager" if b == "inductor" else b)
    )
    row = rk.measure("swiglu", 2, 96, copy_gbs=1000.0, rounds=3)
    # fake times count the calls: infinifuse, inductor, eager, then again
    assert row["infinifuse_ms_rounds"] == pytest.approx([1e-3, 4e-3, 7e-3])
    assert row["eager_ms_rounds"] == pytest.approx([3e-3, 6e-3, 9e-3])
    assert row["infinifuse_ms"] == pytest.approx(4e-3)  # the median
    assert row["ratio_vs_inductor"] == pytest.approx(4 / 5)


def test_row_kernel_sweep_runs_every_config_on_the_cpu(row_kernels_on_cpu):
    # The sweep swaps launch.launch_config and reads configs' helpers: a rename there breaks
    # it only on a GPU run otherwise. Timing is faked; what runs is every config's launch.
    results = row_kernels_on_cpu.sweep("swiglu", 2, 96, copy_gbs=1000.0)
    assert len(results) > 10 and any(r["default"] for r in results)
    from fusebackend.kernels import launch

    assert launch.launch_config.__module__ == "fusebackend.kernels.configs"  # restored
