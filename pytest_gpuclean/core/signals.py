"""Signals around a gpuclean session: SIGTERM taken as Ctrl-C, and interrupts that only hurry the final
sweep.

Imported by a session that starts checking, or that writes a report (a cancelled job still gets it).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


class SigtermAsInterrupt:
    """A cancelled CI job sends SIGTERM: taken like Ctrl-C, so that the final sweep runs and the reports
    are written, then the process dies of SIGTERM as the job runner expects. A handler that the suite (or
    another plugin) installed is left alone."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._terminated = False

    def install(self) -> None:
        """Take SIGTERM, if nobody else did (in the main thread only: no handler can be set elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        """Give SIGTERM back, unless someone replaced our handler since."""
        if self._previous is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)
        self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
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

    def on_signal(signum: int, frame: Any) -> None:
        hurry.set()

    for sig in previous:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _die_of(signum: int) -> None:
    # Registered when SIGTERM interrupted the session: everything is written, now exit the way the
    # sender expects (status 128 + 15 in a shell), not as an interrupted pytest.
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
