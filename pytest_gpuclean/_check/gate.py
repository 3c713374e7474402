"""The one gate before every signal (SIGSTOP, SIGTERM, SIGKILL), over plain facts.

It leaves alone this process and its ancestors, what is protected now, another user's process (any uid of
any thread), and a relay: a process whose descendants run as another user (``su``, ``sudo``)."""

from __future__ import annotations

from pytest_gpuclean._model.records import Credentials
from pytest_gpuclean.report.text import one_line


def refusal(credentials: Credentials | None, my_uid: int, *, itself: bool = False,
            protected: bool = False) -> str | None:
    """Why ``my_uid`` may not signal the process (None: it may). ``credentials`` None: it is gone."""
    if itself:
        return "gpuclean itself or one of its ancestors"
    if protected:
        return "not provably ours now (a live fixture's, the session set-up's, or older than the session)"
    if credentials is None:
        return None
    others = [name for uid, name in credentials.users if uid != my_uid]
    if others:
        if len(others) == len(credentials.users):
            return "another user's process"
        return f"another user's process (it runs as {', '.join(others)} too)"
    if credentials.relays_to:
        first, more = credentials.relays_to[0], len(credentials.relays_to) - 1
        return (f"a signal to it may be relayed to pid {first.pid} of user {first.user} "
                f"({one_line(first.cmdline, 60)}), its descendant"
                + (f", and to {more} more descendant(s) of other users" if more else "")
                + ": su, sudo and runuser pass signals on")
    return None
