"""Which SDPA kernel does each model-zoo family's attention run, in eager and in the fused
graph, and why not a fused one? (fp16, the zoo's padded 2 x 7, CUDA)

SDPA picks flash, memory-efficient, cuDNN or its math path per call; the math path is about
ten launches a call (an fp32 upcast of q, k and v, two batched matmuls, the mask, a softmax).
For each family this records the aten attention ops one eager call dispatches, the
attention kernels one call of the infinifuse graph launches (run without CUDA graphs and
profiled: under a dispatch mode Dynamo would run the frame again, not the compiled graph),
and for each math-path call of eager, the reason the memory-efficient kernel gives (torch's
own warning text). It found T5's permuted
position-bias mask (its keys at stride ``heads``: every fused kernel refused it).

    python3 benchmarks/diag/diag_attention_paths.py [family ...]
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import model_zoo  # noqa: E402

# Substrings of attention kernels' names: flash, memory-efficient (fmha), cuDNN (sdpa), and
# the math path's softmax.
_ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "attention", "softmax")


class AttentionOps(TorchDispatchMode):
    """Counts the aten attention ops dispatched (their names say the path)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if "attention" in name or name in ("_softmax", "_safe_softmax"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _layout(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{tuple(t.shape)}/{t.stride()}/{str(t.dtype)[6:]}"


def _why_not_efficient(args, kwargs) -> str:
    with (
        warnings.catch_warnings(record=True) as seen,
        sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]),
    ):
        warnings.simplefilter("always")
        try:
            F.scaled_dot_product_attention(*args, **kwargs)
            return "accepted"
        except RuntimeError:
            return " | ".join(str(w.message)[:200] for w in seen)


def family_paths(family: str) -> None:
    model = model_zoo.build(family, dtype=torch.float16, device="cuda")
    inputs = model_zoo.inputs(family, device="cuda")
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad(), AttentionOps() as eager_ops:
            model(**inputs)
    finally:
        F.scaled_dot_product_attention = real
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
    with torch.no_grad():
        compiled(**inputs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(**inputs)
            torch.cuda.synchronize()
    kernels = Counter(
        e.name[:60] for e in prof.events()
        if e.device_type.name == "CUDA" and any(k in e.name.lower() for k in _ATTENTION_KERNELS)
    )  # fmt: skip
    print(f"{family}: eager {dict(eager_ops.ops)}; infinifuse kernels {dict(kernels)}")
    if calls:
        args, kwargs = calls[0]
        layouts = [_layout(a) for a in args] + [f"{k}={_layout(v)}" for k, v in kwargs.items()]
        print(f"  eager's first call: {', '.join(layouts)}")
        if "_scaled_dot_product_attention_math" in eager_ops.ops or not eager_ops.ops:
            print(f"  memory-efficient: {_why_not_efficient(args, kwargs)}")


def main() -> None:
    families = sys.argv[1:] or list(model_zoo.ZOO)
    for family in families:
        try:
            family_paths(family)
        except Exception as e:  # noqa: BLE001 (a diag: one family's failure is reported)
            print(f"{family}: failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
