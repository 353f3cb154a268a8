"""Why does BERT's attention run SDPA's math path under Dynamo but cuDNN's fused kernel in
eager? (H100 profile, 2026-11-23: eager 154 kernels per 8 x 128 call, Dynamo alone 413,
Inductor 195 with `_safe_softmax` and fp32 GEMMs: the math path.)

Prints, for eager and for Dynamo's graph (backend "eager"), the SDPA arguments as the call
sees them, which fused backends accept them (each tried alone, with its rejection message),
and the kernels of one call.

    python benchmarks/diag/diag_bert_sdpa.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode


class _Spy(TorchFunctionMode):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label, self.seen = label, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.seen:
            self.seen = True
            shown = [
                (tuple(a.shape), a.stride(), a.dtype, a.requires_grad) if torch.is_tensor(a) else a
                for a in args
            ]
            print(f"[{self.label}] SDPA args {shown} kwargs {kwargs}")
            print(f"[{self.label}] grad enabled {torch.is_grad_enabled()}, "
                  f"compiling {torch.compiler.is_compiling()}")  # fmt: skip
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION):  # fmt: skip
                try:
                    with sdpa_kernel(backend):
                        func(*args, **kwargs)
                    print(f"[{self.label}]   {backend.name}: accepted")
                except RuntimeError as e:
                    print(f"[{self.label}]   {backend.name}: {str(e)[:600]}")
        return func(*args, **kwargs)


def _kernels(fn, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    attention = sorted({n[:90] for n in names if "sdpa" in n or "softmax" in n or "fmha" in n})
    print(f"[{label}] {len(names)} kernels; attention kernels: {attention}")


def main() -> None:
    from transformers import AutoModel, BertConfig

    torch.manual_seed(0)
    model = AutoModel.from_config(BertConfig()).to("cuda", torch.float16).eval()
    ids = torch.randint(0, model.config.vocab_size, (8, 128), device="cuda")
    print("attention implementation:", model.config._attn_implementation)
    with torch.no_grad():
        with _Spy("eager"):
            model(input_ids=ids)
        _kernels(lambda: model(input_ids=ids), "eager")
        compiled = torch.compile(model, backend="eager")
        compiled(input_ids=ids)
        spy = _Spy("dynamo")

        def traced(gm, example_inputs):
            def run(*args):
                with spy:
                    return gm(*args)

            return run

        torch._dynamo.reset()
        spied = torch.compile(model, backend=traced)
        spied(input_ids=ids)
        _kernels(lambda: compiled(input_ids=ids), "dynamo")


if __name__ == "__main__":
    main()
