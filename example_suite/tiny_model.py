"""Build a tiny, seeded, random-weight Llama and a word-level tokenizer, saved like a real checkpoint.

The example suite cannot download a model (no hub access in CI), so it writes its own with ``save_pretrained``
and lets vLLM and transformers load it from disk exactly as they would load a real one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the test model. Heads, KV heads and the MLP width are even, so that TP=2 splits them."""

    num_layers: int = 4
    hidden_size: int = 128
    head_dim: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 256
    max_positions: int = 256
    seed: int = 0


def build_tiny_llama(out_dir: Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write a float32 Llama checkpoint (config, safetensors weights, tokenizer) to ``out_dir``; return it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        # Linear weights with std 1/sqrt(fan_in) keep activations O(1) through the layers, so every layer
        # really changes the residual stream and a 1e-4 comparison means something (the default 0.02 barely
        # moves it).
        initializer_range=1.0 / math.sqrt(spec.hidden_size),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)  # float32 parameters
        with torch.no_grad():
            # Unit-variance embeddings, like a trained model's residual stream.
            model.get_input_embeddings().weight.normal_(0.0, 1.0)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out_dir)
    build_word_tokenizer(spec.vocab_size).save_pretrained(out_dir)
    return out_dir


def build_word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ``<unk> <s> </s> <pad> w4 w5 ...``, ``vocab_size`` entries."""
    words = list(SPECIAL_TOKENS) + [f"w{i}" for i in range(len(SPECIAL_TOKENS), vocab_size)]
    backend = Tokenizer(WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
