"""Reading what vLLM's connector writes, and the output files (no engine needed)."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from example_suite.hidden_states import ExtractionError, take_vllm_file  # noqa: E402
from example_suite.samples import is_done, read_sample, write_sample  # noqa: E402

pytestmark = pytest.mark.needs_clean_gpus


def test_take_waits_for_the_writers_lock_then_removes_both_files(tmp_path: Path) -> None:
    # vLLM 0.32 holds an exclusive flock on <file>.lock from before it names the file until the write is done.
    path = tmp_path / "req-1.safetensors"
    lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    taken: list[dict[str, object]] = []
    reader = threading.Thread(target=lambda: taken.append(take_vllm_file(path)))
    reader.start()
    # The file does not even exist yet: a reader that did not wait for the lock would fail.
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    safetensors_torch.save_file({"hidden_states": hidden, "token_ids": torch.tensor([7, 8])}, str(path))
    os.close(lock_fd)
    reader.join(60)
    assert not reader.is_alive()
    assert torch.equal(taken[0]["hidden_states"], hidden)
    assert not path.exists() and not Path(f"{path}.lock").exists()


def test_a_file_this_client_cannot_see_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ExtractionError, match="shared_storage_path must be a directory this client can read"):
        take_vllm_file(tmp_path / "elsewhere.safetensors")


def test_output_file_round_trip_and_what_counts_as_done(tmp_path: Path) -> None:
    hidden = torch.randn(3, 2, 4)
    path = write_sample(tmp_path, 7, hidden, [1, 5, 9], [2, 4])
    assert path.name == "hs_7.safetensors" and not list(tmp_path.glob("*.tmp"))
    sample = read_sample(path)
    assert torch.equal(sample.hidden_states, hidden)
    assert sample.token_ids == [1, 5, 9] and sample.layer_ids == [2, 4]
    assert is_done(path, [1, 5, 9], [2, 4])
    assert is_done(path, "some text", [2, 4])  # a text prompt: any complete file
    assert not is_done(path, [1, 5, 8], [2, 4])  # another prompt's file
    assert not is_done(path, [1, 5, 9], [1, 2])  # other layers
    path.write_bytes(path.read_bytes()[:-8])
    assert not is_done(path, [1, 5, 9], [2, 4])  # truncated
