"""Small-config transformers models for the zoo tests and the zoo benchmark.

Each entry builds a base model (``AutoModel.from_config``) with random weights: 2 layers,
hidden size 64, vocabulary 128. Nothing is downloaded. Every family takes a padded attention
mask (row 1 ends with two padding positions), so the masking code of each family runs.
"""

from __future__ import annotations

from typing import Any

import torch

# Sizes shared by every config: small enough for the CPU interpreter, large enough that head
# dims, rotary dims and intermediate sizes are all > 1.
HIDDEN, HEADS, LAYERS, VOCAB, INTERMEDIATE = 64, 4, 2, 128, 96

_COMMON = {
    "vocab_size": VOCAB,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# family -> (config class name, config kwargs, is_decoder)
ZOO: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("LlamaConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": 2,
              "intermediate_size": INTERMEDIATE}, True),
    "qwen2": ("Qwen2Config", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": 2,
              "intermediate_size": INTERMEDIATE}, True),
    "mistral": ("MistralConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "num_key_value_heads": 2,
                "intermediate_size": INTERMEDIATE, "sliding_window": 32}, True),
    "gemma": ("GemmaConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": INTERMEDIATE}, True),
    "gemma2": ("Gemma2Config", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
               "num_attention_heads": HEADS, "num_key_value_heads": 2, "head_dim": 16,
               "intermediate_size": INTERMEDIATE, "sliding_window": 32}, True),
    "phi3": ("Phi3Config", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS, "num_key_value_heads": 2,
             "intermediate_size": INTERMEDIATE}, True),
    "gpt2": ("GPT2Config", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS,
             "n_positions": 64}, True),
    "gpt_neox": ("GPTNeoXConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                 "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE}, True),
    "opt": ("OPTConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "ffn_dim": INTERMEDIATE,
            "word_embed_proj_dim": HIDDEN, "max_position_embeddings": 64}, True),
    "bloom": ("BloomConfig", {"hidden_size": HIDDEN, "n_layer": LAYERS, "n_head": HEADS}, True),
    "falcon": ("FalconConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
               "num_attention_heads": HEADS}, True),
    "gptj": ("GPTJConfig", {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS,
             "rotary_dim": 8, "n_positions": 64}, True),
    "stablelm": ("StableLmConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                 "num_attention_heads": HEADS, "num_key_value_heads": 2,
                 "intermediate_size": INTERMEDIATE}, True),
    "bert": ("BertConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE}, False),
    "roberta": ("RobertaConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
                "pad_token_id": 1}, False),
    "distilbert": ("DistilBertConfig", {"dim": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS,
                   "hidden_dim": INTERMEDIATE}, False),
    "albert": ("AlbertConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
               "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
               "embedding_size": 32}, False),
    "electra": ("ElectraConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
                "embedding_size": 32}, False),
    "mpnet": ("MPNetConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
              "pad_token_id": 1}, False),
    "xlm_roberta": ("XLMRobertaConfig", {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                    "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
                    "pad_token_id": 1}, False),
    "t5_encoder": ("T5Config", {"d_model": HIDDEN, "num_layers": LAYERS, "num_heads": HEADS,
                   "d_kv": 16, "d_ff": INTERMEDIATE}, False),
}  # fmt: skip


def build(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """The family's base model in eval mode, random weights from a fixed seed."""
    import transformers

    class_name, kwargs, _ = ZOO[family]
    config = getattr(transformers, class_name)(**{**_COMMON, **kwargs})
    torch.manual_seed(0)
    if family == "t5_encoder":
        model = transformers.T5EncoderModel(config)
    else:
        model = transformers.AutoModel.from_config(config)
    return model.to(device=device, dtype=dtype).eval()


def inputs(family: str, device: str = "cpu", batch: int = 2, length: int = 7) -> dict[str, Any]:
    """Random ids (never the pad id) and a mask whose last row ends with 2 padding slots."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, -2:] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def main_output(outputs: Any) -> torch.Tensor:
    """The tensor the zoo compares: the last hidden state of the base model."""
    return outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]


# Decoder families whose generate() with a StaticCache the generate tests cover.
GENERATE_FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "phi3", "gpt2"]
# Families whose sliding-window cache layers hand the decode graph a Python int that grows
# by one per token (transformers' ``cumulative_length_int``). Without CUDA graphs (the CPU)
# every decode step is a new input signature, so no step is a cache hit; when capturing,
# the host split takes the int out of the captured part.
SLIDING_WINDOW_FAMILIES = {"mistral", "gemma2"}


def build_causal_lm(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """The family's causal LM (with its head), cache on, for generate()."""
    import transformers

    class_name, kwargs, is_decoder = ZOO[family]
    assert is_decoder, family
    config = getattr(transformers, class_name)(**{**_COMMON, **kwargs, "use_cache": True})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype).eval()
