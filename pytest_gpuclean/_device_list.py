"""A device list's syntax (``--gpuclean-devices``, ``CUDA_VISIBLE_DEVICES``): its tokens, and two that name
the same device whatever the devices are. A leaf: the options' parser (``settings.py``) refuses a bad list
with it before any device is read, and ``backends.py`` maps the tokens to devices.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "parse_device_list",
    "repeated_tokens",
]


def parse_device_list(spec: str) -> list[str]:
    """Split a CUDA_VISIBLE_DEVICES-style list into tokens; CUDA stops at ``-1``."""
    tokens: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            continue
        if token.startswith("-"):
            break  # CUDA treats a negative index as the end of the list
        tokens.append(token)
    return tokens


def repeated_tokens(tokens: Sequence[str]) -> tuple[str, str] | None:
    """Two tokens of a device list that name the same device whatever the devices are, or None: the same
    index (``0,00``), or the same UUID or one a prefix of the other, case aside (a UUID prefix names a
    single device or is an error). Needs no backend."""
    for i, later in enumerate(tokens):
        for earlier in tokens[:i]:
            if earlier.isdigit() != later.isdigit():
                continue  # an index and a UUID: only the devices can tell
            a, b = earlier.lower(), later.lower()
            if int(a) == int(b) if a.isdigit() else a.startswith(b) or b.startswith(a):
                return earlier, later
    return None
