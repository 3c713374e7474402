"""The core: reading devices and processes, ownership, the check, locks, health; knows nothing of pytest
beyond ``settings`` raising its ``UsageError``. (Empty: importing a layer loads none of its modules.)"""

__all__: list[str] = []
