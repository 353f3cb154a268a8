"""Workloads of the suite. Each builds a model with random weights and its inputs on a device.

Nothing is downloaded: transformers models are built from their configs (``from_config``).
Full sizes are for one GPU; ``quick`` sizes are tiny so the whole suite runs on a CPU, where
infinifuse's kernels run in Triton's interpreter.

Decode workloads use transformers' ``StaticCache``, allocated up front
(``early_initialization``): the cache tensors keep their addresses (``mark_static_address``)
and every decode call has the same shapes, which is what CUDA graphs need; ``prepare``
empties the cache and prefills a context eagerly (outside any compiled function), so every
backend starts its first decode call from the same state.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

# The embedding chain, shared with the kernel benchmark (benchmarks/ is on
# sys.path: run.py is started as a script).
from embedding_chain import Chain  # noqa: E402

# The 21 small-config architectures of the zoo tests (tests/model_zoo.py), imported read-only;
# appended to the path so that nothing in tests/ shadows a module of benchmarks/.
sys.path.append(str(Path(__file__).resolve().parents[2] / "tests"))
import model_zoo  # noqa: E402

__all__ = ["Case", "Workload", "decode_weight_bytes", "select", "workloads"]


@dataclasses.dataclass
class Case:
    """A built workload: the model, the keyword arguments of every call, its main output."""

    model: nn.Module
    kwargs: dict[str, Any]  # the same for every call; decode state advances in the cache
    main_output: Callable[[Any], torch.Tensor]  # the tensor compared with eager's
    prepare: Callable[[], None] = lambda: None  # restores the state before a first call
    sweep: list[dict[str, Any]] | None = None  # per-length kwargs of a sweep workload
    shape: str = ""
    # decode workloads: bytes of the parameters one step reads (decode_weight_bytes)
    weight_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    dtype: torch.dtype
    build: Callable[[torch.device, int], Case]  # (device, calls the case must allow)
    rounds: int  # timed rounds; the per-call figure is the median over rounds
    loop: int  # calls per timed round
    needs_transformers: bool = True
    # Count CUDA kernel launches of one call without CUDA graphs (torch.profiler).
    count_kernels: bool = False
    # The backends this workload runs with (None: every backend asked for).
    backends: tuple[str, ...] | None = None
    # "model": measured in this process; "generate": benchmarks/generate.py in subprocesses.
    kind: str = "model"
    # kind "generate": the arguments given to benchmarks/generate.py.
    argv: tuple[str, ...] = ()
    # A model's decode step (``_decode``): its rows carry the weight-streaming floor, for
    # which run.py measures the copy bandwidth once.
    decode: bool = False


def _logits(out: Any) -> torch.Tensor:
    return out.logits


def _last_hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state


def _chain(batch: int, seq: int, dim: int, vocab: int, dtype: torch.dtype) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        torch.manual_seed(0)
        model = Chain(vocab, max(seq, 16), dim).to(device, dtype).eval()
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        pos_ids = torch.arange(seq, device=device)[None]
        return Case(
            model,
            {"ids": ids, "pos_ids": pos_ids},
            lambda out: out,
            shape=f"B={batch} T={seq} D={dim}",
        )

    return build


def _causal_lm(config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # Built on the target device: random init of 1.1B parameters on a CPU takes ~10 s.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval()  # no-op moves if built in place


def static_cache(model: nn.Module, batch: int, max_len: int) -> Any:
    """A StaticCache with its tensors allocated now (static addresses, fixed shapes)."""
    from transformers import StaticCache

    config = model.config
    cache = StaticCache(config=config, max_cache_len=max_len)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    param = next(model.parameters())
    # Lazily-allocated layers would be allocated inside the first compiled call, where
    # transformers skips mark_static_address: the decode graph would then take the cache
    # tensors as ordinary inputs, copied into the CUDA graph's buffers on every replay.
    cache.early_initialization(batch, heads, head_dim, param.dtype, param.device)
    return cache


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters one decode step reads: every parameter once (shared ones,
    such as a head tied to the embedding, once), except embedding tables (``nn.Embedding``),
    of which a step gathers a row or a few, unless the table is also the LM head's weight
    (tied: the head reads all of it)."""

    def where(t: torch.Tensor) -> int:
        # by storage: a tied head may be another Parameter over the table's memory (a meta
        # tensor has none: by identity)
        return id(t) if t.is_meta else t.data_ptr()

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    head_at = None if head_weight is None else where(head_weight)
    gathered = {where(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[tuple[int, int]] = set()
    total = 0
    for param in model.parameters():
        key = (where(param), param.numel())
        if key in seen or (key[0] in gathered and key[0] != head_at):
            continue
        seen.add(key)
        total += param.numel() * param.element_size()
    return total


def _decode(
    make_config: Callable[[], Any], context: int, dtype: torch.dtype, batch: int = 1
) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        model = _causal_lm(make_config(), device, dtype)
        vocab = model.config.vocab_size
        cache = static_cache(model, batch, context + calls + 8)
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
        token = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)

        def prepare() -> None:
            cache.reset()  # zeroes in place: addresses (and captured graphs) stay valid
            model(input_ids=prompt, past_key_values=cache, use_cache=True)

        kwargs = {"input_ids": token, "past_key_values": cache, "use_cache": True}
        return Case(
            model,
            kwargs,
            _logits,
            prepare,
            shape=f"batch {batch}, 1 token, StaticCache {context}+{calls} of {context + calls + 8}",
            weight_bytes=decode_weight_bytes(model),
        )

    return build


def _prefill(make_config: Callable[[], Any], seq: int, dtype: torch.dtype) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        model = _causal_lm(make_config(), device, dtype)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=generator)
        kwargs = {"input_ids": ids.to(device), "use_cache": False}
        return Case(model, kwargs, _logits, shape=f"batch 1 x {seq} tokens, no cache")

    return build


def _bert(make_config: Callable[[], Any], batch: int, seq: int, dtype: torch.dtype) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        from transformers import AutoModel

        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModel.from_config(make_config())
        model = model.to(device=device, dtype=dtype).eval()
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)
        return Case(model, {"input_ids": ids.to(device)}, _last_hidden, shape=f"{batch} x {seq}")

    return build


def _sweep(make_config: Callable[[], Any], lengths: list[int], dtype: torch.dtype) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        model = _causal_lm(make_config(), device, dtype)
        generator = torch.Generator().manual_seed(1)
        per_length = [
            {
                "input_ids": torch.randint(
                    0, model.config.vocab_size, (1, n), generator=generator
                ).to(device),
                "use_cache": False,
            }
            for n in lengths
        ]
        return Case(
            model,
            per_length[0],
            _logits,
            sweep=per_length,
            shape=f"batch 1, {len(lengths)} lengths {lengths[0]}..{lengths[-1]}, no cache",
        )

    return build


def _llama_shapes() -> Any:
    """examples/llama_shapes.py (TinyLlama's shape and the tiny widths), by path: the suite
    runs with benchmarks/ on sys.path, not examples/."""
    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import llama_shapes

    return llama_shapes


# The quick decoders' vocabulary: one decode step's LM head over 512 words ran 256 two-column
# GEMV programs in Triton's CPU interpreter, 3.6 of the step's 4.2 s (tiny Llama, 2026-11-30);
# at 64 words, 32 programs. The same launch and kernel, on fewer columns.
QUICK_VOCAB = 64


def _llama_config(quick: bool) -> Callable[[], Any]:
    def make() -> Any:
        from transformers import LlamaConfig

        shapes = _llama_shapes()
        if quick:
            return LlamaConfig(**{**shapes.TINY_WIDTHS, "vocab_size": QUICK_VOCAB},
                               num_hidden_layers=2)  # fmt: skip
        return LlamaConfig(**shapes.TINYLLAMA)

    return make


def _gpt2_config(quick: bool) -> Callable[[], Any]:
    def make() -> Any:
        from transformers import GPT2Config

        if quick:
            # bos/eos inside the tiny vocabulary: transformers warns about the default 50256.
            return GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                vocab_size=QUICK_VOCAB,
                n_positions=256,
                bos_token_id=0,
                eos_token_id=0,
            )
        return GPT2Config()  # GPT-2 small, 124M

    return make


def _qwen2_config(quick: bool) -> Callable[[], Any]:
    def make() -> Any:
        from transformers import Qwen2Config

        if quick:
            widths = {**_llama_shapes().TINY_WIDTHS, "vocab_size": QUICK_VOCAB}
            return Qwen2Config(**widths, num_hidden_layers=2)
        # Qwen2-0.5B's shape (its embedding is tied to the head, as in the released model).
        return Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        )

    return make


def _zoo(family: str, dtype: torch.dtype) -> Callable:
    def build(device: torch.device, calls: int) -> Case:
        model = model_zoo.build(family, dtype=dtype, device=str(device))
        kwargs = model_zoo.inputs(family, device=str(device))
        return Case(model, kwargs, model_zoo.main_output, shape="2 x 7, padded mask")

    return build


# The zoo's backends: inductor's count stands in for reduce-overhead's.
ZOO_BACKENDS = ("eager", "inductor", "reduce-overhead", "infinifuse")
# --quick runs a decoder with RMSNorm, one with LayerNorm and an encoder: a few minutes on
# two CPU cores with Triton's interpreter.
ZOO_QUICK = ("llama", "gpt2", "bert")


def _zoo_workloads(quick: bool, dtype: torch.dtype) -> list[Workload]:
    families = ZOO_QUICK if quick else tuple(sorted(model_zoo.ZOO))
    return [
        Workload(
            f"zoo-{family}",
            f"zoo: {model_zoo.ZOO[family][0].removesuffix('Config')}, 2 layers, hidden 64",
            dtype,
            _zoo(family, dtype),
            2 if quick else 5,
            2 if quick else 20,
            count_kernels=True,
            backends=ZOO_BACKENDS,
        )
        for family in families
    ]


def _generate_workload(quick: bool, device: torch.device, dtype: torch.dtype) -> Workload:
    if quick:
        # Inductor on the CPU compiles C++ (minutes, and a toolchain): auto-compile only on CUDA.
        variants = ["eager", "infinifuse"] + (["autocompile"] if device.type == "cuda" else [])
        argv = ("--layers", "1", "--prompt", "8", "--new-tokens", "4", "--repeats", "1",
                "--cache-lens", "32", "64", "--variants", *variants)  # fmt: skip
        description = "generate(): 1-layer TinyLlama-shaped, 4 tokens"
    else:
        argv = ()  # generate.py's defaults: 22 layers, 64 tokens, caches 128 and 4096
        description = "generate(): TinyLlama-shaped, 64 tokens, caches 128 and 4096"
    return Workload("generate", description, dtype, _no_build, 0, 0, kind="generate", argv=argv)


def _no_build(device: torch.device, calls: int) -> Case:
    raise TypeError("the generate workload runs benchmarks/generate.py, it builds nothing here")


def _bert_config(quick: bool) -> Callable[[], Any]:
    def make() -> Any:
        from transformers import BertConfig

        if quick:
            return BertConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                vocab_size=512,
                max_position_embeddings=128,
            )
        return BertConfig()  # BERT-base

    return make


def workloads(quick: bool, device: torch.device) -> list[Workload]:
    """The suite, in run order. fp16 on a GPU; fp32 on a CPU (CPU fp16 kernels are slow).

    The four models of docs/PERFORMANCE.md's decode table (llama-decode, qwen2-decode,
    gpt2-decode, bert) and the zoo count kernels per call; the zoo has one workload per family
    ("zoo-llama", ...).
    """
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if quick:
        sweep_lengths = [8, 12, 16, 20]
        return [
            Workload(
                "chain-decode",
                "embedding chain, decode",
                dtype,
                _chain(1, 1, 64, 1000, dtype),
                3,
                3,
                needs_transformers=False,
            ),
            Workload(
                "chain-prefill",
                "embedding chain, prefill",
                dtype,
                _chain(2, 16, 64, 1000, dtype),
                3,
                3,
                needs_transformers=False,
            ),
            Workload(
                "llama-decode",
                "tiny Llama, decode",
                dtype,
                _decode(_llama_config(True), 8, dtype),
                3,
                2,
                count_kernels=True,
                decode=True,
            ),
            Workload(
                "qwen2-decode",
                "tiny Qwen2, decode",
                dtype,
                _decode(_qwen2_config(True), 8, dtype),
                3,
                2,
                count_kernels=True,
                decode=True,
            ),
            Workload(
                "llama-prefill",
                "tiny Llama, prefill",
                dtype,
                _prefill(_llama_config(True), 16, dtype),
                3,
                2,
            ),
            Workload(
                "bert",
                "tiny BERT",
                dtype,
                _bert(_bert_config(True), 2, 16, dtype),
                3,
                2,
                count_kernels=True,
            ),
            Workload(
                "gpt2-decode",
                "tiny GPT-2, decode",
                dtype,
                _decode(_gpt2_config(True), 8, dtype),
                3,
                2,
                count_kernels=True,
                decode=True,
            ),
            Workload(
                "gpt2-prefill",
                "tiny GPT-2, prefill",
                dtype,
                _prefill(_gpt2_config(True), 16, dtype),
                3,
                2,
            ),
            Workload(
                "gpt2-sweep",
                f"tiny GPT-2, {len(sweep_lengths)} lengths x 3 calls",
                dtype,
                _sweep(_gpt2_config(True), sweep_lengths, dtype),
                1,
                3,
            ),
            *_zoo_workloads(True, dtype),
            _generate_workload(True, device, dtype),
        ]
    # Loop lengths keep the model rows under ~8 min on an H200: Inductor compiles of the
    # 22-layer model take 20-25 s each and dominate; timed loops are ~1-3 s per row. The
    # zoo (21 families, Inductor compiled twice each) and generate (cold processes) come on
    # top, not yet timed on a GPU: run them as parts (--only zoo / --only generate --merge).
    sweep_lengths = [16 + 20 * i for i in range(24)]  # 16..476: 24 distinct shapes
    return [
        Workload(
            "chain-decode",
            "gelu(tok*sqrt(D)+pos)*0.5+bias, decode",
            dtype,
            _chain(1, 1, 2048, 32000, dtype),
            5,
            100,
            needs_transformers=False,
        ),
        Workload(
            "chain-prefill",
            "gelu(tok*sqrt(D)+pos)*0.5+bias, prefill",
            dtype,
            _chain(16, 2048, 2048, 32000, dtype),
            5,
            10,
            needs_transformers=False,
        ),
        Workload(
            "llama-decode",
            "TinyLlama-1.1B shape (22 layers), decode",
            dtype,
            _decode(_llama_config(False), 64, dtype),
            5,
            20,
            count_kernels=True,
            decode=True,
        ),
        Workload(
            "qwen2-decode",
            "Qwen2-0.5B shape (24 layers), decode",
            dtype,
            _decode(_qwen2_config(False), 64, dtype),
            5,
            20,
            count_kernels=True,
            decode=True,
        ),
        # Small batches: matmul groups take up to 16 rows (passes/matmul_groups.py)
        *(
            Workload(
                f"llama-b{batch}-decode",  # not "llama-decode-...": --only matches prefixes
                f"TinyLlama-1.1B shape (22 layers), decode at batch {batch}",
                dtype,
                _decode(_llama_config(False), 64, dtype, batch),
                5,
                20,
                count_kernels=True,
                decode=True,
            )
            for batch in (4, 16)
        ),
        Workload(
            "llama-prefill",
            "TinyLlama-1.1B shape (22 layers), prefill",
            dtype,
            _prefill(_llama_config(False), 512, dtype),
            5,
            4,
        ),
        Workload(
            "bert",
            "BERT-base, 8 x 128",
            dtype,
            _bert(_bert_config(False), 8, 128, dtype),
            5,
            10,
            count_kernels=True,
        ),
        Workload(
            "gpt2-decode",
            "GPT-2 124M, decode",
            dtype,
            _decode(_gpt2_config(False), 64, dtype),
            5,
            20,
            count_kernels=True,
            decode=True,
        ),
        Workload(
            "gpt2-prefill",
            "GPT-2 124M, prefill",
            dtype,
            _prefill(_gpt2_config(False), 512, dtype),
            5,
            10,
        ),
        # issue 38's one-token forward without a cache: Conv1D's [K, N] weights on one row
        Workload(
            "gpt2-token",
            "GPT-2 124M, one token, no cache",
            dtype,
            _prefill(_gpt2_config(False), 1, dtype),
            5,
            20,
            count_kernels=True,
        ),
        Workload(
            "gpt2-sweep",
            f"GPT-2 124M, {len(sweep_lengths)} lengths x 3 calls",
            dtype,
            _sweep(_gpt2_config(False), sweep_lengths, dtype),
            1,
            3,
        ),
        *_zoo_workloads(False, dtype),
        _generate_workload(False, device, dtype),
    ]


def select(all_workloads: list[Workload], only: str | None) -> list[Workload]:
    """Workloads named by ``only``: comma-separated names or prefixes ("llama", "gpt2-sweep")."""
    if not only:
        return all_workloads
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    names = [w.name for w in all_workloads]
    for item in wanted:
        if not any(name.startswith(item) for name in names):
            raise SystemExit(f"--only: no workload matches {item!r}; workloads: {', '.join(names)}")
    return [w for w in all_workloads if any(w.name.startswith(item) for item in wanted)]
