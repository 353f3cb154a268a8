"""Host chains that read only sizes become per-signature constants (issue 37, item 1).

transformers 5.17's MPNet builds its relative position buckets on the host from
``torch.arange(seq_len)`` (no device), with an in-place ``ret += ...``, and moves the (L, L)
result with ``.to(device)``; DeBERTa moves ``torch.tensor(mid - 1).type_as(relative_pos)``.
Under dynamic shapes the copy stayed inside the captured region and every signature fell
back to eager ("capture failed: Cannot copy between CPU and CUDA tensors during CUDA graph
capture").

No GPU here: the graphs are traced on the CPU, then made to look as traced on a GPU
(``_as_traced_on_a_gpu``: the host chain keeps CPU example values, every other tensor is a
fake CUDA tensor), and the fake capture of test_reliability.py refuses, as CUDA does, a
captured graph whose device node reads a host tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
import torch.nn as nn
from helpers import rand_ids
from test_reliability import FAKE_CUDA, Capture
from torch._subclasses.fake_tensor import FakeTensor

import fusebackend
import fusebackend.backend
from fusebackend.passes.fx_util import example_value
from fusebackend.runtime import capture as cap

COPY_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
V, DIM, HEADS = 40, 16, 2


# ------------------------------------------------------------------------------ models


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """transformers 5.17's ``MPNetEncoder.relative_position_bucket``: host ops, ``+=``."""
    ret = 0
    n = -relative_position
    num_buckets //= 2
    ret += (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    ret += torch.where(is_small, n, val_if_large)
    return ret


class MPNet517(nn.Module):
    """One attention layer with MPNet-5.17's position bias: built on the host from the
    length alone (``torch.arange`` without a device), moved with ``.to(x.device)``."""

    def __init__(self, num_buckets=32):
        super().__init__()
        self.num_buckets = num_buckets
        self.emb = nn.Embedding(V, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.relative_attention_bias = nn.Embedding(num_buckets, HEADS)

    def compute_position_bias(self, x):
        bsz, qlen, klen = x.size(0), x.size(1), x.size(1)
        context_position = torch.arange(qlen, dtype=torch.long)[:, None]
        memory_position = torch.arange(klen, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        rp_bucket = relative_position_bucket(relative_position, num_buckets=self.num_buckets)
        rp_bucket = rp_bucket.to(x.device)
        values = self.relative_attention_bias(rp_bucket)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        return values.expand((bsz, -1, qlen, klen)).contiguous()

    def forward(self, ids, mask):
        x = self.emb(ids)
        b, n = ids.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
        scores = scores + self.compute_position_bias(x)
        scores = scores + (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, DIM)


class DebertaBuckets(nn.Module):
    """DeBERTa-v2's ``make_log_bucket_position`` on a relative position built on the device
    from sizes: ``torch.tensor(mid - 1).type_as(relative_pos)`` is a host tensor moved."""

    def __init__(self, bucket_size=8, max_position=64):
        super().__init__()
        self.bucket_size, self.max_position = bucket_size, max_position
        self.emb = nn.Embedding(V, DIM)
        self.pos = nn.Embedding(2 * bucket_size, DIM)

    def forward(self, ids):
        x = self.emb(ids)
        n = ids.shape[1]
        q_ids = torch.arange(0, n, device=x.device)
        relative_pos = q_ids[:, None] - q_ids[None, :]
        mid = self.bucket_size // 2
        sign = torch.sign(relative_pos)
        abs_pos = torch.where(
            (relative_pos < mid) & (relative_pos > -mid),
            torch.tensor(mid - 1).type_as(relative_pos),
            torch.abs(relative_pos),
        )
        log_pos = (
            torch.ceil(
                torch.log(abs_pos / mid)
                / torch.log(torch.tensor((self.max_position - 1) / mid))
                * (mid - 1)
            )
            + mid
        )
        bucket = torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)
        idx = (bucket.long() + self.bucket_size).clamp(0, 2 * self.bucket_size - 1)
        return x + self.pos(idx).mean(dim=1)[None]


# --------------------------------------------------------------- the GPU's view on a CPU


def _factory_without_device(node: torch.fx.Node) -> bool:
    factories = (torch.arange, torch.tensor, torch.zeros, torch.ones, torch.full)
    return node.op == "call_function" and node.target in factories and "device" not in node.kwargs


def _moves(node: torch.fx.Node) -> bool:
    if node.op == "call_method" and node.target in ("to", "type_as", "cuda"):
        return any(isinstance(a, (torch.device, torch.fx.Node)) for a in node.args[1:])
    return False


def _as_traced_on_a_gpu(gm: torch.fx.GraphModule, cpu_inputs=()) -> set[str]:
    """Give ``gm``'s tensors the devices a GPU trace has: a factory without a device and
    ops on its results alone (and the inputs ``cpu_inputs`` names) stay on the CPU, the
    rest (and each move) is on FAKE_CUDA. Returns the names of the host nodes."""
    host: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        value = example_value(node)
        if not isinstance(value, torch.Tensor):
            continue
        if node.op == "placeholder" and node.name in cpu_inputs:
            host.add(node)
            continue
        tensors = [i for i in node.all_input_nodes if isinstance(example_value(i), torch.Tensor)]
        if node.op in ("call_function", "call_method") and not _moves(node):
            if _factory_without_device(node) or (tensors and all(i in host for i in tensors)):
                host.add(node)
                continue
        if _moves(node):  # a new tensor on the GPU (on the CPU, .to(cpu) returns its input)
            meta = torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device="meta"
            )
            node.meta["example_value"] = FakeTensor(value.fake_mode, meta, FAKE_CUDA)
        else:
            value.fake_device = FAKE_CUDA
    return {n.name for n in host}


def _reads_host(gm) -> list[str]:
    """Nodes of a graph to capture that read a host tensor (a copy CUDA refuses)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    found = []
    for node in graph.nodes:
        value = example_value(node)
        if node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "cpu":
            found.append(node.name)  # a host op in the captured part
            continue
        for i in node.all_input_nodes:
            v = example_value(i)
            # A 0-d host tensor is read as a number, unless it is moved.
            if isinstance(v, torch.Tensor) and v.device.type == "cpu" and (v.dim() or _moves(node)):
                found.append(node.name)
    return found


@pytest.fixture
def gpu_like(monkeypatch) -> Capture:
    """The fake-CUDA capture path; its capture fails as CUDA's does on a host copy."""
    monkeypatch.setattr(fusebackend.backend, "_graph_device", lambda inputs: FAKE_CUDA)
    capture = Capture()

    def refuse_host_copies(fn, inputs):
        if _reads_host(fn):
            raise RuntimeError(COPY_ERROR)

    capture.fail = refuse_host_copies
    monkeypatch.setattr(cap, "capture_graph", capture)
    return capture


def _compile(model, cpu_inputs=(), dynamic=True, **options):
    options = {"cudagraphs": True, "capture_on_call": 1, **options}
    host_nodes: list[set[str]] = []

    def backend(gm, example_inputs):
        host_nodes.append(_as_traced_on_a_gpu(gm, cpu_inputs))
        return fusebackend.backend.infinifuse(gm, example_inputs, options=options)

    return torch.compile(model, backend=backend, dynamic=dynamic), host_nodes


def _mpnet_args(batch, length):
    ids = rand_ids(V, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length - max(1, length // 3) :] = 0
    return ids, mask


def _rows() -> list[dict]:
    """describe() of every live compiled graph's cache."""
    rows = []
    for graph in fusebackend.reports().graphs:
        cache = graph.runtime_ref() if graph.runtime_ref is not None else None
        rows += cache.describe() if cache is not None else []
    return rows


def _modes() -> list[str]:
    return [row["mode"] for row in _rows()]


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("options", [{}, {"length_buckets": (8, 16)}], ids=["exact", "buckets"])
def test_mpnet_517_position_bias_is_captured_per_signature(gpu_like, options):
    torch.manual_seed(0)
    model = MPNet517().eval()
    compiled, host_nodes = _compile(model, **options)
    with torch.no_grad():
        for length in (5, 7, 11, 5, 13, 7):
            args = _mpnet_args(2, length)
            torch.testing.assert_close(compiled(*args), model(*args))
    assert {"arange", "ret_1"} <= host_nodes[-1], host_nodes  # the chain is host work
    report = fusebackend.last_report().graphs[-1]
    taken = report.rewrites["signature_constants"]
    assert {"arange", "ret_1", "rp_bucket"} <= set(taken), taken
    assert "host_copies_kept" not in report.rewrites
    cache = report.runtime_ref()
    for graph in (cache._unfused, cache._fused):
        assert _reads_host(graph) == []
    s = fusebackend.stats()
    assert s["capture_failures"] == 0, fusebackend.describe()
    assert set(_modes()) <= {"fusion", "graph_replay"}, fusebackend.describe()
    assert all(row["captured"] for row in _rows()), _rows()
    assert any(graph().replays for graph in gpu_like.graphs if graph() is not None)


def test_mpnet_517_chain_is_evaluated_once_per_signature_and_replay_copies_nothing(gpu_like):
    torch.manual_seed(1)
    model = MPNet517().eval()
    compiled, _ = _compile(model)
    calls = []
    with torch.no_grad():
        compiled(*_mpnet_args(2, 4))  # Dynamo's first graph is static; the next are dynamic
        cache = fusebackend.last_report().graphs[-1].runtime_ref()
        real = cache._per_signature
        cache._per_signature = lambda *a: calls.append(a) or real(*a)
        compiled(*_mpnet_args(2, 6))
        cache = fusebackend.last_report().graphs[-1].runtime_ref()
        if cache._per_signature is None or not calls:
            real = cache._per_signature
            cache._per_signature = lambda *a: calls.append(a) or real(*a)
        calls.clear()
        for length in (6, 9, 6, 9, 6):
            args = _mpnet_args(2, length)
            torch.testing.assert_close(compiled(*args), model(*args))
    assert len(calls) == 1  # length 9's new entry; 6 already had its entry
    entries = [entry for _, entry in cache.table.items()]
    assert all(e.graph is not None and e.derived for e in entries)
    # the captured graph reads the entry's tensors in place: none of the graph's last inputs
    # (the per-signature ones) is among those a replay copies into static buffers
    inputs = [n for n in cache._unfused.graph.nodes if n.op == "placeholder"]
    first_derived = len(inputs) - cache._per_signature_count
    for entry in entries:
        assert not entry.host_copies
        assert all(i < first_derived for i in entry.copy_idx), (entry.copy_idx, first_derived)


def test_mpnet_517_at_static_shapes_computes_its_chain_once_per_signature(gpu_like):
    # At static shapes fold_constants folds the buckets up to the in-place ``+=``; the rest
    # reads only constants. It was host work, run and its result staged at every call (the
    # zoo's MPNet took 0.19 against reduce-overhead's 0.13 ms a call on an H200); it is a
    # per-signature input now: no host part, and a replay copies no host tensor.
    torch.manual_seed(1)
    model = MPNet517().eval()
    compiled, _ = _compile(model, dynamic=False, fusion=False)  # (the split is preparation)
    with torch.no_grad():
        for _ in range(3):
            args = _mpnet_args(2, 6)
            torch.testing.assert_close(compiled(*args), model(*args))
    graph = fusebackend.last_report().graphs[-1]
    assert graph.rewrites.get("signature_constants"), graph.rewrites
    assert not graph.rewrites.get("host_nodes"), graph.rewrites
    entries = [entry for _, entry in graph.runtime_ref().table.items()]
    assert entries and all(e.graph is not None and not e.host_copies for e in entries)


def test_before_the_fix_the_chain_fails_capture(gpu_like, monkeypatch):
    """Without the per-signature split the pattern's copy stays captured: eager fallback
    with the capture-failure reason (what the issue reports)."""
    import fusebackend.prepare as prepare
    from fusebackend.passes.signature_constants import SignatureConstants

    monkeypatch.setattr(
        prepare,
        "split_signature_constants",
        lambda gm, is_host: SignatureConstants(None, 0, [], []),
    )
    model = MPNet517().eval()
    compiled, _ = _compile(model)
    with torch.no_grad():
        for length in (5, 7):
            args = _mpnet_args(2, length)
            torch.testing.assert_close(compiled(*args), model(*args))
    rows = _rows()
    assert any(COPY_ERROR in (row["reason"] or "") for row in rows), rows
    assert {row["mode"] for row in rows} == {"eager"}, rows


def test_deberta_type_as_of_a_constant_is_captured(gpu_like):
    torch.manual_seed(2)
    model = DebertaBuckets().eval()
    compiled, _ = _compile(model)
    with torch.no_grad():
        for length in (5, 9, 12, 9):
            ids = rand_ids(V, (2, length))
            torch.testing.assert_close(compiled(ids), model(ids))
    report = fusebackend.last_report().graphs[-1]
    cache = report.runtime_ref()
    assert _reads_host(cache._unfused) == []
    assert fusebackend.stats()["capture_failures"] == 0, fusebackend.describe()
    assert set(_modes()) <= {"fusion", "graph_replay"}, fusebackend.describe()


def test_type_as_of_a_folded_constant_folds():
    from fusebackend.passes.constants import fold_constants

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(x):
        return x * torch.tensor(3).type_as(x) + torch.tensor(2).to(x)

    x = torch.randn(4)
    torch.compile(fn, backend=keep, fullgraph=True)(x)
    (gm,) = graphs
    folded = fold_constants(gm)
    assert any(n.startswith("type_as") for n in folded), folded
    assert any(n.startswith("to") for n in folded), folded
    assert not [n for n in gm.graph.nodes if n.op == "call_method"]
    torch.testing.assert_close(gm(x)[0], fn(x))


def test_a_buffer_the_graph_updates_is_no_constant():
    """A host buffer the graph writes at each call (a step counter) is state: a chain reading
    it is no per-signature constant (it would keep the first call's count), and so the host
    split, which asks this function first, keeps running it at each call."""
    from fusebackend.passes.signature_constants import split_signature_constants

    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    gm.register_buffer("steps", torch.zeros(3))
    graph, meta = gm.graph, torch.device("meta")  # "meta": the device side of the graph

    def node(kind, target, args, value):
        made = (
            getattr(graph, kind)(target, args) if args is not None else getattr(graph, kind)(target)
        )
        made.meta["example_value"] = value
        return made

    x = node("placeholder", "x", None, torch.empty(3, device=meta))
    steps = node("get_attr", "steps", None, gm.steps)
    node("call_method", "add_", (steps, 1), gm.steps)
    double = node("call_function", torch.mul, (steps, 2), torch.empty(3))
    moved = node("call_method", "to", (double, meta), torch.empty(3, device=meta))
    graph.output((node("call_function", torch.add, (x, moved), torch.empty(3, device=meta)),))
    found = split_signature_constants(gm, lambda value: value.device.type == "cpu")
    assert found.module is None and found.nodes == [], found.nodes


def test_a_host_chain_reading_a_tensor_input_is_refused_with_its_node_and_fix(gpu_like):
    """A host tensor computed from an input's data each call is no per-signature constant:
    the report names the copy, what it reads and the fix."""

    class Scaled(nn.Module):
        def forward(self, x, w):
            host = torch.arange(x.shape[1]) * w  # w: a CPU input's data
            return x + host.to(x.device)

    compiled, _ = _compile(Scaled(), cpu_inputs=("l_w_",))
    x, w = torch.randn(2, 5), torch.randn(5)
    with torch.no_grad():
        compiled(x, w)
        compiled(torch.randn(2, 6), torch.randn(6))
    kept = fusebackend.last_report().graphs[-1].rewrites.get("host_copies_kept", [])
    assert kept and "copies a host tensor" in kept[0] and "device=" in kept[0], kept


# ------------------------------------------------------------------ real models on a GPU


def _encoder(family: str):
    import transformers

    if family == "mpnet":
        config = transformers.MPNetConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
            intermediate_size=48, max_position_embeddings=64, pad_token_id=1,
        )  # fmt: skip
        return transformers.MPNetModel(config)
    config = transformers.DebertaV2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=48, max_position_embeddings=64, relative_attention=True,
        position_buckets=8, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
    )  # fmt: skip
    return transformers.DebertaV2Model(config)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mpnet", "deberta_v2"])
def test_real_encoders_capture_every_length_and_equal_eager(family):
    # transformers 5.17 (the GPU machines') builds MPNet's buckets on the host; DeBERTa-v2
    # moves torch.tensor(mid - 1).type_as(...): every length is captured, none falls back
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = _encoder(family).eval().cuda()
    compiled = torch.compile(model, backend="infinifuse", options={"capture_on_call": 1})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for length in (5, 7, 11, 13, 7, 5):
            ids = rand_ids(V, (2, length), g=g).cuda()
            mask = torch.ones_like(ids)
            mask[1, -2:] = 0  # a padded row
            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
            got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    s = fusebackend.stats()
    assert not s["fallback_reasons"], s["fallback_reasons"]
    assert s["capture_failures"] == 0 and s["recordings"] >= 4, s
    assert set(s["fusion_modes"].values()) == {"fusion"}, s["fusion_modes"]
    kept = [n for g in fusebackend.reports().graphs for n in g.rewrites.get("host_copies_kept", [])]
    assert not kept, kept
