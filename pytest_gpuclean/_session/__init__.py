"""The pytest integration below ``plugin.py``: the started session, each test's check, the records, the
outputs."""

