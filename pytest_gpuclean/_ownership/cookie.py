"""The environment cookie that says which gpuclean session (and which test of it) started a process.

Every pytest run exports it before any conftest runs, and a session that checks nothing loads only this
module: it stays a leaf (the callers do the readings). ``evidence.py`` decides what a cookie proves."""

from __future__ import annotations

import os

COOKIE_VAR = "GPUCLEAN_TEST"
"""Set in the pytest process while a test or higher-scoped fixture runs: every process spawned then
inherits ``<session id>:<owner token>``, wherever it ends up."""
OWNER_VAR = "GPUCLEAN_OWNER"
"""The owner's name (a test's node id), so a dead session's debris can still be blamed on its test."""
WORKERS_SINCE_VAR = "GPUCLEAN_XDIST_WORKERS_SINCE"
"""Set by an xdist controller as it starts its workers: the boot tick then. A child of the controller with
the controller's cookie started at or after it is a worker (xdist exports the run id only once the worker
runs, so it is not in the initial environment that others can read)."""
SESSION_TOKEN = "session"
"""The token of the session set-up itself (conftests, plugins, collection, between tests). Other tokens are
a letter and a count, never this."""
SESSION_NAME = "pytest session"
PREEXISTING_TOKEN = "before"
"""The token of processes that existed before the session, and of what they start: never in a cookie."""


def new_session_id(inherited_cookie: str | None, start_ticks: int, pid_namespace: int) -> str:
    """A session id naming its leader, this process: ``gc.<pid>.<start ticks>.<pid namespace>.<random>``.
    Pid and start time let a later session prove this one dead (pid gone or reused); the namespace says
    where the pid means something.

    A cookie already set (a CI job's, an outer session's test) prefixes it, so what this session spawns is
    still theirs too."""
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
