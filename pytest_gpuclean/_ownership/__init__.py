"""Ownership: whose a process is (the cookie, the ownership windows, the session's census)."""

