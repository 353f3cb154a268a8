"""How long does ``split_host`` take on the Llama generate graphs? (CPU; no GPU needed)

Captures the prefill and decode graphs Dynamo hands a backend during transformers'
generate() with a StaticCache (2 and 22 layers, tiny widths), then times the host/device
split with int64 values playing the host (cache positions, ids) and floats the device.

    PYTHONPATH=$PWD python3 benchmarks/diag/diag_split_time.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import model_zoo  # noqa: E402

from fusebackend.passes.host_inputs import split_host  # noqa: E402


def graphs_of(layers: int) -> list[torch.fx.GraphModule]:
    model_zoo.ZOO["llama"][1]["num_hidden_layers"] = layers
    model = model_zoo.build_causal_lm("llama")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model.forward = torch.compile(model.forward, backend=capture)
    ids = torch.randint(3, model_zoo.VOCAB, (1, 9))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    return graphs


def main() -> None:
    for layers in (2, 22):
        for gm in graphs_of(layers):
            nodes = len(gm.graph.nodes)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                split = split_host(gm, lambda v: v.dtype == torch.int64)
                best = min(best, time.perf_counter() - start)
            hosts = len(split.nodes) if split is not None else 0
            print(f"layers={layers} nodes={nodes} host nodes={hosts} split {best * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
