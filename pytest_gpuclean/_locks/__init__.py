"""Cross-process GPU locks, shared by every session on the host (docs/sharing.md)."""

