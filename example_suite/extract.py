"""Command line: hidden states for a prompt file, offline or from a ``vllm serve``; or start that server.

::

    python -m example_suite.extract serve --model DIR --layers 2,3,4 --port 8000 [--tp 2]
    python -m example_suite.extract client --url http://127.0.0.1:8000 --out OUT prompts.jsonl
    python -m example_suite.extract offline --model DIR --layers 2,3,4 --out OUT prompts.jsonl [--tp 2]

``prompts.jsonl`` holds one ``{"input_ids": [int, ...]}`` or ``{"text": "..."}`` per line. Every prompt ``i``
becomes ``OUT/hs_<i>.safetensors`` (layout: :mod:`example_suite.samples`). A rerun skips prompts whose file
is complete and redoes the others (``--no-resume`` redoes all). Problems the user can fix (a bad prompt file,
an unreachable server, a layer id out of range) end with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from example_suite.hidden_states import ExtractionError

EXIT_USER_ERROR = 2


def _layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m example_suite.extract", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    layers_help = (
        "comma-separated layer ids: 0 = embeddings, k = output of decoder layer k-1, L = last layer "
        "before the final norm; sorted and de-duplicated (default: EAGLE-3's 2, L//2, L-3, L)"
    )

    offline = commands.add_parser("offline", help="run an in-process vllm.LLM engine")
    serve = commands.add_parser("serve", help="run `vllm serve` with hidden-state extraction (until stopped)")
    for sub in (offline, serve):
        sub.add_argument("--model", required=True, help="local model directory")
        sub.add_argument("--layers", type=_layers, default=None, help=layers_help)
        sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
        sub.add_argument("--dtype", default="auto", help="vLLM dtype (default: auto)")
        sub.add_argument("--max-model-len", type=int, default=2048)
        sub.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=None,
            help="fraction of each GPU vLLM may take (CUDA only)",
        )
        sub.add_argument(
            "--kv-cache-memory-bytes",
            type=int,
            default=None,
            help="the KV cache's size per GPU, instead of what the memory profile leaves (CUDA only)",
        )
        sub.add_argument(
            "--max-num-seqs", type=int, default=None, help="requests an engine step takes at most (vLLM's)"
        )
        sub.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="tokens an engine step takes at most (vLLM's)",
        )
    offline.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (default 64)")
    offline.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no compiled graphs (vLLM's enforce_eager): a faster start, slower steps",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--storage",
        type=Path,
        default=None,
        help="where the server writes each request's file (default: a private temporary "
        "directory; clients must be able to read it)",
    )
    serve.add_argument("--log", type=Path, default=Path("vllm-serve.log"), help="the server's output")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more `vllm serve` arguments")

    client = commands.add_parser("client", help="send the prompts to a running server")
    client.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    client.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    client.add_argument("--served-model", default=None, help="model name (default: ask the server)")
    client.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="the ids the server was started with, if known: checked and recorded",
    )
    for sub in (offline, client):
        sub.add_argument("prompts", type=Path, help='jsonl: {"input_ids": [...]} or {"text": "..."} per line')
        sub.add_argument("--out", required=True, type=Path, help="output directory (hs_<i>.safetensors)")
        sub.add_argument(
            "--no-resume",
            dest="resume",
            action="store_false",
            help="redo every prompt, also those with a complete file",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        return _extract(args)
    except ExtractionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def _extract(args: argparse.Namespace) -> int:
    from example_suite.samples import pending_indices, read_prompts

    prompts = read_prompts(args.prompts)
    # Before an engine starts: a rerun with nothing left to do needs none.
    layers = sorted(set(args.layers)) if args.layers is not None else None
    todo = pending_indices(args.out, prompts, layers, resume=args.resume) if args.out.is_dir() else prompts
    done = len(prompts) - len(todo)
    if not todo:
        print(f"all {len(prompts)} prompts already have their file in {args.out}", file=sys.stderr)
        return 0
    if args.command == "client":
        from example_suite.client import HiddenStatesClient

        client = HiddenStatesClient(
            args.url, model=args.served_model, concurrency=args.concurrency, layer_ids=args.layers
        )
        client.extract(prompts, args.out, resume=args.resume, progress=True)
        layers = client.layer_ids
    else:
        from example_suite.offline import OfflineExtractor

        if args.batch_size < 1:
            raise ExtractionError("--batch-size must be at least 1")
        with OfflineExtractor(
            args.model,
            layer_ids=args.layers,
            tensor_parallel_size=args.tp,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            **_engine_args(args),
            **({"enforce_eager": True} if args.enforce_eager else {}),
        ) as extractor:
            extractor.extract(
                prompts, args.out, resume=args.resume, progress=True, batch_size=args.batch_size
            )
            layers = extractor.layer_ids
    print(
        f"wrote {len(prompts) - done} files to {args.out}, kept {done} (layer ids "
        f"{layers if layers is not None else 'as the server was started'})",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from example_suite.server import VllmServer

    extra = [a for a in args.vllm_args if a != "--"]
    for name, value in _engine_args(args).items():
        extra += [f"--{name.replace('_', '-')}", str(value)]
    server = VllmServer(
        args.model,
        layer_ids=args.layers,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        storage_dir=args.storage,
        extra_args=extra,
        host=args.host,
        port=args.port,
        log_path=args.log,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"starting: {' '.join(server.argv)}\nlog: {server.log_path}", file=sys.stderr)
    server.start()
    print(
        f"ready at {server.url}: layer ids {server.layer_ids}, files in {server.storage_dir}; "
        "stop with Ctrl-C or SIGTERM",
        file=sys.stderr,
    )
    assert server.process is not None
    while not stop.is_set() and server.process.poll() is None:
        stop.wait(1.0)
    exited = server.process.poll()
    report = server.stop()
    if exited is not None:
        raise ExtractionError(f"vllm serve exited by itself with status {exited}; see {server.log_path}")
    print(f"stopped in {report.stop_s:.1f} s", file=sys.stderr)
    return 0


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line (vLLM's defaults for the others)."""
    names = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


if __name__ == "__main__":
    sys.exit(main())
