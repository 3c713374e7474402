"""Signals around a gpuclean session: SIGTERM taken as Ctrl-C, and interrupts that only hurry the final
sweep."""

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
    """A cancelled CI job sends SIGTERM: taken like Ctrl-C, so the final sweep runs and the reports are
    written, then the process dies of SIGTERM as the runner expects. Another's handler is left alone.

    A child a test forks inherits the handler, but there SIGTERM must end it as POSIX says (status -15, no
    ``finally``, no ``KeyboardInterrupt``): every forked child gets the old disposition back.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._terminated = False
        self._pid = 0

    def install(self) -> None:
        """Take SIGTERM, if nobody else did (main thread only: no handler can be set elsewhere)."""
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
        """In a forked child: SIGTERM as before the plugin took it, if the handler is still ours."""
        if self._previous is not None and os.getpid() != self._pid and (
                signal.getsignal(signal.SIGTERM) == self._on_sigterm):
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # pytest reports the interrupt at the code that was interrupted, not this line.
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

    A second Ctrl-C during the final sweep must shorten the grace, not abandon the leaks and reports. A
    signal the process was started ignoring (a shell's background job) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: handler for sig in (signal.SIGINT, signal.SIGTERM)
                if (handler := signal.getsignal(sig)) is not signal.SIG_IGN}
    pid = os.getpid()

    def on_signal(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a child forked meanwhile: the signal is its own
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
    """Which interrupt hurries the sweep now: not a SIGINT the process was started ignoring."""
    words = [word for sig, word in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"))
             if signal.getsignal(sig) is not signal.SIG_IGN]
    return " or ".join(words) or "an interrupt"


def _as_before(signum: int, handler: Any) -> None:
    """In a child that inherited the plugin's handler: ``signum`` sent again, handled as before the plugin
    took it."""
    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_at_fork: list[SigtermAsInterrupt] = []
"""The installed handler: ``os.register_at_fork`` cannot unregister, so the hooks, registered once, look
here."""
_hooked = False
_fork = threading.local()
"""Per forking thread: whether the hook before the fork blocked SIGTERM, for the hooks after to unblock."""


def _forked_children_restore(handler: SigtermAsInterrupt) -> None:
    global _hooked
    if not _hooked:
        os.register_at_fork(before=_block_before_fork, after_in_parent=_unblock_after_fork,
                            after_in_child=_restore_in_child)
        _hooked = True
    _at_fork[:] = [handler]


def _block_before_fork() -> None:
    # A SIGTERM reaching the child before its hook restores the default would hit our handler, and Python
    # drops a signal whose handler is replaced before it runs: the child would live on (multiprocessing's
    # terminate() right after start()). Blocked across the fork, it stays pending until the default is back.
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
        # Never raise out of an at-fork hook: CPython would print it in every child.
        with contextlib.suppress(ValueError, OSError):
            handler.restore_in_child()
    _unblock_after_fork()


def _die_of(signum: int) -> None:
    # Everything is written: now exit as the SIGTERM's sender expects (status 143), not as pytest.
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
