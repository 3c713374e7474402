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
# On a GPU, vLLM would otherwise reserve 92% of each card; the tiny model needs a few GB at most.
GPU_MEMORY_UTILIZATION = 0.1


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
        }
        if self.device == "cuda":
            args["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION
        return {**args, **extra}

    def server(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``VllmServer``."""
        extra_args = ["--enforce-eager", "--block-size", str(self.block_size)]
        if self.device == "cuda":
            extra_args += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]
        return {"dtype": self.dtype, "max_model_len": self.max_model_len, "extra_args": extra_args, **extra}
