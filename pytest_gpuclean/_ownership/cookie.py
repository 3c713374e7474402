"""The environment cookie that says which gpuclean session (and which test of it) started a process. Apart
from ``evidence.py``, which decides what it proves: every pytest run exports it before any conftest runs,
and a session that checks nothing loads no more than this."""

from __future__ import annotations

import os

COOKIE_VAR = "GPUCLEAN_TEST"
"""Set in the pytest process while a test or higher-scoped fixture runs: every process spawned then
inherits ``<session id>:<owner token>`` and so says who started it, wherever it ends up."""
OWNER_VAR = "GPUCLEAN_OWNER"
"""Set next to the cookie: the owner's name (a test's node id), so that the debris of a session that died
can still be blamed on the test that made it."""
WORKERS_SINCE_VAR = "GPUCLEAN_XDIST_WORKERS_SINCE"
"""Set by an xdist controller as it starts its workers: the boot tick then. A child of the controller that
started with the controller's cookie at or after it is one of its workers (xdist exports the run id in a
worker only once the worker runs: it is not in the worker's initial environment, which others can read)."""
SESSION_TOKEN = "session"
"""The token of the session set-up itself (conftests, plugins, collection, what runs between tests):
exported before the conftests are imported. Other tokens are a letter and a count, never this."""
SESSION_NAME = "pytest session"
PREEXISTING_TOKEN = "before"
"""The token of the processes that existed before the session began (``evidence.PREEXISTING``), and of what
they start: never one of a cookie."""


def new_session_id(inherited_cookie: str | None, start_ticks: int, pid_namespace: int) -> str:
    """A session id that names its leader, this process (started at ``start_ticks``, in ``pid_namespace``):
    ``gc.<pid>.<start ticks>.<pid namespace>.<random>``. (The readings are the caller's, so that this
    module, exported before any conftest runs, stays a leaf.)

    The leader's pid and start time let any later session prove that this one is dead (its pid gone,
    or reused by a process that started later); the namespace says where that pid means something. A
    cookie already set (a CI job's, or an outer session's test) prefixes it, so what this session spawns
    is still recognised by the job's hooks and by the outer session as theirs.
    """
    own = f"gc.{os.getpid()}.{start_ticks}.{pid_namespace}.{os.urandom(4).hex()}"
    return f"{inherited_cookie}/{own}" if inherited_cookie else own


def cookie(session_id: str, token: str) -> str:
    """The value of ``COOKIE_VAR`` for ``token`` of session ``session_id``."""
    return f"{session_id}:{token}"


def restore_env(name: str, value: str | None) -> None:
    """Put environment variable ``name`` back as it was (``None``: unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
