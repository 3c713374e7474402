"""Locks: cross-process GPU locks (a symlink-safe directory, per-GPU marks, the kept locks, holders)."""
