"""First-run validation: is the fused graph's result the unfused graph's, within tolerance?
(``mismatch``), and a new signature's fused run, compared when asked (``fused_run``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.effects import Effects, RngState

log = logging.getLogger(__name__)

__all__ = [
    "ELEMENT_FRACTION",
    "NOISE_CAP",
    "NOISE_SHARE",
    "ROW_SLACK",
    "TOLERANCES",
    "fused_run",
    "input_noise",
    "mismatch",
    "one_line",
]

# Per-dtype (rtol, atol) for the first-run comparison of fused against unfused outputs.
# Floating tensors are compared by norm, over the whole tensor and over each row (last dim):
# ||fused - unfused|| <= rtol * ||unfused|| + atol * sqrt(numel). An element-wise check was
# too strict: the fused kernels compute in fp32 and round once where eager rounds every op,
# and over a 22-layer fp16 Llama those differences grow. On an H100 (2026-11-23) it rejected
# a correct fused decode step over 1 logit of 32000 that was 0.0115 apart, and Inductor's
# own logits differ from eager's by 2.9e-3 relative on that model. Per row (with ROW_SLACK
# times rtol: a short row, such as a head of 64 in a KV cache, spreads more than a whole
# tensor), because a wrong row (unwritten, scaled) hides in the norm of a large tensor.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-9),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-9),
}
ROW_SLACK = 4
# On top of the norms, no element may be off by more than this fraction of its row's
# largest magnitude (plus atol): a few wrong elements hide in a row's norm. The H100 case
# above: 0.09 apart at most, in rows whose largest logit is about 4 (2.4%).
ELEMENT_FRACTION = 0.05
# Some models amplify rounding far past these bounds: timm RegNetY-016 in fp16 (calibrated
# BatchNorms, H200, 2026-11-28, benchmarks/diag/diag_fp16_noise.py) moves its logits by 7.4%
# of their norm when the image moves by one ulp, eager fp16 is 5.5% from eager fp32, and
# Inductor's logits are 4.1% from eager's; the fused graph was 1.9% from the unfused one, and
# 5.4% from fp32 (closer than eager). Where a fused graph fails the bounds above, the unfused
# graph runs once more on inputs moved by one ulp (``input_noise``), and each bound of an
# output (the norm's rtol and an element's fraction of its row's largest magnitude) becomes
# at least NOISE_SHARE of how far that moved it. An output noisier than NOISE_CAP (or with a
# zero norm: infinite noise) keeps the fixed bounds: a wrong kernel moves an output by its
# whole norm, far past the noise of any model whose result means something. The cap was 0.1
# until timm Inception-v3 in fp16 (calibrated BatchNorms, H200, 2026-11-28, 015bb9f) moved
# 15% for one ulp of its image, and its fused graph, 2.4% from the unfused one, ran unfused
# (2.19 ms a call at batch 1 against reduce-overhead's 1.47): with 0.25 the widest bound is
# 12.5% of an output's norm.
NOISE_SHARE = 0.5
NOISE_CAP = 0.25
_NOISE_INPUT_BYTES = 1 << 28  # the inputs moved: copies, so only where they are this small
# A fused graph may round differently from the unfused one and be the more accurate of the
# two: BatchNorms folded into half-precision weights (``passes/conv_activation.py``) skip
# eager's cancellation of the rounded convolution output against the running mean. timm
# ResNet-50 in fp16 with calibrated BatchNorms (CPU, 2026-11-30): folded 3.4% of the logits'
# norm from eager fp16, past the noise bound (one ulp of the image moves eager 3.1%), and 2.2%
# from fp32 where eager fp16 is 2.9%. Where both bounds above fail, a half-precision graph
# runs once more unfused on float32 copies of its half-precision inputs (parameters too, up
# to _WIDE_INPUT_BYTES): the fused graph passes where each half-precision output is no
# farther from that result than the unfused graph's is, times WIDE_SLACK, and every other
# output matches as before. A wrong kernel lands as far from float32 as from eager.
WIDE_SLACK = 1.25
_WIDE_INPUT_BYTES = 1 << 30
_HALF = (torch.float16, torch.bfloat16)


def mismatch(
    actual: Sequence[Any], expected: Sequence[Any], what: str,
    noise: Sequence[float] | None = None,
) -> str | None:  # fmt: skip
    """Why ``actual`` is not ``expected`` within the per-dtype tolerances, or None.

    NaN must meet NaN and an infinity the infinity of the same sign, at the same positions.
    Dtypes without a tolerance (integers, bool) must be equal. ``noise`` (per output, from
    ``input_noise``) widens the bounds of noisy outputs (NOISE_SHARE).
    """
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for j, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, Tensor):
            if not isinstance(a, Tensor):
                return f"{what} {j} is a {type(a).__name__}, expected a tensor"
            why = _tensor_mismatch(a, e, 0.0 if noise is None else noise[j])
            if why is not None:
                return f"{what} {j}: {why}"
        elif isinstance(a, Tensor) or a != e:
            return f"{what} {j} is {a!r}, expected {e!r}"
    return None


def _tensor_mismatch(a: Tensor, e: Tensor, noise: float = 0.0) -> str | None:
    if a.shape != e.shape or a.dtype != e.dtype or a.device != e.device:
        return (
            f"{a.dtype}{list(a.shape)} on {a.device}, expected {e.dtype}{list(e.shape)} "
            f"on {e.device}"
        )
    if e.dtype not in TOLERANCES:
        return None if torch.equal(a, e) else f"not equal ({e.dtype} is compared exactly)"
    if e.numel() == 0:
        return None
    try:
        rtol, atol = TOLERANCES[e.dtype]
        noise = noise if noise <= NOISE_CAP else 0.0
        return _float_mismatch(a.detach(), e.detach(), max(rtol, NOISE_SHARE * noise), atol,
                               max(ELEMENT_FRACTION, NOISE_SHARE * noise))  # fmt: skip
    except torch.OutOfMemoryError:
        # The comparison needs a few temporaries of the output's size; without the memory,
        # the fused graph is not trusted (and the caller's call still succeeds).
        return "could not be compared: out of memory"


def _float_mismatch(
    a: Tensor, e: Tensor, rtol: float, atol: float, fraction: float = ELEMENT_FRACTION
) -> str | None:
    # NaN must meet NaN, an infinity the same infinity: compared as values where either
    # is not finite (NaN != NaN, so through the NaN masks).
    finite = torch.isfinite(e) & torch.isfinite(a)
    if not torch.equal(a.isnan(), e.isnan()):
        return "NaN at other positions"
    if not torch.equal(
        torch.where(a.isnan() | finite, 0, a), torch.where(e.isnan() | finite, 0, e)
    ):
        return "infinity at other positions or of another sign"
    # fp32 temporaries (fp64 for fp64): the bounds above are far above fp32's rounding.
    wide = torch.promote_types(e.dtype, torch.float32)
    rows = e.reshape(-1, e.shape[-1]) if e.dim() > 0 else e.reshape(1, 1)
    # abs() out of place: complex tensors have no in-place abs (their magnitude is real)
    diff = torch.where(finite, a.to(wide) - e.to(wide), 0).reshape(rows.shape).abs()
    ref = torch.where(finite, e, 0).to(wide).reshape(rows.shape).abs()
    diff_norm, ref_norm = diff.norm().item(), ref.norm().item()
    if diff_norm > rtol * ref_norm + atol * diff.numel() ** 0.5:
        return f"relative difference {_ratio(diff_norm, ref_norm):.3g} (norm; up to {rtol:g})"
    row_diff, row_ref = diff.norm(dim=-1), ref.norm(dim=-1)
    row_rtol = ROW_SLACK * rtol
    bad = row_diff > row_rtol * row_ref + atol * rows.shape[-1] ** 0.5
    if bad.any():
        r = int(bad.nonzero()[0, 0])
        ratio = _ratio(row_diff[r].item(), row_ref[r].item())
        return f"row {r}: relative difference {ratio:.3g} (norm; up to {row_rtol:g})"
    bound = fraction * ref.amax(dim=-1, keepdim=True) + atol
    far = diff > bound
    if far.any():
        r, c = (int(i) for i in far.nonzero()[0])
        return (
            f"row {r}: one element {diff[r, c].item():.3g} apart (up to {bound[r, 0].item():.3g}: "
            f"{fraction:g} of the row's largest magnitude)"
        )
    return None


def input_noise(
    unfused: Callable[..., Sequence[Any]], args: Sequence[Any], expected: Sequence[Any]
) -> list[float] | None:
    """Per output of ``unfused``, how far (relative, by norm) moving each floating input that
    is not a parameter by one ulp (seeded random signs) moves it from ``expected``; None where
    no input moves or the moved copies would pass ``_NOISE_INPUT_BYTES``. The caller puts the
    random generators back (a graph with dropout draws again)."""
    try:
        return _input_noise(unfused, args, expected)
    except Exception:  # noqa: BLE001  (a graph that cannot run on moved inputs: no noise)
        return None


def _input_noise(
    unfused: Callable[..., Sequence[Any]], args: Sequence[Any], expected: Sequence[Any]
) -> list[float] | None:
    moved, size = list(args), 0
    for i, x in enumerate(args):
        if type(x) is not Tensor or not x.is_floating_point() or x.numel() == 0:
            continue  # (parameters, integer ids, subclasses such as DTensor: as they are)
        if x.element_size() == 1:
            continue  # (fp8: no arithmetic on the CPU; its ulp is coarse anyway)
        size += x.numel() * x.element_size()
        if size > _NOISE_INPUT_BYTES:
            return None
        generator = torch.Generator(device=x.device).manual_seed(i)
        sign = torch.randint(0, 2, x.shape, generator=generator, device=x.device)
        moved[i] = x.detach() * (1 + torch.finfo(x.dtype).eps * (2 * sign - 1).to(x.dtype))
    if size == 0:
        return None
    noise = []
    for out, e in zip(unfused(*moved), expected, strict=True):
        if isinstance(e, Tensor) and e.is_floating_point() and e.numel():
            ref = e.detach().to(torch.promote_types(e.dtype, torch.float32))
            diff = (out.detach().to(ref.dtype) - ref).nan_to_num(0.0).norm().item()
            noise.append(_ratio(diff, ref.nan_to_num(0.0).norm().item()))
        else:
            noise.append(0.0)
    return noise


def nearer_wide_result(
    unfused: Callable[..., Sequence[Any]], args: Sequence[Any],
    actual: Sequence[Any], expected: Sequence[Any],
) -> bool:  # fmt: skip
    """Is each half-precision output of the fused run (``actual``) no farther from the
    unfused graph's float32 result than the unfused outputs (``expected``) are, times
    WIDE_SLACK, with every other output matching? False where no input is half precision, the
    float32 copies would pass ``_WIDE_INPUT_BYTES`` or the graph cannot run on them."""
    try:
        return _nearer_wide_result(unfused, args, actual, expected)
    except Exception:  # noqa: BLE001  (a graph that refuses float32 inputs: no verdict)
        return False


def _nearer_wide_result(
    unfused: Callable[..., Sequence[Any]], args: Sequence[Any],
    actual: Sequence[Any], expected: Sequence[Any],
) -> bool:  # fmt: skip
    wide_args, size = list(args), 0
    for i, x in enumerate(args):
        if type(x) in (Tensor, torch.nn.Parameter) and x.dtype in _HALF:
            size += x.numel() * 4
            if size > _WIDE_INPUT_BYTES:
                return False
            wide_args[i] = x.detach().float()
    if size == 0:
        return False
    others = [(a, e) for a, e in zip(actual, expected, strict=True)
              if not (isinstance(e, Tensor) and e.dtype in _HALF)]  # fmt: skip
    if mismatch([a for a, _ in others], [e for _, e in others], "output") is not None:
        return False
    for a, e, w in zip(actual, expected, unfused(*wide_args), strict=True):
        if not (isinstance(e, Tensor) and e.dtype in _HALF and e.numel()):
            continue
        if not (isinstance(a, Tensor) and isinstance(w, Tensor)):
            return False
        if (a.dtype, a.shape, a.device) != (e.dtype, e.shape, e.device) or w.shape != e.shape:
            return False
        wide = w.detach().float()
        fused_far = (a.detach().float() - wide).nan_to_num(0.0).norm().item()
        eager_far = (e.detach().float() - wide).nan_to_num(0.0).norm().item()
        atol = TOLERANCES[e.dtype][1] * e.numel() ** 0.5
        if fused_far > WIDE_SLACK * eager_far + atol:
            return False
    return True


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("inf")


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fused_run(
    fused: Callable[..., Sequence[Any]],
    unfused: Callable[..., Sequence[Any]],
    effects: Effects,
    device: torch.device | None,
    *,
    first: bool,
    validate: bool,
) -> tuple[Sequence[Any], list[Any], str | None]:
    """Run the fused callable once; return (outputs, the inputs of the run whose effects
    count, failure reason or None).

    ``first``: the key's first run in its cache (counted in ``fusion_attempts``);
    ``validate``: compare it with the unfused graph (the caller asks once per validation
    class, ``keys.plan_class``: the same graph at other sizes, until one matches). A fused
    run that raises falls back when the unfused graph does not. The fused and the reference
    run each write into their own copies of the mutated inputs (``effects.isolate``), so a
    fused callable that fails halfway leaves no trace.
    """
    if first:
        COUNTERS.fusion_attempts += 1
    fused_args = effects.isolate()
    # The reference run must draw the same random numbers (dropout in the graph) and
    # leave the generators where one run of the model would.
    rng = RngState(device)
    try:
        outputs = fused(*fused_args)
    except Exception as exc:
        # Run the unfused graph: if it raises too, the error is the model's own (an
        # out-of-range index, a shape error) and reaches the caller as eager's would,
        # without being counted or logged as a fusion failure.
        rng.restore()
        ref_args = effects.isolate()
        effects.release()
        try:
            expected = unfused(*ref_args)
        except Exception:
            raise exc from None  # the fused error names the bad value (kernels' checks)
        log.debug("the fused graph's error, in full", exc_info=exc)
        return expected, ref_args, f"fused graph raised {type(exc).__name__}: {one_line(exc)}"
    winner, failure = fused_args, None
    if validate:
        COUNTERS.validations += 1
        ref_args = effects.isolate()
        effects.release()
        rng.restore()
        expected = unfused(*ref_args)
        failure = mismatch(outputs, expected, "output")
        if failure is not None and not effects.indices:
            # (a graph that writes its inputs is not run a third time)
            rng.restore()
            noise = input_noise(unfused, ref_args, expected)
            if noise is not None:
                widened = mismatch(outputs, expected, "output", noise)
                if widened is None:
                    COUNTERS.validations_within_noise += 1
                failure = widened and (
                    f"{widened} (one ulp of input noise moves the output {max(noise):.3g})"
                )
            if failure is not None:
                rng.restore()
                if nearer_wide_result(unfused, ref_args, outputs, expected):
                    COUNTERS.validations_nearer_float32 += 1
                    failure = None
        for i in effects.indices:
            failure = failure or mismatch(
                [fused_args[i]], [ref_args[i]], f"mutated input {i} after"
            )
        if failure is not None:
            # The class stays unvalidated: its next new key is compared again.
            failure = f"fused graph does not match the unfused graph: {failure}"
            outputs, winner = expected, ref_args
    if failure is None and first:
        COUNTERS.fusion_successes += 1
    return outputs, winner, failure
