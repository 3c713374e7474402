"""Signals around a gpuclean session: SIGTERM taken as Ctrl-C, and interrupts that only hurry the final
sweep.

Imported by a session that starts checking, or that writes a report (a cancelled job still gets it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


class SigtermAsInterrupt:
    """A cancelled CI job sends SIGTERM: taken like Ctrl-C, so that the final sweep runs and the reports
    are written, then the process dies of SIGTERM as the job runner expects. A handler that the suite (or
    another plugin) installed is left alone.

    The handler acts in the pytest process only. A child that a test forks (``os.fork``, multiprocessing's
    fork context) inherits Python's signal handlers: there SIGTERM must end the child as POSIX says (status
    -15, no ``finally`` blocks, no ``KeyboardInterrupt`` on stderr), as it does without the plugin. So the
    disposition is given back in every forked child right after the fork, and a handler that still runs in
    another process (a signal that arrived before that) ends it the default way.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._terminated = False
        self._pid = 0

    def install(self) -> None:
        """Take SIGTERM, if nobody else did (in the main thread only: no handler can be set elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._pid = os.getpid()
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        _forked_children_restore(self)

    def uninstall(self) -> None:
        """Give SIGTERM back, unless someone replaced our handler since."""
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None
        _at_fork[:] = [h for h in _at_fork if h is not self]

    def restore_in_child(self) -> None:
        """In a forked child: SIGTERM as it was before the plugin took it, if the handler is still ours."""
        if self._previous is not None and os.getpid() != self._pid and (
                signal.getsignal(signal.SIGTERM) == self._on_sigterm):
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # The KeyboardInterrupt is the test's (or whatever ran): pytest reports it at the last frame that
        # does not hide itself, the code that was interrupted, not this line.
        __tracebackhide__ = True
        if os.getpid() != self._pid:
            # A forked child that got SIGTERM before its at-fork hook ran: die of it, as without the plugin.
            _as_before(signum, self._previous)
            return
        if not self._terminated:
            self._terminated = True
            atexit.register(_die_of, signal.SIGTERM)
        raise KeyboardInterrupt("SIGTERM")


def quiet_interrupts(hurry: threading.Event) -> Callable[[], None]:
    """Make SIGINT/SIGTERM set ``hurry`` instead of raising, until the returned function is called.

    During the final sweep a second Ctrl-C (or the job runner's SIGTERM) must shorten the grace, not
    abandon the leaks and the reports. A signal the process was started ignoring stays ignored: a shell
    starts a background job (``cmd &``, ``nohup``) with SIGINT ignored, so that a Ctrl-C to the terminal's
    group leaves it alone.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: handler for sig in (signal.SIGINT, signal.SIGTERM)
                if (handler := signal.getsignal(sig)) is not signal.SIG_IGN}
    pid = os.getpid()

    def on_signal(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # (a child forked meanwhile: the signal is its own, handled as before)
            _as_before(signum, previous.get(signal.Signals(signum)))
            return
        hurry.set()

    for sig in previous:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def again_words() -> str:
    """Which interrupt hurries the sweep now (``quiet_interrupts``): a SIGINT the process was started
    ignoring (a background job) is not one, and a Ctrl-C does nothing there."""
    words = [word for sig, word in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"))
             if signal.getsignal(sig) is not signal.SIG_IGN]
    return " or ".join(words) or "an interrupt"


def _as_before(signum: int, handler: Any) -> None:
    """In a child that inherited one of the plugin's handlers: ``signum`` handled as it was before the plugin
    took it (``handler``; the default where none was kept), sent again."""
    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_at_fork: list[SigtermAsInterrupt] = []
"""The installed handler whose disposition forked children get back: ``os.register_at_fork`` has no way to
unregister, so the hooks are registered once per process and look here."""
_hooked = False
_fork = threading.local()
"""Per forking thread: whether the hook before the fork blocked SIGTERM (and the hooks after unblock it)."""


def _forked_children_restore(handler: SigtermAsInterrupt) -> None:
    global _hooked
    if not _hooked:
        os.register_at_fork(before=_block_before_fork, after_in_parent=_unblock_after_fork,
                            after_in_child=_restore_in_child)
        _hooked = True
    _at_fork[:] = [handler]


def _block_before_fork() -> None:
    # A SIGTERM sent to the child before its hook below has put the default back would reach the plugin's
    # handler there, and Python drops a signal whose handler is replaced before it runs: the child would live
    # on (seen on CI: multiprocessing's terminate() right after start(), exitcode 0). Blocked across the
    # fork, it stays pending in the kernel until the default is back, then ends the child as POSIX says. The
    # test's own mask is as it was once the fork returns, in both processes.
    if not _at_fork:
        return
    with contextlib.suppress(ValueError, OSError):
        _fork.unblock = signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _unblock_after_fork() -> None:
    if getattr(_fork, "unblock", False):
        _fork.unblock = False
        with contextlib.suppress(ValueError, OSError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _restore_in_child() -> None:
    for handler in _at_fork:
        # (never raise out of an at-fork hook: CPython would print it in every child)
        with contextlib.suppress(ValueError, OSError):
            handler.restore_in_child()
    _unblock_after_fork()


def _die_of(signum: int) -> None:
    # Registered when SIGTERM interrupted the session: everything is written, now exit the way the
    # sender expects (status 128 + 15 in a shell), not as an interrupted pytest.
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
