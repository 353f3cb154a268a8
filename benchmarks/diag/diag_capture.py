"""Does a failed CUDA-graph capture leave this torch's RNG and allocator state usable?"""

import torch

from fusebackend.runtime import capture as cc


def fn_ok(x):
    return (x * 2 + torch.randn_like(x),)


def fn_raise(x):
    if torch.cuda.is_current_stream_capturing():
        raise torch.OutOfMemoryError("injected")
    return fn_ok(x)


def fn_item(x):
    y = x * 2
    return (y * (y.sum() > 0).item(),)


def check(label):
    try:
        torch.randn(3, device="cuda")
        g, outs = cc.capture_graph(
            fn_ok, [torch.randn(4, device="cuda")], device=torch.device("cuda"), warmup_iterations=1
        )
        g.replay()
        torch.cuda.synchronize()
        print(label, "-> OK (randn + new capture work)")
    except Exception as e:
        print(label, "-> BROKEN:", type(e).__name__, str(e)[:150])


for name, fn in [
    ("raise-in-capture", fn_raise),
    ("item-in-capture", fn_item),
    ("raise-again", fn_raise),
    ("item-again", fn_item),
]:
    try:
        cc.capture_graph(
            fn, [torch.randn(4, device="cuda")], device=torch.device("cuda"), warmup_iterations=1
        )
        print(name, "captured?!")
    except Exception as e:
        print(name, "failed as expected:", type(e).__name__, str(e)[:100])
    check("after " + name)
