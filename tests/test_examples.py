"""Smoke tests of the examples and of the benchmark suite at tiny sizes (CPU is enough).

The examples run in this process (their ``main`` takes argv); the suite runs in a
subprocess because it sets process-wide state (Inductor's cache switch, Triton's cache
directory, warning filters). Tests that need transformers skip without it, except in CI
(``CI=true``), where the test extra installs it and a skip would hide a broken install.
No test asserts a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import fusebackend

ROOT = Path(__file__).resolve().parents[1]


def _load(relative: str) -> ModuleType:
    path = ROOT / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # as `python examples/x.py` does (llama_shapes)
    name = "_example_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_transformers() -> None:
    """Skip without transformers, but fail in CI: .ci/run installs it (the test extra)."""
    if _has_transformers():
        return
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail('transformers is missing in CI: .ci/run installs it with ".[test]"')
    pytest.skip('needs transformers: pip install -e ".[hf]"')


def test_quickstart_example_fuses_and_matches_eager(capsys):
    example = _load("examples/quickstart.py")
    error = example.main([])
    out = capsys.readouterr().out
    assert "group0" in out and "mode fusion" in out, out
    # tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, so the kernel itself ran.
    assert "| triton " in out, out
    assert error <= 1e-5, out


def test_examples_leave_triton_interpret_alone_without_the_flag(monkeypatch):
    # Without CUDA a fused group runs its torch reference unless the user asks for Triton's
    # interpreter (it decoded ~10x slower than fusion off on the CPU): no example sets it.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    example = _load("examples/bert_embeddings.py")
    argv = ["--device", "cpu", "--batch", "2", "--seq", "5", "--hidden", "24", "--vocab", "97"]
    assert example.main(argv) <= 1e-5
    assert "TRITON_INTERPRET" not in os.environ
    report = fusebackend.last_report()
    if not torch.cuda.is_available():
        backend = report.groups[0].backend
        assert backend.startswith("not rewritten: Triton cannot run on cpu"), report
    torch._dynamo.reset()  # compile again: whether a group uses Triton is fixed at compile time
    assert example.main([*argv, "--interpret"]) <= 1e-5
    assert os.environ["TRITON_INTERPRET"] == "1"  # monkeypatch restores it after the test
    if not torch.cuda.is_available():
        groups = fusebackend.last_report().groups
        assert [g.backend for g in groups] == ["triton"], str(fusebackend.last_report())


def test_bert_embeddings_example_fuses_three_tables(capsys):
    example = _load("examples/bert_embeddings.py")
    argv = ["--device", "cpu", "--batch", "2", "--seq", "5", "--hidden", "24", "--vocab", "97"]
    error = example.main(argv)
    out = capsys.readouterr().out
    assert "three-table group" in out, out
    assert "lookups per group: [3]" in out, out
    # fp32: the kernel computes in fp32 like eager; only summation order may differ.
    assert error <= 1e-5, out


def test_bert_embeddings_example_module_matches_without_compile():
    example = _load("examples/bert_embeddings.py")
    model = example.BertStyleEmbeddings(vocab=31, hidden=8).eval()
    ids = torch.randint(0, 31, (2, 3))
    with torch.no_grad():
        default_types = model(ids)
        zeros = model(ids, torch.zeros_like(ids))
    torch.testing.assert_close(default_types, zeros)


def test_llama_generate_example_matches_eager():
    _needs_transformers()
    example = _load("examples/llama_generate.py")
    argv = ["--device", "cpu", "--layers", "1", "--prompt-len", "6", "--new-tokens", "4"]
    result = example.main(argv)
    assert result["tokens"].shape == (1, 4)
    assert result["tokens_match"], result
    assert result["rel_error"] <= 1e-4, result
    assert result["cache"] == "StaticCache"
    stats = result["stats"]
    # One prefill and one decode signature, each compiled once, no failed run.
    assert stats["cache_misses"] == 2, stats
    assert stats["fusion_fallbacks"] == 0, stats["fallback_reasons"]
    assert len(stats["fusion_modes"]) == 2, stats


def test_llama_generate_example_no_fusion_and_dynamic_cache():
    _needs_transformers()
    example = _load("examples/llama_generate.py")
    argv = [
        "--device",
        "cpu",
        "--layers",
        "1",
        "--prompt-len",
        "5",
        "--new-tokens",
        "3",
        "--no-fusion",
        "--cache",
        "dynamic",
    ]
    result = example.main(argv)
    assert result["backend"] == "infinifuse (fusion off)"
    assert result["cache"] == "DynamicCache"
    assert result["tokens_match"], result
    assert set(result["stats"]["fusion_modes"].values()) <= {"eager", "graph_replay"}


# --tiny is 2 layers; one keeps every path (prefill, decode steps, the StaticCache writes) at
# half the interpreter time: the two generate() tests below took 65-74 s each in CI with 2.
_HF_TINY = ["--tiny", "--layers", "1", "--prompt-len", "7", "--new-tokens", "5"]


def test_hf_generate_example_matches_eager():
    # mode="default" here; CompileConfig's own default (reduce-overhead) is the test below.
    _needs_transformers()
    example = _load("examples/hf_generate.py")
    result = example.main([*_HF_TINY, "--device", "cpu", "--mode", "default"])
    assert result["tokens_equal"] == 5 and result["tokens_match"], result
    stats = result["stats"]
    # generate compiled its forward through infinifuse (the decode graph at least) and every
    # signature ran fused: nothing fell back.
    assert stats["cache_misses"] >= 1 and stats["cache_hits"] >= 1, stats
    assert set(stats["fusion_modes"].values()) == {"fusion"}, stats
    assert stats["fusion_fallbacks"] == 0, stats["fallback_reasons"]
    assert result["first_generate_s"] > 0 and result["tokens_per_s"] > 0


def test_hf_generate_example_with_compile_configs_default_mode():
    _needs_transformers()
    example = _load("examples/hf_generate.py")
    result = example.main([*_HF_TINY, "--device", "cpu"])
    assert result["label"] == "CompileConfig(backend='infinifuse', mode='reduce-overhead')"
    assert result["tokens_match"], result


def test_hf_generate_example_names_the_extra_without_transformers(monkeypatch):
    example = _load("examples/hf_generate.py")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[hf\]"'):
        example.main(["--tiny", "--layers", "1"])


def test_hf_generate_tiny_is_tiny_in_depth_too():
    # --tiny used to keep TinyLlama's 22 layers: --tiny --interpret took 5.5 minutes.
    _needs_transformers()
    example = _load("examples/hf_generate.py")
    device = torch.device("cpu")
    config = example.build_model(example.parse_args(["--tiny"]), device, torch.float32).config
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64), config
    deeper = example.build_model(example.parse_args(["--tiny", "--layers", "3"]), device,
                                 torch.float32).config  # fmt: skip
    assert deeper.num_hidden_layers == 3


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", _examples(), ids=lambda p: p.name)
def test_every_example_answers_help(path):
    # The README says each example lists its options with --help (llama_shapes.py, a module
    # of shapes, printed nothing).
    done = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:") and len(done.stdout.splitlines()) > 3, done.stdout


def test_every_example_is_in_the_readmes_examples_table():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Examples") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `examples/")]
    for path in _examples():
        assert any(row.startswith(f"| `examples/{path.name}`") for row in rows), path.name


def _run_suite(out_dir: Path, *args: str) -> dict:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--out-dir",
        str(out_dir),
        "--quick",
        *args,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out_dir / "suite.json").read_text())


def test_suite_quick_writes_rows_targets_and_merges(tmp_path):
    report = _run_suite(tmp_path, "--only", "chain-decode,llama-decode")
    env = report["environment"]
    for key in ("device", "torch", "triton", "transformers", "date", "quick"):
        assert key in env, env
    assert env["quick"] is True

    rows = {(r["workload"], r["backend"]): r for r in report["rows"]}
    backends = (
        "eager",
        "dynamo",
        "inductor",
        "reduce-overhead",
        "infinifuse",
        "infinifuse-nofusion",
        "infinifuse-nomatmul",
    )
    assert set(rows) == {(w, b) for w in ("chain-decode", "llama-decode") for b in backends}
    cuda = torch.cuda.is_available()
    for (workload, backend), row in rows.items():
        if workload == "llama-decode" and not _has_transformers():
            assert row["status"] == "skipped", row
            continue
        if backend in ("inductor", "reduce-overhead") and not cuda:
            assert row["status"] == "skipped" and row["error"] == "no CUDA", row
            continue
        assert row["status"] == "ok", row
        for key in ("per_call_ms", "first_call_s", "rel_error", "tolerance", "mode"):
            assert key in row, (key, row)
        assert row["error_ok"], row
        assert row["tolerance"] == (1e-2 if cuda else 1e-4)
        if backend.startswith("infinifuse"):
            assert row["mode"] != "n/a" and "stats" in row, row
        else:
            assert row["mode"] == "n/a", row
    # Decode rows carry the weight-streaming floor's figures, every backend (measured or not);
    # without CUDA there is no copy bandwidth, so no floor.
    for (workload, _), row in rows.items():
        if workload == "chain-decode":
            assert "weight_bytes" not in row and "floor_fraction" not in row, row
        elif _has_transformers():
            assert row["weight_bytes"] > 0, row
            if not cuda:
                assert row["copy_gbs"] is None and row["floor_fraction"] is None, row
            elif row["status"] == "ok":
                assert row["copy_gbs"] > 0 and 0 < row["floor_fraction"], row
    # The chain is the fusion pattern itself: on CPU its kernel runs in the interpreter.
    assert "fusion" in rows["chain-decode", "infinifuse"]["mode"].split(",")
    assert rows["chain-decode", "infinifuse-nofusion"]["mode"] in ("eager", "graph_replay")

    targets = {t["name"]: t for t in report["targets"]}
    # 12 backend-ratio targets (the four decode/encoder models' among them), the weight-
    # streaming floor's, 3 of the zoo, 2 of generate, and the error target over every row.
    assert len(targets) == 19, list(targets)
    floor = targets["TinyLlama-shape decode: fraction of the weight-streaming floor"]
    assert floor["direction"] == "at least" and floor["limit"] == 0.55
    if not cuda:
        assert floor["status"] == "not measured", floor
    first_call = targets["TinyLlama-shape decode, first call: infinifuse / Dynamo alone"]
    if _has_transformers():
        assert first_call["status"] in ("met", "missed") and first_call["value"] > 0
    else:
        assert first_call["status"] == "not measured"
    sweep = targets["GPT-2 24-length sweep, first pass: infinifuse / Dynamo alone"]
    assert sweep["status"] == "not measured"  # not selected
    assert targets[next(n for n in targets if n.startswith("every row"))]["status"] == "met"

    markdown = (tmp_path / "suite.md").read_text()
    assert "| chain-decode |" in markdown and "## Targets" in markdown
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "suite.png").stat().st_size > 0

    # A second part merges into the same directory: its rows are added, the others kept.
    merged = _run_suite(tmp_path, "--only", "chain-prefill", "--backends", "eager", "--merge")
    keys = {(r["workload"], r["backend"]) for r in merged["rows"]}
    assert ("chain-prefill", "eager") in keys and ("chain-decode", "infinifuse") in keys


def test_suite_help_is_complete():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # The description's first sentence spans two lines of the docstring: all of it is shown.
    assert "(fusion on\nand off) on an embedding chain" in done.stdout, done.stdout
    assert "built from configs (random weights)." in done.stdout, done.stdout
    for flag in ("--out-dir", "--device", "--quick", "--only", "--merge", "--list"):
        line = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith(flag))
        assert len(line.split()) > 2, f"{flag} has no help text: {line!r}"


def test_suite_targets_logic():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from suite.report import compute_targets
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def row(workload, backend, status="ok", first=1.0, per_call=1.0, error=0.0):
        return {
            "workload": workload,
            "backend": backend,
            "status": status,
            "first_call_s": first,
            "per_call_ms": per_call,
            "rel_error": error,
            "tolerance": 1e-2,
            "error_ok": error <= 1e-2,
        }

    rows = [
        row("llama-decode", "infinifuse", first=3.0, per_call=5.0),
        row("llama-decode", "dynamo", first=2.5),
        row("llama-decode", "reduce-overhead", first=20.0, per_call=2.0),
        row("gpt2-sweep", "infinifuse", status="error"),
        row("gpt2-sweep", "dynamo"),
        row("bert", "inductor", error=0.5),
    ]
    computed = compute_targets(rows)
    targets = {(t["workload"], t["metric"], t["baseline"]): t for t in computed[:-1]}
    decode_dynamo = targets["llama-decode", "first_call_s", "dynamo"]
    assert decode_dynamo["status"] == "met" and decode_dynamo["value"] == pytest.approx(1.2)
    assert targets["llama-decode", "first_call_s", "reduce-overhead"]["status"] == "met"  # 0.15
    per_call = targets["llama-decode", "per_call_ms", "reduce-overhead"]
    assert per_call["status"] == "missed" and per_call["value"] == pytest.approx(2.5)
    # The backend under test failing is a miss; a missing baseline is a gap.
    assert targets["gpt2-sweep", "first_call_s", "dynamo"]["status"] == "missed"
    assert targets["gpt2-sweep", "first_call_s", "reduce-overhead"]["status"] == "not measured"
    errors = computed[-1]
    assert errors["status"] == "missed" and "bert/inductor" in errors["note"]


def test_fast_generate_example_runs_the_device_loop_and_matches_generate():
    _needs_transformers()
    example = _load("examples/fast_generate.py")
    # --eager-step: the loop alone (an infinifuse step of this shape takes ~10 s interpreted;
    # tests/test_device_generate.py runs the loop through infinifuse)
    argv = ["--tiny", "--device", "cpu", "--new-tokens", "5", "--k", "2", "--eager-step"]
    result = example.main(argv)
    assert result["tokens_equal_generate"] == 5, result
    assert result["repeat_equal"] and result["tokens_per_s"] > 0, result
    assert "device loop, k=2, 5 new tokens" in result["report"], result
