"""Hidden-state capture inside vLLM workers, and the layer-id convention shared with the caller.

Layer ids: id ``k`` is the residual stream *after* decoder layer ``k-1``, i.e. the output of layer ``k-1``;
id 0 is the token embeddings. That is HF transformers' ``output_hidden_states[k]`` for ``k < N`` and vLLM's
own EAGLE-3 ``aux_hidden_state_layers`` numbering. For ``k == N`` (the last layer) it is the output of the
last decoder layer *before* the final norm; HF's ``hidden_states[N]`` is after the final norm, so the two
differ only there.

This module is imported by vLLM in every worker process (``worker_extension_cls``). It needs torch and
safetensors only, and of vLLM only ``self.model_runner.get_model()`` and the tensor-parallel rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

WORKER_EXTENSION = "example_suite.hidden_states.HiddenStatesWorkerExtension"


def default_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 selection ``[2, N//2, N-3, N]``, made valid: clamped to ``0..N``, de-duplicated, sorted.

    vLLM and speculators feed the draft model the aux layers ``(2, N//2, N-3)`` plus the last layer's output.
    For small N these collide or go negative (N=4 gives ``[2, 2, 1, 4]``), so we keep each id once, in order:
    N=4 -> ``[1, 2, 4]``, N=32 -> ``[2, 16, 29, 32]``.
    """
    wanted = (2, num_layers // 2, num_layers - 3, num_layers)
    return sorted({min(max(k, 0), num_layers) for k in wanted})


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Validate user-given ids against ``0..num_layers``; keeps the caller's order, rejects duplicates."""
    ids = [int(k) for k in layer_ids]
    if not ids:
        raise ValueError("no layer ids given")
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{num_layers} (id k = output of decoder layer k-1)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate layer ids in {ids}")
    return ids


@dataclass
class ForwardCapture:
    """One model forward: the flattened batch vLLM ran, and the states taken from it (all on the CPU)."""

    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _CaptureState:
    layer_ids: list[int]
    saver: bool  # TP rank 0: the only rank that hooks, records and writes
    handles: list[Any] = field(default_factory=list)
    forwards: list[ForwardCapture] = field(default_factory=list)
    recording: bool = False


def _bound_arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    # Bind by name so that we do not depend on whether vLLM passes input_ids/positions positionally or by
    # keyword.
    return dict(inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments)


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def split_requests(
    forwards: Sequence[ForwardCapture], prompts: Sequence[Sequence[int]]
) -> list[tuple[ForwardCapture, int]]:
    """Find each prompt's tokens in the captured flattened batches: ``(forward, start offset)`` per prompt.

    vLLM concatenates all scheduled requests into one ``[num_tokens, hidden]`` batch in an order of its own
    choosing. With prefix caching and chunked prefill off, every prompt is prefilled whole, in one forward, as
    a
    contiguous run whose positions are ``0..len-1``. We therefore look for a run with exactly those positions
    and exactly the prompt's token ids. Padding, decode tokens or repeated forwards cannot match by accident.
    Identical prompts get distinct runs, in order.
    """
    used: set[tuple[int, int]] = set()
    found: list[tuple[ForwardCapture, int]] = []
    for index, prompt in enumerate(prompts):
        want_ids = torch.tensor(list(prompt), dtype=torch.long)
        want_pos = torch.arange(len(prompt), dtype=torch.long)
        match = None
        for f_index, fwd in enumerate(forwards):
            assert fwd.input_ids is not None and fwd.positions is not None
            for start in torch.nonzero(fwd.positions == 0).flatten().tolist():
                stop = start + len(prompt)
                if (f_index, start) in used or stop > fwd.input_ids.numel():
                    continue
                if torch.equal(fwd.positions[start:stop], want_pos) and torch.equal(
                    fwd.input_ids[start:stop], want_ids
                ):
                    match = (f_index, start)
                    break
            if match is not None:
                break
        if match is None:
            raise RuntimeError(
                f"prompt {index} (length {len(prompt)}) was not found whole in any captured forward pass; "
                "is prefix caching or chunked prefill on?"
            )
        used.add(match)
        found.append((forwards[match[0]], match[1]))
    return found


class HiddenStatesWorkerExtension:
    """Mixed into every vLLM worker via ``LLM(worker_extension_cls=WORKER_EXTENSION)``; driven by
    ``LLM.collective_rpc``. Method names carry a ``hsx_`` prefix because vLLM refuses extension attributes
    that
    clash with the worker's own.

    Only tensor-parallel rank 0 records and writes files: the residual stream is all-reduced, hence identical,
    on
    every rank. Results travel back as file paths, so no tensor crosses the RPC boundary and
    ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is not needed.
    """

    model_runner: Any  # provided by the vLLM worker class we are mixed into

    def hsx_num_layers(self) -> int:
        """Number of decoder layers N of the served model (valid layer ids are 0..N)."""
        return len(self.model_runner.get_model().model.layers)

    def hsx_install(self, layer_ids: list[int]) -> None:
        """Hook the decoder layers for ``layer_ids`` (replacing earlier hooks); only TP rank 0 records."""
        from vllm.distributed import get_tensor_model_parallel_rank

        self.hsx_uninstall()
        inner = self.model_runner.get_model().model
        layers = inner.layers
        ids = check_layer_ids(layer_ids, len(layers))
        state = _CaptureState(layer_ids=ids, saver=get_tensor_model_parallel_rank() == 0)
        self._hsx_state: _CaptureState | None = state
        if not state.saver:
            return

        def current() -> ForwardCapture | None:
            return state.forwards[-1] if state.recording and state.forwards else None

        # Hooks on the decoder model itself do not fire: vLLM's @support_torch_compile replaces its __call__
        # and calls forward() directly. Its submodules are called normally, so the embedding's input gives the
        # token ids (and opens a new record per forward), and the first layer's input gives the positions and
        # the embedding output (id 0; the residual is still None there).
        def on_embedding_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if state.recording:
                (token_ids,) = _bound_arguments(module, args, kwargs).values()
                state.forwards.append(ForwardCapture(input_ids=_to_cpu(token_ids)))

        def on_first_layer_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            fwd = current()
            if fwd is None:
                return
            bound = _bound_arguments(module, args, kwargs)
            fwd.positions = _to_cpu(bound["positions"])
            if 0 in ids:
                fwd.states[0] = _to_cpu(bound["hidden_states"])

        def make_output_hook(layer_id: int) -> Any:
            def on_layer_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                fwd = current()
                if fwd is None:
                    return
                hidden, residual = output
                # The next layer's fused add+RMSNorm overwrites both tensors in place: sum them now.
                stream = hidden if residual is None else hidden + residual
                fwd.states[layer_id] = _to_cpu(stream)

            return on_layer_output

        state.handles.append(
            inner.embed_tokens.register_forward_pre_hook(on_embedding_input, with_kwargs=True)
        )
        state.handles.append(layers[0].register_forward_pre_hook(on_first_layer_input, with_kwargs=True))
        for layer_id in sorted(set(ids) - {0}):
            state.handles.append(layers[layer_id - 1].register_forward_hook(make_output_hook(layer_id)))

    def hsx_uninstall(self) -> None:
        """Remove the hooks (if any) and drop captured data."""
        state: _CaptureState | None = getattr(self, "_hsx_state", None)
        if state is not None:
            for handle in state.handles:
                handle.remove()
        self._hsx_state = None

    def hsx_begin(self) -> None:
        """Start recording forwards; discards anything recorded before."""
        state = self._hsx_require()
        state.forwards.clear()
        state.recording = True

    def hsx_save(self, prompts: list[list[int]], paths: list[str]) -> list[str] | None:
        """Stop recording and write one safetensors file per prompt; rank 0 returns the paths, others None."""
        state = self._hsx_require()
        state.recording = False
        if not state.saver:
            return None
        if len(prompts) != len(paths):
            raise ValueError("prompts and paths differ in length")
        try:
            for prompt, path, (fwd, start) in zip(
                prompts, paths, split_requests(state.forwards, prompts), strict=True
            ):
                stop = start + len(prompt)
                missing = [k for k in state.layer_ids if k not in fwd.states]
                if missing:
                    raise RuntimeError(f"layers {missing} produced no output in the forward pass")
                hidden = torch.stack([fwd.states[k][start:stop] for k in state.layer_ids], dim=1)
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                save_file(
                    {
                        "input_ids": torch.tensor(prompt, dtype=torch.int64),
                        "hidden_states": hidden.contiguous(),
                        "layer_ids": torch.tensor(state.layer_ids, dtype=torch.int64),
                    },
                    path,
                )
        finally:
            state.forwards.clear()
        return paths

    def _hsx_require(self) -> _CaptureState:
        state: _CaptureState | None = getattr(self, "_hsx_state", None)
        if state is None:
            raise RuntimeError("hsx_install was not called on this worker")
        return state
