"""Work on parameters and buffers alone, done once (passes/parameter_work.py).

Swin's relative position bias (a table gathered by a buffer of indices, permuted and made
contiguous in every block) and a weight-normed linear are folded into derived tensors: the
report lists them, outputs equal eager's, and an in-place edit or ``load_state_dict`` after
compiling gives eager's new result. Views of weights, elementwise work a row group takes in,
graph outputs, written buffers and tensors past the size cap stay as traced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, compile_fused

import fusebackend
from fusebackend.passes import parameter_work


class WindowAttention(nn.Module):
    """timm Swin's attention bias: a table of (2w-1)^2 x heads gathered by a buffer."""

    def __init__(self, width: int = 16, heads: int = 2, window: int = 3) -> None:
        super().__init__()
        self.heads, self.area = heads, window * window
        self.qkv = nn.Linear(width, 3 * width)
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                            indexing="ij")).flatten(1)  # fmt: skip
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", relative[..., 0] * (2 * window - 1) + relative[..., 1])

    def bias(self) -> torch.Tensor:
        bias = self.table[self.index.view(-1)].view(self.area, self.area, -1)
        return bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * 0.5) @ k.transpose(-2, -1) + self.bias()
        return (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


class WeightNormed(nn.Module):
    """A linear layer whose weight is g * v / ||v|| on every call (weight normalization)."""

    def __init__(self, width: int = 12, out: int = 10) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(out, width))
        self.g = nn.Parameter(torch.rand(out, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.g * self.v / torch.linalg.vector_norm(self.v, dim=1, keepdim=True))


def _folded() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("parameter_work", [])


def _derived_then_edited(model: nn.Module, x: torch.Tensor, edit) -> list[str]:
    """Compile ``model``, compare a call with eager's, ``edit(model)`` in place and compare
    again (the derived tensors must follow); the nodes whose work was folded."""
    compiled = compile_fused(model)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
        folded = _folded()
        edit(model)
        assert_close(compiled(x), model(x))
    return folded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_relative_position_bias_is_derived_once_and_follows_edits(dtype):
    torch.manual_seed(0)
    model = WindowAttention().eval().to(dtype)
    x = torch.randn(3, 9, 16, dtype=dtype)
    compiled = compile_fused(model)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
        assert len(_folded()) == 1, str(fusebackend.last_report())
        model.table.mul_(-2.0).add_(1.0)  # an in-place edit after compiling
        assert_close(compiled(x), model(x))
        state = {k: torch.randn_like(v) if k == "table" else v
                 for k, v in model.state_dict().items()}  # fmt: skip
        model.load_state_dict(state)
        assert_close(compiled(x), model(x))


def test_weight_normed_linear_is_derived_once_and_follows_edits():
    torch.manual_seed(1)
    folded = _derived_then_edited(WeightNormed().eval(), torch.randn(4, 5, 12),
                                  lambda model: model.g.mul_(3.0))  # fmt: skip
    assert len(folded) == 1, str(fusebackend.last_report())


class SinusoidalRotary(nn.Module):
    """GPT-J's attention: a buffer of sines and cosines gathered by position ids built from
    Python values (a constant at static lengths), split, each column repeated twice."""

    def __init__(self, positions: int = 32, half: int = 4) -> None:
        super().__init__()
        angles = torch.arange(positions)[:, None] / 10.0 ** (torch.arange(half) / half)
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], -1)[None])

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(q.shape[1], device=q.device)[None, :, None].repeat(1, 1, 8)
        sin, cos = torch.split(torch.gather(self.table, 1, ids), 4, dim=-1)
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return q * cos + q.flip(-1) * sin


def test_work_on_a_buffer_and_constants_is_derived_once_and_follows_edits():
    # The gather reads a constant (the position ids) beside the buffer: the whole chain, to
    # the two repeats, is derived; an in-place edit of the buffer derives it again.
    folded = _derived_then_edited(SinusoidalRotary().eval(), torch.randn(2, 7, 3, 8),
                                  lambda model: model.table.mul_(-0.5))  # fmt: skip
    assert folded == ["sin_1", "cos_1"], folded  # the repeats


def test_what_is_left_as_traced():
    w = nn.Parameter(torch.randn(6, 8))
    scale = nn.Parameter(torch.rand(8) + 0.5)

    def views_and_groups(x):
        # a view of a weight, and elementwise work the row group of its reader takes in
        return x @ w.t(), torch.sigmoid(x * (1.0 + scale))

    def an_output(x):
        return x + 1.0, w.t().contiguous()  # returned: never a tensor the backend owns

    x = torch.randn(3, 8)
    for fn in (views_and_groups, an_output):
        torch._dynamo.reset()
        with torch.no_grad():
            assert_close(compile_fused(fn)(x), fn(x))
        assert _folded() == [], (fn.__name__, str(fusebackend.last_report()))


def test_a_buffer_the_graph_writes_and_the_size_cap(monkeypatch):
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(4, 4))
            self.table = nn.Parameter(torch.randn(5, 4))
            self.register_buffer("index", torch.tensor([4, 0, 2]))

        def forward(self, x):
            self.count.add_(1.0)
            return x @ self.count.t().contiguous() + self.table[self.index].sum(0)

    torch.manual_seed(2)
    model = Counter()
    twin = Counter()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    compiled = compile_fused(model)
    with torch.no_grad():
        for _ in range(2):
            assert_close(compiled(x), twin(x))
    assert _folded() == ["sum_1"], str(fusebackend.last_report())  # the gather, not count
    torch._dynamo.reset()
    monkeypatch.setattr(parameter_work, "MAX_BYTES", 8)
    model.load_state_dict(twin.state_dict())
    compiled = compile_fused(model)
    with torch.no_grad():
        assert_close(compiled(x), twin(x))
    assert _folded() == [], str(fusebackend.last_report())


class WrittenAfterMade(nn.Module):
    """BEiT's relative position index, built in forward: a tensor of constants written in
    place through views after it is made, then summed and used to gather a table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.arange(3)
        rel = (a[:, None, None] - a[None, :, None]).expand(3, 3, 2).contiguous()
        rel[:, :, 0] += 3
        rel[:, :, 0] *= 2
        bias = self.table[rel.sum(-1).view(-1)].view(9, 8)
        return F.layer_norm(x + bias, (8,))


class ExpandedFrequencies(nn.Module):
    """transformers' rotary embedding: inv_freq[None, :, None] expanded to the batch of the
    position ids (stride 0 along the batch), multiplied by them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1).to(x.device)
        freqs = (inv @ positions[:, None, :].float()).transpose(1, 2)
        return x * torch.cat((freqs, freqs), dim=-1).cos()


def test_a_value_the_graph_writes_after_making_it_is_not_folded():
    # Folded, the sum would read the index as made, before the writes (found on BEiT by a
    # sweep of architectures, 2026-11-30: validation refused every signature)
    torch.manual_seed(3)
    model = WrittenAfterMade().eval()
    x = torch.randn(2, 9, 8)
    with torch.no_grad():
        assert_close(compile_fused(model)(x), model(x))


def test_an_expanded_value_is_left_as_traced():
    # Its buffer would have a stride 0, which no copy can write: the compile raised at a
    # batch of 2 (transformers' generate() at batch 2 in every rotary family, 2026-11-30)
    model = ExpandedFrequencies().eval()
    x = torch.randn(2, 5, 8)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        assert_close(compile_fused(model)(x, positions), model(x, positions))
    assert _folded() == [], str(fusebackend.last_report())


class SplitRotaryTable(nn.Module):
    """timm's EVA-02 rotary embedding: sines and cosines of a buffer concatenated once,
    then ``tensor_split`` in two (a node whose value is a tuple) in every attention."""

    def __init__(self, positions: int = 7, half: int = 4) -> None:
        super().__init__()
        angles = torch.arange(positions)[:, None] / 10.0 ** (torch.arange(half) / half)
        self.register_buffer("angles", angles)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        emb = torch.cat([self.angles.sin(), self.angles.cos()], -1)
        sin, cos = emb.tensor_split(2, -1)
        return q * cos + q.flip(-1) * sin


def test_a_split_of_derived_work_reads_the_derived_tensor():
    # The concatenation is derived; its split (a tuple of views) stays as traced. The compile
    # raised on the tuple before (found on timm's eva02_tiny_patch14_224 by
    # benchmarks/diag/diag_model_sweep.py, 2026-11-30)
    torch.manual_seed(4)
    folded = _derived_then_edited(SplitRotaryTable().eval(), torch.randn(2, 7, 4),
                                  lambda model: model.angles.mul_(-0.5))  # fmt: skip
    assert len(folded) == 1, str(fusebackend.last_report())  # the concatenation


class BufferMaxima(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, _ = self.table.max(dim=0)  # a tuple-valued op that is no view
        return x @ values[:, None]


def test_a_tuple_valued_op_on_a_buffer_compiles():
    torch.manual_seed(5)
    model = BufferMaxima().eval()
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert_close(compile_fused(model)(x), model(x))
