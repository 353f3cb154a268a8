"""Llama shapes shared by the examples and benchmarks/generate.py (configs only: random
weights, nothing is downloaded).

    python examples/llama_shapes.py    # print them (a module the other examples import)

``TINYLLAMA`` is TinyLlama-1.1B's shape (``hf_generate.py`` and ``llama_generate.py``'s
``--tinyllama``); ``TINY_WIDTHS`` and ``TINY_LAYERS`` shrink it for a CPU (``--tiny``).
"""

from __future__ import annotations

import argparse
import json

# TinyLlama-1.1B's shape (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json).
TINYLLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)

# The widths shrunk so that Dynamo and Triton's interpreter finish in seconds on a CPU. The
# vocabulary too: a decode step's LM head over 512 words ran 256 two-column GEMV programs in
# the interpreter, 3.6 of the step's 4.2 s (2026-11-30); 64 words make 32.
TINY_WIDTHS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=256,
)
# The layers of a tiny model: 22 narrow layers still took 5.5 minutes in Triton's interpreter
# (hf_generate.py --tiny --interpret on a CPU, issue 25).
TINY_LAYERS = 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Prints TINYLLAMA, TINY_WIDTHS and TINY_LAYERS as JSON; takes no options.",
    )
    parser.parse_args(argv)
    shapes = {"TINYLLAMA": TINYLLAMA, "TINY_WIDTHS": TINY_WIDTHS, "TINY_LAYERS": TINY_LAYERS}
    print(json.dumps(shapes, indent=2))


if __name__ == "__main__":
    main()
