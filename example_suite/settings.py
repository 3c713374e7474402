"""The example suite's settings: the tiny model's shape, the prompts' lengths, and what every engine and
server of the suite runs with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NUM_LAYERS = 4  # TinyLlamaSpec().num_layers
HIDDEN_SIZE = 128  # TinyLlamaSpec().hidden_size
ALL_LAYERS = list(range(NUM_LAYERS + 1))  # 0 (embeddings) .. L (last decoder layer's output, before the norm)
LONG_PROMPT = [1] + [(7 * i + 11) % 250 + 4 for i in range(111)]  # 112 tokens: 4 blocks of 32
MAX_MODEL_LEN = 128  # the longest test prompt has 112 tokens
# The smallest block size CPU vLLM accepts (a multiple of 32): the long prompt then spans 4 KV blocks, and a
# repeat of it hits the prefix cache for 3 of them.
BLOCK_SIZE = 32
# On a GPU, vLLM would otherwise reserve 92% of each card; the tiny model needs a few GB at most. vLLM still
# checks at start that this much is free.
GPU_MEMORY_UTILIZATION = 0.1
# The KV cache on a GPU, instead of what the memory profile leaves of that 10% (7.6 GiB for 3.2M tokens of the
# tiny model on an H100): about 51,000 tokens, hundreds of times the longest prompt, and less to allocate at
# start and for the driver to release at the end.
KV_CACHE_BYTES = 128 << 20
# vLLM sizes its start-up profile run and its sampler warm-up by these (defaults of 8,192 batched tokens and
# 256 to 1,024 sequences); the suite sends at most 8 requests at once, each of at most 128 tokens.
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 2 * MAX_MODEL_LEN


@dataclass(frozen=True)
class EngineSettings:
    """What every engine and server of the suite runs with (fp32, so that the comparisons can be tight)."""

    device: str
    dtype: str = "float32"
    max_model_len: int = MAX_MODEL_LEN
    block_size: int = BLOCK_SIZE

    def offline(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``OfflineExtractor``."""
        args: dict[str, Any] = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            # Eager: starts in 13 s instead of 36 s on 2 CPU cores (compilation), and the suite's tiny model
            # gains nothing from compiled graphs.
            "enforce_eager": True,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        }
        if self.device == "cuda":
            args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
            args["kv_cache_memory_bytes"] = KV_CACHE_BYTES
        return {**args, **extra}

    def server(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``VllmServer``."""
        extra_args = [
            "--enforce-eager",
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
        ]
        if self.device == "cuda":
            extra_args += [
                "--gpu-memory-utilization",
                str(GPU_MEMORY_UTILIZATION),
                "--kv-cache-memory-bytes",
                str(KV_CACHE_BYTES),
            ]
        return {"dtype": self.dtype, "max_model_len": self.max_model_len, "extra_args": extra_args, **extra}
