"""A record's values on one line: a command line, (device, MiB) pairs. A leaf: the report and the checker's
messages both use it."""

from __future__ import annotations

from collections.abc import Sequence

CMDLINE_CHARS = 200


def one_line(text: str, limit: int = CMDLINE_CHARS) -> str:
    """A command line on one line: inline scripts (``python -c``) contain newlines."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def mib_list(pairs: Sequence[tuple[str, float]]) -> str:
    """``GPU 0 512 MiB, GPU 1 8 MiB`` for (device label, MiB) pairs; empty for none."""
    return ", ".join(f"{label} {value:.0f} MiB" for label, value in pairs)
