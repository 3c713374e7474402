"""Hidden states from a running ``vllm serve``: one completion request per prompt, several in flight.

::

    client = HiddenStatesClient("http://127.0.0.1:8000", concurrency=8)
    paths = client.extract([[1, 5, 9], "some text"], out_dir="out")   # out/hs_0.safetensors, ...

The server must run with hidden-state extraction (:class:`example_suite.server.VllmServer`, or by hand as in
docs/example_suite.md). Each request is ``POST /v1/completions`` with ``max_tokens`` 1; the response's
top-level ``kv_transfer_params.hidden_states_path`` names the file the server wrote, which this client reads
(so the server's ``shared_storage_path`` must be readable here: same machine or a shared filesystem), checks
against the prompt, and moves into ``out_dir`` as ``hs_<i>.safetensors``. Only the standard library talks
HTTP.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from example_suite.hidden_states import ExtractionError, hidden_states_path, take_vllm_file
from example_suite.samples import ExtractionRun, Prompt

DEFAULT_CONCURRENCY = 8
REQUEST_TIMEOUT_S = 600.0


class HiddenStatesClient:
    """A client of one ``vllm serve`` started with hidden-state extraction.

    ``layer_ids``: the ids the server was started with, if known; they are then checked against the number
    of layers each file has and recorded in the output files' metadata.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        layer_ids: Sequence[int] | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname:
            raise ExtractionError(f"server URL {url!r}: expected http://HOST:PORT")
        if concurrency < 1:
            raise ExtractionError(f"concurrency must be at least 1, got {concurrency}")
        self.url = f"http://{parsed.hostname}:{parsed.port or 80}"
        self._host, self._port = parsed.hostname, parsed.port or 80
        self.model = model
        self.concurrency = concurrency
        self.layer_ids = sorted(set(layer_ids)) if layer_ids is not None else None
        self.timeout_s = timeout_s
        # For tests: called in the request's thread after the request was sent and before its response is
        # read, with the prompt's index.
        self.after_send: Callable[[int], None] | None = None

    def served_model(self) -> str:
        """The name of the served model (``GET /v1/models``); an :class:`ExtractionError` if unreachable."""
        status, body = self._call("GET", "/v1/models", None, index=None)
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ExtractionError(
                f"{self.url}/v1/models answered {status} without a model: {body[:200]!r}"
            ) from None

    def extract(
        self, prompts: Sequence[Prompt], out_dir: str | Path, *, resume: bool = True, progress: bool = False
    ) -> list[Path]:
        """Write ``out_dir/hs_<i>.safetensors`` for every prompt; returns their paths, in prompt order.

        With ``resume``, prompts whose file is already good are skipped. Up to ``concurrency`` requests are
        in flight at once. The first failure stops the run (requests already sent still finish).
        """
        run = ExtractionRun(prompts, out_dir, self.layer_ids, resume=resume, progress=progress)
        model = self.model or self.served_model()
        with run, ThreadPoolExecutor(self.concurrency, thread_name_prefix="hidden-states") as pool:
            futures: list[Future[Path]] = [pool.submit(self._extract_one, model, i, run) for i in run.todo]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for future in futures:
                    future.cancel()
                raise failed[0].exception()  # type: ignore[misc]
        return run.paths()

    def _extract_one(self, model: str, index: int, run: ExtractionRun) -> Path:
        request = {"model": model, "prompt": run.prompts[index], "max_tokens": 1, "temperature": 0.0}
        status, body = self._call("POST", "/v1/completions", request, index=index)
        if status != 200:
            raise ExtractionError(f"prompt {index}: the server answered {status}: {_error_message(body)}")
        try:
            response = json.loads(body)
        except ValueError:
            raise ExtractionError(
                f"prompt {index}: the server's answer is not JSON: {body[:200]!r}"
            ) from None
        return run.save(index, take_vllm_file(hidden_states_path(response.get("kv_transfer_params"))))

    def _call(self, method: str, path: str, payload: Any, *, index: int | None) -> tuple[int, str]:
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        try:
            body = json.dumps(payload).encode() if payload is not None else None
            headers = {"Content-Type": "application/json"} if body is not None else {}
            connection.request(method, path, body=body, headers=headers)
            if index is not None and self.after_send is not None:
                self.after_send(index)
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        except (ConnectionError, OSError, http.client.HTTPException) as exc:
            raise ExtractionError(
                f"cannot reach the vLLM server at {self.url} ({method} {path}: {exc.__class__.__name__}: "
                f"{exc}); is `vllm serve` running there?"
            ) from None
        finally:
            connection.close()


def _error_message(body: str) -> str:
    # vLLM answers errors as {"error": {"message": ...}} (older: {"message": ...}).
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return body[:500]
