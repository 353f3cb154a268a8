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

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from helpers import assert_close, assert_fused, eager, run_fused, single_group
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

V = 13


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
