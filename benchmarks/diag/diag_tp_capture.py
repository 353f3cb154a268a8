"""Where does tensor parallelism on N GPUs fail or hang, if it does? Step by step, each step
printed as it ends and a stack dump of every thread if a step hangs (faulthandler after
--hang-s): an all-reduce + copy compiled by infinifuse (captured), then transformers'
tp_plan="auto" tiny Llama through a compiled forward and through CompileConfig.

    torchrun --nproc_per_node 2 benchmarks/diag/diag_tp_capture.py
"""

import faulthandler
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

HANG_S = float(os.environ.get("DIAG_HANG_S", "60"))


def mark(text: str) -> None:
    print(f"[rank {os.environ['RANK']} {time.strftime('%H:%M:%S')}] {text}", flush=True)
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # restarted by every step


def main() -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    if os.environ.get("DIAG_LOG"):
        logging.getLogger("fusebackend").setLevel(logging.INFO)
    import fusebackend

    group = dist.group.WORLD.group_name
    functional = torch.ops._c10d_functional

    def reduced(x, w, r):
        y = x @ w
        y.copy_(functional.wait_tensor(functional.all_reduce(y, "sum", group)))
        return (r + y) * 2.0

    torch.manual_seed(dist.get_rank())
    x, w = torch.randn(4, 64, device=device), torch.randn(64, 64, device=device)
    r = torch.randn(4, 64, device=device)
    mark("eager all-reduce")
    want = reduced(x, w.clone(), r)
    torch.cuda.synchronize()
    compiled = torch.compile(reduced, backend="infinifuse")
    with torch.no_grad():
        for call in range(4):
            mark(f"compiled all-reduce call {call}")
            out = compiled(x, w, r)
            torch.cuda.synchronize()
    stats = fusebackend.stats()
    diff = (out - want).abs().max().item()
    mark(f"max diff {diff:.3g}; modes {stats['fusion_modes']}, recordings {stats['recordings']}")
    fusebackend.clear_cache()
    torch._dynamo.reset()
    sys.argv = [sys.argv[0], "--tiny", "--batch", "2", "--new-tokens", "4"]
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import tp_generate

    tp_generate.MARK = mark
    dist.destroy_process_group()
    mark("tp_generate")
    tp_generate.main()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
