"""The pytest integration below ``plugin.py``: the started session, each test's check, the Ray cluster's
per-test checks, the report outputs. (Empty: importing a layer loads none of its modules.)"""

__all__: list[str] = []
