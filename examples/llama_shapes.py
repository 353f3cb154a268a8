"""Llama shapes shared by the examples and benchmarks/generate.py (configs only: random
weights, nothing is downloaded)."""

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

# The widths shrunk so that Dynamo and Triton's interpreter finish in seconds on a CPU.
TINY_WIDTHS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)
