"""transformers generate with a StaticCache: the KV tensors and counters are used in place.

Tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128). Through a compiled
forward, the prefill is compiled too: it creates the KV tensors (``torch.zeros``, not
folded: returned and mutated) and advances the cache's counter through
``counter.to(counter.device).add_(n)`` (an alias the old mutation analysis missed: the
first call ran it twice and generate raised IndexError). Through ``CompileConfig``, only the
decode step is compiled and its KV tensors are ``mark_static_address``-ed.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_model_fused, perturb_uniform_parameters

import fusebackend

transformers = pytest.importorskip("transformers")


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, intermediate_size=128, max_position_embeddings=256,
    )  # fmt: skip
    return perturb_uniform_parameters(transformers.LlamaForCausalLM(config).eval())


def _generate(model, ids, **kwargs):
    # 4 new tokens (the prefill's and 3 decode steps; 8 ran 4 more): the cache holds 10 slots
    # (max_length - 1), so a prefill that advanced the counter twice (to 14) still makes the
    # first decode step write past its end
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=4, do_sample=False, cache_implementation="static", **kwargs
        )


def _kv_in_place(graphs) -> bool:
    return any(any("keys" in name for name in g.static_inputs) for g in graphs)


def test_generate_through_a_compiled_forward_equals_eager():
    model = _model()
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = _generate(model, ids, disable_compile=True)
    start = fusebackend.report._recorded
    model.forward = torch.compile(model.forward, backend="infinifuse")
    assert torch.equal(_generate(model, ids), expected)
    graphs = fusebackend.report._reports_since(start)
    assert len(graphs) >= 2  # prefill and decode
    assert any(g.mutated_inputs for g in graphs)
    assert _kv_in_place(graphs), [g.static_inputs for g in graphs]
    assert_model_fused(graphs)


def test_generate_through_compile_config_equals_eager():
    model = _model()
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    expected = _generate(model, ids, disable_compile=True)
    compile_config = transformers.CompileConfig(backend="infinifuse")  # mode="reduce-overhead"
    compile_config._compile_all_devices = True  # transformers compiles only on CUDA otherwise
    start = fusebackend.report._recorded
    assert torch.equal(_generate(model, ids, compile_config=compile_config), expected)
    graphs = fusebackend.report._reports_since(start)
    assert graphs, "generate compiled nothing"
    assert _kv_in_place(graphs), [g.static_inputs for g in graphs]
    assert_model_fused(graphs)
