"""vLLM's native hidden-state extraction: layer ids, the two engine configs, and reading what vLLM writes.

vLLM extracts hidden states itself when an engine (``vllm.LLM`` or ``vllm serve``) gets two configs:

- ``speculative_config``: the ``extract_hidden_states`` method, whose "draft model" only records the
  residual stream at ``eagle_aux_hidden_state_layer_ids`` into a KV-cache-like buffer;
- ``kv_transfer_config``: ``ExampleHiddenStatesConnector``, which writes each finished request's states to
  ``<shared_storage_path>/<request id>.safetensors`` and names that file in the request's output
  (``RequestOutput.kv_transfer_params["hidden_states_path"]``; the server returns the same dict as the
  completion response's top-level ``kv_transfer_params``).

That file holds ``hidden_states`` [prompt tokens, layers, hidden] in the model's dtype and ``token_ids``
[prompt tokens] int64, written by TP rank 0 only.

Layer ids (measured against HF transformers, see docs/example_suite.md): vLLM sorts and de-duplicates them;
id ``k < L`` (L = number of decoder layers) is HF's ``hidden_states[k]`` (0 = the embeddings); id ``L`` is the
last decoder layer's output *before* the final norm, while HF's last entry is after it. Id 0 is right only
with the norm settings of :func:`exact_embeddings_configs`, which :func:`engine_configs` adds.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONNECTOR = "ExampleHiddenStatesConnector"
# The CPU build's stand-in (example_suite/cpu_connector.py); same name as the stock class, because vLLM looks
# the class up by ``kv_connector`` in the module named by ``kv_connector_module_path``.
CPU_CONNECTOR_MODULE = "example_suite.cpu_connector"


class ExtractionError(Exception):
    """A problem the user can fix (bad input, unreachable server, ...): the CLI shows no traceback."""


def num_decoder_layers(model: str | Path) -> int:
    """``num_hidden_layers`` of a local HF model directory (its ``text_config`` for multimodal configs)."""
    config_path = Path(model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ExtractionError(
            f"{config_path}: no such file (--model must be a local model directory)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ExtractionError(f"{config_path}: cannot read the model config: {exc}") from None
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("num_hidden_layers"), int):
            return int(section["num_hidden_layers"])
    raise ExtractionError(f"{config_path}: no num_hidden_layers")


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layers ``(2, L//2, L-3)`` plus the last layer ``L``, made valid for small L.

    Clamped to ``0..L``, de-duplicated and sorted as vLLM would: L=32 gives ``[2, 16, 29, 32]``, L=4 gives
    ``[1, 2, 4]`` (from ``2, 2, 1, 4``).
    """
    wanted = (2, num_layers // 2, num_layers - 3, num_layers)
    return sorted({min(max(k, 0), num_layers) for k in wanted})


def normalize_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The ids vLLM will use, in the order of the file's layer axis: sorted, each once; ``None``: the default.

    vLLM sorts and de-duplicates the ids itself; doing it here keeps the order of the file's columns the
    same on every vLLM version and lets the caller see it before an engine starts. An id outside ``0..L``
    is an :class:`ExtractionError` (vLLM would fail later and less clearly).
    """
    if layer_ids is None:
        return default_layer_ids(num_layers)
    ids = sorted({int(k) for k in layer_ids})
    if not ids:
        raise ExtractionError("no layer ids given")
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise ExtractionError(
            f"layer id(s) {bad} out of range: this model has {num_layers} decoder layers, so ids are "
            f"0..{num_layers} (0 = embeddings, k = output of decoder layer k-1, {num_layers} = last layer "
            "before the final norm)"
        )
    return ids


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """The ``speculative_config`` that turns on hidden-state extraction at ``layer_ids``."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(storage_dir: str | Path, *, cpu: bool) -> dict[str, Any]:
    """The ``kv_transfer_config`` that writes each request's states under ``storage_dir``.

    ``cpu``: load the connector from :mod:`example_suite.cpu_connector` (the stock one fails on CPU vLLM).
    """
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    if cpu:
        config["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return config


def exact_embeddings_configs() -> dict[str, dict[str, Any]]:
    """Engine configs that keep id 0 the embeddings: vLLM's RMSNorm computed out of place.

    Why: vLLM records id 0 as the embeddings tensor itself, without a copy, and the first decoder layer
    takes that same tensor as its residual. Where the fused residual-add RMSNorm runs as an in-place kernel
    (CUDA's ``_C.fused_add_rms_norm``, used whenever the ``rms_norm`` custom op is on, as with
    ``enforce_eager``), every later norm adds into that tensor, so id 0 comes back equal to id L (measured on
    an H200 with vLLM 0.20.2: max |diff| 8.48 against HF's embeddings). PyTorch's own norm computes out of
    place. vLLM 0.20 picks the kernel through the ``rms_norm`` custom op; later versions through the IR op
    priority of ``fused_add_rms_norm``, which this returns too where the installed vLLM has it. CPU vLLM
    has only the out-of-place norm: there these change nothing, and the CPU suite checks vLLM accepts them.
    """
    configs: dict[str, dict[str, Any]] = {"compilation_config": {"custom_ops": ["-rms_norm"]}}
    from vllm.config.kernel import IrOpPriorityConfig

    if "fused_add_rms_norm" in {field.name for field in dataclasses.fields(IrOpPriorityConfig)}:
        configs["kernel_config"] = {"ir_op_priority": {"fused_add_rms_norm": ["native"]}}
    return configs


def engine_configs(layer_ids: Sequence[int], storage_dir: str | Path, *, cpu: bool) -> dict[str, Any]:
    """Every engine config extraction at ``layer_ids`` needs, by ``vllm.LLM`` keyword.

    ``vllm serve`` takes the same as ``--name-with-dashes JSON`` (:func:`server_arguments`).
    """
    configs: dict[str, Any] = {
        "speculative_config": speculative_config(layer_ids),
        "kv_transfer_config": kv_transfer_config(storage_dir, cpu=cpu),
    }
    if 0 in layer_ids:
        configs.update(exact_embeddings_configs())
    return configs


def server_arguments(configs: dict[str, Any]) -> list[str]:
    """:func:`engine_configs` as ``vllm serve`` arguments."""
    return [
        part for name, value in configs.items() for part in (f"--{name.replace('_', '-')}", json.dumps(value))
    ]


def hidden_states_path(kv_transfer_params: Any) -> str:
    """The file vLLM named in a request's ``kv_transfer_params``; an :class:`ExtractionError` if none."""
    path = kv_transfer_params.get("hidden_states_path") if isinstance(kv_transfer_params, dict) else None
    if not isinstance(path, str) or not path:
        raise ExtractionError(
            f"vLLM returned no hidden_states_path (kv_transfer_params={kv_transfer_params!r}): was the "
            "engine started with the extract_hidden_states speculative_config and the hidden-states "
            "kv_transfer_config?"
        )
    return path


def take_vllm_file(path: str | Path) -> dict[str, Any]:
    """Load a file the connector wrote (waiting for its write to finish), then delete it and its lock file.

    vLLM 0.32 writes in a background thread and holds an exclusive ``flock`` on ``<path>.lock`` until the
    file is complete; a shared lock therefore waits for the write without polling (what the connector
    module's own ``load_hidden_states`` does; 0.20.2 has no such function and no lock file, and its write is
    complete before the request finishes). vLLM never deletes either file, so we do, once read.
    """
    from safetensors.torch import load_file

    file = Path(path)
    lock = Path(f"{file}.lock")
    try:
        lock_fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        lock_fd = None
    try:
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
        try:
            tensors = load_file(str(file), device="cpu")
        except FileNotFoundError:  # safetensors raises it without an errno
            raise ExtractionError(
                f"{file}: vLLM named this hidden-states file but it does not exist here (the server's "
                "shared_storage_path must be a directory this client can read)"
            ) from None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    for leftover in (file, lock):
        leftover.unlink(missing_ok=True)
    return tensors
