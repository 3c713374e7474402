"""Prompts in, one ``hs_<i>.safetensors`` per prompt out; which files a rerun can keep.

The output layout is the one speculators' training reads (one file per sample, named by the prompt's index):

``OUT/hs_<i>.safetensors`` (i = the prompt's 0-based index in the prompt list or file)
    ``hidden_states``  [tokens, layers, hidden]  the dtype the model ran in (``--dtype``)
    ``token_ids``      [tokens]                  int64, the prompt's token ids (for text: as the server's
                                                 tokenizer encoded it)
    metadata ``layer_ids``: the layer ids of the layer axis as a JSON list, where known (see
    :mod:`example_suite.hidden_states` for what an id means)

Files are written to ``hs_<i>.safetensors.tmp`` and renamed, so an interrupted run leaves no half-written
``hs_<i>.safetensors`` of its own; a rerun still checks every existing file (a copy can be truncated, a
disk can fill up) and redoes the ones that do not open or do not fit their prompt.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from example_suite.hidden_states import ExtractionError

# A prompt is its token ids (sent as they are) or a text, which vLLM tokenizes as it does any completion
# prompt (adding the special tokens, such as BOS, that the model's tokenizer adds by default).
Prompt = list[int] | str

LAYER_IDS_KEY = "layer_ids"


def sample_path(out_dir: Path, index: int) -> Path:
    """``out_dir/hs_<index>.safetensors``."""
    return out_dir / f"hs_{index}.safetensors"


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts from a jsonl file: one ``{"input_ids": [int, ...]}`` or ``{"text": "..."}`` per line."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ExtractionError(f"{path}: cannot read the prompt file: {exc.strerror or exc}") from None
    prompts: list[Prompt] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        expected = 'expected {"input_ids": [int, ...]} or {"text": "..."}'
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ExtractionError(f"{path}:{line_no}: not JSON ({exc}); {expected}") from None
        ids = record.get("input_ids") if isinstance(record, dict) else None
        text = record.get("text") if isinstance(record, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids):
            prompts.append([int(t) for t in ids])
        elif isinstance(text, str) and text.strip():
            prompts.append(text)
        else:
            raise ExtractionError(f"{path}:{line_no}: {expected}, got {line.strip()[:80]}")
    if not prompts:
        raise ExtractionError(f"{path}: no prompts")
    return prompts


def check_prompts(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Library callers' prompts, checked like a prompt file's lines."""
    checked: list[Prompt] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ExtractionError(f"prompt {index} is an empty text")
            checked.append(prompt)
        else:
            ids = list(prompt)
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ExtractionError(f"prompt {index}: expected a non-empty list of token ids, got {ids!r}")
            checked.append([int(t) for t in ids])
    return checked


@dataclass(frozen=True)
class Sample:
    """One prompt's result, as read back from its file."""

    hidden_states: Any  # torch.Tensor [tokens, layers, hidden]
    token_ids: list[int]
    layer_ids: list[int] | None


def write_sample(
    out_dir: Path, index: int, hidden_states: Any, token_ids: Any, layer_ids: Sequence[int] | None
) -> Path:
    """Write ``hs_<index>.safetensors`` (via a temporary file and a rename); returns its path."""
    import torch
    from safetensors.torch import save_file

    path = sample_path(out_dir, index)
    tmp = path.with_name(path.name + ".tmp")
    metadata = {LAYER_IDS_KEY: json.dumps(list(layer_ids))} if layer_ids is not None else None
    tensors = {
        "hidden_states": hidden_states.contiguous(),
        "token_ids": torch.as_tensor(token_ids, dtype=torch.int64).contiguous(),
    }
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def read_sample(path: Path) -> Sample:
    """Load one output file; raises (safetensors' or our ``ValueError``) if it is truncated or malformed."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        if keys != {"hidden_states", "token_ids"}:
            raise ValueError(f"{path}: tensors {sorted(keys)}, expected hidden_states and token_ids")
        hidden_states = f.get_tensor("hidden_states")
        token_ids = f.get_tensor("token_ids")
        metadata = f.metadata() or {}
    layer_ids = json.loads(metadata[LAYER_IDS_KEY]) if LAYER_IDS_KEY in metadata else None
    if hidden_states.dim() != 3 or token_ids.dim() != 1 or hidden_states.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"{path}: hidden_states {tuple(hidden_states.shape)} does not fit token_ids "
            f"{tuple(token_ids.shape)}"
        )
    if layer_ids is not None and len(layer_ids) != hidden_states.shape[1]:
        raise ValueError(f"{path}: {hidden_states.shape[1]} layers, metadata says {layer_ids}")
    return Sample(hidden_states, [int(t) for t in token_ids.tolist()], layer_ids)


def is_done(path: Path, prompt: Prompt, layer_ids: Sequence[int] | None) -> bool:
    """True when ``path`` holds a complete result for ``prompt`` (and these layer ids, where known)."""
    if not path.is_file():
        return False
    try:
        sample = read_sample(path)
    except Exception:
        return False
    if isinstance(prompt, list) and sample.token_ids != prompt:
        return False
    if isinstance(prompt, str) and not sample.token_ids:
        return False
    return layer_ids is None or sample.layer_ids is None or sample.layer_ids == list(layer_ids)


def pending_indices(
    out_dir: Path, prompts: Sequence[Prompt], layer_ids: Sequence[int] | None, *, resume: bool
) -> list[int]:
    """Indices of ``prompts`` without a good file in ``out_dir`` (all of them without ``resume``)."""
    if not resume:
        return list(range(len(prompts)))
    return [i for i, p in enumerate(prompts) if not is_done(sample_path(out_dir, i), p, layer_ids)]


def check_token_ids(index: int, prompt: Prompt, token_ids: Iterable[int]) -> None:
    """vLLM's file must be about the prompt we sent: its ids must be the prompt's (for an id prompt)."""
    got = [int(t) for t in token_ids]
    if isinstance(prompt, list) and got != prompt:
        raise ExtractionError(
            f"prompt {index}: vLLM returned states for token ids {got[:12]}..., "
            f"not for the prompt {prompt[:12]}..."
        )
    if not got:
        raise ExtractionError(f"prompt {index}: vLLM returned no tokens")


class Progress:
    """A tqdm bar over prompts, or nothing (``enabled=False``)."""

    def __init__(self, total: int, *, enabled: bool, initial: int = 0) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

            self._bar = tqdm(total=total, initial=initial, unit="prompt", desc="hidden states")

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class ExtractionRun:
    """One pass of an extractor over ``prompts``: which still need a file, and saving vLLM's result for each.

    ``todo`` holds the indices to send to vLLM (with ``resume``, those without a good file). :meth:`save`
    checks vLLM's tensors against the prompt and the layer ids and writes ``hs_<i>.safetensors``; it may be
    called from several threads, inside ``with``, which shows the progress bar (from ``__enter__``, so that an
    error before it prints no bar) and closes it.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        out_dir: str | Path,
        layer_ids: Sequence[int] | None,
        *,
        resume: bool,
        progress: bool,
    ) -> None:
        self.prompts = check_prompts(prompts)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        self.todo = pending_indices(self.out, self.prompts, self.layer_ids, resume=resume)
        self._progress = progress
        self._bar = Progress(0, enabled=False)
        self._bar_lock = threading.Lock()

    def save(self, index: int, tensors: dict[str, Any]) -> Path:
        """Check what vLLM returned for prompt ``index`` (its file's tensors) and write the prompt's file."""
        check_token_ids(index, self.prompts[index], tensors["token_ids"].tolist())
        layers, wanted = tensors["hidden_states"].shape[1], self.layer_ids
        if wanted is not None and layers != len(wanted):
            raise ExtractionError(
                f"prompt {index}: vLLM returned {layers} layers, but the layer ids given are {wanted}"
            )
        path = write_sample(self.out, index, tensors["hidden_states"], tensors["token_ids"], self.layer_ids)
        with self._bar_lock:
            self._bar.update()
        return path

    def paths(self) -> list[Path]:
        """Every prompt's output file, in prompt order."""
        return [sample_path(self.out, i) for i in range(len(self.prompts))]

    def __enter__(self) -> ExtractionRun:
        kept = len(self.prompts) - len(self.todo)
        self._bar = Progress(len(self.prompts), enabled=self._progress, initial=kept)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.close()
