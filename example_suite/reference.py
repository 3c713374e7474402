"""The references extractions are compared with: the tiny model in HF transformers (fp32 on the CPU), and
vLLM's TP=1 states once a module has computed them.

Imports torch lazily: the conftest imports this module in environments without torch or vLLM, where every
test is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any


@dataclass
class Tp1Reference:
    """vLLM's TP=1 states for ``prompts`` at ``ALL_LAYERS``, once some module has computed them."""

    states: list[Any] | None = None


class HfReference:
    """The tiny model in HF transformers, fp32 on the CPU: residual streams per prompt, cached by ids."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._states: dict[tuple[int, ...], Any] = {}

    @cached_property
    def model(self) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir).eval()  # float32, as saved

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def token_ids(self, text: str) -> list[int]:
        """How the model's tokenizer encodes ``text`` by default (as vLLM does for a text prompt)."""
        return list(self.tokenizer(text)["input_ids"])

    def states(self, token_ids: Sequence[int]) -> Any:
        """HF's ``hidden_states`` for the prompt, stacked: [tokens, L+1, hidden]; entry L is normed."""
        key = tuple(int(t) for t in token_ids)
        if key not in self._states:
            import torch

            with torch.no_grad():
                out = self.model(torch.tensor([list(key)]), output_hidden_states=True)
            self._states[key] = torch.stack([h[0] for h in out.hidden_states], dim=1)
        return self._states[key]

    def checkpoint_embeddings(self, token_ids: Sequence[int]) -> Any:
        """The embedding rows of ``token_ids`` read from the checkpoint file itself (not through HF)."""
        from safetensors import safe_open

        with safe_open(str(self.model_dir / "model.safetensors"), framework="pt") as f:
            return f.get_tensor("model.embed_tokens.weight")[list(token_ids)]

    def final_norm(self, hidden: Any) -> Any:
        """HF's final RMSNorm (``model.model.norm``) applied to ``hidden``, on the CPU in fp32."""
        import torch

        with torch.no_grad():
            return self.model.model.norm(hidden.to("cpu", torch.float32))
