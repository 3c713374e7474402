"""Deciding: pure functions over plain readings (what is ours, what is excused, what may be signalled)."""

__all__: list[str] = []
