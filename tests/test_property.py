"""Property test: random elementwise chains after an embedding lookup, fused, equal eager.

Each example draws a table dtype, an index dtype and shape, a row width and a chain of 1-6
steps (ops of the table with random scalars or random broadcast tensor operands), compiles
it with infinifuse, proves the whole chain became one group, and compares with eager.

The step set keeps magnitudes and condition numbers bounded (scalars in [-2, 2]; sin, cos
and exp see inputs clamped to |x| <= 1.5 or x <= 1, where an input off by one ulp moves the
output by at most about one ulp) so that the few-ulp differences the tolerances allow are not
amplified past them (with bf16 the Triton interpreter truncates instead of rounding to
nearest, so each bf16 value may already be one ulp off; see helpers.TOLERANCES); ops whose
domain can produce NaN are applied to a non-negative value (log1p-style composites), and
comparisons use equal_nan=True for the NaN/Inf an overflow could produce on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from helpers import assert_close, assert_fused, eager, run_fused, single_group
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

V = 13
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (round toward zero), NaN kept NaN."""
    bits = x.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    return torch.where(x.isnan(), x, bits.view(torch.float32)).to(torch.bfloat16)


class _InterpretersBf16(TorchFunctionMode):
    """Eager bf16 as Triton's interpreter computes it (helpers.py: it converts fp32 to bf16
    by truncation): each op whose result is bf16 runs on fp32 copies of its bf16 operands
    and its result is truncated to bf16, so a chain of several ops (four GELUs, then a
    clamp at the edge of its range) cannot drift past the tolerance by one truncation per
    op. Casts into bf16 (from another dtype) round to nearest: one ulp, within it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        is_bf16 = lambda t: isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16  # noqa: E731
        if not any(map(is_bf16, torch.utils._pytree.tree_leaves((args, kwargs)))):
            return result
        if not any(map(is_bf16, torch.utils._pytree.tree_leaves(result))):
            return result
        wide = tree_map(lambda t: t.float() if is_bf16(t) else t, (args, kwargs))
        widened = func(*wide[0], **wide[1])
        return tree_map(
            lambda r, w: _truncated(w) if is_bf16(r) and w.dtype == torch.float32 else r,
            result, widened,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    apply: Callable  # apply(x, operands) -> tensor
    nodes: int  # FX nodes this step adds to the group
    operand: str | None = None  # "row" [D], "full" like x, "col" [..., 1]: drawn per example

    def __repr__(self) -> str:  # hypothesis prints falsifying examples with this
        return self.name


scalars = st.floats(-2.0, 2.0, allow_nan=False, width=32).map(lambda v: round(v, 3))
nonzero = st.floats(0.25, 2.0, width=32).map(lambda v: round(v, 3)) | st.floats(
    -2.0, -0.25, width=32
).map(lambda v: round(v, 3))


def _unary(name, fn, nodes=1):
    return st.just(Step(name, lambda x, ops: fn(x), nodes))


def _tensor(name, fn, kind):
    return st.just(Step(f"{name}[{kind}]", lambda x, ops: fn(x, ops[kind]), 1, kind))


kinds = st.sampled_from(["row", "full", "col"])

steps = st.one_of(
    scalars.map(lambda s: Step(f"add({s})", lambda x, ops: x + s, 1)),
    scalars.map(lambda s: Step(f"sub({s})", lambda x, ops: torch.sub(x, s), 1)),
    scalars.map(lambda s: Step(f"rsub({s})", lambda x, ops: s - x, 1)),
    scalars.map(lambda s: Step(f"mul({s})", lambda x, ops: x * s, 1)),
    nonzero.map(lambda s: Step(f"div({s})", lambda x, ops: x / s, 1)),
    st.tuples(scalars, scalars).map(
        lambda p: Step(f"add_alpha({p})", lambda x, ops: torch.add(x, p[0], alpha=p[1]), 1)
    ),
    _unary("neg", lambda x: -x),
    _unary("abs", torch.abs),
    _unary("relu", F.relu),
    _unary("sigmoid", torch.sigmoid),
    _unary("tanh", torch.tanh),
    _unary("erf", torch.erf),
    _unary("gelu", F.gelu),
    _unary("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    _unary("silu", F.silu),
    _unary("sin_clamped", lambda x: torch.sin(x.clamp(-1.5, 1.5)), 2),
    _unary("cos_clamped", lambda x: torch.cos(x.clamp(-1.5, 1.5)), 2),
    _unary("exp_clamped", lambda x: torch.exp(x.clamp(max=1.0)), 2),
    _unary("log_abs_plus_1", lambda x: torch.log(x.abs() + 1.0), 3),
    _unary("sqrt_relu_plus", lambda x: torch.sqrt(F.relu(x) + 0.1), 3),
    _unary("square_tanh", lambda x: torch.tanh(x) ** 2, 2),
    _unary("reciprocal_shifted", lambda x: 1.0 / (x.abs() + 0.5), 3),
    st.floats(0.0, 0.5).map(
        lambda s: Step(f"leaky({s:.2f})", lambda x, ops: F.leaky_relu(x, s), 1)
    ),
    st.tuples(scalars, scalars).map(
        lambda p: Step(
            f"clamp{tuple(sorted(p))}",
            lambda x, ops: x.clamp(min(p), max(p)),
            1,
        )
    ),
    scalars.map(lambda s: Step(f"clamp_min({s})", lambda x, ops: x.clamp(min=s), 1)),
    scalars.map(lambda s: Step(f"clamp_max({s})", lambda x, ops: torch.clamp_max(x, s), 1)),
    st.tuples(scalars, scalars).map(
        lambda p: Step(
            f"hardtanh{tuple(sorted(p))}",
            lambda x, ops: F.hardtanh(x, min(p) - 0.01, max(p) + 0.01),
            1,
        )
    ),
    st.tuples(scalars, scalars).map(
        lambda p: Step(
            f"where(x>{p[0]},x,{p[1]})", lambda x, ops: torch.where(x > p[0], x, p[1]), 2
        )
    ),
    kinds.flatmap(lambda k: _tensor("add_t", lambda x, t: x + t, k)),
    kinds.flatmap(lambda k: _tensor("sub_t", lambda x, t: t - x, k)),
    kinds.flatmap(lambda k: _tensor("mul_t", lambda x, t: x * t, k)),
    kinds.flatmap(lambda k: _tensor("max_t", torch.maximum, k)),
    kinds.flatmap(lambda k: _tensor("min_t", lambda x, t: torch.minimum(t, x), k)),
    kinds.flatmap(
        lambda k: st.just(
            Step(
                f"where_t[{k}]",
                lambda x, ops, k=k: torch.where(x < ops[k], ops[k], x),
                2,
                k,
            )
        )
    ),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]).map(
        lambda dt: Step(f"to({dt})", lambda x, ops: x.to(dt), 1)
    ),
)

index_shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(1, 9)),
    st.tuples(st.integers(1, 3), st.integers(1, 6)),
    st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)),
)


@dataclasses.dataclass
class Case:
    dtype: torch.dtype
    index_dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int
    chain: list[Step]
    also_return_first: bool
    seed: int


cases = st.builds(
    Case,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    shape=index_shapes,
    dim=st.sampled_from([1, 2, 3, 5, 8, 17, 33]),
    chain=st.lists(steps, min_size=1, max_size=6),
    also_return_first=st.booleans(),
    seed=st.integers(0, 2**16),
)


def _operands(case: Case, g: torch.Generator) -> dict[str, torch.Tensor]:
    full = (*case.shape, case.dim)

    def rand(*shape):
        mag = torch.rand(*shape, generator=g) * 2.0 + 0.05
        sign = torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)
        return (mag * sign).to(case.dtype)

    return {
        "row": rand(case.dim),
        "full": rand(*full),
        "col": rand(*case.shape, 1) if case.shape else rand(1),
    }


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases)
def test_random_chains_match_eager(case: Case):
    torch._dynamo.reset()  # every example is a new function: compile from scratch
    g = torch.Generator().manual_seed(case.seed)
    mag = torch.rand(V, case.dim, generator=g) * 2.0 + 0.05
    table = (mag * torch.where(torch.rand(V, case.dim, generator=g) < 0.5, -1.0, 1.0)).to(
        case.dtype
    )
    ids = torch.randint(0, V, case.shape, generator=g).to(case.index_dtype)
    operands = _operands(case, g)
    chain = list(case.chain)

    def fn(ids, table, row, full, col):
        ops = {"row": row, "full": full, "col": col}
        x = F.embedding(ids, table)
        first = None
        for step in chain:
            x = step.apply(x, ops)
            first = x if first is None else first
        return (x, first) if case.also_return_first else x

    args = (ids, table, operands["row"], operands["full"], operands["col"])
    with _InterpretersBf16() if _INTERPRETED else contextlib.nullcontext():
        expected = eager(fn, *args)
    actual, report = run_fused(fn, *args, expect_fused=False)

    # The tolerance of the narrowest float dtype the chain went through.
    narrowest = [case.dtype] + [s for s in (_cast_target(step) for step in chain) if s is not None]
    floor = max(narrowest, key=lambda dt: {torch.float32: 0, torch.float16: 1}.get(dt, 2))
    assert_close(actual, expected, equal_nan=True, floor_dtype=floor)

    if all(_cast_target(step) == case.dtype for step in chain):
        # the lookup and casts to the dtype it has (eager returns the tensor itself): one
        # eager kernel, so nothing is worth fusing
        assert report.groups == [], str(report)
        return
    assert_fused(report)
    group = single_group(report)
    assert len(group.nodes) == 1 + sum(step.nodes for step in chain), str(report)
    assert report.rejections == [], str(report)


def _cast_target(step: Step) -> torch.dtype | None:
    if step.name.startswith("to("):
        return getattr(torch, step.name[len("to(torch.") : -1])
    return None


# --- row chains: elementwise steps mixed with reductions, norms, softmax and rotate_half ------
#
# x is an input of shape lead + [D] (0 rows included); each row step reads the chain's value
# and external operands only: a keepdim last-dim reduction folded back into the row
# (x - mean, x * tanh(amax), ...), residual add + norm (F.layer_norm, F.rms_norm,
# transformers' decomposed RMSNorm: the residual keeps the row's spread ~1, so the norm does
# not amplify one ulp of difference, see test_fuzz's row section), softmax / log_softmax with
# a scale and an additive mask, and rotary embeddings of an input q (rotate_half by slices or
# chunk). The whole chain must be ONE group with every row step's reduction or move in it.
# Tolerances: test_fuzz.row_tolerance (fp32 1e-4; fp16 atol 2e-2; bf16 atol 0.0625).


def _reduce_step(name, fn, how):
    return Step(
        f"row:{name}->{how}",
        lambda x, ops: {
            "sub": lambda r: x - r,
            "mul_tanh": lambda r: x * torch.tanh(r),
            "div": lambda r: x / (r.abs() + 1.0),
        }[how](fn(x)),
        1,
    )


def _reduce(name, fn):
    return st.sampled_from(["sub", "mul_tanh", "div"]).map(lambda how: _reduce_step(name, fn, how))


def _rms_decomposed(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _norm(name, fn):
    return st.just(Step(f"row:residual+{name}", lambda x, ops: fn(x + ops["full"], ops), 1))


def _rotate(q, form):
    if form == "chunk" and q.shape[-1] > 1:
        a, b = q.chunk(2, dim=-1)
    else:
        a, b = q[..., : q.shape[-1] // 2], q[..., q.shape[-1] // 2 :]
    return torch.cat((-b, a), dim=-1)


def _rope(form: str) -> Step:
    # Every rope step rotates the same input q: two steps share one rotation (the
    # common-values pass computes it once), so the test counts the rotation once.
    return Step(
        f"row:rope_{form}",
        lambda x, ops: x * ops["cos"] + _rotate(ops["q"], form) * ops["sin"],
        1,
    )


row_steps = st.one_of(
    _reduce("sum/D", lambda x: x.sum(-1, keepdim=True) * (1.0 / max(x.shape[-1], 1))),
    _reduce("mean", lambda x: x.mean(-1, keepdim=True)),
    _reduce("amax", lambda x: x.amax(-1, keepdim=True)),
    _reduce("amin", lambda x: x.amin(-1, keepdim=True)),
    _reduce("var", lambda x: x.var(-1, keepdim=True, unbiased=False)),
    _norm("layer_norm", lambda x, o: F.layer_norm(x, x.shape[-1:], o["w"], o["b"], 1e-5)),
    _norm("rms_norm", lambda x, o: F.rms_norm(x, x.shape[-1:], o["w"], 1e-6)),
    _norm("rms_decomposed", lambda x, o: _rms_decomposed(x, o["w"])),
    st.tuples(st.floats(0.1, 2.0).map(lambda v: round(v, 3)), st.booleans(), st.booleans()).map(
        lambda p: Step(
            f"row:{'log_' if p[1] else ''}softmax(x*{p[0]}{' + mask' if p[2] else ''})",
            lambda x, ops: (torch.log_softmax if p[1] else torch.softmax)(
                x * p[0] + (ops["mask"] if p[2] else 0.0), -1
            ),
            1,
        )
    ),
    st.sampled_from(["slices", "chunk"]).map(lambda form: _rope(form)),
)


@dataclasses.dataclass
class RowChainCase:
    dtype: torch.dtype
    lead: tuple[int, ...]
    dim: int
    first: Step  # a row step: every chain has one
    chain: list[Step]
    seed: int


row_cases = st.builds(
    RowChainCase,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    lead=st.one_of(
        st.tuples(st.integers(0, 4)),
        st.tuples(st.integers(1, 3), st.integers(1, 4)),
        st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3)),
    ),
    dim=st.sampled_from([1, 2, 7, 16, 33, 128]),
    first=row_steps,
    chain=st.lists(st.one_of(steps, row_steps, row_steps), max_size=4),
    seed=st.integers(0, 2**16),
)


def _row_operands(case: RowChainCase, g: torch.Generator) -> dict[str, torch.Tensor]:
    full, d = (*case.lead, case.dim), case.dim

    def rand(*shape, scale=1.0):
        mag = torch.rand(*shape, generator=g) * 2.0 + 0.05
        sign = torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)
        return (mag * sign * scale).to(case.dtype)

    keep = torch.rand(*case.lead[:-1], 1, d, generator=g) < 0.7
    keep[..., 0] = True
    angles = torch.rand(d, generator=g) * 6.3
    return {
        "row": rand(d), "full": rand(*full), "col": rand(*case.lead, 1), "q": rand(*full),
        "w": rand(d, scale=0.5), "b": rand(d, scale=0.5),
        "cos": angles.cos().to(case.dtype), "sin": angles.sin().to(case.dtype),
        "mask": torch.zeros(keep.shape, dtype=case.dtype).masked_fill(
            ~keep, torch.finfo(case.dtype).min
        ),
    }  # fmt: skip


# CI draws 150 examples (~17 s); FUSEBACKEND_ROW_EXAMPLES=2000 for a longer search.
@settings(
    max_examples=int(os.environ.get("FUSEBACKEND_ROW_EXAMPLES", "150")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=row_cases)
@example(  # CI found it: two rope steps, one rotation of q
    case=RowChainCase(torch.float32, (3,), 2, _rope("slices"), [_rope("slices")], seed=0)
)
@example(  # and a cancellation then x / 0.25 twice: one bf16 ulp made 16
    case=RowChainCase(
        torch.bfloat16,
        (3,),
        7,
        _reduce_step("mean", lambda x: x.mean(-1, keepdim=True), "sub"),
        [Step("div(0.25)", lambda x, ops: x / 0.25, 1)] * 2,
        seed=0,
    )
)
def test_random_row_chains_match_eager(case: RowChainCase):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(case.seed)
    x = torch.tanh(torch.randn(*case.lead, case.dim, generator=g) * 1.5).to(case.dtype) * 2.0
    operands = _row_operands(case, g)
    chain = [case.first, *case.chain]
    names = sorted(operands)

    def fn(x, *tensors):
        ops = dict(zip(names, tensors))
        for step in chain:
            # a value past 2.5 is read through tanh (bf16: one ulp at 2.5 is 2e-2, the
            # tolerance; larger values would let the next op amplify one ulp past it)
            x = step.apply(torch.tanh(x) * 2.0 if step.name.startswith("row:") else x, ops)
        return x

    args = (x, *(operands[n] for n in names))
    # bf16 on the interpreter: eager with its truncating rounding, as the chains above (a
    # reduction's one-ulp cancellation, then x / 0.25 twice, is 16 ulps; found by CI)
    with _InterpretersBf16() if _INTERPRETED else contextlib.nullcontext():
        expected = eager(fn, *args)
    actual, report = run_fused(fn, *args)
    casts = [c for c in (_cast_target(s) for s in chain) if c is not None]
    narrowest = max([case.dtype, *casts], key=lambda dt: NARROW.get(dt, 2))
    assert_close(actual, expected, equal_nan=True, **_row_tolerance(narrowest))
    group = single_group(report)
    # Every row step's reduction or rotation is in the group. At D = 1 rotate_half is
    # cat((-q, q[..., :0])), which rotation.py does not take for a rotation ("a cat of slices
    # that do not rotate one tensor's columns"): the cat stays eager, its product joins.
    rows = [s for s in chain if s.name.startswith("row:") and "rope" not in s.name]
    rotations = any("rope" in s.name for s in chain) and case.dim > 1
    assert len(group.reductions) + len(group.moves) >= len(rows) + rotations, str(report)


NARROW = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _row_tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
        torch.float16: {"rtol": 1e-2, "atol": 2e-2},
        torch.bfloat16: {"rtol": 2e-2, "atol": 0.0625},
    }[dtype]
