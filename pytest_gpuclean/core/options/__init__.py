"""Options: the plugin's settings, resolved once, and the syntax of a device list."""

__all__: list[str] = []
