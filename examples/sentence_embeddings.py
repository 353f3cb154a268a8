"""sentence-transformers with the inner transformers model compiled by infinifuse.

    python examples/sentence_embeddings.py                 # MiniLM-L6 shape, 3000 sentences
    python examples/sentence_embeddings.py --compare       # + eager, Inductor reduce-overhead
    python examples/sentence_embeddings.py --shape bert-base   # 12 layers, hidden 768
    python examples/sentence_embeddings.py --tiny --interpret  # CPU: 2 layers, hidden 64
    python examples/sentence_embeddings.py --model-dir DIR # a local model (never downloads)
    python examples/sentence_embeddings.py --dynamic       # torch.compile(..., dynamic=True)

The workload of issue 25, built locally (nothing is downloaded): a BertModel of the MiniLM-L6
shape (6 layers, hidden 384, 12 heads, intermediate 1536; random weights) saved to a temporary
directory beside a WordPiece tokenizer built from the synthetic corpus' vocabulary (transformers'
``BertTokenizerFast`` on a vocab file this script writes), loaded as

    SentenceTransformer(modules=[models.Transformer(dir), models.Pooling(384, "mean")])

and the inner transformers model compiled in place::

    hf = st[0].auto_model
    hf.forward = torch.compile(hf.forward, backend="infinifuse")

(sentence-transformers 6 calls ``auto_model.forward`` directly, not ``auto_model(...)``, so
``auto_model.compile()`` would not take effect, and ``auto_model`` is a read-only property.)

The corpus: 3000 synthetic sentences of 2-199 words (median ~14, fixed seed) of pseudo-words
that the tokenizer splits into one to three pieces. ``encode(corpus, batch_size=32)`` runs twice
(the first pass compiles and captures; the second shows what a warm cache costs): sentence-
transformers sorts the corpus by length and pads each batch to its longest sentence, so every
batch may be a new shape. Then 200 single queries, one ``encode`` call each (p50/p90 latency).

Printed: per backend the two passes' times, query latencies, the embeddings' cosine against
eager's (per sentence, the smallest), and for infinifuse ``fusebackend.stats()``: captures,
evictions, live entries, graph-pool bytes, per phase. ``--compare`` runs eager and Inductor
(``mode="reduce-overhead"``) in this process too, one after the other with Dynamo reset
between; ``benchmarks/sentence_embeddings.py`` runs each backend in its own cold process.
fp16 on CUDA, fp32 on the CPU. Needs sentence-transformers (``pip install -e ".[test]"`` or
``pip install sentence-transformers``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

# Everything is local; a real model given with --model-dir must not be fetched either.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Model shapes: config fields, and the architecture where it is not BERT. bert-base has
# BERT-base's widths; mpnet-base is all-mpnet-base-v2's architecture (MPNetModel: relative
# position buckets computed per length, on the host in transformers <= 5.17); deberta-v3-base
# is DeBERTa-v3's (relative attention with log position buckets). Every shape uses the same
# WordPiece tokenizer: the workload's token lengths stay the same across architectures.
SHAPES: dict[str, dict[str, Any]] = {
    "minilm-l6": {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 12,
                  "intermediate_size": 1536},
    "bert-base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                  "intermediate_size": 3072},
    "mpnet-base": {"architecture": "mpnet", "num_hidden_layers": 12, "hidden_size": 768,
                   "num_attention_heads": 12, "intermediate_size": 3072},
    "deberta-v3-base": {"architecture": "deberta-v2", "num_hidden_layers": 12,
                        "hidden_size": 768, "num_attention_heads": 12,
                        "intermediate_size": 3072},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
             "intermediate_size": 128},
    "mpnet-tiny": {"architecture": "mpnet", "num_hidden_layers": 2, "hidden_size": 64,
                   "num_attention_heads": 2, "intermediate_size": 128},
}  # fmt: skip
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length
# "dynamo": Dynamo's tracing with no code generation (torch.compile's backend="eager"), the
# part of a first pass any torch.compile backend pays before it does its own work
BACKENDS = ("eager", "infinifuse", "reduce-overhead", "inductor", "dynamo")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The counters of fusebackend.stats() reported per phase (those present in this version).
STAT_KEYS = ("cache_size", "cache_hits", "cache_misses", "recordings", "evictions", "rerecords",
             "capture_failures", "fusion_attempts", "fusion_successes", "fusion_fallbacks",
             "validations", "graph_pool_bytes", "captured_bytes")  # fmt: skip

# Pseudo-words are consonant + vowel syllables: every word is a run of syllables, and the vocab
# holds every syllable as a word start and as a "##" continuation, so WordPiece's greedy
# longest match always splits a word into whole syllables and never yields [UNK].
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _needs(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != name:  # installed, but broken
            raise SystemExit(f"importing {name} failed: {exc!r}") from exc
        raise SystemExit(
            f'{exc}: this example needs {name}; install it with pip install -e ".[test]" '
            "(from the repository root) or pip install sentence-transformers"
        ) from exc


def lexicon(size: int = 6000, seed: int = 0) -> list[str]:
    """Distinct pseudo-words of 1-3 syllables, most frequent first (Zipf ranks)."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def make_sentences(
    n: int, seed: int = 0, median: int = 14, low: int = 2, high: int = 199
) -> list[str]:
    """``n`` sentences of ``low``..``high`` words, log-normal lengths around ``median``; the
    first two (when n >= 2) are exactly ``low`` and ``high`` words long, so the range is the
    stated one. Words are drawn by Zipf frequency from ``lexicon()``; deterministic per seed."""
    words = lexicon()
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    rng = random.Random(seed)
    lengths = [min(high, max(low, round(rng.lognormvariate(math.log(median), 0.75))))
               for _ in range(n)]  # fmt: skip
    if n >= 2:
        lengths[0], lengths[1] = low, high
    return [" ".join(rng.choices(words, weights=weights, k=k)) + "." for k in lengths]


def vocab_tokens(whole_words: int = 3000) -> list[str]:
    """A WordPiece vocab: special tokens, the period, every syllable as a start and as a ``##``
    continuation, and the ``whole_words`` most frequent pseudo-words."""
    tokens = list(_SPECIAL) + ["."]
    tokens += _SYLLABLES + ["##" + s for s in _SYLLABLES]
    tokens += [w for w in lexicon()[:whole_words] if w not in _SYLLABLES]
    return tokens


def wordpiece_tokenizer(tokens: list[str], directory: str) -> Any:
    """transformers' BertTokenizerFast on ``tokens`` (also written to directory/vocab.txt).

    transformers 5 takes the vocab as ``vocab=`` (a dict or a path); a ``vocab_file=`` there
    is silently ignored and leaves only the special tokens, every word then [UNK]. 4.x takes
    ``vocab_file=``. Either way the result is checked."""
    transformers = _needs("transformers")
    vocab_path = os.path.join(directory, "vocab.txt")
    with open(vocab_path, "w") as f:
        f.write("\n".join(tokens) + "\n")
    common = {"do_lower_case": True, "model_max_length": MAX_SEQ_LENGTH}
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = transformers.BertTokenizerFast(vocab=vocab, **common)
    if len(tokenizer.get_vocab()) != len(vocab):  # transformers 4.x
        tokenizer = transformers.BertTokenizerFast(vocab_file=vocab_path, **common)
    if len(tokenizer.get_vocab()) != len(vocab):
        raise RuntimeError(
            f"transformers {transformers.__version__}: BertTokenizerFast holds "
            f"{len(tokenizer.get_vocab())} tokens, not the {len(vocab)} given"
        )
    return tokenizer


def build_model_dir(directory: str, shape: dict[str, int], seed: int = 0) -> str:
    """Write a random-weight model of ``shape`` (BERT unless its ``architecture`` says otherwise)
    and its WordPiece tokenizer to ``directory``."""
    transformers = _needs("transformers")
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars
    tokens = vocab_tokens()
    wordpiece_tokenizer(tokens, directory).save_pretrained(directory)
    fields = {k: v for k, v in shape.items() if k != "architecture"}
    # a real vocabulary's embedding table (30522 rows, MiniLM's and BERT's) where the shape is
    # a real model's; ids past the synthetic vocab are never looked up
    vocab_size = max(len(tokens), 30522) if shape["hidden_size"] >= 384 else len(tokens)
    common = {"vocab_size": vocab_size, "max_position_embeddings": 512, "pad_token_id": 0}
    architecture = shape.get("architecture", "bert")
    if architecture == "bert":
        config, model_class = transformers.BertConfig(**common, **fields), transformers.BertModel
    elif architecture == "mpnet":  # MPNet's default pad id is 1; the tokenizer's [PAD] is 0
        config = transformers.MPNetConfig(**common, **fields)
        model_class = transformers.MPNetModel
    elif architecture == "deberta-v2":  # DeBERTa-v3-base's attention settings
        config = transformers.DebertaV2Config(
            **{**common, "vocab_size": max(vocab_size, 128100)}, **fields,
            relative_attention=True, position_buckets=256, max_relative_positions=-1,
            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
            type_vocab_size=0, position_biased_input=False,
        )  # fmt: skip
        model_class = transformers.DebertaV2Model
    else:
        raise ValueError(f"architecture {architecture!r}: expected bert, mpnet or deberta-v2")
    torch.manual_seed(seed)
    model_class(config).eval().save_pretrained(directory)
    return directory


def load_sentence_transformer(
    directory: str, device: torch.device, dtype: torch.dtype, hidden: int | None = None
) -> Any:
    """``SentenceTransformer(modules=[Transformer(dir), Pooling(hidden, "mean")])``, or the
    directory's own modules when it is a saved sentence-transformers model (modules.json)."""
    st = _needs("sentence_transformers")
    try:  # 6.x; sentence_transformers.models (the spelling) warns there
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer

    if os.path.exists(os.path.join(directory, "modules.json")):
        model = st.SentenceTransformer(directory, device=str(device), local_files_only=True)
    else:
        transformer = Transformer(directory)
        if hidden is None:
            hidden = transformer.auto_model.config.hidden_size
        model = st.SentenceTransformer(
            modules=[transformer, Pooling(hidden, "mean")], device=str(device)
        )
    return model.to(device=device, dtype=dtype).eval()


def check_tokenizer(model: Any) -> None:
    """The loaded tokenizer splits the synthetic corpus' words into vocab pieces (no [UNK]):
    with only the special tokens every word would be one [UNK], a different workload."""
    tokenizer = model.tokenizer
    probe = tokenizer(make_sentences(20, seed=99))["input_ids"]
    if any(tokenizer.unk_token_id in row for row in probe):
        raise RuntimeError(
            f"the tokenizer maps words of the synthetic corpus to [UNK] (its vocab holds "
            f"{len(tokenizer.get_vocab())} tokens, {len(vocab_tokens())} were written)"
        )


# torch.compile's arguments per backend of compile_inner ("eager": not compiled)
_COMPILE_ARGS: dict[str, dict[str, Any]] = {
    "infinifuse": {"backend": "infinifuse"},
    "reduce-overhead": {"mode": "reduce-overhead"},
    "inductor": {},
    "dynamo": {"backend": "eager"},
}


def compile_inner(
    model: Any, backend: str, options: dict[str, Any] | None = None, dynamic: bool | None = None
) -> None:
    """Compile the inner transformers model's forward in place (see the module docstring).
    ``options``: infinifuse's. ``dynamic``: torch.compile's (None: Dynamo's default, a static
    graph first and symbolic lengths after its recompiles; True: symbolic lengths from the
    first trace, the setting sentence-transformers' docs recommend for varied lengths)."""
    if backend == "eager":
        return
    if backend not in _COMPILE_ARGS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    kwargs = {**_COMPILE_ARGS[backend], "dynamic": dynamic}
    if backend == "infinifuse":
        kwargs["options"] = options
    hf = model[0].auto_model
    hf.forward = torch.compile(hf.forward, **kwargs)


def uncompile_inner(model: Any) -> None:
    """Undo ``compile_inner``: the class's own forward again."""
    hf = model[0].auto_model
    if "forward" in vars(hf):
        del hf.forward


def padded_shapes(model: Any, sentences: list[str], batch_size: int) -> list[tuple[int, ...]]:
    """The ``input_ids`` shapes ``encode(sentences, batch_size)`` hands the model: sentence-
    transformers sorts by character length (longest first) and pads each batch."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    shapes = []
    for start in range(0, len(order), batch_size):
        batch = [sentences[i] for i in order[start : start + batch_size]]
        prepare = getattr(model, "preprocess", None) or model.tokenize  # tokenize: before 6.0
        shapes.append(tuple(prepare(batch)["input_ids"].shape))
    return shapes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Any) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def fuse_stats() -> dict[str, Any]:
    """The counters of ``fusebackend.stats()`` this report uses, and the modes of live entries."""
    import fusebackend

    stats = fusebackend.stats()
    out = {k: stats[k] for k in STAT_KEYS if k in stats}
    out["modes"] = dict(Counter(stats.get("fusion_modes", {}).values()))
    out["eviction_reasons"] = dict(stats.get("eviction_reasons", {}))
    return out


def captured_signatures() -> set[str] | None:
    """Readable keys of the live entries that hold a captured CUDA graph, over every graph
    compiled so far (``fusebackend.reports()``); None where this version cannot tell."""
    import fusebackend

    if not hasattr(fusebackend, "reports"):
        return None
    keys: set[str] = set()
    for graph in fusebackend.reports().graphs:
        for entry in graph.runtime_modes():
            if "captured" not in entry:
                return None
            if entry["captured"]:
                keys.add(entry["key"])
    return keys


def recaptures(
    captures: int | None, before: set[str] | None, after: set[str] | None, evictions: int
) -> tuple[int | None, str]:
    """Captures of a phase that captured a signature again, and how that was counted.

    A signature's first capture may come late (the runtime captures on a later call of a
    signature, e.g. the second pass's): captured keys new since ``before`` are first captures
    and are not counted. That needs ``before`` to hold every key captured until then, so
    when an entry was evicted before the phase, every capture of the phase is counted."""
    if captures is None:
        return None, "no recordings counter"
    if before is None or after is None:
        return captures, "every capture (no per-entry capture state in this version)"
    if evictions:
        return captures, "every capture (entries were evicted before: first captures unknown)"
    first = len(after - before)
    return max(0, captures - first), f"captures minus {first} first captures of new keys"


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    keys = ("cache_misses", "cache_hits", "recordings", "evictions", "fusion_attempts",
            "validations", "capture_failures", "rerecords")  # fmt: skip
    out = {k: after[k] - before[k] for k in keys if k in after and k in before}
    reasons = after.get("eviction_reasons", {})
    evicted = {r: n - before.get("eviction_reasons", {}).get(r, 0) for r, n in reasons.items()}
    out["eviction_reasons"] = {r: n for r, n in evicted.items() if n}
    return out


def cosine(a: Any, b: Any) -> dict[str, float]:
    """Per-row cosine of two embedding matrices (float64): smallest and mean; largest |a-b|."""
    x = torch.as_tensor(a, dtype=torch.float64)
    y = torch.as_tensor(b, dtype=torch.float64)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return {"min": float(cos.min()), "mean": float(cos.mean()),
            "max_abs_diff": float((x - y).abs().max())}  # fmt: skip


class QueryProbe:
    """Where one ``encode(query)`` spends its time, per query (``measure``'s query loops).

    Wraps, on this model instance only, ``preprocess`` (tokenizing; the token count is read from
    its ``input_ids``), the first module's ``forward`` (the transformers model, compiled or not:
    host time, and on CUDA its GPU time from two events, read after the call's closing sync) and
    the later modules' (pooling); ``rest`` is the call's time less those three: encode's own
    Python, ``batch_to_device``, ``.cpu()`` and, on CUDA, the wait for the GPU there. Python's
    garbage collections are timed through ``gc.callbacks`` and charged to the running query.
    Each wrapper costs a few microseconds (two ``perf_counter`` calls; on CUDA two event
    records). ``remove()`` restores the instance."""

    COLUMNS = ("words", "tokens", "new_length", "total_ms", "tokenize_ms", "model_ms",
               "model_gpu_ms", "pooling_ms", "rest_ms", "gc_ms", "gc_collections",
               "gc_gen2")  # fmt: skip

    def __init__(self, model: Any, device: torch.device) -> None:
        import gc

        self.model, self.device, self._gc = model, device, gc
        self.rows: list[dict[str, Any]] = []
        self._row: dict[str, Any] | None = None
        self._events: list[tuple[Any, Any]] = []
        self._gc_start: float | None = None
        self._seen: set[int] = set()
        self._patched: list[tuple[Any, str]] = []
        name = "preprocess" if hasattr(model, "preprocess") else "tokenize"  # before 6.0
        self._wrap(model, name, self._tokenize)
        self._wrap(model[0], "forward", self._model)
        for module in list(model)[1:]:
            self._wrap(module, "forward", self._pooling)
        gc.callbacks.append(self._on_gc)

    def _wrap(self, owner: Any, name: str, around: Any) -> None:
        inner = getattr(owner, name)
        owned = name in vars(owner)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return around(inner, *args, **kwargs)

        object.__setattr__(owner, name, wrapper)
        self._patched.append((owner, name) if not owned else (owner, name, inner))

    def _add(self, key: str, seconds: float) -> None:
        if self._row is not None:
            self._row[key] += 1e3 * seconds

    def _tokenize(self, inner: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        self._add("tokenize_ms", time.perf_counter() - start)
        if self._row is not None and "input_ids" in out:
            self._row["tokens"] = int(out["input_ids"].shape[-1])
        return out

    def _model(self, inner: Any, *args: Any, **kwargs: Any) -> Any:
        cuda = self.device.type == "cuda" and self._row is not None
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        if cuda:
            end.record()
            self._events.append((begin, end))
        self._add("model_ms", time.perf_counter() - start)
        return out

    def _pooling(self, inner: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        self._add("pooling_ms", time.perf_counter() - start)
        return out

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None and self._row is not None:
            self._row["gc_ms"] += 1e3 * (time.perf_counter() - self._gc_start)
            self._row["gc_collections"] += 1
            self._row["gc_gen2"] += info.get("generation") == 2
            self._gc_start = None

    def begin(self, query: str) -> None:
        self._events = []
        self._row = {k: 0.0 for k in ("tokenize_ms", "model_ms", "pooling_ms", "gc_ms")}
        self._row.update(words=len(query.split()), tokens=None, gc_collections=0, gc_gen2=0)

    def end(self, seconds: float) -> None:
        """After the query's closing sync: its total and the GPU time of its model call(s)."""
        row, self._row = self._row, None
        assert row is not None
        row["total_ms"] = 1e3 * seconds
        row["model_gpu_ms"] = (sum(b.elapsed_time(e) for b, e in self._events)
                               if self._events else None)  # fmt: skip
        row["rest_ms"] = row["total_ms"] - row["tokenize_ms"] - row["model_ms"] - row["pooling_ms"]
        row["new_length"] = row["tokens"] not in self._seen
        self._seen.add(row["tokens"])
        self.rows.append(row)

    def take(self) -> list[dict[str, Any]]:
        rows, self.rows = self.rows, []
        return rows

    def remove(self) -> None:
        if self._on_gc in self._gc.callbacks:
            self._gc.callbacks.remove(self._on_gc)
        for patched in reversed(self._patched):
            owner, name = patched[0], patched[1]
            if len(patched) == 3:
                object.__setattr__(owner, name, patched[2])
            else:
                vars(owner).pop(name, None)
        self._patched = []


TOKEN_BUCKETS = ((1, 16), (17, 32), (33, 64), (65, 128), (129, 10**9))
_PHASES = ("tokenize_ms", "model_ms", "model_gpu_ms", "pooling_ms", "rest_ms", "gc_ms")


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": _percentile(values, 0.5), "p90": _percentile(values, 0.9),
            "mean": statistics.fmean(values), "max": max(values)}  # fmt: skip


def _pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def summarize_queries(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-phase p50/p90 over queries, the phases' share of the queries at or above the total's
    p90, total by token bucket and by whether the query's token length was new to the loop,
    the total's correlation with tokens, and garbage collections."""
    if not rows:
        return {}
    totals = [r["total_ms"] for r in rows]
    p90 = _percentile(totals, 0.9)
    slow = [r for r in rows if r["total_ms"] >= p90]
    phases = {k: _spread([r[k] for r in rows if r[k] is not None]) for k in _PHASES}
    share = {}
    for key in _PHASES:
        values = [r[key] for r in slow if r[key] is not None]
        if values:
            share[key] = sum(values) / sum(r["total_ms"] for r in slow)
    buckets = {}
    for low, high in TOKEN_BUCKETS:
        inside = [r for r in rows if r["tokens"] is not None and low <= r["tokens"] <= high]
        if inside:
            name = f"{low}-{high}" if high < 10**9 else f">={low}"
            buckets[name] = {**_spread([r["total_ms"] for r in inside]),
                             "new_length": sum(r["new_length"] for r in inside)}  # fmt: skip
    tokens = [r["tokens"] for r in rows if r["tokens"] is not None]
    seen = [r for r in rows if not r["new_length"]]
    return {
        "tokens": {**_spread(tokens), "distinct": len(set(tokens))},
        "phases_ms": phases,
        "share_of_slowest_10pct": share,
        "slowest_10pct": {"n": len(slow), "new_length": sum(r["new_length"] for r in slow),
                          "gc_collections": sum(r["gc_collections"] for r in slow),
                          "tokens_p50": _percentile([r["tokens"] or 0 for r in slow], 0.5)},
        "total_by_tokens_ms": buckets,
        "total_by_new_length_ms": {"new": _spread([r["total_ms"] for r in rows
                                                   if r["new_length"]]),
                                   "seen": _spread([r["total_ms"] for r in seen])},
        "correlation_total_tokens": _pearson([float(r["tokens"] or 0) for r in rows], totals),
        "correlation_total_tokens_seen_lengths": _pearson(
            [float(r["tokens"] or 0) for r in seen], [r["total_ms"] for r in seen]
        ),
        "gc": {"collections": sum(r["gc_collections"] for r in rows),
               "gen2": sum(r["gc_gen2"] for r in rows),
               "queries_with_gc": sum(1 for r in rows if r["gc_collections"]),
               "total_ms": sum(r["gc_ms"] for r in rows)},
    }  # fmt: skip


def query_trace(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-query rows, as columns and rows of values (compact JSON)."""

    def cell(value: Any) -> Any:
        return round(value, 4) if isinstance(value, float) else value

    return {"columns": list(QueryProbe.COLUMNS),
            "rows": [[cell(r[c]) for c in QueryProbe.COLUMNS] for r in rows]}  # fmt: skip


def measure(
    model: Any,
    backend: str,
    corpus: list[str],
    queries: list[str],
    batch_size: int,
    device: torch.device,
    options: dict[str, Any] | None = None,
    probe: bool = True,
    repeat_queries: bool = True,
    dynamic: bool | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One backend on the workload: two corpus passes, then single queries.

    Returns (numbers, embeddings); the inner model is restored to eager afterwards. The first
    pass includes Dynamo's and the backend's compile work (nothing is compiled before it).
    With ``probe``, each query's tokens and phase times (``QueryProbe``): ``query_phases``
    (``summarize_queries``) and ``query_trace``. With ``repeat_queries`` every query is encoded
    a second time after the timed loop (each length then seen before, by the same process):
    ``query_repeat_*``, ``query_repeat_phases``. Neither changes ``query_p50_ms`` and the
    other query fields, which time the first loop as before. ``dynamic``: torch.compile's
    (``compile_inner``).
    """
    result: dict[str, Any] = {"backend": backend}
    compile_inner(model, backend, options, dynamic)
    fused = backend == "infinifuse"
    try:
        counters_before = dict(torch._dynamo.utils.counters["stats"])
        phases: dict[str, Any] = {"start": fuse_stats()} if fused else {}
        encode = lambda batch: model.encode(batch, batch_size=batch_size)  # noqa: E731
        _, result["first_pass_s"] = _timed(device, lambda: encode(corpus))
        if fused:
            phases["first_pass"] = fuse_stats()
            captured_first = captured_signatures()
        embeddings, result["second_pass_s"] = _timed(device, lambda: encode(corpus))
        if fused:
            phases["second_pass"] = fuse_stats()
            captured_second = captured_signatures()
        probed = QueryProbe(model, device) if probe else None

        def query_pass() -> tuple[list[float], list[Any]]:
            """Each query encoded once: (seconds, embeddings), probed when asked."""
            times, outs = [], []
            for query in queries:
                if probed:
                    probed.begin(query)
                out, seconds = _timed(device, lambda q=query: model.encode(q))
                if probed:
                    probed.end(seconds)
                times.append(seconds)
                outs.append(out)
            return times, outs

        try:
            latencies, query_embeddings = query_pass()
            if fused:
                phases["queries"] = fuse_stats()
            rows = probed.take() if probed else []
            repeats: list[float] = []
            if repeat_queries and queries:
                repeats, _ = query_pass()  # every length seen before now
                if fused:
                    result["query_repeat_delta"] = _delta(fuse_stats(), phases["queries"])
            repeat_rows = probed.take() if probed else []
        finally:
            if probed:
                probed.remove()
        if rows:
            result["query_phases"] = summarize_queries(rows)
            result["query_trace"] = query_trace(rows)
        if repeats:
            result.update(
                query_repeat_p50_ms=1e3 * _percentile(repeats, 0.5),
                query_repeat_p90_ms=1e3 * _percentile(repeats, 0.9),
                query_repeat_mean_ms=1e3 * statistics.fmean(repeats),
            )
        if repeat_rows:
            result["query_repeat_phases"] = summarize_queries(repeat_rows)
            result["query_repeat_trace"] = query_trace(repeat_rows)
        counters = torch._dynamo.utils.counters["stats"]
        result["dynamo_graphs"] = counters["unique_graphs"] - counters_before.get(
            "unique_graphs", 0
        )
    finally:
        uncompile_inner(model)
    if latencies:
        result.update(
            query_p50_ms=1e3 * _percentile(latencies, 0.5),
            query_p90_ms=1e3 * _percentile(latencies, 0.9),
            query_mean_ms=1e3 * statistics.fmean(latencies),
            queries=len(latencies),
        )
    if fused:
        result["stats"] = phases
        result["first_pass_delta"] = _delta(phases["first_pass"], phases["start"])
        result["second_pass_delta"] = _delta(phases["second_pass"], phases["first_pass"])
        result["queries_delta"] = _delta(phases["queries"], phases["second_pass"])
        second = result["second_pass_delta"]
        result["second_pass_captures"] = second.get("recordings")
        result["second_pass_new_entries"] = second.get("cache_misses")
        # captures, while re-encoding the corpus, of signatures captured before: 0 when the
        # cache kept them (the target); first captures on a later call don't count
        result["second_pass_recaptures"], result["recaptures_counted_as"] = recaptures(
            second.get("recordings"),
            captured_first,
            captured_second,
            phases["first_pass"].get("evictions", 0),
        )
        if captured_second is not None:
            result["captured_signatures_after_second_pass"] = len(captured_second)
        import fusebackend

        report = fusebackend.last_report()
        result["fused_groups_last_graph"] = len(report.groups)
        if hasattr(fusebackend, "reports"):  # every graph of this run (Dynamo's recompiles)
            result["graphs"] = [
                {"name": g.name, "path": g.path, "groups": len(g.groups)}
                for g in fusebackend.reports().graphs
            ]
    if device.type == "cuda":
        result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["memory_reserved_bytes"] = torch.cuda.memory_reserved(device)
    import numpy as np

    queries_out = np.stack(query_embeddings) if query_embeddings else np.zeros((0, 0))
    return result, {"corpus": embeddings, "queries": queries_out}


def describe(model: Any) -> str:
    config = model[0].auto_model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return (f"{config.model_type}, {config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, intermediate "
            f"{config.intermediate_size}, {params:.1f}M parameters")  # fmt: skip


def print_result(result: dict[str, Any]) -> None:
    print(f"\n[{result['backend']}]")
    print(f"encode(corpus), first pass (compiles included): {result['first_pass_s']:.2f} s")
    print(f"encode(corpus), second pass: {result['second_pass_s']:.3f} s")
    if "query_p50_ms" in result:
        print(f"single queries ({result['queries']}): p50 {result['query_p50_ms']:.2f} ms, "
              f"p90 {result['query_p90_ms']:.2f} ms")  # fmt: skip
    if "cosine_vs_eager" in result:
        c = result["cosine_vs_eager"]
        q = result.get("query_cosine_vs_eager", {}).get("min")
        print(f"cosine vs eager: corpus min {c['min']:.6f} (mean {c['mean']:.6f}), queries "
              f"min {'-' if q is None else format(q, '.6f')}; largest |difference| "
              f"{c['max_abs_diff']:.2e}")  # fmt: skip
    if result["backend"] != "eager":
        print(f"Dynamo graphs compiled: {result['dynamo_graphs']}")
    if "stats" in result:
        end = result["stats"]["queries"]
        print(f"fused groups in the last graph: {result['fused_groups_last_graph']}")
        print(f"re-captures on the second pass: {result['second_pass_recaptures']} "
              f"({result['recaptures_counted_as']})")  # fmt: skip
        for phase in ("first_pass", "second_pass", "queries"):
            d = result[f"{phase}_delta"]
            print(f"  {phase}: new entries {d.get('cache_misses')}, captures "
                  f"{d.get('recordings')}, evictions {d.get('evictions')}"
                  f"{' ' + str(d['eviction_reasons']) if d.get('eviction_reasons') else ''}, "
                  f"hits {d.get('cache_hits')}, "
                  f"validations {d.get('validations')}")  # fmt: skip
        print(f"  at the end: live entries {end.get('cache_size')}, captures "
              f"{end.get('recordings')}, evictions {end.get('evictions')}, graph pool "
              f"{end.get('graph_pool_bytes', 0) / 2**20:.1f} MiB (captured entries' own "
              f"buffers {end.get('captured_bytes', 0) / 2**20:.1f} MiB), modes "
              f"{end['modes']}")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(ln for ln in __doc__.splitlines() if ln.startswith("    python")),
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="minilm-l6",
                        help="the random model's shape (default minilm-l6)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU-sized run: shape 'tiny' (2 layers, hidden 64), 40 sentences of "
                        "up to 48 words, batch size 8, 10 queries (each unless given)")  # fmt: skip
    parser.add_argument("--model-dir",
                        help="a local model directory (a sentence-transformers model, or a "
                        "transformers encoder with its tokenizer: mean pooling is added); "
                        "loaded offline, never downloaded")  # fmt: skip
    parser.add_argument("--sentences", type=int, help="corpus size (default 3000; --tiny 40)")
    parser.add_argument("--max-words", type=int,
                        help="longest sentence, in words (default 199; --tiny 48)")  # fmt: skip
    parser.add_argument("--queries", type=int, help="single queries (default 200; --tiny 10)")
    parser.add_argument("--batch-size", type=int, help="encode's batch_size (default 32; --tiny 8)")
    parser.add_argument("--backend", choices=BACKENDS, default="infinifuse",
                        help="the backend to show (default infinifuse)")  # fmt: skip
    parser.add_argument(
        "--options",
        type=json.loads,
        default=None,
        help="infinifuse's options as JSON, e.g. '{\"max_graphs\": 64}'",
    )
    parser.add_argument("--dynamic", action="store_true",
                        help="torch.compile(..., dynamic=True): symbolic lengths from the first "
                        "trace (sentence-transformers' advice for varied lengths), no "
                        "recompiles as lengths change")  # fmt: skip
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run eager and Inductor reduce-overhead (this process)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda if available")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(_DTYPES),
                        help="default: float16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--interpret", action="store_true",
                        help="set TRITON_INTERPRET=1: on the CPU, run the generated Triton "
                        "kernels in Triton's interpreter (slow) instead of leaving the graph "
                        "as traced")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model_dir and args.tiny:
        parser.error("--tiny shapes a random model; --model-dir loads its own")
    if args.model_dir and not os.path.isdir(args.model_dir):
        parser.error(f"--model-dir {args.model_dir!r} is not a directory")
    if args.tiny:
        args.shape = "tiny"
    if args.sentences is None:
        args.sentences = 40 if args.tiny else 3000
    if args.queries is None:
        args.queries = 10 if args.tiny else 200
    if args.max_words is None:
        args.max_words = 48 if args.tiny else 199
    if args.batch_size is None:
        args.batch_size = 8 if args.tiny else 32
    if args.max_words < 2:
        parser.error("--max-words: at least 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the numbers it prints."""
    args = parse_args(argv)
    if args.interpret:
        # Read when a kernel is first compiled, below (Triton is imported lazily by then).
        os.environ["TRITON_INTERPRET"] = "1"
    _needs("transformers")
    _needs("sentence_transformers")
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype or ("float16" if device.type == "cuda" else "float32")]
    corpus = make_sentences(args.sentences, seed=args.seed, high=args.max_words)
    # queries: the same length distribution, without the two forced extremes
    queries = make_sentences(args.queries + 2, seed=args.seed + 1, high=args.max_words)[2:]
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.model_dir or build_model_dir(tmp, SHAPES[args.shape], args.seed)
        model = load_sentence_transformer(
            directory, device, dtype, None if args.model_dir else SHAPES[args.shape]["hidden_size"]
        )
    if not args.model_dir:
        check_tokenizer(model)
    shapes = padded_shapes(model, corpus, args.batch_size)
    words = sorted(len(s.split()) for s in corpus)
    print(f"model: {args.model_dir or args.shape} ({describe(model)}), {dtype}, {device}")
    print(f"corpus: {len(corpus)} sentences of {words[0]}-{words[-1]} words (median "
          f"{statistics.median(words):.0f}), batch_size {args.batch_size}: {len(shapes)} "
          f"batches, {len(set(shapes))} distinct padded shapes; {len(queries)} single "
          f"queries")  # fmt: skip
    # CUDA context, cuBLAS and the allocator start before anything is timed, for every backend.
    model.encode(["warm up the device", "and its libraries"], batch_size=2)
    backends = [args.backend]
    if args.compare:
        backends = ["eager"] + [b for b in (args.backend, "reduce-overhead") if b != "eager"]
    results: dict[str, Any] = {"shapes": len(set(shapes)), "batches": len(shapes), "runs": {}}
    reference = None
    if "eager" not in backends:  # the reference embeddings, untimed
        reference = {"corpus": model.encode(corpus, batch_size=args.batch_size),
                     "queries": [model.encode(q) for q in queries]}  # fmt: skip
    import numpy as np

    import fusebackend

    for backend in backends:
        torch._dynamo.reset()
        fusebackend.clear_cache()
        fusebackend.reset_stats()
        result, embeddings = measure(
            model, backend, corpus, queries, args.batch_size, device, args.options,
            dynamic=True if args.dynamic else None,
        )  # fmt: skip
        if backend == "eager":
            reference = embeddings
        else:
            result["cosine_vs_eager"] = cosine(embeddings["corpus"], reference["corpus"])
            if queries:  # one at a time, as the timed queries ran
                result["query_cosine_vs_eager"] = cosine(
                    embeddings["queries"], np.stack(reference["queries"])
                )
        results["runs"][backend] = result
        print_result(result)
    eager = results["runs"].get("eager")
    if eager:
        print()
        for backend, r in results["runs"].items():
            if backend == "eager":
                continue
            first = r["first_pass_s"] / eager["first_pass_s"]
            second = r["second_pass_s"] / eager["second_pass_s"]
            line = f"{backend} / eager: first pass {first:.2f}x, second pass {second:.2f}x"
            if "query_p50_ms" in r and "query_p50_ms" in eager:
                line += f", query p50 {r['query_p50_ms'] / eager['query_p50_ms']:.2f}x"
            print(line)
    return results


if __name__ == "__main__":
    main()
