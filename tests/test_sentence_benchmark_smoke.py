"""benchmarks/sentence_embeddings.py at a tiny size on the CPU, and the workload it shares with
examples/sentence_embeddings.py (corpus, tokenizer). The benchmark runs in a subprocess, as it
starts one cold process per backend (~30 s on two CPU cores: a 2-layer, hidden-64 BERT, 24
sentences of up to 40 words, 6 queries, encoded twice, eager and infinifuse). Each query's tokens
and phase times (the probe of the p90 question) and the repeated queries are checked
too. No test asserts a time.
Without sentence-transformers the tests skip, except in CI (``CI=true``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT_KEYS = ("device", "torch", "triton", "transformers", "sentence_transformers", "date",
                    "commit", "python")  # fmt: skip
RUN_KEYS = ("first_pass_s", "second_pass_s", "query_p50_ms", "query_p90_ms", "dynamo_graphs",
            "distinct_padded_shapes", "batches", "model", "dtype", "environment")  # fmt: skip
# the per-query probe (tokens and phase times) and the repeated queries
QUERY_KEYS = ("query_phases", "query_trace", "query_repeat_p50_ms", "query_repeat_p90_ms",
              "query_repeat_mean_ms", "query_repeat_phases", "query_repeat_trace")  # fmt: skip
PHASE_SUMMARY_KEYS = ("tokens", "phases_ms", "share_of_slowest_10pct", "slowest_10pct",
                      "total_by_tokens_ms", "total_by_new_length_ms", "correlation_total_tokens",
                      "correlation_total_tokens_seen_lengths", "gc")  # fmt: skip
TRACE_COLUMNS = ["words", "tokens", "new_length", "total_ms", "tokenize_ms", "model_ms",
                 "model_gpu_ms", "pooling_ms", "rest_ms", "gc_ms", "gc_collections",
                 "gc_gen2"]  # fmt: skip
TARGET_NAMES = ["first pass / eager", "second pass / eager", "query p50 / reduce-overhead",
                "query p50 / eager", "query p90 / reduce-overhead",
                "re-captures on the second pass"]  # fmt: skip


def _needs_sentence_transformers() -> None:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail('sentence-transformers is missing in CI: .ci/run installs ".[test]"')
        pytest.skip('needs sentence-transformers: pip install -e ".[test]"')


@pytest.fixture(scope="module")
def example():
    path = ROOT / "examples" / "sentence_embeddings.py"
    spec = importlib.util.spec_from_file_location("_example_sentence_embeddings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_is_the_issues_shape_and_deterministic(example):
    corpus = example.make_sentences(3000, seed=0)
    words = [len(s.split()) for s in corpus]
    assert len(corpus) == 3000 and min(words) == 2 and max(words) == 199
    assert 12 <= statistics.median(words) <= 16, statistics.median(words)
    assert corpus == example.make_sentences(3000, seed=0)
    assert corpus != example.make_sentences(3000, seed=1)
    assert max(len(s.split()) for s in example.make_sentences(50, high=40)) == 40


def test_tokenizer_splits_every_word_without_unknown_tokens(example, tmp_path):
    """transformers 5 ignores BertTokenizerFast(vocab_file=...): every word was [UNK] once."""
    _needs_sentence_transformers()
    tokenizer = example.wordpiece_tokenizer(example.vocab_tokens(), str(tmp_path))
    tokenizer.save_pretrained(tmp_path)
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)  # as Transformer(dir) loads
    corpus = example.make_sentences(300, seed=3)
    ids = loaded(corpus)["input_ids"]
    assert ids == tokenizer(corpus)["input_ids"]
    assert all(loaded.unk_token_id not in row for row in ids)
    pieces = [len(row) - 2 for row in ids]  # [CLS] and [SEP]
    words = [len(s.split()) + 1 for s in corpus]  # the period is a token
    # frequent words are whole tokens, rare ones split into syllables
    assert all(w <= p <= 3 * w for w, p in zip(words, pieces)) and sum(pieces) > sum(words)
    assert loaded.model_max_length == example.MAX_SEQ_LENGTH


def test_recaptures_count_only_signatures_captured_before(example):
    # capture on the second call: the second pass's captures are first captures of new keys
    assert example.recaptures(3, {"a"}, {"a", "b", "c", "d"}, evictions=0)[0] == 0
    # a key captured in the first pass captured again (re-recorded or dropped and made again)
    assert example.recaptures(2, {"a", "b"}, {"a", "b", "c"}, evictions=0)[0] == 1
    # entries evicted before the pass: first captures cannot be told apart, all count
    count, how = example.recaptures(3, {"a"}, {"a", "b", "c", "d"}, evictions=1)
    assert count == 3 and "evicted" in how
    assert example.recaptures(4, None, None, evictions=0)[0] == 4
    assert example.recaptures(None, set(), set(), evictions=0)[0] is None


def test_rounds_summarize_each_backends_median():
    spec = importlib.util.spec_from_file_location(
        "_sentence_benchmark", ROOT / "benchmarks" / "sentence_embeddings.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(backend, second, recaptures=None, round_no=1):
        return {"shape": "s", "backend": backend, "first_pass_s": 1.0, "second_pass_s": second,
                "second_pass_recaptures": recaptures, "round": round_no}  # fmt: skip

    runs = [run("eager", 1.0), run("infinifuse", 0.9, 0), run("eager", 0.6, round_no=2),
            run("infinifuse", 0.5, 1, round_no=2), run("eager", 0.8, round_no=3),
            run("infinifuse", 0.4, 0, round_no=3)]  # fmt: skip
    summary = bench.summarize(runs)["s"]
    targets = {t["name"]: t for t in summary["targets"]}
    # medians: infinifuse 0.5 s against eager 0.8 s (not the last round's 0.4 / 0.8)
    assert targets["second pass / eager"]["ratio"] == pytest.approx(0.5 / 0.8)
    assert targets["re-captures on the second pass"]["value"] == 1  # the worst round
    assert summary["context"]["rounds"] == 3
    lines = bench.table(runs, {"s": summary})
    assert [line.split()[1:3] for line in lines[1:3]] == [["eager", "#1"], ["infinifuse", "#1"]]


def test_sentence_benchmark_tiny_writes_runs_environment_and_targets(tmp_path):
    _needs_sentence_transformers()
    out = tmp_path / "sentence.json"
    env = dict(os.environ)
    command = [sys.executable, str(ROOT / "benchmarks" / "sentence_embeddings.py"), "--tiny",
               "--backends", "eager,infinifuse,infinifuse-call1,infinifuse-dynamic",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())

    environment = result["environment"]
    missing = [k for k in ENVIRONMENT_KEYS if k not in environment]
    assert not missing, (missing, environment)
    assert environment["tiny"] is True and environment["sentence_transformers"]
    assert environment["query_probe"] is True and environment["repeat_queries"] is True
    assert environment["cudnn_sdp"] is True and "cudnn_sdp_enabled" in environment
    assert result["workload"]["sentences"] == 24 and result["workload"]["max_words"] == 40
    runs = {(r["shape"], r["backend"]): r for r in result["runs"]}
    backends = ("eager", "infinifuse", "infinifuse-call1", "infinifuse-dynamic")
    assert set(runs) == {("tiny", b) for b in backends}
    # a variant is infinifuse with its options, a row of its own
    call1 = runs["tiny", "infinifuse-call1"]
    assert call1["options"] == {"capture_on_call": 1}, call1["options"]
    assert call1["graphs"] and call1["cosine_vs_eager"]["min"] > 0.99999, call1
    assert runs["tiny", "infinifuse"]["options"] is None
    assert call1["dynamic"] is None and runs["tiny", "infinifuse"]["dynamic"] is None
    # torch.compile(dynamic=True): symbolic lengths from the first trace, so fewer Dynamo
    # graphs than the default's static graph + recompiles (2 against 3 on this corpus)
    dynamic = runs["tiny", "infinifuse-dynamic"]
    assert dynamic["dynamic"] is True and dynamic["options"] == {}, dynamic
    assert dynamic["dynamo_graphs"] < runs["tiny", "infinifuse"]["dynamo_graphs"], runs
    assert dynamic["cosine_vs_eager"]["min"] > 0.99999, dynamic["cosine_vs_eager"]
    for run in runs.values():
        assert "error" not in run, run
        missing = [k for k in RUN_KEYS if k not in run]
        assert not missing, (missing, run)
        assert run["first_pass_s"] > 0 and run["second_pass_s"] > 0 and run["queries"] == 6
        assert run["batches"] == 3 and run["distinct_padded_shapes"] >= 2, run
        _check_query_probe(run)
    fused = runs["tiny", "infinifuse"]
    # the same embeddings as eager's (fp32 on the CPU)
    assert fused["cosine_vs_eager"]["min"] > 0.99999, fused["cosine_vs_eager"]
    assert fused["query_cosine_vs_eager"]["min"] > 0.99999, fused["query_cosine_vs_eager"]
    assert fused["dynamo_graphs"] >= 1 and fused["fused_groups_last_graph"] >= 5, fused
    # per-phase stats: the first pass made the entries, the second pass captured nothing
    assert set(fused["stats"]) == {"start", "first_pass", "second_pass", "queries"}
    assert fused["first_pass_delta"]["cache_misses"] >= 2, fused["first_pass_delta"]
    assert fused["second_pass_recaptures"] == fused["second_pass_captures"] == 0, fused
    assert fused["recaptures_counted_as"], fused
    assert [g["groups"] >= 5 for g in fused["graphs"]] == [True] * fused["dynamo_graphs"], fused
    assert set(fused["stats"]["queries"]["modes"]) == {"fusion"}, fused["stats"]["queries"]
    assert fused["fallback_reasons"] == {}, fused["fallback_reasons"]
    # the repeated queries' lengths were all seen: no new entry, no capture
    assert fused["query_repeat_delta"]["cache_misses"] == 0, fused["query_repeat_delta"]

    targets = {t["name"]: t for t in result["summary"]["tiny"]["targets"]}
    assert list(targets) == TARGET_NAMES
    assert targets["first pass / eager"]["ratio"] == pytest.approx(
        fused["first_pass_s"] / runs["tiny", "eager"]["first_pass_s"]
    )
    assert targets["query p50 / reduce-overhead"]["ratio"] is None  # not run here
    assert targets["re-captures on the second pass"]["met"] is True
    # the table is printed last, a line per run, then the targets
    tail = done.stdout.strip().splitlines()[-6:]
    assert tail[0].split()[:2] == ["shape", "backend"], tail
    assert [line.split()[:2] for line in tail[1:5]] == [["tiny", b] for b in backends], tail
    assert tail[5].startswith("tiny: first pass / eager"), tail


def _check_query_probe(run):
    """Per query: tokens, new length, phases adding up to the total; summaries of both loops."""
    missing = [k for k in QUERY_KEYS if k not in run]
    assert not missing, (missing, sorted(run))
    assert run["query_repeat_p50_ms"] > 0 and run["query_repeat_p90_ms"] > 0, run
    for loop in ("query", "query_repeat"):
        trace = run[f"{loop}_trace"]
        assert trace["columns"] == TRACE_COLUMNS, trace["columns"]
        rows = [dict(zip(trace["columns"], row)) for row in trace["rows"]]
        assert len(rows) == run["queries"], trace
        for row in rows:
            assert row["tokens"] >= row["words"] + 2, row  # [CLS], words, the period, [SEP]
            parts = row["tokenize_ms"] + row["model_ms"] + row["pooling_ms"] + row["rest_ms"]
            assert parts == pytest.approx(row["total_ms"], abs=1e-2), row
            assert row["model_ms"] > 0 and row["tokenize_ms"] > 0 and row["gc_ms"] >= 0, row
            assert row["model_gpu_ms"] is None, row  # CPU: no CUDA events
        seen, first = set(), []
        for row in rows:
            first.append(row["tokens"] not in seen)
            seen.add(row["tokens"])
        if loop == "query":
            assert [r["new_length"] for r in rows] == first, rows
        else:  # every length was seen in the first loop
            assert not any(r["new_length"] for r in rows), rows
        summary = run[f"{loop}_phases"]
        missing = [k for k in PHASE_SUMMARY_KEYS if k not in summary]
        assert not missing, (missing, summary)
        for phase in ("tokenize_ms", "model_ms", "pooling_ms", "rest_ms", "gc_ms"):
            assert {"p50", "p90"} <= set(summary["phases_ms"][phase]), summary["phases_ms"]
        by_new = summary["total_by_new_length_ms"]
        assert by_new["new"]["n"] == sum(r["new_length"] for r in rows), by_new
        assert by_new["new"]["n"] + by_new["seen"]["n"] == run["queries"], by_new
        assert sum(b["n"] for b in summary["total_by_tokens_ms"].values()) == run["queries"]
        assert summary["tokens"]["distinct"] == len(seen), summary["tokens"]
        assert {"collections", "gen2", "queries_with_gc", "total_ms"} <= set(summary["gc"])
    # the first loop's totals are query_p50_ms' samples
    totals = sorted(row[3] for row in run["query_trace"]["rows"])
    assert totals[0] <= run["query_p50_ms"] <= totals[-1], (totals, run["query_p50_ms"])


def test_sentence_benchmark_names_a_bad_backend(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "sentence_embeddings.py"), "--backends",
               "eager,tensorrt", "--out", str(tmp_path / "x.json")]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown backend 'tensorrt'" in done.stderr, done.stderr
    assert not (tmp_path / "x.json").exists()
