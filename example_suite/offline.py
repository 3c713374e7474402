"""Hidden states from an in-process ``vllm.LLM`` engine (vLLM's native extraction; no server).

::

    with OfflineExtractor("model_dir", tensor_parallel_size=2, layer_ids=[2, 3, 4]) as ex:
        paths = ex.extract([[1, 5, 9], "some text"], out_dir="out")   # out/hs_0.safetensors, out/hs_1...

Scripts that create an engine need an ``if __name__ == "__main__":`` guard: vLLM starts its processes with
``spawn``, which re-imports the main module.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from example_suite.hidden_states import (
    ExtractionError,
    engine_configs,
    hidden_states_path,
    normalize_layer_ids,
    num_decoder_layers,
    take_vllm_file,
)
from example_suite.reaping import descendants, wait_and_reap
from example_suite.runtime import detect_runtime, openmp_registrations, vllm_environment_applied
from example_suite.samples import ExtractionRun, Prompt

# vLLM's default grace for EngineCore is 5 s, shorter than a TP=2 engine needs to stop on 2 busy CPU cores.
SHUTDOWN_TIMEOUT_S = 15.0
DEFAULT_BATCH_SIZE = 64


class OfflineExtractor:
    """One ``vllm.LLM`` engine that writes hidden states at ``layer_ids``. Close it (or use ``with``)."""

    def __init__(
        self,
        model: str | Path,
        *,
        layer_ids: Sequence[int] | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int = 2048,
        **engine_args: Any,
    ) -> None:
        self.num_layers = num_decoder_layers(model)
        self.layer_ids = normalize_layer_ids(layer_ids, self.num_layers)
        # vLLM writes one file per request here; extract() moves each into place.
        staging_dir = Path(tempfile.mkdtemp(prefix="vllm-hidden-states-"))
        configs = engine_configs(self.layer_ids, staging_dir, cpu=detect_runtime().device == "cpu")
        fixed = set(configs) & set(engine_args)
        if fixed:
            staging_dir.rmdir()
            raise ValueError(f"engine arguments {sorted(fixed)} are set by the extractor")
        from vllm import LLM

        self.staging_dir = staging_dir
        args: dict[str, Any] = {
            "model": str(model),
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "max_model_len": max_model_len,
            **engine_args,
            **configs,
        }
        before = {p.pid for p in descendants()}
        self._llm: Any = None
        try:
            with vllm_environment_applied(tensor_parallel_size):
                self._llm = LLM(**args)
        except BaseException:
            shutil.rmtree(self.staging_dir, ignore_errors=True)
            raise
        # EngineCore and the workers, so that close() can make sure they are gone.
        self._engine_processes = [p for p in descendants() if p.pid not in before]

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM``."""
        if self._llm is None:
            raise RuntimeError("extractor is closed")
        return self._llm

    def extract(
        self,
        prompts: Sequence[Prompt],
        out_dir: str | Path,
        *,
        resume: bool = True,
        progress: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> list[Path]:
        """Write ``out_dir/hs_<i>.safetensors`` for every prompt; returns their paths, in prompt order.

        With ``resume``, prompts whose file is already good are skipped. Prompts go to the engine
        ``batch_size`` at a time (one ``generate`` call each, one request per prompt).
        """
        from vllm import SamplingParams

        with ExtractionRun(prompts, out_dir, self.layer_ids, resume=resume, progress=progress) as run:
            for start in range(0, len(run.todo), batch_size):
                batch = run.todo[start : start + batch_size]
                outputs = self.llm.generate(
                    [_engine_prompt(run.prompts[i]) for i in batch],
                    SamplingParams(max_tokens=1, temperature=0.0),
                    use_tqdm=False,
                )
                for index, output in zip(batch, outputs, strict=True):
                    run.save(index, take_vllm_file(hidden_states_path(output.kv_transfer_params)))
        return run.paths()

    def close(self) -> None:
        """Shut the engine down and wait for its processes to exit."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # vLLM has no public LLM.shutdown() in 0.20..0.32; engine_core.shutdown(timeout) exists in all:
        # it SIGTERMs EngineCore (which stops its workers), joins it and SIGKILLs it after the timeout.
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        del llm
        gc.collect()
        # EngineCore can exit before a worker does; the worker then ends as an orphan, re-parented to us when
        # we are a child subreaper (gpuclean), and stays a zombie. Wait for every engine process, reap our
        # zombies, and kill what outlives the grace period.
        left = wait_and_reap(self._engine_processes, SHUTDOWN_TIMEOUT_S, kill_survivors=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        if not left:
            # A worker that vLLM had to kill leaves its OpenMP registration in /dev/shm (CPU).
            for entry in openmp_registrations(p.pid for p in self._engine_processes):
                entry.unlink(missing_ok=True)

    def __enter__(self) -> OfflineExtractor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _engine_prompt(prompt: Prompt) -> Any:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": prompt}


__all__ = ["ExtractionError", "OfflineExtractor"]
