"""The environment cookie that says which gpuclean session (and which test of it) started a process.

Exported before any conftest runs; a session that checks nothing loads only this leaf module.
``evidence.py`` decides what a cookie proves."""

from __future__ import annotations

import os

COOKIE_VAR = "GPUCLEAN_TEST"
"""Set while a test or higher-scoped fixture runs: every process spawned then inherits ``<session
id>:<owner token>``."""
OWNER_VAR = "GPUCLEAN_OWNER"
"""The owner's name (a test's node id), so a dead session's debris can still be blamed on its test."""
WORKERS_SINCE_VAR = "GPUCLEAN_XDIST_WORKERS_SINCE"
"""Set by an xdist controller as it starts its workers: the boot tick then. xdist exports the run id only
once a worker runs, so others cannot read it in the worker's initial environment."""
SESSION_TOKEN = "session"
"""The set-up's own token (conftests, plugins, collection, between tests)."""
SESSION_NAME = "pytest session"
PREEXISTING_TOKEN = "before"
"""The token of processes that existed before the session, and of what they start: never in a cookie."""


def new_session_id(inherited_cookie: str | None, start_ticks: int, pid_namespace: int) -> str:
    """A session id naming its leader: ``gc.<pid>.<start ticks>.<pid namespace>.<random>``, so a later
    session can prove it dead. An inherited cookie (a CI job's, an outer session's test) prefixes it, so
    they still recognise what this session spawns."""
    own = f"gc.{os.getpid()}.{start_ticks}.{pid_namespace}.{os.urandom(4).hex()}"
    return f"{inherited_cookie}/{own}" if inherited_cookie else own


def cookie(session_id: str, token: str) -> str:
    return f"{session_id}:{token}"


def restore_env(name: str, value: str | None) -> None:
    """Put environment variable ``name`` back as it was (``None``: unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
