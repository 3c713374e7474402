"""Locks: cross-process GPU locks. ``gpus.py`` takes them; ``directory.py`` (the symlink-safe lock directory,
its lock files and per-GPU marks), ``held.py`` (a test's locks, its holder records, the kept locks),
``holders.py`` (who holds a lock) and ``describe.py`` (that, in words) are what it stands on."""

