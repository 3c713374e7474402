"""The one gate before every signal: whether gpuclean may signal a process at all, decided over plain facts.

Every path that signals (a check's reaping rounds and the freeze of what replaces itself, the session-end
sweep, a dead session's debris, ``gpuclean reap`` in all its modes) asks ``refusal`` first, for SIGSTOP as for
SIGTERM and SIGKILL, and leaves alone, naming it, each process it refuses:

- this process or one of its ancestors;
- what is protected now (a live fixture's, the session set-up's, what is older than the session);
- another user's process: one whose real, effective, saved or filesystem uid, or one of whose threads', is not
  the invoking user's (a ``setpriv``'d child, a setuid program);
- a relay: a process whose descendants run as another user. ``su``, ``sudo`` and ``runuser`` pass the signals
  they receive on to the child they run as someone else, and nothing tells a program that does from one
  that does not, so a signal to any ancestor of another user's process may reach that user.

The facts (``Credentials``) are read from /proc by ``reading/credentials.py``; nothing here reads or signals
(``tests/test_checker_decisions.py`` tables it).
"""

from __future__ import annotations

from pytest_gpuclean._model.records import Credentials
from pytest_gpuclean.report.text import one_line


def refusal(credentials: Credentials | None, my_uid: int, *, itself: bool = False,
            protected: bool = False) -> str | None:
    """Why the process that ``credentials`` describe may not be signalled by user ``my_uid`` (None: it may).

    ``itself``: it is this process or one of its ancestors; ``protected``: the census protects it now.
    ``credentials`` None: the process is gone, and no signal can reach anything (the ladder reports it).
    """
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
