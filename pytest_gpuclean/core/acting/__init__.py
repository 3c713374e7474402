"""Acting: what changes the machine (signals, the reap ladder, pools shut down)."""

__all__: list[str] = []
