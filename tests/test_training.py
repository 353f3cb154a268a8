"""Training: with gradients needed the graph goes through aot_autograd unfused, and every
gradient equals eager's. Inference on the same model still fuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, assert_fused, rand_ids, rand_table

import fusebackend

V, P, D = 29, 8, 16
GRAD_REASON = "unfused (gradients needed"


class Embeddings(nn.Module):
    def __init__(self, dtype=torch.float32, padding_idx=None, scale_grad_by_freq=False):
        super().__init__()
        self.tok = nn.Embedding(
            V, D, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq, dtype=dtype
        )
        self.pos = nn.Embedding(P, D, dtype=dtype)
        self.bias = nn.Parameter(rand_table(1, D, dtype)[0])
        with torch.no_grad():
            self.tok.weight.copy_(rand_table(V, D, dtype))
            self.pos.weight.copy_(rand_table(P, D, dtype))

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.tok(ids) + self.pos(positions)
        return F.gelu(x) * 1.5 + self.bias


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def _train_step(model, ids, compiled=None):
    out = (compiled if compiled is not None else model)(ids)
    loss = (out.float() * torch.linspace(-1, 1, out.shape[-1])).pow(2).mean()
    loss.backward()
    return out


@pytest.mark.parametrize(
    "dtype, kwargs",
    [
        (torch.float32, {}),
        (torch.float32, {"padding_idx": 0}),
        (torch.float32, {"scale_grad_by_freq": True}),
        (torch.float16, {}),
    ],
    ids=["fp32", "fp32-padding_idx", "fp32-scale_grad_by_freq", "fp16"],
)
def test_gradients_equal_eager(dtype, kwargs):
    torch.manual_seed(0)
    model = Embeddings(dtype, **kwargs)
    reference = copy.deepcopy(model)
    ids = rand_ids(V, (3, 6))
    ids[0, :3] = torch.tensor([0, 0, 5])  # padding rows and repeated ids

    compiled = torch.compile(model, backend="infinifuse")
    out = _train_step(model, ids, compiled)
    expected = _train_step(reference, ids)

    assert_close(out, expected)
    assert out.requires_grad
    for name, grad in _grads(model).items():
        assert grad is not None, name
        assert_close(grad, _grads(reference)[name])
        assert grad.abs().sum() > 0, name
    if "padding_idx" in kwargs:
        assert torch.all(model.tok.weight.grad[0] == 0)

    report = fusebackend.last_report()
    assert report.graphs[0].path.startswith(GRAD_REASON), str(report)
    assert report.groups == []


def test_a_graph_compiled_with_gradients_reports_the_reason_and_explain_the_inference_graph():
    # explain is an inference tool: it runs under torch.no_grad() (without it the README's
    # snippet reported "gradients needed"); the training graph's report says why it is unfused.
    torch.manual_seed(1)
    model = Embeddings()
    ids = rand_ids(V, (2, 5))
    torch.compile(model, backend="infinifuse")(ids)
    report = fusebackend.last_report()
    assert report.graphs[0].path.startswith(GRAD_REASON)
    assert "torch.no_grad()" in report.graphs[0].path  # tells the user how to fuse
    assert GRAD_REASON in str(report)
    explained = fusebackend.explain(model, ids)
    assert len(explained.graphs) == 1 and len(explained.groups) == 1, str(explained)
    assert not explained.graphs[0].path.startswith(GRAD_REASON), str(explained)


def test_gradient_of_a_float_input():
    torch.manual_seed(2)
    table = rand_table(V, D)
    ids = rand_ids(V, (2, 5))
    x = rand_table(10, D).reshape(2, 5, D).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()

    def fn(ids, table, x):
        return torch.sigmoid(F.embedding(ids, table) * x)

    compiled = torch.compile(fn, backend="infinifuse")
    compiled(ids, table, x).sum().backward()
    fn(ids, table, x_ref).sum().backward()
    assert_close(x.grad, x_ref.grad)
    assert fusebackend.last_report().graphs[0].path.startswith(GRAD_REASON)


def test_several_steps_of_sgd_track_eager():
    torch.manual_seed(3)
    model = Embeddings()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="infinifuse")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _step in range(3):
        ids = rand_ids(V, (2, 7))
        for o in (opt, opt_ref):
            o.zero_grad()
        _train_step(model, ids, compiled)
        _train_step(reference, ids)
        opt.step()
        opt_ref.step()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, p_ref, msg=lambda m, name=name: f"{name}: {m}")


def test_same_model_fuses_for_inference_after_training():
    torch.manual_seed(4)
    model = Embeddings()
    compiled = torch.compile(model, backend="infinifuse", options={"validate": False})
    ids = rand_ids(V, (2, 5))
    _train_step(model, ids, compiled)
    assert fusebackend.last_report().graphs[0].path.startswith(GRAD_REASON)

    with torch.no_grad():
        out = compiled(ids)
        expected = model(ids)
    report = fusebackend.last_report()
    assert_fused(report)
    assert len(report.groups[0].lookups) == 2
    assert_close(out, expected)
    assert not out.requires_grad


def test_grad_enabled_without_trainable_inputs_still_fuses():
    # Gradients are needed only when some input requires grad.
    torch.manual_seed(5)
    model = Embeddings().requires_grad_(False)
    compiled = torch.compile(model, backend="infinifuse", options={"validate": False})
    ids = rand_ids(V, (2, 5))
    assert torch.is_grad_enabled()
    out = compiled(ids)
    assert_fused(fusebackend.last_report())
    assert_close(out, model(ids))


def test_inference_mode_fuses_and_then_training_still_gets_gradients():
    # inference_mode is the usual serving context; its outputs are inference tensors. The
    # same compiled model must still train afterwards (a grad-mode guard recompiles).
    torch.manual_seed(6)
    model = Embeddings()
    compiled = torch.compile(model, backend="infinifuse", options={"validate": False})
    ids = rand_ids(V, (3, 7))
    with torch.inference_mode():
        out = compiled(ids)
        expected = model(ids)
    assert_fused(fusebackend.last_report())
    assert out.is_inference() and not out.requires_grad
    assert_close(out, expected)

    reference = copy.deepcopy(model)
    _train_step(model, ids, compiled)
    assert fusebackend.last_report().graphs[-1].path.startswith(GRAD_REASON)
    _train_step(reference, ids)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, p_ref.grad, msg=lambda m, name=name: f"{name}: {m}")
