"""GPU-only: graph preparation on a real device (constants, host work, static inputs)."""

from __future__ import annotations

import pytest
import torch

import fusebackend
from tests.helpers import assert_close, rand_ids, rand_table

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _modes(graph) -> list[str]:
    return [entry["mode"] for entry in graph.runtime_modes()]


def test_constant_mask_is_folded_and_the_graph_is_captured():
    def fn(ids, table):
        zero = torch.tensor(0.0, device=ids.device, dtype=table.dtype)
        x = torch.nn.functional.embedding(ids, table) * 2.0
        return torch.where(x > zero, x, torch.full((), -1e4, device=ids.device, dtype=x.dtype))

    g = torch.Generator().manual_seed(0)
    ids, table = rand_ids(17, (2, 5), g=g).cuda(), rand_table(17, 9, torch.float16, g=g).cuda()
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(ids, table), fn(ids, table))
    graph = fusebackend.last_report().graphs[0]
    assert graph.constants, str(fusebackend.last_report())
    assert _modes(graph) == ["fusion"], str(fusebackend.last_report())
    assert fusebackend.stats()["recordings"] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_constants_moved_to_the_device_and_under_autocast_equal_eager(dtype):
    # A ramp built on the host and moved to the device folds to a device buffer; a constant
    # product under CUDA autocast stays in the graph (folded outside the region it would be
    # fp32, where eager's is rounded to the autocast dtype)
    def fn(x):
        ramp = (torch.arange(6).reshape(2, 3).t() * 0.3).to(x.device)
        with torch.autocast("cuda", dtype=dtype):
            m = torch.full((3, 2), 1.1, device=x.device) @ torch.full(
                (2, 2), 1.7333, device=x.device
            )
        return x * ramp + m

    x = torch.randn(3, 2, device="cuda")
    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    with torch.no_grad():
        expected = fn(x)
        for _ in range(3):
            # fp32 defaults (a fused multiply-add may round once): m's fp32 value, 5.72
            # against eager's 5.71875 in bf16, is 2e-4 off, far past them
            torch.testing.assert_close(compiled(x), expected)
    graph = fusebackend.last_report().graphs[0]
    assert {"t", "mul", "ramp"} <= set(graph.constants), graph.constants  # ramp: the .to()
    assert "m" not in graph.constants, graph.constants
    assert _modes(graph) == ["fusion"], str(fusebackend.last_report())


def test_cpu_counter_runs_on_the_host_and_the_device_part_is_captured():
    def fn(counter, x):
        pos = counter + 1  # host bookkeeping
        counter.add_(x.shape[0])
        return x * pos.to(x.device, x.dtype), pos

    x = torch.randn(5, device="cuda")
    counter, expected_counter = torch.tensor(3), torch.tensor(3)
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        for _ in range(4):
            out = compiled(counter, x)
            expected = fn(expected_counter, x)
            assert_close(list(out), list(expected))
            assert out[1].device.type == "cpu"
            assert_close(counter, expected_counter)
    graph = fusebackend.last_report().graphs[0]
    assert graph.host_nodes, str(fusebackend.last_report())
    assert "eager" not in _modes(graph), str(fusebackend.last_report())
    assert fusebackend.stats()["recordings"] == 1  # the counter's value is not in the key


def test_a_written_device_copy_of_cpu_ids_leaves_them_alone_and_is_captured():
    """``d = ids.to(cuda); d.add_(1)``: eager writes a fresh copy, never the caller's ids."""

    def fn(ids, table):
        d = ids.to(table.device)
        d.add_(1)
        return torch.nn.functional.embedding(d, table) * 2.0

    g = torch.Generator().manual_seed(4)
    table = rand_table(19, 7, g=g).cuda()
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            ids = rand_ids(18, (2, 5), g=g)  # on the CPU
            before = ids.clone()
            assert_close(compiled(ids, table), fn(before.clone(), table))
            assert torch.equal(ids, before)
    graph = fusebackend.last_report().graphs[0]
    assert graph.host_inputs == ["l_ids_"] and graph.mutated_inputs == [], str(graph)
    assert "eager" not in _modes(graph), str(fusebackend.last_report())


def test_a_cpu_setitem_runs_on_the_host_and_the_device_part_is_captured():
    def fn(counter, x):
        y = x * counter.to(x.device)  # read before the host write (staged like an input)
        counter[0] = counter[0] + 5  # setitem returns None: host work all the same
        return y, counter * 1

    x = torch.randn(3, device="cuda")
    counter, expected_counter = torch.tensor([3]), torch.tensor([3])
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        for _ in range(4):
            out = compiled(counter, x)
            expected = fn(expected_counter, x)
            assert_close(list(out), list(expected))
            assert_close(counter, expected_counter)
    graph = fusebackend.last_report().graphs[0]
    assert "setitem" in graph.host_nodes, str(fusebackend.last_report())
    assert "eager" not in _modes(graph), str(fusebackend.last_report())
    assert fusebackend.stats()["recordings"] == 1


def test_a_random_op_on_the_device_is_not_folded():
    def fn(x):
        return x + torch._standard_gamma(torch.full((64,), 2.0, device=x.device))

    x = torch.zeros(64, device="cuda")
    compiled = torch.compile(fn, backend="infinifuse")
    with torch.no_grad():
        first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second)
    assert fusebackend.last_report().graphs[0].constants == ["full"]


def test_mutated_cache_is_used_in_place_without_copies():
    """A KV-cache-like buffer written in place: static (no copy in, no write-back)."""

    def step(cache, pos, value):
        cache.index_copy_(0, pos, value)
        return cache.sum(0)

    cache = torch.zeros(4096, 8, device="cuda")
    compiled = torch.compile(step, backend="infinifuse")
    copies = []
    real = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        if self.numel() == cache.numel() or src.numel() == cache.numel():
            copies.append(self.shape)
        return real(self, src, *args, **kwargs)

    expected = torch.zeros_like(cache)
    with torch.no_grad():
        for t in range(3):
            pos = torch.tensor([t], device="cuda")
            value = torch.randn(1, 8, device="cuda")
            compiled(cache, pos, value)  # first call: direct run + capture
        torch.Tensor.copy_ = counting_copy
        try:
            for t in range(3, 6):
                pos = torch.tensor([t], device="cuda")
                value = torch.randn(1, 8, device="cuda")
                out = compiled(cache, pos, value)
                expected = cache.clone()
        finally:
            torch.Tensor.copy_ = real
    assert_close(out, expected.sum(0))
    assert copies == [], copies
    graph = fusebackend.last_report().graphs[0]
    assert graph.static_inputs == ["l_cache_"], str(fusebackend.last_report())


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, intermediate_size=128, max_position_embeddings=256,
    )  # fmt: skip
    return transformers, transformers.LlamaForCausalLM(config).cuda().eval()


@pytest.mark.parametrize("way", ["forward", "compile_config"])
def test_generate_static_cache_is_captured_and_equals_eager(way):
    transformers, model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 7), device="cuda")
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        expected = model.generate(ids, disable_compile=True, **kwargs)
        start = fusebackend.report._recorded
        if way == "forward":
            model.forward = torch.compile(model.forward, backend="infinifuse")
            out = model.generate(ids, **kwargs)
        else:
            config = transformers.CompileConfig(backend="infinifuse")
            out = model.generate(ids, compile_config=config, **kwargs)
    assert torch.equal(out, expected)
    graphs = fusebackend.report._reports_since(start)
    report = str(fusebackend.report.FusionReport(graphs))
    assert graphs, report
    for graph in graphs:
        assert "eager" not in _modes(graph), report
    assert any(any("keys" in n for n in g.static_inputs) for g in graphs), report
