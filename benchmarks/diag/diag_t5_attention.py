"""Which SDPA kernel does T5's attention get, and why (fp16, the zoo's padded 2 x 7 and a
longer 2 x 64)? Prints each SDPA call's arguments (shapes, strides, dtypes, scale), whether
the memory-efficient and flash kernels accept them (torch's own warning text when not), and
the kernels of one eager call.

    python3 benchmarks/diag/diag_t5_attention.py
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import model_zoo  # noqa: E402


def describe(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{tuple(t.shape)} stride {t.stride()} {t.dtype}"


def main() -> None:
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    for length in (7, 64):
        model = model_zoo.build("t5_encoder", dtype=torch.float16, device="cuda")
        inputs = model_zoo.inputs("t5_encoder", device="cuda", length=length)
        calls.clear()
        F.scaled_dot_product_attention = spy
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            F.scaled_dot_product_attention = real
        print(f"== length {length}: {len(calls)} SDPA calls")
        args, kwargs = calls[0]
        print("  args:", [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()})
        for backend in (
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
        ):
            with warnings.catch_warnings(record=True) as seen, sdpa_kernel([backend]):
                warnings.simplefilter("always")
                try:
                    real(*args, **kwargs)
                    print(f"  {backend.name}: accepted")
                except RuntimeError as e:
                    why = " | ".join(str(w.message)[:300] for w in seen)
                    print(f"  {backend.name}: refused ({str(e)[:120]}): {why}")
        with (
            torch.no_grad(),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
        ):
            model(**inputs)
            torch.cuda.synchronize()
        kinds = Counter(e.name[:90] for e in prof.events() if e.device_type.name == "CUDA")
        print(f"  eager kernels: {sum(kinds.values())}")
        for name, count in kinds.most_common():
            print(f"    {count:3d} {name}")


if __name__ == "__main__":
    main()
